"""What a new Redis connection sends before its first command: nothing that a health check can
misread.

redis-py 8 opens a connection with HELLO, then sends `CLIENT MAINT_NOTIFICATIONS ON` and two
`CLIENT SETINFO` in one flight and reads their replies after. Each send checks the connection's
health first, and a PING falling due between two of those sends (a thread held up for a
`health_check_interval` in the middle of a connect: a loaded machine, a 1 s interval) reads the
reply of the command before it as its own: `unknown subcommand 'MAINT_NOTIFICATIONS'` (or
`'SETINFO'`, servers before 7.2) fails a connect that was fine, and the listener logged it as an
unexpected error (a CI run, 2026-12-07). With the two left out, at most `SELECT` follows HELLO,
and a PING sent before it has no reply of another command to read.

Neither is something keyexpiry uses: maintenance notifications are Redis Enterprise's warning
of a planned move (keyexpiry reconnects and reconciles after any), and the library's name in
`CLIENT LIST` is cosmetic.
"""

from __future__ import annotations

import inspect
from typing import Any

from redis import Redis


def handshake_options() -> dict[str, Any]:
    """Client options that leave the maintenance notifications and the library's name out of a
    connection's handshake, as far as the installed redis-py has them (module docstring); a
    new config object per call, shared by no two clients."""
    params = inspect.signature(Redis.__init__).parameters
    options: dict[str, Any] = {}
    if "driver_info" in params:
        options["driver_info"] = None
    elif "lib_name" in params:
        options["lib_name"] = None
        options["lib_version"] = None
    if "maint_notifications_config" in params:
        from redis.maint_notifications import MaintNotificationsConfig

        options["maint_notifications_config"] = MaintNotificationsConfig(enabled=False)
    return options
