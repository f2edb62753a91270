"""The frame every holdfast unix socket speaks, and the socket helpers around it.

A frame is a 4-byte big-endian length, then that many bytes of body (one tagged msgspec
msgpack struct: which structs is each protocol's business). File descriptors travel as
SCM_RIGHTS ancillary data on the frame's first byte. Each protocol caps its own frames
(`max_frame`): a header announcing more is refused before a byte of the body is read.

The cache daemon and keeper (`cachedaemon.protocol`) and the engine fork server
(`holdfast_contract.forkserver`, `engine.forkserver`) frame with this module only. Every
bad frame is one `ProtocolError`; a clean close before a frame's first byte is `EOFError`.
Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import socket
import struct
import time
from collections.abc import Sequence
from pathlib import Path

from holdfast_contract.errors import ProtocolError

HEADER = struct.Struct(">I")
MAX_FDS = 253  # SCM_MAX_FD on Linux
Fds = Sequence[int]


# ---- frames ----
def frame_of(body: bytes, max_frame: int, what: str = "frame") -> bytes:
    """`body` with its length header; ProtocolError past `max_frame`."""
    check_length(len(body), max_frame, what)
    return HEADER.pack(len(body)) + body


def check_length(length: int, max_frame: int, what: str = "frame") -> int:
    if length > max_frame:
        raise ProtocolError(f"a {what} of {length} bytes exceeds the {max_frame}-byte cap")
    return length


def frame_length(head: bytes, max_frame: int, what: str = "frame") -> int:
    """The body length a header announces; ProtocolError past `max_frame`."""
    (length,) = HEADER.unpack(head)
    return check_length(int(length), max_frame, what)


def send_frame(sock: socket.socket, frame: bytes, fds: Fds = ()) -> None:
    """Send an encoded frame (header included), `fds` (at most MAX_FDS) on its first byte."""
    if len(fds) > MAX_FDS:
        raise ProtocolError(f"{len(fds)} fds in one frame; at most {MAX_FDS}")
    if fds:
        sent = socket.send_fds(sock, [frame[:1]], list(fds))
        sock.sendall(frame[sent:])
    else:
        sock.sendall(frame)


def recv_exact(sock: socket.socket, n: int, what: str) -> bytes:
    """`n` bytes; ProtocolError naming `what` at a timeout or a close before the last."""
    buf = bytearray()
    while len(buf) < n:
        try:
            part = sock.recv(n - len(buf))
        except TimeoutError as exc:
            raise ProtocolError(f"timed out reading the {what} ({len(buf)}/{n} bytes)") from exc
        if not part:
            raise ProtocolError(f"connection closed mid-{what} ({len(buf)}/{n} bytes)")
        buf += part
    return bytes(buf)


def recv_frame(
    sock: socket.socket, *, max_frame: int, max_fds: int = 0, what: str = "frame"
) -> tuple[bytes, list[int]]:
    """One frame's body and the fds sent with it. ProtocolError on a bad, truncated or
    oversized frame or a timeout (fds that arrived are closed first); EOFError on a clean
    close before any byte."""
    fds: list[int] = []
    flags = 0
    try:
        if max_fds:
            first, fds, flags, _ = socket.recv_fds(sock, 1, max_fds)
        else:
            first = sock.recv(1)
    except TimeoutError as exc:
        raise ProtocolError(f"timed out waiting for a {what}") from exc
    try:
        if flags & socket.MSG_CTRUNC:  # those that fit were installed: closed below
            raise ProtocolError(f"more than {max_fds} fds sent with one {what}")
        if not first:
            raise EOFError("peer closed the connection")
        head = first + recv_exact(sock, HEADER.size - 1, f"{what} header")
        return recv_exact(sock, frame_length(head, max_frame, what), f"{what} body"), fds
    except BaseException:
        close_fds(fds)
        raise


class FrameReader:
    """One frame read as it arrives on a non-blocking socket, so that a slow or silent peer
    holds up nobody: call `feed` each time the socket is readable. The fds that rode on the
    first byte are kept in `fds` for the caller to take or close, whatever happens."""

    def __init__(self, *, max_frame: int, max_fds: int) -> None:
        self.max_frame, self.max_fds = max_frame, max_fds
        self.buf = bytearray()
        self.fds: list[int] = []

    def feed(self, sock: socket.socket) -> bytes | None:
        """Read what has arrived; the body once whole, else None. ProtocolError on an
        oversized frame or too many fds, EOFError when the peer closes before the end."""
        try:
            if not self.buf:  # the fds ride on the first byte
                data, fds, flags, _ = socket.recv_fds(sock, 1, self.max_fds)
                self.fds += fds
                if flags & socket.MSG_CTRUNC:
                    raise ProtocolError(f"more than {self.max_fds} fds sent with one frame")
            else:
                data = sock.recv(self._missing())
        except BlockingIOError:
            return None
        if not data:
            raise EOFError(f"connection closed mid-frame ({len(self.buf)} bytes)")
        self.buf += data
        return self._body()

    def _length(self) -> int | None:
        if len(self.buf) < HEADER.size:
            return None
        return frame_length(bytes(self.buf[: HEADER.size]), self.max_frame)

    def _missing(self) -> int:
        length = self._length()
        return (
            HEADER.size - len(self.buf) if length is None else HEADER.size + length - len(self.buf)
        )

    def _body(self) -> bytes | None:
        length = self._length()
        if length is None or len(self.buf) < HEADER.size + length:
            return None
        return bytes(self.buf[HEADER.size :])


def drop_frame(sock: socket.socket, *, max_frame: int, within: float = 1.0) -> None:
    """Read one frame of a peer that will be refused and drop it, so the refusal that follows
    reaches a peer that has finished sending. Gives up at EOF, at a header over `max_frame`
    or once `within` seconds have passed. Plain reads: fds sent with it are never installed."""
    deadline = time.monotonic() + within
    head = _read_until(sock, HEADER.size, deadline)
    if len(head) < HEADER.size or HEADER.unpack(head)[0] > max_frame:
        return
    left = HEADER.unpack(head)[0]
    while left > 0:
        got = len(_read_until(sock, min(left, 1 << 16), deadline))
        if got == 0:
            return
        left -= got


def _read_until(sock: socket.socket, n: int, deadline: float) -> bytes:
    """Up to `n` bytes read before `deadline`; fewer at EOF, timeout or a socket error."""
    buf = bytearray()
    while len(buf) < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            sock.settimeout(remaining)
            part = sock.recv(n - len(buf))
        except OSError:  # TimeoutError among them
            break
        if not part:
            break
        buf += part
    return bytes(buf)


# ---- fds and sockets ----
def close_fds(fds: Fds) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a unix socket (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


def socket_answers(path: str | os.PathLike[str], timeout: float = 1.0) -> bool:
    """Whether a process listens on the unix socket at `path`: False only when nothing can
    be there (no such file, or the connection is refused: its owner is gone). Any other
    failure (a full backlog, a timeout, a socket of another user) counts as an answer, so a
    caller about to replace the socket refuses instead of taking a live server's path."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(os.fspath(path))
        except (FileNotFoundError, ConnectionRefusedError):
            return False
        except OSError:  # busy, slow or not ours: someone is there
            return True
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listened on a moment ago: drawn below the kernel's
    range of ephemeral ports where it can (a port of that range may be taken by any
    outgoing connection between now and the listen), else one the kernel picks."""
    low = _ephemeral_low()
    draw = random.SystemRandom()
    for _ in range(64 if low > 2048 else 0):
        port = draw.randrange(max(1024, low - 16384), low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    continue
                break  # (a host not bindable here: the kernel's pick says so below)
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (net.ipv4.ip_local_port_range)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
