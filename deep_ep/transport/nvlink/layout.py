"""get_dispatch_layout as one kernel (local, no communication, no host wait).

Programs take blocks of BLOCK_T tokens. For each token: the ranks its valid expert ids (in [0, E)) belong to
(is_token_in_rank), and for each valid id one count for its expert. Per-rank and per-expert counts are
added to zero-initialised outputs with atomics. Ids outside [-1, E) count as no selection and are recorded
in `bad` (count, one offending value) for the host to report at its next wait.
"""
import triton
import triton.language as tl


@triton.jit
def layout_kernel(idx_ptr, per_rank_ptr, per_expert_ptr, in_rank_ptr, bad_ptr, num_tokens, num_experts,
                  experts_per_rank, K: tl.constexpr, R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_R: tl.constexpr):
    to = tl.arange(0, BLOCK_T)
    ko = tl.arange(0, BLOCK_K)
    ro = tl.arange(0, BLOCK_R)
    for block in range(tl.program_id(0) * BLOCK_T, num_tokens, tl.num_programs(0) * BLOCK_T):
        tokens = block + to
        live = tokens < num_tokens
        mask = live[:, None] & (ko[None, :] < K)
        ids = tl.load(idx_ptr + tokens.to(tl.int64)[:, None] * K + ko[None, :], mask=mask, other=-1)
        valid = mask & (ids >= 0) & (ids < num_experts)
        bad = mask & ((ids < -1) | (ids >= num_experts))
        num_bad = tl.sum(tl.sum(bad.to(tl.int32), axis=1), axis=0)
        if num_bad > 0:
            tl.atomic_add(bad_ptr, num_bad.to(tl.int64))
            tl.atomic_xchg(bad_ptr + 1, tl.max(tl.max(tl.where(bad, ids, -(1 << 40)), axis=1), axis=0))
        tl.atomic_add(per_expert_ptr + tl.where(valid, ids, 0), 1, mask=valid)
        owner = tl.where(valid, ids // experts_per_rank, R)
        hits = tl.max((owner[:, :, None] == ro[None, None, :]).to(tl.int32), axis=1)
        hits = tl.where(live[:, None] & (ro[None, :] < R), hits, 0)
        tl.store(in_rank_ptr + tokens.to(tl.int64)[:, None] * R + ro[None, :], hits.to(tl.int8),
                 mask=live[:, None] & (ro[None, :] < R))
        tl.atomic_add(per_rank_ptr + ro, tl.sum(hits, axis=0), mask=ro < R)
