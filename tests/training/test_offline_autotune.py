"""`grace train` and `grace eval` run the kernels' fixed configs unless asked to tune
(`cli/common.py::offline_kernels`): each case runs in a fresh interpreter, since
`kernels/_tuning.py` reads the switch once, at import."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# a command that fails on its missing model after choosing the configs, then the switch
PROBE = """
import sys
from cli import main
rc = main(sys.argv[1:])
import kernels._tuning as t
print(rc, t.AUTOTUNE)
"""


def _autotune_after(args: list[str], env_value: str | None) -> tuple[int, bool]:
    env = {k: v for k, v in os.environ.items() if k != "GRACE_AUTOTUNE"}
    if env_value is not None:
        env["GRACE_AUTOTUNE"] = env_value
    done = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, check=True)  # fmt: skip
    rc, tuned = done.stdout.split()[-2:]
    return int(rc), tuned == "True"


EVAL = ["eval", "--world", "/missing", "--index", "/missing", "--model", "/missing"]
TRAIN = ["train", "--world", "/missing", "--out", "/missing-out"]


@pytest.mark.parametrize("command", [EVAL, TRAIN], ids=["eval", "train"])
def test_offline_commands_use_fixed_configs_unless_asked(command: list[str]) -> None:
    rc, tuned = _autotune_after(command, None)
    assert rc != 0 and not tuned  # the default: no tuning
    assert _autotune_after([*command, "--autotune"], None)[1]
    assert _autotune_after([*command, "--autotune"], "0")[1]  # the flag wins
    assert _autotune_after(command, "1")[1]  # the environment's choice is kept


def test_autotune_flag_is_explained_in_help(capsys: pytest.CaptureFixture[str]) -> None:
    from cli import main

    for command in ("eval", "train"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "--autotune" in capsys.readouterr().out
