"""Prebuilt cubins (``MSCCLANG_CUBIN_DIR``): a directory built from other sources is never used,
and says so (a GPU test session once spent its time limit in NVRTC builds behind a stale one)."""

from __future__ import annotations

import logging

from mscclang.runtime import build


def test_stale_prebuilt_directory_is_named_in_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MSCCLANG_CUBIN_DIR", str(tmp_path))
    stale = tmp_path / "mscclang_i32_sm_90_0123456789abcdef.cubin"
    stale.write_bytes(b"x")
    with caplog.at_level(logging.WARNING, logger="mscclang.runtime"):
        assert build.find_prebuilt("i32", "sm_90") is None
    msg = " ".join(r.getMessage() for r in caplog.records)
    assert build.prebuilt_name("i32", "sm_90") in msg and stale.name in msg and "build-kernel" in msg
    good = tmp_path / build.prebuilt_name("i32", "sm_90")
    good.write_bytes(b"y")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mscclang.runtime"):
        assert build.find_prebuilt("i32", "sm_90") == good
    assert not caplog.records


def test_no_prebuilt_directory_is_silent(monkeypatch, caplog):
    monkeypatch.delenv("MSCCLANG_CUBIN_DIR", raising=False)
    with caplog.at_level(logging.WARNING, logger="mscclang.runtime"):
        assert build.find_prebuilt("f16", "sm_90") is None
    assert not caplog.records


def test_traced_modules_have_prebuilt_names_of_their_own(tmp_path, monkeypatch, caplog):
    """``build-kernel --traced`` copies the traced modules beside the others, under names of
    their own (their sources differ); a folder without them is silent, one with them is used."""
    monkeypatch.setenv("MSCCLANG_CUBIN_DIR", str(tmp_path))
    name = build.prebuilt_name("bf16", "sm_90", traced=True)
    assert name.startswith("mscclang_bf16_trace_sm_90_") and name != build.prebuilt_name("bf16", "sm_90")
    (tmp_path / build.prebuilt_name("bf16", "sm_90")).write_bytes(b"u")
    with caplog.at_level(logging.WARNING, logger="mscclang.runtime"):
        assert build.find_prebuilt("bf16", "sm_90", traced=True) is None
    assert not caplog.records
    (tmp_path / name).write_bytes(b"t")
    assert build.find_prebuilt("bf16", "sm_90", traced=True) == tmp_path / name
    assert build.find_prebuilt("bf16", "sm_90") == tmp_path / build.prebuilt_name("bf16", "sm_90")
