"""Normal combine over peer-mapped buffers: one kernel, C sender and C reducer programs, streaming back
through the same rings and counters as the dispatch (dispatch.py), in the other direction: ring (d, q) of
rank s holds the rows rank d returns to s from channel q, TAIL[d][q] counts what d has put in, HEAD[s][q]
in d's buffer what s has taken out.

Slot of a returned row: [weights f32 x K | pad to X_OFF words | bf16 payload x H].
Protocol (channel q; rank d returns to source s the rows it received from (s, q), in the same order):
  every program first waits until every peer has read all earlier operations out of its buffer, and the
    last to finish publishes that this rank has (sync.begin_operation / end_operation).
  sender q of rank d: round-robin over the sources (starting after itself, so that all links are
    busy), send up to `batch` rows to each s that has room (HEAD[s][q] in this rank's buffer), publish
    TAIL[d][q] in s's buffer. A sender never blocks on one full ring while another has room.
  reducer q of rank s: per batch of its tokens, wait until every destination's rows for the batch arrived
    (TAIL), reduce them (Note [reduction order]), then publish HEAD[s][q] in every destination's buffer.
A reducer waits for at most `batch` rows per ring (batch <= ring_slots) after freeing all earlier ones,
and senders never block on one ring, so the exchange cannot deadlock.

Note [reduction order]: out[t] = bf16(f32(bias0) + f32(bias1) + sum over d ascending with
is_token_in_rank[t, d] of f32(row from d)), the reference transport's order, so the result is bitwise
equal to it. The biases are added first in one add (an absent one as +0: two -0 biases give -0), and a
row is added only where the token went to d (not + 0.0 elsewhere: a -0 total stays -0). The rank's own
rows are read from the combine input directly.
"""
import triton
import triton.language as tl

from .dispatch import (counters_at_peers, counters_here, rows_before, slot_addresses, timed_out,
                       token_routes)
from .intrinsics import clock_ns, to_bf16
from .sync import begin_operation, channel_tokens, end_operation, lane, peer_view, publish, wait_at_least
from .status import WAIT_ROWS, WAIT_SPACE


# ---- rows and their sums (shared with direct.py) --------------------------------------------------------------
@triton.jit
def return_rows(rows, live, buffer, region, index, modulo, slot_words, x_ptr, weights_ptr, num_rows,
                H: tl.constexpr, K: tl.constexpr, X_OFF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows `rows` of x and their weights (where `live`) into slots `index % modulo` of the slots from word
    `region` of the buffer at `buffer`: zeros for rows x does not hold (num_worst_tokens dropped them)."""
    ho, ko = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_K)
    in_x = live & (rows < num_rows) & (rows >= 0)
    tile = tl.load(x_ptr + rows[:, None] * H + ho[None, :], mask=in_x[:, None] & (ho[None, :] < H), other=0.0)
    weights = tl.load(weights_ptr + rows[:, None] * K + ko[None, :], mask=in_x[:, None] & (ko[None, :] < K),
                      other=0.0)
    slots = tl.multiple_of(slot_addresses(buffer, region, index % modulo, slot_words), 16)
    targets = slots.to(tl.pointer_type(tl.bfloat16))[:, None] + 2 * X_OFF + ho[None, :]
    targets = tl.max_contiguous(tl.multiple_of(targets, [1, 16]), [1, BLOCK_H])
    tl.store(targets, tile, mask=live[:, None] & (ho[None, :] < H))
    if K > 0:
        tl.store(slots.to(tl.pointer_type(tl.float32))[:, None] + ko[None, :], weights,
                 mask=live[:, None] & (ko[None, :] < K))


@triton.jit
def add_slots(total, weight_total, slots, take, H: tl.constexpr, K: tl.constexpr, X_OFF: tl.constexpr,
              BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """total + the rows in slots `slots` (f32, where `take`), weight_total + their weights; read past L1."""
    ho, ko = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_K)
    slots = tl.multiple_of(slots, 16)
    sources = slots.to(tl.pointer_type(tl.bfloat16))[:, None] + 2 * X_OFF + ho[None, :]
    sources = tl.max_contiguous(tl.multiple_of(sources, [1, 16]), [1, BLOCK_H])
    rows = tl.load(sources, mask=take[:, None] & (ho[None, :] < H), other=0.0, cache_modifier=".cg").to(tl.float32)
    total = tl.where(take[:, None], total + rows, total)   # Note [reduction order]
    if K > 0:
        weight_total += tl.load(slots.to(tl.pointer_type(tl.float32))[:, None] + ko[None, :],
                                mask=take[:, None] & (ko[None, :] < K), other=0.0, cache_modifier=".cg")
    return total, weight_total


@triton.jit
def add_own_rows(total, weight_total, rows, take, x_ptr, weights_ptr, num_rows, H: tl.constexpr, K: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """total + this rank's own rows `rows` of x (f32, where `take`), weight_total + their weights; rows x does
    not hold (num_worst_tokens dropped them) add nothing."""
    ho, ko = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_K)
    own_row = take & (rows < num_rows) & (rows >= 0)
    values = tl.load(x_ptr + rows[:, None] * H + ho[None, :], mask=own_row[:, None] & (ho[None, :] < H),
                     other=0.0).to(tl.float32)
    total = tl.where(own_row[:, None], total + values, total)   # Note [reduction order]
    if K > 0:
        weight_total += tl.load(weights_ptr + rows[:, None] * K + ko[None, :],
                                mask=own_row[:, None] & (ko[None, :] < K), other=0.0)
    return total, weight_total


@triton.jit
def reduce_tokens(tokens, live, x_ptr, weights_ptr, in_rank_ptr, before_ptr, bias0_ptr, bias1_ptr, out_ptr,
                  out_weights_ptr, own, regions, index0, modulo, slot_words, self_row0, num_rows, rank, ro,
                  R: tl.constexpr, H: tl.constexpr, K: tl.constexpr, X_OFF: tl.constexpr, HAS_BIAS0: tl.constexpr,
                  HAS_BIAS1: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr):
    """Combined rows of a tile of this rank's tokens (where `live`), in Note [reduction order]. The row from
    peer d is in slot (index0[d] + position) % modulo of the slots at word regions[d] of this rank's buffer
    (position: the token's place among this rank's tokens for d); its own rows are rows self_row0 + position
    of x."""
    ho, ko = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_K)
    t64 = tokens.to(tl.int64)
    row_mask = live[:, None] & (ho[None, :] < H)
    bias0 = tl.zeros([ROWS, BLOCK_H], tl.float32)
    bias1 = tl.zeros([ROWS, BLOCK_H], tl.float32)
    if HAS_BIAS0:
        bias0 = tl.load(bias0_ptr + t64[:, None] * H + ho[None, :], mask=row_mask).to(tl.float32)
    if HAS_BIAS1:
        bias1 = tl.load(bias1_ptr + t64[:, None] * H + ho[None, :], mask=row_mask).to(tl.float32)
    total = bias0 + bias1
    weight_total = tl.zeros([ROWS, BLOCK_K], tl.float32)
    for d in tl.static_range(R):
        take, position = token_routes(t64, live, in_rank_ptr, before_ptr, d, R)
        position = position.to(tl.int64)
        if d == rank:
            total, weight_total = add_own_rows(total, weight_total, self_row0 + position, take, x_ptr, weights_ptr,
                                               num_rows, H, K, BLOCK_H, BLOCK_K)
        else:
            slot = (lane(index0, ro, d) + position) % modulo
            slots = slot_addresses(own, lane(regions, ro, d), slot, slot_words)
            total, weight_total = add_slots(total, weight_total, slots, take, H, K, X_OFF, BLOCK_H, BLOCK_K)
    tl.store(out_ptr + t64[:, None] * H + ho[None, :], to_bf16(total), mask=row_mask)
    if K > 0:
        tl.store(out_weights_ptr + t64[:, None] * K + ko[None, :], weight_total, mask=live[:, None] & (ko[None, :] < K))


# ---- the rings' combine ---------------------------------------------------------------------------------------
@triton.jit
def return_to_rings(step, first_index, first_row, q, x_ptr, weights_ptr, bases_ptr, num_rows, rank, ro, ring_word,
                    ring_words, slot_words, ring_slots, C: tl.constexpr, R: tl.constexpr, H: tl.constexpr,
                    K: tl.constexpr, X_OFF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                    ROWS: tl.constexpr):
    """For every source s, from the one after this rank on: step[s] rows of x from row first_row[s] on, into
    ring (rank, q) of s's buffer from ring index first_index[s] on."""
    to = tl.arange(0, ROWS)
    region = ring_word + (rank * C + q).to(tl.int64) * ring_words
    for k in range(R - 1):
        s = (rank + 1 + k) % R
        n = lane(step, ro, s)
        first = lane(first_index, ro, s)
        row0 = lane(first_row, ro, s)
        peer = tl.load(bases_ptr + s)
        for i in range(0, n, ROWS):
            return_rows(row0 + i + to, i + to < n, peer, region, first + i + to, ring_slots, slot_words, x_ptr,
                        weights_ptr, num_rows, H, K, X_OFF, BLOCK_H, BLOCK_K)


@triton.jit
def send_channel(q, ok, x_ptr, weights_ptr, recv_count_ptr, recv_base_ptr, bases_ptr, status_ptr, num_rows, rank,
                 ctrl, peers, ro, peer_bases, tail_word, head_word, sent_word, ring_word, ring_words, slot_words,
                 ring_slots, batch, timeout_ns, C: tl.constexpr, CMAX: tl.constexpr, R: tl.constexpr,
                 H: tl.constexpr, K: tl.constexpr, X_OFF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_R: tl.constexpr, ROWS: tl.constexpr):
    """Sender q: the rows received from (s, q), back into ring (rank, q) of every source s (module docstring)."""
    count = tl.load(recv_count_ptr + ro * C + q, mask=peers, other=0).to(tl.int64)
    row_base = tl.load(recv_base_ptr + ro * C + q, mask=peers, other=0).to(tl.int64)
    sent0 = tl.load(counters_here(ctrl, sent_word, ro, q, CMAX), mask=peers, other=0)
    head_ptrs = counters_here(ctrl, head_word, ro, q, CMAX)
    tail_ptrs = counters_at_peers(peer_bases, tail_word, rank, q, CMAX)
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
            return_to_rings(step, sent0 + sent, row_base + sent, q, x_ptr, weights_ptr, bases_ptr, num_rows, rank,
                            ro, ring_word, ring_words, slot_words, ring_slots, C, R, H, K, X_OFF, BLOCK_H, BLOCK_K,
                            ROWS)
            sent += step
            publish(tail_ptrs, sent0 + sent, peers)
            remaining = tl.sum(count - sent)
            start = clock_ns()
            idle = tl.zeros([], tl.int32)
        else:
            idle += 1
            if timed_out(start, idle, timeout_ns, status_ptr, WAIT_SPACE, open_, ro):
                failed = remaining > 0
    tl.store(counters_here(ctrl, sent_word, ro, q, CMAX), sent0 + count, mask=peers)


@triton.jit
def reduce_channel(q, ok, x_ptr, weights_ptr, in_rank_ptr, before_ptr, prefix_ptr, bias0_ptr, bias1_ptr, out_ptr,
                   out_weights_ptr, status_ptr, num_tokens, num_rows, rank, own, ctrl, peers, ro, peer_bases,
                   tail_word, head_word, recvd_word, ring_word, ring_words, slot_words, ring_slots, batch, timeout_ns,
                   C: tl.constexpr, CMAX: tl.constexpr, R: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
                   X_OFF: tl.constexpr, HAS_BIAS0: tl.constexpr, HAS_BIAS1: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_K: tl.constexpr, ROWS: tl.constexpr):
    """Reducer q: the channel's tokens, a batch at a time, from the rows in ring (d, q) of every peer d here
    (module docstring)."""
    to = tl.arange(0, ROWS)
    t0, t1 = channel_tokens(q, num_tokens, C)
    recvd0 = tl.load(counters_here(ctrl, recvd_word, ro, q, CMAX), mask=peers, other=0)
    base = recvd0 - rows_before(before_ptr, t0, ro, R).to(tl.int64)   # + before[t, d]: ring index of token t's row at d
    tail_ptrs = counters_here(ctrl, tail_word, ro, q, CMAX)
    head_ptrs = counters_at_peers(peer_bases, head_word, rank, q, CMAX)
    self_row0 = tl.load(prefix_ptr + rank).to(tl.int64)
    regions = ring_word + (ro * C + q).to(tl.int64) * ring_words
    for tb in range(t0, t1, batch):
        te = tl.minimum(tb + batch, t1)
        upto = base + rows_before(before_ptr, te, ro, R).to(tl.int64)
        if ok:
            ok = wait_at_least(tail_ptrs, upto, peers, ro, timeout_ns, status_ptr, WAIT_ROWS)
        if ok:
            for first_token in range(tb, te, ROWS):
                reduce_tokens(first_token + to, first_token + to < te, x_ptr, weights_ptr, in_rank_ptr, before_ptr,
                              bias0_ptr, bias1_ptr, out_ptr, out_weights_ptr, own, regions, base, ring_slots,
                              slot_words, self_row0, num_rows, rank, ro, R, H, K, X_OFF, HAS_BIAS0, HAS_BIAS1, BLOCK_H,
                              BLOCK_K, ROWS)
            publish(head_ptrs, upto, peers)
    tl.store(counters_here(ctrl, recvd_word, ro, q, CMAX), base + rows_before(before_ptr, t1, ro, R).to(tl.int64),
             mask=peers)


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
    ops, ok = begin_operation(ctrl, ops_word, done_word, peers, ro, timeout_ns, status_ptr)
    if pid < C:
        send_channel(pid, ok, x_ptr, weights_ptr, recv_count_ptr, recv_base_ptr, bases_ptr, status_ptr, num_rows,
                     rank, ctrl, peers, ro, peer_bases, tail_word, head_word, sent_word, ring_word, ring_words,
                     slot_words, ring_slots, batch, timeout_ns, C, CMAX, R, H, K, X_OFF, BLOCK_H, BLOCK_K, BLOCK_R,
                     ROWS)
    else:
        reduce_channel(pid - C, ok, x_ptr, weights_ptr, in_rank_ptr, before_ptr, prefix_ptr, bias0_ptr, bias1_ptr,
                       out_ptr, out_weights_ptr, status_ptr, num_tokens, num_rows, rank, own, ctrl, peers, ro,
                       peer_bases, tail_word, head_word, recvd_word, ring_word, ring_words, slot_words, ring_slots,
                       batch, timeout_ns, C, CMAX, R, H, K, X_OFF, HAS_BIAS0, HAS_BIAS1, BLOCK_H, BLOCK_K, ROWS)
    end_operation(ctrl, ops_word, done_word, ticket_word, peer_bases, rank, peers, ops)
