"""Cooperative tasks of a simulation: what a task waits for (:class:`Wait`), the inbound counter
of a channel end (:class:`ChannelEnd`), and a task (:class:`Task`: a thread block of one launch
on one rank, or a port channel's proxy).

A block task is a generator. It yields ``None`` after each op (a scheduling point) and a
:class:`Wait` when it cannot go on; a waiting task is woken when the state it waits on (a
channel counter, a rank's packets, a barrier, a semaphore, a proxy) changes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Optional

import numpy as np

from mscclang.sim.program import COp
from mscclang.sim.races import Actor, OpRef

if TYPE_CHECKING:
    from mscclang.sim.ports import Proxy


class Wait:
    """Why a task cannot go on: ``key`` (what wakes it) and a description for reports."""

    __slots__ = ("key", "what", "info")

    def __init__(self, key: tuple, what: str, info: tuple) -> None:
        self.key = key
        self.what = what
        self.info = info


class ChannelEnd:
    """The inbound counter of one channel end and what each signal published; the first op that
    signalled it and the first that waited on it (what an ``unbalanced-channel`` finding names)."""

    __slots__ = ("counter", "expected", "clocks", "label", "first_signal", "first_wait")

    def __init__(self, label: str) -> None:
        self.counter = 0
        self.expected = 0
        self.clocks: list[tuple[np.ndarray, np.ndarray]] = []  # prefix joins (vc, rvc)
        self.label = label
        self.first_signal: Optional[OpRef] = None
        self.first_wait: Optional[OpRef] = None


class Task:
    __slots__ = ("rank", "tb", "launch", "actor", "gen", "cops", "pos", "cur", "wait", "done",
                 "proxy", "woken")

    def __init__(self, rank: int, tb: int, launch: int, actor: Actor, cops: list[COp]) -> None:
        self.rank = rank
        self.tb = tb
        self.launch = launch
        self.actor = actor
        self.cops = cops
        self.pos = 0
        self.cur: Optional[COp] = None
        self.wait: Optional[Wait] = None
        self.done = False
        self.proxy: Optional["Proxy"] = None
        self.gen: Optional[Iterator] = None
        self.woken = False

    def where(self) -> str:
        if self.proxy is not None:
            return f"rank {self.rank} port proxy {self.proxy.channel}"
        if self.cur is None:
            return f"rank {self.rank} tb {self.tb}"
        return f"rank {self.rank} tb {self.tb} op {self.cur.index} {self.cur.name}"
