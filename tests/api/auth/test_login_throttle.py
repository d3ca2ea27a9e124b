"""Logins slow down for guessers: five failures a minute per username and per
client address, counted before the password is checked, so that a burst of
concurrent guesses gets no more password checks than the limit."""

from __future__ import annotations

import asyncio
import threading

from .conftest import ADMIN_PASSWORD, ADMIN_USER

LIMIT = 5  # the fixture's throttle
BURST = 24  # as many guesses as the attacker sent at once
ANSWER_TIMEOUT_S = 60.0


class GatedChecks:
    """Wraps the store's password check: counts the checks and holds each one
    until the test opens the gate, so that every guess of a burst is in flight
    (checked or answered without a check) before any check finishes."""

    def __init__(self, verify) -> None:
        self._verify = verify
        self._lock = threading.Lock()
        self.calls = 0
        self.gate = threading.Event()

    def __call__(self, username: str, password: str):
        with self._lock:
            self.calls += 1
        self.gate.wait(ANSWER_TIMEOUT_S)
        return self._verify(username, password)


async def burst(authed, monkeypatch, bodies: list[dict[str, str]]) -> list[int]:
    """Send ``bodies`` to /token at once from one address; the status codes."""
    checks = GatedChecks(authed.service.store.verify_password)
    monkeypatch.setattr(authed.service.store, "verify_password", checks)
    tasks = [
        asyncio.create_task(authed.http.post("/token", json=body)) for body in bodies
    ]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + ANSWER_TIMEOUT_S
    # Open the gate once every guess is either at the password check or answered,
    # or as soon as more guesses than the limit reached the check (the bug).
    while checks.calls + sum(task.done() for task in tasks) < len(tasks):
        if checks.calls > LIMIT or loop.time() > deadline:
            break
        await asyncio.sleep(0.01)
    checks.gate.set()
    codes = [response.status_code for response in await asyncio.gather(*tasks)]
    assert checks.calls <= LIMIT, f"{checks.calls} passwords checked in a burst"
    return codes


async def test_a_burst_of_guesses_at_one_user_gets_only_the_limit_of_checks(
    authed, monkeypatch
):
    wrong = {"username": ADMIN_USER, "password": "not it"}
    codes = await burst(authed, monkeypatch, [wrong] * BURST)
    assert sorted(codes) == [401] * LIMIT + [429] * (BURST - LIMIT)


async def test_a_burst_over_many_user_names_from_one_address_is_throttled(
    authed, monkeypatch
):
    guesses = [{"username": f"user{n}", "password": "guess"} for n in range(BURST)]
    codes = await burst(authed, monkeypatch, guesses)
    assert sorted(codes) == [401] * LIMIT + [429] * (BURST - LIMIT)
    # the throttle is the address's: the same names from elsewhere are checked
    async with authed.client_from("10.9.9.9") as elsewhere:
        other = await elsewhere.post("/token", json=guesses[-1])
    assert other.status_code == 401


async def test_a_user_under_attack_is_throttled_from_every_address(authed):
    wrong = {"username": ADMIN_USER, "password": "not it"}
    for index in range(LIMIT):
        async with authed.client_from(f"10.0.0.{index + 1}") as guesser:
            assert (await guesser.post("/token", json=wrong)).status_code == 401
    right = {"username": ADMIN_USER, "password": ADMIN_PASSWORD}
    async with authed.client_from("10.0.0.99") as fresh:
        refused = await fresh.post("/token", json=right)
    assert refused.status_code == 429
    assert 0 < int(refused.headers["retry-after"]) <= 61


async def test_failures_older_than_the_window_no_longer_count(authed):
    wrong = {"username": ADMIN_USER, "password": "not it"}
    right = {"username": ADMIN_USER, "password": ADMIN_PASSWORD}

    async def codes(*bodies: dict[str, str]) -> list[int]:
        return [(await authed.http.post("/token", json=b)).status_code for b in bodies]

    assert await codes(wrong) == [401]
    authed.clock.now += 30.0
    assert await codes(*[wrong] * (LIMIT - 1), right) == [401] * (LIMIT - 1) + [429]
    # the first failure left the window: one more guess is checked, and then
    # the window is full again
    authed.clock.now += 30.0
    assert await codes(wrong, right) == [401, 429]
    # the four of 30 s ago leave too: one failure in the window, the right
    # password is let in
    authed.clock.now += 30.0
    assert await codes(right) == [200]


async def test_a_right_password_clears_its_user_but_not_its_address(authed):
    """An attacker with an account of their own cannot reset the address's count
    by logging in to it between guesses at other accounts."""
    _ = await authed.user_with("mallory", [])
    mine = {"username": "mallory", "password": "mallory-password"}
    for index in range(LIMIT - 1):
        guess = {"username": f"victim{index}", "password": "guess"}
        assert (await authed.http.post("/token", json=guess)).status_code == 401
    assert (await authed.http.post("/token", json=mine)).status_code == 200
    guess = {"username": "victim9", "password": "guess"}
    assert (await authed.http.post("/token", json=guess)).status_code == 401
    assert (await authed.http.post("/token", json=guess)).status_code == 429
    # the right password was no failure: the user's own count starts empty
    async with authed.client_from("10.7.7.7") as elsewhere:
        for _ in range(LIMIT):
            bad = {"username": "mallory", "password": "typo"}
            assert (await elsewhere.post("/token", json=bad)).status_code == 401


def test_names_tried_once_do_not_pile_up(monkeypatch):
    """Guesses at ever new names (from ever new addresses) leave no entry
    behind once their window has passed."""
    from xinference.api.auth import throttle as module
    from xinference.api.auth.throttle import LoginThrottle

    monkeypatch.setattr(module, "SWEEP_ABOVE_KEYS", 100)
    clock = [0.0]
    limiter = LoginThrottle(limit=5, window_s=60.0, clock=lambda: clock[0])
    for index in range(60):
        limiter.admit([f"user:u{index}", f"addr:10.0.{index}.1"])
    assert len(limiter._failures) == 120
    clock[0] += 61.0
    limiter.admit(["user:late", "addr:10.9.9.9"])
    assert set(limiter._failures) == {"user:late", "addr:10.9.9.9"}
