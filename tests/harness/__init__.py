"""Test-only code that does not ship in the wheel: GPU test bodies run on the worker pool by name
(``pool.run("tests.harness.comm_checks:check_collective", ...)``), CPU fakes and hand-built plans
shared by the test modules. The pool's workers import it because spawned processes inherit the
parent's ``sys.path`` (pytest puts the repository root there)."""
