"""Transactional handlers (`@exposed(transactional=True)`): the handler writes through
`current().tx`, and its run is recorded as done in that same transaction, under its claim, so its
business writes and the task's `done` commit together or not at all."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from loguru import logger
from sqlalchemy import Connection
from sqlalchemy.exc import SQLAlchemyError

from keyexpiry.clock import Clock
from keyexpiry.errors import StoreError
from keyexpiry.ledger.rows import Outcome, TaskStatus
from keyexpiry.ledger.store import Store
from keyexpiry.runner.inflight import ClaimedRun, InFlight


def run_in_transaction(
    store: Store,
    clock: Clock,
    run: ClaimedRun,
    inflight: InFlight,
    call: Callable[[Connection], Outcome],
    failed: Callable[[str], Outcome],
) -> Outcome | None:
    """Begin a transaction, `call` the handler with its connection, then record a success in
    that transaction and commit; roll back anything else.

    Returns the outcome to queue (a success comes back marked `recorded`: the recorder only
    counts it), or None when the run's work was rolled back and nothing is to be recorded
    here: the watchdog failed it meanwhile, or its claim was lost (the task runs again under
    the claim that took it). `failed(why)` makes the failure outcome when the transaction itself
    cannot begin or be recorded: the task then retries per its schedule.
    """
    log = logger.bind(key=run.row.key, attempt=run.row.attempts)
    try:
        conn = store.begin()
    except StoreError as exc:
        log.error("could not begin the handler's transaction: {}; not run", exc)
        return failed(f"StoreError: could not begin the handler's transaction: {exc}")
    tx = conn.get_transaction()
    try:
        if not inflight.attach_tx(run, _ender(store, conn)):
            _rollback(conn)
            return None  # failed by the watchdog before it began
        outcome = call(conn)
        if outcome.status is not TaskStatus.DONE:
            _rollback(conn)  # the handler failed: its writes go, the failure is recorded later
            return outcome
        if tx is None or not tx.is_active:
            # Whatever it committed is committed, and running it again would repeat that.
            log.error("the handler committed or rolled back current().tx itself; task is dead")
            return dataclasses.replace(
                outcome,
                status=TaskStatus.DEAD,
                last_error="the handler ended current().tx itself (commit or rollback): a "
                "transactional handler must leave its transaction to keyexpiry",
                result=None,
            )
        if not inflight.committing(run):
            _rollback(conn)
            return None  # past its timeout: the watchdog recorded it as failed
        if not store.record_in(conn, outcome, clock.now_ms()):
            _rollback(conn)
            log.warning(
                "claim lost while running (taken over, requeued or rescheduled); "
                "its transaction is rolled back"
            )
            return None
        store.commit(conn)
        return dataclasses.replace(outcome, recorded=True)
    except StoreError as exc:
        # The COMMIT's answer may be lost: if it committed, the row is done and this failure's
        # record finds it so and changes nothing; if not, the task retries per schedule.
        _rollback(conn)
        log.error("could not record the run in its transaction: {}", exc)
        return failed(f"StoreError: could not record the run in its transaction: {exc}")
    finally:
        if inflight.detach_tx(run):
            conn.close()
        else:
            # The watchdog is ending this connection's session: were it pooled again, the KILL
            # could land on whoever took it next.
            conn.invalidate()
            conn.close()


def _ender(store: Store, conn: Connection) -> Callable[[], None]:
    """What ends `conn`'s transaction from another thread once its run is abandoned, so a hung
    handler's locks go with its timeout: on MySQL/MariaDB a KILL of its session, on PostgreSQL a
    termination of its backend (the server rolls back); elsewhere nothing can (SQLite: the
    handler's thread ends it when it returns)."""
    driver: Any = conn.connection.driver_connection
    session: int | None = None
    if conn.dialect.name in ("mysql", "mariadb") and hasattr(driver, "thread_id"):
        session = int(driver.thread_id())
    elif conn.dialect.name == "postgresql" and hasattr(driver, "info"):
        session = int(driver.info.backend_pid)
    if session is None:
        return lambda: None
    killed = session
    return lambda: store.kill_session(killed)


def _rollback(conn: Connection) -> None:
    try:
        conn.rollback()
    except SQLAlchemyError as exc:
        # A dead connection rolled back on the server's side; the pool discards it on close.
        logger.debug("rollback of a handler's transaction failed: {}", exc)
