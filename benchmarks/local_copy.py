"""How fast one GPU copies a dispatch's rows locally, by the ways the NVLink transport could copy them.

  python benchmarks/local_copy.py [--tokens 4096] [--hidden 7168]

The direct dispatch copies the rows it received from its buffer into `recv_x` after the push (~65 us for
58.7 MB with 24 programs, `benchmarks/sweep_normal.py --num-ranks 1`). This prints, for the same rows:
- a contiguous device-to-device copy (`Tensor.copy_`);
- the copy from the direct protocol's slots (rows `slot_words` apart, with scales, ids and weights after the
  data) into a dense `recv_x`, as torch does it (an elementwise copy kernel on all SMs);
- the same copy by one Triton kernel with 24 programs: plain loads and stores, and TMA bulk copies
  (tensor descriptors: the copy engine of each SM, which moves a whole tile per instruction).
Each is the median of `triton.testing.do_bench` (L2 cleared before each run), with the bytes read + written.
Last, the two torch copies while another stream's kernel holds every SM's threads for 2 ms: a copy that
takes about as long as alone ran on the copy engines; one that takes ~2 ms needed SMs.
"""
from __future__ import annotations

import argparse
import time

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

HOLD_NS = 2_000_000


@triton.jit
def _copy_rows(src_ptr, dst_ptr, num_rows, src_stride, W: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    rows = tl.arange(0, ROWS)
    for row in range(tl.program_id(0) * ROWS, num_rows, tl.num_programs(0) * ROWS):
        r = (row + rows).to(tl.int64)
        live = (r < num_rows)[:, None] & (offs[None, :] < W)
        tile = tl.load(src_ptr + r[:, None] * src_stride + offs[None, :], mask=live)
        tl.store(dst_ptr + r[:, None] * W + offs[None, :], tile, mask=live)


@triton.jit
def _copy_rows_tma(src_desc, dst_desc, num_rows, W: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    for row in range(tl.program_id(0) * BR, num_rows, tl.num_programs(0) * BR):
        for col in tl.static_range(0, W, BC):
            dst_desc.store([row, col], src_desc.load([row, col]))


@triton.jit
def _hold(duration_ns):
    """Keeps its program resident for `duration_ns`."""
    start = globaltimer()
    spins = 0
    while globaltimer() - start < duration_ns:
        spins += 1


def _time_while_sms_are_held(fn, device: torch.device) -> float:
    """us that `fn` (on its own stream) takes while a kernel holding every SM's threads runs."""
    holder, worker = torch.cuda.Stream(device), torch.cuda.Stream(device)
    programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count   # 2 x 1024 threads per SM
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    with torch.cuda.stream(holder):
        _hold[(programs,)](HOLD_NS, num_warps=32)
    time.sleep(HOLD_NS / 4e9)   # the holder's programs are resident before the copy is queued
    with torch.cuda.stream(worker):
        begin.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return begin.elapsed_time(end) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--programs", type=int, default=24)
    args = parser.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    T, H = args.tokens, args.hidden
    words = H // 2                      # bf16 row as int32 words
    slot_words = words + 64             # the direct protocol's slot: data, then scales / ids / weights
    slots = torch.randint(-2 ** 31, 2 ** 31 - 1, (T, slot_words), dtype=torch.int32, device=device)
    dense_src = slots[:, :words].contiguous()
    out = torch.empty((T, words), dtype=torch.int32, device=device)
    moved = 2 * T * H * 2               # bytes read + written

    def kernel() -> None:
        _copy_rows[(args.programs,)](slots, out, T, slot_words, W=words, BLOCK=triton.next_power_of_2(words),
                                     ROWS=1, num_warps=16)

    def tma_kernel(rows: int, cols: int, warps: int):
        from triton.tools.tensor_descriptor import TensorDescriptor
        source = TensorDescriptor(slots, [T, words], [slot_words, 1], [rows, cols])
        target = TensorDescriptor(out, [T, words], [words, 1], [rows, cols])
        return lambda: _copy_rows_tma[(args.programs,)](source, target, T, W=words, BR=rows, BC=cols,
                                                        num_warps=warps)

    cases = {"contiguous copy_": lambda: out.copy_(dense_src),
             "strided slots -> dense, torch copy_": lambda: out.copy_(slots[:, :words]),
             f"strided slots -> dense, Triton, {args.programs} programs": kernel}
    if words % 256 == 0:
        for rows, cols, warps in ((1, 256, 4), (2, 256, 4), (4, 256, 4), (8, 256, 8), (16, 256, 8)):
            cases[f"... TMA tiles {rows} x {cols} words, {warps} warps"] = tma_kernel(rows, cols, warps)
    print(f"{T} rows of {H} bf16 ({T * H * 2 / 1e6:.1f} MB), median of do_bench")
    for name, fn in cases.items():
        fn()
        torch.cuda.synchronize()
        us = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3
        if not name.startswith("contiguous"):
            assert torch.equal(out, dense_src), name
            out.zero_()
        print(f"  {name:55s} {us:8.1f} us  {moved / us / 1e3:7.0f} GB/s (read + write)")
    for name in list(cases)[:2]:
        print(f"  {name:55s} {_time_while_sms_are_held(cases[name], device):8.1f} us while every SM is held "
              f"for {HOLD_NS / 1e3:.0f} us")


if __name__ == "__main__":
    main()
