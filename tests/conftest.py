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


@pytest.fixture(scope="module")
def catalog():
    """The shipped library's :class:`~mscclang.comm.catalog.Catalog` (``plans/`` and its index);
    the test is skipped when the checkout has no plans."""
    from mscclang.comm.catalog import Catalog, default_plans_dir

    folder = default_plans_dir()
    if folder is None or not (folder / "index.json").is_file():
        pytest.skip("no plans/ with its index in this checkout (run `mscclang generate-plans`)")
    return Catalog.from_dir(folder)
