"""Flow control from the command line: pause and resume a task class or method fleet-wide, list
the pauses in force."""

from __future__ import annotations

import json

import typer

from keyexpiry.cli.common import known_errors, local_time, parse_when, plain_client, settings_from
from keyexpiry.errors import ConfigError

app = typer.Typer()


@app.command()
@known_errors
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
    when = parse_when(until, "--until")
    for_s = None if for_ is None else parse_duration(for_)
    with plain_client(settings_from(ctx)) as client:
        done = client.pause(target, until=when, for_s=for_s, reason=reason)
    end = "until resumed" if done.until_ms is None else f"until {local_time(done.until_ms)}"
    why = f" ({done.reason})" if done.reason else ""
    typer.echo(printable(f"paused {done.target} {end}{why}"))


@app.command()
@known_errors
def resume(
    ctx: typer.Context,
    target: str = typer.Argument(..., metavar="CLASS[.METHOD]"),
) -> None:
    """End the pause of a task class or method (exit 0 either way; says whether it was
    paused). Resuming a class leaves the pauses of its methods."""
    from keyexpiry.flow.pauses import parse_target

    name = parse_target(target)
    with plain_client(settings_from(ctx)) as client:
        was_paused = client.resume(name)
    typer.echo(f"resumed {name}" if was_paused else f"{name} was not paused")


@app.command()
@known_errors
def paused(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="One JSON object per line."),
) -> None:
    """The pauses in force: target, since, until, reason; malformed pause rows counted."""
    from keyexpiry.keys import clip
    from keyexpiry.printable import printable

    with plain_client(settings_from(ctx)) as client:
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
            end = "until resumed" if p.until_ms is None else local_time(p.until_ms)
            since = local_time(p.paused_at_ms)
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
