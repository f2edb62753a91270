"""A small threaded server of protocol frames on a unix socket, shared by daemon and keeper.

One thread accepts and checks each peer's uid; a connection of this uid gets a thread that
answers frames until the peer closes or goes quiet past the read timeout. A bad frame closes
only its own connection; everyone else is still served.

A peer of another uid is refused: its thread reads and drops its request (one frame, bounded
in bytes and seconds) before it sends the refusal and closes, so the peer reads the
explanation instead of a broken pipe on a request still being written. Refused peers have
their own few slots: they can neither hold the server nor take the slots of its users.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
from collections.abc import Callable

import structlog

import cachedaemon.protocol as protocol
from holdfast_contract import wire
from holdfast_contract.errors import ProtocolError

log = structlog.get_logger("cachedaemon.server")

Reply = tuple[protocol._Msg, list[int]]
Handler = Callable[[protocol._Msg, list[int]], Reply]
REFUSED_SLOTS = 8  # refusals in progress at once; a peer past them is closed unanswered


class FrameServer:
    def __init__(
        self,
        sock: socket.socket,
        handler: Handler,
        *,
        read_timeout: float = 5.0,
        max_fds: int = 0,
        max_connections: int = 256,
        refused_read_timeout: float = 1.0,
        close_reply_fds: bool = False,
    ) -> None:
        self._sock = sock
        self._handler = handler
        self._timeout = read_timeout
        self._max_fds = max_fds
        self._slots = threading.BoundedSemaphore(max_connections)
        self._refused_slots = threading.BoundedSemaphore(REFUSED_SLOTS)
        self._refused_timeout = refused_read_timeout
        self._close_reply_fds = close_reply_fds  # the handler's reply fds are dups for us
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
            if not self._dispatch(conn):
                conn.close()

    def _dispatch(self, conn: socket.socket) -> bool:
        """Give `conn` a thread: a user's or a refusal's; False when no slot is free."""
        try:
            uid = wire.peer_uid(conn)
        except OSError:
            return False
        if uid != os.getuid():
            if not self._refused_slots.acquire(blocking=False):
                log.warning("peer refused unanswered: too many refusals", peer_uid=uid)
                return False
            threading.Thread(target=self._refuse, args=(conn, uid), daemon=True).start()
            return True
        if not self._slots.acquire(blocking=False):
            log.warning("connection refused: too many clients")
            return False
        threading.Thread(target=self._serve_conn, args=(conn,), daemon=True).start()
        return True

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
            self._answer(conn)
        except (OSError, ProtocolError) as exc:
            log.debug("connection dropped", error=str(exc))
        finally:
            with self._lock:
                self.connected -= 1
            conn.close()
            self._slots.release()

    def _refuse(self, conn: socket.socket, uid: int) -> None:
        log.warning("peer refused", peer_uid=uid)
        msg = f"peer uid {uid} is not this server's uid {os.getuid()}; connect as that user"
        try:
            wire.drop_frame(conn, max_frame=protocol.MAX_FRAME, within=self._refused_timeout)
            conn.settimeout(self._refused_timeout)
            protocol.send(conn, protocol.ErrorReply(msg))
        except (OSError, ProtocolError) as exc:
            log.debug("refused peer gone", peer_uid=uid, error=str(exc))
        finally:
            conn.close()
            self._refused_slots.release()

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
            try:
                protocol.send(conn, reply, reply_fds)
            finally:
                if self._close_reply_fds:
                    wire.close_fds(reply_fds)
