"""`keyexpiry bench`: the benchmark's scenarios against real servers started for the run, and
the soak."""

from __future__ import annotations

from pathlib import Path

import typer

from keyexpiry.cli.common import known_errors
from keyexpiry.errors import ConfigError

app = typer.Typer()


@app.command()
@known_errors
def bench(
    scenario: list[str] = typer.Option(
        None,
        "--scenario",
        help="steady, sparse, burst, throughput, create, listeners (the default: all six); "
        "ledger, aio, cluster, memory, flow, run-now, django, churn, soak (only when named).",
    ),
    minutes: float = typer.Option(
        10.0,
        "--minutes",
        min=0.5,
        help="soak: minutes of load and faults (--quick: 2); churn: minutes of load.",
    ),
    runs: int = typer.Option(3, "--runs", min=1, help="Runs per scenario and variant."),
    backend: str = typer.Option(
        "mariadb",
        "--backend",
        help="mariadb, postgres or sqlite; several, comma-separated, run side by side "
        "(e.g. mariadb,postgres). soak: mariadb, postgres, or patroni / patroni-sync "
        "(PostgreSQL under Patroni, asynchronous / synchronous replication).",
    ),
    quick: bool = typer.Option(
        False, "--quick", help="A fifth of the sizes (ledger: 1 M rows, not 10 M)."
    ),
    out: Path = typer.Option(Path("bench-results/latest.json"), "--json", help="Write here."),
    redis: str = typer.Option(
        "sentinel",
        "--redis",
        help="soak: the Redis it runs on, sentinel (with HAProxy) or cluster.",
    ),
    network: bool = typer.Option(
        False,
        "--network",
        help="soak: one listener in a network namespace of its own, and partitions from Redis "
        "and from the ledger and 200 ms ± 100 ms latency with 5 % loss in the rotation (root).",
    ),
    peers: bool = typer.Option(
        True,
        "--peers/--no-peers",
        help="Also run steady on huey and arq, run-now on Celery, Dramatiq, RQ, arq and huey "
        "(needs the `peers` extra; skipped with a note).",
    ),
) -> None:
    """Benchmark against real servers started for the run (redis-server, and mariadbd or
    PostgreSQL for those backends, from the system)."""
    from keyexpiry.bench.run import DEFAULT_SCENARIOS, SCENARIOS, run

    names = list(scenario or DEFAULT_SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    backends = backend.split(",")
    soak_only = {"patroni", "patroni-sync"} if "soak" in names else set()
    if unknown or not set(backends) <= {"mariadb", "postgres", "sqlite", *soak_only}:
        raise ConfigError(f"unknown scenario/backend: {unknown or backend}")
    if "soak" in names:
        others = [n for n in names if n != "soak"]
        _soak(minutes, quick=quick, others=others, backends=backends, redis=redis, network=network)
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    run(names, runs=runs, backend=backend, quick=quick, out=out, peers=peers, minutes=minutes)
    typer.echo(f"figures written to {out}")


def _soak(
    minutes: float,
    *,
    quick: bool,
    others: list[str],
    backends: list[str],
    redis: str,
    network: bool = False,
) -> None:
    """`bench --scenario soak`: its own servers (Redis behind Sentinel and HAProxy, or a Redis
    Cluster, `--redis`; the ledger of `--backend`: MariaDB, PostgreSQL, or PostgreSQL under
    Patroni), its own report."""
    from dataclasses import replace

    from keyexpiry.bench import soak

    patroni_ledgers = ("patroni", "patroni-sync")

    if others:
        raise ConfigError(f"soak runs alone, not with {', '.join(others)}")
    if len(backends) != 1 or backends[0] not in ("mariadb", "postgres", *patroni_ledgers):
        raise ConfigError(
            "the soak's ledger is one of mariadb, postgres, patroni, patroni-sync (--backend)"
        )
    if redis not in ("sentinel", "cluster"):
        raise ConfigError("the soak's Redis is sentinel or cluster (--redis)")
    if network:
        from keyexpiry.bench.servers.netns import available

        if why := available():
            raise ConfigError(f"--network: {why}")
    cfg = soak.SoakConfig.quick(minutes if minutes != 10.0 else 2.0) if quick else None
    cfg = replace(
        cfg or soak.SoakConfig(minutes=minutes), ledger=backends[0], redis=redis, network=network
    )
    report = soak.run(cfg, Path("bench-results/soak"))
    verdict = report["verdict"]
    typer.echo(soak.summary(report))
    typer.echo(f"history, soak.json and plots in {report['run_dir']}")
    if not verdict.get("passed"):
        raise typer.Exit(1)
