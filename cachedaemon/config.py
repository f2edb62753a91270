"""CacheConfig: the frozen identity of a pool. Any field that differs is a mismatch.

Built from a checkpoint dir without reading any file: each file's name, size, mtime,
ctime, inode and device identify the checkpoint (`checkpoint_identity`), so a file written
again, even in place and to the same size, is another checkpoint. What the files held when
the pool was loaded is the pool's content digest (`cachedaemon.digest`, in its manifest).
Imports no torch (versions come from package metadata) so the supervisor and the keeper
can use it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from pathlib import Path
from typing import Any

import msgspec

import cachedaemon.layouts as layouts
from cachedaemon.sharding import Rule
from cachedaemon.version import __version__
from holdfast_contract.formats import DTYPES as DTYPES
from holdfast_contract.formats import QUANTIZATIONS as QUANTIZATIONS

BACKENDS = ("memfd", "cuda-vmm")


class LoadOptions(msgspec.Struct, frozen=True):
    """How a rank's tensors are made from the checkpoint (see loader.py): the one list of
    load options that the daemon, a disk load and the identity of a pool all take."""

    dtype: str = "bfloat16"
    tp_size: int = 1
    tp_rank: int = 0
    quantization: str = "none"
    device: str = "cpu"
    shard_rules: tuple[Rule, ...] = ()
    layout: str = "reference"  # cachedaemon/layouts.py: reference, or vllm

    @classmethod
    def of(cls, config: CacheConfig) -> LoadOptions:
        """The options a pool of `config` was made with (the default shard plan: a
        config keeps only the hash of its rules)."""
        return cls(
            config.dtype,
            config.tp_size,
            config.tp_rank,
            config.quantization,
            config.device,
            layout=layouts.kind(config.layout),
        )


class FileIdentity(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A checkpoint file as stat sees it: any write to it changes mtime_ns and ctime_ns
    (ctime cannot be set back by hand), a copy or a replacement changes the inode."""

    name: str
    size: int
    mtime_ns: int
    ctime_ns: int
    inode: int
    device: int

    def differs(self, other: FileIdentity) -> list[str]:
        """The stat facts that differ (`size`, `mtime_ns`, ...)."""
        return [f for f in self.__struct_fields__ if getattr(self, f) != getattr(other, f)]


class EnvStamp(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    torch_version: str
    cuda_version: str  # "" on CPU
    device_capability: str  # "" on CPU, "9.0" on an H200
    holdfast_version: str


class CacheConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    checkpoint: tuple[FileIdentity, ...]
    architecture: str
    dtype: str
    tp_size: int
    tp_rank: int
    quantization: str
    quant_config_hash: str
    shard_plan_hash: str
    backend: str
    device: str
    env: EnvStamp
    layout: str = "reference"  # or "vllm <version>" (cachedaemon/layouts.py)

    def fingerprint(self) -> str:
        return hashlib.sha256(msgspec.json.encode(self)).hexdigest()[:32]

    def diff(self, other: CacheConfig) -> list[str]:
        """Dotted names of the fields that differ (`env.torch_version`, `checkpoint`)."""
        out: list[str] = []
        for field in self.__struct_fields__:
            mine, theirs = getattr(self, field), getattr(other, field)
            if mine == theirs:
                continue
            if isinstance(mine, msgspec.Struct):
                out += [
                    f"{field}.{sub}"
                    for sub in mine.__struct_fields__
                    if getattr(mine, sub) != getattr(theirs, sub)
                ]
            else:
                out.append(field)
        return out


def _hash_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def checkpoint_identity(model_dir: Path) -> tuple[FileIdentity, ...]:
    """The stat facts of config.json and every safetensors file; reads none of them."""
    from cachedaemon.checkpoint import safetensors_files

    out = []
    for path in [model_dir / "config.json", *safetensors_files(model_dir)]:
        st = path.stat()
        out.append(
            FileIdentity(
                path.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev
            )
        )
    return tuple(out)


def checkpoint_changes(mine: CacheConfig, served: CacheConfig) -> list[str]:
    """One line per checkpoint file whose stat facts differ between an engine's dir
    (`mine`) and the files the pool was loaded from (`served`)."""
    a = {f.name: f for f in mine.checkpoint}
    b = {f.name: f for f in served.checkpoint}
    out = []
    for name in sorted(a.keys() | b.keys()):
        x, y = a.get(name), b.get(name)
        if x is None or y is None:
            out.append(f"{name}: only in {'the pool' if x is None else 'this dir'}")
        elif x != y:
            out.append(f"{name}: {', '.join(x.differs(y))} differ")
    return out


def env_stamp(device: str) -> EnvStamp:
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = ""
    cuda_version, capability = "", ""
    if device.startswith("cuda"):
        import torch

        cuda_version = str(torch.version.cuda or "")
        index = torch.device(device).index or 0
        major, minor = torch.cuda.get_device_capability(index)
        capability = f"{major}.{minor}"
    return EnvStamp(torch_version, cuda_version, capability, __version__)


def default_backend(device: str) -> str:
    return "cuda-vmm" if device.startswith("cuda") else "memfd"


def make_config(
    model_dir: str | Path,
    *,
    dtype: str = "bfloat16",
    tp_size: int = 1,
    tp_rank: int = 0,
    quantization: str = "none",
    device: str = "cpu",
    backend: str = "auto",
    shard_rules: tuple[Rule, ...] = (),
    layout: str = "reference",
) -> CacheConfig:
    """`config_for` with LoadOptions' fields as keywords, for a caller that has no
    LoadOptions at hand (`make_config(ckpt, dtype="float32")`)."""
    opts = LoadOptions(dtype, tp_size, tp_rank, quantization, device, shard_rules, layout)
    return config_for(model_dir, opts, backend=backend)


def config_for(model_dir: str | Path, opts: LoadOptions, *, backend: str = "auto") -> CacheConfig:
    """The CacheConfig of a pool of `model_dir` made with `opts`; validates each option,
    naming the flag to change."""
    from cachedaemon.checkpoint import read_hf_config
    from cachedaemon.errors import CacheError, QuantizationError
    from cachedaemon.sharding import plan_hash

    model = Path(model_dir)
    dtype, tp_size, tp_rank = opts.dtype, opts.tp_size, opts.tp_rank
    quantization, device = opts.quantization, opts.device
    if dtype not in DTYPES:
        raise CacheError(f"unsupported --dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if quantization not in QUANTIZATIONS:
        raise QuantizationError(
            f"unknown --quantization {quantization!r}; allowed: {', '.join(QUANTIZATIONS)}"
        )
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise CacheError(f"--tp-rank {tp_rank} must be in [0, --tp-size {tp_size})")
    if opts.layout == "vllm" and (quantization != "none" or opts.shard_rules):
        raise CacheError(
            "--layout vllm holds vLLM's own unquantized parameters, sharded by vLLM's "
            "loaders: drop --quantization and --shard-rule, or use --layout reference"
        )
    try:
        layout = layouts.stamp(opts.layout)
    except ValueError as e:
        raise CacheError(str(e)) from None
    if backend == "auto":
        backend = default_backend(device)
    if backend not in BACKENDS:
        raise CacheError(f"unknown backend {backend!r}; choose auto or one of {BACKENDS}")
    if (backend == "memfd") != (device == "cpu"):
        raise CacheError(f"backend {backend!r} does not serve device {device!r}")
    hf = read_hf_config(model)
    archs = hf.get("architectures") or [hf.get("model_type", "unknown")]
    quant_cfg = {"method": quantization, "block": [128, 128]} if quantization != "none" else {}
    return CacheConfig(
        checkpoint=checkpoint_identity(model),
        architecture=str(archs[0]),
        dtype=dtype,
        tp_size=tp_size,
        tp_rank=tp_rank,
        quantization=quantization,
        quant_config_hash=_hash_json(quant_cfg),
        shard_plan_hash=plan_hash(opts.shard_rules),
        backend=backend,
        device=device,
        env=env_stamp(device),
        layout=layout,
    )
