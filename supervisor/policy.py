"""The supervisor's policy schema: frozen structs, the only home of defaults, and the
rules between their fields (`semantic_errors`).

A policy file is read into a `Policy` by supervisor/policy_file.py (`load_policy`), which
also hands the engine kind its own section and applies its resolve and rules: the schema
keeps the kind's name (`EnginesSpec.kind`) and section but imports no kind
(supervisor/kinds/).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import msgspec

from holdfast_contract.command import FORKABLE, template_errors
from holdfast_contract.env import DEFAULT_HEARTBEAT_MS
from holdfast_contract.formats import Dtype, Quantization
from supervisor.fleet_spec import ClusterSpec, advertise_errors, cluster_errors
from supervisor.update.spec import UpdateSpec, update_errors


class _Spec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


class ModelSpec(_Spec, frozen=True):
    path: str | None = None  # HF checkpoint dir; relative to the policy file
    preset: Literal["tiny", "small", "llama-8b"] | None = None  # generated when path is unset
    seed: int = 0
    dtype: Dtype = "bfloat16"
    quantization: Quantization = "none"
    tp_size: int = 1


class DevicesSpec(_Spec, frozen=True):
    ids: list[str] = msgspec.field(default_factory=lambda: ["cpu"])  # one per tp rank
    memory_mb: int = 0  # per device, for batch admission; 0 = unlimited
    # per device: what holdfast may hold there, pools and engines together, as an update's
    # memory check counts it (supervisor/update/memory.py); 0: what the device says
    capacity_mb: int = 0


class CacheSpec(_Spec, frozen=True):
    backend: Literal["memfd", "cuda-vmm"] = "memfd"
    runtime_dir: str = "/tmp/holdfast-demo"
    keeper: bool = True
    verify: bool = True
    ready_timeout_s: float = 120.0
    spare: bool = True  # a hot spare daemon per rank takes over from escrow when one dies


class BatchSpec(_Spec, frozen=True):
    name: str = "batch"
    count: int = 1
    priority: int = 0  # lower is evicted first
    memory_mb: int = 0
    command: list[str] | None = None  # defaults to engines.command


class LoadSpec(_Spec, frozen=True):
    evict_above: int = 8  # primary in-flight requests that evict one batch engine
    respawn_below: int = 2  # ... and below which evicted batch engines come back
    respawn_hold_s: float = 1.0  # load must stay below respawn_below this long


class EnginesSpec(_Spec, frozen=True):
    # holdfast: `command` (the reference engine by default); vllm: vLLM API servers built
    # from `engines.vllm` (supervisor/kinds/vllm.py); each kind is registered in
    # supervisor/kinds/ (`registry`), which checks the name
    kind: str = "holdfast"
    # the kind's own section, `engines.<kind>` in the file, as the kind's type; set by
    # load_policy (supervisor/kinds/ `take_sections`), refused in the file
    section: Any = None
    command: list[str] = msgspec.field(default_factory=lambda: list(FORKABLE))
    env: dict[str, str] = msgspec.field(default_factory=dict)
    # fork engines from a process that has imported them already; None: whenever the
    # command is `{python} -m engine ...` (others are started with exec either way), and
    # for kind vllm (holdfast_vllm.forkserver in the vLLM venv)
    forkserver: bool | None = None
    # the reference engine's fork server's spares (engine/spare.py, engine/ready.py): auto,
    # a spare with its CUDA context and kernels loaded on CUDA devices; on, the same on any
    # device; ready, a spare that has built the whole engine (attached, KV cache, warm-up,
    # graphs) and holds an engine's memory while it waits; off, none. YAML reads a bare on
    # and off as true and false: those mean on and off here (`spares_mode`)
    spares: Literal["auto", "on", "ready", "off"] | bool = "auto"
    health: Literal["agent", "http"] = "agent"
    # the serving engines keep their KV cache in the keeper with a ledger of its streams; a
    # standby keeps only a small cache, and promoted after the primary's death, takes the
    # dead one's, so cut streams go on with no prefill of what was sent (engine/kvshare.py;
    # the reference engine on CPU devices; router.warm_every is then unused)
    kv_adopt: bool = False
    primary: int = 1
    standby: int = 1
    memory_mb: int = 0  # per primary/standby engine, beyond the shared weights
    ready_timeout_s: float = 120.0
    stop_grace_s: float = 2.0
    # the nice value of a promoted primary's threads (supervisor/priority.py); 0: unchanged
    primary_nice: int = -5
    port_base: int = 0  # 0: free ports, drawn below the ephemeral range (wire.free_port)
    batch: list[BatchSpec] = msgspec.field(default_factory=list)
    load: LoadSpec = msgspec.field(default_factory=LoadSpec)


class HeartbeatSpec(_Spec, frozen=True):
    interval_ms: int = DEFAULT_HEARTBEAT_MS
    miss_limit: int = 4
    # an engine still starting (CUDA context, kernels compiled) may be silent this long
    starting_silence_ms: int = 5000
    # a ready engine silent past interval x miss_limit whose threads are runnable (waiting
    # for a CPU on a busy machine) is fenced only once silent this long; a stopped or
    # blocked one is fenced at interval x miss_limit
    busy_silence_ms: int = 2000
    # how often the primary's processes are looked at for having begun to exit (a killed
    # CUDA process takes 100+ ms to finish exiting); 0: wait for the exit itself
    exit_poll_ms: int = 2
    # the exit watch's looks, and a promotion one sets off up to routed and told, run as
    # SCHED_FIFO (supervisor/realtime.py); needs root or CAP_SYS_NICE, else they run at
    # normal priority
    realtime_promotion: bool = True

    @property
    def miss_window_s(self) -> float:
        """How long a ready engine may stay silent before it is fenced (the hang window):
        interval_ms x miss_limit, in seconds."""
        return self.interval_ms * self.miss_limit / 1000


class RestartSpec(_Spec, frozen=True):
    initial_s: float = 0.05
    max_s: float = 5.0
    multiplier: float = 2.0
    jitter_s: float = 0.05
    max_restarts: int = 5  # more than this within window_s: quarantined
    window_s: float = 60.0


class RouterSpec(_Spec, frozen=True):
    listen: str = "127.0.0.1:8000"
    retry: bool = True
    retry_deadline_s: float = 5.0
    upstream_timeout_s: float = 300.0
    migration_limit: int = 3  # continuations of one cut stream; 0: none (a cut ends it)
    # keep each stream's past warm on the next standby every this many tokens, so a
    # continuation there prefills only what came after (reference engines); 0: never
    warm_every: int = 32


class ApiSpec(_Spec, frozen=True):
    listen: str = "127.0.0.1:8001"


class MqttSpec(_Spec, frozen=True):
    host: str = "127.0.0.1"
    port: int = 1883
    prefix: str = "holdfast"
    qos: Literal[0, 1, 2] = 1
    keepalive_s: int = 5


class EventsSpec(_Spec, frozen=True):
    mqtt: MqttSpec | None = None  # no MQTT when unset
    queue: int = 10000  # events kept while the broker is away; older ones are dropped


class LogSpec(_Spec, frozen=True):
    format: Literal["console", "json"] = "console"
    level: Literal["debug", "info", "warning", "error"] = "info"


class Policy(_Spec, frozen=True):
    model: ModelSpec = msgspec.field(default_factory=ModelSpec)
    devices: DevicesSpec = msgspec.field(default_factory=DevicesSpec)
    cache: CacheSpec = msgspec.field(default_factory=CacheSpec)
    engines: EnginesSpec = msgspec.field(default_factory=EnginesSpec)
    heartbeat: HeartbeatSpec = msgspec.field(default_factory=HeartbeatSpec)
    restart: RestartSpec = msgspec.field(default_factory=RestartSpec)
    router: RouterSpec = msgspec.field(default_factory=RouterSpec)
    api: ApiSpec = msgspec.field(default_factory=ApiSpec)
    events: EventsSpec = msgspec.field(default_factory=EventsSpec)
    log: LogSpec = msgspec.field(default_factory=LogSpec)
    update: UpdateSpec = msgspec.field(default_factory=UpdateSpec)  # `supervisor update`
    cluster: ClusterSpec | None = None  # several nodes electing one primary (docs/fleet.md)
    source: str = ""  # the file it came from; set by load_policy (a value in the file is ignored)


def semantic_errors(p: Policy, *, schema_only: bool = False) -> list[str]:
    """Cross-field rules msgspec cannot express, each naming the key to change; with
    `schema_only`, none that look at this machine's files. The engine kind's own rules are
    its `errors` (`policy_file.rule_errors` runs both)."""
    errors = _model_errors(p, schema_only) + _engine_errors(p.engines)
    if not schema_only:
        errors += _runtime_dir_errors(p.cache.runtime_dir)
    for path, value in (("$.router.listen", p.router.listen), ("$.api.listen", p.api.listen)):
        errors += _listen_errors(path, value)
    if p.router.listen == p.api.listen:
        errors.append("$.api.listen: same address as router.listen; give each its own port")
    for key in ("interval_ms", "miss_limit", "starting_silence_ms", "busy_silence_ms"):
        if getattr(p.heartbeat, key) < 1:
            errors.append(f"$.heartbeat.{key}: must be at least 1")
    if p.devices.capacity_mb < 0:
        errors.append("$.devices.capacity_mb: must be 0 (what the device says) or more")
    if p.heartbeat.exit_poll_ms < 0:
        errors.append("$.heartbeat.exit_poll_ms: must be 0 (off) or more")
    r = p.restart
    if r.initial_s <= 0 or r.max_s < r.initial_s or r.multiplier < 1 or r.jitter_s < 0:
        errors.append("$.restart: need 0 < initial_s <= max_s, multiplier >= 1, jitter_s >= 0")
    if r.max_restarts < 0 or r.window_s <= 0:
        errors.append("$.restart: need max_restarts >= 0 and window_s > 0")
    if p.events.queue < 1:
        errors.append("$.events.queue: must be at least 1")
    if not -20 <= p.engines.primary_nice <= 19:
        errors.append("$.engines.primary_nice: must be a nice value, -20..19 (0: unchanged)")
    if p.router.warm_every < 0:
        errors.append("$.router.warm_every: must be 0 (off) or more tokens")
    errors += kv_adopt_errors(p)
    errors += update_errors(p.update)
    if p.cluster is not None:
        errors += cluster_errors(p.cluster, p.heartbeat.miss_window_s)
        if not p.cluster.advertise:
            errors += advertise_errors(p.router.listen, "router.listen")
    return errors


def kv_adopt_errors(p: Policy) -> list[str]:
    """engines.kv_adopt needs what it is built on: the reference engine, CPU or CUDA
    devices, one rank, and the keeper."""
    if not p.engines.kv_adopt:
        return []
    why = []
    if p.engines.kind != "holdfast":
        why.append(f"engines.kind is {p.engines.kind!r}, not the reference engine")
    if any(d != "cpu" and not d.startswith("cuda") for d in p.devices.ids):
        why.append(f"devices.ids {list(p.devices.ids)} are not all cpu or cuda")
    if p.model.tp_size != 1:
        why.append(f"model.tp_size is {p.model.tp_size}, not 1")
    if not p.cache.keeper:
        why.append("cache.keeper is false")
    if spares_mode(p.engines) == "ready":  # built before it knows whose cache it holds
        why.append("engines.spares is ready")
    if not why:
        return []
    return [
        f"$.engines.kv_adopt: {'; '.join(why)}: the KV cache is shared only there; set it false"
    ]


def spares_mode(e: EnginesSpec) -> str:
    """engines.spares as engine.forkserver's --spares takes it (true: on, false: off)."""
    if isinstance(e.spares, bool):
        return "on" if e.spares else "off"
    return e.spares


def admission_cap_mb(p: Policy) -> int:
    """devices.memory_mb for the engines (0: no limit), less what a ready spare holds while
    it waits (`engines.spares: ready`: one engine's budget per device, the largest)."""
    cap, e = p.devices.memory_mb, p.engines
    if cap <= 0 or spares_mode(e) != "ready" or e.kind != "holdfast":
        return cap
    return max(cap - max([e.memory_mb, *(b.memory_mb for b in e.batch)]), 1)


def checkpoint_errors(path: Path, key: str = "$.model.path") -> list[str]:
    """What keeps model.path from being a checkpoint dir on this machine, if anything."""
    fix = "point it at a Hugging Face checkpoint dir (config.json + *.safetensors)"
    if not path.exists():
        return [f"{key}: {path} does not exist; {fix}"]
    if not path.is_dir():
        return [f"{key}: {path} is not a directory; {fix}"]
    if not (path / "config.json").is_file():
        return [f"{key}: {path} holds no config.json; {fix}"]
    if not any(path.glob("*.safetensors")):
        return [f"{key}: {path} holds no *.safetensors; {fix} with its weights"]
    return []


def _model_errors(p: Policy, schema_only: bool) -> list[str]:
    m = p.model
    errors: list[str] = []
    if m.path is None and m.preset is None:
        errors.append(
            "$.model: set model.path to a checkpoint dir, or model.preset to generate one"
        )
    if m.path is not None and not schema_only:
        errors += checkpoint_errors(Path(m.path))
    if m.tp_size < 1:
        errors.append("$.model.tp_size: must be at least 1")
    elif len(p.devices.ids) != m.tp_size:
        errors.append(
            f"$.devices.ids: {len(p.devices.ids)} devices for tp_size {m.tp_size}; "
            "list one device per rank"
        )
    return errors


def _runtime_dir_errors(run: str) -> list[str]:
    """cache.runtime_dir must be a directory, or be makeable as one: its nearest existing
    ancestor must be a directory."""
    path = Path(run)
    while not path.exists() and not path.is_symlink() and path != path.parent:
        path = path.parent
    if path.is_dir():
        return []
    what = "is" if str(path) == run else f"has {path} in it, which is"
    return [
        f"$.cache.runtime_dir: {run} {what} not a directory; set cache.runtime_dir to a "
        "directory (it is made when missing)"
    ]


def _engine_errors(e: EnginesSpec) -> list[str]:
    errors: list[str] = []
    if e.primary != 1:
        errors.append(f"$.engines.primary: got {e.primary}, must be 1 (one primary at a time)")
    if e.standby < 0:
        errors.append("$.engines.standby: must be 0 or more")
    if not e.command:
        errors.append("$.engines.command: empty; give the engine command as a list")
    errors += template_errors("$.engines.command", e.command)
    names = [b.name for b in e.batch]
    for i, b in enumerate(e.batch):
        if b.count < 0 or b.memory_mb < 0:
            errors.append(f"$.engines.batch[{i}]: count and memory_mb must be 0 or more")
        if not b.name.isidentifier() or names.count(b.name) > 1:
            errors.append(f"$.engines.batch[{i}].name: {b.name!r} must be a unique identifier")
        if b.command is not None:
            errors += template_errors(f"$.engines.batch[{i}].command", b.command)
    if e.load.respawn_below > e.load.evict_above:
        errors.append("$.engines.load.respawn_below: must not exceed evict_above")
    if not 0 <= e.port_base < 65000:
        errors.append("$.engines.port_base: must be 0 (OS-chosen) or a port below 65000")
    return errors


def _listen_errors(path: str, value: str) -> list[str]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        return [f"{path}: {value!r} is not HOST:PORT (like 127.0.0.1:8000)"]
    return []


def split_listen(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host, int(port)
