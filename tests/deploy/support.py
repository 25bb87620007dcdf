"""What the deployment tests (test_chart.py, test_monitoring.py) check deploy/ against: the
server's real routes, its real /metrics exposition after real requests, and PromQL parsed by a real parser."""

from __future__ import annotations

import functools
import io
import json
import re
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import helm_python
import jsonschema
import kubernetes_validate
import promql_parser
import yaml
from fastapi.testclient import TestClient
from kubernetes_validate.utils import schema_contents
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families
from referencing import Registry, Resource

from models.demo import DEMO_DIR
from service.base.config import Settings
from service.edge.app import create_app
from tests.paths import ROOT

DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "multimax-serve"
KUBE_VERSION = "1.30.0"  # the chart's kubeVersion floor
CRDS = Path(__file__).parent / "data" / "crds"
# Series Prometheus makes itself for every target: never in the server's exposition.
PROMETHEUS_SERIES = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped"})
# Labels Prometheus (job, instance) and the Prometheus Operator (namespace, pod, service, endpoint, container)
# attach to every scraped series.
TARGET_LABELS = frozenset({"job", "instance", "namespace", "pod", "service", "endpoint", "container"})
# Grafana's variables, as Prometheus would receive them (`$model` is a multi-value variable: a regex).
GRAFANA_VARIABLES = {"__rate_interval": "1m", "__interval": "15s", "__range": "1h", "model": ".+"}


@dataclass
class Exposition:
    """The label sets of every sample name on one GET /metrics page."""

    series: dict[str, list[dict[str, str]]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Exposition:
        series: dict[str, list[dict[str, str]]] = defaultdict(list)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                series[sample.name].append(dict(sample.labels))
        return cls(dict(series))


def render(values: dict[str, Any], name: str = "mm", namespace: str = "serving",
           chart: Path = CHART) -> list[dict[str, Any]]:
    """The chart's manifests as `helm template NAME CHART --namespace NAMESPACE` renders them (Helm's engine)."""
    with helm_python.Chart.load(chart) as loaded:
        out = loaded.render(values, name=name, namespace=namespace)
    docs = [d for path, text in sorted(out.items()) if path.endswith(".yaml") for d in yaml.safe_load_all(text)]
    return [d for d in docs if d]


@functools.cache
def _crd_validators() -> dict[tuple[str, str], jsonschema.Draft202012Validator]:
    defs = schema_contents(f"kubernetes-json-schema/v{KUBE_VERSION}-local-strict/_definitions.json", KUBE_VERSION)
    registry: Registry = Resource.from_contents(defs) @ Registry()
    validators = {}
    for path in CRDS.glob("*.json"):
        schema = json.loads(path.read_text())
        props = schema["properties"]
        validators[(props["apiVersion"]["const"], props["kind"]["const"])] = jsonschema.Draft202012Validator(
            schema, registry=registry)
    return validators


def validate(doc: dict[str, Any]) -> None:
    """Raises if the resource does not match its schema: Kubernetes' own (strict) for built-in kinds, the subset
    in tests/deploy/data/crds for the CRDs the chart renders."""
    crd = _crd_validators().get((doc["apiVersion"], doc["kind"]))
    if crd is not None:
        crd.validate(doc)
    else:
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("L", (32, 32), 128).save(buf, "PNG")
    return buf.getvalue()


@contextmanager
def demo_client(settings: Settings | None = None) -> Iterator[TestClient]:
    """The shipped demo models served in-process (no warm-up: the tests do not time anything)."""
    settings = (settings or Settings()).replace(model_dir=DEMO_DIR, warmup_calls=0)
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        yield client


def exercised_exposition(client: TestClient) -> Exposition:
    """/metrics after a classification, a generation of several tokens and a request for an unknown model, so
    that every labelled series (histograms observe only once something happened) is on the page."""
    r = client.post("/v1/models/digits_multimax/classify", content=_png(), headers={"content-type": "image/png"})
    assert r.status_code == 200, r.text
    r = client.post("/v1/completions", json={"model": "text_multimax", "prompt": "def f", "max_tokens": 4,
                                            "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert client.post("/v1/completions", json={"model": "no_such_model", "prompt": "x"}).status_code == 404
    r = client.get("/metrics")
    assert r.status_code == 200
    return Exposition.parse(r.text)


def get_routes(client: TestClient) -> set[str]:
    """Paths the app answers with GET, from its own OpenAPI description (FastAPI builds it from the routing
    table; the table itself nests included routers differently across FastAPI versions)."""
    paths = client.get("/openapi.json").json()["paths"]
    return {path for path, operations in paths.items() if "get" in operations}


def grafana_to_promql(expr: str) -> str:
    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in GRAFANA_VARIABLES:
            raise AssertionError(f"unknown Grafana variable ${name} in {expr!r}")
        return GRAFANA_VARIABLES[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", sub, expr)


def selectors(expr: str) -> list[promql_parser.VectorSelector]:
    """Every vector selector of a PromQL expression (raises on a syntax error)."""
    found: list[promql_parser.VectorSelector] = []

    def visit(node: promql_parser.Expr) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            found.append(node)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return found


def check_query(expr: str, exposition: Exposition) -> list[str]:
    """Problems of one PromQL expression against the exposition: a metric the server does not export, a label
    its series do not carry, a matcher no exported value satisfies. Empty: every selector can match."""
    problems = []
    for sel in selectors(expr):
        if sel.name is None:
            problems.append(f"{sel}: selects no metric by name")
            continue
        if sel.name in PROMETHEUS_SERIES:
            continue
        if sel.name not in exposition.series:
            problems.append(f"{sel.name}: not in the server's /metrics")
            continue
        label_sets = exposition.series[sel.name]
        for m in sel.matchers.matchers:
            if m.name in TARGET_LABELS:
                continue
            values = {labels[m.name] for labels in label_sets if m.name in labels}
            if not values:
                problems.append(f"{sel.name}: has no label {m.name!r}")
            elif m.op == promql_parser.MatchOp.Equal and m.value not in values:
                problems.append(f"{sel.name}{{{m.name}={m.value!r}}}: the server exports {sorted(values)}")
            elif m.op == promql_parser.MatchOp.Re and not any(re.fullmatch(m.value, v) for v in values):
                problems.append(f"{sel.name}{{{m.name}=~{m.value!r}}}: matches none of {sorted(values)}")
    return problems + _grouping_problems(expr, exposition)


def _grouping_problems(expr: str, exposition: Exposition) -> list[str]:
    """`sum by (label)` over series that lack the label: one group with an empty legend, a silent mistake."""
    problems = []

    def visit(node: promql_parser.Expr) -> None:
        if not isinstance(node, promql_parser.AggregateExpr) or node.modifier is None:
            return
        if node.modifier.type != promql_parser.AggModifierType.By:
            return
        have = set(TARGET_LABELS)
        for sel in selectors(str(node.expr)):
            have.update(k for labels in exposition.series.get(sel.name or "", ()) for k in labels)
        problems.extend(f"{node}: groups by {label!r}, which its series lack"
                        for label in node.modifier.labels if label not in have)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return problems


def dashboard_queries(path: Path) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of a Grafana dashboard JSON file."""
    dash = json.loads(path.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", ())]
