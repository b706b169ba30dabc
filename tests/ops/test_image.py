"""The CPU image's build inputs, checked without a container engine: the lock that the
Dockerfile installs from (requirements/image.txt), triton kept out of the CPU image and
out of the served import path, and the `make image` / `make image-smoke` targets and
their scripts (deploy/image/), and every doc section that deploy/ and tests/ops/ point to.
The image itself is built and run by `make image-smoke`, by hand: docs/ops/container.md
"Built and run: the CPU image with podman"."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.ops.test_container import REPO, chain, parse_cli, stages

LOCK = REPO / "requirements" / "image.txt"
IMAGE_DIR = REPO / "deploy" / "image"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
CONTAINER_DOC = REPO / "docs" / "ops" / "container.md"
# what the image installs: the Dockerfile's COPY lines (test_container.py checks them)
SERVED_PACKAGES = ("cli", "contracts", "index_builder", "kernels", "service", "training")
# the image's platform: Linux x86_64, CPython 3.11 (the lock's header says which 3.11)
IMAGE_MARKERS = default_environment() | {
    "sys_platform": "linux",
    "platform_machine": "x86_64",
    "python_version": "3.11",
}


def lock_pins() -> dict[str, str]:
    pins = {}
    for raw in LOCK.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        assert sep and re.fullmatch(r"[\w.!+-]+", version), f"not an exact pin: {line!r}"
        assert canonicalize_name(name) not in pins, f"pinned twice: {name}"
        pins[canonicalize_name(name)] = version
    return pins


def builder_runs(variant: str) -> list[str]:
    all_stages = stages(variant)
    builder = next(s for s in all_stages if s.name == "builder")
    return [r for s in chain(all_stages, builder) for r in s.values("RUN")]


# --------------------------------------------------------------------------- the lock


def test_lock_pins_every_base_otlp_postgres_and_build_requirement_within_range() -> None:
    pins = lock_pins()
    project = PYPROJECT["project"]
    extras = project["optional-dependencies"]
    wanted = (project["dependencies"] + extras["otlp"] + extras["postgres"]
              + PYPROJECT["build-system"]["requires"])  # fmt: skip
    for text in wanted:
        req = Requirement(text)
        if req.marker and not req.marker.evaluate(IMAGE_MARKERS):
            continue
        name = canonicalize_name(req.name)
        if name == "torch":  # the Dockerfile's TORCH_VERSION, from the variant's index
            continue
        assert name in pins, f"{req.name} is not in {LOCK.relative_to(REPO)}"
        assert req.specifier.contains(pins[name], prereleases=True), (text, pins[name])


def test_lock_leaves_out_torch_triton_and_the_project() -> None:
    pins = lock_pins()
    # torch: TORCH_VERSION and the variant's wheel index decide it; triton: GPU only
    assert not {"torch", "triton", "grace-serving", "pip"} & set(pins)
    assert not any(n.startswith("nvidia-") for n in pins), "CUDA wheels in the CPU lock"


@pytest.mark.parametrize("variant", ["cpu", "gpu"])
def test_the_image_installs_exactly_the_lock(variant: str) -> None:
    runs = builder_runs(variant)
    rel = str(LOCK.relative_to(REPO))
    torch_at = next(i for i, r in enumerate(runs) if '"torch==${TORCH_VERSION}"' in r)
    # after torch: the lock sets every other package, torch's dependencies included
    lock_at = next(i for i, r in enumerate(runs) if f"pip install -r {rel}" in r)
    assert lock_at > torch_at and "pip check" in runs[lock_at]
    # the project builds with the lock's setuptools/wheel/pybind11, not whatever is newest
    (project_run,) = [r for r in runs if re.search(r"pip install .*\.(\s|$)", r)]
    assert "--no-deps" in project_run and "--no-build-isolation" in project_run
    # nothing reads pyproject's ranges at build time any more
    assert not any("tomllib" in r for r in runs)
    copies = [v for s in stages(variant) for v in s.values("COPY")]
    assert any(v.split()[0] == rel for v in copies), f"COPY {rel} missing"


def test_lock_script_writes_the_lock_it_documents() -> None:
    script = (IMAGE_DIR / "lock.sh").read_text()
    assert "OUT=${OUT:-requirements/image.txt}" in script
    assert "--exclude torch" in script and "freeze --all" in script
    assert "deploy/image/lock.sh" in LOCK.read_text()  # the header says how it is made
    assert "deploy/image/lock.sh" in CONTAINER_DOC.read_text()
    proc = subprocess.run(["sh", "-n", str(IMAGE_DIR / "lock.sh")], capture_output=True)
    assert proc.returncode == 0, proc.stderr


# --------------------------------------------------------------------------- triton


def test_triton_is_a_gpu_extra_that_make_install_keeps() -> None:
    base = [Requirement(r).name for r in PYPROJECT["project"]["dependencies"]]
    assert "triton" not in base, "triton back in the base dependencies: 1 GB in the CPU image"
    gpu = [Requirement(r).name for r in PYPROJECT["project"]["optional-dependencies"]["gpu"]]
    assert gpu == ["triton"]
    # make install (and so CI, .ci/run) installs it: tests/kernels run its interpreter
    install = re.search(r'pip install (?:-q )?-e "\.\[([\w,]+)\]"', (REPO / "Makefile").read_text())
    assert install and "gpu" in install[1].split(","), "make install drops the gpu extra"


def test_cpu_serving_imports_without_triton() -> None:
    # Every module the image installs imports with triton absent (the dispatchers fall
    # back to their torch references); then a CPU layer norm runs through its dispatcher.
    code = textwrap.dedent(
        f"""
        import importlib, pkgutil, sys
        sys.modules["triton"] = None  # `import triton` now raises ImportError
        import service.app, cli
        for pkg in {SERVED_PACKAGES!r}:
            module = importlib.import_module(pkg)
            for info in pkgutil.walk_packages(getattr(module, "__path__", []), pkg + "."):
                if not info.name.startswith("kernels._triton"):  # the kernels themselves
                    importlib.import_module(info.name)
        import torch
        from kernels.layer_norm import layer_norm
        x = torch.randn(3, 17)
        w, b = torch.ones(17), torch.zeros(17)
        y = layer_norm(x, w, b, 1e-5)
        torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (17,), w, b))
        assert sys.modules["triton"] is None
        print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, timeout=240)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


# --------------------------------------------------------------------------- make image


def make_dry_run(target: str) -> str:
    proc = subprocess.run(["make", "-n", "-s", target, "ENGINE=podman", "TORCH_WHEELS=/w",
                           "BUILD_CA="], cwd=REPO, capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_make_image_builds_the_cpu_variant_keeping_healthcheck() -> None:
    build = next(line for line in make_dry_run("image").splitlines() if " build " in line)
    argv = shlex.split(build)
    assert argv[:2] == ["podman", "build"]
    assert "--format docker" in build  # OCI images drop HEALTHCHECK
    assert "VARIANT=cpu" in argv and argv[-1] == "."
    makefile = (REPO / "Makefile").read_text()
    version = re.search(r"^TORCH_VERSION \?= (\S+)", makefile, re.M)[1]
    # a local wheel directory: mounted, found by pip, and only the CPU build matches
    assert "/w:/wheels:ro" in argv and "PIP_FIND_LINKS=/wheels" in argv
    assert f"TORCH_VERSION={version}+cpu" in argv
    dockerfile = (REPO / "Dockerfile").read_text()
    for arg in ("PIP_FIND_LINKS", "PIP_CERT"):  # unset unless passed: no default
        assert re.search(rf"^ARG {arg}$", dockerfile, re.M), arg


def test_make_image_smoke_runs_the_smoke_script() -> None:
    assert "deploy/image/smoke.sh" in make_dry_run("image-smoke")
    for script in ("smoke.sh", "base.sh"):
        proc = subprocess.run(["sh", "-n", str(IMAGE_DIR / script)], capture_output=True)
        assert proc.returncode == 0, proc.stderr


def test_smoke_script_covers_each_step() -> None:
    script = (IMAGE_DIR / "smoke.sh").read_text()
    run = re.search(r'"\$ENGINE" run -d (.*?)"\$IMAGE"', script, re.S)[1]
    assert "--read-only" in run and "--tmpfs /tmp" in run and ":/data" in run
    assert 'id -u)" = 10001' in script  # non-root, as the image's USER says
    assert "until in_server grace health" in script and "healthcheck run" in script
    assert "grace query" in script
    assert "grace_index_swaps_total" in script  # the swap seen in the metrics...
    assert '"$after" != "$before"' in script  # ...and in the response's index version
    assert "kill --signal TERM" in script and '[ "$code" = 0 ]' in script
    # the sidecar runs from the image's entrypoint with arguments `grace builder` takes
    builder = re.search(r'"\$IMAGE" builder \\\n(.*?) \|\|', script, re.S)[1]
    args = parse_cli(["builder", *shlex.split(builder.replace("\\\n", " "))])
    assert args.once and args.out == "/data/index" and args.model == "/data/model"


RUNC_RLIMIT_7 = (
    "Error: runc: runc create failed: unable to start container process: error during "
    "container init: error setting rlimits for ready process: error setting rlimit type 7: "
    "operation not permitted: OCI permission denied"
)


def test_smoke_script_names_the_fix_when_podman_cannot_set_the_open_files_limit(
    tmp_path: Path,
) -> None:
    """A first run on a host whose hard RLIMIT_NOFILE is below podman's default ends in one
    line saying what to put where (values this host grants), not in runc's message alone."""
    engine = tmp_path / "podman"  # answers like podman; `run` fails as runc does
    engine.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        '  --version) echo "podman version 4.3.1" ;;\n'
        "  image) echo 1203916304 ;;\n"
        f"  run) echo '{RUNC_RLIMIT_7}' >&2; exit 126 ;;\n"
        "  logs) exit 1 ;;\n"
        "esac\n"
    )
    engine.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "ENGINE": str(engine)}
    smoke = ["sh", str(IMAGE_DIR / "smoke.sh")]
    proc = subprocess.run(smoke, capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 1
    [line] = [x for x in proc.stderr.splitlines() if x.startswith("smoke FAILED")]
    limits = Path("/proc/self/limits").read_text()
    nofile = re.search(r"^Max open files\s+\S+\s+(\S+)", limits, re.M)[1]
    entries = r'\["nofile=(\d+):\1", "nproc=(\d+):\2"\]'
    fix = re.search(rf"default_ulimits = {entries} under \[containers]", line)
    assert fix and fix[1] == nofile, line
    assert "/etc/containers/containers.conf" in line and "~/.config/containers/" in line


def test_base_script_is_the_documented_mmdebstrap_command() -> None:
    script = (IMAGE_DIR / "base.sh").read_text()
    # its options and suite, up to the target (a temporary tar in the script)
    command = re.search(r"^mmdebstrap .*? bookworm ", script, re.S | re.M)[0]
    doc = CONTAINER_DOC.read_text()
    # the doc shows the same command (indented as a code block)
    assert " ".join(command.split()) in " ".join(doc.split()), "docs and base.sh differ"
    assert "--variant=minbase" in command and "python3-venv" in command


# --------------------------------------------------------------------------- the docs


def test_doc_examples_that_read_the_world_mount_the_data_volume() -> None:
    # `grace query` takes its user from data/world (cwd /): without the volume it fails
    runs = re.findall(r"^ {4}(docker run (?:.*\\\n)*.*)$", CONTAINER_DOC.read_text(), re.M)
    lines = [" ".join(block.split()) for block in runs]
    queries = [line for line in lines if " query" in line]
    assert queries, "no docker run ... query example"
    for line in queries:
        assert re.search(r"-v \S+:/data\b", line), f"query without the data volume: {line}"


def test_every_doc_section_that_ops_files_point_to_exists() -> None:
    """A pointer such as smoke.sh's (a doc's path, then a section's title in quotes, maybe
    wrapped over comment lines) names a heading of that doc, so none can rot unseen."""
    pointer = re.compile(r'(docs/[\w/.-]+\.md),? \\?"([^"\\]+)\\?"')  # or in \"…\" (sh)
    files = [p for p in (REPO / "deploy").rglob("*") if p.is_file()]
    files += sorted((REPO / "tests" / "ops").glob("*.py"))
    found, broken = 0, []
    for path in files:
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        flat = re.sub(r"\s*\n\s*(?:#+\s*)?", " ", text)  # comment lines joined
        for doc, section in pointer.findall(flat):
            found += 1
            headings = re.findall(r"^#+\s+(.+)$", (REPO / doc).read_text(), re.M)
            if not any(re.sub(r"[`*]", "", h).startswith(section) for h in headings):
                broken.append(f'{path.relative_to(REPO)}: {doc} has no section "{section}"')
    assert found >= 4, "the pointer pattern no longer finds the scripts' pointers"
    assert not broken, "\n".join(broken)


def test_doc_says_what_a_probe_sees_during_bootstrap() -> None:
    doc = " ".join(CONTAINER_DOC.read_text().split())
    assert "stays NOT_SERVING" not in doc  # nothing listens before the model is loaded
    assert "connection refused" in doc.lower()
