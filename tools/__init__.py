"""Developer tools that do not ship in the wheel: the plan fuzzer (``fuzz``), the verifier's
mutation sweep (``mutation``) and the GPU measurements behind notes/ (``port_bench``,
``reliability``, ``faults``). Run them from the repository root as ``python3 -m tools.NAME``
(the root must be on ``sys.path``: they use ``tests.harness`` and start GPU workers that import it)."""
