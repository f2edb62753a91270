"""The supervisor under test: a derived policy, the process, and its health API.

The suite runs the scenario's policy with its own runtime dir, free router/API ports and
(by default) its own MQTT broker, so a run never collides with anything else on the host.
"""

from __future__ import annotations

import asyncio
import importlib.util
import signal
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import structlog
import yaml

from chaos.errors import CrewError
from chaos.procs import ProcRef, descendants, wait_gone
from chaos.stagepolicy import load_stage_policy
from holdfast_contract.control import CrewStatus, decode_status_json
from holdfast_contract.env import var
from holdfast_contract.wire import free_port
from supervisor.errors import PolicyError
from supervisor.policy import MqttSpec, Policy, split_listen
from supervisor.policy_file import policy_data

log = structlog.get_logger("chaos.cluster")

# `python -m supervisor` where the package has a __main__, else its cli module directly.
_SUPERVISOR_MODULE = (
    "supervisor" if importlib.util.find_spec("supervisor.__main__") else "supervisor.cli"
)


def derive_policy(
    source: Path, run_dir: Path, mqtt: MqttSpec | None, overrides: dict[str, Any] | None = None
) -> Policy:
    """The scenario's policy (with the stage's overrides) with this run's runtime dir, free
    ports and broker."""
    try:
        policy = load_stage_policy(source, overrides or {})
    except PolicyError as exc:
        raise CrewError(f"the scenario's policy cannot start: {exc}") from exc
    events = policy.events
    if mqtt is not None:
        base = events.mqtt or mqtt
        events = msgspec.structs.replace(
            events, mqtt=msgspec.structs.replace(base, host=mqtt.host, port=mqtt.port)
        )
    return msgspec.structs.replace(
        policy,
        cache=msgspec.structs.replace(policy.cache, runtime_dir=str(run_dir)),
        router=msgspec.structs.replace(policy.router, listen=f"127.0.0.1:{free_port()}"),
        api=msgspec.structs.replace(policy.api, listen=f"127.0.0.1:{free_port()}"),
        events=events,
    )


def write_policy(policy: Policy, path: Path) -> Path:
    data = policy_data(policy)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


class Supervisor:
    """One `supervisor run` process (or an attached one), and its health API."""

    def __init__(
        self, policy: Policy, policy_file: Path, log_file: Path, *, attached: bool = False
    ) -> None:
        self.attached = attached
        self.policy = policy
        self.policy_file = policy_file
        self.log_file = log_file
        host, port = split_listen(policy.api.listen)
        self.api = f"http://{host}:{port}"
        host, port = split_listen(policy.router.listen)
        self.router = f"http://{host}:{port}"
        self.run_dir = Path(policy.cache.runtime_dir)
        self.proc: asyncio.subprocess.Process | None = None
        self.ref: ProcRef | None = None
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Supervisor:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
        if self._session is not None:
            await self._session.close()

    async def start(self) -> None:
        with self.log_file.open("ab") as out:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                _SUPERVISOR_MODULE,
                "run",
                str(self.policy_file),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
            )
        self.ref = ProcRef.of(self.proc.pid)
        log.info("supervisor_started", pid=self.proc.pid, policy=str(self.policy_file))

    def pid(self) -> int | None:
        if self.proc is not None:
            return self.proc.pid
        if self.attached:  # the live supervisor writes its pid into its lock file
            holder = (self.run_dir / "supervisor.lock").read_text().strip()
            return int(holder) if holder.isdigit() else None
        return None

    def children(self) -> list[ProcRef]:
        pid = self.pid()
        return descendants(pid) if pid is not None else []

    def processes(self) -> list[ProcRef]:
        """The supervisor itself (the keeper lives in it) and every process below it."""
        pid = self.pid()
        own = ProcRef.of(pid) if pid is not None else None
        return ([own] if own is not None else []) + self.children()

    def exited(self) -> int | None:
        return self.proc.returncode if self.proc is not None else None

    async def cluster(self) -> CrewStatus | None:
        """The health API's /cluster, or None while nothing answers."""
        assert self._session is not None, "use `async with Supervisor(...)`"
        try:
            async with self._session.get(self.api + "/cluster") as resp:
                if resp.status != 200:
                    return None
                return decode_status_json(await resp.read())
        except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError):
            return None

    async def kill(self) -> ProcRef | None:
        """SIGKILL the supervisor alone (not its group): its children must go by themselves."""
        proc, ref = self.proc, self.ref
        if proc is None or ref is None:
            return None
        ref.signal(signal.SIGKILL)
        await proc.wait()
        self.proc = None
        return ref

    async def stop(self, grace: float = 10.0) -> list[ProcRef]:
        """SIGTERM, wait `grace`, then SIGKILL; then SIGKILL every child that outlived it.

        Returns the children that had to be killed (a clean stop leaves none)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return []
        children = descendants(proc.pid)
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), grace)
            except TimeoutError:
                log.warning("supervisor_stop_timeout", pid=proc.pid, grace_s=grace)
                proc.kill()
                await proc.wait()
        left = await wait_gone(children, grace)
        for ref in left:
            log.error("lingering_child", pid=ref.pid, name=ref.env(var("name")))
            ref.signal(signal.SIGKILL)
        await wait_gone(left, grace)
        return left


def describe_exit(sup: Supervisor, started: float) -> str:
    tail = ""
    if sup.log_file.exists():
        tail = " | ".join(sup.log_file.read_text(errors="replace").strip().splitlines()[-6:])
    return (
        f"supervisor exited after {time.time() - started:.1f}s; policy {sup.policy_file}; "
        f"last log lines: {tail}"
    )
