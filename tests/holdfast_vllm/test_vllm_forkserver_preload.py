"""What the vLLM fork server imports before it forks: the CPU worker only on the CPU, and a
refusal to serve a CUDA machine when the imports replaced torch's own pin_memory, streams or
events (vllm.v1.worker.cpu.shm does, on import; every fork of an H100's server inherited it
and died in its sampler's first Triton kernel)."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest

from supervisor.kinds.vllm_spec import VllmSpec, python_of

VLLM_PYTHON = python_of(VllmSpec())
ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not Path(VLLM_PYTHON).is_file(), reason="no vLLM venv"),
]


def run_vllm_python(code: str) -> str:
    done = subprocess.run(
        [VLLM_PYTHON, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "VLLM_TARGET_DEVICE": "cpu"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_cpu_workers_import_is_seen_replacing_torchs_pin_memory_streams_and_events() -> None:
    out = run_vllm_python(
        """
        from holdfast_vllm.forkserver import torch_as_found, torch_replaced
        before = torch_as_found()
        assert torch_replaced(before) == []
        import vllm.v1.worker.cpu.shm  # noqa: F401
        print(",".join(torch_replaced(before)))
        """
    )
    replaced = out.strip().split(",")
    assert "torch.Tensor.pin_memory" in replaced
    assert "torch.cuda.Stream" in replaced and "torch.cuda.Event" in replaced


def test_vllms_own_stream_tracking_which_every_engine_has_is_not_counted() -> None:
    out = run_vllm_python(
        """
        import torch
        from holdfast_vllm.forkserver import torch_as_found, torch_replaced
        before = torch_as_found()
        import vllm.utils.torch_utils  # noqa: F401
        print(torch.cuda.set_stream is not before["torch.cuda.set_stream"])
        print(",".join(torch_replaced(before)) or "none")
        """
    )
    patched, replaced = out.strip().splitlines()[-2:]
    assert patched == "True"  # vLLM wraps it on every platform
    assert replaced == "none"


def test_the_cpu_worker_is_preloaded_only_where_vllms_platform_is_the_cpu() -> None:
    out = run_vllm_python(
        """
        import sys
        from holdfast_vllm.forkserver import CPU_PRELOAD, preload
        from vllm.platforms import current_platform
        seconds, missing = preload()
        print(current_platform.device_name)
        print(",".join(name for name in CPU_PRELOAD if name in sys.modules))
        """
    )
    platform, loaded = out.strip().splitlines()[-2:]
    assert platform == "cpu"
    assert loaded.split(",") == ["vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner"]


def test_warm_loads_the_tokenizer_and_chat_template_an_api_server_then_finds(
    tiny_model: Path,
) -> None:
    out = run_vllm_python(
        f"""
        from holdfast_vllm.forkserver import warm
        seconds, failed = warm({str(tiny_model)!r})
        assert failed == [], failed
        from vllm.engine.arg_utils import EngineArgs
        from vllm.renderers.hf import resolve_chat_template
        from vllm.tokenizers.registry import cached_get_tokenizer, cached_tokenizer_from_config
        from vllm.transformers_utils.processor import cached_get_processor
        loads = cached_get_tokenizer.cache_info().misses, cached_get_processor.cache_info().misses
        # what the API server does, with the ModelConfig its own flags make
        config = EngineArgs(model={str(tiny_model)!r}).create_model_config()
        tokenizer = cached_tokenizer_from_config(config)
        template = resolve_chat_template(tokenizer, None, None, model_config=config)
        print(loads, cached_get_tokenizer.cache_info().misses,
              cached_get_processor.cache_info().misses, cached_get_tokenizer.cache_info().hits,
              template is not None)
        """
    )
    loads, tokenizers, processors, hits, template = out.strip().splitlines()[-1].rsplit(" ", 4)
    assert loads == "(1, 1)"  # warm loaded each once
    assert (tokenizers, processors) == ("1", "1")  # and the server's calls loaded none again
    assert hits == "1" and template == "True"
