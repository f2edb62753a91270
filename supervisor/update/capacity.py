"""What a device holds and has free, as the machine says, without torch or a CUDA context
in the supervisor: a GPU `cuda:N` as the driver reports it through `nvidia-smi` (N counted
among `CUDA_VISIBLE_DEVICES` where that is set), host memory (`cpu`) as /proc/meminfo's
MemTotal and MemAvailable, under the memory limit of this process's cgroup (v2
`memory.max`, or v1 `memory.limit_in_bytes`, each less the usage, up the tree). The
policy's `devices.capacity_mb` replaces them all (supervisor/update/memory.py)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import msgspec

from supervisor.errors import SupervisorError

MB = 1 << 20
NVIDIA_SMI_S = 10.0  # nvidia-smi answers within a second; a hung driver does not
CGROUP = Path("/sys/fs/cgroup")


class CapacityUnknown(SupervisorError):
    """The device's memory could not be asked; the message says why and what to set."""


class Capacity(msgspec.Struct, frozen=True):
    """A device's memory, in bytes, and where the figures come from."""

    total: int
    free: int
    source: str  # "nvidia-smi", "/proc/meminfo", "cgroup memory.max", ...


def of_device(device: str) -> Capacity:
    """The memory of `device` (`cpu` or `cuda:N`); CapacityUnknown when it cannot be asked."""
    if device == "cpu":
        return host()
    if device.startswith("cuda"):
        return gpu(device)
    raise CapacityUnknown(f"device {device!r} is neither cpu nor cuda:N")


def gpu(device: str) -> Capacity:
    """`cuda:N`'s total and free memory, as the driver says through nvidia-smi."""
    _, _, n = device.partition(":")
    ordinal = int(n) if n.isdigit() else 0
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    visible = [v for v in visible if v]
    if "CUDA_VISIBLE_DEVICES" in os.environ and ordinal >= len(visible):
        raise CapacityUnknown(
            f"{device}: CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r} shows "
            f"{len(visible)} devices"
        )
    which = visible[ordinal] if visible else str(ordinal)
    argv = ["nvidia-smi", "--query-gpu=memory.total,memory.free"]
    argv += ["--format=csv,noheader,nounits", "-i", which]
    fix = "set devices.capacity_mb to the memory holdfast may use on each device"
    try:
        out = subprocess.run(
            argv, capture_output=True, text=True, timeout=NVIDIA_SMI_S, check=True
        ).stdout
        total, free = (int(x) for x in out.strip().splitlines()[0].split(","))
    except FileNotFoundError:
        raise CapacityUnknown(f"{device}: nvidia-smi is not on PATH; {fix}") from None
    except subprocess.TimeoutExpired:
        raise CapacityUnknown(
            f"{device}: nvidia-smi did not answer in {NVIDIA_SMI_S:g} s; {fix}"
        ) from None
    except subprocess.CalledProcessError as e:
        said = (e.stderr or e.stdout or "").strip()[:200]
        raise CapacityUnknown(f"{device}: nvidia-smi -i {which} failed: {said}; {fix}") from e
    except (ValueError, IndexError):
        raise CapacityUnknown(f"{device}: nvidia-smi said {out!r}; {fix}") from None
    return Capacity(total * MB, free * MB, f"nvidia-smi -i {which}")


def host() -> Capacity:
    """Host memory: MemTotal and MemAvailable, under this process's cgroup limit."""
    try:
        info = {
            key: int(rest.split()[0]) * 1024
            for key, _, rest in (
                line.partition(":") for line in Path("/proc/meminfo").read_text().splitlines()
            )
            if key in ("MemTotal", "MemAvailable")
        }
        total, free = info["MemTotal"], info["MemAvailable"]
    except (OSError, KeyError, ValueError, IndexError) as e:
        raise CapacityUnknown(
            f"cpu: /proc/meminfo cannot be read ({e}); set devices.capacity_mb"
        ) from e
    limit = cgroup_limit()
    if limit is None or (limit.total >= total and limit.free >= free):
        return Capacity(total, free, "/proc/meminfo")
    return Capacity(min(total, limit.total), min(free, limit.free), limit.source)


def cgroup_limit() -> Capacity | None:
    """The tightest memory limit of this process's cgroup and its ancestors (its limit,
    and the limit less the usage), or None where none is set."""
    best: Capacity | None = None
    for limit_file, usage_file, name in _cgroup_files():
        try:
            raw = limit_file.read_text().strip()
            used = int(usage_file.read_text().strip())
        except (OSError, ValueError):
            continue
        if not raw.isdigit() or int(raw) >= 1 << 60:  # "max", or v1's "no limit"
            continue
        limit = int(raw)
        if best is None or limit - used < best.free:
            best = Capacity(limit, max(0, limit - used), f"cgroup {name} ({limit_file})")
    return best


def _cgroup_files() -> list[tuple[Path, Path, str]]:
    """(limit file, usage file, its name) of every cgroup from this process's to the root."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    out: list[tuple[Path, Path, str]] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified tree
            base, limit, usage, name = CGROUP, "memory.max", "memory.current", "memory.max"
        elif "memory" in controllers.split(","):  # v1: the memory controller's tree
            base, limit, usage = CGROUP / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"
            name = "memory.limit_in_bytes"
        else:
            continue
        here = Path(path)
        for p in [here, *here.parents]:
            d = base / str(p).lstrip("/")
            out.append((d / limit, d / usage, name))
    return out
