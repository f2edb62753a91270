"""`update.refit_inflight: retry`: a refit's old primary does not finish what it has in
flight on the old weights; it cuts it at once and refits, and the router answers each cut
request from the new weights: a collected answer made again whole by the new version, a
stream continued from the tokens its client has (marked as migrated, as after a failover).
No request fails and every stream gets all its tokens.

Real `supervisor run`, the reference engine on two tiny checkpoints of the same shapes
(seeds 0 and 1); answers are sized in tokens, long enough that the old primary has streams
under way when its place passes on (drain_s is long: a finish would wait for them)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

from tests.engines.harness import topic
from tests.supervisor.update.test_update_rollout import Clients, boot

TOKENS = 400  # a stream on the tiny model lasts long beside a refit's switch


def test_a_refit_that_retries_cuts_the_old_primary_and_loses_nothing(
    tmp_path: Path, tiny_model: Path, next_model: Path
) -> None:
    sup = boot(
        tmp_path,
        tiny_model,
        update={"keep_old_s": 0.5, "drain_s": 300, "refit_inflight": "retry"},
    )
    try:
        first = sup.wait_pair()
        v1 = sup.status()["version"]
        clients = Clients(sup.router, streams=3, plain=2, tokens=TOKENS)
        try:
            clients.wait_for(2)
            mark = sup.tap.mark()
            said = sup.cli("refit", "--model", str(next_model), "--wait")
            assert "refit finished" in said.stdout, said.stdout
            switched = sup.wait(topic("update.main.switched"), timeout=30, after=mark)
            v2 = switched.data["version"]
            sup.wait(topic(f"engine.{first.name}.refitted"), timeout=60, after=mark)
            clients.wait_for(3, version=v2)
        finally:
            answers = clients.stop()
        failed = [(a.status, a.error) for a in answers if a.status != 200 or a.error or not a.done]
        assert failed == []
        assert all(len(a.tokens) == TOKENS for a in answers)
        assert {a.version for a in answers} == {v1, v2}
        # the old primary cut what it had, and the streams among it went on on the new one
        log = (sup.run / "logs" / f"{first.name}.0.log").read_text()
        cuts = [json.loads(x) for x in log.splitlines() if '"requests cut"' in x]
        assert cuts and cuts[0]["count"] >= 1, log[-3000:]
        assert any(a.migrated for a in answers if a.stream)
        # a collected answer is never made by two versions: each version's is one answer
        made: dict[str, set[tuple[int, ...]]] = {}
        for a in answers:
            if not a.stream:
                made.setdefault(a.version, set()).add(tuple(a.tokens))
        assert all(len(m) == 1 for m in made.values()), made
        assert sup.status()["version"] == v2
        assert sup.stop(signal.SIGTERM) == 0, sup.output()
    finally:
        if sup.proc.poll() is None:
            sup.stop(signal.SIGKILL)
