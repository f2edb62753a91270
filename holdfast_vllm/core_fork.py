"""vLLM's EngineCore forked from its API server (`HOLDFAST_VLLM_FORK=1`), not spawned.

`fork_engine_core` is called by the plugin (`holdfast_vllm.plugin.register`) and in each
API server the fork server starts (`holdfast_vllm.forkserver`); the loader reports how its
EngineCore started (`engine_core_start`). Imports no vLLM until `fork_engine_core` runs.
"""

from __future__ import annotations

import os
import socket
from typing import Any

FORK_ENV = "HOLDFAST_VLLM_FORK"
_PATCHED = "__holdfast_fork__"
# the pid of the API server that put fork back; a module global, so a forked EngineCore
# inherits it and a spawned one (which imports this module afresh) does not
forked_from = 0


def engine_core_start() -> str:
    """How this process (vLLM's EngineCore, the worker inside it) was started: "forked"
    from an API server that put fork back (`fork_engine_core`), else "spawned" (or the API
    server itself, where vLLM runs the engine in-process)."""
    return "forked" if forked_from not in (0, os.getpid()) else "spawned"


def fork_engine_core() -> None:
    """Have vLLM fork its EngineCore from the API server, imports done, not spawn it.

    vLLM's CPU platform sets VLLM_WORKER_MULTIPROC_METHOD=spawn while it checks the config
    (`CpuPlatform.check_and_update_config`), so each EngineCore imports vLLM and torch
    from scratch: on a 2-core machine a third of a start. vLLM's own default elsewhere is
    fork, which it refuses only where CUDA is initialized (`_maybe_force_spawn`, which
    still runs). The API server computes nothing on the CPU before it starts the
    EngineCore, so no OpenMP pool exists yet to be lost in the child. (vLLM's command
    line also sets spawn where the variable is unset, `cli_env_setup`.) This sets fork
    once the platform's check is done; the platform is otherwise unchanged."""
    from vllm.platforms import current_platform

    cls: Any = type(current_platform)
    check = cls.check_and_update_config
    if getattr(check, _PATCHED, False):
        return

    def checked(klass: Any, vllm_config: Any) -> None:
        global forked_from
        check(vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
        forked_from = os.getpid()

    setattr(checked, _PATCHED, True)
    cls.check_and_update_config = classmethod(checked)
    os.register_at_fork(after_in_child=drop_listeners)


def drop_listeners() -> None:
    """In a fork of the API server (its EngineCore): let go of the API server's TCP
    sockets that are bound but not connected, which a fork inherits and a spawn does not:
    its HTTP port, bound before the EngineCore starts and listened on after. Held by the
    EngineCore, the port would outlive an API server that died alone, taking connections
    it never accepts. Each is replaced by /dev/null on the same fd, so the fd number stays
    taken until whatever object holds it in this process closes it."""
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            if fd == null:
                continue
            try:
                s = socket.socket(fileno=fd)
            except OSError:  # not a socket (or already gone)
                continue
            try:
                drop = _unconnected_tcp(s)
            finally:
                s.detach()
            if drop:
                os.dup2(null, fd)
    finally:
        os.close(null)


def _unconnected_tcp(s: socket.socket) -> bool:
    if s.family not in (socket.AF_INET, socket.AF_INET6) or s.type != socket.SOCK_STREAM:
        return False
    try:
        s.getpeername()
    except OSError:  # ENOTCONN: a listener, or one to be
        return True
    return False
