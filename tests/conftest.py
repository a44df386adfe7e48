"""Fixtures for every test."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _terminal_width_not_inherited(monkeypatch):
    """gradtrace takes its width from ``COLUMNS`` where set, as Rich does; pytest-xdist's workers set it to 80,
    and a shell may export it. Tests that read tables or lines set the width they mean (or none)."""
    monkeypatch.delenv("COLUMNS", raising=False)
