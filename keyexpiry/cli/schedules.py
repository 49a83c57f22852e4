"""Recurring schedules from the command line: `schedules` lists them, `schedule pause|resume|
remove|run-now NAME` operates one."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import typer

from keyexpiry.cli.common import known_errors, local_time, plain_client, settings_from
from keyexpiry.errors import KeyExpiryError

if TYPE_CHECKING:
    from keyexpiry.client import Client
    from keyexpiry.ledger.recurring import ScheduleRow

app = typer.Typer()


def _schedule_task(s: ScheduleRow) -> str:
    """`Class.method(arg, …)` of a schedule's task, its arguments as canonical text."""
    return f"{s.class_name}.{s.method}({', '.join(s.args)})"


def _schedule_state(s: ScheduleRow) -> str:
    return "paused" if s.paused else "ended" if s.occurrence_ms is None else "active"


def _last_run(s: ScheduleRow) -> str:
    """How the last run went and when; and when it last succeeded, if that was earlier."""
    if s.last_status is None or s.last_finished_ms is None:
        return "never run"
    text = f"{s.last_status} {local_time(s.last_finished_ms)}"
    if s.last_status != "done":
        ok = "never" if s.last_success_ms is None else local_time(s.last_success_ms)
        text += f" (last success: {ok})"
    return text


@app.command("schedules")
@known_errors
def list_schedules(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="One JSON object per line."),
) -> None:
    """The recurring schedules: name, state (active, paused, ended), task, when it runs, next
    run and last run."""
    from keyexpiry.printable import printable
    from keyexpiry.schedules.operate import live_classes, unregistered, unregistered_note

    with plain_client(settings_from(ctx)) as client:
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
        nxt = local_time(s.occurrence_ms) if state == "active" else "-"
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
@known_errors
def schedule_pause(ctx: typer.Context, name: str = typer.Argument(..., metavar="NAME")) -> None:
    """Stop a schedule (its pending occurrence cancelled) until `schedule resume`; what it
    misses meanwhile then follows its catch_up."""
    from keyexpiry.printable import printable

    with plain_client(settings_from(ctx)) as client:
        if _schedule_named(client, name).paused:
            typer.echo(printable(f"schedule {name} was already paused"))
            return
        if not client.pause_schedule(name):
            _schedule_named(client, name)  # removed meanwhile: says so
    typer.echo(printable(f"paused schedule {name} (`keyexpiry schedule resume {name}` to go on)"))


@schedule_app.command("resume")
@known_errors
def schedule_resume(ctx: typer.Context, name: str = typer.Argument(..., metavar="NAME")) -> None:
    """Resume a paused schedule (exit 0 if it was not paused); an occurrence it missed runs
    now, as its catch_up says."""
    from keyexpiry.printable import printable

    with plain_client(settings_from(ctx)) as client:
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
        nxt = f"next run {local_time(after.occurrence_ms)}"
    typer.echo(printable(f"resumed schedule {name}: {nxt}"))


def _catching_up(s: ScheduleRow, now_ms: int) -> str:
    """What a resumed schedule whose occurrence is due does now, by its catch_up."""
    from keyexpiry.schedules.rules import plan_run

    assert s.occurrence_ms is not None
    rec = s.recurrence
    plan = plan_run(rec, s.occurrence_ms, now_ms, s.anchor_ms, s.catch_up, s.catch_up_max)
    if not plan.missed:
        return f"the run due {local_time(s.occurrence_ms)} runs now"
    missed = f"runs missed since {local_time(s.occurrence_ms)}"
    if not plan.run:  # catch_up="none"
        nxt = rec.after(now_ms, s.anchor_ms)
        then = "it has ended" if nxt is None else f"next run {local_time(nxt)}"
        return f"{missed}, skipped (catch_up=none); {then}"
    if s.catch_up == "latest":
        return f"{missed}: one run now, for the latest ({local_time(plan.scheduled_for_ms)})"
    return (
        f"{missed}: each runs now in turn (catch_up=all, the last {s.catch_up_max} at most), "
        f"from {local_time(plan.scheduled_for_ms)}"
    )


@schedule_app.command("remove")
@known_errors
def schedule_remove(ctx: typer.Context, name: str = typer.Argument(..., metavar="NAME")) -> None:
    """Delete a schedule and cancel its pending occurrence (a running one finishes)."""
    from keyexpiry.printable import printable

    with plain_client(settings_from(ctx)) as client:
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
@known_errors
def schedule_run_now(ctx: typer.Context, name: str = typer.Argument(..., metavar="NAME")) -> None:
    """Run a schedule's pending occurrence now, as an extra run: the regular occurrences
    follow as before. Exit 1 when nothing can start (running, paused or ended)."""
    from keyexpiry.ledger.rows import TaskStatus
    from keyexpiry.printable import printable

    with plain_client(settings_from(ctx)) as client:
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
