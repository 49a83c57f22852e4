"""The fault suite's verdicts, and docs/RELIABILITY.md built from them.

A fault test ends with ``verdict.check(client, keys, ...)``: it waits for every task to
finish, counts how often each ran, records one row (scenario, tasks, run once, run
twice, lost, time to recover) and then asserts. Each pytest process appends its rows to
``build/reliability/<worker>.jsonl``; the controlling process merges them at the end of
the session into ``build/RELIABILITY.md`` (``make reliability`` copies it to docs/).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

from keyexpiry import Client
from keyexpiry.ledger.store import TaskStatus
from tests import sample_tasks

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "build" / "reliability"
REPORT = ROOT / "build" / "RELIABILITY.md"


@dataclass(frozen=True)
class Row:
    """One scenario's outcome, as the report shows it."""

    scenario: str
    backend: str
    tasks: int
    run_once: int
    run_twice: int
    lost: int
    recover_s: float
    guarantee: str
    cancelled: int = 0
    """Tasks a truthful cancel stopped: each has no run and status cancelled."""


ENGINES = ("sqlite", "mariadb", "postgres")
"""The ledgers a fault scenario runs on, as its rows name them (and its test ids spell them)."""


class Verdict:
    """Counts how each task of a scenario ended, records it, then asserts it."""

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self._request = request
        node = request.node
        params = getattr(getattr(node, "callspec", None), "params", {})
        # The ledger: a parametrised URL fixture's value, an `engine` parameter, or the
        # fixtures the test uses (a server of its own); SQLite otherwise.
        named = {"mysql": "mariadb", "pg": "postgres", "sqlite": "sqlite"}
        db = params.get("db_url") or params.get("server_db_url")
        fixtures = set(request.fixturenames)
        if db in named:
            self.backend = named[db]
        elif params.get("engine") in ENGINES:
            self.backend = str(params["engine"])
        elif {"pg_url", "postgres_factory"} & fixtures:
            self.backend = "postgres"
        elif {"mysql_url", "mariadb_factory", "galera_cluster"} & fixtures:
            self.backend = "mariadb"
        else:
            self.backend = "sqlite"
        ids = getattr(getattr(node, "callspec", None), "id", "")
        variant = [part for part in _id_parts(ids) if part not in ENGINES]
        name = node.originalname.removeprefix("test_").replace("_", " ")
        self.scenario = name + (f" [{', '.join(variant)}]" if variant else "")

    def check(
        self,
        client: Client,
        keys: Sequence[str],
        *,
        since_ms: int | None = None,
        timeout_s: float = 30.0,
        at_least_once: bool = False,
        calls: Mapping[str, int] | None = None,
        cancelled: Sequence[str] = (),
        fault_at_ms: int | None = None,
    ) -> Row:
        """Wait until every key is done (or `timeout_s` passes), record, then assert.

        `since_ms` is when the fault ended (Redis clock); recovery is measured from it,
        or from the last due time when it is later. `at_least_once` is for the
        documented crash windows, where a second run is allowed. `calls` counts handler
        runs (default: the in-process sample tasks). `cancelled` lists tasks whose
        cancel returned True: each must be `cancelled` in the ledger and never have run.
        `fault_at_ms`, when given, is where recovery is measured from, whatever the due times
        (a requeue moves them).
        """
        deadline = time.monotonic() + timeout_s
        out = list(keys)
        while True:
            got = client.store.get_many(out)
            out = [k for k in out if k not in got or got[k].status is not TaskStatus.DONE]
            if not out or time.monotonic() >= deadline:
                break
            # Each poll reads every row still out, in this process, beside the listeners under
            # test: 10k rows read every 20 ms took most of the CPU of a 2-core machine and made
            # the scenario itself several times slower. A wide poll waits longer.
            time.sleep(min(0.5, 0.02 + len(out) * 20e-6))
        rows = client.store.get_many(list(keys))
        counts = sample_tasks.CALLS if calls is None else calls
        runs = [counts.get(k, 0) for k in keys]
        stopped = client.store.get_many(list(cancelled))
        # A cancelled task that ran anyway (or is not cancelled) is reported as run twice:
        # cancel said it would not run, so any run is one too many.
        untruthful = [
            k
            for k in cancelled
            if counts.get(k, 0) or k not in stopped or stopped[k].status is not TaskStatus.CANCELLED
        ]
        done = [r for r in rows.values() if r.status is TaskStatus.DONE]
        start_ms = max([r.due_at_ms for r in rows.values()] + [since_ms or 0])
        if fault_at_ms is not None:
            start_ms = fault_at_ms
        end_ms = max((r.finished_at_ms or 0 for r in done), default=start_ms)
        row = Row(
            scenario=self.scenario,
            backend=self.backend,
            tasks=len(keys) + len(cancelled),
            run_once=sum(1 for n in runs if n == 1),
            run_twice=sum(1 for n in runs if n > 1) + len(untruthful),
            lost=sum(1 for n in runs if n == 0),
            recover_s=round(max(0, end_ms - start_ms) / 1000, 2),
            guarantee="at least once" if at_least_once else "exactly once",
            cancelled=len(cancelled) - len(untruthful),
        )
        _append(self._request.config, row)
        late = [r.key for r in rows.values() if r.started_at_ms and r.started_at_ms < r.due_at_ms]
        assert not late, f"ran before due: {late[:5]}"
        not_done = [k for k in keys if k not in rows or rows[k].status is not TaskStatus.DONE]
        assert not not_done, f"{len(not_done)} not done within {timeout_s} s, e.g. {not_done[:3]}"
        assert row.lost == 0, row
        assert not untruthful, f"cancel said True but ran or is not cancelled: {untruthful[:5]}"
        if not at_least_once:
            assert row.run_twice == 0, row
        return row


def _id_parts(ids: str) -> list[str]:
    """The parameter ids pytest joined with "-"; an empty part marks a minus sign ("-10m")."""
    parts: list[str] = []
    sign = ""
    for part in ids.split("-"):
        if not part:
            sign = "-"
            continue
        parts.append(sign + part)
        sign = ""
    return parts


@pytest.fixture
def verdict(request: pytest.FixtureRequest) -> Verdict:
    """``verdict.check(client, keys)``: wait, record for RELIABILITY.md, assert."""
    return Verdict(request)


def _worker(config: pytest.Config) -> str:
    workerinput = getattr(config, "workerinput", None)
    return str(workerinput["workerid"]) if workerinput else "main"


def _append(config: pytest.Config, row: Row) -> None:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    with (OUT_DIR / f"{_worker(config)}.jsonl").open("a") as fh:
        fh.write(json.dumps(asdict(row)) + "\n")


def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):
        shutil.rmtree(OUT_DIR, ignore_errors=True)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if hasattr(session.config, "workerinput") or not OUT_DIR.is_dir():
        return
    rows = sorted(_read_rows(), key=lambda r: (r.scenario, r.backend))
    if rows:
        REPORT.write_text(render(rows))
        target = os.environ.get("KEYEXPIRY_RELIABILITY_OUT")
        if target:
            shutil.copyfile(REPORT, target)


def _read_rows() -> Iterator[Row]:
    for path in sorted(OUT_DIR.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            yield Row(**json.loads(line))


SOAK_DIR = ROOT / "docs" / "soak"
"""The soak run docs/RELIABILITY.md shows: its `soak.json` and plots, copied from
`bench-results/soak/<time>/` (`keyexpiry bench --scenario soak --minutes 60`)."""


def _soak_section() -> list[str]:
    path = SOAK_DIR / "soak.json"
    if not path.exists():
        return []
    from keyexpiry.bench.soak import markdown

    try:
        section = markdown(json.loads(path.read_text()), "soak")
    except (ValueError, KeyError, TypeError) as exc:
        # The fault suite's table must still be written: say what is wrong with the soak's.
        return [f"(docs/soak/soak.json could not be shown: {exc!r})", ""]
    hours = SOAK_DIR / "hours.md"
    if hours.exists():
        # Written by hand (every topology's hours, which one is shown): kept under the heading
        # when the section is built again, where an edit of RELIABILITY.md itself was lost.
        heading, _, rest = section.partition("\n\n")
        section = f"{heading}\n\n{hours.read_text().strip()}\n\n{rest}"
    return [section, ""]


def render(rows: Sequence[Row]) -> str:
    """The Markdown report for `rows`."""
    lines = [
        "# Reliability: the soak's and the fault suite's results",
        "",
        "Two kinds of evidence: an endurance soak (a fleet under steady load, hit by one fault",
        "after another for an hour, judged from its recorded history) and the fault suite",
        "(each fault alone, on every ledger engine). The soak on the other topologies (PostgreSQL,",
        "a Redis Cluster) and what those runs found: docs/ENDURANCE.md.",
        "",
        *_soak_section(),
        "## The fault suite",
        "",
        "Produced by `make reliability` (runs `tests/faults/` against real redis-server and",
        "SQLite, MariaDB (one server, or Galera behind HAProxy) or PostgreSQL (one server, or a",
        "primary with a standby) and writes this file); every row is one scenario's ledger and",
        "handler counts. *Recover* is the time from the later of the fault's end and the last due",
        "time to the last task finished; for a listener killed or paused, from the kill or pause.",
        "*Cancelled*: tasks whose cancel returned True, none of which ran. See",
        "docs/GUARANTEES.md for what is promised.",
        "",
        "| scenario | ledger | tasks | run once | run twice | lost | cancelled | recover (s) "
        "| promise |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.scenario} | {r.backend} | {r.tasks} | {r.run_once} | {r.run_twice} "
            f"| {r.lost} | {r.cancelled} | {r.recover_s:.2f} | {r.guarantee} |"
        )
    total = sum(r.tasks for r in rows)
    lost = sum(r.lost for r in rows)
    twice = sum(r.run_twice for r in rows)
    cancelled = sum(r.cancelled for r in rows)
    lines += [
        "",
        f"{len(rows)} scenario runs, {total} tasks, {lost} lost, {twice} run twice, "
        f"{cancelled} cancelled.",
        "",
    ]
    return "\n".join(lines)
