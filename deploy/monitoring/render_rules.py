"""Render the PrometheusRule manifest from the plain rules file, the one source.

`rules/grace.rules.yml` is what promtool checks and tests and what a plain Prometheus
(the compose stack) loads; the Prometheus Operator wants the same groups under
`spec:` of a `PrometheusRule`. The manifest is that file, indented, under a fixed
header, so comments and layout carry over and a diff reads the same in both.

    python deploy/monitoring/render_rules.py           # rewrite prometheusrule.yaml
    python deploy/monitoring/render_rules.py --check   # exit 1 if it is out of date
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RULES = HERE / "rules" / "grace.rules.yml"
MANIFEST = HERE / "prometheusrule.yaml"

HEADER = """\
# GENERATED from rules/grace.rules.yml by render_rules.py: edit that file, then run
#   python deploy/monitoring/render_rules.py
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="fail if the manifest is out of date")
    args = p.parse_args(argv)
    want = render(RULES.read_text())
    if args.check:
        if not MANIFEST.exists() or MANIFEST.read_text() != want:
            print(f"{MANIFEST} is out of date: run {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    MANIFEST.write_text(want)
    return 0


if __name__ == "__main__":
    sys.exit(main())
