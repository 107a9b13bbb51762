"""Normal dispatch over peer-mapped buffers: one kernel, C sender and C receiver programs, streaming
through a ring per (source rank, channel) in every destination's buffer, so any buffer size works.

Buffers (per rank; int64 counters that only grow, counting rows since the Buffer was made, never reset):
  TAIL[src][ch]  rows source src has put into its ring (src, ch) here: written by src's sender ch
  HEAD[dst][ch]  rows destination dst has taken out of this rank's ring (rank, ch) there: written by dst's
                 receiver ch
  SENT[dst][ch], RECVD[src][ch]  this rank's own totals at the end of the last operation
  rings of `ring_slots` slots, one per (source, channel); a slot holds one token:
  [payload words | scale words | pad | top-k ids int64 | weights f32 | source token].

Protocol (channel q = tokens [q * ceil(T/C), ...)):
  every program first waits until every peer has read all earlier operations out of its buffer
    (sync.begin_operation: rings may change slot size, and another protocol may have used the area), and
    the last program to finish publishes that this rank has (sync.end_operation).
  sender q of rank s, per batch of tokens: wait until HEAD[d][q] leaves room for the batch's rows in every
    peer d, store each token at slot (row counter mod ring_slots) of ring (s, q) in every peer d that
    receives it (this rank's own tokens straight into its outputs), then publish TAIL[s][q] in every peer
    (sync.publish: release after a barrier).
  receiver q of rank d: poll TAIL[s][q] of every source s, copy the rows that arrived into the outputs
    (row = first row of (s, q) in the outputs + index), publish HEAD[d][q] in each source's buffer. Every
    pass serves every source with rows, so a receiver never waits on one source while another has rows.
    Then it marks its share of the output rows past the received ones (num_worst_tokens) as empty.
Rows of (s, q) land in the outputs in token order after the rows of (s, q - 1): the reference order.

The helpers that move tokens (slots, outputs, pushes) serve the direct protocol too (direct.py), and the
counter and wait helpers serve the combines (combine.py, direct.py).
"""
import triton
import triton.language as tl

from .intrinsics import clock_ns
from .sync import (begin_operation, channel_tokens, end_operation, gave_up, lane, peer_view, publish, report_timeout,
                   row_pointers, wait_at_least)
from .status import NO_PEER, WAIT_ROWS, WAIT_SPACE


# ---- counters and waits (shared with combine.py and direct.py) ------------------------------------------------
@triton.jit
def counters_here(ctrl, word, ro, column, STRIDE: tl.constexpr):
    """Pointers to the counters [every rank lane][column] of the table at `word` in this rank's buffer."""
    return ctrl + word + ro * STRIDE + column


@triton.jit
def counters_at_peers(peer_bases, word, rank, column, STRIDE: tl.constexpr):
    """Pointers to counter [rank][column] of the table at `word` in every rank lane's buffer."""
    return (peer_bases + (word + rank * STRIDE + column) * 8).to(tl.pointer_type(tl.int64))


@triton.jit
def rows_before(before_ptr, token, ro, R: tl.constexpr):
    """before[token, d] for every rank lane d: this rank's tokens before `token` that go to rank d."""
    return tl.load(before_ptr + token * R + ro, mask=ro < R, other=0)


@triton.jit
def token_routes(t64, live, in_rank_ptr, before_ptr, d, R: tl.constexpr):
    """For rank d and tokens `t64` (where `live`): whether each goes to d, and its position among this rank's
    tokens for d (before[t, d])."""
    goes = live & (tl.load(in_rank_ptr + t64 * R + d, mask=live, other=0) != 0)
    return goes, tl.load(before_ptr + t64 * R + d, mask=live, other=0)


@triton.jit
def slot_addresses(buffer, region, slot, slot_words):
    """Byte addresses of the slots numbered `slot` of the slots from word `region` of the buffer at `buffer`."""
    return buffer + 4 * (region + slot * slot_words)


@triton.jit
def timed_out(start, idle, timeout_ns, status_ptr, code, waiting, ro):
    """After `idle` polls without progress since `start`: whether the program stops waiting (sync.gave_up);
    then the timeout is reported with `code` and the first rank lane of `waiting`."""
    stop = gave_up(start, idle, timeout_ns, status_ptr)
    if stop:
        report_timeout(status_ptr, code, tl.min(tl.where(waiting, ro, NO_PEER)))
    return stop


# ---- tokens, slots and outputs (shared with direct.py) --------------------------------------------------------
@triton.jit
def load_tokens(tokens, live, x_ptr, scales_ptr, idx_ptr, weights_ptr, XW: tl.constexpr, SW: tl.constexpr,
                K: tl.constexpr, HAS_W: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_S: tl.constexpr,
                BLOCK_K: tl.constexpr, ROWS: tl.constexpr):
    """A tile of this rank's tokens: payload words, scales, top-k ids and weights (zeros where absent)."""
    xo, so, ko = tl.arange(0, BLOCK_X), tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_K)
    t64 = tokens.to(tl.int64)
    x = tl.load(row_pointers(x_ptr.to(tl.int64) + t64 * (4 * XW), xo, tl.int32, BLOCK_X),
                mask=live[:, None] & (xo[None, :] < XW))
    scales = tl.zeros([ROWS, BLOCK_S], tl.int32)
    ids = tl.zeros([ROWS, BLOCK_K], tl.int64)
    weights = tl.zeros([ROWS, BLOCK_K], tl.float32)
    if SW > 0:
        scales = tl.load(scales_ptr + t64[:, None] * SW + so[None, :], mask=live[:, None] & (so[None, :] < SW))
    if K > 0:
        ids = tl.load(idx_ptr + t64[:, None] * K + ko[None, :], mask=live[:, None] & (ko[None, :] < K))
        if HAS_W:
            weights = tl.load(weights_ptr + t64[:, None] * K + ko[None, :], mask=live[:, None] & (ko[None, :] < K))
    return x, scales, ids, weights


@triton.jit
def store_slots(slots, send, x, scales, ids, weights, tokens, XW: tl.constexpr, SW: tl.constexpr, K: tl.constexpr,
                ID_OFF: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr):
    """Tokens into slots at byte addresses `slots` (where `send`): [payload | scales | pad | top-k ids int64 |
    weights f32 | source token]."""
    xo, so, ko = tl.arange(0, BLOCK_X), tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_K)
    tl.store(row_pointers(slots, xo, tl.int32, BLOCK_X), x, mask=send[:, None] & (xo[None, :] < XW))
    words = slots.to(tl.pointer_type(tl.int32))[:, None]
    if SW > 0:
        tl.store(words + XW + so[None, :], scales, mask=send[:, None] & (so[None, :] < SW))
    if K > 0:
        tl.store((words + ID_OFF).to(tl.pointer_type(tl.int64), bitcast=True) + ko[None, :], ids,
                 mask=send[:, None] & (ko[None, :] < K))
        tl.store((words + ID_OFF + 2 * K).to(tl.pointer_type(tl.float32), bitcast=True) + ko[None, :], weights,
                 mask=send[:, None] & (ko[None, :] < K))
    tl.store(slots.to(tl.pointer_type(tl.int32)) + ID_OFF + 3 * K, tokens, mask=send)


@triton.jit
def load_slots(slots, live, XW: tl.constexpr, SW: tl.constexpr, K: tl.constexpr, HAS_W: tl.constexpr,
               ID_OFF: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
               ROWS: tl.constexpr):
    """What store_slots wrote (where `live`; zeros elsewhere), read past the L1 cache: peers wrote it."""
    xo, so, ko = tl.arange(0, BLOCK_X), tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_K)
    x = tl.load(row_pointers(slots, xo, tl.int32, BLOCK_X), mask=live[:, None] & (xo[None, :] < XW),
                cache_modifier=".cg")
    words = slots.to(tl.pointer_type(tl.int32))[:, None]
    scales = tl.zeros([ROWS, BLOCK_S], tl.int32)
    ids = tl.zeros([ROWS, BLOCK_K], tl.int64)
    weights = tl.zeros([ROWS, BLOCK_K], tl.float32)
    if SW > 0:
        scales = tl.load(words + XW + so[None, :], mask=live[:, None] & (so[None, :] < SW), cache_modifier=".cg")
    if K > 0:
        ids = tl.load((words + ID_OFF).to(tl.pointer_type(tl.int64), bitcast=True) + ko[None, :],
                      mask=live[:, None] & (ko[None, :] < K), cache_modifier=".cg")
        if HAS_W:
            weights = tl.load((words + ID_OFF + 2 * K).to(tl.pointer_type(tl.float32), bitcast=True) + ko[None, :],
                              mask=live[:, None] & (ko[None, :] < K), cache_modifier=".cg")
    tokens = tl.load(slots.to(tl.pointer_type(tl.int32)) + ID_OFF + 3 * K, mask=live, cache_modifier=".cg")
    return x, scales, ids, weights, tokens


@triton.jit
def store_outputs(rows, keep, x, scales, ids, weights, tokens, out_x_ptr, out_scales_ptr, out_idx_ptr,
                  out_weights_ptr, out_src_ptr, num_rows, expert_begin, experts_per_rank, XW: tl.constexpr,
                  SW: tl.constexpr, K: tl.constexpr, HAS_W: tl.constexpr, BLOCK_X: tl.constexpr,
                  BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr):
    """Received rows (where `keep`) into the outputs: ids of other ranks' experts become -1, their weights 0.
    Rows from `num_rows` on are dropped (num_worst_tokens smaller than what arrives)."""
    xo, so, ko = tl.arange(0, BLOCK_X), tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_K)
    keep = keep & (rows >= 0) & (rows < num_rows)   # rows come from the plan; never write outside the outputs
    rows64 = rows.to(tl.int64)[:, None]
    keep2 = keep[:, None]
    tl.store(row_pointers(out_x_ptr.to(tl.int64) + rows.to(tl.int64) * (4 * XW), xo, tl.int32, BLOCK_X), x,
             mask=keep2 & (xo[None, :] < XW))
    if SW > 0:
        tl.store(out_scales_ptr + rows64 * SW + so[None, :], scales, mask=keep2 & (so[None, :] < SW))
    if K > 0:
        local = (ids >= expert_begin) & (ids < expert_begin + experts_per_rank)
        tl.store(out_idx_ptr + rows64 * K + ko[None, :], tl.where(local, ids - expert_begin, -1),
                 mask=keep2 & (ko[None, :] < K))
        if HAS_W:
            tl.store(out_weights_ptr + rows64 * K + ko[None, :], tl.where(local, weights, 0.0),
                     mask=keep2 & (ko[None, :] < K))
    tl.store(out_src_ptr + rows.to(tl.int64), tokens, mask=keep)


@triton.jit
def copy_slots_out(slots, rows, live, out_x_ptr, out_scales_ptr, out_idx_ptr, out_weights_ptr, out_src_ptr, num_rows,
                   expert_begin, experts_per_rank, XW: tl.constexpr, SW: tl.constexpr, K: tl.constexpr,
                   HAS_W: tl.constexpr, ID_OFF: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_S: tl.constexpr,
                   BLOCK_K: tl.constexpr, ROWS: tl.constexpr):
    """The tokens in slots `slots` (where `live`) into the output rows `rows`."""
    x, scales, ids, weights, tokens = load_slots(slots, live, XW, SW, K, HAS_W, ID_OFF, BLOCK_X, BLOCK_S, BLOCK_K,
                                                 ROWS)
    store_outputs(rows, live, x, scales, ids, weights, tokens, out_x_ptr, out_scales_ptr, out_idx_ptr,
                  out_weights_ptr, out_src_ptr, num_rows, expert_begin, experts_per_rank, XW, SW, K, HAS_W, BLOCK_X,
                  BLOCK_S, BLOCK_K)


@triton.jit
def push_tile(tokens, live, x_ptr, scales_ptr, idx_ptr, weights_ptr, in_rank_ptr, before_ptr, out_x_ptr,
              out_scales_ptr, out_idx_ptr, out_weights_ptr, out_src_ptr, bases_ptr, regions, index0, modulo,
              slot_words, self_row0, num_rows, rank, expert_begin, experts_per_rank, ro, R: tl.constexpr,
              XW: tl.constexpr, SW: tl.constexpr, K: tl.constexpr, HAS_W: tl.constexpr, ID_OFF: tl.constexpr,
              BLOCK_X: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr):
    """A tile of this rank's tokens (where `live`) to every peer d that receives them, into slot
    (index0[d] + position) % modulo of the slots at word regions[d] of d's buffer, position being the token's
    place among this rank's tokens for d; this rank's own ones into its outputs (row self_row0 + position)."""
    x, scales, ids, weights = load_tokens(tokens, live, x_ptr, scales_ptr, idx_ptr, weights_ptr, XW, SW, K, HAS_W,
                                          BLOCK_X, BLOCK_S, BLOCK_K, ROWS)
    for d in tl.static_range(R):
        keep, position = token_routes(tokens.to(tl.int64), live, in_rank_ptr, before_ptr, d, R)
        if d == rank:
            store_outputs(self_row0 + position, keep, x, scales, ids, weights, tokens, out_x_ptr, out_scales_ptr,
                          out_idx_ptr, out_weights_ptr, out_src_ptr, num_rows, expert_begin, experts_per_rank, XW,
                          SW, K, HAS_W, BLOCK_X, BLOCK_S, BLOCK_K)
        else:
            slot = (lane(index0, ro, d) + position) % modulo
            slots = slot_addresses(tl.load(bases_ptr + d), lane(regions, ro, d), slot, slot_words)
            store_slots(slots, keep, x, scales, ids, weights, tokens, XW, SW, K, ID_OFF, BLOCK_X, BLOCK_S, BLOCK_K)


@triton.jit
def push_tokens(first, end, x_ptr, scales_ptr, idx_ptr, weights_ptr, in_rank_ptr, before_ptr, out_x_ptr,
                out_scales_ptr, out_idx_ptr, out_weights_ptr, out_src_ptr, bases_ptr, regions, index0, modulo,
                slot_words, self_row0, num_rows, rank, expert_begin, experts_per_rank, ro, R: tl.constexpr,
                XW: tl.constexpr, SW: tl.constexpr, K: tl.constexpr, HAS_W: tl.constexpr, ID_OFF: tl.constexpr,
                BLOCK_X: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr):
    """This rank's tokens [first, end), a tile at a time (push_tile)."""
    to = tl.arange(0, ROWS)
    for first_token in range(first, end, ROWS):
        push_tile(first_token + to, first_token + to < end, x_ptr, scales_ptr, idx_ptr, weights_ptr, in_rank_ptr,
                  before_ptr, out_x_ptr, out_scales_ptr, out_idx_ptr, out_weights_ptr, out_src_ptr, bases_ptr, regions,
                  index0, modulo, slot_words, self_row0, num_rows, rank, expert_begin, experts_per_rank, ro, R, XW, SW,
                  K, HAS_W, ID_OFF, BLOCK_X, BLOCK_S, BLOCK_K, ROWS)


# ---- the rings' dispatch --------------------------------------------------------------------------------------
@triton.jit
def send_channel(q, ok, x_ptr, scales_ptr, idx_ptr, weights_ptr, in_rank_ptr, before_ptr, prefix_ptr, out_x_ptr,
                 out_scales_ptr, out_idx_ptr, out_weights_ptr, out_src_ptr, bases_ptr, status_ptr, num_tokens, num_rows,
                 rank, expert_begin, experts_per_rank, ctrl, peers, ro, peer_bases, tail_word, head_word, sent_word,
                 ring_word, ring_words, slot_words, ring_slots, batch, timeout_ns, C: tl.constexpr,
                 CMAX: tl.constexpr, R: tl.constexpr, XW: tl.constexpr, SW: tl.constexpr, K: tl.constexpr,
                 HAS_W: tl.constexpr, ID_OFF: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_S: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, ROWS: tl.constexpr):
    """Sender q: the channel's tokens, a batch at a time, into ring (rank, q) of every peer (module docstring)."""
    t0, t1 = channel_tokens(q, num_tokens, C)
    sent0 = tl.load(counters_here(ctrl, sent_word, ro, q, CMAX), mask=peers, other=0)
    base = sent0 - rows_before(before_ptr, t0, ro, R).to(tl.int64)   # + before[t, d]: ring index of token t's row at d
    head_ptrs = counters_here(ctrl, head_word, ro, q, CMAX)
    tail_ptrs = counters_at_peers(peer_bases, tail_word, rank, q, CMAX)
    self_row0 = tl.load(prefix_ptr + rank)
    region = tl.full([BLOCK_R], ring_word, tl.int64) + (rank * C + q).to(tl.int64) * ring_words
    for tb in range(t0, t1, batch):
        te = tl.minimum(tb + batch, t1)
        upto = base + rows_before(before_ptr, te, ro, R).to(tl.int64)
        if ok:   # room for the batch: the ring's rows up to `upto` overwrite only rows the peer has taken
            ok = wait_at_least(head_ptrs, upto - ring_slots, peers, ro, timeout_ns, status_ptr, WAIT_SPACE)
        if ok:
            push_tokens(tb, te, x_ptr, scales_ptr, idx_ptr, weights_ptr, in_rank_ptr, before_ptr, out_x_ptr,
                        out_scales_ptr, out_idx_ptr, out_weights_ptr, out_src_ptr, bases_ptr, region, base, ring_slots,
                        slot_words, self_row0, num_rows, rank, expert_begin, experts_per_rank, ro, R, XW, SW, K, HAS_W,
                        ID_OFF, BLOCK_X, BLOCK_S, BLOCK_K, ROWS)
            publish(tail_ptrs, upto, peers)
    tl.store(counters_here(ctrl, sent_word, ro, q, CMAX), base + rows_before(before_ptr, t1, ro, R).to(tl.int64),
             mask=peers)


@triton.jit
def copy_out_rings(arrived, first_index, first_row, q, own, out_x_ptr, out_scales_ptr, out_idx_ptr, out_weights_ptr,
                   out_src_ptr, num_rows, rank, expert_begin, experts_per_rank, ro, ring_word, ring_words, slot_words,
                   ring_slots, C: tl.constexpr, R: tl.constexpr, XW: tl.constexpr, SW: tl.constexpr, K: tl.constexpr,
                   HAS_W: tl.constexpr, ID_OFF: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_S: tl.constexpr,
                   BLOCK_K: tl.constexpr, ROWS: tl.constexpr):
    """For every source s: arrived[s] rows of ring (s, q) here, from ring index first_index[s] on, into the
    outputs from row first_row[s] on."""
    to = tl.arange(0, ROWS)
    for s in range(R):
        if s != rank:
            n = lane(arrived, ro, s)
            first = lane(first_index, ro, s)
            row0 = lane(first_row, ro, s)
            region = ring_word + (s * C + q).to(tl.int64) * ring_words
            for i in range(0, n, ROWS):
                copy_slots_out(slot_addresses(own, region, (first + i + to) % ring_slots, slot_words), row0 + i + to,
                               i + to < n, out_x_ptr, out_scales_ptr, out_idx_ptr, out_weights_ptr, out_src_ptr,
                               num_rows, expert_begin, experts_per_rank, XW, SW, K, HAS_W, ID_OFF, BLOCK_X, BLOCK_S,
                               BLOCK_K, ROWS)


@triton.jit
def receive_channel(q, ok, recv_count_ptr, recv_base_ptr, out_x_ptr, out_scales_ptr, out_idx_ptr, out_weights_ptr,
                    out_src_ptr, status_ptr, num_rows, rank, expert_begin, experts_per_rank, own, ctrl, peers, ro,
                    peer_bases, tail_word, head_word, recvd_word, ring_word, ring_words, slot_words, ring_slots,
                    timeout_ns, C: tl.constexpr, CMAX: tl.constexpr, R: tl.constexpr, XW: tl.constexpr,
                    SW: tl.constexpr, K: tl.constexpr, HAS_W: tl.constexpr, ID_OFF: tl.constexpr,
                    BLOCK_X: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                    ROWS: tl.constexpr):
    """Receiver q: the rows of ring (s, q) of every source s as they arrive (module docstring)."""
    count = tl.load(recv_count_ptr + ro * C + q, mask=peers, other=0).to(tl.int64)
    out_base = tl.load(recv_base_ptr + ro * C + q, mask=peers, other=0)
    recvd0 = tl.load(counters_here(ctrl, recvd_word, ro, q, CMAX), mask=peers, other=0)
    tail_ptrs = counters_here(ctrl, tail_word, ro, q, CMAX)
    head_ptrs = counters_at_peers(peer_bases, head_word, rank, q, CMAX)
    taken = tl.zeros([BLOCK_R], tl.int64)
    remaining = tl.sum(count)
    failed = (remaining < 0) | (ok == 0)
    start = clock_ns()
    idle = tl.zeros([], tl.int32)
    while (remaining > 0) & (failed == 0):
        open_ = peers & (taken < count)
        tails = tl.atomic_add(tail_ptrs, 0, mask=open_, sem="acquire", scope="sys")
        arrived = tl.where(open_, tl.minimum(tails - recvd0 - taken, count - taken), 0)
        if tl.sum(arrived) > 0:
            copy_out_rings(arrived, recvd0 + taken, out_base + taken, q, own, out_x_ptr, out_scales_ptr, out_idx_ptr,
                           out_weights_ptr, out_src_ptr, num_rows, rank, expert_begin, experts_per_rank, ro, ring_word,
                           ring_words, slot_words, ring_slots, C, R, XW, SW, K, HAS_W, ID_OFF, BLOCK_X, BLOCK_S,
                           BLOCK_K, ROWS)
            taken += arrived
            publish(head_ptrs, recvd0 + taken, peers)
            remaining = tl.sum(count - taken)
            start = clock_ns()
            idle = tl.zeros([], tl.int32)
        else:
            idle += 1
            if timed_out(start, idle, timeout_ns, status_ptr, WAIT_ROWS, open_, ro):
                failed = remaining > 0
    tl.store(counters_here(ctrl, recvd_word, ro, q, CMAX), recvd0 + count, mask=peers)


@triton.jit
def clear_unreceived_rows(q, prefix_ptr, out_idx_ptr, out_weights_ptr, out_src_ptr, num_rows, C: tl.constexpr,
                          R: tl.constexpr, K: tl.constexpr, HAS_W: tl.constexpr, BLOCK_K: tl.constexpr):
    """Receiver q's share (every C-th) of the output rows past the received ones (num_worst_tokens): no expert,
    no source token."""
    ko = tl.arange(0, BLOCK_K)
    for row in range(tl.load(prefix_ptr + R) + q, num_rows, C):
        row64 = row.to(tl.int64)
        if K > 0:
            tl.store(out_idx_ptr + row64 * K + ko, tl.full([BLOCK_K], -1, tl.int64), mask=ko < K)
            if HAS_W:
                tl.store(out_weights_ptr + row64 * K + ko, tl.zeros([BLOCK_K], tl.float32), mask=ko < K)
        tl.store(out_src_ptr + row64, -1)


@triton.jit
def dispatch_kernel(x_ptr, scales_ptr, idx_ptr, weights_ptr, in_rank_ptr, before_ptr, recv_count_ptr, recv_base_ptr,
                    prefix_ptr, out_x_ptr, out_scales_ptr, out_idx_ptr, out_weights_ptr, out_src_ptr, bases_ptr,
                    status_ptr, num_tokens, num_rows, rank, expert_begin, experts_per_rank, tail_word, head_word,
                    sent_word, recvd_word, ops_word, done_word, ticket_word, ring_word, ring_words, slot_words,
                    ring_slots, batch, timeout_ns,
                    C: tl.constexpr, CMAX: tl.constexpr, R: tl.constexpr, XW: tl.constexpr, SW: tl.constexpr,
                    K: tl.constexpr, HAS_W: tl.constexpr, ID_OFF: tl.constexpr, BLOCK_X: tl.constexpr,
                    BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, ROWS: tl.constexpr):
    pid = tl.program_id(0)
    ro, peers, own, ctrl, peer_bases = peer_view(bases_ptr, rank, R, BLOCK_R)
    ops, ok = begin_operation(ctrl, ops_word, done_word, peers, ro, timeout_ns, status_ptr)
    if pid < C:
        send_channel(pid, ok, x_ptr, scales_ptr, idx_ptr, weights_ptr, in_rank_ptr, before_ptr, prefix_ptr, out_x_ptr,
                     out_scales_ptr, out_idx_ptr, out_weights_ptr, out_src_ptr, bases_ptr, status_ptr, num_tokens,
                     num_rows, rank, expert_begin, experts_per_rank, ctrl, peers, ro, peer_bases, tail_word, head_word,
                     sent_word, ring_word, ring_words, slot_words, ring_slots, batch, timeout_ns, C, CMAX, R, XW, SW,
                     K, HAS_W, ID_OFF, BLOCK_X, BLOCK_S, BLOCK_K, BLOCK_R, ROWS)
    else:
        receive_channel(pid - C, ok, recv_count_ptr, recv_base_ptr, out_x_ptr, out_scales_ptr, out_idx_ptr,
                        out_weights_ptr, out_src_ptr, status_ptr, num_rows, rank, expert_begin, experts_per_rank, own,
                        ctrl, peers, ro, peer_bases, tail_word, head_word, recvd_word, ring_word, ring_words,
                        slot_words, ring_slots, timeout_ns, C, CMAX, R, XW, SW, K, HAS_W, ID_OFF, BLOCK_X, BLOCK_S,
                        BLOCK_K, BLOCK_R, ROWS)
        clear_unreceived_rows(pid - C, prefix_ptr, out_idx_ptr, out_weights_ptr, out_src_ptr, num_rows, C, R, K, HAS_W,
                              BLOCK_K)
    end_operation(ctrl, ops_word, done_word, ticket_word, peer_bases, rank, peers, ops)
