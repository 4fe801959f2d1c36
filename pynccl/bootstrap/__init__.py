"""Getting ranks together: launcher detection and sharing the unique id.

NCCL leaves one job to its caller: handing the 128-byte ``ncclUniqueId`` that
rank 0 creates to every other rank (with several ids, each made by the first rank of
its root's group: :mod:`._roots`). This package does it with the standard library only:

* :func:`detect_launch_env` reads rank, world size, local rank and the master
  address from torchrun, ``python -m pynccl launch``, torch's ``env://`` variables,
  Open MPI, MVAPICH2, Cray PALS, MPICH/Intel MPI, Slurm steps, LeaderWorkerSet or
  indexed Jobs/JobSet; :func:`select_device` turns the local rank into a CUDA device.
* Backends implementing :class:`Rendezvous` share the id: :class:`TcpRendezvous`
  (rank 0 serves it, mutually authenticated by ``PYNCCL_RENDEZVOUS_KEY``),
  :class:`StoreRendezvous`, :class:`MpiRendezvous`, :class:`FileRendezvous`.
* :func:`from_env` does all of it and returns a :class:`~pynccl.Communicator`.

Typical use, on every rank::

    from pynccl.bootstrap import from_env
    comm = from_env()                  # TCP at MASTER_ADDR:MASTER_PORT, PYNCCL_RENDEZVOUS_KEY
    comm = from_env(store=store)       # or a torch.distributed store, mpi_comm=, file=

started by ``python -m pynccl launch -n 4 train.py``, torchrun (through torchrun's own
store), srun or mpirun; ``from_env(rank=r, world_size=n, store=store)`` where no launcher
started the processes (Ray actors, a process pool).
Importing this package loads no library.
"""

from __future__ import annotations

from ._seal import KEY_ENV, InsecureRendezvousWarning
from .backends import FileRendezvous, MpiRendezvous, Rendezvous, StoreRendezvous
from .env import (
    LAUNCHERS,
    LaunchEnv,
    detect_launch_env,
    expand_nodelist,
    first_host,
    select_device,
    slurm_default_port,
    visible_devices,
)
from .errors import (
    LaunchEnvError,
    RendezvousAddressError,
    RendezvousAuthError,
    RendezvousError,
    RendezvousMismatchError,
    RendezvousProtocolError,
    RendezvousTimeoutError,
)
from .tcp import TcpRendezvous, TcpRendezvousServer

__all__ = [
    "KEY_ENV",
    "LAUNCHERS",
    "FileRendezvous",
    "InsecureRendezvousWarning",
    "LaunchEnv",
    "LaunchEnvError",
    "MpiRendezvous",
    "Rendezvous",
    "RendezvousAddressError",
    "RendezvousAuthError",
    "RendezvousError",
    "RendezvousMismatchError",
    "RendezvousProtocolError",
    "RendezvousTimeoutError",
    "StoreRendezvous",
    "TcpRendezvous",
    "TcpRendezvousServer",
    "detect_launch_env",
    "expand_nodelist",
    "first_host",
    "from_env",
    "make_rendezvous",
    "select_device",
    "slurm_default_port",
    "visible_devices",
]


TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

# from_env builds a Communicator, so it lives in the object layer (pynccl.comm); this
# package never imports comm and re-exports the two names lazily (PEP 562).
_OBJECT_LAYER = ("from_env", "make_rendezvous")


def __getattr__(name: str) -> Any:
    if name in _OBJECT_LAYER:
        import importlib

        value = getattr(importlib.import_module("pynccl.comm._from_env"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pynccl.bootstrap' has no attribute {name!r}")
