"""Low-latency kernel times on one rank: each operation's kernels, from torch.profiler over
CUDA-graph replays of dispatch (FP8) + combine, and the replayed round trip timed with CUDA events (behind a
short GPU sleep, so that the graph's launch latency on the host is hidden, as behind a model's earlier work).

  python benchmarks/ll_kernel_times.py [--tokens 128 1] [--hidden 7168] [--topk 8] [--experts 288]

One GPU, one rank: every row goes to the rank itself, so this measures what the kernels and the graph
cost without NVLink (their floor on any number of GPUs), not the transfer. The kernels are summed per
operation by name (a name containing `dispatch` or `combine`), as DeepEP's and other profilers' scripts do.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from deep_ep import Buffer


def _time_one(buffer: Buffer, tokens: int, hidden: int, topk: int, experts: int, expert_out: torch.Tensor,
              replays: int) -> str:
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    topk_idx = torch.stack([torch.randperm(experts, device="cuda")[:topk] for _ in range(tokens)]).to(torch.int64)
    topk_weights = torch.rand(tokens, topk, device="cuda")
    num_max_tokens = expert_out.shape[1]

    def round_trip() -> None:
        _, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, num_max_tokens, experts, use_fp8=True)
        buffer.low_latency_combine(expert_out, topk_idx, topk_weights, handle)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(4):
            round_trip()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        round_trip()
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):   # timed before the profiler runs: its hooks add to every launch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(200_000)   # (~0.1 ms: the graph's launch is queued behind it, as in a model's decode step)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    # GPU time per replay of each operation's kernels (by name, as DeepEP's bench_kineto finds them) and of others
    per_op: dict = {}
    for event in prof.key_averages():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        op = next((name for name in ("dispatch", "combine") if name in event.key), event.key[:24].replace(" ", "_"))
        per_op[op] = per_op.get(op, 0.0) + event.device_time_total / replays
    return (f"{tokens:6d} {statistics.median(times):10.1f}  "
            + "  ".join(f"{name} {value:5.1f}" for name, value in sorted(per_op.items())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 1])
    parser.add_argument("--max-tokens", type=int, default=128, help="num_max_dispatch_tokens_per_rank")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=288)
    parser.add_argument("--replays", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ll_kernel_times.py needs a CUDA GPU")
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)   # one process: no network
    N, H, E = args.max_tokens, args.hidden, args.experts
    buffer = Buffer(dist.group.WORLD, 0, Buffer.get_low_latency_rdma_size_hint(N, H, 1, E), low_latency_mode=True,
                    num_qps_per_rank=E, explicitly_destroy=True)
    expert_out = torch.randn(E, N, H, device="cuda", dtype=torch.bfloat16)
    print(f"one rank, hidden {H}, top-{args.topk}, {E} experts, N {N}")
    print("tokens  graph us  kernel us per replay (graph: median of replays; kernels: mean, summed per operation)")
    try:
        for tokens in args.tokens:
            if not 0 < tokens <= N:
                raise SystemExit(f"--tokens: each must be in [1, {N}], got {tokens}")
            print(_time_one(buffer, tokens, H, args.topk, E, expert_out, args.replays), flush=True)
    finally:
        buffer.destroy()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
