"""Normal combine over peer-mapped buffers (one round: every destination's rows fit the staging area).

Buffers: rank s's staging area has one region per destination rank d of `capacity` slots; a slot holds
one returned row: [weights f32 x K | pad | payload bf16 x H].
Protocol (epoch e):
  send (rank d, every program): wait until each source s raised CONSUMED[s] in d's buffer to >= e - 1;
    then for its share of received rows i (from source s, position p = i - prefix[s], which is the
    position send_head[t, d] the token had in s's dispatch) store row i into s's slot (d, p); fence.
  signal: DATA[d] is raised to e in every peer's buffer.
  reduce (rank s, every program): wait until DATA[d] >= e for every d; for each of its tokens t,
    out[t] = bf16(f32(bias0) + f32(bias1) + sum over d ascending with is_token_in_rank[t, d] of
    f32(slot (d, send_head[t, d]))), the same order as the reference transport, so bitwise equal.
  signal: CONSUMED[s] is raised to e in every peer's buffer.
"""
import triton
import triton.language as tl

from .sync import WAIT_CONSUMED, WAIT_DATA, fence_sys, wait_all_peers


@triton.jit
def combine_send_kernel(x_ptr, weights_ptr, prefix_ptr, bases_ptr, consumed_ptr, epoch_ptr, status_ptr, rank,
                        staging_word, slot_words, capacity, timeout_ns, R: tl.constexpr, H: tl.constexpr,
                        K: tl.constexpr, X_OFF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                        BLOCK_R: tl.constexpr):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    epoch = tl.load(epoch_ptr)
    ready = wait_all_peers(consumed_ptr, epoch - 1, timeout_ns, status_ptr, WAIT_CONSUMED, R)
    ro = tl.arange(0, BLOCK_R)
    ends = tl.load(prefix_ptr + 1 + ro, mask=ro < R, other=2147483647)
    num_recv = tl.load(prefix_ptr + R)
    ho = tl.arange(0, BLOCK_H)
    ko = tl.arange(0, BLOCK_K)
    if ready:
        for i in range(pid, num_recv, num_programs):
            source = tl.sum((ends <= i).to(tl.int32))
            position = (i - tl.load(prefix_ptr + source)).to(tl.int64)
            i64 = i.to(tl.int64)
            slot = tl.load(bases_ptr + source) + (staging_word + (rank * capacity + position) * slot_words) * 4
            slot = tl.multiple_of(slot, 16)
            row = tl.load(x_ptr + i64 * H + ho, mask=ho < H)
            targets = tl.max_contiguous(tl.multiple_of(slot.to(tl.pointer_type(tl.bfloat16)) + 2 * X_OFF + ho, [16]),
                                        [BLOCK_H])
            tl.store(targets, row, mask=ho < H)
            if K > 0:
                weights = tl.load(weights_ptr + i64 * K + ko, mask=ko < K)
                tl.store(slot.to(tl.pointer_type(tl.float32)) + ko, weights, mask=ko < K)
    fence_sys()


@triton.jit
def combine_reduce_kernel(own_base, data_flag_word, in_rank_ptr, send_head_ptr, bias0_ptr, bias1_ptr, out_ptr,
                          out_weights_ptr, num_tokens, epoch_ptr, status_ptr, staging_word, slot_words, capacity,
                          timeout_ns, R: tl.constexpr, H: tl.constexpr, K: tl.constexpr, X_OFF: tl.constexpr,
                          HAS_BIAS0: tl.constexpr, HAS_BIAS1: tl.constexpr, BLOCK_H: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    epoch = tl.load(epoch_ptr)
    flags = own_base.to(tl.pointer_type(tl.int64)) + data_flag_word
    ready = wait_all_peers(flags, epoch, timeout_ns, status_ptr, WAIT_DATA, R)
    tl.debug_barrier()
    ho = tl.arange(0, BLOCK_H)
    ko = tl.arange(0, BLOCK_K)
    if ready:
        for t in range(pid, num_tokens, num_programs):
            t64 = t.to(tl.int64)
            total = tl.zeros([BLOCK_H], tl.float32)
            if HAS_BIAS0:
                total += tl.load(bias0_ptr + t64 * H + ho, mask=ho < H).to(tl.float32)
            if HAS_BIAS1:
                total += tl.load(bias1_ptr + t64 * H + ho, mask=ho < H).to(tl.float32)
            weight_total = tl.zeros([BLOCK_K], tl.float32)
            for d in tl.static_range(R):
                if tl.load(in_rank_ptr + t64 * R + d) != 0:
                    position = tl.load(send_head_ptr + t64 * R + d).to(tl.int64)
                    slot = own_base + (staging_word + (d * capacity + position) * slot_words) * 4
                    slot = tl.multiple_of(slot, 16)
                    sources = tl.max_contiguous(
                        tl.multiple_of(slot.to(tl.pointer_type(tl.bfloat16)) + 2 * X_OFF + ho, [16]), [BLOCK_H])
                    row = tl.load(sources, mask=ho < H, cache_modifier=".cg")
                    total += row.to(tl.float32)
                    if K > 0:
                        weight_total += tl.load(slot.to(tl.pointer_type(tl.float32)) + ko, mask=ko < K,
                                                cache_modifier=".cg")
            tl.store(out_ptr + t64 * H + ho, total.to(tl.bfloat16), mask=ho < H)
            if K > 0:
                tl.store(out_weights_ptr + t64 * K + ko, weight_total, mask=ko < K)
