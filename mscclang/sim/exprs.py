"""Reduction expressions: what the symbolic run knows about each value, to prove that every rank
holds the same bits (docs/semantics.md, "Rank consistency").

The symbolic shadow of a simulation (:mod:`mscclang.sim.state`) keeps, next to the counts of
which input chunks reached a granule, one *expression id* per granule: an interned tree of how
the value was computed. Leaves are rank ``p``'s input chunk ``k`` and residual chunk ``k`` (the
residual is the same on every rank, as tensor parallelism has it); a node is one reduction op
over its sources in their reduction order (rounded once per op for fp8, once per binary step
for the other dtypes), or a norm of a residual value. Copies, packets and puts move ids, not
nodes. Two values are the same bits when their trees are equal up to what IEEE arithmetic
guarantees:

* the first binary step of a reduction commutes (``a + b == b + a``), so a node's first two
  sources are kept in a canonical order;
* (``flat`` only) a reduction whose first source is another reduction's result continues that
  reduction when every step rounds to the stored dtype (fp16, bf16, fp32, integers): nested
  left-first reductions are spliced into one. fp8 rounds once per op, so there the op
  boundaries count (the ``strict`` tree).

Integer sums wrap exactly and min/max are exact, so only floating-point sums depend on the
order; the check reports the dtypes concerned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

#: the id of a granule nothing has written (zeroed or poisoned memory)
EMPTY = 0


@dataclass(frozen=True)
class Node:
    """One interned value. ``kind``: ``"x"`` (``args`` = (rank, input chunk)), ``"res"``
    ((residual chunk,)), ``"red"`` (the source ids in reduction order), ``"norm"`` ((residual
    id, quantised)) or ``"flat"`` (a spliced reduction, only in :meth:`ExprTable.flat`)."""

    kind: str
    args: tuple


class ExprTable:
    """The interned expressions of one simulation; ids are indexes (0 is :data:`EMPTY`). Ranks
    that compute the same tree share its id; ``op_of`` keeps, per reduction id and per rank that
    computed it, the op that did so first there (its description), ``cause_of`` likewise its
    name and DSL line, so that a report names each rank's own ops (:meth:`ops_in`)."""

    def __init__(self) -> None:
        self.nodes: list[Optional[Node]] = [None]
        self.ids: dict[Node, int] = {}
        self.op_of: dict[int, dict[int, str]] = {}
        #: per reduction id and rank, what identifies its op across thread blocks (name and DSL line)
        self.cause_of: dict[int, dict[int, tuple]] = {}
        self._flat: dict[int, int] = {}
        #: per reduction id and rank, its sources in the order its first op there wrote them
        self.written: dict[int, dict[int, tuple]] = {}

    def intern(self, node: Node, op: Optional[str] = None, cause: tuple = (), rank: int = -1) -> int:
        """The id of ``node`` (a new one the first time); ``op`` on ``rank`` computed it."""
        got = self.ids.get(node)
        if got is None:
            got = self.ids[node] = len(self.nodes)
            self.nodes.append(node)
        if op is not None:
            self.op_of.setdefault(got, {}).setdefault(rank, op)
            self.cause_of.setdefault(got, {}).setdefault(rank, cause or (op,))
        return got

    def leaf(self, kind: str, *args: int) -> int:
        return self.intern(Node(kind, tuple(args)))

    def reduce(self, sources: Sequence[np.ndarray], op: str, cause: tuple = (), rank: int = -1) -> np.ndarray:
        """The ids of reducing ``sources`` (one id array per source, in reduction order) granule
        by granule; ``op`` describes the reducing op (on ``rank``), ``cause`` what is common to
        its copies on other thread blocks (its name and DSL line)."""
        stack = np.stack(sources, axis=1)
        combos, inverse = np.unique(stack, axis=0, return_inverse=True)
        out = np.empty(combos.shape[0], dtype=np.int32)
        for i, row in enumerate(combos.tolist()):
            written = tuple(row)
            if len(row) >= 2 and row[1] < row[0]:
                row[0], row[1] = row[1], row[0]   # the first step commutes
            out[i] = self.intern(Node("red", tuple(row)), op, cause, rank)
            self.written.setdefault(int(out[i]), {}).setdefault(rank, written)
        return out[inverse.reshape(-1)]

    def norm(self, ids: np.ndarray, quant: bool) -> np.ndarray:
        """The ids of normalising residual values ``ids`` (one granule each)."""
        combos, inverse = np.unique(ids, return_inverse=True)
        out = np.array([self.intern(Node("norm", (int(c), quant))) for c in combos.tolist()], dtype=np.int32)
        return out[inverse.reshape(-1)]

    # comparing ---------------------------------------------------------------------------------
    def flat(self, i: int) -> int:
        """The canonical id of ``i`` when every binary step rounds to the stored dtype: nested
        reductions met as a first source are spliced (see the module docstring). Iterative: a
        chain of thousands of ops is no deeper for it."""
        todo = [i]
        while todo:
            j = todo[-1]
            if j in self._flat:
                todo.pop()
                continue
            node = self.nodes[j]
            kids = () if node is None else (node.args if node.kind == "red" else
                                            (node.args[0],) if node.kind == "norm" else ())
            missing = [k for k in kids if k not in self._flat]
            if missing:
                todo.extend(missing)
                continue
            todo.pop()
            self._flat[j] = self._flat_of(j)
        return self._flat[i]

    def _flat_of(self, j: int) -> int:
        """:meth:`flat` of ``j`` once its sources' are known."""
        node = self.nodes[j]
        if node is None or node.kind not in ("red", "norm"):
            return j
        if node.kind == "norm":
            return self.intern(Node("norm", (self._flat[node.args[0]], node.args[1])))
        if len(node.args) == 1:
            return self._flat[node.args[0]]
        kids = [self._flat[k] for k in node.args]
        cands = []
        for first, second in ((kids[0], kids[1]), (kids[1], kids[0])):
            fn = self.nodes[first]
            head = list(fn.args) if fn is not None and fn.kind == "flat" else [first]
            cands.append(tuple(head + [second] + kids[2:]))
        return self.intern(Node("flat", min(cands)))

    def render(self, i: int, rank: int = -1, depth: int = 0) -> str:
        """A readable form of ``i`` as held by ``rank`` (each reduction in the order it was
        written there, see :meth:`ops_in`): ``x2[0]`` is rank 2's input chunk 0, ``res[0]``
        residual chunk 0, a reduction ``a + b + c`` combines left to right, ``(...)`` is one
        rounded by another op."""
        node = self.nodes[i] if 0 <= i < len(self.nodes) else None
        if node is None:
            return "(nothing)"
        if node.kind == "x":
            return f"x{node.args[0]}[{node.args[1]}]"
        if node.kind == "res":
            return f"res[{node.args[0]}]"
        if node.kind == "norm":
            return f"norm({self.render(node.args[0], rank, depth + 1)})"
        if depth > 6:
            return "(...)"
        body = " + ".join(self.render(k, rank, depth + 1) for k in self.by_rank(self.written, i, rank) or node.args)
        return f"({body})" if depth else body

    def by_rank(self, table: dict[int, dict], i: int, rank: int) -> Any:
        """``table``'s (:attr:`op_of`, :attr:`cause_of`, :attr:`written`) entry of id ``i`` on
        ``rank`` when that rank computed it, else on the rank that computed it first (a value it
        received); None for no reduction."""
        got = table.get(i)
        return None if not got else got.get(rank, next(iter(got.values())))

    def ops_in(self, i: int, rank: int = -1) -> list[str]:
        """The ops that computed the reductions of ``i`` as held by ``rank``, outermost first,
        each once: a reduction ``rank`` computed itself names its op there, one it received the
        op of the rank that computed it first."""
        seen: list[str] = []
        todo = [i]
        while todo:
            j = todo.pop(0)
            node = self.nodes[j] if 0 <= j < len(self.nodes) else None
            if node is None or node.kind not in ("red", "norm"):
                continue
            op = self.by_rank(self.op_of, j, rank)
            if op is not None and op not in seen:
                seen.append(op)
            todo.extend(node.args if node.kind == "red" else [node.args[0]])
        return seen
