"""Under torchrun: share the id through torchrun's own store.

torchrun's agent already runs a ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT``
(``TORCHELASTIC_USE_AGENT_STORE=True``, in every rendezvous mode: the default static
one, ``--standalone``, ``--rdzv-backend c10d``, a given ``--master-port``), so rank 0
cannot serve there and the other ranks would reach torch's store instead. The ranks
connect to that store as clients, as ``torch.distributed``'s own ``env://`` does. torch
is in the process by definition (torchrun started it), so importing it costs no new
dependency; it is imported only here, only then.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from datetime import timedelta

from ._conventions import LaunchEnv, detected
from .backends import StoreRendezvous
from .errors import LaunchEnvError, RendezvousError

__all__ = ["attempt_prefix", "torchrun_store"]

_FLAG = "TORCHELASTIC_USE_AGENT_STORE"
_RESTART = "TORCHELASTIC_RESTART_COUNT"


def attempt_prefix(env: LaunchEnv, environ: Mapping[str, str], base: str = "pynccl") -> str:
    """``base``, plus torchrun's run id and restart attempt when there are any: a job
    restarted with ``--max-restarts`` over the same store never reads an earlier
    attempt's id."""
    parts = [base]
    if env.launcher == "torchrun" and env.job_id is not None:
        parts.append(f"run-{env.job_id}")
    restart = (environ.get(_RESTART) or "").strip()
    if restart:
        parts.append(f"attempt-{restart}")
    return "/".join(parts)


def torchrun_store(
    env: LaunchEnv, environ: Mapping[str, str], timeout: float
) -> StoreRendezvous | None:
    """A :class:`StoreRendezvous` over torchrun's store, or ``None`` when torchrun did not
    start this process with one (then ``MASTER_PORT`` is free for the TCP rendezvous).

    Raises :class:`LaunchEnvError` at once when torchrun keeps ``MASTER_PORT`` for
    ``torch.distributed``'s own store (``TORCHELASTIC_USE_AGENT_STORE=False``), or
    when torch cannot be imported; :class:`RendezvousError` when its store cannot
    be reached.
    """
    flag = environ.get(_FLAG)
    if env.launcher != "torchrun" or flag is None:
        return None
    if env.master_addr is None or env.master_port is None:
        return None  # the TCP rendezvous says what is missing
    where = f"{env.master_addr}:{env.master_port}"
    if flag.strip() != "True":
        raise LaunchEnvError(
            f"{detected('torchrun')} with {_FLAG}={flag.strip()!r}: {where} is where "
            "torch.distributed's rank 0 starts its own store (init_process_group), so the "
            "TCP rendezvous cannot use it; pass store= (a torch.distributed store, e.g. "
            "torch.distributed.TCPStore on another port, or torch's default store after "
            "init_process_group) or file=",
            "torchrun",
        )
    try:
        # by name: torch is optional, and mypy then reads no torch stubs whether or not
        # torch is installed
        tcp_store = importlib.import_module("torch.distributed").TCPStore
    except (ImportError, AttributeError) as e:
        raise LaunchEnvError(
            f"{detected('torchrun')} ({_FLAG}=True: torchrun's own store listens on {where}) "
            f"but torch.distributed cannot be imported ({e}); pass store= or file=",
            "torchrun",
        ) from e
    try:
        store = tcp_store(
            host_name=env.master_addr,
            port=env.master_port,
            world_size=None,
            is_master=False,
            timeout=timedelta(seconds=timeout),
            wait_for_workers=False,
        )
    except Exception as e:  # torch raises DistNetworkError / RuntimeError subclasses
        raise RendezvousError(
            f"rank {env.rank}: cannot reach torchrun's store at {where}: {type(e).__name__}: {e}"
        ) from e
    return StoreRendezvous(store, prefix=attempt_prefix(env, environ))
