"""Whether an update's second pool fits beside the one that serves, said before anything
changes (supervisor/update/memory.py): `supervisor validate` reports it per device with the
numbers; `supervisor update` is refused with them when it does not fit, goes ahead when it
does, and with `update.free_standby_kv` stops the old standbys before the new pool is built.

The device's room is the policy's `devices.capacity_mb`, so the verdicts do not depend on
this machine's memory; pools are the tiny checkpoint's real ones (float32, sized from their
headers as the daemons lay them out); engines are echo engines of declared `memory_mb`."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from cachedaemon.config import LoadOptions
from cachedaemon.pool_plan import pool_bytes
from tests.engines.harness import Supervisor, env, topic, write_policy

MB = 1 << 20
SERVING_MB = 20  # engines.memory_mb: the primary and each standby
BATCH_MB = 30


def pool_mb(model: Path) -> str:
    """The tiny pool as the report writes it (float32 on the memfd backend)."""
    return f"{pool_bytes(model, LoadOptions('float32'), 'memfd') / MB:.1f} MB"


def policy(base: Path, model: Path, capacity_mb: int, **sections: Any) -> Path:
    engines = {"memory_mb": SERVING_MB, "standby": 1, **sections.pop("engines", {})}
    return write_policy(
        base / "policy.yaml",
        model,
        base / "run",
        devices={"ids": ["cpu"], "capacity_mb": capacity_mb},
        engines=engines,
        **sections,
    )


def validate(path: Path) -> str:
    cp = subprocess.run(
        [sys.executable, "-m", "supervisor", "validate", str(path)],
        env=env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cp.returncode == 0, cp.stderr
    return cp.stdout


def test_validate_says_whether_the_policy_can_be_updated_in_place(
    tmp_path: Path, tiny_model: Path
) -> None:
    pool = pool_mb(tiny_model)
    # 2 pools + the primary and a standby (40 MB) + the new version's two (40 MB) = 80.8 MB
    sums = f"pools {pool} serving + {pool} new, engines 40.0 MB now + 40.0 MB new"
    (tmp_path / "a").mkdir()
    roomy = validate(policy(tmp_path / "a", tiny_model, 100))
    assert "update memory: two pools fit\n" in roomy
    assert f"cpu (rank 0): fits: {sums} = 80.8 MB of 100.0 MB (devices.capacity_mb)" in roomy

    (tmp_path / "b").mkdir()
    tight = validate(policy(tmp_path / "b", tiny_model, 70))
    assert "two pools do not fit: `supervisor update` is refused" in tight
    assert "set update.free_standby_kv: true" in tight
    assert f"cpu (rank 0): does not fit: {sums} = 80.8 MB of 70.0 MB" in tight

    (tmp_path / "c").mkdir()
    freed = validate(policy(tmp_path / "c", tiny_model, 70, update={"free_standby_kv": True}))
    assert "two pools fit once the old standbys stop (update.free_standby_kv)" in freed
    assert f"fits: {sums} - 20.0 MB of the old standbys = 60.8 MB of 70.0 MB" in freed

    (tmp_path / "d").mkdir()
    unknown = validate(policy(tmp_path / "d", tiny_model, 70, engines={"memory_mb": 0}, update={}))
    assert "memory not known, counted as 0: the serving engines" in unknown


def test_an_update_that_does_not_fit_is_refused_with_the_numbers_until_a_batch_engine_goes(
    tmp_path: Path, tiny_model: Path, next_model: Path
) -> None:
    """Engines 20 + 20 + a batch engine's 30 MB, the new version's 40 MB and two pools of
    0.4 MB do not fit 100 MB; once the batch engine is evicted by hand they do."""
    batch = [{"name": "batch", "count": 1, "memory_mb": BATCH_MB}]
    sup = Supervisor(
        policy(tmp_path, tiny_model, 100, engines={"batch": batch}, update={"keep_old_s": 0})
    )
    try:
        sup.wait_pair()
        sup.wait(topic("engine.batch-1.ready"), timeout=120)
        before = sup.status()
        cp = sup.cli("update", "--model", str(next_model), check=False)
        assert cp.returncode == 1, cp.stdout
        pool = pool_mb(tiny_model)
        assert (
            "the new version's pool does not fit beside the pool that serves: cpu (rank 0): "
            f"does not fit: pools {pool} serving + {pool} new, engines 70.0 MB now + 40.0 MB "
            "new = 110.8 MB of 100.0 MB (devices.capacity_mb)"
        ) in cp.stderr
        assert "set update.free_standby_kv: true" in cp.stderr
        after = sup.status()
        assert after["update"] is None and after["epoch"] == before["epoch"]
        assert [e["name"] for e in after["engines"]] == [e["name"] for e in before["engines"]]
        assert not (sup.run / "gen-2").exists()

        mark = sup.tap.mark()
        sup.cli("evict", "batch-1")
        sup.wait(topic("engine.batch-1.evicted"), timeout=60, after=mark)
        said = sup.cli("update", "--model", str(next_model)).stdout
        assert (
            "memory: two pools fit: cpu (rank 0): fits: "
            f"pools {pool} serving + {pool} new, engines 40.0 MB now + 40.0 MB new = 80.8 MB"
        ) in said
        switched = sup.wait(topic("update.main.switched"), timeout=300, after=mark)
        sup.wait(topic("update.main.finished"), timeout=300, after=mark)
        old_standby = next(e["name"] for e in before["engines"] if e["role"] == "standby")
        retired = sup.wait(topic(f"engine.{old_standby}.retired"), timeout=60, after=mark)
        assert sup.tap.events.index(retired) > sup.tap.events.index(switched)  # kept till then
        assert sup.stop(signal.SIGTERM) == 0, sup.output()
    finally:
        if sup.proc.poll() is None:
            sup.stop(signal.SIGKILL)


def test_free_standby_kv_stops_the_old_standbys_before_the_new_pool_is_built(
    tmp_path: Path, tiny_model: Path, next_model: Path
) -> None:
    """80.8 MB do not fit 70 MB; without the old standby's 20 MB they do."""
    sup = Supervisor(
        policy(tmp_path, tiny_model, 70, update={"free_standby_kv": True, "keep_old_s": 0})
    )
    try:
        sup.wait_pair()
        before = sup.status()
        v1 = before["version"]
        old_standby = next(e["name"] for e in before["engines"] if e["role"] == "standby")
        mark = sup.tap.mark()
        said = sup.cli("update", "--model", str(next_model)).stdout
        assert "memory: two pools fit once the old standbys stop (update.free_standby_kv)" in said
        assert "- 20.0 MB of the old standbys = 60.8 MB of 70.0 MB" in said
        retired = sup.wait(topic(f"engine.{old_standby}.retired"), timeout=60, after=mark)
        assert retired.data["version"] == v1
        built = sup.wait(lambda e: e.kind == "daemon" and e.name == "0-g2", 120, after=mark)
        assert sup.tap.events.index(retired) < sup.tap.events.index(built)
        switched = sup.wait(topic("update.main.switched"), timeout=300, after=mark)
        sup.wait(topic("update.main.finished"), timeout=300, after=mark)
        after = sup.status()
        v2 = switched.data["version"]
        assert after["version"] == v2 != v1
        assert sorted(e["role"] for e in after["engines"]) == ["primary", "standby"]
        assert {e["version"] for e in after["engines"]} == {v2}
        assert sup.stop(signal.SIGTERM) == 0, sup.output()
    finally:
        if sup.proc.poll() is None:
            sup.stop(signal.SIGKILL)


def test_a_version_rolled_back_after_the_old_standbys_stopped_gets_them_back(
    tmp_path: Path, tiny_model: Path, next_model: Path
) -> None:
    """The new version's engines refuse to start (their checkpoint dir holds `refuse`):
    it is rolled back, and the standby stopped for its room starts again on the old pool."""
    refusing = tmp_path / "refusing"
    shutil.copytree(next_model, refusing)
    (refusing / "refuse").write_text("")
    echo = "exec {python} -m tests.engines.echo"
    command = ["/bin/sh", "-c", f"if [ -e '{{model}}/refuse' ]; then exit 2; fi; {echo}"]
    sup = Supervisor(
        policy(
            tmp_path,
            tiny_model,
            70,
            engines={"command": command},
            update={"free_standby_kv": True},
            restart={"max_restarts": 1},
        )
    )
    try:
        sup.wait_pair()
        before = sup.status()
        old_standby = next(e["name"] for e in before["engines"] if e["role"] == "standby")
        mark = sup.tap.mark()
        sup.cli("update", "--model", str(refusing))
        sup.wait(topic(f"engine.{old_standby}.retired"), timeout=60, after=mark)
        back = sup.wait(topic("update.main.rolled-back"), timeout=300, after=mark)
        assert "quarantined" in back.data["why"]
        again = sup.wait(
            lambda e: e.event == "ready" and e.kind == "engine",
            timeout=120,
            after=sup.tap.events.index(back),
        )
        after = sup.status()
        assert after["version"] == before["version"] and after["epoch"] == before["epoch"]
        standbys = [e for e in after["engines"] if e["role"] == "standby"]
        assert [(e["name"], e["version"]) for e in standbys] == [(again.name, before["version"])]
        assert sup.stop(signal.SIGTERM) == 0, sup.output()
    finally:
        if sup.proc.poll() is None:
            sup.stop(signal.SIGKILL)


def test_a_refit_that_does_not_fit_is_refused_with_the_numbers(
    tmp_path: Path, tiny_model: Path, next_model: Path
) -> None:
    """A refit starts no engine, but its pool is a second one: engines 20 + 20 MB and two
    pools of 0.4 MB do not fit 40 MB."""
    sup = Supervisor(policy(tmp_path, tiny_model, 40))
    try:
        sup.wait_pair()
        before = sup.status()
        cp = sup.cli("refit", "--model", str(next_model), check=False)
        assert cp.returncode == 1, cp.stdout
        pool = pool_mb(tiny_model)
        assert (
            f"cpu (rank 0): does not fit: pools {pool} serving + {pool} new, engines 40.0 MB "
            "now + 0.0 MB new = 40.8 MB of 40.0 MB (devices.capacity_mb)"
        ) in cp.stderr, cp.stderr
        after = sup.status()
        assert after["update"] is None and after["epoch"] == before["epoch"]
        assert not (sup.run / "gen-2").exists()
        assert sup.stop(signal.SIGTERM) == 0, sup.output()
    finally:
        if sup.proc.poll() is None:
            sup.stop(signal.SIGKILL)
