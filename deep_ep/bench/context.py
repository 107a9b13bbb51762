"""One rank of the benchmark: its group and device, the collectives the benchmark itself needs, verification
agreed by every rank and the timing of a call; with the helpers both modes share (random routing, DeepEP's
calc_diff, recording a result)."""
from __future__ import annotations

import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

PREFIX = "[deep_ep.bench]"
FP8_FACTOR = (1 + 4 / 128) / 2  # DeepEP: an FP8 byte plus one float32 scale per 128 values, vs. BF16
NUM_INPUTS = 3   # the timed calls of an operation take turns over this many inputs (RankContext.time_pair)
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class VerificationError(AssertionError):
    """A result differs from what the DeepEP contract says (raised on every rank at once)."""


class RankContext:
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
        `streamed`: DeepEP's own benchmark (tests/utils.py `bench`): one L2 flush (256 MB zeroed), then calls
          back to back, each bracketed by events on the current stream, the first left out; a call whose host
          work takes longer than its GPU work shows the host's pace;
        `host`: host seconds of each of those calls (the Python and launch cost of the API);
        `kernel` (GPU): GPU busy time per call from torch.profiler (the union of the kernels' and copies'
          intervals, flushes excluded), the figure DeepEP's newer tests report;
        `isolated`: a barrier before each call, so it starts on an idle GPU and pays all its host time."""
        return self._time([lambda _: fn()], 1, [None], "")[0]

    def time_pair(self, name: str, fn: Callable[[int], Any], baseline: Callable[[int], Any], num_inputs: int,
                  check: Callable[[int, Any], List[str]]
                  ) -> Tuple[Dict[str, List[float]], Dict[str, List[float]]]:
        """`time` of `fn` and of `baseline`, their calls interleaved (one of each in turn, the first of the two
        alternating), so that the machine's drift during the run reaches both alike. Each call gets the next
        of `num_inputs` inputs (its index, the same for both in a turn), and `check(index, output)` verifies
        what `fn` returned: after every timed call on the CPU (outside the timed span), after the last one of
        each series on a GPU (where checking between calls would put work between calls timed back to back);
        every rank raises VerificationError if any check failed."""
        ours, base = self._time([fn, baseline], num_inputs, [check, None], name)
        return ours, base

    def _time(self, fns: List[Callable[[int], Any]], num_inputs: int,
              checks: List[Optional[Callable[[int, Any], List[str]]]], name: str) -> List[Dict[str, List[float]]]:
        for call in range(self.plan["warmup"]):
            for fn in fns:
                fn(call % num_inputs)
        problems: List[str] = []
        isolated = [([], []) for _ in fns]
        if self.plan.get("isolated", True):
            isolated = self._series(fns, num_inputs, checks, problems, barrier_each=True)
        self.barrier()
        streamed = self._series(fns, num_inputs, checks, problems, barrier_each=False)
        self.barrier()
        if any(checks):
            self.verify(f"{name}: the outputs of the timed calls", problems[:5])
        times = [dict(streamed=s[0], isolated=i[0], host=s[1]) for s, i in zip(streamed, isolated)]
        if self.is_cuda:
            for fn, each in zip(fns, times):
                each["kernel"], each["kernels"] = self._kernel_series(lambda: fn(0))
                self.barrier()
        if self.plan.get("profile"):
            for each, functions in zip(times, self._profile_series(fns, num_inputs)):
                each["functions"] = functions
            for fn, each in zip(fns, times):
                each["tensor_ops"] = self._count_tensor_ops(lambda: fn(0))
                each["tensor_op_times"] = self._tensor_op_times(fn, num_inputs)
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

    def _series(self, fns: List[Callable[[int], Any]], num_inputs: int,
                checks: List[Optional[Callable[[int, Any], List[str]]]], problems: List[str], barrier_each: bool
                ) -> List[Tuple[List[float], List[float]]]:
        """For each of `fns`: seconds of each of `iters` calls, events around each call (GPU) or the host clock
        (CPU), and the host seconds of each call; the functions take turns call by call, the first of them
        rotating, each call given the next input index. Back to back (not `barrier_each`): one flush first,
        and one round more whose times are left out (it may start behind the flush), as DeepEP's benchmark
        does. Appends what `checks` find to `problems` (see `time_pair`)."""
        host: List[List[float]] = [[] for _ in fns]
        events: List[list] = [[] for _ in fns]
        last: List[Tuple[int, Any]] = [(0, None) for _ in fns]
        skip = int(not barrier_each)
        if self.is_cuda and not barrier_each:
            self._flush()
        for call in range(self.plan["iters"] + skip):
            index = call % num_inputs
            for turn in range(len(fns)):
                which = (call + turn) % len(fns)
                if barrier_each:
                    self.barrier()
                if self.is_cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                t0 = time.perf_counter()
                out = fns[which](index)
                host[which].append(time.perf_counter() - t0)
                if self.is_cuda:
                    end.record()
                    events[which].append((start, end))
                    last[which] = (index, out)
                elif checks[which] is not None:
                    problems += checks[which](index, out)
                del out
        if self.is_cuda:
            self.sync()
            problems += [p for check, (index, out) in zip(checks, last) if check is not None
                         for p in check(index, out)]
        series = []
        for which in range(len(fns)):
            elapsed = host[which]
            if self.is_cuda:
                elapsed = [start.elapsed_time(end) / 1e3 for start, end in events[which]]
            series.append((elapsed[skip:], host[which][skip:]))
        return series

    def _profile_series(self, fns: List[Callable[[int], Any]], num_inputs: int) -> List[List[list]]:
        """For each of `fns`, where its host time goes: `iters` more calls (taking turns as timed) under
        cProfile, one profiler per function; returns for each its functions taking the most own time, as
        [name, own microseconds per call, calls per call], the first entry the whole call ("total")."""
        import cProfile
        import pstats
        profilers = [cProfile.Profile() for _ in fns]
        iters = self.plan["iters"]
        for call in range(iters):
            for turn in range(len(fns)):
                which = (call + turn) % len(fns)
                profilers[which].enable()
                fns[which](call % num_inputs)
                self.sync()
                profilers[which].disable()
        tables = []
        for profiler in profilers:
            stats = pstats.Stats(profiler).stats
            rows = sorted(((_function_name(where), own, calls) for where, (_, calls, own, _, _) in stats.items()),
                          key=lambda row: -row[1])
            total = sum(row[1] for row in rows)
            tables.append([["total", total / iters * 1e6, 1.0]] +
                          [[name, own / iters * 1e6, calls / iters] for name, own, calls in rows[:12]])
        return tables

    def _count_tensor_ops(self, fn: Callable[[], Any]) -> int:
        """How many tensor operations (torch's ATen operators, views and collectives included) one call of `fn`
        makes on this rank: each costs a trip through torch's dispatcher on the host."""
        from torch.utils._python_dispatch import TorchDispatchMode

        class Counter(TorchDispatchMode):
            count = 0

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                Counter.count += 1
                return func(*args, **(kwargs or {}))
        with Counter():
            fn()
        self.sync()
        return Counter.count

    def _tensor_op_times(self, fn: Callable[[int], Any], num_inputs: int, top: int = 10) -> List[list]:
        """Where the host time of `iters` more calls of `fn` goes by tensor operation (torch.profiler's self CPU
        time of each ATen operator, collectives as the operator that starts them, not their wait): [name, own
        microseconds per call, calls per call] of the `top` costliest, the first entry their sum over all
        operators ("total"). The calls run back to back, not taking turns with another function."""
        from torch.profiler import ProfilerActivity, profile
        iters = self.plan["iters"]
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            for call in range(iters):
                fn(call % num_inputs)
            self.sync()
        rows = sorted(((event.key, event.self_cpu_time_total / iters, event.count / iters)
                       for event in profiler.key_averages()), key=lambda row: -row[1])
        return [["total", sum(row[1] for row in rows), 1.0]] + [list(row) for row in rows[:top]]

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
        device_events = [e for e in prof.events() if e.device_type == DeviceType.CUDA and not is_flush(e.name)]
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



def _function_name(where: Tuple[str, int, str]) -> str:
    """A cProfile entry's function: `module.py:line name`, or the built-in's name."""
    path, line, name = where
    if path == "~":
        return name
    return f"{path.rsplit('/', 1)[-1]}:{line} {name}"


def is_flush(name: str) -> bool:
    """The marked L2 flush's kernel (see RankContext._flush)."""
    return "neg_kernel" in name


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepEP's similarity measure: 1 - 2 sum((x+1)(y+1)) / sum((x+1)^2 + (y+1)^2), in float64."""
    x, y = x.double() + 1, y.double() + 1
    denominator = (x * x + y * y).sum()
    return float(1 - 2 * (x * y).sum() / denominator)


def random_routing(gen: torch.Generator, num_tokens: int, num_topk: int, num_experts: int, device: torch.device
             ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Distinct top-k experts per token, a few selections dropped (-1) and the last token sent nowhere."""
    from ..config import topk_idx_t
    scores = torch.randn(num_tokens, num_experts, generator=gen).abs() + 1
    topk_idx = scores.topk(num_topk, dim=1).indices.to(topk_idx_t)
    flat = topk_idx.view(-1)
    flat[torch.randperm(flat.numel(), generator=gen)[:max(1, flat.numel() // 64)]] = -1
    if num_tokens > 1:
        topk_idx[-1] = -1
    topk_weights = torch.randn(num_tokens, num_topk, generator=gen).abs().float()
    return topk_idx.to(device), topk_weights.to(device)


def same_output(got: Any, expected: Any) -> bool:
    """Bit for bit equal: two tensors, or two tuples of them (FP8 rows and their scales)."""
    if isinstance(expected, (tuple, list)):
        return isinstance(got, (tuple, list)) and len(got) == len(expected) and \
            all(same_output(g, e) for g, e in zip(got, expected))
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape or got.dtype != expected.dtype:
        return False
    as_int = _INT_OF_SIZE[got.element_size()]
    return torch.equal(got.contiguous().view(as_int), expected.contiguous().view(as_int))


def median_us(times: Sequence[float]) -> float:
    return statistics.median(times) * 1e6


def record(results: Dict[str, Any], name: str, times: Dict[str, List[float]], nbytes: Optional[int],
            baseline_times: Optional[Dict[str, List[float]]] = None, link_bytes: Optional[int] = None) -> None:
    results[name] = dict(time_us=median_us(times["streamed"]),
                         isolated_us=median_us(times["isolated"]) if times["isolated"] else None,
                         host_us=median_us(times["host"]) if "host" in times else None,
                         kernel_us=median_us(times["kernel"]) if "kernel" in times else None,
                         kernels=times.get("kernels"), functions=times.get("functions"),
                         baseline_functions=baseline_times.get("functions") if baseline_times else None,
                         tensor_ops=times.get("tensor_ops"), tensor_op_times=times.get("tensor_op_times"),
                         baseline_tensor_op_times=baseline_times.get("tensor_op_times") if baseline_times else None,
                         baseline_tensor_ops=baseline_times.get("tensor_ops") if baseline_times else None,
                         bytes=nbytes, link_bytes=link_bytes,
                         baseline_time_us=median_us(baseline_times["streamed"]) if baseline_times else None)
