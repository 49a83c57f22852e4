"""Setting task keys in Redis so they expire at their due time, and announcing those due soon."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol, cast

import redis
from redis.cluster import RedisCluster

from keyexpiry.keys import MAX_KEY_BYTES, wake_channel
from keyexpiry.redis.cluster import by_node

_WAKE_ENTRIES_PER_MESSAGE = 1000
WAKE_MAX_BYTES = _WAKE_ENTRIES_PER_MESSAGE * (MAX_KEY_BYTES + 24)
"""No wake message keyexpiry sends is longer (1,000 lines of a due time and a key)."""
# Below this many future keys plain SETs are cheaper than a script (whose load check costs a
# round trip); above it one script call per chunk replaces a command and a reply per key.
_SCRIPT_MIN_KEYS = 64
_PAST_MS = 1
"""The expiry time of a key armed already due: long past on any server's clock."""
_SCRIPT_CHUNK = 1000
# The due times travel as one space-separated argument: redis-py packs each argument in Python,
# and one string instead of a thousand numbers makes arming a bulk create ~25% faster here.
_ARM_SCRIPT = """
local i = 0
for due in string.gmatch(ARGV[1], '%d+') do
  i = i + 1
  redis.call('SET', KEYS[i], '', 'PXAT', due)
end
return i
"""
# The same for keys found missing: one set meanwhile (a reschedule) is left as it is.
_ARM_MISSING_SCRIPT = _ARM_SCRIPT.replace("'PXAT', due)", "'PXAT', due, 'NX')")


class ArmingSettings(Protocol):
    """What arming reads of the settings (`keyexpiry.Settings` has it)."""

    @property
    def wake_ahead_s(self) -> float: ...
    @property
    def key_prefix(self) -> str: ...


def arm_keys(
    client: redis.Redis,
    items: Sequence[tuple[str, int]],
    now_ms: int,
    settings: ArmingSettings,
    *,
    missing: bool = False,
) -> None:
    """In one pipeline: `SET key "" PXAT due_ms` for each (key, due_ms), a lookup for keys
    already due, and a wake message for the driver listing those due within `wake_ahead_s`.

    `PXAT` makes Redis expire the key at exactly the ledger's due time (on Redis's clock). A due
    time already past still produces `expired` (never `del`, as an EXPIRE in the past would); the
    lookup makes Redis notice at once rather than at its next sweep.

    `missing`: the keys were found missing; one that is there now was set meanwhile by whoever
    changed its row (a reschedule), and is left as it is (`SET … NX`).
    """
    if not items:
        return
    horizon = now_ms + int(settings.wake_ahead_s * 1000)
    one = len(items) == 1
    if one and _arm_one(client, *items[0], now_ms, horizon, settings.key_prefix, missing):
        return
    pipe = client.pipeline(transaction=False)
    soon: list[str] = []
    future = [(k, d) for k, d in items if d > now_ms]
    cluster = isinstance(client, RedisCluster)
    bulk = len(future) >= _SCRIPT_MIN_KEYS
    if cluster and bulk:
        # A script over many keys is cross-slot on a cluster: one plain pipeline per primary.
        _set_per_node(cast(RedisCluster, client), future, missing)
    scripted = bulk and not cluster
    for key, due_ms in items:
        if due_ms <= now_ms:
            # Already due: a plain SET, then a lookup right behind it so Redis expires it now.
            # Its expiry time is the epoch's first millisecond, not the due time: Redis expires
            # a key only once its clock is *past* that time, and a task due this very
            # millisecond (ttl 0), or a creator's clock a hair ahead of Redis's, would leave the
            # lookup finding it alive, to wait up to 100 ms for Redis's sweep (measured: run-now
            # tasks p50 40 ms, p99 105 ms after their create).
            pipe.set(key, b"", pxat=_PAST_MS, nx=missing)
            pipe.exists(key)
        else:
            if not bulk:
                pipe.set(key, b"", pxat=due_ms, nx=missing)
            if due_ms <= horizon:
                soon.append(f"{due_ms} {key}")
    if scripted:
        script = client.register_script(_ARM_MISSING_SCRIPT if missing else _ARM_SCRIPT)
        for start in range(0, len(future), _SCRIPT_CHUNK):
            chunk = future[start : start + _SCRIPT_CHUNK]
            dues = " ".join([str(int(d)) for _, d in chunk])
            script(keys=[k for k, _ in chunk], args=[dues], client=pipe)
    channel = wake_channel(redis_db(client), settings.key_prefix)
    for start in range(0, len(soon), _WAKE_ENTRIES_PER_MESSAGE):
        message = "\n".join(soon[start : start + _WAKE_ENTRIES_PER_MESSAGE])
        if cluster:
            # Sharded: PUBLISH would be copied over the cluster bus to every node.
            pipe.spublish(channel, message)
        else:
            pipe.publish(channel, message)
    pipe.execute()


def _arm_one(
    client: redis.Redis | RedisCluster,
    key: str,
    due_ms: int,
    now_ms: int,
    horizon_ms: int,
    prefix: str,
    missing: bool = False,
) -> bool:
    """One key (a single create, typically), as `arm_keys` arms it, its commands sent straight
    on a pooled connection: redis-py's command and pipeline paths (argument decorators,
    observability, the retry wrapper) cost more CPU than the round trip itself, and a single
    create is bound by CPU. Returns False, having sent nothing that matters, when the ordinary
    path must do it: a cluster or single-connection client, or anything unexpected (an error
    reply, a dropped connection), whose retries and errors are then redis-py's (the commands
    are idempotent; a wake message sent twice costs the driver one lookup)."""
    if isinstance(client, RedisCluster) or client.connection is not None:
        return False
    nx: tuple[str, ...] = ("NX",) if missing else ()
    if due_ms <= now_ms:
        commands: list[tuple[object, ...]] = [
            ("SET", key, b"", "PXAT", _PAST_MS, *nx),
            ("EXISTS", key),
        ]
    elif due_ms <= horizon_ms:
        channel = wake_channel(redis_db(client), prefix)
        commands = [
            ("SET", key, b"", "PXAT", due_ms, *nx),
            ("PUBLISH", channel, f"{due_ms} {key}"),
        ]
    else:
        commands = [("SET", key, b"", "PXAT", due_ms, *nx)]
    pool = client.connection_pool
    try:
        conn = pool.get_connection()
    except redis.RedisError:
        return False
    try:
        conn.send_packed_command(conn.pack_commands(commands))  # type: ignore[no-untyped-call]
        for _ in commands:
            conn.read_response()
        return True
    except redis.RedisError:
        # An error reply or a cut connection: nothing of it may stay on a pooled one.
        conn.disconnect()  # type: ignore[no-untyped-call]
        return False
    except BaseException:
        # Interrupted between the commands and their replies: the replies must not be read by
        # the connection's next user.
        conn.disconnect()  # type: ignore[no-untyped-call]
        raise
    finally:
        pool.release(conn)


def _set_per_node(
    client: RedisCluster, items: Sequence[tuple[str, int]], missing: bool = False
) -> None:
    """`SET key "" PXAT due` for many keys of a cluster: one plain pipeline per primary (a
    cluster pipeline took ~1.6x as long for 10k SETs, measured). A slot that moved meanwhile
    (MOVED, ASK) or a node that failed over sends the lot again through the cluster pipeline,
    which follows redirections (the SETs are idempotent)."""
    try:
        for node, positions in by_node(client, [key for key, _ in items]):
            pipe = node.pipeline(transaction=False)
            for i in positions:
                pipe.set(items[i][0], b"", pxat=items[i][1], nx=missing)
            pipe.execute()
    except redis.RedisError:
        pipe = client.pipeline(transaction=False)  # type: ignore[no-untyped-call]
        for key, due_ms in items:
            pipe.set(key, b"", pxat=due_ms, nx=missing)
        pipe.execute()


def redis_db(client: redis.Redis) -> int:
    """The database number the client uses (for the keyevent and wake channel names); a
    cluster client has no pool of its own and only database 0."""
    pool = getattr(client, "connection_pool", None)
    return 0 if pool is None else int(pool.connection_kwargs.get("db", 0) or 0)


def parse_wake(payload: bytes | str) -> Iterator[tuple[str, int]]:
    """(key, due_ms) pairs from a wake message; malformed lines are skipped, and so is a
    message longer than WAKE_MAX_BYTES (not ours: never decoded or split)."""
    if len(payload) > WAKE_MAX_BYTES:
        return
    # Task keys are ASCII (arguments are percent-escaped): anything else is not one of ours.
    text = payload.decode("ascii", "replace") if isinstance(payload, bytes) else payload
    for line in text.split("\n"):
        due, _, key = line.partition(" ")
        if key and len(key) <= MAX_KEY_BYTES and due.isascii() and due.isdigit():
            yield key, int(due)
