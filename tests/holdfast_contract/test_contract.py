"""The contract between supervisor, engines and the chaos suite: what imports what, the
environment reader's errors, the placeholders, and the fork server's frames."""

from __future__ import annotations

import ast
import os
import socket
import struct
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from engine.agent_client import AgentClient
from engine.config import from_args
from engine.errors import AgentError, EngineError
from holdfast_contract import forkserver
from holdfast_contract.command import PLACEHOLDERS, Placeholders, render, template_errors
from holdfast_contract.env import FIELDS, EngineEnv, read_env, to_environ, var
from holdfast_contract.errors import EnvError, ForkServerError
from supervisor.backoff import RestartBook
from supervisor.engines import EngineLauncher
from supervisor.errors import PolicyError
from supervisor.policy import Policy, RestartSpec
from supervisor.policy_file import parse_policy
from supervisor.units import Engine

REPO = Path(__file__).resolve().parents[2]


def run_fresh(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )


SUPERVISOR_IMPORTS = """
import importlib, pkgutil, sys
import supervisor
names = [m.name for m in pkgutil.walk_packages(supervisor.__path__, "supervisor.")]
for name in names:
    if name.endswith(".__main__"):  # runs the CLI; it imports supervisor.cli only
        continue
    importlib.import_module(name)
assert len(names) > 10, names
bad = sorted(m for m in sys.modules if m == "torch" or m.split(".")[0] in ("torch", "engine"))
print("\\n".join(bad))
"""


def test_no_supervisor_module_loads_torch_or_the_engine() -> None:
    cp = run_fresh(SUPERVISOR_IMPORTS)
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.strip() == "", f"supervisor modules loaded: {cp.stdout.split()}"


CONTRACT_IMPORTS = """
import importlib, pkgutil, sys
import msgspec, msgspec.json, msgspec.msgpack, msgspec.structs  # and what msgspec loads itself
before = set(sys.modules)
import holdfast_contract
names = [m.name for m in pkgutil.walk_packages(holdfast_contract.__path__, "holdfast_contract.")]
names.remove("holdfast_contract.logs")  # logging set-up: structlog too (tests/holdfast_contract/test_logs.py)
for name in names:
    importlib.import_module(name)
assert len(names) >= 6, names
allowed = set(sys.stdlib_module_names) | {"holdfast_contract"}
print("\\n".join(sorted(m for m in set(sys.modules) - before if m.split(".")[0] not in allowed)))
"""


def test_the_contract_loads_only_the_standard_library_and_msgspec() -> None:
    cp = run_fresh(CONTRACT_IMPORTS)
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.strip() == "", f"holdfast_contract loaded: {cp.stdout.split()}"


def test_the_contract_names_no_other_package_in_its_imports() -> None:
    allowed = set(sys.stdlib_module_names) | {"msgspec", "holdfast_contract", "__future__"}
    for path in sorted((REPO / "holdfast_contract").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                tops = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                tops = [(node.module or "").split(".")[0]]
            else:
                continue
            here = allowed | {"structlog"} if path.name == "logs.py" else allowed
            assert set(tops) <= here, f"{path.name}:{node.lineno} imports {tops}"


# the floors above the fleet: what composes a `supervisor run` (and its CLI)
ABOVE_THE_FLEET = {"supervisor/service.py", "supervisor/cli.py"}


def below_the_fleet() -> list[Path]:
    """The supervisor's modules outside `supervisor/fleet/`, its proxy's included."""
    fleet = REPO / "supervisor" / "fleet"
    return [p for p in sorted((REPO / "supervisor").rglob("*.py")) if fleet not in p.parents]


def test_no_module_below_the_fleet_imports_it() -> None:
    """`supervisor/fleet/` stands on the supervisor's core (policy, states, core, the
    proxy): a core module importing it would run back up a floor (the policy's `cluster:`
    section is `supervisor/fleet_spec.py` for that reason)."""
    paths = below_the_fleet()
    assert REPO / "supervisor" / "proxy" / "router.py" in paths
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            fleet = [
                n for n in names if n == "supervisor.fleet" or n.startswith("supervisor.fleet.")
            ]
            name = path.relative_to(REPO).as_posix()
            assert not fleet or name in ABOVE_THE_FLEET, f"{name}:{node.lineno} imports {fleet}"


def test_the_core_routes_without_loading_the_proxy() -> None:
    """`supervisor.core` points `PrimaryView` (supervisor/primary.py) at the primary; the
    HTTP proxy (supervisor/proxy/) reads it from above and the core never loads it."""
    cp = run_fresh(
        "import sys, supervisor.core\n"
        "print(sorted(m for m in sys.modules if m.startswith('supervisor.proxy')))"
    )
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.strip() == "[]", cp.stdout


# ---- the environment ----
def test_every_field_is_one_variable_and_round_trips() -> None:
    env = EngineEnv(
        name="e1",
        role="standby",
        port=9001,
        epoch=3,
        daemons=("/run/daemon-0.sock", "/run/daemon-1.sock"),
        rank=1,
        world_size=2,
        heartbeat_ms=20,
    )
    environ = to_environ(env)
    assert environ["HOLDFAST_PORT"] == "9001"
    assert environ["HOLDFAST_DAEMONS"] == "/run/daemon-0.sock,/run/daemon-1.sock"
    assert "HOLDFAST_MODEL" not in environ  # unset fields are not written
    assert read_env(environ) == env
    assert sorted(var(f) for f in FIELDS) == sorted({var(f) for f in FIELDS})
    with pytest.raises(KeyError, match="'heartbeat' is not a field of EngineEnv"):
        var("heartbeat")


def test_unset_and_empty_variables_read_as_none() -> None:
    assert read_env({}) == EngineEnv()
    assert read_env({"HOLDFAST_PORT": "", "HOLDFAST_NAME": ""}) == EngineEnv()
    assert read_env({"HOLDFAST_DAEMONS": "a.sock,,b.sock"}).daemons == ("a.sock", "b.sock")


@pytest.mark.parametrize(
    ("name", "raw", "message"),
    [
        ("HOLDFAST_PORT", "eighty", "HOLDFAST_PORT='eighty' is not a valid int"),
        (
            "HOLDFAST_PORT",
            "70000",
            "HOLDFAST_PORT='70000' is out of range; set HOLDFAST_PORT to 1..65535",
        ),
        ("HOLDFAST_HEARTBEAT_MS", "0", "set HOLDFAST_HEARTBEAT_MS to at least 1"),
        ("HOLDFAST_HEARTBEAT_MS", "2.5", "HOLDFAST_HEARTBEAT_MS='2.5' is not a valid int"),
        ("HOLDFAST_EPOCH", "-1", "set HOLDFAST_EPOCH to at least 0"),
        ("HOLDFAST_WORLD_SIZE", "0", "set HOLDFAST_WORLD_SIZE to at least 1"),
        ("HOLDFAST_KV_CACHE_MB", "lots", "HOLDFAST_KV_CACHE_MB='lots' is not a valid int"),
    ],
)
def test_a_bad_variable_is_named_in_the_error(name: str, raw: str, message: str) -> None:
    with pytest.raises(EnvError, match=message.replace(".", r"\.")):
        read_env({"HOLDFAST_NAME": "e1", name: raw})


def test_the_engine_and_its_agent_report_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    bad = {"HOLDFAST_MODEL": "/m", "HOLDFAST_DAEMONS": "/d.sock", "HOLDFAST_HEARTBEAT_MS": "x"}
    with pytest.raises(EngineError, match="HOLDFAST_HEARTBEAT_MS='x' is not a valid int"):
        from_args([], env=bad)
    for name, value in {**bad, "HOLDFAST_AGENT": "ipc:///nowhere", "HOLDFAST_NAME": "e1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("HOLDFAST_PORT", "9001")
    with pytest.raises(AgentError, match="HOLDFAST_HEARTBEAT_MS='x'"):
        AgentClient.from_env()
    monkeypatch.setenv("HOLDFAST_HEARTBEAT_MS", "25")
    monkeypatch.delenv("HOLDFAST_PORT")
    with pytest.raises(AgentError, match="HOLDFAST_PORT is not set"):
        AgentClient.from_env()


def launcher(tmp_path: Path, command: list[str]) -> tuple[EngineLauncher, Engine]:
    policy = msgspec.structs.replace(
        Policy(), heartbeat=msgspec.structs.replace(Policy().heartbeat, interval_ms=30)
    )
    sockets = [str(tmp_path / "daemon-0.sock")]
    launch = EngineLauncher(policy, tmp_path, "/models/m", sockets)
    engine = Engine("e2", "serving", "standby", RestartBook(RestartSpec()), command=command)
    engine.port = 9123
    return launch, engine


def test_what_the_supervisor_sets_the_engine_reads(tmp_path: Path) -> None:
    launch, engine = launcher(tmp_path, ["{python}", "-m", "engine"])
    env = launch.env(engine, rank=0, epoch=4)
    cfg = from_args([], env=env)
    assert (cfg.name, cfg.role, cfg.port, cfg.epoch) == ("e2", "standby", 9123, 4)
    assert (cfg.model, cfg.daemons, cfg.heartbeat_ms) == ("/models/m", launch.source.daemons, 30)
    assert cfg.agent == f"ipc://{tmp_path / 'agents'}"


# ---- command placeholders ----
def test_the_launcher_fills_in_every_placeholder(tmp_path: Path) -> None:
    launch, engine = launcher(tmp_path, [f"--{key}={{{key}}}" for key in sorted(PLACEHOLDERS)])
    argv = launch.argv(engine, launch.env(engine, rank=0, epoch=4))
    filled = dict(arg[2:].split("=", 1) for arg in argv)
    assert set(filled) == PLACEHOLDERS
    assert (filled["python"], filled["port"], filled["epoch"]) == (sys.executable, "9123", "4")
    assert filled["daemons"] == str(tmp_path / "daemon-0.sock")


def test_policy_validation_knows_the_same_placeholders(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")  # validate looks for one
    known = " ".join(f"'{{{key}}}'" for key in sorted(PLACEHOLDERS))
    policy = f"model: {{path: {model}}}\nengines: {{command: [{known.replace(' ', ', ')}]}}\n"
    parse_policy(policy, tmp_path / "p.yaml")
    with pytest.raises(
        PolicyError, match=r"\$\.engines\.command\[2\]: unknown placeholder \{gpu\}"
    ):
        parse_policy(policy.replace("{device}", "{gpu}"), tmp_path / "p.yaml")


def test_template_errors_and_render() -> None:
    assert template_errors("$.c", ["{python}", "-m", "engine", "--port", "{port}"]) == []
    assert template_errors("$.c", ["{nope}"])[0].startswith("$.c[0]: unknown placeholder {nope}")
    assert template_errors("$.c", ["{port"])[0].startswith("$.c[0]: bad template '{port'")
    values = Placeholders(*(f"<{k}>" for k in Placeholders.__struct_fields__))
    assert render(["x{name}", "{rank}/{world_size}"], values) == ["x<name>", "<rank>/<world_size>"]


# ---- fork server frames ----
def test_fork_server_replies_over_a_socketpair() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(
            forkserver.frame(forkserver.Started(41)) + forkserver.frame(forkserver.Exited(-9))
        )
        assert forkserver.read_reply(b) == forkserver.Started(41)
        assert forkserver.read_reply(b) == forkserver.Exited(-9)
        whole = forkserver.frame(forkserver.Refused("no"))
        a.sendall(whole[:-1])
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(ForkServerError, match="closed mid-reply"):
            forkserver.read_reply(b)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack(">I", forkserver.MAX_FRAME + 1))
        with pytest.raises(ForkServerError, match=f"a reply of {forkserver.MAX_FRAME + 1} bytes"):
            forkserver.read_reply(b)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack(">I", 3) + b"\xff\xff\xff")
        with pytest.raises(ForkServerError, match="fork server connection"):
            forkserver.read_reply(b)
        a.close()
        with pytest.raises(ForkServerError, match="closed before a reply"):
            forkserver.read_reply(b)


def test_a_spawn_request_decodes_on_the_server_side() -> None:
    spawn = forkserver.Spawn(argv=["--port", "1"], env={"A": "b"}, cwd="/", owner=7)
    body = forkserver.frame(spawn)[4:]
    assert forkserver.decode_spawn(body) == spawn
    with pytest.raises(msgspec.DecodeError):
        forkserver.decode_spawn(forkserver.frame(forkserver.Started(1))[4:])
