"""mscclang.config: every MSCCLANG_* variable is declared there once and read nowhere else; the
settings are read at access time and refuse bad values naming the variable; the one byte-count
grammar (mscclang.units); docs/settings.md is the generated table."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from mscclang import config
from mscclang.cli.main import main as cli_main
from mscclang.config import (EnvBool, EnvBytes, EnvChoice, EnvFloat, EnvInt, EnvSetting, Settings, declared,
                             settings, settings_markdown)
from mscclang.errors import InvalidCall, LimitError, MscclangError, RuntimeUnavailable
from mscclang.units import format_bytes, format_size, parse_bytes

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mscclang"
NAME = re.compile(r"MSCCLANG_[A-Z0-9_]*[A-Z0-9]")


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*") if p.is_file() and p.suffix in (".py", ".json")
                  and "__pycache__" not in p.parts)


def _c_names() -> set[str]:
    """MSCCLANG_* names that are C identifiers, not settings: those of the executor's CUDA
    sources, and macros of the CUDA text the package generates (#ifdef NAME, -DNAME)."""
    names: set[str] = set()
    for p in (ROOT / "executor").rglob("*"):
        if p.is_file() and p.suffix in (".cu", ".cuh", ".h"):
            names |= set(NAME.findall(p.read_text()))
    macro = re.compile(r"(?:#\s*(?:ifdef|ifndef|define)\s+|-D)(MSCCLANG_\w+)")
    for p in _sources():
        names |= set(macro.findall(p.read_text()))
    return names


def test_every_name_in_the_package_is_declared_in_config():
    declared_names = {s.name for s in declared()}
    c_names = _c_names()
    missing = {}
    for p in _sources():
        for n in set(NAME.findall(p.read_text())) - declared_names - c_names:
            missing.setdefault(n, []).append(str(p.relative_to(ROOT)))
    assert not missing, f"MSCCLANG_* names not declared in mscclang/config.py: {missing}"
    assert len(declared_names) == len(declared()), "a variable is declared twice"
    assert {"MSCCLANG_PLAN_MAGIC", "MSCCLANG_CHECK_LAYOUT"} <= c_names  # the exemption is narrow
    assert not (c_names & declared_names) - {"MSCCLANG_ENABLE_NVLS"}


def _constants(tree: ast.Module) -> dict[str, str]:
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Constant):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name) and isinstance(node.value.value, str):
                    out[t.id] = node.value.value
    return out


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or \
           (isinstance(node, ast.Name) and node.id == "environ")


def environ_reads(source: str) -> list[tuple[int, str]]:
    """(line, key) of every read of os.environ whose key is an MSCCLANG_* string (literal or a
    module constant) or not a constant at all (a generic reader): ``os.environ.get(k)``,
    ``os.getenv(k)``, ``os.environ[k]`` (not as an assignment target), ``k in os.environ``."""
    tree = ast.parse(source)
    consts = _constants(tree)
    keys: list[tuple[int, ast.AST]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if isinstance(f, ast.Attribute) and ((f.attr == "get" and _is_environ(f.value)) or f.attr == "getenv"):
                keys.append((node.lineno, node.args[0]))
        elif isinstance(node, ast.Subscript) and _is_environ(node.value) and isinstance(node.ctx, ast.Load):
            keys.append((node.lineno, node.slice))
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            keys.append((node.lineno, node.left))
    out = []
    for line, k in keys:
        if isinstance(k, ast.Constant) and isinstance(k.value, str):
            key = k.value
        elif isinstance(k, ast.Name) and k.id in consts:
            key = consts[k.id]
        else:
            key = f"<{ast.unparse(k)}>"
        if key.startswith("MSCCLANG_") or key.startswith("<"):
            out.append((line, key))
    return sorted(out)


#: generic environment readers outside config.py, each with why it is one: (file, key expression)
#: modules allowed to read a variable by a computed name (none in the package today)
GENERIC_READERS: set[tuple[str, str]] = set()


def test_only_config_reads_mscclang_variables():
    found = {}
    for p in PACKAGE.rglob("*.py"):
        rel = p.relative_to(PACKAGE).as_posix()
        if rel == "config.py":
            continue
        reads = [(line, key) for line, key in environ_reads(p.read_text()) if (rel, key) not in GENERIC_READERS]
        if reads:
            found[rel] = reads
    assert not found, f"read settings through mscclang.config.settings, not os.environ: {found}"


def test_the_scanner_sees_every_kind_of_read():
    src = ('import os\nX = "MSCCLANG_A"\nos.environ.get("MSCCLANG_B")\nos.environ[X]\nos.getenv("MSCCLANG_C")\n'
           '"MSCCLANG_D" in os.environ\nos.environ.get(name)\nos.environ["MSCCLANG_E"] = "1"\n'
           'os.environ.get("HOME")\n')
    assert [k for _, k in environ_reads(src)] == ["MSCCLANG_B", "MSCCLANG_A", "MSCCLANG_C", "MSCCLANG_D", "<name>"]


# ------------------------------------------------------------------------------- byte counts

@pytest.mark.parametrize("text,value", [
    ("0", 0), ("4096", 4096), ("512B", 512), ("64K", 64 << 10), ("64k", 64 << 10), ("64KB", 64 << 10),
    ("64KiB", 64 << 10), ("1M", 1 << 20), ("1MiB", 1 << 20), ("1mb", 1 << 20), ("1.5G", 3 << 29),
    ("1.5k", 1536), ("2T", 2 << 40), (" 8 M ", 8 << 20), ("1_048_576", 1 << 20), (".5K", 512), (4096, 4096),
])
def test_parse_bytes_accepts(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "lots", "-1", "5 parsecs", "4XB", "4iB", "4 K B", "K", "1P", "1_", "0.3", -5])
def test_parse_bytes_refuses_naming_the_value(text):
    with pytest.raises(ValueError, match=re.escape(repr(text))):
        parse_bytes(text)
    with pytest.raises(ValueError, match="^X="):
        parse_bytes(text, "X")


def test_formats_read_back():
    assert [format_size(x) for x in (1024, 1536, 3 << 20, 1 << 30, 1 << 40, 0)] == ["1K", "1536", "3M", "1G", "1T", "0"]
    for n in (1, 1536, 3 << 20, 5 << 30, 7 << 40):
        assert parse_bytes(format_size(n)) == n
    assert [format_bytes(x) for x in (12, 1024, 3 << 29, 1 << 40)] == ["12 B", "1 KiB", "1.5 GiB", "1 TiB"]


# ---------------------------------------------------------------------------------- settings

def test_read_at_access_time_and_blank_means_default(monkeypatch):
    monkeypatch.delenv("MSCCLANG_SPEC_HOT_CALLS", raising=False)
    assert settings.spec_hot_calls == 3
    monkeypatch.setenv("MSCCLANG_SPEC_HOT_CALLS", "7")
    assert settings.spec_hot_calls == 7
    monkeypatch.setenv("MSCCLANG_SPEC_HOT_CALLS", "  ")
    assert settings.spec_hot_calls == 3
    monkeypatch.setenv("MSCCLANG_STAGING_CAP_BYTES", "8M")
    assert settings.staging_cap_bytes == 8 << 20
    monkeypatch.setenv("MSCCLANG_SPECIALIZE", "OFF")
    assert settings.specialize == "never"
    monkeypatch.setenv("MSCCLANG_CHECK_REGISTRATION", "yes")
    assert settings.check_registration is True
    with pytest.raises(AttributeError, match="MSCCLANG_SPEC_HOT_CALLS"):
        settings.spec_hot_calls = 4


def test_a_mapping_of_ones_own():
    s = Settings({"MSCCLANG_GPUS_PER_NODE": "2", "MSCCLANG_SIM_MAX_SECONDS": "2.5"})
    assert s.gpus_per_node == 2 and s.sim_max_seconds == 2.5 and s.register == "off"
    assert Settings({}).gpus_per_node is None
    assert Settings.register.parse("AUTO") == "auto" and Settings.register.parse(None) == "off"
    assert s.is_set("gpus_per_node") and not s.is_set("timeout_s")
    assert not Settings({"MSCCLANG_TIMEOUT_S": " "}).is_set("timeout_s")
    with pytest.raises(AttributeError, match="no setting 'environ'"):
        s.is_set("environ")


_BAD = {EnvBool: "maybe", EnvInt: "x", EnvFloat: "fast", EnvBytes: "lots", EnvChoice: "zzz"}


@pytest.mark.parametrize("setting", [s for s in declared() if type(s) in _BAD], ids=lambda s: s.name)
def test_bad_values_raise_naming_the_variable(setting: EnvSetting):
    bad = _BAD[type(setting)]
    with pytest.raises(MscclangError, match=f"^{setting.name}='{bad}': ") as e:
        getattr(Settings({setting.name: bad}), setting.attr)
    assert isinstance(e.value, setting.error)
    if isinstance(setting, EnvChoice):
        assert all(c in str(e.value) for c in setting.choices)


def test_ranges_and_error_classes():
    with pytest.raises(RuntimeUnavailable, match="MSCCLANG_SPEC_HOT_CALLS=0: must be at least 1"):
        Settings({"MSCCLANG_SPEC_HOT_CALLS": "0"}).spec_hot_calls
    with pytest.raises(LimitError, match="MSCCLANG_SIM_MAX_MEMORY='-3'"):
        Settings({"MSCCLANG_SIM_MAX_MEMORY": "-3"}).sim_max_memory
    with pytest.raises(LimitError, match="must be positive"):
        Settings({"MSCCLANG_MAX_PLAN_BYTES": "0"}).max_plan_bytes
    with pytest.raises(LimitError, match="must be positive"):
        Settings({"MSCCLANG_SIM_MAX_SECONDS": "0"}).sim_max_seconds
    with pytest.raises(InvalidCall, match="MSCCLANG_MAX_REGISTRATIONS=0"):
        Settings({"MSCCLANG_MAX_REGISTRATIONS": "0"}).max_registrations
    with pytest.raises(RuntimeUnavailable, match="not a number of GPUs per node"):
        Settings({"MSCCLANG_GPUS_PER_NODE": "two"}).gpus_per_node
    assert Settings({"MSCCLANG_SIM_MAX_MEMORY": "1.5G"}).sim_max_memory == 3 << 29


def test_declarations_are_checked():
    with pytest.raises(ValueError, match="MSCCLANG_"):
        EnvInt("OTHER", 1, "doc")
    with pytest.raises(ValueError, match="among"):
        EnvChoice("MSCCLANG_X", "c", ("a", "b"), "doc")


# ---------------------------------------------------------------------------------- the table

def test_docs_settings_md_is_the_generated_table():
    doc = ROOT / "docs" / "settings.md"
    assert doc.read_text() == settings_markdown(), \
        "docs/settings.md is stale: python3 -m mscclang env --markdown > docs/settings.md"
    for s in declared():
        assert f"`{s.name}`" in doc.read_text()


def test_readme_points_to_the_settings_doc():
    assert "docs/settings.md" in (ROOT / "README.md").read_text()


def test_env_command(monkeypatch, capsys):
    monkeypatch.setenv("MSCCLANG_REGISTER", "auto")
    monkeypatch.delenv("MSCCLANG_MAX_REGISTRATIONS", raising=False)
    assert cli_main(["env"]) == 0
    out = capsys.readouterr().out
    assert "MSCCLANG_REGISTER = auto" in out and "MSCCLANG_MAX_REGISTRATIONS = default: 64" in out
    monkeypatch.setenv("MSCCLANG_REGISTER", "sometimes")
    assert cli_main(["env"]) == 1
    assert "INVALID: MSCCLANG_REGISTER='sometimes'" in capsys.readouterr().out
    assert cli_main(["env", "--markdown"]) == 0
    assert capsys.readouterr().out == settings_markdown()


def test_describe_lists_every_setting_once():
    rows = config.describe(Settings({"MSCCLANG_TIMEOUT_S": "5"}))
    assert [r.name for r in rows] == [s.name for s in declared()]
    assert next(r for r in rows if r.name == "MSCCLANG_TIMEOUT_S").value == "5.0"
