"""docs/dsl.md, the DSL reference: it names every public name of ``mscclang.dsl`` with its
signature (constructor and user-facing method parameters), and every ```python block runs on its
own, and every ``CollectiveProgram`` a block leaves in a variable compiles and verifies on the
simulator (a block that calls ``verify`` itself checks its own results; one marked
``# a fragment`` is only run)."""

from __future__ import annotations

import contextlib
import enum
import inspect
import io
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

import mscclang.dsl as dsl
from mscclang.dsl import CollectiveProgram
from mscclang.plan.models import ChannelType
from mscclang.sim import verify

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "dsl.md"
TEXT = DOC.read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", TEXT, flags=re.S)

#: user-facing methods whose parameters the reference must list (beyond the constructors)
METHODS = {
    "CollectiveProgram": ["from_spec", "to_plan", "to_json", "post_process_operations"],
    "Rank": ["get_input_buffer", "get_output_buffer", "copy", "copy_packets", "unpack_packets",
             "reduce", "barrier", "get_residual_buffer", "add_residual", "rms_norm"],
    "MemoryChannel": ["signal", "wait", "put", "get", "put_packets", "read_put_packets", "reduce"],
    "PortChannel": ["signal", "wait", "flush", "put", "put_with_signal", "put_with_signal_and_flush",
                    "put_packets", "read_put_packets"],
    "SwitchChannel": ["at_rank", "reduce", "broadcast", "broadcast_packets"],
    "SwitchChannel.SwitchChannelRankView": ["reduce", "broadcast", "broadcast_packets"],
    "Semaphore": ["acquire", "release"],
    "ThreadBlockGroup": ["numtb", "get_internal_id"],
    "Collective": ["precondition", "postcondition"],
}


def _params(fn) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]


def _documented_call(name: str, params: list[str]) -> bool:
    """Some stretch of the doc spells ``name(`` followed by every parameter name, in order,
    before the closing parenthesis (signatures may wrap lines)."""
    for m in re.finditer(rf"(?<!\w){re.escape(name)}\(", TEXT):
        depth, i = 1, m.end()
        while i < len(TEXT) and depth:
            depth += {"(": 1, ")": -1}.get(TEXT[i], 0)
            i += 1
        args = TEXT[m.end():i - 1]
        pos = 0
        for p in params:
            hit = re.search(rf"\b{re.escape(p)}\b", args[pos:])
            if hit is None:
                break
            pos += hit.end()
        else:
            return True
    return False


def test_every_public_name_is_documented():
    missing = [n for n in dsl.__all__ if f"`{n}" not in TEXT]
    assert not missing, f"docs/dsl.md does not mention {missing}"
    for extra in ("DSLError", "DSLWarning", "MscclangWarning", "CompileError", "strict=True",
                  "__mscclang_helper__", "src"):
        assert extra in TEXT, extra


@pytest.mark.parametrize("name", dsl.__all__)
def test_signatures_are_documented(name):
    obj = getattr(dsl, name)
    if isinstance(obj, type) and issubclass(obj, enum.Enum):
        for member in ("none", "before", "after", "both") if name == "SyncType" else [m.name for m in obj]:
            assert re.search(rf"`{name}`: .*`{member}`", TEXT), (name, member)
        return
    params = _params(obj)
    assert _documented_call(name, params), f"no '{name}(' listing {params} in docs/dsl.md"


@pytest.mark.parametrize("owner", sorted(METHODS))
def test_methods_are_documented(owner):
    cls = dsl
    for part in owner.split("."):
        cls = getattr(cls, part)
    for method in METHODS[owner]:
        params = _params(getattr(cls, method))
        assert _documented_call(method, params), f"no '{method}(' listing {params} for {owner}"


def test_methods_list_is_complete():
    """Every public method of the user-facing classes is in METHODS (a new one needs docs)."""
    internal = {"ir", "gpus", "error", "check_rank", "check_tb", "tb_targets", "check_chunk",
                "check_same_size", "check_scratch", "check_src_position", "add_op", "barrier_id", "touch",
                "set_loop_context", "input_chunks", "output_chunks", "buffer_sizes",
                "SwitchChannelRankView"}
    for owner, listed in METHODS.items():
        cls = dsl
        for part in owner.split("."):
            cls = getattr(cls, part)
        public = {m for m, v in vars(cls).items()
                  if not m.startswith("_") and m not in internal and (callable(v) or isinstance(v, classmethod))}
        assert public <= set(listed), (owner, public - set(listed))


def test_doc_has_python_examples():
    assert len(BLOCKS) >= 15
    assert any("relaxed=True" in b and ".put(" in b for b in BLOCKS)  # the ready handshake


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=lambda i: f"block{i}")
def test_example_runs_and_verifies(index):
    code = BLOCKS[index]
    namespace: dict = {"__name__": "__dsl_doc__"}
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a block that expects warnings checks them itself
        exec(compile(code, f"dsl.md block {index}", "exec"), namespace)
    progs = {id(v): v for v in namespace.values() if isinstance(v, CollectiveProgram)}
    if "verify(" in code or "# a fragment" in code:
        return
    for prog in progs.values():
        report = verify(prog.to_plan(), schedules=3)
        assert report.ok, f"docs/dsl.md block {index}: {report}"


def _ring_block() -> str:
    found = [b for b in BLOCKS if "def ring_allgather(" in b]
    assert len(found) == 1, "docs/dsl.md has one ring example (a block defining ring_allgather)"
    return found[0]


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_ring_example_is_a_ring_and_verifies_for_any_rank_count(n):
    """The ring example's program, for rank counts other than the one the block runs: every rank
    has channels to its two ring neighbours only, and the plan verifies (2 ranks included, where
    both neighbours are one peer and the pairing rule decides which channel is which)."""
    namespace: dict = {"__name__": "__dsl_doc__"}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(_ring_block(), "dsl.md ring block", "exec"), namespace)
    with warnings.catch_warnings():
        warnings.simplefilter("error")    # an unbalanced channel would be a DSLWarning
        plan = namespace["ring_allgather"](n).to_plan()
    for r, gpu in enumerate(plan.gpus):
        peers = gpu.peers(ChannelType.memory)
        assert set(peers) == {(r + 1) % n, (r - 1) % n}, (r, peers)
    report = verify(plan, schedules=4)
    assert report.ok, f"ring_allgather({n}): {report}"


def test_pairing_rule_is_stated():
    section = TEXT[TEXT.index("## Channel pairing"):].split("\n## ", 1)[0]
    assert "the j-th channel from rank A to rank B pairs with B's j-th channel to A" in section
    assert "global channel index order" in section and "one-directional" in section
    assert "```python" in section     # with an example that runs


def test_ring_example_compiles_and_verifies_from_the_command_line(tmp_path):
    """What the ring section says to run: the block saved as ``ring.py`` with the ending it
    gives, then ``mscclang compile`` and ``mscclang verify``."""
    tail = re.search(r"end the file with\n\n((?:    .*\n)+)", TEXT)
    assert tail, "the ring section shows how to end the file for `mscclang compile`"
    source = tmp_path / "ring.py"
    source.write_text(_ring_block() + "\n" + textwrap.dedent(tail.group(1)))
    plan = tmp_path / "ring.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for args in (["compile", str(source), "-o", str(plan)], ["verify", str(plan)]):
        res = subprocess.run([sys.executable, "-m", "mscclang", *args], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, (args, res.stderr)
    assert "OK" in res.stdout and '"ring_allgather_8"' in plan.read_text()
