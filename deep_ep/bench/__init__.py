"""Benchmark of deep_ep's dispatch / combine round trips: `python -m deep_ep.bench` (or `deep-ep-bench`).

The command spawns its own ranks (2 by default): GPUs with NCCL when CUDA is available (a gloo group with
CUDA tensors on GPU `rank % num_gpus` when there are more ranks than GPUs), else CPU processes with gloo.
Every rank runs, in lockstep:

  normal mode       get_dispatch_layout, BF16 dispatch, FP8 dispatch (per-128 scales), cached dispatch
                    (BF16 and FP8: what DeepEP's benchmark times as 'dispatch'), combine;
  low-latency mode  low_latency_dispatch (FP8 and BF16), low_latency_combine;

verifies each result once (row counts against the layout, received rows against a plain all-to-all,
combine(dispatch(x)) == x * number of destination ranks, LL combine with identity experts == x * sum of
the valid weights), then times it after warm-up calls, with `torch.cuda.Event` on the current stream (GPU)
or `time.perf_counter` (CPU), medians reported: calls back to back (the headline figure; DeepEP's own
benchmark method, where a call's host work overlaps the previous call on the GPU), and isolated calls, each
after a barrier, which pay all their host time on an idle GPU.
Next to every data-moving operation it times the baseline a user would write without this library: a
permute + `torch.distributed.all_to_all_single` of the same rows (with the count exchange for dispatch)
and back for combine, and reports the ratio of the two times.

Bandwidths follow DeepEP's test scripts (logical bytes, 1 GB = 1e9 bytes, rank 0's figures):
dispatch = received rows x hidden x 2 (x (1 + 4/128) / 2 for FP8), combine = the same BF16 bytes;
low-latency dispatch = per valid top-k selection H + H/128*4 + 16 bytes (FP8) or 2H (BF16), combine 2H.

The table goes to stdout (to stderr with `--json`, which prints one JSON object on stdout); progress
goes to stderr. The exit code is 0 when every check passed, 1 when a check failed or a rank crashed,
2 for bad arguments.
"""
from __future__ import annotations
from .cli import build_parser, main
from .context import VerificationError, calc_diff
from .report import format_kernels, format_table

__all__ = ["VerificationError", "build_parser", "calc_diff", "format_kernels", "format_table", "main"]
