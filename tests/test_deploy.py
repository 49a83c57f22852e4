"""deploy/'s monitoring files: alert rules, scrape config and dashboard query only metrics
`/metrics` serves, and the units and compose file turn the endpoints on. No servers."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from keyexpiry.ops.endpoints import parse_bind
from keyexpiry.ops.metrics import NAMES
from keyexpiry.run_metrics import RunMetrics

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"

METRIC = re.compile(r"keyexpiry_[a-z_]+")
# Prometheus exposes a histogram as name_bucket/_count/_sum; only real histograms may take a
# suffix, so `keyexpiry_ledger_query_seconds_bucket` (a gauge) is still caught.
HISTOGRAMS = frozenset(
    family.name for family in RunMetrics().collect() if family.type == "histogram"
)
# Every listener reports the same ledger numbers: a sum multiplies them by the listener count.
SUMMED_LEDGER_GAUGE = re.compile(
    r"\bsum\s*(?:(?:by|without)\s*\([^)]*\)\s*)?\(\s*keyexpiry_(?:tasks|pending|overdue|schedule_\w+)\b"
)

ALERTS = (
    "KeyexpiryListenerDown",
    "KeyexpiryListenerNotReady",
    "KeyexpiryLatenessHigh",
    "KeyexpiryDeadTasks",
    "KeyexpiryOverdueGrowing",
    "KeyexpiryOverdueStuck",
    "KeyexpiryEventsNotArriving",
    "KeyexpiryThreadErrors",
    "KeyexpiryLedgerDown",
    "KeyexpiryScheduleNotSucceeding",
)


def load_yaml(name: str) -> Any:
    return yaml.safe_load((DEPLOY / name).read_text())


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in load_yaml("alerts.yml")["groups"] for rule in group["rules"]]


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    return data


def panel_exprs() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dashboard()["panels"] for t in p["targets"]]


def metric_names(expr: str) -> set[str]:
    names = set()
    for name in METRIC.findall(expr):
        for suffix in ("_bucket", "_count", "_sum"):
            if name.endswith(suffix) and name.removesuffix(suffix) in HISTOGRAMS:
                name = name.removesuffix(suffix)
                break
        names.add(name)
    return names


def test_metric_names_strips_only_histogram_suffixes() -> None:
    assert {"keyexpiry_lateness_seconds", "keyexpiry_handler_seconds"} == HISTOGRAMS
    expr = (
        "rate(keyexpiry_lateness_seconds_bucket[5m]) / keyexpiry_handler_seconds_count"
        " + keyexpiry_ledger_query_seconds_sum"
    )
    assert metric_names(expr) == {
        "keyexpiry_lateness_seconds",
        "keyexpiry_handler_seconds",
        "keyexpiry_ledger_query_seconds_sum",
    }


def test_alerts_are_the_documented_set() -> None:
    assert [rule["alert"] for rule in alert_rules()] == list(ALERTS)


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda rule: rule["alert"])
def test_alert_uses_served_metrics(rule: dict[str, Any]) -> None:
    names = metric_names(rule["expr"])
    assert names <= set(NAMES), f"{sorted(names - set(NAMES))} not in NAMES"
    # Only Prometheus' own `up` stands in for keyexpiry's metrics.
    assert names or "up{" in rule["expr"]
    assert not SUMMED_LEDGER_GAUGE.search(rule["expr"])


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda rule: rule["alert"])
def test_alert_says_what_and_what_to_do(rule: dict[str, Any]) -> None:
    annotations = rule.get("annotations", {})
    assert annotations.get("summary", "").strip()
    assert len(annotations.get("description", "").split()) >= 20
    assert rule.get("labels", {}).get("severity") in {"critical", "warning"}


def test_alerts_name_the_commands_that_help() -> None:
    text = " ".join(rule["annotations"]["description"] for rule in alert_rules())
    for command in ("keyexpiry doctor", "keyexpiry reconcile", "keyexpiry retry --dead"):
        assert command in text


def test_scrape_config_matches_the_alerts() -> None:
    config = load_yaml("prometheus.yml")
    assert config["rule_files"] == ["alerts.yml"]
    (job,) = [c for c in config["scrape_configs"] if c["job_name"] == "keyexpiry"]
    targets = [t for static in job["static_configs"] for t in static["targets"]]
    assert targets and all(t.endswith(":9464") for t in targets)
    # Alerts filtering on a job name nobody scrapes would never fire.
    jobs = {m for rule in alert_rules() for m in re.findall(r'job="([^"]*)"', rule["expr"])}
    assert jobs == {job["job_name"]}


@pytest.mark.parametrize(("title", "expr"), panel_exprs(), ids=lambda v: v)
def test_dashboard_uses_served_metrics(title: str, expr: str) -> None:
    names = metric_names(expr)
    assert names <= set(NAMES), f"{title}: {sorted(names - set(NAMES))} not in NAMES"
    assert names or "up{" in expr, f"{title}: no keyexpiry metric in {expr!r}"
    assert not SUMMED_LEDGER_GAUGE.search(expr), f"{title}: sums a ledger gauge"


def test_dashboard_is_importable_anywhere() -> None:
    dash = dashboard()
    assert dash["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    task = variables["task"]
    assert task["definition"] == "label_values(keyexpiry_runs_total, task)"
    assert task["query"]["query"] == task["definition"]
    panels = dash["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    # A hard-coded data source uid exists only in the Grafana the dashboard was exported from.
    for p in panels:
        for source in [p["datasource"], *(t["datasource"] for t in p["targets"])]:
            assert source == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, p["title"]


def test_compose_listener_serves_and_checks_readyz() -> None:
    listener = load_yaml("compose.yaml")["services"]["listener"]
    host, port = parse_bind(listener["environment"]["KEYEXPIRY_HTTP"])
    assert (host, port) == ("0.0.0.0", 9464)
    # The merge key must keep the shared settings, or the listener starts without Redis.
    assert "KEYEXPIRY_REDIS_URL" in listener["environment"]
    probe = " ".join(listener["healthcheck"]["test"])
    assert f"127.0.0.1:{port}/readyz" in probe and "urllib" in probe


def test_systemd_units_serve_http() -> None:
    plain = (DEPLOY / "keyexpiry-listen.service").read_text()
    (bind,) = re.findall(r"^Environment=KEYEXPIRY_HTTP=(\S+)$", plain, re.MULTILINE)
    assert parse_bind(bind) == ("127.0.0.1", 9464)
    template = (DEPLOY / "keyexpiry-listen@.service").read_text()
    (bind,) = re.findall(r"^ExecStart=.* --http (\S+)", template, re.MULTILINE)
    ports = [parse_bind(bind.replace("%i", str(n)))[1] for n in range(1, 10)]
    assert ports == list(range(9461, 9470))


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
@pytest.mark.parametrize(
    "args", [("check", "rules", "alerts.yml"), ("check", "config", "prometheus.yml")]
)
def test_promtool_accepts(args: tuple[str, ...]) -> None:
    done = subprocess.run(
        ["promtool", *args], cwd=DEPLOY, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_promtool_a_daily_schedule_alerts_26_hours_after_its_last_success(tmp_path: Path) -> None:
    """Two listeners report the same schedule (one alert, not two); a daily one fires after its
    interval plus 2 h; a paused one (no interval series) never does."""
    (rule,) = [r for r in alert_rules() if r["alert"] == "KeyexpiryScheduleNotSucceeding"]
    name = "reports:daily"

    def series(metric: str, instance: str, schedule: str, values: str) -> dict[str, str]:
        labels = f'job="keyexpiry",instance="{instance}",schedule="{schedule}"'
        return {"series": f"keyexpiry_schedule_{metric}{{{labels}}}", "values": values}

    case = {
        "rule_files": [str(DEPLOY / "alerts.yml")],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1h",
                "input_series": [
                    # Succeeded at Unix time 0, where promtool's clock starts.
                    series("last_success_timestamp_seconds", "a", name, "0x30"),
                    series("last_success_timestamp_seconds", "b", name, "0x30"),
                    series("interval_seconds", "a", name, "86400x30"),
                    series("interval_seconds", "b", name, "86400x30"),
                    series("last_success_timestamp_seconds", "a", "paused", "0x30"),
                ],
                "alert_rule_test": [
                    {"eval_time": "25h", "alertname": rule["alert"], "exp_alerts": []},
                    {
                        "eval_time": "27h",
                        "alertname": rule["alert"],
                        "exp_alerts": [
                            {
                                "exp_labels": {"severity": "warning", "schedule": name},
                                "exp_annotations": {
                                    "summary": f"keyexpiry schedule {name} has not succeeded "
                                    "for 1d 3h 0m 0s",
                                    "description": rule["annotations"]["description"].replace(
                                        "{{ $labels.schedule }}", name
                                    ),
                                },
                            }
                        ],
                    },
                ],
            }
        ],
    }
    (tmp_path / "schedule_test.yml").write_text(yaml.safe_dump(case))
    done = subprocess.run(
        ["promtool", "test", "rules", "schedule_test.yml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
