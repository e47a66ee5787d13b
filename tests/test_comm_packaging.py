"""The communicator's data ships in the wheel: the tuning defaults as package data, plans/ as
data files under share/mscclang/plans, which default_plans_dir() finds in an installed tree.
(Checked by hand with ``pip wheel . -w /tmp/whl --no-deps``; here the configuration and the
lookup are checked without building.)"""

import fnmatch
import json
import shutil
import sys
from pathlib import Path

import pytest

from mscclang.comm import catalog as catalog_mod
from mscclang.comm.tuning import DEFAULT_TUNING_FILE, load_tuning

ROOT = Path(__file__).resolve().parent.parent

tomllib = pytest.importorskip("tomllib") if sys.version_info >= (3, 11) else pytest.importorskip("tomli")


def _setuptools_cfg():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_tuning_defaults_are_package_data():
    pats = _setuptools_cfg()["package-data"]["mscclang"]
    rel = DEFAULT_TUNING_FILE.relative_to(ROOT / "mscclang").as_posix()
    assert any(fnmatch.fnmatch(rel, p) for p in pats), (rel, pats)


def test_plans_are_data_files_where_the_catalog_looks():
    files = _setuptools_cfg()["data-files"]
    pats = files.get("share/mscclang/plans")
    assert pats, files
    for f in sorted((ROOT / "plans").glob("*.json")):
        assert any(fnmatch.fnmatch(f.relative_to(ROOT).as_posix(), p) for p in pats), f.name


def test_installed_plans_found_under_a_data_root(tmp_path, monkeypatch):
    """As installed from the wheel: no checkout next to the package, plans under
    <data root>/share/mscclang/plans."""
    src = ROOT / "plans"
    if not (src / "index.json").is_file():
        pytest.skip("no plans/ in this checkout")
    pkg = tmp_path / "site" / "mscclang"
    (pkg / "comm").mkdir(parents=True)
    shutil.copy(DEFAULT_TUNING_FILE, pkg / "comm" / DEFAULT_TUNING_FILE.name)
    dest = tmp_path / "prefix" / "share" / "mscclang" / "plans"
    shutil.copytree(src, dest)
    monkeypatch.delenv("MSCCLANG_PLANS_DIR", raising=False)
    monkeypatch.setattr(catalog_mod, "__file__", str(pkg / "comm" / "catalog.py"))
    monkeypatch.setattr(catalog_mod, "installed_data_dirs", lambda: [tmp_path / "elsewhere", tmp_path / "prefix"])
    assert catalog_mod.default_plans_dir() == dest
    cat = catalog_mod.Catalog.from_dir()
    entries = json.loads((src / "index.json").read_text())["plans"]
    assert len(cat) == len(entries) > 0
    assert load_tuning(pkg / "comm" / DEFAULT_TUNING_FILE.name).rules
    # nothing installed anywhere: no folder
    monkeypatch.setattr(catalog_mod, "installed_data_dirs", lambda: [tmp_path / "elsewhere"])
    assert catalog_mod.default_plans_dir() is None
