"""deploy/k8s: CI has no cluster, so the manifests are parsed and held to what the homelab relies on (probes,
GPU, Recreate, scrape annotations, Service 80 -> 8080)."""

from __future__ import annotations

from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
SERVER_FLAGS = {"--model", "--device", "--host", "--port", "--context-length", "--max-batch-tokens",
                "--max-queue", "--request-timeout", "--shutdown-timeout"}


def load(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / "k8s" / name).read_text()) if d]


def container_checks(pod: dict, container: dict) -> None:
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["terminationGracePeriodSeconds"] > 25 + 5
    args = container["args"]
    assert args[0] == "serve"
    flags = {a.split("=", 1)[0] for a in args[1:]}
    assert flags <= SERVER_FLAGS | {"--max-batch-requests", "--api-key", "--validation", "--confidence",
                                    "--on-overflow", "--max-body-bytes"}, flags
    values = dict(a.split("=", 1) for a in args[1:])
    assert values["--port"] == "8080" and values["--host"] == "0.0.0.0"
    assert int(values["--shutdown-timeout"]) + 5 < pod["terminationGracePeriodSeconds"]
    res = container["resources"]
    for kind in ("requests", "limits"):
        assert res[kind]["nvidia.com/gpu"] == 1
        assert "cpu" in res[kind] and "memory" in res[kind]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/live"
    ports = {p["containerPort"] for p in container["ports"]}
    assert ports == {8080}
    model_mount = next(m for m in container["volumeMounts"] if m["mountPath"] == values["--model"])
    assert model_mount["readOnly"] is True
    volume = next(v for v in pod["volumes"] if v["name"] == model_mount["name"])
    assert volume["persistentVolumeClaim"]["readOnly"] is True


def test_deployment():
    (deployment,) = load("deployment.yaml")
    assert deployment["apiVersion"] == "apps/v1" and deployment["kind"] == "Deployment"
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    template = spec["template"]
    assert spec["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    annotations = template["metadata"]["annotations"]
    assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": "8080",
                           "prometheus.io/path": "/metrics"}
    (container,) = template["spec"]["containers"]
    container_checks(template["spec"], container)
    assert container["livenessProbe"]["httpGet"]["port"] == "http"


def test_service_routes_80_to_the_pods_8080():
    (service,) = load("service.yaml")
    (deployment,) = load("deployment.yaml")
    assert service["kind"] == "Service" and service["metadata"]["name"] == "clef-serve"
    (port,) = service["spec"]["ports"]
    assert port["port"] == 80 and port["targetPort"] == 8080
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()


def test_kserve_inference_service():
    (isvc,) = load("inferenceservice.yaml")
    assert isvc["apiVersion"] == "serving.kserve.io/v1beta1" and isvc["kind"] == "InferenceService"
    annotations = isvc["metadata"]["annotations"]
    assert annotations["serving.kserve.io/deploymentMode"] == "RawDeployment"
    assert annotations["prometheus.io/port"] == "8080" and annotations["prometheus.io/scrape"] == "true"
    predictor = isvc["spec"]["predictor"]
    assert predictor["minReplicas"] == predictor["maxReplicas"] == 1
    assert predictor["deploymentStrategy"] == {"type": "Recreate"}
    (container,) = predictor["containers"]
    assert container["name"] == "kserve-container"
    container_checks(predictor, container)
    (deployment,) = load("deployment.yaml")
    assert container["image"] == deployment["spec"]["template"]["spec"]["containers"][0]["image"]
