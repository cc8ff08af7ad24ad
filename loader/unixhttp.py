"""``http.client`` over a unix domain socket: the daemon's and the master's ``unix://`` addresses.

Shared by the loader's daemon and master clients and by the CLI's daemon client (stdlib only, so
``import loader`` stays light).
"""

from __future__ import annotations

import http.client
import socket

__all__ = ["UnixHTTPConnection"]


class UnixHTTPConnection(http.client.HTTPConnection):
    """An ``HTTPConnection`` whose transport is the unix socket at ``path``."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
