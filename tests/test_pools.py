"""Idle Redis connections a burst opened are closed once they stay unused (a real Redis)."""

from __future__ import annotations

import redis

from keyexpiry.redis.pools import IdleTrimmer, pools_of
from tests.conftest import RedisFactory
from tests.ke import live_connections


def test_connections_a_burst_opened_are_closed_once_unused_and_the_pool_still_works(
    redis_factory: RedisFactory,
) -> None:
    client = redis.Redis.from_url(redis_factory().url())
    pool = client.connection_pool
    try:
        # A recovery: six threads reconnect at once, and the pool keeps six connections.
        burst = [pool.get_connection() for _ in range(6)]
        for conn in burst:
            conn.send_command("PING")
            conn.read_response()
        for conn in burst:
            pool.release(conn)
        assert live_connections(pool) == 6
        trimmer = IdleTrimmer(lambda: pools_of(client), every_s=60)
        assert trimmer.tick(0.0) == 0
        held = pool.get_connection()  # one in use at the next sample: the working set
        assert trimmer.tick(30.0) == 0
        pool.release(held)
        # Idle at every sample: 5 of the 6 (one was in use at 30 s: the working set is kept).
        assert trimmer.tick(61.0) == 5
        assert live_connections(pool) == 1
        assert client.ping()
        # A pool in steady use loses nothing.
        assert trimmer.tick(62.0) == 0 and trimmer.tick(130.0) == 0
        assert live_connections(pool) == 1
    finally:
        client.close()
