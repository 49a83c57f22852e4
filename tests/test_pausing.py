"""Pausing task classes and methods (the ledger's side and the API's; the listener holding paused
tasks back is tested with the listener): names, durations, the pause table on every engine,
`Client`/`AsyncClient` pause, resume and paused, and the wake message a pause publishes."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import math
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.cluster import key_slot
from sqlalchemy import text
from typer.testing import CliRunner

from keyexpiry import Client, Settings
from keyexpiry.aio import AsyncClient
from keyexpiry.bench.servers import wait_until
from keyexpiry.bench.servers.cluster import LocalCluster
from keyexpiry.cli import app
from keyexpiry.errors import ArgumentError, UnknownTaskError
from keyexpiry.flow.pauses import (
    PAUSE_WAKE,
    Pause,
    check_reason,
    is_paused,
    parse_duration,
    parse_target,
    target_matches,
)
from keyexpiry.keys import wake_channel
from keyexpiry.ledger.store import Store, make_engine
from keyexpiry.redis.arming import parse_wake
from keyexpiry.redis.permits import held_key
from tests import sample_tasks
from tests.ke import make_settings

Probe = sample_tasks.Probe


# --- names, durations, reasons (no servers) ---------------------------------------------------


@pytest.mark.parametrize(
    ("text", "target"),
    [
        ("OrderTimeout", "OrderTimeout"),
        ("OrderTimeout.close_unpaid", "OrderTimeout.close_unpaid"),
        ("  A1.b_2 ", "A1.b_2"),
        ("C" * 128 + "." + "m" * 128, "C" * 128 + "." + "m" * 128),
    ],
)
def test_a_target_is_a_class_or_class_dot_method(text: str, target: str) -> None:
    assert parse_target(text) == target


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "class name ''"),
        ("1Order", "class name '1Order'"),
        ("_Private", "class name '_Private'"),
        ("Order.", "method name ''"),
        ("Order.close.now", "method name 'close.now'"),
        ("Order@close", "class name 'Order@close'"),
        ("Ordér", "class name"),
        ("C" * 129, "longer than 128"),
        ("Order." + "m" * 129, "longer than 128"),
    ],
)
def test_a_bad_target_is_an_argument_error_naming_it(text: str, message: str) -> None:
    with pytest.raises(ArgumentError, match="cannot pause") as err:
        parse_target(text)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_class_pause_holds_every_method_a_method_pause_only_its_own() -> None:
    assert target_matches("Orders", "Orders", "close")
    assert target_matches("Orders.close", "Orders", "close")
    assert not target_matches("Orders.close", "Orders", "open")
    assert not target_matches("Order", "Orders", "close")  # no prefix matching
    assert not target_matches("Orders.clos", "Orders", "close")
    whole = Pause("Orders", 5_000, 1_000, None)
    method = Pause("Orders.close", None, 1_000, "psp down")
    other = Pause("Refunds", None, 1_000, None)
    assert is_paused([other], "Orders", "close", 2_000) is None
    assert is_paused([whole, other], "Orders", "open", 2_000) == whole
    # Both hold it: the one that lasts longer says when it may run.
    assert is_paused([whole, method], "Orders", "close", 2_000) == method
    longer = Pause("Orders.close", 9_000, 0)
    assert is_paused([whole, longer], "Orders", "close", 0) == longer
    # An ended pause holds nothing, even in a list read before it ended.
    assert is_paused([whole], "Orders", "open", 5_000) is None
    assert is_paused([whole], "Orders", "open", 4_999) == whole


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90s", 90),
        ("30m", 1800),
        ("2h", 7200),
        ("1d", 86_400),
        ("1w", 604_800),
        ("1h30m", 5400),
        ("1d2h3m4s", 93_784),
        ("1.5h", 5400),
        (" 2H ", 7200),
        ("0.5s", 0.5),
    ],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "not understood"),
        ("30", "not understood"),
        ("m", "not understood"),
        ("30x", "not understood"),
        ("-5m", "not understood"),
        ("30m1h", "not understood"),  # largest unit first
        ("1h1h", "not understood"),  # each unit once
        ("1e3s", "not understood"),
        ("nan", "not understood"),
        ("0s", "above 0"),
        ("0h0m", "above 0"),
        ("6000w", "above 0 to 3153600000"),  # beyond 100 years
    ],
)
def test_a_bad_duration_is_an_argument_error(text: str, message: str) -> None:
    with pytest.raises(ArgumentError, match=message):
        parse_duration(text)


def test_a_reason_is_one_line_of_at_most_255_characters() -> None:
    assert check_reason(None) is None and check_reason("  ") is None
    assert check_reason(" psp down 🎈 ") == "psp down 🎈"
    assert check_reason("x" * 255) == "x" * 255
    for bad, message in (
        ("x" * 256, "256 characters"),
        ("two\nlines", "control characters"),
        ("nul\x00", "control characters"),
        ("\ud800", "not valid text"),
    ):
        with pytest.raises(ArgumentError, match=message):
            check_reason(bad)


def test_the_pause_wake_line_is_no_task_for_an_older_listener() -> None:
    assert PAUSE_WAKE == "#keyexpiry#pause"
    assert list(parse_wake(PAUSE_WAKE)) == []


# --- the pause table, on every engine -----------------------------------------------------------


def test_pause_repause_resume_in_the_ledger(store: Store) -> None:
    assert store.pauses(1_000) == []
    store.pause("Orders.close", until_ms=None, now_ms=1_000, reason="psp down")
    store.pause("Orders", until_ms=9_000, now_ms=1_500)
    store.pause("Alpha", until_ms=None, now_ms=1_600)
    assert store.pauses(2_000) == [
        Pause("Alpha", None, 1_600, None),
        Pause("Orders", 9_000, 1_500, None),
        Pause("Orders.close", None, 1_000, "psp down"),
    ]
    # Pausing again replaces until, time and reason; a reason left out is gone.
    store.pause("Orders.close", until_ms=7_000, now_ms=3_000, reason="maintenance 🎈")
    store.pause("Orders", until_ms=None, now_ms=3_000)
    by_target = {p.target: p for p in store.pauses(3_000)}
    assert by_target["Orders.close"] == Pause("Orders.close", 7_000, 3_000, "maintenance 🎈")
    assert by_target["Orders"] == Pause("Orders", None, 3_000, None)
    # Resuming a class leaves its methods' pauses.
    assert store.resume("Orders") is True
    assert store.resume("Orders") is False
    assert [p.target for p in store.pauses(3_000)] == ["Alpha", "Orders.close"]
    assert store.resume("Nobody.paused") is False


def test_targets_are_case_sensitive_on_every_engine(store: Store) -> None:
    store.pause("Orders", until_ms=None, now_ms=1)
    store.pause("orders", until_ms=None, now_ms=2)
    store.pause("ORDERS", until_ms=None, now_ms=3)
    assert [p.target for p in store.pauses(10)] == ["ORDERS", "Orders", "orders"]  # bytes order
    assert store.resume("orders") is True
    assert [p.target for p in store.pauses(10)] == ["ORDERS", "Orders"]


def test_a_pause_ends_at_its_until_and_its_row_goes(store: Store) -> None:
    store.pause("Orders", until_ms=5_000, now_ms=1_000, reason="short")
    store.pause("Refunds", until_ms=None, now_ms=1_000)
    assert [p.target for p in store.pauses(4_999)] == ["Orders", "Refunds"]
    assert [p.target for p in store.pauses(5_000)] == ["Refunds"]  # until is exclusive
    # The ended pause was deleted by that read: even a resume that asks no time finds nothing.
    assert store.resume("Orders") is False
    # An ended pause resumed is "not paused", and its row goes too.
    store.pause("Orders", until_ms=6_000, now_ms=5_500)
    assert store.resume("Orders", now_ms=6_000) is False
    assert store.resume("Orders") is False
    store.pause("Orders", until_ms=6_000, now_ms=5_500)
    assert store.resume("Orders", now_ms=5_999) is True


def test_the_read_that_deletes_an_ended_pause_keeps_a_new_one(store: Store) -> None:
    # A pause renewed between a listener's read and its delete: the delete is guarded by until.
    store.pause("Orders", until_ms=5_000, now_ms=1_000)
    assert store.pauses(4_000)[0].until_ms == 5_000
    store.pause("Orders", until_ms=20_000, now_ms=6_000)
    assert store.pauses(6_000) == [Pause("Orders", 20_000, 6_000, None)]


# --- Client and AsyncClient ---------------------------------------------------------------------


def _subscribed(client: Client) -> Any:
    """A pub/sub connection on `client`'s wake channel, its subscription confirmed."""
    pubsub = client.redis.pubsub(ignore_subscribe_messages=False)
    pubsub.subscribe(wake_channel(client.rt.db, client.settings.key_prefix))
    wait_until(
        lambda: (m := pubsub.get_message(timeout=0.1)) is not None and m["type"] == "subscribe",
        5,
        message="no subscribe confirmation",
    )
    return pubsub


def _next_message(pubsub: Any, timeout_s: float = 5.0) -> str:
    got: list[str] = []

    def arrived() -> bool:
        msg = pubsub.get_message(timeout=0.1)
        if msg is not None and msg["type"] in ("message", "smessage"):
            data = msg["data"]
            got.append(data.decode() if isinstance(data, bytes) else str(data))
        return bool(got)

    wait_until(arrived, timeout_s, message="no wake message")
    return got[0]


def test_client_pause_resume_and_paused(client: Client) -> None:
    pubsub = _subscribed(client)
    try:
        before = client.clock.now_ms()
        pause = client.pause("Probe.record", reason="  checking the PSP  ")
        assert _next_message(pubsub) == PAUSE_WAKE  # listeners re-read the pauses at once
        assert pause.target == "Probe.record" and pause.until_ms is None
        assert pause.reason == "checking the PSP" and before <= pause.paused_at_ms
        assert client.paused() == [pause]

        # The exposed method or the class itself name the same targets.
        again = client.pause(Probe.record, for_s=30)
        assert again.target == "Probe.record" and again.until_ms is not None
        assert again.until_ms - again.paused_at_ms == 30_000 and again.reason is None
        assert _next_message(pubsub) == PAUSE_WAKE
        whole = client.pause(Probe, until=dt.datetime.now(dt.UTC) + dt.timedelta(hours=2))
        assert whole.target == "Probe" and whole.until_ms is not None
        # `until` is on this host's clock, `paused_at` on Redis's (extrapolated): a few ms apart.
        assert 7_190_000 < whole.until_ms - whole.paused_at_ms <= 7_200_050
        _next_message(pubsub)
        assert [p.target for p in client.paused()] == ["Probe", "Probe.record"]

        assert client.resume(Probe.record) is True
        assert _next_message(pubsub) == PAUSE_WAKE
        assert client.resume("Probe.record") is False
        assert client.resume(Probe) is True
        assert client.paused() == []
    finally:
        pubsub.close()


def test_a_class_this_process_does_not_know_may_be_paused(client: Client) -> None:
    # A producer does not import the handlers: a valid name is enough.
    assert client.registry.has_class("Probe") and not client.registry.has_class("Elsewhere")
    assert client.pause("Elsewhere.run", for_s=60).target == "Elsewhere.run"
    assert client.resume("Elsewhere.run") is True


def test_pause_arguments_are_checked(client: Client) -> None:
    now = dt.datetime.now(dt.UTC)
    bad: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({"target": "Probe.record", "until": now + dt.timedelta(hours=1), "for_s": 5},
         ArgumentError, "at most one of until and for_s"),
        ({"target": "Probe.record", "until": now - dt.timedelta(seconds=1)},
         ArgumentError, "not in the future"),
        ({"target": "Probe.record", "until": dt.datetime(1960, 1, 1, tzinfo=dt.UTC)},
         ArgumentError, "not in the future"),
        ({"target": "Probe.record", "until": dt.datetime(2300, 1, 1, tzinfo=dt.UTC)},
         ArgumentError, "more than 100 years away"),
        ({"target": "Probe.record", "until": dt.datetime(2099, 1, 1)},
         ArgumentError, "timezone-aware"),
        ({"target": "Probe.record", "until": "tomorrow"}, ArgumentError, "must be a datetime"),
        ({"target": "Probe.record", "for_s": 0}, ArgumentError, "for_s must be above 0"),
        ({"target": "Probe.record", "for_s": -1}, ArgumentError, "for_s must be above 0"),
        ({"target": "Probe.record", "for_s": math.nan}, ArgumentError, "for_s must be above 0"),
        ({"target": "Probe.record", "for_s": True}, ArgumentError, "must be a number"),
        ({"target": "Probe.record", "for_s": "30m"}, ArgumentError, "must be a number"),
        ({"target": "Probe.record", "reason": "r" * 256}, ArgumentError, "at most 255"),
        ({"target": "Probe.record", "reason": "a\nb"}, ArgumentError, "control characters"),
        ({"target": "Probe.record.x"}, ArgumentError, "cannot pause"),
        ({"target": "os.system; drop"}, ArgumentError, "cannot pause"),
        ({"target": 42}, ArgumentError, "got int"),
        ({"target": Path}, UnknownTaskError, "not a registered task class"),
        ({"target": Probe.not_exposed}, UnknownTaskError, "not an exposed method"),
    ]  # fmt: skip
    for kwargs, error, message in bad:
        with pytest.raises(error, match=message):
            client.pause(**kwargs)
    with pytest.raises(ArgumentError, match="cannot pause"):
        client.resume("not a name")
    assert client.paused() == []  # nothing was written by any of them


def test_a_lost_wake_message_does_not_fail_the_pause(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    def down(*_args: object) -> None:
        raise redis.ConnectionError("Redis went away")

    monkeypatch.setattr("keyexpiry.client.announce", down)
    # The row is the truth: listeners read it at their next poll.
    assert client.pause("Probe").target == "Probe"
    assert [p.target for p in client.paused()] == ["Probe"]
    assert client.resume("Probe") is True


def test_the_wake_channel_follows_the_key_prefix(
    redis_url: str, sqlite_url: str, tmp_path: Path
) -> None:
    with Client(make_settings(redis_url, sqlite_url, tmp_path, key_prefix="shop:")) as client:
        pubsub = _subscribed(client)
        try:
            assert client.pause("Orders").target == "Orders"  # the prefix is not in the target
            assert _next_message(pubsub) == PAUSE_WAKE
        finally:
            pubsub.close()


def test_held_sums_what_live_listeners_publish(client: Client) -> None:
    assert client.held() == {}
    now = client.clock.now_ms()
    stale_ms = int(max(3 * client.settings.heartbeat_s, client.settings.takeover_after_s) * 1000)
    key = held_key(client.settings.key_prefix)
    entries = {
        "a": {"at_ms": now, "held": {"Probe.record": {"paused": 3, "limit": 1}}},
        "b": {"at_ms": now - 100, "held": {"Probe.record": {"paused": 2}, "Other.x": {"rate": 4}}},
        "dead": {"at_ms": now - stale_ms - 1_000, "held": {"Probe.record": {"paused": 50}}},
    }
    client.redis.hset(key, mapping={k: json.dumps(v) for k, v in entries.items()})
    client.redis.hset(key, "junk", "not json")
    assert client.held() == {
        "Probe.record": {"paused": 5, "limit": 1},
        "Other.x": {"rate": 4},
    }


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_async_client_pauses_resumes_and_lists(settings: Settings) -> None:
    async def scenario() -> None:
        async with AsyncClient(settings) as ke:
            pause = await ke.pause("Probe.record", for_s=60, reason="async")
            assert (await ke.paused()) == [pause]
            assert (await ke.read_pauses()).pauses == [pause]
            assert await ke.held() == {}
            with pytest.raises(ArgumentError, match="not in the future"):
                await ke.pause("Probe", until=dt.datetime(2000, 1, 1, tzinfo=dt.UTC))
            assert await ke.resume("Probe.record") is True
            assert await ke.paused() == []

    asyncio.run(scenario())


def test_a_pause_on_a_cluster_is_published_sharded(
    cluster_url: str, sqlite_url: str, tmp_path: Path, redis_cluster: LocalCluster
) -> None:
    with Client(make_settings(cluster_url, sqlite_url, tmp_path)) as client:
        channel = wake_channel(0, client.settings.key_prefix)
        # SPUBLISH reaches the subscribers of the primary that serves the channel's slot.
        node = redis_cluster.owner_of(key_slot(channel.encode())).client()
        pubsub = node.pubsub()
        try:
            pubsub.ssubscribe(channel)
            wait_until(
                lambda: (
                    (m := pubsub.get_message(timeout=0.1)) is not None and m["type"] == "ssubscribe"
                ),
                5,
                message="no ssubscribe confirmation",
            )
            client.pause("Orders.close", for_s=60)
            assert _next_message(pubsub) == PAUSE_WAKE
            assert client.resume("Orders.close") is True
            assert _next_message(pubsub) == PAUSE_WAKE
        finally:
            pubsub.close()
            node.close()


# --- malformed pause rows (written by hand or by another program) -------------------------------
def _hand_made_pause_table(store: Store) -> None:
    """The pause table as a hand-made one may be: paused_at_ms without its NOT NULL."""
    with store.engine.begin() as conn:
        if store.engine.dialect.name == "sqlite":  # no ALTER COLUMN: made again, by hand
            conn.execute(text("DROP TABLE keyexpiry_pause"))
            conn.execute(
                text(
                    "CREATE TABLE keyexpiry_pause (target VARCHAR(257) PRIMARY KEY, "
                    "until_ms BIGINT, paused_at_ms BIGINT, reason VARCHAR(255))"
                )
            )
        elif store.engine.dialect.name == "postgresql":
            conn.execute(
                text("ALTER TABLE keyexpiry_pause ALTER COLUMN paused_at_ms DROP NOT NULL")
            )
        else:
            conn.execute(text("ALTER TABLE keyexpiry_pause MODIFY paused_at_ms BIGINT NULL"))


def _insert_pause_rows(store: Store, rows: list[str]) -> None:
    with store.engine.begin() as conn:
        for values in rows:
            columns = "target, until_ms, paused_at_ms, reason"
            conn.execute(text(f"INSERT INTO keyexpiry_pause ({columns}) VALUES {values}"))


BAD_PAUSE_ROWS = {
    # target: (the row's values, what its problem says)
    "Bad Target": ("('Bad Target', NULL, 1000, NULL)", "is no 'Class' or 'Class.method'"),
    "Orders.close.now": ("('Orders.close.now', NULL, 1000, NULL)", "is no 'Class'"),
    " Padded": ("(' Padded', NULL, 1000, NULL)", "is no 'Class'"),
    "NoTime": ("('NoTime', NULL, NULL, NULL)", "its paused_at_ms column holds NULL, not a number"),
}
SQLITE_ONLY_BAD_PAUSE_ROWS = {
    # SQLite keeps whatever is written, whatever the column's type.
    "Text": ("('Text', 'abc', 1000, NULL)", "its until_ms column holds str 'abc', not a number"),
    "Forever": ("('Forever', 9e999, 1000, NULL)", "its until_ms column holds float 'inf'"),
    "Blob": ("('Blob', NULL, X'00', NULL)", "its paused_at_ms column holds bytes"),
    "Reason": ("('Reason', NULL, 1000, X'ff')", "its reason column holds bytes"),
}


def test_a_malformed_pause_row_is_skipped_and_every_other_pause_stands(store: Store) -> None:
    _hand_made_pause_table(store)
    bad = dict(BAD_PAUSE_ROWS)
    if store.engine.dialect.name == "sqlite":
        bad |= SQLITE_ONLY_BAD_PAUSE_ROWS
    store.pause("Good", until_ms=None, now_ms=1_000, reason="sound")
    store.pause("Later.run", until_ms=2**63 - 1, now_ms=1_000)  # far, but a time all the same
    _insert_pause_rows(store, [values for values, _ in bad.values()])
    sound = [Pause("Good", None, 1_000, "sound"), Pause("Later.run", 2**63 - 1, 1_000, None)]
    assert store.pauses(2_000) == sound
    read = store.read_pauses(2_000)
    assert read.pauses == sound
    problems = {m.target: m.problem for m in read.malformed}
    assert sorted(problems) == sorted(bad)
    for target, (_, says) in bad.items():
        assert says in problems[target] and "\n" not in problems[target], (target, problems)
    # Left as they are (for whoever reads them to see), read again the same.
    assert store.read_pauses(3_000).malformed == read.malformed
    # A sound pause that ends is still deleted beside them.
    store.pause("Short", until_ms=4_000, now_ms=3_000)
    assert [p.target for p in store.pauses(3_500)] == ["Good", "Later.run", "Short"]
    assert [p.target for p in store.pauses(4_000)] == ["Good", "Later.run"]


def test_paused_lists_the_sound_pauses_and_says_how_many_rows_it_skipped(
    cli_env: dict[str, str], sqlite_url: str
) -> None:
    runner = CliRunner()
    assert runner.invoke(app, ["pause", "Probe.record"], env=cli_env).exit_code == 0
    store = Store(make_engine(sqlite_url))
    try:
        _insert_pause_rows(
            store,
            ["('Text', 'abc', 1000, NULL)", "('Forever', 9e999, 1000, NULL)",
             "('Evil\x1b[2J', NULL, 1000, NULL)"],
        )  # fmt: skip
    finally:
        store.engine.dispose()
    result = runner.invoke(app, ["paused"], env=cli_env)
    assert result.exit_code == 0, result.output
    assert result.exception is None
    lines = result.stdout.splitlines()
    assert lines[0].startswith("TARGET") and len(lines) == 2 and lines[1].startswith("Probe.record")
    assert "3 malformed pause row(s) skipped" in result.stderr
    assert "'Text': its until_ms column holds str 'abc'" in result.stderr
    assert "\x1b" not in result.stderr  # a forged target reaches no terminal raw
    result = runner.invoke(app, ["paused", "--json"], env=cli_env)
    assert result.exit_code == 0
    assert [json.loads(line)["target"] for line in result.stdout.splitlines()] == ["Probe.record"]
    assert "3 malformed pause row(s) skipped" in result.stderr
