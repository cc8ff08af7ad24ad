"""A TCP forwarder to a real master, on its own threads: the base of the test proxies that count
what a client sends or lose an answer on the way back."""

from __future__ import annotations

import contextlib
import socket
import threading

__all__ = ["TcpForwarder"]


class TcpForwarder:
    """Forwards every connection to ``127.0.0.1:port`` both ways. Subclasses override
    :meth:`serve` (what to do with a new connection) or :meth:`seen` (bytes the client sent)."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self.serve, args=(client,), daemon=True).start()

    def serve(self, client: socket.socket) -> None:
        self.forward(client, socket.create_connection(("127.0.0.1", self.target)))

    def forward(self, client: socket.socket, upstream: socket.socket) -> None:
        threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def seen(self, data: bytes) -> None:
        """Bytes the client sent (called before they are forwarded)."""

    def _pump(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if from_client:
                    self.seen(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.listener.close()
