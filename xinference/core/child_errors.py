"""What the processes an engine starts write to stderr, kept to name a failure.

vLLM's engine core runs in a process of its own; when it fails to start, the
process that started it raises only "Engine core initialization failed. See root
cause above. Failed core proc(s): {}", and the cause (vLLM's own words, such as
"No common block size for 16 (CPU_ATTN: [MultipleOf(32)])") is in the traceback
the engine core printed to its stderr: in the server's log, never in the error a
user sees. ``ChildStderr`` puts a pipe in place of this process's stderr while
the engine starts, so that the processes started meanwhile inherit it; a thread
copies everything that comes through to the real stderr (the log reads as
before, for as long as those processes live) and keeps the last lines, from
which ``root_cause`` reads the last exception printed.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from collections import deque
from types import TracebackType

# How much of the children's latest output is kept (bytes), and how long a failure
# waits for their last lines to come through the pipe.
TAIL_BYTES = 64 * 1024
SETTLE_S = 0.2
SETTLE_MAX_S = 2.0

# The last line of a traceback: "ValueError: ...", "torch.OutOfMemoryError: ..."
_EXCEPTION_LINE = re.compile(
    r"^(?P<name>[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)): (?P<message>.+)$"
)


def root_cause(text: str) -> str | None:
    """The last exception line (``Name: message``) in ``text``, else None."""
    for line in reversed(text.splitlines()):
        if _EXCEPTION_LINE.match(line.strip()):
            return line.strip()
    return None


class ChildStderr:
    """A context: stderr goes through a pipe copied to the real one, so that the
    processes started inside it write through it too (for their whole life)."""

    def __init__(self) -> None:
        self._tail: deque[bytes] = deque()
        self._kept = 0
        self._lock = threading.Lock()
        self._last_data = time.monotonic()
        self._pump: threading.Thread | None = None

    def __enter__(self) -> ChildStderr:
        sys.stderr.flush()
        real = os.dup(2)
        read_end, write_end = os.pipe()
        os.dup2(write_end, 2)  # inheritable: the children write here
        os.close(write_end)
        self._pump = threading.Thread(
            target=self._copy, args=(read_end, real), name="child-stderr", daemon=True
        )
        self._real = real
        self._pump.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        # This process writes to the real stderr again; the children keep the
        # pipe, which the pump empties until the last of them has exited.
        sys.stderr.flush()
        os.dup2(self._real, 2)

    def text(self) -> str:
        """The children's latest output, once it stood still for ``SETTLE_S``
        (at most ``SETTLE_MAX_S``): a process that failed wrote its traceback
        before it exited, but the pump may not have read it yet."""
        deadline = time.monotonic() + SETTLE_MAX_S
        while time.monotonic() < deadline:
            with self._lock:
                quiet = time.monotonic() - self._last_data
            if quiet >= SETTLE_S:
                break
            time.sleep(SETTLE_S - quiet)
        with self._lock:
            return b"".join(self._tail).decode(errors="replace")

    def _copy(self, read_end: int, real: int) -> None:
        try:
            while chunk := os.read(read_end, 65536):
                try:
                    os.write(real, chunk)
                except OSError:
                    pass  # the real stderr is gone: keep draining, or writers block
                with self._lock:
                    self._last_data = time.monotonic()
                    self._tail.append(chunk)
                    self._kept += len(chunk)
                    while self._kept - len(self._tail[0]) >= TAIL_BYTES:
                        self._kept -= len(self._tail.popleft())
        finally:
            os.close(read_end)
            os.close(real)
