"""The NVLink kernels move rows in 16-byte accesses: checked in their PTX for sm_90, compiled here (no GPU).

A row pointer that loses its alignment or contiguity hints still gives correct results, but the kernel
then moves rows in 2- or 4-byte pieces, several times slower; only the benchmark on the GPU machine would
show it. Each case compiles a kernel as the transport launches it (pointers 16-byte aligned, the shape's
block sizes and warps) and counts its global loads and stores by width. The counters that other programs
change while a kernel runs are read with atomics or volatile loads, never plain (cacheable) loads, every
acquire and release is system-wide (peers on other GPUs), and no branch of a waiting kernel depends on what one
thread alone saw (the clock, a volatile load).
"""
import re
from collections import Counter
from typing import Dict, Iterable, List, Optional

import pytest
import torch
from dist_utils import SUPPORTED_TRITON

triton = pytest.importorskip("triton", minversion=SUPPORTED_TRITON)
pytest.importorskip("triton.backends.nvidia")

import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from deep_ep.transport.nvlink.launcher import next_pow2  # noqa: E402
from deep_ep.transport.nvlink.normal import (COMBINE_TILE, DISPATCH_TILE, NUM_WARPS, combine_slot,  # noqa: E402
                                             rows_per_step)
from deep_ep.transport.nvlink import combine, direct, dispatch, ll_combine, ll_dispatch, notify  # noqa: E402
from deep_ep.transport.nvlink import low_latency as ll  # noqa: E402
from deep_ep.transport.nvlink import sync  # noqa: E402

H = 7168    # DeepSeek's hidden size
K = 8
R = 2
ACCESS = re.compile(r"\b(ld|st)\.global(?:\.[a-z0-9_:]+)*?(?:\.v([248]))?\.[bfsu](8|16|32|64)\b")
POINTERS = {"x_ptr": "*bf16", "rows_ptr": "*bf16", "out_ptr": "*bf16", "bias0_ptr": "*bf16", "bias1_ptr": "*bf16",
            "idx_ptr": "*i64", "out_idx_ptr": "*i64", "weights_ptr": "*fp32", "out_weights_ptr": "*fp32",
            "in_rank_ptr": "*i8", "bases_ptr": "*i64", "arrived_ptr": "*i64", "received_ptr": "*i64",
            "stats_ptr": "*i64", "layout_ptr": "*i64"}   # others: *i32
NOTIFY_SHAPES = dict(REC=64, STRIDE=64, BLOCK=64, C=4, BLOCK_C=4, BLOCK_E=8)   # (and R, BLOCK_R)
NOTIFY_POINTERS = dict(received_ptr="*i32", mailbox_ptr="*i64", checks_ptr="*i64", mismatch_ptr="*i64",
                       epoch_ptr="*i64")   # (as the transport passes them)
CASE_POINTERS = {"notify": NOTIFY_POINTERS}   # the cases below whose pointers differ from POINTERS


def _ptx(kernel, num_warps: int, constexprs: Dict[str, object], divisible: Iterable[str] = (),
         pointers: Optional[Dict[str, str]] = None, fp_fusion: bool = True) -> str:
    """`kernel` compiled for sm_90, as the transport launches it: its PTX."""
    pointers = dict(POINTERS, **(pointers or {}))
    signature, values, attrs = {}, {}, {}
    for i, param in enumerate(kernel.params):
        name = param.name
        if param.is_constexpr:
            signature[name] = "constexpr"
            values[(i,)] = constexprs[name]
        elif name.endswith("_ptr"):
            signature[name] = pointers.get(name, "*i32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "i64" if name == "timeout_ns" or name.endswith("_offset") else "i32"
            if name in divisible:   # (Triton specialises ints divisible by 16 so)
                attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(kernel, signature, values, attrs), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps, enable_fp_fusion=fp_fusion))
    return compiled.asm["ptx"]


def _accesses(kernel, num_warps: int, constexprs: Dict[str, object], divisible: Iterable[str] = (),
              pointers: Optional[Dict[str, str]] = None, fp_fusion: bool = True) -> Counter:
    """Global loads and stores of `kernel` compiled for sm_90, counted by (kind, bytes per access)."""
    counts: Counter = Counter()
    for kind, vector, bits in ACCESS.findall(_ptx(kernel, num_warps, constexprs, divisible, pointers, fp_fusion)):
        counts[kind, int(vector or 1) * int(bits) // 8] += 1
    return counts


def _expect_16_byte_rows(counts: Counter, tile_bytes: int, num_warps: int, loads: bool = True,
                         stores: bool = True, no_2_byte: bool = True) -> None:
    """At least one 16-byte access per thread for every 16 bytes * threads of the row tile, and (rows of bf16)
    no 2-byte accesses."""
    per_tile = tile_bytes // (32 * num_warps * 16)
    assert per_tile >= 1
    if loads:
        assert counts["ld", 16] >= per_tile, counts
    if stores:
        assert counts["st", 16] >= per_tile, counts
    if no_2_byte:
        assert counts["ld", 2] == 0 and counts["st", 2] == 0, counts


LL_COMBINE = dict(H=H, K=K, R=R, HAS_MASK=False, AUTO_MASK=False, LOGFMT=False, BLOCK_H=next_pow2(H), BLOCK_E=256,
                  BLOCK_R=R, ROWS=ll.COMBINE_SEND_ROWS, HAS_STATS=False, BLOCK_K=K,
                  CHUNK=min(next_pow2(H), max(128, ll.COMBINE_TILE // K)), PDL=True)
LL_STRIDES = ("x_expert_stride", "x_row_stride", "num_max_tokens")
# the low-latency kernels' phases, as the transport launches them (the fused launch is never a PDL one)
SEND, RECEIVE, FUSED = dict(SEND=True, RECEIVE=False), dict(SEND=False, RECEIVE=True), dict(SEND=True, RECEIVE=True,
                                                                                            PDL=False)


@pytest.mark.parametrize("own_from_x, shrink", [(False, False), (True, False), (True, True)])
def test_low_latency_combine_receive_loads_rows_in_16_bytes(own_from_x, shrink):
    counts = _accesses(ll_combine.ll_combine_kernel, ll.RECV_WARPS,
                       dict(LL_COMBINE, **RECEIVE, OWN_FROM_X=own_from_x, HAS_MASK=shrink, AUTO_MASK=shrink),
                       LL_STRIDES, fp_fusion=False)
    _expect_16_byte_rows(counts, K * LL_COMBINE["CHUNK"] * 2, ll.RECV_WARPS, stores=False)


@pytest.mark.parametrize("own_from_x", [False, True])
def test_low_latency_combine_send_moves_rows_in_16_bytes(own_from_x):
    counts = _accesses(ll_combine.ll_combine_kernel, ll.NUM_WARPS, dict(LL_COMBINE, **SEND, OWN_FROM_X=own_from_x),
                       LL_STRIDES)
    _expect_16_byte_rows(counts, ll.COMBINE_SEND_ROWS * next_pow2(H) * 2, ll.NUM_WARPS)


def _ll_dispatch_constexprs(fp8: bool, topk: int = K) -> Dict[str, object]:
    payload_words, scale_words = (H // 4, H // 128) if fp8 else (H // 2, 0)
    return dict(H=H, K=topk, R=R, FP8=fp8, ROUND=False, UE8M0=False, XW=payload_words, SW=scale_words,
                SLOT_W=payload_words + scale_words, HAS_MASK=False, AUTO_MASK=False, BLOCK_H=next_pow2(H),
                BLOCK_K=topk, BLOCK_R=R, BLOCK_G=next_pow2(H) // 128 if fp8 else 1, HAS_STATS=False,
                BLOCK_RN=next_pow2(R * 128), BLOCK_X=next_pow2(payload_words),
                BLOCK_S=next_pow2(max(scale_words, 1)), ROWS=ll.RECV_ROWS, AHEAD=True, PDL=True)


# (top-32 without shrink: a send loop carrying the next token's ids failed to compile there with Triton 3.6)
@pytest.mark.parametrize("fp8, shrink, topk",
                         [(True, False, K), (False, False, K), (True, True, K), (False, False, 32)],
                         ids=["fp8", "bf16", "fp8-shrink", "bf16-top32"])
def test_low_latency_dispatch_send_moves_rows_in_16_bytes(fp8, shrink, topk):
    counts = _accesses(ll_dispatch.ll_dispatch_kernel, ll.NUM_WARPS,
                       dict(_ll_dispatch_constexprs(fp8, topk), **SEND, HAS_MASK=shrink, AUTO_MASK=shrink),
                       ("num_max_tokens",))
    # the bf16 row is loaded once and stored (as e4m3 or bf16) once per destination rank
    _expect_16_byte_rows(counts, next_pow2(H) * 2, ll.NUM_WARPS, stores=False)
    _expect_16_byte_rows(counts, next_pow2(H) * (1 if fp8 else 2), ll.NUM_WARPS, loads=False)


def test_low_latency_dispatch_receive_copies_rows_in_16_bytes():
    constexprs = dict(_ll_dispatch_constexprs(True), **RECEIVE)
    counts = _accesses(ll_dispatch.ll_dispatch_kernel, ll.RECV_WARPS, constexprs, ("num_max_tokens",))
    _expect_16_byte_rows(counts, ll.RECV_ROWS * constexprs["BLOCK_X"] * 4, ll.RECV_WARPS)


def _ll_launches(phases=(SEND, RECEIVE)):
    """(name, kernel, constexprs, ints divisible by 16) of each low-latency operation's launch in `phases`."""
    names = {id(SEND): "send", id(RECEIVE): "receive", id(FUSED): "fused"}
    for phase in phases:
        yield (f"dispatch {names[id(phase)]}", ll_dispatch.ll_dispatch_kernel,
               dict(_ll_dispatch_constexprs(True), **phase), ("num_max_tokens",))
        yield (f"combine {names[id(phase)]}", ll_combine.ll_combine_kernel,
               dict(LL_COMBINE, **phase, OWN_FROM_X=True), LL_STRIDES)


@pytest.mark.parametrize("pdl", [True, False])
def test_low_latency_kernels_wait_for_the_previous_kernel_only_when_chained(pdl):
    """Launched as programmatic dependents, the send and receive kernels must wait for the previous kernel (its
    writes are not visible before): griddepcontrol.wait, once, before any global load or store; no early
    trigger for the next kernel."""
    for name, kernel, constexprs, divisible in _ll_launches():
        ptx = _ptx(kernel, 4, dict(constexprs, PDL=pdl), divisible)
        assert ptx.count("griddepcontrol.wait") == int(pdl), name
        assert "griddepcontrol.launch_dependents" not in ptx, name
        if pdl:   # before the first access to global memory
            accesses = re.finditer(r"\b(ld|st|atom|red)(\.[a-z0-9_]+)*?\.global", ptx)
            first_access = min(match.start() for match in accesses)
            assert ptx.index("griddepcontrol.wait") < first_access, name


def test_low_latency_kernels_carry_one_cxx_style_name_per_operation():
    """Every launch of an operation (send, receive, fused) is one kernel whose name profilers demangle to
    `deep_ep::low_latency::<operation>()`, as DeepEP's `deep_ep::internode_ll::dispatch<...>`: DeepEP's timing
    finds a receive hook's two phases by `::dispatch` / `::combine` in the profiler's names."""
    for name, kernel, constexprs, divisible in _ll_launches((SEND, RECEIVE, FUSED)):
        entries = re.findall(r"\.entry\s+(\w+)\(", _ptx(kernel, 4, constexprs, divisible))
        assert [torch._C._demangle(entry) for entry in entries] == \
            [f"deep_ep::low_latency::{name.split()[0]}()"], (name, entries)


def _dispatch_constexprs() -> Dict[str, object]:
    words = H // 2   # bf16 rows, moved as int32 words
    return dict(C=12, R=R, XW=words, SW=0, K=K, HAS_W=True, ID_OFF=words, BLOCK_X=next_pow2(words), BLOCK_S=1,
                BLOCK_K=K, BLOCK_R=R, ROWS=rows_per_step(words, DISPATCH_TILE))


NORMAL_POINTERS = {"x_ptr": "*i32", "out_x_ptr": "*i32"}


@pytest.mark.parametrize("protocol", ["direct", "rings"])
def test_normal_dispatch_moves_rows_in_16_bytes(protocol):
    constexprs = _dispatch_constexprs()
    if protocol == "direct":
        kernel, constexprs = direct.direct_dispatch_kernel, dict(constexprs, AMAX=48)
    else:
        kernel, constexprs = dispatch.dispatch_kernel, dict(constexprs, CMAX=64)
    counts = _accesses(kernel, NUM_WARPS, constexprs, ("slot_words", "ring_words"), NORMAL_POINTERS)
    _expect_16_byte_rows(counts, constexprs["ROWS"] * constexprs["BLOCK_X"] * 4, NUM_WARPS)


@pytest.mark.parametrize("biases", [0, 1, 2])
@pytest.mark.parametrize("protocol", ["direct", "rings"])
def test_normal_combine_moves_rows_in_16_bytes(protocol, biases):
    constexprs = dict(R=R, H=H, K=K, X_OFF=combine_slot(K, H)[0], HAS_BIAS0=biases >= 1, HAS_BIAS1=biases == 2,
                      BLOCK_H=next_pow2(H), BLOCK_K=K, BLOCK_R=R, ROWS=rows_per_step(H, COMBINE_TILE))
    if protocol == "direct":
        kernel = direct.direct_combine_kernel
        constexprs = dict(constexprs, C=12, AMAX=48, REDUCE_ROWS=max(1, constexprs["ROWS"] // 2))
    else:
        kernel, constexprs = combine.combine_kernel, dict(constexprs, C=12, CMAX=64)
    counts = _accesses(kernel, NUM_WARPS, constexprs, ("slot_words", "ring_words"), fp_fusion=False)
    _expect_16_byte_rows(counts, constexprs["ROWS"] * constexprs["BLOCK_H"] * 2, NUM_WARPS)


@pytest.mark.parametrize("own_from_x", [False, True])
def test_low_latency_fused_combine_moves_rows_in_16_bytes(own_from_x):
    counts = _accesses(ll_combine.ll_combine_kernel, ll.NUM_WARPS, dict(LL_COMBINE, **FUSED, OWN_FROM_X=own_from_x),
                       LL_STRIDES, fp_fusion=False)
    _expect_16_byte_rows(counts, ll.COMBINE_SEND_ROWS * next_pow2(H) * 2, ll.NUM_WARPS)


def test_low_latency_fused_dispatch_moves_rows_in_16_bytes():
    constexprs = dict(_ll_dispatch_constexprs(True), **FUSED)
    counts = _accesses(ll_dispatch.ll_dispatch_kernel, ll.NUM_WARPS, constexprs, ("num_max_tokens",))
    _expect_16_byte_rows(counts, ll.RECV_ROWS * constexprs["BLOCK_X"] * 4, ll.NUM_WARPS)


@triton.jit
def _receive_start(arrived_ptr, received_ptr, mask_ptr, shrink_ptr, stats_ptr, status_ptr, num_senders, timeout_ns,
                   R: tl.constexpr, AUTO_MASK: tl.constexpr, BLOCK_R: tl.constexpr):
    sync.wait_for_senders(arrived_ptr, received_ptr, mask_ptr, shrink_ptr, stats_ptr, num_senders, timeout_ns,
                          status_ptr, 4, R, True, AUTO_MASK, True, BLOCK_R)


@pytest.mark.parametrize("auto_mask", [False, True])
def test_low_latency_receive_wait_reads_no_counter_with_a_plain_load(auto_mask):
    """RECEIVED, ARRIVED, the masks and the status change while kernels run: a plain load may be served from
    L1."""
    loads = re.findall(r"\bld\.global[.a-z0-9]*", _ptx(_receive_start, 4, dict(R=8, AUTO_MASK=auto_mask, BLOCK_R=8)))
    assert not [load for load in loads if not re.search(r"\.(acquire|relaxed|volatile)\b", load)], loads


# ---- uniform control flow ----------------------------------------------------------------------------------------
STATEMENT = re.compile(r"^\s*(@!?(%p\d+)\s+)?([a-z][\w.:]*)\s*(.*)$")
REGISTER = re.compile(r"%[a-z]+\d+")


def _branches_on_own_views(ptx: str) -> list:
    """The conditional branches of `ptx` whose predicate depends, through registers, on a value that each thread
    observes for itself: the global timer, a volatile load, an atomic's result (Triton hands the latter to the
    other threads through shared memory; a value read back from shared memory or from a bar.red reduction
    counts as the same in every thread). Flow-insensitive: a register is tainted if any of its definitions is."""
    statements = []
    for line in ptx.splitlines():
        if "bar.red" in line:   # cta_any: its result is one value for the whole program
            continue
        for text in line.split(";"):
            match = STATEMENT.match(text)
            if match:
                statements.append(match.groups()[1:])
    tainted: set = set()
    changed = True
    while changed:
        changed = False
        for guard, opcode, operands in statements:
            if opcode.startswith(("st.", "bar.", "bra", "ret", "fence", "membar", "red.", "ld.shared")):
                continue
            first, _, rest = operands.partition(",")
            if first.strip().startswith("{"):   # a vector destination
                first, _, rest = operands.partition("}")
            dests = REGISTER.findall(first)
            sources = REGISTER.findall(rest) + ([guard] if guard else [])
            own_view = ("%globaltimer" in rest or opcode.startswith("atom")
                        or (opcode.startswith("ld.") and ".volatile" in opcode))
            if (own_view or tainted.intersection(sources)) and not tainted.issuperset(dests):
                tainted.update(dests)
                changed = True
    return [(guard, opcode) for guard, opcode, _ in statements if opcode.startswith("bra") and guard in tainted]


def _uniformity_cases():
    h, k, r = 512, 4, 4
    ll_dispatch_shapes = dict(H=h, K=k, R=r, FP8=True, ROUND=False, UE8M0=False, XW=h // 4, SW=h // 128,
                              SLOT_W=h // 4 + h // 128, HAS_MASK=True, AUTO_MASK=True, BLOCK_H=h, BLOCK_K=k, BLOCK_R=r,
                              BLOCK_G=h // 128, HAS_STATS=True, BLOCK_RN=r * 16, BLOCK_X=h // 4, BLOCK_S=4,
                              ROWS=ll.RECV_ROWS, AHEAD=False, PDL=True)
    ll_combine_shapes = dict(H=h, K=k, R=r, HAS_MASK=True, AUTO_MASK=True, LOGFMT=False, BLOCK_H=h, BLOCK_E=4,
                             BLOCK_R=r, ROWS=ll.COMBINE_SEND_ROWS, HAS_STATS=True, BLOCK_K=k, CHUNK=h, OWN_FROM_X=True,
                             PDL=True)
    rows = dict(C=4, R=r, XW=h // 2, SW=0, K=k, HAS_W=True, ID_OFF=h // 2, BLOCK_X=h // 2, BLOCK_S=1, BLOCK_K=k,
                BLOCK_R=r, ROWS=4)
    combine_rows = dict(R=r, H=h, K=k, X_OFF=combine_slot(k, h)[0], HAS_BIAS0=True, HAS_BIAS1=False, BLOCK_H=h,
                        BLOCK_K=k, BLOCK_R=r, ROWS=4)
    return {
        "ll dispatch send": (ll_dispatch.ll_dispatch_kernel, dict(ll_dispatch_shapes, **SEND)),
        "ll dispatch receive": (ll_dispatch.ll_dispatch_kernel, dict(ll_dispatch_shapes, **RECEIVE)),
        "ll dispatch fused": (ll_dispatch.ll_dispatch_kernel, dict(ll_dispatch_shapes, **FUSED)),
        "ll combine send": (ll_combine.ll_combine_kernel, dict(ll_combine_shapes, **SEND)),
        "ll combine receive": (ll_combine.ll_combine_kernel, dict(ll_combine_shapes, **RECEIVE)),
        "ll combine fused": (ll_combine.ll_combine_kernel, dict(ll_combine_shapes, **FUSED)),
        "dispatch rings": (dispatch.dispatch_kernel, dict(rows, CMAX=8)),
        "dispatch direct": (direct.direct_dispatch_kernel, dict(rows, AMAX=8)),
        "combine rings": (combine.combine_kernel, dict(combine_rows, C=4, CMAX=8)),
        "combine direct": (direct.direct_combine_kernel, dict(combine_rows, C=4, AMAX=8, REDUCE_ROWS=2)),
        "notify": (notify.notify_kernel, dict(NOTIFY_SHAPES, R=r, BLOCK_R=r)),
    }


def _case_ptx(case: str) -> str:
    kernel, constexprs = _uniformity_cases()[case]
    return _ptx(kernel, 4, constexprs, pointers=CASE_POINTERS.get(case))


@pytest.mark.parametrize("case", list(_uniformity_cases()))
def test_waits_branch_alike_in_every_thread(case):
    """A thread that leaves a wait on its own reading of the clock or of a flag while the others go on polling
    meets them at the wrong barriers, and the program computes garbage: in shrink mode, on the GPU, a dispatch
    receive that gave up on one rank copied wrong rows of the others. No branch of a waiting kernel may depend
    on such a reading unless a reduction over the program (cta_any) has made it one value."""
    assert _branches_on_own_views(_case_ptx(case)) == []


ACQUIRE = re.compile(r"\b(atom|ld)\.[a-z0-9_.:]*acquire")
GLOBAL_ACCESS = re.compile(r"\b(ld|st)\.global|\bld\.volatile|\batom\.(?!shared)")


def _accesses_before_a_barrier(ptx: str) -> List[str]:
    """Acquiring accesses (atomics, loads) followed by a global access before any CTA barrier."""
    lines = ptx.splitlines()
    found = []
    for i, line in enumerate(lines):
        if ACQUIRE.search(line):
            for later in lines[i + 1:]:
                if "bar.sync" in later:
                    break
                if GLOBAL_ACCESS.search(later):
                    found.append(f"{line.strip()} then {later.strip()}")
                    break
    return found


@pytest.mark.parametrize("case", list(_uniformity_cases()))
def test_acquired_values_reach_other_threads_through_a_barrier(case):
    """An acquire orders only its own thread's later accesses. A wait's counter is read by one thread per lane
    and passed to the others; those others may read the rows it guards only after a CTA barrier (which
    Triton's lowering puts between the atomic's shared-memory store and the others' loads): then the acquire
    orders their reads too."""
    assert _accesses_before_a_barrier(_case_ptx(case)) == []


ORDERED = re.compile(r"\b(?:atom|red|ld|st|fence)(?:\.[a-z0-9_]+)*?\.(?:acquire|release|acq_rel)(?:\.[a-z0-9_]+)*")


@pytest.mark.parametrize("case", list(_uniformity_cases()))
def test_acquires_and_releases_reach_other_gpus(case):
    """Peers on other GPUs write the counters a kernel waits on and read what its releases guard: an acquire or
    release at GPU scope orders nothing for them (on one shared GPU it would pass every test). The one exception:
    the ticket by which a normal-mode kernel's programs find the last of them (a word of this GPU's own memory
    that only its own programs touch)."""
    ordered = [match.group(0) for match in ORDERED.finditer(_case_ptx(case))]
    narrow = [op for op in ordered if "sys" not in op.split(".")]
    # (the normal-mode kernels and the notify end with is_last_program)
    ticket = case.startswith(("dispatch ", "combine ", "notify"))
    assert ordered and len(narrow) == int(ticket), ordered
    assert all(op.startswith("atom.global.gpu.acq_rel.add") for op in narrow), ordered


def test_notify_kernel_stores_the_counts_before_it_releases_the_ticket():
    """The host reads a dispatch's counts from its mailbox once the ticket is there (mailbox.py): every store
    of the payload comes before a CTA barrier that precedes the ticket's system-scope release (the last
    exchange of the kernel: the one before it raises a peer's notify flag), and nothing is stored after it."""
    lines = _ptx(notify.notify_kernel, 4, dict(NOTIFY_SHAPES, R=R, BLOCK_R=R), pointers=NOTIFY_POINTERS).splitlines()
    releases = [i for i, line in enumerate(lines) if re.search(r"\batom\.", line) and "exch" in line
                and "release" in line]
    assert len(releases) == 2, releases
    release = lines[releases[-1]].split()
    assert any(op.startswith("atom.") and {"release", "sys"} <= set(op.split(".")) for op in release), release
    before, after = lines[:releases[-1]], lines[releases[-1] + 1:]
    last_store = max(i for i, line in enumerate(before) if re.search(r"\bst\.global", line))
    assert any("bar.sync" in line for line in before[last_store + 1:]), "no barrier between the payload and the ticket"
    assert not [line for line in after if re.search(r"\b(st|atom|red)\.global", line)]
