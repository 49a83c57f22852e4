"""`python manage.py keyexpiry <command> [options]`: every `keyexpiry` CLI command (`listen`,
`list`, `show`, `cancel`, `retry`, `reconcile`, `doctor`, `schedules`, `web`, …) with the
settings settings.py gives (`KEYEXPIRY`, the ledger's `DATABASES` alias).

`listen` imports every installed app's `tasks.py` and runs the Django task functions found
there (and the task classes of `KEYEXPIRY["TASKS"]`), each run wrapped in Django's connection
hygiene (`keyexpiry.django.functions`). Django's `TIME_ZONE` sets the process's local time zone;
keyexpiry's log lines carry their UTC offset, so they stay unambiguous beside other processes'.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, ClassVar

from django.core.management.base import BaseCommand, CommandError, CommandParser

from keyexpiry.errors import KeyExpiryError


class Command(BaseCommand):
    """Run the keyexpiry CLI with settings.py's settings."""

    help = "Run a keyexpiry command (listen, list, show, cancel, retry, …) with settings.py's"
    requires_system_checks: ClassVar[list[str]] = []  # the CLI's commands check their own

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("cli_args", nargs=argparse.REMAINDER, metavar="COMMAND [ARG…]")

    def run_from_argv(self, argv: list[str]) -> None:
        # Every argument after `keyexpiry` is the CLI's (its own --help included), not Django's.
        sys.exit(run(argv[2:], prog_name=f"{os.path.basename(argv[0])} {argv[1]}"))

    def handle(self, *args: Any, **options: Any) -> None:
        code = run([*options.get("cli_args", []), *args])
        if code:
            raise CommandError(f"keyexpiry exited with status {code}", returncode=code)


def run(args: list[str], *, prog_name: str = "manage.py keyexpiry") -> int:
    """Run the keyexpiry CLI on `args`; its exit status."""
    from keyexpiry.django.discovery import discover
    from keyexpiry.django.settings import as_environ, keyexpiry_settings
    from keyexpiry.registry import default_registry

    try:
        environ = as_environ()
        if args[:1] == ["listen"] or args[:1] == ["web"]:
            discover(default_registry, keyexpiry_settings().tasks)
    except KeyExpiryError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    from keyexpiry.cli import app

    # The CLI reads its settings from KEYEXPIRY_* variables: set for the command only, and put
    # back after it, so that a `call_command` leaves no ledger URL (and its password) behind in
    # the process for whatever runs next.
    before = {name: os.environ.get(name) for name in environ}
    os.environ.update(environ)
    try:
        app(args=args, prog_name=prog_name, standalone_mode=True)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return 0
