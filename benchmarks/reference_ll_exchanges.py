"""The reference transport's two low-latency exchanges against each other: the counted one (rows sent as they
are selected, their counts with the header) and the fixed-size one (no host wait; what runs inside a CUDA graph
capture), CPU tensors on a gloo group. Calls of the two take turns; prints the median time per call of each
and their ratio, per operation.

  python benchmarks/reference_ll_exchanges.py [--ranks 2] [--tokens 64] [--hidden 1024] [--topk 8]
                                              [--experts 64] [--iters 100]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rank(rank: int, args: argparse.Namespace, port: int, results) -> None:
    from deep_ep import Buffer
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.ranks)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.ranks))
    N, H, K, E = args.tokens, args.hidden, args.topk, args.experts
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(N, H, generator=gen).to(torch.bfloat16)
    topk_idx = torch.rand(N, E, generator=gen).topk(K, dim=1).indices
    weights = torch.rand(N, K, generator=gen)
    buffer = Buffer(dist.group.WORLD, 0, Buffer.get_low_latency_rdma_size_hint(N, H, args.ranks, E),
                    low_latency_mode=True, num_qps_per_rank=E // args.ranks, transport="reference",
                    explicitly_destroy=True)
    transport = buffer._transport
    handles = {}
    for fixed in (False, True):
        transport.fixed_size_low_latency = fixed
        recv_x, _, handles[fixed], _, _ = buffer.low_latency_dispatch(x, topk_idx, N, E, use_fp8=False)
        handles[fixed] = (recv_x.clone(), handles[fixed])
    operations = {
        "dispatch FP8": lambda fixed: buffer.low_latency_dispatch(x, topk_idx, N, E, use_fp8=True),
        "dispatch BF16": lambda fixed: buffer.low_latency_dispatch(x, topk_idx, N, E, use_fp8=False),
        "combine BF16": lambda fixed: buffer.low_latency_combine(handles[fixed][0], topk_idx, weights,
                                                                 handles[fixed][1]),
    }
    times: Dict[str, Dict[bool, List[float]]] = {}
    for name, call in operations.items():
        times[name] = {False: [], True: []}
        for i in range(args.iters + 5):
            for fixed in ((False, True) if i % 2 else (True, False)):
                transport.fixed_size_low_latency = fixed
                dist.barrier()
                start = time.perf_counter()
                call(fixed)
                if i >= 5:
                    times[name][fixed].append(time.perf_counter() - start)
    if rank == 0:
        results.update({name: (statistics.median(t[False]), statistics.median(t[True])) for name, t in times.items()})
    dist.barrier()
    buffer.destroy()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--iters", type=int, default=100)
    args = parser.parse_args()
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(args, 29000 + os.getpid() % 2000, results), nprocs=args.ranks)
        print(f"{args.ranks} ranks, {args.tokens} tokens, hidden {args.hidden}, top-{args.topk}, {args.experts} "
              f"experts: median of {args.iters} calls each (a barrier before each), rank 0")
        print(f"{'operation':16s} {'counted us':>11s} {'fixed-size us':>14s} {'fixed / counted':>16s}")
        for name, (counted, fixed) in results.items():
            print(f"{name:16s} {counted * 1e6:11.1f} {fixed * 1e6:14.1f} {fixed / counted:16.2f}")


if __name__ == "__main__":
    main()
