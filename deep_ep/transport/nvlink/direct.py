"""Normal dispatch and combine when every rank's whole share fits its buffer (the "direct" protocol): all
programs push rows straight to their final slot in the peer's buffer, with no flow control, and copy out or
reduce what they received. The transport picks it when the largest per-rank total fits (it knows the counts
from the dispatch's host wait); the rings (dispatch.py, combine.py) serve the rest.

Buffers (per rank): `capacity` slots in the area the rings otherwise use (slot formats of dispatch.py and
combine.py; slot numbers are taken modulo `capacity`, which the host's choice makes a no-op, so that inputs
changed against the handle can garble rows but never write outside the buffer);
counters ARRIVE[source][program] = (OPS << 32) + n: program `program` of `source` has pushed n rows here in
operation OPS (which ones: below). A word whose high 32 bits are not the low 32 bits of OPS is left from another
operation and counts as n = 0 (a program with no rows publishes nothing, so a word can stay unwritten for many
operations). Every program first waits until every peer has read all earlier operations out of its buffer,
and the last to finish publishes that this rank has (sync.begin_operation / end_operation), so slots are
never overwritten while read, whatever protocol the previous operation used.

Dispatch (2C programs; program p = 2q + h works on half h of channel q; rows of (s, q): the rows rank s sends
here from channel q, in token order):
  push, in stages of `stage_tokens` tokens: half 0 from its first token forwards, half 1 from its last token
    backwards; each token into slot push_row0[d] + position of every peer d that receives it (position: the
    token's place among this rank's tokens for d; the slot number is the token's row in d's outputs), this
    rank's own tokens straight into its outputs. After each stage, publish in every peer d ARRIVE[rank][p] =
    the rows of (rank, q) sent to d so far: half 0 has sent the first ones, half 1 the last ones (release).
  receive, between stages and after the last one: program p copies out half h of the rows of (s, q) of every
    peer s, those that have arrived: from its low end up as far as ARRIVE[s][2q] reaches, from its high end
    down as far as ARRIVE[s][2q + 1] reaches (the two meet where s's half-channels split the rows), until
    every row is copied, from the slots into the same output rows.
Combine (2C programs; rows of (s, q): the rows of x that came from rank s's channel q, in token order):
  push, in stages of `stage_tokens` rows per peer: program p returns half h of the rows of (s, q) to every
    peer s, half 0 from its low end up, half 1 from its high end down; row i of x from source s goes to slot
    combine_row0[s] + i - prefix[s] of s's buffer (combine_row0[s]: the rows s sent to ranks before this
    one). After each stage, publish in every peer s ARRIVE[rank][p] = the rows of (s, q) returned so far.
  reduce, between stages and after the last one: program p combines the tokens of half h of channel q (half
    1 from its last token backwards), a tile at a time once the rows of its tokens from every peer d have
    arrived (the token's row among (this rank, q)'s rows at d is below ARRIVE[d][2q], or at least count -
    ARRIVE[d][2q + 1]), as combine.py does: the row from d is in slot (tokens this rank sent to ranks before
    d) + position.
Each program waits for programs of its peers' kernels, so every rank's 2C programs must be able to run at
once (as with the rings): always so with one rank per GPU; with several ranks sharing a GPU, keep their
programs within what it holds.
"""
import triton
import triton.language as tl

from .combine import reduce_tokens, return_rows
from .dispatch import (copy_slots_out, counters_at_peers, counters_here, push_tokens, rows_before, slot_addresses,
                       timed_out, token_routes)
from .intrinsics import clock_ns
from .sync import begin_operation, channel_tokens, end_operation, lane, peer_view, publish
from .status import NO_PEER, WAIT_ROWS


# ---- halves and arrivals ----------------------------------------------------------------------------------------
@triton.jit
def half_channel(q, half, num_tokens, C):
    """The tokens [first, end) of half `half` of channel q (the first half takes the extra token)."""
    t0, t1 = channel_tokens(q, num_tokens, C)
    middle = t0 + (t1 - t0 + 1) // 2
    return tl.where(half == 0, t0, middle), tl.where(half == 0, middle, t1)


@triton.jit
def half_rows(counts, half):
    """The rows [lo, hi) of half `half` of `counts` rows (per lane; the first half takes the extra row)."""
    middle = (counts + 1) // 2
    return tl.where(half == 0, 0, middle), tl.where(half == 0, middle, counts)


@triton.jit
def rows_arrived(ptrs, mark, peers):
    """The rows that ARRIVE words at `ptrs` (where `peers`) report for the operation whose OPS << 32 is `mark`
    (0 for words of other operations: their high 32 bits differ from the low 32 bits of OPS; int64 arithmetic
    wraps, so a word unwritten for more than 2^31 operations does not pass for a current one); acquire, so the
    rows' slots may be read after a barrier."""
    values = tl.atomic_add(ptrs, 0, mask=peers, sem="acquire", scope="sys")
    rows = values - mark
    return tl.where(peers & (rows >= 0) & (rows < (1 << 32)), rows, 0).to(tl.int32)


@triton.jit
def both_ends_arrived(arrived, mark, peers):
    """The rows every peer's two half-programs of channel q report (ARRIVE[s][2q] from the front,
    ARRIVE[s][2q + 1] from the back), after a barrier: every thread's reads of the slots follow the acquiring
    loads."""
    fronts = rows_arrived(arrived, mark, peers)
    backs = rows_arrived(arrived + 1, mark, peers)
    tl.debug_barrier()
    return fronts, backs


# ---- dispatch ---------------------------------------------------------------------------------------------------
@triton.jit
def push_stage(pushed, first, end, half, before_first, before_end, progress_ptrs, mark, stage_tokens, peers, x_ptr,
               scales_ptr, idx_ptr, weights_ptr, in_rank_ptr, before_ptr, out_x_ptr, out_scales_ptr, out_idx_ptr,
               out_weights_ptr, out_src_ptr, bases_ptr, push_row0, slot_word, slot_words, capacity, self_row0,
               num_rows, rank, expert_begin, experts_per_rank, ro, R: tl.constexpr, XW: tl.constexpr,
               SW: tl.constexpr, K: tl.constexpr, HAS_W: tl.constexpr, ID_OFF: tl.constexpr, BLOCK_X: tl.constexpr,
               BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, ROWS: tl.constexpr):
    """The next stage of half `half` of the tokens [first, end), `pushed` of them done (half 0 forwards from
    `first`, half 1 backwards from `end`); then ARRIVE[rank][p] in every peer d = the rows sent to d so far.
    Returns the tokens pushed."""
    upto = pushed + tl.minimum(stage_tokens, end - first - pushed)
    stage_first = tl.where(half == 0, first + pushed, end - upto)
    stage_end = tl.where(half == 0, first + upto, end - pushed)
    push_tokens(stage_first, stage_end, x_ptr, scales_ptr, idx_ptr, weights_ptr, in_rank_ptr, before_ptr, out_x_ptr,
                out_scales_ptr, out_idx_ptr, out_weights_ptr, out_src_ptr, bases_ptr,
                tl.full([BLOCK_R], slot_word, tl.int64), push_row0, capacity, slot_words, self_row0, num_rows, rank,
                expert_begin, experts_per_rank, ro, R, XW, SW, K, HAS_W, ID_OFF, BLOCK_X, BLOCK_S, BLOCK_K, ROWS)
    boundary = rows_before(before_ptr, tl.where(half == 0, stage_end, stage_first), ro, R)
    rows_sent = tl.where(half == 0, boundary - before_first, before_end - boundary)
    publish(progress_ptrs, mark + rows_sent.to(tl.int64), peers)
    return upto


@triton.jit
def copy_rows(own, low0, low1, high0, high1, slot_word, slot_words, capacity, out_x_ptr, out_scales_ptr, out_idx_ptr,
              out_weights_ptr, out_src_ptr, num_rows, expert_begin, experts_per_rank, XW: tl.constexpr,
              SW: tl.constexpr, K: tl.constexpr, HAS_W: tl.constexpr, ID_OFF: tl.constexpr, BLOCK_X: tl.constexpr,
              BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr):
    """Output rows [low0, low1) and [high0, high1) from the slots of the same numbers into the outputs."""
    to = tl.arange(0, ROWS)
    lows = low1 - low0
    total = lows + high1 - high0
    for i in range(0, total, ROWS):
        index = i + to
        rows = tl.where(index < lows, low0 + index, high0 + index - lows)
        slots = slot_addresses(own, slot_word, (rows % capacity).to(tl.int64), slot_words)
        copy_slots_out(slots, rows, index < total, out_x_ptr,
                       out_scales_ptr, out_idx_ptr, out_weights_ptr, out_src_ptr, num_rows, expert_begin,
                       experts_per_rank, XW, SW, K, HAS_W, ID_OFF, BLOCK_X, BLOCK_S, BLOCK_K, ROWS)


@triton.jit
def copy_arrived(front, new_front, new_back, back, bases, own, slot_word, slot_words, capacity, out_x_ptr,
                 out_scales_ptr, out_idx_ptr, out_weights_ptr, out_src_ptr, num_rows, rank, expert_begin,
                 experts_per_rank, ro, R: tl.constexpr, XW: tl.constexpr, SW: tl.constexpr, K: tl.constexpr,
                 HAS_W: tl.constexpr, ID_OFF: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_S: tl.constexpr,
                 BLOCK_K: tl.constexpr, ROWS: tl.constexpr):
    """For every peer s: the rows [front, new_front) and [new_back, back) of (s, q) (relative to bases[s], its
    first output row) into the outputs."""
    for s in range(R):
        if s != rank:
            b = lane(bases, ro, s)
            copy_rows(own, b + lane(front, ro, s), b + lane(new_front, ro, s), b + lane(new_back, ro, s),
                      b + lane(back, ro, s), slot_word, slot_words, capacity, out_x_ptr, out_scales_ptr, out_idx_ptr,
                      out_weights_ptr, out_src_ptr, num_rows, expert_begin, experts_per_rank, XW, SW, K, HAS_W, ID_OFF,
                      BLOCK_X, BLOCK_S, BLOCK_K, ROWS)


@triton.jit
def direct_dispatch_kernel(x_ptr, scales_ptr, idx_ptr, weights_ptr, in_rank_ptr, before_ptr, recv_count_ptr,
                           recv_base_ptr, prefix_ptr, push_row0_ptr, out_x_ptr, out_scales_ptr, out_idx_ptr,
                           out_weights_ptr, out_src_ptr, bases_ptr, status_ptr, num_tokens, num_rows, rank,
                           expert_begin, experts_per_rank, arrive_word, ops_word, done_word, ticket_word, slot_word,
                           slot_words, capacity, stage_tokens, timeout_ns, C: tl.constexpr, AMAX: tl.constexpr,
                           R: tl.constexpr, XW: tl.constexpr, SW: tl.constexpr, K: tl.constexpr, HAS_W: tl.constexpr,
                           ID_OFF: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
                           BLOCK_R: tl.constexpr, ROWS: tl.constexpr):
    pid = tl.program_id(0)
    q = pid // 2
    half = pid % 2
    ro, peers, own, ctrl, peer_bases = peer_view(bases_ptr, rank, R, BLOCK_R)
    ops, ok = begin_operation(ctrl, ops_word, done_word, peers, ro, timeout_ns, status_ptr)
    mark = ops.to(tl.int64) << 32
    # pushing: tokens [first, end) of the channel's half, `pushed` of them so far
    first, end = half_channel(q, half, num_tokens, C)
    push_row0 = tl.load(push_row0_ptr + ro, mask=ro < R, other=0).to(tl.int64)
    self_row0 = tl.load(prefix_ptr + rank)
    before_first = rows_before(before_ptr, first, ro, R)
    before_end = rows_before(before_ptr, end, ro, R)
    progress_ptrs = counters_at_peers(peer_bases, arrive_word, rank, pid, AMAX)
    pushed = tl.zeros([], tl.int32)
    # receiving: rows [front, back) of (s, q) of every peer s (from its first output row) still to copy out
    counts = tl.load(recv_count_ptr + ro * C + q, mask=peers, other=0)
    bases = tl.load(recv_base_ptr + ro * C + q, mask=peers, other=0)
    front, back = half_rows(counts, half)
    arrived = counters_here(ctrl, arrive_word, ro, 2 * q, AMAX)
    remaining = tl.sum(back - front)
    failed = (ok == 0) | (remaining < 0)
    start = clock_ns()
    idle = tl.zeros([], tl.int32)
    while ((pushed < end - first) | (remaining > 0)) & (failed == 0):
        if pushed < end - first:
            pushed = push_stage(pushed, first, end, half, before_first, before_end, progress_ptrs, mark, stage_tokens,
                                peers, x_ptr, scales_ptr, idx_ptr, weights_ptr, in_rank_ptr, before_ptr, out_x_ptr,
                                out_scales_ptr, out_idx_ptr, out_weights_ptr, out_src_ptr, bases_ptr, push_row0,
                                slot_word, slot_words, capacity, self_row0, num_rows, rank, expert_begin,
                                experts_per_rank, ro, R, XW, SW, K, HAS_W, ID_OFF, BLOCK_X, BLOCK_S, BLOCK_K, BLOCK_R,
                                ROWS)
            start = clock_ns()
        fronts, backs = both_ends_arrived(arrived, mark, peers)   # how far s's two halves have pushed
        new_front = tl.where(peers, tl.maximum(front, tl.minimum(fronts, back)), front)
        new_back = tl.where(peers, tl.minimum(back, tl.maximum(counts - backs, new_front)), back)
        if tl.sum((new_front - front) + (back - new_back)) > 0:
            copy_arrived(front, new_front, new_back, back, bases, own, slot_word, slot_words, capacity, out_x_ptr,
                         out_scales_ptr, out_idx_ptr, out_weights_ptr, out_src_ptr, num_rows, rank, expert_begin,
                         experts_per_rank, ro, R, XW, SW, K, HAS_W, ID_OFF, BLOCK_X, BLOCK_S, BLOCK_K, ROWS)
            front = new_front
            back = new_back
            remaining = tl.sum(back - front)
            start = clock_ns()
            idle = tl.zeros([], tl.int32)
        elif pushed >= end - first:
            idle += 1
            if timed_out(start, idle, timeout_ns, status_ptr, WAIT_ROWS, peers & (back > front), ro):
                failed = remaining > 0
    end_operation(ctrl, ops_word, done_word, ticket_word, peer_bases, rank, peers, ops)


# ---- combine ----------------------------------------------------------------------------------------------------
@triton.jit
def return_stage(step, lo, hi, sent, half, row_bases, x_ptr, weights_ptr, combine_row0_ptr, prefix_ptr, bases_ptr,
                 num_rows, rank, ro, slot_word, slot_words, capacity, R: tl.constexpr, H: tl.constexpr,
                 K: tl.constexpr, X_OFF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                 ROWS: tl.constexpr):
    """step[s] more rows of half `half` of (s, q) (x rows row_bases[s] + ...) back to every peer s, `sent[s]`
    of them done (half 0 up from lo[s], half 1 down from hi[s]): row i of x from s into slot
    combine_row0[s] + i - prefix[s] of s's buffer."""
    to = tl.arange(0, ROWS)
    for s in range(R):
        if s != rank:
            n = lane(step, ro, s)
            stage_first = tl.where(half == 0, lane(lo + sent, ro, s), lane(hi - sent, ro, s) - n)
            x_row0 = lane(row_bases, ro, s)
            slot0 = (tl.load(combine_row0_ptr + s) + x_row0 - tl.load(prefix_ptr + s)).to(tl.int64)
            peer = tl.load(bases_ptr + s)
            for v in range(stage_first, stage_first + n, ROWS):
                return_rows((x_row0 + v + to).to(tl.int64), v + to < stage_first + n, peer, slot_word, slot0 + v + to,
                            capacity, slot_words, x_ptr, weights_ptr, num_rows, H, K, X_OFF, BLOCK_H, BLOCK_K)


@triton.jit
def tokens_ready(tokens, live, in_rank_ptr, before_ptr, channel_before, counts, fronts, backs, rank, ro,
                 R: tl.constexpr):
    """Whether every peer's row of every token of a tile (where `live`) has arrived: the row of (this rank, q) at
    position r (the token's place among this rank's tokens for d, minus channel_before[d]) came from the front
    if r < fronts[d], from the back if r >= counts[d] - backs[d]. Returns (all arrived, a peer still awaited)."""
    t64 = tokens.to(tl.int64)
    waiting = tl.zeros([], tl.int32)
    awaited = tl.full([], NO_PEER, tl.int32)
    for d in tl.static_range(R):
        if d != rank:
            take, position = token_routes(t64, live, in_rank_ptr, before_ptr, d, R)
            r = position - lane(channel_before, ro, d)
            late = take & (r >= lane(fronts, ro, d)) & (r < lane(counts, ro, d) - lane(backs, ro, d))
            late_rows = tl.sum(late.to(tl.int32))
            awaited = tl.where((late_rows > 0) & (awaited == NO_PEER), d, awaited)
            waiting += late_rows
    return waiting == 0, awaited


@triton.jit
def reduce_arrived(reduced, first, end, half, fronts, backs, channel_before, own_counts, x_ptr, weights_ptr,
                   in_rank_ptr, before_ptr, bias0_ptr, bias1_ptr, out_ptr, out_weights_ptr, own, regions, slot_of,
                   capacity, slot_words, self_row0, num_rows, rank, ro, R: tl.constexpr, H: tl.constexpr,
                   K: tl.constexpr, X_OFF: tl.constexpr, HAS_BIAS0: tl.constexpr, HAS_BIAS1: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, REDUCE_ROWS: tl.constexpr):
    """The next tiles of half `half` of the tokens [first, end), `reduced` of them done (half 0 forwards from
    `first`, half 1 backwards from `end`), as long as every peer's rows of the tile have arrived. Returns
    (the tokens reduced, a peer still awaited or NO_PEER)."""
    tile = tl.arange(0, REDUCE_ROWS)
    awaited = tl.full([], NO_PEER, tl.int32)
    going = reduced < end - first
    while going:
        n = tl.minimum(end - first - reduced, REDUCE_ROWS)
        tokens = tl.where(half == 0, first + reduced, end - reduced - n) + tile
        ready, awaited = tokens_ready(tokens, tile < n, in_rank_ptr, before_ptr, channel_before, own_counts, fronts,
                                      backs, rank, ro, R)
        if ready:
            reduce_tokens(tokens, tile < n, x_ptr, weights_ptr, in_rank_ptr, before_ptr, bias0_ptr, bias1_ptr,
                          out_ptr, out_weights_ptr, own, regions, slot_of, capacity, slot_words, self_row0, num_rows,
                          rank, ro, R, H, K, X_OFF, HAS_BIAS0, HAS_BIAS1, BLOCK_H, BLOCK_K, REDUCE_ROWS)
            reduced += n
        going = ready & (reduced < end - first)
    return reduced, awaited


@triton.jit
def direct_combine_kernel(x_ptr, weights_ptr, in_rank_ptr, before_ptr, recv_count_ptr, recv_base_ptr, prefix_ptr,
                          combine_row0_ptr, bias0_ptr, bias1_ptr, out_ptr, out_weights_ptr, bases_ptr, status_ptr,
                          num_tokens, num_rows, rank, arrive_word, ops_word, done_word, ticket_word, slot_word,
                          slot_words, capacity, stage_tokens, timeout_ns, C: tl.constexpr, AMAX: tl.constexpr,
                          R: tl.constexpr, H: tl.constexpr, K: tl.constexpr, X_OFF: tl.constexpr,
                          HAS_BIAS0: tl.constexpr, HAS_BIAS1: tl.constexpr, BLOCK_H: tl.constexpr,
                          BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, ROWS: tl.constexpr,
                          REDUCE_ROWS: tl.constexpr):
    pid = tl.program_id(0)
    q = pid // 2
    half = pid % 2
    ro, peers, own, ctrl, peer_bases = peer_view(bases_ptr, rank, R, BLOCK_R)
    ops, ok = begin_operation(ctrl, ops_word, done_word, peers, ro, timeout_ns, status_ptr)
    mark = ops.to(tl.int64) << 32
    # pushing: rows [lo, hi) of (s, q) of every peer s (x rows row_bases[s] + ...), `sent` of them so far
    counts = tl.load(recv_count_ptr + ro * C + q, mask=peers, other=0)
    row_bases = tl.load(recv_base_ptr + ro * C + q, mask=peers, other=0)
    lo, hi = half_rows(counts, half)
    sent = tl.zeros([BLOCK_R], tl.int32)
    progress_ptrs = counters_at_peers(peer_bases, arrive_word, rank, pid, AMAX)
    # reducing: tokens [first, end) of the channel's half, `reduced` of them so far
    first, end = half_channel(q, half, num_tokens, C)
    t0, t1 = channel_tokens(q, num_tokens, C)
    channel_before = rows_before(before_ptr, t0, ro, R)   # this rank's rows for d before q
    own_counts = rows_before(before_ptr, t1, ro, R) - channel_before   # rows of (rank, q) at d
    per_destination = rows_before(before_ptr, num_tokens, ro, R).to(tl.int64)
    slot_of = tl.cumsum(per_destination, axis=0) - per_destination   # rows from d start after those before d
    regions = tl.full([BLOCK_R], slot_word, tl.int64)
    self_row0 = tl.load(prefix_ptr + rank).to(tl.int64)
    arrived = counters_here(ctrl, arrive_word, ro, 2 * q, AMAX)
    reduced = tl.zeros([], tl.int32)
    unsent = tl.sum(hi - lo)
    failed = (ok == 0) | (unsent < 0)
    start = clock_ns()
    idle = tl.zeros([], tl.int32)
    while ((unsent > 0) | (reduced < end - first)) & (failed == 0):
        pushing = unsent > 0
        if pushing:
            step = tl.where(peers, tl.minimum(hi - lo - sent, stage_tokens), 0)
            return_stage(step, lo, hi, sent, half, row_bases, x_ptr, weights_ptr, combine_row0_ptr, prefix_ptr,
                         bases_ptr, num_rows, rank, ro, slot_word, slot_words, capacity, R, H, K, X_OFF, BLOCK_H,
                         BLOCK_K, ROWS)
            sent += step
            unsent = tl.sum(hi - lo - sent)
            publish(progress_ptrs, mark + sent.to(tl.int64), peers)
        fronts, backs = both_ends_arrived(arrived, mark, peers)
        reduced_before = reduced
        reduced, awaited = reduce_arrived(reduced, first, end, half, fronts, backs, channel_before, own_counts, x_ptr,
                                          weights_ptr, in_rank_ptr, before_ptr, bias0_ptr, bias1_ptr, out_ptr,
                                          out_weights_ptr, own, regions, slot_of, capacity, slot_words, self_row0,
                                          num_rows, rank, ro, R, H, K, X_OFF, HAS_BIAS0, HAS_BIAS1, BLOCK_H, BLOCK_K,
                                          REDUCE_ROWS)
        if pushing | (reduced > reduced_before):
            start = clock_ns()
            idle = tl.zeros([], tl.int32)
        else:
            idle += 1
            if timed_out(start, idle, timeout_ns, status_ptr, WAIT_ROWS, ro == awaited, ro):
                failed = reduced < end - first
    end_operation(ctrl, ops_word, done_word, ticket_word, peer_bases, rank, peers, ops)
