"""The Node.js example (examples/node/retrieve.js, docs/CLIENTS.md "From Node.js") run as a
user runs it: against a real `grace serve` process, a request of the request log's
protobuf JSON (camelCase, int64 as strings) gets the ads that request gets from Python and
the server's request id; an invalid one prints INVALID_ARGUMENT, its BadRequest fields and
the id the server logged the call under; a snake_case file is refused rather than sent
emptied. Against the client's fake server, a RetryInfo is decoded. Skips without node and
npm (`make ops-tools` installs them); the locked npm packages are installed once, outside
the checkout."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from cli.query import request_for_user
from clients.python.tests.fake_grace import Answer, FakeRetrieval, serve
from service.request_log import to_json_line
from service.rpc.grace.v1 import retrieval_pb2, retrieval_pb2_grpc
from tests.helpers.server_process import REPO, ServerProcess, serving
from tests.helpers.serving import make_serving_data

NODE, NPM = shutil.which("node"), shutil.which("npm")
if NODE is None or NPM is None:
    why = "node or npm is not installed (make ops-tools, or apt-get install nodejs npm)"
    pytest.skip(f"{why}: the Node.js example is not run", allow_module_level=True)

EXAMPLE = REPO / "examples" / "node"
OFFLINE = ("ENOTFOUND", "EAI_AGAIN", "ECONNREFUSED", "ETIMEDOUT", "ENETUNREACH")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def node_modules(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example's locked packages, installed beside a copy of its package files (npm's
    own cache in ~/.npm makes it a local copy after the first time)."""
    root = tmp_path_factory.mktemp("node")
    for name in ("package.json", "package-lock.json"):
        shutil.copy(EXAMPLE / name, root)
    cmd = [NPM, "ci", "--ignore-scripts", "--no-audit", "--no-fund", "--prefer-offline"]
    npm = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300, check=False)
    if npm.returncode != 0:
        if any(code in npm.stderr for code in OFFLINE):
            pytest.skip(f"npm registry unreachable: {npm.stderr[-300:]}")
        pytest.fail(f"npm ci failed:\n{npm.stderr[-2000:]}")
    return root / "node_modules"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    data = make_serving_data(tmp_path_factory.mktemp("node-serve"))
    with serving(data, data / "server.log") as running:
        running.data = data  # type: ignore[attr-defined]
        yield running


def example(node_modules: Path, target: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`node retrieve.js --target … ARGS` with the packages on NODE_PATH; generous timeout:
    the first call on a cold CPU server of a busy machine."""
    cmd = [NODE, str(EXAMPLE / "retrieve.js"), "--target", target, "--timeout", "60", *args]
    env = os.environ | {"NODE_PATH": str(node_modules)}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=False)


def test_a_logged_request_gets_its_own_ads(
    node_modules: Path, server: ServerProcess, tmp_path: Path
) -> None:
    world = server.data / "world"  # type: ignore[attr-defined]
    request = request_for_user(world, 3, 20, retrieval_pb2.CD_GTM)
    line = to_json_line(request)
    assert '"userId": "' in line and '"maxAds": 20' in line  # the format the pitfall is about
    logged = tmp_path / "requests.jsonl"  # a request log: the example sends its first line
    logged.write_text(line + "\n" + to_json_line(retrieval_pb2.RetrieveRequest()) + "\n")
    with grpc.insecure_channel(server.target) as channel:
        want = retrieval_pb2_grpc.AdRetrievalStub(channel).Retrieve(request, timeout=60)
    done = example(node_modules, server.target, str(logged))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "health: SERVING" in done.stdout
    assert f"request id: {request.request_id}" in done.stdout  # "query-3": the field was read
    got = [int(ad) for ad in re.findall(r"\tad (\d+)\t", done.stdout)]
    assert got == [ad.ad_id for ad in want.ads] and 0 < len(got) <= 20  # every field was sent


def test_an_invalid_request_names_its_fields_and_the_logged_id(
    node_modules: Path, server: ServerProcess, tmp_path: Path
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"targeting": {"age": -1}, "options": {"maxAds": -1}}))
    done = example(node_modules, server.target, str(bad))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "INVALID_ARGUMENT: targeting.age: " in done.stdout
    assert "  bad field targeting.age: " in done.stdout
    assert "  bad field options.max_ads: " in done.stdout
    request_id = re.search(r"^request id: ([0-9a-f]{32})$", done.stdout, re.M)  # the server's
    assert request_id, done.stdout
    end = time.monotonic() + 60  # the server's warning line about the call, flushed soon
    while f"request_id={request_id.group(1)}" not in server.log_text():
        server.check_alive()
        assert time.monotonic() < end, server.log_tail()
        time.sleep(0.05)


def test_a_snake_case_request_is_refused_not_sent_emptied(
    node_modules: Path, tmp_path: Path
) -> None:
    """protobufjs would drop `user_id` under keepCase: false without a word."""
    snake = tmp_path / "snake.json"
    snake.write_text(json.dumps({"user": {"user_id": "7"}, "targeting": {"country": "US"}}))
    done = example(node_modules, "127.0.0.1:1", str(snake))  # refused before connecting
    assert done.returncode == 2 and "user.user_id" in done.stderr, done.stderr


def test_a_retry_info_is_decoded(node_modules: Path) -> None:
    fake = FakeRetrieval()
    busy = grpc.StatusCode.RESOURCE_EXHAUSTED
    fake.answer(Answer(busy, "queue full", retry_delay=0.25, request_id="node-busy"))
    with serve(fake) as target:
        done = example(node_modules, target)  # the request built in the example
    assert done.returncode == 1, done.stdout + done.stderr
    want = ["RESOURCE_EXHAUSTED: queue full", "  retry after 0.25 s", "request id: node-busy"]
    assert done.stdout.splitlines()[1:] == want
    [call] = fake.calls
    sent = call.request
    assert sent.user.user_id == 7 and sent.options.filter_mode == retrieval_pb2.CD_GTM
    assert 0 < call.time_remaining <= 61  # a deadline was sent (60 s, rounded up on the wire)
