"""Rendering a bench result: the markdown table (time, bus bandwidth, ratio to each peer), the
target verdicts, and a PNG plot of latency and bus bandwidth against size."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Union

from mscclang.bench.results import IMPL_LABELS, ORDINARY, BenchResult, Record
from mscclang.bench.sizes import format_size
from mscclang.bench.targets import Verdict, check_targets

PEERS = ("nccl", "symm", "unfused", "flashinfer")



def facts_lines(meta: dict, keys: tuple = (("dtype", "dtype"), ("torch", "torch"), ("nccl", "NCCL"),
                                          ("date", "date"))) -> list[str]:
    """The run's facts (machine, dtype, versions, date) as a sentence and a blank line, for the
    head of a report; none when the meta holds none."""
    facts = []
    if meta.get("device"):
        facts.append(f"{meta.get('world_size', '?')}x {meta['device']}")
    for key, label in keys:
        if meta.get(key):
            facts.append(f"{label} {meta[key]}")
    return ["; ".join(facts) + ".", ""] if facts else []

def _plan_label(r: Optional[Record]) -> str:
    """The plan that ran, marked when the timed calls ran the interpreter kernel rather than the
    plan-specialised one (the bench's calls did not reach the specialisation policy's count, or
    its build failed): such a time is not the library's fast path."""
    if r is None:
        return "-"
    label = r.plan or "-"
    if r.extra.get("kernel") == "interpreter" and label != "-" and not label.startswith(("nccl", "gloo")):
        label += " [interpreter]"
    return label


def _cell_us(r: Optional[Record]) -> str:
    if r is None:
        return "-"
    if not r.measured:
        return "FAIL" if r.error and not r.error.startswith("skipped") else "skip"
    return f"{r.us:.2f}" if r.us is not None and r.us < 100 else f"{r.us:.1f}"


def _cell_bw(r: Optional[Record]) -> str:
    if r is None or not r.measured or r.busbw is None:
        return "-"
    return f"{r.busbw:.1f}"


def markdown(res: BenchResult, title: str = "mscclang bench") -> str:
    """The whole report as markdown: one table per collective and mode, then the targets."""
    meta = res.meta
    lines = [f"# {title}", ""]
    lines += facts_lines(meta)
    lines += ["Times are medians per call in microseconds; busbw is the bus bandwidth in GB/s "
              "(nccl-tests convention; allgather sizes are output bytes). `xNCCL` / `xsymm` = the "
              "peer's time / mscclang's time (above 1: mscclang is faster); `ordinary` is mscclang on "
              "plain torch.empty tensors (graphs captured inside comm.graph_capture()), `xsym` its "
              "time / mscclang's on symmetric tensors. Every result was "
              "checked against a reference before it was timed; FAIL = wrong result or error, "
              "skip = not run.", ""]
    impls = res.impls()
    peers = [p for p in PEERS if p in impls and p != "mscclang"]
    forced = [i for i in impls if i.startswith("mscclang:")]   # --algos columns
    for coll in res.colls():
        for mode in res.modes():
            recs = [r for r in res.records if r.coll == coll and r.mode == mode]
            if not recs:
                continue
            lines += [f"## {coll} ({mode})", ""]
            head = ["size"]
            if "mscclang" in impls:
                head += ["mscclang us", "busbw", "plan"]
            has_ord = any(r.impl == ORDINARY for r in recs)
            if has_ord:
                head += ["ordinary us", "busbw", "plan"] + (["xsym"] if "mscclang" in impls else [])
            for p in peers:
                if any(r.impl == p for r in recs):
                    head += [f"{IMPL_LABELS.get(p, p)} us", "busbw"]
            ratio_peers = [p for p in peers if any(r.impl == p for r in recs)] if "mscclang" in impls else []
            head += [f"x{'NCCL' if p == 'nccl' else p}" for p in ratio_peers]   # fused case: NCCL + torch norm
            alg = [a for a in forced if any(r.impl == a for r in recs)]
            for a in alg:
                head += [f"{a.partition(':')[2]} us", "busbw", "plan"] + (["xNCCL"] if "nccl" in impls else [])
            lines.append("| " + " | ".join(head) + " |")
            lines.append("|" + "---|" * len(head))
            for nbytes in res.sizes(coll):
                mine = res.find(coll, "mscclang", mode, nbytes)
                row = [format_size(nbytes)]
                if "mscclang" in impls:
                    row += [_cell_us(mine), _cell_bw(mine), _plan_label(mine)]
                if has_ord:
                    od = res.find(coll, ORDINARY, mode, nbytes)
                    row += [_cell_us(od), _cell_bw(od), _plan_label(od)]
                    if "mscclang" in impls:
                        both = od is not None and mine is not None and od.measured and mine.measured and mine.us
                        row.append(f"{od.us / mine.us:.2f}" if both else "-")
                for p in peers:
                    if any(r.impl == p for r in recs):
                        pr = res.find(coll, p, mode, nbytes)
                        row += [_cell_us(pr), _cell_bw(pr)]
                for p in ratio_peers:
                    pr = res.find(coll, p, mode, nbytes)
                    if mine is not None and pr is not None and mine.measured and pr.measured and mine.us:
                        row.append(f"{pr.us / mine.us:.2f}")
                    else:
                        row.append("-")
                for a in alg:
                    ar = res.find(coll, a, mode, nbytes)
                    row += [_cell_us(ar), _cell_bw(ar), _plan_label(ar)]
                    if "nccl" in impls:
                        pr = res.find(coll, "nccl", mode, nbytes)
                        ok = ar is not None and pr is not None and ar.measured and pr.measured and ar.us
                        row.append(f"{pr.us / ar.us:.2f}" if ok else "-")
                lines.append("| " + " | ".join(row) + " |")
            lines.append("")
            errs = [r for r in recs if not r.ok and r.error and not r.error.startswith("skipped")]
            for r in errs[:8]:
                lines.append(f"- {r.impl} {format_size(r.bytes)}: {r.error}")
            if errs:
                lines.append("")
    world = res.meta.get("world_size")
    head = "## Targets (CUDA graph)"
    if world not in (None, 2):
        head = f"## Targets of 2x H200 (CUDA graph; for reference only: this run used {world} GPUs)"
    lines += targets_lines(head, check_targets(res, "graph"))
    return "\n".join(lines)


def targets_lines(head: str, verdicts: list[Verdict], what: str = "collective") -> list[str]:
    """A report's targets section: ``head``, how many of the measured targets were met, and one
    row per verdict (its first column headed ``what``); none without verdicts."""
    if not verdicts:
        return []
    met = sum(v.ok is True for v in verdicts)
    judged = sum(v.ok is not None for v in verdicts)
    return [head, "", f"{met} of {judged} measured targets met.", "",
            f"| {what} | size | goal | measured | verdict |", "|---|---|---|---|---|",
            *(v.row() for v in verdicts), ""]


def write_report(out_dir: Union[str, Path], stem: str, doc: dict, md: str,
                 json_path: Optional[Union[str, Path]] = None) -> dict[str, Path]:
    """Write a measurement's JSON document ``doc`` to ``json_path`` (default
    ``<out_dir>/<stem>.json``) and its markdown to ``<out_dir>/<stem>.md``; their paths."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    paths = {"json": Path(json_path) if json_path else d / f"{stem}.json", "md": d / f"{stem}.md"}
    paths["json"].write_text(json.dumps(doc, indent=1) + "\n")
    paths["md"].write_text(md)
    return paths


_STYLE = {"mscclang": ("tab:red", "o"), ORDINARY: ("tab:orange", "D"), "nccl": ("tab:blue", "s"), "symm": ("tab:green", "^")}


def plot(res: BenchResult, path: Union[str, Path]) -> Path:
    """Latency and bus bandwidth against size, one row per collective; solid lines for CUDA
    graph, dashed for eager. Returns the written path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colls = res.colls()
    fig, axes = plt.subplots(max(1, len(colls)), 2, figsize=(12, 3.6 * max(1, len(colls))), squeeze=False)
    for row, coll in enumerate(colls):
        ax_t, ax_b = axes[row]
        for impl in res.impls():
            color, marker = _STYLE.get(impl, ("tab:gray", "x"))
            for mode in res.modes():
                pts = sorted((r.bytes, r.us, r.busbw) for r in res.records
                             if r.coll == coll and r.impl == impl and r.mode == mode and r.measured)
                if not pts:
                    continue
                xs = [p[0] for p in pts]
                style = "-" if mode == "graph" else "--"
                label = f"{IMPL_LABELS.get(impl, impl)} ({mode})"
                ax_t.plot(xs, [p[1] for p in pts], style, color=color, marker=marker, ms=4, label=label)
                ax_b.plot(xs, [p[2] or 0 for p in pts], style, color=color, marker=marker, ms=4, label=label)
        sizes = res.sizes(coll)
        for ax in (ax_t, ax_b):
            ax.set_xscale("log", base=2)
            ax.set_xticks(sizes)
            ax.set_xticklabels([format_size(s) for s in sizes], rotation=45, fontsize=7)
            ax.grid(True, which="both", alpha=0.3)
        ax_t.set_yscale("log")
        ax_t.set_ylabel("time per call (us)")
        ax_b.set_ylabel("bus bandwidth (GB/s)")
        ax_t.set_title(f"{coll}: latency")
        ax_b.set_title(f"{coll}: bus bandwidth")
        if ax_t.get_legend_handles_labels()[0]:
            ax_t.legend(fontsize=7)
    meta = res.meta
    if meta.get("device"):
        fig.suptitle(f"{meta.get('world_size', '?')}x {meta['device']}, {meta.get('dtype', '')}")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def render(res: BenchResult, out_dir: Union[str, Path], stem: str = "bench") -> dict[str, Path]:
    """Write ``<stem>.json``, ``<stem>.md`` and ``<stem>.png`` into ``out_dir``."""
    from mscclang.bench.results import save_result

    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    paths = {"json": d / f"{stem}.json", "md": d / f"{stem}.md", "png": d / f"{stem}.png"}
    save_result(res, paths["json"])
    paths["md"].write_text(markdown(res) + "\n")
    plot(res, paths["png"])
    return paths
