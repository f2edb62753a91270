"""The warm-up on CUDA runs one decoder layer of each kind: which layers those are, and
that the model has all of its layers again after it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from engine.job import Job
from engine.modelargs import read_model_args
from engine.runner import one_of_each_kind
from tests.engine.test_engine_batching import build_engine


def test_identical_layers_are_one_kind() -> None:
    layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(5))
    kept = one_of_each_kind(layers)
    assert len(kept) == 1 and kept[0] is layers[0]


def test_a_layer_of_other_shapes_or_dtype_or_class_is_a_kind_of_its_own() -> None:
    layers = nn.ModuleList(
        [
            nn.Linear(4, 4),
            nn.Linear(4, 4),
            nn.Linear(4, 8),  # other shapes
            nn.Linear(4, 4).to(torch.bfloat16),  # other dtype
            nn.Linear(4, 8),
            nn.Bilinear(4, 4, 4),  # another class
            nn.Linear(4, 4, bias=False),  # another set of tensors
        ]
    )
    kept = one_of_each_kind(layers)
    assert [id(m) for m in kept] == [id(layers[i]) for i in (0, 2, 3, 5, 6)]


@pytest.mark.gpu
def test_a_cuda_engine_warmed_on_one_layer_answers_with_every_layer(tiny_model: Path) -> None:
    """The warm-up's layers are put back: the CUDA engine's float32 answer is the CPU's."""
    answers = []
    for device in ("cpu", "cuda"):
        engine = build_engine(tiny_model, device=device)
        layers = engine.runner.model.model.layers
        assert len(layers) == read_model_args(tiny_model).num_hidden_layers > 1
        engine.start()
        try:
            answers.append(engine.run(Job((5, 17, 99, 3), 24, ignore_eos=True)).tokens)
        finally:
            engine.stop_followers()
    assert answers[0] == answers[1]
