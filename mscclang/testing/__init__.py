"""Test and demo harness shipped with the package (``mscclang run`` and ``mscclang demo`` use it
from the wheel): GPU check commands, sample plans, the CPU simulator backend of the communicator
and a thread-per-rank harness. Nothing here runs on a user's collective call."""
