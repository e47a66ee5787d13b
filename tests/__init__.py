"""The test suite (a package, so the shared helpers import as ``tests.harness``)."""
