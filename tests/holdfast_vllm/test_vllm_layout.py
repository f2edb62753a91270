"""The pool in vLLM's layout (`cachedaemon serve --layout vllm`, holdfast_vllm/layout.py).

Tests marked `vllm` run real vLLM (the venv of scripts/install-vllm.sh): a daemon on that
venv's python builds the pool with vLLM's own model and loaders; a vLLM engine attached
zero_copy holds every weight as a view of it (no private weight bytes) and answers greedy
tokens equal to vLLM's default loader; an engine that asks for the other layout is
refused with both named; a tensor-parallel rank's pool equals what vLLM's own loader reads
for that rank, and the slices of the checkpoint a rank of vLLM holds. The others need no
vLLM: the layout in the identity, and a daemon without vLLM refusing --layout vllm.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from conftest import REPO, LoggedProc, child_env

from cachedaemon.config import LoadOptions, make_config
from cachedaemon.errors import CacheError
from tests.holdfast_vllm.test_vllm_plugin import PROMPTS, VLLM_PYTHON, needs_vllm, prompt_ids

NEW_TOKENS = 32


# -- no vLLM ---------------------------------------------------------------------------------


def test_the_layout_is_part_of_a_pools_identity(tiny_model: Path) -> None:
    reference = make_config(tiny_model)
    assert reference.layout == "reference"
    vllm = msgspec.structs.replace(reference, layout="vllm 0.32.0")
    assert reference.diff(vllm) == ["layout"]
    assert reference.fingerprint() != vllm.fingerprint()
    assert LoadOptions.of(vllm).layout == "vllm" and LoadOptions.of(reference).layout == "reference"


def test_a_vllm_layout_takes_no_holdfast_quantization_or_shard_rules(tiny_model: Path) -> None:
    with pytest.raises(CacheError, match="drop --quantization and --shard-rule"):
        make_config(tiny_model, layout="vllm", quantization="fp8-block")
    with pytest.raises(CacheError, match="unknown --layout 'fused'"):
        make_config(tiny_model, layout="fused")


def _has_vllm(python: str) -> bool:
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    return subprocess.run([python, "-c", probe], timeout=60).returncode == 0


def test_a_daemon_without_vllm_refuses_the_vllm_layout(tiny_model: Path, tmp_path: Path) -> None:
    if _has_vllm(sys.executable):
        pytest.skip("this python has vLLM")
    argv = [sys.executable, "-m", "cachedaemon", "serve", "--model", str(tiny_model)]
    argv += ["--runtime-dir", str(tmp_path / "run"), "--layout", "vllm"]
    done = subprocess.run(argv, capture_output=True, text=True, env=child_env(), timeout=120)
    assert done.returncode == 2, done.stderr
    assert "this python has no vLLM: run the daemon with the python of the vLLM venv" in (
        done.stderr
    )
    assert not (tmp_path / "run" / "daemon-0.sock").exists()


def test_vllms_version_is_read_from_a_tree_without_metadata(tmp_path: Path) -> None:
    """A carried site-packages tree may keep vLLM without its dist-info."""
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("raise ImportError('not to be imported')\n")
    (tmp_path / "vllm" / "_version.py").write_text("__version__ = version = '0.26.0'\n")
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    code = "from cachedaemon import layouts; print(layouts.stamp('vllm'))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.stdout.strip() == "vllm 0.26.0", done.stderr


# -- real vLLM -------------------------------------------------------------------------------


class VllmDaemon(LoggedProc):
    """`cachedaemon serve --layout vllm` on the vLLM venv's python."""

    def __init__(self, model: Path, run_dir: Path, *extra: str) -> None:
        argv = [str(VLLM_PYTHON), "-m", "cachedaemon", "--log-format", "json", "serve"]
        argv += ["--model", str(model), "--runtime-dir", str(run_dir), "--dtype", "float32"]
        super().__init__([*argv, *extra])
        self.socket = str(run_dir / "daemon-0.sock")


class Pools(msgspec.Struct):
    model: Path
    vllm: VllmDaemon  # --layout vllm
    reference: VllmDaemon  # --layout reference, on the same python


@pytest.fixture(scope="module")
def pools(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pools]:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"vLLM is not installed ({VLLM_PYTHON} is absent)")
    from tests.vllm_checkpoints import causal_lm_checkpoint

    root = tmp_path_factory.mktemp("layout")
    model = causal_lm_checkpoint(root / "llama", "llama")
    p = Pools(
        model,
        VllmDaemon(model, root / "run-vllm", "--layout", "vllm"),
        VllmDaemon(model, root / "run-reference"),
    )
    try:
        for d in (p.vllm, p.reference):
            d.wait_for('"event": "serving"', 600)
        yield p
    finally:
        p.vllm.stop()
        p.reference.stop()


def generate(
    model: Path, load_format: str, extra: dict[str, Any], prompts: list[list[int]], tmp: Path
) -> subprocess.CompletedProcess[str]:
    env = child_env()
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CACHE_ROOT=str(tmp / "vllm-cache"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
    )
    env.pop("HOLDFAST_DAEMONS", None)
    argv = [
        str(VLLM_PYTHON),
        str(REPO / "tests" / "programs" / "vllm_generate.py"),
        str(model),
        load_format,
    ]
    argv += [json.dumps(extra), json.dumps(prompts), str(NEW_TOKENS)]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900, cwd=tmp)


def tokens_of(cp: subprocess.CompletedProcess[str]) -> list[list[int]]:
    lines = [x for x in cp.stdout.splitlines() if x.startswith('{"tokens"')]
    assert cp.returncode == 0 and lines, cp.stdout[-3000:] + cp.stderr[-3000:]
    tokens: list[list[int]] = json.loads(lines[-1])["tokens"]
    return tokens


@pytest.mark.vllm
@needs_vllm
def test_zero_copy_shares_every_weight_and_equals_vllms_own_loader(
    pools: Pools, tmp_path: Path
) -> None:
    prompts = prompt_ids(pools.model)
    own = tokens_of(generate(pools.model, "auto", {}, prompts, tmp_path))
    assert len(own) == len(PROMPTS) and all(len(t) == NEW_TOKENS for t in own)
    cp = generate(pools.model, "holdfast", {"sockets": [pools.vllm.socket]}, prompts, tmp_path)
    assert tokens_of(cp) == own
    out = cp.stdout + cp.stderr
    (line,) = [x for x in out.splitlines() if "weights attached" in x]
    assert "layout=vllm" in line and "mode=zero_copy" in line
    assert "private_bytes=0 " in line and "loaded_from_pool=0 " in line, line
    built = pools.vllm.wait_for('"event": "vllm layout built"')[0]
    assert f"shared={json.loads(built)['parameters']} " in line, line  # every parameter


@pytest.mark.vllm
@needs_vllm
def test_an_engine_asking_for_the_other_layout_is_refused_with_both_named(
    pools: Pools, tmp_path: Path
) -> None:
    cp = generate(pools.model, "holdfast", {"sockets": [pools.reference.socket]}, [[1]], tmp_path)
    out = cp.stdout + cp.stderr
    assert cp.returncode != 0 and '{"tokens"' not in cp.stdout
    assert "layout: pool is reference, engine wants vllm 0.32.0: start the daemon with " in out
    assert "--layout vllm" in out
    # and the other way round
    extra = {"sockets": [pools.vllm.socket], "layout": "reference"}
    cp = generate(pools.model, "holdfast", extra, [[1]], tmp_path)
    out = cp.stdout + cp.stderr
    assert cp.returncode != 0
    assert "layout: pool is vllm 0.32.0, engine wants reference: " in out


@pytest.mark.vllm
@needs_vllm
def test_each_tensor_parallel_rank_is_sharded_as_vllm_shards_it(
    pools: Pools, tmp_path: Path
) -> None:
    argv = [
        str(VLLM_PYTHON),
        str(REPO / "tests" / "programs" / "vllm_layout_check.py"),
        str(pools.model),
    ]
    done = subprocess.run(
        [*argv, "2", str(tmp_path)], capture_output=True, text=True, env=child_env(), timeout=900
    )
    lines = [x for x in done.stdout.splitlines() if x.startswith('{"ranks"')]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = json.loads(lines[-1])["ranks"]
    for rank in ranks:  # what vLLM's own loader reads from the files for that rank
        assert rank["differ"] == [] and rank["missing"] == [], rank
        assert "model.layers.0.self_attn.qkv_proj.weight" in rank["names"]
    from safetensors.torch import load_file

    ckpt = load_file(pools.model / "model.safetensors")
    for r in (0, 1):
        check_rank_slices(load_file(tmp_path / f"rank-{r}.safetensors"), ckpt, r)


def check_rank_slices(pool: dict[str, torch.Tensor], ckpt: dict[str, torch.Tensor], r: int) -> None:
    """The test Llama (hidden 128, 2 heads of 64, 1 KV head, MLP 256, vocab 256) on rank r of
    2: its query head, the one KV head on both ranks, half of each MLP and of the vocab."""
    layer, half = "model.layers.0.", slice(r * 64, (r + 1) * 64)
    q, k, v = (ckpt[f"{layer}self_attn.{x}_proj.weight"] for x in "qkv")
    assert torch.equal(pool[f"{layer}self_attn.qkv_proj.weight"], torch.cat([q[half], k, v]))
    o = ckpt[f"{layer}self_attn.o_proj.weight"]
    assert torch.equal(pool[f"{layer}self_attn.o_proj.weight"], o[:, half])
    mlp = slice(r * 128, (r + 1) * 128)
    gate, up = (ckpt[f"{layer}mlp.{x}_proj.weight"] for x in ("gate", "up"))
    assert torch.equal(pool[f"{layer}mlp.gate_up_proj.weight"], torch.cat([gate[mlp], up[mlp]]))
    down = ckpt[f"{layer}mlp.down_proj.weight"]
    assert torch.equal(pool[f"{layer}mlp.down_proj.weight"], down[:, mlp])
    assert torch.equal(pool["model.embed_tokens.weight"], ckpt["model.embed_tokens.weight"][mlp])
    assert torch.equal(pool["model.norm.weight"], ckpt["model.norm.weight"])


@pytest.mark.vllm
@needs_vllm
def test_a_vllm_layout_pool_keeps_the_checkpoints_content_digest(pools: Pools) -> None:
    """Built through vLLM's loaders, the pool still digests every byte it reads, so a copy
    of the checkpoint is checked by content (`cachedaemon verify`) against it too."""
    verify = [sys.executable, "-m", "cachedaemon", "verify", "--socket", pools.vllm.socket]
    same = subprocess.run([*verify, "--model", str(pools.model)], capture_output=True, text=True)
    assert same.returncode == 0, same.stdout + same.stderr
    changed = pools.model.parent / "changed"
    shutil.copytree(pools.model, changed)
    with (changed / "model.safetensors").open("r+b") as f:  # tensor bytes, header as it was
        f.seek(8 + int.from_bytes(f.read(8), "little") + 64)
        data = f.read(16)
        f.seek(-16, os.SEEK_CUR)
        f.write(bytes(b ^ 0x40 for b in data))
    cp = subprocess.run([*verify, "--model", str(changed)], capture_output=True, text=True)
    out = cp.stdout + cp.stderr
    assert cp.returncode == 1 and "model.safetensors" in out, out
