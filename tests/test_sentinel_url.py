"""`redis+sentinel://` URLs: parsed into sentinels, service, database, credentials and options;
malformed ones refused with a ConfigError that says why (pure logic, no server)."""

from __future__ import annotations

from pathlib import Path

import pytest

from keyexpiry import Settings
from keyexpiry.errors import ConfigError
from keyexpiry.masking import mask_url
from keyexpiry.redis.sentinel import SentinelURL, is_sentinel_url, parse_sentinel_url
from tests.test_deploy import load_yaml


def test_a_full_url_is_parsed() -> None:
    url = (
        "redis+sentinel://ke:s%40cret@10.0.0.1:26379,10.0.0.2:26380,[::1]:26381,sentinel-c"
        "/orders/3?sentinel_password=spw&sentinel_username=watch&socket_timeout=2.5"
        "&health_check_interval=7&client_name=ke"
    )
    parsed = parse_sentinel_url(url)
    assert parsed == SentinelURL(
        sentinels=(
            ("10.0.0.1", 26379),
            ("10.0.0.2", 26380),
            ("::1", 26381),
            ("sentinel-c", 26379),
        ),
        service="orders",
        db=3,
        username="ke",
        password="s@cret",
        sentinel_username="watch",
        sentinel_password="spw",
        tls=False,
        options=(("socket_timeout", 2.5), ("health_check_interval", 7), ("client_name", "ke")),
    )
    assert "s@cret" not in repr(parsed) and "spw" not in repr(parsed)


def test_the_short_form_and_tls() -> None:
    parsed = parse_sentinel_url("rediss+sentinel://127.0.0.1:5000/mymaster")
    assert parsed.sentinels == (("127.0.0.1", 5000),)
    assert (parsed.service, parsed.db, parsed.tls) == ("mymaster", 0, True)
    assert parsed.username is parsed.password is parsed.sentinel_password is None
    assert parse_sentinel_url("redis+sentinel://h/svc/").db == 0  # a trailing slash


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis+sentinel:///svc", "names no sentinel"),
        ("redis+sentinel://user:pw@/svc", "names no sentinel"),
        ("redis+sentinel://h1:26379", "service name"),
        ("redis+sentinel://h1:26379/", "service name"),
        ("redis+sentinel://h1:26379/svc/0/extra", "service name"),
        ("redis+sentinel://h1:26379/svc/zero", "database must be a number"),
        ("redis+sentinel://h1:26379/svc/-1", "database must be a number"),
        ("redis+sentinel://h1:port/svc", "not a port number"),
        ("redis+sentinel://h1:70000/svc", "not a port number"),
        ("redis+sentinel://h1:0/svc", "not a port number"),
        ("redis+sentinel://h1,,h2/svc", "is not host:port"),
        ("redis+sentinel://:26379/svc", "is not host:port"),
        ("redis+sentinel://h1/svc?db=2", "database in the path"),
        ("redis+sentinel://h1/svc?socket_timeout=soon", "Invalid value for 'socket_timeout'"),
        ("redis+sentinel://h1/svc?sockettimeout=1", "unknown option(s) sockettimeout"),
    ],
)
def test_a_malformed_url_is_refused_with_the_reason(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_sentinel_url(url)
    with pytest.raises(ConfigError, match="redis_url"):
        Settings(redis_url=url, state_dir=Path("/nonexistent"))


def test_settings_accept_a_sentinel_url_and_mask_both_passwords() -> None:
    url = "redis+sentinel://ke:pw1@h1:26379,h2:26379/svc/1?sentinel_password=pw2&socket_timeout=3"
    settings = Settings(redis_url=url, state_dir=Path("/nonexistent"))
    shown = mask_url(settings.redis_url)
    assert shown == (
        "redis+sentinel://ke:***@h1:26379,h2:26379/svc/1?sentinel_password=***&socket_timeout=3"
    )
    assert "pw1" not in repr(settings) and "pw2" not in repr(settings)


def test_only_sentinel_schemes_are_sentinel_urls() -> None:
    assert is_sentinel_url("redis+sentinel://h/svc")
    assert is_sentinel_url("REDISS+SENTINEL://h/svc")
    assert not is_sentinel_url("redis://h:6379/0")
    assert not is_sentinel_url("unix:///run/redis.sock")
    assert not is_sentinel_url(None)
    with pytest.raises(ConfigError, match="not a Sentinel URL"):
        parse_sentinel_url("redis://h:6379/0")


def test_the_sentinel_compose_file_names_its_own_sentinels() -> None:
    compose = load_yaml("sentinel/compose.yaml")
    services = compose["services"]
    url = services["listener"]["environment"]["KEYEXPIRY_REDIS_URL"]
    parsed = parse_sentinel_url(url)
    assert {host for host, _ in parsed.sentinels} == {"sentinel-1", "sentinel-2", "sentinel-3"}
    for host, port in parsed.sentinels:
        script = services[host]["command"][-1]
        assert f"sentinel monitor {parsed.service} redis-a 6379 2" in script
        assert f"--port {port}" in script
    for node in ("redis-a", "redis-b"):  # a promoted replica must announce expired keys too
        command = services[node]["command"]
        assert "E" in command[command.index("--notify-keyspace-events") + 1]
