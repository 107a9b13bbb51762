"""Normal dispatch over peer-mapped buffers (one round: every source's rows fit its staging area).

Buffers: rank d's staging area has one region per source s of `capacity` slots; a slot holds one token:
[top-k ids int64 x K | weights f32 x K | source token int32 | pad | payload words | scale words].
Protocol (epoch e):
  send (rank s, every program): wait until each peer d raised CONSUMED[d] in s's buffer to >= e - 1 (d
    has read what s sent it in the previous operation); then for its share of tokens t and every d with
    is_token_in_rank[t, d], store the token into d's slot (s, send_head[t, d]) with plain stores; fence.
  signal: then DATA[s] is raised to e in every peer's buffer (sync.signal_peers_kernel).
  receive (rank d, every program): wait until DATA[s] >= e for every source s, then copy its share of
    the received rows, row i = slot (s, i - prefix[s]), into the outputs (local ids, masked weights).
  signal: then CONSUMED[d] is raised to e in every peer's buffer.
"""
import triton
import triton.language as tl

from .sync import WAIT_CONSUMED, WAIT_DATA, fence_sys, wait_all_peers


@triton.jit
def dispatch_send_kernel(x_ptr, scales_ptr, idx_ptr, weights_ptr, in_rank_ptr, send_head_ptr, bases_ptr,
                         consumed_ptr, epoch_ptr, status_ptr, num_tokens, rank, staging_word, slot_words, capacity,
                         timeout_ns, R: tl.constexpr, XW: tl.constexpr, SW: tl.constexpr, K: tl.constexpr,
                         X_OFF: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    epoch = tl.load(epoch_ptr)
    ready = wait_all_peers(consumed_ptr, epoch - 1, timeout_ns, status_ptr, WAIT_CONSUMED, R)
    if ready:
        per_program = tl.cdiv(num_tokens, num_programs)
        first = pid * per_program
        last = tl.minimum(first + per_program, num_tokens)
        xo = tl.arange(0, BLOCK_X)
        so = tl.arange(0, BLOCK_S)
        ko = tl.arange(0, BLOCK_K)
        for t in range(first, last):
            t64 = t.to(tl.int64)
            x = tl.load(x_ptr + t64 * XW + xo, mask=xo < XW)
            if SW > 0:
                scales = tl.load(scales_ptr + t64 * SW + so, mask=so < SW)
            if K > 0:
                ids = tl.load(idx_ptr + t64 * K + ko, mask=ko < K)
                weights = tl.load(weights_ptr + t64 * K + ko, mask=ko < K)
            for d in tl.static_range(R):
                position = tl.load(send_head_ptr + t64 * R + d).to(tl.int64)
                if (tl.load(in_rank_ptr + t64 * R + d) != 0) & (position < capacity):
                    slot = tl.load(bases_ptr + d) + (staging_word + (rank * capacity + position) * slot_words) * 4
                    slot = tl.multiple_of(slot, 16)
                    words = slot.to(tl.pointer_type(tl.int32))
                    targets = tl.max_contiguous(tl.multiple_of(words + X_OFF + xo, [16]), [BLOCK_X])
                    tl.store(targets, x, mask=xo < XW)
                    if SW > 0:
                        tl.store(words + X_OFF + XW + so, scales, mask=so < SW)
                    if K > 0:
                        tl.store(slot.to(tl.pointer_type(tl.int64)) + ko, ids, mask=ko < K)
                        tl.store((slot + 8 * K).to(tl.pointer_type(tl.float32)) + ko, weights, mask=ko < K)
                    tl.store(words + 3 * K, t)
    fence_sys()


@triton.jit
def dispatch_recv_kernel(own_base, data_flag_word, prefix_ptr, out_x_ptr, out_scales_ptr, out_idx_ptr,
                         out_weights_ptr, out_src_ptr, num_rows, expert_begin, experts_per_rank, epoch_ptr, status_ptr,
                         staging_word, slot_words, capacity, timeout_ns, R: tl.constexpr, XW: tl.constexpr,
                         SW: tl.constexpr, K: tl.constexpr, X_OFF: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
                         BLOCK_X: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    epoch = tl.load(epoch_ptr)
    flags = own_base.to(tl.pointer_type(tl.int64)) + data_flag_word
    ready = wait_all_peers(flags, epoch, timeout_ns, status_ptr, WAIT_DATA, R)
    tl.debug_barrier()
    ro = tl.arange(0, BLOCK_R)
    ends = tl.load(prefix_ptr + 1 + ro, mask=ro < R, other=2147483647)
    num_recv = tl.minimum(tl.load(prefix_ptr + R), num_rows)  # never past the outputs (num_worst_tokens)
    xo = tl.arange(0, BLOCK_X)
    so = tl.arange(0, BLOCK_S)
    ko = tl.arange(0, BLOCK_K)
    if ready:
        for i in range(pid, num_recv, num_programs):
            source = tl.sum((ends <= i).to(tl.int32))
            position = (i - tl.load(prefix_ptr + source)).to(tl.int64)
            slot = own_base + (staging_word + (source * capacity + position) * slot_words) * 4
            slot = tl.multiple_of(slot, 16)
            words = slot.to(tl.pointer_type(tl.int32))
            i64 = i.to(tl.int64)
            sources = tl.max_contiguous(tl.multiple_of(words + X_OFF + xo, [16]), [BLOCK_X])
            x = tl.load(sources, mask=xo < XW, cache_modifier=".cg")
            tl.store(out_x_ptr + i64 * XW + xo, x, mask=xo < XW)
            if SW > 0:
                scales = tl.load(words + X_OFF + XW + so, mask=so < SW, cache_modifier=".cg")
                tl.store(out_scales_ptr + i64 * SW + so, scales, mask=so < SW)
            if K > 0:
                ids = tl.load(slot.to(tl.pointer_type(tl.int64)) + ko, mask=ko < K, cache_modifier=".cg")
                local = (ids >= expert_begin) & (ids < expert_begin + experts_per_rank)
                tl.store(out_idx_ptr + i64 * K + ko, tl.where(local, ids - expert_begin, -1), mask=ko < K)
                if HAS_WEIGHTS:
                    weights = tl.load((slot + 8 * K).to(tl.pointer_type(tl.float32)) + ko, mask=ko < K,
                                      cache_modifier=".cg")
                    tl.store(out_weights_ptr + i64 * K + ko, tl.where(local, weights, 0.0), mask=ko < K)
            tl.store(out_src_ptr + i64, tl.load(words + 3 * K, cache_modifier=".cg"))
        for i in range(num_recv + pid, num_rows, num_programs):  # num_worst_tokens tail
            i64 = i.to(tl.int64)
            if K > 0:
                tl.store(out_idx_ptr + i64 * K + ko, tl.full([BLOCK_K], -1, tl.int64), mask=ko < K)
                if HAS_WEIGHTS:
                    tl.store(out_weights_ptr + i64 * K + ko, tl.zeros([BLOCK_K], tl.float32), mask=ko < K)
            tl.store(out_src_ptr + i64, -1)
