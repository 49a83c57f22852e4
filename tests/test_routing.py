"""What one expired or evicted key is to a listener: classified without Redis, a ledger or I/O."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from keyexpiry.keys import MAX_KEY_BYTES, canary_key, format_key, sentinel_key
from keyexpiry.listener.routing import KeyShapes, Route, as_bytes

OWNER = "host:1:abcdef"


def shapes(prefix: str = "") -> KeyShapes:
    """The shapes of a listener that has the task class `Order` registered."""
    return KeyShapes.of(prefix, canary_key(OWNER, prefix), {"Order"}.__contains__)


LONG = b"Order@ship@" + b"x" * MAX_KEY_BYTES


@pytest.mark.parametrize(
    ("prefix", "data", "route"),
    [
        # Without a prefix only a registered class, or a well-formed key, is ours.
        ("", format_key("Order", "ship", ["42"]).encode(), Route.TASK),
        ("", b"Elsewhere@run@1", Route.TASK),  # another listener's class: the claimer decides
        ("", b"Order@not a method", Route.TASK),  # ours: the claimer refuses it, once
        ("", b"session:abc", Route.FOREIGN),
        ("", b"Other@\xff", Route.FOREIGN),
        ("", b"Order@\xff", Route.REFUSED),
        ("", LONG, Route.REFUSED),
        ("", b"Other" + LONG, Route.FOREIGN),
        ("", canary_key(OWNER).encode(), Route.CANARY),
        ("", canary_key("elsewhere:2:123456").encode(), Route.INTERNAL),
        ("", sentinel_key(3).encode(), Route.SENTINEL),
        ("", b"#keyexpiry#driver", Route.INTERNAL),
        # Under a prefix everything inside it is ours, the rest foreign.
        ("app:", b"app:Order@ship@42", Route.TASK),
        ("app:", b"app:garbage", Route.TASK),
        ("app:", b"Order@ship@42", Route.FOREIGN),
        ("app:", b"app:\xff", Route.REFUSED),
        ("app:", b"app:" + LONG, Route.REFUSED),
        ("app:", canary_key(OWNER, "app:").encode(), Route.CANARY),
        ("app:", canary_key(OWNER).encode(), Route.FOREIGN),
        ("app:", sentinel_key(1, "app:").encode(), Route.SENTINEL),
    ],
)
def test_an_expired_key_is_classified(prefix: str, data: bytes, route: Route) -> None:
    verdict = shapes(prefix).expired(data)
    assert verdict.route is route
    assert verdict.key == (data.decode() if route is Route.TASK else "")
    assert bool(verdict.reason) == (route is Route.REFUSED)


@pytest.mark.parametrize(
    ("prefix", "data", "route"),
    [
        ("", format_key("Order", "ship", ["42"]).encode(), Route.TASK),
        ("", b"Elsewhere@run@1", Route.TASK),
        # The application's own keys are evicted too: never refused, never logged.
        ("", b"Order@not a method", Route.FOREIGN),
        ("", b"session:abc", Route.FOREIGN),
        ("", b"Order@\xff", Route.FOREIGN),
        ("", LONG, Route.FOREIGN),
        ("", canary_key(OWNER).encode(), Route.CANARY),
        ("", sentinel_key(1).encode(), Route.INTERNAL),
        ("app:", b"app:Order@ship@42", Route.TASK),
        ("app:", b"app:garbage", Route.FOREIGN),
        ("app:", b"Order@ship@42", Route.FOREIGN),
        ("app:", canary_key(OWNER, "app:").encode(), Route.CANARY),
    ],
)
def test_an_evicted_key_is_classified(prefix: str, data: bytes, route: Route) -> None:
    verdict = shapes(prefix).evicted(data)
    assert verdict.route is route
    assert verdict.key == (data.decode() if route is Route.TASK else "")


@given(data=st.binary(max_size=2 * MAX_KEY_BYTES), prefix=st.sampled_from(["", "app:"]))
def test_no_key_reaches_the_claimer_undecodable_or_over_the_limit(data: bytes, prefix: str) -> None:
    for verdict in (shapes(prefix).expired(data), shapes(prefix).evicted(data)):
        if verdict.route is Route.TASK:
            assert len(data) <= MAX_KEY_BYTES
            assert verdict.key.encode() == data


def test_a_str_payload_is_read_as_the_bytes_redis_would_send() -> None:
    assert as_bytes("Order@ship@42") == b"Order@ship@42"
    assert as_bytes("\udcff") == b"\xff"  # surrogate-escaped bytes survive as bytes
    assert as_bytes(b"\xff") == b"\xff"
