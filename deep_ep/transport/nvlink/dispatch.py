"""Normal dispatch over peer-mapped buffers: one kernel, C sender and C receiver programs, streaming
through a ring per (source rank, channel) in every destination's buffer, so any buffer size works.

Buffers (per rank): counters TAIL[src][ch] (rows the source has put into its ring here), HEAD[dst][ch]
(rows the destination has taken out of this rank's ring there), and this rank's own SENT[dst][ch] and
RECVD[src][ch] at the end of the last operation; rings of `ring_slots` slots, one per (source, channel).
A slot holds one token: [payload words | scale words | pad | top-k ids int64 | weights f32 | source token].
These counters only grow (they count rows since the Buffer was made), so they are never reset.

Protocol (channel q = tokens [q * ceil(T/C), ...)):
  every program first waits until every peer has read all earlier operations out of its buffer
    (sync.begin_operation: rings may change slot size, and another protocol may have used the area), and
    the last program to finish publishes that this rank has (sync.end_operation).
  sender q of rank s: per batch of tokens: wait until HEAD[d][q] leaves room for the batch's rows, store
    each token into every peer d that receives it, at slot (row counter mod ring_slots) of ring (s, q) in
    d's buffer, and publish TAIL[s][q] in every peer (release, after a barrier). The rank's own tokens go
    straight to its outputs: from the sender (OWN_BY_SENDER) or from the receiver, so that senders only push over
    NVLink (which of the two is faster is measured by the benchmark; the setting picks one).
  receiver q of rank d: poll TAIL[s][q] of every source, copy the rows that arrived into the outputs
    (row = first row of (s, q) in the outputs + index), and publish HEAD[d][q] in the source's buffer.
    Sources are served round-robin, so a receiver never waits on one source while another has rows.
    Unless OWN_BY_SENDER, while no ring has rows it copies a few tiles of this rank's own tokens of
    channel q straight from x to the outputs, until all are done.
Rows of (s, q) land in the outputs in token order after the rows of (s, q - 1): the reference order.
"""
import triton
import triton.language as tl

from .intrinsics import clock_ns
from .sync import (begin_operation, channel_tokens, end_operation, lane, peer_view, gave_up, publish, report_timeout,
                   row_pointers, wait_at_least)
from .status import NO_PEER, WAIT_ROWS, WAIT_SPACE

OWN_STEP = tl.constexpr(4)   # tiles of own tokens a receiver copies between two looks at its rings


@triton.jit
def store_outputs(rows, keep, x, scales, ids, weights, tokens, out_x_ptr, out_scales_ptr, out_idx_ptr,
                  out_weights_ptr, out_src_ptr, num_rows, expert_begin, experts_per_rank, xo, so, ko, XW: tl.constexpr,
                  SW: tl.constexpr, K: tl.constexpr, HAS_W: tl.constexpr, BLOCK_X: tl.constexpr):
    """Received rows (where `keep`) into the outputs: ids of other ranks' experts become -1, their weights 0.
    Rows from `num_rows` on are dropped (num_worst_tokens smaller than what arrives)."""
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
def load_tokens(tokens, live, x_ptr, scales_ptr, idx_ptr, weights_ptr, xo, so, ko, XW: tl.constexpr,
                SW: tl.constexpr, K: tl.constexpr, HAS_W: tl.constexpr, BLOCK_X: tl.constexpr,
                BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr):
    """A tile of this rank's tokens: payload words, scales, top-k ids and weights (zeros where absent)."""
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
def store_slots(slots, send, x, scales, ids, weights, tokens, xo, so, ko, XW: tl.constexpr, SW: tl.constexpr,
                K: tl.constexpr, ID_OFF: tl.constexpr, BLOCK_X: tl.constexpr):
    """Tokens into slots at byte addresses `slots` (where `send`): [payload | scales | pad | top-k ids int64 |
    weights f32 | source token]."""
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
def load_slots(slots, live, xo, so, ko, XW: tl.constexpr, SW: tl.constexpr, K: tl.constexpr, HAS_W: tl.constexpr,
               ID_OFF: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
               ROWS: tl.constexpr):
    """What store_slots wrote (where `live`; zeros elsewhere), read past the L1 cache: peers wrote it."""
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
def push_tokens(tokens, live, x_ptr, scales_ptr, idx_ptr, weights_ptr, in_rank_ptr, before_ptr, out_x_ptr,
                out_scales_ptr, out_idx_ptr, out_weights_ptr, out_src_ptr, bases_ptr, regions, index0, modulo,
                slot_words, self_row0, num_rows, rank, expert_begin, experts_per_rank, ro, xo, so, ko, R: tl.constexpr,
                XW: tl.constexpr, SW: tl.constexpr, K: tl.constexpr, HAS_W: tl.constexpr, ID_OFF: tl.constexpr,
                BLOCK_X: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
                OWN: tl.constexpr):
    """A tile of this rank's tokens (where `live`) to every peer d that receives them, into slot
    (index0[d] + position) % modulo of the slots at word regions[d] of d's buffer, position being the token's
    place among this rank's tokens for d; with OWN, this rank's own ones into its outputs (row self_row0 +
    position)."""
    t64 = tokens.to(tl.int64)
    x, scales, ids, weights = load_tokens(tokens, live, x_ptr, scales_ptr, idx_ptr, weights_ptr, xo, so, ko, XW, SW,
                                          K, HAS_W, BLOCK_X, BLOCK_S, BLOCK_K, ROWS)
    for d in tl.static_range(R):
        keep = live & (tl.load(in_rank_ptr + t64 * R + d, mask=live, other=0) != 0)
        position = tl.load(before_ptr + t64 * R + d, mask=live, other=0)
        if d == rank:
            if OWN:
                rows = self_row0 + position
                store_outputs(rows, keep, x, scales, ids, weights, tokens, out_x_ptr,
                              out_scales_ptr, out_idx_ptr, out_weights_ptr, out_src_ptr, num_rows,
                              expert_begin, experts_per_rank, xo, so, ko, XW, SW, K, HAS_W, BLOCK_X)
        else:
            index = (lane(index0, ro, d) + position) % modulo
            slots = tl.load(bases_ptr + d) + 4 * (lane(regions, ro, d) + index * slot_words)
            store_slots(slots, keep, x, scales, ids, weights, tokens, xo, so, ko, XW, SW, K, ID_OFF, BLOCK_X)


@triton.jit
def dispatch_kernel(x_ptr, scales_ptr, idx_ptr, weights_ptr, in_rank_ptr, before_ptr, recv_count_ptr, recv_base_ptr,
                    prefix_ptr, out_x_ptr, out_scales_ptr, out_idx_ptr, out_weights_ptr, out_src_ptr, bases_ptr,
                    status_ptr, num_tokens, num_rows, rank, expert_begin, experts_per_rank, tail_word, head_word,
                    sent_word, recvd_word, ops_word, done_word, ticket_word, ring_word, ring_words, slot_words,
                    ring_slots, batch, timeout_ns,
                    C: tl.constexpr, CMAX: tl.constexpr, R: tl.constexpr, XW: tl.constexpr, SW: tl.constexpr,
                    K: tl.constexpr, HAS_W: tl.constexpr, ID_OFF: tl.constexpr, BLOCK_X: tl.constexpr,
                    BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, ROWS: tl.constexpr,
                    OWN_BY_SENDER: tl.constexpr):
    pid = tl.program_id(0)
    ro, peers, own, ctrl, peer_bases = peer_view(bases_ptr, rank, R, BLOCK_R)
    to = tl.arange(0, ROWS)
    xo = tl.arange(0, BLOCK_X)
    so = tl.arange(0, BLOCK_S)
    ko = tl.arange(0, BLOCK_K)
    ops, ok = begin_operation(ctrl, ops_word, done_word, peers, ro, timeout_ns, status_ptr)
    if pid < C:
        # ---- sender of channel q ----------------------------------------------------------------------------
        q = pid
        t0, t1 = channel_tokens(q, num_tokens, C)
        sent0 = tl.load(ctrl + sent_word + ro * CMAX + q, mask=peers, other=0)
        base = sent0 - tl.load(before_ptr + t0 * R + ro, mask=ro < R, other=0).to(tl.int64)
        head_ptrs = ctrl + head_word + ro * CMAX + q
        tail_ptrs = (peer_bases + (tail_word + rank * CMAX + q) * 8).to(tl.pointer_type(tl.int64))
        self_row0 = tl.load(prefix_ptr + rank)
        # ring (rank, q), in every peer
        region = tl.full([BLOCK_R], ring_word, tl.int64) + (rank * C + q).to(tl.int64) * ring_words
        for tb in range(t0, t1, batch):
            te = tl.minimum(tb + batch, t1)
            upto = base + tl.load(before_ptr + te * R + ro, mask=ro < R, other=0).to(tl.int64)
            if ok:
                ok = wait_at_least(head_ptrs, upto - ring_slots, peers, ro, timeout_ns, status_ptr, WAIT_SPACE)
            if ok:
                for first_token in range(tb, te, ROWS):
                    push_tokens(first_token + to, first_token + to < te, x_ptr, scales_ptr, idx_ptr, weights_ptr,
                                in_rank_ptr, before_ptr, out_x_ptr, out_scales_ptr, out_idx_ptr, out_weights_ptr,
                                out_src_ptr, bases_ptr, region, base, ring_slots, slot_words, self_row0, num_rows, rank,
                                expert_begin, experts_per_rank, ro, xo, so, ko, R, XW, SW, K, HAS_W, ID_OFF, BLOCK_X,
                                BLOCK_S, BLOCK_K, ROWS, OWN_BY_SENDER)
                publish(tail_ptrs, upto, peers)
        done = base + tl.load(before_ptr + t1 * R + ro, mask=ro < R, other=0).to(tl.int64)
        tl.store(ctrl + sent_word + ro * CMAX + q, done, mask=peers)
    else:
        # ---- receiver of channel q ----------------------------------------------------------------------
        q = pid - C
        count = tl.load(recv_count_ptr + ro * C + q, mask=peers, other=0).to(tl.int64)
        out_base = tl.load(recv_base_ptr + ro * C + q, mask=peers, other=0)
        recvd0 = tl.load(ctrl + recvd_word + ro * CMAX + q, mask=peers, other=0)
        tail_ptrs = ctrl + tail_word + ro * CMAX + q
        head_ptrs = (peer_bases + (head_word + rank * CMAX + q) * 8).to(tl.pointer_type(tl.int64))
        taken = tl.zeros([BLOCK_R], tl.int64)
        remaining = tl.sum(count)
        failed = (remaining < 0) | (ok == 0)
        # this rank's own tokens of channel q go straight to the outputs, copied while no ring has rows
        own_next, own_end = channel_tokens(q, num_tokens, C)
        if OWN_BY_SENDER:
            own_end = own_next
        self_row0 = tl.load(prefix_ptr + rank)
        start = clock_ns()
        idle = tl.zeros([], tl.int32)
        while ((remaining > 0) | (own_next < own_end)) & (failed == 0):
            open_ = peers & (taken < count)
            tails = tl.atomic_add(tail_ptrs, 0, mask=open_, sem="acquire", scope="sys")
            avail = tl.where(open_, tl.minimum(tails - recvd0 - taken, count - taken), 0)
            if tl.sum(avail) > 0:
                for s in range(R):
                    if s != rank:
                        n = lane(avail, ro, s)
                        first = lane(recvd0 + taken, ro, s)
                        row0 = lane(out_base + taken, ro, s)
                        ring = own + 4 * (ring_word + (s * C + q).to(tl.int64) * ring_words)
                        for i in range(0, n, ROWS):
                            index = first + i + to
                            live = i + to < n
                            slots = ring + 4 * (index % ring_slots) * slot_words
                            x, scales, ids, weights, tokens = load_slots(slots, live, xo, so, ko, XW, SW, K, HAS_W,
                                                                         ID_OFF, BLOCK_X, BLOCK_S, BLOCK_K, ROWS)
                            rows = row0 + i + to
                            store_outputs(rows, live, x, scales, ids, weights, tokens, out_x_ptr,
                                           out_scales_ptr, out_idx_ptr, out_weights_ptr, out_src_ptr, num_rows,
                                           expert_begin, experts_per_rank, xo, so, ko, XW, SW, K, HAS_W, BLOCK_X)
                taken += avail
                publish(head_ptrs, recvd0 + taken, peers)
                remaining = tl.sum(count - taken)
                start = clock_ns()
                idle = tl.zeros([], tl.int32)
            elif own_next < own_end:
                for first_token in range(own_next, tl.minimum(own_next + OWN_STEP * ROWS, own_end), ROWS):
                    tokens = first_token + to
                    live = tokens < own_end
                    t64 = tokens.to(tl.int64)
                    keep = live & (tl.load(in_rank_ptr + t64 * R + rank, mask=live, other=0) != 0)
                    x, scales, ids, weights = load_tokens(tokens, keep, x_ptr, scales_ptr, idx_ptr, weights_ptr, xo,
                                                           so, ko, XW, SW, K, HAS_W, BLOCK_X, BLOCK_S, BLOCK_K, ROWS)
                    rows = self_row0 + tl.load(before_ptr + t64 * R + rank, mask=live, other=0)
                    store_outputs(rows, keep, x, scales, ids, weights, tokens, out_x_ptr,
                                   out_scales_ptr, out_idx_ptr, out_weights_ptr, out_src_ptr, num_rows,
                                   expert_begin, experts_per_rank, xo, so, ko, XW, SW, K, HAS_W, BLOCK_X)
                own_next = tl.minimum(own_next + OWN_STEP * ROWS, own_end)
                start = clock_ns()
                idle = tl.zeros([], tl.int32)
            else:
                idle += 1
                if gave_up(start, idle, timeout_ns, status_ptr):
                    report_timeout(status_ptr, WAIT_ROWS, tl.min(tl.where(open_, ro, NO_PEER)))
                    failed = remaining > 0
        tl.store(ctrl + recvd_word + ro * CMAX + q, recvd0 + count, mask=peers)
        # rows past the received ones (num_worst_tokens): no expert, no source token
        for row in range(tl.load(prefix_ptr + R) + q, num_rows, C):
            row64 = row.to(tl.int64)
            if K > 0:
                tl.store(out_idx_ptr + row64 * K + ko, tl.full([BLOCK_K], -1, tl.int64), mask=ko < K)
                if HAS_W:
                    tl.store(out_weights_ptr + row64 * K + ko, tl.zeros([BLOCK_K], tl.float32), mask=ko < K)
            tl.store(out_src_ptr + row64, -1)
    end_operation(ctrl, ops_word, done_word, ticket_word, peer_bases, rank, peers, ops)
