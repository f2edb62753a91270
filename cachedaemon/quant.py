"""Post-load transforms. `fp8-block`: 128x128 blocks of float8_e4m3fn plus a float32 scale
per block (`<name>_scale_inv`, so dequantized = fp8.float() * scale of its block). Which
tensors it takes and their scales' shapes are known without torch (cachedaemon/pool_plan.py
sizes a pool with them); torch is imported by the transforms alone."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from cachedaemon.config import QUANTIZATIONS
from cachedaemon.errors import QuantizationError

if TYPE_CHECKING:
    import torch

BLOCK = 128
FP8_MAX = 448.0
_LINEAR = re.compile(r"(_proj|\.w[123])\.weight$")


def check_method(method: str) -> None:
    if method not in QUANTIZATIONS:
        raise QuantizationError(
            f"unknown quantization {method!r}; allowed: {', '.join(QUANTIZATIONS)}"
        )


def quantizes(method: str, name: str, shape: tuple[int, ...]) -> bool:
    """Whether `method` turns this tensor into fp8 + scales (2-D linear weights only)."""
    return method == "fp8-block" and len(shape) == 2 and bool(_LINEAR.search(name))


def scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    return (-(-shape[0] // BLOCK), -(-shape[1] // BLOCK))


def fp8_block_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D tensor on its own device; bit-identical on CPU and CUDA."""
    import torch

    rows, cols = weight.shape
    br, bc = scale_shape((rows, cols))
    w = weight.to(torch.float32)
    padded = torch.zeros(br * BLOCK, bc * BLOCK, dtype=torch.float32, device=w.device)
    padded[:rows, :cols] = w
    blocks = padded.view(br, BLOCK, bc, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))
    # a tensor divisor: CUDA turns division by a Python scalar into a multiplication by
    # its reciprocal, which differs from the CPU in the last bit
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q8 = q.view(br * BLOCK, bc * BLOCK)[:rows, :cols].to(torch.float8_e4m3fn)
    return q8.contiguous(), scale.contiguous()


def fp8_block_dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    import torch

    rows, cols = q.shape
    expanded = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]
    return q.to(torch.float32) * expanded
