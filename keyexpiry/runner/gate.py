"""Flow control on the claim path: a task whose method is paused, or whose fleet-wide limit,
rate or group says "not now", is held back in this listener before its claim, so it stays
pending in the ledger (no attempt counted, no lease taken) and is claimed when it may start.

Permits come from Redis (`keyexpiry.redis.permits`): one script call per method per claim
batch, only for methods with flow rules. A held key waits here in due order and is offered to
the claimer again when its method may start: at once when a run of it ends here, after the
rate's wait, or after a short poll (a slot freed by another listener). Pauses are read from the
ledger (they outlive every listener and Redis) each second, and at once on a pause's wake.
"""

from __future__ import annotations

import collections
import functools
import math
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import redis
from loguru import logger
from redis import Redis

from keyexpiry.clock import Clock, monotonic_s
from keyexpiry.errors import KeyExpiryError, StoreError
from keyexpiry.flow.pauses import Pause, is_paused
from keyexpiry.flow.rules import rate_interval_us
from keyexpiry.keys import parse_key
from keyexpiry.ledger.rows import MalformedRows
from keyexpiry.ledger.store import Store
from keyexpiry.ledger.table import PAUSE_TABLE
from keyexpiry.log import SaidOnce
from keyexpiry.redis import permits
from keyexpiry.redis.permits import GRANTED, REASONS, Permits, Terms
from keyexpiry.registry import TaskSpec, group_positions
from keyexpiry.runner.inflight import ClaimedRun
from keyexpiry.settings import Settings
from keyexpiry.threads import ThreadErrors

POLL_S = 0.02
"""How soon keys held back by a limit or a group are offered again when no run of their method
ended here (a slot another listener frees is only seen by trying)."""
RATE_MIN_WAIT_S = 0.005
"""The shortest wait before trying a rate again: a few starts' worth per script call."""
PAUSE_CHECK_S = 1.0
"""How often pauses are read from the ledger (a pause's wake message makes it at once)."""
HELD_MAX = 200_000
"""Keys one listener holds back at most; past it, a key is left to the ledger (pending, found
again by the overdue check once its method may start)."""
PAUSED = "paused"
REDIS_DOWN_WAIT_S = 0.5
"""How soon keys held back because Redis did not answer are offered again."""
HOLD_STALE_S = 10.0
"""How long past its next try a held key still counts as held (`Gate.holds`): a claimer too
busy to offer it for that long leaves it to the overdue check, like any pending task."""


@dataclass(frozen=True, slots=True)
class _Rule:
    task: str
    terms: Terms
    positions: tuple[int, ...]

    @property
    def holds_slots(self) -> bool:
        """Whether a run keeps its permit until it ends (a limit or a group); under a rate
        alone a permit is spent when granted."""
        return bool(self.terms.concurrency or self.positions)


class Gate:
    """Flow control for one listener (`admit` before a claim, `release` when a run ends)."""

    def __init__(
        self,
        *,
        store: Store,
        redis: Redis,
        clock: Clock,
        settings: Settings,
        owner: str,
        errors: ThreadErrors | None = None,
    ) -> None:
        """Pauses read from `store`, permits kept in `redis` under `owner` (this listener)."""
        self.store, self.redis, self.clock = store, redis, clock
        self.settings, self.owner = settings, owner
        self._errors = errors if errors is not None else ThreadErrors()
        self._said = SaidOnce(1000)
        self.malformed = MalformedRows()
        """Pause rows keyexpiry would never have written, met here (each logged once): they
        pause nothing."""
        self._permits = Permits(
            redis, settings.key_prefix, ttl_ms=int(settings.takeover_after_s * 1000)
        )
        self._lock = threading.Lock()
        self._held: dict[str, collections.OrderedDict[str, str]] = {}
        """task → held key → reason, in the order they were heard (due order)."""
        self._retry_at: dict[str, float] = {}
        self._holding: dict[str, set[str]] = {}
        """task → members of the permits this listener holds (refreshed every heartbeat)."""
        self._rules: dict[str, _Rule] = {}
        self._pauses: tuple[Pause, ...] = ()
        self._pauses_read_s = -PAUSE_CHECK_S
        self._reread = threading.Event()
        self._warned = False
        self._offered: set[str] = set()
        """Held keys handed back to the claimer, not yet decided again (not counted twice)."""
        self.held_back_total: collections.Counter[tuple[str, str]] = collections.Counter()
        """(task, reason) → keys held back (each counted when it starts waiting)."""
        self.wake: Callable[[], None] = lambda: None
        """Set by the claimer: wakes its wait when held keys may be offered again."""

    # --- the claimer's side ------------------------------------------------------------------
    def admit(self, specs: dict[str, TaskSpec], token: str) -> dict[str, TaskSpec]:
        """The keys among `specs` that may be claimed now (permits taken under `token`); the
        others are held back here."""
        now_ms = self.clock.now_ms() if self._pauses else 0  # no clock read on the hot path
        allowed: dict[str, TaskSpec] = {}
        shaped: dict[str, list[str]] = {}
        for key, spec in specs.items():
            if self._pauses and is_paused(self._pauses, spec.class_name, spec.method, now_ms):
                self.hold_paused(spec, key)
            elif spec.options.shaped:
                shaped.setdefault(spec.label, []).append(key)
            else:
                allowed[key] = spec
        for task, keys in shaped.items():
            rule = self._rule(specs[keys[0]])
            try:
                candidates = [self._candidate(rule, token, key) for key in keys]
                codes, wait_s = self._permits.acquire(task, rule.terms, candidates)
            except redis.RedisError as exc:
                # No permit without Redis: held, and tried again when it answers.
                self._say_redis(exc)
                self._hold(task, [(k, REASONS[permits.LIMIT]) for k in keys], REDIS_DOWN_WAIT_S)
                continue
            if rule.holds_slots:
                with self._lock:
                    holding = self._holding.setdefault(task, set())
                    for (m, _), code in zip(candidates, codes, strict=True):
                        if code == GRANTED:
                            holding.add(m)
            for key, code in zip(keys, codes, strict=True):
                if code == GRANTED:
                    allowed[key] = specs[key]
            denied = [(k, REASONS[c]) for k, c in zip(keys, codes, strict=True) if c != GRANTED]
            if denied:
                self._hold(task, denied, max(wait_s, RATE_MIN_WAIT_S) if wait_s else POLL_S)
        if self._offered:
            with self._lock:
                self._offered.difference_update(specs)
        return allowed

    def unclaimed(self, specs: dict[str, TaskSpec], token: str, keys: Iterable[str]) -> None:
        """Keys admitted under `token` whose claim took nothing (a stale event, a peer's claim):
        their permits go back."""
        by_task: dict[str, list[str]] = {}
        for key in keys:
            spec = specs[key]
            if spec.options.shaped:
                rule = self._rule(spec)
                if rule.holds_slots:
                    by_task.setdefault(rule.task, []).append(self._candidate(rule, token, key)[0])
        for task, members in by_task.items():
            self._give_back(task, members)

    def release(self, run: ClaimedRun) -> None:
        """`run` is over here (ended, abandoned, dropped, released): its permit goes back and
        keys of its method waiting here are offered again."""
        spec = run.spec
        if not spec.options.shaped:
            return
        rule = self._rule(spec)
        if not rule.holds_slots:
            return  # a rate's permit was spent at the start: nothing to give back or wait for
        self._give_back(rule.task, [self._candidate(rule, run.token, run.row.key)[0]])
        with self._lock:
            waiting = bool(self._held.get(rule.task))
            if waiting:
                self._retry_at[rule.task] = monotonic_s()  # now, as `holds` reads it
        if waiting:
            self.wake()

    def take_ready(self, room: int) -> list[str]:
        """Held keys whose method may start now (by their wait), oldest first, up to `room`."""
        if not self._held or room <= 0:
            return []
        now_s = monotonic_s()
        now_ms = self.clock.now_ms()
        ready: list[str] = []
        with self._lock:
            for task, held in self._held.items():
                if not held or self._retry_at.get(task, 0.0) > now_s:
                    continue
                if self._pauses and is_paused(self._pauses, *_names(task), now_ms):
                    continue
                rule = self._rules.get(task)
                cap = room - len(ready)
                if rule is not None and rule.terms.concurrency:
                    cap = min(cap, rule.terms.concurrency)
                elif rule is not None and rule.terms.interval_us and not rule.positions:
                    # A rate grants its burst, or what accrued since the last try, at most.
                    accrued = RATE_MIN_WAIT_S * 1e6 / rule.terms.interval_us + 1
                    burst = rule.terms.tolerance_us / rule.terms.interval_us + 1
                    cap = min(cap, math.ceil(max(accrued, burst)))
                for _ in range(min(cap, len(held))):
                    key = held.popitem(last=False)[0]
                    self._offered.add(key)
                    ready.append(key)
                self._retry_at[task] = now_s + POLL_S
                if len(ready) >= room:
                    break
        return ready

    def wait_s(self, longest_s: float) -> float:
        """How long the claimer may wait for new keys before held ones may be offered."""
        if not self._held:
            return longest_s
        now_s = monotonic_s()
        now_ms = self.clock.now_ms()
        with self._lock:
            waiting = [t for t, held in self._held.items() if held]
            soonest = min(
                (
                    self._retry_at.get(t, 0.0)
                    for t in waiting
                    if not (self._pauses and is_paused(self._pauses, *_names(t), now_ms))
                ),
                default=now_s + longest_s,
            )
        return min(longest_s, max(0.0, soonest - now_s))

    def holds(self, key: str) -> bool:
        """Whether `key` is held back here, or its method is paused (its task is not stuck)."""
        now_s = monotonic_s()
        with self._lock:
            # Offered again and not yet decided: still held, a moment out of `_held`.
            if key in self._offered:
                return True
            for task, held in self._held.items():
                if key in held:
                    # Only while its next try is as near as its rules allow: a hold that went
                    # wrong must not hide a task from the overdue check for ever.
                    retry_at_s = self._retry_at.get(task, 0.0)
                    if now_s - HOLD_STALE_S <= retry_at_s <= now_s + self._longest_wait_s(task):
                        return True
                    break
        if not self._pauses:
            return False
        try:
            parsed = parse_key(key, prefix=self.settings.key_prefix)
        except KeyExpiryError:
            return False
        now_ms = self.clock.now_ms()
        return is_paused(self._pauses, parsed.class_name, parsed.method, now_ms) is not None

    def held(self) -> dict[str, dict[str, int]]:
        """task → reason → keys held back here now."""
        out: dict[str, dict[str, int]] = {}
        with self._lock:
            for task, held in self._held.items():
                for reason in held.values():
                    counts = out.setdefault(task, {})
                    counts[reason] = counts.get(reason, 0) + 1
        return out

    def waiting(self, task: str) -> list[str]:
        """The keys of `task` (`Class.method`) held back here, in the order they will be
        offered (due order)."""
        with self._lock:
            return list(self._held.get(task, ()))

    def paused_now(self, spec: TaskSpec) -> bool:
        """Whether `spec`'s method is paused (as this listener last read the pauses)."""
        if not self._pauses:
            return False
        now_ms = self.clock.now_ms()
        return is_paused(self._pauses, spec.class_name, spec.method, now_ms) is not None

    def hold_paused(self, spec: TaskSpec, key: str) -> None:
        """Hold `key` (given back after its claim) until its method is resumed."""
        self._hold(spec.label, [(key, PAUSED)], 0.0)

    def paused(self) -> tuple[Pause, ...]:
        """The pauses this listener last read."""
        return self._pauses

    # --- the flow thread ---------------------------------------------------------------------
    def read_pauses(self) -> None:
        """Read pauses now, in the caller's thread (a listener starting: before its first
        claim). A ledger out of reach leaves none in force until the flow thread reads them."""
        now_s = monotonic_s()
        self._guarded("reading the pauses", functools.partial(self._read_pauses, now_s))

    def interrupt(self) -> None:
        """End the flow thread's wait now (its listener stops: `loop`'s `stop` is set)."""
        self._reread.set()

    def reread_pauses(self) -> None:
        """Read pauses now (a pause's wake message arrived)."""
        self._reread.set()

    def loop(self, stop: threading.Event) -> None:
        """Until `stop`: read pauses each second (or when woken), refresh this listener's
        permits and publish what it holds back every heartbeat."""
        settings = self.settings
        beat_s = settings.heartbeat_s
        last_beat_s = -beat_s
        while not stop.is_set():
            self._reread.wait(min(PAUSE_CHECK_S, beat_s))
            if stop.is_set():
                break  # woken by `interrupt`: the listener is stopping
            now_s = monotonic_s()
            # Each step guarded on its own: pauses that cannot be read must not stop the
            # permits' refresh (lapsed, they let a limit's runs overlap).
            if self._reread.is_set() or now_s - self._pauses_read_s >= PAUSE_CHECK_S:
                self._reread.clear()
                self._guarded("reading the pauses", functools.partial(self._read_pauses, now_s))
            if now_s - last_beat_s >= beat_s:
                last_beat_s = now_s
                self._guarded("refreshing permits", self._beat)
        try:  # stopped: nothing of ours is held back any more
            permits.publish_held(self.redis, self.settings.key_prefix, self.owner, 0, {})
        except redis.RedisError:
            pass  # stale after takeover_after_s anyway

    def _guarded(self, step: str, run: Callable[[], None]) -> None:
        """Run one step of the flow thread; an unexpected error is counted (the thread's
        errors: repeated, the listener is not ready) and logged once, and the thread goes on."""
        try:
            run()
        except Exception as exc:
            self._errors.add("flow")
            if self._said.first((step, type(exc).__name__, str(exc)[:200])):
                logger.opt(exception=True).error(
                    "flow control: unexpected error {} ({}); said once, it goes on", step, exc
                )
            else:
                logger.debug("flow control: unexpected error {} again: {!r}", step, exc)

    def _read_pauses(self, now_s: float) -> None:
        try:
            read = self.store.read_pauses(self.clock.now_ms())
        except (StoreError, redis.RedisError) as exc:  # the clock is Redis's
            logger.debug("pauses not read (the last ones stay in force): {}", exc)
            return
        for bad in read.malformed:
            self.malformed.report(f"{PAUSE_TABLE} {bad.target}", bad.problem, "no pause: skipped")
        pauses = tuple(read.pauses)
        self._pauses_read_s = now_s
        if pauses != self._pauses:
            before = {p.target for p in self._pauses}
            after = {p.target for p in pauses}
            for target in sorted(after - before):
                logger.info("{} is paused: its tasks are held back when due", target)
            for target in sorted(before - after):
                logger.info("{} is resumed: its held-back tasks start in due order", target)
            self._pauses = pauses
            self.wake()

    def _beat(self) -> None:
        with self._lock:
            holding = {task: list(members) for task, members in self._holding.items() if members}
        try:
            for task, members in holding.items():
                self._permits.refresh(task, members)
                # One released meanwhile was just written back: nobody would release it again.
                with self._lock:
                    still = self._holding.get(task, set())
                    gone = [m for m in members if m not in still]
                if gone:
                    self._permits.release(task, gone)
            permits.publish_held(
                self.redis, self.settings.key_prefix, self.owner, self.clock.now_ms(), self.held()
            )
        except redis.RedisError as exc:
            self._say_redis(exc)

    # --- inside ------------------------------------------------------------------------------
    def _rule(self, spec: TaskSpec) -> _Rule:
        rule = self._rules.get(spec.label)
        if rule is None:
            options = spec.options
            interval_us = rate_interval_us(options.rate) if options.rate else 0
            tolerance_us = (options.rate.burst - 1) * interval_us if options.rate else 0
            rule = _Rule(
                spec.label,
                Terms(options.concurrency or 0, interval_us, tolerance_us),
                group_positions(spec),
            )
            self._rules[spec.label] = rule
        return rule

    def _longest_wait_s(self, task: str) -> float:
        """The longest a key of `task` may wait for its next try: a rate's spacing of starts,
        or the wait after Redis did not answer."""
        rule = self._rules.get(task)
        interval_s = rule.terms.interval_us / 1e6 if rule is not None else 0.0
        return max(REDIS_DOWN_WAIT_S, POLL_S, RATE_MIN_WAIT_S, interval_s)

    def _candidate(self, rule: _Rule, token: str, key: str) -> tuple[str, str]:
        group = ""
        if rule.positions:
            args = parse_key(key, prefix=self.settings.key_prefix).args
            # A key short of the group's argument is no runnable task (its run ends dead when
            # its arguments are decoded): no group to wait for.
            group = "\x1f".join(args[i] for i in rule.positions if i < len(args))
        return permits.member(group, token, key), group

    def _hold(self, task: str, keys: list[tuple[str, str]], wait_s: float) -> None:
        with self._lock:
            held = self._held.setdefault(task, collections.OrderedDict())
            # New keys join the back; keys offered again go back to the front, in their order:
            # either way, due order holds.
            for key, reason in reversed(keys):
                if key in self._offered:
                    held[key] = reason
                    held.move_to_end(key, last=False)
            total = sum(len(h) for h in self._held.values())
            for key, reason in keys:
                if key in self._offered:
                    continue
                if key not in held:
                    if total >= HELD_MAX:
                        continue  # left to the ledger (see HELD_MAX)
                    total += 1
                    self.held_back_total[(task, reason)] += 1
                held[key] = reason
            # Bounded whatever the wait said (it is read from Redis): a key never waits past
            # its method's next possible start.
            self._retry_at[task] = monotonic_s() + min(wait_s, self._longest_wait_s(task))

    def _give_back(self, task: str, members: list[str]) -> None:
        with self._lock:
            holding = self._holding.get(task)
            if holding is not None:
                holding.difference_update(members)
        try:
            self._permits.release(task, members)
        except redis.RedisError as exc:
            # Not refreshed any more, the permits lapse by themselves within takeover_after_s.
            self._say_redis(exc)

    def _say_redis(self, exc: redis.RedisError) -> None:
        if not self._warned:
            self._warned = True
            logger.warning("flow control: Redis did not answer ({}); held tasks wait", exc)
        else:
            logger.debug("flow control: Redis did not answer: {}", exc)


def _names(task: str) -> tuple[str, str]:
    class_name, _, method = task.partition(".")
    return class_name, method
