"""The next version of the tiny model, for updates and refits."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def next_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The next version: the tiny preset's shapes, other weights."""
    from cachedaemon.checkpoint_gen import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("models") / "tiny-v2", "tiny", seed=1)
