"""A third engine kind registered from outside supervisor/kinds/ (tests/fake_kind.py,
through `$HOLDFAST_KINDS`): its section is validated at its path, and a real supervisor
starts engines of it, sees them ready through the kind's probes, takes their load from the
kind's own probe, and serves a request through the router."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.engines.harness import Supervisor, complete, env, write_policy

REGISTER = {"HOLDFAST_KINDS": "tests.fake_kind:KIND"}


def fake_policy(tmp_path: Path, model: Path, **fake: object) -> Path:
    return write_policy(
        tmp_path / "policy.yaml",
        model,
        tmp_path / "run",
        engines={"kind": "fake", "fake": fake, "command": ["{python}", "-m", "engine"]},
        heartbeat={"interval_ms": 100, "miss_limit": 10},
    )


def validate(policy: Path, extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor", "validate", "--schema-only", str(policy)],
        env={**env(), **extra},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_kind_and_its_section_are_checked_only_once_registered(tmp_path: Path) -> None:
    policy = fake_policy(tmp_path, tmp_path, greeting="ahoy", colour="red")
    unknown = validate(policy, {})
    assert unknown.returncode == 2
    assert "$.engines.kind: got 'fake', expected one of 'holdfast', 'vllm'" in unknown.stderr
    registered = validate(policy, REGISTER)
    assert registered.returncode == 2
    assert "$.engines.fake.colour: unknown key; allowed here: greeting, load" in registered.stderr
    assert "$.engines.kind" not in registered.stderr
    bad = validate(fake_policy(tmp_path, tmp_path, greeting="two words"), REGISTER)
    assert "$.engines.fake.greeting: must be a word" in bad.stderr
    assert validate(fake_policy(tmp_path, tmp_path, greeting="ahoy"), REGISTER).returncode == 0


def test_a_supervisor_runs_engines_of_a_registered_kind(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in REGISTER.items():
        monkeypatch.setenv(key, value)
    sup = Supervisor(fake_policy(tmp_path, tiny_model, greeting="ahoy", load=3))
    try:
        first = sup.wait_pair(timeout=120)
        log = (sup.run / "logs" / f"{first.name}.0.log").read_text()
        assert "fake engine" in log and "greeting=ahoy" in log  # the kind's command
        code, body = complete(sup.router, "hi", max_tokens=16)
        assert code == 200, body
        assert body["choices"][0]["text"] == "ahoy:hi"
        # the first was asked of the engine as a stream and collected (the kind's stream
        # shape); this one (echo is not collectable) is relayed as the engine answers it
        code, relayed = complete(sup.router, "yo", stream=False, echo=False)
        assert code == 200 and relayed["choices"][0]["text"] == "ahoy:yo", relayed
        deadline = time.monotonic() + 30  # the kind's own probe: the load the engine reports
        while True:
            engines = {e["name"]: e for e in sup.status()["engines"]}
            if engines[first.name]["in_flight"] == 3 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert engines[first.name]["in_flight"] == 3, engines
        assert sup.stop(signal.SIGTERM) == 0, sup.output()
    finally:
        if sup.proc.poll() is None:
            sup.stop(signal.SIGKILL)
