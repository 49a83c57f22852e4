"""Task keys: escaping round-trips, limits, and refusal of anything that is not a task key."""

from __future__ import annotations

import string
from urllib.parse import quote

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from keyexpiry import Client, Settings, keys
from keyexpiry.errors import KeyFormatError
from keyexpiry.keys import (
    MAX_KEY_BYTES,
    TaskKey,
    braces_unescaped,
    expired_channel,
    format_key,
    is_sentinel,
    parse_key,
    sentinel_key,
)
from keyexpiry.ledger.rows import NewTask, TaskStatus

names = st.from_regex(r"[A-Za-z][A-Za-z0-9_]{0,20}", fullmatch=True)
args = st.lists(st.text(max_size=20), max_size=4)
prefixes = st.sampled_from(["", "app1:", "ke/"])


@given(class_name=names, method=names, arguments=args, prefix=prefixes)
def test_any_arguments_round_trip_through_a_key(
    class_name: str, method: str, arguments: list[str], prefix: str
) -> None:
    key = format_key(class_name, method, arguments, prefix=prefix)
    assert key.isascii() and " " not in key
    assert parse_key(key, prefix=prefix) == TaskKey(class_name, method, tuple(arguments))


def test_the_plain_design_keys_stay_readable() -> None:
    assert format_key("OrderTimeout", "close_unpaid", ["218"]) == "OrderTimeout@close_unpaid@218"
    assert format_key("A", "m", ["a@b", "50%", "x y", "é"]) == "A@m@a%40b@50%25@x%20y@%C3%A9"


def test_no_arguments_and_one_empty_argument_are_different_keys() -> None:
    assert parse_key("A@m").args == ()
    assert parse_key("A@m@").args == ("",)


@pytest.mark.parametrize(
    "key",
    [
        "no-separator",
        "@m@1",
        "A@@1",
        "os.path@join@1",
        "Task@__class__@1",
        "_Private@m",
        "A@_m",
        "1A@m",
        "A@m@%zz",  # bad escape
        "A@m@%ff",  # escapes to invalid UTF-8
        "A@m@a b",  # space must be escaped
        "A@m@%41",  # non-canonical: 'A' needs no escaping
        "A@m@\x00",
    ],
)
def test_malformed_keys_are_refused(key: str) -> None:
    with pytest.raises(KeyFormatError):
        parse_key(key)


def test_keys_over_the_limit_are_refused_at_create_and_parse() -> None:
    with pytest.raises(KeyFormatError, match=f"limit is {MAX_KEY_BYTES}"):
        format_key("A", "m", ["x" * MAX_KEY_BYTES])
    with pytest.raises(KeyFormatError):
        parse_key("A@m@" + "x" * MAX_KEY_BYTES)


def test_prefix_is_required_when_set() -> None:
    assert parse_key("app:A@m@1", prefix="app:") == TaskKey("A", "m", ("1",))
    with pytest.raises(KeyFormatError):
        parse_key("A@m@1", prefix="app:")


def test_sentinels_and_channels() -> None:
    assert is_sentinel(sentinel_key(3, "p:"), "p:")
    assert not is_sentinel("p:A@m", "p:")
    with pytest.raises(KeyFormatError):
        parse_key(sentinel_key(1))
    assert expired_channel(2) == "__keyevent@2__:expired"


def test_braces_are_escaped_and_keys_spelled_before_still_parse() -> None:
    key = format_key("Order", "close", ["{tenant}", "50%{"])
    assert key == "Order@close@%7Btenant%7D@50%25%7B"
    assert parse_key(key).args == ("{tenant}", "50%{")
    # A task created before braces were escaped keeps running under its old key...
    assert parse_key("Order@close@{tenant}@50%25{").args == ("{tenant}", "50%{")
    assert braces_unescaped(key) == "Order@close@{tenant}@50%25{"
    # ...but a key escaping something else needlessly is still not canonical.
    with pytest.raises(KeyFormatError, match="canonical"):
        parse_key("Order@close@%7Btenant}@%41")


def test_cancel_finds_a_task_created_before_braces_were_escaped(
    client: Client, settings: Settings
) -> None:
    old_key = "Probe@record@{legacy}"
    now_ms = client.clock.now_ms()
    # As stored before the upgrade: the arguments' braces literal in the key.
    client.store.upsert_pending(
        [NewTask(old_key, "Probe", "record", ("{legacy}",), now_ms + 60_000)], now_ms
    )
    assert client.cancel("Probe.record", "{legacy}") is True
    assert client.store.get(old_key).status is TaskStatus.CANCELLED  # type: ignore[union-attr]


# Arguments made mostly of the characters a key leaves as they are, so that both the shortcut
# (an argument that is its own escape) and quote's own path are taken, and each character that
# must be escaped alone among plain ones.
_KEPT = string.ascii_letters + string.digits + "_.-~" + keys._SAFE
_PLAIN_OR_NOT = st.one_of(
    st.text(alphabet=st.sampled_from(list(_KEPT + "@%{} é\n\x00")), max_size=12),
    st.text(max_size=40),
    st.tuples(st.text(alphabet=_KEPT, max_size=5), st.characters(), st.text(alphabet=_KEPT)).map(
        "".join
    ),
)


@example("@")
@example("a@b")
@example("100%")
@example("{tag}")
@example("x y")
@example("café")
@example("")
@given(_PLAIN_OR_NOT)
def test_an_argument_is_escaped_exactly_as_quote_escapes_it(arg: str) -> None:
    try:
        expected = quote(arg, safe=keys._SAFE, encoding="utf-8", errors="strict")
    except UnicodeEncodeError:
        expected = None
    if expected is None:
        with pytest.raises(KeyFormatError):
            keys.escape_arg(arg)
    else:
        assert keys.escape_arg(arg) == expected
        assert keys.unescape_arg(expected) == arg
