"""The low-level binding: lazy binding, result checking, version gating, config structs.

Uses a tiny C library compiled here that exports a few NCCL symbols of an old
release, so gating is tested against a real shared object.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from pynccl import DataType, NcclInvalidArgument, NcclInvalidUsage, NotSupportedError, RedOp, Result
from pynccl._capi.nccl import PROTOTYPES, NcclLibrary, decode_version
from pynccl._capi.structs import (
    NCCL_CONFIG_UNDEF_INT,
    make_coll_config,
    make_config,
    make_sim_info,
    ncclCollConfig_t,
    ncclConfig_t,
    ncclSimInfo_t,
)

TINY_SOURCE = r"""
#include <stddef.h>
static int calls;
int ncclGetVersion(int *v) { *v = 21801; return 0; }
const char *ncclGetErrorString(int r) { return r == 5 ? "invalid usage" : "other"; }
const char *ncclGetLastError(void *comm) { (void)comm; return "tiny: last error text"; }
int ncclGroupStart(void) { return ++calls > 1000 ? 3 : 0; }
int ncclGroupEnd(void) { return 5; }
int ncclCommCount(void *comm, int *n) { if (!comm) return 4; *n = 7; return 0; }
int ncclAllReduce(const void *s, void *r, size_t count, int dt, int op, void *comm, void *st) {
  (void)s; (void)r; (void)dt; (void)op; (void)comm; (void)st;
  return count == ((size_t)1 << 33) ? 0 : 4;
}
int ncclCommFinalize(void *comm) { (void)comm; return 7; }
int ncclReduce(const void *s, void *r, size_t count, int dt, int op, int root, void *c, void *st) {
  (void)s; (void)r; (void)c; (void)st;  /* success iff dt == count and op == root */
  return (size_t)dt == count && op == root ? 0 : 4;
}
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> NcclLibrary:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    d = tmp_path_factory.mktemp("tiny")
    src = d / "tiny.c"
    src.write_text(TINY_SOURCE)
    out = d / "libnccl_tiny.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(out), str(src)], check=True)
    return NcclLibrary(ctypes.CDLL(str(out)), str(out), "explicit")


def test_version_decoding() -> None:
    assert decode_version(23203) == (2, 32, 3)
    assert decode_version(21801) == (2, 18, 1)
    assert decode_version(2804) == (2, 8, 4)  # old formula X*1000+Y*100+Z
    assert decode_version(2708) == (2, 7, 8)


def test_tiny_library_version(tiny: NcclLibrary) -> None:
    assert tiny.version == (2, 18, 1) and tiny.version_code == 21801


def test_missing_function_raises_not_supported_on_call(tiny: NcclLibrary) -> None:
    assert not tiny.has("ncclAlltoAll")
    fn = tiny.ncclAlltoAll  # binding itself does not raise
    with pytest.raises(NotSupportedError) as info:
        fn(0, 0, 0, 0, 0, 0)
    text = str(info.value)
    assert "ncclAlltoAll" in text and "2.28.3" in text and "2.18.1" in text
    assert isinstance(info.value, NotImplementedError)
    assert info.value.required == (2, 28, 3) and info.value.loaded == (2, 18, 1)


def test_unknown_name_is_attribute_error(tiny: NcclLibrary) -> None:
    with pytest.raises(AttributeError, match="ncclNoSuchThing"):
        _ = tiny.ncclNoSuchThing


def test_checked_call_raises_typed_error_with_texts(tiny: NcclLibrary) -> None:
    with pytest.raises(NcclInvalidUsage) as info:
        tiny.ncclGroupEnd()
    assert info.value.function == "ncclGroupEnd"
    assert info.value.result is Result.INVALID_USAGE
    assert "invalid usage" in str(info.value) and "tiny: last error text" in str(info.value)


def test_success_and_in_progress_results(tiny: NcclLibrary) -> None:
    assert tiny.ncclGroupStart() is Result.SUCCESS
    assert tiny.ncclCommFinalize(1) is Result.IN_PROGRESS


def test_size_t_count_is_not_truncated(tiny: NcclLibrary) -> None:
    # The tiny library returns success only if it received exactly 2**33.
    assert tiny.ncclAllReduce(0, 0, 1 << 33, 7, 0, 1, 0) is Result.SUCCESS
    with pytest.raises(NcclInvalidArgument):
        tiny.ncclAllReduce(0, 0, 1 << 32, 7, 0, 1, 0)


def test_enum_arguments_reach_c_as_their_values(tiny: NcclLibrary) -> None:
    # DataType / RedOp members are passed as shared c_int objects (a faster conversion):
    # C must see the same values as for plain ints, for every member.
    for dt in DataType:
        for op in RedOp:
            assert tiny.ncclReduce(0, 0, int(dt), dt, op, int(op), 1, 0) is Result.SUCCESS
            assert tiny.ncclReduce(0, 0, int(dt), int(dt), int(op), int(op), 1, 0) is Result.SUCCESS
    with pytest.raises(NcclInvalidArgument):
        tiny.ncclReduce(0, 0, 3, DataType.FLOAT32, RedOp.MAX, 2, 1, 0)
    with pytest.raises(ctypes.ArgumentError):  # not an int at all: ctypes refuses, as before
        tiny.ncclReduce(0, 0, 7, "float32", RedOp.SUM, 0, 1, 0)


def test_out_parameters_and_const_char(tiny: NcclLibrary) -> None:
    n = ctypes.c_int()
    tiny.ncclCommCount(1, ctypes.byref(n))
    assert n.value == 7
    assert tiny.ncclGetErrorString(5) == "invalid usage"
    assert tiny.raw("ncclCommCount")(None, ctypes.byref(n)) == 4  # raw: unchecked


def test_binding_is_cached_and_thread_safe(tiny: NcclLibrary) -> None:
    seen: list[object] = []
    threads = [threading.Thread(target=lambda: seen.append(tiny.ncclCommCount)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(fn is seen[0] for fn in seen)
    assert tiny.ncclCommCount is seen[0]


def test_binding_from_a_finalizer_during_binding_does_not_deadlock(tmp_path: Path) -> None:
    """A __del__ that the GC runs while one name is being bound (DeviceBuffer.__del__ calls
    cudaFree) binds another name on the same thread: the binding lock must let it."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    src = tmp_path / "tiny.c"
    src.write_text(TINY_SOURCE)
    out = tmp_path / "libnccl_tiny2.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(out), str(src)], check=True)
    lib = NcclLibrary(ctypes.CDLL(str(out)), str(out), "explicit")
    bound: list[object] = []

    class Finalized:
        def __del__(self) -> None:
            bound.append(lib.ncclGroupEnd)  # binds while the outer name is being bound

    original = lib._bind

    def bind_with_gc(name: str, proto: object) -> object:
        if name == "ncclCommCount":
            Finalized()  # collected here, inside the binding of ncclCommCount
        return original(name, proto)  # type: ignore[arg-type]

    lib._bind = bind_with_gc  # type: ignore[method-assign]
    worker = threading.Thread(target=lambda: bound.append(lib.ncclCommCount), daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "binding deadlocked on its own lock"
    assert len(bound) == 2


def test_generated_wrappers_keep_c_argument_names(tiny: NcclLibrary) -> None:
    import inspect

    params = list(inspect.signature(tiny.ncclAllReduce).parameters)
    assert params == ["sendbuff", "recvbuff", "count", "datatype", "op", "comm", "stream"]


def test_prototype_table_covers_nccl_h_2_32_3() -> None:
    assert len(PROTOTYPES) == 73
    for name, proto in PROTOTYPES.items():
        assert name.startswith("nccl")
        assert (2, 3, 5) <= proto.first <= (2, 32, 3)
    ar = PROTOTYPES["ncclAllReduce"]
    assert [ctype for _, ctype in ar.args][2] is ctypes.c_size_t


def test_config_initialiser_matches_nccl_config_initializer() -> None:
    cfg = make_config()
    assert cfg.size == ctypes.sizeof(ncclConfig_t) == 120
    assert cfg.magic == 0xCAFEBEEF and cfg.version == 23203
    assert cfg.blocking == NCCL_CONFIG_UNDEF_INT and cfg.nvlsHostMode == NCCL_CONFIG_UNDEF_INT
    assert cfg.netName is None and cfg.commName is None
    cfg = make_config({"blocking": 0, "commName": "job-7", "maxCTAs": 8})
    assert (cfg.blocking, cfg.commName, cfg.maxCTAs) == (0, b"job-7", 8)


def test_config_refuses_fields_the_library_lacks() -> None:
    with pytest.raises(NotSupportedError) as info:
        make_config({"commName": "x"}, loaded=(2, 18, 1))
    assert "commName" in str(info.value) and "2.27" in str(info.value)
    make_config({"splitShare": 1}, loaded=(2, 18, 1))  # 2.18 knows splitShare
    with pytest.raises(ValueError, match="nosuch"):
        make_config({"nosuch": 1})
    with pytest.raises(ValueError, match="32-bit"):
        make_config({"maxCTAs": 2**40})


def test_coll_config_and_sim_info() -> None:
    cc = make_coll_config({"algSelection": "ring"})
    assert cc.size == ctypes.sizeof(ncclCollConfig_t) == 72
    assert cc.forceAlgSelection == 1 and cc.userProfilerTag == 0 and cc.algSelection == b"ring"
    assert cc.CTAPolicy == NCCL_CONFIG_UNDEF_INT
    with pytest.raises(NotSupportedError):
        make_coll_config({"launchCompletionEvent": 1}, loaded=(2, 31, 2))
    si = make_sim_info()
    assert si.size == ctypes.sizeof(ncclSimInfo_t) == 24 and si.magic == 0x74685283
    assert si.estimatedTime == -1.0


def test_real_library_path_in_repr() -> None:
    import pynccl

    L = pynccl.lib()
    assert Path(L.path).exists() and L.path in repr(L)
