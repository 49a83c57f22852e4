"""Old home of `Client` (now `keyexpiry.client`); kept importable for one release."""

from keyexpiry.client import Client, Target, TaskRequest, due_at_ms

__all__ = ["Client", "Target", "TaskRequest", "due_at_ms"]
