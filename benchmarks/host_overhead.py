"""Host cost of deep_ep calls: how long the host takes to enqueue one call, per operation (calls back to
back; none of them waits for the GPU), and where that time goes (cProfile of rank 0).

  python benchmarks/host_overhead.py [--calls 50] [--profile] [--breakdown] [--transport nvlink] [--ranks 2]

--breakdown times the layers of each call (the Buffer's checks, the comm-stream handling, the transport,
its kernel launches) with a timer around each, which costs far less than cProfile's per-function hooks.

Normal mode at the DeepSeek training shape (4096 tokens, hidden 7168, top-8, 256 experts) and low-latency
mode at the decode shape (128 tokens, top-8, 288 experts), eager calls. A call's host time is hidden
behind the GPU when it is shorter than the GPU time of the call before it; the benchmark's "isolated"
column pays all of it. Ranks default to the GPUs (at most 2), one per GPU; with one GPU a single rank
(every row stays local, which changes the GPU time, not the host's work per call).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# (owner, attribute) of the layers --breakdown times: each call's time includes the layers below it
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
    """Wraps the functions of LAYERS with timers; `totals` maps 'owner.name' to (calls, ns)."""

    def __init__(self) -> None:
        import importlib
        self.totals = {}
        for owner, names in LAYERS:
            module, _, cls = owner.partition(":")
            target = importlib.import_module(module)
            target = getattr(target, cls) if cls else target
            for name in names:
                setattr(target, name, self._timed(f"{cls or module.rsplit('.', 1)[-1]}.{name}",
                                                  getattr(target, name)))

    def _timed(self, label, fn):
        totals = self.totals

        def timed(*args, **kwargs):
            start = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                calls, ns = totals.get(label, (0, 0))
                totals[label] = (calls + 1, ns + time.perf_counter_ns() - start)
        return timed

    def report(self, calls: int):
        """'layer: us per operation call' for the layers that ran, then clear."""
        out = [f"{label} {ns / calls / 1e3:.1f} ({count / calls:g}x)" for label, (count, ns) in self.totals.items()]
        self.totals.clear()
        return "; ".join(out)


def _worker(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    R = args.ranks
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    if R <= torch.cuda.device_count():
        dist.init_process_group("nccl", rank=rank, world_size=R, device_id=device)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=R)
    import deep_ep
    from deep_ep.fp8 import per_token_cast_to_fp8
    layers = _Layers() if args.breakdown else None
    T, H, K, E = 4096, 7168, 8, 256
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda()
    topk_idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices.to(deep_ep.topk_idx_t).cuda()
    weights = torch.rand(T, K, generator=gen).cuda()
    x_fp8 = per_token_cast_to_fp8(x)
    config = deep_ep.Buffer.get_dispatch_config(R)
    nvl_bytes = config.get_nvl_buffer_size_hint(H * 2, R)
    buffer = deep_ep.Buffer(dist.group.WORLD, nvl_bytes, 0, transport=args.transport, explicitly_destroy=True)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  topk_idx=topk_idx, topk_weights=weights)
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, **layout)
    worst = T * 2
    ops = {
        "get_dispatch_layout": lambda: buffer.get_dispatch_layout(topk_idx, E),
        "cached dispatch BF16": lambda: buffer.dispatch(x, handle=handle),
        "cached dispatch FP8": lambda: buffer.dispatch(x_fp8, handle=handle),
        "combine": lambda: buffer.combine(recv_x, handle),
        "dispatch num_worst_tokens": lambda: buffer.dispatch(x, num_worst_tokens=worst, **layout),
    }
    # low-latency mode: its own Buffer, decode shape
    N, E_LL = 128, 288
    ll_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(N, H, R, E_LL)
    ll_buffer = deep_ep.Buffer(dist.group.WORLD, 0, ll_bytes, low_latency_mode=True, num_qps_per_rank=E_LL // R,
                               transport=args.transport, explicitly_destroy=True)
    ll_x = x[:N].contiguous()
    ll_idx = torch.rand(N, E_LL, generator=gen).topk(K, dim=1).indices.to(deep_ep.topk_idx_t).cuda()
    ll_weights = weights[:N].contiguous()
    ll_recv, _, ll_handle, _, _ = ll_buffer.low_latency_dispatch(ll_x, ll_idx, N, E_LL, use_fp8=False)
    ll_out = torch.randn(ll_recv.shape, generator=gen).to(torch.bfloat16).cuda()
    ops["low_latency_dispatch FP8"] = lambda: ll_buffer.low_latency_dispatch(ll_x, ll_idx, N, E_LL, use_fp8=True)
    ops["low_latency_combine"] = lambda: ll_buffer.low_latency_combine(ll_out, ll_idx, ll_weights, ll_handle)
    for fn in ops.values():
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    lines = [f"{R} rank(s), transport {buffer.transport_name}; {args.calls} calls back to back; host: time to enqueue "
             "a call; events: median GPU time between events around each call (the benchmark's headline method)",
             f"  {'operation':28s} {'host us':>8s} {'events us':>10s}"]
    for name, fn in ops.items():
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.calls):
            fn()
        host_us = (time.perf_counter() - start) / args.calls * 1e6
        torch.cuda.synchronize()
        dist.barrier()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(args.calls)]
        for begin, end in events:
            begin.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        event_us = statistics.median(begin.elapsed_time(end) * 1e3 for begin, end in events)
        lines.append(f"  {name:28s} {host_us:8.1f} {event_us:10.1f}")
        if layers is not None:
            layers.totals.clear()
            dist.barrier()
            for _ in range(args.calls):
                fn()
            lines.append(f"    layers, us per call: {layers.report(args.calls)}")
            torch.cuda.synchronize()
        if args.profile and name in PROFILED:
            # every rank repeats the calls (their kernels wait for each other); rank 0 profiles them
            dist.barrier()
            profile = cProfile.Profile() if rank == 0 else None
            if profile is not None:
                profile.enable()
            for _ in range(args.calls):
                fn()
            if profile is not None:
                profile.disable()
                text = io.StringIO()
                pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(22)
                lines.append(f"--- cProfile of {name}, by own time ---")
                lines.extend(line for line in text.getvalue().splitlines()[6:] if line.strip())
            torch.cuda.synchronize()
    if rank == 0:
        print("\n".join(lines), flush=True)
    torch.cuda.synchronize()
    dist.barrier()
    buffer.destroy()
    ll_buffer.destroy()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--profile", action="store_true", help="also print a cProfile of rank 0")
    parser.add_argument("--breakdown", action="store_true", help="also time the layers of each call (rank 0's)")
    parser.add_argument("--transport", default="auto")
    parser.add_argument("--ranks", type=int, default=min(2, torch.cuda.device_count()),
                        help="processes (placed round-robin on the GPUs; gloo group when they share GPUs)")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(args, port), nprocs=args.ranks)


if __name__ == "__main__":
    main()
