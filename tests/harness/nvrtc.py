"""Whether NVRTC is usable here, and the marker of tests that compile kernel sources with it (one
home for the check the kernel-build tests share)."""

from __future__ import annotations

import os

import pytest


def nvrtc_ok() -> bool:
    """Whether NVRTC loads and reports its version."""
    from mscclang.runtime import build

    try:
        build.nvrtc_version()
        return True
    except Exception:  # noqa: BLE001 - any failure means no NVRTC here
        return False


#: skip without NVRTC, except in CI, which must compile every kernel variant (there a missing
#: NVRTC is a failure, not a skip)
needs_nvrtc = pytest.mark.skipif(not nvrtc_ok() and not os.environ.get("CI"), reason="NVRTC not available")
