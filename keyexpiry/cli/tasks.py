"""Commands on single tasks and lists of them: create, cancel, retry, show, list."""

from __future__ import annotations

import json
import sys
from typing import Any

import typer

from keyexpiry.cli.common import (
    TasksOpt,
    TaskUsage,
    client_with_tasks,
    known_errors,
    local_time,
    parse_since,
    parse_when,
    settings_from,
    task_modules,
)
from keyexpiry.errors import ArgumentError, ConfigError, KeyExpiryError
from keyexpiry.limits import MAX_LIST_ROWS

app = typer.Typer()


def _key(client: Any, class_name: str, method: str, args: list[str]) -> str:
    """The key for CLI arguments: typed through the registry when the class is loaded."""
    from keyexpiry.errors import UnknownTaskError
    from keyexpiry.keys import format_key

    try:
        return str(client.key_for(f"{class_name}.{method}", *args))
    except UnknownTaskError:
        return format_key(class_name, method, args, prefix=client.settings.key_prefix)


@app.command(cls=TaskUsage)
@known_errors
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
    when = parse_when(at, "--at")
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
    with client_with_tasks(settings_from(ctx, tasks=task_modules(tasks))) as client:
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


@app.command(cls=TaskUsage)
@known_errors
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
        with client_with_tasks(settings_from(ctx, tasks=task_modules(tasks))) as client:
            count = client.cancel_tag(tag)
        typer.echo(f"cancelled {count} task(s) tagged {tag}")
        return
    if class_name is None or method is None:
        raise ConfigError("name the task (CLASS METHOD [ARG]...) or give --tag")
    with client_with_tasks(settings_from(ctx, tasks=task_modules(tasks))) as client:
        key = _key(client, class_name, method, args or [])
        if client.cancel_keys([key]):
            typer.echo(f"cancelled {key}")
            return
        row = client.store.get(key)
        state = "does not exist" if row is None else f"is {row.status}"
        raise KeyExpiryError(f"{key} {state}, not pending: nothing cancelled")


@app.command(cls=TaskUsage)
@known_errors
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
    when = parse_when(at, "--at")
    if dead:
        if class_name is not None:
            raise ConfigError("give CLASS METHOD [ARG]... or --dead, not both")
        after = parse_since(since)
        with client_with_tasks(settings_from(ctx, tasks=task_modules(tasks))) as client:
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
    with client_with_tasks(settings_from(ctx, tasks=task_modules(tasks))) as client:
        key = _key(client, class_name, method, args or [])
        if client.retry_keys([key], at=when):
            typer.echo(f"requeued {key}")
            return
        row = client.store.get(key)
        state = "does not exist" if row is None else f"is {row.status}, attempt {row.attempts}"
        raise KeyExpiryError(f"{key} {state}: only dead or failed-and-waiting tasks are retried")


@app.command(cls=TaskUsage)
@known_errors
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

    with client_with_tasks(settings_from(ctx, tasks=task_modules(tasks))) as client:
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
            value = local_time(round(value * 1000))
        elif name in ("result", "payload") and value is not None:
            value = json.dumps(value, ensure_ascii=False)
        # Text from outside (a handler's error, a tag, a row written by hand): control
        # characters escaped; an error's traceback keeps its lines, indented under its label,
        # so none of them can pass for a field.
        multiline = name == "last_error" and value is not None
        shown = printable_lines(value, " " * 14) if multiline else printable(str(value))
        typer.echo(f"{name:>12}: {shown}")


@app.command("list")
@known_errors
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
    store = open_store(settings_from(ctx))
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
            due = "not a time" if "due_at_ms" in row.unreadable else local_time(row.due_at_ms)
            tagged = f"  [{row.tag}]" if row.tag is not None else ""
            flagged = f"  MALFORMED: {row.problem}" if row.problem else ""
            line = f"{row.status:<9} {row.attempts:>5}  {due:<29}  {row.key}{tagged}{flagged}"
            typer.echo(printable(line))  # one line, whatever a tag or error holds
