"""The health API: /health, /primary, /standby and /cluster as JSON over aiohttp, and
/metrics in the Prometheus text format (`supervisor.metrics`).

In a cluster (`fleet` given) /primary answers 200 only on the leader node, while it
leads, and /cluster adds the node's view of the cluster to the crew's status."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import msgspec
from aiohttp import web

from holdfast_contract.control import CrewStatus, FleetStatus
from supervisor.metrics import SupervisorMetrics


def _json(obj: object, status: int = 200) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(obj), status=status, content_type="application/json"
    )


class Fleet(Protocol):
    """This node in its cluster (`supervisor.fleet.node.Node`)."""

    def is_leader(self) -> bool: ...

    def status(self) -> FleetStatus: ...


class HealthApi:
    """Reads the crew through `snapshot`; never changes anything."""

    def __init__(
        self,
        snapshot: Callable[[], CrewStatus],
        metrics: SupervisorMetrics | None = None,
        fleet: Fleet | None = None,
    ) -> None:
        self._snapshot = snapshot
        self._metrics = metrics
        self._fleet = fleet

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
        if self._fleet is not None and not self._fleet.is_leader():
            fleet = self._fleet.status()
            return _json(
                {
                    "error": f"node {fleet.node} does not lead cluster {fleet.cluster}",
                    "leader": fleet.leader,
                    "leader_router": fleet.leader_router,
                    "epoch": st.epoch,
                },
                status=503,
            )
        for e in st.engines:
            if e.name == st.primary and e.state == "primary":
                return _json(e)
        return _json({"error": "no primary is serving", "epoch": st.epoch}, status=503)

    async def standby(self, _: web.Request) -> web.Response:
        ready = [e for e in self._snapshot().engines if e.state == "standby"]
        return _json(ready, status=200 if ready else 503)

    async def cluster(self, _: web.Request) -> web.Response:
        """The crew's status; in a cluster, with the node's cluster view on top (its
        `epoch` is the term's; the crew's own is `local_epoch`)."""
        st = self._snapshot()
        if self._fleet is None:
            return _json(st)
        crew = msgspec.to_builtins(st)
        fleet = msgspec.to_builtins(self._fleet.status())
        return _json({**crew, "local_epoch": st.epoch, **fleet})
