"""The web page against a real ``xinference local --auth`` server, in headless
Chromium (as ``test_web_page.py``; no engine): first-run admin setup, sign out,
a wrong password refused, sign in, and the page's own calls authorised."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ..deploy.local_server import LocalServer
from .browser import chromium_page, expect

PASSWORD = "a long admin password"


@pytest.fixture
def page(authed_server: LocalServer, tmp_path: Path) -> Iterator[Any]:
    with chromium_page(tmp_path / "profile") as page:
        page.statuses = []
        page.on(
            "response",
            lambda r: page.statuses.append((r.url.split("/", 3)[-1], r.status)),
        )
        page.goto(authed_server.endpoint + "/")
        yield page


def test_first_run_setup_then_sign_out_and_in(page):
    dialog = page.get_by_role("dialog", name="Create the admin")
    expect(dialog).to_be_visible()
    dialog.get_by_label("Username").fill("admin")
    dialog.get_by_label("Password", exact=True).fill(PASSWORD)
    dialog.get_by_label("Repeat the password").fill(PASSWORD + "x")
    dialog.get_by_role("button", name="Create admin").click()
    expect(dialog.get_by_role("alert")).to_have_text("The two passwords differ.")
    dialog.get_by_label("Repeat the password").fill(PASSWORD)
    dialog.get_by_role("button", name="Create admin").click()
    expect(dialog).to_be_hidden()
    expect(page.get_by_text("Signed in as admin")).to_be_visible()
    # the page's polling now gets through
    page.wait_for_function("document.querySelector('#models').textContent.length > 0")
    page.wait_for_timeout(2500)
    assert ("v1/models", 200) in page.statuses, page.statuses

    page.get_by_role("button", name="Sign out").click()
    sign_in = page.get_by_role("dialog", name="Sign in")
    expect(sign_in).to_be_visible()
    sign_in.get_by_label("Username").fill("admin")
    sign_in.get_by_label("Password").fill("not the password")
    sign_in.get_by_role("button", name="Sign in").click()
    expect(sign_in.get_by_role("alert")).to_contain_text("wrong username or password")
    sign_in.get_by_label("Password").fill(PASSWORD)
    sign_in.get_by_role("button", name="Sign in").click()
    expect(sign_in).to_be_hidden()
    expect(page.get_by_text("Signed in as admin")).to_be_visible()

    # setup happens once: a new visit asks to sign in, not to create an admin
    page.evaluate("sessionStorage.clear()")
    page.reload()
    expect(page.get_by_role("dialog", name="Sign in")).to_be_visible()
    expect(page.get_by_role("dialog", name="Create the admin")).to_have_count(0)
