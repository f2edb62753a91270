"""A refit in place under load: `supervisor refit --model DIR` switches every engine (the
primary, its standby, a batch engine) to new weights of the same shapes without a restart
(the same processes answer after it), with no failed request, every answer labelled with
the version that made it and made by that version alone; the old pool is freed. A refit
of other shapes, or with a tensor missing or mis-shaped, is refused before anything
changes, with what to fix.

Real `supervisor run`, the reference engine on two generated tiny checkpoints of the same
shapes and other weights (seeds 0 and 1); answers are sized in tokens."""

from __future__ import annotations

import http.client
import os
import shutil
import signal
import threading
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.engines.harness import exits_within, topic
from tests.supervisor.update.test_update_rollout import (
    Clients,
    ask,
    assert_each_made_by_one_version,
    boot,
    copy_with,
    escrowed,
    get_version,
)

BATCH = {"batch": [{"name": "batch", "count": 1}]}


def test_a_refit_under_load_switches_every_engine_in_place_and_frees_the_old_pool(
    tmp_path: Path, tiny_model: Path, next_model: Path
) -> None:
    sup = boot(
        tmp_path,
        tiny_model,
        update={"keep_old_s": 0.5, "drain_s": 60},
        engines={"command": ["{python}", "-m", "engine"], "ready_timeout_s": 120, **BATCH},
    )
    try:
        sup.wait_pair()
        sup.wait(topic("engine.batch-1.ready"), timeout=180)
        before = sup.status()
        v1 = before["version"]
        pids = {e["name"]: e["pid"] for e in before["engines"]}
        old_daemons = [d["pid"] for d in before["daemons"]]
        old_pool = {d["fingerprint"] for d in before["daemons"]}
        clients = Clients(sup.router, streams=2, plain=1)
        try:
            clients.wait_for(3)
            mark = sup.tap.mark()
            said = sup.cli("refit", "--model", str(next_model), "--wait")
            assert "refit finished" in said.stdout, said.stdout
            switched = sup.wait(topic("update.main.switched"), timeout=30, after=mark)
            v2 = switched.data["version"]
            assert v2 != v1 and switched.data["refit"] is True
            for name in pids:
                sup.wait(topic(f"engine.{name}.refitted"), timeout=30, after=mark)
            clients.wait_for(4, version=v2)
        finally:
            answers = clients.stop()
        assert_each_made_by_one_version(answers, v1, v2)
        after = sup.status()
        assert after["version"] == v2 and after["update"]["state"] == "finished"
        assert after["update"]["kind"] == "refit"
        # the same processes, each on the new version: nothing restarted
        assert {e["name"]: e["pid"] for e in after["engines"]} == pids
        assert {e["version"] for e in after["engines"]} == {v2}
        assert sorted(e["state"] for e in after["engines"]) == ["batch", "primary", "standby"]
        assert all(exits_within(pid, 30) for pid in old_daemons)
        new_pool = {d["fingerprint"] for d in after["daemons"]}
        assert escrowed(sup.run) == new_pool and not old_pool & new_pool
        assert get_version(sup.router) == (200, v2)
        assert sup.stop(signal.SIGTERM) == 0, sup.output()
    finally:
        if sup.proc.poll() is None:
            sup.stop(signal.SIGKILL)


def with_tensor(model: Path, out: Path, name: str, tensor: torch.Tensor | None) -> Path:
    """`model` with one tensor of its safetensors replaced (None: left out)."""
    shutil.copytree(model, out)
    state = load_file(out / "model.safetensors")
    if tensor is None:
        del state[name]
    else:
        state[name] = tensor
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_refits_that_cannot_fit_are_refused_before_anything_changes(
    tmp_path: Path, tiny_model: Path
) -> None:
    sup = boot(tmp_path, tiny_model)
    try:
        sup.wait_pair()
        before = sup.status()

        def refused(*args: str) -> str:
            cp = sup.cli(*args, check=False)
            assert cp.returncode == 1, cp.stdout
            return cp.stderr

        norm = "model.norm.weight"
        shape = load_file(tiny_model / "model.safetensors")[norm].shape
        wide = with_tensor(tiny_model, tmp_path / "wide", norm, torch.ones(shape[0] * 2))
        assert norm in refused("refit", "--model", str(wide))
        gone = with_tensor(tiny_model, tmp_path / "gone", norm, None)
        assert norm in refused("refit", "--model", str(gone))
        wider = copy_with(tiny_model, tmp_path / "wider", hidden_size=4096)
        assert "other shapes" in refused("refit", "--model", str(wider))
        assert "serves now" in refused("refit", "--model", str(tiny_model))
        same = sup.status()
        assert (same["epoch"], same["primary"], same["update"]) == (
            before["epoch"],
            before["primary"],
            None,
        )
        assert [e["pid"] for e in same["engines"]] == [e["pid"] for e in before["engines"]]
        assert escrowed(sup.run) == {d["fingerprint"] for d in before["daemons"]}
        assert sup.stop(signal.SIGTERM) == 0, sup.output()
    finally:
        if sup.proc.poll() is None:
            sup.stop(signal.SIGKILL)


def test_a_crew_without_a_standby_refits_its_primary_where_it_serves(
    tmp_path: Path, tiny_model: Path, next_model: Path
) -> None:
    """No standby: the primary takes nothing new while its requests finish (the router
    retries them), swaps, and serves the new version, in the same process."""
    sup = boot(
        tmp_path,
        tiny_model,
        update={"keep_old_s": 0, "drain_s": 60},
        engines={"command": ["{python}", "-m", "engine"], "ready_timeout_s": 120, "standby": 0},
        router={"retry": True, "retry_deadline_s": 60},
    )
    try:
        first = sup.wait(lambda e: e.event == "promoted", timeout=180)
        before = sup.status()
        v1, pid = before["version"], before["engines"][0]["pid"]
        clients = Clients(sup.router, streams=2, plain=1)
        try:
            clients.wait_for(3)
            mark = sup.tap.mark()
            said = sup.cli("refit", "--model", str(next_model), "--wait")
            assert "refit finished" in said.stdout, said.stdout
            sup.wait(topic(f"engine.{first.name}.refitted"), timeout=30, after=mark)
            v2 = sup.status()["version"]
            assert v2 != v1
            clients.wait_for(3, version=v2)
        finally:
            answers = clients.stop()
        failed = [(a.status, a.error) for a in answers if a.status != 200 or a.error or not a.done]
        assert failed == []
        made: dict[str, set[tuple[int, ...]]] = {}
        for a in answers:
            assert a.stream or a.fingerprint == a.version
            made.setdefault(a.version, set()).add(tuple(a.tokens))
        assert set(made) == {v1, v2} and all(len(m) == 1 for m in made.values()), made
        after = sup.status()
        assert [(e["name"], e["pid"], e["version"]) for e in after["engines"]] == [
            (first.name, pid, v2)
        ]
        assert after["epoch"] == before["epoch"]
        assert sup.stop(signal.SIGTERM) == 0, sup.output()
    finally:
        if sup.proc.poll() is None:
            sup.stop(signal.SIGKILL)


def test_an_engine_that_dies_while_it_refits_restarts_on_the_new_pool_at_once(
    tmp_path: Path, tiny_model: Path, next_model: Path
) -> None:
    """The batch engine refits once its request under way is done (update.drain_s 300):
    killed while it waits, it is restarted on the new pool, and the refit ends without
    waiting out the drain."""
    sup = boot(
        tmp_path,
        tiny_model,
        update={"keep_old_s": 0, "drain_s": 300},
        engines={"command": ["{python}", "-m", "engine"], "ready_timeout_s": 120, **BATCH},
    )
    try:
        sup.wait_pair()
        sup.wait(topic("engine.batch-1.ready"), timeout=180)
        batch = next(e for e in sup.status()["engines"] if e["name"] == "batch-1")
        # four clients back to back, with answers of four lengths (prompt + 500 fit in 512),
        # so their ends drift apart: when the refit comes, and still when the engine is
        # killed a moment after it said so, some request is under way there
        stop = threading.Event()
        done = [threading.Event() for _ in range(4)]

        def asking(tokens: int, first: threading.Event) -> None:
            while not stop.is_set():
                try:
                    ask(f"http://127.0.0.1:{batch['port']}", True, tokens)
                    first.set()
                except (OSError, http.client.HTTPException):  # killed under it: expected
                    pass

        for tokens, first in zip((500, 430, 370, 310), done, strict=True):
            threading.Thread(target=asking, args=(tokens, first), daemon=True).start()
        assert all(first.wait(120) for first in done)
        mark = sup.tap.mark()
        sup.cli("refit", "--model", str(next_model))
        sup.wait(topic("engine.batch-1.reported-refitting"), timeout=60, after=mark)
        os.kill(batch["pid"], signal.SIGKILL)
        end = sup.wait(topic("update.main.finished"), timeout=120, after=mark)
        stop.set()
        # it never refitted: it was killed while its request was under way, and restarted
        assert "engine.batch-1.refitted" not in [e.topic for e in sup.tap.events[mark:]]
        v2 = end.data["version"]
        sup.wait(
            lambda e: e.topic == "engine.batch-1.ready" and e.ts > end.ts - 60,
            timeout=120,
            after=mark,
        )
        after = {e["name"]: e for e in sup.status()["engines"]}
        assert after["batch-1"]["version"] == v2 and after["batch-1"]["pid"] != batch["pid"]
        assert {e["version"] for e in after.values()} == {v2}
        assert sup.stop(signal.SIGTERM) == 0, sup.output()
    finally:
        if sup.proc.poll() is None:
            sup.stop(signal.SIGKILL)
