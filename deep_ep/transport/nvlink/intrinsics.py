"""The GPU intrinsics the kernels use, and stand-ins for Triton's CPU interpreter (TRITON_INTERPRET=1), which
runs kernels without inline PTX or libdevice. Under the interpreter the low-latency kernels run on CPU tensors
(each program in turn, one launch after another), so tests check their logic on machines without a GPU."""
import time

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait, globaltimer, libdevice

from .launcher import INTERPRETED

if INTERPRETED:
    @triton.jit
    def clock_ns():
        """Nanoseconds of the host's monotonic clock."""
        return tl.full([], time.monotonic_ns(), tl.int64)

    @triton.jit
    def cta_any(flag):
        """Whether `flag` (a scalar) is nonzero (one program is one thread here)."""
        return flag != 0

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
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x != x, (bits >> 16) | 0x40, rounded)   # a NaN stays a (quiet) NaN
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def follow_previous_kernel():
        """(Launches run one after another here.)"""

    @triton.jit
    def fence_sys():
        """(Programs run one after another here, on coherent memory.)"""

    @triton.jit
    def to_e4m3(x):
        """float32 (finite, |x| <= 448) -> e4m3, rounded to nearest even (the interpreter's cast rounds its own
        way): the significand is shifted to the e4m3 quantum at |x|, 2^(max(exponent, -6) - 3)."""
        bits = x.to(tl.uint32, bitcast=True)
        magnitude = (bits & 0x7FFFFFFF).to(tl.int64)
        exponent = magnitude >> 23
        significand = tl.where(exponent > 0, (magnitude & 0x7FFFFF) | (1 << 23), magnitude & 0x7FFFFF)
        exponent = tl.maximum(exponent, 1)                      # float32 subnormals: the exponent of 2^-126
        quantum = tl.maximum(exponent - 127, -6) - 3
        shift = tl.minimum(tl.maximum(quantum - (exponent - 150), 0), 40)
        q = significand >> shift
        dropped = significand - (q << shift)
        half = (tl.full(shift.shape, 1, tl.int64) << shift) >> 1
        q += ((dropped > half) | ((dropped == half) & ((q & 1) == 1))).to(tl.int64)
        code = tl.where(quantum <= -9, q, ((exponent - 120) << 3) + q - 8)
        code = tl.minimum(tl.where(magnitude == 0, 0, code), 0x7E)
        sign = ((bits >> 31) & 1).to(tl.int64)
        return (code | (sign << 7)).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
else:
    clock_ns = globaltimer          # nanoseconds of the GPU's global timer
    popcount = libdevice.popc       # bits set in each int32

    @triton.jit
    def cta_any(flag):
        """Whether `flag` (a scalar that each thread computes for itself) is nonzero in any thread of the
        program, the same answer in all of them (a barrier with an OR reduction: every thread must get here)."""
        return tl.inline_asm_elementwise(
            "{ .reg .pred own, some; setp.ne.s32 own, $1, 0; bar.red.or.pred some, 0, own; selp.s32 $0, 1, 0, some; }",
            "=r,r", [flag.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1) != 0

    @triton.jit
    def fence_sys():
        """A system-scope fence: this thread's earlier writes are visible to every GPU before its later ones."""
        tl.inline_asm_elementwise("fence.acq_rel.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                                  pack=1)

    @triton.jit
    def follow_previous_kernel():
        """The start of a kernel launched with `launch_pdl` (programmatic dependent launch, sm_90 and later),
        which may begin once the previous kernel's programs have all exited: wait until that kernel's writes
        are visible. The launch thus overlaps the previous kernel's end. There is no early trigger for the next
        kernel: its programs would be resident while this one runs (slower, benchmarks/RESULTS.md). Without the
        launch attribute a no-op."""
        gdc_wait()

    @triton.jit
    def to_bf16(x):
        """float32 -> bfloat16, rounded to nearest even."""
        return x.to(tl.bfloat16)

    @triton.jit
    def to_e4m3(x):
        """float32 (|x| <= 448) -> e4m3, rounded to nearest even."""
        return x.to(tl.float8e4nv)
