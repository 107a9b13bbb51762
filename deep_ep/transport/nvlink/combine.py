"""Normal combine over peer-mapped buffers: one kernel, C sender and C reducer programs, streaming back
through the same rings and counters as the dispatch (see dispatch.py), in the other direction.

Slot of a returned row: [weights f32 x K | pad to X_OFF words | bf16 payload x H].
Protocol (channel q; rank d returns to source s the rows it received from (s, q), in the same order):
  every program first waits until every peer has read all earlier operations out of its buffer, and the
    last to finish publishes that this rank has (sync.begin_operation / end_operation).
  sender q of rank d: round-robin over the sources (starting after itself, so that all links are
    busy), send up to `batch` rows to each s that has room (HEAD[s][q] in this rank's buffer), publish
    TAIL[d][q] in s's buffer. A sender never blocks on one full ring while another has room.
  reducer q of rank s: per batch of its tokens, wait until every destination's rows for the batch arrived
    (TAIL), then out[t] = bf16(f32(bias0) + f32(bias1) + sum over d ascending with is_token_in_rank[t, d]
    of f32(row from d)): the reference transport's order, so bitwise equal. Its own rows are read from the
    combine input directly. Then publish HEAD[s][q] in every destination's buffer.
A reducer waits for at most `batch` rows per ring (batch <= ring_slots) after freeing all earlier ones,
and senders never block on one ring, so the exchange cannot deadlock.
"""
import triton
import triton.language as tl

from .intrinsics import clock_ns, to_bf16
from .sync import (begin_operation, channel_tokens, end_operation, lane, peer_view, gave_up, publish, report_timeout,
                   wait_at_least)
from .status import NO_PEER, WAIT_ROWS, WAIT_SPACE


@triton.jit
def store_combine_slots(slots, live, tile, weights, ho, ko, H: tl.constexpr, K: tl.constexpr, X_OFF: tl.constexpr,
                        BLOCK_H: tl.constexpr):
    """Rows (bf16 tile) and their weights into slots at byte addresses `slots` (where `live`)."""
    slots = tl.multiple_of(slots, 16)
    targets = slots.to(tl.pointer_type(tl.bfloat16))[:, None] + 2 * X_OFF + ho[None, :]
    targets = tl.max_contiguous(tl.multiple_of(targets, [1, 16]), [1, BLOCK_H])
    tl.store(targets, tile, mask=live[:, None] & (ho[None, :] < H))
    if K > 0:
        tl.store(slots.to(tl.pointer_type(tl.float32))[:, None] + ko[None, :], weights,
                 mask=live[:, None] & (ko[None, :] < K))


@triton.jit
def add_combine_slots(total, weight_total, slots, take, ho, ko, H: tl.constexpr, K: tl.constexpr,
                      X_OFF: tl.constexpr, BLOCK_H: tl.constexpr):
    """total + the rows in slots `slots` (f32, where `take`), weight_total + their weights; read past L1."""
    slots = tl.multiple_of(slots, 16)
    sources = slots.to(tl.pointer_type(tl.bfloat16))[:, None] + 2 * X_OFF + ho[None, :]
    sources = tl.max_contiguous(tl.multiple_of(sources, [1, 16]), [1, BLOCK_H])
    rows = tl.load(sources, mask=take[:, None] & (ho[None, :] < H), other=0.0, cache_modifier=".cg").to(tl.float32)
    total = tl.where(take[:, None], total + rows, total)   # (not + 0.0 where not taken: a -0 total stays -0)
    if K > 0:
        weight_total += tl.load(slots.to(tl.pointer_type(tl.float32))[:, None] + ko[None, :],
                                mask=take[:, None] & (ko[None, :] < K), other=0.0, cache_modifier=".cg")
    return total, weight_total


@triton.jit
def reduce_tokens(tokens, live, x_ptr, weights_ptr, in_rank_ptr, before_ptr, bias0_ptr, bias1_ptr, out_ptr,
                  out_weights_ptr, own, regions, index0, modulo, slot_words, self_row0, num_rows, rank, ro, ho, ko,
                  R: tl.constexpr, H: tl.constexpr, K: tl.constexpr, X_OFF: tl.constexpr, HAS_BIAS0: tl.constexpr,
                  HAS_BIAS1: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr):
    """Combined rows of a tile of this rank's tokens (where `live`): out[t] = bf16(f32(bias0) + f32(bias1) + sum
    over ranks d ascending with is_token_in_rank[t, d] of f32(row from d)), the reference transport's order.
    The row from peer d is in slot (index0[d] + position) % modulo of the slots at word regions[d] of this
    rank's buffer (position: the token's place among this rank's tokens for d); its own rows are read from x
    (row self_row0 + position)."""
    t64 = tokens.to(tl.int64)
    row_mask = live[:, None] & (ho[None, :] < H)
    # f32(bias0) + f32(bias1) in one add, an absent bias +0 (two -0 biases give -0)
    bias0 = tl.zeros([ROWS, BLOCK_H], tl.float32)
    bias1 = tl.zeros([ROWS, BLOCK_H], tl.float32)
    if HAS_BIAS0:
        bias0 = tl.load(bias0_ptr + t64[:, None] * H + ho[None, :], mask=row_mask).to(tl.float32)
    if HAS_BIAS1:
        bias1 = tl.load(bias1_ptr + t64[:, None] * H + ho[None, :], mask=row_mask).to(tl.float32)
    total = bias0 + bias1
    weight_total = tl.zeros([ROWS, BLOCK_K], tl.float32)
    for d in tl.static_range(R):
        take = live & (tl.load(in_rank_ptr + t64 * R + d, mask=live, other=0) != 0)
        position = tl.load(before_ptr + t64 * R + d, mask=live, other=0).to(tl.int64)
        if d == rank:
            rows = self_row0 + position
            own_row = take & (rows < num_rows) & (rows >= 0)   # num_worst_tokens: dropped rows
            own_values = tl.load(x_ptr + rows[:, None] * H + ho[None, :], mask=own_row[:, None] & (ho[None, :] < H),
                                 other=0.0).to(tl.float32)
            total = tl.where(own_row[:, None], total + own_values, total)
            if K > 0:
                weight_total += tl.load(weights_ptr + rows[:, None] * K + ko[None, :],
                                        mask=own_row[:, None] & (ko[None, :] < K), other=0.0)
        else:
            index = (lane(index0, ro, d) + position) % modulo
            slots = own + 4 * (lane(regions, ro, d) + index * slot_words)
            total, weight_total = add_combine_slots(total, weight_total, slots, take, ho, ko, H, K, X_OFF, BLOCK_H)
    tl.store(out_ptr + t64[:, None] * H + ho[None, :], to_bf16(total), mask=row_mask)
    if K > 0:
        tl.store(out_weights_ptr + t64[:, None] * K + ko[None, :], weight_total, mask=live[:, None] & (ko[None, :] < K))


@triton.jit
def combine_kernel(x_ptr, weights_ptr, in_rank_ptr, before_ptr, recv_count_ptr, recv_base_ptr, prefix_ptr, bias0_ptr,
                   bias1_ptr, out_ptr, out_weights_ptr, bases_ptr, status_ptr, num_tokens, num_rows, rank, tail_word,
                   head_word, sent_word, recvd_word, ops_word, done_word, ticket_word, ring_word, ring_words,
                   slot_words, ring_slots, batch, timeout_ns,
                   C: tl.constexpr, CMAX: tl.constexpr, R: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
                   X_OFF: tl.constexpr, HAS_BIAS0: tl.constexpr, HAS_BIAS1: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, ROWS: tl.constexpr):
    pid = tl.program_id(0)
    ro, peers, own, ctrl, peer_bases = peer_view(bases_ptr, rank, R, BLOCK_R)
    to = tl.arange(0, ROWS)
    ho = tl.arange(0, BLOCK_H)
    ko = tl.arange(0, BLOCK_K)
    ops, ok = begin_operation(ctrl, ops_word, done_word, peers, ro, timeout_ns, status_ptr)
    if pid < C:
        # ---- sender of channel q --------------------------------------------------------------------------
        q = pid
        count = tl.load(recv_count_ptr + ro * C + q, mask=peers, other=0).to(tl.int64)
        row_base = tl.load(recv_base_ptr + ro * C + q, mask=peers, other=0).to(tl.int64)
        sent0 = tl.load(ctrl + sent_word + ro * CMAX + q, mask=peers, other=0)
        head_ptrs = ctrl + head_word + ro * CMAX + q
        tail_ptrs = (peer_bases + (tail_word + rank * CMAX + q) * 8).to(tl.pointer_type(tl.int64))
        sent = tl.zeros([BLOCK_R], tl.int64)
        remaining = tl.sum(count)
        failed = ok == 0
        start = clock_ns()
        idle = tl.zeros([], tl.int32)
        while (remaining > 0) & (failed == 0):
            open_ = peers & (sent < count)
            heads = tl.atomic_add(head_ptrs, 0, mask=open_, sem="acquire", scope="sys")
            room = ring_slots - (sent0 + sent - heads)
            step = tl.where(open_, tl.minimum(tl.minimum(room, count - sent), batch), 0)
            if tl.sum(step) > 0:
                for k in range(R - 1):
                    s = (rank + 1 + k) % R
                    n = lane(step, ro, s)
                    first = lane(sent0 + sent, ro, s)
                    row0 = lane(row_base + sent, ro, s)
                    ring = tl.load(bases_ptr + s) + 4 * (ring_word + (rank * C + q).to(tl.int64) * ring_words)
                    for i in range(0, n, ROWS):
                        rows = row0 + i + to
                        live = i + to < n
                        in_x = live & (rows < num_rows) & (rows >= 0)   # num_worst_tokens: rows past x were dropped
                        tile = tl.load(x_ptr + rows[:, None] * H + ho[None, :], mask=in_x[:, None] & (ho[None, :] < H),
                                       other=0.0)
                        weights = tl.load(weights_ptr + rows[:, None] * K + ko[None, :],
                                          mask=in_x[:, None] & (ko[None, :] < K), other=0.0)
                        store_combine_slots(ring + 4 * ((first + i + to) % ring_slots) * slot_words, live, tile,
                                            weights, ho, ko, H, K, X_OFF, BLOCK_H)
                sent += step
                publish(tail_ptrs, sent0 + sent, peers)
                remaining = tl.sum(count - sent)
                start = clock_ns()
                idle = tl.zeros([], tl.int32)
            else:
                idle += 1
                if gave_up(start, idle, timeout_ns, status_ptr):
                    report_timeout(status_ptr, WAIT_SPACE, tl.min(tl.where(open_, ro, NO_PEER)))
                    failed = remaining > 0
        tl.store(ctrl + sent_word + ro * CMAX + q, sent0 + count, mask=peers)
    else:
        # ---- reducer of channel q ---------------------------------------------------------------------------
        q = pid - C
        t0, t1 = channel_tokens(q, num_tokens, C)
        recvd0 = tl.load(ctrl + recvd_word + ro * CMAX + q, mask=peers, other=0)
        base = recvd0 - tl.load(before_ptr + t0 * R + ro, mask=ro < R, other=0).to(tl.int64)
        tail_ptrs = ctrl + tail_word + ro * CMAX + q
        head_ptrs = (peer_bases + (head_word + rank * CMAX + q) * 8).to(tl.pointer_type(tl.int64))
        self_row0 = tl.load(prefix_ptr + rank).to(tl.int64)
        regions = ring_word + (ro * C + q).to(tl.int64) * ring_words   # ring (d, q) here, for every peer d
        for tb in range(t0, t1, batch):
            te = tl.minimum(tb + batch, t1)
            upto = base + tl.load(before_ptr + te * R + ro, mask=ro < R, other=0).to(tl.int64)
            if ok:
                ok = wait_at_least(tail_ptrs, upto, peers, ro, timeout_ns, status_ptr, WAIT_ROWS)
            if ok:
                for first_token in range(tb, te, ROWS):
                    reduce_tokens(first_token + to, first_token + to < te, x_ptr, weights_ptr, in_rank_ptr, before_ptr,
                                  bias0_ptr, bias1_ptr, out_ptr, out_weights_ptr, own, regions, base, ring_slots,
                                  slot_words, self_row0, num_rows, rank, ro, ho, ko, R, H, K, X_OFF, HAS_BIAS0,
                                  HAS_BIAS1, BLOCK_H, BLOCK_K, ROWS)
                publish(head_ptrs, upto, peers)
        done = base + tl.load(before_ptr + t1 * R + ro, mask=ro < R, other=0).to(tl.int64)
        tl.store(ctrl + recvd_word + ro * CMAX + q, done, mask=peers)
    end_operation(ctrl, ops_word, done_word, ticket_word, peer_bases, rank, peers, ops)
