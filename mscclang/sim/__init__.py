"""mscclang.sim: the CPU simulator and verifier, the executable definition of what a plan means.

* :func:`run` executes a plan for all ranks on numpy inputs and returns the outputs;
* :func:`verify` runs it under many schedules, sizes, dtypes, reduce ops and packet types and
  returns a :class:`Report` of deadlocks, races, unsynchronised signals, unbalanced channels and
  semaphores, and wrong outputs (numeric and symbolic).
"""

from mscclang.sim.engine import SCHEDULES, Simulation
from mscclang.sim.program import sim_program
from mscclang.sim.report import Deadlock, Problem, Report
from mscclang.sim.runner import VerifyOptions, run
from mscclang.sim.verify import default_launches, default_sizes, verify

__all__ = ["Deadlock", "Problem", "Report", "SCHEDULES", "Simulation", "VerifyOptions", "sim_program",
           "default_launches", "default_sizes", "run", "verify"]
