"""The `keyexpiry` command: parse options, build settings, call one library function."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import functools
import gc
import importlib
import inspect
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import typer
from loguru import logger
from typer.core import TyperArgument, TyperCommand

from keyexpiry.errors import ArgumentError, ConfigError, KeyExpiryError
from keyexpiry.limits import MAX_LIST_ROWS
from keyexpiry.log import configure_logging
from keyexpiry.masking import redact
from keyexpiry.settings import Settings

if TYPE_CHECKING:
    from keyexpiry.client import Client
    from keyexpiry.ledger.recurring import ScheduleRow

F = TypeVar("F", bound=Callable[..., Any])


class _TaskUsage(TyperCommand):
    """Usage `CLASS METHOD [ARG]...` for every command that names a task, bracketed whole where
    an option (`--tag`, `--dead`) may stand in for it: one form, not typer's `{CLASS} {method}`
    beside `[CLASS] [METHOD]`."""

    def collect_usage_pieces(self, ctx: object) -> list[str]:
        task = "CLASS METHOD [ARG]..."
        named = [p for p in self.params if isinstance(p, TyperArgument) and p.nargs == 1]
        required = all(p.required for p in named)
        return [self.options_metavar or "[OPTIONS]", task if required else f"[{task}]"]


app = typer.Typer(
    help="Delayed tasks on Redis keyspace notifications, with a SQL ledger.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

TasksOpt = typer.Option(
    None, "--tasks", envvar="KEYEXPIRY_TASKS", help="Comma-separated modules that register tasks."
)


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            installed = version("keyexpiry")
        except PackageNotFoundError:  # run from a source tree that was never installed
            from keyexpiry import __version__ as installed
        typer.echo(f"keyexpiry {installed}")
        raise typer.Exit()


@app.callback()
def _global(
    ctx: typer.Context,
    redis_url: str = typer.Option(
        None,
        envvar="KEYEXPIRY_REDIS_URL",
        help="redis://, rediss:// or redis+cluster://host:port,… URL; empty: embedded.",
    ),
    database_url: str = typer.Option(
        None, envvar="KEYEXPIRY_DATABASE_URL", help="SQLAlchemy URL; empty: SQLite in state dir."
    ),
    state_dir: Path = typer.Option(
        None, envvar="KEYEXPIRY_STATE_DIR", help="Where embedded Redis and SQLite live."
    ),
    key_prefix: str = typer.Option(None, envvar="KEYEXPIRY_KEY_PREFIX", help="Task key prefix."),
    log_level: str = typer.Option("INFO", envvar="KEYEXPIRY_LOG_LEVEL", help="Log level."),
    log_format: str = typer.Option(
        "text", envvar="KEYEXPIRY_LOG_FORMAT", help="text, or json: one object per line."
    ),
    version: bool = typer.Option(
        False, "--version", is_eager=True, callback=_print_version, help="Print the version."
    ),
) -> None:
    try:
        configure_logging(log_level, log_format=log_format)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=1) from None
    ctx.obj = {
        "redis_url": redis_url,
        "database_url": database_url,
        "state_dir": state_dir,
        "key_prefix": key_prefix,
        "log_level": log_level,
    }


def _errors(func: F) -> F:
    """Known errors become one line on stderr and exit code 1, never a traceback."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except KeyExpiryError as exc:
            _error(kwargs.get("ctx"), str(exc))
        except Exception as exc:
            import redis

            from keyexpiry.redis.server import describe_redis_error

            if not isinstance(exc, redis.RedisError):
                raise
            _error(kwargs.get("ctx"), describe_redis_error(exc))

    return wrapper  # type: ignore[return-value]


def _error(ctx: typer.Context | None, message: str) -> NoReturn:
    """`error: message` on stderr, exit 1; a credential of the URLs in use never shows, even
    when a driver's message quotes the piece of a URL it failed on."""
    typer.echo(f"error: {_redact(ctx, message)}", err=True)
    raise typer.Exit(code=1) from None


def _redact(ctx: typer.Context | None, text: str) -> str:
    obj = (ctx.obj if ctx is not None else None) or {}
    urls = [obj.get(name) for name in ("redis_url", "database_url")]
    urls += [os.environ.get(f"KEYEXPIRY_{name}") for name in ("REDIS_URL", "DATABASE_URL")]
    return redact(text, *urls)


def _settings(ctx: typer.Context, **flags: Any) -> Settings:
    return Settings.from_env(**(ctx.obj or {}), **flags)


def load_task_modules(modules: tuple[str, ...]) -> None:
    """Import the modules that register task classes; the current directory is importable."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ConfigError(f"cannot import task module {name!r}: {exc}") from None


def _tasks(value: str | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    return tuple(p.strip() for p in value.split(",") if p.strip())


@contextlib.contextmanager
def _runtime(settings: Settings) -> Iterator[Any]:
    """Connections for a one-off command, closed afterwards."""
    from keyexpiry.runtime import Runtime

    rt = Runtime.open(settings)
    try:
        yield rt
    finally:
        rt.close()


def _client(settings: Settings) -> Any:
    from keyexpiry.client import Client

    load_task_modules(settings.tasks)
    return Client(settings)


def _key(client: Any, class_name: str, method: str, args: list[str]) -> str:
    """The key for CLI arguments: typed through the registry when the class is loaded."""
    from keyexpiry.errors import UnknownTaskError
    from keyexpiry.keys import format_key

    try:
        return str(client.key_for(f"{class_name}.{method}", *args))
    except UnknownTaskError:
        return format_key(class_name, method, args, prefix=client.settings.key_prefix)


def _local_time(ms: int) -> str:
    """`ms` as local ISO 8601 time to the millisecond with its UTC offset, the one format every
    command prints (`2025-01-02T03:04:05.678+00:00`); any stored value prints, even out of range."""
    try:
        return dt.datetime.fromtimestamp(ms / 1000).astimezone().isoformat("T", "milliseconds")
    except (ValueError, OverflowError, OSError):
        return f"{ms} ms (not a date)"


@app.command()
@_errors
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

    settings = _settings(
        ctx,
        tasks=_tasks(tasks),
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


@app.command(cls=_TaskUsage)
@_errors
def create(
    ctx: typer.Context,
    class_name: str = typer.Argument(..., metavar="CLASS"),
    method: str = typer.Argument(..., metavar="METHOD"),
    args: list[str] = typer.Argument(None, metavar="ARG"),
    ttl: float = typer.Option(None, "--ttl", help="Run after this many seconds."),
    ttl_ms: int = typer.Option(None, "--ttl-ms", help="Run after this many milliseconds."),
    at: str = typer.Option(None, "--at", help="Run at an ISO 8601 time (naive = local time)."),
    tag: str = typer.Option(None, "--tag", help="A business key to list and cancel it by."),
    payload: str = typer.Option(
        None, "--payload", help="A JSON document that travels with the task (current().payload)."
    ),
    tasks: str = TasksOpt,
) -> None:
    """Schedule CLASS.METHOD(ARG...) and print its key."""
    when = _when(at, "--at")
    if sum(x is not None for x in (ttl, ttl_ms, when)) != 1:
        raise ConfigError("give exactly one of --ttl, --ttl-ms or --at")
    document = None
    if payload is not None:
        from keyexpiry.limits import MAX_JSON_DEPTH, json_too_deep

        if json_too_deep(payload):  # before decoding it: that is what would fail
            raise ArgumentError(f"--payload is nested deeper than {MAX_JSON_DEPTH} levels")
        try:
            document = json.loads(payload)
        except ValueError as exc:
            raise ArgumentError(f"--payload is not JSON: {exc}") from None
    with _client(_settings(ctx, tasks=_tasks(tasks))) as client:
        key = client.create(
            f"{class_name}.{method}",
            *(args or []),
            ttl_s=ttl,
            ttl_ms=ttl_ms,
            at=when,
            tag=tag,
            payload=document,
        )
    typer.echo(key)


@app.command(cls=_TaskUsage)
@_errors
def cancel(
    ctx: typer.Context,
    class_name: str = typer.Argument(None, metavar="CLASS"),
    method: str = typer.Argument(None, metavar="METHOD"),
    args: list[str] = typer.Argument(None, metavar="ARG"),
    tag: str = typer.Option(None, "--tag", help="Instead of a task: every pending one so tagged."),
    tasks: str = TasksOpt,
) -> None:
    """Cancel a pending task (exit 1 if it is not pending), or with --tag every pending task
    tagged so (prints how many; none is not an error)."""
    if tag is not None:
        if class_name is not None:
            raise ConfigError("give either CLASS METHOD [ARG]... or --tag, not both")
        with _client(_settings(ctx, tasks=_tasks(tasks))) as client:
            count = client.cancel_tag(tag)
        typer.echo(f"cancelled {count} task(s) tagged {tag}")
        return
    if class_name is None or method is None:
        raise ConfigError("name the task (CLASS METHOD [ARG]...) or give --tag")
    with _client(_settings(ctx, tasks=_tasks(tasks))) as client:
        key = _key(client, class_name, method, args or [])
        if client.cancel_keys([key]):
            typer.echo(f"cancelled {key}")
            return
        row = client.store.get(key)
        state = "does not exist" if row is None else f"is {row.status}"
        raise KeyExpiryError(f"{key} {state}, not pending: nothing cancelled")


def _when(value: str | None, flag: str) -> dt.datetime | None:
    """An ISO 8601 time (naive = local) given on the command line, aware."""
    if value is None:
        return None
    try:
        when = dt.datetime.fromisoformat(value)
    except ValueError:
        raise ConfigError(f"{flag} {value!r} is not an ISO 8601 time") from None
    if when.tzinfo is None:
        try:
            when = when.astimezone()
        except (OverflowError, ValueError, OSError):
            raise ConfigError(f"{flag} {value!r} is out of range") from None
    return when


_UNITS_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def _since(value: str | None) -> dt.datetime | None:
    """`--since`: an ISO 8601 time, or an age such as 30m, 12h, 7d."""
    if value is None:
        return None
    text = value.strip()
    if text[:-1].isdigit() and text[-1:] in _UNITS_S:
        age_s = int(text[:-1]) * _UNITS_S[text[-1]]
        if age_s > 100 * 365 * 86400:
            raise ConfigError(f"--since {value!r} is more than 100 years")
        return dt.datetime.now(dt.UTC) - dt.timedelta(seconds=age_s)
    return _when(text, "--since")


@app.command(cls=_TaskUsage)
@_errors
def retry(
    ctx: typer.Context,
    class_name: str = typer.Argument(None, metavar="CLASS"),
    method: str = typer.Argument(None, metavar="METHOD"),
    args: list[str] = typer.Argument(None, metavar="ARG"),
    dead: bool = typer.Option(False, "--dead", help="Retry every dead task (see --class)."),
    only_class: str = typer.Option(None, "--class", help="With --dead: only this class."),
    since: str = typer.Option(
        None, "--since", help="With --dead: only tasks dead since (ISO time, or 30m, 12h, 7d)."
    ),
    at: str = typer.Option(None, "--at", help="Run at this ISO 8601 time, not now."),
    tasks: str = TasksOpt,
) -> None:
    """Run a dead (or failed and waiting) task again, attempts reset; or all with --dead."""
    when = _when(at, "--at")
    if dead:
        if class_name is not None:
            raise ConfigError("give CLASS METHOD [ARG]... or --dead, not both")
        after = _since(since)
        with _client(_settings(ctx, tasks=_tasks(tasks))) as client:
            total = client.store.count_dead(
                class_name=only_class,
                since_ms=None if after is None else round(after.timestamp() * 1000),
            )
            with typer.progressbar(
                length=total, label="retrying", file=sys.stderr, show_pos=True
            ) as bar:
                shown = [0]

                def progress(done: int, _total: int) -> None:
                    bar.update(done - shown[0])
                    shown[0] = done

                count = client.retry_dead(
                    class_name=only_class, since=after, at=when, progress=progress
                )
        typer.echo(f"requeued {count} dead task(s)")
        return
    if only_class is not None or since is not None:
        raise ConfigError("--class and --since go with --dead")
    if class_name is None or method is None:
        raise ConfigError("give CLASS METHOD [ARG]..., or --dead")
    with _client(_settings(ctx, tasks=_tasks(tasks))) as client:
        key = _key(client, class_name, method, args or [])
        if client.retry_keys([key], at=when):
            typer.echo(f"requeued {key}")
            return
        row = client.store.get(key)
        state = "does not exist" if row is None else f"is {row.status}, attempt {row.attempts}"
        raise KeyExpiryError(f"{key} {state}: only dead or failed-and-waiting tasks are retried")


def _plain_client(settings: Settings) -> Any:
    """A client without the task modules: a command that names tasks only by name needs none
    (nor a module that cannot be imported on this host)."""
    from keyexpiry.client import Client

    return Client(settings)


@app.command()
@_errors
def pause(
    ctx: typer.Context,
    target: str = typer.Argument(..., metavar="CLASS[.METHOD]"),
    until: str = typer.Option(
        None, "--until", help="Until this ISO 8601 time (naive = local time)."
    ),
    for_: str = typer.Option(None, "--for", metavar="DURATION", help="For 30m, 2h, 1d, 1h30m…"),
    reason: str = typer.Option(None, "--reason", help="Why: shown by `paused` and the dashboard."),
) -> None:
    """Hold back a task class, or one method, on every listener (until --until, for --for, or
    until `resume`); its tasks wait, pending, and run once the pause ends."""
    from keyexpiry.flow.pauses import parse_duration
    from keyexpiry.printable import printable

    if until is not None and for_ is not None:
        raise ConfigError("give at most one of --until and --for")
    when = _when(until, "--until")
    for_s = None if for_ is None else parse_duration(for_)
    with _plain_client(_settings(ctx)) as client:
        done = client.pause(target, until=when, for_s=for_s, reason=reason)
    end = "until resumed" if done.until_ms is None else f"until {_local_time(done.until_ms)}"
    why = f" ({done.reason})" if done.reason else ""
    typer.echo(printable(f"paused {done.target} {end}{why}"))


@app.command()
@_errors
def resume(
    ctx: typer.Context,
    target: str = typer.Argument(..., metavar="CLASS[.METHOD]"),
) -> None:
    """End the pause of a task class or method (exit 0 either way; says whether it was
    paused). Resuming a class leaves the pauses of its methods."""
    from keyexpiry.flow.pauses import parse_target

    name = parse_target(target)
    with _plain_client(_settings(ctx)) as client:
        was_paused = client.resume(name)
    typer.echo(f"resumed {name}" if was_paused else f"{name} was not paused")


@app.command()
@_errors
def paused(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="One JSON object per line."),
) -> None:
    """The pauses in force: target, since, until, reason; malformed pause rows counted."""
    from keyexpiry.keys import clip
    from keyexpiry.printable import printable

    with _plain_client(_settings(ctx)) as client:
        read = client.read_pauses()
    pauses = read.pauses
    if as_json:
        for p in pauses:
            typer.echo(json.dumps(p.to_json()))
    elif not pauses:
        typer.echo("nothing is paused")
    else:
        typer.echo(f"{'TARGET':<30} {'SINCE':<29}  {'UNTIL':<29}  REASON")
        for p in pauses:
            end = "until resumed" if p.until_ms is None else _local_time(p.until_ms)
            since = _local_time(p.paused_at_ms)
            line = f"{p.target:<30} {since:<29}  {end:<29}  {p.reason or ''}"
            typer.echo(printable(line.rstrip()))
    # On stderr: stdout stays the pauses alone (`--json` is read by programs).
    for bad in read.malformed:
        typer.echo(
            printable(f"malformed pause row {clip(bad.target, 60)}: {bad.problem}"), err=True
        )
    if read.malformed:
        typer.echo(
            f"{len(read.malformed)} malformed pause row(s) skipped: they pause nothing", err=True
        )


def _schedule_task(s: ScheduleRow) -> str:
    """`Class.method(arg, …)` of a schedule's task, its arguments as canonical text."""
    return f"{s.class_name}.{s.method}({', '.join(s.args)})"


def _schedule_state(s: ScheduleRow) -> str:
    return "paused" if s.paused else "ended" if s.occurrence_ms is None else "active"


def _last_run(s: ScheduleRow) -> str:
    """How the last run went and when; and when it last succeeded, if that was earlier."""
    if s.last_status is None or s.last_finished_ms is None:
        return "never run"
    text = f"{s.last_status} {_local_time(s.last_finished_ms)}"
    if s.last_status != "done":
        ok = "never" if s.last_success_ms is None else _local_time(s.last_success_ms)
        text += f" (last success: {ok})"
    return text


@app.command("schedules")
@_errors
def list_schedules(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="One JSON object per line."),
) -> None:
    """The recurring schedules: name, state (active, paused, ended), task, when it runs, next
    run and last run."""
    from keyexpiry.printable import printable
    from keyexpiry.schedules.operate import live_classes, unregistered, unregistered_note

    with _plain_client(_settings(ctx)) as client:
        rows, problems = client.store.schedules_and_problems()
        classes = live_classes(client.rt)
    flagged = unregistered(rows, classes)
    for problem in problems:  # a malformed row is said, and the others still list
        typer.echo(printable(f"warning: {problem} (ignored)"), err=True)
    if as_json:
        for s in rows:
            # `registered`: whether a live listener registers its class (null: cannot tell).
            registered = None if classes is None else s.name not in flagged
            typer.echo(json.dumps({**s.to_json(), "registered": registered}))
        return
    if not rows:
        typer.echo("no schedules")
        return
    typer.echo(f"{'NAME':<24} {'STATE':<6}  {'TASK':<30} {'WHEN':<26} {'NEXT':<29}  LAST RUN")
    for s in rows:
        state = _schedule_state(s)
        # A paused schedule's occurrence waits for its resume; an ended one has none.
        nxt = _local_time(s.occurrence_ms) if state == "active" else "-"
        line = (
            f"{s.name:<24} {state:<6}  {_schedule_task(s):<30} {s.recurrence.describe():<26} "
            f"{nxt:<29}  {_last_run(s)}"
        )
        typer.echo(printable(line))  # names and arguments are text from outside: one line
    for s in rows:
        if s.name in flagged:
            typer.echo(printable(f"warning: {unregistered_note(s, classes)}"), err=True)


schedule_app = typer.Typer(
    help="Operate one recurring schedule by its name (`keyexpiry schedules` lists them).",
    no_args_is_help=True,
)
app.add_typer(schedule_app, name="schedule")


def _schedule_named(client: Client, name: str) -> ScheduleRow:
    """Schedule `name`, or a one-line error (exit 1) when there is none."""
    found = client.get_schedule(name)
    if found is None:
        raise KeyExpiryError(f"no schedule named {name!r} (`keyexpiry schedules` lists them)")
    return found


@schedule_app.command("pause")
@_errors
def schedule_pause(ctx: typer.Context, name: str = typer.Argument(..., metavar="NAME")) -> None:
    """Stop a schedule (its pending occurrence cancelled) until `schedule resume`; what it
    misses meanwhile then follows its catch_up."""
    from keyexpiry.printable import printable

    with _plain_client(_settings(ctx)) as client:
        if _schedule_named(client, name).paused:
            typer.echo(printable(f"schedule {name} was already paused"))
            return
        if not client.pause_schedule(name):
            _schedule_named(client, name)  # removed meanwhile: says so
    typer.echo(printable(f"paused schedule {name} (`keyexpiry schedule resume {name}` to go on)"))


@schedule_app.command("resume")
@_errors
def schedule_resume(ctx: typer.Context, name: str = typer.Argument(..., metavar="NAME")) -> None:
    """Resume a paused schedule (exit 0 if it was not paused); an occurrence it missed runs
    now, as its catch_up says."""
    from keyexpiry.printable import printable

    with _plain_client(_settings(ctx)) as client:
        if not _schedule_named(client, name).paused:
            typer.echo(printable(f"schedule {name} was not paused"))
            return
        client.resume_schedule(name)
        after = _schedule_named(client, name)
        now_ms = client.clock.now_ms()
    if after.occurrence_ms is None:
        nxt = "it has ended: nothing more runs"
    elif after.occurrence_ms <= now_ms:
        nxt = _catching_up(after, now_ms)
    else:
        nxt = f"next run {_local_time(after.occurrence_ms)}"
    typer.echo(printable(f"resumed schedule {name}: {nxt}"))


def _catching_up(s: ScheduleRow, now_ms: int) -> str:
    """What a resumed schedule whose occurrence is due does now, by its catch_up."""
    from keyexpiry.schedules.rules import plan_run

    assert s.occurrence_ms is not None
    rec = s.recurrence
    plan = plan_run(rec, s.occurrence_ms, now_ms, s.anchor_ms, s.catch_up, s.catch_up_max)
    if not plan.missed:
        return f"the run due {_local_time(s.occurrence_ms)} runs now"
    missed = f"runs missed since {_local_time(s.occurrence_ms)}"
    if not plan.run:  # catch_up="none"
        nxt = rec.after(now_ms, s.anchor_ms)
        then = "it has ended" if nxt is None else f"next run {_local_time(nxt)}"
        return f"{missed}, skipped (catch_up=none); {then}"
    if s.catch_up == "latest":
        return f"{missed}: one run now, for the latest ({_local_time(plan.scheduled_for_ms)})"
    return (
        f"{missed}: each runs now in turn (catch_up=all, the last {s.catch_up_max} at most), "
        f"from {_local_time(plan.scheduled_for_ms)}"
    )


@schedule_app.command("remove")
@_errors
def schedule_remove(ctx: typer.Context, name: str = typer.Argument(..., metavar="NAME")) -> None:
    """Delete a schedule and cancel its pending occurrence (a running one finishes)."""
    from keyexpiry.printable import printable

    with _plain_client(_settings(ctx)) as client:
        found = _schedule_named(client, name)
        if not client.unschedule(name):
            _schedule_named(client, name)  # removed meanwhile: says so
    typer.echo(printable(f"removed schedule {name}"))
    if found.source == "code":
        # Every listener that registers the method declares its schedule as it starts.
        typer.echo(
            printable(
                f"warning: {name} is declared in code (@exposed with cron= or every_s=): a "
                "listener that registers it declares it again when it starts; remove it "
                f"from the code, or `keyexpiry schedule pause {name}` instead"
            ),
            err=True,
        )


@schedule_app.command("run-now")
@_errors
def schedule_run_now(ctx: typer.Context, name: str = typer.Argument(..., metavar="NAME")) -> None:
    """Run a schedule's pending occurrence now, as an extra run: the regular occurrences
    follow as before. Exit 1 when nothing can start (running, paused or ended)."""
    from keyexpiry.ledger.rows import TaskStatus
    from keyexpiry.printable import printable

    with _plain_client(_settings(ctx)) as client:
        if client.run_schedule_now(name):
            typer.echo(
                printable(f"schedule {name}: an extra run is due now (the regular ones follow)")
            )
            return
        # Nothing started: say why.
        found = _schedule_named(client, name)
        if found.paused:
            raise KeyExpiryError(f"schedule {name!r} is paused: nothing started (resume it)")
        if found.occurrence_ms is None:
            raise KeyExpiryError(f"schedule {name!r} has ended: nothing started")
        row = client.store.get(found.task_key)
    if row is not None and row.status is TaskStatus.RUNNING:
        raise KeyExpiryError(f"schedule {name!r}: its occurrence is running now, nothing started")
    raise KeyExpiryError(
        f"schedule {name!r} has no pending occurrence now (listeners put it back within "
        "seconds): nothing started, try again"
    )


@app.command()
@_errors
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
    settings = _settings(ctx, tasks=_tasks(tasks))
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
@_errors
def listeners(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="One JSON object per line."),
) -> None:
    """The listeners sharing this ledger: id, host, started, last heartbeat, running tasks and
    their share of the task keys."""
    from keyexpiry.listener.partition import shares
    from keyexpiry.runtime import Runtime

    settings = _settings(ctx)
    rt = Runtime.open(settings)
    try:
        now_ms = rt.clock.now_ms()
        rows = rt.store.listeners() if rt.store.table_exists() else []
    finally:
        rt.close()
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
            started = _local_time(row.started_at_ms)
            typer.echo(
                f"{state:<8} {row.id:<40} {row.host:<20} started {started}  "
                f"heartbeat {age_ms / 1000:.1f} s ago  running {row.running}  "
                f"share {share.get(row.id, 0.0):.0%}"
            )


@app.command()
@_errors
def prune(
    ctx: typer.Context,
    older_than: str = typer.Option(
        None,
        "--older-than",
        help="Finished longer ago than this (30m, 12h, 7d, 2w); default: the retention settings.",
    ),
    status: str = typer.Option(
        "done,cancelled,dead", "--status", help="Which finished statuses, comma-separated."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Count, delete nothing."),
) -> None:
    """Delete finished rows past their retention, in batches of 1,000 (progress bar)."""
    from keyexpiry.ledger import retention
    from keyexpiry.ledger.store import TaskStatus
    from keyexpiry.runtime import Runtime

    settings = _settings(ctx)
    try:
        statuses = [TaskStatus(s.strip()) for s in status.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"--status {status!r}: use done, cancelled and/or dead") from None
    if not statuses or any(s not in retention.FINISHED for s in statuses):
        raise ConfigError(f"--status {status!r}: only done, cancelled and dead rows are pruned")
    retain = {
        TaskStatus.DONE: settings.retain_done_s,
        TaskStatus.CANCELLED: settings.retain_done_s,
        TaskStatus.DEAD: settings.retain_dead_s,
    }
    if older_than is not None:
        cutoff = _since(older_than)
        assert cutoff is not None
        age_s = max(0.0, (dt.datetime.now(dt.UTC) - cutoff).total_seconds())
        retain = dict.fromkeys(retain, age_s or 0.001)
    rt = Runtime.open(settings)
    try:
        before = retention.cutoffs(rt.clock.now_ms(), {s: retain[s] for s in statuses})
        counts = {s: rt.store.count_finished_before(s, b) for s, b in before.items()}
        if dry_run:
            report = retention.PruneReport({s.value: n for s, n in counts.items()})
            typer.echo(f"would delete {report.total} row(s): {report}")
            return
        with typer.progressbar(
            length=sum(counts.values()), label="pruning", file=sys.stderr, show_pos=True
        ) as bar:
            report = retention.prune(rt.store, before, progress=bar.update)
    finally:
        rt.close()
    typer.echo(f"deleted {report.total} row(s): {report}")


@app.command(cls=_TaskUsage)
@_errors
def show(
    ctx: typer.Context,
    class_name: str = typer.Argument(..., metavar="CLASS"),
    method: str = typer.Argument(..., metavar="METHOD"),
    args: list[str] = typer.Argument(None, metavar="ARG"),
    as_json: bool = typer.Option(False, "--json", help="One JSON object."),
    tasks: str = TasksOpt,
) -> None:
    """Show one task's ledger row and remaining TTL."""
    from keyexpiry.errors import TaskNotFoundError

    with _client(_settings(ctx, tasks=_tasks(tasks))) as client:
        key = _key(client, class_name, method, args or [])
        row = client.store.get(key)
        if row is None:
            raise TaskNotFoundError(f"no task {key}")
        pttl = int(client.redis.pttl(key))
    data = row.to_json()
    data["ttl_ms"] = pttl if pttl >= 0 else None
    if as_json:
        typer.echo(json.dumps(data))
        return
    from keyexpiry.printable import printable, printable_lines

    for name, value in data.items():
        if name == "problem" and value is None:
            continue  # a sound row; a malformed one says what is wrong with it
        if name.endswith("_at") and value is not None:
            value = _local_time(round(value * 1000))
        elif name in ("result", "payload") and value is not None:
            value = json.dumps(value, ensure_ascii=False)
        # Text from outside (a handler's error, a tag, a row written by hand): control
        # characters escaped; an error's traceback keeps its lines, indented under its label,
        # so none of them can pass for a field.
        multiline = name == "last_error" and value is not None
        shown = printable_lines(value, " " * 14) if multiline else printable(str(value))
        typer.echo(f"{name:>12}: {shown}")


@app.command("list")
@_errors
def list_tasks(
    ctx: typer.Context,
    status: str = typer.Option(None, "--status", help="pending/running/done/dead/cancelled."),
    limit: int = typer.Option(50, "--limit", min=1, max=MAX_LIST_ROWS),
    tag: str = typer.Option(None, "--tag", help="Only tasks with this tag."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per line."),
) -> None:
    """List tasks by due time."""
    from keyexpiry.ledger.rows import task_status
    from keyexpiry.printable import printable
    from keyexpiry.runtime import open_store
    from keyexpiry.tags import check_tag

    wanted = task_status(status or None, ConfigError, "--status")
    wanted_tag = check_tag(tag, ConfigError)
    store = open_store(_settings(ctx))
    try:
        rows: list[Any] = []
        if store.table_exists():
            # A ledger from an older keyexpiry lacks columns every read names: upgrade it in
            # place first, as every other command (through Client) and listener start does.
            store.create_schema()
            rows = store.list_tasks(wanted, limit, tag=wanted_tag)
    finally:
        store.engine.dispose()
    if rows and not as_json:
        typer.echo(f"{'STATUS':<9} {'TRIES':>5}  {'DUE':<29}  KEY  [TAG]")
    for row in rows:
        if as_json:
            typer.echo(json.dumps(row.to_json()))
        else:
            due = "not a time" if "due_at_ms" in row.unreadable else _local_time(row.due_at_ms)
            tagged = f"  [{row.tag}]" if row.tag is not None else ""
            flagged = f"  MALFORMED: {row.problem}" if row.problem else ""
            line = f"{row.status:<9} {row.attempts:>5}  {due:<29}  {row.key}{tagged}{flagged}"
            typer.echo(printable(line))  # one line, whatever a tag or error holds


@app.command()
@_errors
def reconcile(
    ctx: typer.Context,
    dry_run: bool = typer.Option(False, "--dry-run", help="Report, change nothing."),
) -> None:
    """Re-arm keys Redis lost and requeue runs whose listener died."""
    from keyexpiry.listener.reconcile import Reconciler

    settings = _settings(ctx)
    with _runtime(settings) as rt:
        store = rt.store
        store.create_schema()
        reconciler = Reconciler(rt)
        with typer.progressbar(length=max(store.count_pending(), 1), label="reconciling") as bar:
            done = [0]

            def progress(n: int, _total: int) -> None:
                bar.update(n - done[0])
                done[0] = n

            report = reconciler.run(dry_run=dry_run, progress=progress)
    typer.echo(("would have: " if dry_run else "") + str(report))


@app.command("init-db")
@_errors
def init_db(ctx: typer.Context) -> None:
    """Create the ledger's tables, or bring an older ledger up to date (idempotent): add what it
    lacks, and drop the indexes this version no longer uses. Run it once every listener runs
    this version."""
    from keyexpiry.runtime import open_store

    store = open_store(_settings(ctx))
    try:
        # Builds every missing index, however big the table (online on MySQL/MariaDB), and only
        # then drops the retired ones (an older listener still running may read through them).
        store.create_schema(all_indexes=True)
    finally:
        store.engine.dispose()
    typer.echo("time_limit_task, keyexpiry_listener, keyexpiry_pause and keyexpiry_schedule ready")


@app.command()
@_errors
def doctor(
    ctx: typer.Context,
    fix: bool = typer.Option(False, "--fix", help="Turn keyspace notifications on if allowed."),
) -> None:
    """Check Redis and the database; exit 1 if something fails."""
    from keyexpiry.ops.doctor import run_checks

    with _runtime(_settings(ctx)) as rt:
        checks = run_checks(rt, fix=fix)
    for c in checks:
        typer.echo(f"[{c.status:>4}] {c.name:<13} {_redact(ctx, c.detail)}")
    if any(c.status == "fail" for c in checks):
        raise typer.Exit(code=1)


@app.command()
@_errors
def demo(ctx: typer.Context) -> None:
    """A self-contained tour: example tasks due in seconds fire in a listener, then it exits."""
    from keyexpiry.demo import DEMO_MODULES, run_demo

    settings = _settings(ctx, tasks=DEMO_MODULES)
    load_task_modules(settings.tasks)
    if not run_demo(settings):
        raise KeyExpiryError("some demo tasks did not finish in time")


@app.command()
@_errors
def bench(
    scenario: list[str] = typer.Option(
        None,
        "--scenario",
        help="steady, sparse, burst, throughput, create, listeners (the default: all six); "
        "ledger, aio, cluster, memory, flow, soak (only when named).",
    ),
    minutes: float = typer.Option(
        10.0, "--minutes", min=0.5, help="soak: minutes of load and faults (--quick: 2)."
    ),
    runs: int = typer.Option(3, "--runs", min=1, help="Runs per scenario and variant."),
    backend: str = typer.Option(
        "mariadb",
        "--backend",
        help="mariadb, postgres or sqlite; several, comma-separated, run side by side "
        "(e.g. mariadb,postgres).",
    ),
    quick: bool = typer.Option(
        False, "--quick", help="A fifth of the sizes (ledger: 1 M rows, not 10 M)."
    ),
    out: Path = typer.Option(Path("bench-results/latest.json"), "--json", help="Write here."),
    peers: bool = typer.Option(
        True,
        "--peers/--no-peers",
        help="Also run steady on huey and arq (needs the `peers` extra; skipped with a note).",
    ),
) -> None:
    """Benchmark against real servers started for the run (redis-server, and mariadbd or
    PostgreSQL for those backends, from the system)."""
    from keyexpiry.bench.run import DEFAULT_SCENARIOS, SCENARIOS, run

    names = list(scenario or DEFAULT_SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    backends = backend.split(",")
    if unknown or not set(backends) <= {"mariadb", "postgres", "sqlite"}:
        raise ConfigError(f"unknown scenario/backend: {unknown or backend}")
    if "soak" in names:
        _soak(minutes, quick=quick, others=[n for n in names if n != "soak"])
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    run(names, runs=runs, backend=backend, quick=quick, out=out, peers=peers)
    typer.echo(f"figures written to {out}")


def _soak(minutes: float, *, quick: bool, others: list[str]) -> None:
    """`bench --scenario soak`: its own servers (Sentinel, HAProxy, MariaDB), its own report."""
    from keyexpiry.bench import soak

    if others:
        raise ConfigError(f"soak runs alone, not with {', '.join(others)}")
    cfg = soak.SoakConfig.quick(minutes if minutes != 10.0 else 2.0) if quick else None
    report = soak.run(cfg or soak.SoakConfig(minutes=minutes), Path("bench-results/soak"))
    verdict = report["verdict"]
    typer.echo(soak.summary(report))
    typer.echo(f"history, soak.json and plots in {report['run_dir']}")
    if not verdict.get("passed"):
        raise typer.Exit(1)


embedded_app = typer.Typer(help="The embedded redis-server (the default when no Redis URL is set).")
app.add_typer(embedded_app, name="embedded")


def _embedded_dir(ctx: typer.Context) -> Path | None:
    """The embedded server's state dir, or None (said on stdout) when a Redis URL is set."""
    settings = _settings(ctx)
    if settings.embedded_redis:
        return settings.state_dir
    typer.echo("no embedded redis-server in use (KEYEXPIRY_REDIS_URL is set)")
    return None


@embedded_app.command("status")
@_errors
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
@_errors
def embedded_stop(ctx: typer.Context) -> None:
    """Stop the embedded redis-server for the state dir (its data is saved)."""
    from keyexpiry.redis.embedded import stop_embedded_redis

    if (state_dir := _embedded_dir(ctx)) is not None:
        stopped = stop_embedded_redis(state_dir)
        typer.echo(f"embedded redis-server {'stopped' if stopped else 'was not running'}")


def _one_line_help() -> None:
    # Typer shows a docstring's hard line wraps in the command list: each command's summary
    # (its first paragraph) as one line, wrapped to the terminal by typer itself.
    groups = [g.typer_instance for g in app.registered_groups if g.typer_instance is not None]
    for info in [c for t in (app, *groups) for c in t.registered_commands]:
        doc = inspect.getdoc(info.callback) if info.callback is not None else None
        if info.short_help is None and doc:
            info.short_help = " ".join(doc.split("\n\n")[0].split())


_one_line_help()


def main() -> None:
    """Console entry point."""
    app()
