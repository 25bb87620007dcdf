"""The compose stack (deploy/compose) and the monitoring around the server: compose.yaml parsed and validated by
a Compose-spec parser (compose-spec, bindings to the Rust compose_spec crate), the server's command parsed by
the server's own parser, and every PromQL expression (Grafana dashboard, alert rules) parsed by a PromQL parser
(promql-parser) with each metric name and label matcher checked against the /metrics page of the server running
in-process after real requests. Nothing is started but the app: no Docker, Prometheus or Grafana here."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml
from compose_spec import PyCompose

from service.base.config import Settings, build_parser, load_settings
from tests.deploy.support import (
    DEPLOY,
    ROOT,
    Exposition,
    check_query,
    dashboard_queries,
    demo_client,
    exercised_exposition,
    get_routes,
    grafana_to_promql,
    selectors,
)

COMPOSE_DIR = DEPLOY / "compose"
COMPOSE = COMPOSE_DIR / "compose.yaml"
DASHBOARD = COMPOSE_DIR / "grafana" / "dashboards" / "multimax-serve.json"
ALERTS = COMPOSE_DIR / "prometheus" / "alerts.yml"
PROMETHEUS = COMPOSE_DIR / "prometheus" / "prometheus.yml"
# What the issue asks the dashboard to show, as the metrics that show it.
DASHBOARD_TOPICS = {
    "queue depth": "multimax_pending_requests",
    "batch sizes": "multimax_batch_size_bucket",
    "time to first token": "multimax_time_to_first_token_seconds_bucket",
    "inter-token latency": "multimax_inter_token_latency_seconds_bucket",
    "tokens/s": "multimax_generation_tokens_total",
    "request rates by status": "multimax_requests_total",
    "readiness": "multimax_model_ready",
}


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def interpolate(text: str) -> str:
    """Compose's `${VAR:-default}` with an empty environment: the defaults."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", text)


def bind_mounts(service: dict[str, Any]) -> list[tuple[Path, str]]:
    """(host path, container path) of the service's bind mounts, host paths resolved as Compose does."""
    mounts = []
    for volume in service.get("volumes", ()):
        source, target = interpolate(volume).split(":")[:2]
        if source.startswith((".", "/")):
            mounts.append(((COMPOSE_DIR / source).resolve(), target))
    return mounts


def server_settings() -> Settings:
    """The compose server's settings, its container paths mapped to the host paths Compose binds there."""
    server = compose()["services"]["server"]
    mounts = {target: source for source, target in bind_mounts(server)}
    args = [re.sub(r"^--model-dir=(.*)$", lambda m: f"--model-dir={mounts[m.group(1)]}", a) for a in server["command"]]
    return load_settings(args, environ={})


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[set[str], Exposition]]:
    """The compose server's app in-process: its GET routes and its /metrics after real requests."""
    with demo_client(server_settings()) as client:
        yield get_routes(client), exercised_exposition(client)


# ---- compose.yaml -----------------------------------------------------------------------------------------


def test_compose_file_follows_the_compose_spec() -> None:
    # the parser does not interpolate: the file as Compose reads it with no variables set
    project = PyCompose.from_yaml(interpolate(COMPOSE.read_text()))
    project.validate()  # volumes, networks, configs and secrets referenced are declared
    assert set(project.service_names()) == {"server", "prometheus", "grafana"}


def test_compose_validation_refuses_mistakes() -> None:
    text = interpolate(COMPOSE.read_text())
    for bad in (text.replace("stop_grace_period:", "stop_grace_periods:"),  # an unknown key
                text.replace("127.0.0.1:8000:8000", "127.0.0.1:8000:eight-thousand"),  # a bad port
                text.replace("condition: service_started", "condition: service_startd")):  # a bad value
        with pytest.raises(ValueError):
            PyCompose.from_yaml(bad).validate()


def test_compose_server_runs_the_image_with_options_the_server_accepts() -> None:
    server = compose()["services"]["server"]
    assert server["image"] == "multimax-serve:0.1.0"
    assert (COMPOSE_DIR / server["build"]["context"]).resolve() == ROOT  # the Dockerfile at the repository root
    build_parser().parse_args(server["command"])  # the image's entrypoint is `python -m service`
    settings = server_settings()
    assert settings.host == "0.0.0.0"
    assert any(p.endswith(f":{settings.port}") for p in server["ports"])
    assert all(p.startswith("127.0.0.1:") for s in compose()["services"].values() for p in s.get("ports", ()))
    # by default the shipped demo models are mounted where --model-dir points
    assert settings.model_dir == (ROOT / "models" / "demo").resolve()
    assert server["user"] == "10001:10001" and server["read_only"]


def test_compose_stop_grace_exceeds_the_graceful_timeout() -> None:
    server = compose()["services"]["server"]
    grace = promql_parser.parse_duration(server["stop_grace_period"]).total_seconds()
    assert grace > server_settings().graceful_timeout_s


def test_compose_healthcheck_asks_the_readiness_route(served: tuple[set[str], Exposition]) -> None:
    check = " ".join(compose()["services"]["server"]["healthcheck"]["test"])
    url = re.search(r"http://127\.0\.0\.1:(\d+)(/[\w/]+)", check)
    assert url is not None, check
    assert int(url.group(1)) == server_settings().port
    assert url.group(2) == "/v2/health/ready" and url.group(2) in served[0]


def test_every_mount_and_dependency_is_declared() -> None:
    """What the spec parser leaves to `docker compose config`: bind sources exist, named volumes are declared,
    depends_on names services of the file."""
    spec = compose()
    for name, service in spec["services"].items():
        for source, _ in bind_mounts(service):
            assert source.exists(), f"{name}: {source} does not exist"
        sources = {interpolate(v).split(":")[0] for v in service.get("volumes", ())}
        named = {v for v in sources if not v.startswith((".", "/"))}
        assert named <= set(spec.get("volumes") or {}), (name, named)
        assert set(service.get("depends_on", {})) <= set(spec["services"])


# ---- Prometheus -------------------------------------------------------------------------------------------


def test_prometheus_scrapes_the_servers_metrics_route(served: tuple[set[str], Exposition]) -> None:
    config = yaml.safe_load(PROMETHEUS.read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] in served[0]
    (target,) = [t for sc in job["static_configs"] for t in sc["targets"]]
    host, port = target.split(":")
    assert host in compose()["services"] and int(port) == server_settings().port
    # the alert file Prometheus loads is the one mounted from this directory
    mounts = {target: source for source, target in bind_mounts(compose()["services"]["prometheus"])}
    assert all(mounts[path] == ALERTS for path in config["rule_files"])


def test_alert_rules_query_metrics_the_server_exports(served: tuple[set[str], Exposition]) -> None:
    rules = [r for group in yaml.safe_load(ALERTS.read_text())["groups"] for r in group["rules"]]
    assert rules
    for rule in rules:
        assert not check_query(rule["expr"], served[1]), (rule["alert"], check_query(rule["expr"], served[1]))
        assert promql_parser.parse_duration(rule["for"]).total_seconds() > 0
        # labels the summary names are ones the expression keeps
        for label in re.findall(r"\$labels\.(\w+)", json.dumps(rule["annotations"])):
            assert label in rule["expr"] or label == "instance", (rule["alert"], label)


# ---- Grafana ----------------------------------------------------------------------------------------------


def test_dashboard_queries_the_metrics_the_server_exports(served: tuple[set[str], Exposition]) -> None:
    queries = dashboard_queries(DASHBOARD)
    problems = {(title, q): p for title, q in queries if (p := check_query(grafana_to_promql(q), served[1]))}
    assert not problems
    names = {sel.name for _, q in queries for sel in selectors(grafana_to_promql(q))}
    for topic, metric in DASHBOARD_TOPICS.items():
        assert metric in names, f"the dashboard shows no {topic} ({metric})"


def test_dashboard_variable_lists_a_label_the_server_exports(served: tuple[set[str], Exposition]) -> None:
    for variable in json.loads(DASHBOARD.read_text())["templating"]["list"]:
        m = re.fullmatch(r"label_values\((\w+), *(\w+)\)", variable["query"]["query"])
        assert m is not None, variable["query"]
        metric, label = m.groups()
        assert any(label in labels for labels in served[1].series[metric])


def test_the_query_check_catches_wrong_names_and_labels(served: tuple[set[str], Exposition]) -> None:
    exposition = served[1]
    assert check_query("rate(multimax_requests_total[1m])", exposition) == []
    assert check_query("rate(multimax_request_total[1m])", exposition)  # misspelt metric
    assert check_query('multimax_requests_total{status="200"}', exposition)  # no such label
    assert check_query('multimax_requests_total{outcome="ok"}', exposition)  # no such value
    assert check_query('multimax_requests_total{outcome=~"err.*"}', exposition) == []
    assert check_query("sum by (model, status) (rate(multimax_requests_total[1m]))", exposition)  # no such label
    assert check_query("sum by (le, pod) (rate(multimax_queue_seconds_bucket[1m]))", exposition) == []
    with pytest.raises(Exception):  # noqa: B017 -- the parser's error type is not part of its API
        check_query("sum by (model (multimax_pending_requests)", exposition)


def test_dashboard_is_well_formed_and_provisioned() -> None:
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"] and dash["title"]
    for panel in dash["panels"]:
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24 and g["w"] > 0 and g["h"] > 0
    (source,) = yaml.safe_load((COMPOSE_DIR / "grafana/provisioning/datasources/prometheus.yml").read_text())[
        "datasources"]
    uids = {t["datasource"]["uid"] for p in dash["panels"] for t in p["targets"]} | {
        p["datasource"]["uid"] for p in dash["panels"]}
    assert uids == {source["uid"]}
    host, port = re.fullmatch(r"http://([\w-]+):(\d+)", source["url"]).groups()  # type: ignore[union-attr]
    assert host in compose()["services"] and any(p.endswith(f":{port}") for p in
                                                 compose()["services"][host]["ports"])
    # the provider reads the directory Compose mounts the dashboard JSON into
    (provider,) = yaml.safe_load((COMPOSE_DIR / "grafana/provisioning/dashboards/multimax-serve.yml").read_text())[
        "providers"]
    mounts = {target: source for source, target in bind_mounts(compose()["services"]["grafana"])}
    assert mounts[provider["options"]["path"]] == DASHBOARD.parent
    assert mounts["/etc/grafana/provisioning"] == COMPOSE_DIR / "grafana" / "provisioning"
    assert os.path.basename(compose()["services"]["grafana"]["environment"][
        "GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]) == DASHBOARD.name
