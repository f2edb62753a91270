"""A KV cache shared on a GPU (engine/kvshare.py, engine/kvcuda.py): the writer's cache is
one VMM allocation, exported as an fd and held by the keeper; a standby maps only a few
pages of a range of the same size, and a CUDA graph captured over that range replays on
the dead writer's keys and values once the standby has adopted them, at the same addresses.

Real processes, a real keeper, real device memory; skipped without CUDA."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import torch

from cachedaemon import protocol
from cachedaemon.keeper import Keeper
from engine.kvshare import Home, Layout
from holdfast_contract.agent_protocol import kv_key
from tests.engine.test_kvshare import end, spawn

# 4 layers of 2399 blocks (and scratch) of 16 tokens, 8 heads of 128: 2 x 300 MB (600 MB)
LAYOUT = Layout(
    layers=4, blocks=2399, block_size=16, kv_heads=8, head_dim=128, dtype="bfloat16", model="m"
)
WRITER = textwrap.dedent(
    """
    import sys, time, torch
    from engine.kvshare import Entry, Home, Layout
    layout = Layout(4, 2399, 16, 8, 128, "bfloat16", "m")
    home = Home(sys.argv[1], "writer", layout, 600, 4, 64, torch.device("cuda:0"))
    shared = home.fresh(primary=True)
    k, v = shared.tensors()
    k.fill_(1.5)
    v.fill_(-2.0)
    torch.cuda.synchronize()
    shared.write([Entry("a", list(range(40)), [3, 4, 5])], [3, 4, 5, 9])
    print("written", shared.space.base, flush=True)
    time.sleep(600)
    """
)


@pytest.mark.gpu
def test_a_standby_adopts_a_dead_writers_gpu_cache_under_its_captured_graph(
    tmp_path: Path,
) -> None:
    with Keeper(tmp_path / "keeper.sock") as keeper:
        proc = spawn(WRITER, keeper, "written")
        try:
            device = torch.device("cuda:0")
            home = Home(str(keeper.socket_path), "standby", LAYOUT, 600, 4, 64, device)
            cache = home.standby_cache(256)
            space = home.space
            assert space is not None
            assert cache.usable == 16 and cache.blocks == LAYOUT.blocks
            # a few pages: the first 16 blocks and the scratch one of each layer, not all
            assert space.mapped <= space.size // 8, (space.mapped, space.size)
            cache.k[:, :16].fill_(7.0)  # what the standby computed on its own pages
            cache.k[:, LAYOUT.blocks].fill_(7.0)
            k_at, v_at = cache.k.data_ptr(), cache.v.data_ptr()
            out = torch.zeros(3, dtype=torch.float32, device=device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out[0] = cache.k[0, 4].float().mean()
                out[1] = cache.v[3, LAYOUT.blocks].float().mean()
                out[2] = cache.k[3, 5].float().mean()
            graph.replay()
            torch.cuda.synchronize()
            assert out[0].item() == 7.0
            proc.kill()
            proc.wait()  # reaped: its exit is over, its device context gone
            took, why = home.take_over(kv_key("writer"))
            assert why == "" and [e.key for e in took.entries] == ["a"] and took.held == [9]
            adopted = home.cache(took.shared)
            assert (adopted.k.data_ptr(), adopted.v.data_ptr()) == (k_at, v_at)
            assert space.mapped == space.size and adopted.usable == LAYOUT.blocks
            graph.replay()  # captured over the standby's pages: reads the writer's now
            torch.cuda.synchronize()
            assert out.tolist() == [1.5, -2.0, 1.5]
            assert bool((adopted.v == -2.0).all())
            home.deposit(took.shared, primary=True)  # the adopter's to hand on at its own death
            reply, fds = protocol.call(
                str(keeper.socket_path), protocol.ReclaimKV(kv_key("standby")), max_fds=2
            )
            assert isinstance(reply, protocol.KVReclaimed) and len(fds) == 2
            for fd in fds:
                os.close(fd)
        finally:
            end(proc)
