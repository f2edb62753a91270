"""The checkpoints that `update` and `refit` faults go to.

A fault names them in `models`: a dir (`path`, relative to the scenario file) or a
generated preset (`preset`, `seed`: written once into the same cache the supervisor uses
for `model.preset`), either optionally copied with fields of its config.json changed
(`config`: a checkpoint of the same shapes that the engine refuses at start, say). They
are made ready before the stage's supervisor starts. Each trial goes to the first of its
fault's `models` that does not serve now, so `models: [B, A]` alternates between two
checkpoints whatever else runs between the trials.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any, Literal

import msgspec

from chaos.errors import ChaosError
from supervisor.errors import StartupError
from supervisor.policy import Policy

UPDATE_FAULTS = frozenset({"update", "refit"})


class ModelRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One checkpoint an update or a refit goes to."""

    path: str | None = None  # a checkpoint dir, relative to the scenario file
    preset: Literal["tiny", "small", "llama-8b"] | None = None  # generated, as model.preset
    seed: int = 0  # the preset's weights
    config: dict[str, Any] = {}  # a copy with these config.json fields changed


def model_problems(fault: object, where: str) -> list[str]:
    """What is wrong with a fault's `models` and `expect` (`where`: its path in the file)."""
    if not isinstance(fault, dict):
        return []
    kind, models = fault.get("kind"), fault.get("models")
    if kind not in UPDATE_FAULTS:
        return [
            f"{where}.{key}: only {' and '.join(sorted(UPDATE_FAULTS))} faults take {key}; "
            f"drop it from this {kind} fault"
            for key in ("models", "expect")
            if key in fault
        ]
    if not isinstance(models, list) or not models:
        return [
            f"{where}.models: a {kind} fault needs the checkpoints it goes to, e.g. "
            "`models: [{preset: tiny, seed: 1}, {preset: tiny, seed: 0}]`"
        ]
    problems = []
    for i, model in enumerate(models):
        if isinstance(model, dict) and ("path" in model) == ("preset" in model):
            problems.append(
                f"{where}.models[{i}]: set exactly one of `path` (a checkpoint dir) and "
                "`preset` (a generated one, with `seed`)"
            )
    return problems


def missing_dirs(refs: list[ModelRef], base: Path) -> list[str]:
    """The `path` models that are no dir here (`base`: the scenario file's dir)."""
    return [
        f"model path {ref.path} ({base / ref.path}) is not a directory; give a checkpoint dir"
        for ref in refs
        if ref.path is not None and not (base / ref.path).is_dir()
    ]


class Checkpoints:
    """The dir of every model a stage's faults name, and which of them serves now."""

    def __init__(self, dirs: dict[bytes, Path], serving: Path | None) -> None:
        self._dirs = dirs
        self.serving = serving  # None: unknown (an update that never ended)

    def next(self, refs: list[ModelRef]) -> Path:
        """The first of `refs` whose dir does not serve now."""
        dirs = [self._dirs[_key(ref)] for ref in refs]
        return next((d for d in dirs if d != self.serving), dirs[0])


async def prepare(refs: list[ModelRef], base: Path, policy: Policy, out: Path) -> Checkpoints:
    """Every model of `refs` ready on disk (presets generated, copies made into `out`),
    and the dir `policy` serves."""
    from supervisor.service import ensure_model  # the supervisor's own preset cache

    async def made(model: ModelRef) -> Path:
        try:
            if model.path is not None:
                return (base / model.path).resolve()
            spec = msgspec.structs.replace(
                policy.model, path=None, preset=model.preset, seed=model.seed
            )
            return Path(await ensure_model(msgspec.structs.replace(policy, model=spec))).resolve()
        except StartupError as exc:
            raise ChaosError(f"cannot make the checkpoint {model}: {exc}") from exc

    dirs: dict[bytes, Path] = {}
    for ref in refs:
        if _key(ref) not in dirs:
            plain = await made(msgspec.structs.replace(ref, config={}))
            dirs[_key(ref)] = _changed_copy(plain, ref.config, out) if ref.config else plain
    serving = Path(await ensure_model(policy)).resolve()
    return Checkpoints(dirs, serving)


def _changed_copy(src: Path, config: dict[str, Any], out: Path) -> Path:
    """A copy of `src` with `config` merged onto its config.json (a copy, not links: the
    original's files keep every stat fact an engine or a daemon watches)."""
    tag = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:8]
    dst = out / f"{src.name}-{tag}"
    if not dst.is_dir():
        shutil.copytree(src, dst)
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config)
        (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst.resolve()


def _key(ref: ModelRef) -> bytes:
    return msgspec.json.encode(ref)
