#!/usr/bin/env bash
# Free-threaded CPython: build (or reuse) CPython 3.13 with --disable-gil from Debian trixie's
# source package, install this checkout of pynccl (and numpy's free-threaded cp313t wheel) into
# a venv of it, run the thread-world tests (tests/comm and tests/groups, on the checkout in place
# as CI does; FT_TESTS to change) with the GIL checked off throughout (tests/support/gil_off.py),
# and print a throughput figure (scripts/threads_throughput.py: calls/s with 1 thread and with
# 2 threads in one process, on this interpreter and on one with the GIL).
#
#   scripts/free_threaded.sh              # build or reuse, install, test, measure
#   scripts/free_threaded.sh --build-only # only build (or reuse) the interpreter; print its path
#   scripts/free_threaded.sh --no-build   # fail (exit 3) instead of building when none is cached
#   scripts/free_threaded.sh --skip-tests # install and measure only
#   scripts/free_threaded.sh --help
#
# Where: ${PYNCCL_CACHE_DIR:-~/.cache/pynccl}/free-threaded/ holds the interpreter
# (cpython-3.13t/, reused while its stamp file says it was built from the same Debian version
# with the same flags), the venv (venv/) and the build log (build.log). Delete the folder to
# start over. Environment: FT_JOBS (make -j, default nproc), FT_SUITE (the Debian suite, default
# trixie), FT_MIRROR (the Debian mirror, default the one the system's apt uses), PYTHON311 (an
# interpreter with the GIL for the comparison figure, default .venv/bin/python or python3).
#
# The source: apt-get source --download-only python3.13 with a private apt configuration (its
# own sources.list naming only trixie's deb-src, its own lists and cache in a temporary
# directory; the system's apt configuration, lists and cache are not touched). apt checks the
# downloaded files against trixie's signed Sources index (debian-archive-keyring). The build
# uses the upstream tarball inside the source package (python3.13_*.orig.tar.xz): Debian's
# patches target Debian's /usr multiarch layout, not a --prefix build. The build needs gcc,
# make, and the -dev packages of libffi (ctypes), openssl (pip), zlib, bz2, lzma, sqlite3,
# readline; missing ones are installed with apt-get when running as root, otherwise named.
#
# Exit status: 0 when everything ran and passed; 1 when a step failed; 2 for bad usage;
# 3 for --no-build with no interpreter cached.
set -euo pipefail

unset PYTHON_GIL  # the GIL must be off because the build and every module allow it, not forced
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="${PYNCCL_CACHE_DIR:-$HOME/.cache/pynccl}/free-threaded"
PREFIX="$CACHE/cpython-3.13t"
FT_PY="$PREFIX/bin/python3.13t"
STAMP="$PREFIX/.pynccl-build"
VENV="$CACHE/venv"
SUITE="${FT_SUITE:-trixie}"
JOBS="${FT_JOBS:-$(nproc)}"
CONFIGURE_FLAGS="--disable-gil --with-ensurepip=install"
BUILD_DEPS="gcc make libffi-dev libssl-dev zlib1g-dev libbz2-dev liblzma-dev libsqlite3-dev libreadline-dev"

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

MODE=all
SKIP_TESTS=0
for arg in "$@"; do
    case "$arg" in
        -h|--help) usage; exit 0 ;;
        --build-only) MODE=build ;;
        --no-build) MODE=nobuild ;;
        --skip-tests) SKIP_TESTS=1 ;;
        *) echo "free_threaded.sh: unknown argument '$arg' (expected --help, --build-only," \
               "--no-build or --skip-tests)" >&2; exit 2 ;;
    esac
done

log() { printf '[free_threaded %(%H:%M:%S)T] %s\n' -1 "$*"; }

# The system apt's mirror for Debian's main archive (so a configured mirror or proxy is kept).
debian_mirror() {
    if [ -n "${FT_MIRROR:-}" ]; then echo "$FT_MIRROR"; return; fi
    local uri
    uri=$(grep -rhoE '^(URIs:|deb)\s+\S*debian/?(\s|$)' /etc/apt/sources.list \
        /etc/apt/sources.list.d/ 2>/dev/null | grep -v security | head -1 | awk '{print $2}')
    echo "${uri:-http://deb.debian.org/debian}"
}

ensure_build_deps() {
    local missing=() pkg
    for pkg in $BUILD_DEPS; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'ok installed' \
            || missing+=("$pkg")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ "$(id -u)" = 0 ]; then
        log "installing build dependencies: ${missing[*]}"
        apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null
    else
        echo "free_threaded.sh: missing build dependencies: ${missing[*]}" \
             "(apt-get install them, or run as root)" >&2
        return 1
    fi
}

# Downloads Debian $SUITE's python3.13 source package into $1 with a private apt configuration.
fetch_source() {
    local dest="$1" apt_dir="$1/apt" mirror
    mirror=$(debian_mirror)
    mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$apt_dir/parts" \
        "$apt_dir/prefs"
    echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror $SUITE main" \
        > "$apt_dir/sources.list"
    local opts=(
        -o "Dir::Etc::sourcelist=$apt_dir/sources.list"
        -o "Dir::Etc::sourceparts=$apt_dir/parts"
        -o "Dir::Etc::preferencesparts=$apt_dir/prefs"
        -o "Dir::State::Lists=$apt_dir/lists"
        -o "Dir::Cache=$apt_dir/cache"
        -o "APT::Sandbox::User=root"
        -o "Acquire::Languages=none"
    )
    log "apt-get update (private config: deb-src $mirror $SUITE main)"
    apt-get "${opts[@]}" update >"$dest/apt-update.log" 2>&1 \
        || { cat "$dest/apt-update.log" >&2; return 1; }
    log "apt-get source --download-only python3.13"
    (cd "$dest" && apt-get "${opts[@]}" source --download-only python3.13) \
        >"$dest/apt-source.log" 2>&1 || { cat "$dest/apt-source.log" >&2; return 1; }
}

build_interpreter() {
    ensure_build_deps
    mkdir -p "$CACHE"
    local work
    work=$(mktemp -d "$CACHE/build.XXXXXX")
    # shellcheck disable=SC2064
    trap "rm -rf '$work'" EXIT
    fetch_source "$work"
    local orig dsc version
    orig=$(ls "$work"/python3.13_*.orig.tar.xz)
    dsc=$(ls "$work"/python3.13_*.dsc)
    version=$(sed -n 's/^Version: //p' "$dsc")
    log "Debian python3.13 $version: building upstream $(basename "$orig") with $CONFIGURE_FLAGS"
    tar -xJf "$orig" -C "$work"
    local src
    src=$(find "$work" -maxdepth 1 -type d -name 'Python-3.13*' | head -1)
    rm -rf "$PREFIX"
    local t0=$SECONDS
    (
        cd "$src"
        # shellcheck disable=SC2086
        nice -n 10 ./configure --prefix="$PREFIX" $CONFIGURE_FLAGS
        nice -n 10 make -j"$JOBS"
        nice -n 10 make install
    ) >"$CACHE/build.log" 2>&1 || { tail -40 "$CACHE/build.log" >&2; return 1; }
    "$FT_PY" -c 'import sys, ctypes, ssl; assert not sys._is_gil_enabled()'
    printf 'debian=%s\nflags=%s\nseconds=%s\n' "$version" "$CONFIGURE_FLAGS" \
        "$((SECONDS - t0))" > "$STAMP"
    log "built $FT_PY in $((SECONDS - t0)) s (log: $CACHE/build.log)"
    rm -rf "$work"
    trap - EXIT
}

have_interpreter() {
    [ -x "$FT_PY" ] && [ -f "$STAMP" ] && grep -qxF "flags=$CONFIGURE_FLAGS" "$STAMP" \
        && "$FT_PY" -c 'import sys; assert not sys._is_gil_enabled()' 2>/dev/null
}

if have_interpreter; then
    log "reusing $FT_PY ($(sed -n 's/^debian=//p' "$STAMP"), built in $(sed -n 's/^seconds=//p' "$STAMP") s)"
elif [ "$MODE" = nobuild ]; then
    echo "free_threaded.sh: no free-threaded interpreter cached at $PREFIX" >&2
    exit 3
else
    build_interpreter
fi
if [ "$MODE" = build ]; then
    echo "$FT_PY"
    exit 0
fi

# -- the venv: this checkout of pynccl (installed, not in place), numpy's cp313t wheel ----------
pip_quiet() {
    # pip's own output only when it fails (a configured extra index that is absent warns)
    local out
    out=$("$VENV/bin/python" -m pip "$@" 2>&1) || { echo "$out" >&2; return 1; }
}
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import sys; assert sys._is_gil_enabled() is False' 2>/dev/null; then
    rm -rf "$VENV"
    "$FT_PY" -m venv "$VENV"
fi
log "installing numpy, ml_dtypes, pytest, hypothesis (free-threaded wheels only) into $VENV"
pip_quiet install -q --only-binary=:all: numpy ml_dtypes pytest hypothesis
log "installing pynccl from $ROOT"
pip_quiet install -q --no-deps --force-reinstall "$ROOT"
VPY="$VENV/bin/python"
(cd /tmp && "$VPY" - <<'PY'
import sys
import numpy
import pynccl
assert not sys._is_gil_enabled(), "importing pynccl and numpy turned the GIL on"
print(f"[free_threaded] {sys.version.split()[0]}t, GIL off; pynccl {pynccl.__version__} "
      f"installed at {pynccl.__file__}, numpy {numpy.__version__}")
PY
)

# -- the thread-world tests, with the GIL checked off throughout -------------------------------
# On this checkout in place, as CI runs them (pyproject puts the checkout first on the path;
# the installed copy above is what the import check and the figure use). support.gil_off
# fails the run if the GIL is ever on. The thread-world tests: ThreadWorld, GroupWorld and
# one-process tests of the object API and of groups (nothing there needs torch), the quick
# run's selection, then the exit-time test (marked slow):
FT_TESTS="${FT_TESTS:-tests/comm tests/groups}"
status=0
if [ "$SKIP_TESTS" = 0 ]; then
    log "pytest (GIL checked off before, during and after every test): $(echo $FT_TESTS)"
    t0=$SECONDS
    # shellcheck disable=SC2086
    (cd "$ROOT" && export PYTHONPATH="$ROOT/tests" \
        && timeout 1800 "$VPY" -m pytest -q -p no:cacheprovider -p support.gil_off $FT_TESTS \
        && timeout 600 "$VPY" -m pytest -q -p no:cacheprovider -p support.gil_off -m slow \
            tests/comm/test_free_threading.py) || status=1
    log "tests took $((SECONDS - t0)) s"
fi

# -- the figure: calls/s with 1 and 2 threads, GIL off here, and on an interpreter with it ------
OTHER="${PYTHON311:-}"
if [ -z "$OTHER" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then OTHER="$ROOT/.venv/bin/python"; else OTHER=python3; fi
fi
log "throughput (null loopback libnccl, all_reduce on one 1-rank communicator per thread)"
(cd /tmp && "$VPY" "$ROOT/scripts/threads_throughput.py") || status=1
(cd /tmp && PYTHONPATH="$ROOT" "$OTHER" "$ROOT/scripts/threads_throughput.py") || status=1
exit "$status"
