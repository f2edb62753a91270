"""Attached tensors are read-only views of the pool: a write into one ends the process with a
message naming the tensor and the way to a private copy, never a bare SIGSEGV; and
`attach_model(..., copy=...)` gives private copies that can be changed."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import child_env

from cachedaemon.client import attach_model
from cachedaemon.errors import CacheError

NAME = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def sock(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, module_daemons: Any) -> Path:
    run = tmp_path_factory.mktemp("ro") / "run"
    module_daemons(tiny_model, run)
    return run / "daemon-0.sock"


def child(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("faulthandler", [False, True])
def test_a_write_into_an_attached_tensor_says_what_happened(sock: Path, faulthandler: bool) -> None:
    code = (
        ("import faulthandler; faulthandler.enable()\n" if faulthandler else "")
        + "from cachedaemon import attach_state_dict\n"
        + f"state = attach_state_dict({str(sock)!r})\n"
        + "print('attached', flush=True)\n"
        + f"state[{NAME!r}].add_(1)\n"
        + "print('wrote', flush=True)\n"
    )
    done = child(code)
    assert done.returncode == -signal.SIGSEGV, (done.returncode, done.stderr[-2000:])
    assert done.stdout.splitlines() == ["attached"]
    assert "a write into the read-only weight pool" in done.stderr
    assert f"tensor {NAME!r}" in done.stderr
    assert "attach_model(model, socket, copy=True)" in done.stderr
    if faulthandler:  # the previous handler still runs after ours: the traceback follows
        assert "Fatal Python error: Segmentation fault" in done.stderr


def test_copy_gives_private_tensors_and_leaves_the_pool_alone(sock: Path) -> None:
    code = f"""
import torch
from cachedaemon.client import attach_model, attach_state_dict
state = attach_state_dict({str(sock)!r})
before = {{k: v.clone() for k, v in state.items()}}

class Whole(torch.nn.Module):
    pass

def empty():
    m = Whole()
    for k, v in state.items():
        owner = m
        *path, leaf = k.split(".")
        for p in path:
            if not hasattr(owner, p):
                owner.add_module(p, torch.nn.Module())
            owner = getattr(owner, p)
        owner.register_parameter(leaf, torch.nn.Parameter(
            torch.empty(v.shape, dtype=v.dtype, device="meta"), requires_grad=False))
    return m

mine = empty()
attach_model(mine, {str(sock)!r}, copy=True)
with torch.no_grad():
    for p in mine.parameters():
        p.add_(1)
some = empty()
attach_model(some, {str(sock)!r}, copy=[{NAME!r}])
with torch.no_grad():
    some.get_parameter({NAME!r}).mul_(0)
again = attach_state_dict({str(sock)!r})
assert all(torch.equal(again[k], before[k]) for k in before), "the pool changed"
assert not torch.equal(mine.get_parameter({NAME!r}), before[{NAME!r}])
assert int(some.get_parameter({NAME!r}).count_nonzero()) == 0
from cachedaemon.readonly import name_at
other = "model.norm.weight"
assert name_at(some.get_parameter(other).data_ptr()) == other, "not named: still the pool's"
assert name_at(some.get_parameter({NAME!r}).data_ptr()) is None, "named: a private copy"
print("private copies ok")
"""
    done = child(code)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "private copies ok" in done.stdout


def test_copy_of_a_name_the_pool_lacks_is_a_clear_error(sock: Path) -> None:
    module = torch.nn.Module()
    with pytest.raises(CacheError, match=r"copy=.*\['model.nope'\].*does not hold"):
        attach_model(module, sock, copy=["model.nope"])
