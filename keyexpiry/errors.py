"""The one exception tree of keyexpiry; the CLI turns each into a message and exit code 1."""


class KeyExpiryError(Exception):
    """Raised when keyexpiry cannot do what was asked; the root of every keyexpiry error."""


class ConfigError(KeyExpiryError):
    """Raised when a setting is missing, malformed or out of its allowed range."""


class KeyFormatError(KeyExpiryError):
    """Raised when a task key cannot be built or parsed (bad name, too long, bad escaping)."""


class UnknownTaskError(KeyExpiryError):
    """Raised when a class or method is not registered and exposed as a task."""


class ArgumentError(KeyExpiryError):
    """Raised when task arguments have the wrong count or cannot be converted to their types."""


class TaskNotFoundError(KeyExpiryError):
    """Raised when no ledger row exists for a task key."""


class NotPendingError(KeyExpiryError):
    """Raised when an operation needs a pending task but the task is in another state."""


class StoreError(KeyExpiryError):
    """Raised when the SQL ledger cannot be reached or a statement against it fails."""

    disconnected: bool = False
    """True when the connection was lost (the statement may be retried on a new one)."""
    lock_timeout: bool = False
    """True when a row lock held by another transaction outlasted the server's lock wait."""
    maybe_applied: bool = False
    """True when the connection was lost after the statement or COMMIT reached the server: it
    may have been committed (its answer is what was lost)."""


class RedisUnavailableError(KeyExpiryError):
    """Raised when Redis cannot be reached or refuses a command."""


class RedisConfigError(KeyExpiryError):
    """Raised when Redis is configured so that expiry events cannot reach keyexpiry."""


class EmbeddedServerError(KeyExpiryError):
    """Raised when the embedded redis-server cannot be started or reached."""


class DoNotRetry(Exception):
    """Raised by a handler when a failure is final: the task goes to `dead` without retries."""


class Retry(Exception):
    """Raised by a handler to ask for another attempt, optionally after `delay_s` seconds."""

    def __init__(self, message: str = "retry requested", *, delay_s: float | None = None) -> None:
        super().__init__(message)
        self.delay_s = delay_s
