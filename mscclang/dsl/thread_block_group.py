"""``ThreadBlockGroup``: several thread blocks that share one data op."""

from __future__ import annotations

from typing import Sequence

from mscclang.errors import DSLError

__all__ = ["ThreadBlockGroup"]


class ThreadBlockGroup:
    """A group of thread blocks of one rank. A data op given ``tb_group=`` is recorded on every
    member with ``tbg_info = (position in the group, group size)``; at run time member ``i`` moves
    the ``i``-th near-equal slice of the op's bytes."""

    def __init__(self, tb_list: Sequence[int]):
        self.tb_list: list[int] = list(tb_list)
        if not self.tb_list:
            raise DSLError("ThreadBlockGroup([]): a thread block group needs at least one thread block")
        self._pos: dict[int, int] = {}
        for i, tb in enumerate(self.tb_list):
            if not isinstance(tb, int) or isinstance(tb, bool) or tb < 0:
                raise DSLError(f"ThreadBlockGroup({self.tb_list}): thread block id {tb!r} is not a non-negative int")
            if tb in self._pos:
                raise DSLError(f"ThreadBlockGroup({self.tb_list}): thread block {tb} is listed twice")
            self._pos[tb] = i

    def get_internal_id(self, tb: int) -> int:
        """Position of ``tb`` in the group."""
        if tb not in self._pos:
            raise DSLError(f"thread block {tb} is not in ThreadBlockGroup({self.tb_list})")
        return self._pos[tb]

    def numtb(self) -> int:
        """Number of thread blocks in the group."""
        return len(self.tb_list)

    def __len__(self) -> int:
        return len(self.tb_list)

    def __repr__(self) -> str:
        return f"ThreadBlockGroup({self.tb_list})"
