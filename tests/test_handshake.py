"""A connection whose health check falls due in the middle of its handshake still connects,
against a real redis-server (`keyexpiry.redis.handshake`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import redis

from keyexpiry.redis.handshake import handshake_options
from keyexpiry.runtime import redis_options
from tests.conftest import RedisFactory
from tests.ke import make_settings

CONNECTS = 50


def _connect_failures(url: str, options: dict[str, Any]) -> list[str]:
    """Fresh connections, each asked to PING; what went wrong with each that failed."""
    failures = []
    for _ in range(CONNECTS):
        client = redis.Redis.from_url(url, **options)
        try:
            client.ping()
        except redis.RedisError as exc:
            failures.append(f"{type(exc).__name__}: {exc}")
        finally:
            client.close()
    return failures


def test_a_health_check_due_during_the_handshake_reads_no_other_commands_reply(
    redis_factory: RedisFactory, sqlite_url: str, tmp_path: Path
) -> None:
    url = redis_factory().url()
    # A check due at every send stands for a thread held up a whole interval mid-connect (a
    # loaded machine, a 1 s interval: a listener's subscription failed so in CI).
    options = redis_options(url, make_settings(url, sqlite_url, tmp_path))
    options["health_check_interval"] = 1e-6
    assert _connect_failures(url, options) == []
    # The same without keyexpiry's handshake options fails every connect on redis-py 8 (its
    # PING reads CLIENT MAINT_NOTIFICATIONS' or SETINFO's reply): the test measures the case.
    if handshake_options():
        bare = {k: v for k, v in options.items() if k not in handshake_options()}
        assert len(_connect_failures(url, bare)) == CONNECTS
