"""``mscclang bench``: collectives x sizes x {mscclang on symmetric tensors, mscclang on ordinary
tensors, NCCL, torch SymmetricMemory two-shot}, eager and CUDA graph, one process per GPU; JSON, a
markdown table and a PNG plot. ``--first-calls``: the first and second call of new sizes;
``--host``: host time per queued call (:mod:`mscclang.bench.host`)."""

from mscclang.bench.report import markdown, plot, render
from mscclang.bench.results import BenchResult, Record, load_result, save_result
from mscclang.bench.sizes import DEFAULT_SIZES, QUICK_SIZES, format_size, parse_size, parse_sizes
from mscclang.bench.targets import check_targets

__all__ = ["BenchResult", "DEFAULT_SIZES", "QUICK_SIZES", "Record", "check_targets", "format_size",
           "load_result", "markdown", "parse_size", "parse_sizes", "plot", "render", "save_result"]
