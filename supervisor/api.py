"""The health API: /health, /primary, /standby and /cluster as JSON over aiohttp, and
/metrics in the Prometheus text format (`supervisor.metrics`)."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
from aiohttp import web

from holdfast_contract.control import ClusterStatus
from supervisor.metrics import SupervisorMetrics


def _json(obj: object, status: int = 200) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(obj), status=status, content_type="application/json"
    )


class HealthApi:
    """Reads the cluster through `snapshot`; never changes anything."""

    def __init__(
        self, snapshot: Callable[[], ClusterStatus], metrics: SupervisorMetrics | None = None
    ) -> None:
        self._snapshot = snapshot
        self._metrics = metrics

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/primary", self.primary)
        app.router.add_get("/standby", self.standby)
        app.router.add_get("/cluster", self.cluster)
        if self._metrics is not None:
            app.router.add_get("/metrics", self._metrics.handle)
            app.cleanup_ctx.append(self._metrics.running)  # counts events while serving
        return app

    async def health(self, _: web.Request) -> web.Response:
        st = self._snapshot()
        return _json({"ok": True, "epoch": st.epoch, "primary": st.primary})

    async def primary(self, _: web.Request) -> web.Response:
        st = self._snapshot()
        for e in st.engines:
            if e.name == st.primary and e.state == "primary":
                return _json(e)
        return _json({"error": "no primary is serving", "epoch": st.epoch}, status=503)

    async def standby(self, _: web.Request) -> web.Response:
        ready = [e for e in self._snapshot().engines if e.state == "standby"]
        return _json(ready, status=200 if ready else 503)

    async def cluster(self, _: web.Request) -> web.Response:
        return _json(self._snapshot())
