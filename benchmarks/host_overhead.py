"""Host cost of deep_ep calls: how long the host takes to enqueue one call, per operation (calls back to
back; none of them waits for the GPU), and where that time goes (cProfile of rank 0).

  python benchmarks/host_overhead.py [--calls 50] [--profile] [--transport nvlink]

Needs 2 GPUs. DeepSeek training shape (4096 tokens, hidden 7168, top-8, 256 experts). A call's host time
is hidden behind the GPU when it is shorter than the GPU time of the call before it; the benchmark's
"isolated" column pays all of it.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PROFILED = ("get_dispatch_layout", "cached dispatch BF16", "combine")


def _worker(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda", rank))
    import deep_ep
    from deep_ep.fp8 import per_token_cast_to_fp8
    T, H, K, E = 4096, 7168, 8, 256
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda()
    topk_idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices.to(deep_ep.topk_idx_t).cuda()
    weights = torch.rand(T, K, generator=gen).cuda()
    x_fp8 = per_token_cast_to_fp8(x)
    config = deep_ep.Buffer.get_dispatch_config(2)
    nvl_bytes = config.get_nvl_buffer_size_hint(H * 2, 2)
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
    for fn in ops.values():
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    lines = [f"host time per call, {args.calls} calls back to back (transport {buffer.transport_name}):"]
    for name, fn in ops.items():
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.calls):
            fn()
        host_us = (time.perf_counter() - start) / args.calls * 1e6
        torch.cuda.synchronize()
        lines.append(f"  {name:28s} {host_us:8.1f} us")
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
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--profile", action="store_true", help="also print a cProfile of rank 0")
    parser.add_argument("--transport", default="auto")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(args, port), nprocs=2)


if __name__ == "__main__":
    main()
