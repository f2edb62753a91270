"""The README's "Watch a failover" recipe, run as written against a real supervisor (the
demo policy on the tests' broker, ports and runtime dir: those three substituted in the
commands): mosquitto_sub shows the standby promoted, the kill -9 command kills the primary
that `status --json` names, and the stream ends whole."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import yaml

from tests.engines.harness import REPO, Supervisor, env, mqtt_broker

SECTION = "## Watch a failover"


def recipe() -> list[str]:
    """The recipe's commands, one a line, from the README's first bash block after SECTION."""
    text = (REPO / "README.md").read_text()
    block = text[text.index(SECTION) :].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def demo_policy(path: Path, model: Path, prefix: str) -> Path:
    """policies/demo.yaml on this test's checkpoint, broker, ports and runtime dir."""
    from holdfast_contract.wire import free_port

    policy = yaml.safe_load((REPO / "policies" / "demo.yaml").read_text())
    host, port = mqtt_broker()
    policy["model"] = {"path": str(model), "dtype": "float32"}
    policy["cache"]["runtime_dir"] = str(path.parent / "run")
    policy["router"]["listen"] = f"127.0.0.1:{free_port()}"
    policy["api"]["listen"] = f"127.0.0.1:{free_port()}"
    policy["events"]["mqtt"] = {"host": host, "port": port, "prefix": prefix}
    policy["heartbeat"] = {"interval_ms": 100, "miss_limit": 20}  # a busy machine: no fences
    path.write_text(yaml.safe_dump(policy))
    return path


class Output:
    """A command's stdout, line by line as it comes, read in a thread."""

    def __init__(self, cmd: str) -> None:
        self.proc = subprocess.Popen(
            cmd, shell=True, env=env(), stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()

    def wait(self, pred: Callable[[str], bool], timeout: float) -> str:
        with self._cond:
            found = self._cond.wait_for(lambda: next(filter(pred, self.lines), None), timeout)
        if found is None:
            raise AssertionError(f"no such line within {timeout} s: {self.lines[-20:]}")
        return found

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):  # the shell and what it started
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._reader.join(10)  # it reads to the end of the pipe
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def test_the_readme_failover_recipe_runs(tmp_path: Path, tiny_model: Path) -> None:
    run, sub, stream, kill = recipe()
    assert run == "python3 -m supervisor run"
    prefix = f"hf-test/{uuid.uuid4().hex}"
    policy = demo_policy(tmp_path / "demo.yaml", tiny_model, prefix)
    listen = yaml.safe_load(policy.read_text())["router"]["listen"]
    host, port = mqtt_broker()
    sup = Supervisor(policy)
    outputs: list[Output] = []
    try:
        first = sup.wait_pair(timeout=180)
        sub = sub.replace("mosquitto_sub", f"mosquitto_sub -h {host} -p {port}")
        events = Output(sub.replace("holdfast/demo", prefix))
        outputs.append(events)
        events.wait(lambda line: line.startswith(f"{prefix}/status online"), timeout=30)
        chunks = Output(stream.replace("localhost:8000", listen))
        outputs.append(chunks)
        chunks.wait(lambda line: line.startswith("data: {"), timeout=60)
        status = f"python3 -m supervisor status --json --policy {shlex.quote(str(policy))}"
        killed = subprocess.run(
            kill.replace("python3 -m supervisor status --json", status),
            shell=True,
            env=env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert killed.returncode == 0, killed.stderr
        # the primary was the one killed; its standby is promoted as it dies, or by the next
        # tick where the standby's last heartbeat was late (a busy machine)
        sup.wait(lambda e: e.event == "died" and e.name == first.name, timeout=30)
        promoted = sup.wait(lambda e: e.event == "promoted" and e.name != first.name, timeout=30)
        assert promoted.data["previous"] in (first.name, None), promoted.data
        seen = json.loads(
            events.wait(
                lambda line: (
                    line.startswith(f"{prefix}/events ")
                    and '"event":"promoted"' in line
                    and f'"name":"{promoted.name}"' in line
                ),
                timeout=30,
            ).partition(" ")[2]
        )
        assert seen["epoch"] == promoted.epoch == first.epoch + 1
        chunks.proc.wait(120)
        sent = [line for line in chunks.lines if line]
        assert sent[-1] == "data: [DONE]", sent[-5:]
        assert not any('"error"' in line for line in sent), sent[-5:]
        cut = [e for e in sup.tap.events if e.event == "migrated"]
        print(f"\n{len(sent)} chunks; migrated: {[e.data for e in cut]}")
    finally:
        for out in outputs:
            out.close()
        sup.stop()
