"""The dashboard over HTTP (Starlette's TestClient) against a real Redis and ledger: what pages
show, who may see them, and what actions do. The browser test is test_web_browser.py."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator

import pytest
from sqlalchemy import update
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.testclient import TestClient
from typer.testing import CliRunner

from keyexpiry import Client, Settings
from keyexpiry.bench.servers import free_port, wait_until
from keyexpiry.cli import app as cli_app
from keyexpiry.ledger.rows import Outcome
from keyexpiry.ledger.store import TaskStatus
from keyexpiry.ledger.table import S
from keyexpiry.redis.permits import held_key
from keyexpiry.web import create_app
from tests import sample_tasks

TOKEN = "s3cret-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
record = sample_tasks.Probe.record


@pytest.fixture
def web(settings: Settings, client: Client) -> Iterator[TestClient]:
    with TestClient(create_app(settings, token=TOKEN), headers=AUTH) as tc:
        yield tc


def csrf_of(page: str) -> str:
    found = re.search(r'name="csrf" value="([0-9a-f]+)"', page)
    assert found, "no CSRF token in the page"
    return found.group(1)


def make_dead(client: Client, name: str, error: str = "boom") -> str:
    """A dead row with two errors, made through the store (no listener needed)."""
    key = client.create(record, name, ttl_s=600)
    now = client.clock.now_ms()
    for attempt, status in ((1, TaskStatus.PENDING), (2, TaskStatus.DEAD)):
        (row,) = client.store.claim([key], now_ms=now + 600_000, lease_until_ms=now + 1, token="t")
        client.store.record(
            [Outcome(row.id, key, "t", status, now, now, f"{error} {attempt}")], now
        )
    return key


def test_every_request_needs_the_token(settings: Settings, client: Client) -> None:
    with TestClient(create_app(settings, token=TOKEN)) as tc:
        resp = tc.get("/")
        assert resp.status_code == 401
        assert resp.headers["www-authenticate"].startswith("Basic realm=")
        assert tc.get("/", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert tc.get("/", headers=AUTH).status_code == 200
        assert tc.get("/", auth=("anyone", TOKEN)).status_code == 200
        assert tc.get("/", auth=("anyone", "nope")).status_code == 401
        assert tc.get("/static/dashboard.css").status_code == 401


def test_without_a_token_only_loopback_is_served(settings: Settings, client: Client) -> None:
    app = create_app(settings)
    # A loopback Host too (DNS rebinding: tests/test_http_hostile.py).
    with TestClient(app, base_url="http://localhost:8080", client=("127.0.0.1", 5000)) as tc:
        assert tc.get("/").status_code == 200
    with TestClient(app, base_url="http://localhost:8080", client=("10.1.2.3", 5000)) as tc:
        resp = tc.get("/")
        assert resp.status_code == 403 and "loopback" in resp.text
    runner = CliRunner()
    result = runner.invoke(
        cli_app,
        ["web", "--bind", "0.0.0.0:8080"],
        env={"KEYEXPIRY_REDIS_URL": settings.redis_url or "", "KEYEXPIRY_WEB_TOKEN": ""},
    )
    assert result.exit_code == 1 and "loopback only" in result.stderr


def test_the_overview_counts_and_lists_from_the_ledger(web: TestClient, client: Client) -> None:
    for i in range(3):
        client.create(record, f"soon{i}", ttl_s=60 + i)
    client.create(record, "tomorrow", ttl_s=86400)
    dead = make_dead(client, "d1")
    page = web.get("/").text
    assert re.search(r'id="dead-count">1<', page)
    assert re.search(r'<span class="n">4</span> pending', page)
    assert re.search(r'<span class="n">3</span> due in the next hour', page)
    assert "<title>3 due +0m</title>" in page  # the chart's first 5-minute bar
    assert dead in page and "boom 2" in page
    assert 'content="default-src' not in page  # CSP is a header, not a meta tag
    assert "default-src 'self'" in web.get("/").headers["content-security-policy"]


def test_search_by_class_method_key_and_status(web: TestClient, client: Client) -> None:
    client.create(record, "x y", ttl_s=60)
    client.create(sample_tasks.Probe.always_fail, "z", ttl_s=60)
    make_dead(client, "gone")
    by_class = web.get("/tasks", params={"q": "Probe"}).text
    assert "Probe@record@x%20y" in by_class and "Probe@always_fail@z" in by_class
    by_method = web.get("/tasks", params={"q": "Probe.always_fail"}).text
    assert "Probe@always_fail@z" in by_method and "Probe@record@x%20y" not in by_method
    by_key = web.get("/tasks", params={"q": "Probe@record@x%20y"}).text
    assert "Probe@record@x%20y" in by_key and "Probe@always_fail" not in by_key
    dead_only = web.get("/tasks", params={"q": "Probe", "status": "dead"}).text
    assert "Probe@record@gone" in dead_only and "x%20y" not in dead_only
    # LIKE wildcards in a query are literal: `_` matches only an underscore
    assert "Probe@record" not in web.get("/tasks", params={"q": "Probe.r_cord"}).text
    assert web.get("/tasks", params={"q": "Probe", "status": "zzz"}).status_code == 400


def test_a_task_page_shows_row_errors_and_ttl(web: TestClient, client: Client) -> None:
    key = make_dead(client, "dead one")
    page = web.get("/task", params={"key": key}).text
    assert "Errors (2, newest first)" in page
    assert page.index("boom 2") < page.index("boom 1")
    assert 'id="action-retry"' in page and 'id="action-cancel"' not in page
    pending = client.create(record, "later", ttl_s=300)
    page = web.get("/task", params={"key": pending}).text
    ttl = re.search(r"expires in (\d+) ms", page)
    # PXAT on the Redis clock this client extrapolates: a millisecond either way is that clock.
    assert ttl and 290_000 < int(ttl.group(1)) <= 300_050
    assert 'id="action-run"' in page and 'id="action-cancel"' in page
    assert web.get("/task", params={"key": "Nope@x@1"}).status_code == 404


def test_actions_need_the_csrf_token_and_act_like_the_client(
    web: TestClient, client: Client
) -> None:
    dead = make_dead(client, "d")
    page = web.get("/task", params={"key": dead}).text
    token = csrf_of(page)
    assert web.post("/task/retry", data={"key": dead}).status_code == 403
    assert web.post("/task/retry", data={"key": dead, "csrf": "0" * 64}).status_code == 403
    cross_site = web.post(
        "/task/retry",
        data={"key": dead, "csrf": token},
        headers={"Origin": "https://evil.example"},
    )
    assert cross_site.status_code == 403
    assert client.store.get(dead).status is TaskStatus.DEAD  # type: ignore[union-attr]

    resp = web.post("/task/retry", data={"key": dead, "csrf": token}, follow_redirects=False)
    assert resp.status_code == 303 and resp.headers["location"].startswith("/task?key=")
    row = client.store.get(dead)
    assert row is not None and (row.status, row.attempts) == (TaskStatus.PENDING, 0)
    assert "boom 2" in (row.last_error or "")  # the history stays

    later = client.create(record, "later", ttl_s=300)
    page = web.post("/task/run", data={"key": later, "csrf": token}).text
    assert "due now" in page
    row = client.store.get(later)
    assert row is not None and row.due_at_ms <= client.clock.now_ms()

    other = client.create(record, "other", ttl_s=300)
    assert "cancelled" in web.post("/task/cancel", data={"key": other, "csrf": token}).text
    assert client.store.get(other).status is TaskStatus.CANCELLED  # type: ignore[union-attr]
    assert client.ttl_ms(record, "other") is None
    again = web.post("/task/cancel", data={"key": other, "csrf": token}).text
    assert "not pending: nothing cancelled" in again


def test_the_overview_lists_pauses_and_what_is_held_back_escaped(
    web: TestClient, client: Client
) -> None:
    page = web.get("/").text
    assert "Nothing is paused." in page and "Nothing held back." in page
    client.pause("Probe.record", for_s=600, reason="<script>alert(1)</script>")
    client.pause("Elsewhere")  # a class this process does not know
    now = client.clock.now_ms()
    entry = {"at_ms": now, "held": {"Probe.record": {"paused": 7, "<b>": 1}}}
    client.redis.hset(held_key(client.settings.key_prefix), "l1", json.dumps(entry))
    page = web.get("/").text
    assert "Nothing is paused." not in page and "Nothing held back." not in page
    paused = page[page.index('<section id="paused">') : page.index('<section id="held">')]
    assert paused.index("Elsewhere") < paused.index("Probe.record")  # by target
    assert "until resumed" in paused and re.search(r"in (9|10)m \d+s", paused)
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in paused and "<script>" not in page
    assert 'id="resume-Probe.record"' in paused and 'id="resume-Elsewhere"' in paused
    held = page[page.index('<section id="held">') :]
    assert re.search(r"Probe\.record</td><td>paused</td><td class=\"num\">7<", held)
    assert "<td>&lt;b&gt;</td>" in held


def test_a_forged_held_entry_nested_deep_or_infinite_leaves_the_overview_working(
    web: TestClient, client: Client
) -> None:
    """Anyone who can write to Redis can write this hash: its entries are read as the ledger's
    rows are, and one keyexpiry would not have written counts for nothing."""
    now = client.clock.now_ms()
    key = held_key(client.settings.key_prefix)
    sound = {"at_ms": now, "held": {"Probe.record": {"paused": 2}}}
    deep = "[" * 990 + "]" * 990
    client.redis.hset(
        key,
        mapping={
            "sound": json.dumps(sound),
            "deep": deep,
            "deep-inside": f'{{"at_ms": {now}, "held": {{"Probe.record": {deep}}}}}',
            "infinite": f'{{"at_ms": {now}, "held": {{"Probe.record": {{"limit": Infinity}}}}}}',
        },
    )
    assert client.held() == {"Probe.record": {"paused": 2}}
    page = web.get("/")
    assert page.status_code == 200, page.text
    held = page.text[page.text.index('<section id="held">') :]
    assert re.search(r"Probe\.record</td><td>paused</td><td class=\"num\">2<", held), held


def test_pause_and_resume_from_the_overview(web: TestClient, client: Client) -> None:
    token = csrf_of(web.get("/").text)
    form = {"target": "Probe.record", "for": "30m", "reason": "PSP down"}
    assert web.post("/pause", data=form).status_code == 403
    assert web.post("/pause", data={**form, "csrf": "0" * 64}).status_code == 403
    cross_site = web.post(
        "/pause", data={**form, "csrf": token}, headers={"Origin": "https://evil.example"}
    )
    assert cross_site.status_code == 403 and client.paused() == []

    resp = web.post("/pause", data={**form, "csrf": token}, follow_redirects=False)
    assert resp.status_code == 303 and resp.headers["location"] == "/?msg=paused"
    (pause,) = client.paused()
    assert (pause.target, pause.reason) == ("Probe.record", "PSP down")
    assert pause.until_ms is not None and pause.until_ms - pause.paused_at_ms == 1_800_000
    page = web.post("/pause", data={"target": "Probe", "csrf": token}).text  # no duration
    assert "paused: listeners hold its tasks back" in page
    assert (client.paused()[0].target, client.paused()[0].until_ms) == ("Probe", None)

    # A bad form comes back with its error and what was typed, escaped.
    bad = web.post("/pause", data={"target": "<b>x", "for": "30m", "csrf": token})
    assert bad.status_code == 400 and "error: cannot pause" in bad.text
    assert 'value="&lt;b&gt;x"' in bad.text and "<b>x" not in bad.text
    bad = web.post("/pause", data={"target": "Probe", "for": "soon", "csrf": token})
    assert bad.status_code == 400 and "duration &#39;soon&#39; is not understood" in bad.text
    assert len(client.paused()) == 2

    resp = web.post(
        "/resume", data={"target": "Probe.record", "csrf": token}, follow_redirects=False
    )
    assert resp.status_code == 303 and resp.headers["location"] == "/?msg=resumed"
    again = web.post("/resume", data={"target": "Probe.record", "csrf": token}).text
    assert "was not paused: nothing resumed" in again
    assert web.post("/resume", data={"target": "Probe.record"}).status_code == 403
    assert [p.target for p in client.paused()] == ["Probe"]
    assert web.get("/pause").status_code == 405


def _section(page: str, name: str) -> str:
    start = page.index(f'<section id="{name}">')
    return page[start : page.index("</section>", start)]


def test_the_overview_lists_schedules_escaped(web: TestClient, client: Client) -> None:
    assert "No schedules." in web.get("/").text
    daily = client.schedule("<b>daily</b>", record, "<i>", cron="0 9 * * *", tz="Europe/Berlin")
    client.schedule("paused", record, "p", every_s=60)
    client.pause_schedule("paused")
    client.schedule("ended", record, "e", every_s=60, end=dt.datetime(2001, 1, 1, tzinfo=dt.UTC))
    with client.store.engine.begin() as conn:  # a failed last run, as a listener records it
        conn.execute(
            update(S)
            .where(S.c.name == "ended")
            .values(
                last_status="dead", last_finished_ms=1_000, last_error="Traceback\nKeyError: 'x'"
            )
        )
    section = _section(web.get("/").text, "schedules")
    rows = section.split("<tr>")[2:]  # after the head's
    assert [re.search(r'<td class="key">([^<]*)<', r).group(1) for r in rows] == [  # type: ignore[union-attr]
        "&lt;b&gt;daily&lt;/b&gt;", "ended", "paused",
    ]  # fmt: skip
    first, ended, paused = rows
    assert "<b>" not in section and "<i>" not in section
    assert "Probe.record(&lt;i&gt;)" in first and "0 9 * * * (Europe/Berlin)" in first
    assert daily.occurrence_ms is not None and _utc(daily.occurrence_ms) in first
    assert "never run" in first and ">active<" in first
    assert 'id="schedule-pause-&lt;b&gt;daily&lt;/b&gt;"' in first and "schedule-run-" in first
    assert ">dead</span> 1970-01-01 00:00:01.000" in ended and "last success: never" in ended
    assert "KeyError: &#39;x&#39;" in ended and "Traceback" not in ended  # the headline
    assert ">ended<" in ended and "<button" not in ended
    assert ">paused<" in paused and 'id="schedule-resume-paused"' in paused
    assert "schedule-run-" not in paused
    # A row edited by hand into one keyexpiry cannot read: the rest of the overview still shows.
    with client.store.engine.begin() as conn:
        conn.execute(update(S).where(S.c.name == "paused").values(tz="Mars/Base"))
    page = web.get("/").text
    # Left out (and said once in the log); the others still listed.
    assert 'id="schedule-resume-paused"' not in page and "schedule-run-" in page
    assert '<section id="paused">' in page and "No schedules." not in page


def _utc(ms: int) -> str:
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def test_pause_resume_and_run_a_schedule_from_the_overview(web: TestClient, client: Client) -> None:
    sched = client.schedule("reports:eu", record, "eu", cron="@yearly")
    token = csrf_of(web.get("/").text)
    form = {"name": "reports:eu"}
    assert web.post("/schedule/pause", data=form).status_code == 403
    assert web.post("/schedule/run", data={**form, "csrf": "0" * 64}).status_code == 403
    cross_site = web.post(
        "/schedule/pause", data={**form, "csrf": token}, headers={"Origin": "https://evil.example"}
    )
    assert cross_site.status_code == 403 and not client.get_schedule("reports:eu").paused  # type: ignore[union-attr]

    resp = web.post("/schedule/pause", data={**form, "csrf": token}, follow_redirects=False)
    assert resp.status_code == 303 and resp.headers["location"] == "/?msg=schedule-paused"
    assert client.get_schedule("reports:eu").paused  # type: ignore[union-attr]
    page = web.post("/schedule/run", data={**form, "csrf": token}).text
    assert "has no pending occurrence (paused, ended or running): nothing started" in page
    page = web.post("/schedule/resume", data={**form, "csrf": token}).text
    assert "schedule resumed" in page and 'id="schedule-pause-reports:eu"' in page
    assert not client.get_schedule("reports:eu").paused  # type: ignore[union-attr]

    resp = web.post("/schedule/run", data={**form, "csrf": token}, follow_redirects=False)
    assert resp.status_code == 303 and resp.headers["location"] == "/?msg=schedule-due-now"
    row = client.store.get(sched.task_key)
    assert row is not None and row.status is TaskStatus.PENDING
    # The dashboard's clock and the test's each follow Redis's TIME from their own samples: they
    # may disagree by a few ms (a round trip's uncertainty), seen as a 2 ms flake under load.
    slack_ms = 50
    assert row.due_at_ms <= client.clock.now_ms() + slack_ms < (sched.occurrence_ms or 0)

    gone = web.post("/schedule/pause", data={"name": "gone", "csrf": token})
    assert "no such schedule" in gone.text
    assert web.post("/schedule/remove", data={**form, "csrf": token}).status_code == 404
    assert web.get("/schedule/pause").status_code == 405
    assert [s.name for s in client.schedules()] == ["reports:eu"]


def test_mounted_under_a_path_in_another_app(settings: Settings, client: Client) -> None:
    dashboard = create_app(settings, token=TOKEN)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        yield
        dashboard.close()  # a mounted app's own lifespan is not run: its client would leak

    outer = Starlette(routes=[Mount("/ops/tasks", dashboard)], lifespan=lifespan)
    client.create(record, "m", ttl_s=60)
    with TestClient(outer, headers=AUTH) as tc:
        page = tc.get("/ops/tasks/").text
        assert 'href="/ops/tasks/static/dashboard.css"' in page
        assert 'action="/ops/tasks/tasks"' in page
        assert 'action="/ops/tasks/pause"' in page
        client.schedule("mounted", record, "s", every_s=60)
        assert 'action="/ops/tasks/schedule/run"' in tc.get("/ops/tasks/").text
        assert tc.get("/ops/tasks/static/dashboard.css").status_code == 200
        found = tc.get("/ops/tasks/tasks", params={"q": "Probe"}).text
        assert 'href="/ops/tasks/task?key=Probe%40record%40m"' in found


def test_keyexpiry_web_serves_the_dashboard(cli_env: dict[str, str], client: Client) -> None:
    """The command as an operator runs it: a process, a port, the token."""
    port = free_port()
    env = {**os.environ, **cli_env, "KEYEXPIRY_WEB_TOKEN": TOKEN}
    proc = subprocess.Popen(
        [sys.executable, "-m", "keyexpiry", "web", "--bind", f"127.0.0.1:{port}"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )

    def status(headers: dict[str, str]) -> int:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/", headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return 0

    try:
        wait_until(lambda: status({}) != 0, 20, message="keyexpiry web did not start")
        assert status({}) == 401
        assert status(AUTH) == 200
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=15)
    assert proc.returncode in (0, -15), err.decode()


def test_a_task_page_shows_its_tag_and_result_escaped(web: TestClient, client: Client) -> None:
    key = client.create(record, "tagged", ttl_s=600, tag="order:<218>")
    now = client.clock.now_ms()
    (row,) = client.store.claim([key], now_ms=now + 600_000, lease_until_ms=now + 1, token="t")
    done = Outcome(row.id, key, "t", TaskStatus.DONE, now, now, None, '{"html": "<b>"}')
    client.store.record([done], now)
    page = web.get("/task", params={"key": key}).text
    assert '<dd id="tag">order:&lt;218&gt;</dd>' in page
    assert "<code>{&#34;html&#34;: &#34;&lt;b&gt;&#34;}</code>" in page
    untagged = client.create(record, "plain", ttl_s=600)
    page = web.get("/task", params={"key": untagged}).text
    assert '<dd id="tag">-</dd>' in page and '<dd id="result">-</dd>' in page
