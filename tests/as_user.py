"""A piece of a test run as another user: in a forked child that switches gid and uid."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any


def as_user(uid: int, work: Callable[[], Any]) -> Any:
    """What `work` returns (anything JSON can carry) run in a forked child of `uid`, or the
    exception it raised as "Type: message". The child never returns to pytest."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        result: Any = "the child failed"
        try:
            os.setgid(uid)
            os.setuid(uid)
            result = work()
        except BaseException as e:
            result = f"{type(e).__name__}: {e}"
        finally:
            os.write(w, json.dumps(result).encode())
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        text = f.read().decode()
    os.waitpid(pid, 0)
    return json.loads(text)
