"""Errors a serving process raises to whoever started it (the `grace serve` CLI prints them
as one line and exits non-zero). Kept free of heavy imports so the CLI can catch them
without loading torch."""

from __future__ import annotations


class StartupError(RuntimeError):
    """The server cannot start: e.g. no index version under the root passes validation
    (the message names each version and why it was refused)."""
