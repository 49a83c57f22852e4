"""keyexpiry: delayed tasks on Redis keyspace notifications, with a SQL ledger."""

from keyexpiry.client import Client, TaskRequest
from keyexpiry.context import TaskContext, current
from keyexpiry.errors import DoNotRetry, KeyExpiryError, Retry
from keyexpiry.listener import Listener
from keyexpiry.registry import Registry, default_registry, exposed, task
from keyexpiry.rows import TaskRow, TaskStatus
from keyexpiry.scheduling import Did, IfExists, Scheduled
from keyexpiry.settings import Settings

__all__ = [
    "Client",
    "Did",
    "DoNotRetry",
    "IfExists",
    "KeyExpiryError",
    "Listener",
    "Registry",
    "Retry",
    "Scheduled",
    "Settings",
    "TaskContext",
    "TaskRequest",
    "TaskRow",
    "TaskStatus",
    "current",
    "default_registry",
    "exposed",
    "task",
]
__version__ = "0.1.0"
