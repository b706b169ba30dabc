"""Fixtures shared by the index builder's tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from index_builder.publish import current_path, publish
from tests.helpers.indexes import small_index, writer


@pytest.fixture
def published(tmp_path: Path) -> Path:
    """A small index published under tmp_path: its version directory."""
    publish(tmp_path, writer(small_index()))
    path = current_path(tmp_path)
    assert path is not None
    return path
