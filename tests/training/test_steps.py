"""The step loop's helpers (training/steps.py): batches built ahead on a thread, the
precision a step computes in, and the progress lines of a run without a bar."""

from __future__ import annotations

import contextlib
import logging
import threading

import pytest
import torch

from training.steps import ProgressLog, autocast, check_precision, prefetch


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("grace-train-batches")]


def test_prefetch_yields_every_item_made_in_order() -> None:
    made: list[int] = []

    def make(x: int) -> int:
        made.append(x)
        return x * x

    assert list(prefetch(range(50), make)) == [x * x for x in range(50)]
    assert made == list(range(50))
    assert not _prefetch_threads()


def test_an_error_in_make_is_raised_to_the_consumer_at_its_item() -> None:
    def make(x: int) -> int:
        if x == 3:
            raise KeyError("bad row 3")
        return x

    got: list[int] = []
    with pytest.raises(KeyError, match="bad row 3"):
        for y in prefetch(range(10), make):
            got.append(y)
    assert got == [0, 1, 2]
    assert not _prefetch_threads()


def test_a_consumer_that_stops_early_stops_the_thread() -> None:
    with contextlib.closing(prefetch(range(10_000), lambda x: x, depth=2)) as items:
        for y in items:
            if y == 5:
                break
    assert not _prefetch_threads()  # closing joined it, although 9,994 items were left


def test_check_precision_names_the_choices() -> None:
    check_precision("fp32")
    check_precision("bf16")
    with pytest.raises(ValueError, match=r"one of \('fp32', 'bf16'\), got 'fp16'"):
        check_precision("fp16")


@pytest.mark.parametrize(("precision", "dtype"), [("fp32", torch.float32),
                                                  ("bf16", torch.bfloat16)])  # fmt: skip
def test_autocast_runs_matmuls_in_the_precision_asked(precision: str, dtype: torch.dtype) -> None:
    layer = torch.nn.Linear(8, 8)
    with autocast("cpu", precision):  # type: ignore[arg-type]
        out = layer(torch.randn(4, 8))
    assert out.dtype == dtype
    assert layer.weight.dtype == torch.float32  # the weights stay fp32


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("train: step")]


@pytest.mark.parametrize("total", [10, 37, 1000])
def test_a_run_without_a_bar_logs_ten_lines(caplog: pytest.LogCaptureFixture, total: int) -> None:
    log = logging.getLogger("grace.test.progress")
    report = ProgressLog(log, 0, total, enabled=True)
    with caplog.at_level(logging.INFO, logger=log.name):
        for step in range(1, total + 1):
            report(step, 2.5, None)
    lines = _lines(caplog)
    assert len(lines) == 10
    assert lines[-1].startswith(f"train: step {total}/{total} (100 %), loss 2.500")
    assert "ETA 0 s" in lines[-1]


def test_a_resumed_run_logs_the_tenths_left_and_a_bar_run_none(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = logging.getLogger("grace.test.progress")
    with caplog.at_level(logging.INFO, logger=log.name):
        resumed = ProgressLog(log, 35, 100, enabled=True)
        for step in range(36, 101):
            resumed(step, None, 1.25)
        assert [m.split(" (")[0] for m in _lines(caplog)] == [
            f"train: step {s}/100" for s in range(40, 101, 10)
        ]
        assert "validation loss 1.250" in _lines(caplog)[0]
        caplog.clear()
        quiet = ProgressLog(log, 0, 100, enabled=False)
        for step in range(1, 101):
            quiet(step, 1.0, None)
    assert _lines(caplog) == []
