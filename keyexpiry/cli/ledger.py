"""The ledger's upkeep: create or upgrade its tables, reconcile it with Redis, prune finished
rows."""

from __future__ import annotations

import datetime as dt
import sys

import typer

from keyexpiry.cli.common import known_errors, opened_runtime, parse_since, settings_from
from keyexpiry.errors import ConfigError

app = typer.Typer()


@app.command("init-db")
@known_errors
def init_db(ctx: typer.Context) -> None:
    """Create the ledger's tables, or bring an older ledger up to date (idempotent): add what it
    lacks, and drop the indexes this version no longer uses. Run it once every listener runs
    this version."""
    from keyexpiry.runtime import open_store

    store = open_store(settings_from(ctx))
    try:
        # Builds every missing index, however big the table (online on MySQL/MariaDB), and only
        # then drops the retired ones (an older listener still running may read through them).
        store.create_schema(all_indexes=True)
    finally:
        store.engine.dispose()
    typer.echo("time_limit_task, keyexpiry_listener, keyexpiry_pause and keyexpiry_schedule ready")


@app.command()
@known_errors
def reconcile(
    ctx: typer.Context,
    dry_run: bool = typer.Option(False, "--dry-run", help="Report, change nothing."),
) -> None:
    """Re-arm keys Redis lost and requeue runs whose listener died."""
    from keyexpiry.listener.reconcile import Reconciler

    settings = settings_from(ctx)
    with opened_runtime(settings) as rt:
        store = rt.store
        store.create_schema()
        reconciler = Reconciler.of(rt)
        with typer.progressbar(length=max(store.count_pending(), 1), label="reconciling") as bar:
            done = [0]

            def progress(n: int, _total: int) -> None:
                bar.update(n - done[0])
                done[0] = n

            report = reconciler.run(dry_run=dry_run, progress=progress)
    typer.echo(("would have: " if dry_run else "") + str(report))


@app.command()
@known_errors
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

    settings = settings_from(ctx)
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
        cutoff = parse_since(older_than)
        assert cutoff is not None
        age_s = max(0.0, (dt.datetime.now(dt.UTC) - cutoff).total_seconds())
        retain = dict.fromkeys(retain, age_s or 0.001)
    with opened_runtime(settings) as rt:
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
    typer.echo(f"deleted {report.total} row(s): {report}")
