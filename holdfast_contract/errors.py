"""The root of every error holdfast raises on purpose, and the contract's own errors."""

from __future__ import annotations


class HoldfastError(Exception):
    """Root of every error holdfast raises on purpose."""


class ContractError(HoldfastError):
    """Something one side handed the other breaks the contract between them."""


class EnvError(ContractError):
    """A HOLDFAST_* variable is missing or malformed; the message names the variable."""


class ForkServerError(ContractError):
    """No engine fork server answers, or it refused the request; the message says which."""


class ProtocolError(ContractError):
    """A frame on a holdfast socket is garbage, truncated, oversized or unexpected."""
