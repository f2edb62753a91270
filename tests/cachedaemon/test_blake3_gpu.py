"""BLAKE3 on the GPU (cachedaemon.blake3_gpu) against the blake3 package, byte for byte.

On a CPU machine the kernels run in Triton's interpreter, in a child process: TRITON_INTERPRET
must be set before triton is imported, and this process may have imported it already. The
interpreter hashes about one 64-byte block every 40 ms, so its inputs are a few chunks each,
plus one of 68 chunks (a tree of 7 levels); a second batch runs with tiles of 2 lanes and
groups of 2 nodes, so that a small input takes several chunk programs and tree launches. With
CUDA the same batches run on the GPU, and a `gpu` test adds 64 MiB pieces.
"""

from __future__ import annotations

import importlib.util
import os
import random
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from blake3 import blake3

from tests.triton_interpreter import run_interpreted

if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton (pip install triton)", allow_module_level=True)

# one worker runs this module: its `results` (minutes in the interpreter) are made once
pytestmark = pytest.mark.xdist_group("blake3-interpreter")
KiB, MiB = 1 << 10, 1 << 20

# name -> (lanes, group, lengths): lanes and group are the kernels' tile sizes, None for the
# defaults. Lengths cover one chunk's block boundaries, two and three chunks around their
# edges, 4, 5, 7 and 68 chunks (trees of odd shapes), and bytes left over after whole words.
# With 2 lanes and groups of 2, 18 chunks take 3 chunk programs and 3 tree launches
BATCHES: dict[str, tuple[int | None, int | None, list[int]]] = {
    "defaults": (
        None,
        None,
        [1, 2, 3, 63, 64, 65, 1023, 1024, 1025, 2047, 2048, 2049, 3 * KiB + 5]
        + [5 * KiB, 7 * KiB - 3, 67 * KiB + 9],
    ),
    "small tiles": (2, 2, [17 * KiB + 3, 1]),
}

# The child: hashes each batch's ranges of one buffer on the CPU through the interpreter and
# prints, per batch, [length, digest, blake3's digest] for each range
CHILD = textwrap.dedent(
    """
    import dataclasses, json, sys
    import torch
    import triton.runtime.interpreter as interp
    from tests.cachedaemon.test_blake3_gpu import run_batch
    # BLAKE3 wraps its 32-bit adds on purpose; the interpreter's check of each add for
    # overflow doubles its time and asserts nothing without debug
    builder = getattr(interp, "interpreter_builder", None)
    if builder is not None and hasattr(builder.options, "sanitize_overflow"):
        builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)
    from cachedaemon.blake3_gpu import disagrees
    batches = json.loads(sys.argv[1])
    out = {name: run_batch(torch.device("cpu"), *b) for name, b in batches.items()}
    print(json.dumps({**out, "disagrees": disagrees(torch.device("cpu"))}))
    """
)


def layout(lengths: list[int], seed: int) -> tuple[list[tuple[int, int]], int]:
    """Ranges one after another at 4-byte aligned starts, 0-7 bytes apart, and the buffer
    size: one byte more than the last range, so that a word read past it would show."""
    rng = random.Random(seed)
    ranges, pos = [], 0
    for n in lengths:
        ranges.append((pos, n))
        pos = (pos + n + 3) // 4 * 4 + 4 * rng.randint(0, 1)
    return ranges, ranges[-1][0] + ranges[-1][1] + 1


def run_batch(
    device: torch.device, lanes: int | None, group: int | None, lengths: list[int]
) -> list:
    """[n, digest hex, blake3 hex] for each length, its range in a buffer of nonzero bytes."""
    from cachedaemon import blake3_gpu

    ranges, size = layout(lengths, seed=len(lengths))
    gen = torch.Generator().manual_seed(size)
    host = torch.randint(1, 256, (size,), dtype=torch.uint8, generator=gen)
    buf = host.to(device)
    words = blake3_gpu._enqueue(buf, ranges, lanes or blake3_gpu.LANES, group or blake3_gpu.GROUP)
    got = blake3_gpu.to_bytes(words)
    data = host.numpy().tobytes()
    return [
        [n, d.hex(), blake3(data[s : s + n], max_threads=1).hexdigest()]
        for (s, n), d in zip(ranges, got, strict=True)
    ]


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    if torch.cuda.is_available():
        from cachedaemon.blake3_gpu import disagrees

        out = {name: run_batch(torch.device("cuda"), *b) for name, b in BATCHES.items()}
        return {**out, "disagrees": disagrees(torch.device("cuda"))}
    return run_interpreted(CHILD, BATCHES)


def test_the_loaders_own_check_finds_the_digests_equal(results: dict[str, Any]) -> None:
    assert results["disagrees"] is None  # blake3_gpu.disagrees: what cuda_load asks first


@pytest.mark.parametrize("batch", list(BATCHES))
def test_digests_equal_blake3(results: dict[str, Any], batch: str) -> None:
    rows = results[batch]
    assert [n for n, _, _ in rows] == BATCHES[batch][2]
    wrong = [(n, got, want) for n, got, want in rows if got != want]
    assert not wrong, f"lengths whose digest differs from blake3's: {wrong}"


def test_rejects_ranges_it_cannot_hash() -> None:
    from cachedaemon.blake3_gpu import digests

    buf = torch.zeros(4096, dtype=torch.uint8)
    for bad, says in [
        ((0, 0), "at least 1 byte"),
        ((8, -4), "at least 1 byte"),
        ((2, 100), "multiple of 4"),
        ((4000, 100), "outside"),
        ((-4, 8), "outside"),
    ]:
        with pytest.raises(ValueError, match=says):
            digests(buf, [(0, 64), bad])
    with pytest.raises(ValueError, match="1-D uint8"):
        digests(buf.view(torch.int32), [(0, 4)])
    assert digests(buf, []) == []


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter takes CPU tensors"
)
def test_rejects_a_cpu_tensor_without_the_interpreter() -> None:
    from cachedaemon import blake3_gpu

    if blake3_gpu._interpreted():
        pytest.skip("triton was imported in interpreter mode")
    with pytest.raises(ValueError, match="CUDA tensor"):
        blake3_gpu.digests(torch.ones(64, dtype=torch.uint8), [(0, 64)])


@pytest.mark.gpu
def test_pieces_of_64_mib_and_odd_lengths_on_cuda() -> None:
    from cachedaemon.blake3_gpu import digests, enqueue, to_bytes

    rng = random.Random(5)
    lengths = [64 * MiB, 64 * MiB - 1, 64 * MiB - 3, 64 * MiB + 1, 3 * MiB + 7, 1, 5, 4097]
    lengths += [rng.randint(1, 4 * MiB) for _ in range(20)]
    ranges, size = layout(lengths, seed=5)
    gen = torch.Generator(device="cuda").manual_seed(5)
    buf = torch.randint(1, 256, (size,), dtype=torch.uint8, device="cuda", generator=gen)
    data = buf.cpu().numpy().tobytes()
    want = [blake3(data[s : s + n], max_threads=1).digest() for s, n in ranges]
    assert digests(buf, ranges) == want
    stream = torch.cuda.Stream()  # as the loader does: its own stream, one copy at the end
    with torch.cuda.stream(stream):
        words = enqueue(buf, ranges[::-1])
    stream.synchronize()
    assert to_bytes(words) == want[::-1]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])  # as the files hold it; cast
def test_a_gpu_loads_digest_is_the_cpu_digest_of_the_files(tiny_model: Path, dtype: str) -> None:
    """bfloat16 (the file's): every tensor hashed in the pool on the GPU; float32: every
    tensor cast on the GPU, so hashed by its reader as read."""
    from cachedaemon.backends import get_backend
    from cachedaemon.config import LoadOptions, config_for
    from cachedaemon.cuda_load import gpu_hashing
    from cachedaemon.digest import differences, digest_dir
    from cachedaemon.pool import build_pool

    assert gpu_hashing(torch.device("cuda:0"))  # the bfloat16 load hashes on the GPU
    opts = LoadOptions(dtype=dtype, device="cuda:0")
    config = config_for(tiny_model, opts)
    pool, _ = build_pool(
        tiny_model, opts, get_backend(config.backend, "cuda:0"), config.fingerprint()
    )
    try:
        files = pool.manifest.files
    finally:
        pool.close()
    assert len(files) > 1 and differences(files, digest_dir(tiny_model)) == []
