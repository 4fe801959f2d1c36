"""Where rank 0's rendezvous server listens, and opening that socket with errors that
say what is wrong (a MASTER_ADDR that is not this host, a port in use)."""

from __future__ import annotations

import errno
import ipaddress
import socket

from .errors import RendezvousAddressError

__all__ = ["open_listener"]


def _resolve_bind(host: str, port: int, bind: str | None) -> tuple[socket.AddressFamily, str]:
    """Where rank 0 listens: loopback stays loopback, other addresses listen on all interfaces
    once we know ``host`` is one of ours (so a wrong MASTER_ADDR fails here, not as a hang)."""
    if bind is not None:
        try:
            fam = socket.AF_INET6 if ipaddress.ip_address(bind).version == 6 else socket.AF_INET
        except ValueError:
            fam = socket.AF_INET
        return fam, bind
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise RendezvousAddressError(
            f"rank 0 cannot resolve the rendezvous host {host!r} (MASTER_ADDR): {e}"
        ) from None
    addrs = [(info[0], str(info[4][0])) for info in infos]
    if all(ipaddress.ip_address(a.split("%")[0]).is_loopback for _, a in addrs):
        return addrs[0]
    local = []
    for fam, addr in addrs:
        try:
            with socket.socket(fam, socket.SOCK_STREAM) as probe:
                probe.bind((addr, 0))
            local.append(fam)
        except OSError:
            continue
    if not local:
        shown = ", ".join(a for _, a in addrs)
        raise RendezvousAddressError(
            f"rank 0 cannot listen on {host}:{port}: {host} ({shown}) is not an address of "
            f"this machine ({socket.gethostname()}); MASTER_ADDR must name rank 0's host"
        )
    if socket.AF_INET in local:
        return socket.AF_INET, "0.0.0.0"
    return socket.AF_INET6, "::"


def open_listener(host: str, port: int, bind: str | None, *, backlog: int) -> socket.socket:
    """A listening, non-blocking TCP socket for ``host:port`` (``bind`` overrides the
    address); :class:`RendezvousAddressError` (with ``errno`` set) when it cannot be had."""
    family, bind_host = _resolve_bind(host, port, bind)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((bind_host, port))
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        why = (
            "the port is already in use (another job, or a previous run still "
            "holding it); choose another MASTER_PORT"
            if e.errno == errno.EADDRINUSE
            else str(e)
        )
        err = RendezvousAddressError(
            f"rank 0 cannot listen on {host}:{port} (bound {bind_host}:{port}): {why}"
        )
        err.errno = e.errno
        raise err from None
    sock.setblocking(False)
    return sock
