"""What the operator sets for the REST server: the options of ``xinference-local``
and ``xinference-supervisor`` that shape how requests are served, in one value
that ``create_app`` takes (``deploy/cmdline.py`` turns the command line into it;
code that starts a server itself passes its own)."""

from __future__ import annotations

from dataclasses import dataclass

from .body_limit import DEFAULT_MAX_REQUEST_BYTES
from .tenancy import DEFAULT_KV_SHARING, KV_SHARING


@dataclass(frozen=True, slots=True)
class ServerOptions:
    # the largest request body read (``body_limit.py``): a larger one is a 413
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    # whose requests share cached KV with authentication on (``tenancy.py``):
    # "user", "key" or "all"
    kv_sharing: str = DEFAULT_KV_SHARING

    def __post_init__(self) -> None:
        if self.max_request_bytes <= 0:
            raise ValueError(
                f"--max-request-bytes must be positive, got {self.max_request_bytes}"
            )
        if self.kv_sharing not in KV_SHARING:
            raise ValueError(
                f"--kv-sharing must be one of {', '.join(KV_SHARING)}, "
                f"got {self.kv_sharing!r}"
            )
