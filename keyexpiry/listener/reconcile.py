"""Repair between the ledger and Redis: run what was missed, re-arm what Redis lost.

Runs at listener start-up, after every reconnect, on each sentinel expiry, and on demand
(`keyexpiry reconcile`). The ledger is the truth; Redis keys are derived from it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from loguru import logger
from redis import Redis

from keyexpiry import retries
from keyexpiry.clock import Clock, iso_ms
from keyexpiry.errors import UnknownTaskError
from keyexpiry.keys import excerpt, task_class_of
from keyexpiry.ledger.rows import MalformedRows, TaskRow, TaskStatus
from keyexpiry.ledger.scans import KEYS_START, PendingKey
from keyexpiry.ledger.store import Store
from keyexpiry.limits import MAX_HORIZON_S, MIN_DUE_MS
from keyexpiry.log import SaidOnce
from keyexpiry.redis.arming import arm_keys
from keyexpiry.registry import Registry
from keyexpiry.runtime import Runtime
from keyexpiry.settings import Settings

PAGE_ROWS = 1000
DUE_FIRST_MS = 300_000
"""Rows due within this are reconciled first, at once; the rest is walked afterwards, paced by
the caller, so a listener (re)starting on a large ledger never holds back work falling due."""
# A key whose remaining TTL differs from the ledger by more than this was changed by someone else.
TTL_TOLERANCE_MS = 1000


OWN_OVERDUE_MAX_PAGES = 20
"""How many pages of overdue keys one check reads at most to find this listener's own among its
peers' (20 pages of 1,000 index entries: a few ms)."""


@dataclass
class ReconcileReport:
    """What one reconciliation found and did."""

    checked: int = 0
    overdue: int = 0
    rearmed: int = 0
    lease_expired: int = 0
    dead: int = 0
    malformed: int = 0
    """Rows keyexpiry would never have written, found (each is logged once, with its key)."""
    claimed_since_silent: int = 0
    """Runs of a listener judged silent that it claimed after its silence began (it is alive:
    `requeue_runs_of` left them)."""

    def __str__(self) -> str:
        text = (
            f"checked {self.checked} pending, {self.overdue} overdue, {self.rearmed} key(s) "
            f"re-armed, {self.lease_expired} expired lease(s) requeued, {self.dead} dead"
        )
        if self.malformed:
            text += f", {self.malformed} malformed row(s) (see the log)"
        return text


class Reconciler:
    """Compares pending ledger rows with Redis keys and repairs the difference.

    `submit`, when given (inside a listener), receives overdue keys to claim directly; without it
    (the CLI) overdue keys are re-armed so they expire at once and a listener runs them. `mine`,
    when given, says which keys are this listener's share: only those are submitted (a peer's
    overdue rows are its own reconciliation's, or its successor's catch-up); lost keys of any
    share are re-armed.
    """

    def __init__(
        self,
        *,
        store: Store,
        redis: Redis,
        clock: Clock,
        settings: Settings,
        registry: Registry | None,
        submit: Callable[[list[str]], None] | None = None,
        mine: Callable[[str], bool] | None = None,
    ) -> None:
        """Reads rows from `store` and keys from `redis` (and arms them there), on `clock`'s
        time; `registry` (None: every class counts as known) resolves a row's retry options."""
        self.store, self.redis, self.clock = store, redis, clock
        self.settings, self.registry = settings, registry
        self.submit = submit
        self.mine = mine
        self.rearmed_total = 0
        """Keys re-armed from the ledger since start (for metrics)."""
        self.requeued_total = 0
        """Tasks handed to the claimer or back to pending from the ledger since start."""
        self.malformed = MalformedRows()
        """Malformed rows met (each said once): skipped, never a failed pass."""
        self.overdue_repeats_total = 0
        """Overdue rows repaired again at the due time they were already reported for (for
        metrics): rows no listener runs, re-armed every lease check, reported once each."""
        self._reported = SaidOnce()

    @classmethod
    def of(
        cls,
        rt: Runtime,
        *,
        submit: Callable[[list[str]], None] | None = None,
        mine: Callable[[str], bool] | None = None,
    ) -> Reconciler:
        """A reconciler on the runtime's ledger, Redis, clock, settings and registry (what
        `keyexpiry reconcile` and a listener both repair with)."""
        return cls(
            store=rt.store,
            redis=rt.redis,
            clock=rt.clock,
            settings=rt.settings,
            registry=rt.registry,
            submit=submit,
            mine=mine,
        )

    def _arm(self, items: Sequence[tuple[str, int]], now_ms: int, *, missing: bool = False) -> None:
        arm_keys(self.redis, items, now_ms, self.settings, missing=missing)

    def run(
        self, *, dry_run: bool = False, progress: Callable[[int, int], None] | None = None
    ) -> ReconcileReport:
        """One full pass, as fast as it goes; `progress(done, total)` is called after each page."""
        total = self.store.count_pending()
        walk = self.start(dry_run=dry_run)
        while walk.step():
            if progress is not None:
                progress(walk.report.checked, max(total, walk.report.checked))
        if progress is not None:
            progress(walk.report.checked, max(total, walk.report.checked))
        return walk.report

    def start(self, *, dry_run: bool = False, page_rows: int = PAGE_ROWS) -> PendingWalk:
        """The urgent part of a pass, done now: expired leases requeued, then every pending row
        due within `DUE_FIRST_MS` (overdue ones run, lost keys re-armed). Returns the walk over
        the rest, a page per `step()`, for the caller to pace: the key of a row due later only
        has to be back before the row falls due."""
        report = ReconcileReport()
        self._requeue_expired_leases(report, dry_run)
        self._report_unknown_statuses(report)
        upto_ms = self.clock.now_ms() + DUE_FIRST_MS
        urgent = PendingWalk(self, report, dry_run=dry_run, upto_ms=upto_ms)
        while urgent.step():
            pass
        return PendingWalk(self, report, dry_run=dry_run, after=urgent.after, page_rows=page_rows)

    def _report_unknown_statuses(self, report: ReconcileReport) -> None:
        """Rows with a status outside `TaskStatus`: no other query reads them, so they would
        sit unseen for ever. One query of ranges that are empty in a sound ledger."""
        for row in self.store.unknown_status_rows():
            report.malformed += 1
            self.malformed.report(row.key, row.problem or "", "left alone", attempt=row.attempts)

    def _max_attempts(self, row: TaskRow) -> int:
        options = None
        if self.registry is not None:
            try:
                options = self.registry.resolve(row.class_name, row.method).options
            except UnknownTaskError:
                pass  # not registered here: the row's own schedule, else the settings'
        return retries.max_attempts(row.retry_schedule_s, options, self.settings)

    def repair_stuck(
        self,
        *,
        grace_ms: int,
        events_arriving: bool,
        limit: int = 1000,
        mine: Callable[[str], bool] | None = None,
    ) -> int:
        """Pending rows due more than `grace_ms` ago: their key was deleted, renamed, persisted,
        evicted or flushed, or its event was lost. Re-arm them so they expire now (the event
        stays the dispatch path); while events do not arrive at all, submit them directly.
        With `mine`, only keys of this listener's share (a live peer's overdue rows are most
        likely in its backlog, and its own check repairs them), up to `limit` of them however
        many of the peers' come first.

        One query on the (status, due_at_ms, …) index, which normally returns nothing.
        """
        now_ms = self.clock.now_ms()
        if mine is None:
            rows = self.store.overdue(now_ms=now_ms - grace_ms, limit=limit)
        else:
            rows = self.overdue_keys(now_ms - grace_ms, limit, mine)
        if not rows:
            return 0
        keys = [k for k, _ in rows]
        # A row no listener can run (its class registered nowhere, a method not exposed) is
        # overdue again at every check: one line per row and due time, then only the counter.
        fresh = [k for k, due in rows if self._reported.first((k, due))]
        self.overdue_repeats_total += len(rows) - len(fresh)
        if self.submit is not None and not events_arriving:
            self.submit(keys)
            self.requeued_total += len(keys)
            action = "running them from the ledger (expired events are not arriving)"
        else:
            self._arm(rows, now_ms)
            self.rearmed_total += len(rows)
            action = f"re-armed; {self._overdue_cause(fresh or keys)}"
        if not fresh:
            logger.debug("{} overdue task(s) repaired again (reported before)", len(rows))
            return len(rows)
        shown = ", ".join(excerpt(k, 60) for k in fresh[:3])
        more = f" and {len(fresh) - 3} more" if len(fresh) > 3 else ""
        logger.warning(
            "{} pending task(s) overdue by more than {} ms ({}{}): {}",
            len(fresh),
            grace_ms,
            shown,
            more,
            action,
        )
        return len(rows)

    def overdue_keys(
        self, upto_ms: int, limit: int, keep: Callable[[str], bool]
    ) -> list[tuple[str, int]]:
        """Up to `limit` (key, due) of the pending rows due by `upto_ms` whose key `keep`
        accepts (this listener's share, the buckets it just gained), earliest first: pages of
        the covering index (keys only, no row reads) until enough are found, the overdue rows
        end, or `OWN_OVERDUE_MAX_PAGES` pages were read (a peer's backlog that big is the
        peer's to run, and the next check reads on)."""
        found: list[tuple[str, int]] = []
        after = KEYS_START
        for _ in range(OWN_OVERDUE_MAX_PAGES):
            page = self.store.pending_keys_page(after=after, upto_ms=upto_ms, limit=limit)
            found += [(p.key, p.due_at_ms) for p in page if keep(p.key)]
            if len(page) < limit or len(found) >= limit:
                break
            after = page[-1].position
        return found[:limit]

    def _overdue_cause(self, keys: list[str]) -> str:
        """Why tasks stay overdue while events arrive: no listener has their class, or their
        key (or its event) was lost."""
        if self.registry is not None:
            prefix = self.settings.key_prefix.encode()
            unknown = sorted(
                {
                    name
                    for k in keys
                    if (name := task_class_of(k.encode(), prefix)) is not None
                    and not self.registry.has_class(name)
                }
            )
            if unknown:
                return (
                    f"this listener does not run class {', '.join(unknown[:5])}: is a listener "
                    "with --tasks for it running?"
                )
        return "their key or its expired event was lost (deleted, evicted, flushed, or a restart)"

    def requeue_expired_leases(self) -> ReconcileReport:
        """Only the lease part of a pass: cheap (one indexed query), run every few seconds."""
        report = ReconcileReport()
        self._requeue_expired_leases(report, dry_run=False)
        return report

    def _requeue_expired_leases(self, report: ReconcileReport, dry_run: bool) -> None:
        now_ms = self.clock.now_ms()
        self._requeue(self.store.expired_leases(now_ms), report, dry_run, now_ms, "lease expired")

    def requeue_runs_of(self, listener_id: str, silent_since_ms: int) -> ReconcileReport:
        """Requeue the running tasks of a listener that stopped beating (heartbeats, not
        leases: a killed listener's runs come back in seconds, whatever their timeout).

        Unless it claimed one of them after `silent_since_ms`: then it is alive and its row's
        time is stale (a heartbeat held by the network and written late puts an old time back;
        seen with a 27 s partition from the ledger, whose held heartbeat landed after the heal
        and had a run claimed after it requeued and run twice). Nothing more is requeued then
        (`claimed_since_silent` says how many); its next heartbeat settles it."""
        report = ReconcileReport()
        seen: set[int] = set()
        while True:  # a page at a time: each requeued row leaves the next page's range
            rows = [r for r in self.store.runs_of(listener_id, limit=PAGE_ROWS) if r.id not in seen]
            # Checked on every page: a claim made while the pages are walked counts too. A row
            # read here is requeued only under the token it was read with, so a run claimed
            # after this read is never the one requeued.
            recent = [r for r in rows if (r.started_at_ms or 0) >= silent_since_ms]
            if recent:
                report.claimed_since_silent = len(recent)
                return report
            seen.update(r.id for r in rows)
            self._requeue(
                rows, report, False, self.clock.now_ms(), "heartbeat lost", lease_expired=False
            )
            if len(rows) < PAGE_ROWS:
                return report

    def _requeue(
        self,
        rows: list[TaskRow],
        report: ReconcileReport,
        dry_run: bool,
        now_ms: int,
        why: str,
        *,
        lease_expired: bool = True,
    ) -> None:
        requeued: list[str] = []
        next_occurrences: list[tuple[str, int]] = []
        for row in rows:
            log = logger.bind(key=row.key, attempt=row.attempts)
            report.lease_expired += 1
            if dry_run:
                continue
            if lease_expired and row.lease_until_ms is None:
                # Written without a lease (or with one that is not a time), by something other
                # than a claim: nothing would ever end the run; its lease counts as run out.
                error = f"running with no lease (claimed by {row.claimed_by})"
            else:
                error = f"{why}: listener {row.claimed_by} stopped before recording an outcome"
            if row.attempts >= self._max_attempts(row):
                if self.store.requeue_lost(
                    row, status=TaskStatus.DEAD, error=error, now_ms=now_ms,
                    lease_expired=lease_expired, rearm=next_occurrences,
                ):  # fmt: skip
                    report.dead += 1
                    log.error("{}; out of attempts, task is dead", error)
                continue
            if self.store.requeue_lost(
                row, status=TaskStatus.PENDING, error=error, now_ms=now_ms,
                lease_expired=lease_expired,
            ):  # fmt: skip
                log.warning("{}; running it again", error)
                requeued.append(row.key)
        if next_occurrences:
            self._arm(next_occurrences, now_ms)  # a dead occurrence's schedule moved on
        if requeued:
            self.requeued_total += len(requeued)
            if self.submit is not None:
                self.submit(requeued)
            else:
                self._arm([(k, now_ms) for k in requeued], now_ms)

    def _repair_page(self, page: list[PendingKey], report: ReconcileReport, dry_run: bool) -> None:
        now_ms = self.clock.now_ms()
        page = self._sound(page, report, now_ms)
        overdue = [r for r in page if r.due_at_ms <= now_ms]
        future = [r for r in page if r.due_at_ms > now_ms]
        report.overdue += len(overdue)
        to_arm: list[PendingKey] = []
        missing: set[str] = set()
        if future:
            pipe = self.redis.pipeline(transaction=False)
            for row in future:
                pipe.pttl(row.key)
            # A TTL is read at some instant between these two: a stall of the process or of the
            # round trip (a page of 1,000 on a loaded machine) must not make every key of the
            # page look wrong, and get re-armed and counted as lost.
            sent_ms = self.clock.now_ms()
            ttls = pipe.execute()
            back_ms = self.clock.now_ms()
            for row, pttl in zip(future, ttls, strict=True):
                shortest_ms = row.due_at_ms - back_ms - TTL_TOLERANCE_MS
                longest_ms = row.due_at_ms - sent_ms + TTL_TOLERANCE_MS
                if pttl < 0 or not shortest_ms <= int(pttl) <= longest_ms:
                    to_arm.append(row)
                    if pttl == -2:
                        missing.add(row.key)
        if overdue:
            if self.submit is not None:
                mine = self.mine
                keys = [r.key for r in overdue if mine is None or mine(r.key)]
                if keys and not dry_run:
                    self.submit(keys)
                    self.requeued_total += len(keys)
            else:
                to_arm.extend(overdue)
        to_arm = self._unchanged(to_arm)
        report.rearmed += len(to_arm)
        if dry_run or not to_arm:
            return
        # A key found missing is set only if it still is: a reschedule that committed after
        # `_unchanged` read its row set the new due already (the Cluster soak: one task put
        # back to its old due by the FLUSHALL's walk, run 12 s late by the overdue check).
        lost = [(r.key, r.due_at_ms) for r in to_arm if r.key in missing]
        wrong = [(r.key, r.due_at_ms) for r in to_arm if r.key not in missing]
        self._arm(lost, now_ms, missing=True)
        self._arm(wrong, now_ms)
        if wrong:
            # A key found with the wrong expiry is overwritten: one whose row changed since the
            # re-read is armed again at its new due (a reschedule commits before it sets its
            # key, so one that commits after this read sets its key after ours).
            fresh = self.store.pending_again([k for k, _ in wrong])
            moved = [
                (k, now.due_at_ms)
                for k, due in wrong
                if (now := fresh.get(k)) is not None and now.due_at_ms != due
            ]
            self._arm(moved, now_ms)
        self.rearmed_total += len(to_arm)
        for row in to_arm:
            logger.bind(key=row.key, attempt=row.attempts).debug("key re-armed from the ledger")

    def _unchanged(self, rows: list[PendingKey]) -> list[PendingKey]:
        """The rows of `rows` still pending at the due time the page was read with.

        A row changed since (rescheduled, cancelled, claimed) had its key set or removed by
        whoever changed it; arming the due time the page read would undo that. Seen in the
        soaks: a task rescheduled a moment after a fault's reconnect, while that reconnect's
        walk read its page, got its key put back to the old due (its new one looked wrong), so
        nothing fired at the new due and it ran at the overdue check, 7-21 s late."""
        if not rows:
            return rows
        fresh = self.store.pending_again([r.key for r in rows])
        return [
            r
            for r in rows
            if (now := fresh.get(r.key)) is not None and now.due_at_ms == r.due_at_ms
        ]

    def _sound(
        self, page: list[PendingKey], report: ReconcileReport, now_ms: int
    ) -> list[PendingKey]:
        """The rows of `page` that can be repaired; the others are reported (once each) and
        skipped, so one row written outside keyexpiry never fails every pass after it.

        A due time before 1970 is one keyexpiry never writes (`MIN_DUE_MS`), but it is due
        now as much as any overdue row: reported, and run like one. A due time past the
        horizon is armed as stored (Redis takes it), and reported: it will not run.
        """
        sound: list[PendingKey] = []
        horizon_ms = now_ms + MAX_HORIZON_S * 1000
        for row in page:
            if row.problem is not None:
                report.malformed += 1
                self.malformed.report(row.key, row.problem, "skipped", attempt=row.attempts)
                continue
            if not MIN_DUE_MS <= row.due_at_ms <= horizon_ms:
                report.malformed += 1
                early = row.due_at_ms < MIN_DUE_MS
                when = "before 1970" if early else "past the 100-year horizon"
                fate = "run as due now" if early else "left as it is"
                problem = f"its due time {iso_ms(row.due_at_ms)} is {when}"
                self.malformed.report(row.key, problem, fate, attempt=row.attempts)
            sound.append(row)
        return sound


class PendingWalk:
    """A keyset walk over pending keys in due order, after `after` = (due_at_ms, task_key) and
    up to `upto_ms` when given, repairing one page into `report` per `step()`."""

    def __init__(
        self,
        reconciler: Reconciler,
        report: ReconcileReport,
        *,
        dry_run: bool,
        after: tuple[Any, str] = KEYS_START,
        upto_ms: int | None = None,
        page_rows: int = PAGE_ROWS,
    ) -> None:
        self.report = report
        self.after = after
        self.done = False
        self._reconciler = reconciler
        self._dry_run = dry_run
        self._upto_ms = upto_ms
        self._page_rows = page_rows

    def step(self) -> bool:
        """Repair the next page; True while rows may remain. A page that fails is read again
        by the next call: the position moves only past a repaired page."""
        if self.done:
            return False
        page = self._reconciler.store.pending_keys_page(
            after=self.after, upto_ms=self._upto_ms, limit=self._page_rows
        )
        if page:
            self._reconciler._repair_page(page, self.report, self._dry_run)
            self.after = page[-1].position
            self.report.checked += len(page)
        self.done = len(page) < self._page_rows
        return not self.done
