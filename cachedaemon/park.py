"""`cachedaemon park`: a cache daemon started ahead of the pool it will serve.

A daemon's start before its load is mostly imports (torch alone: 3-5 s on a GPU machine)
and, on a GPU, its CUDA context. Neither depends on the checkpoint, so the supervisor keeps
one parked daemon per rank for the next update or refit (`update.park`): it imports what
`serve` runs, makes the device's context, listens on its claim socket and waits. A claim
sends the `serve` command line and the log file to write to; the parked process answers
with its pid, moves its output to that log and runs `cachedaemon serve` in place, so the
new pool's daemon starts loading at once.

A claim is one JSON object, sent whole before the sender shuts its side down:
`{"argv": ["--log-format", "json", "serve", ...], "log": "/run/gen-2/logs/daemon-0.log"}`;
the answer is `{"pid": N}`. A claim that does not parse ends the parked daemon (exit 2, the
reason on stderr) without an answer: the claimer starts a daemon of its own. The parked
daemon is its starter's child and dies with it (the supervisor's children get SIGKILL when
it dies)."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import structlog

from cachedaemon.errors import CacheError

log = structlog.get_logger("cachedaemon.park")
CLAIM_TIMEOUT_S = 5.0  # a claimer sends its claim at once: silence past this is no claim
MAX_CLAIM_BYTES = 1 << 20


class Claim:
    """What a claim carries: the `cachedaemon` command line to run, and its log file."""

    def __init__(self, argv: list[str], log_path: str) -> None:
        self.argv, self.log_path = argv, log_path

    @classmethod
    def parse(cls, data: bytes) -> Claim:
        try:
            msg = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CacheError(f"a claim is one JSON object; got {data[:80]!r} ({e})") from e
        argv, path = msg.get("argv") if isinstance(msg, dict) else None, None
        if isinstance(msg, dict):
            path = msg.get("log")
        if not (isinstance(argv, list) and all(isinstance(a, str) for a in argv)):
            raise CacheError('a claim needs "argv": the cachedaemon command line, as strings')
        if "serve" not in argv:
            raise CacheError(f"a parked daemon runs `serve`; the claim's argv is {argv!r}")
        if not isinstance(path, str) or not path:
            raise CacheError('a claim needs "log": the file the daemon writes to')
        return cls(argv, path)


def warm(device: str, backend: str) -> None:
    """Everything `serve` imports, also what its load imports only when it runs, and the
    device's context (a GPU backend makes it); on a GPU also what the load's first
    pass would pay (`cuda_load.prewarm`)."""
    import importlib

    from cachedaemon.backends import get_backend
    from cachedaemon.config import default_backend

    mods = ["torch", "cachedaemon.server", "cachedaemon.checkpoint", "cachedaemon.pool_plan"]
    mods += ["cachedaemon.progress", "cachedaemon.loader", "cachedaemon.digest"]
    if device.startswith("cuda"):
        mods += ["cachedaemon.cuda_load", "cachedaemon.blake3_gpu"]
    for name in mods:
        importlib.import_module(name)
    get_backend(default_backend(device) if backend == "auto" else backend, device)
    if device.startswith("cuda"):
        import torch

        from cachedaemon.cuda_load import prewarm

        prewarm(torch.device(device))


def wait_for_claim(path: Path) -> Claim:
    """Listen on `path` until a claim comes; answer it with this pid."""
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(path))
        os.chmod(path, 0o600)
        listener.listen(1)
        log.info("parked", pid=os.getpid(), claim=str(path))
        while True:
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(CLAIM_TIMEOUT_S)
                try:
                    data = _read_all(conn)
                except (TimeoutError, OSError):
                    continue  # a probe or a claimer that went away: still parked
                if not data:
                    continue
                claim = Claim.parse(data)
                conn.sendall(json.dumps({"pid": os.getpid()}).encode())
                return claim
    finally:
        listener.close()
        path.unlink(missing_ok=True)


def _read_all(conn: socket.socket) -> bytes:
    parts, size = [], 0
    while chunk := conn.recv(65536):
        parts.append(chunk)
        size += len(chunk)
        if size > MAX_CLAIM_BYTES:
            raise CacheError(f"a claim over {MAX_CLAIM_BYTES} bytes")
    return b"".join(parts)


def take_log(path: str) -> None:
    """This process's stdout and stderr go to `path` (appended) from now on."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)


def claim(path: Path, argv: list[str], log_path: Path, timeout_s: float = 2.0) -> int | None:
    """The claimer's side: hand `argv` (from the first flag after `-m cachedaemon`) and the
    log file to the daemon parked on `path`; its pid, or None if none is parked there or
    it did not answer."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(str(path))
        sock.sendall(json.dumps({"argv": argv, "log": str(log_path)}).encode())
        sock.shutdown(socket.SHUT_WR)
        reply = json.loads(_read_all(sock) or b"null")
    except (OSError, TimeoutError, ValueError, CacheError):
        return None
    finally:
        sock.close()
    pid = reply.get("pid") if isinstance(reply, dict) else None
    return pid if isinstance(pid, int) else None
