"""A thin asyncio client for etcd v3 through its JSON gateway (`/v3/...`, etcd 3.4+).

Only what the election needs: leases (grant, keepalive, time to live, revoke), a put-if-absent
transaction, get (one key or a prefix), a delete guarded by the key's create revision, and
a watch from a revision. Every request has its own deadline; a connection failure moves on
to the next endpoint, and `EtcdUnavailable` names every endpoint tried. Wire replies are
decoded once, here, into the frozen structs of supervisor/fleet/gateway.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any, TypeVar

import aiohttp
import msgspec

from supervisor.fleet.errors import EtcdError, EtcdUnavailable, LeaseLost
from supervisor.fleet.gateway import (
    ErrorReply,
    Header,
    KeepAlive,
    KeyValue,
    Lease,
    Range,
    TimeToLive,
    Txn,
    WatchEvent,
    WatchFrame,
    b64,
    prefix_end,
    watch_result,
)

T = TypeVar("T")
__all__ = ["EtcdClient", "EtcdError", "EtcdUnavailable", "KeyValue", "LeaseLost", "WatchEvent"]
NOT_FOUND = 5  # gRPC status code etcd answers for a lease that does not exist (any more)


def _url(endpoint: str) -> str:
    return endpoint.rstrip("/") if "://" in endpoint else f"http://{endpoint}"


class EtcdClient:
    """`async with EtcdClient(["127.0.0.1:2379"]) as etcd: ...`"""

    def __init__(self, endpoints: list[str], *, timeout_s: float = 1.0) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoints; list at least one HOST:PORT")
        self.endpoints = [_url(e) for e in endpoints]
        self.timeout_s = timeout_s
        self._current = 0
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> EtcdClient:
        self._session = aiohttp.ClientSession()
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("EtcdClient used outside `async with`")
        return self._session

    async def _call(self, path: str, body: dict[str, Any], kind: type[T], timeout: float) -> T:
        """POST to each endpoint in turn, starting with the last one that answered."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        tried: list[str] = []
        count, start = len(self.endpoints), self._current
        for i in range(count):
            index = (start + i) % count
            left = deadline - loop.time()
            if left <= 0:
                break
            # one endpoint cut off must not eat the whole deadline: half of what is left,
            # all of it for the last one
            budget = left if i == count - 1 else left / 2
            url = self.endpoints[index] + path
            try:
                async with self.session.post(
                    url, json=body, timeout=aiohttp.ClientTimeout(total=budget)
                ) as resp:
                    data = await resp.read()
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                tried.append(f"{self.endpoints[index]} ({type(exc).__name__}: {exc})")
                self._current = (index + 1) % count  # the next call starts elsewhere
                continue
            self._current = index
            if resp.status != 200:
                err = msgspec.json.decode(data, type=ErrorReply, strict=False)
                raise EtcdError(f"etcd {path}: {err.message or err.error}", err.code)
            return msgspec.json.decode(data, type=kind, strict=False)
        raise EtcdUnavailable(
            f"etcd unreachable within {timeout:.2f} s: {'; '.join(tried) or 'no time left'}; "
            "check cluster.etcd and that etcd runs"
        )

    async def grant(self, ttl_s: int, *, timeout: float | None = None) -> tuple[int, int]:
        """A new lease: (id, granted TTL in seconds; etcd may raise a TTL to its minimum)."""
        reply = await self._call("/v3/lease/grant", {"TTL": ttl_s}, Lease, self._t(timeout))
        return reply.ID, reply.TTL

    async def keepalive(self, lease: int, *, timeout: float | None = None) -> int:
        """Renew `lease` once; its TTL again. LeaseLost if it has expired."""
        body = {"ID": str(lease)}
        reply = await self._call("/v3/lease/keepalive", body, KeepAlive, self._t(timeout))
        if reply.result.TTL <= 0:
            raise LeaseLost(f"etcd lease {lease:x} expired", NOT_FOUND)
        return reply.result.TTL

    async def time_to_live(self, lease: int, *, timeout: float | None = None) -> tuple[int, int]:
        """(remaining TTL in whole seconds rounded down, granted TTL) of `lease`; the
        remaining TTL is -1 once the lease is gone."""
        body = {"ID": str(lease)}
        reply = await self._call("/v3/lease/timetolive", body, TimeToLive, self._t(timeout))
        return reply.TTL, reply.grantedTTL

    async def revoke(self, lease: int, *, timeout: float | None = None) -> None:
        """Revoke `lease` (its keys are deleted); a lease already gone is not an error."""
        try:
            await self._call("/v3/lease/revoke", {"ID": str(lease)}, Header, self._t(timeout))
        except EtcdError as exc:
            if exc.code != NOT_FOUND or isinstance(exc, EtcdUnavailable):
                raise

    async def put(
        self, key: str, value: bytes, *, lease: int = 0, timeout: float | None = None
    ) -> int:
        """Put unconditionally; the new revision."""
        body = {"key": b64(key), "value": b64(value), "lease": str(lease)}
        reply = await self._call("/v3/kv/put", body, Range, self._t(timeout))
        return reply.header.revision

    async def _put_if(
        self, key: str, value: bytes, compare: dict[str, str], lease: int, timeout: float | None
    ) -> tuple[bool, KeyValue | None]:
        """Put `key` if `compare` (one etcd txn compare on it) holds: (put, the key as it
        now is, None if absent)."""
        k = b64(key)
        body = {
            "compare": [{"key": k, **compare}],
            "success": [
                {"request_put": {"key": k, "value": b64(value), "lease": str(lease)}},
                {"request_range": {"key": k}},
            ],
            "failure": [{"request_range": {"key": k}}],
        }
        reply = await self._call("/v3/kv/txn", body, Txn, self._t(timeout))
        kvs = [
            kv for part in reply.responses if part.response_range for kv in part.response_range.kvs
        ]
        return reply.succeeded, (kvs[-1] if kvs else None)

    async def _delete_if(self, key: str, compare: dict[str, str], timeout: float | None) -> bool:
        """Delete `key` if `compare` (one etcd txn compare on it) holds."""
        k = b64(key)
        body = {
            "compare": [{"key": k, **compare}],
            "success": [{"request_delete_range": {"key": k}}],
        }
        reply = await self._call("/v3/kv/txn", body, Txn, self._t(timeout))
        return reply.succeeded

    async def put_if_absent(
        self, key: str, value: bytes, *, lease: int = 0, timeout: float | None = None
    ) -> tuple[bool, KeyValue]:
        """Create `key` only if it does not exist: (created, the key as it now is)."""
        absent = {"target": "CREATE", "create_revision": "0"}
        created, kv = await self._put_if(key, value, absent, lease, timeout)
        if kv is None:  # deleted again between the put and the range of the same txn: impossible
            raise EtcdError(f"etcd txn on {key} returned no key")
        return created, kv

    async def put_if_unchanged(
        self,
        key: str,
        value: bytes,
        mod_revision: int,
        *,
        lease: int = 0,
        timeout: float | None = None,
    ) -> tuple[bool, KeyValue | None]:
        """Put `key` only if it is still the version written at `mod_revision` (a put
        keeps its create revision and moves its mod revision): (put, the key as it now
        is, None if absent)."""
        unchanged = {"target": "MOD", "mod_revision": str(mod_revision)}
        return await self._put_if(key, value, unchanged, lease, timeout)

    async def get(self, key: str, *, timeout: float | None = None) -> KeyValue | None:
        reply = await self._call("/v3/kv/range", {"key": b64(key)}, Range, self._t(timeout))
        return reply.kvs[0] if reply.kvs else None

    async def get_prefix(
        self, prefix: str, *, timeout: float | None = None
    ) -> tuple[int, list[KeyValue]]:
        """Every key under `prefix`, and the store revision they were read at."""
        body = {"key": b64(prefix), "range_end": prefix_end(prefix)}
        reply = await self._call("/v3/kv/range", body, Range, self._t(timeout))
        return reply.header.revision, reply.kvs

    async def delete_if_created(
        self, key: str, create_revision: int, *, timeout: float | None = None
    ) -> bool:
        """Delete `key` only if it is still the one created at `create_revision`."""
        created = {"target": "CREATE", "create_revision": str(create_revision)}
        return await self._delete_if(key, created, timeout)

    async def delete_if_unchanged(
        self, key: str, mod_revision: int, *, timeout: float | None = None
    ) -> bool:
        """Delete `key` only if it is still the version written at `mod_revision`."""
        unchanged = {"target": "MOD", "mod_revision": str(mod_revision)}
        return await self._delete_if(key, unchanged, timeout)

    async def delete_if_leased(self, key: str, lease: int, *, timeout: float | None = None) -> bool:
        """Delete `key` only if it is attached to `lease`."""
        return await self._delete_if(key, {"target": "LEASE", "lease": str(lease)}, timeout)

    async def delete(self, key: str, *, timeout: float | None = None) -> None:
        await self._call("/v3/kv/deleterange", {"key": b64(key)}, Header, self._t(timeout))

    async def watch(self, prefix: str, start_revision: int) -> AsyncIterator[WatchEvent]:
        """Events on keys under `prefix` from `start_revision` on, until the stream breaks
        (EtcdUnavailable) or the revision was compacted (EtcdError). No deadline: the
        caller owns the task and cancels it."""
        body = {
            "create_request": {
                "key": b64(prefix),
                "range_end": prefix_end(prefix),
                "start_revision": str(start_revision),
            }
        }
        url = self.endpoints[self._current] + "/v3/watch"
        try:
            async with self.session.post(
                url, json=body, timeout=aiohttp.ClientTimeout(total=None, connect=self.timeout_s)
            ) as resp:
                async for line in resp.content:
                    if not line.strip():
                        continue
                    frame = msgspec.json.decode(line, type=WatchFrame, strict=False)
                    result = watch_result(frame, prefix)
                    for event in result.events:
                        yield event
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise EtcdUnavailable(f"etcd watch on {url} broke: {type(exc).__name__}") from exc
        raise EtcdUnavailable(f"etcd watch on {url} ended")

    def _t(self, timeout: float | None) -> float:
        return self.timeout_s if timeout is None else timeout
