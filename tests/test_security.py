"""Credentials: ACL users, TLS, and passwords that never reach logs or error messages."""

from __future__ import annotations

import contextlib
import shutil
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from loguru import logger
from redis.backoff import NoBackoff
from redis.retry import Retry
from typer.testing import CliRunner

from keyexpiry import Client, Listener, Settings, TaskRequest
from keyexpiry.bench.servers import LOOPBACK, RedisServer, wait_until
from keyexpiry.cli import app
from keyexpiry.errors import RedisConfigError, RedisUnavailableError
from keyexpiry.masking import mask_url
from tests.conftest import REDIS_SERVER, RedisFactory, _require
from tests.ke import Running, make_settings
from tests.reliability import Verdict

StartListener = Callable[[Settings], Running]
PASSWORD = "s3cret-Pw-4711"
WRONG = "wr0ng-Pw-0815"


@pytest.fixture
def log_lines() -> Iterator[list[str]]:
    """Every loguru line of the test, tracebacks with local variables included (loguru's
    default when an application never configured logging), so nothing can hide there."""
    lines: list[str] = []
    sink = logger.add(lines.append, level="DEBUG", format="{level} {message}", diagnose=True)
    yield lines
    with contextlib.suppress(ValueError):  # a CLI call in the test may have reset the sinks
        logger.remove(sink)


def acl_user(server: RedisServer, *rules: str) -> str:
    """ACL user `ke` with PASSWORD on `server` (all keys, channels and commands unless `rules`
    say otherwise); return its plain-TCP URL."""
    admin = server.client()
    try:
        admin.execute_command(
            "ACL", "SETUSER", "ke", "on", f">{PASSWORD}", *(rules or ("~*", "&*", "+@all"))
        )
    finally:
        admin.close()
    return f"redis://ke:{PASSWORD}@{LOOPBACK}:{server.port}/0"


def test_passwords_are_masked_in_userinfo_and_query() -> None:
    assert mask_url("redis://ke:pw@[::1]:6379/0") == "redis://ke:***@[::1]:6379/0"
    assert mask_url("unix:///run/r.sock?db=1&password=pw") == "unix:///run/r.sock?db=1&password=***"
    assert (
        mask_url("rediss://ke:pw@h:1/0?ssl_ca_certs=/ca.pem&Password=pw")
        == "rediss://ke:***@h:1/0?ssl_ca_certs=/ca.pem&Password=***"
    )
    assert mask_url("sqlite:////tmp/x.db") == "sqlite:////tmp/x.db"


# -- ACL ---------------------------------------------------------------------------------------


def test_acl_user_without_channel_permission_fails_at_start_up(
    redis_factory: RedisFactory, sqlite_url: str, tmp_path: Path, log_lines: list[str]
) -> None:
    server = redis_factory()
    url = acl_user(server, "~*", "resetchannels", "+@all")
    listener = Listener(make_settings(url, sqlite_url, tmp_path))
    raised: list[BaseException] = []

    def run() -> None:
        try:
            listener.run()
        except BaseException as exc:
            raised.append(exc)

    before = set(threading.enumerate())
    thread = threading.Thread(target=run, daemon=True)
    started_s = time.monotonic()
    thread.start()
    thread.join(15)
    if thread.is_alive():  # the bug: NOPERM retried forever
        listener.stop()
        thread.join(15)
        pytest.fail("the listener kept retrying a subscription its ACL user may not make")
    # Its threads stop with it, not waited out for 5 s each while they go on working.
    assert time.monotonic() - started_s < 3.0
    left = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    assert "keyexpiry-reconcile" not in left, left
    (exc,) = raised
    assert isinstance(exc, RedisConfigError)
    assert "may not subscribe to __keyevent@0__:expired" in str(exc)
    assert "ACL SETUSER ke &__keyevent@0__:expired" in str(exc)
    assert not [line for line in log_lines if "this user has no permissions" in line]
    assert PASSWORD not in str(exc) + "".join(log_lines)


def test_wrong_password_is_one_clear_cli_error_without_the_password(
    redis_factory: RedisFactory, sqlite_url: str, tmp_path: Path
) -> None:
    server = redis_factory()
    good = acl_user(server)
    with Client(make_settings(good, sqlite_url, tmp_path)) as c:
        c.create("Probe.record", "secret", ttl_s=600)
    env = {
        "KEYEXPIRY_REDIS_URL": good.replace(PASSWORD, WRONG),
        "KEYEXPIRY_DATABASE_URL": sqlite_url,
        "KEYEXPIRY_STATE_DIR": str(tmp_path / "state"),
        "KEYEXPIRY_TASKS": "tests.sample_tasks",
    }
    runner = CliRunner()
    for args in (["show", "Probe", "record", "secret"], ["doctor"]):
        result = runner.invoke(app, args, env=env)
        output = result.stdout + result.stderr
        assert result.exit_code == 1, output
        assert result.exception is None or isinstance(result.exception, SystemExit), output
        assert "Traceback" not in output
        assert WRONG not in output and PASSWORD not in output
    show = runner.invoke(app, ["show", "Probe", "record", "secret"], env=env)
    assert show.stderr.startswith("error: Redis refused the credentials"), show.stderr
    assert len(show.stderr.strip().splitlines()) == 1


def test_listener_with_a_wrong_password_keeps_retrying_and_logs_no_password(
    redis_factory: RedisFactory, sqlite_url: str, tmp_path: Path, log_lines: list[str]
) -> None:
    server = redis_factory()
    url = acl_user(server).replace(PASSWORD, WRONG)
    listener = Listener(make_settings(url, sqlite_url, tmp_path))
    thread = threading.Thread(target=listener.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: sum("refused the credentials" in line for line in log_lines) >= 2, 10)
        assert listener.problem is not None and "refused the credentials" in listener.problem
        assert thread.is_alive()
    finally:
        listener.stop()
        thread.join(15)
    text = "".join(log_lines)
    assert WRONG not in text
    assert f"redis://ke:***@{LOOPBACK}:{server.port}/0" in text  # the start-up line, masked


# -- TLS ---------------------------------------------------------------------------------------


class TlsRedisServer(RedisServer):
    """redis-server answering TLS only (`--port 0`), its certificate signed by `ca`."""

    def __init__(self, workdir: Path, *, certs: dict[str, Path], binary: str) -> None:
        super().__init__(workdir, binary=binary)
        self.certs = certs

    def url(self, db: int = 0) -> str:
        return f"rediss://{LOOPBACK}:{self.port}/{db}?ssl_ca_certs={self.certs['ca']}"

    def client(self, db: int = 0, **kwargs: Any) -> redis.Redis:
        # The harness's own client takes older certificates too (the tests' clients are what
        # the URLs make them).
        return redis.Redis(
            host=LOOPBACK,
            port=self.port,
            db=db,
            ssl=True,
            ssl_ca_certs=str(self.certs["ca"]),
            ssl_exclude_verify_flags=[ssl.VerifyFlags.VERIFY_X509_STRICT],
            **kwargs,
        )

    def _command(self) -> list[str]:
        return [
            *super()._command(),
            "--port", "0",
            "--tls-port", str(self.port),
            "--tls-cert-file", str(self.certs["cert"]),
            "--tls-key-file", str(self.certs["key"]),
            "--tls-ca-cert-file", str(self.certs["ca"]),
            "--tls-auth-clients", "no",
        ]  # fmt: skip

    def _admin_client(self, timeout_s: float) -> redis.Redis:
        return self.client(
            socket_connect_timeout=timeout_s,
            socket_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
        )


def make_certs(directory: Path, *, strict: bool = True) -> dict[str, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1, made with the openssl CLI.

    Both carry what strict verification (Python 3.13's default `VERIFY_X509_STRICT`) requires:
    the CA a critical basicConstraints and a keyUsage that allows signing certificates, the
    server certificate its names in subjectAltName and the key that signed it
    (authorityKeyIdentifier).
    """
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("the openssl command is not installed")
    directory.mkdir(parents=True, exist_ok=True)
    p = {n: directory / f"{n}.pem" for n in ("ca", "ca-key", "cert", "key", "csr")}
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True, timeout=30)

    # Without `strict`: what older tooling made, and strict verification refuses (a CA whose
    # basicConstraints is not critical, no keyUsage; a server certificate with its names only).
    ca_ext = (
        ["-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,keyCertSign,cRLSign",
         "-addext", "subjectKeyIdentifier=hash"]
        if strict
        else ["-addext", "basicConstraints=CA:TRUE"]
    )  # fmt: skip
    run("req", "-x509", *ec, "-keyout", str(p["ca-key"]), "-out", str(p["ca"]), "-days", "1",
        "-subj", "/CN=keyexpiry test CA", *ca_ext)  # fmt: skip
    run("req", *ec, "-keyout", str(p["key"]), "-out", str(p["csr"]), "-subj", f"/CN={LOOPBACK}")
    ext = directory / "ext.cnf"
    names = f"subjectAltName=IP:{LOOPBACK},DNS:localhost\n"
    ext.write_text(
        names + "basicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth,clientAuth\n"
        "subjectKeyIdentifier=hash\n"
        "authorityKeyIdentifier=keyid,issuer\n"
        if strict
        else names
    )
    run("x509", "-req", "-in", str(p["csr"]), "-CA", str(p["ca"]), "-CAkey", str(p["ca-key"]),
        "-CAcreateserial", "-out", str(p["cert"]), "-days", "1", "-extfile", str(ext))  # fmt: skip
    return p


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[TlsRedisServer]:
    """A TLS-only Redis with ACL user `ke`, killed at teardown."""
    server = TlsRedisServer(
        tmp_path / "redis-tls", certs=make_certs(tmp_path / "certs"), binary=_require(REDIS_SERVER)
    )
    server.start()
    try:
        acl_user(server)
        yield server
    finally:
        server.kill()


def test_tls_with_an_acl_user_creates_listens_and_runs(
    tls_server: TlsRedisServer,
    db_url: str,
    tmp_path: Path,
    start_listener: StartListener,
    verdict: Verdict,
    log_lines: list[str],
) -> None:
    url = tls_server.url().replace("rediss://", f"rediss://ke:{PASSWORD}@")
    cfg = make_settings(url, db_url, tmp_path)
    with Client(cfg) as c:
        running = start_listener(cfg)
        keys = c.create_many(
            TaskRequest("Probe.record", (f"tls{i}",), ttl_ms=200 + 50 * i) for i in range(5)
        )
        verdict.check(c, keys)
        assert running.listener.status()["problem"] is None
    text = "".join(log_lines)
    assert PASSWORD not in text and PASSWORD not in repr(cfg)
    assert f"rediss://ke:***@{LOOPBACK}:{tls_server.port}/0?ssl_ca_certs=" in text


def test_older_certificates_pass_with_the_strict_check_excluded_in_the_url(
    tmp_path: Path, redis_url: str
) -> None:
    """Python 3.13 verifies strictly by default and refuses certificates older tooling made;
    README's remedy, short of re-issuing them, is redis-py's URL option. Strict verification is
    asked for here explicitly, so this shows the refusal and the remedy on every Python."""
    server = TlsRedisServer(
        tmp_path / "redis-tls",
        certs=make_certs(tmp_path / "certs", strict=False),
        binary=_require(REDIS_SERVER),
    )
    server.start()
    try:
        strict = f"{server.url()}&ssl_include_verify_flags=VERIFY_X509_STRICT"
        refused = make_settings(strict, f"sqlite:///{tmp_path / 'a.db'}", tmp_path)
        with pytest.raises(RedisUnavailableError), Client(refused) as c:
            c.create("Probe.record", "old-cert", ttl_s=60)
        relaxed = f"{strict}&ssl_exclude_verify_flags=VERIFY_X509_STRICT"
        with Client(make_settings(relaxed, f"sqlite:///{tmp_path / 'b.db'}", tmp_path)) as c:
            assert c.create("Probe.record", "old-cert", ttl_s=60) == "Probe@record@old-cert"
    finally:
        server.kill()
