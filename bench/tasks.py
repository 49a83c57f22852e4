"""The trivial handler every benchmark scenario runs."""

from __future__ import annotations

from keyexpiry import exposed, task


@task
class Bench:
    """Does nothing: the benchmark measures keyexpiry, not the handler."""

    @exposed
    def noop(self, i: int) -> None:
        """Return at once."""

    @exposed
    def other(self, i: int) -> None:
        """Background tasks due far in the future (the 'N pending' of the sparse scenario)."""
