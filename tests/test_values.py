"""Every value that enters keyexpiry is refused at the door with one line, or kept exactly.

Property-based (Hypothesis): arbitrary floats, Decimals, huge ints, odd datetimes and strings
thrown at argument encoding, due times, retry schedules, `@exposed` options and settings. Each
either raises a KeyExpiryError subclass with a one-line message naming the field, or yields a
value the listener can run with exactly what was given; equal values always give equal keys.
Pure logic: the encoding is what `create`/`cancel` and the listener use (real-server cases are
in test_hostile.py).
"""

from __future__ import annotations

import datetime as dt
import json
import math
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from keyexpiry import exposed
from keyexpiry.creates import due_at_ms
from keyexpiry.errors import ArgumentError, ConfigError, KeyExpiryError
from keyexpiry.keys import format_key
from keyexpiry.ledger.rows import args_json
from keyexpiry.limits import MAX_DELAY_S, MAX_HORIZON_S
from keyexpiry.registry import Registry, TaskSpec
from keyexpiry.settings import Settings

NOW_MS = 1_700_000_000_000
LINE_LIMIT = 400


def _spec() -> TaskSpec:
    reg = Registry()

    @reg.register
    class Typed:
        @exposed
        def run(self, n: int, price: Decimal, ratio: float, flag: bool, day: dt.date) -> None: ...

    return reg.resolve("Typed", "run")


SPEC = _spec()
KIND = ("int", "Decimal", "float", "bool", "date")

anything = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.decimals(allow_nan=True, allow_infinity=True),
    st.integers(),
    st.integers(min_value=-(10**2000), max_value=10**2000),
    st.booleans(),
    st.text(max_size=40),
    st.sampled_from(["5", "5.0", "+5", "-0", "1e3", "NaN", "inf", "1_000", "0x10", " 7 ", "9.90"]),
    st.datetimes(timezones=st.none() | st.timezones()),
    st.dates(),
    st.none(),
)


def _one_line(exc: BaseException) -> None:
    assert isinstance(exc, KeyExpiryError), repr(exc)
    text = str(exc)
    assert "\n" not in text and 0 < len(text) < LINE_LIMIT, text[:200]


def _same_value(given: Any, got: Any, kind: str) -> bool:
    """What the handler receives equals what was given, as the annotation reads it."""
    if isinstance(given, str):
        return True  # parsed text: checked by the round trip below
    if kind == "float":
        return isinstance(got, float) and got == given
    if kind in ("int", "Decimal"):
        return got == given and type(got).__name__ == kind
    return bool(got == given)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(position=st.integers(0, 4), value=anything)
def test_any_argument_is_refused_in_one_line_or_runs_with_exactly_its_value(
    position: int, value: Any
) -> None:
    args: list[Any] = [1, Decimal(1), 1.0, True, dt.date(2026, 1, 1)]
    args[position] = value
    try:
        encoded = SPEC.encode_args(args)
        format_key(SPEC.class_name, SPEC.method, encoded)
    except KeyExpiryError as exc:
        _one_line(exc)
        return
    decoded = SPEC.decode_args(encoded)
    assert _same_value(value, decoded[position], KIND[position]), (value, decoded[position])
    # The listener decodes what create encoded, and encoding that again changes nothing.
    assert SPEC.encode_args(decoded) == encoded
    if isinstance(decoded[position], float | Decimal):
        assert math.isfinite(decoded[position])


@given(n=st.integers(-(10**15), 10**15))
def test_equal_numbers_give_equal_keys(n: int) -> None:
    base = [1, Decimal(1), 1.0, True, dt.date(2026, 1, 1)]

    def key(pos: int, value: object) -> tuple[str, ...]:
        args = list(base)
        args[pos] = value
        return SPEC.encode_args(args)

    spellings_int = [n, float(n), str(n), Decimal(n), Decimal(n).scaleb(0) * Decimal("1.00")]
    if abs(n) <= 2**53:
        assert len({key(0, v) for v in spellings_int}) == 1
        assert len({key(2, v) for v in (n, float(n), str(n), f"{n}.0")}) == 1
    assert len({key(1, v) for v in (n, Decimal(n), str(n), f"{n}.000", Decimal(f"{n}.0"))}) == 1


@given(d=st.decimals(allow_nan=False, allow_infinity=False, places=4))
def test_decimals_equal_in_value_share_a_key(d: Decimal) -> None:
    base: list[Any] = [1, d, 1.0, True, dt.date(2026, 1, 1)]
    padded: list[Any] = [1, Decimal(f"{d:f}0"), 1.0, True, dt.date(2026, 1, 1)]
    try:
        first = SPEC.encode_args(base)
    except ArgumentError as exc:  # too many digits for a key
        _one_line(exc)
        return
    assert first == SPEC.encode_args(padded)
    assert SPEC.decode_args(first)[1] == d


@settings(max_examples=300, deadline=None)
@given(
    field=st.sampled_from(["ttl_s", "ttl_ms", "at"]),
    value=st.one_of(
        st.floats(),
        st.integers(min_value=-(10**30), max_value=10**30),
        st.decimals(),
        st.datetimes(timezones=st.none() | st.timezones()),
        st.text(max_size=10),
        st.booleans(),
    ),
)
def test_any_due_time_is_refused_in_one_line_or_is_within_the_horizon(
    field: str, value: Any
) -> None:
    try:
        due = due_at_ms(NOW_MS, **{field: value})
    except KeyExpiryError as exc:
        _one_line(exc)
        return
    assert isinstance(due, int)
    assert 0 <= due <= NOW_MS + MAX_HORIZON_S * 1000
    # Every due time accepted prints as a date (`keyexpiry list` never fails on it).
    dt.datetime.fromtimestamp(due / 1000, dt.UTC)


@settings(max_examples=200, deadline=None)
@given(schedule=st.lists(st.floats() | st.integers(-(10**20), 10**20) | st.text(max_size=5)))
def test_any_retry_schedule_is_refused_in_one_line_or_is_finite_and_bounded(
    schedule: list[Any],
) -> None:
    for build in (
        lambda: exposed(retry_schedule_s=schedule),
        lambda: Settings(retry_schedule_s=tuple(schedule)),
    ):
        try:
            build()
        except ConfigError as exc:
            _one_line(exc)
            assert "retry_schedule_s" in str(exc)
            continue
    try:
        exposed(retry_schedule_s=schedule)
    except ConfigError:
        return
    # Accepted: then every delay really is a finite number of seconds in range.
    assert all(0 <= float(v) <= MAX_DELAY_S for v in schedule)


NUMERIC_ENV = [
    "CONCURRENCY",
    "HANDLER_TIMEOUT_S",
    "LEASE_GRACE_S",
    "RETRY_SCHEDULE_S",
    "SENTINEL_INTERVAL_S",
    "HEALTH_CHECK_INTERVAL_S",
    "CANARY_INTERVAL_S",
    "LEASE_CHECK_S",
    "DRIVER_WINDOW_S",
    "CLAIM_BATCH",
]


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(NUMERIC_ENV),
    raw=st.one_of(
        st.sampled_from(["nan", "inf", "-inf", "1e300", "-1", "0", "1e-9", "1,nan", "99" * 30]),
        st.floats().map(repr),
        st.integers().map(str),
        st.text(max_size=12),
    ),
)
def test_any_numeric_setting_is_refused_in_one_line_or_is_finite(name: str, raw: str) -> None:
    try:
        s = Settings.from_env({f"KEYEXPIRY_{name}": raw})
    except ConfigError as exc:
        _one_line(exc)
        return
    value = getattr(s, name.lower())
    values = value if isinstance(value, tuple) else (value,)
    assert all(math.isfinite(v) and v >= 0 for v in values), value


@pytest.mark.parametrize(
    "options, field",
    [
        ({"timeout_s": float("nan")}, "timeout_s"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": 1e300}, "timeout_s"),
        ({"retry_schedule_s": [float("nan")]}, "retry_schedule_s[0]"),
        ({"retry_schedule_s": [1, 1e300]}, "retry_schedule_s[1]"),
        ({"retry_schedule_s": [-1]}, "retry_schedule_s[0]"),
        ({"retry_schedule_s": "15"}, "retry_schedule_s"),
    ],
)
def test_exposed_refuses_bad_options_at_import(options: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace("[", r"\[")) as caught:
        exposed(**options)
    _one_line(caught.value)


def test_an_empty_retry_schedule_means_no_retries_everywhere() -> None:
    from keyexpiry import retries
    from keyexpiry.registry import ExposeOptions

    s = Settings()
    assert retries.max_attempts((), ExposeOptions(retry_schedule_s=(5,)), s) == 1
    assert retries.max_attempts(None, ExposeOptions(retry_schedule_s=()), s) == 1
    assert retries.max_attempts(None, ExposeOptions(), s.replace(retry_schedule_s=())) == 1
    assert retries.max_attempts(None, ExposeOptions(), s) == 1 + len(s.retry_schedule_s)


@example(())
@example(("218",))
@example(('say "hi"', "back\\slash", "tab\t", "é", "\u2028"))
@given(
    st.lists(st.text(max_size=12) | st.sampled_from(["218", "a b", "x\ny", '"', "é"])).map(tuple)
)
def test_args_are_written_as_the_json_encoder_writes_them(args: tuple[str, ...]) -> None:
    # The `args` column: a shortcut for plain strings must write what json writes.
    assert args_json(args) == json.dumps(list(args), ensure_ascii=False)
    assert json.loads(args_json(args)) == list(args)
