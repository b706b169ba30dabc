"""`grace query` and `grace --version` as a user runs them, against real server processes:
a user is named by position or by the id `query` prints, a world the server does not
serve (or none at all) is refused in one line, the examples' request file is answered by
a server of the examples, bad JSON is one line (no traceback), and a reader that goes
away (`| head`) ends it quietly."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from index_builder.build import build_index
from index_builder.synth import generate_world
from service.model.checkpoint import save_checkpoint
from service.model.config import PROFILES
from service.model.retriever import GenerativeRetriever
from tests.helpers.server_process import ServerProcess, serving
from tests.helpers.serving import make_serving_data

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    data = make_serving_data(tmp_path_factory.mktemp("query"))
    with serving(data, data / "server.log") as running:
        running.data = data  # type: ignore[attr-defined]
        yield running


def grace(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli", *args], cwd=REPO, input=stdin,
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip


def test_a_user_is_named_by_position_or_by_the_id_query_prints(server: ServerProcess) -> None:
    world = str(server.data / "world")  # type: ignore[attr-defined]
    by_position = grace("query", "--target", server.target, "--world", world, "--user", "3")
    assert by_position.returncode == 0, by_position.stderr
    user_id = re.match(r"user (\d+) ", by_position.stdout).group(1)
    by_id = grace("query", "--target", server.target, "--world", world, "--user-id", user_id)
    assert by_id.returncode == 0, by_id.stderr
    assert by_id.stdout.splitlines()[0] == by_position.stdout.splitlines()[0]
    missing = grace("query", "--target", server.target, "--world", world, "--user-id", "7")
    assert missing.returncode != 0 and "--user-id 7: no such user" in missing.stderr


def test_a_world_the_server_does_not_serve_is_refused_in_one_line(
    server: ServerProcess, tmp_path: Path
) -> None:
    generate_world("tiny", 5, tmp_path / "other", progress=False)  # another seed: other ads
    for world, why in ((tmp_path / "other", "serves another catalog"),
                       (tmp_path / "none", "no world at")):  # fmt: skip
        done = grace("query", "--target", server.target, "--world", str(world))
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and why in lines[0], done.stderr
        assert "--world" in lines[0] and "--request-json" in lines[0]
        assert not done.stdout  # no ads printed for a user of another world


def test_the_examples_answer_their_request_file(tmp_path: Path) -> None:
    """The README's examples path, an untrained model standing in for `grace train`'s."""
    examples = REPO / "examples"
    build_index(examples / "catalog.jsonl", tmp_path / "index", sid_space="examples-v1",
                progress=False)  # fmt: skip
    torch.manual_seed(0)
    save_checkpoint(GenerativeRetriever(PROFILES["tiny"]), None, tmp_path / "model",
                    sid_space="examples-v1")  # fmt: skip
    with serving(tmp_path, tmp_path / "server.log") as running:
        done = grace("query", "--target", running.target,
                     "--request-json", str(examples / "request.json"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("user 500 (US, age 30, female, 1 locations, 5 history events)")
    ranks = [line.split() for line in done.stdout.splitlines() if line[:4].strip().isdigit()]
    assert ranks and all(1001 <= int(r[1]) <= 1012 for r in ranks)  # the examples' ads


@pytest.mark.parametrize(
    "text", ['{"user": ', '{"no_such_field": 1}'], ids=["malformed", "unknown"]
)
def test_a_bad_request_json_is_one_line(server: ServerProcess, text: str) -> None:
    done = grace("query", "--target", server.target, "--request-json", "-", stdin=text)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--request-json is not a RetrieveRequest" in lines[0]
    assert "Traceback" not in done.stderr


def test_a_reader_that_goes_away_ends_query_quietly(server: ServerProcess) -> None:
    world = str(server.data / "world")  # type: ignore[attr-defined]
    cmd = (f"{sys.executable} -m cli query --target {server.target} --world {world} "
           "--max-ads 200 | head -1")  # fmt: skip
    done = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip
    assert done.stdout.startswith("user ") and done.stdout.count("\n") == 1
    assert "Broken pipe" not in done.stderr and "Traceback" not in done.stderr
    assert done.returncode == 0


def test_version_names_the_package() -> None:
    done = grace("--version")
    assert done.returncode == 0 and re.match(r"grace-serving \d+\.\d+\.\d+", done.stdout)


def test_blocks_and_attributes_from_the_command_line(server: ServerProcess) -> None:
    """--exclude-ads keeps those ads out and query says what the exact stage removed;
    --attribute sends an attribute by name, and one the served schema lacks is the
    server's one-line INVALID_ARGUMENT; a bad id list is query's own one line."""
    world = str(server.data / "world")  # type: ignore[attr-defined]
    base = ("query", "--target", server.target, "--world", world, "--user", "3")
    first = grace(*base)
    assert first.returncode == 0, first.stderr
    ads = [line.split()[1] for line in first.stdout.splitlines() if line[:4].strip().isdigit()]
    blocked = grace(*base, "--exclude-ads", ",".join(ads[:3]))
    assert blocked.returncode == 0, blocked.stderr
    shown = [line.split()[1] for line in blocked.stdout.splitlines() if line[:4].strip().isdigit()]
    assert shown and not set(shown) & set(ads[:3])
    assert re.search(r"removed block \d+", blocked.stdout)
    unknown = grace(*base, "--attribute", "platform=ios")
    assert unknown.returncode == 1
    assert "targeting.attributes['platform']: the served index's schema has no such" in (
        unknown.stderr)  # fmt: skip
    bad = grace(*base, "--exclude-ads", "1,x")
    assert bad.returncode == 2 and "expected comma-separated ids" in bad.stderr


def test_a_world_users_attributes_and_blocks_reach_the_request() -> None:
    """`grace query` and `grace record` send a world user's whole targeting: the named
    fields, the attributes of the world's own schema and the user's block lists."""
    from cli.query import targeting_message
    from contracts.targeting import Targeting

    t = Targeting("US", 30, "female", ("US/R1",), attributes=(("audiences", ("a", "b")),),
                  exclude_ad_ids=(5,), exclude_campaign_ids=(3, 4))  # fmt: skip
    msg = targeting_message(t)
    assert (msg.country, msg.age, msg.gender, list(msg.locations)) == ("US", 30, "female",
                                                                       ["US/R1"])  # fmt: skip
    assert list(msg.attributes["audiences"].values) == ["a", "b"]
    assert list(msg.exclude_ad_ids) == [5] and list(msg.exclude_campaign_ids) == [3, 4]
    assert not msg.exclude_advertiser_ids
