"""A tiny key-value store over an AF_UNIX socket, for ``from_env(store=...)`` across processes.

``python kv_store.py ADDRESS`` serves one store (a ``multiprocessing`` manager, no TCP)
at the socket path ``ADDRESS`` until killed, printing ``READY`` once it listens; the
authentication key is ``$PYNCCL_TEST_STORE_AUTHKEY``. Clients call
:func:`connect(ADDRESS) <connect>` and get a proxy with ``set(key, value)`` and
``get(key)`` (``None`` for a missing key), which is what
:class:`pynccl.bootstrap.StoreRendezvous` needs.
"""

from __future__ import annotations

import os
import sys
from multiprocessing.managers import BaseManager

AUTHKEY_ENV = "PYNCCL_TEST_STORE_AUTHKEY"


class KVStore:
    """A dictionary behind ``set``/``get``, living in the server process."""

    def __init__(self) -> None:
        self._data: dict[str, object] = {}

    def set(self, key: str, value: object) -> None:
        self._data[key] = value

    def get(self, key: str) -> object:
        return self._data.get(key)


class DictStore:
    """An in-process store for ``StoreRendezvous`` in one process's threads: ``get`` of a
    missing key raises KeyError (the polling semantics of torch's stores)."""

    def __init__(self) -> None:
        self.data: dict[str, object] = {}

    def set(self, key: str, value: object) -> None:
        self.data[key] = value

    def get(self, key: str) -> object:
        return self.data[key]


_STORE = KVStore()


class StoreManager(BaseManager):
    """Serves the one :class:`KVStore` of the server process as ``store()``."""


def _authkey() -> bytes:
    key = os.environ.get(AUTHKEY_ENV)
    if not key:
        raise SystemExit(f"{AUTHKEY_ENV} is not set")
    return key.encode()


def connect(address: str) -> object:
    """A proxy for the store served at ``address``."""
    StoreManager.register("store")
    manager = StoreManager(address=address, authkey=_authkey())
    manager.connect()
    return manager.store()  # type: ignore[attr-defined]


def main(address: str) -> None:
    StoreManager.register("store", callable=lambda: _STORE)
    server = StoreManager(address=address, authkey=_authkey()).get_server()
    print("READY", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1])
