"""The dashboard in a real headless Chromium (Debian's `chromium`, driven by Playwright): log in
with the token, read the overview, open a dead task, retry it and see it run.

KEYEXPIRY_SCREENSHOT_DIR=docs makes it write the screenshots the docs show."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from keyexpiry import Client, Settings
from keyexpiry.ledger.store import TaskStatus
from keyexpiry.web import create_app
from keyexpiry.web.serve import DashboardServer
from tests import sample_tasks
from tests.ke import Running, wait_status

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"  # `make servers` installs it
TOKEN = "browser-token-0123456789"
StartListener = Callable[[Settings], Running]

# Chromium's background services try the (closed) network at every start; the sandbox needs
# user namespaces a root CI container may not have.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture
def dashboard(settings: Settings, client: Client) -> Iterator[str]:
    """The dashboard served on a loopback port, as `keyexpiry web` serves it."""
    server = DashboardServer(create_app(settings, token=TOKEN), "127.0.0.1", 0)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    assert server.started.wait(15), "the dashboard's port did not start"
    yield f"http://127.0.0.1:{server.port}"
    server.stop()
    thread.join(10)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_an_operator_retries_a_dead_task_in_the_browser(
    settings: Settings,
    client: Client,
    start_listener: StartListener,
    dashboard: str,
    tmp_path: Path,
) -> None:
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import expect, sync_playwright

    start_listener(settings)
    sample_tasks.BROKEN.add("order-218")
    dead = client.create(sample_tasks.Probe.broken, "order-218", ttl_ms=10)
    wait_status(client, dead, TaskStatus.DEAD)
    for i in range(40):  # something to chart: tasks over the next hour
        client.create(sample_tasks.Probe.record, f"order-{1000 + i}", ttl_s=60 + i * 80)
    shots = Path(os.environ.get("KEYEXPIRY_SCREENSHOT_DIR") or tmp_path)

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            # Without credentials headless Chromium gets the 401 challenge and gives up.
            with pytest.raises(PlaywrightError, match="AUTH"):
                browser.new_page().goto(dashboard)
            context = browser.new_context(
                http_credentials={"username": "ops", "password": TOKEN},
                viewport={"width": 1200, "height": 900},
            )
            page = context.new_page()
            page.goto(dashboard)
            expect(page.locator("#dead-count")).to_have_text("1")
            expect(page.locator("svg.chart rect")).to_have_count(12)
            page.screenshot(path=str(shots / "dashboard.png"), full_page=True)

            page.get_by_role("link", name=dead).first.click()
            expect(page.locator("#status")).to_have_text("dead")
            expect(page.locator("pre.error").first).to_contain_text("order-218 is broken")
            page.screenshot(path=str(shots / "dashboard-task.png"), full_page=True)

            sample_tasks.BROKEN.discard("order-218")  # the cause is fixed: retry it
            page.locator("#action-retry").click()
            expect(page.get_by_role("status")).to_contain_text("requeued")
            wait_status(client, dead, TaskStatus.DONE)
            page.reload()
            expect(page.locator("#status")).to_have_text("done")
            expect(page.locator("#attempts")).to_have_text("1")

            page.goto(dashboard)
            expect(page.locator("#dead-count")).to_have_text("0")
            page.fill("input[name=q]", "Probe.record")
            page.get_by_role("button", name="Search").click()
            expect(page.locator("td.key")).to_have_count(40)
        finally:
            browser.close()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_an_operator_pauses_and_resumes_a_method_in_the_browser(
    client: Client, dashboard: str
) -> None:
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(http_credentials={"username": "ops", "password": TOKEN})
            page = context.new_page()
            page.goto(dashboard)
            expect(page.locator("#paused")).to_contain_text("Nothing is paused.")
            expect(page.locator("#held")).to_contain_text("Nothing held back.")

            page.fill("#pause-target", "Probe.record")
            page.fill("#pause-for", "2h")
            page.fill("#pause-reason", "PSP <down>")
            page.locator("#pause-submit").click()
            expect(page.get_by_role("status")).to_contain_text("paused")
            row = page.locator("#paused tbody tr")
            expect(row).to_have_count(1)
            expect(row).to_contain_text("Probe.record")
            expect(row).to_contain_text("PSP <down>")  # shown as typed, never as markup
            (pause,) = client.paused()
            assert pause.target == "Probe.record" and pause.reason == "PSP <down>"
            assert pause.until_ms is not None and pause.until_ms - pause.paused_at_ms == 7_200_000

            page.locator("#resume-Probe\\.record").click()
            expect(page.get_by_role("status")).to_contain_text("resumed")
            expect(page.locator("#paused")).to_contain_text("Nothing is paused.")
            assert client.paused() == []
        finally:
            browser.close()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_an_operator_pauses_resumes_and_runs_a_schedule_in_the_browser(
    client: Client, dashboard: str
) -> None:
    from playwright.sync_api import expect, sync_playwright

    sched = client.schedule("reports:eu", sample_tasks.Probe.record, "eu", cron="@yearly")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(http_credentials={"username": "ops", "password": TOKEN})
            page = context.new_page()
            page.goto(dashboard)
            row = page.locator("#schedules tbody tr")
            expect(row).to_have_count(1)
            expect(row).to_contain_text("Probe.record(eu)")
            expect(row).to_contain_text("active")

            page.get_by_role("button", name="Pause schedule reports:eu").click()
            expect(page.get_by_role("status")).to_contain_text("schedule paused")
            expect(row).to_contain_text("paused")
            assert client.get_schedule("reports:eu").paused  # type: ignore[union-attr]

            page.get_by_role("button", name="Resume schedule reports:eu").click()
            expect(page.get_by_role("status")).to_contain_text("schedule resumed")
            page.get_by_role("button", name="Run schedule reports:eu now").click()
            expect(page.get_by_role("status")).to_contain_text("extra run due now")
            occurrence = client.store.get(sched.task_key)
            assert occurrence is not None and occurrence.status is TaskStatus.PENDING
            assert occurrence.due_at_ms <= client.clock.now_ms() < (sched.occurrence_ms or 0)
        finally:
            browser.close()
