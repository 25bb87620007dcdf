"""The Helm chart (deploy/helm/multimax-serve) rendered by Helm's own engine (helm-python-sdk binds Helm's Go
SDK; no helm binary, no cluster, no network) with several value sets, each resource validated against its
schema, and the rendered Deployment checked against the server it runs: probes on the app's real health routes,
arguments parsed by the server's own parser, the grace period above --graceful-timeout-s, the API key Secret
read by --api-key-file, the autoscaler's metric in the server's /metrics.

Validation: built-in kinds against Kubernetes' OpenAPI schemas (kubernetes-validate, strict: unknown fields
are errors); the ServiceMonitor and ServingRuntime CRDs against schema subsets written for these tests
(tests/deploy/data/crds, each says what it covers), whose container and volume parts are Kubernetes' own schemas.
"""

from __future__ import annotations

import base64
import functools
import json
import re
from pathlib import Path
from typing import Any

import helm_python
import jsonschema
import pytest
import yaml

from models.demo import DEMO_DIR
from service.base.config import Settings, build_parser, load_settings
from service.base.metrics import Metrics
from tests.deploy.support import (
    CHART,
    DEPLOY,
    KUBE_VERSION,
    check_query,
    demo_client,
    exercised_exposition,
    get_routes,
    render,
    selectors,
    validate,
)

ADAPTER_VALUES = DEPLOY / "helm" / "prometheus-adapter-values.yaml"
KEYS = ["k-0123456789abcdef", "k-fedcba9876543210"]
VOLUME = {"persistentVolumeClaim": {"claimName": "multimax-models", "readOnly": True}}

VALUE_SETS: dict[str, dict[str, Any]] = {
    "default": {},
    "api-key-secret": {"apiKeys": {"create": True, "keys": KEYS}, "models": {"volume": VOLUME}},
    "existing-secret": {"apiKeys": {"existingSecret": "team-keys"}},
    "autoscaling": {"autoscaling": {"enabled": True}, "serviceMonitor": {"enabled": True}},
    "no-autoscaling-no-pdb": {"autoscaling": {"enabled": False}, "podDisruptionBudget": {"enabled": False}},
    "kserve": {"kserve": {"servingRuntime": {"enabled": True}}, "apiKeys": {"create": True, "keys": KEYS}},
    "tuned": {"server": {"gracefulTimeoutSeconds": 120.5, "extraArgs": ["--max-batch-size=32", "--device=cpu"]},
              "models": {"volume": VOLUME, "names": ["digits_multimax", "text_multimax"]},
              "resources": {"limits": {"nvidia.com/gpu": 1}}, "serviceMonitor": {"enabled": True}},
}


@functools.cache
def rendered(name: str) -> tuple[dict[str, Any], ...]:
    return tuple(render(VALUE_SETS[name]))


def one(docs: tuple[dict[str, Any], ...] | list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind}s"
    return found[0]


def kinds(docs: tuple[dict[str, Any], ...]) -> set[str]:
    return {d["kind"] for d in docs}


def containers(docs: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    """Every container that runs `python -m service`: the Deployment's and the ServingRuntime's."""
    found = [c for d in docs if d["kind"] == "Deployment" for c in d["spec"]["template"]["spec"]["containers"]]
    return found + [c for d in docs if d["kind"] == "ServingRuntime" for c in d["spec"]["containers"]]


def settings_of(args: list[str], tmp_path: Path, secret: dict[str, Any] | None = None) -> Settings:
    """The server's settings from a container's arguments, as `python -m service` reads them; paths that exist
    only in the pod point to local stand-ins (the demo models; the Secret's file, written from the Secret)."""
    local = []
    for arg in args:
        if arg.startswith("--model-dir="):
            arg = f"--model-dir={DEMO_DIR}"
        elif arg.startswith("--api-key-file="):
            key_file = tmp_path / "api-keys"
            data = secret["data"][Path(arg.split("=", 1)[1]).name] if secret else base64.b64encode(b"stand-in\n")
            key_file.write_bytes(base64.b64decode(data))
            arg = f"--api-key-file={key_file}"
        local.append(arg)
    return load_settings(local, environ={})


# ---- the chart as Kubernetes sees it ---------------------------------------------------------------------


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_resource_validates_against_its_schema(name: str) -> None:
    docs = rendered(name)
    assert {"Deployment", "Service"} <= kinds(docs)
    for doc in docs:
        validate(doc)


def test_the_schemas_refuse_what_kubernetes_would() -> None:
    """The validation can fail: a misspelt field of a built-in kind and of each CRD, and a bad duration."""
    docs = [*rendered("kserve"), *rendered("autoscaling")]
    deployment = json.loads(json.dumps(one(rendered("default"), "Deployment")))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    monitor = json.loads(json.dumps(one(docs, "ServiceMonitor")))
    monitor["spec"]["endpoints"][0]["interval"] = "15 seconds"
    runtime = json.loads(json.dumps(one(docs, "ServingRuntime")))
    runtime["spec"]["containers"][0]["argz"] = []
    unknown = json.loads(json.dumps(one(docs, "ServingRuntime")))
    unknown["spec"]["protocolVersions"] = ["v3"]
    for doc in (deployment, monitor, runtime, unknown):
        with pytest.raises(jsonschema.ValidationError):
            validate(doc)


def test_helm_lint_is_clean() -> None:
    for values in VALUE_SETS.values():
        report = helm_python.lint(CHART, values, strict=True, kube_version="v" + KUBE_VERSION)
        assert not report["errors"], report
        # severity 1 is informational (e.g. "icon is recommended"); warnings and errors fail
        assert all(m["severity"] <= 1 for m in report["messages"]), report["messages"]


def test_value_sets_switch_the_optional_resources() -> None:
    assert kinds(rendered("default")) == {"Deployment", "Service", "PodDisruptionBudget"}
    assert kinds(rendered("no-autoscaling-no-pdb")) == {"Deployment", "Service"}
    assert kinds(rendered("autoscaling")) == {"Deployment", "Service", "PodDisruptionBudget",
                                              "HorizontalPodAutoscaler", "ServiceMonitor"}
    assert "ServingRuntime" in kinds(rendered("kserve")) and "Secret" in kinds(rendered("kserve"))
    assert "Secret" not in kinds(rendered("existing-secret"))  # the chart never writes someone else's Secret
    # the HPA owns the replica count: a fixed one in the Deployment would fight it on every upgrade
    assert "replicas" not in one(rendered("autoscaling"), "Deployment")["spec"]
    assert one(rendered("default"), "Deployment")["spec"]["replicas"] == 2


def test_bad_values_fail_to_render_with_a_reason() -> None:
    cases = [({"apiKeys": {"create": True, "existingSecret": "x", "keys": KEYS}}, "either existingSecret or create"),
             ({"apiKeys": {"create": True}}, "at least one key"),
             ({"terminationGracePeriodSeconds": 30}, "must exceed"),
             # values.schema.json: a misspelt key, a wrong type
             ({"autoscalling": {"enabled": True}}, "additional properties 'autoscalling' not allowed"),
             ({"server": {"gracefulTimeoutSeconds": "30"}}, "want number")]
    for values, reason in cases:
        with pytest.raises(helm_python.HelmError, match=reason):
            render(values)


# ---- the chart against the server ------------------------------------------------------------------------


PROBES = ("startupProbe", "livenessProbe", "readinessProbe")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The app as the "api-key-secret" pod runs it (its arguments, its Secret's keys): its GET routes, what its
    probe paths answer without a key, what a protected route answers without and with one, and /metrics."""
    docs = rendered("api-key-secret")
    container = containers(docs)[0]
    settings = settings_of(container["args"], tmp_path_factory.mktemp("keys"), one(docs, "Secret"))
    assert settings.api_keys == tuple(KEYS)
    with demo_client(settings) as client:
        probes = {container[k]["httpGet"]["path"]: client.get(container[k]["httpGet"]["path"]).status_code
                  for k in PROBES}
        result = {"routes": get_routes(client), "probes": probes, "protected": client.get("/v1/models").status_code,
                  "keyed": client.get("/v1/models", headers={"Authorization": f"Bearer {KEYS[1]}"}).status_code}
        client.headers["Authorization"] = f"Bearer {KEYS[0]}"
        result["exposition"] = exercised_exposition(client)
    return result


@pytest.mark.parametrize("name", VALUE_SETS)
def test_probes_use_the_servers_health_routes(name: str, served: dict[str, Any]) -> None:
    for container in containers(rendered(name)):
        paths = {k: container[k]["httpGet"]["path"] for k in PROBES if k in container}
        assert {"livenessProbe", "readinessProbe"} <= set(paths)
        for kind, path in paths.items():
            assert path in served["routes"], f"{kind} {path}: no such GET route in the app"
            port = container[kind]["httpGet"]["port"]
            assert port in ("http", *(p["containerPort"] for p in container["ports"])), port
        assert paths["readinessProbe"] == "/v2/health/ready"  # readiness, not mere liveness
        assert paths["livenessProbe"] == "/v2/health/live"  # a busy or degraded model must not get the pod killed


def test_probes_answer_without_an_api_key(served: dict[str, Any]) -> None:
    """The kubelet sends no Authorization header: with keys on, the probes still get 200 while the API needs one."""
    assert served["probes"] and set(served["probes"].values()) == {200}, served["probes"]
    assert served["protected"] == 401 and served["keyed"] == 200


def test_startup_probe_covers_loading_and_warm_up() -> None:
    """The server binds its port only after loading and warming up every model: the startup probe must allow
    minutes for that (liveness would otherwise kill a pod that is still loading), then hand over to liveness."""
    pod = one(rendered("default"), "Deployment")["spec"]["template"]["spec"]
    startup = pod["containers"][0]["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
    live = pod["containers"][0]["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] < 60


@pytest.mark.parametrize("name", VALUE_SETS)
def test_arguments_are_options_the_server_accepts(name: str, tmp_path: Path) -> None:
    docs = rendered(name)
    secret = next((d for d in docs if d["kind"] == "Secret"), None)
    for container in containers(docs):
        args = container["args"]
        assert "command" not in container  # the image's entrypoint is `python -m service`
        build_parser().parse_args(args)  # exits 2 on an unknown option or a bad value
        settings = settings_of(args, tmp_path, secret)
        assert settings.host == "0.0.0.0"
        assert settings.port in {p["containerPort"] for p in container["ports"]}


def test_an_option_the_server_lacks_is_caught() -> None:
    args = containers(render({"server": {"extraArgs": ["--max-batch-sise=8"]}}))[0]["args"]
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(args)
    assert exc.value.code == 2


@pytest.mark.parametrize("name", VALUE_SETS)
def test_grace_period_exceeds_the_servers_graceful_timeout(name: str, tmp_path: Path) -> None:
    docs = rendered(name)
    secret = next((d for d in docs if d["kind"] == "Secret"), None)
    for d in docs:
        if d["kind"] != "Deployment":
            continue
        pod = d["spec"]["template"]["spec"]
        settings = settings_of(pod["containers"][0]["args"], tmp_path, secret)
        hook = pod["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]
        # SIGTERM comes after the preStop sleep; then the server may take graceful_timeout_s, then drain
        assert pod["terminationGracePeriodSeconds"] > hook + settings.graceful_timeout_s
        assert settings.graceful_timeout_s == VALUE_SETS[name].get("server", {}).get("gracefulTimeoutSeconds", 30)


def test_api_key_secret_is_mounted_where_the_server_reads_it(tmp_path: Path) -> None:
    docs = rendered("api-key-secret")
    secret, pod = one(docs, "Secret"), one(docs, "Deployment")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    key_file = next(a.split("=", 1)[1] for a in container["args"] if a.startswith("--api-key-file="))
    volume = next(v for v in pod["volumes"] if v.get("secret"))
    mount = next(m for m in container["volumeMounts"] if m["name"] == volume["name"])
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    assert mount["readOnly"] and key_file == f"{mount['mountPath']}/{volume['secret']['items'][0]['path']}"
    assert volume["secret"]["items"][0]["key"] in secret["data"]
    assert settings_of(container["args"], tmp_path, secret).api_keys == tuple(KEYS)
    # an existing Secret is mounted by name, and its keys never pass through the chart
    existing = one(rendered("existing-secret"), "Deployment")["spec"]["template"]["spec"]
    assert any(v.get("secret", {}).get("secretName") == "team-keys" for v in existing["volumes"])


def test_models_come_from_the_volume() -> None:
    pod = one(rendered("tuned"), "Deployment")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    models = next(v for v in pod["volumes"] if v["name"] == "models")
    assert models["persistentVolumeClaim"] == VOLUME["persistentVolumeClaim"]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "models")
    assert mount["readOnly"] and f"--model-dir={mount['mountPath']}" in container["args"]
    assert "--models=digits_multimax,text_multimax" in container["args"]
    # without a volume, no --model-dir: the image's own default directory
    assert not any(a.startswith("--model-dir") for a in containers(rendered("default"))[0]["args"])


def test_pod_runs_as_the_images_non_root_user() -> None:
    pod = one(rendered("default"), "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 10001
    assert pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"]
    assert {"name": "tmp", "mountPath": "/tmp"} in pod["containers"][0]["volumeMounts"]


def test_service_pdb_and_monitor_select_the_pods() -> None:
    docs = rendered("autoscaling")
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    service = one(docs, "Service")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert one(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    monitor = one(docs, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    assert one(docs, "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]["name"] == \
        one(docs, "Deployment")["metadata"]["name"]


def test_service_monitor_scrapes_the_metrics_route(served: dict[str, Any]) -> None:
    for endpoint in one(rendered("autoscaling"), "ServiceMonitor")["spec"]["endpoints"]:
        assert endpoint["path"] in served["routes"]
        assert endpoint["path"] == "/metrics"


def test_kserve_runtime_serves_v2_from_the_model_mount(served: dict[str, Any]) -> None:
    runtime = one(rendered("kserve"), "ServingRuntime")["spec"]
    assert runtime["protocolVersions"] == ["v2"]
    # the V2 routes KServe's clients call exist in the app
    assert {"/v2/health/ready", "/v2/models/{name}", "/v2/models/{name}/ready"} <= served["routes"]
    args = runtime["containers"][0]["args"]
    assert "--model-dir=/mnt/models" in args  # where KServe's storage initializer writes storageUri's files
    assert any(f.get("autoSelect") for f in runtime["supportedModelFormats"])


# ---- the autoscaler's metric ------------------------------------------------------------------------------


def adapter_rules() -> list[dict[str, Any]]:
    return yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]


def adapter_query(rule: dict[str, Any], series: str) -> str:
    """The PromQL the adapter sends for one HPA request (its template filled as the adapter fills it)."""
    return (rule["metricsQuery"].replace("<<.Series>>", series)
            .replace("<<.LabelMatchers>>", 'namespace="serving",pod=~"mm-multimax-serve-.*"')
            .replace("<<.GroupBy>>", "pod"))


def test_hpa_metric_is_the_servers_queue_gauge_served_by_the_adapter(served: dict[str, Any]) -> None:
    exposition = served["exposition"]
    hpa = one(rendered("autoscaling"), "HorizontalPodAutoscaler")
    wanted = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}
    assert wanted == {"multimax_pending_requests"}
    served_names = set()
    for rule in adapter_rules():
        for sel in selectors(rule["seriesQuery"]):
            assert not check_query(str(sel), exposition)
            series = sel.name
            # the adapter renames series by name.matches -> name.as; the HPA asks for the new name
            exposed = re.sub(rule["name"]["matches"], rule["name"]["as"], series)
            served_names.add(exposed)
            assert not check_query(adapter_query(rule, series), exposition)
            # the rule's resources are labels the ServiceMonitor adds (the server's own series carry neither)
            assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
            assert all("namespace" not in s and "pod" not in s for s in exposition.series[series])
    assert wanted <= served_names
    # a gauge: averaged over pods it is the queue per pod (a counter would need a rate)
    assert {m.type for m in Metrics().registry.collect() if m.name in wanted} == {"gauge"}
