"""The GPU intrinsics the kernels use, and stand-ins for Triton's CPU interpreter (TRITON_INTERPRET=1), which
runs kernels without inline PTX or libdevice. Under the interpreter the low-latency kernels run on CPU tensors
(each program in turn, one launch after another), so tests check their logic on machines without a GPU."""
import time

import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer, libdevice

from .launcher import INTERPRETED

if INTERPRETED:
    @triton.jit
    def clock_ns():
        """Nanoseconds of the host's monotonic clock."""
        return tl.full([], time.monotonic_ns(), tl.int64)

    @triton.jit
    def popcount(x):
        """Bits set in each int32 of x."""
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits - ((bits >> 1) & 0x55555555)
        bits = (bits & 0x33333333) + ((bits >> 2) & 0x33333333)
        bits = (bits + (bits >> 4)) & 0x0F0F0F0F
        return ((bits * 0x01010101) >> 24).to(tl.int32)

    @triton.jit
    def to_bf16(x):
        """float32 -> bfloat16, rounded to nearest even (the interpreter's own cast truncates)."""
        bits = x.to(tl.uint32, bitcast=True)
        rounded = bits + 0x7FFF + ((bits >> 16) & 1)
        return (rounded >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
else:
    clock_ns = globaltimer          # nanoseconds of the GPU's global timer
    popcount = libdevice.popc       # bits set in each int32

    @triton.jit
    def to_bf16(x):
        """float32 -> bfloat16, rounded to nearest even."""
        return x.to(tl.bfloat16)
