"""Running and watching keyexpiry: the listener, the dashboard, the fleet's listeners, the
checks, the demo, and the embedded redis-server."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
from pathlib import Path

import typer
from loguru import logger

from keyexpiry.cli.common import (
    TasksOpt,
    known_errors,
    load_task_modules,
    local_time,
    opened_runtime,
    redact_urls,
    settings_from,
    task_modules,
)
from keyexpiry.errors import ConfigError, KeyExpiryError

app = typer.Typer()


@app.command()
@known_errors
def listen(
    ctx: typer.Context,
    tasks: str = TasksOpt,
    concurrency: int = typer.Option(
        None, envvar="KEYEXPIRY_CONCURRENCY", help="Handlers run at once (worker threads)."
    ),
    async_concurrency: int = typer.Option(
        None,
        envvar="KEYEXPIRY_ASYNC_CONCURRENCY",
        help="async def handlers run at once (coroutines on the listener's event loop).",
    ),
    configure_redis: bool = typer.Option(
        False, "--configure-redis", help="Turn on notify-keyspace-events Ex if it is off."
    ),
    http: str = typer.Option(
        None,
        "--http",
        envvar="KEYEXPIRY_HTTP",
        metavar="HOST:PORT",
        help="Serve Prometheus /metrics, /healthz and /readyz here.",
    ),
) -> None:
    """Run the listener until SIGTERM/SIGINT."""
    from keyexpiry.listener.listener import Listener

    settings = settings_from(
        ctx,
        tasks=task_modules(tasks),
        concurrency=concurrency,
        async_concurrency=async_concurrency,
        configure_redis=configure_redis or None,
        http=http,
    )
    load_task_modules(settings.tasks)
    listener = Listener(settings)
    # Every line of this process names its listener (JSON logs carry it as `extra.listener`).
    logger.configure(extra={"listener": listener.owner})
    # Everything loaded so far (modules, the registry, SQLAlchemy's tables) lives as long as the
    # process: frozen, the collector's full passes skip it. A full pass over it holds every thread
    # for 36-46 ms (measured in a bench listener), and every task due meanwhile waits that long;
    # frozen, the full passes seen took 1-2 ms. Only here: this process is the listener's own.
    gc.collect()
    gc.freeze()
    listener.run()


@app.command()
@known_errors
def web(
    ctx: typer.Context,
    bind: str = typer.Option(
        "127.0.0.1:8080", "--bind", envvar="KEYEXPIRY_WEB_BIND", metavar="HOST:PORT"
    ),
    tasks: str = TasksOpt,
) -> None:
    """Serve the dashboard (set KEYEXPIRY_WEB_TOKEN to require a token and bind beyond loopback;
    KEYEXPIRY_WEB_TRUSTED_PROXIES to read X-Forwarded-For from the proxies listed)."""
    from keyexpiry.settings import parse_bind
    from keyexpiry.web import create_app
    from keyexpiry.web.security import is_loopback
    from keyexpiry.web.serve import DashboardServer

    host, port = parse_bind(bind, "--bind")
    token = os.environ.get("KEYEXPIRY_WEB_TOKEN") or None
    if token is None and not is_loopback(host):
        raise ConfigError(
            f"--bind {bind}: without KEYEXPIRY_WEB_TOKEN the dashboard binds to loopback only"
        )
    settings = settings_from(ctx, tasks=task_modules(tasks))
    load_task_modules(settings.tasks)
    app_ = create_app(settings, token=token)  # refuses what it cannot serve safely, first
    if token is None:
        logger.warning(
            "no KEYEXPIRY_WEB_TOKEN: serving loopback clients only, without authentication"
        )
    server = DashboardServer(app_, host, port, trusted_proxies=settings.web_trusted_proxies)
    logger.info(
        "dashboard on http://{}:{}/ (at most {} connections)",
        host if ":" not in host else f"[{host}]",
        server.port,
        server.connection_cap,
    )
    server.run()


@app.command()
@known_errors
def listeners(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="One JSON object per line."),
) -> None:
    """The listeners sharing this ledger: id, host, started, last heartbeat, running tasks and
    their share of the task keys."""
    from keyexpiry.listener.partition import shares

    settings = settings_from(ctx)
    with opened_runtime(settings) as rt:
        now_ms = rt.clock.now_ms()
        rows = rt.store.listeners() if rt.store.table_exists() else []
    silent_ms = int(settings.takeover_after_s * 1000)
    if not rows and not as_json:
        typer.echo("no listener is running")
    live = {
        r.id: r.classes
        for r in rows
        if now_ms - r.heartbeat_at_ms <= silent_ms and r.stopping_at_ms is None
    }
    share = shares(live)
    for row in rows:
        age_ms = now_ms - row.heartbeat_at_ms
        state = (
            "silent"
            if age_ms > silent_ms
            else "stopping"
            if row.stopping_at_ms
            # Announcing no classes: not subscribed to Redis (`Fleet.away`), its peers share.
            else "away"
            if row.classes == frozenset()
            else "live"
        )
        if as_json:
            data = dataclasses.asdict(row) | {
                "classes": None if row.classes is None else sorted(row.classes),
                "heartbeat_age_ms": age_ms,
                "state": state,
                "share": share.get(row.id, 0.0),
            }
            typer.echo(json.dumps(data))
        else:
            started = local_time(row.started_at_ms)
            typer.echo(
                f"{state:<8} {row.id:<40} {row.host:<20} started {started}  "
                f"heartbeat {age_ms / 1000:.1f} s ago  running {row.running}  "
                f"share {share.get(row.id, 0.0):.0%}"
            )


@app.command()
@known_errors
def doctor(
    ctx: typer.Context,
    fix: bool = typer.Option(False, "--fix", help="Turn keyspace notifications on if allowed."),
) -> None:
    """Check Redis and the database; exit 1 if something fails."""
    from keyexpiry.ops.doctor import run_checks

    with opened_runtime(settings_from(ctx)) as rt:
        checks = run_checks(rt, fix=fix)
    for c in checks:
        typer.echo(f"[{c.status:>4}] {c.name:<13} {redact_urls(ctx, c.detail)}")
    if any(c.status == "fail" for c in checks):
        raise typer.Exit(code=1)


@app.command()
@known_errors
def demo(ctx: typer.Context) -> None:
    """A self-contained tour: example tasks due in seconds fire in a listener, then it exits."""
    from keyexpiry.demo import DEMO_MODULES, run_demo

    settings = settings_from(ctx, tasks=DEMO_MODULES)
    load_task_modules(settings.tasks)
    if not run_demo(settings):
        raise KeyExpiryError("some demo tasks did not finish in time")


embedded_app = typer.Typer(help="The embedded redis-server (the default when no Redis URL is set).")
app.add_typer(embedded_app, name="embedded")


def _embedded_dir(ctx: typer.Context) -> Path | None:
    """The embedded server's state dir, or None (said on stdout) when a Redis URL is set."""
    settings = settings_from(ctx)
    if settings.embedded_redis:
        return settings.state_dir
    typer.echo("no embedded redis-server in use (KEYEXPIRY_REDIS_URL is set)")
    return None


@embedded_app.command("status")
@known_errors
def embedded_status(ctx: typer.Context) -> None:
    """Say whether the embedded redis-server for the state dir is running, and where."""
    from keyexpiry.redis.embedded import is_running, socket_path

    if (state_dir := _embedded_dir(ctx)) is not None:
        state = "running" if is_running(state_dir) else "not running"
        typer.echo(
            f"embedded redis-server {state} (socket {socket_path(state_dir)}, "
            f"state dir {state_dir})"
        )


@embedded_app.command("stop")
@known_errors
def embedded_stop(ctx: typer.Context) -> None:
    """Stop the embedded redis-server for the state dir (its data is saved)."""
    from keyexpiry.redis.embedded import stop_embedded_redis

    if (state_dir := _embedded_dir(ctx)) is not None:
        stopped = stop_embedded_redis(state_dir)
        typer.echo(f"embedded redis-server {'stopped' if stopped else 'was not running'}")
