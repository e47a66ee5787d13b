"""mscclang.config: every MSCCLANG_* variable is declared there once and read nowhere else; the
settings are read at access time and refuse bad values naming the variable; the one byte-count
grammar (mscclang.units); docs/settings.md is the generated table."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Optional

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


def _key(k: Optional[ast.AST], consts: dict[str, str]) -> str:
    if isinstance(k, ast.Constant) and isinstance(k.value, str):
        return k.value
    if isinstance(k, ast.Name) and k.id in consts:
        return consts[k.id]
    return "<os.environ>" if k is None else f"<{ast.unparse(k)}>"


def environ_reads(source: str) -> list[tuple[int, str]]:
    """(line, key) of every read of the process environment: ``os.environ.get(k)``,
    ``os.environ.setdefault(k, v)`` (and every other method but ``update``), ``os.getenv(k)``,
    ``os.environ[k]`` (not as an assignment or ``del`` target), ``k in os.environ``, and
    ``os.environ`` itself handed on as a mapping (key ``<os.environ>``). A key that is neither a
    literal nor a module constant is ``<expression>``. Writes (``os.environ[k] = v``,
    ``os.environ.update(m)``, ``del os.environ[k]``) are not reads."""
    tree = ast.parse(source)
    consts = _constants(tree)
    parent = {c: n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (getattr(node.func, "attr", None) == "getenv"
                                           or getattr(node.func, "id", None) == "getenv"):
            out.append((node.lineno, _key(node.args[0] if node.args else None, consts)))
        if not _is_environ(node):
            continue
        up = parent.get(node)
        if isinstance(up, ast.Attribute):
            if up.attr == "update":
                continue
            call = parent.get(up)
            key = call.args[0] if isinstance(call, ast.Call) and call.args else None
        elif isinstance(up, ast.Subscript) and up.value is node:
            if not isinstance(up.ctx, ast.Load):
                continue
            key = up.slice
        elif isinstance(up, ast.Compare):
            key = up.left
        else:
            key = None
        out.append((node.lineno, _key(key, consts)))
    return sorted(out)


def test_only_config_reads_the_environment():
    """Every variable mscclang reads, MSCCLANG_* or another program's (NCCL, CUDA, torch, the
    launcher), is read through mscclang.config; other modules only write the environment."""
    found = {}
    for p in PACKAGE.rglob("*.py"):
        rel = p.relative_to(PACKAGE).as_posix()
        if rel != "config.py" and (reads := environ_reads(p.read_text())):
            found[rel] = reads
    assert not found, f"read the environment through mscclang.config.settings, not os.environ: {found}"


def test_the_scanner_sees_every_kind_of_read():
    src = ('import os\nX = "MSCCLANG_A"\nos.environ.get("MSCCLANG_B")\nos.environ[X]\nos.getenv("MSCCLANG_C")\n'
           '"MSCCLANG_D" in os.environ\nos.environ.get(name)\nos.environ["MSCCLANG_E"] = "1"\n'
           'os.environ.get("HOME")\nos.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")\n'
           'env = env or os.environ\nos.environ.update(other)\ndel os.environ["Y"]\n')
    assert [k for _, k in environ_reads(src)] == ["MSCCLANG_B", "MSCCLANG_A", "MSCCLANG_C", "MSCCLANG_D", "<name>",
                                                 "HOME", "CUDA_DEVICE_MAX_CONNECTIONS", "<os.environ>"]


def _code_strings(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, text) of every string constant of the code, docstrings left out."""
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def test_nccl_environment_and_variable_names_have_one_home():
    """NVLink multicast is never enabled: ``nccl_env()`` is the one place that says so, and
    every module that starts NCCL sets it; no module but config.py spells a variable's name as a
    key (``Settings.<name>.name`` names it)."""
    assert config.nccl_env() == {"NCCL_NVLS_ENABLE": "0"}
    net = config.nccl_env(network_only=True)
    assert net["NCCL_NVLS_ENABLE"] == "0" and net["NCCL_P2P_DISABLE"] == net["NCCL_SHM_DISABLE"] == "1"
    names = {s.name for s in declared()} | {e.name for e in config.externals()}
    assert {"LOCAL_WORLD_SIZE", "CUDA_DEVICE_MAX_CONNECTIONS", "NCCL_NVLS_ENABLE"} <= names
    found = {}
    for p in PACKAGE.rglob("*.py"):
        rel = p.relative_to(PACKAGE).as_posix()
        if rel == "config.py":
            continue
        bad = [(line, s) for line, s in _code_strings(ast.parse(p.read_text()))
               if "NCCL_NVLS_ENABLE" in s or s in names or re.fullmatch(r"NCCL_[A-Z0-9_]+", s)]
        if bad:
            found[rel] = bad
    assert not found, f"variable names spelled outside mscclang/config.py (use nccl_env(), Settings.<x>.name): {found}"


_WRAPPERS = {"int", "float", "bool", "str", "min", "max"}


def _reads_settings(e: ast.AST) -> bool:
    """``settings.x``, ``Settings.x.default``, ``Settings.x.parse(v)``, ``Settings(env).x``."""
    while isinstance(e, (ast.Attribute, ast.Call)):
        e = e.value if isinstance(e, ast.Attribute) else e.func
    return isinstance(e, ast.Name) and e.id in ("settings", "Settings")


def _is_second_name(e: ast.AST) -> bool:
    if isinstance(e, ast.Call) and isinstance(e.func, ast.Name) and e.func.id in _WRAPPERS:
        return any(_is_second_name(a) for a in e.args)
    if isinstance(e, ast.IfExp):
        return _is_second_name(e.body) or _is_second_name(e.orelse)
    return _reads_settings(e)


def second_names(source: str) -> list[str]:
    """Functions whose body is only a settings read (wrapped at most in int/min/max/..., a choice
    between an explicit value and the setting, or a try), and module names bound to a setting's
    value, default, name or choices, or to a function of mscclang.config."""
    tree = ast.parse(source)
    from_config = {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom)
                   and n.module == "mscclang.config" for a in n.names}
    out = []
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = n.body[1:] if ast.get_docstring(n) is not None else n.body
            if len(body) == 1 and isinstance(body[0], ast.Try) and len(body[0].body) == 1:
                body = body[0].body
            if len(body) == 1 and isinstance(body[0], ast.Return) and body[0].value is not None \
                    and _is_second_name(body[0].value):
                out.append(f"{n.lineno}: def {n.name}")
    for n in tree.body:
        if isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None:
            if _reads_settings(n.value) or (isinstance(n.value, ast.Name) and n.value.id in from_config):
                out.append(f"{n.lineno}: {ast.unparse(n.targets[0] if isinstance(n, ast.Assign) else n.target)}")
    return out


def test_settings_have_no_second_names():
    """Code reads ``settings.<name>`` (an explicit API value: ``Settings.<name>.or_env(value)``),
    never an accessor or constant that re-exports a setting under another name."""
    found = {}
    for p in PACKAGE.rglob("*.py"):
        rel = p.relative_to(PACKAGE).as_posix()
        if rel != "config.py" and (names := second_names(p.read_text())):
            found[rel] = names
    assert not found, f"read settings.<name> directly: {found}"


def test_the_second_name_scanner_sees_every_form():
    src = ("from mscclang.config import Settings, settings, default_sim_max_memory\n"
           "A = Settings.x.default\nB: str = Settings.x.name\nC = default_sim_max_memory\nD = 3\n"
           "def f():\n    'doc'\n    return settings.x\n"
           "def g():\n    return max(settings.x, 4)\n"
           "def h(v=None):\n    return Settings.x.parse(v) if v is not None else settings.x\n"
           "def i():\n    try:\n        return settings.x\n    except E:\n        raise F from None\n"
           "def j():\n    n = settings.x\n    return n * 2\n"
           "def k():\n    return Limits(settings.x, settings.y)\n")
    assert [s.split(": ")[1] for s in second_names(src)] == ["def f", "def g", "def h", "def i", "A", "B", "C"]


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


def test_an_explicit_value_or_the_environment(monkeypatch):
    """``Settings.<name>.or_env(value)``: an API's explicit value by the setting's rule (its
    error class included), else the environment's value at that moment."""
    monkeypatch.setenv("MSCCLANG_SPECIALIZE", "never")
    assert Settings.specialize.or_env() == "never" and Settings.specialize.or_env("1") == "always"
    monkeypatch.delenv("MSCCLANG_SPECIALIZE")
    assert Settings.specialize.or_env(None) == "auto"
    with pytest.raises(RuntimeUnavailable, match="MSCCLANG_ASYNC_ERROR='loud'"):
        Settings.async_error.or_env("loud")
    monkeypatch.setenv("MSCCLANG_REGISTER", "nope")
    with pytest.raises(InvalidCall, match="MSCCLANG_REGISTER='nope'"):
        Settings.register.or_env()
    assert Settings.register.or_env("explicit") == "explicit"


def test_variables_of_other_programs_are_read_as_text():
    s = Settings({"LOCAL_WORLD_SIZE": " 4 ", "CUDA_DEVICE_MAX_CONNECTIONS": "16"})
    assert s.local_world_size == " 4 " and s.cuda_device_max_connections == "16" and s.xdg_cache_home is None
    assert [v.name for v in config.externals()] == [v.name for v in vars(Settings).values()
                                                    if isinstance(v, config.EnvVar) and v not in declared()]
    assert not {v.name for v in config.externals()} & {v.name for v in declared()}
    with pytest.raises(AttributeError, match="LOCAL_WORLD_SIZE"):
        s.local_world_size = "2"
    assert config.worker_env(s) == {"NCCL_NVLS_ENABLE": "0", "CUDA_DEVICE_MAX_CONNECTIONS": "16"}
    assert config.worker_env(Settings({}))["CUDA_DEVICE_MAX_CONNECTIONS"] == "32"


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


def _folder(tmp_path: Path, kind: str) -> str:
    """A value of MSCCLANG_PLANS_DIR or MSCCLANG_TUNING of the given kind, made under tmp_path."""
    f = tmp_path / "x"
    if kind in ("empty", "no plan", "broken index"):
        f.mkdir()
    if kind == "no plan":
        (f / "t.json").write_text((PACKAGE / "comm" / "tuning_2xh200.json").read_text())
    elif kind == "broken index":
        (f / "index.json").write_text("{not json")
    elif kind in ("file", "not a table"):
        f.write_text('{"format": "mscclang.plan/1"}' if kind == "not a table" else "{not json")
    return str(ROOT / "plans") if kind == "good" else str(f)


@pytest.mark.parametrize("var,kind,problem", [
    ("MSCCLANG_PLANS_DIR", "missing", "no such folder"),
    ("MSCCLANG_PLANS_DIR", "file", "not a folder"),
    ("MSCCLANG_PLANS_DIR", "empty", "holds no plan"),
    ("MSCCLANG_PLANS_DIR", "no plan", "no file of the folder is a plan"),
    ("MSCCLANG_PLANS_DIR", "broken index", "not valid JSON"),
    ("MSCCLANG_PLANS_DIR", "good", None),
    ("MSCCLANG_TUNING", "missing", "cannot read tuning file"),
    ("MSCCLANG_TUNING", "file", "not valid JSON"),
    ("MSCCLANG_TUNING", "empty", "cannot read tuning file"),
    ("MSCCLANG_TUNING", "not a table", "expected format 'mscclang.tuning/1'"),
])
def test_describe_refuses_what_the_catalog_and_the_tuning_loader_refuse(tmp_path, var, kind, problem):
    value = _folder(tmp_path, kind)
    row = next(r for r in config.describe(Settings({var: value})) if r.name == var)
    if problem is None:
        assert row.problem is None and row.value == value
    else:
        assert row.problem is not None and row.problem.startswith(f"{var}={value!r}: ") and problem in row.problem, row


@pytest.mark.parametrize("var,kind,problem", [
    ("MSCCLANG_EXECUTOR_DIR", "missing", "no such folder"), ("MSCCLANG_EXECUTOR_DIR", "file", "not a folder"),
    ("MSCCLANG_CUBIN_DIR", "missing", "no such folder"), ("MSCCLANG_CUBIN_DIR", "file", "not a folder"),
    ("MSCCLANG_CACHE_DIR", "file", "not a folder"), ("MSCCLANG_CACHE_DIR", "missing", None),
    ("MSCCLANG_CUBIN_DIR", "empty", None), ("MSCCLANG_EXECUTOR_DIR", "empty", None),
])
def test_folder_settings_refuse_a_file_or_a_missing_folder(tmp_path, var, kind, problem):
    """Seen: a MSCCLANG_EXECUTOR_DIR or MSCCLANG_CUBIN_DIR naming no folder was passed over in
    silence (the checkout's sources, NVRTC builds); a kernel cache that is a file failed deep in a build."""
    value = _folder(tmp_path, kind)
    s = next(d for d in declared() if d.name == var)
    row = next(r for r in config.describe(Settings({var: value})) if r.name == var)
    if problem is None:
        assert getattr(Settings({var: value}), s.attr) == value and row.problem is None
    else:
        with pytest.raises(MscclangError, match=f"{var}={re.escape(repr(value))}: {problem}"):
            getattr(Settings({var: value}), s.attr)
        assert problem in row.problem


def test_the_runtime_refuses_an_executor_dir_that_is_not_there(monkeypatch, tmp_path):
    from mscclang.runtime import build

    monkeypatch.setenv("MSCCLANG_EXECUTOR_DIR", str(tmp_path / "nope"))
    with pytest.raises(MscclangError, match="MSCCLANG_EXECUTOR_DIR=.*nope.*: no such folder"):
        build.executor_dir()


def test_describe_accepts_a_tuning_table_given_as_text():
    text = (PACKAGE / "comm" / "tuning_2xh200.json").read_text()
    assert next(r for r in config.describe(Settings({"MSCCLANG_TUNING": text}))
                if r.name == "MSCCLANG_TUNING").problem is None
    bad = next(r for r in config.describe(Settings({"MSCCLANG_TUNING": '{"rules": 3}'})) if r.name == "MSCCLANG_TUNING")
    assert "expected format" in bad.problem


def test_env_command_marks_a_plans_folder_without_plans(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("MSCCLANG_PLANS_DIR", str(tmp_path))
    assert cli_main(["env"]) == 1
    assert f"INVALID: MSCCLANG_PLANS_DIR='{tmp_path}': the folder holds no plan" in capsys.readouterr().out


def test_describe_lists_every_setting_once():
    rows = config.describe(Settings({"MSCCLANG_TIMEOUT_S": "5"}))
    assert [r.name for r in rows] == [s.name for s in declared()]
    assert next(r for r in rows if r.name == "MSCCLANG_TIMEOUT_S").value == "5.0"
