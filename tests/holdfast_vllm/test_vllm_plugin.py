"""The holdfast_vllm loader plugin.

Tests marked `vllm` drive real vLLM (the venv of scripts/install-vllm.sh) as a subprocess
attached to real cache daemons: greedy tokens equal transformers' generate for a Llama and a
Qwen2 with tied embeddings, a daemon that serves another checkpoint gives the fingerprint
diff and a disk load (or, with fallback false, an error that names the fields). The others
need no vLLM: the loader's options, the fingerprint it asks for, and how a pool's tensors are
placed into a model whose weights were built on meta (the part shared with the CUDA path).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, Daemons

from cachedaemon.config import default_backend
from holdfast_vllm import identity, placement
from holdfast_vllm.errors import PluginError
from holdfast_vllm.options import LoaderOptions, parse
from tests.identity_checkpoints import changed_copy, copy_of

VENV = Path(os.environ.get("HOLDFAST_VLLM_VENV", "/opt/holdfast/vllm-venv"))
VLLM_PYTHON = VENV / "bin" / "python"
needs_vllm = pytest.mark.skipif(
    not VLLM_PYTHON.exists(),
    reason=f"vLLM is not installed ({VLLM_PYTHON} is absent): run bash scripts/install-vllm.sh",
)
PROMPTS = [
    "holdfast keeps the weights",
    "When the primary dies,",
    "Hello world! How are",
    "Tokens are pieces of words",
]
NEW_TOKENS = 16


# -- options: no vLLM, no torch ----------------------------------------------------------


def test_options_default_to_holdfast_daemons_one_socket_per_rank() -> None:
    opts = parse({}, {"HOLDFAST_DAEMONS": "/r/daemon-0.sock,/r/daemon-1.sock"})
    assert opts == LoaderOptions(sockets=("/r/daemon-0.sock", "/r/daemon-1.sock"))
    assert opts.socket_for(1, 2) == "/r/daemon-1.sock"
    assert parse({"sockets": "/a.sock"}, {}).sockets == ("/a.sock",)  # one path, not a list
    with pytest.raises(PluginError, match="2 daemon socket.*tensor-parallel size 4"):
        opts.socket_for(0, 4)


def test_a_refusal_recorded_in_a_child_is_the_owners_last_line() -> None:
    """As when the EngineCore refuses and the API server then reports its failure."""
    child = "from holdfast_vllm import refusal; refusal.record('model.safetensors: differs')"
    code = (
        "import subprocess, sys\n"
        "from holdfast_vllm import refusal\n"
        "refusal.arm()\n"
        f"subprocess.run([sys.executable, '-c', {child!r}], check=True)\n"
        "raise RuntimeError('Engine core initialization failed. See root cause above.')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "HOLDFAST_VLLM_REFUSAL"}
    env["PYTHONPATH"] = str(REPO)
    cp = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    lines = cp.stderr.strip().splitlines()
    assert cp.returncode == 1, cp.stderr
    assert lines[-1] == "holdfast: the weights were not attached: model.safetensors: differs"
    assert lines[-2].startswith("RuntimeError: Engine core initialization failed")


def test_verify_defaults_to_holdfast_verify_and_the_config_wins() -> None:
    assert parse({"sockets": ["/a"]}, {}).verify == "stat"
    assert parse({"sockets": ["/a"]}, {"HOLDFAST_VERIFY": "content"}).verify == "content"
    extra = {"sockets": ["/a"], "verify": "stat"}
    assert parse(extra, {"HOLDFAST_VERIFY": "content"}).verify == "stat"


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({}, "needs the daemon sockets"),
        ({"sockets": ["/a"], "mode": "zerocopy"}, "zero_copy or copy"),
        ({"sockets": ["/a"], "fallbak": True}, "fallbak"),
        ({"sockets": ["/a"], "timeout_s": 0}, "timeout_s must be > 0"),
        ({"sockets": ["/a"], "verify": "sha256"}, "verify.*stat or content"),
    ],
)
def test_bad_options_say_which_key_to_fix(extra: dict[str, Any], says: str) -> None:
    with pytest.raises(PluginError, match=says):
        parse(extra, {})


# -- the fingerprint asked for, on CPU and CUDA --------------------------------------------


def test_identity_names_dtype_and_device_as_a_daemon_does(tmp_path: Path) -> None:
    assert identity.dtype_name(torch.bfloat16) == "bfloat16"
    with pytest.raises(PluginError, match="--dtype float32, bfloat16 or float16"):
        identity.dtype_name(torch.float64)
    assert identity.device_name(torch.device("cpu")) == "cpu"
    assert identity.device_name(torch.device("cuda")) == "cuda:0"  # no GPU needed for this
    assert identity.device_name(torch.device("cuda", 3)) == "cuda:3"
    assert default_backend(identity.device_name(torch.device("cuda", 3))) == "cuda-vmm"
    with pytest.raises(PluginError, match="not xpu"):
        identity.device_name(torch.device("xpu"))
    with pytest.raises(PluginError, match="not a local checkpoint dir"):
        identity.cache_config("Qwen/Qwen2-0.5B", torch.float32, 0, 1, torch.device("cpu"))


def test_identity_differs_by_tp_rank(tiny_model: Path) -> None:
    cpu = torch.device("cpu")
    rank0 = identity.cache_config(tiny_model, torch.float32, 0, 2, cpu)
    rank1 = identity.cache_config(tiny_model, torch.float32, 1, 2, cpu)
    assert rank0.diff(rank1) == ["tp_rank"]


# -- placement: a pool's tensors into a model built with its weights on meta ---------------


class Fused(torch.nn.Module):
    """A model shaped like vLLM's: a fused qkv parameter the checkpoint holds in parts, a
    tied head, a norm's ones, and a scale buffer its init computes."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Parameter(torch.empty(8, 4), requires_grad=False)
        self.embed.weight_loader = "kept"  # type: ignore[attr-defined]  # vLLM's attributes
        self.qkv = torch.nn.Parameter(torch.empty(12, 4), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.ones(4), requires_grad=False)
        self.head = torch.nn.Module()
        self.head.weight = self.embed  # tied by object
        self.register_buffer("_k_scale", torch.tensor(1.0))

    def load_weights(self, weights: Any) -> set[str]:
        parts = dict(weights)
        self.qkv.copy_(torch.cat([parts["q"], parts["k"], parts["v"]]))
        return {"qkv"}


def _pool() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    names = {"embed": (8, 4), "norm": (4,), "q": (4, 4), "k": (4, 4), "v": (4, 4)}
    return {n: torch.randn(s) for n, s in names.items()} | {"_k_scale": torch.tensor(2.0)}


def test_weights_land_on_meta_what_init_computes_stays_real() -> None:
    with torch.device("cpu"), placement.WeightsOnMeta():
        model = Fused()
    assert model.embed.is_meta and model.qkv.is_meta
    assert not model.norm.is_meta and not model._k_scale.is_meta
    assert model.head.weight is model.embed


@pytest.mark.parametrize("zero_copy", [True, False])
def test_place_shares_matching_parameters_copies_buffers_loads_the_rest(zero_copy: bool) -> None:
    with placement.WeightsOnMeta():
        model = Fused()
    pool = _pool()
    placed = placement.place(model, pool, zero_copy=zero_copy, device=torch.device("cpu"))
    if zero_copy:
        assert set(placed.shared) == {"embed", "norm"}
        assert model.embed.data_ptr() == pool["embed"].data_ptr()  # a view, no copy
        assert set(placed.rest) == {"q", "k", "v"}
    else:
        assert placed.shared == () and set(placed.rest) == {"embed", "norm", "q", "k", "v"}
    assert model.head.weight is model.embed  # the tie survives
    assert model.embed.weight_loader == "kept"  # type: ignore[attr-defined]
    assert model._k_scale.data_ptr() != pool["_k_scale"].data_ptr()  # engine-owned
    assert model._k_scale.item() == 2.0
    loaded = model.load_weights((n, pool[n]) for n in placed.rest)
    if not zero_copy:
        model.embed.copy_(pool["embed"])
        model.norm.copy_(pool["norm"])
        loaded |= {"embed", "norm"}
    placement.check_loaded(placed, loaded | set(placed.shared), model)
    assert torch.equal(model.qkv, torch.cat([pool["q"], pool["k"], pool["v"]]))
    assert torch.equal(model.head.weight, pool["embed"])


def test_a_parameter_the_pool_cannot_fill_is_an_error() -> None:
    with placement.WeightsOnMeta():
        model = Fused()
    pool = {n: t for n, t in _pool().items() if n not in ("q", "k", "v")}
    placed = placement.place(model, pool, zero_copy=True, device=torch.device("cpu"))
    with pytest.raises(PluginError, match="got no tensor from the pool.*'qkv'"):
        placement.check_loaded(placed, set(placed.shared), model)


# -- real vLLM -------------------------------------------------------------------------------


class Checkpoints:
    def __init__(self, root: Path, daemons: Daemons) -> None:
        from tests.vllm_checkpoints import causal_lm_checkpoint

        self.root = root
        self.dirs = {a: causal_lm_checkpoint(root / a, a) for a in ("llama", "qwen2")}
        self.dirs["other"] = causal_lm_checkpoint(root / "other", "llama", layers=3)
        procs = [
            daemons(d, root / f"run-{a}", "--dtype", "float32", wait=False)
            for a, d in self.dirs.items()
        ]
        for p in procs:
            p.wait_serving()

    def socket(self, name: str) -> str:
        return str(self.root / f"run-{name}" / "daemon-0.sock")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory, module_daemons: Daemons) -> Checkpoints:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"vLLM is not installed ({VLLM_PYTHON} is absent)")
    return Checkpoints(tmp_path_factory.mktemp("vllm"), module_daemons)


def prompt_ids(model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [list(tok(p)["input_ids"]) for p in PROMPTS]


def transformers_tokens(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy continuations from transformers' generate, one prompt at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for ids in prompts:
            gen = model.generate(
                torch.tensor([ids]),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                pad_token_id=0,
            )
            out.append(gen[0, len(ids) :].tolist())
    return out


def run_vllm(
    model_dir: Path, extra: dict[str, Any], prompts: list[list[int]], tmp: Path
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CACHE_ROOT=str(tmp / "vllm-cache"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    env.pop("HOLDFAST_DAEMONS", None)
    argv = [
        str(VLLM_PYTHON),
        str(REPO / "tests" / "programs" / "vllm_generate.py"),
        str(model_dir),
        "holdfast",
        json.dumps(extra),
        json.dumps(prompts),
        str(NEW_TOKENS),
    ]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900, cwd=tmp)


def tokens_of(cp: subprocess.CompletedProcess[str]) -> list[list[int]]:
    lines = [x for x in cp.stdout.splitlines() if x.startswith('{"tokens"')]
    assert cp.returncode == 0 and lines, cp.stdout[-3000:] + cp.stderr[-3000:]
    tokens: list[list[int]] = json.loads(lines[-1])["tokens"]
    return tokens


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize(("arch", "mode"), [("llama", "zero_copy"), ("qwen2", "copy")])
def test_greedy_tokens_equal_transformers(
    ckpts: Checkpoints, arch: str, mode: str, tmp_path: Path
) -> None:
    model_dir = ckpts.dirs[arch]
    prompts = prompt_ids(model_dir)
    want = transformers_tokens(model_dir, prompts)
    assert len({tuple(t) for t in want}) == len(PROMPTS), "prompts that all give one answer"
    extra = {"sockets": [ckpts.socket(arch)], "mode": mode, "layout": "reference"}
    cp = run_vllm(model_dir, extra, prompts, tmp_path)
    assert tokens_of(cp) == want
    out = cp.stdout + cp.stderr
    assert "weights attached" in out and f"mode={mode}" in out
    assert "loading from disk" not in out


@pytest.mark.vllm
@needs_vllm
def test_another_checkpoints_daemon_falls_back_with_the_diff(
    ckpts: Checkpoints, tmp_path: Path
) -> None:
    model_dir = ckpts.dirs["llama"]
    prompts = prompt_ids(model_dir)
    extra = {"sockets": [ckpts.socket("other")], "fallback": True, "layout": "reference"}
    cp = run_vllm(model_dir, extra, prompts, tmp_path)
    assert tokens_of(cp) == transformers_tokens(model_dir, prompts)
    out = cp.stdout + cp.stderr
    assert "attach failed; loading from disk" in out and "'checkpoint'" in out
    assert "weights attached" not in out


@pytest.mark.vllm
@needs_vllm
def test_another_checkpoints_daemon_without_fallback_is_refused(
    ckpts: Checkpoints, tmp_path: Path
) -> None:
    model_dir = ckpts.dirs["llama"]
    extra = {"sockets": [ckpts.socket("other")], "layout": "reference"}
    cp = run_vllm(model_dir, extra, [[1, 2]], tmp_path)
    assert cp.returncode != 0
    out = cp.stdout + cp.stderr
    assert "serves a pool of another checkpoint or config: " in out
    assert "model.safetensors: size, mtime_ns" in out and 'or set "fallback": true' in out


@pytest.mark.vllm
@needs_vllm
def test_changed_weights_under_the_same_header_are_refused_last_and_named(
    ckpts: Checkpoints, tmp_path: Path
) -> None:
    changed, _ = changed_copy(ckpts.dirs["llama"], tmp_path / "changed")
    cp = run_vllm(
        changed, {"sockets": [ckpts.socket("llama")], "layout": "reference"}, [[1, 2]], tmp_path
    )
    assert cp.returncode != 0
    lines = [x for x in (cp.stdout + cp.stderr).splitlines() if x.strip()]
    print("\n".join(lines[-60:]))
    assert "weights attached" not in cp.stdout + cp.stderr
    assert "model.safetensors: " in lines[-1] and '"verify": "content"' in lines[-1], lines[-5:]


@pytest.mark.vllm
@needs_vllm
def test_a_byte_identical_copy_is_attached_with_verify_content(
    ckpts: Checkpoints, tmp_path: Path
) -> None:
    copy = copy_of(ckpts.dirs["llama"], tmp_path / "copy")
    prompts = prompt_ids(copy)
    extra = {"sockets": [ckpts.socket("llama")], "layout": "reference", "verify": "content"}
    cp = run_vllm(copy, extra, prompts, tmp_path)
    assert tokens_of(cp) == transformers_tokens(copy, prompts)
    out = cp.stdout + cp.stderr
    assert "compared their content" in out and "weights attached" in out
