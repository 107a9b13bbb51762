"""Host cost of eager deep_ep calls: how long the host takes to enqueue one call while the GPU is still busy
with earlier work (so the host never waits for it), per operation and call flags; and, for a non-cached
dispatch (whose host waits for the received counts), the GPU's idle gap between the end of the copy or kernel
that brings the counts to the host and the start of the dispatch kernel, read from a profiler trace.

  python benchmarks/host_overhead.py [--ranks 1 2 4] [--calls 200] [--transport nvlink] [--against TREE]
                                     [--rounds N] [--json FILE] [--commit HASH] [--breakdown] [--profile]
                                     [--operations NAME ...]

Shapes: normal mode at the DeepSeek training shape (4096 tokens, hidden 7168, top-8, 256 experts),
low-latency mode at the decode shape (128 tokens, hidden 7168, top-8, 288 experts). Ranks share the GPUs
round-robin (a gloo group when they share one). Each timed call gets fresh inputs: one of five input sets,
copied into one of three buffers before the call (outside the timed span), so a buffer holds new contents
at every use; the outputs of the last calls are compared with those of untimed calls on the same inputs.
Before every batch of calls a sleep kernel keeps the GPU busy for longer than the batch takes to enqueue; the
first batch of each operation and form is not timed (the caching allocator's pools grow to what the batches
hold in flight).
Figure: the median over the timed calls of rank 0's host time per call, in microseconds.

--against TREE runs every measurement also with the package in TREE (a directory holding `deep_ep`, e.g. an
earlier commit's `git archive`), in the same process order, and prints the ratio this tree / TREE.
--rounds N repeats the whole measurement N times (with --against: this tree, then TREE, in turn), each in new
processes; a row's figure is then the median of the rounds' figures, its ratio the median of the rounds' ratios,
shown with their range (a machine's drift between processes moves rows of unchanged code by up to 1.5x).
--breakdown times the layers of each call with a timer around each (far cheaper than cProfile's hooks);
--profile prints a cProfile of rank 0 for a few operations.
"""
from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import os
import platform
import pstats
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
T, H, K, E = 4096, 7168, 8, 256          # normal mode
N, E_LL = 128, 288                       # low-latency mode
INPUT_SETS, BUFFERS, BATCH = 5, 3, 50
GAP_CALLS = 30
IDLE_GAP = "non-cached dispatch: GPU idle after the counts"   # (the row read from a profiler trace)
# the limits, us per call (None: no limit for that row)
LIMITS = {"get_dispatch_layout": 25, "cached dispatch BF16": 30, "cached dispatch FP8": 30, "combine": 30,
          "dispatch num_worst_tokens": 40, "low_latency_dispatch FP8": 25, "low_latency_dispatch BF16": 25,
          "low_latency_combine": 25, "receive hook (dispatch)": None, "receive hook (combine)": None,
          IDLE_GAP: 40}
# (owner, attributes) of the layers --breakdown times: each call's time includes the layers below it
LAYERS = (("deep_ep.buffer:Buffer", ("get_dispatch_layout", "dispatch", "combine", "low_latency_dispatch",
                                     "low_latency_combine")),
          ("deep_ep.streams:CommStream", ("run",)),
          ("deep_ep.transport.nvlink.normal:NVLinkNormal", ("get_dispatch_layout", "dispatch", "cached_dispatch",
                                                            "combine", "_run_dispatch", "_plan", "_begin")),
          ("deep_ep.transport.nvlink.low_latency:NVLinkLowLatency", ("dispatch", "combine")),
          ("deep_ep.transport.nvlink.launcher:Relaunch", ("__call__",)))
PROFILED = ("get_dispatch_layout", "cached dispatch BF16", "combine", "low_latency_dispatch FP8",
            "low_latency_combine")


class _Layers:
    """Wraps the functions of LAYERS that exist with timers; `totals` maps 'owner.name' to (calls, ns)."""

    def __init__(self) -> None:
        import importlib
        self.totals: Dict[str, Any] = {}
        for owner, names in LAYERS:
            module, _, cls = owner.partition(":")
            try:
                target = getattr(importlib.import_module(module), cls)
            except (ImportError, AttributeError):
                continue
            for name in names:
                if hasattr(target, name):
                    setattr(target, name, self._timed(f"{cls}.{name}", getattr(target, name)))

    def _timed(self, label: str, fn: Callable) -> Callable:
        totals = self.totals

        def timed(*args, **kwargs):
            start = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                calls, ns = totals.get(label, (0, 0))
                totals[label] = (calls + 1, ns + time.perf_counter_ns() - start)
        return timed

    def report(self, calls: int) -> str:
        """'layer: us per operation call' for the layers that ran, then clear."""
        out = [f"{label} {ns / calls / 1e3:.1f} ({count / calls:g}x)" for label, (count, ns) in self.totals.items()]
        self.totals.clear()
        return "; ".join(out)


class _Op:
    """One timed operation. `call(inputs, kwargs)` is the Buffer call, returning what the Buffer returns;
    `inputs[s]` is input set s, as the call takes it; `outputs(result)` gives the output tensors to compare,
    once the call (and its receive hook) has completed."""

    def __init__(self, name: str, call: Callable, inputs: List[Any], flags: List[str],
                 outputs: Callable[[Any], List[torch.Tensor]], hook: Optional[str] = None) -> None:
        self.name, self.call, self.inputs, self.flags = name, call, inputs, flags
        self.outputs, self.hook = outputs, hook


def _event_and_hook(result: Tuple[Any, ...]) -> Tuple[Any, Any]:
    """The EventOverlap of a call's result (None if it has none or holds no event) and its receive hook."""
    event = hook = None
    for item in result:
        if type(item).__name__ == "EventOverlap":
            event = item if item.event is not None else None
        elif callable(item) and not isinstance(item, torch.Tensor):
            hook = item
    return event, hook


def _tensors(value: Any) -> List[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple):
        return tuple(_clone(item) for item in value)
    return value


def _copy(dst: Any, src: Any) -> None:
    for d, s in zip(_tensors(dst), _tensors(src)):
        d.copy_(s)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.bool else t


def _same(a: List[torch.Tensor], b: List[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(_bits(x), _bits(y)) for x, y in zip(a, b))


def _flag_kwargs(flag: str) -> Dict[str, Any]:
    import deep_ep
    if flag == "sync":
        return {}
    if flag == "async_finish":
        return dict(async_finish=True)
    if flag == "return_recv_hook":
        return dict(return_recv_hook=True)
    kwargs: Dict[str, Any] = dict(previous_event=deep_ep.Buffer.capture(), async_finish=True)
    if flag == "previous_event+allocate_on_comm_stream":
        kwargs["allocate_on_comm_stream"] = True
    return kwargs


NORMAL_FLAGS = ["sync", "async_finish", "previous_event", "previous_event+allocate_on_comm_stream"]
LL_FLAGS = ["sync", "async_finish", "return_recv_hook"]


def _busy(seconds: float) -> None:
    """Keep the current stream busy for about `seconds` (a sleep kernel; the clock taken as 2 GHz, an
    over-estimate of the GPUs' clocks gives a shorter sleep, so the batches ask for plenty)."""
    torch.cuda._sleep(int(seconds * 2e9))


def _time_op(op: _Op, flag: str, calls: int) -> Dict[str, Any]:
    """Median host time per call (this rank's), whether the outputs of the last calls equal those of untimed
    calls on the same inputs, and for hook mode the hook's median host time."""
    buffers = [_clone(op.inputs[0]) for _ in range(BUFFERS)]
    expected = []
    for s in range(INPUT_SETS):   # untimed calls: the outputs each input set gives
        _copy(buffers[0], op.inputs[s])
        result = op.call(buffers[0], {})
        torch.cuda.synchronize()
        expected.append([t.clone() for t in op.outputs(result)])
    torch.cuda.synchronize()
    times: List[int] = []
    hook_times: List[int] = []
    kept = []
    events: List[Any] = [None] * BUFFERS   # the asynchronous call that last read each buffer
    # a first batch untimed: the allocator's pools reach the size the batches need (e.g. the comm stream's, the
    # first time a flag form allocates there, while the busy GPU keeps the earlier calls' blocks pending)
    for start in range(-BATCH, calls, BATCH):
        dist.barrier()
        _busy(0.1)
        if start == 0:
            times.clear()
            hook_times.clear()
        for i in range(start, min(calls, start + BATCH)):
            b = i % BUFFERS
            if events[b] is not None:
                events[b].current_stream_wait()   # (its call may still read the buffer)
            _copy(buffers[b], op.inputs[i % INPUT_SETS])
            kwargs = _flag_kwargs(flag)
            begin = time.perf_counter_ns()
            result = op.call(buffers[b], kwargs)
            times.append(time.perf_counter_ns() - begin)
            events[b], hook = _event_and_hook(result)
            if hook is not None:
                begin = time.perf_counter_ns()
                hook()
                hook_times.append(time.perf_counter_ns() - begin)
            if i >= calls - INPUT_SETS:
                kept.append((i % INPUT_SETS, result))
        torch.cuda.synchronize()
    checked = all(_same(op.outputs(result), expected[s]) for s, result in kept)
    measured = dict(host_us=statistics.median(times) / 1e3, checked=checked)
    if hook_times:
        measured["hook_us"] = statistics.median(hook_times) / 1e3
    return measured


def _idle_gap(buffer: Any, x: torch.Tensor, layout: Dict[str, Any], rank: int) -> Optional[float]:
    """Median GPU idle time before the dispatch kernel of a non-cached dispatch, over GAP_CALLS calls (rank 0's
    trace): from the end of the GPU work before it, which brings the counts to the host (a device-to-host copy,
    or a kernel writing them into pinned memory), to its start."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        for _ in range(GAP_CALLS):
            buffer.dispatch(x, **layout)
        torch.cuda.synchronize()
    if rank:
        return None
    path = f"/tmp/deep_ep_host_overhead_{os.getpid()}.json"
    trace.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    os.unlink(path)
    gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                 key=lambda e: e["ts"])
    gaps = []
    for i, event in enumerate(gpu):
        if i and event["cat"] == "kernel" and "dispatch" in event["name"] and "notify" not in event["name"]:
            gaps.append(event["ts"] - max(e["ts"] + e["dur"] for e in gpu[:i]))
    return statistics.median(gaps) if gaps else None


def _worker(rank: int, args: argparse.Namespace, port: int, tree: Optional[str], out: str) -> None:
    if tree:
        sys.path.insert(0, tree)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    R = args.num_ranks
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    if R <= torch.cuda.device_count():
        dist.init_process_group("nccl", rank=rank, world_size=R, device_id=device)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=R)
    import deep_ep
    from deep_ep.fp8 import per_token_cast_to_fp8
    layers = _Layers() if args.breakdown else None
    gen = torch.Generator().manual_seed(rank)
    xs = [torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda() for _ in range(INPUT_SETS)]
    topk_idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices.to(deep_ep.topk_idx_t).cuda()
    idx_sets = [torch.rand(T, E, generator=gen).topk(K, dim=1).indices.to(deep_ep.topk_idx_t).cuda()
                for _ in range(INPUT_SETS)]
    weights = torch.rand(T, K, generator=gen).cuda()
    config = deep_ep.Buffer.get_dispatch_config(R)
    nvl_bytes = config.get_nvl_buffer_size_hint(H * 2, R)
    buffer = deep_ep.Buffer(dist.group.WORLD, nvl_bytes, 0, transport=args.transport, explicitly_destroy=True)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  topk_idx=topk_idx, topk_weights=weights)
    recv_x, _, _, _, handle, _ = buffer.dispatch(xs[0], **layout)
    recv_sets = [torch.randn(recv_x.shape, generator=gen).to(torch.bfloat16).cuda() for _ in range(INPUT_SETS)]
    fp8_sets = [per_token_cast_to_fp8(x) for x in xs]

    num_recv = recv_x.shape[0]

    def normal_outputs(keep: Tuple[int, ...], rows: Optional[int] = None):
        return lambda result: [t[:rows] if rows is not None else t for i in keep for t in _tensors(result[i])]

    ops = [
        _Op("get_dispatch_layout", lambda idx, kw: buffer.get_dispatch_layout(idx, E, **kw), idx_sets, NORMAL_FLAGS,
            normal_outputs((0, 2, 3))),
        _Op("cached dispatch BF16", lambda x, kw: buffer.dispatch(x, handle=handle, **kw), xs, NORMAL_FLAGS,
            normal_outputs((0,))),
        _Op("cached dispatch FP8", lambda x, kw: buffer.dispatch(x, handle=handle, **kw), fp8_sets, NORMAL_FLAGS,
            normal_outputs((0,))),
        _Op("combine", lambda x, kw: buffer.combine(x, handle, **kw), recv_sets, NORMAL_FLAGS, normal_outputs((0,))),
        _Op("dispatch num_worst_tokens", lambda x, kw: buffer.dispatch(x, num_worst_tokens=T * R, **layout, **kw),
            xs, NORMAL_FLAGS, normal_outputs((0, 1, 2), rows=num_recv)),
    ]
    ll_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(N, H, R, E_LL)
    ll_buffer = deep_ep.Buffer(dist.group.WORLD, 0, ll_bytes, low_latency_mode=True, num_qps_per_rank=E_LL // R,
                               transport=args.transport, explicitly_destroy=True)
    ll_xs = [x[:N].contiguous() for x in xs]
    ll_idx = torch.rand(N, E_LL, generator=gen).topk(K, dim=1).indices.to(deep_ep.topk_idx_t).cuda()
    ll_weights = weights[:N].contiguous()
    ll_recv, _, ll_handle, _, _ = ll_buffer.low_latency_dispatch(ll_xs[0], ll_idx, N, E_LL, use_fp8=False)
    ll_outs = [torch.randn(ll_recv.shape, generator=gen).to(torch.bfloat16).cuda() for _ in range(INPUT_SETS)]

    def ll_dispatch_outputs(result):   # the received rows of each expert (the rest of its region is not written)
        recv, counts = result[0], result[1].tolist()
        return [t[e, :c] for t in _tensors(recv) for e, c in enumerate(counts)]

    ops += [
        _Op("low_latency_dispatch FP8", lambda x, kw: ll_buffer.low_latency_dispatch(x, ll_idx, N, E_LL, use_fp8=True,
                                                                                     **kw),
            ll_xs, LL_FLAGS, ll_dispatch_outputs, "dispatch"),
        _Op("low_latency_dispatch BF16", lambda x, kw: ll_buffer.low_latency_dispatch(x, ll_idx, N, E_LL,
                                                                                      use_fp8=False, **kw),
            ll_xs, LL_FLAGS, ll_dispatch_outputs, "dispatch"),
        _Op("low_latency_combine", lambda y, kw: ll_buffer.low_latency_combine(y, ll_idx, ll_weights, ll_handle,
                                                                               **kw),
            ll_outs, LL_FLAGS, lambda result: [result[0]], "combine")]
    records = []
    for op in ops:
        if args.operations and op.name not in args.operations:
            continue
        for flag in op.flags:
            measured = _time_op(op, flag, args.calls)
            ok = torch.tensor([int(measured["checked"])], device=device)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            records.append(dict(operation=op.name, flags=flag, host_us=measured["host_us"], checked=bool(ok.item())))
            if "hook_us" in measured:
                records.append(dict(operation=f"receive hook ({op.hook})", flags=flag, host_us=measured["hook_us"],
                                    checked=bool(ok.item())))
            if layers is not None and flag == "sync":
                layers.totals.clear()
                dist.barrier()
                _busy(0.1)
                for _ in range(BATCH):
                    op.call(op.inputs[0], {})
                records[-1]["layers"] = layers.report(BATCH)
                torch.cuda.synchronize()
            if args.profile and flag == "sync" and op.name in PROFILED:
                records[-1]["profile"] = _profile(op, rank)
    if not args.operations or IDLE_GAP in args.operations:
        records.append(dict(operation=IDLE_GAP, flags="sync", host_us=_idle_gap(buffer, xs[0], layout, rank),
                            checked=True))
    torch.cuda.synchronize()
    dist.barrier()
    buffer.destroy()
    ll_buffer.destroy()
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(dict(records=records, package=str(Path(deep_ep.__file__).parent))))


def _profile(op: _Op, rank: int) -> str:
    """A cProfile of rank 0's calls (every rank repeats them: their kernels wait for each other): the functions
    with the most own time, in us per operation call."""
    dist.barrier()
    _busy(0.1)
    profile = cProfile.Profile() if rank == 0 else None
    if profile is not None:
        profile.enable()
    for _ in range(BATCH):
        op.call(op.inputs[0], {})
    if profile is not None:
        profile.disable()
    torch.cuda.synchronize()
    if profile is None:
        return ""
    rows = sorted(pstats.Stats(profile).stats.items(), key=lambda item: -item[1][2])[:20]
    lines = [f"{'own us':>8s} {'total us':>9s} {'calls':>6s}  function (per operation call)"]
    for (path, line, name), (_, calls, own, total, _) in rows:
        where = f"{Path(path).name}:{line}({name})" if line else name
        lines.append(f"{own / BATCH * 1e6:8.2f} {total / BATCH * 1e6:9.2f} {calls / BATCH:6.1f}  {where}")
    return "\n".join(lines)


def _measure(args: argparse.Namespace, ranks: int, tree: Optional[str]) -> Dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args.num_ranks = ranks
    with tempfile.TemporaryDirectory() as scratch:   # (rank 0 writes its records there)
        out = Path(scratch) / "records.json"
        mp.spawn(_worker, args=(args, port, tree, str(out)), nprocs=ranks)
        return json.loads(out.read_text())


def _versions() -> Dict[str, str]:
    import triton
    return dict(python=platform.python_version(), torch=torch.__version__, triton=triton.__version__,
                gpu=torch.cuda.get_device_name(0))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="timed calls per operation and flags")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1], help="rank counts (processes sharing the GPUs)")
    parser.add_argument("--transport", default="nvlink")
    parser.add_argument("--against", help="a directory holding an earlier `deep_ep` to time in the same run")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the measurement (see above)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--commit", help="the commit the JSON names (default: git rev-parse --short HEAD)")
    parser.add_argument("--breakdown", action="store_true", help="also time the layers of each call (rank 0's)")
    parser.add_argument("--profile", action="store_true", help="also print a cProfile of rank 0")
    parser.add_argument("--operations", nargs="+", choices=[name for name in LIMITS if not name.startswith("receive")],
                        metavar="NAME", help="time only these rows (names as in the table; default: all)")
    args = parser.parse_args()
    versions = _versions()
    print(" ".join(f"{k} {v}" for k, v in versions.items()), flush=True)
    rows: List[Dict[str, Any]] = []
    for ranks in args.ranks:   # each rank count's table (and the JSON so far) as soon as it is measured
        ours, theirs = [], []
        for _ in range(args.rounds):
            ours.append(_measure(args, ranks, None)["records"])
            if args.against:
                theirs.append(_measure(args, ranks, args.against)["records"])
        measured = [_row(ranks, [records[i] for records in ours], [records[i] for records in theirs])
                    for i in range(len(ours[0]))]
        for record in ours[0]:
            for extra in ("layers", "profile"):
                if record.get(extra):
                    print(f"--- {extra}: {record['operation']} ({ranks} ranks) ---\n{record[extra]}")
        _print_table(measured, args)
        rows += measured
        if args.json:
            _write_json(rows, args, versions)
    failed = [r for r in rows if not r["checked"]]
    if failed:
        print(f"outputs differ from untimed calls on the same inputs: {len(failed)} row(s)")
    return 1 if failed else 0


def _median(values: List[Optional[float]]) -> Optional[float]:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _row(ranks: int, rounds: List[Dict[str, Any]], against: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One table row from a record of each round (and of each round of the tree --against names)."""
    first = rounds[0]
    row = dict(ranks=ranks, operation=first["operation"], flags=first["flags"],
               host_us=_median([r["host_us"] for r in rounds]), checked=all(r["checked"] for r in rounds))
    if len(rounds) > 1:
        row["rounds_us"] = [r["host_us"] for r in rounds]
    if against:
        assert all((o["operation"], o["flags"]) == (first["operation"], first["flags"]) for o in against)
        row["against_us"] = _median([o["host_us"] for o in against])
        row["against_checked"] = all(o["checked"] for o in against)
        ratios = [r["host_us"] / o["host_us"] for r, o in zip(rounds, against) if r["host_us"] and o["host_us"]]
        row["ratio"] = statistics.median(ratios) if ratios else None
        if len(rounds) > 1:
            row["against_rounds_us"] = [o["host_us"] for o in against]
            row["ratios"] = ratios
    return row


def _print_table(rows: List[Dict[str, Any]], args: argparse.Namespace) -> None:
    rounds = f", median of {args.rounds} rounds" if args.rounds > 1 else ""
    print(f"\nhost time per eager call, us (median of {args.calls} calls, rank 0; GPU kept busy{rounds})"
          + (f"; 'before': {args.against}" if args.against else ""), flush=True)
    head = f"{'ranks':>5s} {'operation':46s} {'flags':38s} {'us':>7s}"
    spread = args.against and args.rounds > 1
    print(head + (f" {'before':>7s} {'ratio':>6s}" if args.against else "") + (f" {'range':>11s}" if spread else "")
          + f" {'limit':>6s}")
    for r in rows:
        line = f"{r['ranks']:5d} {r['operation']:46s} {r['flags']:38s} {_fmt(r['host_us'])}"
        if args.against:
            ratio = r["ratio"]
            line += f" {_fmt(r['against_us'])} {'' if ratio is None else f'{ratio:6.2f}':>6s}"
        if spread:
            ratios = r.get("ratios") or []
            line += f" {f'{min(ratios):.2f}-{max(ratios):.2f}' if ratios else '-':>11s}"
        limit = LIMITS.get(r["operation"])
        print(line + f" {'' if limit is None else limit:>6}" + ("" if r["checked"] else "  OUTPUT MISMATCH"), flush=True)


def _write_json(rows: List[Dict[str, Any]], args: argparse.Namespace, versions: Dict[str, str]) -> None:
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, stdout=subprocess.PIPE,
                                           stderr=subprocess.DEVNULL, text=True).stdout.strip()
    args.json.write_text(json.dumps(dict(
        figure="host time per eager call (median, rank 0, GPU kept busy), us; the idle-gap row: GPU idle us",
        date=datetime.date.today().isoformat(), commit=commit, against=args.against, **versions,
        command="python benchmarks/host_overhead.py " + " ".join(sys.argv[1:]), calls=args.calls,
        rounds=args.rounds, records=rows), indent=1) + "\n")


def _fmt(value: Optional[float]) -> str:
    return f"{value:7.1f}" if value is not None else f"{'-':>7s}"


if __name__ == "__main__":
    sys.exit(main())
