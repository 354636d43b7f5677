"""Headless Chromium for the page's tests: Debian's `/usr/bin/chromium` driven by Playwright's Python
package (launched by `executable_path`: Playwright never downloads a browser here). Playwright is a dev
dependency; without Debian's chromium the browser tests skip with a reason naming the command that
installs it, which `make test` runs."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import sync_playwright

CHROMIUM = Path(os.environ.get("PELT_CHROMIUM", "/usr/bin/chromium"))
INSTALL_CHROMIUM = "bash deploy/install-chromium.sh (as root: apt-get install -y chromium)"
# as the machine's notes advise for a closed network: no background connections, no first-run work
CHROMIUM_FLAGS = [
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
DEADLINE_MS = 60_000  # the longest any wait on the page may take


def launch_chromium() -> Iterator[Any]:
    """A headless Debian Chromium under Playwright, or a skip naming what to install."""
    os.environ.setdefault("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
    if not CHROMIUM.exists():
        why = f"the browser tests need Debian's chromium at {CHROMIUM}: {INSTALL_CHROMIUM}"
        if os.environ.get("PELT_REQUIRE_BROWSER") == "1":  # CI sets it: a missing browser fails, never skips
            pytest.fail(f"{why} (PELT_REQUIRE_BROWSER=1 is set)")
        pytest.skip(why)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_FLAGS
        )
        try:
            yield browser
        finally:
            browser.close()


@dataclass
class PageSession:
    """One browser tab on the page, with what it saw: dialogs (none may open), console errors (a
    Content-Security-Policy violation shows there) and screenshots written to `artifacts`."""

    page: Any
    url: str
    artifacts: Path
    dialogs: list[str] = field(default_factory=list)
    console_errors: list[str] = field(default_factory=list)

    def open(self) -> PageSession:
        self.page.goto(self.url + "/")
        self.page.locator("#token-input").wait_for(state="visible")
        return self

    def sign_in(self, token: str) -> None:
        self.page.fill("#token-input", token)
        self.page.click("#token-form button[type=submit]")

    def open_task(self, name: str) -> None:
        self.page.locator(f"#task-list button[data-task='{name}']").click()
        self.page.locator("#task-title", has_text=name).wait_for()

    def wait_until(self, script: str, arg: Any = None) -> None:
        """Wait until `script` (a JS function of `arg`) is true on the page, DEADLINE_MS at most."""
        self.page.wait_for_function(script, arg=arg, timeout=DEADLINE_MS)

    def screenshot(self, name: str) -> Path:
        path = self.artifacts / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        return path

    def csp_violations(self) -> list[str]:
        return [text for text in self.console_errors if "Content Security Policy" in text]


def page_session(browser: Any, url: str, artifacts: Path) -> Iterator[PageSession]:
    """A fresh browser context (its own sessionStorage) with one tab on the page."""
    context = browser.new_context(accept_downloads=True, viewport={"width": 1400, "height": 1000})
    context.set_default_timeout(DEADLINE_MS)
    page = context.new_page()
    session = PageSession(page, url, artifacts)

    def on_dialog(dialog: Any) -> None:
        session.dialogs.append(dialog.message)
        dialog.dismiss()

    page.on("dialog", on_dialog)
    page.on("console", lambda m: session.console_errors.append(m.text) if m.type == "error" else None)
    try:
        yield session.open()
    finally:
        context.close()


__all__ = ["CHROMIUM", "DEADLINE_MS", "PageSession", "launch_chromium", "page_session"]
