"""Monitoring (deploy/monitoring/): the rules pass promtool's checks and unit tests, the
PrometheusRule is the plain rules file, every rule and alert is unit-tested and has a
runbook, and every query of the rules and the Grafana dashboard names series, and label
values, that a live demo server really exposes on /metrics."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import grpc
import pytest
import yaml

try:
    import promql_parser as promql
except ImportError:
    if os.environ.get("CI"):
        raise  # a dev extra: CI has it, and must not skip these tests
    pytest.skip("promql-parser (dev extra) not installed", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
MON = ROOT / "deploy" / "monitoring"
RULES = MON / "rules" / "grace.rules.yml"
UNIT_TESTS = sorted((MON / "rules" / "tests").glob("*.yml"))
MANIFEST = MON / "prometheusrule.yaml"
DASHBOARD = MON / "grafana" / "grace-dashboard.json"
RUNBOOK = ROOT / "docs" / "ops" / "monitoring.md"
_spec = importlib.util.spec_from_file_location("grace_render_rules", MON / "render_rules.py")
render_rules = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render_rules)
# Grafana's interval variables, replaced by a duration before parsing as PromQL.
GRAFANA_INTERVALS = ("$__rate_interval", "$__interval", "$__range")
TEMPLATE_VAR = re.compile(r"\$\{?(\w+)\}?")
# Labels the scrape adds (Prometheus target labels): not on the server's own /metrics.
TARGET_LABELS = {"namespace", "job", "instance", "pod"}
# Series Prometheus makes itself for each target.
PROMETHEUS_MADE = {"up"}


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        msg = "promtool missing: apt-get install -y --no-install-recommends prometheus"
        if os.environ.get("CI"):
            pytest.fail(msg)  # CI installs it: a skip there would hide the rule tests
        pytest.skip(msg)
    return path


def rules() -> dict:
    return yaml.safe_load(RULES.read_text())


def all_rules() -> list[dict]:
    return [r for g in rules()["groups"] for r in g["rules"]]


def recorded() -> set[str]:
    return {r["record"] for r in all_rules() if "record" in r}


def alerts() -> list[dict]:
    return [r for r in all_rules() if "alert" in r]


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


# --- PromQL ---------------------------------------------------------------------------


def as_promql(expr: str) -> str:
    """A Grafana query as plain PromQL: interval variables become 5m; other template
    variables (only ever inside label-matcher strings here) become a plain word."""
    for var in GRAFANA_INTERVALS:
        expr = expr.replace(var, "5m")
    return TEMPLATE_VAR.sub(r"var_\1", expr)


def selectors(expr: str) -> list:
    """Every vector selector in a PromQL expression (parsed, so functions, keywords,
    `by (...)` clauses, label matchers and durations never read as metric names)."""
    found: list = []
    promql.walk(
        promql.parse(expr),
        lambda n: found.append(n) if isinstance(n, promql.VectorSelector) else None,
    )
    return found


def ranges(expr: str) -> set[timedelta]:
    found: set[timedelta] = set()
    promql.walk(
        promql.parse(expr),
        lambda n: found.add(n.range) if isinstance(n, promql.MatrixSelector) else None,
    )
    return found


def rule_queries() -> Iterator[tuple[str, str]]:
    for r in all_rules():
        yield r.get("record") or r["alert"], r["expr"]


def dashboard_queries() -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    for panel in dashboard()["panels"]:
        for t in panel.get("targets", []):
            yield f"panel {panel['title']!r} {t['refId']}", as_promql(t["expr"])
    for var in dashboard()["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((.+),\s*\w+\)", var["query"])
            assert m, f"variable {var['name']}: {var['query']}"
            yield f"variable {var['name']}", as_promql(m[1])


def test_query_parsing_sees_only_metric_names() -> None:
    expr = as_promql(
        "histogram_quantile(0.99, sum by (le, instance) (rate(grpc_server_handling_seconds_bucket"
        '{job=~"$job", le!="+Inf"}[$__rate_interval]))) / on (instance) group_left '
        "max without (stage) (grace_queue_depth offset 5m) or vector(0) > bool 1"
    )
    assert {s.name for s in selectors(expr)} == {
        "grpc_server_handling_seconds_bucket",
        "grace_queue_depth",
    }
    assert ranges(expr) == {timedelta(minutes=5)}


# --- promtool -------------------------------------------------------------------------


def test_promtool_checks_the_rules() -> None:
    out = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(all_rules())} rules found" in out.stdout


def test_promtool_unit_tests_pass() -> None:
    wanted = {"recording.test.yml", "slo.test.yml", "index.test.yml", "model.test.yml",
              "scrape.test.yml"}  # fmt: skip
    assert {p.name for p in UNIT_TESTS} >= wanted
    cmd = [promtool(), "test", "rules", *map(str, UNIT_TESTS)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("SUCCESS") == len(UNIT_TESTS), out.stdout


def test_unit_tests_cover_every_rule_and_every_alert_both_ways() -> None:
    """A test file that lost its cases passes promtool too: count what they exercise."""
    tested: set[str] = set()
    firing: set[str] = set()
    quiet: set[str] = set()
    for path in UNIT_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for t in case.get("promql_expr_test", []):
                tested |= {s.name for s in selectors(t["expr"])}
            for t in case.get("alert_rule_test", []):
                (firing if t.get("exp_alerts") else quiet).add(t["alertname"])
    names = {a["alert"] for a in alerts()}
    assert recorded() <= tested, f"recording rules without a unit test: {recorded() - tested}"
    assert names <= firing, f"alerts never tested firing: {names - firing}"
    assert names <= quiet, f"alerts never tested quiet: {names - quiet}"


def test_unit_tests_fail_when_resource_exhausted_stops_counting_as_an_error(
    tmp_path: Path,
) -> None:
    """The unit tests bite: drop RESOURCE_EXHAUSTED (overload) from the error codes, the
    documented SLO decision, and they fail."""
    work = tmp_path / "rules"
    shutil.copytree(RULES.parent, work)
    text = (work / RULES.name).read_text()
    assert text.count("|RESOURCE_EXHAUSTED|") == 7  # one per SLI window
    (work / RULES.name).write_text(text.replace("|RESOURCE_EXHAUSTED|", "|"))
    cmd = [promtool(), "test", "rules", str(work / "tests" / "recording.test.yml")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "job:grace_retrieve_errors:ratio_rate" in out.stdout + out.stderr


# --- one source -----------------------------------------------------------------------


def test_prometheusrule_is_rendered_from_the_rules_file() -> None:
    cmd = [sys.executable, str(MON / "render_rules.py"), "--check"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    manifest = yaml.safe_load(MANIFEST.read_text())
    assert manifest["apiVersion"] == "monitoring.coreos.com/v1"
    assert manifest["kind"] == "PrometheusRule"
    assert manifest["spec"] == rules()


def test_kustomization_ships_the_rule_and_the_dashboard_configmap() -> None:
    k = yaml.safe_load((MON / "kustomization.yaml").read_text())
    assert k["resources"] == ["prometheusrule.yaml"]
    [gen] = k["configMapGenerator"]
    assert gen["files"] == ["grafana/grace-dashboard.json"]
    assert gen["options"]["labels"]["grafana_dashboard"] == "1"  # a string, as the sidecar wants
    assert gen["options"]["disableNameSuffixHash"] is True


# --- the rules themselves ---------------------------------------------------------------


def test_slo_windows_are_what_the_names_say() -> None:
    unit = {"m": "minutes", "h": "hours", "d": "days"}
    slis = [r for r in all_rules() if re.search(r":ratio_rate\d+[mhd]$", r.get("record", ""))]
    assert len(slis) == 14  # 7 windows x 2 SLOs
    for r in slis:
        n, u = re.search(r"(\d+)([mhd])$", r["record"]).groups()
        assert ranges(r["expr"]) == {timedelta(**{unit[u]: int(n)})}, r["record"]


def test_error_codes_are_grpc_codes_and_exclude_client_mistakes() -> None:
    codes: set[str] = set()
    for _, expr in rule_queries():
        for s in selectors(expr):
            for m in s.matchers.matchers:
                if m.name == "grpc_code" and m.op == promql.MatchOp.Re:
                    codes |= set(m.value.split("|"))
    assert codes <= set(grpc.StatusCode.__members__)
    assert {"INTERNAL", "UNAVAILABLE", "DEADLINE_EXCEEDED", "UNKNOWN"} <= codes
    assert {"RESOURCE_EXHAUSTED"} <= codes  # overload is a capacity fault (runbook)
    assert not codes & {"OK", "INVALID_ARGUMENT", "NOT_FOUND", "CANCELLED"}


def anchors(doc: Path) -> set[str]:
    """The anchors a forge (GitHub, GitLab) gives a Markdown file's headings."""
    headings = re.findall(r"^#+\s+(.+)$", doc.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_every_alert_has_severity_annotations_and_a_runbook_section() -> None:
    runbooks = {h.strip() for h in re.findall(r"^###\s+(.+)$", RUNBOOK.read_text(), re.M)}
    for a in alerts():
        name = a["alert"]
        assert a["labels"]["severity"] in {"critical", "warning"}, name
        assert a["annotations"]["summary"] and a["annotations"]["description"], name
        assert name in runbooks, f"{name}: no '### {name}' section in {RUNBOOK.name}"


def test_every_runbook_url_is_an_absolute_link_to_its_runbook_section() -> None:
    """Alertmanager, Grafana and chat only follow absolute links: each alert's runbook_url
    is the renderer's base, then the repository path of a doc that exists and one of its
    headings' anchors, that alert's runbook."""
    for a in alerts():
        url = a["annotations"]["runbook_url"]
        assert re.match(r"https?://[^/\s]+/", url), f"{a['alert']}: not absolute: {url}"
        assert url.startswith(render_rules.RUNBOOK_BASE), url
        path, _, anchor = url.removeprefix(render_rules.RUNBOOK_BASE).partition("#")
        assert (ROOT / path).is_file(), f"{a['alert']}: {path} is not in the repository"
        assert anchor == a["alert"].lower() and anchor in anchors(ROOT / path), url


def test_the_runbook_base_is_a_setting_of_the_renderer(tmp_path: Path) -> None:
    """`--runbook-base` moves every runbook link (rules, manifest and the promtool tests
    that expect them, which then still pass) and `--check` holds the files to a base."""
    work = tmp_path / "monitoring"
    shutil.copytree(MON, work)
    script = [sys.executable, str(work / "render_rules.py")]
    base = "https://git.example.com/ads/grace-serving/-/blob/main/"
    assert subprocess.run([*script, "--runbook-base", base]).returncode == 0
    texts = [p.read_text() for p in (work / "prometheusrule.yaml", *work.glob("rules/**/*.yml"))]
    urls = [u for text in texts for u in re.findall(r"runbook_url: (\S+)", text)]
    assert len(urls) > len(alerts()) and all(u.startswith(base + "docs/ops/") for u in urls)
    assert subprocess.run([*script, "--check", "--runbook-base", base]).returncode == 0
    stale = subprocess.run([*script, "--check"], capture_output=True, text=True)
    assert stale.returncode == 1 and "prometheusrule.yaml is out of date" in stale.stderr
    tests = sorted(map(str, (work / "rules" / "tests").glob("*.yml")))
    out = subprocess.run([promtool(), "test", "rules", *tests], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    bad = subprocess.run([*script, "--runbook-base", "docs/"], capture_output=True, text=True)
    assert bad.returncode == 2 and "not an http(s) URL ending in '/'" in bad.stderr


# --- the dashboard --------------------------------------------------------------------


def test_dashboard_is_a_provisionable_grafana_dashboard() -> None:
    d = dashboard()
    assert d["uid"] == "grace-serving" and d["schemaVersion"] >= 39
    [ds] = [v for v in d["templating"]["list"] if v["name"] == "datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in d["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"] and all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"])
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            assert v["datasource"]["uid"] == "${datasource}", v["name"]


def test_dashboard_shows_what_the_issue_asks_for() -> None:
    names = {s.name for _, expr in dashboard_queries() for s in selectors(expr)}
    wanted = {
        "grpc_server_handled_total",  # QPS by code
        "job_grpc_method:grpc_server_handling_seconds:p50_5m",  # end to end
        "job_grpc_method:grpc_server_handling_seconds:p99_5m",
        "job_stage:grace_stage_duration_seconds:p50_5m",  # per stage
        "job_stage:grace_stage_duration_seconds:p99_5m",
        "grace_batch_size_bucket",
        "grace_batch_padding_total",  # GPU padding share (docs/OPERATIONS.md)
        "grace_queue_depth",
        "grace_inflight_requests",
        "job:grace_ads_pass_ratio:rate5m",
        "grace_index_info",
        "grace_index_age_seconds",
        "grace_index_swaps_total",
        "grace_index_swap_failures_total",
        "grace_index_behind_current",
        "grace_model_info",  # the served model and its rollout
        "grace_model_swaps_total",
        "grace_model_swap_failures_total",
        "grace_model_behind_current",
        "grace_admission_refused_total",  # shedding (docs/RELIABILITY.md)
        "grace_queue_expired_total",
        "grace_stage_dropped_total",
        "grace_admission_predicted_seconds",
        "grace_gpu_memory_bytes",
        "job:grace_retrieve_slow:ratio_rate1h",  # the SLOs
        "job:grace_retrieve_errors:ratio_rate1h",
    }
    assert wanted <= names, wanted - names


# --- against a live server --------------------------------------------------------------


@pytest.fixture(scope="module")
def live_samples(tmp_path_factory: pytest.TempPathFactory) -> list:
    """Every sample on /metrics of the tiny demo server after a few Retrieve calls (and
    one refused), so histograms and counters carry samples; the server is worker 0 of a
    supervisor's board, so the workers' series are there too; and the builder sidecar's."""
    import multiprocessing

    from prometheus_client.parser import text_string_to_metric_families

    from cli.query import request_for_user
    from service.app import start
    from service.board import Board
    from service.rpc.grace.v1 import retrieval_pb2, retrieval_pb2_grpc
    from tests.helpers.serving import make_serving_data, serving_settings

    root = make_serving_data(tmp_path_factory.mktemp("monitoring"))
    settings = serving_settings(root)

    async def main() -> str:
        board = Board(multiprocessing.get_context("spawn"), 1, 5.0)
        app = await start(settings, placed=(0, "cpu"), board=board)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
                stub = retrieval_pb2_grpc.AdRetrievalStub(ch)
                requests = [request_for_user(root / "world", u, 50, retrieval_pb2.CD_GTM)
                            for u in range(4)]  # fmt: skip
                await asyncio.gather(*(stub.Retrieve(r) for r in requests))
                bad = request_for_user(root / "world", 0, 10, retrieval_pb2.CD_GTM)
                bad.targeting.gender = "robot"
                with pytest.raises(grpc.aio.AioRpcError):
                    await stub.Retrieve(bad)
            url = f"http://127.0.0.1:{app.metrics_port}/metrics"
            return await asyncio.to_thread(lambda: urllib.request.urlopen(url).read().decode())
        finally:
            await app.drain()

    text = asyncio.run(main())
    # the builder sidecar's series (`grace builder --metrics-port`): its registry after a
    # published build and a failed one
    from prometheus_client import generate_latest

    from index_builder.builder_metrics import BuilderMetrics
    from index_builder.catalog import CatalogError

    builder = BuilderMetrics()
    builder.built()
    builder.failed(CatalogError("c.jsonl", "line 2", "ad_id", "duplicate ad_id 1"))
    text += generate_latest(builder.registry).decode()
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def fixed_labels(sel) -> set[tuple[str, str]]:
    """The `label="value"` matchers of a selector, less the labels the scrape adds."""
    return {
        (m.name, m.value)
        for m in sel.matchers.matchers
        if m.op == promql.MatchOp.Equal and m.name not in TARGET_LABELS
    }


def check_against_live(queries: list[tuple[str, str]], samples: list, known: set[str]) -> None:
    """Each selector names a live series (or a recording rule in `known`), and its
    fixed-value label matchers (`label="value"`) select at least one live sample."""
    live = {s.name for s in samples}
    problems = []
    for where, expr in queries:
        for sel in selectors(expr):
            if not sel.name:
                problems.append(f"{where}: a selector without a metric name")
            elif sel.name in known:
                continue
            elif sel.name not in live:
                problems.append(f"{where}: {sel.name} is not on /metrics")
            else:
                fixed = fixed_labels(sel)
                if not any(s.name == sel.name and fixed <= s.labels.items() for s in samples):
                    problems.append(f"{where}: no live {sel.name} sample has {dict(fixed)}")
    assert not problems, "\n".join(problems)


def test_live_server_exposes_what_the_test_expects(live_samples: list) -> None:
    live = {s.name for s in live_samples}
    assert {"grpc_server_handling_seconds_bucket", "grace_stage_duration_seconds_bucket",
            "grace_index_info", "grace_model_info"} <= live  # fmt: skip
    # the GPU memory panel reads a flat 0 on a CPU server, not "No data"
    assert [s.value for s in live_samples if s.name == "grace_gpu_memory_bytes"] == [0.0]
    codes = {s.labels["grpc_code"] for s in live_samples if s.name == "grpc_server_handled_total"}
    assert codes == {"OK", "INVALID_ARGUMENT"}


def test_rules_reference_only_series_the_server_exposes(live_samples: list) -> None:
    check_against_live(list(rule_queries()), live_samples, recorded() | PROMETHEUS_MADE)


def test_dashboard_references_only_series_the_server_exposes_or_rules_record(
    live_samples: list,
) -> None:
    check_against_live(list(dashboard_queries()), live_samples, recorded())
