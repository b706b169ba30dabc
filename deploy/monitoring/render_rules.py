"""Render the PrometheusRule manifest from the plain rules file, the one source, and set
every alert's runbook link to an absolute URL.

`rules/grace.rules.yml` is what promtool checks and tests and what a plain Prometheus
(the compose stack) loads; the Prometheus Operator wants the same groups under
`spec:` of a `PrometheusRule`. The manifest is that file, indented, under a fixed
header, so comments and layout carry over and a diff reads the same in both.

Every alert's `runbook_url` is `<runbook base>docs/ops/monitoring.md#<alert>`, a link
that Alertmanager, Grafana and chat can follow. The base is the address where the
repository's files are browsed (`--runbook-base`, default `RUNBOOK_BASE`); the renderer
writes it into the rules file, into the promtool unit tests that expect the annotation,
and so into the manifest.

    python deploy/monitoring/render_rules.py           # rewrite what is out of date
    python deploy/monitoring/render_rules.py --runbook-base https://git.example.com/ads/grace-serving/-/blob/main/
    python deploy/monitoring/render_rules.py --check   # exit 1 if any is out of date
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from urllib.parse import urlsplit

HERE = Path(__file__).resolve().parent
RULES = HERE / "rules" / "grace.rules.yml"
UNIT_TESTS = sorted((HERE / "rules" / "tests").glob("*.yml"))
MANIFEST = HERE / "prometheusrule.yaml"
# where the repository's files are browsed: a runbook_url is this + the runbook's path
RUNBOOK_BASE = "https://github.com/ORG/grace-serving/blob/main/"
# a runbook_url line: whatever base it has, then the runbook page's repository path
_RUNBOOK_URL = re.compile(r"^(\s*runbook_url:\s*)\S*?(docs/ops/monitoring\.md#\S+)$", re.M)

HEADER = """\
# GENERATED from rules/grace.rules.yml by render_rules.py: edit that file, then run
#   python deploy/monitoring/render_rules.py [--runbook-base URL]
# (tests/ops/test_monitoring.py fails while the two differ.)
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: grace-serving
  labels:
    app.kubernetes.io/name: grace-serving
    app.kubernetes.io/component: monitoring
spec:
"""


def render(rules_text: str) -> str:
    """The manifest for one rules file: its lines indented two spaces under `spec:`."""
    body = "".join(f"  {line}" if line.strip() else line for line in rules_text.splitlines(True))
    return HEADER + body


def rebase(text: str, base: str) -> str:
    """`text` (rules or a promtool unit test) with every runbook_url on `base`."""
    return _RUNBOOK_URL.sub(lambda m: m[1] + base + m[2], text)


def base_url(value: str) -> str:
    """`--runbook-base`: an http(s) URL ending in '/', since the runbook's path follows."""
    url = urlsplit(value)
    if url.scheme not in ("http", "https") or not url.netloc or not value.endswith("/"):
        raise argparse.ArgumentTypeError(f"not an http(s) URL ending in '/': {value!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--runbook-base", type=base_url, default=RUNBOOK_BASE, metavar="URL",
        help="where the repository's files are browsed, ending in '/' (default %(default)s)",
    )  # fmt: skip
    p.add_argument("--check", action="store_true", help="fail if any output is out of date")
    args = p.parse_args(argv)
    want = {path: rebase(path.read_text(), args.runbook_base) for path in (RULES, *UNIT_TESTS)}
    want[MANIFEST] = render(want[RULES])
    stale = [path for path, text in want.items() if not path.exists() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path} is out of date: run {Path(__file__).name} (same --runbook-base)",
                  file=sys.stderr)  # fmt: skip
        return 1 if stale else 0
    for path in stale:
        path.write_text(want[path])
    return 0


if __name__ == "__main__":
    sys.exit(main())
