"""Where `grace serve`'s workers run (service/placement.py): `workers` per GPU on the GPUs
the settings name, from fake device lists (no GPU here), and the supervisor's per-GPU
environment with one MPS daemon per GPU (a stand-in control binary)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from service import workers
from service.mps import ENV
from service.placement import PlacementError, Slot, place, visible_ids
from service.settings import load_settings
from service.workers import worker_settings


def settings(**kw):
    return load_settings({"port": 50999, **kw})


def test_a_cpu_runs_workers_in_all() -> None:
    slots = place(settings(workers=3), "cpu", [])
    assert slots == [Slot(0, None, None), Slot(1, None, None), Slot(2, None, None)]
    assert {s.label for s in slots} == {"cpu"}


def test_one_gpu_is_served_as_before() -> None:
    """One visible GPU (or cuda:N): every worker sees every device and keeps the device
    setting; nothing in its environment changes."""
    assert place(settings(workers=2), "cuda", ["0"]) == [Slot(0, 0, None), Slot(1, 0, None)]
    on_3 = place(settings(workers=2, device="cuda:3"), "cuda:3", ["0", "1", "2", "3"])
    assert on_3 == [Slot(0, 3, None), Slot(1, 3, None)]
    assert worker_settings(settings(workers=2, device="cuda:3"), on_3[1]).device == "cuda:3"


def test_every_visible_gpu_gets_workers_each_gpu_major() -> None:
    slots = place(settings(workers=2, device="cuda"), "cuda", ["0", "1", "2", "3"])
    assert [(s.worker, s.gpu, s.visible) for s in slots] == [
        (0, 0, "0"), (1, 0, "0"), (2, 1, "1"), (3, 1, "1"),
        (4, 2, "2"), (5, 2, "2"), (6, 3, "3"), (7, 3, "3"),
    ]  # fmt: skip
    s = settings(workers=2, device="cuda", metrics_port=9464)
    w = worker_settings(s, slots[5])
    # a worker of one GPU of several sees only that one, as cuda:0
    assert (w.device, w.metrics_port, w.workers, w.gpus) == ("cuda:0", 9469, 1, None)


def test_the_gpus_setting_picks_visible_ordinals_and_keeps_their_ids() -> None:
    """CUDA_VISIBLE_DEVICES from the orchestrator is respected: ordinal 1 of '4,6' is
    device 6, and a worker is given '6' to see."""
    ids = visible_ids(2, {"CUDA_VISIBLE_DEVICES": "4,6"})
    assert ids == ["4", "6"]
    slots = place(settings(workers=1, gpus="1,0", device="cuda"), "cuda", ids)
    assert [(s.worker, s.gpu, s.visible, s.label) for s in slots] == [
        (0, 1, "6", "1"), (1, 0, "4", "0")
    ]  # fmt: skip
    one = place(settings(workers=2, gpus="1", device="cuda"), "cuda", ids)
    assert one == [Slot(0, 1, None, "cuda:1"), Slot(1, 1, None, "cuda:1")]  # one GPU, as before
    assert worker_settings(settings(workers=2, gpus="1"), one[0]).device == "cuda:1"
    uuids = visible_ids(2, {"CUDA_VISIBLE_DEVICES": "GPU-a1, GPU-b2"})
    assert uuids == ["GPU-a1", "GPU-b2"]
    assert visible_ids(3, {}) == ["0", "1", "2"]


def test_gpus_this_host_lacks_are_refused_in_one_line() -> None:
    with pytest.raises(PlacementError, match=r"GPU 2, 5 asked for, but this process sees 2 GPU"):
        place(settings(gpus="0,2,5", device="cuda"), "cuda", ["0", "1"])
    with pytest.raises(PlacementError, match="device 'cuda', but this process sees no GPU"):
        place(settings(device="cuda"), "cuda", [])


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ({"gpus": "0,0"}, "distinct"),
        ({"gpus": "-1"}, "distinct"),
        ({"gpus": "0,1", "device": "cpu"}, "picks GPUs for device 'cuda' or 'auto'"),
        ({"gpus": "1", "device": "cuda:0"}, "not 'cuda:0'"),
    ],
)
def test_bad_gpus_settings_are_refused(given: dict, said: str) -> None:
    with pytest.raises(ValidationError, match=said):
        settings(**given)


def test_the_port_checks_count_every_gpus_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """One worker per GPU on two GPUs is two workers: a fixed port, and metrics ports
    metrics_port .. + 1 that the gRPC port may not be among."""
    monkeypatch.setattr(workers, "place", lambda s, d, ids: [Slot(0, 0, "0"), Slot(1, 1, "1")])
    with pytest.raises(PlacementError, match="2 workers share one port"):
        workers.slots(load_settings({"port": 0, "device": "cpu"}))
    with pytest.raises(PlacementError, match=r"among the 2 workers' metrics ports 9464\.\.9465"):
        workers.slots(load_settings({"port": 9465, "metrics_port": 9464, "device": "cpu"}))


def test_each_gpu_gets_its_own_mps_daemon_and_its_workers_its_environment(
    control: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two GPUs, two workers each: two daemons, each started seeing only its GPU; each
    worker is given its GPU's CUDA_VISIBLE_DEVICES and that daemon's pipes; the
    supervisor's own environment is left alone; both daemons quit after the workers."""
    seen: dict = {}

    def fake_supervise(s, placed, envs) -> int:
        seen.update(envs)
        seen["outer"] = os.environ.get(ENV[0])
        return 0

    monkeypatch.setattr(workers, "_supervise", fake_supervise)
    s = settings(workers=2, mps=True, device="cuda")
    placed = place(s, "cuda", ["3", "7"])
    assert workers.supervise(s, placed) == 0
    assert seen.pop("outer") is None  # no daemon exported to the supervisor itself
    assert [seen[w]["CUDA_VISIBLE_DEVICES"] for w in range(4)] == ["3", "3", "7", "7"]
    pipes = [seen[w][ENV[0]] for w in range(4)]
    assert pipes[0] == pipes[1] != pipes[2] == pipes[3]
    calls = [c.split("|") for c in control.read_text().splitlines() if not c.startswith("probe")]
    # each daemon started and was told to quit seeing only its GPU, with its own pipes
    assert [(c[0], c[1], c[2], c[3]) for c in calls] == [
        ("-d", "", pipes[0], "3"), ("-d", "", pipes[2], "7"),
        ("", "quit", pipes[2], "7"), ("", "quit", pipes[0], "3"),
    ]  # fmt: skip


def test_serve_names_the_gpus_it_cannot_see_in_one_line(tmp_path: Path) -> None:
    """`grace serve --device cuda --gpus 1` where no GPU is visible: one line, exit 2,
    before anything is built or loaded."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU, even on a GPU machine
    done = subprocess.run(
        [sys.executable, "-m", "cli", "serve", "--device", "cuda", "--gpus", "1",
         "--data-dir", str(tmp_path), "--port", "50997", "--no-progress"],
        cwd=root, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "grace serve: error: device 'cuda', but this process sees no GPU "
        "(CUDA_VISIBLE_DEVICES decides which it sees)"
    ]
    assert not any(tmp_path.iterdir())  # nothing built
