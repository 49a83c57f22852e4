"""The expiry driver: make Redis announce each task key at its due time, not whenever it notices.

Redis publishes `expired` only when it deletes a key: on a lookup, or in a background sweep that
samples about 20 keys per tick. Among many keys with far-away TTLs a due key can wait minutes.
The driver keeps a window of upcoming (key, due) pairs read from the ledger's (status, due_at_ms,
…) index, sleeps until the next due time, and looks the due keys up (PTTL), which makes Redis expire
them and publish `expired` on the spot. The event stays the one dispatch path.

Lookups come in passes at most one tick apart: a key due alone is looked up the millisecond after
its due time (Redis expires a key once its clock is *past* the key's time: looked up in its due
millisecond, it is still there), keys falling due while a pass was recent wait for the next tick
and go together. A key a lookup found still alive (this clock a hair ahead of Redis's) is looked
up again when Redis expires it, tick or no tick: it has waited its turn already. Every expiry
sets off a chain of work (an event to read, a claim transaction, an outcome to record); keys that
expire in the same instant share it, so a busy listener pays it once per tick rather than once
per key.

Tasks created after a window was read arrive through the wake channel (creators publish tasks due
soon). Anyone who may PUBLISH can write there too, so what it says is kept apart from what the
ledger says, each bounded by `driver_max_rows`: forged entries cost lookups of keys that are not
there, never the place of a due row read from the ledger. When more wake entries come than fit
(a forged flood, or a burst larger than the window), they are dropped, and the window is read
from the ledger again instead (at most once a second): no real task is dropped unseen.
One listener at a time drives, elected by a Redis lock, so lookups are not multiplied.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Iterable
from typing import Any, cast

import redis
from loguru import logger
from redis import Redis
from redis.cluster import RedisCluster
from redis.commands.core import Script

from keyexpiry.clock import Clock, monotonic_s
from keyexpiry.errors import StoreError
from keyexpiry.keys import driver_lock_key
from keyexpiry.ledger.store import Store
from keyexpiry.log import Tally
from keyexpiry.redis.cluster import by_node
from keyexpiry.settings import Settings
from keyexpiry.threads import ThreadErrors, spawn

# A key still alive this close to its due time is looked up again at its real expiry time;
# beyond it the task was rescheduled (the wake channel or the next read brings the new time).
_RECHECK_MS = 50
_LOOKUP_BATCH = 1000
TICK_MS = 4
"""The default shortest time between two lookup passes (`Settings.driver_tick_ms`): the most a
busy stream of keys waits past its due time for the driver, traded for keys looked up, announced
and claimed together."""
LEASE_MS = 2000
"""How long the driver's lock outlives its last renewal: a driver that dies (kill -9, a frozen
process, a lookup held by a paused node) is replaced within this and `STANDBY_RETRY_S`. It was
5 s: the Cluster soak's kill -9 of the driver left every listener's tasks due in the next 4 s
up to 4 s late (announced by Redis's own sweep, or by the next driver)."""
_RENEW_EVERY_MS = LEASE_MS // 5
"""The driver renews its lock at least this often (its longest sleep)."""
STANDBY_RETRY_S = 0.5
"""How often a listener that does not drive tries to take the lock."""
OVERFLOW_REREAD_S = 1.0
"""After wake entries were dropped (more than `driver_max_rows` waiting), the window is read
from the ledger again, at most this often: the real ones among them are late by this much at
most, and a flood of forged wakes costs a window read a second."""
_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('pexpire', KEYS[1], ARGV[2])
end
return redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) and 1 or 0
"""
# One command for a whole pass, where a pipeline costs the client a command to pack and a reply to
# parse per key. A key past its due time is expired (and announced) by its lookup in the script
# as by a plain PTTL. The keys come as KEYS on one node; on a Redis Cluster node as ARGV: a
# script's declared keys must share one slot (CROSSSLOT otherwise), but a script without a
# shebang may look up keys of any slot its node serves, so `_pttl_by_node` sends one call to each
# primary before reading any reply. A key its node does not serve (a slot moved since the
# client's map was read) fails that call ("non local key"); the pass then goes through the
# cluster pipeline, which follows it.
_LOOK_UP = """
local keys = #KEYS > 0 and KEYS or ARGV
local out = {}
for i = 1, #keys do
  out[i] = redis.call('pttl', keys[i])
end
return out
"""


class ExpiryDriver:
    """Looks due keys up at their due time; bounded to `driver_max_rows` upcoming entries."""

    def __init__(
        self,
        *,
        store: Store,
        redis: Redis,
        clock: Clock,
        settings: Settings,
        owner: str,
        on_cluster: bool = False,
    ) -> None:
        """`redis` is the commands client (a `RedisCluster` behind it when `on_cluster`): the
        lock, the lookups and the ledger window read from `store`, all on `clock`'s time."""
        self.store, self.redis, self.clock = store, redis, clock
        self.settings, self.owner = settings, owner
        self._on_cluster = on_cluster
        self.lookups = 0
        self.forced = 0
        self.passes = 0
        """Lookup passes made (`lookups / passes` keys per pass)."""
        self.is_leader = False
        self._heap: list[tuple[int, str]] = []
        """Upcoming (due, key) read from the ledger."""
        self._recheck: list[tuple[int, str]] = []
        """(when, key) a lookup found alive a hair before Redis expires it: looked up again at
        that time, not held for the next tick."""
        self._woken: list[tuple[int, str]] = []
        """(due, key) announced on the wake channel (which anyone may write): kept apart, so a
        forged entry never takes the place of a row read from the ledger."""
        self._overflowed = False
        """Wake entries were dropped since the window was last read (set by `note`)."""
        self._overflow_read_s = -OVERFLOW_REREAD_S
        self.wakes_dropped = 0
        """Wake messages dropped (all or part) because `driver_max_rows` entries waited."""
        self._dropped_said = Tally(60.0)
        self._dropped_seen = 0
        self._lock = threading.Lock()
        self._horizon_ms = 0
        self._reading_upto_ms = 0
        """While a window read runs, the end of the window it reads (0 otherwise): see `note`."""
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._errors = ThreadErrors()
        self._renew = self.redis.register_script(_RENEW)
        self._pttls = self.redis.register_script(_LOOK_UP)
        self._node_pttls: dict[str, Script] = {}
        """`_LOOK_UP` registered on each Cluster primary's client, by node name."""
        self._lock_key = driver_lock_key(settings.key_prefix)
        self._lease_checked_ms = 0
        self._reread = False
        """Set by `reread` (another thread): the next step reads the whole window again."""
        self._tick_ms = settings.driver_tick_ms
        self._last_pass_ms = -self._tick_ms

    def start(self, errors: ThreadErrors | None = None) -> None:
        """Run the driver on its own thread; unexpected exceptions are counted in `errors`."""
        self._errors = errors or ThreadErrors()
        self._thread = spawn("driver", self._loop, stopped=self._stop, errors=self._errors)

    def stop(self) -> None:
        """Stop and give up the lock so another listener takes over at once."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.is_leader:
            try:
                if self.redis.get(self._lock_key) == self.owner.encode():
                    self.redis.delete(self._lock_key)
            except redis.RedisError:
                pass

    def note(self, items: Iterable[tuple[str, int]]) -> None:
        """Tasks announced on the wake channel: track those inside the current window. Past
        `driver_max_rows` of them, the rest is dropped unread (`items` may be lazy: the
        subscription's reader must keep up with a flood) and the window read again."""
        if not self.is_leader:
            return
        added = dropped = 0
        max_rows = self.settings.driver_max_rows
        woken = self._woken
        with self._lock:
            # A row committed after a running read took its snapshot is in neither that read nor
            # the next (which starts at the new horizon): its wake is its only way in. Found by
            # the soak: tasks created as a new driver took over waited up to 25 s.
            horizon_ms = max(self._horizon_ms, self._reading_upto_ms)
            for key, due_ms in items:
                if len(woken) >= max_rows:
                    dropped = 1
                    break
                # Beyond the horizon the next window read finds it; inside, only this note does.
                if due_ms <= horizon_ms:
                    heapq.heappush(woken, (due_ms, key))
                    added += 1
            if dropped:
                self._overflowed = True
        if dropped:
            self.wakes_dropped += 1  # messages, not entries: the rest is never parsed
        if added or dropped:
            self._wake.set()

    def reread(self) -> None:
        """Read the whole window again at the next step: wakes published while this listener
        was not subscribed (a dropped connection, a failover) were lost, and the tasks they
        announced are inside the window already read, where only a wake would have put them
        (found by the soak: such tasks waited up to 25 s for Redis's own sweep)."""
        self._reread = True
        self._wake.set()

    def pending_count(self) -> int:
        """Entries waiting in the window (for status and the benchmark)."""
        with self._lock:
            return len(self._heap) + len(self._woken) + len(self._recheck)

    # --- loop ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        backoff_s = self.settings.reconnect_initial_s
        while not self._stop.is_set():
            try:
                timeout_s = self._step()
                backoff_s = self.settings.reconnect_initial_s
            except (redis.RedisError, StoreError, OSError) as exc:
                # A replica refusing the lock's write is reported once, by the listener.
                log = logger.debug if isinstance(exc, redis.ReadOnlyError) else logger.warning
                log("expiry driver: {}; retrying in {:.1f} s", exc, backoff_s)
                timeout_s = backoff_s
                backoff_s = min(backoff_s * 2, self.settings.reconnect_max_s)
            except Exception:
                self._errors.add("driver")
                logger.exception("expiry driver failed; retrying")
                timeout_s = backoff_s
            self._wake.wait(timeout_s)
            self._wake.clear()

    def _step(self) -> float:
        """One pass: keep the lock, read the window, look due keys up; return seconds to sleep."""
        now_ms = self.clock.now_ms()
        if not self._hold_lock(now_ms):
            return STANDBY_RETRY_S
        window_ms = int(self.settings.driver_window_s * 1000)
        overflow_in_s = self._after_overflow()
        if self._reread:
            self._reread = False
            with self._lock:
                self._heap.clear()
                # A little in the past, as a new driver starts: what fell due in the gap too.
                self._horizon_ms = min(self._horizon_ms, now_ms - 5000)
        if self._horizon_ms - now_ms < window_ms // 2:
            self._read_window(now_ms, window_ms)
            # A read as long as the lease (a loaded ledger) may have let a peer take the lock:
            # renewed before any lookup, or two drivers would look the same keys up.
            now_ms = self.clock.now_ms()
            if not self._hold_lock(now_ms):
                return STANDBY_RETRY_S
        tick_ms = self._tick_ms
        next_pass = self._last_pass_ms + tick_ms
        due: list[tuple[int, str]] = []
        with self._lock:
            # A key is looked up once Redis has expired it: past its due millisecond.
            recheck = self._recheck
            while recheck and recheck[0][0] <= now_ms:
                due.append(heapq.heappop(recheck))
            next_due = self._next_due()
            # Before the tick is over a due key waits for the keys falling due with it.
            if next_due is not None and next_due < now_ms and now_ms >= next_pass:
                for heap in (self._heap, self._woken):
                    while heap and heap[0][0] < now_ms:
                        due.append(heapq.heappop(heap))
                next_pass = now_ms + tick_ms
                self._last_pass_ms = now_ms
                next_due = self._next_due()
        if due:
            self._look_up(due, now_ms)
            now_ms = self.clock.now_ms()
        with self._lock:  # the lookups may have put a key back (alive a hair longer)
            next_due = self._next_due()
            next_recheck = recheck[0][0] if recheck else None
        next_read = self._horizon_ms - window_ms // 2
        if overflow_in_s is not None:
            next_read = min(next_read, now_ms + int(overflow_in_s * 1000))
        wake_at = next_read if next_due is None else min(max(next_due + 1, next_pass), next_read)
        if next_recheck is not None:
            wake_at = min(wake_at, next_recheck)
        # Renew the lock in time; never sleep past the next due time (or tick).
        return max(0.0, min((wake_at - now_ms) / 1000.0, _RENEW_EVERY_MS / 1000.0))

    def _next_due(self) -> int | None:
        """The earliest due time waiting, of either source, rechecks aside (under `_lock`)."""
        heap, woken = self._heap, self._woken
        if heap and woken:
            return min(heap[0][0], woken[0][0])
        return heap[0][0] if heap else woken[0][0] if woken else None

    def _after_overflow(self) -> float | None:
        """Wake entries were dropped: forget the wake entries, forged ones with them, and read
        the window from the ledger again (`_reread`), where the real ones are, at most once per
        `OVERFLOW_REREAD_S`. Returns the seconds until that may happen when it may not yet
        (None: nothing to do)."""
        now_s = monotonic_s()
        if n := self._dropped_said.unsaid(now_s):
            logger.warning(
                "expiry driver: {} more wake message(s) dropped in the last minute (the window "
                "read from the ledger instead)",
                n,
            )
        if not self._overflowed:
            return None
        wait_s = self._overflow_read_s + OVERFLOW_REREAD_S - now_s
        if wait_s > 0:
            return wait_s
        self._overflow_read_s = now_s
        with self._lock:
            self._overflowed = False
            self._woken.clear()
        self._reread = True
        dropped, self._dropped_seen = self.wakes_dropped - self._dropped_seen, self.wakes_dropped
        if self._dropped_said.add(dropped, now_s):
            logger.warning(
                "expiry driver: more than driver_max_rows ({}) wake entries waiting (a burst, "
                "or messages forged on the wake channel): dropped, and the window read from "
                "the ledger instead",
                self.settings.driver_max_rows,
            )
        return None

    def _hold_lock(self, now_ms: int) -> bool:
        if self.is_leader and now_ms - self._lease_checked_ms < _RENEW_EVERY_MS:
            return True
        held = bool(self._renew(keys=[self._lock_key], args=[self.owner, LEASE_MS]))
        self._lease_checked_ms = now_ms
        if held and not self.is_leader:
            logger.info("expiry driver: this listener drives expiries")
            # Pick up from a little in the past: what the previous driver may not have reached.
            with self._lock:
                self._heap.clear()
                self._woken.clear()
                self._recheck.clear()
                self._horizon_ms = now_ms - 5000
        elif not held and self.is_leader:
            logger.info("expiry driver: another listener took over")
            with self._lock:
                self._heap.clear()
                self._woken.clear()
                self._recheck.clear()
        self.is_leader = held
        return held

    def _read_window(self, now_ms: int, window_ms: int) -> None:
        upto = now_ms + window_ms
        with self._lock:
            room = self.settings.driver_max_rows - len(self._heap)
            after = self._horizon_ms
            if room > 0:
                self._reading_upto_ms = upto
        if room <= 0:
            return
        try:
            rows = self.store.upcoming(after_ms=after, upto_ms=upto, limit=room)
        except BaseException:
            with self._lock:
                self._reading_upto_ms = 0
            raise
        with self._lock:
            for key, due_ms in rows:
                heapq.heappush(self._heap, (due_ms, key))
            # A full read stops at its last due time, so nothing between is skipped.
            self._horizon_ms = rows[-1][1] if len(rows) == room else upto
            self._reading_upto_ms = 0  # with the horizon: no wake falls between the two

    def _pttl_each(self, keys: list[str]) -> list[int]:
        if not self._on_cluster:
            return list(self._pttls(keys=keys))
        # Keys of many slots: one script call per primary (keys as arguments); a slot that
        # moved meanwhile goes through the cluster pipeline, which follows it.
        try:
            return self._pttl_by_node(keys)
        except redis.ResponseError:
            pipe = self.redis.pipeline(transaction=False)
            for key in keys:
                pipe.pttl(key)
            return [int(p) for p in pipe.execute()]

    def _pttl_by_node(self, keys: list[str]) -> list[int]:
        """`keys`' PTTLs, one script call per primary, every call sent before any reply is read.

        Sent one after the other, each primary expired its keys (and published their events) a
        round trip after the one before, so a pass reached the listener as one burst per primary,
        each of which can wake the subscriber, the claimer and a claim transaction of its own,
        where one node's pass is one burst. Measured (steady wave, 10k tasks): the cluster
        listener's main thread woke 2.8 times as often as one node's (voluntary context switches
        9,845 against 3,463), and its CPU was 1.41-1.51 times one node's with the calls sent
        one by one, 1.24-1.33 times sent together (alternating runs, `bench --scenario cluster`).
        Sent together, the primaries expire their keys at about the same moment.
        """
        out = [0] * len(keys)
        sent: list[tuple[redis.Redis, Script, list[int], Any]] = []
        try:
            for node, positions in by_node(cast(RedisCluster, self.redis), keys):
                name = _node_name(node)
                script = self._node_pttls.get(name)
                if script is None:
                    script = self._node_pttls[name] = node.register_script(_LOOK_UP)
                conn: Any = node.connection_pool.get_connection()
                sent.append((node, script, positions, conn))
                conn.send_command("EVALSHA", script.sha, 0, *[keys[i] for i in positions])
            refused: redis.ResponseError | None = None
            for node, script, positions, conn in sent:
                try:
                    pttls = conn.read_response()
                except redis.exceptions.NoScriptError:
                    # Not loaded there yet (a new or restarted primary): the script call loads it.
                    pttls = None
                except redis.ResponseError as exc:
                    refused = refused or exc  # every reply is read before the pass gives up
                    continue
                if pttls is None:
                    pttls = script(keys=[], args=[keys[i] for i in positions], client=node)
                for i, pttl in zip(positions, pttls, strict=True):
                    out[i] = int(pttl)
            if refused is not None:
                raise refused
        except BaseException:
            # A reply may be left unread on a connection: none goes back to its pool in use.
            for _node, _script, _positions, conn in sent:
                conn.disconnect()
            raise
        finally:
            for node, _script, _positions, conn in sent:
                node.connection_pool.release(conn)
        return out

    def _look_up(self, due: list[tuple[int, str]], now_ms: int) -> None:
        for start in range(0, len(due), _LOOKUP_BATCH):
            chunk = due[start : start + _LOOKUP_BATCH]
            results = self._pttl_each([key for _, key in chunk])
            self.lookups += len(chunk)
            self.passes += start == 0
            again: list[tuple[int, str]] = []
            for (_, key), pttl in zip(chunk, results, strict=True):
                pttl = int(pttl)
                if pttl == -2:
                    self.forced += 1  # expired by this lookup (or already gone)
                elif 0 <= pttl <= _RECHECK_MS:
                    again.append((now_ms + pttl + 1, key))  # our clock is a hair early
            if again:
                with self._lock:
                    for item in again:
                        heapq.heappush(self._recheck, item)


def _node_name(node: redis.Redis) -> str:
    """host:port of a node's plain client (the key of its registered script)."""
    kwargs = node.connection_pool.connection_kwargs
    return f"{kwargs.get('host')}:{kwargs.get('port')}"
