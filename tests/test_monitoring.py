"""deploy/monitoring's dashboard and alert rules, held to what `clefcore serve` exports and to what each alert
promises. Every PromQL expression is parsed, and each series, label and value it names must be one a live
server's /metrics exports (after traffic that gives every labelled series a sample) or one Prometheus adds
(TARGET_LABELS, PROMETHEUS_SERIES). The alerts are replayed through promtool's rule unit tests (required: .ci/run
installs it). The PrometheusRule's Kubernetes shape is tests/test_k8s.py's.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_harness import SUPPORT_TICKET, Server, ticket

yaml = pytest.importorskip("yaml")
promql_parser = pytest.importorskip("promql_parser")   # the test extras install it

MONITORING = Path(__file__).resolve().parent.parent / "deploy" / "monitoring"
DASHBOARD = MONITORING / "dashboard.json"
ALERTS = MONITORING / "alerts.yaml"
# Labels Prometheus adds to every target's series, whatever its discovery: the expressions group by these.
TARGET_LABELS = {"instance", "job"}
# Series Prometheus writes for every target itself, with those labels: whether its last scrape succeeded.
PROMETHEUS_SERIES = {"up"}
# Grafana's interval variables, as the range a panel would query
GRAFANA_INTERVALS = ("$__rate_interval", "$__interval", "$__range")
FAIL_MARKER = "MONITORING-FAULT"
CLOUDFLARE = "/client/v4/accounts/0123abc/ai/run/@cf/cloudflare/clef"   # SUPPORT_TICKET names model "clef"


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def prometheus_rule() -> dict:
    (rule,) = [d for d in yaml.safe_load_all(ALERTS.read_text()) if d]
    return rule


def alert_rules() -> list[dict]:
    return [r for group in prometheus_rule()["spec"]["groups"] for r in group["rules"]]


def panels(board: dict) -> list[dict]:
    """Every panel, those inside collapsed rows included."""
    out = []
    for panel in board["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


# --- what the expressions reference ------------------------------------------------------------------------

@dataclass(frozen=True)
class Expression:
    where: str            # for the failure message: the panel, variable or alert
    promql: str
    shown_labels: tuple[str, ...] = ()   # labels a legend or an annotation prints


def grafana_promql(text: str, variables: list[str]) -> str:
    """A panel's query as Prometheus would receive it: Grafana's interval variables as a range, the dashboard's
    own variables (regex-matched, multi-value) as a pattern that matches anything."""
    for name in GRAFANA_INTERVALS:
        text = text.replace(name, "5m")
    for name in variables:
        text = text.replace("${%s}" % name, ".+").replace("$" + name, ".+")
    assert "$" not in text, f"a Grafana variable the check does not know: {text}"
    return text


def legend_labels(legend: str) -> tuple[str, ...]:
    return tuple(re.findall(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}", legend))


def dashboard_expressions(board: dict) -> list[Expression]:
    variables = [v["name"] for v in board["templating"]["list"]]
    out = []
    for panel in panels(board):
        for target in panel.get("targets", []):
            out.append(Expression(f"panel {panel['title']!r} query {target['refId']}",
                                  grafana_promql(target["expr"], variables), legend_labels(target["legendFormat"])))
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            selector, label = re.fullmatch(r"label_values\((.+),\s*([a-zA-Z_]\w*)\)", variable["query"]).groups()
            out.append(Expression(f"variable {variable['name']!r}", grafana_promql(selector, variables), (label,)))
    return out


def rule_expressions(rules: list[dict]) -> list[Expression]:
    return [Expression(f"alert {r['alert']}", r["expr"],
                       tuple(label for text in r["annotations"].values()
                             for label in re.findall(r"\$labels\.([a-zA-Z_]\w*)", text)))
            for r in rules]


def all_expressions() -> list[Expression]:
    return dashboard_expressions(dashboard()) + rule_expressions(alert_rules())


@dataclass
class References:
    selectors: list = field(default_factory=list)     # promql_parser.VectorSelector
    labels: set = field(default_factory=set)          # by / without / on / ignoring / group_left / group_right


def references(promql: str) -> References:
    found = References()

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            found.selectors.append(node)
        elif isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            found.labels.update(node.modifier.labels)
        elif isinstance(node, promql_parser.BinaryExpr) and node.modifier is not None:
            if node.modifier.matching is not None:
                found.labels.update(node.modifier.matching.labels)
            found.labels.update(node.modifier.group_labels or ())

    promql_parser.walk(promql_parser.parse(promql), visit)
    return found


# --- the check ----------------------------------------------------------------------------------------------

Exported = dict[str, dict[str, set[str]]]   # series name -> label -> the values seen


def exported_series(text: str) -> Exported:
    series: Exported = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = series.setdefault(sample.name, {})
            for name, value in sample.labels.items():
                labels.setdefault(name, set()).add(value)
    return series


def problems(expression: Expression, exported: Exported) -> list[str]:
    """What in ``expression`` the server does not export: empty when everything it names exists."""
    where = expression.where
    try:
        found = references(expression.promql)
    except ValueError as error:
        return [f"{where}: not PromQL ({error}): {expression.promql}"]
    out = []
    available = set(TARGET_LABELS)
    for selector in found.selectors:
        matchers = selector.matchers.matchers
        name = selector.name or next((m.value for m in matchers if m.name == "__name__"
                                      and m.op == promql_parser.MatchOp.Equal), None)
        if name in PROMETHEUS_SERIES:
            continue
        if name not in exported:
            out.append(f"{where}: selects {name!r}, which /metrics does not export")
            continue
        labels = exported[name]
        available |= labels.keys()
        for m in matchers:
            if m.name == "__name__" or m.name in TARGET_LABELS:
                continue
            if m.name not in labels:
                out.append(f"{where}: matches label {m.name!r}, which {name} does not carry ({sorted(labels)})")
            elif m.op == promql_parser.MatchOp.Equal and m.value not in labels[m.name]:
                out.append(f"{where}: {name}{{{m.name}={m.value!r}}} matches none of {sorted(labels[m.name])}")
            elif m.op == promql_parser.MatchOp.Re and not any(re.fullmatch(m.value, v) for v in labels[m.name]):
                out.append(f"{where}: {name}{{{m.name}=~{m.value!r}}} matches none of {sorted(labels[m.name])}")
    for label in sorted((found.labels | set(expression.shown_labels)) - available):
        out.append(f"{where}: uses label {label!r}, which none of its series carries")
    return out


def traffic(server: Server) -> None:
    """Every kind of answer whose series the expressions select: decisions on both routes, a 500 from the
    device, and a 429 (one queued request at most, each forward held 0.3 s, four at once)."""
    assert server.decide(SUPPORT_TICKET).status == 200
    assert server.post(CLOUDFLARE, SUPPORT_TICKET).status == 200
    assert server.decide(ticket(f"The checkout fails. {FAIL_MARKER}")).status == 500
    with ThreadPoolExecutor(4) as pool:
        for attempt in range(10):
            replies = list(pool.map(lambda i: server.decide(ticket(f"Refund number {attempt}-{i}.")), range(4)))
            if any(r.status == 429 for r in replies):
                return
    raise AssertionError("no 429 in 10 bursts of 4 with --max-queue 1")


@pytest.fixture(scope="module")
def exported() -> Exported:
    env = {"CLEFCORE_TEST_BATCH_DELAY_S": "0.3", "CLEFCORE_TEST_FAIL_MARKER": FAIL_MARKER}
    with Server("--max-queue", "1", env=env) as server:
        server.wait_ready()
        traffic(server)
        return exported_series(server.get("/metrics").text)


def test_every_expression_names_series_that_metrics_exports(exported):
    expressions = all_expressions()
    assert len(expressions) > 30
    found = [p for e in expressions for p in problems(e, exported)]
    assert not found, "\n".join(found)


def test_the_check_catches_what_metrics_does_not_export(exported):
    cases = {
        "clef_queue_depht": "does not export",                                       # a misspelt metric
        "rate(clef_precision_fallbacks[5m])": "does not export",                      # a counter without _total
        "clef_request_duration_seconds": "does not export",                           # a histogram without _bucket
        'clef_requests_total{rute="/v1/systemone"}': "does not carry",               # a misspelt label
        'clef_requests_total{route="/v1/systemOne"}': "matches none of",             # a value never sent
        'clef_requests_total{route=~"/v1/decide|/client"}': "matches none of",       # a regex is anchored
        "sum by (reasons) (clef_requests_rejected_total)": "none of its series",     # a grouping label
        "clef_ready / on (lane) clef_devices": "none of its series",                  # a matching label
        "sum(rate(clef_batches_total[5m]": "not PromQL",
    }
    for promql, expected in cases.items():
        found = problems(Expression("case", promql), exported)
        assert len(found) == 1 and expected in found[0], (promql, found)
    # a legend's or an annotation's label
    found = problems(Expression("case", "sum by (lane) (clef_device_memory_bytes)", ("lanes",)), exported)
    assert len(found) == 1 and "'lanes'" in found[0], found
    # and the same expressions, spelt right, pass
    for promql in ("clef_queue_depth", "rate(clef_precision_fallbacks_total[5m])",
                   'clef_requests_total{route=~"/v1/systemone|/client/.+"}',
                   "sum by (reason, instance) (clef_requests_rejected_total)"):
        assert problems(Expression("case", promql), exported) == [], promql


def test_the_dashboard_shows_what_an_operator_watches():
    selected = {s.name for e in dashboard_expressions(dashboard()) for s in references(e.promql).selectors}
    # request rate and latency by route, answers by status, refusals, queue, device busy and memory, event-loop
    # lag, precision fallbacks, readiness
    assert {"clef_request_duration_seconds_count", "clef_request_duration_seconds_bucket", "clef_requests_total",
            "clef_requests_rejected_total", "clef_queue_depth", "clef_device_busy_seconds_total",
            "clef_device_memory_bytes", "clef_event_loop_lag_seconds_bucket", "clef_precision_fallbacks_total",
            "clef_ready"} <= selected, selected


# --- the dashboard as Grafana imports it --------------------------------------------------------------------

def test_the_dashboard_imports_with_a_prometheus_datasource_variable():
    board = dashboard()
    assert board["title"] and board["uid"] and isinstance(board["schemaVersion"], int)
    assert "id" not in board   # Grafana assigns it; a fixed id would overwrite another dashboard
    (source,) = [v for v in board["templating"]["list"] if v["type"] == "datasource"]
    assert source["query"] == "prometheus"
    uses = {"type": "prometheus", "uid": "${%s}" % source["name"]}
    ids = [p["id"] for p in panels(board)]
    assert len(ids) == len(set(ids)), ids
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            assert variable["datasource"] == uses
    taken: set[tuple[int, int]] = set()
    for panel in panels(board):
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24 and pos["h"] > 0, panel["title"]
        cells = {(pos["x"] + dx, pos["y"] + dy) for dx in range(pos["w"]) for dy in range(pos["h"])}
        assert not cells & taken, f"panel {panel['title']!r} overlaps another"
        taken |= cells
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == uses, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert panel["targets"] and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == uses and target["expr"], panel["title"]


# --- the alerts, replayed -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Scenario:
    """Series of a made-up past (promtool's expanding notation, one sample a minute), and for one alert the
    times it must be quiet and the times it must fire, with the labels it fires for and its $value."""
    alert: str
    series: dict[str, str]
    quiet_at: tuple[str, ...]
    firing_at: dict[str, list[tuple[dict, float | None]]]


A, B, C = "a:8080", "b:8080", "c:9100"
JOB = "kubernetes-pods"
DECISION_OK = 'clef_requests_total{instance="%s",route="/v1/systemone",status="200"}'
DECISION_429 = 'clef_requests_total{instance="%s",route="/v1/systemone",status="429"}'
REJECTED = 'clef_requests_rejected_total{instance="%s",reason="queued_work",size="1024"}'
DECISION_5XX = 'clef_requests_total{instance="%s",route="/v1/systemone",status="%s"}'
TIMEOUTS = 'clef_request_failures_total{instance="%s",type="timeout"}'
LATENCY = 'clef_request_duration_seconds_bucket{instance="%s",route="/v1/systemone",le="%s"}'
SCENARIOS = [
    # The only server's series ends at minute 5: 10 minutes later the alert fires.
    Scenario("ClefcoreDown", {f'clef_ready{{instance="{A}"}}': "1x5 stale"},
             quiet_at=("3m", "14m"), firing_at={"17m": [({}, None)]}),
    # a's scrapes fail from minute 11 (its series go stale); b runs on; c, another application's target, is
    # down all along but never served clefcore.
    Scenario("ClefcoreReplicaDown", {
        f'up{{instance="{A}",job="{JOB}"}}': "1x10 0x20", f'clef_workers{{instance="{A}",job="{JOB}"}}': "1x10 stale",
        f'up{{instance="{B}",job="{JOB}"}}': "1x30", f'clef_workers{{instance="{B}",job="{JOB}"}}': "1x30",
        f'up{{instance="{C}",job="{JOB}"}}': "0x30"},
        quiet_at=("10m", "14m"), firing_at={"17m": [({"instance": A, "job": JOB}, None)]}),
    # a loads for 30 min (a cold kernel cache, within the startup probe's budget) and gets ready; b stops being
    # ready at minute 6 and stays so.
    Scenario("ClefcoreNotReady", {f'clef_ready{{instance="{A}"}}': "0x30 1x30",
                                  f'clef_ready{{instance="{B}"}}': "1x5 0x55"},
             quiet_at=("5m", "30m", "40m"), firing_at={"42m": [({"instance": B}, None)]}),
    # a restarts at minute 11 (its heartbeat starts again from 0); b runs on. The alert clears 15 min later.
    Scenario("ClefcoreDeviceLost", {f'clef_event_loop_lag_seconds_count{{instance="{A}"}}': "0+3000x10 0+3000x30",
                                    f'clef_event_loop_lag_seconds_count{{instance="{B}"}}': "0+3000x40"},
             quiet_at=("10m", "28m"), firing_at={"12m": [({"instance": A}, None)], "24m": [({"instance": A}, None)]}),
    # a keeps saying ready on one device of two; b drops a device while draining (not ready): a rollout.
    Scenario("ClefcoreDeviceLost", {f'clef_devices{{instance="{A}"}}': "2x10 1x10",
                                    f'clef_ready{{instance="{A}"}}': "1x20",
                                    f'clef_devices{{instance="{B}"}}': "2x10 1x10",
                                    f'clef_ready{{instance="{B}"}}': "1x10 0x10"},
             quiet_at=("9m",), firing_at={"15m": [({"instance": A}, None)]}),
    # a's device stalls from minute 5 to 7; b's for one sample only.
    Scenario("ClefcoreDeviceStalled", {f'clef_device_stalled{{instance="{A}"}}': "0x4 1x3 0x10",
                                       f'clef_device_stalled{{instance="{B}"}}': "0x4 1 0x12"},
             quiet_at=("4m", "5m", "9m"), firing_at={"6m": [({"instance": A}, None)]}),
    # a answers 10 of 110 decision requests a minute with 500; b 10 of 1010 with 503.
    Scenario("ClefcoreErrors", {
        DECISION_OK % A: "0+100x30", DECISION_5XX % (A, "500"): "0+10x30",
        DECISION_OK % B: "0+1000x30", DECISION_5XX % (B, "503"): "0+10x30"},
        quiet_at=("3m",), firing_at={"15m": [({"instance": A}, 10 / 110)]}),
    # a times out 2 of 102 decision requests a minute; b 1 of 1001.
    Scenario("ClefcoreTimeouts", {
        DECISION_OK % A: "0+100x40", DECISION_5XX % (A, "503"): "0+2x40", TIMEOUTS % A: "0+2x40",
        DECISION_OK % B: "0+1000x40", DECISION_5XX % (B, "503"): "0+1x40", TIMEOUTS % B: "0+1x40"},
        quiet_at=("5m",), firing_at={"30m": [({"instance": A}, 2 / 102)]}),
    # Each minute a answers 90 of 100 decisions within 1 s, 98 within 10 s, all within 30 s: its p99 is 20 s
    # (interpolated in the 10-30 s bucket). b answers all within 1 s.
    Scenario("ClefcoreSlowAnswers", {
        LATENCY % (A, "1"): "0+90x40", LATENCY % (A, "10"): "0+98x40", LATENCY % (A, "30"): "0+100x40",
        LATENCY % (A, "+Inf"): "0+100x40",
        LATENCY % (B, "1"): "0+100x40", LATENCY % (B, "10"): "0+100x40", LATENCY % (B, "30"): "0+100x40",
        LATENCY % (B, "+Inf"): "0+100x40"},
        quiet_at=("10m",), firing_at={"30m": [({"instance": A}, 20.0)]}),
    # a refuses 10 of 110 decision requests a minute (health probes do not count); b 10 of 1010.
    Scenario("ClefcoreRefusingRequests", {
        DECISION_OK % A: "0+100x40", DECISION_429 % A: "0+10x40", REJECTED % A: "0+10x40",
        f'clef_requests_total{{instance="{A}",route="/health",status="200"}}': "0+1000x40",
        DECISION_OK % B: "0+1000x40", DECISION_429 % B: "0+10x40", REJECTED % B: "0+10x40"},
        quiet_at=("10m",), firing_at={"20m": [({"instance": A}, 10 / 110)]}),
    # a answers 1 of 60 batches again; b none.
    Scenario("ClefcorePrecisionFallbacks", {
        f'clef_batches_total{{instance="{A}"}}': "0+60x60",
        f'clef_precision_fallbacks_total{{instance="{A}"}}': "0+1x60",
        f'clef_batches_total{{instance="{B}"}}': "0+60x60",
        f'clef_precision_fallbacks_total{{instance="{B}"}}': "0x60"},
        quiet_at=("20m",), firing_at={"45m": [({"instance": A}, 1 / 60)]}),
]


def render(template: str, labels: dict, value: float | None) -> str:
    """An annotation as Prometheus fills it in, for the two placeholders the rules use."""
    for name, label in labels.items():
        template = template.replace("{{ $labels.%s }}" % name, label)
    if value is not None:   # humanizePercentage: Go's %.4g of the percentage; humanizeDuration: under a minute
        template = template.replace("{{ $value | humanizePercentage }}", "%.4g%%" % (value * 100))
        template = template.replace("{{ $value | humanizeDuration }}", "%.4gs" % value)
    assert "{{" not in template, f"a placeholder the scenario does not fill: {template}"
    return template


def promtool_tests(rules: list[dict]) -> dict:
    by_name = {r["alert"]: r for r in rules}
    tests = []
    for scenario in SCENARIOS:
        rule = by_name[scenario.alert]
        checks = [{"eval_time": t, "alertname": scenario.alert, "exp_alerts": []} for t in scenario.quiet_at]
        for t, firing in scenario.firing_at.items():
            checks.append({"eval_time": t, "alertname": scenario.alert, "exp_alerts": [
                {"exp_labels": {**rule["labels"], **labels},
                 "exp_annotations": {k: render(v, labels, value) for k, v in rule["annotations"].items()}}
                for labels, value in firing]})
        tests.append({"interval": "1m", "alert_rule_test": checks,
                      "input_series": [{"series": s, "values": v} for s, v in scenario.series.items()]})
    return {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests}


def run_promtool(tmp_path: Path, groups: list[dict], *command: str) -> subprocess.CompletedProcess:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(promtool_tests(
        [r for g in groups for r in g["rules"]]), sort_keys=False))
    return subprocess.run(["promtool", *command], cwd=tmp_path, capture_output=True, text=True, timeout=120)


def test_promtool_is_installed():
    """The replays below need it: a missing promtool fails here, instead of the replays passing unrun."""
    assert shutil.which("promtool"), "promtool not found: .ci/run installs Debian's prometheus package for it"


promtool = pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (see above)")


@promtool
def test_promtool_accepts_the_rules(tmp_path):
    result = run_promtool(tmp_path, prometheus_rule()["spec"]["groups"], "check", "rules", "rules.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in result.stdout, result.stdout


@promtool
def test_each_alert_fires_when_it_says_and_not_beside_a_healthy_server(tmp_path):
    assert {s.alert for s in SCENARIOS} == {r["alert"] for r in alert_rules()}
    result = run_promtool(tmp_path, prometheus_rule()["spec"]["groups"], "test", "rules", "tests.yaml")
    assert result.returncode == 0, result.stdout + result.stderr


@promtool
@pytest.mark.parametrize("alert, change", [
    ("ClefcoreNotReady", {"for": "50m"}),                       # waits past the scenario's firing time
    ("ClefcoreNotReady", {"for": "15m"}),                       # fires during a cold start
    ("ClefcoreReplicaDown", {"expr": "up == 0"}),               # another application's target too
    ("ClefcoreSlowAnswers", {"expr": "histogram_quantile(0.99, sum by (instance, le) "
                                     "(rate(clef_request_duration_seconds_bucket[10m]))) > 30"}),  # never fires
    ("ClefcoreDeviceStalled", {"for": "0m"}),                   # one stalled sample pages
    ("ClefcoreRefusingRequests", {"expr": "sum by (instance) (rate(clef_requests_rejected_total[10m])) / "
                                          "sum by (instance) (rate(clef_requests_total[10m])) > 0.05"}),  # probes too
    ("ClefcoreDeviceLost", {"expr": "resets(clef_event_loop_lag_seconds_count[15m]) > 0"}),  # no device count
])
def test_the_replay_catches_a_wrong_rule(tmp_path, alert, change):
    groups = copy.deepcopy(prometheus_rule()["spec"]["groups"])
    (rule,) = [r for g in groups for r in g["rules"] if r["alert"] == alert]
    rule.update(change)
    result = run_promtool(tmp_path, groups, "test", "rules", "tests.yaml")
    assert result.returncode != 0 and alert in result.stdout + result.stderr


# --- the rules' shape ---------------------------------------------------------------------------------------

def seconds(duration: str) -> int:
    """A Prometheus duration of one unit (5m, 1h, 30s) in seconds."""
    number, unit = re.fullmatch(r"(\d+)([smh])", duration).groups()
    return int(number) * {"s": 1, "m": 60, "h": 3600}[unit]


def test_every_alert_waits():
    assert [r["alert"] for r in alert_rules() if seconds(r.get("for", "0s")) < 60] == []


def test_not_ready_waits_out_the_startup_probes_budget():
    """A cold first load may take the whole startup probe's budget; NotReady must not fire within it."""
    from test_k8s import startup_budget_s
    (rule,) = [r for r in alert_rules() if r["alert"] == "ClefcoreNotReady"]
    assert seconds(rule["for"]) > startup_budget_s()


def test_the_operations_guide_lists_every_alert_with_what_to_do():
    text = (Path(__file__).resolve().parent.parent / "docs" / "operations.md").read_text()
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(Clefcore\w+)` \((?:critical|warning)\) \|(.*)\|$",
                                                        text, re.M)}
    assert set(rows) == {r["alert"] for r in alert_rules()}
    for rule in alert_rules():
        assert f"`{rule['alert']}` ({rule['labels']['severity']})" in text
        fires_when, what_to_do = rows[rule["alert"]].split(" | ", 1)
        assert fires_when.strip() and len(what_to_do.strip()) > 40, rule["alert"]
