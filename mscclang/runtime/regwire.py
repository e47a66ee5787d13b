"""The wire format of registration: one fixed-size record per tensor position, exchanged by every
rank through the store (flags, the allocation's id, base and size, the tensor's offset and size,
its existing registration, the 64-byte IPC handle)."""

from __future__ import annotations

import struct
from dataclasses import dataclass

from mscclang.errors import RegistrationError

REC = struct.Struct("<B7xQQQQQq64s")
OK, ABSENT = 1, 2


@dataclass(frozen=True)
class Row:
    """One rank's description of its tensor at one position of an exchange."""

    flags: int
    buffer_id: int
    alloc_base: int
    alloc_size: int
    offset: int
    nbytes: int
    existing: int
    handle: bytes

    @property
    def ok(self) -> bool:
        return bool(self.flags & OK)


def read_rows(data: bytes, n: int, rank: int) -> list[Row]:
    if len(data) < n * REC.size:
        raise RegistrationError(f"rank {rank} sent {len(data)} bytes of registration records, expected "
                                f"{n * REC.size}")
    return [Row(*REC.unpack_from(data, i * REC.size)) for i in range(n)]
