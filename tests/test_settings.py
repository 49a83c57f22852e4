"""Settings: env parsing, precedence, validation messages, passwords never shown."""

from __future__ import annotations

from pathlib import Path

import pytest

from keyexpiry.errors import ConfigError
from keyexpiry.masking import mask_url
from keyexpiry.settings import Settings


def test_env_then_flags_precedence() -> None:
    env = {
        "KEYEXPIRY_CONCURRENCY": "3",
        "KEYEXPIRY_TASKS": "a.b, c",
        "KEYEXPIRY_RETRY_SCHEDULE_S": "1,2.5",
        "KEYEXPIRY_CONFIGURE_REDIS": "yes",
        "KEYEXPIRY_STATE_DIR": "/tmp/x",
    }
    s = Settings.from_env(env)
    assert s.concurrency == 3
    assert s.tasks == ("a.b", "c")
    assert s.retry_schedule_s == (1.0, 2.5)
    assert s.configure_redis is True
    assert s.state_dir == Path("/tmp/x")
    assert Settings.from_env(env, concurrency=5, tasks=None).concurrency == 5


@pytest.mark.parametrize(
    "env, message",
    [
        ({"KEYEXPIRY_CONCURRENCY": "many"}, "KEYEXPIRY_CONCURRENCY='many' is invalid"),
        ({"KEYEXPIRY_CONCURRENCY": "0"}, "concurrency must be from 1 to 1024, got 0"),
        ({"KEYEXPIRY_CONFIGURE_REDIS": "perhaps"}, "expected true or false"),
        ({"KEYEXPIRY_REDIS_URL": "localhost:6379"}, "is not a URL"),
        ({"KEYEXPIRY_KEY_PREFIX": "a@b"}, "must not contain '@'"),
    ],
)
def test_bad_settings_say_what_is_allowed(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Settings.from_env(env)


def test_passwords_are_masked() -> None:
    s = Settings(
        redis_url="redis://app:s3cret@db:6379/0",
        database_url="mysql+pymysql://u:hunter2@h/x",
    )
    assert "s3cret" not in repr(s) and "hunter2" not in repr(s)
    assert mask_url("rediss://:pw@h:1/0") == "rediss://:***@h:1/0"
    assert mask_url(None) == "(embedded)"
