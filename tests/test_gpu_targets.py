"""Every worker-pool target the GPU tests name (``"module:function"``, or ``f"{C}:function"`` with
``C = "module"``) exists. Found on a GPU: after the harness moved out of the package, 80 GPU
tests errored at set-up on a target that no longer existed, which no CPU test could see."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_CONST = re.compile(r'^\s*(\w+(?:\s*,\s*\w+)*)\s*=\s*("[\w.]+"(?:\s*,\s*"[\w.]+")*)\s*$', re.M)
_FSTR = re.compile(r'f"\{(\w+)\}:(\w+)"')
_PLAIN = re.compile(r'"((?:mscclang|tests|tools)\.[\w.]+):(\w+)"')


def _targets() -> list[tuple[str, str, str]]:
    out = []
    for p in sorted((ROOT / "tests" / "gpu").glob("*.py")):
        src = p.read_text()
        consts: dict[str, str] = {}
        for names, values in _CONST.findall(src):
            for n, v in zip([x.strip() for x in names.split(",")], re.findall(r'"([\w.]+)"', values)):
                consts[n] = v
        for const, fn in _FSTR.findall(src):
            assert const in consts, f"{p.name}: f-string target {{{const}}}:{fn} names no module constant"
            out.append((p.name, consts[const], fn))
        out += [(p.name, mod, fn) for mod, fn in _PLAIN.findall(src)]
    return out


TARGETS = _targets()


def test_the_gpu_tests_name_targets():
    assert len(TARGETS) > 50


@pytest.mark.parametrize("where,module,function", sorted(set(TARGETS)))
def test_target_exists(where, module, function):
    mod = importlib.import_module(module)
    assert callable(getattr(mod, function, None)), f"{where}: {module}:{function} does not exist"


def test_check_cases_size_test_collectives_too():
    """Found on a GPU: the port-pipeline and context-growth GPU tests run a 'test' collective, which
    the shared reference does not define; a check case sizes it as equal input and output."""
    from types import SimpleNamespace

    from mscclang.cli.run_checks import _sizes

    plan = lambda coll: SimpleNamespace(collective=coll)  # noqa: E731 - what _sizes reads of a plan
    assert _sizes(plan("test"), 4096, 4, 2) == (1024, 1024)
    assert _sizes(plan("allgather"), 4096, 4, 2) == (1024, 2048)
    assert _sizes(plan("reducescatter"), 4100, 4, 2) == (1024, 512)
