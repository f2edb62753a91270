"""The policy schema: every error with its path, unknown keys refused, shipped policies valid."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.errors import PolicyError
from supervisor.policy import Policy
from supervisor.policy_file import load_policy, parse_policy
from tests.engines.harness import REPO, env


def supervisor_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor", *args],
        env=env(),
        capture_output=True,
        text=True,
        timeout=30,
    )


def errors_of(text: str, tmp_path: Path) -> list[str]:
    with pytest.raises(PolicyError) as info:
        parse_policy(text, tmp_path / "policy.yaml")
    return info.value.errors


def test_every_error_is_reported_with_its_path(tmp_path: Path) -> None:
    errors = errors_of(
        "engines: {standby: two, bogus: 1, batch: [{count: x}]}\n"
        "model: {dtype: int3}\nheartbeat: {interval_ms: 1.5}\nrouter: {listen: 80}\n",
        tmp_path,
    )
    assert "$.engines.standby: expected int, got str" in errors
    assert any(e.startswith("$.engines.bogus: unknown key") for e in errors)
    assert "$.engines.batch[0].count: expected int, got str" in errors
    assert any(e.startswith("$.model.dtype: got 'int3', expected one of") for e in errors)
    assert "$.heartbeat.interval_ms: expected int, got float" in errors
    assert "$.router.listen: expected str, got int" in errors
    assert len(errors) == 6


def test_cross_field_rules_name_the_key(tmp_path: Path) -> None:
    errors = errors_of(
        "model: {path: /nonexistent/model}\nengines: {primary: 2, command: ['{pyhton}']}\n"
        "devices: {ids: [cpu, cpu]}\nrouter: {listen: 'localhost'}\n",
        tmp_path,
    )
    text = "\n".join(errors)
    assert "$.model.path: /nonexistent/model does not exist" in text
    assert "$.engines.primary: got 2, must be 1" in text
    assert "$.engines.command[0]: unknown placeholder {pyhton}" in text
    assert "$.devices.ids: 2 devices for tp_size 1" in text
    assert "$.router.listen: 'localhost' is not HOST:PORT" in text


def test_top_level_garbage(tmp_path: Path) -> None:
    assert errors_of("- a\n- b\n", tmp_path) == ["$: expected a mapping at the top, got list"]
    assert errors_of("model: [unclosed\n", tmp_path)[0].startswith("$: not valid YAML")


def test_defaults_live_in_the_schema(tmp_path: Path) -> None:
    p = parse_policy("model: {preset: tiny}\n", tmp_path / "p.yaml")
    assert p.heartbeat.interval_ms == 50 and p.heartbeat.miss_limit == 4
    assert p.engines.primary == 1 and p.engines.standby == 1
    assert p.events.mqtt is None
    assert p.cache.runtime_dir == "/tmp/holdfast-demo"


def test_relative_model_path_is_resolved_against_the_policy(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"")
    p = parse_policy("model: {path: m}\n", tmp_path / "p.yaml")
    assert p.model.path == str(tmp_path / "m")


SHIPPED = sorted(
    [*(REPO / "policies").glob("*.yaml"), *(REPO / "chaos" / "scenarios").glob("policy-*.yaml")]
)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_policies_are_valid(path: Path) -> None:
    # Real deployments name real checkpoints: check everything but whether they exist here.
    policy = load_policy(path, schema_only=True)
    assert isinstance(policy, Policy)
    assert len(policy.devices.ids) == policy.model.tp_size


def test_schema_only_validate_passes_every_shipped_policy_and_still_finds_errors(
    tmp_path: Path,
) -> None:
    cp = supervisor_cli("validate", "--schema-only", *map(str, SHIPPED))
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.count(": ok, schema only") == len(SHIPPED) >= 7
    elsewhere = tmp_path / "elsewhere.yaml"
    elsewhere.write_text("model: {path: /no/such/model}\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {preset: tiny}\nengines: {standby: x}\n")
    cp = supervisor_cli("validate", "--schema-only", str(bad), str(elsewhere))
    assert cp.returncode == 2
    assert cp.stderr.splitlines() == [
        f"{bad}: invalid policy",
        "  $.engines.standby: expected int, got str",
    ]
    assert f"{elsewhere}: ok, schema only" in cp.stdout
    full = supervisor_cli("validate", str(elsewhere))
    assert full.returncode == 2
    assert "$.model.path: /no/such/model does not exist" in full.stderr


def test_a_source_key_is_accepted_and_the_file_name_wins(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("source: written-by-a-tool.yaml\nmodel: {preset: tiny}\n")
    assert load_policy(path).source == str(path)
    unknown = errors_of("model: {preset: tiny}\nbogus: 1\n", tmp_path)
    assert len(unknown) == 1 and "source" in unknown[0]  # listed as allowed, and it is


def test_validate_cli_prints_every_error_and_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("engines: {standby: x}\nextra: 1\n")
    cp = supervisor_cli("validate", str(bad))
    assert cp.returncode == 2
    assert "$.engines.standby: expected int, got str" in cp.stderr
    assert "$.extra: unknown key" in cp.stderr
    ok = supervisor_cli("validate")
    assert ok.returncode == 0, ok.stderr
    assert "demo.yaml: ok" in ok.stdout


def test_help_has_examples_and_no_torch() -> None:
    cp = supervisor_cli("--help")
    assert cp.returncode == 0 and "supervisor run policies/h200.yaml" in cp.stdout
    code = (
        "import supervisor.cli, supervisor.agent_hub, supervisor.service; import sys; "
        "assert 'torch' not in sys.modules, 'supervisor imported torch'"
    )
    subprocess.run([sys.executable, "-c", code], env=env(), check=True, timeout=30)
    assert os.path.exists(REPO / "supervisor" / "__main__.py")


def test_kv_adopt_is_refused_where_the_kv_cache_cannot_be_shared(tmp_path: Path) -> None:
    errors = errors_of(
        "engines: {kv_adopt: true, spares: ready}\ndevices: {ids: ['xpu:0']}\n"
        "cache: {keeper: false}\n",
        tmp_path,
    )
    [kv] = [e for e in errors if e.startswith("$.engines.kv_adopt")]
    for why in ("['xpu:0'] are not all cpu or cuda", "cache.keeper is false", "spares is ready"):
        assert why in kv
    assert kv.endswith("set it false")
    for devices in ("['cpu']", "['cuda:0']"):
        policy = f"engines: {{kv_adopt: true}}\nmodel: {{path: /x}}\ndevices: {{ids: {devices}}}\n"
        assert not [e for e in errors_of(policy, tmp_path) if "kv_adopt" in e]
