"""`engines.spares: ready` under the supervisor: the engine fork server keeps a spare that
has built the whole engine, so an engine the supervisor restarts after a kill is handed
over built (no attach, no warm-up) and serves; the policy's checks name the key when
spares cannot be made."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import msgspec
import pytest

from supervisor.errors import PolicyError
from supervisor.policy import Policy, admission_cap_mb
from supervisor.policy_file import parse_policy
from tests.engines.harness import complete
from tests.supervisor.update.test_update_rollout import ENGINE, boot


def ready_lines(log: Path) -> list[dict]:
    """The "ready" lines of an engine's log (rank 0's: every incarnation appends)."""
    lines = [json.loads(x) for x in log.read_text().splitlines() if '"ready"' in x]
    return [x for x in lines if x.get("event") == "ready"]


def next_ready(log: Path, before: int, timeout: float = 30) -> dict:
    """The ready line after the `before` there were: the engine says it is ready (the
    supervisor may see it) just before it logs so."""
    deadline = time.monotonic() + timeout
    while len(lines := ready_lines(log)) <= before:
        assert time.monotonic() < deadline, f"no new ready line in {log}"
        time.sleep(0.05)
    return lines[before]


def until_spare_built(forkserver_log: Path, timeout: float = 120) -> int:
    """Until the spare the fork server forked last has built its engine; its pid."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [
            json.loads(x) for x in forkserver_log.read_text().splitlines() if x.startswith("{")
        ]
        forked = [x["pid"] for x in lines if x.get("event") == "spare forked"]
        warm = {x["pid"] for x in lines if x.get("event") == "spare warm"}
        if forked and forked[-1] in warm:
            return forked[-1]
        assert time.monotonic() < deadline, "no spare built"
        time.sleep(0.05)


def test_an_engine_restarted_after_a_kill_is_handed_a_ready_spare(
    tmp_path: Path, tiny_model: Path
) -> None:
    engines = {"command": ENGINE, "ready_timeout_s": 120, "stop_grace_s": 5.0, "spares": "ready"}
    sup = boot(tmp_path, tiny_model, engines=engines)
    try:
        first = sup.wait_pair()
        code, body = complete(sup.router, None, prompt_token_ids=[1, 2, 3], max_tokens=4)
        assert code == 200, body
        want = body["choices"][0]["token_ids"]
        spare = until_spare_built(sup.run / "logs" / "forkserver.log")
        log = sup.run / "logs" / f"{first.name}.0.log"
        before = len(ready_lines(log))
        mark = sup.tap.mark()
        second = sup.kill_primary(first)
        # the killed engine comes back as a standby, from the spare the last fork left
        sup.wait(lambda e: e.event == "ready" and e.name == first.name, timeout=120, after=mark)
        again = next_ready(log, before)
        assert again["role"] == "standby", again
        pids = {e["name"]: e["pid"] for e in sup.status()["engines"]}
        assert pids[first.name] == spare, (pids, spare)  # the spare's process serves
        phases = again["phases"]
        assert phases["spare"] > 0, phases
        assert phases["attach"] == phases["warmup"] == phases["build"] == 0, phases
        assert "spare's build not used" not in log.read_text()
        # and it serves once promoted in turn, the same tokens as before
        sup.kill_primary(second)
        assert sup.status()["primary"] == first.name
        code, body = complete(sup.router, None, prompt_token_ids=[1, 2, 3], max_tokens=4)
        assert code == 200 and body["engine"] == first.name, body
        assert body["choices"][0]["token_ids"] == want
    finally:
        if sup.proc.poll() is None:
            sup.stop(signal.SIGKILL)


@pytest.mark.parametrize(
    "engines, want",
    [
        (
            "{spares: ready, forkserver: false}",
            "$.engines.spares: ready needs the engine fork server",
        ),
        (
            "{spares: on, command: [/bin/engine]}",
            "$.engines.spares: on needs the engine fork server",
        ),
        ("{kind: vllm, spares: ready}", "$.engines.spares: ready is the reference engine's"),
        (
            "{spares: later}",
            "$.engines.spares: got 'later', expected one of 'auto', 'on', 'ready', 'off'",
        ),
    ],
)
def test_spares_the_fork_server_cannot_make_are_refused_naming_the_key(
    tmp_path: Path, engines: str, want: str
) -> None:
    text = f"model: {{preset: tiny}}\nengines: {engines}\n"
    with pytest.raises(PolicyError) as refused:
        parse_policy(text, tmp_path / "policy.yaml", schema_only=True)
    assert any(e.startswith(want) for e in refused.value.errors), refused.value.errors


def test_a_ready_spare_keeps_one_engine_budget_free_for_admission() -> None:
    p = msgspec.convert(
        {
            "model": {"preset": "tiny"},
            "devices": {"memory_mb": 10000},
            "engines": {
                "memory_mb": 2000,
                "spares": "ready",
                "batch": [{"name": "b", "memory_mb": 3000}],
            },
        },
        Policy,
    )
    assert admission_cap_mb(p) == 7000
    auto = msgspec.convert({"model": {"preset": "tiny"}, "devices": {"memory_mb": 10000}}, Policy)
    assert admission_cap_mb(auto) == 10000
