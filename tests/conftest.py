"""Fixtures shared by the test modules (helpers that are not fixtures live in ``tests/harness``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness.shipped import shipped_plan_files


@pytest.fixture(scope="session")
def shipped_plans() -> list[Path]:
    """The shipped library plan files (``plans/*.json`` without the index), in name order; the
    test is skipped when the folder is absent or holds no plan."""
    files = shipped_plan_files()
    if not files:
        pytest.skip("plans/ holds no library plans (run `mscclang generate-plans`)")
    return files
