"""Block shapes and padding math of the communicator's tail handling."""

import pytest

from mscclang.comm.errors import CommError
from mscclang.errors import InvalidCall
from mscclang.comm.padding import needs_padding, padded_block_elems
from mscclang.plan.collectives import collective


def block_shape(coll, n, i, o):
    return collective(coll).shape(n, i, o)


def message_bytes(coll, i, o):
    return collective(coll).message_bytes(i, o)


@pytest.mark.parametrize("coll,n,i,o,expect", [
    ("allreduce", 2, 7, 7, (1, 1, 7)),
    ("all_gather", 4, 3, 12, (1, 4, 3)),
    ("reduce_scatter", 4, 12, 3, (4, 1, 3)),
    ("alltoall", 2, 10, 10, (2, 2, 5)),
    ("broadcast", 8, 5, 5, (1, 1, 5)),
])
def test_block_shape(coll, n, i, o, expect):
    s = block_shape(coll, n, i, o)
    assert (s.in_blocks, s.out_blocks, s.block_elems) == expect
    assert s.in_elems == i and s.out_elems == o


@pytest.mark.parametrize("coll,n,i,o,msg", [
    ("allgather", 2, 3, 7, "output of 2 x 3"),
    ("reducescatter", 2, 7, 3, "input of 2 x 3"),
    ("alltoall", 2, 7, 7, "divisible by the world size 2"),
    ("alltoall", 2, 8, 6, "equal input and output"),
    ("allreduce", 2, 8, 6, "equal input and output"),
])
def test_block_shape_rejects(coll, n, i, o, msg):
    with pytest.raises(InvalidCall, match=msg):
        block_shape(coll, n, i, o)


@pytest.mark.parametrize("elems,esz,granule", [(k, e, g) for k in (0, 1, 2, 3, 7, 8, 9, 1000, 1001)
                                              for e in (2, 4) for g in (1, 2, 4, 8, 16, 32)])
def test_padded_block_elems_is_the_smallest_multiple(elems, esz, granule):
    kp = padded_block_elems(elems, esz, granule)
    assert kp >= elems
    if elems == 0:
        assert kp == 0
        return
    assert (kp * esz) % granule == 0
    # nothing smaller works
    for k in range(elems, kp):
        assert (k * esz) % granule != 0
    assert needs_padding(block_shape("allreduce", 2, elems, elems), esz, granule) == (kp != elems)


def test_padded_rejects_nonpositive_granule():
    with pytest.raises(CommError):
        padded_block_elems(3, 2, 0)


def test_message_bytes_convention():
    assert message_bytes("allgather", 10, 40) == 40
    assert message_bytes("reduce_scatter", 40, 10) == 40
    assert message_bytes("all_reduce", 40, 40) == 40
