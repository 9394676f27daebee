"""The chart's PromQL, read the way Grafana and the Prometheus Operator read it (shared by the dashboard tests).

``dashboard_queries(board)`` lists every panel target and every variable's ``label_values()`` selector;
``render_rules(values)`` renders ``templates/prometheusrule.yaml`` with helm_python (the chart's defaults
merged with ``values``) and returns its rule groups; ``substituted`` replaces Grafana's variables.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import helm_python
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "fusedserve"
DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))
SUBSTITUTIONS = {"__rate_interval": "5m", "__range": "1h", "__interval": "1m"}


def boards() -> dict[str, dict[str, Any]]:
    """Dashboard JSON models by file stem (speculative, communication, serving, operator)."""
    return {p.stem: json.loads(p.read_text()) for p in DASHBOARDS}


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' nested panels included."""
    for panel in items:
        yield panel
        yield from panels(panel.get("panels", []))


def dashboard_queries(board: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every target, and of every variable's label_values() selector."""
    for panel in panels(board["panels"]):
        for t in panel.get("targets", []):
            yield f"{board['uid']} / {panel['title']} ({panel['type']}) / {t['refId']}", t["expr"]
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["definition"])
            assert match, var["definition"]
            yield f"{board['uid']} / ${var['name']}", f"group by ({match.group(2)}) ({match.group(1)})"


def panel_expr(board: dict[str, Any], title: str, kind: str = "timeseries", ref: str = "A") -> str:
    """The (unsubstituted) expression of one panel target."""
    [expr] = [t["expr"] for p in panels(board["panels"]) if p["title"] == title and p["type"] == kind
              for t in p["targets"] if t["refId"] == ref]
    return str(expr)


def substituted(expr: str, values: Mapping[str, str] | None = None) -> str:
    """Grafana's variables replaced: ``values`` first, then intervals by durations, the rest by '.*' (the
    dashboards' "All": every matcher of a variable is a regex)."""
    table = {**SUBSTITUTIONS, **(values or {})}
    return re.sub(r"\$\{?(\w+)\}?", lambda m: table.get(m.group(1), ".*"), expr)


def _merged(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merged(out.get(k, {}), v) if isinstance(v, Mapping) else v
    return out


def render_rules(values: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """The PrometheusRule's ``spec.groups`` as the chart renders them (monitoring on, ``values`` on top)."""
    merged = _merged({"monitoring": {"enabled": True}}, values or {})
    with helm_python.Chart.load(CHART) as chart:
        rendered = chart.render(merged, name="fs", namespace="fusedserve-system")
    rule = yaml.safe_load(rendered["fusedserve/templates/prometheusrule.yaml"])
    return list(rule["spec"]["groups"])


def alert_rules(values: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Alert name -> rendered expression."""
    return {r["alert"]: r["expr"] for g in render_rules(values) for r in g["rules"]}
