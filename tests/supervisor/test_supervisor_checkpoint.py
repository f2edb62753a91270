"""The supervisor notices that a serving pool's checkpoint changed on disk: an event, the
daemon's line in `supervisor status`, and a word each time it starts an engine on it."""

from __future__ import annotations

from pathlib import Path

from tests.engines.harness import Supervisor, topic, write_policy
from tests.identity_checkpoints import copy_of, scale_in_place


def test_a_checkpoint_changed_under_a_serving_pool_is_reported(
    tiny_model: Path, tmp_path: Path
) -> None:
    model = copy_of(tiny_model, tmp_path / "model")
    sup = Supervisor(write_policy(tmp_path / "policy.yaml", model, tmp_path / "run"))
    try:
        first = sup.wait_pair()
        assert sup.status()["daemons"][0]["checkpoint_changed"] == []
        mark = sup.tap.mark()
        scale_in_place(model)  # same size, same header, new weights
        changed = sup.wait(topic("daemon.0.checkpoint_changed"), timeout=30, after=mark)
        assert changed.data["files"] == ["model.safetensors: mtime_ns, ctime_ns differ"]
        daemon = sup.status()["daemons"][0]
        assert daemon["checkpoint_changed"] == changed.data["files"]
        assert "checkpoint changed on disk" in sup.cli("status").stdout
        mark = sup.tap.mark()
        sup.kill_primary(first)  # its replacement is started on the same pool
        handout = sup.wait(topic("daemon.0.stale_handout"), timeout=60, after=mark)
        assert handout.data["engine"] == first.name
        assert handout.data["files"] == changed.data["files"]
    finally:
        sup.stop()
