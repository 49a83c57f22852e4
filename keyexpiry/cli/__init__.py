"""The `keyexpiry` command: parse options, build settings, call one library function.

This module builds the typer app: the global options, `--version`, and the command groups in
the order `--help` lists them. Each group is a module of its own, thin over the library:
`operations` (listen, web, listeners, doctor, demo, embedded), `tasks` (create, cancel, retry,
show, list), `flow` (pause, resume, paused), `schedules` (schedules, schedule …), `ledger`
(init-db, reconcile, prune) and `bench`; `common` holds what they share (the error-to-exit-code
mapping among it). Every module here is imported by `keyexpiry --help`, so each imports the heavy
parts (the client, the ledger, Redis, the web) inside the command that uses them."""

from __future__ import annotations

import inspect
from pathlib import Path

import typer

from keyexpiry.cli import bench, flow, ledger, operations, schedules, tasks
from keyexpiry.cli.common import load_task_modules
from keyexpiry.errors import ConfigError
from keyexpiry.log import configure_logging

__all__ = ["app", "load_task_modules", "main"]

app = typer.Typer(
    help="Delayed tasks on Redis keyspace notifications, with a SQL ledger.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
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
    # What every command's settings start from (`common.settings_from`).
    ctx.obj = {
        "redis_url": redis_url,
        "database_url": database_url,
        "state_dir": state_dir,
        "key_prefix": key_prefix,
        "log_level": log_level,
    }


# Added without a name, a group's commands join the top level: `--help` lists them group by
# group, in this order (a group's sub-commands, `schedule …` and `embedded …`, after its own).
app.add_typer(operations.app)
app.add_typer(tasks.app)
app.add_typer(flow.app)
app.add_typer(schedules.app)
app.add_typer(ledger.app)
app.add_typer(bench.app)


def _one_line_help(typers: list[typer.Typer]) -> None:
    # Typer shows a docstring's hard line wraps in the command list: each command's summary
    # (its first paragraph) as one line, wrapped to the terminal by typer itself.
    for t in typers:
        for info in t.registered_commands:
            doc = inspect.getdoc(info.callback) if info.callback is not None else None
            if info.short_help is None and doc:
                info.short_help = " ".join(doc.split("\n\n")[0].split())
        groups = [g.typer_instance for g in t.registered_groups if g.typer_instance is not None]
        _one_line_help(groups)


_one_line_help([app])


def main() -> None:
    """Console entry point."""
    app()
