"""A shared KV cache on a GPU: one virtual range per engine for the cache's two tensors,
whose memory changes only between steps, while no pointer into it does.

A serving engine maps one cuMemCreate allocation over the whole range and exports it as a
POSIX fd, which the keeper holds (engine/kvshare.py). A standby reserves a range of the
same size and maps only the pages its own blocks (the first `usable` of every layer) and
the scratch block fall in; its CUDA graphs are captured over the range's addresses.
Promoted, it unmaps those pages and maps the dead primary's allocation, or a new one,
over the whole range: every graph it captured replays on the adopted keys and values.
"""

from __future__ import annotations

import time

import torch

from engine.errors import EngineError


class CudaSpace:
    """`size` bytes of address space on `device` for two tensors of `tensor_bytes` each,
    and what is mapped into it now (`runs`: (offset, size) of each mapping)."""

    def __init__(self, device: torch.device, tensor_bytes: int) -> None:
        from cachedaemon import cuda_driver as drv

        drv.require_bindings()
        self.device = device
        self.ordinal = device.index if device.index is not None else torch.cuda.current_device()
        self.ctx = drv.primary_context(self.ordinal)  # torch's own context, made current
        self.gran = drv.granularity(self.ordinal)
        self.tensor_bytes = tensor_bytes
        self.size = -(-2 * tensor_bytes // self.gran) * self.gran
        self.base = drv.reserve(self.size, self.gran)
        self.runs: list[tuple[int, int]] = []
        self.timings: dict[str, float] = {}  # the last map_whole's: unmap, import, map

    @property
    def mapped(self) -> int:
        """Bytes of device memory mapped into the range now."""
        return sum(size for _, size in self.runs)

    def raw(self) -> torch.Tensor:
        """The whole range as one uint8 tensor (its unmapped pages must not be touched;
        its first page is always mapped)."""
        from cachedaemon import cuda_driver as drv

        return torch.as_tensor(drv.DeviceBytes(self.base, self.size), device=self.device)

    def map_whole(self, fd: int | None) -> int:
        """Map the allocation behind `fd` (a dead engine's, adopted; the fd stays the
        caller's) or, with None, a new one over the whole range, in place of what was
        mapped. Returns the allocation's fd: `fd`, or the new one's export. Raises
        EngineError if it cannot be mapped (then nothing is)."""
        from cachedaemon import cuda_driver as drv

        t0 = time.perf_counter()
        self.unmap()
        t1 = time.perf_counter()
        try:
            handle = drv.import_fd(fd) if fd is not None else drv.create(self.ordinal, self.size)
        except drv.CudaDriverError as e:
            what = (
                "the adopted KV cache" if fd is not None else f"a KV cache of {self.size >> 20} MB"
            )
            raise EngineError(f"{what} cannot be made on {self.device}: {e}") from None
        try:
            t2 = time.perf_counter()
            drv.map_at(self.ordinal, self.base, self.size, handle, writable=True)
            self.runs = [(0, self.size)]
            ms = [
                round((b - a) * 1e3, 2) for a, b in ((t0, t1), (t1, t2), (t2, time.perf_counter()))
            ]
            self.timings = dict(zip(("unmap_ms", "import_ms", "map_ms"), ms, strict=True))
            return fd if fd is not None else drv.export_fd(handle)
        except drv.CudaDriverError as e:
            self.unmap()
            raise EngineError(f"a KV cache does not map on {self.device}: {e}") from None
        finally:
            drv.release(handle)  # the mapping (and the fd) keep the memory

    def map_pages(self, spans: list[tuple[int, int]]) -> None:
        """Map fresh memory under every page that one of `spans` ((offset, bytes) into the
        range) touches, and nothing else; the range's first page is always among them."""
        from cachedaemon import cuda_driver as drv

        self.unmap()
        pages = {0}
        for at, n in spans:
            pages.update(range(at // self.gran, (at + n - 1) // self.gran + 1))
        try:
            for start, count in _runs(sorted(pages)):
                at, size = start * self.gran, count * self.gran
                handle = drv.create(self.ordinal, size)
                try:
                    drv.map_at(self.ordinal, self.base + at, size, handle, writable=True)
                finally:
                    drv.release(handle)
                self.runs.append((at, size))
        except drv.CudaDriverError as e:
            self.unmap()
            raise EngineError(f"a standby's KV pages do not map on {self.device}: {e}") from None

    def unmap(self) -> None:
        """Unmap everything mapped into the range, once the device is done with it (the
        range stays reserved; memory nothing else holds is freed)."""
        from cachedaemon import cuda_driver as drv

        if not self.runs:
            return
        torch.cuda.synchronize(self.device)
        runs, self.runs = self.runs, []
        for at, size in runs:
            drv.unmap_at(self.base + at, size)


def _runs(pages: list[int]) -> list[tuple[int, int]]:
    """Sorted page numbers as (first, count) of each run of consecutive ones."""
    out: list[tuple[int, int]] = []
    for p in pages:
        if out and out[-1][0] + out[-1][1] == p:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((p, 1))
    return out


def standby_spans(
    layers: int, blocks: int, block_bytes: int, usable: int, tensor_bytes: int
) -> list[tuple[int, int]]:
    """The (offset, bytes) a standby touches in a range of two tensors (keys, then values)
    of shape (layers, blocks + 1, ...): in every layer its first `usable` blocks and the
    scratch block (the last)."""
    layer = (blocks + 1) * block_bytes
    spans = []
    for half in (0, tensor_bytes):
        for i in range(layers):
            at = half + i * layer
            spans.append((at, usable * block_bytes))
            spans.append((at + blocks * block_bytes, block_bytes))
    return spans
