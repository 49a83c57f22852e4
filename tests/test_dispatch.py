"""The dispatcher on its own (real Redis and SQL): what it claims for what it is given."""

from __future__ import annotations

from keyexpiry import Client, Settings
from keyexpiry.bench.servers import wait_until
from keyexpiry.ledger.store import TaskStatus
from keyexpiry.runner.dispatch import Dispatcher
from tests import sample_tasks
from tests.ke import wait_status


def test_a_key_seen_twice_before_its_claim_is_claimed_once_and_can_be_queued_again(
    client: Client, settings: Settings
) -> None:
    """After a reconnect the reconciliation submits overdue keys that the event stream also
    delivered: queued once, not once per sighting. Once claimed the key may be queued again
    (a task moved and due again must not be dropped)."""
    key = client.create("Probe.record", "twice", ttl_ms=0)
    dispatcher = Dispatcher(client.rt)
    dispatcher.submit([key, key])
    dispatcher.submit(iter([key]))
    assert dispatcher.stats.already_queued == 2
    assert dispatcher.backlog() == 1
    dispatcher.start()
    try:
        row = wait_status(client, key, TaskStatus.DONE)
        assert row.attempts == 1 and sample_tasks.CALLS[key] == 1
        dispatcher.submit([key])
        assert dispatcher.stats.already_queued == 2  # off the queue since its claim
        wait_until(dispatcher.idle, 5)
    finally:
        dispatcher.stop(5)
    assert sample_tasks.CALLS[key] == 1
    assert dispatcher.stats.submitted == 4
