"""Sentence embeddings as sentence-transformers computes them from a checkpoint's modules.

modules.json lists the pipeline: the Transformer, then a Pooling module (its config.json
names the mode: mean, cls, max, mean_sqrt_len or lasttoken, always over the attention
mask), then optionally Normalize (unit length). A dir without modules.json pools by mean.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import torch

from engine.errors import ModelConfigError
from engine.tokenizer import read_json

MODES = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_lasttoken": "lasttoken",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}
SUPPORTED = ("mean", "cls", "max", "mean_sqrt_len", "lasttoken")
MODULES = ("Transformer", "Pooling", "Normalize")


class Pooling(msgspec.Struct, frozen=True):
    mode: str = "mean"
    normalize: bool = False


def _mode(config_path: Path) -> str:
    config = read_json(config_path)
    modes = [mode for key, mode in MODES.items() if config.get(key)]
    if len(modes) != 1 or modes[0] not in SUPPORTED:
        raise ModelConfigError(
            f"{config_path}: pooling modes {modes or 'none'}; this engine pools with exactly "
            f"one of {', '.join(SUPPORTED)}"
        )
    return modes[0]


def read_pooling(model_dir: str | Path) -> Pooling:
    path = Path(model_dir) / "modules.json"
    if not path.is_file():
        return Pooling()
    try:
        modules = msgspec.json.decode(path.read_bytes(), type=list[dict[str, object]])
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ModelConfigError(f"{path}: not a list of modules ({e})") from e
    mode, normalize = "mean", False
    for m in modules:
        kind = str(m.get("type", "")).rpartition(".")[2]
        if kind not in MODULES:
            raise ModelConfigError(
                f"{path}: a {kind or 'nameless'} module; this engine runs {', '.join(MODULES)}"
            )
        if kind == "Pooling":
            mode = _mode(Path(model_dir) / str(m.get("path", "")) / "config.json")
        normalize = normalize or kind == "Normalize"
    return Pooling(mode, normalize)


def pool(hidden: torch.Tensor, mask: torch.Tensor, how: Pooling) -> torch.Tensor:
    """[batch, tokens, dim] hidden states and a [batch, tokens] mask -> [batch, dim]."""
    hidden, m = hidden.float(), mask.unsqueeze(-1).float()
    if how.mode == "cls":
        out = hidden[:, 0]
    elif how.mode == "max":
        out = hidden.masked_fill(m == 0, float("-inf")).max(dim=1).values
    elif how.mode == "lasttoken":
        last = mask.sum(dim=1) - 1
        out = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    else:
        total, count = (hidden * m).sum(dim=1), m.sum(dim=1).clamp(min=1e-9)
        out = total / (count if how.mode == "mean" else count.sqrt())
    return torch.nn.functional.normalize(out, p=2, dim=1) if how.normalize else out
