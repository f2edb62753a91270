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
from tests.supervisor.update.test_update_rollout import PROMPT, Clients, boot

TOKENS = 400  # a stream on the tiny model lasts long beside a refit's switch
WARM_EVERY = 8


def test_a_refit_that_retries_cuts_the_old_primary_and_loses_nothing(
    tmp_path: Path, tiny_model: Path, next_model: Path
) -> None:
    sup = boot(
        tmp_path,
        tiny_model,
        # rewarm_s far above any machine's pace: the switch waits for the heir's pasts
        update={"keep_old_s": 0.5, "drain_s": 300, "refit_inflight": "retry", "rewarm_s": 60},
        router={"warm_every": WARM_EVERY},
    )
    try:
        sup.wait_pair()
        v1 = sup.status()["version"]
        clients = Clients(sup.router, streams=3, plain=2, tokens=TOKENS)
        models, versions, cuts = [next_model, tiny_model], {v1}, 0
        try:
            clients.wait_for(2)
            # refits back and forth until one finds requests under way on the primary it
            # replaces (the clients may all be between requests at a switch)
            for turn in range(6):
                old = sup.status()["primary"]
                mark = sup.tap.mark()
                said = sup.cli("refit", "--model", str(models[turn % 2]), "--wait")
                assert "refit finished" in said.stdout, said.stdout
                switched = sup.wait(topic("update.main.switched"), timeout=30, after=mark)
                versions.add(switched.data["version"])
                sup.wait(topic(f"engine.{old}.refitted"), timeout=60, after=mark)
                clients.wait_for(3, version=switched.data["version"])
                log = (sup.run / "logs" / f"{old}.0.log").read_text()
                cuts = sum(
                    json.loads(x)["count"] for x in log.splitlines() if '"requests cut"' in x
                )
                if cuts:
                    migrated = [
                        e.data for e in sup.tap.events[mark:] if topic("router.main.migrated")(e)
                    ]
                    break
        finally:
            answers = clients.stop()
        failed = [(a.status, a.error) for a in answers if a.status != 200 or a.error or not a.done]
        assert failed == []
        assert all(len(a.tokens) == TOKENS for a in answers)
        assert {a.version for a in answers} == versions and len(versions) == 2
        # the old primary cut what it had; any stream among it went on on the new one
        assert cuts >= 1, "no refit found a request under way on the primary it replaced"
        cut_streams = [a for a in answers if a.stream and a.migrated]
        assert all(len(a.tokens) == TOKENS for a in cut_streams)
        # before the switch the router kept the streams' pasts warm on the refitted heir,
        # on the new weights: each cut stream went on from a past kept there, its answer's
        # tokens included (the heir gave back what it kept when it refitted; a prompt
        # alone may be found in its prefix cache), never computing its whole past again
        assert migrated, "the cut streams' continuations were not seen"
        for m in migrated:
            if m["tokens"] >= TOKENS - WARM_EVERY // 2:
                continue  # about to end: not worth warming (its continuation is short)
            assert m["continued"] == "kept", m
            # the switch waits until every stream's past is kept to within WARM_EVERY
            # tokens (a stream 11 tokens on then has more than its prompt kept); tokens
            # still come until the old primary hears of its refit and cuts (some 60-80 ms
            # on busy cores): past 4 * WARM_EVERY at the cut, more than the prompt is kept
            if m["tokens"] > 4 * WARM_EVERY:
                assert m["kept"] > len(PROMPT) + 2, m
        # a collected answer is never made by two versions: each version's is one answer
        made: dict[str, set[tuple[int, ...]]] = {}
        for a in answers:
            if not a.stream:
                made.setdefault(a.version, set()).add(tuple(a.tokens))
        assert all(len(m) == 1 for m in made.values()), made
        assert sup.stop(signal.SIGTERM) == 0, sup.output()
    finally:
        if sup.proc.poll() is None:
            sup.stop(signal.SIGKILL)
