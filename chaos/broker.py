"""The suite's own MQTT broker on a free loopback port, so broker faults never touch the
machine's shared broker. Stopped and started again on the same port by `restart-broker`."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import structlog

from chaos.errors import ChaosError
from holdfast_contract.wire import free_port

log = structlog.get_logger("chaos.broker")

MOSQUITTO_CANDIDATES = ("/usr/sbin/mosquitto", "mosquitto")


def mosquitto_binary() -> str:
    """$HOLDFAST_MOSQUITTO (a carried broker, see scripts/carry-mosquitto.sh), else the
    system's mosquitto."""
    carried = os.environ.get("HOLDFAST_MOSQUITTO")
    if carried:
        if not os.access(carried, os.X_OK):
            raise ChaosError(f"HOLDFAST_MOSQUITTO={carried} is not an executable file")
        return carried
    for candidate in MOSQUITTO_CANDIDATES:
        found = shutil.which(candidate)
        if found:
            return found
    raise ChaosError(
        "no mosquitto binary (looked for $HOLDFAST_MOSQUITTO, /usr/sbin/mosquitto and "
        "`mosquitto` on PATH); install mosquitto, or carry one (scripts/carry-mosquitto.sh)"
    )


class OwnBroker:
    """`async with OwnBroker(workdir) as broker:` ... `await broker.stop()`, `await broker.start()`."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.host = "127.0.0.1"
        self.conf = workdir / "mosquitto.conf"
        self.conf.write_text(
            f"listener {self.port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
            "log_dest stderr\nlog_type information\n"
        )
        self.proc: asyncio.subprocess.Process | None = None
        self._drain: asyncio.Task[None] | None = None

    async def __aenter__(self) -> OwnBroker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self, timeout: float = 10.0) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            mosquitto_binary(),
            "-c",
            str(self.conf),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            await asyncio.wait_for(self._listening(self.proc), timeout)
        except TimeoutError as exc:
            await self.stop()
            raise ChaosError(
                f"mosquitto did not listen on 127.0.0.1:{self.port} in {timeout}s"
            ) from exc
        self._drain = asyncio.create_task(_drain(self.proc))
        log.info("broker_started", port=self.port, pid=self.proc.pid)

    async def _listening(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stderr is not None
        seen: list[str] = []
        async for raw in proc.stderr:
            line = raw.decode(errors="replace").strip()
            seen.append(line)
            if line.endswith(" running"):
                return
        raise ChaosError(f"mosquitto exited before listening: {' | '.join(seen[-5:])}")

    async def stop(self) -> None:
        proc, self.proc = self.proc, None
        if self._drain is not None:
            self._drain.cancel()
            self._drain = None
        if proc is None or proc.returncode is not None:
            return
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 5.0)
        except TimeoutError:
            proc.kill()
            await proc.wait()
        log.info("broker_stopped", port=self.port)


async def _drain(proc: asyncio.subprocess.Process) -> None:
    if proc.stderr is not None:
        async for _ in proc.stderr:
            pass
