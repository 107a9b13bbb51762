"""How fast one GPU copies a dispatch's rows locally, by the ways the NVLink transport could copy them.

  python benchmarks/local_copy.py [--tokens 4096] [--hidden 7168]

The direct dispatch copies the rows it received from its buffer into `recv_x` after the push (~65 us for
58.7 MB with 24 programs, `benchmarks/sweep_normal.py --num-ranks 1`). This prints, for the same rows:
- a contiguous device-to-device copy (`Tensor.copy_`, which CUDA may serve with its copy engines, using
  no SMs);
- the copy from the direct protocol's slots (rows `slot_words` apart, with scales, ids and weights after the
  data) into a dense `recv_x`, as torch does it (an elementwise copy kernel on all SMs);
- the same copy by one Triton kernel with 24 programs.
Each is the median of `triton.testing.do_bench` (L2 cleared before each run), with the bytes read + written.
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_rows(src_ptr, dst_ptr, num_rows, src_stride, W: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    rows = tl.arange(0, ROWS)
    for row in range(tl.program_id(0) * ROWS, num_rows, tl.num_programs(0) * ROWS):
        r = (row + rows).to(tl.int64)
        live = (r < num_rows)[:, None] & (offs[None, :] < W)
        tile = tl.load(src_ptr + r[:, None] * src_stride + offs[None, :], mask=live)
        tl.store(dst_ptr + r[:, None] * W + offs[None, :], tile, mask=live)


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

    cases = {"contiguous copy_ (copy engine or driver's choice)": lambda: out.copy_(dense_src),
             "strided slots -> dense, torch copy_": lambda: out.copy_(slots[:, :words]),
             f"strided slots -> dense, Triton, {args.programs} programs": kernel}
    print(f"{T} rows of {H} bf16 ({T * H * 2 / 1e6:.1f} MB), median of do_bench")
    for name, fn in cases.items():
        fn()
        torch.cuda.synchronize()
        us = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3
        if name.startswith("strided"):
            assert torch.equal(out, dense_src), name
        print(f"  {name:55s} {us:8.1f} us  {moved / us / 1e3:7.0f} GB/s (read + write)")


if __name__ == "__main__":
    main()
