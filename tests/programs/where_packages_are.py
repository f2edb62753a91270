"""Print where each of holdfast's packages is imported from, one `name path` a line."""

from __future__ import annotations

import importlib

for name in ("cachedaemon", "supervisor", "engine", "chaos", "holdfast_contract", "holdfast_vllm"):
    module = importlib.import_module(name)
    print(name, module.__file__)
