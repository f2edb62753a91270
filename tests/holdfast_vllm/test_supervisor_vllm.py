"""vLLM as a supervised engine kind (`engines.kind: vllm`): a real supervisor running real
vLLM API servers from the venv of scripts/install-vllm.sh, attached to the pool's daemon
through the holdfast_vllm plugin; and the bad input around it.

The tests marked `vllm` are skipped when that venv is absent. The others (the policy's
expansion, the /metrics load mapping, `supervisor validate` without vLLM) run anywhere.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from holdfast_contract.wire import free_port
from supervisor.kinds import kind_of
from supervisor.kinds.vllm import MODULE
from supervisor.kinds.vllm_metrics import Sample, load_of, parse_metrics
from supervisor.kinds.vllm_spec import VllmSpec, python_of
from supervisor.policy_file import load_policy
from tests.engines.harness import Load, Supervisor, complete, env, get, pid_alive, write_policy

REPO = Path(__file__).resolve().parents[2]

VLLM_PYTHON = python_of(VllmSpec())
HAS_VLLM = Path(VLLM_PYTHON).is_file()
needs_vllm = pytest.mark.skipif(
    not HAS_VLLM,
    reason=f"vLLM is not installed ({VLLM_PYTHON} is absent): run bash scripts/install-vllm.sh",
)
START_S = 900.0  # four vLLM imports on a shared 2-core machine; the deadline is only a bound


def vllm_policy(tmp_path: Path, checkpoint: Path, **engines: Any) -> Path:
    policy = {
        "model": {"path": str(checkpoint), "dtype": "float32"},
        "cache": {"runtime_dir": str(tmp_path / "run"), "ready_timeout_s": START_S},
        "engines": {"kind": "vllm", "ready_timeout_s": START_S, "stop_grace_s": 2.0, **engines},
        "heartbeat": {"interval_ms": 100, "miss_limit": 10},
        "router": {"listen": f"127.0.0.1:{free_port()}"},
        "api": {"listen": f"127.0.0.1:{free_port()}"},
    }
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(policy))
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.vllm_checkpoints import causal_lm_checkpoint

    return causal_lm_checkpoint(tmp_path_factory.mktemp("vllm") / "llama", "llama")


def validate(policy: Path, **extra_env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor", "validate", str(policy)],
        env={**env(), **extra_env},
        capture_output=True,
        text=True,
        timeout=120,
    )


# ---- the policy, anywhere ----
def test_kind_vllm_expands_to_the_api_server_with_the_plugin(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    policy = load_policy(vllm_policy(tmp_path, tmp_path / "m", standby=1), schema_only=True)
    cmd = policy.engines.command
    assert cmd[1:3] == ["-m", MODULE] and cmd[0] == VLLM_PYTHON
    assert cmd[cmd.index("--port") + 1] == "{port}" and cmd[cmd.index("--model") + 1] == "{model}"
    assert cmd[cmd.index("--load-format") + 1] == "holdfast"
    config = cmd[cmd.index("--model-loader-extra-config") + 1]
    assert config == '{{"fallback": true, "mode": "zero_copy", "layout": "vllm"}}'  # plain JSON
    # its daemons build the pool in vLLM's layout, with the python that has vLLM
    assert kind_of(policy).daemon_runtime(policy) == (VLLM_PYTHON, "vllm")
    reference = vllm_policy(tmp_path, tmp_path / "m", vllm={"layout": "reference"})
    reference_policy = load_policy(reference, schema_only=True)
    assert kind_of(reference_policy).daemon_runtime(reference_policy)[1] == "reference"
    assert policy.engines.health == "http"
    assert policy.engines.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    # forked from the vLLM fork server, which serves exactly this command's head, and the
    # EngineCore forked in turn
    forks = kind_of(policy).forks(policy)
    assert forks is not None and forks.server[:3] == [VLLM_PYTHON, "-m", "holdfast_vllm.forkserver"]
    assert forks.server[3:] == ["--warm-model", policy.model.path]  # its tokenizer, loaded once
    assert forks.serves == cmd[:3]
    assert policy.engines.env["HOLDFAST_VLLM_FORK"] == "1"


def test_kind_vllm_forks_nothing_when_the_policy_says_so(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    path = vllm_policy(tmp_path, tmp_path / "m", forkserver=False, vllm={"fork_engine_core": False})
    policy = load_policy(path, schema_only=True)
    assert kind_of(policy).forks(policy) is None
    assert "HOLDFAST_VLLM_FORK" not in policy.engines.env


def test_kind_vllm_on_a_cuda_device_forks_each_engine_warmed_with_the_models_tokenizer(
    tmp_path: Path,
) -> None:
    gpu = load_policy(REPO / "policies" / "vllm-gpu.yaml", schema_only=True)
    assert gpu.devices.ids == ["cuda:0"] and gpu.engines.forkserver is None
    forks = kind_of(gpu).forks(gpu)
    assert forks is not None
    assert forks.server[1:] == ["-m", "holdfast_vllm.forkserver", "--warm-model", gpu.model.path]
    raw = yaml.safe_load((REPO / "policies" / "vllm-gpu.yaml").read_text())
    raw["engines"]["forkserver"] = False
    (tmp_path / "execd.yaml").write_text(yaml.safe_dump(raw))
    execd = load_policy(tmp_path / "execd.yaml", schema_only=True)
    assert kind_of(execd).forks(execd) is None


def test_kind_vllm_with_a_command_of_its_own_is_refused(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    path = write_policy(
        tmp_path / "p.yaml",
        tmp_path / "m",
        tmp_path / "run",
        engines={"kind": "vllm", "command": ["vllm", "serve", "{model}"]},
    )
    cp = subprocess.run(
        [sys.executable, "-m", "supervisor", "validate", "--schema-only", str(path)],
        env=env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cp.returncode == 2
    assert "$.engines.command: engines.kind vllm builds the command" in cp.stderr
    assert "engines.vllm.args" in cp.stderr


def test_kind_vllm_where_vllm_is_not_installed_says_how_to_install(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"")
    cp = validate(vllm_policy(tmp_path, tmp_path / "m"), HOLDFAST_VLLM_VENV=str(tmp_path / "nv"))
    assert cp.returncode == 2, cp.stdout + cp.stderr
    assert "$.engines.kind: vllm, but vLLM is not installed here" in cp.stderr
    assert f"{tmp_path / 'nv' / 'bin' / 'python'} does not exist" in cp.stderr
    assert "bash scripts/install-vllm.sh" in cp.stderr


def test_a_python_without_vllm_is_named(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"")
    policy = vllm_policy(tmp_path, tmp_path / "m")
    text = policy.read_text().replace(
        "kind: vllm", f"kind: vllm\n  vllm: {{python: {sys.executable}}}"
    )
    policy.write_text(text)
    cp = validate(policy)
    assert cp.returncode == 2, cp.stdout + cp.stderr
    assert f"{sys.executable} cannot import vllm" in cp.stderr
    assert "bash scripts/install-vllm.sh" in cp.stderr


METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 9.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
"""


def test_metrics_map_to_the_load_the_batch_rules_read() -> None:
    sample = parse_metrics(METRICS)
    assert sample == Sample(running=3.0, waiting=2.0, kv_usage=0.25)
    assert load_of(sample, VllmSpec(), evict_above=8) == (5, 2)
    full = Sample(running=1.0, waiting=0.0, kv_usage=0.97)  # a full KV cache: over the rule
    assert load_of(full, VllmSpec(), evict_above=8) == (9, 0)
    assert load_of(full, VllmSpec(kv_evict_above=0.99), evict_above=8) == (1, 0)


# ---- real vLLM ----
@pytest.mark.vllm
@needs_vllm
def test_router_serves_and_killing_the_primary_promotes_the_standby(
    tmp_path: Path, checkpoint: Path
) -> None:
    sup = Supervisor(vllm_policy(tmp_path, checkpoint, standby=1))
    try:
        first = sup.wait_pair(timeout=START_S)
        code, body = complete(sup.router, prompt="Hello", max_tokens=4, timeout=60)
        assert code == 200, body
        assert body["engine"] == first.name and body["usage"]["completion_tokens"] == 4
        status, primary = get(f"{sup.api}/primary")
        assert status == 200
        # each engine a fork of the vLLM fork server, its EngineCore a fork of it in turn
        server = _forkserver_pid(tmp_path / "run")
        assert _ppid(primary["pid"]) == server
        log = (tmp_path / "run" / "logs" / f"{first.name}.0.log").read_text()
        assert '"engine_core": "forked", "event": "weights attached"' in log
        # every weight a view of the pool the daemon built in vLLM's layout
        assert '"layout": "vllm"' in log and '"private_bytes": 0,' in log, log[-3000:]
        daemon_log = (tmp_path / "run" / "logs" / "daemon-0.log").read_text()
        assert '"event": "vllm layout built"' in daemon_log
        (core,) = _children(primary["pid"])  # holds none of the API server's listeners
        http = _listening_inodes(primary["pid"])
        assert http and not http & _listening_inodes(core)
        load = Load(sup.router, clients=2, prompt="Hello", max_tokens=2, timeout=60)
        try:
            load.wait_ok(4, timeout=120)
            second = sup.kill_primary(first)
            load.wait_ok(4, timeout=120)
        finally:
            load.stop()
        assert second.data["promote_ms"] < 1000
        assert load.failures == [], load.failures[:3]
        assert second.name in load.engines
        died = sup.wait(lambda e: e.event == "died" and e.name == first.name, timeout=10)
        assert died.data["role"] == "primary"
        assert not pid_alive(primary["pid"])
        assert _group_gone(primary["pid"], timeout=30) == []  # its EngineCore went with it
    finally:
        assert sup.stop() == 0, sup.output()


@pytest.mark.vllm
@needs_vllm
def test_vllm_dying_during_startup_is_reported_and_the_supervisor_stays_up(
    tmp_path: Path, checkpoint: Path
) -> None:
    policy = vllm_policy(tmp_path, checkpoint, standby=0, vllm={"args": ["--no-such-flag"]})
    text = policy.read_text() + "restart:\n  max_restarts: 0\n"
    policy.write_text(text)
    sup = Supervisor(policy)
    try:
        gone = sup.wait(lambda e: e.event == "quarantined", timeout=START_S)
        assert gone.name == "e1"
        assert "during start-up, before it was ready" in gone.data["detail"]
        assert "--no-such-flag" in gone.data["tail"]  # vLLM's own last lines
        assert get(f"{sup.api}/health")[0] == 200  # the supervisor is up
        assert sup.proc.poll() is None
        assert sup.status()["engines"][0]["state"] == "quarantined"
    finally:
        assert sup.stop() == 0, sup.output()
    assert _group_gone(gone.data["pid"], timeout=30) == []


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()]


def _listening_inodes(pid: int) -> set[int]:
    """The inodes of the listening TCP sockets process `pid` holds."""
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A":  # TCP_LISTEN
                listening.add(int(cols[9]))
    held = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            held.add(int(target[8:-1]))
    return held & listening


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


def _forkserver_pid(run: Path) -> int:
    """The pid of the vLLM fork server serving `run`'s socket."""
    sock = str(run / "vllm-forkserver.sock")
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                argv = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"holdfast_vllm.forkserver" in argv and sock.encode() in argv:
                return int(d.name)
    raise AssertionError(f"no vLLM fork server serves {sock}")


def _group_left(pgid: int) -> list[int]:
    """Processes still in process group `pgid` (vLLM's EngineCore is in its server's)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            if int(stat[2]) == pgid and stat[0] != "Z":
                out.append(int(d.name))
    return out


def _group_gone(pgid: int, timeout: float) -> list[int]:
    """Waits (on pidfds, up to `timeout`) for every process of group `pgid` to exit; the
    ones still there."""
    deadline = time.monotonic() + timeout
    for pid in _group_left(pgid):
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        finally:
            os.close(fd)
    return _group_left(pgid)
