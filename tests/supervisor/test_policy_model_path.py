"""`supervisor validate` says what is wrong with model.path as it is: missing, a file, a dir
without config.json."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.errors import PolicyError
from supervisor.policy_file import parse_policy

FIX = "point it at a Hugging Face checkpoint dir (config.json + *.safetensors)"


def model_path_error(path: Path, tmp_path: Path) -> str:
    with pytest.raises(PolicyError) as info:
        parse_policy(f"model: {{path: '{path}'}}\n", tmp_path / "policy.yaml")
    (error,) = [e for e in info.value.errors if e.startswith("$.model.path")]
    return error


def test_a_missing_model_path_is_said_not_to_exist(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    assert model_path_error(missing, tmp_path) == f"$.model.path: {missing} does not exist; {FIX}"


def test_a_file_as_model_path_is_said_not_to_be_a_directory(tmp_path: Path) -> None:
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"")
    assert model_path_error(file, tmp_path) == f"$.model.path: {file} is not a directory; {FIX}"


def test_an_empty_dir_as_model_path_holds_no_config(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert model_path_error(empty, tmp_path) == f"$.model.path: {empty} holds no config.json; {FIX}"
