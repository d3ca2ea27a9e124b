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
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from xinference.api.restful_api import replica_stats_json
from xinference.core.messages import ReplicaStats
from xinference.model.llm.vllm.xavier.stats import (
    ActorCounters,
    StoreStats,
    TransportStats,
    XavierStats,
)

from ..deploy.local_server import LocalServer, wait_for_no_descendants
from .browser import chromium_page, expect

# Past the supervisor's own engine-load deadline (900 s), so its error shows first.
LAUNCH_TIMEOUT_MS = 960_000
EXIT_TIMEOUT_S = 60.0
MODEL = "tiny-qwen2"
# Long enough for several 32-token blocks, so the second replica has a prefix to load.
SHARED_PREFIX = "You are a careful assistant. Answer in one short sentence. " * 12
NONZERO = re.compile(r"^(0\.\d*[1-9]\d*|1(\.0*)?)$")


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
    console: list[str] = field(default_factory=list)  # "type: text"


@pytest.fixture
def session(server: LocalServer, tmp_path: Path) -> Iterator[Session]:
    profile = tmp_path / "chromium-profile"
    with chromium_page(profile, viewport={"width": 1400, "height": 1000}) as page:
        opened = Session(page)
        page.on("request", lambda r: opened.requested.append(r.url))
        page.on("pageerror", lambda e: opened.errors.append(str(e)))
        page.on("console", lambda m: opened.console.append(f"{m.type}: {m.text}"))
        page.goto(server.endpoint + "/")
        yield opened


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
    # the browser's own requests (the page's icon) found what they asked for
    assert not [line for line in session.console if "404" in line], session.console
    assert len(session.requested) >= 4  # the page, its CSS and JS, the API
    for url in session.requested:
        assert url.startswith(server.endpoint + "/"), url


class StubApi:
    """Answers the page's API calls from scripted state (``page.route``), so that
    the page's handling of each answer is checked without engines."""

    def __init__(self) -> None:
        self.models: list[dict[str, Any]] = []
        self.progress = 0.0
        # (status, body) of the next POST /v1/chat/completions and /v1/models
        self.chat: tuple[int, dict[str, Any]] = (200, {})
        self.launch: tuple[int, dict[str, Any]] = (200, {})
        self.stats: list[dict[str, Any]] = []  # GET /v1/models/{uid}/stats
        self.prefix: dict[str, Any] = {}  # POST /v1/models/{uid}/prefix
        self.registrations: list[dict[str, Any]] = []
        self.terminated: dict[str, Any] = {}  # DELETE /v1/models/{uid}'s answer
        self.deletes: list[str] = []  # the paths DELETE was sent to
        self.down = False  # the server stopped: every call fails to connect

    def handle(self, route: Any) -> None:
        request = route.request
        path = request.url.split("://", 1)[1].split("/", 1)[1].split("?")[0]
        status, body = 200, {}
        if self.down:
            route.abort("connectionrefused")
            return
        if request.method == "DELETE":
            self.deletes.append(path)
            body = self.terminated
        elif path == "v1/model_registrations/LLM":
            body = self.registrations
        elif path.endswith("/prefix"):
            body = self.prefix
        elif path == "v1/models" and request.method == "GET":
            body = {"object": "list", "data": self.models}
        elif path == "v1/models" and request.method == "POST":
            status, body = self.launch
        elif path.endswith("/progress"):
            body = {"progress": self.progress, "detail": "loading", "elapsed_s": 3.0}
        elif path.endswith("/stats"):
            body = self.stats
        elif path == "v1/chat/completions":
            status, body = self.chat
        route.fulfill(status=status, json=body)


def model(uid: str, status: str) -> dict[str, Any]:
    return {
        "id": uid,
        "status": status,
        "replica": 2,
        "replicas_ready": 0,
        "xavier": "Xavier: on",
        "router": "round-robin",
    }


def test_page_states_follow_the_server(session: Session, screenshots: Path) -> None:
    """Launch progress as the server reports it, server errors read as errors (4xx
    as refusals), and statuses about a model go when the model goes."""
    page = session.page
    api = StubApi()
    page.route(re.compile(r".*/v1/.*"), api.handle)

    # the bar shows the launch's progress, not only the replicas that serve
    api.models, api.progress = [model("m", "launching")], 0.5
    bar = page.get_by_role("progressbar", name="Launch of m")
    expect(bar).to_have_attribute("value", "0.5", timeout=10_000)

    api.models = [model("m", "ready")]
    expect(page.locator("#chat-model")).to_have_value("m", timeout=10_000)
    api.chat = (500, {"detail": "engine core died"})
    page.get_by_role("button", name="Send").click()
    chat_error = page.locator("#chat-error")
    expect(chat_error).to_have_text("Server error (HTTP 500): engine core died")
    api.chat = (400, {"detail": "the prompt is longer than 2048 tokens"})
    page.get_by_role("button", name="Send").click()
    expect(chat_error).to_have_text("Refused: the prompt is longer than 2048 tokens")

    page.get_by_label("Model (registry name or local path)").fill(MODEL)
    api.launch = (500, {"detail": "worker lost"})
    page.get_by_role("button", name="Launch").click()
    status = page.locator("#launch-status")
    expect(status).to_have_text("Launch failed: Server error (HTTP 500): worker lost")
    api.launch = (200, {"model_uid": "m", "xavier": "Xavier: on"})
    page.get_by_role("button", name="Launch").click()
    expect(status).to_have_text("Launched m: Xavier: on")
    page.screenshot(path=str(screenshots / "0-states.png"), full_page=True)

    # terminated elsewhere: the next refresh clears what was about it
    api.models = []
    expect(page.locator("#models")).to_contain_text("No model is launched.")
    expect(status).to_have_text("")
    expect(chat_error).to_have_text("")
    assert session.errors == []


def replica_stats(rank: int, xavier: XavierStats) -> dict[str, Any]:
    """``/stats``' JSON for one replica, as the API writes it."""
    return replica_stats_json(
        ReplicaStats(
            model_uid="m",
            rank=rank,
            block_size=32,
            requests_total=12,
            requests_in_flight=0,
            prompt_tokens_total=2000,
            cached_prompt_tokens_total=1400,
            generated_tokens_total=100,
            xavier=xavier,
        )
    )


def test_the_figures_count_both_tiers_and_both_load_paths(session: Session) -> None:
    """A CPU run moves its bytes through the CPU tier's replies, and on the fast
    path most hits are the engine's lease-free READs: the page counts both (it
    read "0 B / 0 B" while /metrics reported 573,440 bytes)."""
    page = session.page
    api = StubApi()
    page.route(re.compile(r".*/v1/.*"), api.handle)
    cpu_run = XavierStats(
        actor=ActorCounters(cpu_tier_blocks_loaded=4, loads_ok=1),
        store=StoreStats(),
        transport=TransportStats(),
        cpu_tier_transport=TransportStats(
            received_wire_bytes=573_440, received_useful_bytes=573_440
        ),
    )
    fast_path = XavierStats(
        actor=ActorCounters(
            device_tier_blocks_loaded=1,
            loads_ok=1,
            direct_reads=11,
            direct_read_blocks=11,
            direct_read_wire_bytes=2 * 1024**2,
            direct_read_useful_bytes=1024**2,
        ),
        store=StoreStats(),
        transport=TransportStats(sent_wire_bytes=1024, sent_useful_bytes=1024),
        cpu_tier_transport=TransportStats(sent_wire_bytes=1024, sent_useful_bytes=512),
    )
    api.models = [model("m", "ready")]
    api.stats = [replica_stats(0, cpu_run), replica_stats(1, fast_path)]
    received = page.locator('td[data-rank="0"][data-figure="Received wire / useful"]')
    expect(received).to_have_text("560.0 KiB / 560.0 KiB", timeout=10_000)
    assert figure(page, 0, "Remote hits (CPU)") == "4"
    assert figure(page, 1, "Received wire / useful") == "2.0 MiB / 1.0 MiB"
    assert figure(page, 1, "Sent wire / useful") == "2.0 KiB / 1.5 KiB"
    assert figure(page, 1, "Remote hits (device)") == "12"
    assert figure(page, 1, "External tokens") == str(12 * 32)
    assert figure(page, 1, "Loads (actor / lease-free)") == "12 (1 / 11)"
    assert session.errors == []


def test_terminate_asks_first_then_keeps_the_final_counters(
    session: Session, screenshots: Path
) -> None:
    """A terminate discards the live figures: it is asked for twice, and the
    counters it returns stay on the page once the model is gone."""
    page = session.page
    api = StubApi()
    page.route(re.compile(r".*/v1/.*"), api.handle)
    loader = XavierStats(
        actor=ActorCounters(cpu_tier_blocks_loaded=1, loads_ok=1),
        cpu_tier_transport=TransportStats(received_useful_bytes=32 * 1024),
    )
    api.models = [model("m", "ready")]
    api.stats = [replica_stats(0, XavierStats()), replica_stats(1, loader)]
    api.terminated = {
        "model_uid": "m",
        "xavier_counters": {"1": loader.as_dict(), "0": XavierStats().as_dict()},
    }
    page.get_by_role("button", name="Terminate m").click()
    question = page.get_by_role("group", name="Terminate m?")
    expect(question).to_be_visible()
    # a refresh draws the card again: the question stays until answered
    page.wait_for_timeout(2500)
    expect(question).to_be_visible()
    question.screenshot(path=str(screenshots / "0-terminate-question.png"))
    page.get_by_role("button", name="Keep m serving").click()
    expect(page.get_by_role("button", name="Terminate m")).to_be_visible()
    assert api.deletes == []

    page.get_by_role("button", name="Terminate m").click()
    page.get_by_role("button", name="Yes, terminate m").click()
    api.models = []
    expect(page.locator("#models")).to_contain_text("No model is launched.")
    assert api.deletes == ["v1/models/m"]
    expect(page.locator("#models-status")).to_have_text(
        "Terminated m. Final counters: replica 0 loaded 0 blocks from peers (0 B) "
        "in 0 loads and sent 0 B; replica 1 loaded 1 block from peers (32.0 KiB) "
        "in 1 load and sent 0 B."
    )
    page.screenshot(path=str(screenshots / "0-terminated.png"), full_page=True)
    assert session.errors == []


def test_small_words_and_a_stopped_server(session: Session, screenshots: Path) -> None:
    """One block is "1 block"; the model box offers the names a launch takes;
    once the server stops answering the page no longer says no model runs."""
    page = session.page
    api = StubApi()
    api.registrations = [
        {"model_name": "tiny-qwen2", "is_builtin": True, "description": "tests"},
        {"model_name": "mine", "is_builtin": False, "description": "local model"},
    ]
    page.route(re.compile(r".*/v1/.*"), api.handle)
    page.reload()
    options = page.locator("#model-names option")
    expect(options).to_have_count(2)
    assert options.nth(0).get_attribute("value") == "tiny-qwen2"
    api.models = [model("m", "ready")]
    expect(page.locator("#prefix-model")).to_have_value("m", timeout=10_000)
    api.prefix = {
        "holder": 0,
        "prefix_blocks": 1,
        "prefix_tokens": 32,
        "prompt_tokens": 40,
    }
    page.get_by_role("button", name="Look up").click()
    expect(page.locator("#prefix-result")).to_have_text(
        "Replica 0 holds 1 block: 32 of 40 prompt tokens."
    )
    api.down = True
    expect(page.locator("#models")).to_have_text(
        "The server does not answer: which models run is unknown until it does.",
        timeout=10_000,
    )
    expect(page.locator("#connection")).to_contain_text("Cannot reach the server")
    page.screenshot(path=str(screenshots / "0-server-stopped.png"), full_page=True)


def test_no_select_cuts_its_options_off(session: Session) -> None:
    page = session.page
    for width in (1400, 390):
        page.set_viewport_size({"width": width, "height": 1000})
        selects = page.locator("select")
        for i in range(selects.count()):
            # the widest option's text, in the select's font, plus its padding and
            # arrow (20 px), fits inside the box
            room = selects.nth(i).evaluate("""e => {
                  const ctx = document.createElement("canvas").getContext("2d");
                  ctx.font = getComputedStyle(e).font;
                  const widest = Math.max(0, ...[...e.options].map(
                    (o) => ctx.measureText(o.text).width));
                  return e.clientWidth - widest - 20;
                }""")
            name = selects.nth(i).get_attribute("id")
            assert room >= 0, f"{name} at {width} px: {-room:.0f} px cut off"


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
    bar = page.get_by_role("progressbar", name=f"Launch of {MODEL}")
    expect(bar).to_be_visible()
    # it moves while the engines load (sub-pools started: past 0)
    expect(bar).to_have_attribute("value", NONZERO, timeout=LAUNCH_TIMEOUT_MS)
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
    page.get_by_role("button", name=f"Yes, terminate {MODEL}").click()
    expect(page.locator("#models")).to_contain_text(
        "No model is launched.", timeout=180_000
    )
    # the final counters stay: replica 1 loaded the shared prefix
    expect(page.locator("#models-status")).to_contain_text(
        re.compile(rf"Terminated {MODEL}\. Final counters: .*replica 1 loaded [1-9]")
    )
    # the finished launch's status went with its model
    expect(page.locator("#launch-status")).to_have_text("")
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
