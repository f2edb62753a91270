"""--model-loader-extra-config of `--load-format holdfast`: one frozen struct, checked once.

    {"sockets": ["/run/h/daemon-0.sock", "/run/h/daemon-1.sock"],   # TP rank -> socket
     "fallback": true, "mode": "zero_copy", "timeout_s": 10, "layout": "vllm",
     "verify": "stat"}

`sockets` defaults to HOLDFAST_DAEMONS (comma-separated, as the supervisor sets it),
`verify` to HOLDFAST_VERIFY.
Imports neither torch nor vLLM.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from holdfast_contract.env import var
from holdfast_vllm.errors import PluginError

Mode = Literal["zero_copy", "copy"]
Layout = Literal["vllm", "reference"]
Verify = Literal["stat", "content"]
DAEMONS = var("daemons")  # HOLDFAST_DAEMONS
VERIFY = var("verify")  # HOLDFAST_VERIFY
MODES = ("zero_copy", "copy")


class LoaderOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    sockets: tuple[str, ...] = ()
    fallback: bool = False  # load from disk with vLLM's default loader instead of failing
    mode: Mode = "zero_copy"  # zero_copy: parameters are views of the pool; copy: private
    timeout_s: float = 10.0  # seconds to wait for a daemon's answer
    # vllm: the pool holds vLLM's own parameters (`cachedaemon serve --layout vllm`), all
    # shared; reference: the checkpoint's tensors, vLLM's fused parameters private copies
    layout: Layout = "vllm"
    # stat: attach a pool loaded from --model's very files (stat facts equal; no tensor
    # data read); content: also one loaded from a byte-identical copy, after digesting
    # --model's files (every byte read once)
    verify: Verify = "stat"

    def socket_for(self, rank: int, world_size: int) -> str:
        """The daemon socket of tensor-parallel rank `rank`."""
        if len(self.sockets) != world_size:
            raise PluginError(
                f"--model-loader-extra-config names {len(self.sockets)} daemon socket(s) for "
                f'tensor-parallel size {world_size}: give one per rank in "sockets" (rank '
                f"order), or set {DAEMONS} (comma-separated)"
            )
        return self.sockets[rank]


def parse(
    extra: Mapping[str, Any] | None, environ: Mapping[str, str] = os.environ
) -> LoaderOptions:
    """The options of one vLLM LoadConfig; PluginError names the key to fix."""
    raw = dict(extra or {})
    if "sockets" not in raw and environ.get(DAEMONS):
        raw["sockets"] = [s for s in environ[DAEMONS].split(",") if s]
    if "verify" not in raw and environ.get(VERIFY):
        raw["verify"] = environ[VERIFY]
    if isinstance(raw.get("sockets"), str):
        raw["sockets"] = [raw["sockets"]]
    try:
        opts = msgspec.convert(raw, LoaderOptions)
    except msgspec.ValidationError as e:
        raise PluginError(
            f"--model-loader-extra-config for --load-format holdfast: {e}; keys: "
            f"sockets (list of paths, one per TP rank), fallback (bool), mode "
            f"({' or '.join(MODES)}), timeout_s (seconds), layout (vllm or reference), "
            f"verify (stat or content; default {VERIFY})"
        ) from e
    if not opts.sockets:
        raise PluginError(
            "--load-format holdfast needs the daemon sockets: pass "
            '--model-loader-extra-config \'{"sockets": ["<run>/daemon-0.sock"]}\' or set '
            f"{DAEMONS}"
        )
    if opts.timeout_s <= 0:
        raise PluginError(f"timeout_s must be > 0 seconds, not {opts.timeout_s}")
    return opts
