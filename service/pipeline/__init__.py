"""The four-stage pipeline (docs/ARCHITECTURE.md §2): `records.py` the typed hand-offs,
`stages.py` the stage bodies, `runner.py` their threads, `runtime.py` the served pair.
"""
