"""The web page at ``/``, driven in a real headless Chromium (Debian's package) by
Playwright against a real ``xinference local`` server.

The quick test checks the page itself: served offline (every request it makes goes
to the server that served it), every control has an accessible name, and a launch
the API refuses shows the API's message next to the field it names.

The slow test is a user's session with the CPU build of vLLM: launch the tiny model
with Xavier from the form, send two chat prompts that share a long prefix (round
robin serves the second on the other replica, which loads the prefix from the
first), see the page report the remote hit and the counters rise, ask the prefix
box who holds the prompt, terminate, then start a second launch and cancel it. A
screenshot of each step is written under ``$XINFERENCE_WEB_SCREENSHOTS`` (or the
test's tmp dir).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from ..deploy.local_server import LocalServer, wait_for_no_descendants

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

# Past the supervisor's own engine-load deadline (900 s), so its error shows first.
LAUNCH_TIMEOUT_MS = 960_000
EXIT_TIMEOUT_S = 60.0
MODEL = "tiny-qwen2"
# Long enough for several 32-token blocks, so the second replica has a prefix to load.
SHARED_PREFIX = "You are a careful assistant. Answer in one short sentence. " * 12


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    chosen = os.environ.get("XINFERENCE_WEB_SCREENSHOTS")
    path = Path(chosen) if chosen else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass
class Session:
    """One page in a fresh Chromium profile, with what it requested and threw."""

    page: Any
    requested: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


@pytest.fixture
def session(server: LocalServer, tmp_path: Path) -> Iterator[Session]:
    with playwright_sync.sync_playwright() as driver:
        context = driver.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"),
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 1000},
        )
        try:
            page = context.pages[0] if context.pages else context.new_page()
            opened = Session(page)
            page.on("request", lambda r: opened.requested.append(r.url))
            page.on("pageerror", lambda e: opened.errors.append(str(e)))
            page.goto(server.endpoint + "/")
            yield opened
        finally:
            context.close()
    shutil.rmtree(tmp_path / "chromium-profile", ignore_errors=True)


def fill_launch_form(page: Any, *, replicas: str) -> None:
    page.get_by_label("Model (registry name or local path)").fill(MODEL)
    page.get_by_label("Replicas", exact=True).fill(replicas)
    page.get_by_label("Enable Xavier").check()
    page.get_by_label("Device budget per replica").fill("64")
    page.get_by_label("Device budget unit").select_option("MiB")
    page.get_by_label("Block size").fill("32")
    page.get_by_label("Max model length").fill("2048")
    # float32: vLLM's CPU bf16 outputs change with a KV connector (tests/api e2e).
    page.get_by_label("Data type").select_option("float32")
    page.get_by_label("Enforce eager").check()


def send_chat(page: Any, text: str) -> str:
    """Send ``text`` from the chat box; the new reply's summary line."""
    replies = page.get_by_role("list", name="Chat replies").get_by_role("listitem")
    before = replies.count()
    page.get_by_label("Message", exact=True).fill(text)
    page.get_by_role("button", name="Send").click()
    expect(replies).to_have_count(before + 1, timeout=120_000)
    return replies.first.locator(".meta").inner_text()


def wait_published(server: LocalServer, text: str) -> None:
    """Xavier publishes a request's blocks in the background once it returned:
    wait until the tracker lists the chat prompt's first blocks."""
    body = {"messages": [{"role": "user", "content": text}]}
    deadline = time.monotonic() + 30
    while True:
        response = httpx.post(
            f"{server.endpoint}/v1/models/{MODEL}/prefix", json=body, timeout=10
        )
        assert response.status_code == 200, response.text
        if response.json()["prefix_blocks"] >= 4:
            return
        assert time.monotonic() < deadline, response.json()
        time.sleep(0.05)


def figure(page: Any, rank: int, name: str) -> str:
    cell = page.locator(f'td[data-rank="{rank}"][data-figure="{name}"]')
    return cell.inner_text()


def test_page_is_offline_accessible_and_shows_api_errors(
    session: Session, server: LocalServer, screenshots: Path
) -> None:
    page = session.page
    expect(page).to_have_title("Xinference with Xavier")
    controls = page.locator("input, select, textarea, button")
    assert controls.count() >= 20
    for i in range(controls.count()):
        expect(controls.nth(i)).to_have_accessible_name(re.compile(r"\w"))

    fill_launch_form(page, replicas="1")
    page.get_by_role("button", name="Launch").click()
    replica_error = page.locator("#replica-error")
    # the API's own words, next to the field they are about
    expect(replica_error).to_contain_text("it needs replica >= 2, got 1")
    expect(page.get_by_label("Replicas", exact=True)).to_have_attribute(
        "aria-invalid", "true"
    )
    page.screenshot(path=str(screenshots / "0-refused.png"), full_page=True)

    page.get_by_label("Replicas", exact=True).fill("2")
    page.get_by_label("Device budget per replica").fill("-1")
    page.get_by_role("button", name="Launch").click()
    expect(page.locator("#xavier_gpu_cache_bytes-error")).to_contain_text(
        "invalid xavier_gpu_cache_bytes"
    )
    expect(replica_error).to_have_text("")
    assert session.errors == []
    assert len(session.requested) >= 4  # the page, its CSS and JS, the API
    for url in session.requested:
        assert url.startswith(server.endpoint + "/"), url


@pytest.mark.vllm
@pytest.mark.slow
# Two launches (the second cancelled) on a CPU that other jobs may share: a launch
# alone has taken over 10 minutes on a loaded 2-core machine.
@pytest.mark.timeout(1800)
def test_launch_chat_see_remote_hits_terminate(
    session: Session, server: LocalServer, screenshots: Path
) -> None:
    page = session.page
    baseline = server.descendants()
    fill_launch_form(page, replicas="2")
    page.get_by_role("button", name="Launch").click()
    # progress while the engines load
    expect(
        page.get_by_role("progressbar", name=f"Replicas of {MODEL} ready")
    ).to_be_visible()
    page.screenshot(path=str(screenshots / "1-launching.png"), full_page=True)
    expect(page.locator("#launch-status")).to_contain_text(
        f"Launched {MODEL}", timeout=LAUNCH_TIMEOUT_MS
    )
    table = page.get_by_role("table", name=f"Replicas of {MODEL}")
    expect(table).to_be_visible()
    expect(
        page.locator('td[data-rank="1"][data-figure="Remote hits (device)"]')
    ).to_have_text("0")
    page.screenshot(path=str(screenshots / "2-launched.png"), full_page=True)

    # Round robin: the first prompt goes to replica 0, the second to replica 1,
    # which has never seen the shared prefix and loads it from replica 0.
    first = send_chat(page, SHARED_PREFIX + "What colour is the sky?")
    assert first.startswith("Served by replica 0 · no remote hit"), first
    wait_published(server, SHARED_PREFIX + "What colour is the sky?")
    second = send_chat(page, SHARED_PREFIX + "What colour is grass?")
    match = re.match(
        r"Served by replica 1 · remote hit: (\d+) tokens loaded from replica 0", second
    )
    assert match, second
    loaded = int(match.group(1))
    assert loaded >= 4 * 32, second
    # the live counters follow: replica 1's hits cover what the reply reported
    hits = page.locator('td[data-rank="1"][data-figure="Remote hits (device)"]')
    expect(hits).not_to_have_text("0", timeout=10_000)
    assert int(hits.inner_text()) * 32 >= loaded
    assert int(figure(page, 1, "External tokens")) >= loaded
    assert figure(page, 0, "Remote hits (device)") == "0"
    assert figure(page, 1, "Load errors") == "0"
    page.screenshot(path=str(screenshots / "3-remote-hit.png"), full_page=True)

    page.get_by_label("Prompt (looked up as a chat user message)").fill(
        SHARED_PREFIX + "What colour is the sky?"
    )
    page.get_by_role("button", name="Look up").click()
    expect(page.locator("#prefix-result")).to_contain_text(
        re.compile(r"Replica [01] holds \d+ blocks")
    )
    page.screenshot(path=str(screenshots / "4-prefix.png"), full_page=True)

    page.get_by_role("button", name=f"Terminate {MODEL}").click()
    expect(page.locator("#models")).to_contain_text(
        "No model is launched.", timeout=180_000
    )
    page.screenshot(path=str(screenshots / "5-terminated.png"), full_page=True)
    assert wait_for_no_descendants(server, baseline, EXIT_TIMEOUT_S) == set()

    # A second launch, cancelled while its engines load: nothing is left behind.
    page.get_by_role("button", name="Launch").click()
    cancel = page.get_by_role("button", name=f"Cancel the launch of {MODEL}")
    cancel.click(timeout=60_000)
    expect(page.locator("#launch-status")).to_contain_text(
        "was cancelled", timeout=180_000
    )
    expect(page.locator("#models")).to_contain_text("No model is launched.")
    page.screenshot(path=str(screenshots / "6-cancelled.png"), full_page=True)
    assert wait_for_no_descendants(server, baseline, EXIT_TIMEOUT_S) == set()
    assert session.errors == []
