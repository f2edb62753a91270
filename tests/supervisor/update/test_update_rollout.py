"""A rolling model update under load: `supervisor update --model DIR` passes the primary's
place to the next version with no failed request, every answer labelled with the version
that made it and made by that version alone; the old pool is freed (its daemons gone, its
escrow entry withdrawn). A new version whose engines cannot start is rolled back with
nothing lost, and `supervisor rollback` switches back while the old pool is kept.

Real `supervisor run`, the reference engine (`python -m engine`) on two generated tiny
checkpoints of the same shapes and other weights (seeds 0 and 1); answers are sized in
tokens, deadlines are only safety nets."""

from __future__ import annotations

import http.client
import json
import shutil
import signal
import threading
from pathlib import Path
from typing import Any

from cachedaemon import protocol
from tests.engines.harness import Supervisor, exits_within, topic, write_policy

ENGINE = ["{python}", "-m", "engine"]
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]
TOKENS = 24
VERSION = "X-Holdfast-Model-Version"


def boot(base: Path, model: Path, **sections: Any) -> Supervisor:
    policy = write_policy(
        base / "policy.yaml",
        model,
        base / "run",
        **{
            "engines": {"command": ENGINE, "ready_timeout_s": 120, "stop_grace_s": 5.0},
            "heartbeat": {"interval_ms": 100, "miss_limit": 10},
            **sections,
        },
    )
    return Supervisor(policy)


class Answer:
    """One request's outcome: its status, version header, token ids, and how it ended."""

    def __init__(self, stream: bool) -> None:
        self.stream = stream
        self.status = 0
        self.version = ""
        self.fingerprint = ""
        self.tokens: list[int] = []
        self.done = False  # a stream's [DONE], or a whole JSON body
        self.migrated = False
        self.error = ""


def ask(router: str, stream: bool, tokens: int = TOKENS) -> Answer:
    """One completion of PROMPT through the router, streamed or not."""
    host, port = router.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    body = {"prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True, "stream": stream}
    out = Answer(stream)
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        out.status, out.version = resp.status, resp.getheader(VERSION, "")
        data = resp.read()
        if resp.status != 200:
            out.error = data.decode(errors="replace")
        elif stream:
            _read_stream(data, out)
        else:
            whole = json.loads(data)
            out.tokens = whole["choices"][0]["token_ids"]
            out.fingerprint = whole.get("system_fingerprint", "")
            out.done = True
    finally:
        conn.close()
    return out


def _read_stream(data: bytes, out: Answer) -> None:
    for event in data.split(b"\n\n"):
        if event.startswith(b":"):
            out.migrated = True
        elif event == b"data: [DONE]":
            out.done = True
        elif event.startswith(b"data: "):
            chunk = json.loads(event.removeprefix(b"data: "))
            if "error" in chunk:
                out.error = json.dumps(chunk["error"])
            for choice in chunk.get("choices", []):
                out.tokens.extend(choice.get("token_ids") or [])


class Clients:
    """Clients asking through the router in threads, streamed and not, until stopped."""

    def __init__(self, router: str, streams: int = 2, plain: int = 1, tokens: int = TOKENS) -> None:
        self.router = router
        self.tokens = tokens
        self.answers: list[Answer] = []
        self._cond = threading.Condition()
        self._stop = threading.Event()
        kinds = [True] * streams + [False] * plain
        self._threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in kinds]
        for t in self._threads:
            t.start()

    def _run(self, stream: bool) -> None:
        while not self._stop.is_set():
            try:
                a = ask(self.router, stream, self.tokens)
            except OSError as e:
                a = Answer(stream)
                a.error = repr(e)
            with self._cond:
                self.answers.append(a)
                self._cond.notify_all()

    def wait_for(self, count: int, version: str = "", timeout: float = 300) -> None:
        """Until `count` more answers (of `version`, if given) came."""
        with self._cond:
            have = len([a for a in self.answers if not version or a.version == version])
            self._cond.wait_for(
                lambda: (
                    len([a for a in self.answers if not version or a.version == version])
                    >= have + count
                ),
                timeout,
            )

    def any_error(self) -> bool:
        with self._cond:
            return any(a.error for a in self.answers)

    def stop(self) -> list[Answer]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=150)
        return self.answers


def assert_each_made_by_one_version(answers: list[Answer], v1: str, v2: str) -> None:
    """None failed; every answer is labelled v1 or v2 (a collected one's fingerprint too),
    and each version made one answer to the one prompt, streamed or not, unlike the
    other's: an answer mixing the two would be a third."""
    failed = [(a.status, a.error) for a in answers if a.status != 200 or a.error or not a.done]
    assert failed == [] and len(answers) >= 7
    made: dict[str, set[tuple[int, ...]]] = {}
    for a in answers:
        assert a.version in (v1, v2) and not a.migrated
        assert a.stream or a.fingerprint == a.version
        made.setdefault(a.version, set()).add(tuple(a.tokens))
    assert set(made) == {v1, v2} and all(len(m) == 1 for m in made.values()), made
    assert made[v1] != made[v2]


def escrowed(run: Path) -> set[str]:
    """The fingerprints of the pools the keeper holds."""
    reply, _ = protocol.call(str(run / "keeper.sock"), protocol.ListPools())
    assert isinstance(reply, protocol.Pools), reply
    return {p.fingerprint for p in reply.pools}


def test_an_update_under_load_fails_no_request_and_frees_the_old_pool(
    tmp_path: Path, tiny_model: Path, next_model: Path
) -> None:
    sup = boot(
        tmp_path,
        tiny_model,
        update={"keep_old_s": 0.5, "smoke": {"prompt": "Hello", "max_tokens": 2}},
    )
    try:
        sup.wait_pair()
        before = sup.status()
        v1 = before["version"]
        old_daemons = [d["pid"] for d in before["daemons"]]
        old_pool = {d["fingerprint"] for d in before["daemons"]}
        assert v1 and old_pool <= escrowed(sup.run)
        clients = Clients(sup.router)
        try:
            clients.wait_for(3)
            mark = sup.tap.mark()
            said = sup.cli("update", "--model", str(next_model)).stdout
            assert "updating to" in said
            switched = sup.wait(topic("update.main.switched"), timeout=300, after=mark)
            v2 = switched.data["version"]
            assert v2 != v1 and switched.data["previous"] == v1
            sup.wait(topic("update.main.finished"), timeout=300, after=mark)
            clients.wait_for(4, version=v2)
        finally:
            answers = clients.stop()
        assert_each_made_by_one_version(answers, v1, v2)
        after = sup.status()
        assert after["version"] == v2 and after["update"]["state"] == "finished"
        assert {e["version"] for e in after["engines"]} == {v2}
        assert all(exits_within(pid, 30) for pid in old_daemons)
        new_pool = {d["fingerprint"] for d in after["daemons"]}
        assert escrowed(sup.run) == new_pool and not old_pool & new_pool
        assert sup.stop(signal.SIGTERM) == 0, sup.output()
    finally:
        if sup.proc.poll() is None:
            sup.stop(signal.SIGKILL)


def test_a_stream_the_old_primary_cannot_finish_ends_with_an_error_on_its_version(
    tmp_path: Path, tiny_model: Path, next_model: Path
) -> None:
    """update.drain_s shorter than a stream: the old primary exits with streams under way;
    each ends with an error event that names the update, never continued on the new
    version. Long streams back to back, so the switch finds some under way."""
    sup = boot(tmp_path, tiny_model, update={"drain_s": 0.001, "keep_old_s": 0})
    try:
        sup.wait_pair()
        clients = Clients(sup.router, streams=2, plain=0, tokens=400)
        models, switches = [next_model, tiny_model], []
        try:
            clients.wait_for(2)
            # updates back and forth until one finds a stream under way on the old primary
            # (the clients may both be between requests at a switch)
            for turn in range(6):
                mark = sup.tap.mark()
                sup.cli("update", "--model", str(models[turn % 2]))
                switched = sup.wait(topic("update.main.switched"), timeout=300, after=mark)
                sup.wait(topic("update.main.finished"), timeout=300, after=mark)
                v_from, v_to = switched.data["previous"], switched.data["version"]
                switches.append((v_from, v_to))
                clients.wait_for(2, version=v_to)
                if clients.any_error():
                    break
        finally:
            answers = clients.stop()
        cut = [a for a in answers if a.error]
        assert cut, "no stream was under way at any switch"
        for a in cut:
            assert not a.done and not a.migrated
            assert any(
                a.version == v_from and f"updated from version {v_from} to {v_to}" in a.error
                for v_from, v_to in switches
            ), a.error
        whole = [a for a in answers if not a.error]
        assert all(a.done and not a.migrated and a.status == 200 for a in whole)
        assert {a.version for a in whole} == {v for pair in switches for v in pair}
        assert sup.stop(signal.SIGTERM) == 0, sup.output()
    finally:
        if sup.proc.poll() is None:
            sup.stop(signal.SIGKILL)


def broken_copy(model: Path, out: Path) -> Path:
    """`model` with a config.json the engine refuses (an unknown rope_scaling type): the
    daemons load it, its engines exit at start."""
    return copy_with(model, out, rope_scaling={"rope_type": "bogus", "factor": 2.0})


def copy_with(model: Path, out: Path, **config: Any) -> Path:
    """`model` with config.json fields changed."""
    shutil.copytree(model, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(config)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_a_version_whose_engines_cannot_start_is_rolled_back_with_nothing_lost(
    tmp_path: Path, tiny_model: Path
) -> None:
    bad = broken_copy(tiny_model, tmp_path / "broken")
    sup = boot(tmp_path, tiny_model, update={"ready_timeout_s": 240})
    try:
        first = sup.wait_pair()
        before = sup.status()
        clients = Clients(sup.router, streams=1, plain=1)
        try:
            clients.wait_for(2)
            mark = sup.tap.mark()
            sup.cli("update", "--model", str(bad))
            back = sup.wait(topic("update.main.rolled-back"), timeout=300, after=mark)
            assert "quarantined" in back.data["why"]
            clients.wait_for(2)
        finally:
            answers = clients.stop()
        assert [a.error for a in answers if a.status != 200 or a.error] == []
        assert {a.version for a in answers} == {before["version"]}
        after = sup.status()
        assert after["primary"] == first.name and after["epoch"] == before["epoch"]
        assert after["update"]["state"] == "rolled-back"
        assert sorted(e["name"] for e in after["engines"]) == sorted(
            e["name"] for e in before["engines"]
        )
        assert escrowed(sup.run) == {d["fingerprint"] for d in before["daemons"]}
        assert not any(Path(sup.run, "gen-2").glob("daemon-*.sock"))
        assert sup.stop(signal.SIGTERM) == 0, sup.output()
    finally:
        if sup.proc.poll() is None:
            sup.stop(signal.SIGKILL)


def test_rollback_by_hand_before_the_switch_stops_the_new_version(
    tmp_path: Path, tiny_model: Path
) -> None:
    """The new version's engines exit at start and are restarted (a restart budget that
    never quarantines them): the update stays warming until `supervisor rollback`."""
    bad = broken_copy(tiny_model, tmp_path / "broken")
    sup = boot(tmp_path, tiny_model, restart={"max_restarts": 10000, "window_s": 1})
    try:
        first = sup.wait_pair()
        before = sup.status()
        mark = sup.tap.mark()
        sup.cli("update", "--model", str(bad))
        sup.wait(lambda e: e.kind == "engine" and e.event == "died", timeout=120, after=mark)
        assert sup.status()["update"]["state"] == "warming"
        assert "rolling back" in sup.cli("rollback").stdout
        back = sup.wait(topic("update.main.rolled-back"), timeout=120, after=mark)
        assert back.data["why"] == "rolled back by hand"
        after = sup.status()
        assert (after["primary"], after["epoch"]) == (first.name, before["epoch"])
        assert [e["name"] for e in after["engines"]] == [e["name"] for e in before["engines"]]
        assert escrowed(sup.run) == {d["fingerprint"] for d in before["daemons"]}
        code, body = get_version(sup.router, PROMPT)
        assert (code, body) == (200, before["version"])
        assert sup.stop(signal.SIGTERM) == 0, sup.output()
    finally:
        if sup.proc.poll() is None:
            sup.stop(signal.SIGKILL)


def test_refused_updates_name_what_to_fix_and_change_nothing_then_a_rollback_by_hand(
    tmp_path: Path, tiny_model: Path, next_model: Path
) -> None:
    """Echo engines (they ignore the weights; the daemons load the real checkpoints), and
    a batch engine, which follows each switch onto the version served."""
    policy = write_policy(
        tmp_path / "policy.yaml",
        tiny_model,
        tmp_path / "run",
        engines={"batch": [{"name": "batch", "count": 1}]},
        update={"keep_old_s": 300, "drain_s": 1},
    )
    sup = Supervisor(policy)
    try:
        sup.wait_pair()
        before = sup.status()
        v1 = before["version"]

        def refused(*args: str) -> str:
            cp = sup.cli(*args, check=False)
            assert cp.returncode == 1, cp.stdout
            return cp.stderr

        assert "nothing to roll back" in refused("rollback")
        assert "does not exist" in refused("update", "--model", str(tmp_path / "nowhere"))
        empty = tmp_path / "empty"
        empty.mkdir()
        (empty / "config.json").write_text("{}")
        assert "holds no *.safetensors" in refused("update", "--model", str(empty))
        other = copy_with(tiny_model, tmp_path / "other", model_type="gpt2")
        assert "model_type 'gpt2'" in refused("update", "--model", str(other))
        wider = copy_with(tiny_model, tmp_path / "wider", hidden_size=4096)
        assert "other shapes" in refused("update", "--model", str(wider))
        assert "serves now" in refused("update", "--model", str(tiny_model))
        same = sup.status()
        assert (same["epoch"], same["primary"], same["update"]) == (
            before["epoch"],
            before["primary"],
            None,
        )
        assert [e["pid"] for e in same["engines"]] == [e["pid"] for e in before["engines"]]
        # the same bytes in another dir: built, found to be the version served, freed
        mark = sup.tap.mark()
        sup.cli("update", "--model", str(shutil.copytree(tiny_model, tmp_path / "copy")))
        back = sup.wait(topic("update.main.rolled-back"), timeout=120, after=mark)
        assert f"version that serves ({v1})" in back.data["why"]
        assert escrowed(sup.run) == {d["fingerprint"] for d in before["daemons"]}

        mark = sup.tap.mark()
        sup.cli("update", "--model", str(next_model))
        assert "under way" in refused("update", "--model", str(next_model))
        switched = sup.wait(topic("update.main.switched"), timeout=300, after=mark)
        v2 = switched.data["version"]
        assert get_version(sup.router) == (200, v2)
        standby = next(e["name"] for e in before["engines"] if e["name"] != before["primary"])
        sup.wait(topic(f"engine.{standby}.retired"), timeout=60, after=mark)  # then it keeps
        sup.wait(topic("engine.batch-1.ready"), timeout=60, after=mark)
        assert {e["name"]: e["version"] for e in sup.status()["engines"]}["batch-1"] == v2
        new_daemons = [d["pid"] for d in sup.status()["daemons"]]
        assert "under way" in refused("update", "--model", str(tiny_model))  # old pool kept

        mark = sup.tap.mark()
        done = sup.cli("rollback", "--wait")
        assert f"version {v1}" in done.stdout, done.stdout
        sup.wait(topic("update.main.rolled-back"), timeout=60, after=mark)
        sup.wait(topic("engine.batch-1.ready"), timeout=60, after=mark)
        after = sup.status()
        assert after["version"] == v1 and {e["version"] for e in after["engines"]} == {v1}
        assert after["update"]["state"] == "rolled-back"
        assert after["epoch"] == switched.epoch + 1
        assert all(exits_within(pid, 30) for pid in new_daemons)
        assert escrowed(sup.run) == {d["fingerprint"] for d in before["daemons"]}
        code, body = get_version(sup.router)
        assert code == 200 and body == v1
        assert "nothing to roll back" in refused("rollback")
        assert sup.stop(signal.SIGTERM) == 0, sup.output()
    finally:
        if sup.proc.poll() is None:
            sup.stop(signal.SIGKILL)


def get_version(router: str, prompt: Any = "hi") -> tuple[int, str]:
    """One completion through the router: its status and version header."""
    host, port = router.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        body = {"prompt": prompt, "max_tokens": 2}
        conn.request("POST", "/v1/completions", json.dumps(body))
        resp = conn.getresponse()
        resp.read()
        return resp.status, resp.getheader(VERSION, "")
    finally:
        conn.close()
