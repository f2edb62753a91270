"""A mosquitto carried with its libraries (scripts/carry-mosquitto.sh) runs from its
wrapper with a bare environment, and the chaos suite's own broker can be that wrapper."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from pathlib import Path

import aiomqtt
import pytest

from chaos.broker import OwnBroker

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not Path("/usr/sbin/mosquitto").exists(), reason="needs mosquitto here")
def test_carried_mosquitto_serves_a_client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dest = tmp_path / "mqtt"
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "carry-mosquitto.sh"), str(dest)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    libs = {p.name.split(".so")[0] for p in (dest / "lib").iterdir()}
    assert "libssl" in libs and not libs & {"libc", "libm", "libresolv"}
    monkeypatch.setenv("HOLDFAST_MOSQUITTO", str(dest / "mosquitto"))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no system broker on the way
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    assert shutil.which("mosquitto", path=os.environ["PATH"]) is None

    async def roundtrip() -> bytes:
        broker = OwnBroker(tmp_path)
        async with broker, aiomqtt.Client(broker.host, broker.port, timeout=5.0) as client:
            await client.subscribe("holdfast-test/carry", qos=1)
            await client.publish("holdfast-test/carry", b"over the carried broker", qos=1)
            async for message in client.messages:
                return bytes(message.payload)  # type: ignore[arg-type]
        return b""

    assert asyncio.run(asyncio.wait_for(roundtrip(), 30)) == b"over the carried broker"
