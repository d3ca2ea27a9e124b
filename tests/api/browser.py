"""Headless Chromium for the web-page tests: Debian's package driven by playwright.

Both browser test modules open the page the same way; a module that imports this
one is skipped, saying why, where playwright or the browser is missing.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

playwright_sync = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed (scripts/setup.sh)"
)
expect = playwright_sync.expect

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
if not Path(CHROMIUM).exists():
    pytest.skip(
        f"{CHROMIUM} is missing: Debian's chromium package (scripts/setup.sh)",
        allow_module_level=True,
    )


@contextmanager
def chromium_page(profile: Path, **context_options: Any) -> Iterator[Any]:
    """The first page of a fresh persistent Chromium profile at ``profile``,
    removed again (with the browser) when the block ends."""
    with playwright_sync.sync_playwright() as driver:
        context = driver.chromium.launch_persistent_context(
            str(profile),
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_ARGS,
            **context_options,
        )
        try:
            yield context.pages[0] if context.pages else context.new_page()
        finally:
            context.close()
    shutil.rmtree(profile, ignore_errors=True)
