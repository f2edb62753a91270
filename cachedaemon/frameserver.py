"""A small threaded server of protocol frames on a unix socket, shared by daemon and keeper.

One thread accepts; each connection gets a thread that checks the peer's uid, then answers
frames until the peer closes or goes quiet past the read timeout. A bad frame closes only
its own connection; everyone else is still served.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
from collections.abc import Callable

import structlog

from cachedaemon import protocol
from cachedaemon.errors import ProtocolError

log = structlog.get_logger("cachedaemon.server")

Reply = tuple[protocol._Msg, list[int]]
Handler = Callable[[protocol._Msg, list[int]], Reply]


class FrameServer:
    def __init__(
        self,
        sock: socket.socket,
        handler: Handler,
        *,
        read_timeout: float = 5.0,
        max_fds: int = 0,
        max_connections: int = 256,
    ) -> None:
        self._sock = sock
        self._handler = handler
        self._timeout = read_timeout
        self._max_fds = max_fds
        self._slots = threading.BoundedSemaphore(max_connections)
        self._wake_r, self._wake_w = os.pipe()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.connected = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self.serve_forever, name="accept", daemon=True)
        self._thread.start()

    def serve_forever(self) -> None:
        while not self._stopping.is_set():
            ready, _, _ = select.select([self._sock.fileno(), self._wake_r], [], [])
            if self._wake_r in ready:
                break
            try:
                conn, _ = self._sock.accept()
            except OSError:
                continue
            if not self._slots.acquire(blocking=False):
                log.warning("connection refused: too many clients")
                conn.close()
                continue
            threading.Thread(target=self._serve_conn, args=(conn,), daemon=True).start()

    def close(self) -> None:
        self._stopping.set()
        os.write(self._wake_w, b"x")
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._sock.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _serve_conn(self, conn: socket.socket) -> None:
        with self._lock:
            self.connected += 1
        try:
            conn.settimeout(self._timeout)
            uid = protocol.peer_uid(conn)
            if uid != os.getuid():
                log.warning("peer refused", peer_uid=uid)
                msg = f"peer uid {uid} is not this server's uid {os.getuid()}; connect as that user"
                protocol.send(conn, protocol.ErrorReply(msg))
                return
            self._answer(conn)
        except (OSError, ProtocolError) as exc:
            log.debug("connection dropped", error=str(exc))
        finally:
            with self._lock:
                self.connected -= 1
            conn.close()
            self._slots.release()

    def _answer(self, conn: socket.socket) -> None:
        while not self._stopping.is_set():
            try:
                msg, fds = protocol.recv(conn, max_fds=self._max_fds)
            except EOFError:
                return
            except ProtocolError as exc:
                log.warning("bad frame", error=str(exc))
                with contextlib.suppress(OSError):
                    protocol.send(conn, protocol.ErrorReply(f"bad frame: {exc}"))
                return
            reply, reply_fds = self._handler(msg, fds)
            protocol.send(conn, reply, reply_fds)
