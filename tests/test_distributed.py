"""mscclang as a torch.distributed backend (``mscclang.distributed``) on the CPU: two spawned ranks
over a FileStore run ``init_process_group("mscclang")`` and every mapped torch.distributed call,
each result checked exactly against the reference computed locally. On a CPU machine the
Communicator has no GPU runtime, so each of its calls falls back to torch.distributed through its
own gloo group: what these tests check is the op mapping (which ProcessGroup methods torch calls
and what they do), the inner-group path (reduce, float64, explicit all-to-all splits), the Work
semantics (``async_op``, ``get_future``), errors and teardown."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.distributed as dist

from tests.harness.launch import free_port, torchrun_cpu

ROOT = Path(__file__).resolve().parent.parent
WORLD = 2


def _x(rank: int, n: int = 8, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rank ``rank``'s deterministic input (integers, so every sum is exact)."""
    return (torch.arange(n, dtype=torch.float64) * (rank + 1) + rank).to(dtype)


def _check_ops(rank: int) -> None:
    import mscclang.distributed as md

    pg = dist.group.WORLD
    assert isinstance(pg, md.MscclangProcessGroup), type(pg)
    xs = [_x(r) for r in range(WORLD)]
    # all_reduce: sum, min, max, avg
    for op, ref in ((dist.ReduceOp.SUM, sum(xs)), (dist.ReduceOp.MIN, torch.minimum(*xs)),
                    (dist.ReduceOp.MAX, torch.maximum(*xs)), (dist.ReduceOp.AVG, sum(xs) / WORLD)):
        t = _x(rank)
        dist.all_reduce(t, op=op)
        assert torch.equal(t, ref), (op, t, ref)
    # all_gather_into_tensor and list all_gather
    out = torch.empty(8 * WORLD)
    dist.all_gather_into_tensor(out, _x(rank))
    assert torch.equal(out, torch.cat(xs))
    outs = [torch.empty(8) for _ in range(WORLD)]
    dist.all_gather(outs, _x(rank))
    assert all(torch.equal(o, x) for o, x in zip(outs, xs))
    # reduce_scatter_tensor and list reduce_scatter
    out = torch.empty(8 // WORLD)
    dist.reduce_scatter_tensor(out, _x(rank))
    assert torch.equal(out, sum(xs).chunk(WORLD)[rank])
    out = torch.empty(4)
    dist.reduce_scatter(out, [_x(rank, 4) + j for j in range(WORLD)])
    assert torch.equal(out, sum(_x(r, 4) + rank for r in range(WORLD)))
    # all_to_all_single, equal blocks
    out = torch.empty(8)
    dist.all_to_all_single(out, _x(rank))
    assert torch.equal(out, torch.cat([x.chunk(WORLD)[rank] for x in xs]))
    # broadcast from each root
    for root in range(WORLD):
        t = _x(rank)
        dist.broadcast(t, src=root)
        assert torch.equal(t, xs[root])
    dist.barrier()
    assert pg._inner == {}   # all ran on the Communicator, none on the inner group
    # send / recv (point-to-point runs on the inner group: the library's plans are collective)
    if rank == 0:
        dist.send(_x(0) + 100, dst=1)
        t = torch.empty(8)
        dist.recv(t, src=1)
        assert torch.equal(t, _x(1) + 200)
    else:
        t = torch.empty(8)
        dist.recv(t, src=0)
        assert torch.equal(t, _x(0) + 100)
        dist.send(_x(1) + 200, dst=0)
    # a bf16 all_reduce (a dtype the Communicator runs)
    t = _x(rank, dtype=torch.bfloat16)
    dist.all_reduce(t)
    assert torch.equal(t, sum(_x(r, dtype=torch.bfloat16) for r in range(WORLD)))
    assert set(pg._inner) == {"cpu"}   # made by the send/recv


def _check_fallback(rank: int) -> None:
    import mscclang.distributed as md

    pg = dist.group.WORLD
    assert pg._inner == {}   # nothing went to the inner group so far
    xs = [_x(r) for r in range(WORLD)]
    t = _x(rank)
    dist.reduce(t, dst=1)
    if rank == 1:
        assert torch.equal(t, sum(xs))
    assert set(pg._inner) == {"cpu"}
    # one torch group per device type: the inner group is the Communicator's fallback group
    dist.all_reduce(_x(rank))   # the Communicator's call (its fallback on a machine without GPUs)
    assert pg._inner["cpu"] is pg.communicator._fallback.own_backend
    # float64 runs on the inner group
    t = _x(rank, dtype=torch.float64)
    dist.all_reduce(t)
    assert torch.equal(t, sum(_x(r, dtype=torch.float64) for r in range(WORLD)))
    # PRODUCT too
    t = _x(rank) + 1
    dist.all_reduce(t, op=dist.ReduceOp.PRODUCT)
    assert torch.equal(t, (xs[0] + 1) * (xs[1] + 1))
    # uneven all_to_all: rank r sends r+1 elements to each peer... sizes agreed across ranks
    ins = [1, 3] if rank == 0 else [2, 4]     # rank 0 -> 0: 1, 0 -> 1: 3; 1 -> 0: 2, 1 -> 1: 4
    outs = [1, 2] if rank == 0 else [3, 4]
    inp = torch.arange(sum(ins), dtype=torch.float32) + 10 * rank
    out = torch.empty(sum(outs))
    dist.all_to_all_single(out, inp, output_split_sizes=outs, input_split_sizes=ins)
    a0, a1 = torch.arange(4.0), torch.arange(6.0) + 10
    ref = torch.cat([a0[:1], a1[:2]]) if rank == 0 else torch.cat([a0[1:], a1[2:]])
    assert torch.equal(out, ref)
    # gather and scatter
    gl = [torch.empty(8) for _ in range(WORLD)] if rank == 0 else None
    dist.gather(_x(rank), gl, dst=0)
    if rank == 0:
        assert all(torch.equal(g, x) for g, x in zip(gl, xs))
    t = torch.empty(8)
    dist.scatter(t, [x + 1 for x in xs] if rank == 0 else None, src=0)
    assert torch.equal(t, xs[rank] + 1)
    assert isinstance(pg, md.MscclangProcessGroup)


def _check_work(rank: int) -> None:
    import mscclang.distributed as md

    xs = [_x(r) for r in range(WORLD)]
    t = _x(rank)
    w = dist.all_reduce(t, async_op=True)
    assert isinstance(w, md.MscclangWork)
    assert w.wait() is True and w.is_completed() and torch.equal(t, sum(xs))
    fut = w.get_future()
    assert fut.done() and torch.equal(fut.value()[0], sum(xs))
    out = torch.empty(8 * WORLD)
    w = dist.all_gather_into_tensor(out, _x(rank), async_op=True)
    assert w.wait() is True and torch.equal(w.get_future().wait()[0], torch.cat(xs))
    w = dist.barrier(async_op=True)
    assert w.wait() is True


def _check_errors(rank: int) -> None:
    from mscclang.errors import InvalidCall

    pg = dist.group.WORLD
    # a bad call raises (sync) ...
    with _raises(InvalidCall):
        pg.broadcast([_x(rank)], _bcast(WORLD + 3, False))   # a root outside the group
    # ... or through wait() (async)
    w = pg.broadcast([_x(rank)], _bcast(WORLD + 3, True))
    with _raises(InvalidCall):
        w.wait()
    with _raises(InvalidCall):   # never a failed future: DDP's reducer crashed on one
        w.get_future()
    # the group still works after the bad calls
    t = _x(rank)
    dist.all_reduce(t)
    assert torch.equal(t, sum(_x(r) for r in range(WORLD)))


def _check_lists(rank: int) -> None:
    """Seen: ``dist.all_gather`` with a one-tensor output list on 2 ranks returned rank 0's
    tensor (gloo raises "invalid output tensor list"). Every list argument is checked alike on
    every rank, naming the argument; the group keeps working after each refusal."""
    from mscclang.errors import InvalidCall

    x = torch.full((2,), float(rank))
    for call, words in (
            (lambda: dist.all_gather([torch.empty(2)], x), "output_lists[0] has 1 item(s); expected 2"),
            (lambda: dist.all_gather([torch.empty(2), torch.empty(2, 1)], x),
             "output_lists[0][1] is a tensor of shape (2, 1)"),
            (lambda: dist.group.WORLD.allgather([[torch.empty(2), torch.empty(2, dtype=torch.int32)]], [x.int()]),
             "output_lists[0][0] is a tensor of shape (2,), torch.float32"),
            (lambda: dist.all_gather([torch.empty(2), torch.empty(2, device="meta")], x),
             "output_lists[0][1] is a tensor of shape (2,), torch.float32, on meta; expected a tensor of shape (2,), "
             "torch.float32, on cpu"),
            (lambda: dist.reduce_scatter(torch.empty(2), [x]), "input_lists[0] has 1 item(s); expected 2"),
            (lambda: dist.reduce_scatter(torch.empty(2), [x, x.to("meta")]),
             "input_lists[0][1] is a tensor of shape (2,), torch.float32, on meta"),   # gloo: one rank "unsupported device type", the other a copy error
            (lambda: dist.reduce_scatter(torch.empty(2), [x, torch.ones(3)]),
             "input_lists[0][1] is a tensor of shape (3,)"),
            (lambda: dist.group.WORLD.allgather_into_tensor_coalesced([torch.empty(4)], [x, x]),
             "outputs has 1 item(s); expected 2 (one per input)"),
            (lambda: dist.group.WORLD.reduce_scatter_tensor_coalesced([torch.empty(1)], [x, x],
                                                                       dist.ReduceScatterOptions()),
             "outputs has 1 item(s); expected 2 (one per input)"),
            (lambda: dist.group.WORLD.allreduce_coalesced([x, x.int()], dist.AllreduceCoalescedOptions()), "one dtype"),
            (lambda: dist.group.WORLD.broadcast([x], _opts_root_tensor(1)), "root tensor index 1"),
            (lambda: dist.all_to_all_single(torch.empty(4)[::2], x), "must be contiguous")):
        try:
            call()
        except InvalidCall as e:
            assert f"rank {rank}: " in str(e) and words in str(e), (words, str(e))
        else:
            raise AssertionError(f"no InvalidCall ({words})")
    t = x.clone()
    dist.all_reduce(t)
    assert torch.equal(t, torch.ones(2))


def _opts_root_tensor(index: int) -> dist.BroadcastOptions:
    o = dist.BroadcastOptions()
    o.rootRank, o.rootTensor = 0, index
    return o


def _bcast(root: int, async_op: bool) -> dist.BroadcastOptions:
    o = dist.BroadcastOptions()
    o.rootRank = root
    o.rootTensor = 0
    o.asyncOp = async_op
    return o


class _raises:
    """``pytest.raises`` for the spawned ranks (no pytest machinery needed there)."""

    def __init__(self, kind: type) -> None:
        self.kind = kind

    def __enter__(self) -> None:
        return None

    def __exit__(self, et, e, tb) -> bool:
        if et is None:
            raise AssertionError(f"{self.kind.__name__} not raised")
        return issubclass(et, self.kind)


def _check_p2p(rank: int) -> None:
    """send/recv in both orders, then batch_isend_irecv (a ring: every rank sends before it
    receives, which deadlocks if a send waits for its receiver), isend/irecv Works."""
    n = WORLD
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    for size in (8, 1 << 16):   # small (buffered by gloo) and large
        got = torch.empty(size)
        ops = [dist.P2POp(dist.isend, _x(rank, size) + 1000, nxt), dist.P2POp(dist.irecv, got, prv)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        assert torch.equal(got, _x(prv, size) + 1000), size
        got = torch.empty(size)
        ws = [dist.isend(_x(rank, size), nxt), dist.irecv(got, prv)]
        for w in ws:
            w.wait()
        assert torch.equal(got, _x(prv, size)), size


def _check_subgroup(rank: int) -> None:
    """A default gloo group, then ``dist.new_group(backend="mscclang")``: calls on the new group
    run on its Communicator; the default group is untouched."""
    import mscclang.distributed as md

    sub = dist.new_group(backend="mscclang")
    assert isinstance(sub, md.MscclangProcessGroup) and not isinstance(dist.group.WORLD, md.MscclangProcessGroup)
    t = _x(rank)
    dist.all_reduce(t, group=sub)
    assert torch.equal(t, sum(_x(r) for r in range(WORLD)))
    out = torch.empty(8 * WORLD)
    dist.all_gather_into_tensor(out, _x(rank), group=sub)
    assert torch.equal(out, torch.cat([_x(r) for r in range(WORLD)]))
    t = _x(rank)
    dist.all_reduce(t)   # the default gloo group
    assert torch.equal(t, sum(_x(r) for r in range(WORLD)))
    dist.destroy_process_group(sub)


CHECKS: dict[str, Callable[[int], None]] = {"ops": _check_ops, "fallback": _check_fallback,
                                            "work": _check_work, "errors": _check_errors, "p2p": _check_p2p,
                                            "lists": _check_lists,
                                            "subgroup": _check_subgroup}


def _worker(rank: int, init_file: str, backend: str, checks: list, q) -> None:
    try:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        import mscclang.distributed  # noqa: F401 - registers the backend

        logging.basicConfig(level=logging.WARNING)
        store = dist.FileStore(init_file, WORLD)
        dist.init_process_group(backend, store=store, rank=rank, world_size=WORLD)
        for name in checks:
            CHECKS[name](rank)
        pg = dist.group.WORLD
        comm = getattr(pg, "communicator", None)
        dist.destroy_process_group()
        if comm is not None:
            assert pg._comm is None and pg._inner == {} and comm.backend is None
            from mscclang.errors import CommError

            for call in (lambda: pg.allreduce([torch.ones(2)]),
                         lambda: pg.allreduce([torch.ones(2, dtype=torch.float64)])):
                with _raises(CommError):   # the Communicator's path and the inner group's alike
                    call()
            assert pg._inner == {}
        q.put((rank, "ok"))
    except BaseException:  # noqa: BLE001 - reported to the test
        q.put((rank, traceback.format_exc()))


def _spawn(tmp_path: Path, backend: str, checks: list, timeout: float = 180) -> None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = str(tmp_path / "store")
    procs = [ctx.Process(target=_worker, args=(r, init, backend, checks, q)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(WORLD):
            r, res = q.get(timeout=timeout)
            results[r] = res
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(5)
    assert results == {r: "ok" for r in range(WORLD)}, "\n".join(str(v) for v in results.values())


def test_mapped_ops(tmp_path):
    """Every mapped torch.distributed call gives the locally computed result."""
    _spawn(tmp_path, "mscclang", ["ops"])


def test_device_map_spelling(tmp_path):
    """``"cpu:mscclang"`` (a device map) builds the same group."""
    _spawn(tmp_path, "cpu:mscclang", ["ops"])


def test_device_map_with_gloo_for_cpu(tmp_path):
    """``"cuda:mscclang,cpu:gloo"``: the group is mscclang's (torch keeps the first Python group of
    a device map); CPU tensors go to gloo through its inner group whenever the Communicator runs
    on CUDA, and on a machine without CUDA the Communicator's own fallback is gloo."""
    _spawn(tmp_path, "cuda:mscclang,cpu:gloo", ["ops"])


def test_new_group_with_the_backend_inside_a_gloo_default_group(tmp_path):
    _spawn(tmp_path, "gloo", ["subgroup"])


def test_inner_group(tmp_path):
    """reduce, float64, PRODUCT, uneven all_to_all, gather and scatter run on the inner gloo
    group, made at the first such call; it is the Communicator's fallback group (one torch group
    per device type)."""
    _spawn(tmp_path, "mscclang", ["fallback"])


def test_work_and_errors(tmp_path):
    """``async_op=True`` returns a completed Work whose future holds the outputs; a bad call
    raises from the call (sync) or from ``wait()`` (async) and the group keeps working; bad list
    arguments raise InvalidCall naming them (the class: tests/test_distributed_fuzz.py)."""
    _spawn(tmp_path, "mscclang", ["work", "errors", "lists"])


def test_point_to_point(tmp_path):
    """Seen on a GPU: batch_isend_irecv on the backend hung. Every rank posts its send before its
    receive, so a send must not wait for its receiver; large messages too."""
    _spawn(tmp_path, "mscclang", ["p2p"], timeout=90)


def test_import_registers_once():
    import mscclang.distributed as md

    md.register()
    md.register()
    assert md.BACKEND_NAME in dist.Backend.backend_list
    assert dist.Backend.backend_list.count(md.BACKEND_NAME) == 1


def test_ddp_example_under_torchrun():
    """examples/ddp_mscclang.py: 50 DDP steps on mscclang, then on gloo, bit-identical; on a CPU
    no mscclang plan runs (every call falls back to gloo), and the script says so."""
    p = torchrun_cpu(ROOT / "examples" / "ddp_mscclang.py")
    assert p.returncode == 0, p.stdout + p.stderr
    for r in (0, 1):
        assert (f"ddp_mscclang: rank {r}: 50 steps on mscclang and on gloo: parameters bit-identical "
                "(fallback: no mscclang plan ran)") in p.stdout   # the ranks' lines may interleave


def test_torch_callers_under_torchrun(tmp_path):
    """tools/backend_checks.py on the CPU: every mapped op and what torch builds on them (DDP,
    FSDP2 with uneven shards, a DeviceMesh with tensor-parallel layers, torch.compile of a
    functional all_reduce with the eager and inductor backends), each checked. Found by it:
    functional collectives (hence FSDP2, DTensor, torch.compile) failed with "ProcessGroup name not
    set": torch reads a group's name from its first C++ backend, which this group has none of."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = tmp_path / "checks.json"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-port", str(free_port()), str(ROOT / "tools" / "backend_checks.py"),
                        "--out", str(out)], env=env, capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    import json

    res = json.loads(out.read_text())
    want = {"all_reduce", "gathers", "broadcast_barrier", "point_to_point", "async_ops", "inner_group", "ddp",
            "fsdp2", "tensor_parallel", "compiled"}
    assert set(res["checks"]) == want and all(v == "ok" for v in res["checks"].values()), res["checks"]


def test_the_default_group_can_be_destroyed_and_made_again_under_torchrun(tmp_path):
    """Three rounds of init_process_group("mscclang"), collectives, destroy_process_group in one
    process (session 7 saw a hang of the second round, on one rank about half the time)."""
    script = tmp_path / "reinit.py"
    script.write_text(
        "import os, torch, torch.distributed as dist\n"
        "import mscclang.distributed  # noqa: F401\n"
        "for k in range(3):\n"
        "    dist.init_process_group('mscclang')\n"
        "    t = torch.ones(8); dist.all_reduce(t); assert t[0] == 2\n"
        "    b = torch.full((4,), float(dist.get_rank())); dist.broadcast(b, src=1); assert b[0] == 1\n"
        "    dist.destroy_process_group()\n"
        f"open(os.path.join({str(tmp_path)!r}, 'ok' + os.environ['RANK']), 'w').close()\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    for _ in range(2):
        for r in (0, 1):
            (tmp_path / f"ok{r}").unlink(missing_ok=True)
        p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                            "--master-port", str(free_port()), str(script)],
                           env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        assert (tmp_path / "ok0").exists() and (tmp_path / "ok1").exists()


def _torchrun(script, *args, timeout=180):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), str(script), *args],
                          env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_a_failed_collective_under_ddp_raises_instead_of_crashing(tmp_path):
    """An error of the Communicator inside DDP's backward (a planted CollectiveTimeout on every
    rank at step 3) killed both processes with SIGSEGV: the asynchronous Work handed DDP's
    reducer a failed future, which a Python process group cannot do safely. It must raise."""
    script = tmp_path / "ddp_error.py"
    script.write_text(
        "import os, torch, torch.distributed as dist\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "import mscclang.distributed  # noqa: F401\n"
        "from mscclang.errors import CollectiveTimeout\n"
        "dist.init_process_group('mscclang')\n"
        "model = DDP(torch.nn.Linear(16, 4))\n"
        "comm = dist.group.WORLD.communicator\n"
        "for step in range(6):\n"
        "    if step == 3:\n"
        "        def planted(*a, **k):\n"
        "            raise CollectiveTimeout('planted')\n"
        "        comm.all_reduce = planted\n"
        "    try:\n"
        "        model(torch.randn(4, 16)).sum().backward()\n"
        "    except CollectiveTimeout as e:\n"
        f"        open(os.path.join({str(tmp_path)!r}, 'raised' + os.environ['RANK']), 'w').write(str(step))\n"
        "        break\n"
        "os._exit(0)\n")
    p = _torchrun(script)
    assert "SIGSEGV" not in p.stderr and p.returncode == 0, p.stderr[-3000:]
    assert [(tmp_path / f"raised{r}").read_text() for r in (0, 1)] == ["3", "3"]


def test_a_rank_dying_mid_training_ends_in_an_error_on_the_survivor(tmp_path):
    """tools/backend_dead_peer.py: rank 1 leaves at step 5 of a DDP training; rank 0 gets an
    error within the group's timeout (here gloo's, the CPU having no GPU runtime), and
    destroy_process_group() returns (before the fix above: SIGSEGV on the survivor)."""
    out = tmp_path / "dead.json"
    p = _torchrun(ROOT / "tools" / "backend_dead_peer.py", "--out", str(out), "--timeout", "10")
    assert out.exists(), p.stdout[-2000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["raised"] is not None and res["step"] == 5 and res["seconds"] < 10 + 15, res
    assert res["destroyed"] is True
