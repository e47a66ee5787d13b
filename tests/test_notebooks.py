"""The notebooks under notebooks/ run top to bottom on the CPU (nbclient, a real Jupyter kernel of
this Python) and their outputs say what they should: the verifier passes the authored plan and
diagnoses the broken one as a race, the picture is drawn, and without GPUs the GPU notebook says it
skips and shows the simulator's result."""

from __future__ import annotations

import base64
import os
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

from mscclang.plan import load_plan  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"


def execute(name: str, out_dir: Path, monkeypatch: pytest.MonkeyPatch, gpus: bool = False,
            own_folder: bool = False):
    """Run notebook ``name`` in a fresh kernel; returns it with outputs and a tag -> cell map.
    ``gpus``: leave the machine's GPUs visible (else the CI path: none). ``own_folder``: no
    ``$MSCCLANG_NB_OUT`` (as a user runs it), the system temp folder being ``out_dir``. With
    ``$MSCCLANG_NB_SAVE`` set, the executed notebook is also written into that folder."""
    from jupyter_client.kernelspec import NoSuchKernel

    if own_folder:
        monkeypatch.delenv("MSCCLANG_NB_OUT", raising=False)
        monkeypatch.setenv("TMPDIR", str(out_dir))
    else:
        monkeypatch.setenv("MSCCLANG_NB_OUT", str(out_dir))
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    if not gpus:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # CI path: no GPU, whatever the machine has
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    try:
        client.execute()
    except NoSuchKernel:  # pragma: no cover - depends on the machine
        pytest.fail("no 'python3' Jupyter kernel: run `python3 -m ipykernel install --user`")
    save = os.environ.get("MSCCLANG_NB_SAVE")
    if save:
        Path(save).mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, Path(save) / name)
    tagged = {}
    for cell in nb.cells:
        for tag in cell.get("metadata", {}).get("tags", []):
            tagged[tag] = cell
    return nb, tagged


def text_of(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        assert out["output_type"] != "error", f"cell raised: {out.get('ename')}: {out.get('evalue')}"
        if out["output_type"] == "stream":
            parts.append(out["text"])
        elif "data" in out and "text/plain" in out["data"]:
            parts.append(out["data"]["text/plain"])
    return "".join(parts)


def check_common(nb, tagged) -> None:
    for cell in nb.cells:
        if cell.cell_type == "code":
            text_of(cell)  # no error outputs anywhere
    setup = text_of(tagged["setup"])
    assert f"from {ROOT}" in setup
    kernel_python = setup.split("python ", 1)[1].splitlines()[0].strip()
    assert Path(kernel_python).resolve() == Path(sys.executable).resolve(), (
        "the notebook kernel runs another Python than the tests")


def test_author_verify_notebook(tmp_path, monkeypatch):
    nb, tagged = execute("01_author_verify.ipynb", tmp_path, monkeypatch)
    check_common(nb, tagged)

    compiled = text_of(tagged["compile"])
    assert "plan my_allreduce: allreduce over 4 ranks" in compiled and "rank 0:" in compiled
    plan = load_plan(tmp_path / "my_allreduce.json")
    assert plan.world_size == 4 and plan.collective == "allreduce"

    assert "verify my_allreduce: OK" in text_of(tagged["verify-ok"])
    assert "every output equals the sum of the inputs" in text_of(tagged["sim-run"])

    diagnosis = text_of(tagged["diagnosis"])
    assert "verify my_allreduce: FAILED" in diagnosis
    assert "race: rank" in diagnosis and "no happens-before order" in diagnosis
    first = diagnosis.split("first diagnosis:", 1)[1]
    assert " put " in first and " res " in first and ".scr" in first  # names both ops and the buffer

    draw = tagged["draw"]
    assert "wrote my_allreduce.png" in text_of(draw)
    images = [o["data"]["image/png"] for o in draw["outputs"] if "image/png" in o.get("data", {})]
    assert len(images) == 1
    png = base64.b64decode(images[0])
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert (tmp_path / "my_allreduce.png").read_bytes() == png

    # the loop's second half: predict (no GPU), draw on the predicted times, a GPU run that skips
    predicted = text_of(tagged["predict"])
    assert "predicted" in predicted and "us for 1 MiB on 4 GPUs" in predicted and "waited" in predicted
    import json

    trace = json.loads((tmp_path / "my_allreduce_trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"} == {0, 1, 2, 3}
    assert "critical path of" in text_of(tagged["timed-draw"])
    assert (tmp_path / "my_allreduce_timed.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "skipped: the measured run needs 4 GPUs" in text_of(tagged["gpu-run"])


def test_gpu_vs_nccl_notebook_without_gpus_leaves_nothing_behind(tmp_path, monkeypatch):
    """Run as a user runs it (no MSCCLANG_NB_OUT). Seen: the notebooks left mscclang_notebooks/
    in the system temp folder; their folder is now removed when the kernel exits."""
    nb, tagged = execute("02_gpu_vs_nccl.ipynb", tmp_path, monkeypatch, own_folder=True)
    check_common(nb, tagged)
    assert "SKIP GPU run: 0 CUDA GPU(s) visible" in text_of(tagged["device-check"])
    assert "verify oneshot_ll: OK" in text_of(tagged["verify-ok"])
    sim = text_of(tagged["sim-result"])
    assert "all ranks agree: True" in sim and "matches the fp32 reference" in sim
    assert "SKIP GPU run" in text_of(tagged["gpu-run"])
    assert "SKIP comparison" in text_of(tagged["compare"])
    made = next(c for c in nb.cells if "save_plan(plan, plan_path)" in c.source)
    written = text_of(made).strip()
    assert written.startswith("oneshot_ll: LL, 2 ranks,") and written.endswith("oneshot_ll_2.json"), written
    assert str(tmp_path) in written          # it was written in the temp folder ...
    assert sorted(tmp_path.iterdir()) == []  # ... and nothing is left there


def _cuda_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0


@pytest.mark.gpu
def test_gpu_vs_nccl_notebook_on_gpus(tmp_path, monkeypatch):
    """The GPU branch: with 2+ GPUs the notebook runs the plan with `mscclang run` (checked, CUDA
    graph) and NCCL through `mscclang bench`, and prints the comparison table."""
    n = _cuda_gpus()
    if n < 2:
        pytest.skip("needs at least 2 CUDA GPUs")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    nb, tagged = execute("02_gpu_vs_nccl.ipynb", tmp_path, monkeypatch, gpus=True)
    check_common(nb, tagged)
    assert f"{n} GPUs:" in text_of(tagged["device-check"])
    assert "SKIP" not in text_of(tagged["gpu-run"])
    table = text_of(tagged["compare"])
    assert "SKIP" not in table and "speedup" in table
    rows = [ln.split() for ln in table.splitlines()[1:] if ln.strip()]
    assert {int(r[0]) for r in rows} == {4096, 65536, 1 << 20}, table
    for r in rows:
        assert r[1] != "-" and r[2] != "-" and r[3].endswith("x"), table
