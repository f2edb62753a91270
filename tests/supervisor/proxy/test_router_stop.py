"""Stop under load: once `supervisor run` is told to stop (SIGTERM), its router answers every
new request at once with 503 and Retry-After, the stream under way finishes in full, and the
supervisor exits without waiting out router.retry_deadline_s for requests held for a
primary that will never come.

Real `supervisor run`, a real engine on the tiny checkpoint."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from holdfast_contract.wire import free_port
from tests.engines.harness import Supervisor, topic, write_policy
from tests.supervisor.proxy.test_router_streams import ENGINE, PROMPT, TOKENS, stream, token_ids

DEADLINE_S = 60.0  # router.retry_deadline_s: a request held for a primary waits this long


def ask(router: str) -> tuple[int, dict[str, str], Any] | None:
    """One new completion: (status, headers, body), None once nothing listens."""
    body = json.dumps({"prompt_token_ids": PROMPT, "max_tokens": 4}).encode()
    req = urllib.request.Request(
        f"{router}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=2 * DEADLINE_S) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read() or b"null")
    except (urllib.error.URLError, ConnectionError):
        return None


def test_a_stopping_supervisor_refuses_new_requests_at_once_and_finishes_those_under_way(
    tmp_path: Path, tiny_model: Path
) -> None:
    policy = write_policy(
        tmp_path / "policy.yaml",
        tiny_model,
        tmp_path / "run",
        engines={"command": ENGINE, "standby": 0, "ready_timeout_s": 120, "stop_grace_s": 20.0},
        heartbeat={"interval_ms": 100, "miss_limit": 10},
        router={"listen": f"127.0.0.1:{free_port()}", "retry_deadline_s": DEADLINE_S},
    )
    sup = Supervisor(policy)
    try:
        sup.wait(lambda e: e.event == "promoted", timeout=180)
        under_way = stream(sup.router, prompt_token_ids=PROMPT, max_tokens=TOKENS)
        events = [next(under_way)]  # the stream is under way at the engine
        mark = sup.tap.mark()
        t0 = time.monotonic()
        sup.proc.send_signal(signal.SIGTERM)
        sup.wait(topic("supervisor.main.stopping"), timeout=30, after=mark)
        answers: list[tuple[int, dict[str, str], Any]] = []

        def keep_asking() -> None:  # new requests all through the stop, until it is done
            while (answer := ask(sup.router)) is not None:
                answers.append(answer)

        asker = threading.Thread(target=keep_asking)
        asker.start()
        events.extend(under_way)
        assert sup.proc.wait(timeout=2 * DEADLINE_S) == 0, sup.output()
        stopped_s = time.monotonic() - t0
        asker.join(timeout=2 * DEADLINE_S)
        # the stream under way ended in full
        assert events[-1] == b"[DONE]" and len(token_ids(events)) == TOKENS
        # every request that arrived during the stop: 503 at once, with Retry-After
        assert answers, "no request reached the router while it stopped"
        for status, headers, body in answers:
            assert status == 503, (status, body)
            assert int(headers["Retry-After"]) >= 1
            assert body["error"]["type"] == "unavailable"
            assert "stopping" in body["error"]["message"]
        # nothing held for a primary: the stop did not wait out the retry deadline
        assert stopped_s < DEADLINE_S, stopped_s
    finally:
        if sup.proc.poll() is None:
            sup.stop(signal.SIGKILL)
        else:
            sup.tap.close()
