"""deploy/k8s: CI has no cluster, so every manifest is validated offline and held to what the homelab relies
on (../shared/homelab: namespace, model PVC, node, runtime class, the gateway's Service, probe budgets,
scraping).

- Deployment and Service: strict JSON-schema validation (unknown fields refused) against the Kubernetes
  schemas that kubernetes-validate ships, for every Kubernetes version it ships.
- InferenceService: kubernetes-validate has no schema for KServe's CRD, so the check is written here from the
  fields KServe's v1beta1 API documents for InferenceServiceSpec and PredictorSpec (a PodSpec inlined, plus
  its ComponentExtensionSpec and the model-format specs). Every key must be one of those, and every part
  that is a Kubernetes type (the pod spec, the deployment strategy, metadata) is validated strictly as that
  type.
- The container arguments are parsed by clefcore's own command-line parser, so every flag is real.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")
from kubernetes_validate import utils as kv_utils  # noqa: E402

K8S = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
NAMESPACE = "llm-serving"
PORT = 8080
MODEL_DIR = "/mnt/models/clef-flash"
FIRST_LOAD_S = 30 * 60            # the homelab's startup budget for a first load (its SGLang predictor)
MEMORY_REQUEST_MAX = 8 * 2**30    # 16Gi left a predictor Pending on worker-1; 8Gi schedules beside the others
CPU_REQUEST_MAX = 4               # what clef-candle requests and is scheduled with today

# KServe v1beta1 (serving.kserve.io), as its API reference documents them.
ISVC_SPEC_FIELDS = {"predictor", "transformer", "explainer"}
COMPONENT_EXTENSION_FIELDS = {
    "minReplicas", "maxReplicas", "scaleTarget", "scaleMetric", "scaleMetricType", "autoScaling",
    "containerConcurrency", "timeout", "canaryTrafficPercent", "logger", "batcher", "labels", "annotations",
    "deploymentStrategy",
}
MODEL_FORMAT_FIELDS = {"sklearn", "xgboost", "tensorflow", "pytorch", "triton", "onnx", "huggingface", "pmml",
                       "lightgbm", "paddle", "model", "workerSpec"}


def manifests() -> dict[str, list[dict]]:
    return {p.name: [d for d in yaml.safe_load_all(p.read_text()) if d] for p in sorted(K8S.glob("*.yaml"))}


def one(kind: str) -> dict:
    (resource,) = [d for docs in manifests().values() for d in docs if d["kind"] == kind]
    return resource


def k8s_versions() -> list[str]:
    return sorted({v.split("-")[0].lstrip("v") for v in kv_utils.all_versions()},
                  key=lambda v: tuple(map(int, v.split("."))))


def validate_strict(resource: dict) -> None:
    for version in k8s_versions():
        try:
            kubernetes_validate.validate(resource, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            path = ".".join(map(str, error.path))
            raise AssertionError(f"{resource['kind']} against Kubernetes {version}: {path}: {error.message}")


def pod_spec_fields(version: str) -> set[str]:
    path = f"kubernetes-json-schema/v{version}-local-strict/_definitions.json"
    definitions = kv_utils.schema_contents(path, version)
    schemas = definitions.get("$defs") or definitions["definitions"]
    return set(schemas["io.k8s.api.core.v1.PodSpec"]["properties"])


def quantity(text) -> float:
    """A Kubernetes resource quantity (the suffixes used here) as a number."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "m": 1e-3, "": 1}
    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(text)).groups()
    return float(number) * units[unit]


def serve_args(container: dict):
    """The container's arguments through `clefcore`'s own parser (the image's entrypoint is `clefcore`)."""
    from clefcore.cli import build_parser
    args = container["args"]
    assert args[0] == "serve", args
    return build_parser().parse_args(args)


# --- offline schema validation ------------------------------------------------------------------------------

def test_every_manifest_is_known_and_namespaced():
    found = {name: [d["kind"] for d in docs] for name, docs in manifests().items()}
    assert found == {"deployment.yaml": ["Deployment"], "inferenceservice.yaml": ["InferenceService"],
                     "service.yaml": ["Service"]}, found
    for docs in manifests().values():
        for resource in docs:
            assert resource["metadata"]["namespace"] == NAMESPACE


@pytest.mark.parametrize("kind", ["Deployment", "Service"])
def test_builtin_resources_validate_against_the_kubernetes_schemas(kind):
    validate_strict(one(kind))


def test_the_validation_can_fail():
    deployment = copy.deepcopy(one("Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["periodSecond"] = 15  # a typo
    with pytest.raises(AssertionError, match="periodSecond"):
        validate_strict(deployment)
    isvc = copy.deepcopy(one("InferenceService"))
    isvc["spec"]["predictor"]["podMetadata"] = {"annotations": {"prometheus.io/scrape": "true"}}
    with pytest.raises(AssertionError, match="podMetadata"):
        check_inference_service(isvc)


def check_inference_service(isvc: dict) -> None:
    assert set(isvc) == {"apiVersion", "kind", "metadata", "spec"}, set(isvc)
    assert isvc["apiVersion"] == "serving.kserve.io/v1beta1" and isvc["kind"] == "InferenceService"
    # ObjectMeta is Kubernetes' own type: validate it as the metadata of a plain object.
    validate_strict({"apiVersion": "v1", "kind": "ConfigMap", "metadata": isvc["metadata"]})
    assert set(isvc["spec"]) <= ISVC_SPEC_FIELDS, set(isvc["spec"]) - ISVC_SPEC_FIELDS
    predictor = isvc["spec"]["predictor"]
    for version in k8s_versions():
        pod_fields = pod_spec_fields(version)
        unknown = set(predictor) - pod_fields - COMPONENT_EXTENSION_FIELDS - MODEL_FORMAT_FIELDS
        assert not unknown, f"not PredictorSpec fields (Kubernetes {version} PodSpec + KServe): {unknown}"
    kserve_only = COMPONENT_EXTENSION_FIELDS | MODEL_FORMAT_FIELDS
    pod_spec = {k: v for k, v in predictor.items() if k not in kserve_only}
    validate_strict({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "predictor"}, "spec": pod_spec})
    extension = {k: v for k, v in predictor.items() if k in COMPONENT_EXTENSION_FIELDS}
    # Pod labels and annotations: what ObjectMeta allows.
    validate_strict({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {
        "name": "predictor", "labels": extension.get("labels", {}),
        "annotations": extension.get("annotations", {})}})
    if "deploymentStrategy" in extension:  # an apps/v1 DeploymentStrategy
        template = {"metadata": {"labels": {"a": "b"}}, "spec": {"containers": [{"name": "c", "image": "i"}]}}
        validate_strict({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "predictor"},
                         "spec": {"selector": {"matchLabels": {"a": "b"}}, "template": template,
                                  "strategy": extension["deploymentStrategy"]}})
    for key in ("minReplicas", "maxReplicas"):
        assert isinstance(extension.get(key, 0), int) and extension.get(key, 0) >= 0


def test_inference_service_holds_to_the_crd_fields():
    check_inference_service(one("InferenceService"))


# --- the homelab's conventions ------------------------------------------------------------------------------

def pods() -> list[tuple[str, dict, dict]]:
    """(variant, pod spec, pod metadata) for the Deployment's template and the KServe predictor."""
    deployment, isvc = one("Deployment"), one("InferenceService")
    predictor = isvc["spec"]["predictor"]
    template = deployment["spec"]["template"]
    return [("deployment", template["spec"], template["metadata"]),
            ("kserve", predictor, {"labels": predictor["labels"], "annotations": predictor["annotations"]})]


@pytest.mark.parametrize("variant", ["deployment", "kserve"])
def test_pod_fits_worker_1(variant):
    (spec, meta) = next((s, m) for v, s, m in pods() if v == variant)
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["nodeSelector"] == {"kubernetes.io/hostname": "worker-1"}
    (container,) = spec["containers"]
    if variant == "kserve":
        assert container["name"] == "kserve-container"  # the name KServe looks for
    res = container["resources"]
    assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == 1
    assert quantity(res["requests"]["memory"]) <= MEMORY_REQUEST_MAX
    assert quantity(res["requests"]["cpu"]) <= CPU_REQUEST_MAX
    for kind in ("cpu", "memory"):
        assert quantity(res["requests"][kind]) <= quantity(res["limits"][kind])
    # The model: the llm-models PVC, read-only at /mnt/models, the checkpoint in its clef-flash folder.
    args = serve_args(container)
    assert args.model == MODEL_DIR and args.port == PORT and args.host == "0.0.0.0"
    assert args.device == "cuda:0" and args.context_length == 24576
    (mount,) = [m for m in container["volumeMounts"] if MODEL_DIR.startswith(m["mountPath"] + "/")]
    assert mount["mountPath"] == "/mnt/models" and mount["readOnly"] is True
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert volume["persistentVolumeClaim"] == {"claimName": "llm-models", "readOnly": True}
    # The root filesystem is read-only: the kernel caches need a writable /cache (the image's cache paths).
    if container.get("securityContext", {}).get("readOnlyRootFilesystem"):
        assert any(m["mountPath"] == "/cache" for m in container["volumeMounts"])
    assert {p["containerPort"] for p in container["ports"]} == {PORT}


@pytest.mark.parametrize("variant", ["deployment", "kserve"])
def test_probes_budget_a_first_load(variant):
    (spec, _) = next((s, m) for v, s, m in pods() if v == variant)
    (container,) = spec["containers"]
    startup, ready, live = (container[k] for k in ("startupProbe", "readinessProbe", "livenessProbe"))
    assert startup["httpGet"]["path"] == ready["httpGet"]["path"] == "/health"
    assert live["httpGet"]["path"] == "/live"  # a busy or draining server must not be restarted
    assert startup["periodSeconds"] * startup["failureThreshold"] >= FIRST_LOAD_S
    for probe in (startup, ready, live):
        port = probe["httpGet"]["port"]
        named = {p.get("name"): p["containerPort"] for p in container["ports"]}
        assert (named[port] if isinstance(port, str) else port) == PORT
    # SIGTERM drain (--shutdown-timeout) plus the preStop pause fit inside the grace period.
    args = serve_args(container)
    pause = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert args.shutdown_timeout + pause < spec["terminationGracePeriodSeconds"]


@pytest.mark.parametrize("variant", ["deployment", "kserve"])
def test_prometheus_scrapes_the_api_port(variant):
    (_, meta) = next((s, m) for v, s, m in pods() if v == variant)
    assert meta["annotations"] == {"prometheus.io/scrape": "true", "prometheus.io/port": str(PORT),
                                   "prometheus.io/path": "/metrics"}


def test_deployment_rollout():
    deployment = one("Deployment")
    spec = deployment["spec"]
    assert deployment["metadata"]["name"] == "clef-serve"
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()


def test_kserve_variant():
    isvc = one("InferenceService")
    annotations = isvc["metadata"]["annotations"]
    assert annotations["serving.kserve.io/deploymentMode"] == "RawDeployment"
    # The cluster's KServe injects the scrape annotations only with this flag; `podMetadata` does not exist
    # there, so the pod's own annotations sit directly under predictor (checked above).
    assert annotations["serving.kserve.io/enable-prometheus-scraping"] == "true"
    predictor = isvc["spec"]["predictor"]
    assert "podMetadata" not in predictor
    assert predictor["minReplicas"] == predictor["maxReplicas"] == 1
    assert predictor["deploymentStrategy"] == {"type": "Recreate"}
    # KServe names its own Deployment and Service after the InferenceService; clef-serve must stay ours.
    assert isvc["metadata"]["name"] != "clef-serve"
    image = one("Deployment")["spec"]["template"]["spec"]["containers"][0]["image"]
    assert predictor["containers"][0]["image"] == image


@pytest.mark.parametrize("variant", ["deployment", "kserve"])
def test_the_gateways_service_reaches_either_variant(variant):
    service = one("Service")
    assert service["metadata"]["name"] == "clef-serve"
    assert service["spec"].get("type", "ClusterIP") == "ClusterIP"
    (port,) = service["spec"]["ports"]
    assert port["port"] == 80 and port["targetPort"] == PORT
    (_, meta) = next((s, m) for v, s, m in pods() if v == variant)
    assert service["spec"]["selector"].items() <= meta["labels"].items()


@pytest.mark.parametrize("variant", ["deployment", "kserve"])
def test_the_hub_cache_layout_is_offered_commented(variant, monkeypatch):
    """Each manifest carries, commented, the model volume's other layout (the Hugging Face cache, as the SGLang
    predictor used it): a Hub id that clefcore's parser takes in place of the folder, and HF_HOME on the volume's
    mount, under which clefcore looks for the cache."""
    from clefcore import hub
    name = {"deployment": "deployment.yaml", "kserve": "inferenceservice.yaml"}[variant]
    text = (K8S / name).read_text()
    assert re.findall(r"#\s+- (--(?:model|revision)=\S+)", text) == ["--model=Cloudflare/clef-flash",
                                                                    "--revision=<commit>"]
    (home,) = re.findall(r"#\s+- name: HF_HOME\b.*\n\s*#\s+value: (\S+)", text)
    (spec, _) = next((s, m) for v, s, m in pods() if v == variant)
    (container,) = spec["containers"]
    args = [a for a in container["args"] if not a.startswith("--model=")]
    args += ["--model=Cloudflare/clef-flash", "--revision=" + "0" * 40]
    parsed = serve_args(dict(container, args=args))
    assert hub.is_repo_id(parsed.model) and parsed.revision == "0" * 40
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", home)
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "models"]
    assert hub.cache_dir().parent == Path(mount["mountPath"])       # the cache is on the model volume
