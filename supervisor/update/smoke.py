"""An update's smoke request: one completion (the policy's `update.smoke`) that a new
version's standby must answer with HTTP 200 before it may take the primary's place. Sent
to the engine's own port with `SMOKE_HEADER`, which a standby answers (the router never
sends it there)."""

from __future__ import annotations

import aiohttp

from holdfast_contract.control import SMOKE_HEADER
from supervisor.errors import SupervisorError
from supervisor.units import Engine
from supervisor.update.spec import SmokeSpec


class SmokeFailed(SupervisorError):
    """The new version did not answer the smoke request with 200."""


async def smoke(e: Engine, spec: SmokeSpec) -> None:
    """Raise SmokeFailed unless `e` answers the smoke completion with 200 (bounded by the
    caller's deadline, update.ready_timeout_s)."""
    body = {"prompt": spec.prompt, "max_tokens": spec.max_tokens}
    url = f"http://127.0.0.1:{e.port}/v1/completions"
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.post(url, json=body, headers={SMOKE_HEADER: "1"}) as up,
        ):
            text = (await up.read()).decode(errors="replace")[:300]
            status = up.status
    except (aiohttp.ClientError, OSError) as err:
        raise SmokeFailed(f"the smoke request to {e.name} failed: {err}") from err
    if status != 200:
        raise SmokeFailed(
            f"{e.name} (version {e.version}) answered the smoke request (update.smoke) "
            f"with {status}: {text}"
        )
