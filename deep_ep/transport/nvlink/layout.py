"""get_dispatch_layout as one kernel (local, no communication, no host wait, no zero-fill launch).

One program per block of BLOCK_T tokens. It marks the ranks that a token's valid expert ids (in [0, E))
belong to (is_token_in_rank) and adds its block's per-rank and per-expert counts (a histogram; invalid
entries land in the spare bin E; with more than HISTOGRAM_MAX experts, one atomic per selection) into
SUMS, a persistent [R + E] int32 accumulator that is all zeros between calls, with relaxed atomics. Then
each program takes a ticket from DONE (acq_rel, after a barrier over its atomics); the program with the
last ticket resets DONE to 0, swaps SUMS back to zeros and writes what it took into the outputs. So two
layout kernels of one Buffer must not run at once: they do not when its calls and graph replays are
issued in order (as every call of a Buffer must be: they share its buffers). SUMS grows with E; a grown
one replaces it for later calls while graphs captured with the old one keep it. Ids outside [-1, E) count
as no selection and are recorded in `bad` (count, one offending value) for the host to report at its next
wait.
"""
import triton
import triton.language as tl

from .sync import is_last_program

HISTOGRAM_MAX = 2047   # most experts counted with a histogram (BLOCK_E = next power of two above E)
COPY_BLOCK = 1024      # SUMS entries the last program moves at once


@triton.jit
def layout_kernel(idx_ptr, sums_ptr, done_ptr, per_rank_ptr, per_expert_ptr, in_rank_ptr, bad_ptr, num_tokens,
                  num_experts, experts_per_rank, K: tl.constexpr, R: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, COPY: tl.constexpr):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ko = tl.arange(0, BLOCK_K)
    ro = tl.arange(0, BLOCK_R)
    live = tokens < num_tokens
    mask = live[:, None] & (ko[None, :] < K)
    ids = tl.load(idx_ptr + tokens.to(tl.int64)[:, None] * K + ko[None, :], mask=mask, other=-1)
    valid = mask & (ids >= 0) & (ids < num_experts)
    bad = mask & ((ids < -1) | (ids >= num_experts))
    num_bad = tl.sum(tl.sum(bad.to(tl.int32), axis=1), axis=0)
    if num_bad > 0:
        tl.atomic_add(bad_ptr, num_bad.to(tl.int64), sem="relaxed")
        tl.atomic_xchg(bad_ptr + 1, tl.max(tl.max(tl.where(bad, ids, -(1 << 40)), axis=1), axis=0), sem="relaxed")
    expert_sums = sums_ptr + R
    if BLOCK_E > 0:
        bins = tl.where(valid, ids, num_experts).to(tl.int32)
        per_expert = tl.histogram(tl.reshape(bins, [BLOCK_T * BLOCK_K]), BLOCK_E)
        eo = tl.arange(0, BLOCK_E)
        tl.atomic_add(expert_sums + eo, per_expert, mask=(eo < num_experts) & (per_expert > 0), sem="relaxed")
    else:   # too many experts for a histogram in registers: one atomic per selection
        tl.atomic_add(expert_sums + tl.where(valid, ids, 0), 1, mask=valid, sem="relaxed")
    owner = tl.where(valid, ids // experts_per_rank, R)
    hits = tl.max((owner[:, :, None] == ro[None, None, :]).to(tl.int32), axis=1)
    in_range = live[:, None] & (ro[None, :] < R)
    hits = tl.where(in_range, hits, 0)
    tl.store(in_rank_ptr + tokens.to(tl.int64)[:, None] * R + ro[None, :], hits.to(tl.int8), mask=in_range)
    tl.atomic_add(sums_ptr + ro, tl.sum(hits, axis=0), mask=ro < R, sem="relaxed")
    # the last program to finish moves the sums out (atomics read them where the others' atomics landed)
    if is_last_program(done_ptr):
        co = tl.arange(0, COPY)
        for start in range(0, num_experts + R, COPY):
            entries = start + co
            inside = entries < R + num_experts
            sums = tl.atomic_xchg(sums_ptr + entries, 0, mask=inside, sem="relaxed")
            tl.store(per_rank_ptr + entries, sums, mask=entries < R)
            tl.store(per_expert_ptr + (entries - R), sums, mask=inside & (entries >= R))
