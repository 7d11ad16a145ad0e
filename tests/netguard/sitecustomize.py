"""Fail loudly on any network connection that leaves this machine (tests run offline).

Put on PYTHONPATH by the repository's conftest.py, so every Python process the tests start (notebook kernels,
torchrun workers, nbgrader) carries the guard too. Loopback and Unix sockets stay allowed.
"""

import ipaddress
import socket

_original_connect = socket.socket.connect


def _is_local(address) -> bool:
    if not isinstance(address, tuple):
        return True  # Unix socket path
    host = address[0]
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: would need DNS, i.e. the network


def _guarded_connect(self, address):
    if not _is_local(address):
        raise RuntimeError(
            f"Network access attempted during tests: connect({address!r}). Tests must run offline."
        )
    return _original_connect(self, address)


socket.socket.connect = _guarded_connect
