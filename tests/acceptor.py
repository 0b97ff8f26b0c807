"""A listening socket served on a thread, for tests that stand something else at an address."""

from __future__ import annotations

import socket
import threading


class Acceptor:
    """Hands each connection on `sock` to `handle(conn)`, on a thread of its own. Accept polls with
    a timeout so that `close` stops it cleanly. Subclasses set their own state before calling
    `__init__` (the thread starts in it)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.sock.settimeout(0.05)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def handle(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            self.handle(conn)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()
