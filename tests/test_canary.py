"""The canary among many task keys: the listener's own key that must come back as an expired
event. With a million keys carrying a TTL, Redis's sweep may not reach it for many seconds, so
the lookup that sends it must be the one that expires it."""

from __future__ import annotations

import time
from pathlib import Path

from keyexpiry import Listener
from keyexpiry.clock import monotonic_s
from tests.ke import make_settings

_VOLATILE_KEYS = 200_000
_FILL = """
for i = 1, tonumber(ARGV[1]) do redis.call('SET', 'other:' .. i, '', 'PX', 3600000 + i) end
return 1
"""


def test_the_canary_expires_on_its_lookup_among_many_keys_with_a_ttl(
    redis_url: str, sqlite_url: str, tmp_path: Path
) -> None:
    listener = Listener(make_settings(redis_url, sqlite_url, tmp_path))
    try:
        redis = listener.redis
        redis.eval(_FILL, 0, _VOLATILE_KEYS)
        pubsub = redis.pubsub()
        pubsub.subscribe(f"__keyevent@{listener.rt.db}__:expired")
        assert pubsub.get_message(timeout=2) is not None  # the confirmation
        canary = listener.health.canary.encode()
        missed = 0
        for _ in range(20):
            # Sent back to back: most lookups land in the millisecond of their SET.
            listener.health._send_canary(monotonic_s())
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                msg = pubsub.get_message(timeout=0.1)
                if msg is not None and msg["data"] == canary:
                    break
            else:
                missed += 1
        pubsub.close()
        assert missed == 0, f"{missed} of 20 canaries never came back within a second"
    finally:
        listener.rt.close()
