"""The fork server's own errors."""

from __future__ import annotations

from holdfast_contract.errors import HoldfastError


class ForkError(HoldfastError):
    """The fork server cannot listen or serve a request as asked; the message says why."""
