"""What every command module of the `keyexpiry` command shares: the error-to-exit-code mapping,
settings from the global options, task modules, clients and runtimes for one command, and the
time formats the commands read and print.

Light on purpose: `keyexpiry --help` imports this and every command module, so anything heavy
(the client, the ledger, Redis) is imported inside the function that needs it."""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import importlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import typer
from typer.core import TyperArgument, TyperCommand

from keyexpiry.errors import ConfigError, KeyExpiryError
from keyexpiry.masking import redact
from keyexpiry.settings import Settings

if TYPE_CHECKING:
    from keyexpiry.runtime import Runtime

F = TypeVar("F", bound=Callable[..., Any])


class TaskUsage(TyperCommand):
    """Usage `CLASS METHOD [ARG]...` for every command that names a task, bracketed whole where
    an option (`--tag`, `--dead`) may stand in for it: one form, not typer's `{CLASS} {method}`
    beside `[CLASS] [METHOD]`."""

    def collect_usage_pieces(self, ctx: object) -> list[str]:
        task = "CLASS METHOD [ARG]..."
        named = [p for p in self.params if isinstance(p, TyperArgument) and p.nargs == 1]
        required = all(p.required for p in named)
        return [self.options_metavar or "[OPTIONS]", task if required else f"[{task}]"]


TasksOpt = typer.Option(
    None, "--tasks", envvar="KEYEXPIRY_TASKS", help="Comma-separated modules that register tasks."
)


def known_errors(func: F) -> F:
    """Known errors become one line on stderr and exit code 1, never a traceback."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except KeyExpiryError as exc:
            fail(kwargs.get("ctx"), str(exc))
        except Exception as exc:
            import redis

            from keyexpiry.redis.server import describe_redis_error

            if not isinstance(exc, redis.RedisError):
                raise
            fail(kwargs.get("ctx"), describe_redis_error(exc))

    return wrapper  # type: ignore[return-value]


def fail(ctx: typer.Context | None, message: str) -> NoReturn:
    """`error: message` on stderr, exit 1; a credential of the URLs in use never shows, even
    when a driver's message quotes the piece of a URL it failed on."""
    typer.echo(f"error: {redact_urls(ctx, message)}", err=True)
    raise typer.Exit(code=1) from None


def redact_urls(ctx: typer.Context | None, text: str) -> str:
    """`text` with the credentials of the Redis and database URLs in use (flag or env) cut."""
    obj = (ctx.obj if ctx is not None else None) or {}
    urls = [obj.get(name) for name in ("redis_url", "database_url")]
    urls += [os.environ.get(f"KEYEXPIRY_{name}") for name in ("REDIS_URL", "DATABASE_URL")]
    return redact(text, *urls)


def settings_from(ctx: typer.Context, **flags: Any) -> Settings:
    """Settings from the global options (kept in `ctx.obj`), a command's flags and the env."""
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


def task_modules(value: str | None) -> tuple[str, ...] | None:
    """`--tasks a, b` as module names; None (not given) leaves the settings' own."""
    if value is None:
        return None
    return tuple(p.strip() for p in value.split(",") if p.strip())


@contextlib.contextmanager
def opened_runtime(settings: Settings) -> Iterator[Runtime]:
    """Connections for a one-off command, closed afterwards."""
    from keyexpiry.runtime import Runtime

    rt = Runtime.open(settings)
    try:
        yield rt
    finally:
        rt.close()


def client_with_tasks(settings: Settings) -> Any:
    """A client with the task modules loaded: arguments are typed through the registry."""
    from keyexpiry.client import Client

    load_task_modules(settings.tasks)
    return Client(settings)


def plain_client(settings: Settings) -> Any:
    """A client without the task modules: a command that names tasks only by name needs none
    (nor a module that cannot be imported on this host)."""
    from keyexpiry.client import Client

    return Client(settings)


def local_time(ms: int) -> str:
    """`ms` as local ISO 8601 time to the millisecond with its UTC offset, the one format every
    command prints (`2025-01-02T03:04:05.678+00:00`); any stored value prints, even out of range."""
    try:
        return dt.datetime.fromtimestamp(ms / 1000).astimezone().isoformat("T", "milliseconds")
    except (ValueError, OverflowError, OSError):
        return f"{ms} ms (not a date)"


def parse_when(value: str | None, flag: str) -> dt.datetime | None:
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


def parse_since(value: str | None) -> dt.datetime | None:
    """`--since`: an ISO 8601 time, or an age such as 30m, 12h, 7d (`prune --older-than` too)."""
    if value is None:
        return None
    text = value.strip()
    if text[:-1].isdigit() and text[-1:] in _UNITS_S:
        age_s = int(text[:-1]) * _UNITS_S[text[-1]]
        if age_s > 100 * 365 * 86400:
            raise ConfigError(f"--since {value!r} is more than 100 years")
        return dt.datetime.now(dt.UTC) - dt.timedelta(seconds=age_s)
    return parse_when(text, "--since")
