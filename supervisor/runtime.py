"""The runtime dir: created 0700, owned by us, held by exactly one live supervisor.

`RuntimeDir.acquire(path)` takes an exclusive flock on `<run>/supervisor.lock`; a second
supervisor on the same dir is refused while the first lives (the kernel drops the lock when
the holder dies, however it dies). Only while holding the lock are our own stale sockets
removed, and only when nothing listens on them any more: a live listener on one of our
socket paths (or anything that is not a socket there) refuses the start instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from pathlib import Path

from holdfast_contract import wire
from supervisor.errors import RuntimeDirError

OWN_SOCKETS = ("agents", "control", "events")


def check_owner(path: Path) -> None:
    """Refuse a runtime dir that another user owns or that others can enter."""
    st = path.stat()
    if st.st_uid != os.getuid():
        raise RuntimeDirError(
            f"runtime dir {path} is owned by uid {st.st_uid}, not by you (uid {os.getuid()}); "
            "set cache.runtime_dir in the policy (or --runtime-dir) to a dir of your own"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeDirError(f"runtime dir {path} is not a directory; set cache.runtime_dir")


class RuntimeDir:
    """An acquired runtime dir; `release()` removes our sockets and drops the lock."""

    def __init__(self, path: Path, lock_fd: int) -> None:
        self.path = path
        self._lock_fd = lock_fd

    @classmethod
    def acquire(cls, path: str | os.PathLike[str]) -> RuntimeDir:
        run = Path(path)
        old = os.umask(0o077)
        try:
            run.mkdir(mode=0o700, parents=True, exist_ok=True)
            check_owner(run)
            os.chmod(run, 0o700)
            fd = os.open(run / "supervisor.lock", os.O_RDWR | os.O_CREAT, 0o600)
        except PermissionError as e:
            raise RuntimeDirError(
                f"cannot use runtime dir {run}: {e.strerror}; "
                "set cache.runtime_dir to a dir you can write"
            ) from e
        except (FileExistsError, NotADirectoryError) as e:  # a file where a dir must be
            raise RuntimeDirError(
                f"cannot use runtime dir {run}: {e.filename or run} is not a directory; "
                "set cache.runtime_dir to a directory (it is made when missing)"
            ) from e
        finally:
            os.umask(old)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RuntimeDirError(
                f"another supervisor (pid {holder}) runs on {run}; stop it "
                f"(`supervisor stop --runtime-dir {run}`) or set cache.runtime_dir"
            ) from None
        try:
            clear_stale_sockets(run)
        except RuntimeDirError:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        (run / "logs").mkdir(mode=0o700, exist_ok=True)
        return cls(run, fd)

    def endpoint(self, name: str) -> str:
        return f"ipc://{self.path / name}"

    def remove_own_sockets(self) -> None:
        for name in OWN_SOCKETS:
            path = self.path / name
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISSOCK(path.lstat().st_mode):
                    path.unlink()

    def release(self) -> None:
        self.remove_own_sockets()
        with contextlib.suppress(OSError):
            os.ftruncate(self._lock_fd, 0)
        os.close(self._lock_fd)


def clear_stale_sockets(run: Path) -> None:
    """Remove our socket files that a dead supervisor left; refuse any that something still
    listens on, or that are not sockets at all."""
    for name in OWN_SOCKETS:
        path = run / name
        try:
            mode = path.lstat().st_mode
        except FileNotFoundError:
            continue
        if not stat.S_ISSOCK(mode):
            raise RuntimeDirError(
                f"cannot listen on ipc://{path}: something that is not a socket is in the "
                f"way; remove {path} or set cache.runtime_dir"
            )
        if wire.socket_answers(path):
            raise RuntimeDirError(
                f"cannot listen on ipc://{path}: another process listens there; stop it "
                "or set cache.runtime_dir"
            )
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def holder_pid(path: str | os.PathLike[str]) -> int | None:
    """The pid of the live supervisor holding `path`, or None when none holds it."""
    lock = Path(path) / "supervisor.lock"
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        return int(text) if text.isdigit() else None
    finally:
        os.close(fd)
    return None
