"""Grafana dashboards and alert rules against the metrics the processes really export.

The worker's metrics are scraped, not listed by hand: a tp=2 engine group (two gloo ranks, the tiny code model
with its EAGLE3 draft, all-reduce fusion on: the reference fused kernel on CPU) serves one completion over HTTP
and its ``/metrics`` is parsed with prometheus-client's parser. That one scrape has series of every worker family
with their real labels (op/group/path of the collectives only exist at tp > 1). The operator's come from
``OperatorMetrics().registry``; label values the CPU run cannot show (path flashinfer_fused, an operator
condition that is not set yet) come from the constants the code declares them in.

Every PromQL expression (dashboard targets, variable queries, rendered alert rules) must parse (promql-parser);
every metric it selects must be exported, with the labels it filters, groups and matches on; ``rate``/``increase``
only on counters; ``histogram_quantile`` over buckets kept by ``le``. ``promtool`` (Debian's ``prometheus``
package, fetched by scripts/ensure-prometheus.sh) also evaluates the alerts and key panels with Prometheus's own
engine on synthetic series; tests/test_prometheus_e2e.py evaluates them on a real server scraping real workers.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import promql_parser as pq
import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `tests.*` importable under a bare `pytest` too
    sys.path.append(str(ROOT))

from tests import prometheus_server
from tests.chart_queries import (
    CHART,
    DASHBOARDS,
    alert_rules,
    dashboard_queries,
    panel_expr,
    render_rules,
    substituted,
)
from tests.chart_queries import panels as _panels

TARGET = str(ROOT / "examples/checkpoints/tiny-code")
DRAFT = str(ROOT / "examples/checkpoints/tiny-code-eagle3")
LABELS = {"deployment": "demo", "namespace": "ml", "engine_group": "0", "rank": "0", "tp_rank": "0",
          "dp_rank": "0", "ep_rank": "0"}
WORKER_VARIABLES = ["datasource", "namespace", "deployment", "group"]
# Labels Prometheus adds to the operator's series from its ServiceMonitor target (no honorLabels there).
TARGET_LABELS = {"namespace", "pod", "service", "endpoint", "job", "instance", "container"}
# Labels whose values the expressions name: every value used must be one that is exported (or declared).
ENUM_LABELS = {"op", "path", "result", "condition", "status", "finished_reason"}


# --- what is exported ----------------------------------------------------------------------------------------------

def _lead(engine: Any) -> str:
    import httpx

    from fusedserve.worker.serving.http_api import build_app
    from fusedserve.worker.serving.http_server import HttpServer
    from fusedserve.worker.serving.local_engine_client import LocalEngineClient
    from fusedserve.worker.serving.metrics import MetricsRegistry

    client = LocalEngineClient(engine, LABELS, model_name="tiny-code")
    server = HttpServer(build_app(client, MetricsRegistry(LABELS, "tiny-code"))).start()
    try:
        body = {"model": "tiny-code", "prompt": "def fib(n):", "max_tokens": 12, "temperature": 0}
        httpx.post(server.url + "/v1/completions", json=body, timeout=120).raise_for_status()
        return httpx.get(server.url + "/metrics", timeout=30).text
    finally:
        server.stop()
        client.close()


def _rank_main(rank: int, world: int, backend: str) -> str | None:
    from fusedserve.worker.engine.config import EngineConfig
    from fusedserve.worker.parallel.rank import run_engine_group
    from fusedserve.worker.spec_decode.config import SpeculativeConfig

    config = EngineConfig(num_blocks=48, max_num_seqs=4, max_batch_tokens=256,
                          speculative=SpeculativeConfig(DRAFT, num_steps=3))
    return run_engine_group(rank, world, backend, TARGET, config, _lead, fusion="reference")


@dataclass
class Exported:
    """Sample names (``x_total``, ``x_bucket``, ...) with their label names, types and label values."""

    labels: dict[str, set[str]] = field(default_factory=dict)  # sample name -> label names
    types: dict[str, str] = field(default_factory=dict)  # sample name -> counter | gauge | histogram
    operator: set[str] = field(default_factory=set)  # sample names of the operator process
    values: dict[str, set[str]] = field(default_factory=dict)  # label -> values seen or declared

    def add(self, text: str, operator: bool = False) -> None:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                self.labels.setdefault(s.name, set()).update(s.labels)
                self.types[s.name] = family.type
                if operator:
                    self.operator.add(s.name)
                for k, v in s.labels.items():
                    self.values.setdefault(k, set()).add(v)


@pytest.fixture(scope="module")
def exported() -> Exported:
    from fusedserve.models.parallel.ledger import OPS, PATHS
    from fusedserve.operator.metrics import CONDITIONS, RESULTS, STATUSES, OperatorMetrics
    from fusedserve.worker.engine.sequence import FinishReason
    from fusedserve.worker.parallel.local_ranks import run_on_ranks

    out = Exported()
    out.add(run_on_ranks(_rank_main, 2, backend="gloo")[0])
    out.add(generate_latest(OperatorMetrics().registry).decode(), operator=True)
    declared = {"op": OPS, "path": PATHS, "result": RESULTS, "condition": CONDITIONS, "status": STATUSES,
                "finished_reason": [r.value for r in FinishReason]}
    for label, values in declared.items():
        out.values.setdefault(label, set()).update(values)
    return out


# --- the expressions ------------------------------------------------------------------------------------------------

def all_queries() -> list[tuple[str, str]]:
    queries = [q for path in DASHBOARDS for q in dashboard_queries(json.loads(path.read_text()))]
    return queries + [(f"alert {name}", expr) for name, expr in alert_rules().items()]


QUERIES = all_queries()


def _children(node: Any) -> list[Any]:
    if isinstance(node, pq.AggregateExpr):
        return [n for n in (node.param, node.expr) if n is not None]
    if isinstance(node, pq.BinaryExpr):
        return [node.lhs, node.rhs]
    if isinstance(node, pq.Call):
        return list(node.args)
    if isinstance(node, pq.MatrixSelector):
        return [node.vector_selector]
    if isinstance(node, (pq.ParenExpr, pq.SubqueryExpr, pq.UnaryExpr)):
        return [node.expr]
    return []


def _selectors(node: Any) -> Iterator[Any]:
    if isinstance(node, pq.VectorSelector):
        yield node
    for child in _children(node):
        yield from _selectors(child)


def problems(expr: Any, exported: Exported) -> Iterator[str]:
    """Names, labels and functions of one parsed expression that do not fit what is exported."""
    selectors = list(_selectors(expr))
    known: set[str] = {"le"}
    for vs in selectors:
        name = vs.name
        if name not in exported.labels:
            yield f"{name}: not exported"
            continue
        labels = exported.labels[name] | (TARGET_LABELS if name in exported.operator else set())
        known |= labels
        for m in vs.matchers.matchers:
            if m.name not in labels:
                yield f"{name}{{{m.name}}}: no such label"
            elif m.name in ENUM_LABELS and "$" not in m.value and m.value != ".*":
                for value in m.value.split("|"):
                    if value not in exported.values.get(m.name, set()):
                        yield f"{name}{{{m.name}={value!r}}}: no such value"

    def walk(node: Any, fn: str | None) -> Iterator[str]:
        if isinstance(node, pq.AggregateExpr) and node.modifier is not None:
            yield from (f"{node.op} by/without {label}: not a label here"
                        for label in node.modifier.labels if label not in known)
        if isinstance(node, pq.BinaryExpr) and node.modifier is not None:
            used = list(node.modifier.matching.labels if node.modifier.matching else []) + list(
                node.modifier.group_labels or [])
            yield from (f"on/ignoring/group {label}: not a label here" for label in used if label not in known)
        if isinstance(node, pq.Call):
            fn = node.func.name
            if fn == "histogram_quantile":
                buckets = [vs.name for vs in _selectors(node.args[1])]
                if not buckets or not all(b.endswith("_bucket") for b in buckets):
                    yield f"histogram_quantile over {buckets}"
                inner = node.args[1]
                while isinstance(inner, pq.ParenExpr):
                    inner = inner.expr
                if not (isinstance(inner, pq.AggregateExpr) and "le" in (inner.modifier.labels if inner.modifier
                                                                           else [])):
                    yield "histogram_quantile: the buckets are not aggregated by le"
        if isinstance(node, pq.MatrixSelector) and fn in ("rate", "increase"):
            name = node.vector_selector.name or ""
            if exported.types.get(name) not in ("counter", "histogram") or name.endswith("_created"):
                yield f"{fn}({name}): not a counter"
        for child in _children(node):
            yield from walk(child, fn if not isinstance(node, pq.Call) else node.func.name)

    yield from walk(expr, None)


# --- tests ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("where, expr", QUERIES, ids=[w for w, _ in QUERIES])
def test_every_expression_parses(where: str, expr: str) -> None:
    pq.parse(substituted(expr))


def test_every_metric_and_label_used_is_exported(exported: Exported) -> None:
    found = [f"{where}: {p}" for where, expr in QUERIES for p in problems(pq.parse(substituted(expr)), exported)]
    assert found == []


def test_the_checker_catches_mistakes(exported: Exported) -> None:
    """The check above is not vacuous: each of these is a mistake it must report."""
    wrong = {
        "fusedserve_spec_decode_accepted_total": "not exported",
        'fusedserve_collective_calls_total{grp="tp"}': "no such label",
        'fusedserve_collective_calls_total{path="nvshmem"}': "no such value",
        "sum by (engine_grp) (fusedserve_forwards_total)": "not a label here",
        "rate(fusedserve_num_requests_running[5m])": "not a counter",
        "histogram_quantile(0.9, sum(rate(fusedserve_time_to_first_token_seconds_bucket[5m])))": "by le",
        "histogram_quantile(0.9, fusedserve_time_to_first_token_seconds_sum)": "histogram_quantile over",
    }
    for expr, message in wrong.items():
        assert any(message in p for p in problems(pq.parse(expr), exported)), expr
    assert not list(problems(pq.parse('fusedserve_operator_deployments{namespace="x", condition="Ready"}'),
                             exported))


def test_dashboards_use_every_worker_and_operator_metric(exported: Exported) -> None:
    """A family nobody can see is a gap in the dashboards (build_info feeds the variables)."""
    text = "\n".join(path.read_text() for path in DASHBOARDS)
    # vllm:* twins are for vLLM's own dashboards and tooling (test_vllm_dashboard_queries_resolve).
    families = {re.sub(r"_(total|bucket|sum|count|created)$", "", name) for name in exported.labels
                if not name.startswith("vllm:")}
    unused = sorted(f for f in families if not re.search(re.escape(f) + r"(_total|_bucket|_sum|_count)?\b", text))
    assert unused == []


@pytest.mark.parametrize("path", DASHBOARDS, ids=[p.stem for p in DASHBOARDS])
def test_dashboard_json_model(path: Path) -> None:
    board = json.loads(path.read_text())
    assert board["schemaVersion"] >= 39 and board["uid"] == f"fusedserve-{path.stem}" and len(board["uid"]) <= 40
    assert board["id"] is None and board["title"].startswith("fusedserve / ")
    variables = {v["name"]: v for v in board["templating"]["list"]}
    expected = WORKER_VARIABLES if path.stem != "operator" else ["datasource", "namespace"]
    assert list(variables) == expected
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in expected[1:]:
        var = variables[name]
        assert var["type"] == "query" and var["query"] == var["definition"].strip()
        assert var["definition"].startswith("label_values(")
        assert var["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert var["includeAll"] and var["allValue"] == ".*" and var["multi"]
    panels = list(_panels(board["panels"]))
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"] and panel["description"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(set(refs)) == len(refs)
        for t in panel["targets"]:
            assert t["datasource"] == panel["datasource"]
            # Worker panels follow the selectors (latency histograms carry the server's labels: no engine group).
            if path.stem != "operator":
                assert 'namespace=~"$namespace"' in t["expr"] and 'deployment=~"$deployment"' in t["expr"], t
            else:
                assert 'namespace=~"$namespace"' in t["expr"], t


def test_dashboards_show_what_the_issue_asks_for() -> None:
    boards = {p.stem: json.loads(p.read_text()) for p in DASHBOARDS}

    def exprs(stem: str) -> str:
        return "\n".join(e for _, e in dashboard_queries(boards[stem]))

    spec, comm, serving, operator = (exprs(s) for s in ("speculative", "communication", "serving", "operator"))
    assert re.search(r"1 \+ sum.*accepted_tokens_total.*\n\s*/ sum.*drafts_total", spec)  # acceptance length
    assert "accepted_tokens_per_position_total" in spec and "draft_tokens_total" in spec
    heatmaps = [p for p in _panels(boards["speculative"]["panels"]) if p["type"] == "heatmap"]
    assert [t["format"] for p in heatmaps for t in p["targets"]] == ["heatmap"]
    assert "accepted_tokens_per_step_bucket" in heatmaps[0]["targets"][0]["expr"]
    for needle in ("fusedserve_collective_planned_calls_total", "fusedserve_forwards_total",
                   'path=~"flashinfer_fused|reference_fused"', "fusedserve_collective_bytes_total",
                   "fusedserve_collective_seconds_bucket", "by (op, group, path)"):
        assert needle in comm, needle
    for histogram in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
        for q in ("0.5", "0.95", "0.99"):
            assert f"histogram_quantile({q}, sum by (le) (rate(fusedserve_{histogram}_seconds_bucket" in serving
    for needle in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_ratio", "prompt_tokens_total",
                   "generation_tokens_total", "by (finished_reason)"):
        assert needle in serving, needle
    for needle in ("by (result)", "time_to_ready_seconds_bucket", "by (condition, status)"):
        assert needle in operator, needle


def test_alerts_cover_the_failure_modes() -> None:
    rules = alert_rules()
    low = rules["FusedserveAcceptanceLengthLow"]
    assert "accepted_tokens_total" in low and "drafts_total" in low and "<" in low
    assert rules["FusedserveAcceptanceLengthDrop"].count("offset") == 2
    extra = rules["FusedserveExtraCollectives"]
    assert "planned_calls_total" in extra and "unless" in extra  # an op the plan lacks counts too
    assert "by (namespace, deployment, engine_group, rank, op, group)" in extra  # per rank, never averaged away
    assert 'condition="Ready"' in rules["FusedserveDeploymentsNotReady"]
    assert "histogram_quantile(0.95" in rules["FusedserveTimeToFirstTokenHigh"]
    assert 'result!="success"' in rules["FusedserveOperatorReconcileErrors"]


# --- the alerts, evaluated ----------------------------------------------------------------------------------------

def _series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    return {"series": name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}", "values": values}


def _alerts_fire_as_designed() -> list[dict[str, Any]]:
    """promtool unit tests (one sample a minute; `0+60x60` = a counter growing 1/s for an hour)."""
    d1, d2 = {"namespace": "ml", "deployment": "d1"}, {"namespace": "ml", "deployment": "d2", "engine_group": "0"}
    op = {"namespace": "fusedserve-system", "pod": "operator"}
    spec = "fusedserve_spec_decode_"
    rank = [{**d2, "rank": str(r)} for r in range(3)]
    series = [
        _series(spec + "accepted_tokens_total", d1, "0+18x60"),  # d1: 1 + 0.3 = 1.3 < 1.5
        _series(spec + "drafts_total", d1, "0+60x60"),
        _series(spec + "accepted_tokens_total", d2, "0+90x60"),  # d2: 1 + 1.5 = 2.5
        _series(spec + "drafts_total", d2, "0+60x60"),
        # rank 0 follows its plan (2 all-reduces a forward, on two paths); rank 1 adds a reduce-scatter the plan
        # does not have (the reduce-twice bug); rank 2 runs 3 all-reduces a forward where 2 are planned.
        *[_series("fusedserve_forwards_total", r, "0+60x60") for r in rank],
        *[_series("fusedserve_collective_planned_calls_total", {**r, "op": "all_reduce", "group": "tp"},
                  "0+120x60") for r in rank],
        _series("fusedserve_collective_calls_total", {**rank[0], "op": "all_reduce", "group": "tp", "path": "nccl"},
                "0+60x60"),
        _series("fusedserve_collective_calls_total",
                {**rank[0], "op": "all_reduce", "group": "tp", "path": "flashinfer_fused"}, "0+60x60"),
        _series("fusedserve_collective_calls_total", {**rank[1], "op": "all_reduce", "group": "tp", "path": "nccl"},
                "0+120x60"),
        _series("fusedserve_collective_calls_total",
                {**rank[1], "op": "reduce_scatter", "group": "dp", "path": "nccl"}, "0+60x60"),
        _series("fusedserve_collective_calls_total", {**rank[2], "op": "all_reduce", "group": "tp", "path": "nccl"},
                "0+180x60"),
        _series("fusedserve_operator_deployments", {**op, "condition": "Ready", "status": "False"}, "1x60"),
        _series("fusedserve_operator_deployments", {**op, "condition": "Ready", "status": "True"}, "3x60"),
        _series("fusedserve_operator_reconciles_total", {**op, "result": "permanent_error"}, "0+6x60"),
        _series("fusedserve_operator_reconciles_total", {**op, "result": "temporary_error"}, "0x60"),
        _series("fusedserve_operator_reconciles_total", {**op, "result": "success"}, "0+60x60"),
        # every request's first token in (2, 2.5] s
        *[_series("fusedserve_time_to_first_token_seconds_bucket", {**d2, "engine_group": "", "le": le}, v)
          for le, v in (("2.0", "0x60"), ("2.5", "0+60x60"), ("+Inf", "0+60x60"))],
    ]

    def expect(name: str, *labels: dict[str, str], at: str = "30m") -> dict[str, Any]:
        return {"eval_time": at, "alertname": name, "exp_alerts": [{"exp_labels": dict(x)} for x in labels]}

    steady = {"interval": "1m", "input_series": series, "alert_rule_test": [
        expect("FusedserveAcceptanceLengthLow", {**d1, "severity": "warning"}),
        expect("FusedserveAcceptanceLengthDrop"),
        expect("FusedserveExtraCollectives",
               {**rank[1], "op": "reduce_scatter", "group": "dp", "severity": "critical"},
               {**rank[2], "op": "all_reduce", "group": "tp", "severity": "critical"}),
        expect("FusedserveDeploymentsNotReady", {**op, "condition": "Ready", "severity": "critical"}),
        expect("FusedserveOperatorReconcileErrors", {"result": "permanent_error", "severity": "warning"}),
        expect("FusedserveTimeToFirstTokenHigh", {"namespace": "ml", "deployment": "d2", "severity": "warning"}),
    ]}
    # Acceptance length 3.0 for two hours, then 1.5: half of what it was an hour before.
    drop = {"interval": "1m", "input_series": [
        _series(spec + "accepted_tokens_total", d1, "0+120x120 14400+30x60"),
        _series(spec + "drafts_total", d1, "0+60x180")], "alert_rule_test": [
        expect("FusedserveAcceptanceLengthDrop", at="100m"),
        expect("FusedserveAcceptanceLengthDrop", {**d1, "severity": "warning"}, at="150m")]}
    return [steady, drop]


def test_alerts_fire_as_designed(tmp_path: Path) -> None:
    """`promtool check rules` on the rendered rules (expressions and annotation templates), then promtool's rule
    unit tests: each alert fires on the series it is for, with the labels it promises, and not on the others."""
    promtool = prometheus_server.binary("promtool")
    groups = render_rules()
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    check = subprocess.run([promtool, "check", "rules", str(tmp_path / "rules.yaml")], check=False,
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    for group in groups:  # the unit tests compare labels; the annotations were checked above
        for rule in group["rules"]:
            rule.pop("annotations")
    (tmp_path / "bare.yaml").write_text(yaml.safe_dump({"groups": groups}))
    tests = {"rule_files": ["bare.yaml"], "evaluation_interval": "1m", "tests": _alerts_fire_as_designed()}
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests))
    result = subprocess.run([promtool, "test", "rules", "tests.yaml"], check=False, cwd=tmp_path,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def _panel_expr(stem: str, title: str, kind: str = "timeseries", ref: str = "A") -> str:
    return substituted(panel_expr(json.loads((CHART / "dashboards" / f"{stem}.json").read_text()), title, kind, ref))


def test_dashboard_panels_compute_what_they_say(tmp_path: Path) -> None:
    """Key panels evaluated by Prometheus's own engine (promtool's expression tests) on the series above."""
    promtool = prometheus_server.binary("promtool")
    series = _alerts_fire_as_designed()[0]["input_series"]
    d1, d2 = {"deployment": "d1", "namespace": "ml"}, {"deployment": "d2", "namespace": "ml", "engine_group": "0"}
    # Accepted at positions 0, 1, 2 per draft: d1 0.2, 0.1, 0 (sum 0.3); d2 0.8, 0.5, 0.2 (sum 1.5).
    for labels, rates in ((d1, (12, 6, 0)), (d2, (48, 30, 12))):
        series += [_series("fusedserve_spec_decode_accepted_tokens_per_position_total",
                           {**labels, "position": str(i)}, f"0+{r}x60") for i, r in enumerate(rates)]

    def sample(labels: dict[str, str], value: float) -> dict[str, Any]:
        return {"labels": "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}", "value": value}

    def expect(expr: str, *samples: dict[str, Any]) -> dict[str, Any]:
        return {"expr": expr, "eval_time": "60m", "exp_samples": list(samples)}

    rank = {**d2}
    tests = [
        expect(_panel_expr("speculative", "Mean acceptance length"), sample(d1, 1.3), sample(d2, 2.5)),
        expect(_panel_expr("speculative", "Acceptance rate per draft position"),
               *[sample({"position": str(i)}, v) for i, v in enumerate((0.5, 0.3, 0.1))]),
        expect(_panel_expr("communication", "Extra collectives per forward (executed - planned)"),
               sample({**rank, "rank": "0", "op": "all_reduce", "group": "tp"}, 0),
               sample({**rank, "rank": "1", "op": "all_reduce", "group": "tp"}, 0),
               sample({**rank, "rank": "2", "op": "all_reduce", "group": "tp"}, 1),
               sample({**rank, "rank": "1", "op": "reduce_scatter", "group": "dp"}, 1)),
        expect(_panel_expr("communication", "Collectives per forward: executed vs planned", ref="A"),
               sample({"op": "all_reduce", "group": "tp"}, 3), sample({"op": "reduce_scatter", "group": "dp"}, 1)),
        expect(_panel_expr("communication", "Collectives per forward: executed vs planned", ref="B"),
               sample({"op": "all_reduce", "group": "tp"}, 2)),
        expect(_panel_expr("communication", "Fused share of all-reductions", kind="stat"), sample({}, 1 / 7)),
        expect(_panel_expr("serving", "Time to first token", ref="B"), sample({}, 2.475)),
    ]
    (tmp_path / "empty.yaml").write_text("groups: []\n")
    spec = {"rule_files": ["empty.yaml"], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": series, "promql_expr_test": tests}]}
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(spec))
    result = subprocess.run([promtool, "test", "rules", "tests.yaml"], check=False, cwd=tmp_path,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# Queries of vLLM's published Grafana dashboard (vllm-project/vllm, examples/online_serving/prometheus_grafana/
# grafana.json, panels "E2E Request Latency", "Token Throughput", "Time Per Output Token Latency", "Scheduler State",
# "Time To First Token Latency", "Cache Utilization", "Request Prompt/Generation Length", "Finish Reason", "Queue
# Time", "Requests Prefill and Decode Time"), with vLLM v1's name for the cache gauge (kv_cache_usage_perc, which
# replaced gpu_cache_usage_perc), plus the spec-decode, prefix-cache, preemption, inter-token and endpoint-picker queries
# (the Gateway API Inference Extension reads vllm:num_requests_waiting and vllm:kv_cache_usage_perc).
VLLM_QUERIES = [
    ('histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name="$model_name"}'
     '[$__rate_interval])))'),
    ('rate(vllm:e2e_request_latency_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\n'
     'rate(vllm:e2e_request_latency_seconds_count{model_name="$model_name"}[$__rate_interval])'),
    'rate(vllm:prompt_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:generation_tokens_total{model_name="$model_name"}[$__rate_interval])',
    ('histogram_quantile(0.99, sum by(le) (rate(vllm:time_per_output_token_seconds_bucket{model_name="$model_name"}'
     '[$__rate_interval])))'),
    'vllm:num_requests_running{model_name="$model_name"}',
    'vllm:num_requests_waiting{model_name="$model_name"}',
    ('histogram_quantile(0.5, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{model_name="$model_name"}'
     '[$__rate_interval])))'),
    'vllm:kv_cache_usage_perc{model_name="$model_name"}',
    'sum by(le) (increase(vllm:request_prompt_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',
    'sum by(le) (increase(vllm:request_generation_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',
    'sum by(finished_reason) (increase(vllm:request_success_total{model_name="$model_name"}[$__rate_interval]))',
    'rate(vllm:request_queue_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_prefill_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_decode_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    ('histogram_quantile(0.9, sum by(le) (rate(vllm:inter_token_latency_seconds_bucket{model_name="$model_name"}'
     '[$__rate_interval])))'),
    'rate(vllm:num_preemptions_total{model_name="$model_name"}[$__rate_interval])',
    ('1 + sum(rate(vllm:spec_decode_num_accepted_tokens_total{model_name="$model_name"}[$__rate_interval]))'
     ' / sum(rate(vllm:spec_decode_num_drafts_total{model_name="$model_name"}[$__rate_interval]))'),
    ('sum(rate(vllm:spec_decode_num_accepted_tokens_total[$__rate_interval])) / '
     'sum(rate(vllm:spec_decode_num_draft_tokens_total[$__rate_interval]))'),
    ('sum by (position) (rate(vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="$model_name"}'
     '[$__rate_interval]))'),
    'sum by (model_name, engine) (vllm:num_requests_waiting)',
    ('sum(rate(vllm:prefix_cache_hits_total{model_name="$model_name"}[$__rate_interval])) / '
     'sum(rate(vllm:prefix_cache_queries_total{model_name="$model_name"}[$__rate_interval]))'),
]


@pytest.mark.parametrize("expr", VLLM_QUERIES)
def test_vllm_dashboard_queries_resolve(expr: str, exported: Exported) -> None:
    """Every metric a vLLM dashboard query selects is scraped from the worker, with the labels it matches on."""
    parsed = pq.parse(substituted(expr))
    names = [vs.name for vs in _selectors(parsed)]
    assert names and all(n.startswith("vllm:") for n in names)
    assert list(problems(parsed, exported)) == []
    for vs in _selectors(parsed):
        assert "model_name" in exported.labels[vs.name], vs.name


def test_vllm_series_are_one_per_engine_group(exported: Exported) -> None:
    """The tp=2 group's serving gauges come once (engine "0"), not once per rank."""
    assert exported.values["engine"] == {"0"}
    assert exported.values["model_name"] == {"tiny-code"}
