"""A pool is attached only to the checkpoint it was loaded from: changed weights under the
same header, a file rewritten in place, a copy at another path (accepted after a content
check), and the digest that escrow keeps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from cachedaemon import digest, protocol
from cachedaemon.backends import get_backend
from cachedaemon.client import attach_model
from cachedaemon.config import LoadOptions, make_config
from cachedaemon.digest import digest_dir
from cachedaemon.errors import CacheMismatch
from cachedaemon.pool import build_pool
from engine.config import EngineConfig
from engine.errors import WeightsError
from engine.weights import load_weights
from tests.cachedaemon.test_attach import meta_module
from tests.conftest import REPO, LoggedProc, child_env
from tests.identity_checkpoints import TENSOR, changed_copy, copy_of, scale_in_place


def module_for(model: Path) -> torch.nn.Module:
    full = load_file(model / "model.safetensors")
    return meta_module({n: tuple(t.shape) for n, t in full.items()})


def verify(sock: Path, model: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "cachedaemon", "verify", "--socket", str(sock)]
    return subprocess.run(
        [*argv, "--model", str(model), *extra],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=REPO,
        timeout=120,
    )


@pytest.fixture
def original(tiny_model: Path, tmp_path: Path) -> Path:
    return copy_of(tiny_model, tmp_path / "original")


@pytest.fixture
def served(original: Path, tmp_path: Path, start_daemon: Any) -> Path:
    start_daemon(original, tmp_path / "run")
    return tmp_path / "run" / "daemon-0.sock"


def test_changed_weights_under_the_same_header_are_refused_naming_the_file(
    original: Path, served: Path, tmp_path: Path
) -> None:
    changed, scaled = changed_copy(original, tmp_path / "changed")
    with pytest.raises(CacheMismatch, match=r"model\.safetensors: .*inode") as info:
        attach_model(module_for(changed), served, make_config(changed), model_dir=changed)
    assert info.value.fields == ["checkpoint"] and info.value.stat_only
    assert f"cachedaemon verify --socket {served} --model {changed}" in str(info.value)
    # a content check does not accept it either, and says which file holds other bytes
    with pytest.raises(CacheMismatch, match=r"model\.safetensors: content differs") as info:
        attach_model(
            module_for(changed), served, make_config(changed), model_dir=changed, verify="content"
        )
    assert not info.value.stat_only


def test_changed_weights_fall_back_to_disk_and_say_why(
    original: Path, served: Path, tmp_path: Path
) -> None:
    changed, scaled = changed_copy(original, tmp_path / "changed")
    module = module_for(changed)
    report = attach_model(module, served, make_config(changed), model_dir=changed, fallback=True)
    assert report.source == "disk" and "model.safetensors" in report.fallback_reason
    assert torch.equal(module.get_parameter(TENSOR), scaled)  # the changed weights, not the pool's


def test_a_file_rewritten_in_place_is_caught_by_stat(original: Path, served: Path) -> None:
    before = (original / "model.safetensors").stat()
    scale_in_place(original)  # same file, same inode, same size, same header
    after = (original / "model.safetensors").stat()
    assert (after.st_ino, after.st_size) == (before.st_ino, before.st_size)
    with pytest.raises(CacheMismatch, match=r"model\.safetensors: mtime_ns, ctime_ns differ"):
        attach_model(module_for(original), served, make_config(original))


def test_the_reference_engine_refuses_with_the_file_and_the_flags(
    original: Path, served: Path, tmp_path: Path
) -> None:
    changed, _ = changed_copy(original, tmp_path / "changed")
    cfg = EngineConfig(model=str(changed), daemons=(str(served),), dtype="bfloat16")
    with pytest.raises(WeightsError, match=r"model\.safetensors.*--verify content") as info:
        load_weights(module_for(changed), cfg)
    assert "--allow-disk-fallback" in str(info.value)
    fallback = EngineConfig(model=str(changed), daemons=(str(served),), allow_disk_fallback=True)
    assert load_weights(module_for(changed), fallback).source == "disk"


def test_a_byte_identical_copy_is_attached_after_a_content_check(
    original: Path, served: Path, tmp_path: Path
) -> None:
    copy = copy_of(original, tmp_path / "copy")
    with pytest.raises(CacheMismatch, match="cachedaemon verify"):
        attach_model(module_for(copy), served, make_config(copy))
    done = verify(served, copy)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "holds the bytes the pool" in done.stdout and "stat facts differ" in done.stdout
    report = attach_model(
        module_for(copy), served, make_config(copy), model_dir=copy, verify="content"
    )
    assert report.source == "daemon"
    cfg = EngineConfig(model=str(copy), daemons=(str(served),), verify="content")
    assert load_weights(module_for(copy), cfg).source == "daemon"


def test_a_bad_verify_mode_names_the_flag() -> None:
    from engine.config import from_args
    from engine.errors import EngineError

    argv = ["--model", "/m", "--allow-disk-fallback"]
    with pytest.raises(EngineError, match="--verify/HOLDFAST_VERIFY 'sha' is not one of stat"):
        from_args([*argv, "--verify", "sha"], {})
    assert from_args(argv, {"HOLDFAST_VERIFY": "content"}).verify == "content"


def test_verify_names_the_file_that_differs(original: Path, served: Path, tmp_path: Path) -> None:
    changed, _ = changed_copy(original, tmp_path / "changed")
    done = verify(served, changed)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "model.safetensors: content differs" in done.stdout
    assert "config.json" not in done.stdout
    same = json.loads(verify(served, original, "--json").stdout)
    assert same == {"same_content": True, "content": [], "stat": []}


def test_escrow_keeps_the_digest(original: Path, tmp_path: Path, start_daemon: Any) -> None:
    keeper_sock = tmp_path / "keeper.sock"
    keeper = LoggedProc(
        [sys.executable, "-m", "cachedaemon", "keeper", "--socket", str(keeper_sock)]
    )
    try:
        keeper.wait_for("keeper serving", 60)
        run = tmp_path / "run"
        first = start_daemon(original, run, "--keeper", str(keeper_sock))
        sock = str(run / "daemon-0.sock")
        reply, _ = protocol.call(sock, protocol.StatusRequest())
        assert isinstance(reply, protocol.StatusReply) and not reply.adopted
        assert reply.files == digest_dir(original)
        first.stop()
        start_daemon(original, run, "--keeper", str(keeper_sock))
        again, _ = protocol.call(sock, protocol.StatusRequest())
        assert isinstance(again, protocol.StatusReply) and again.adopted
        assert again.files == reply.files  # known without reading the checkpoint
        copy = copy_of(original, tmp_path / "copy")
        report = attach_model(
            module_for(copy), sock, make_config(copy), model_dir=copy, verify="content"
        )
        assert report.source == "daemon"
    finally:
        keeper.stop()


@pytest.mark.parametrize(
    "opts",
    [
        LoadOptions(dtype="bfloat16"),  # read straight into the pool
        LoadOptions(dtype="float32"),  # read into a buffer, converted
        LoadOptions(dtype="bfloat16", tp_size=2, tp_rank=1),  # read whole, then split
    ],
)
def test_the_load_digest_is_the_dir_digest_whatever_the_pool_is_made_of(
    original: Path, opts: LoadOptions, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(digest, "PIECE", 4096)  # tensors of many pieces, as in a real model
    pool, _ = build_pool(original, opts, get_backend("memfd", "cpu"), "fp")
    try:
        assert pool.manifest.files == digest_dir(original)
        assert [f.name for f in pool.manifest.files] == ["config.json", "model.safetensors"]
    finally:
        pool.close()
    scale_in_place(original)
    assert digest_dir(original)[1].blake3 != pool.manifest.files[1].blake3


def test_the_gpu_readers_digest_slice_by_slice_is_the_dir_digest(
    original: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU load's readers hash each slice right after its pread (Digester.read): read in
    staging pieces of two digest pieces, slices that do not divide a piece, the digest is
    the dir's and the bytes read are the file's."""
    import os
    from collections.abc import Callable

    from cachedaemon.checkpoint import CheckpointReader, TensorInfo
    from cachedaemon.cuda_load import _pread_exact

    monkeypatch.setattr(digest, "PIECE", 4096)
    monkeypatch.setattr(digest, "SLICE", 1000)
    staging = 2 * 4096

    def preader(fd: int, info: TensorInfo) -> Callable[[memoryview, int], None]:
        return lambda view, at: _pread_exact(fd, view, info.start + at, info)

    with CheckpointReader(original) as reader:
        digester = digest.Digester(
            reader.model_dir / "config.json", reader.files, reader.tensors.values()
        )
        try:
            for info in reader.tensors.values():
                fd = os.open(info.path, os.O_RDONLY)
                try:
                    got = bytearray()
                    for start in range(0, info.nbytes, staging):
                        buf = memoryview(bytearray(min(staging, info.nbytes - start)))
                        digester.read(info, buf, start, preader(fd, info))
                        got += buf
                    assert bytes(got) == os.pread(fd, info.nbytes, info.start)
                finally:
                    os.close(fd)
            assert digester.result() == digest_dir(original)
        finally:
            digester.close()
    assert max(i.nbytes for i in reader.tensors.values()) > staging  # slices and pieces met
