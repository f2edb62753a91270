"""The engine's HTTP face (aiohttp): completions, embeddings, health, metrics, and drain.

The model runs on its own thread (`engine.batcher`: many requests per step; or one at a
time for `--model-impl hf`); the event loop only parses, validates, submits and streams.
A request past the engine's waiting bound gets 503 with Retry-After: busy, not broken. Every response carries X-Holdfast-Engine/-Epoch/-Role so a
client (or the chaos suite) can tell which engine, under which epoch, answered.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import structlog
from aiohttp import web

from engine import api, chat
from engine.api import InvalidField
from engine.batcher import Post
from engine.errors import BadRequest, QueueFull, Unavailable
from engine.job import Generation, Job, OnStep, Stats, Step
from engine.metrics import Live, Metrics
from engine.replies import ChatReply, CompletionReply, Reply
from engine.tokenizer import Tokenizer
from holdfast_contract.control import KEPT_HEADER, SMOKE_HEADER, VERSION_HEADER

log = structlog.get_logger("engine.server")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ENDED_EARLY = "generation ended after its client left"


class Model(Protocol):
    kind: str  # "generate" | "embed"
    post: Post  # how the model thread hands callbacks to the event loop

    def start(self) -> None: ...

    def submit(
        self, job: Job, on_step: OnStep | None = None, cancel: threading.Event | None = None
    ) -> concurrent.futures.Future[Generation]: ...

    def embed(self, batch: list[list[int]]) -> list[list[float]]: ...

    def wake(self) -> None: ...

    def stats(self) -> Stats: ...

    @property
    def warms(self) -> bool: ...  # whether `warm` keeps prefixes

    def warm(self, key: str, prompt: tuple[int, ...]) -> concurrent.futures.Future[Generation]: ...

    def forget(self, key: str) -> bool: ...

    def follow(self) -> int: ...

    def stop_followers(self) -> None: ...


class EngineServer:
    def __init__(
        self,
        name: str,
        role: str,
        epoch: int,
        model: Model,
        tokenizer: Tokenizer | None,
        limits: api.Limits,
        metrics: Metrics,
        model_id: str = "",
    ) -> None:
        self.name, self.role, self.epoch = name, role, epoch
        self.model_id = model_id or name  # what /v1/models lists and replies name
        self.model, self.tokenizer, self.limits, self.metrics = model, tokenizer, limits, metrics
        self.state = "starting"
        self.version = ""  # the model version it serves since its last refit ("": as started)
        self.holding: asyncio.Event | None = None  # set when a refit that holds requests ends
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.on_state: Callable[[str], None] = lambda state: None
        self._streams: set[asyncio.Future[Any]] = set()
        # requests generating now, and what stops each: `cut` closes them (a refit's)
        self._generating: dict[int, tuple[web.Request, threading.Event]] = {}
        metrics.bind(self.live)

    # ---- lifecycle ----
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors], client_max_size=16 << 20)
        app.on_response_prepare.append(self._stamp)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_post("/holdfast/warm", self.warm)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_text)
        return app

    @property
    def queued(self) -> int:
        """Requests accepted that wait for the KV cache (or, one at a time, for the model)."""
        return self.model.stats().waiting

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Model-thread callbacks (tokens, ends) run on this loop, one wakeup per step."""
        self.model.post = loop.call_soon_threadsafe

    def set_state(self, state: str) -> None:
        self.state = state
        log.info("state", engine=self.name, role=self.role, epoch=self.epoch, state=state)
        self.on_state(state)

    def ready(self) -> None:
        self.set_state("ready" if self.role == "standby" else "serving")

    def promote(self, epoch: int) -> None:
        self.role, self.epoch = "primary", epoch
        log.info("promoted", engine=self.name, epoch=epoch)
        if self.state not in ("draining", "refitting"):
            self.set_state("serving")

    async def idle(self, within_s: float) -> bool:
        """Whether every request in flight ends within `within_s`."""
        try:
            await asyncio.wait_for(self._idle.wait(), within_s)
        except TimeoutError:
            return False
        return True

    def cut(self) -> int:
        """Close the connection of every request generating now and stop its generation
        before the next step: the router sees each cut where it is (a stream after the
        tokens it sent, a collected answer with nothing) and answers it elsewhere. How many
        were cut."""
        cut = list(self._generating.values())
        for request, cancel in cut:
            cancel.set()
            if request.transport is not None:
                request.transport.abort()
        if cut:
            self.model.wake()
            log.info("requests cut", engine=self.name, count=len(cut))
        return len(cut)

    async def drain(self, grace_s: float) -> bool:
        """Stop taking requests; wait up to grace_s for in-flight ones. True if all finished."""
        self.set_state("draining")
        try:
            await asyncio.wait_for(self._idle.wait(), grace_s)
        except TimeoutError:
            log.warning("drain grace ran out", engine=self.name, in_flight=self.in_flight)
            return False
        return True

    def start(
        self, job: Job, on_step: OnStep | None, cancel: threading.Event
    ) -> asyncio.Future[Generation]:
        """Submit a request to the model now (QueueFull and BadRequest raise here, before
        any reply is started). It counts as in flight until the model is done with it, even
        if its client leaves first: then `cancel` is set, and the model drops it before
        its next step."""
        fut = asyncio.wrap_future(self.model.submit(job, on_step, cancel))
        self._begin()
        fut.add_done_callback(self._end)
        return fut

    async def generate(
        self, job: Job, on_step: OnStep | None = None, cancel: threading.Event | None = None
    ) -> Generation:
        cancel = cancel if cancel is not None else threading.Event()
        fut = self.start(job, on_step, cancel)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            cancel.set()
            self.model.wake()
            log.info("client went away", stream=False)
            fut.add_done_callback(self._ended_early)
            raise

    async def call_model(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a blocking model call (embeddings, a group stop) off the event loop."""
        self._begin()
        try:
            return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
        finally:
            self._end(None)

    def _begin(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def _end(self, _: object) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    # ---- middleware ----
    async def _stamp(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers["X-Holdfast-Engine"] = self.name
        response.headers["X-Holdfast-Epoch"] = str(self.epoch)
        response.headers["X-Holdfast-Role"] = self.role
        if self.version:  # refitted: the version it serves, which the router passes on
            response.headers[VERSION_HEADER] = self.version

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            response = await handler(request)
        except QueueFull as e:
            response = _error(503, str(e), "overloaded")
            response.headers["Retry-After"] = str(e.retry_after_s)
        except BadRequest as e:
            response = _error(400, str(e), "invalid_request_error", getattr(e, "param", None))
        except Unavailable as e:
            response = _error(503, str(e), "unavailable")
        except web.HTTPException as e:
            response = _error(e.status, e.reason, "invalid_request_error")
        except Exception as e:  # a bug, not the client's fault: say so, keep serving
            log.exception("request failed", path=request.path)
            response = _error(500, f"internal error: {type(e).__name__}: {e}", "internal_error")
        self.metrics.count(response.status)
        return response

    async def _past_refit(self) -> None:
        """A request that comes while this engine refits where it serves (`holding`: no
        standby took its place) waits for the swap, then is served by the new weights."""
        holding = self.holding
        if holding is not None:
            await holding.wait()

    def _check_serving(self, kind: str, request: web.Request | None = None) -> None:
        """Refuse a request this engine does not serve now. A standby answers an update's
        smoke request (the SMOKE_HEADER), which the supervisor sends it before it may be
        promoted."""
        if self.state in ("draining", "refitting"):
            raise Unavailable(f"engine {self.name} is {self.state} and takes no new requests")
        if self.state == "starting":
            raise Unavailable(f"engine {self.name} is still starting")
        if self.role == "standby" and (request is None or SMOKE_HEADER not in request.headers):
            raise Unavailable(
                f"engine {self.name} is a standby: it serves once promoted "
                f"(`supervisor promote {self.name}`)"
            )
        if self.model.kind != kind:
            what = (
                "/v1/embeddings"
                if self.model.kind == "embed"
                else "/v1/completions and /v1/chat/completions"
            )
            raise BadRequest(f"this model serves {what} only")

    # ---- handlers ----
    async def health(self, request: web.Request) -> web.Response:
        ok = self.state in ("ready", "serving", "refitting")
        body = {
            "name": self.name,
            "role": self.role,
            "epoch": self.epoch,
            "state": self.state,
            "in_flight": self.in_flight,
            "weights": self.metrics.weights_source,
        }
        return web.json_response(body, status=200 if ok else 503)

    def live(self) -> Live:
        """What /metrics reads at each scrape."""
        return Live(self.name, self.role, self.epoch, self.in_flight, self.model.stats())

    async def metrics_text(self, request: web.Request) -> web.Response:
        body = self.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": self.metrics.CONTENT_TYPE})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        await self._past_refit()
        self._check_serving("generate", request)
        req = api.decode_body(await request.read(), api.CompletionRequest)
        prompt, max_tokens = api.completion_prompt(req, self.tokenizer, self.limits)
        job = Job(
            tuple(prompt),
            max_tokens,
            req.logprobs or 0,
            req.ignore_eos,
            req.holdfast_warm,
            req.holdfast_kv,
        )
        out = CompletionReply(
            self.model_id,
            self.tokenizer,
            api.stops(req.stop),
            req.logprobs is not None,
            req.skip_special_tokens,
        )
        if req.return_token_ids:
            out.prompt_ids = list(prompt)
        if req.stream:
            return await self._stream(request, job, out)
        return web.json_response(await self._generate(request, job, out))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        await self._past_refit()
        self._check_serving("generate")
        req = api.decode_body(await request.read(), chat.ChatRequest)
        prompt, max_tokens = chat.chat_prompt(req, self.tokenizer, self.limits)
        job = Job(tuple(prompt), max_tokens, 0, req.ignore_eos, kv_key=req.holdfast_kv)
        out = ChatReply(self.model_id, self.tokenizer, api.stops(req.stop))
        if req.return_token_ids:
            out.prompt_ids = list(prompt)
        if req.stream:
            usage = req.stream_options is not None and req.stream_options.include_usage
            return await self._stream(request, job, out, usage)
        return web.json_response(await self._generate(request, job, out))

    async def warm(self, request: web.Request) -> web.Response:
        """Keep a stream's past warm here (a standby, or any engine ready), so that its
        continuation, if this engine is promoted, prefills only what came after
        (engine/scheduler.py). Not counted in flight: a standby warming is still idle."""
        if self.state not in ("ready", "serving"):
            raise Unavailable(f"engine {self.name} is {self.state} and keeps nothing warm")
        req = api.decode_body(await request.read(), api.WarmRequest)
        if req.forget:
            return web.json_response({"key": req.key, "forgotten": self.model.forget(req.key)})
        if not req.key:
            raise InvalidField("`key` is empty; name the stream to keep warm", "key")
        api.check_ids(req.prompt, self.limits, "prompt")
        if len(req.prompt) >= self.limits.max_model_len:
            raise InvalidField(
                f"`prompt` has {len(req.prompt)} tokens; this engine's context is "
                f"{self.limits.max_model_len}",
                "prompt",
            )
        t0 = time.perf_counter()
        gen = await asyncio.wrap_future(self.model.warm(req.key, tuple(req.prompt)))
        if gen.finish_reason == "cancelled":
            raise Unavailable(
                f"the prefill of {req.key}'s past was cancelled (its continuation came, "
                "it was forgotten, or the weights were refitted): no more of it is kept"
            )
        ms = round((time.perf_counter() - t0) * 1e3, 2)
        return web.json_response({"key": req.key, "kept": len(req.prompt), "ms": ms})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(chat.models_body(self.model_id))

    async def _generate(self, request: web.Request, job: Job, out: Reply) -> dict[str, Any]:
        """One generation, not streamed: the reply's body. A stop string cancels it."""
        t0 = time.perf_counter()
        cancel = threading.Event()

        def on_step(step: Step) -> None:
            out.feed(step.token)
            if out.stopped:
                cancel.set()

        self._generating[id(request)] = (request, cancel)
        try:
            gen = await self.generate(job, on_step if out.stop else None, cancel)
        finally:
            self._generating.pop(id(request), None)
        self.metrics.add_tokens(len(gen.steps))
        log.info(
            "completion",
            prompt=len(job.prompt),
            tokens=len(gen.steps),
            ms=round((time.perf_counter() - t0) * 1e3, 1),
        )
        return out.body(gen)

    async def _stream(
        self, request: web.Request, job: Job, out: Reply, usage: bool = False
    ) -> web.StreamResponse:
        """A continuation (`job.warm_key`) answers with its first token: its KEPT_HEADER
        says how many prompt positions a kept past spared its prefill, known only once
        it is admitted (a warm prefill of its past running then is taken over when it
        ends)."""
        steps: asyncio.Queue[Step | None] = asyncio.Queue()
        cancel = threading.Event()  # set when the client leaves: the model stops next step
        task = self.start(job, steps.put_nowait, cancel)
        task.add_done_callback(lambda _: steps.put_nowait(None))
        self._generating[id(request)] = (request, cancel)
        task.add_done_callback(lambda _: self._generating.pop(id(request), None))
        self._streams.add(task)  # owned here until done, even after the client leaves
        task.add_done_callback(self._streams.discard)
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        counted = False
        try:
            first = [await steps.get()] if job.warm_key else []
            if first and first[0] is not None:
                resp.headers[KEPT_HEADER] = str(first[0].kept)
            await resp.prepare(request)
            for body in out.start():
                await _sse(resp, body)
            while (step := first.pop() if first else await steps.get()) is not None:
                if out.stopped:  # a stop string ended it; the model stops next step
                    continue
                piece = out.feed(step.token)
                if out.stopped:
                    cancel.set()
                for body in out.chunk(piece, step.token):
                    await _sse(resp, body)
            gen: Generation = await task
            self.metrics.add_tokens(len(gen.steps))
            counted = True
            for body in out.end(gen, usage):
                await _sse(resp, body)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            log.info("client went away", stream=True, tokens=len(out.ids))
        finally:
            if not counted:  # the client left (or the handler was cancelled) mid-generation
                cancel.set()
                self.model.wake()
                task.add_done_callback(self._ended_early)
        return resp

    def _ended_early(self, task: asyncio.Future[Generation]) -> None:
        """The generation of a request whose client left, once the model stopped."""
        if not task.cancelled() and task.exception() is None:
            gen = task.result()
            self.metrics.add_tokens(len(gen.steps))
            log.info(ENDED_EARLY, tokens=len(gen.steps), reason=gen.finish_reason)

    async def embeddings(self, request: web.Request) -> web.Response:
        await self._past_refit()
        self._check_serving("embed")
        req = api.decode_body(await request.read(), api.EmbeddingRequest)
        batch = api.embedding_inputs(req, self.tokenizer, self.limits)
        vectors: list[list[float]] = await self.call_model(self.model.embed, batch)
        tokens = sum(map(len, batch))
        data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)]
        return web.json_response(
            {
                "object": "list",
                "data": data,
                "model": self.model_id,  # as /v1/models lists it
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )


def _error(status: int, message: str, kind: str, param: str | None = None) -> web.Response:
    """OpenAI's error shape."""
    error = {"message": message, "type": kind, "param": param, "code": None}
    return web.json_response({"error": error}, status=status)


async def _sse(resp: web.StreamResponse, body: dict[str, Any]) -> None:
    await resp.write(b"data: " + json.dumps(body).encode() + b"\n\n")
