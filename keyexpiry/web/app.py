"""The dashboard's pages and actions (Starlette, server-rendered; no JavaScript).

Reads go through the ledger's indexed queries (the same ones `/metrics` uses for its counts);
actions go through `Client` (retry, run now, cancel; pause and resume; a schedule's pause,
resume and run now), so they behave exactly as the API does.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode

from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route

from keyexpiry.client import Client
from keyexpiry.errors import KeyExpiryError
from keyexpiry.flow.pauses import parse_duration
from keyexpiry.ledger.rows import TaskRow, TaskStatus
from keyexpiry.ledger.table import EARLIER_ERRORS
from keyexpiry.printable import for_html
from keyexpiry.settings import Settings
from keyexpiry.web.security import Csrf, Guard

_HERE = Path(__file__).parent
_LIST_ROWS = 20
_CHART_BUCKET_S = 300
_CHART_BUCKETS = 12  # the next hour in 5-minute bars
MESSAGES = {
    "requeued": "requeued: runs now",
    "not-retryable": "not dead or waiting",
    "due-now": "due now",
    "not-runnable": "not pending: nothing to run",
    "cancelled": "cancelled",
    "not-cancellable": "not pending: nothing cancelled",
    "paused": "paused: listeners hold its tasks back",
    "resumed": "resumed: its held-back tasks run now",
    "not-paused": "was not paused: nothing resumed",
    "schedule-paused": "schedule paused: nothing of it runs until it is resumed",
    "schedule-resumed": "schedule resumed",
    "schedule-due-now": "schedule's extra run due now (its regular runs follow)",
    "schedule-not-runnable": "schedule has no pending occurrence (paused, ended or running): "
    "nothing started",
    "no-schedule": "no such schedule (removed meanwhile?)",
}
"""What an action's redirect may show, by the code in its `msg=`: a link cannot make the
dashboard show text of its author's choosing."""


def _fmt_ms(ms: int | None) -> str:
    if ms is None:
        return "-"
    try:
        return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
    except (OverflowError, ValueError, OSError):
        return f"{ms} ms (not a date)"


def _headline(error: str | None) -> str:
    """The newest error's last line (a traceback ends with the exception and its message)."""
    if not error:
        return ""
    newest = error.split(EARLIER_ERRORS, 1)[0].strip()
    return newest.rsplit("\n", 1)[-1][:200]


def _ago(ms: int | None, now_ms: int) -> str:
    """`in 4m 10s` / `12s ago`: how far a time is from now."""
    if ms is None:
        return ""
    delta_s = (ms - now_ms) / 1000
    size = abs(delta_s)
    if size < 1:
        text = f"{abs(ms - now_ms)} ms"
    elif size < 120:
        text = f"{size:.0f}s"
    elif size < 7200:
        text = f"{size // 60:.0f}m {size % 60:.0f}s"
    elif size < 172800:
        text = f"{size // 3600:.0f}h {size % 3600 // 60:.0f}m"
    else:
        text = f"{size // 86400:.0f}d"
    return f"in {text}" if delta_s > 0 else f"{text} ago"


class Dashboard:
    """The pages, over one `Client` opened at start-up."""

    def __init__(self, make_client: Callable[[], Client], csrf: Csrf, *, owns_client: bool) -> None:
        self._make_client = make_client
        self._owns_client = owns_client
        self._client: Client | None = None
        self._client_lock = threading.Lock()
        self.csrf = csrf
        self.env = Environment(
            loader=FileSystemLoader(_HERE / "templates"),
            autoescape=select_autoescape(["html"]),
            trim_blocks=True,
            lstrip_blocks=True,
            finalize=for_html,  # control characters in any value shown, not sent raw
        )
        self.env.filters["when"] = _fmt_ms
        self.env.filters["headline"] = _headline

    @property
    def client(self) -> Client:
        # Pages run on a thread pool: the first requests may arrive together.
        with self._client_lock:
            if self._client is None:
                self._client = self._make_client()
            return self._client

    def close(self) -> None:
        """Close the client this dashboard opened (never one it was given)."""
        with self._client_lock:
            if self._client is not None and self._owns_client:
                self._client.close()
            self._client = None

    def render(
        self, request: Request, name: str, code: int = 200, message: str | None = None, **ctx: Any
    ) -> Response:
        """A page; `message` (else the one `msg=` names, if any) shown at its top."""
        now_ms = ctx.get("now_ms") or self.client.clock.now_ms()
        html = self.env.get_template(name).render(
            request=request,
            url=lambda route, **q: _url(request, route, **q),
            csrf=self.csrf.token,
            ago=lambda ms: _ago(ms, now_ms),
            message=message or MESSAGES.get(request.query_params.get("msg", "")),
            **ctx,
        )
        # The security headers are added to every response by Guard.
        return HTMLResponse(html, status_code=code)

    # --- pages --------------------------------------------------------------------------------
    def index(self, request: Request) -> Response:
        return self.index_page(request)

    def index_page(
        self, request: Request, message: str | None = None, code: int = 200, **form: str
    ) -> Response:
        """The overview, with `message` at its top (an action's error) and the pause form
        filled with `form` (what was submitted, to correct)."""
        client = self.client
        store, now_ms = client.store, client.clock.now_ms()
        from keyexpiry.schedules.operate import live_classes, unregistered, unregistered_note

        try:
            # A malformed schedule row (edited by hand) is left out and said in this section.
            schedules, schedule_problems = store.schedules_and_problems()
            schedules_error = None
            classes = live_classes(client.rt)
        except KeyExpiryError as exc:
            schedules, schedule_problems, schedules_error, classes = [], [], str(exc), None
        flagged = unregistered(schedules, classes)
        schedule_notes = {
            s.name: unregistered_note(s, classes) for s in schedules if s.name in flagged
        }
        counts = store.active_counts()
        step_ms = _CHART_BUCKET_S * 1000
        edges = [now_ms - 1000] + [now_ms + i * step_ms for i in range(_CHART_BUCKETS + 1)]
        below = store.pending_due_before(edges)
        overdue = below[0]
        bars = [
            (f"+{i * _CHART_BUCKET_S // 60}m", below[i + 2] - below[i + 1])
            for i in range(_CHART_BUCKETS)
        ]
        return self.render(
            request,
            "index.html",
            code,
            message,
            now_ms=now_ms,
            pauses=client.paused(),
            held=sorted(
                (task, reason, n)
                for task, reasons in client.held().items()
                for reason, n in reasons.items()
            ),
            form=form,
            schedules=schedules,
            schedules_error=schedules_error,
            schedule_problems=schedule_problems,
            schedule_notes=schedule_notes,
            counts={s: counts.get(s, 0) for s in ("pending", "running", "dead")},
            overdue=overdue,
            next_hour=below[-1] - below[1],
            bars=bars,
            bar_max=max([n for _, n in bars] + [1]),
            overdue_rows=store.overdue_rows(now_ms=now_ms - 1000, limit=_LIST_ROWS),
            running=store.rows_with_status(TaskStatus.RUNNING, limit=_LIST_ROWS),
            retrying=store.retrying(limit=_LIST_ROWS),
            dead=store.rows_with_status(TaskStatus.DEAD, limit=_LIST_ROWS, newest_first=True),
        )

    def tasks(self, request: Request) -> Response:
        query = request.query_params.get("q", "").strip()
        status_text = request.query_params.get("status", "")
        status = None
        if status_text:
            try:
                status = TaskStatus(status_text)
            except ValueError:
                return PlainTextResponse(f"unknown status {status_text!r}\n", status_code=400)
        rows: list[TaskRow] = []
        if query:
            rows = self.client.store.search(self._key_prefix(query), status=status, limit=200)
        return self.render(
            request, "tasks.html", query=query, status=status_text, rows=rows, statuses=TaskStatus
        )

    def task(self, request: Request) -> Response:
        return self.task_page(request, request.query_params.get("key", ""))

    def task_page(
        self, request: Request, key: str, message: str | None = None, code: int = 200
    ) -> Response:
        """The page of the task `key`, with `message` at its top (an action's error)."""
        row = self.client.store.get(key) if key else None
        if row is None:
            return self.render(request, "missing.html", 404, message, key=key)
        pttl = int(self.client.redis.pttl(key))
        errors = row.last_error.split(EARLIER_ERRORS) if row.last_error else []
        return self.render(
            request,
            "task.html",
            code,
            message,
            row=row,
            ttl_ms=pttl if pttl >= 0 else None,
            errors=errors,
            can_retry=row.status is TaskStatus.DEAD
            or (row.status is TaskStatus.PENDING and row.attempts > 0),
            can_run=row.status is TaskStatus.PENDING,
            can_cancel=row.status is TaskStatus.PENDING,
        )

    # --- actions ------------------------------------------------------------------------------
    async def act(self, request: Request) -> Response:
        form = {
            k: v[0] for k, v in parse_qs((await request.body()).decode("utf-8", "replace")).items()
        }
        if not self.csrf.valid(request, form.get("csrf")):
            return PlainTextResponse("bad or missing CSRF token\n", status_code=403)
        action, key = request.path_params["action"], form.get("key", "")
        if action not in ("retry", "run", "cancel"):
            return PlainTextResponse("unknown action: retry, run or cancel\n", status_code=404)
        try:
            code = await run_in_threadpool(self._do, action, key)
        except KeyExpiryError as exc:
            return await run_in_threadpool(self._failed, request, key, exc)
        return RedirectResponse(_url(request, "task", key=key, msg=code), status_code=303)

    async def pause(self, request: Request) -> Response:
        """POST /pause: pause `target` ("Class" or "Class.method"), for the optional `for`
        duration (30m, 2h, …; none: until resumed), with the optional `reason`."""
        return await self._pause_action(request, "pause")

    async def resume(self, request: Request) -> Response:
        """POST /resume: end the pause of `target`."""
        return await self._pause_action(request, "resume")

    async def _pause_action(self, request: Request, action: str) -> Response:
        form = {
            k: v[0] for k, v in parse_qs((await request.body()).decode("utf-8", "replace")).items()
        }
        if not self.csrf.valid(request, form.get("csrf")):
            return PlainTextResponse("bad or missing CSRF token\n", status_code=403)
        target, duration = form.get("target", ""), form.get("for", "").strip()
        reason = form.get("reason") or None
        try:
            # On the thread pool, `self.client` included: its first use connects (blocking).
            if action == "pause":
                for_s = parse_duration(duration) if duration else None
                await run_in_threadpool(
                    lambda: self.client.pause(target, for_s=for_s, reason=reason)
                )
                code = "paused"
            else:
                resumed = await run_in_threadpool(lambda: self.client.resume(target))
                code = "resumed" if resumed else "not-paused"
        except KeyExpiryError as exc:
            # The form comes back as sent, to correct (escaped by the template like any text).
            sent = {"target": target, "for": duration, "reason": reason or ""}
            filled = sent if action == "pause" else {}
            return await run_in_threadpool(
                functools.partial(self.index_page, request, f"error: {exc}", 400, **filled)
            )
        return RedirectResponse(_url(request, "index", msg=code), status_code=303)

    async def schedule_act(self, request: Request) -> Response:
        """POST /schedule/pause, /schedule/resume, /schedule/run: pause, resume or run now the
        schedule `name` (`Client.pause_schedule`, `resume_schedule`, `run_schedule_now`)."""
        form = {
            k: v[0] for k, v in parse_qs((await request.body()).decode("utf-8", "replace")).items()
        }
        if not self.csrf.valid(request, form.get("csrf")):
            return PlainTextResponse("bad or missing CSRF token\n", status_code=403)
        action, name = request.path_params["action"], form.get("name", "")
        if action not in ("pause", "resume", "run"):
            return PlainTextResponse("unknown action: pause, resume or run\n", status_code=404)
        try:
            code = await run_in_threadpool(self._schedule_do, action, name)
        except KeyExpiryError as exc:
            return await run_in_threadpool(
                functools.partial(self.index_page, request, f"error: {exc}", 400)
            )
        return RedirectResponse(_url(request, "index", msg=code), status_code=303)

    def _schedule_do(self, action: str, name: str) -> str:
        """Do `action` on schedule `name`; the code (in MESSAGES) of what happened."""
        client = self.client
        if action == "pause":
            return "schedule-paused" if client.pause_schedule(name) else "no-schedule"
        if action == "resume":
            return "schedule-resumed" if client.resume_schedule(name) else "no-schedule"
        if client.run_schedule_now(name):
            return "schedule-due-now"
        return "schedule-not-runnable" if client.get_schedule(name) else "no-schedule"

    def _failed(self, request: Request, key: str, exc: KeyExpiryError) -> Response:
        """An action's error, in this answer (never through a link: the text is the error's
        own), on the task's page when that can still be shown."""
        try:
            return self.task_page(request, key, f"error: {exc}", 400)
        except KeyExpiryError:
            return PlainTextResponse(f"error: {exc}\n", status_code=400)

    def _do(self, action: str, key: str) -> str:
        """Do `action` on `key`; the code (in MESSAGES) of what happened."""
        client = self.client
        if action == "retry":
            return "requeued" if client.retry_keys([key]) else "not-retryable"
        if action == "run":
            return "due-now" if client.run_now([key]) else "not-runnable"
        return "cancelled" if client.cancel_keys([key]) else "not-cancellable"

    def _key_prefix(self, query: str) -> str:
        """A key, `Class`, `Class.method` or `Class@method@args`: the key prefix to look up."""
        prefix = self.client.settings.key_prefix
        if query.startswith(prefix) and "@" in query:
            return query
        class_name, dot, method = query.partition(".")
        if dot:
            return f"{prefix}{class_name}@{method}@"
        if "@" in query:
            return prefix + query
        return f"{prefix}{query}@"


_PATHS = {
    "index": "/",
    "tasks": "/tasks",
    "task": "/task",
    "retry": "/task/retry",
    "run": "/task/run",
    "cancel": "/task/cancel",
    "pause": "/pause",
    "resume": "/resume",
    "schedule_pause": "/schedule/pause",
    "schedule_resume": "/schedule/resume",
    "schedule_run": "/schedule/run",
    "css": "/static/dashboard.css",
}


def _url(request: Request, route: str, **query: Any) -> str:
    """A page's URL under wherever the dashboard is mounted (the ASGI root_path)."""
    base = request.scope.get("root_path", "").rstrip("/") + _PATHS[route]
    clean = {k: v for k, v in query.items() if v not in (None, "")}
    return f"{base}?{urlencode(clean)}" if clean else base


def _static(request: Request) -> Response:
    css = (_HERE / "static" / "dashboard.css").read_text()
    return Response(css, media_type="text/css", headers={"Cache-Control": "max-age=3600"})


def create_app(
    settings: Settings | None = None,
    *,
    token: str | None = None,
    client: Client | None = None,
) -> Any:
    """The dashboard as an ASGI app: serve it with `keyexpiry web`, or mount it in your own
    Starlette/FastAPI app (`app.mount("/tasks", create_app(settings, token=...))`).

    With `token` (at least 16 characters, else ConfigError), every request needs
    `Authorization: Bearer TOKEN` (or Basic, password TOKEN), and `Host` must be one of
    `settings.web_allowed_hosts` when that is set; without one only loopback clients using a
    loopback `Host` (or one listed) are served, and a wildcard listed is a ConfigError (it would
    match a DNS-rebinding page's name). Mounted, call the returned app's `close()`
    from your app's shutdown: a mounted app's lifespan is not run, and the `Client` it opened
    would keep its connections.
    """
    if settings is None:
        settings = client.settings if client is not None else Settings.from_env()
    resolved = settings
    dashboard = Dashboard(
        (lambda: client) if client is not None else (lambda: Client(resolved)),
        Csrf(),
        owns_client=client is None,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        yield
        dashboard.close()

    app = Starlette(
        routes=[
            Route("/", dashboard.index, name="index"),
            Route("/tasks", dashboard.tasks, name="tasks"),
            Route("/task", dashboard.task, name="task"),
            Route("/task/{action}", dashboard.act, methods=["POST"], name="act"),
            Route("/pause", dashboard.pause, methods=["POST"], name="pause"),
            Route("/resume", dashboard.resume, methods=["POST"], name="resume"),
            Route(
                "/schedule/{action}",
                dashboard.schedule_act,
                methods=["POST"],
                name="schedule_act",
            ),
            Route("/static/dashboard.css", _static, name="css"),
        ],
        lifespan=lifespan,
    )
    return Guard(
        app, token=token, allowed_hosts=settings.web_allowed_hosts, on_close=dashboard.close
    )
