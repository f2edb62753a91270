"""Hugging Face checkpoint dirs: config.json plus safetensors files, read and validated.

The safetensors header is parsed here (not by the safetensors library) so that every way a
file can be wrong gets an error naming the file, the tensor and what to do about it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from cachedaemon.errors import CheckpointError

MAX_HEADER = 100_000_000
# safetensors dtype code -> (torch dtype name, bytes per element)
ST_DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
}


class TensorInfo(msgspec.Struct, frozen=True):
    name: str
    path: str
    dtype: str  # torch dtype name
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not model_dir.is_dir():
        raise CheckpointError(
            f"model dir {model_dir} does not exist; pass --model a checkpoint dir"
        )
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path} is missing: a checkpoint dir needs config.json") from exc
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return cfg


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files: those of the index if there is one."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index} has no valid weight_map: {exc}") from exc
        files = [model_dir / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names shard files that are missing: {missing}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if not found:
        raise CheckpointError(
            f"no model.safetensors, model.safetensors.index.json or *.safetensors in {model_dir}"
        )
    return found


def read_header(path: Path) -> list[TensorInfo]:
    """Parse and validate one file's header: every tensor inside the file, none overlapping."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is truncated: {size} bytes, no safetensors header")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER or 8 + n > size:
            raise CheckpointError(
                f"{path}: header length {n} runs past the file ({size} bytes); truncated or not safetensors"
            )
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path}: header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header must be a JSON object")
    data_start, data_size = 8 + n, size - 8 - n
    infos = [
        _tensor_info(path, name, entry, data_start, data_size)
        for name, entry in header.items()
        if name != "__metadata__"
    ]
    _check_overlaps(path, infos)
    return infos


def _tensor_info(path: Path, name: str, entry: Any, data_start: int, data_size: int) -> TensorInfo:
    try:
        code, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        shape = tuple(int(d) for d in shape)
        begin, end = int(begin), int(end)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry") from exc
    if code not in ST_DTYPES:
        raise CheckpointError(
            f"{path}: tensor {name!r} has unsupported dtype {code!r}; supported: {', '.join(ST_DTYPES)}"
        )
    dtype, itemsize = ST_DTYPES[code]
    if any(d < 0 for d in shape) or not 0 <= begin <= end:
        raise CheckpointError(f"{path}: tensor {name!r} has negative shape or offsets")
    if end > data_size:
        raise CheckpointError(
            f"{path}: tensor {name!r} ends at byte {end} of a {data_size}-byte data section; "
            "the file is truncated or its header is corrupt"
        )
    if end - begin != math.prod(shape) * itemsize:
        raise CheckpointError(
            f"{path}: tensor {name!r} spans {end - begin} bytes but shape {list(shape)} of "
            f"{code} needs {math.prod(shape) * itemsize}"
        )
    return TensorInfo(name, str(path), dtype, shape, data_start + begin, end - begin)


def _check_overlaps(path: Path, infos: list[TensorInfo]) -> None:
    ordered = sorted((i for i in infos if i.nbytes), key=lambda i: i.start)
    for a, b in zip(ordered, ordered[1:], strict=False):
        if b.start < a.start + a.nbytes:
            raise CheckpointError(
                f"{path}: tensors {a.name!r} and {b.name!r} overlap in the header"
            )


class CheckpointReader:
    """Every tensor of a checkpoint dir, by name, read with pread into caller buffers;
    `on_read` (the load's content digest) sees every tensor's bytes as they arrive."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self.config = read_hf_config(self.model_dir)
        self.files = safetensors_files(self.model_dir)
        self.tensors: dict[str, TensorInfo] = {}
        for path in self.files:
            for info in read_header(path):
                if info.name in self.tensors:
                    raise CheckpointError(
                        f"tensor {info.name!r} appears in both {self.tensors[info.name].path} and {path}"
                    )
                self.tensors[info.name] = info
        self._fds: dict[str, int] = {}
        self.bytes_read = 0
        self.on_read: Callable[[TensorInfo, memoryview], object] | None = None

    @property
    def total_bytes(self) -> int:
        return sum(i.nbytes for i in self.tensors.values())

    def read_into(self, info: TensorInfo, buf: memoryview) -> None:
        """Read the tensor's raw bytes into `buf` (exactly info.nbytes long)."""
        fd = self._fds.get(info.path)
        if fd is None:
            fd = self._fds[info.path] = os.open(info.path, os.O_RDONLY | os.O_CLOEXEC)
        done = 0
        while done < info.nbytes:
            got = os.preadv(fd, [buf[done:]], info.start + done)
            if got <= 0:
                raise CheckpointError(
                    f"{info.path}: short read in tensor {info.name!r}; truncated?"
                )
            done += got
        self.bytes_read += done
        if self.on_read is not None:
            self.on_read(info, buf)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
