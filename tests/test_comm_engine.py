"""The engine as three parts (``mscclang/comm/backend.py``): the runtime's own objects and the
simulator's implement each part's protocol (the simulator runs the runtime's memory part), ``RuntimeBackend`` only assembles the runtime's (no
method of its forwards to another object's), and the lifecycle steps are the executor's."""

from __future__ import annotations

import ast
import inspect
import types
from pathlib import Path

import pytest
import torch

from mscclang.comm.backend import Engine, LaunchPart, MemoryPart, RegistryPart, RuntimeBackend
from mscclang.comm.sim_backend import SimLaunch, SimRegistry, SimWorld
from mscclang.runtime.capture import CaptureGlue
from mscclang.runtime.executor import Executor
from mscclang.runtime.staging import SymmetricMemory

ROOT = Path(__file__).resolve().parents[1]


def _members(proto: type) -> tuple[list[str], dict[str, inspect.Signature]]:
    """A protocol's attributes and its methods' signatures."""
    attrs = list(getattr(proto, "__annotations__", {}))
    methods = {n: inspect.signature(f) for n, f in vars(proto).items()
               if inspect.isfunction(f) and not n.startswith("_")}
    return attrs, methods


@pytest.mark.parametrize("proto,cls", [
    (LaunchPart, Executor), (MemoryPart, SymmetricMemory), (RegistryPart, CaptureGlue),
    (LaunchPart, SimLaunch), (RegistryPart, SimRegistry),
])
def test_each_part_is_implemented_by_the_object_that_does_the_work(proto, cls):
    """Every member of the part exists on the class; a method takes the part's parameters in
    their places, optional ones included, so a caller may pass any of them by position (the GPU
    path runs only on a GPU: a rename or a reordering that misses one side fails here; the
    executor's ``run_call`` once took a stream where the part takes the copies)."""
    attrs, methods = _members(proto)
    assert methods and all(hasattr(cls, a) for a in attrs), (cls, attrs)
    for name, want in methods.items():
        assert callable(getattr(cls, name, None)), f"{cls.__name__} has no {name}"
        got = inspect.signature(getattr(cls, name))
        need = [p for p in want.parameters.values() if p.default is p.empty][1:]
        have = [p for p in got.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1:]
        assert len(have) >= len(need), (cls.__name__, name)
        assert all(p.default is p.empty for p in have[:len(need)]), (cls.__name__, name)
        assert all(p.default is not p.empty for p in have[len(need):]), (cls.__name__, name)
        order = [p.name for p in got.parameters.values()]
        for i, p in enumerate(want.parameters.values()):
            if p.default is not p.empty:
                assert i < len(order) and order[i] == p.name, f"{cls.__name__}.{name} takes {p.name} elsewhere: {order}"


def _is_getattr(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"


def _forwarders(path: Path) -> list[str]:
    """Methods whose body (past the docstring) only calls the same-named method of another object
    with their own parameters, and ``getattr(getattr(...))`` chains."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if _is_getattr(node) and node.args and _is_getattr(node.args[0]):
            found.append(f"{path.name}:{node.lineno} getattr chain")
        if not isinstance(node, ast.FunctionDef):
            continue
        body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        if len(body) == 1 and isinstance(body[0], (ast.Return, ast.Expr)) and isinstance(body[0].value, ast.Call):
            call, params = body[0].value, [a.arg for a in node.args.args[1:]]
            passed = [a.id for a in call.args if isinstance(a, ast.Name)] + \
                [k.value.id for k in call.keywords if isinstance(k.value, ast.Name)]
            if isinstance(call.func, ast.Attribute) and call.func.attr == node.name and passed == params \
                    and len(passed) == len(call.args) + len(call.keywords):
                found.append(f"{path.name}:{node.lineno} {node.name} forwards")
    return found


def test_the_engines_assemble_parts_without_forwarding():
    assert _forwarders(ROOT / "mscclang" / "comm" / "backend.py") == []
    assert _forwarders(ROOT / "mscclang" / "comm" / "sim_backend.py") == []


def test_runtime_backend_assembles_the_executors_objects():
    """The executor is the launch part, its capture glue the registry part, the symmetric memory
    runs over its communicator and staging; the lifecycle steps are the executor's own, and close
    closes the executor, then its communicator."""
    steps: list[str] = []
    comm = types.SimpleNamespace(store="the store", device=0, close=lambda: steps.append("comm.close"),
                                 memory=lambda: {"symmetric": 512})
    ex = object.__new__(Executor)
    ex.comm, ex.capture = comm, types.SimpleNamespace()
    ex.staging = types.SimpleNamespace(cap=4096)
    ex.memory = lambda: {"scratch": 1024}
    ex.close = lambda: steps.append("executor.close")
    be = RuntimeBackend(rank=1, world_size=2, device=torch.device("cpu"), executor=ex)
    assert isinstance(be, Engine) and be.launch is ex and be.registry is ex.capture and be.store == "the store"
    assert (be.check, be.synchronize, be.describe_call, be.reset) == (ex.check, ex.synchronize, ex.describe_call,
                                                                      ex.reset)
    assert be.memory.cap == 4096 and be.memory.memory() == {"scratch": 1024, "symmetric": 512}
    be.describe_call("allreduce of 8 x float32")
    assert comm.call == "allreduce of 8 x float32"
    be.close()
    assert steps == ["executor.close", "comm.close"]


def test_synchronize_releases_what_registered_tensors_that_died_left_mapped():
    """Once the device is idle the registry prunes (before: the adapter did, so a bare executor's
    dead registrations stayed mapped until the next registration step)."""
    pruned: list[int] = []
    ex = object.__new__(Executor)
    ex.waits = types.SimpleNamespace(synchronize=lambda: pruned.append(0))
    ex.capture = types.SimpleNamespace(registry=types.SimpleNamespace(prune=lambda: pruned.append(1)))
    ex.synchronize()
    assert pruned == [0, 1]


def test_the_simulator_engine_is_the_same_three_parts():
    """Its memory part is the GPU runtime's, over the simulator's allocations."""
    be = SimWorld(1, staging_cap=4096).backend(0)
    assert isinstance(be.launch, SimLaunch) and isinstance(be.memory, SymmetricMemory)
    assert isinstance(be.registry, SimRegistry) and be.registry.mode == "off" and not be.launch.traces
    t = be.memory.empty(4, torch.float32)
    assert be.memory.is_symmetric(t) and be.registry.classify(t) == ("sym", 0)
    staged, temp, replaced = be.memory.stage("io", 100)
    assert staged.dtype == torch.uint8 and not temp and not replaced and be.memory.cap == 4096
    assert be.memory.memory()["staging"] == staged.numel() and be.registry.classify(staged) == ("sym", 1)
    big, temp, _ = be.memory.stage("io", 8192)     # above the cap: temporary
    assert temp
    be.memory.pin([staged])
    be.memory.release([staged, big])               # the pinned one stays
    assert be.memory.comm.released == [8192] and be.memory.is_symmetric(staged) and not be.memory.is_symmetric(big)
