"""What the low-latency kernels' fixed steps cost on one GPU, without rows: a kernel of 128 programs that runs
the transport's own synchronisation functions (deep_ep/transport/nvlink/sync.py) up to a given step, one rank.

  python benchmarks/ll_fixed_costs.py

Steps, cumulative: 0 nothing; 1 the send's wait for the buffer half (begin_send); 2 its arrival claim; 3 the
receive's wait for the arrivals; 4 a pass over every local expert's table of slot bits (load, count, fill,
clear: what the dispatch receive does before copying rows); 5 the receive's finish (every program adds its
share to RECEIVED). For each, the kernel time (torch.profiler over CUDA-graph replays) and, from the GPU's
global timer in every program, when each step ended (median and last program, us after the first program
started). One rank: every counter is local, so this is the floor of each step, not its cost across NVLink.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.profiler import ProfilerActivity, profile

from deep_ep.transport.nvlink.intrinsics import clock_ns, popcount
from deep_ep.transport.nvlink.sync import (RECEIVED_UNIT, begin_send, claim_arrival, finish_receive, send_share,
                                           wait_for_senders)

STEPS = ("half free", "claim", "wait", "tables", "finish")


@triton.jit
def _steps(bases_ptr, status_ptr, arrived_ptr, received_ptr, table_ptr, info_ptr, count_ptr, stamps_ptr, experts, RN,
           timeout_ns, LAST: tl.constexpr, SEND: tl.constexpr, BLOCK_RN: tl.constexpr):
    pid = tl.program_id(0)
    lanes = tl.arange(0, 1)
    tl.store(stamps_ptr + pid * 8, clock_ns())
    if SEND & (LAST >= 1):
        ranks, ok, bases = begin_send(bases_ptr, status_ptr, status_ptr, 0, 8, lanes, True, timeout_ns, status_ptr,
                                      1, False, False)
        tl.store(stamps_ptr + pid * 8 + 1, clock_ns())
        if LAST >= 2:
            claim_arrival(bases, ranks & ok, send_share(tl.num_programs(0)), 0, 0)
            tl.store(stamps_ptr + pid * 8 + 2, clock_ns())
    if LAST >= 3:
        ok, _ = wait_for_senders(arrived_ptr, received_ptr, status_ptr, status_ptr, status_ptr, tl.num_programs(0),
                                 timeout_ns, status_ptr, 4, 1, False, False, False, 1)
        tl.store(stamps_ptr + pid * 8 + 3, clock_ns())
    if LAST >= 4:
        jo = tl.arange(0, BLOCK_RN)
        for e in range(pid, experts, tl.num_programs(0)):
            table = table_ptr + e * RN
            total = tl.sum(popcount(tl.load(table + jo, mask=jo < RN, other=0)))
            tl.store(count_ptr + e, total)
            tl.store(info_ptr + e * RN + jo, tl.full([BLOCK_RN], -1, tl.int32), mask=(jo >= total) & (jo < RN))
            tl.debug_barrier()
            tl.store(table + jo, tl.zeros([BLOCK_RN], tl.int32), mask=jo < RN)
        tl.store(stamps_ptr + pid * 8 + 4, clock_ns())
    if LAST >= 5:
        finish_receive(received_ptr)
        tl.store(stamps_ptr + pid * 8 + 5, clock_ns())


def measure(last: int, programs: int = 128, warps: int = 8, experts: int = 288, rn: int = 256, send: bool = True,
            replays: int = 200) -> str:
    """One kernel configuration: its time and when each step ended. Without `send` a torch op adds the
    arrivals the wait expects (the receive alone)."""
    area = torch.zeros(64, dtype=torch.int64, device="cuda")   # [ARRIVED, RECEIVED, ...] of the one rank
    bases = torch.tensor([area.data_ptr()], dtype=torch.int64, device="cuda")
    status = torch.zeros(8, dtype=torch.int32, device="cuda")
    table = torch.zeros(experts * rn, dtype=torch.int32, device="cuda")
    info = torch.empty(experts * rn, dtype=torch.int32, device="cuda")
    count = torch.empty(experts, dtype=torch.int32, device="cuda")
    stamps = torch.zeros(programs, 8, dtype=torch.int64, device="cuda")

    def launch() -> None:
        if not send:
            area[0:1].add_(programs)
        _steps[(programs,)](bases, status, area[0:1], area[1:2], table, info, count, stamps, experts, rn,
                            10 ** 9, LAST=last, SEND=send, BLOCK_RN=triton.next_power_of_2(rn), num_warps=warps,
                            launch_cooperative_grid=True)
        if 3 <= last < 5:   # nothing else publishes RECEIVED
            area[1:2].add_(RECEIVED_UNIT.value)

    for _ in range(5):
        launch()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            launch()
    graph.replay()
    torch.cuda.synchronize()
    if status[0].item() != 0:
        raise RuntimeError(f"a wait timed out: status {status.tolist()}")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays // 10):
            graph.replay()
        torch.cuda.synchronize()
    kernel = [event.device_time_total / event.count for event in prof.key_averages() if event.key.startswith("_steps")]
    after = (stamps[:, 1:6] - stamps[:, 0].min()).float().cpu() / 1000
    ended = "  ".join(f"{STEPS[i]} {after[:, i].median():4.2f}/{after[:, i].max():4.2f}"
                      for i in range(last) if send or i >= 2)
    shape = f"{programs} x {warps} warps{'' if send else ', receive only'}"
    return f"step {last}, {shape}: kernel {kernel[0]:5.2f}  {ended}"


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("ll_fixed_costs.py needs a CUDA GPU")
    print("one rank; kernel us (mean); each step's end, us after the first program started (median / last)")
    for last in range(6):
        print(measure(last), flush=True)
    print(measure(5, send=False))
    print(measure(4, rn=2048))


if __name__ == "__main__":
    main()
