"""Who may join the cluster: a worker shows the secret the supervisor was given.

This keeps a stray or hostile worker from registering (and from being handed
replicas, prompts and KV blocks). It does not make the xoscar pools private:
they take any actor call from whoever reaches them (see ``docs/security.md``).
"""

from __future__ import annotations

import hmac


class WorkerRefused(PermissionError):
    """The supervisor did not take the worker in; the message never holds a secret."""


def secret_matches(expected: str | None, presented: str | None) -> bool:
    """Whether a worker may join: any may when the cluster has no secret."""
    if expected is None:
        return True
    if presented is None:
        return False
    return hmac.compare_digest(expected.encode(), presented.encode())
