"""Which view of a persistent transfer slab a copy goes through: pure policy.

A GPU transfer copies through a persistent slab (``full_bytes``) or through a small
prefix view of it. Copying a small batch through the small view moves fewer bytes,
but xoscar's NIXL channel keeps a registration only while each copy uses the very
same local and remote buffer objects as the copy before it: a switch between the two
views re-registers memory on both endpoints. Switching back and forth costs more
than the padding it saves, so the small view is used only once small batches from a
source have become a habit.

No torch, CUDA or xoscar here: sizes are plain integers.
"""

from __future__ import annotations

from typing import Protocol

DEFAULT_SMALL_BYTES = 256 * 1024
DEFAULT_STREAK = 2


class SlabPolicy(Protocol):
    """What a transfer runtime asks: how many bytes to copy for this batch."""

    def select(self, source_rank: int, nbytes: int) -> int: ...


def _require_int(name: str, value: object, minimum: int) -> int:
    # bool is an int subclass; a flag passed as a size is a caller's mistake.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return value


class _SizedPolicy:
    """Shared sizing and argument checks of the policies below."""

    def __init__(self, full_bytes: int, small_bytes: int) -> None:
        self.full_bytes = _require_int("full_bytes", full_bytes, 1)
        _require_int("small_bytes", small_bytes, 1)
        # The view is a prefix of the slab, so it can never be larger than it.
        self.view_bytes = min(full_bytes, small_bytes)

    def _check_batch(self, source_rank: int, nbytes: int) -> None:
        _require_int("source_rank", source_rank, 0)
        _require_int("nbytes", nbytes, 0)
        if nbytes > self.full_bytes:
            raise ValueError(
                f"a batch of {nbytes} bytes does not fit the {self.full_bytes}-byte "
                "slab; split it into slab-sized copies"
            )


class SlabSelector(_SizedPolicy):
    """Full slab, or the small view once a source keeps sending small batches.

    A batch is small when it fits the view (``nbytes <= view_bytes``, equality
    included). A large batch resets its source's streak and takes the full slab. A
    small batch takes the view only when it completes ``streak`` consecutive small
    batches from that source rank, itself included; before that it takes the full
    slab, so a small/large alternation stays on one buffer and registers nothing
    new. Each source rank has its own streak: copies from different peers run on
    different channels, each with its own registration.
    """

    def __init__(
        self,
        full_bytes: int,
        small_bytes: int = DEFAULT_SMALL_BYTES,
        streak: int = DEFAULT_STREAK,
    ) -> None:
        super().__init__(full_bytes, small_bytes)
        self.streak = _require_int("streak", streak, 1)
        # source rank -> consecutive small batches so far, capped at ``streak``
        self._small_run: dict[int, int] = {}

    def select(self, source_rank: int, nbytes: int) -> int:
        self._check_batch(source_rank, nbytes)
        if nbytes > self.view_bytes:
            self._small_run[source_rank] = 0
            return self.full_bytes
        run = min(self._small_run.get(source_rank, 0) + 1, self.streak)
        self._small_run[source_rank] = run
        return self.view_bytes if run >= self.streak else self.full_bytes

    def forget(self, source_rank: int) -> None:
        """Drop a source's streak (the peer left; a new incarnation starts afresh)."""
        self._small_run.pop(source_rank, None)


class SmallestFitSelector(_SizedPolicy):
    """Reference only: the view whenever the batch fits it, as before the streak rule.

    Kept so that benchmarks and regression tests can show the re-registrations that
    ``SlabSelector`` avoids.
    """

    def __init__(self, full_bytes: int, small_bytes: int = DEFAULT_SMALL_BYTES) -> None:
        super().__init__(full_bytes, small_bytes)

    def select(self, source_rank: int, nbytes: int) -> int:
        self._check_batch(source_rank, nbytes)
        return self.view_bytes if nbytes <= self.view_bytes else self.full_bytes


class FullSlabSelector(_SizedPolicy):
    """Reference only: always the full slab (no view), the padding baseline."""

    def __init__(self, full_bytes: int, small_bytes: int = DEFAULT_SMALL_BYTES) -> None:
        super().__init__(full_bytes, small_bytes)

    def select(self, source_rank: int, nbytes: int) -> int:
        self._check_batch(source_rank, nbytes)
        return self.full_bytes
