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
operations). Every program first waits until every peer has
read all earlier operations out of its buffer, and the last to finish publishes that this rank has
(sync.begin_operation / end_operation), so slots are never overwritten while read, whatever protocol the
previous operation used.

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

from .combine import reduce_tokens, store_combine_slots
from .dispatch import load_slots, push_tokens, store_outputs
from .intrinsics import clock_ns
from .sync import begin_operation, channel_tokens, end_operation, gave_up, lane, peer_view, publish, report_timeout
from .status import NO_PEER, WAIT_ROWS


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
def copy_out(own, low0, low1, high0, high1, slot_word, slot_words, capacity, out_x_ptr, out_scales_ptr, out_idx_ptr,
             out_weights_ptr, out_src_ptr, num_rows, expert_begin, experts_per_rank, to, xo, so, ko, XW: tl.constexpr,
             SW: tl.constexpr, K: tl.constexpr, HAS_W: tl.constexpr, ID_OFF: tl.constexpr, BLOCK_X: tl.constexpr,
             BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr):
    """Output rows [low0, low1) and [high0, high1) from the slots of the same numbers into the outputs."""
    lows = low1 - low0
    total = lows + high1 - high0
    for i in range(0, total, ROWS):
        index = i + to
        live = index < total
        rows = tl.where(index < lows, low0 + index, high0 + index - lows)
        slots = own + 4 * (slot_word + (rows % capacity).to(tl.int64) * slot_words)
        x, scales, ids, weights, tokens = load_slots(slots, live, xo, so, ko, XW, SW, K, HAS_W, ID_OFF, BLOCK_X,
                                                     BLOCK_S, BLOCK_K, ROWS)
        store_outputs(rows, live, x, scales, ids, weights, tokens, out_x_ptr, out_scales_ptr, out_idx_ptr,
                      out_weights_ptr, out_src_ptr, num_rows, expert_begin, experts_per_rank, xo, so, ko, XW, SW, K,
                      HAS_W, BLOCK_X)


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
    to = tl.arange(0, ROWS)
    xo = tl.arange(0, BLOCK_X)
    so = tl.arange(0, BLOCK_S)
    ko = tl.arange(0, BLOCK_K)
    ops, ok = begin_operation(ctrl, ops_word, done_word, peers, ro, timeout_ns, status_ptr)
    mark = ops.to(tl.int64) << 32
    # pushing: tokens [first, end) of the channel's half, half 0 from the front, half 1 from the back
    first, end = half_channel(q, half, num_tokens, C)
    push_row0 = tl.load(push_row0_ptr + ro, mask=ro < R, other=0).to(tl.int64)
    regions = tl.full([BLOCK_R], slot_word, tl.int64)
    self_row0 = tl.load(prefix_ptr + rank)
    before_first = tl.load(before_ptr + first * R + ro, mask=ro < R, other=0)
    before_end = tl.load(before_ptr + end * R + ro, mask=ro < R, other=0)
    progress_ptrs = (peer_bases + (arrive_word + rank * AMAX + pid) * 8).to(tl.pointer_type(tl.int64))
    # receiving: rows [lo, hi) of (s, q), relative to its first output row, of every peer s; [lo, front) and
    # [back, hi) are copied out. Rows below s's ARRIVE[s][2q] have come from the front, rows from
    # count - ARRIVE[s][2q + 1] on from the back.
    counts = tl.load(recv_count_ptr + ro * C + q, mask=peers, other=0)
    bases = tl.load(recv_base_ptr + ro * C + q, mask=peers, other=0)
    front, back = half_rows(counts, half)
    arrived = ctrl + arrive_word + ro * AMAX + 2 * q
    pushed = tl.zeros([], tl.int32)
    remaining = tl.sum(back - front)
    failed = (ok == 0) | (remaining < 0)
    start = clock_ns()
    idle = tl.zeros([], tl.int32)
    while ((pushed < end - first) | (remaining > 0)) & (failed == 0):
        if pushed < end - first:
            upto = pushed + tl.minimum(stage_tokens, end - first - pushed)
            stage_first = tl.where(half == 0, first + pushed, end - upto)
            stage_end = tl.where(half == 0, first + upto, end - pushed)
            for first_token in range(stage_first, stage_end, ROWS):
                push_tokens(first_token + to, first_token + to < stage_end, x_ptr, scales_ptr, idx_ptr, weights_ptr,
                            in_rank_ptr, before_ptr, out_x_ptr, out_scales_ptr, out_idx_ptr, out_weights_ptr,
                            out_src_ptr, bases_ptr, regions, push_row0, capacity, slot_words, self_row0, num_rows,
                            rank, expert_begin, experts_per_rank, ro, xo, so, ko, R, XW, SW, K, HAS_W, ID_OFF, BLOCK_X,
                            BLOCK_S, BLOCK_K, ROWS, True)
            pushed = upto
            boundary = tl.load(before_ptr + tl.where(half == 0, stage_end, stage_first) * R + ro, mask=ro < R,
                               other=0)
            rows_sent = tl.where(half == 0, boundary - before_first, before_end - boundary)
            publish(progress_ptrs, mark + rows_sent.to(tl.int64), peers)
            start = clock_ns()
        fronts = rows_arrived(arrived, mark, peers)
        backs = rows_arrived(arrived + 1, mark, peers)
        tl.debug_barrier()   # every thread's reads of the slots follow the acquiring loads
        new_front = tl.where(peers, tl.maximum(front, tl.minimum(fronts, back)), front)
        new_back = tl.where(peers, tl.minimum(back, tl.maximum(counts - backs, new_front)), back)
        if tl.sum((new_front - front) + (back - new_back)) > 0:
            for s in range(R):
                if s != rank:
                    b = lane(bases, ro, s)
                    copy_out(own, b + lane(front, ro, s), b + lane(new_front, ro, s), b + lane(new_back, ro, s),
                             b + lane(back, ro, s), slot_word, slot_words, capacity, out_x_ptr, out_scales_ptr,
                             out_idx_ptr, out_weights_ptr, out_src_ptr, num_rows, expert_begin, experts_per_rank, to,
                             xo, so, ko, XW, SW, K, HAS_W, ID_OFF, BLOCK_X, BLOCK_S, BLOCK_K, ROWS)
            front = new_front
            back = new_back
            remaining = tl.sum(back - front)
            start = clock_ns()
            idle = tl.zeros([], tl.int32)
        elif pushed >= end - first:
            idle += 1
            if gave_up(start, idle, timeout_ns, status_ptr):
                report_timeout(status_ptr, WAIT_ROWS, tl.min(tl.where(peers & (back > front), ro, NO_PEER)))
                failed = remaining > 0
    end_operation(ctrl, ops_word, done_word, ticket_word, peer_bases, rank, peers, ops)


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
            take = live & (tl.load(in_rank_ptr + t64 * R + d, mask=live, other=0) != 0)
            r = tl.load(before_ptr + t64 * R + d, mask=live, other=0) - lane(channel_before, ro, d)
            late = take & (r >= lane(fronts, ro, d)) & (r < lane(counts, ro, d) - lane(backs, ro, d))
            late_rows = tl.sum(late.to(tl.int32))
            awaited = tl.where((late_rows > 0) & (awaited == NO_PEER), d, awaited)
            waiting += late_rows
    return waiting == 0, awaited


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
    to = tl.arange(0, ROWS)
    ro_reduce = tl.arange(0, REDUCE_ROWS)
    ho = tl.arange(0, BLOCK_H)
    ko = tl.arange(0, BLOCK_K)
    ops, ok = begin_operation(ctrl, ops_word, done_word, peers, ro, timeout_ns, status_ptr)
    mark = ops.to(tl.int64) << 32
    # pushing: rows [lo, hi) of (s, q) of every peer s (x rows row_bases[s] + ...), half 0 from lo up, half 1
    # from hi down; `sent` of them so far
    counts = tl.load(recv_count_ptr + ro * C + q, mask=peers, other=0)
    row_bases = tl.load(recv_base_ptr + ro * C + q, mask=peers, other=0)
    lo, hi = half_rows(counts, half)
    sent = tl.zeros([BLOCK_R], tl.int32)
    progress_ptrs = (peer_bases + (arrive_word + rank * AMAX + pid) * 8).to(tl.pointer_type(tl.int64))
    # reducing: tokens [first, end) of the channel's half, half 0 from the front, half 1 from the back
    first, end = half_channel(q, half, num_tokens, C)
    t0, t1 = channel_tokens(q, num_tokens, C)
    channel_before = tl.load(before_ptr + t0 * R + ro, mask=ro < R, other=0)   # this rank's rows for d before q
    own_counts = tl.load(before_ptr + t1 * R + ro, mask=ro < R, other=0) - channel_before   # rows of (rank, q) at d
    per_destination = tl.load(before_ptr + num_tokens * R + ro, mask=ro < R, other=0).to(tl.int64)
    slot_of = tl.cumsum(per_destination, axis=0) - per_destination   # rows from d start after those before d
    regions = tl.full([BLOCK_R], slot_word, tl.int64)
    self_row0 = tl.load(prefix_ptr + rank).to(tl.int64)
    arrived = ctrl + arrive_word + ro * AMAX + 2 * q
    reduced = tl.zeros([], tl.int32)
    unsent = tl.sum(hi - lo)
    failed = (ok == 0) | (unsent < 0)
    start = clock_ns()
    idle = tl.zeros([], tl.int32)
    while ((unsent > 0) | (reduced < end - first)) & (failed == 0):
        pushing = unsent > 0
        if pushing:
            step = tl.where(peers, tl.minimum(hi - lo - sent, stage_tokens), 0)
            for s in range(R):
                if s != rank:
                    n = lane(step, ro, s)
                    stage_first = tl.where(half == 0, lane(lo + sent, ro, s), lane(hi - sent, ro, s) - n)
                    x_row0 = lane(row_bases, ro, s)
                    slot0 = (tl.load(combine_row0_ptr + s) + x_row0 - tl.load(prefix_ptr + s)).to(tl.int64)
                    peer = tl.load(bases_ptr + s)
                    for v in range(stage_first, stage_first + n, ROWS):
                        live = v + to < stage_first + n
                        rows = (x_row0 + v + to).to(tl.int64)
                        in_x = live & (rows < num_rows)   # num_worst_tokens: rows past x were dropped
                        tile = tl.load(x_ptr + rows[:, None] * H + ho[None, :],
                                       mask=in_x[:, None] & (ho[None, :] < H), other=0.0)
                        weights = tl.load(weights_ptr + rows[:, None] * K + ko[None, :],
                                          mask=in_x[:, None] & (ko[None, :] < K), other=0.0)
                        slots = peer + 4 * (slot_word + ((slot0 + v + to) % capacity) * slot_words)
                        store_combine_slots(slots, live, tile, weights, ho, ko, H, K, X_OFF, BLOCK_H)
            sent += step
            unsent = tl.sum(hi - lo - sent)
            publish(progress_ptrs, mark + sent.to(tl.int64), peers)
        fronts = rows_arrived(arrived, mark, peers)
        backs = rows_arrived(arrived + 1, mark, peers)
        tl.debug_barrier()   # every thread's reads of the slots follow the acquiring loads
        awaited = tl.full([], NO_PEER, tl.int32)
        reduced_before = reduced
        going = reduced < end - first
        while going:
            n = tl.minimum(end - first - reduced, REDUCE_ROWS)
            tokens = tl.where(half == 0, first + reduced, end - reduced - n) + ro_reduce
            ready, awaited = tokens_ready(tokens, ro_reduce < n, in_rank_ptr, before_ptr, channel_before, own_counts,
                                          fronts, backs, rank, ro, R)
            if ready:
                reduce_tokens(tokens, ro_reduce < n, x_ptr, weights_ptr, in_rank_ptr, before_ptr, bias0_ptr,
                              bias1_ptr, out_ptr, out_weights_ptr, own, regions, slot_of, capacity, slot_words,
                              self_row0, num_rows, rank, ro, ho, ko, R, H, K, X_OFF, HAS_BIAS0, HAS_BIAS1, BLOCK_H,
                              BLOCK_K, REDUCE_ROWS)
                reduced += n
            going = ready & (reduced < end - first)
        if pushing | (reduced > reduced_before):
            start = clock_ns()
            idle = tl.zeros([], tl.int32)
        else:
            idle += 1
            if gave_up(start, idle, timeout_ns, status_ptr):
                report_timeout(status_ptr, WAIT_ROWS, awaited)
                failed = reduced < end - first
    end_operation(ctrl, ops_word, done_word, ticket_word, peer_bases, rank, peers, ops)
