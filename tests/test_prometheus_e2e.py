"""The dashboards and alerts evaluated by a real Prometheus that scrapes real workers and the real operator.

One Prometheus 2.42 (Debian's package: tests/prometheus_server.py) on loopback scrapes every second:

- ``fusedserve run examples/02-tiny-code-tp2.yaml`` (tp=2, fused all-reduce + add + RMSNorm, EAGLE3) and
  ``fusedserve run examples/03-tiny-moe-dp-ep.yaml`` (attention dp=2, ep=2), both joined to one test Ray (the
  servers test_ray_runtime uses too: conftest's ``example_servers``), scraped as the PodMonitor does
  (``honor_labels``);
- the ``fusedserve-operator`` command against the emulated API server (tests/kube), with the target labels the
  ServiceMonitor would add; it reconciles examples/02 (its controller ``/status`` is the tp2 server's, so it
  becomes Ready) and one InferenceDeployment with an invalid spec;
- a planted target (tests/planted_target.py): the tp2 worker's live communication counters, renamed to another
  deployment, with one extra collective per forward on each rank.

It loads the chart's PrometheusRule as helm renders it, with the shipped thresholds except where said below,
and windows / ``for`` shortened to seconds (``RULE_VALUES``). The traffic is bounded: ``PHASE_S`` of phase
"high", greedy completions of repetitive code (acceptance length close to 1 + 3), then phase "low", sampled
(temperature 1, seeded) completions of prose (about 1.6): a real acceptance drop; phase low lasts until every
alert of ``FIRING_AT_THE_END`` has fired (at most ``PHASE_S``). The MoE deployment serves requests on both DP groups
all along. Then every dashboard query (Grafana's ``$__rate_interval`` and
``$__range`` = the run, its other variables = All), every variable and every alert quantity is evaluated
through the HTTP API and must return data (``LEGITIMATELY_EMPTY`` says which may not, and why; over an idle
window only quantiles and ratios may be empty, ``IDLE_REASONS``); key panel values are compared with the
engine counters read straight from ``/metrics``; and each alert must have fired on what it is for, and only
there.
"""

from __future__ import annotations

import math
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `tests.*` importable under a bare `pytest` too
    sys.path.append(str(ROOT))

from tests import prometheus_server
from tests.chart_queries import alert_rules, boards, dashboard_queries, panel_expr, render_rules, substituted
from tests.eventually import eventually
from tests.operator_process import TP2, Operator
from tests.planted_target import PlantedTarget
from tests.prometheus_server import PrometheusServer, file_sd_job
from tests.serve_process import ExampleServers, Server, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

MOE, PLANTED = "tiny-moe", "tiny-code-tp2-planted"
OPERATOR_TARGET = {"namespace": "fusedserve-system", "pod": "fusedserve-operator-0", "service": "fusedserve",
                   "endpoint": "metrics", "container": "operator"}
PHASE_S = 14.0
IDLE_S = 3.0
# Shipped thresholds (ratio 0.8, tolerance 0.01, reconcile errors > 0) unless noted; windows in seconds.
RULE_VALUES: dict[str, Any] = {"alerts": {
    # between the two phases' real acceptance lengths (shipped 1.5: the sampled phase is only just above it)
    "acceptanceLengthLow": {"floor": 2.5, "window": "6s", "for": "2s"},
    # "now" (6 s of phase low) against 12 s before (phase high)
    "acceptanceLengthDrop": {"window": "6s", "lookback": "12s", "for": "2s"},
    "extraCollectives": {"window": "8s", "for": "3s"},
    # below any real time to first token (shipped 2 s; these tiny models answer in milliseconds)
    "ttftHigh": {"thresholdSeconds": 0.001, "window": "8s", "for": "2s"},
    "notReady": {"for": "3s"},
    "reconcileErrors": {"window": "20s", "for": "2s"},
}}
# (alertname, deployment) of the alerts the tests below find firing; phase low ends once all of them have fired.
FIRING_AT_THE_END = {("FusedserveAcceptanceLengthLow", TP2), ("FusedserveAcceptanceLengthDrop", TP2),
                     ("FusedserveExtraCollectives", PLANTED), ("FusedserveTimeToFirstTokenHigh", TP2),
                     ("FusedserveTimeToFirstTokenHigh", MOE), ("FusedserveDeploymentsNotReady", None),
                     ("FusedserveOperatorReconcileErrors", None)}
HIGH_PROMPTS = ["import os\nimport os\nimport os\n", "################"]
LOW_PROMPTS = ["The weather in Paris", "Lorem ipsum dolor sit amet", "Once upon a time", "Dear Sir or Madam"]
MOE_PROMPTS = ["def f(x):", "import os", "class B:", "for i in"]
# Queries that may return nothing after this traffic, and why. Everything else must return a finite value.
LEGITIMATELY_EMPTY = {
    "alert FusedserveAcceptanceLengthDrop":
        "compares with the same window `lookback` (1h as shipped) ago, and these servers are minutes old",
}
# Why a dashboard query may show nothing while nothing runs (windows without traffic): the only reasons.
IDLE_REASONS = {
    "quantile": "histogram_quantile over a window without observations is NaN (Grafana: No data)",
    "ratio": "a ratio of rates or increases is 0/0 while nothing runs (Grafana: No data)",
}


def idle_reason(expr: str) -> str | None:
    if "histogram_quantile" in expr:
        return IDLE_REASONS["quantile"]
    if re.search(r"\)\s*/", expr):
        return IDLE_REASONS["ratio"]
    return None


# --- the set-up -------------------------------------------------------------------------------------------------

Samples = list[tuple[str, dict[str, str], float]]


@dataclass
class Observed:
    """What ran, and when (wall-clock seconds, as Prometheus timestamps)."""

    prom: PrometheusServer
    servers: dict[str, Server]
    start: float  # idle; the tp2 counters in ``before`` were read here
    low: float  # phase high ended, phase low began
    end: float  # traffic over, idle since; the tp2 counters in ``after`` were read before
    before: Samples
    after: Samples
    completion_tokens: int  # sum of the tp2 responses' usage.completion_tokens
    window_s: float = 0.0  # [end - window_s, end] holds exactly the traffic, idle samples at both ends
    errors: list[str] = field(default_factory=list)

    def delta(self, name: str, **labels: str) -> float:
        return counter(self.after, name, **labels) - counter(self.before, name, **labels)


def scrape(server: Server) -> Samples:
    """Every sample of a server's ``/metrics``: (name, labels, value)."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]


def counter(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    return sum(v for n, have, v in samples if n == name and all(have.get(k) == x for k, x in labels.items()))


def _traffic(observed_errors: list[str], until: float | threading.Event,
             send: Callable[[int], int]) -> tuple[threading.Thread, list[int]]:
    """A thread calling ``send(i)`` (i = 0, 1, ...) until ``until`` (a time, or an event set); it collects the
    returned token counts."""
    tokens: list[int] = []

    def going() -> bool:
        return not until.is_set() if isinstance(until, threading.Event) else time.time() < until

    def loop() -> None:
        i = 0
        while going():
            try:
                tokens.append(send(i))
            except Exception as e:  # noqa: BLE001 (reported by the fixture)
                observed_errors.append(f"{type(e).__name__}: {e}")
                return
            i += 1

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread, tokens


def _fired_since(prom: PrometheusServer, since: float) -> set[tuple[str, str | None]]:
    """(alertname, deployment) of the alerts that fired at some time since ``since``."""
    window = f"{int((time.time() - since) * 1000) + 1000}ms"
    return {(r["metric"]["alertname"], r["metric"].get("deployment"))
            for r in prom.query(f'last_over_time(ALERTS{{alertstate="firing"}}[{window}])')}


def _run_traffic(tp2: Server, moe: Server, low_at: float, end_at: float, errors: list[str],
                 prom: PrometheusServer, since: float) -> int:
    """Phase high until ``low_at``, then phase low until every alert of FIRING_AT_THE_END has fired since
    ``since`` (or until ``end_at``)."""
    def tp2_high(i: int) -> int:
        comp = tp2.client().completions.create(model=TP2, prompt=HIGH_PROMPTS[i % len(HIGH_PROMPTS)],
                                               max_tokens=32, temperature=0)
        return comp.usage.completion_tokens if comp.usage else 0

    def tp2_low(i: int) -> int:
        comp = tp2.client().completions.create(model=TP2, prompt=LOW_PROMPTS[i % len(LOW_PROMPTS)], max_tokens=32,
                                               temperature=1.0, seed=i)
        return comp.usage.completion_tokens if comp.usage else 0

    def moe_any(i: int) -> int:
        comp = moe.client().completions.create(model=MOE, prompt=MOE_PROMPTS[i % len(MOE_PROMPTS)], max_tokens=16,
                                               temperature=0)
        return comp.usage.completion_tokens if comp.usage else 0

    stop = threading.Event()
    moe_threads = [_traffic(errors, stop, moe_any) for _ in range(2)]
    high = [_traffic(errors, low_at, tp2_high) for _ in range(2)]
    for t, _ in high:
        t.join()
    low = [_traffic(errors, stop, tp2_low) for _ in range(2)]
    while time.time() < end_at and not (errors or FIRING_AT_THE_END <= _fired_since(prom, since)):
        time.sleep(0.5)
    stop.set()
    for t, _ in low + moe_threads:
        t.join()
    return sum(sum(tokens) for _, tokens in high + low)


@pytest.fixture(scope="module")
def prometheus() -> str:
    """Skip (or fail where required, as in CI) before anything starts."""
    prometheus_server.binary("promtool")
    return prometheus_server.binary("prometheus")


@pytest.fixture(scope="module")
def observed(prometheus: str, example_servers: ExampleServers,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    tmp = tmp_path_factory.mktemp("prometheus-e2e")
    operator = planted = prom = None
    try:
        # Prometheus first: it takes up targets only every few seconds (prometheus_server.py), so they are
        # written once known, while it runs
        workdir = tmp / "prometheus"
        scrape_configs = [file_sd_job(workdir, "workers", honor_labels=True, metrics_path="/metrics"),
                          file_sd_job(workdir, "planted", honor_labels=True), file_sd_job(workdir, "operator")]
        prom = PrometheusServer(workdir, free_port(), scrape_configs, {"groups": render_rules(RULE_VALUES)}).start()
        servers = example_servers.get(TP2, MOE)  # started in parallel; shared with test_ray_runtime (conftest)
        tp2, moe = servers[TP2], servers[MOE]
        operator = Operator(tmp, f"{tp2.url}/status")
        planted = PlantedTarget(tp2.url, PLANTED).start()
        prom.set_targets("workers", [s.url.removeprefix("http://") for s in (tp2, moe)])
        prom.set_targets("planted", [planted.address])
        prom.set_targets("operator", [f"127.0.0.1:{operator.metrics_port}"], OPERATOR_TARGET)
        prom.wait_for_targets({"workers", "planted", "operator"})

        start_at = time.time()
        before = scrape(tp2)
        # The rate window starts at tp2's first sample from here (_window). The operator must be scraped inside
        # it before it reconciles, or increase() over the window misses the reconciles: sleeping a fixed
        # IDLE_S / 2 left that to the scrape phases and to how soon kopf answered (its three reconcile-duration
        # panels came back empty on a fresh clone's CI run).
        window_start = eventually(lambda: _scraped_since(prom, TP2_FORWARDS, start_at), timeout=30)
        eventually(lambda: _scraped_since(prom, "fusedserve_operator_reconcile_duration_seconds_count", window_start),
                   timeout=30)
        operator.apply(tmp)
        time.sleep(max(0.0, start_at + IDLE_S - time.time()))
        errors: list[str] = []
        low_at = time.time() + PHASE_S
        tokens = _run_traffic(tp2, moe, low_at, low_at + PHASE_S, errors, prom, start_at)
        after = scrape(tp2)
        eventually(operator.ready, timeout=30)
        time.sleep(IDLE_S)
        run = Observed(prom, servers, start_at, low_at, time.time(), before, after, tokens, errors=errors)
        run.window_s = _window(run)
        yield run
    finally:
        stops = [x.stop for x in (prom, planted, operator) if x is not None]  # the servers are shared (conftest)
        stopping = [threading.Thread(target=stop) for stop in stops]  # each one waits for its processes
        for t in stopping:
            t.start()
        for t in stopping:
            t.join()


TP2_FORWARDS = f'fusedserve_forwards_total{{deployment="{TP2}",rank="0"}}'


def _scraped_since(prom: PrometheusServer, selector: str, t: float) -> float | None:
    """When the first sample of ``selector`` at or after ``t`` was scraped, or None (not yet)."""
    now = time.time()
    stamps = [float(ts) for row in prom.samples(selector, now, now - t + 1.0) for ts, _ in row["values"]
              if float(ts) >= t]
    return min(stamps) if stamps else None


def _window(run: Observed) -> float:
    """The rate window ending at ``run.end`` that starts 1 ms before the first tp2 sample scraped after
    ``run.start``: its first and last samples are idle ones, so increase() covers exactly the traffic (the
    extrapolation to the window's edges scales every series of one scrape alike)."""
    first = _scraped_since(run.prom, TP2_FORWARDS, run.start)
    assert first is not None
    return run.end - first + 0.001


def _grafana(run: Observed, **variables: str) -> dict[str, str]:
    """Grafana's variables for a dashboard showing the whole run."""
    window = f"{int(run.window_s * 1000)}ms"
    return {"__rate_interval": window, "__range": window, "__interval": "1s", **variables}


def _values(rows: list[dict[str, Any]]) -> list[float]:
    return [float(r["value"][1]) for r in rows]


# --- every query returns data -------------------------------------------------------------------------------

def test_the_traffic_ran_without_errors(observed: Observed) -> None:
    assert observed.errors == []
    # the engine's counters match the responses the test got
    assert observed.delta("fusedserve_generation_tokens_total") == observed.completion_tokens > 0
    assert observed.delta("fusedserve_spec_decode_drafts_total") > 0


def _empty_or_broken(run: Observed, queries: list[tuple[str, str]], at: float) -> list[str]:
    found = []
    for where, expr in queries:
        try:
            finite = [v for v in _values(run.prom.query(expr, at=at)) if math.isfinite(v)]
        except prometheus_server.PromQLError as e:
            found.append(f"{where}: {e}")
            continue
        if not finite and where not in LEGITIMATELY_EMPTY:
            found.append(f"{where}: no data")
    return found


def test_every_dashboard_query_and_variable_returns_data(observed: Observed) -> None:
    variables = _grafana(observed)
    queries = [(where, substituted(expr, variables)) for board in boards().values()
               for where, expr in dashboard_queries(board)]
    assert len(queries) > 40
    assert _empty_or_broken(observed, queries, observed.end) == []


def test_while_idle_only_quantiles_and_ratios_show_nothing(observed: Observed) -> None:
    """The same queries over the last 2.5 s, all idle: what is empty there is empty for a listed reason (the
    counters, gauges and rates still show, as zeros); and after the traffic above, those had data too."""
    variables = {"__rate_interval": "2500ms", "__range": "2500ms", "__interval": "1s"}
    empty, unexplained = [], []
    for board in boards().values():
        for where, expr in dashboard_queries(board):
            if _empty_or_broken(observed, [(where, substituted(expr, variables))], observed.end):
                empty.append(where)
                if idle_reason(expr) is None:
                    unexplained.append(where)
    assert unexplained == []
    assert len(empty) >= 10, empty  # the quantile and ratio panels really are empty then


def test_a_query_naming_a_metric_nobody_exports_is_reported(observed: Observed) -> None:
    """The check above is not vacuous: a misspelt family or label value returns no data and is reported."""
    wrong = [("misspelt", 'sum(rate(fusedserve_spec_decode_accepted_total[1m]))'),
             ("no such op", 'sum(rate(fusedserve_collective_calls_total{op="all_to_all"}[1m]))'),
             ("not PromQL", "sum(rate(fusedserve_forwards_total[1m])")]
    assert [w.split(":")[0] for w in _empty_or_broken(observed, wrong, observed.end)] == [w for w, _ in wrong]


def _quantity(expr: str) -> str:
    """An alert expression without its final comparison with a number: the quantity it compares."""
    bare, n = re.subn(r"\s*[<>]=?\s*-?[0-9.]+(e-?[0-9]+)?\s*$", "", expr)
    assert n == 1, expr
    return bare


def test_every_alert_quantity_returns_data_with_the_shipped_values(observed: Observed) -> None:
    """The chart's rules as shipped (10 min windows cover the whole run), evaluated at the end."""
    shipped = alert_rules()
    assert len(shipped) == 6
    queries = [(f"alert {name}", _quantity(expr)) for name, expr in shipped.items()]
    assert _empty_or_broken(observed, queries, observed.end) == []
    for name in LEGITIMATELY_EMPTY:  # and those listed really are empty (else the list is stale)
        expr = dict(queries)[name]
        assert observed.prom.query(expr, at=observed.end) == [], name


def test_the_rules_load_and_evaluate_without_errors(observed: Observed) -> None:
    rules = observed.prom.rules()
    assert sorted(r["name"] for r in rules) == sorted(alert_rules(RULE_VALUES))
    assert [(r["name"], r["health"], r.get("lastError")) for r in rules if r["health"] != "ok"] == []


# --- panels compute what they say ------------------------------------------------------------------------------

def test_acceptance_length_panels_equal_the_engine_counters(observed: Observed) -> None:
    """1 + accepted / drafts of the traffic, from the tp2 engine's counters read before and after it."""
    drafts = observed.delta("fusedserve_spec_decode_drafts_total")
    accepted = observed.delta("fusedserve_spec_decode_accepted_tokens_total")
    expected = 1 + accepted / drafts
    assert 1.5 < expected < 4.0  # both phases in it
    spec = boards()["speculative"]
    variables = _grafana(observed, deployment=TP2)
    [stat] = _values(observed.prom.query(substituted(panel_expr(spec, "Mean acceptance length", "stat"),
                                                     variables), at=observed.end))
    [series] = _values(observed.prom.query(substituted(panel_expr(spec, "Mean acceptance length"), variables),
                                           at=observed.end))
    assert math.isclose(stat, expected, rel_tol=1e-6), (stat, expected)
    assert math.isclose(series, expected, rel_tol=1e-6), (series, expected)
    [rate] = _values(observed.prom.query(substituted(panel_expr(spec, "Draft acceptance rate", "stat"), variables),
                                         at=observed.end))
    assert math.isclose(rate, accepted / observed.delta("fusedserve_spec_decode_draft_tokens_total"), rel_tol=1e-6)
    rows = observed.prom.query(substituted(panel_expr(spec, "Acceptance rate per draft position"), variables),
                               at=observed.end)
    per_position = {r["metric"]["position"]: float(r["value"][1]) for r in rows}
    assert sorted(per_position) == ["0", "1", "2"]  # numSteps 3
    for position, value in per_position.items():
        share = observed.delta("fusedserve_spec_decode_accepted_tokens_per_position_total", position=position) / drafts
        assert math.isclose(value, share, rel_tol=1e-4, abs_tol=1e-9), (position, value, share)
    assert math.isclose(sum(per_position.values()), expected - 1, rel_tol=1e-4)


def _by_op_group(rows: list[dict[str, Any]]) -> dict[tuple[str, str], float]:
    return {(r["metric"]["op"], r["metric"]["group"]): float(r["value"][1]) for r in rows}


def test_collectives_per_forward_executed_equals_planned_on_real_workers(observed: Observed) -> None:
    comm = boards()["communication"]
    for deployment in (TP2, MOE):
        variables = _grafana(observed, deployment=deployment)
        executed, planned = (_by_op_group(observed.prom.query(substituted(
            panel_expr(comm, "Collectives per forward: executed vs planned", ref=ref), variables), at=observed.end))
            for ref in ("A", "B"))
        assert executed and executed.keys() == planned.keys(), deployment
        for k, v in executed.items():
            assert math.isclose(v, planned[k], rel_tol=1e-9), (deployment, k, v, planned[k])
        extra = observed.prom.query(substituted(panel_expr(comm, "Extra collectives per forward (executed - planned)"),
                                                variables), at=observed.end)
        assert extra and all(abs(v) < 1e-9 for v in _values(extra)), (deployment, extra)
    # tp2: 2 ranks, fused all-reduce on the reference path; the counters agree with the panel
    tp2 = _by_op_group(observed.prom.query(substituted(
        panel_expr(comm, "Collectives per forward: executed vs planned", ref="A"), _grafana(observed, deployment=TP2)),
        at=observed.end))
    forwards = observed.delta("fusedserve_forwards_total", rank="0")
    for (op, group), v in tp2.items():
        per_rank = [observed.delta("fusedserve_collective_calls_total", op=op, group=group, rank=r) /
                    observed.delta("fusedserve_forwards_total", rank=r) for r in ("0", "1")]
        assert math.isclose(v, max(per_rank), rel_tol=1e-6), (op, group, v, per_rank, forwards)
    assert ("fused_ar_add_rmsnorm", "tp") in tp2


def test_the_planted_collectives_show_as_one_extra_call_per_forward(observed: Observed) -> None:
    comm = boards()["communication"]
    rows = observed.prom.query(substituted(panel_expr(comm, "Extra collectives per forward (executed - planned)"),
                                           _grafana(observed, deployment=PLANTED)), at=observed.end)
    nonzero = {(r["metric"]["rank"], r["metric"]["op"], r["metric"]["group"]): round(float(r["value"][1]), 9)
               for r in rows if abs(float(r["value"][1])) > 1e-9}
    assert nonzero == {("0", "all_reduce", "tp"): 1.0, ("1", "reduce_scatter", "tp"): 1.0}


# --- alerts fire on what they are for, and only there ----------------------------------------------------------

def _fired(run: Observed, alert: str, state: str = "firing", start: float | None = None,
           end: float | None = None) -> set[tuple[tuple[str, str], ...]]:
    """Label sets (alertname, alertstate, job and instance dropped) of ``alert`` in ``state`` in [start, end]."""
    rows = run.prom.query_range(f'ALERTS{{alertname="{alert}", alertstate="{state}"}}',
                                run.start if start is None else start, run.end if end is None else end)
    drop = {"__name__", "alertname", "alertstate", "job", "instance"}
    return {tuple(sorted((k, v) for k, v in r["metric"].items() if k not in drop)) for r in rows}


def _worker(deployment: str, **more: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"namespace": "default", "deployment": deployment, **more}.items()))


def test_extra_collectives_fires_for_the_planted_collectives_only(observed: Observed) -> None:
    rank = {"namespace": "default", "deployment": PLANTED, "engine_group": "0", "severity": "critical"}
    assert _fired(observed, "FusedserveExtraCollectives") == {
        tuple(sorted({**rank, "rank": "0", "op": "all_reduce", "group": "tp"}.items())),
        tuple(sorted({**rank, "rank": "1", "op": "reduce_scatter", "group": "tp"}.items())),
    }
    # the real deployments were evaluated (the quantity had values), they were just within the plan
    mid = observed.low  # traffic on both sides
    quantity = _quantity(alert_rules(RULE_VALUES)["FusedserveExtraCollectives"])
    real = [(r["metric"]["deployment"], float(r["value"][1])) for r in observed.prom.query(quantity, at=mid)
            if r["metric"]["deployment"] != PLANTED]
    assert {d for d, _ in real} == {TP2, MOE}
    assert all(v <= 0.01 for _, v in real), real


def test_acceptance_alerts_fire_on_the_real_drop_and_not_before(observed: Observed) -> None:
    low = _fired(observed, "FusedserveAcceptanceLengthLow")
    assert low == {_worker(TP2, severity="warning")}  # tiny-moe has no speculation: no series
    # silent while the whole 6 s window was in phase high (acceptance close to 4)
    assert _fired(observed, "FusedserveAcceptanceLengthLow", "pending", observed.start, observed.low - 0.5) == set()
    assert _fired(observed, "FusedserveAcceptanceLengthDrop") == {_worker(TP2, severity="warning")}
    assert _fired(observed, "FusedserveAcceptanceLengthDrop", "pending", observed.start, observed.low) == set()


def test_ttft_not_ready_and_reconcile_error_alerts_fire(observed: Observed) -> None:
    assert _fired(observed, "FusedserveTimeToFirstTokenHigh") == {_worker(TP2, severity="warning"),
                                                                 _worker(MOE, severity="warning")}
    operator = {"namespace": "fusedserve-system", "pod": "fusedserve-operator-0", "service": "fusedserve",
                "endpoint": "metrics", "container": "operator"}
    assert _fired(observed, "FusedserveDeploymentsNotReady") == {
        tuple(sorted({**operator, "condition": "Ready", "severity": "critical"}.items()))}
    results = {dict(labels)["result"] for labels in _fired(observed, "FusedserveOperatorReconcileErrors")}
    assert "permanent_error" in results and "success" not in results, results


