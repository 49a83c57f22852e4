"""A schedule declared in code, for listener subprocesses only (`--tasks
tests.schedule_fault_pulse`): importing this module registers `Pulse` in the default registry,
and every listener of that registry declares its schedule at start. Never import it from the
test process (tests/faults/test_schedule_faults.py names it by its key and schedule name)."""

from __future__ import annotations

from keyexpiry import exposed, task
from tests.schedule_fault_tasks import note


@task
class Pulse:
    @exposed(every_s=1)
    def beat(self) -> None:
        note()
