"""Pictures of execution plans: :func:`draw_plan` renders a plan as a PNG timeline.

Per rank a horizontal band, per thread block a row; each op is a box (coloured by op family,
labelled with its name and short chunk references) placed at its *earliest step*: the layout is
an as-soon-as-possible schedule of the plan's happens-before graph, so every op sits to the right
of the ops it waits for and the arrows between blocks point forward in time. Edges:

* ``signal`` -> ``wait`` (solid red; relaxed pairs dashed orange): the k-th signal into a channel
  end is paired with the k-th wait on it. Channels are paired as in ``docs/semantics.md``: on rank
  A the j-th memory channel to B is bound to the j-th memory channel to A on rank B (port channels
  likewise, numbered separately). ``pws``/``pwsf`` signal too.
* packets (blue): an op that writes LL packets into a scratch slot (``ppkt``, ``cpkt``,
  ``rppkt``, ``respkt``, ``recpkt``, ``recspkt``, ``gstorepkt``) -> every op that reads packets
  from an overlapping slot of that rank (``upkt``, ``rppkt``, the packet reductions).
* semaphores (purple): the k-th ``sem_release`` -> the (k + initial value)-th ``sem_acquire``.
* data (green): an op that writes chunks plainly (``put`` into a peer's buffer, ``copy``, the
  result of a reduction...) -> the first op of each other thread block that reads those chunks
  next in the timeline (before they are written again).
* barriers: a black vertical bar through the blocks that meet; a dotted bracket groups the inner
  ops of a pipeline (labelled ``i.j``: op j of pipeline op i).

A long timeline wraps like text into rows (panels) of bounded width, and rows that do not fit a
page go to further PNG files (``NAME-2.png``...). Every page carries the legend and a key of the box
labels (with the names of the ops it shows).

Chunk references read ``i0:2`` (input chunks 0 and 1), ``s4@r1`` (scratch chunk 4 of rank 1),
``o0:2@sw0`` (through switch channel 0). A plan whose graph has a cycle (it deadlocks) is drawn
with ops at their op index instead, and the title says so.

The module needs matplotlib (the ``plot`` extra); it draws on an Agg canvas of its own and leaves
pyplot's backend and figures alone.
"""

from mscclang.viz.draw import draw_plan
from mscclang.viz.graph import (EDGE_STYLES, FAMILY_COLORS, LABEL_LIMIT, Edge, OpNode, PlanGraph, PlanPicture,
                                build_graph, op_family)
from mscclang.viz.labels import LABEL_KEY, OP_GLOSSARY

__all__ = ["Edge", "OpNode", "PlanGraph", "PlanPicture", "build_graph", "draw_plan", "op_family",
           "FAMILY_COLORS", "EDGE_STYLES", "LABEL_LIMIT", "LABEL_KEY", "OP_GLOSSARY"]
