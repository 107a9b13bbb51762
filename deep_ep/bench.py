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

import argparse
import datetime
import json
import os
import queue
import socket
import statistics
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

PREFIX = "[deep_ep.bench]"
FP8_FACTOR = (1 + 4 / 128) / 2  # DeepEP: an FP8 byte plus one float32 scale per 128 values, vs. BF16

# Shapes: DeepSeek-V3 training (normal) and decoding (low-latency) on GPU; small enough for a laptop on CPU.
GPU_DEFAULTS = dict(tokens=4096, hidden=7168, topk=8, experts=256, ll_tokens=128, ll_experts=288, warmup=10,
                    iters=30)
CPU_DEFAULTS = dict(tokens=512, hidden=1024, topk=8, experts=64, ll_tokens=64, ll_experts=64, warmup=3, iters=10)

# (name, label, mode) of every reported operation, in report order.
OPS = [
    ("layout", "get_dispatch_layout", "normal"),
    ("dispatch_bf16", "dispatch BF16", "normal"),
    ("dispatch_fp8", "dispatch FP8", "normal"),
    ("dispatch_cached", "cached dispatch BF16", "normal"),
    ("dispatch_cached_fp8", "cached dispatch FP8", "normal"),
    ("combine", "combine BF16", "normal"),
    ("ll_dispatch_fp8", "LL dispatch FP8", "low-latency"),
    ("ll_dispatch_bf16", "LL dispatch BF16", "low-latency"),
    ("ll_combine", "LL combine BF16", "low-latency"),
    # CUDA-graph replays and hook phases (GPU, with a transport that needs no host wait: NVLink)
    ("ll_dispatch_graph", "LL dispatch FP8 graph", "low-latency"),
    ("ll_combine_graph", "LL combine graph", "low-latency"),
    ("ll_round_trip_graph", "LL disp+comb graph", "low-latency"),
    ("ll_send_phase", "LL dispatch send/hook", "low-latency"),
    ("ll_recv_phase", "LL dispatch hook()", "low-latency"),
    ("ll_dispatch_1_token", "LL 1-token dispatch", "low-latency"),
    ("ll_combine_1_token", "LL 1-token combine", "low-latency"),
]


class VerificationError(AssertionError):
    """A result differs from what the DeepEP contract says (raised on every rank at once)."""


# ------------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------------
def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m deep_ep.bench",
        description="Time and verify deep_ep dispatch/combine round trips (normal and low-latency modes) "
                    "against a plain all_to_all_single baseline. Spawns its own ranks.")
    p.add_argument("--num-ranks", type=_positive, default=2, help="number of rank processes to spawn (default 2)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto (default): CUDA (NCCL) when a GPU is visible, else CPU (gloo)")
    p.add_argument("--mode", choices=("normal", "low-latency", "all"), default="all", help="default all")
    shape = p.add_argument_group("shape (defaults: DeepSeek-V3 on GPU; 512 tokens, hidden 1024, top-8, "
                                 "64 experts, LL 64 tokens / 64 experts on CPU)")
    shape.add_argument("--tokens", type=_positive, default=None, help="tokens per rank (normal mode)")
    shape.add_argument("--hidden", type=_positive, default=None, help="hidden size (multiple of 16)")
    shape.add_argument("--topk", type=_positive, default=None, help="experts per token")
    shape.add_argument("--experts", type=_positive, default=None, help="total experts (normal mode)")
    shape.add_argument("--ll-tokens", type=_positive, default=None,
                       help="tokens per rank = num_max_dispatch_tokens_per_rank (low-latency mode)")
    shape.add_argument("--ll-experts", type=_positive, default=None, help="total experts (low-latency mode)")
    p.add_argument("--transport", default=None, help="Buffer(transport=...); default: the library's choice")
    p.add_argument("--num-sms", type=_positive, default=None,
                   help="Buffer.set_num_sms (even); default: the library's default")
    p.add_argument("--nvl-bytes", type=_positive, default=None,
                   help="num_nvl_bytes of the normal-mode Buffer (default: the larger of the dispatch and combine "
                        "configs' size hints)")
    p.add_argument("--warmup", type=_non_negative, default=None,
                   help="untimed calls per operation (default 10 on GPU, 3 on CPU)")
    p.add_argument("--iters", type=_positive, default=None,
                   help="timed calls per operation (default 30 on GPU, 10 on CPU)")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs (default 0)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before the whole run is abandoned (default 1800)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (configuration, figures, verification) on stdout; "
                        "the table then goes to stderr")
    p.add_argument("--kernels", action="store_true",
                   help="after the table, each operation's kernels and copies with their microseconds per call (GPU)")
    p.add_argument("--plot", metavar="FILE.png", default=None, help="bar chart of the times (needs matplotlib)")
    return p


def _resolve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Dict[str, Any]:
    """Everything the ranks need, as a picklable dict."""
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = args.device
    if device == "auto":
        device = "cuda" if num_gpus > 0 else "cpu"
    if device == "cuda" and num_gpus == 0:
        parser.error("--device cuda: no CUDA device is visible")
    defaults = GPU_DEFAULTS if device == "cuda" else CPU_DEFAULTS
    plan: Dict[str, Any] = {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in defaults.items()}
    num_ranks = args.num_ranks
    backend = "nccl" if device == "cuda" and num_ranks <= num_gpus else "gloo"
    modes = ["normal", "low-latency"] if args.mode == "all" else [args.mode]
    if plan["hidden"] % 16:
        parser.error(f"--hidden must be a multiple of 16 (16-byte FP8 rows), got {plan['hidden']}")
    if "normal" in modes:
        if plan["experts"] % num_ranks:
            parser.error(f"--experts ({plan['experts']}) must be a multiple of --num-ranks ({num_ranks})")
        if plan["topk"] > plan["experts"]:
            parser.error(f"--topk ({plan['topk']}) must be <= --experts ({plan['experts']})")
    if "low-latency" in modes:
        if plan["ll_experts"] % num_ranks:
            parser.error(f"--ll-experts ({plan['ll_experts']}) must be a multiple of --num-ranks ({num_ranks})")
        if plan["topk"] > plan["ll_experts"]:
            parser.error(f"--topk ({plan['topk']}) must be <= --ll-experts ({plan['ll_experts']})")
    if args.num_sms is not None and args.num_sms % 2:
        parser.error(f"--num-sms must be even, got {args.num_sms}")
    plan.update(num_ranks=num_ranks, device=device, backend=backend, num_gpus=num_gpus, modes=modes,
                transport=args.transport, num_sms=args.num_sms, nvl_bytes=args.nvl_bytes, seed=args.seed)
    return plan


# ------------------------------------------------------------------------------------------------------
# Per-rank helpers
# ------------------------------------------------------------------------------------------------------
class _Ctx:
    """One rank: its group, device and the collectives the benchmark itself needs."""

    def __init__(self, rank: int, plan: Dict[str, Any], group: Any, device: torch.device) -> None:
        self.rank, self.plan, self.group, self.device = rank, plan, group, device
        self.world = plan["num_ranks"]
        self.is_cuda = device.type == "cuda"
        self.nccl = plan["backend"] == "nccl"
        # gloo moves CPU tensors only: CUDA tensors go through host memory, as a user would have to.
        self.coll_device = device if self.nccl else torch.device("cpu")
        self.checks: List[str] = []
        self.phase_no = 0
        self._l2_flush: Optional[torch.Tensor] = None

    def sync(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        self.sync()
        marker = torch.zeros(1, device=self.coll_device)
        import torch.distributed as dist
        dist.all_reduce(marker, group=self.group)
        self.sync()

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """`[world, *tensor.shape]` on the tensor's device (bool tensors travel as uint8)."""
        import torch.distributed as dist
        src = tensor.contiguous()
        as_bool = src.dtype == torch.bool
        if as_bool:
            src = src.to(torch.uint8)
        src = src.to(self.coll_device)
        parts = [torch.empty_like(src) for _ in range(self.world)]
        dist.all_gather(parts, src, group=self.group)
        out = torch.stack(parts).to(tensor.device)
        return out.bool() if as_bool else out

    def all_gather_object(self, obj: Any) -> List[Any]:
        import torch.distributed as dist
        out: List[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def a2a(self, out: torch.Tensor, inp: torch.Tensor, out_splits: Optional[List[int]],
            in_splits: Optional[List[int]]) -> None:
        """`all_to_all_single` of rows (FP8 as bytes; through host memory on a gloo group)."""
        import torch.distributed as dist
        if out.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            out, inp = out.view(torch.uint8), inp.view(torch.uint8)
        inp = inp.contiguous()
        if out.device == self.coll_device:
            dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)
        else:
            staged = torch.empty(out.shape, dtype=out.dtype, device=self.coll_device)
            dist.all_to_all_single(staged, inp.to(self.coll_device), out_splits, in_splits, group=self.group)
            out.copy_(staged)

    def phase(self, text: str) -> None:
        self.phase_no += 1
        if self.rank == 0:
            print(f"{PREFIX} [{self.phase_no}/{self.plan['num_phases']}] {text}", file=sys.stderr, flush=True)

    def verify(self, name: str, problems: List[str]) -> None:
        """Agree across ranks on a check; raise VerificationError on every rank if any rank failed."""
        everyone = self.all_gather_object(problems)
        failed = [f"rank {r}: {p}" for r, ps in enumerate(everyone) for p in ps]
        if failed:
            raise VerificationError(f"{name} FAILED:\n  " + "\n  ".join(failed))
        self.checks.append(name)

    def time(self, fn: Callable[[], Any]) -> Dict[str, List[float]]:
        """Seconds per call, after warm-up calls, several ways:
        `streamed`: calls back to back, each bracketed by events on the current stream, with DeepEP's L2 flush
          (256 MB zeroed) enqueued before each call, as DeepEP's own benchmark does: the GPU is busy with the
          flush while the host prepares the call, so host work overlaps the GPU as in a model's forward pass;
        `host`: host seconds of each of those calls (the Python and launch cost of the API);
        `kernel` (GPU): GPU busy time per call from torch.profiler (the union of the kernels' and copies'
          intervals, flushes excluded), the figure DeepEP's newer tests report;
        `isolated`: a barrier before each call, so it starts on an idle GPU and pays all its host time."""
        for _ in range(self.plan["warmup"]):
            fn()
        isolated, _ = self._series(fn, barrier_each=True)
        self.barrier()
        streamed, host = self._series(fn, barrier_each=False)
        self.barrier()
        times = dict(streamed=streamed, isolated=isolated, host=host)
        if self.is_cuda:
            times["kernel"], times["kernels"] = self._kernel_series(fn)
            self.barrier()
        return times

    def _flush(self, marked: bool = False) -> None:
        """DeepEP's L2 flush: 256 MB zeroed; `marked`: rewritten by a kernel the profiler can tell apart (a
        negation, which no operation under test launches; it also reads, so it takes longer)."""
        if self._l2_flush is None:
            self._l2_flush = torch.empty(int(256e6) // 4, dtype=torch.int32, device=self.device)
        if marked:
            self._l2_flush.neg_()
        else:
            self._l2_flush.zero_()

    def _series(self, fn: Callable[[], Any], barrier_each: bool) -> Tuple[List[float], List[float]]:
        """Seconds of each of `iters` calls, events around each call (GPU) or the host clock (CPU), and the
        host seconds of each call."""
        host: List[float] = []
        events = []
        for _ in range(self.plan["iters"]):
            if barrier_each:
                self.barrier()
            if self.is_cuda:
                if not barrier_each:
                    self._flush()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            fn()
            host.append(time.perf_counter() - t0)
            if self.is_cuda:
                end.record()
                events.append((start, end))
        if not self.is_cuda:
            return host, host
        self.sync()
        return [start.elapsed_time(end) / 1e3 for start, end in events], host

    def _kernel_series(self, fn: Callable[[], Any]) -> Tuple[List[float], Dict[str, float]]:
        """GPU busy seconds per call over `iters` calls, each after a flush (profiled; flushes left out), and
        each kernel's (or copy's) microseconds per call."""
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile
        iters = self.plan["iters"]
        self.sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                self._flush(marked=True)
                fn()
            self.sync()
        device_events = [e for e in prof.events() if e.device_type == DeviceType.CUDA and not _is_flush(e.name)]
        spans = sorted((e.time_range.start, e.time_range.end) for e in device_events)
        per_kernel: Dict[str, float] = {}
        for e in device_events:
            name = e.name.split("(")[0][:48]
            per_kernel[name] = per_kernel.get(name, 0.0) + (e.time_range.end - e.time_range.start) / iters
        busy, reach = 0.0, float("-inf")
        for begin, end in spans:   # the union of the intervals (kernels on two streams may overlap)
            if end > reach:
                busy += end - max(begin, reach)
                reach = end
        return [busy / 1e6 / iters], per_kernel


def _is_flush(name: str) -> bool:
    """The marked L2 flush's kernel (see _Ctx._flush)."""
    return "neg_kernel" in name


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepEP's similarity measure: 1 - 2 sum((x+1)(y+1)) / sum((x+1)^2 + (y+1)^2), in float64."""
    x, y = x.double() + 1, y.double() + 1
    denominator = (x * x + y * y).sum()
    return float(1 - 2 * (x * y).sum() / denominator)


def _routing(gen: torch.Generator, num_tokens: int, num_topk: int, num_experts: int, device: torch.device
             ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Distinct top-k experts per token, a few selections dropped (-1) and the last token sent nowhere."""
    from .config import topk_idx_t
    scores = torch.randn(num_tokens, num_experts, generator=gen).abs() + 1
    topk_idx = scores.topk(num_topk, dim=1).indices.to(topk_idx_t)
    flat = topk_idx.view(-1)
    flat[torch.randperm(flat.numel(), generator=gen)[:max(1, flat.numel() // 64)]] = -1
    if num_tokens > 1:
        topk_idx[-1] = -1
    topk_weights = torch.randn(num_tokens, num_topk, generator=gen).abs().float()
    return topk_idx.to(device), topk_weights.to(device)


def _median_us(times: Sequence[float]) -> float:
    return statistics.median(times) * 1e6


# ------------------------------------------------------------------------------------------------------
# Baseline: what a user writes with torch.distributed alone
# ------------------------------------------------------------------------------------------------------
class _Baseline:
    """Permute + `all_to_all_single` dispatch/combine, the plain-PyTorch way."""

    def __init__(self, ctx: _Ctx) -> None:
        self.ctx = ctx

    def _exchange_counts(self, send_counts: torch.Tensor) -> Tuple[List[int], List[int], torch.Tensor]:
        """All-to-all of per-destination counts (`send_counts` [R * n], n values per destination)."""
        ctx = self.ctx
        send = send_counts.to(torch.int64)
        recv = torch.empty_like(send)
        ctx.a2a(recv, send, None, None)
        per_rank = torch.cat([send.view(ctx.world, -1).sum(1), recv.view(ctx.world, -1).sum(1)]).tolist()
        return per_rank[:ctx.world], per_rank[ctx.world:], recv

    def dispatch(self, tensors: List[torch.Tensor], is_token_in_rank: torch.Tensor,
                 state: Optional[tuple] = None) -> Tuple[List[torch.Tensor], tuple]:
        """Send each token once to every rank in `is_token_in_rank`; rows arrive by source rank, then token."""
        ctx = self.ctx
        if state is None:
            token = is_token_in_rank.t().nonzero()[:, 1]  # by destination rank, then token
            send_splits, recv_splits, _ = self._exchange_counts(is_token_in_rank.sum(0))
            state = (token, send_splits, recv_splits)
        token, send_splits, recv_splits = state
        outs = []
        for t in tensors:
            rows = t.index_select(0, token) if t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) else \
                t.view(torch.uint8).index_select(0, token).view(t.dtype)
            out = t.new_empty((sum(recv_splits), *t.shape[1:]))
            ctx.a2a(out, rows, recv_splits, send_splits)
            outs.append(out)
        return outs, state

    def dispatch_with_topk(self, x, topk_idx, topk_weights, is_token_in_rank, experts_per_rank: int):
        data = list(x) if isinstance(x, tuple) else [x]
        outs, state = self.dispatch(data + [topk_idx, topk_weights], is_token_in_rank)
        recv_idx, recv_w = outs[-2], outs[-1]
        lo = self.ctx.rank * experts_per_rank
        local = (recv_idx >= lo) & (recv_idx < lo + experts_per_rank)
        recv_idx = torch.where(local, recv_idx - lo, torch.full_like(recv_idx, -1))
        recv_w = torch.where(local, recv_w, torch.zeros_like(recv_w))
        recv_x = tuple(outs[:-2]) if isinstance(x, tuple) else outs[0]
        return recv_x, recv_idx, recv_w, state

    def combine(self, y: torch.Tensor, state: tuple, num_tokens: int) -> torch.Tensor:
        token, send_splits, recv_splits = state
        back = y.new_empty((len(token), y.shape[1]))
        self.ctx.a2a(back, y, send_splits, recv_splits)
        out = torch.zeros((num_tokens, y.shape[1]), dtype=torch.float32, device=y.device)
        out.index_add_(0, token, back.float())
        return out.to(torch.bfloat16)

    # ---- low-latency: one row per (token, top-k selection), packed per local expert ------------------
    def ll_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, num_max_tokens: int,
                    use_fp8: bool):
        from .fp8 import per_token_cast_to_fp8
        ctx = self.ctx
        experts_per_rank = num_experts // ctx.world
        flat = topk_idx.view(-1)
        valid = (flat >= 0).nonzero().squeeze(1)
        experts = flat[valid]
        order = torch.argsort(experts, stable=True)  # by expert (so by destination rank), then token
        selection = valid[order]
        token = selection // topk_idx.shape[1]
        per_expert_sent = torch.bincount(experts, minlength=num_experts)
        send_splits, recv_splits, recv_per_expert = self._exchange_counts(per_expert_sent)
        payloads = list(per_token_cast_to_fp8(x)) if use_fp8 else [x]
        received = []
        for t in payloads:
            rows = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
            out = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
            ctx.a2a(out, rows.index_select(0, token), recv_splits, send_splits)
            received.append(out)
        # received rows: by source rank, then local expert, then token -> pack per local expert
        counts = recv_per_expert.view(ctx.world, experts_per_rank)
        row_expert = torch.repeat_interleave(torch.arange(experts_per_rank, device=x.device).repeat(ctx.world),
                                             counts.flatten())
        order2 = torch.argsort(row_expert, stable=True)
        per_expert = counts.sum(0)
        expert_sorted = row_expert[order2]
        slot = torch.arange(len(order2), device=x.device) - (torch.cumsum(per_expert, 0) - per_expert)[expert_sorted]
        packed = []
        for rows, t in zip(received, payloads):
            dest = rows.new_empty((experts_per_rank, ctx.world * num_max_tokens, *rows.shape[1:]))
            dest[expert_sorted, slot] = rows[order2]
            packed.append(dest.view(torch.float8_e4m3fn) if t.dtype == torch.float8_e4m3fn else dest)
        state = (selection, token, send_splits, recv_splits, expert_sorted, slot, order2)
        return (tuple(packed) if use_fp8 else packed[0]), per_expert, state

    def ll_padded(self, send: torch.Tensor) -> torch.Tensor:
        """What a user without a low-latency kernel does at decode: one `all_to_all_single` of a fixed-size
        buffer of `N` rows per rank (every token to every rank, or every token's partial result back to its
        rank), with no count exchange."""
        out = torch.empty_like(send)
        self.ctx.a2a(out, send, None, None)
        return out

    def ll_combine(self, y: torch.Tensor, topk_weights: torch.Tensor, state: tuple) -> torch.Tensor:
        selection, token, send_splits, recv_splits, expert_sorted, slot, order2 = state
        rows = torch.empty((len(order2), y.shape[-1]), dtype=y.dtype, device=y.device)
        rows[order2] = y[expert_sorted, slot]
        back = rows.new_empty((len(selection), y.shape[-1]))
        self.ctx.a2a(back, rows, send_splits, recv_splits)
        out = torch.zeros((topk_weights.shape[0], y.shape[-1]), dtype=torch.float32, device=y.device)
        out.index_add_(0, token, back.float() * topk_weights.view(-1)[selection].unsqueeze(1))
        return out.to(torch.bfloat16)


# ------------------------------------------------------------------------------------------------------
# The benchmark on one rank
# ------------------------------------------------------------------------------------------------------
def _record(results: Dict[str, Any], name: str, times: Dict[str, List[float]], nbytes: Optional[int],
            baseline_times: Optional[Dict[str, List[float]]] = None, link_bytes: Optional[int] = None) -> None:
    results[name] = dict(time_us=_median_us(times["streamed"]), isolated_us=_median_us(times["isolated"]),
                         host_us=_median_us(times["host"]) if "host" in times else None,
                         kernel_us=_median_us(times["kernel"]) if "kernel" in times else None,
                         kernels=times.get("kernels"),
                         bytes=nbytes, link_bytes=link_bytes,
                         baseline_time_us=_median_us(baseline_times["streamed"]) if baseline_times else None)


def _copy_engine_peer_gbps(device: torch.device) -> Optional[float]:
    """The ceiling: a 1 GiB cudaMemcpy from this GPU to the next one (copy engine, no SMs), GB/s, timed on the
    host with both GPUs synchronised (events of one device do not bracket work the copy puts on the other)."""
    if device.type != "cuda" or torch.cuda.device_count() < 2:
        return None
    peer = torch.device("cuda", (device.index + 1) % torch.cuda.device_count())
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty(1 << 30, dtype=torch.uint8, device=peer)
    times = []
    for _ in range(4):
        torch.cuda.synchronize(device)
        torch.cuda.synchronize(peer)
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(device)
        torch.cuda.synchronize(peer)
        times.append(time.perf_counter() - start)
    return src.numel() / 1e9 / statistics.median(times[1:])


def _bench_normal(ctx: _Ctx, results: Dict[str, Any], info: Dict[str, Any]) -> None:
    from . import Buffer
    from .fp8 import per_token_cast_to_fp8
    plan, device, R, rank = ctx.plan, ctx.device, ctx.world, ctx.rank
    T, H, K, E = plan["tokens"], plan["hidden"], plan["topk"], plan["experts"]
    E_loc = E // R
    base = _Baseline(ctx)

    ctx.phase(f"normal: Buffer and inputs ({T} tokens/rank, hidden {H}, top-{K}, {E} experts)")
    gen = torch.Generator().manual_seed(plan["seed"] * 7919 + rank)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(device)
    topk_idx, topk_weights = _routing(gen, T, K, E, device)
    x_fp8 = per_token_cast_to_fp8(x)
    if plan["num_sms"] is not None:
        Buffer.set_num_sms(plan["num_sms"])
    dispatch_config, combine_config = Buffer.get_dispatch_config(R), Buffer.get_combine_config(R)
    num_nvl_bytes = plan["nvl_bytes"] or max(c.get_nvl_buffer_size_hint(H * 2, R)
                                             for c in (dispatch_config, combine_config))
    info["nvl_bytes"] = num_nvl_bytes
    buffer = Buffer(ctx.group, num_nvl_bytes, 0, explicitly_destroy=True, transport=plan["transport"],
                    device=device)
    info["transport"] = buffer.transport_name
    info["num_sms"] = dispatch_config.num_sms

    # ---- layout --------------------------------------------------------------------------------------
    ctx.phase("normal: get_dispatch_layout")
    layout = buffer.get_dispatch_layout(topk_idx, E)
    num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, _ = layout
    owner = torch.where(topk_idx >= 0, topk_idx // E_loc, torch.full_like(topk_idx, R))
    ref_in_rank = torch.zeros(T, R + 1, dtype=torch.bool, device=device)
    ref_in_rank.scatter_(1, owner, True)
    ref_in_rank = ref_in_rank[:, :R]
    ref_per_expert = torch.bincount(topk_idx[topk_idx >= 0], minlength=E).to(torch.int32)
    problems = []
    if not torch.equal(is_token_in_rank.cpu(), ref_in_rank.cpu()):
        problems.append("is_token_in_rank differs from topk_idx // experts_per_rank")
    if not torch.equal(num_tokens_per_rank.cpu(), ref_in_rank.sum(0).to(torch.int32).cpu()):
        problems.append(f"num_tokens_per_rank {num_tokens_per_rank.tolist()} != column sums of is_token_in_rank")
    if not torch.equal(num_tokens_per_expert.cpu(), ref_per_expert.cpu()):
        problems.append("num_tokens_per_expert differs from the bincount of topk_idx")
    ctx.verify("get_dispatch_layout", problems)
    _record(results, "layout", ctx.time(lambda: buffer.get_dispatch_layout(topk_idx, E)), None)

    # what every rank should receive, from all ranks' routing
    all_in_rank = ctx.all_gather(is_token_in_rank)            # [R, T, R]
    all_idx = ctx.all_gather(topk_idx)                        # [R, T, K]
    all_weights = ctx.all_gather(topk_weights)                # [R, T, K]
    all_per_expert = ctx.all_gather(num_tokens_per_expert)    # [R, E]
    mine = all_in_rank[:, :, rank]
    num_recv = int(mine.sum())
    expected_list = all_per_expert[:, rank * E_loc:(rank + 1) * E_loc].sum(0).tolist()
    exp_idx = all_idx[mine]
    local = (exp_idx >= rank * E_loc) & (exp_idx < (rank + 1) * E_loc)
    exp_idx = torch.where(local, exp_idx - rank * E_loc, torch.full_like(exp_idx, -1))
    exp_weights = torch.where(local, all_weights[mine], torch.zeros_like(all_weights[mine]))

    layout_kwargs = dict(num_tokens_per_rank=num_tokens_per_rank, num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
                         is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert,
                         topk_idx=topk_idx, topk_weights=topk_weights, config=dispatch_config)

    def check_dispatch(name, out, baseline_out) -> None:
        recv_x, recv_idx, recv_w, recv_list, handle, _ = out
        b_x, b_idx, b_w, _ = baseline_out
        data = recv_x[0] if isinstance(recv_x, tuple) else recv_x
        problems = []
        if tuple(data.shape) != (num_recv, H):
            problems.append(f"received {tuple(data.shape)} rows, the layouts of all ranks say ({num_recv}, {H})")
        elif recv_list != expected_list:
            problems.append(f"num_recv_tokens_per_expert_list {recv_list} != {expected_list}")
        elif not (torch.equal(recv_idx, exp_idx) and torch.equal(recv_w, exp_weights)):
            problems.append("recv_topk_idx / recv_topk_weights differ from the senders' routing")
        elif isinstance(recv_x, tuple):
            if not (torch.equal(recv_x[0].view(torch.uint8), b_x[0].view(torch.uint8))
                    and torch.equal(recv_x[1], b_x[1])):
                problems.append("received FP8 data / scales differ from a plain all_to_all_single of the rows")
        elif not torch.equal(recv_x, b_x):
            problems.append("received rows differ from a plain all_to_all_single of the rows")
        if handle is None:
            problems.append("no handle returned")
        if not (torch.equal(b_idx, exp_idx) and torch.equal(b_w, exp_weights)):
            problems.append("baseline: received top-k differs from the senders' routing (bench bug)")
        ctx.verify(name, problems)

    if rank == 0:
        info["copy_engine_peer_gbps"] = _copy_engine_peer_gbps(device)
    ctx.barrier()
    # bytes this rank moves to other ranks (the NVLink traffic of an intranode transport)
    rows_out = int(is_token_in_rank.sum()) - int(is_token_in_rank[:, rank].sum())
    rows_back = num_recv - int(is_token_in_rank[:, rank].sum())

    # ---- BF16 dispatch -------------------------------------------------------------------------------
    ctx.phase("normal: dispatch BF16 (+ baseline permute + all_to_all_single)")
    out = buffer.dispatch(x, **layout_kwargs)
    recv_x, handle = out[0], out[4]
    baseline_out = base.dispatch_with_topk(x, topk_idx, topk_weights, is_token_in_rank, E_loc)
    base_state = baseline_out[3]
    check_dispatch("dispatch BF16", out, baseline_out)
    bf16_bytes = num_recv * H * 2
    _record(results, "dispatch_bf16", ctx.time(lambda: buffer.dispatch(x, **layout_kwargs)), bf16_bytes,
            ctx.time(lambda: base.dispatch_with_topk(x, topk_idx, topk_weights, is_token_in_rank, E_loc)),
            rows_out * H * 2)

    # ---- FP8 dispatch --------------------------------------------------------------------------------
    ctx.phase("normal: dispatch FP8 with per-128 scales (+ baseline)")
    out_fp8 = buffer.dispatch(x_fp8, **layout_kwargs)
    check_dispatch("dispatch FP8", out_fp8,
                   base.dispatch_with_topk(x_fp8, topk_idx, topk_weights, is_token_in_rank, E_loc))
    _record(results, "dispatch_fp8", ctx.time(lambda: buffer.dispatch(x_fp8, **layout_kwargs)),
            int(bf16_bytes * FP8_FACTOR),
            ctx.time(lambda: base.dispatch_with_topk(x_fp8, topk_idx, topk_weights, is_token_in_rank, E_loc)),
            int(rows_out * H * 2 * FP8_FACTOR))

    # ---- cached dispatch -----------------------------------------------------------------------------
    ctx.phase("normal: cached dispatch BF16 (+ baseline without the count exchange)")
    cached = buffer.dispatch(x, handle=handle, config=dispatch_config)
    problems = []
    if not (isinstance(cached, tuple) and len(cached) == 6 and cached[1:5] == (None, None, None, None)):
        problems.append("cached dispatch must return (recv_x, None, None, None, None, event)")
    elif not torch.equal(cached[0], recv_x):
        problems.append("cached dispatch rows differ from the first dispatch")
    ctx.verify("cached dispatch BF16", problems)
    _record(results, "dispatch_cached", ctx.time(lambda: buffer.dispatch(x, handle=handle, config=dispatch_config)),
            bf16_bytes, ctx.time(lambda: base.dispatch([x], is_token_in_rank, base_state)), rows_out * H * 2)
    cached_fp8 = buffer.dispatch(x_fp8, handle=handle, config=dispatch_config)
    problems = []
    if not (torch.equal(cached_fp8[0][0].view(torch.uint8), out_fp8[0][0].view(torch.uint8))
            and torch.equal(cached_fp8[0][1], out_fp8[0][1])):
        problems.append("cached FP8 dispatch rows / scales differ from the first FP8 dispatch")
    ctx.verify("cached dispatch FP8", problems)
    _record(results, "dispatch_cached_fp8",
            ctx.time(lambda: buffer.dispatch(x_fp8, handle=handle, config=dispatch_config)),
            int(bf16_bytes * FP8_FACTOR), ctx.time(lambda: base.dispatch(list(x_fp8), is_token_in_rank, base_state)),
            int(rows_out * H * 2 * FP8_FACTOR))
    del out_fp8, cached_fp8

    # ---- combine -------------------------------------------------------------------------------------
    ctx.phase("normal: combine BF16 (+ baseline all_to_all_single back + index_add)")
    combined, combined_w, _ = buffer.combine(recv_x, handle, topk_weights=out[2], config=combine_config)
    expected = x.float() * is_token_in_rank.sum(1, keepdim=True).float()
    baseline_combined = base.combine(recv_x, base_state, T)
    problems = []
    if tuple(combined.shape) != (T, H) or combined.dtype != torch.bfloat16:
        problems.append(f"combined_x is {tuple(combined.shape)} {combined.dtype}, expected ({T}, {H}) bfloat16")
    else:
        error = (combined.float() - expected).abs()
        bound = expected.abs() * 2.0 ** -8  # one bf16 rounding of an exact fp32 sum
        if torch.isnan(combined).any() or bool((error > bound).any()):
            problems.append(f"combine(dispatch(x)) != x * number of destination ranks: max error "
                            f"{float(error.max()):.3g}, calc_diff {calc_diff(combined, expected):.3g}")
        masked_w = torch.where(topk_idx >= 0, topk_weights, torch.zeros_like(topk_weights))
        if combined_w is None or not torch.equal(combined_w, masked_w):
            problems.append("combined_topk_weights != the original weights (of the valid selections)")
    if bool(((baseline_combined.float() - expected).abs() > expected.abs() * 2.0 ** -8).any()):
        problems.append("baseline combine != x * number of destination ranks (bench bug)")
    ctx.verify("combine BF16", problems)
    _record(results, "combine", ctx.time(lambda: buffer.combine(recv_x, handle, config=combine_config)), bf16_bytes,
            ctx.time(lambda: base.combine(recv_x, base_state, T)), rows_back * H * 2)

    del out, recv_x, handle, cached, combined
    ctx.barrier()
    buffer.destroy()


def _bench_low_latency(ctx: _Ctx, results: Dict[str, Any], info: Dict[str, Any]) -> None:
    from . import Buffer
    from .fp8 import num_scale_groups, per_token_cast_back, per_token_cast_to_fp8
    plan, device, R, rank = ctx.plan, ctx.device, ctx.world, ctx.rank
    N, H, K, E = plan["ll_tokens"], plan["hidden"], plan["topk"], plan["ll_experts"]
    E_loc = E // R
    base = _Baseline(ctx)

    ctx.phase(f"low-latency: Buffer and inputs ({N} tokens/rank, hidden {H}, top-{K}, {E} experts)")
    gen = torch.Generator().manual_seed(plan["seed"] * 7919 + 104729 + rank)
    x = torch.randn(N, H, generator=gen).to(torch.bfloat16).to(device)
    topk_idx, topk_weights = _routing(gen, N, K, E, device)
    num_rdma_bytes = Buffer.get_low_latency_rdma_size_hint(N, H, R, E)
    buffer = Buffer(ctx.group, 0, num_rdma_bytes, low_latency_mode=True, num_qps_per_rank=max(1, E_loc),
                    explicitly_destroy=True, transport=plan["transport"], device=device)
    info.setdefault("transport", buffer.transport_name)
    info["ll_transport"] = buffer.transport_name

    num_valid = int((topk_idx >= 0).sum())
    all_x = ctx.all_gather(x)            # [R, N, H]
    all_idx = ctx.all_gather(topk_idx)   # [R, N, K]
    # expected (local expert, source rank, token) keys of this rank's received rows, sorted
    sources, tokens, slots = (all_idx >= rank * E_loc).logical_and(all_idx < (rank + 1) * E_loc).nonzero(as_tuple=True)
    local_expert = all_idx[sources, tokens, slots] - rank * E_loc
    expected_keys = torch.sort((local_expert * R + sources) * N + tokens).values
    expected_count = torch.bincount(local_expert, minlength=E_loc).to(torch.int32)
    valid_weight = torch.where(topk_idx >= 0, topk_weights, torch.zeros_like(topk_weights)).sum(1, keepdim=True)
    combine_expected = x.float() * valid_weight

    def check_ll_dispatch(name: str, out, use_fp8: bool) -> torch.Tensor:
        """Check a low-latency dispatch; return identity expert outputs (bf16 `[E_loc, R*N, H]`)."""
        recv_x, recv_count, handle, _, _ = out
        problems = []
        data = recv_x[0] if use_fp8 else recv_x
        if tuple(data.shape) != (E_loc, R * N, H):
            problems.append(f"recv_x has shape {tuple(data.shape)}, expected ({E_loc}, {R * N}, {H})")
        elif not torch.equal(recv_count.cpu(), expected_count.cpu()):
            problems.append(f"recv_count {recv_count.tolist()} != selections of the local experts "
                            f"{expected_count.tolist()}")
        else:
            src_info, layout_range = handle[0].cpu(), handle[1].cpu()
            src_rank = torch.full((E_loc, R * N), -1, dtype=torch.int64)
            begins, counts = (layout_range >> 32).tolist(), (layout_range & 0xFFFFFFFF).tolist()
            for e in range(E_loc):
                for s in range(R):
                    src_rank[e, begins[e][s]:begins[e][s] + counts[e][s]] = s
            valid = torch.arange(R * N).unsqueeze(0) < recv_count.cpu().unsqueeze(1).long()
            got_keys = (torch.arange(E_loc).unsqueeze(1) * R + src_rank) * N + src_info.long()
            if [sum(c) for c in counts] != recv_count.tolist() or bool((src_rank[valid] < 0).any()):
                problems.append("layout_range blocks do not tile [0, recv_count) of every local expert")
            elif not torch.equal(torch.sort(got_keys[valid]).values, expected_keys.cpu()):
                problems.append("the (source rank, src_info) of the received rows are not the selected tokens")
            else:
                valid_d = valid.to(device)
                rows = all_x[src_rank[valid].to(device), src_info[valid].long().to(device)]
                if use_fp8:
                    ref_data, ref_scales = per_token_cast_to_fp8(rows)
                    if tuple(recv_x[1].shape) != (E_loc, R * N, num_scale_groups(H)):
                        problems.append(f"scales have shape {tuple(recv_x[1].shape)}")
                    elif not (torch.equal(recv_x[0][valid_d].view(torch.uint8), ref_data.view(torch.uint8))
                              and torch.equal(recv_x[1][valid_d], ref_scales)):
                        diff = calc_diff(per_token_cast_back(recv_x[0][valid_d], recv_x[1][valid_d]), rows.float())
                        problems.append(f"FP8 rows differ from per_token_cast_to_fp8 of the source rows "
                                        f"(calc_diff of the dequantised rows {diff:.3g})")
                elif not torch.equal(recv_x[valid_d], rows):
                    problems.append("BF16 rows differ from the source rows")
        ctx.verify(name, problems)
        return _identity_expert_outputs(recv_x) if use_fp8 else recv_x

    def check_ll_combine(name: str, combined: torch.Tensor, tolerance: float,
                         expected: Optional[torch.Tensor] = None) -> None:
        problems = []
        expected = combine_expected if expected is None else expected
        if tuple(combined.shape) != tuple(expected.shape) or combined.dtype != torch.bfloat16:
            problems.append(f"combined_x is {tuple(combined.shape)} {combined.dtype}, expected "
                            f"{tuple(expected.shape)} bfloat16")
        else:
            diff = calc_diff(combined, expected)
            if torch.isnan(combined).any() or not diff < tolerance:
                problems.append(f"combine of identity experts != x * sum of valid weights: calc_diff {diff:.3g} "
                                f"(tolerance {tolerance:g})")
        ctx.verify(name, problems)

    ll_dispatch_bytes_fp8 = num_valid * (H + num_scale_groups(H) * 4 + 16)
    ll_bf16_bytes = num_valid * H * 2

    # ---- FP8 dispatch --------------------------------------------------------------------------------
    ctx.phase("low-latency: dispatch FP8 (+ baseline cast + permute + all_to_all_single + pack)")

    def ll_dispatch(use_fp8: bool):
        return buffer.low_latency_dispatch(x, topk_idx, N, E, use_fp8=use_fp8)

    def baseline_round_trip(name: str, use_fp8: bool, tolerance: float):
        """Run the baseline once and check it like ours (a failure here is a bench bug, not a library bug)."""
        recv, per_expert, state = base.ll_dispatch(x, topk_idx, E, N, use_fp8)
        expert_out = _identity_expert_outputs(recv) if use_fp8 else recv
        combined = base.ll_combine(expert_out, topk_weights, state)
        problems = []
        if not torch.equal(per_expert.to(torch.int32).cpu(), expected_count.cpu()):
            problems.append("baseline: per-expert counts differ (bench bug)")
        diff = calc_diff(combined, combine_expected)
        if torch.isnan(combined).any() or not diff < tolerance:
            problems.append(f"baseline: round trip calc_diff {diff:.3g} (bench bug)")
        ctx.verify(name, problems)
        return expert_out, state

    out = ll_dispatch(True)
    expert_out = check_ll_dispatch("LL dispatch FP8", out, True)
    combined = buffer.low_latency_combine(expert_out, topk_idx, topk_weights, out[2])[0]
    check_ll_combine("LL combine of FP8-dispatched rows", combined, 9e-4)
    baseline_round_trip("baseline LL FP8 round trip", True, 9e-4)
    del out, expert_out, combined
    _record(results, "ll_dispatch_fp8", ctx.time(lambda: ll_dispatch(True)), ll_dispatch_bytes_fp8,
            ctx.time(lambda: base.ll_dispatch(x, topk_idx, E, N, True)))

    # ---- BF16 dispatch -------------------------------------------------------------------------------
    ctx.phase("low-latency: dispatch BF16 (+ baseline)")
    out = ll_dispatch(False)
    expert_out, handle = check_ll_dispatch("LL dispatch BF16", out, False), out[2]
    base_out, base_state = baseline_round_trip("baseline LL BF16 round trip", False, 1e-5)
    _record(results, "ll_dispatch_bf16", ctx.time(lambda: ll_dispatch(False)), ll_bf16_bytes,
            ctx.time(lambda: base.ll_dispatch(x, topk_idx, E, N, False)))

    # ---- combine -------------------------------------------------------------------------------------
    ctx.phase("low-latency: combine BF16 (+ baseline all_to_all_single back + weighted index_add)")
    combined = buffer.low_latency_combine(expert_out, topk_idx, topk_weights, handle)[0]
    check_ll_combine("LL combine BF16", combined, 1e-5)
    _record(results, "ll_combine",
            ctx.time(lambda: buffer.low_latency_combine(expert_out, topk_idx, topk_weights, handle)),
            ll_bf16_bytes, ctx.time(lambda: base.ll_combine(base_out, topk_weights, base_state)))
    del out, expert_out, handle, combined
    if device.type == "cuda" and buffer.transport_name == "nvlink":
        _bench_low_latency_graphs(ctx, results, buffer, base, x, topk_idx, topk_weights, check_ll_combine,
                                  ll_dispatch_bytes_fp8, ll_bf16_bytes)
    ctx.barrier()
    buffer.destroy()


def _identity_expert_outputs(recv: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """What identity experts return for FP8-dispatched rows `(data [E_loc, R*N, H], scales)`: the rows
    dequantised, in bf16, shaped like `data`."""
    from .fp8 import per_token_cast_back
    data, scales = recv
    return per_token_cast_back(data.reshape(-1, data.shape[-1]), scales.reshape(-1, scales.shape[-1])) \
        .to(torch.bfloat16).view(data.shape)


def _capture(fn: Callable[[], Any]) -> "torch.cuda.CUDAGraph":
    """`fn` captured in a CUDA graph (run once eagerly first: kernels compile outside the capture)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def _bench_low_latency_graphs(ctx: _Ctx, results: Dict[str, Any], buffer, base: "_Baseline", x: torch.Tensor,
                              topk_idx: torch.Tensor, topk_weights: torch.Tensor, check_combine: Callable,
                              dispatch_bytes: int, combine_bytes: int) -> None:
    """Decode as serving engines run it: FP8 dispatch and BF16 combine replayed from CUDA graphs (also with one
    token per rank), and the two phases of a dispatch with a receive hook. Baseline: one all_to_all_single
    of a padded buffer each way."""
    from .fp8 import per_token_cast_to_fp8
    plan = ctx.plan
    N, H, E = plan["ll_tokens"], plan["hidden"], plan["ll_experts"]
    ctx.phase("low-latency: CUDA graphs (dispatch FP8, combine, both; 1 token), hook phases, padded baseline")

    fp8_rows = torch.cat([t.view(torch.uint8).view(N, -1) for t in per_token_cast_to_fp8(x)], dim=1)
    to_every_rank = fp8_rows.repeat(ctx.world, 1)
    back_to_sources = torch.zeros((ctx.world * N, H), dtype=torch.bfloat16, device=x.device)
    padded_dispatch = ctx.time(lambda: base.ll_padded(to_every_rank))
    padded_combine = ctx.time(lambda: base.ll_padded(back_to_sources))
    for suffix, tokens in (("graph", N), ("1_token", 1)):
        xs, idx, weights = x[:tokens].contiguous(), topk_idx[:tokens].contiguous(), topk_weights[:tokens].contiguous()
        out = torch.empty((tokens, H), dtype=torch.bfloat16, device=x.device)
        recv, _, handle, _, _ = buffer.low_latency_dispatch(xs, idx, N, E, use_fp8=True)
        experts = _identity_expert_outputs(recv)   # the expert outputs the combine graphs send back
        dispatch_graph = _capture(lambda: buffer.low_latency_dispatch(xs, idx, N, E, use_fp8=True))
        combine_graph = _capture(lambda: buffer.low_latency_combine(experts, idx, weights, handle, out=out))
        combine_graph.replay()
        torch.cuda.synchronize()
        expected = xs.float() * torch.where(idx >= 0, weights, torch.zeros_like(weights)).sum(1, keepdim=True)
        check_combine(f"LL combine replayed from a CUDA graph ({tokens} tokens)", out, 9e-4, expected)
        full = tokens == N
        _record(results, f"ll_dispatch_{suffix}", ctx.time(dispatch_graph.replay), dispatch_bytes if full else None,
                padded_dispatch if full else None)
        _record(results, f"ll_combine_{suffix}", ctx.time(combine_graph.replay), combine_bytes if full else None,
                padded_combine if full else None)
        if full:
            def round_trip() -> None:
                received, _, h, _, _ = buffer.low_latency_dispatch(xs, idx, N, E, use_fp8=True)
                buffer.low_latency_combine(experts, idx, weights, h, out=out)
            round_trip_graph = _capture(round_trip)
            both = {k: [a + b for a, b in zip(padded_dispatch[k], padded_combine[k])] for k in padded_dispatch}
            _record(results, "ll_round_trip_graph", ctx.time(round_trip_graph.replay), dispatch_bytes + combine_bytes,
                    both)
        del dispatch_graph, combine_graph
    send, receive = _hook_phases(ctx, lambda: buffer.low_latency_dispatch(x, topk_idx, N, E, use_fp8=True,
                                                                          return_recv_hook=True)[4])
    _record(results, "ll_send_phase", send, dispatch_bytes)
    _record(results, "ll_recv_phase", receive, None)


def _hook_phases(ctx: _Ctx, send: Callable[[], Callable[[], None]]) -> Tuple[Dict[str, List[float]], ...]:
    """Seconds of the send call and of its hook, each bracketed by events, calls back to back (streamed) and
    after a barrier (isolated)."""
    for _ in range(ctx.plan["warmup"]):
        send()()
    phases: Dict[str, Dict[str, List[float]]] = dict(send={}, receive={})
    for kind, barrier_each in (("isolated", True), ("streamed", False)):
        events = []
        for _ in range(ctx.plan["iters"]):
            if barrier_each:
                ctx.barrier()
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            marks[0].record()
            hook = send()
            marks[1].record()
            marks[2].record()
            hook()
            marks[3].record()
            events.append(marks)
        ctx.sync()
        phases["send"][kind] = [m[0].elapsed_time(m[1]) / 1e3 for m in events]
        phases["receive"][kind] = [m[2].elapsed_time(m[3]) / 1e3 for m in events]
        ctx.barrier()
    return phases["send"], phases["receive"]


def _num_phases(plan: Dict[str, Any]) -> int:
    graphs = plan["device"] == "cuda" and plan["transport"] != "reference"   # the NVLink path: CUDA graphs
    return (6 if "normal" in plan["modes"] else 0) + ((4 + graphs) if "low-latency" in plan["modes"] else 0)


def _run_rank(ctx: _Ctx) -> Dict[str, Any]:
    results: Dict[str, Any] = {}
    info: Dict[str, Any] = {}
    if "normal" in ctx.plan["modes"]:
        _bench_normal(ctx, results, info)
    if "low-latency" in ctx.plan["modes"]:
        _bench_low_latency(ctx, results, info)
    everyone = ctx.all_gather_object(results)
    return dict(per_rank=everyone, info=info, checks=list(ctx.checks))


def _setup_env(plan: Dict[str, Any]) -> None:
    if sys.platform.startswith("linux") and os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks all run on this host
    if "OMP_NUM_THREADS" not in os.environ:
        # Share the cores between the ranks (as torchrun does): with every rank using all cores, the small
        # host-side tensor ops of a call wait for oversubscribed OpenMP threads (milliseconds each).
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // plan["num_ranks"]))


def _worker(rank: int, plan: Dict[str, Any], port: int, reports: Any) -> None:
    """Entry point of a spawned rank: reports ("ok", result) / ("verify", message) / ("error", traceback)."""
    import torch.distributed as dist
    clean = False
    try:
        _setup_env(plan)
        if plan["device"] == "cuda":
            device = torch.device("cuda", rank % plan["num_gpus"])
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        kwargs: Dict[str, Any] = dict(init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                      world_size=plan["num_ranks"], timeout=datetime.timedelta(seconds=300))
        if plan["backend"] == "nccl":
            kwargs["device_id"] = device
        try:
            dist.init_process_group(plan["backend"], **kwargs)
        except TypeError:  # torch without device_id
            kwargs.pop("device_id", None)
            dist.init_process_group(plan["backend"], **kwargs)
        ctx = _Ctx(rank, plan, dist.group.WORLD, device)
        result = _run_rank(ctx)
        reports.put((rank, "ok", result if rank == 0 else None))
        clean = True
    except VerificationError as error:
        reports.put((rank, "verify", str(error)))
    except BaseException:  # noqa: BLE001 - every failure goes back to the launcher
        reports.put((rank, "error", traceback.format_exc()))
    finally:
        if clean and dist.is_initialized():
            dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------------
# Launcher
# ------------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(plan: Dict[str, Any], timeout: float) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    """Spawn the ranks and wait for them; returns (rank 0's result, None) or (None, failure text)."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    reports = ctx.Queue()
    port = _free_port()
    from deep_ep import bench as this_module  # a picklable target even when run as __main__
    procs = [ctx.Process(target=this_module._worker, args=(rank, plan, port, reports), daemon=True)
             for rank in range(plan["num_ranks"])]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    got: Dict[int, Tuple[str, Any]] = {}
    failure: Optional[str] = None
    try:
        while len(got) < len(procs):
            try:
                rank, status, payload = reports.get(timeout=0.5)
                got[rank] = (status, payload)
                if status != "ok" and failure is None:
                    failure = payload if status == "verify" else f"rank {rank} raised:\n{payload}"
                    # a verification failure is agreed by all ranks; give them a moment to report
                    deadline = min(deadline, time.monotonic() + (10 if status == "verify" else 3))
                continue
            except queue.Empty:
                pass
            if failure is not None and time.monotonic() > deadline:
                break
            dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode is not None]
            if dead:
                failure = failure or f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} without a report"
                break
            if time.monotonic() > deadline:
                failure = failure or (f"timed out after {timeout:g} s waiting for ranks "
                                      f"{[r for r in range(len(procs)) if r not in got]}")
                break
    finally:
        for p in procs:
            p.join(timeout=30 if failure is None else 2)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if failure is not None:
        return None, failure
    return got[0][1], None


def _summarise(plan: Dict[str, Any], result: Dict[str, Any], wall_s: float) -> Dict[str, Any]:
    """The JSON report: configuration, rank 0's figures (and every rank's times), verification."""
    per_rank = result["per_rank"]
    info = result["info"]
    ops: Dict[str, Any] = {}
    for name, label, mode in OPS:
        if name not in per_rank[0]:
            continue
        mine = per_rank[0][name]
        entry: Dict[str, Any] = dict(label=label, mode=mode, time_us=mine["time_us"], isolated_us=mine["isolated_us"],
                                     host_us=mine.get("host_us"), kernel_us=mine.get("kernel_us"),
                                     kernel_us_max_rank=max((r[name].get("kernel_us") or 0 for r in per_rank),
                                                            default=0) or None, kernels=mine.get("kernels"),
                                     time_us_max_rank=max(r[name]["time_us"] for r in per_rank),
                                     time_us_per_rank=[r[name]["time_us"] for r in per_rank],
                                     bytes=mine["bytes"],
                                     gbps=(mine["bytes"] / 1e9 / (mine["time_us"] / 1e6)) if mine["bytes"] else None,
                                     link_gbps=(mine["link_bytes"] / 1e9 / (mine["time_us"] / 1e6))
                                     if mine.get("link_bytes") else None)
        if mine["baseline_time_us"] is not None:
            b = mine["baseline_time_us"]
            entry["baseline"] = dict(time_us=b, time_us_max_rank=max(r[name]["baseline_time_us"] for r in per_rank),
                                     gbps=(mine["bytes"] / 1e9 / (b / 1e6)) if mine["bytes"] else None)
            entry["ratio_vs_baseline"] = mine["time_us"] / b
        else:
            entry["baseline"] = None
            entry["ratio_vs_baseline"] = None
        ops[name] = entry
    device_name = "cpu"
    if plan["device"] == "cuda":
        device_name = f"cuda ({torch.cuda.get_device_name(0)}, {min(plan['num_gpus'], plan['num_ranks'])} GPU(s))"
    config = dict(num_ranks=plan["num_ranks"], device=plan["device"], device_name=device_name,
                  backend=plan["backend"], transport=info.get("transport"), modes=plan["modes"],
                  tokens=plan["tokens"], hidden=plan["hidden"], topk=plan["topk"], experts=plan["experts"],
                  ll_tokens=plan["ll_tokens"], ll_experts=plan["ll_experts"],
                  num_sms=info.get("num_sms", plan["num_sms"]), nvl_bytes=info.get("nvl_bytes"),
                  copy_engine_peer_gbps=info.get("copy_engine_peer_gbps"), warmup=plan["warmup"], iters=plan["iters"],
                  seed=plan["seed"], torch=torch.__version__)
    return dict(ok=True, config=config, ops=ops,
                verification=dict(passed=True, checks=result["checks"]),
                units=dict(time="microseconds, median over iters of calls back to back, each after an L2 flush "
                                "(rank 0 unless stated); isolated_us: each call after a barrier; host_us: host time "
                                "of a call; kernel_us: GPU busy time per call (profiler)",
                           bandwidth="GB/s = DeepEP logical bytes / 1e9 / time"),
                wall_s=round(wall_s, 3))


def format_table(report: Dict[str, Any]) -> str:
    c = report["config"]
    lines = [f"deep_ep.bench: {c['num_ranks']} ranks on {c['device_name']}, group {c['backend']}, "
             f"transport {c['transport']}, torch {c['torch']}"]
    if "normal" in c["modes"]:
        lines.append(f"  normal:      {c['tokens']} tokens/rank, hidden {c['hidden']}, top-{c['topk']}, "
                     f"{c['experts']} experts, num_sms {c['num_sms']}, num_nvl_bytes {c['nvl_bytes']}")
    if "low-latency" in c["modes"]:
        lines.append(f"  low-latency: {c['ll_tokens']} tokens/rank, hidden {c['hidden']}, top-{c['topk']}, "
                     f"{c['ll_experts']} experts")
    flush = ", each after an L2 flush (DeepEP's method)" if c["device"] == "cuda" else ""
    lines.append(f"  time: median of {c['iters']} calls back to back after {c['warmup']} warm-up{flush}, rank 0 (max "
                 "over ranks in brackets); kernel: GPU busy time per call (profiler, max over ranks); host: host "
                 "time of a call; isolated: calls each after a barrier")
    lines.append("  GB/s: DeepEP's logical bytes / 1e9 / time; baseline: permute + all_to_all_single, back to back")
    if c.get("copy_engine_peer_gbps"):
        lines.append(f"  ceiling: copy engine to the peer GPU {c['copy_engine_peer_gbps']:.0f} GB/s; link GB/s = bytes "
                     "sent to other ranks / time")
    header = ("operation", "time us", "(max rank)", "kernel us", "host us", "isolated us", "GB/s", "link GB/s",
              "baseline us", "base GB/s", "ours/baseline")
    widths = (22, 9, 11, 10, 9, 12, 9, 10, 12, 10, 14)
    fmt = lambda cells: "".join(str(v).rjust(w) if i else str(v).ljust(w)  # noqa: E731
                                for i, (v, w) in enumerate(zip(cells, widths)))
    lines.append(fmt(header))
    lines.append("-" * sum(widths))

    def num(value: Optional[float], digits: int = 1) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    for entry in report["ops"].values():
        b = entry["baseline"] or {}
        lines.append(fmt((entry["label"], num(entry["time_us"]), f"({num(entry['time_us_max_rank'])})",
                          num(entry.get("kernel_us_max_rank")), num(entry.get("host_us")), num(entry["isolated_us"]),
                          num(entry["gbps"], 2), num(entry.get("link_gbps"), 1), num(b.get("time_us")),
                          num(b.get("gbps"), 2), num(entry["ratio_vs_baseline"], 2))))
    v = report["verification"]
    lines.append(f"verification: {'passed' if v['passed'] else 'FAILED'} ({len(v['checks'])} checks); "
                 f"wall time {report['wall_s']:.1f} s")
    return "\n".join(lines)


def format_kernels(report: Dict[str, Any]) -> str:
    """Rank 0's kernels per operation, longest first (GPU runs; empty on CPU)."""
    lines = []
    for entry in report["ops"].values():
        kernels = entry.get("kernels")
        if kernels:
            parts = sorted(kernels.items(), key=lambda item: -item[1])
            lines.append(f"{entry['label']}: " + ", ".join(f"{name} {us:.1f}" for name, us in parts))
    return "\n".join(lines)


def write_plot(report: Dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    entries = list(report["ops"].values())
    labels = [e["label"] for e in entries]
    ours = [e["time_us"] for e in entries]
    baseline = [e["baseline"]["time_us"] if e["baseline"] else 0.0 for e in entries]
    positions = range(len(entries))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(entries)), 4.5))
    width = 0.4
    ax.bar([p - width / 2 for p in positions], ours, width, label="deep_ep")
    ax.bar([p + width / 2 for p in positions], baseline, width, label="permute + all_to_all_single")
    ax.set_xticks(list(positions))
    ax.set_xticklabels(labels, rotation=30, ha="right")
    ax.set_ylabel("time per call, us (median, rank 0)")
    c = report["config"]
    ax.set_title(f"deep_ep.bench: {c['num_ranks']} ranks, {c['device']} / {c['backend']}, transport {c['transport']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the benchmark; returns the exit code (0 = every check passed)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(f"{PREFIX} --plot needs matplotlib, which is not installed: pip install matplotlib "
                  "(or pip install 'deep-ep-triton[plot]')", file=sys.stderr)
            return 2
    plan = _resolve(args, parser)
    plan["num_phases"] = _num_phases(plan)
    print(f"{PREFIX} spawning {plan['num_ranks']} ranks: {plan['device']} tensors, {plan['backend']} group, "
          f"mode {'+'.join(plan['modes'])}", file=sys.stderr, flush=True)
    start = time.monotonic()
    result, failure = _launch(plan, args.timeout)
    wall_s = time.monotonic() - start
    if failure is not None:
        print(f"{PREFIX} FAILED: {failure}", file=sys.stderr, flush=True)
        if args.json:
            print(json.dumps(dict(ok=False, error=failure, verification=dict(passed=False)), indent=2), flush=True)
        return 1
    report = _summarise(plan, result, wall_s)
    table = format_table(report)
    if args.kernels:
        table += "\n" + format_kernels(report)
    if args.json:
        print(table, file=sys.stderr, flush=True)
        print(json.dumps(report, indent=2), flush=True)
    else:
        print(table, flush=True)
    if args.plot is not None:
        write_plot(report, args.plot)
        print(f"{PREFIX} wrote {args.plot}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
