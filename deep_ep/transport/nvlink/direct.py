"""Normal dispatch and combine when every rank's whole share fits its buffer (the "direct" protocol): all
programs push rows straight to their final slot in the peer's buffer, with no flow control, then copy out
or reduce what they received. The transport picks it when the largest per-rank total fits (it knows the
counts from the dispatch's host wait); the rings (dispatch.py, combine.py) serve the rest.

Buffers (per rank): `capacity` slots in the area the rings otherwise use (slot formats of dispatch.py and
combine.py; slot numbers are taken modulo `capacity`, which the host's choice makes a no-op, so that inputs
changed against the handle can garble rows but never write outside the buffer);
counters ARRIVE[source][program]: the operation number + 1 up to which that program of that source has
pushed its rows here. Every program first waits until every peer has read all earlier operations out of
its buffer, and the last to finish publishes that this rank has (sync.begin_operation / end_operation), so
slots are never overwritten while read, whatever protocol the previous operation used.

Dispatch (2C programs; program p works on half p % 2 of channel q = p // 2):
  push: each token of its half-channel into slot push_row0[d] + position of every peer d that receives it
    (position: the token's place among this rank's tokens for d; the slot number is the token's row in d's
    outputs), this rank's own tokens straight into its outputs; then publish ARRIVE[rank][p] = OPS + 1 in
    every peer (release).
  receive: wait for ARRIVE[s][2q] and ARRIVE[s][2q + 1] of every peer s, then copy half p % 2 of the rows of
    (s, q) (rows recv_base[s][q] + [0, recv_count[s][q])) from those slots into the same output rows.
Combine (2C programs):
  push: the rows of x that came from peers (all but [prefix[rank], prefix[rank + 1])) are split evenly over
    the programs; row i from source s goes to slot combine_row0[s] + i - prefix[s] of s's buffer (combine_row0[s]:
    the rows s sent to ranks before this one). Publish ARRIVE[rank][p] = OPS + 1 in every peer.
  reduce: wait for ARRIVE[d][*] of every peer d (any of its programs may hold rows of any token), then
    combine tokens [p * ceil(T / 2C), ...) as combine.py does, the row from d being in slot
    (tokens this rank sent to ranks before d) + position.
Each program waits for programs of its peers' kernels, so every rank's 2C programs must be able to run at
once (as with the rings): always so with one rank per GPU; with several ranks sharing a GPU, keep their
programs within what it holds.
"""
import triton
import triton.language as tl

from .combine import reduce_tokens, store_combine_slots
from .dispatch import load_slots, push_tokens, store_outputs
from .sync import (WAIT_ROWS, begin_operation, channel_tokens, end_operation, lane, peer_view, publish,
                   wait_at_least)


@triton.jit
def direct_dispatch_kernel(x_ptr, scales_ptr, idx_ptr, weights_ptr, in_rank_ptr, before_ptr, recv_count_ptr,
                           recv_base_ptr, prefix_ptr, push_row0_ptr, out_x_ptr, out_scales_ptr, out_idx_ptr,
                           out_weights_ptr, out_src_ptr, bases_ptr, status_ptr, num_tokens, num_rows, rank,
                           expert_begin, experts_per_rank, arrive_word, ops_word, done_word, ticket_word, slot_word,
                           slot_words, capacity, timeout_ns, C: tl.constexpr, AMAX: tl.constexpr, R: tl.constexpr,
                           XW: tl.constexpr, SW: tl.constexpr, K: tl.constexpr, HAS_W: tl.constexpr,
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
    # ---- push -----------------------------------------------------------------------------------------------
    t0, t1 = channel_tokens(q, num_tokens, C)
    middle = t0 + (t1 - t0 + 1) // 2
    first = tl.where(half == 0, t0, middle)
    end = tl.where(half == 0, middle, t1)
    push_row0 = tl.load(push_row0_ptr + ro, mask=ro < R, other=0).to(tl.int64)
    regions = tl.full([BLOCK_R], slot_word, tl.int64)
    self_row0 = tl.load(prefix_ptr + rank)
    if ok:
        for first_token in range(first, end, ROWS):
            push_tokens(first_token + to, first_token + to < end, x_ptr, scales_ptr, idx_ptr, weights_ptr,
                        in_rank_ptr, before_ptr, out_x_ptr, out_scales_ptr, out_idx_ptr, out_weights_ptr, out_src_ptr,
                        bases_ptr, regions, push_row0, capacity, slot_words, self_row0, num_rows, rank, expert_begin,
                        experts_per_rank, ro, xo, so, ko, R, XW, SW, K, HAS_W, ID_OFF, BLOCK_X, BLOCK_S, BLOCK_K,
                        ROWS, True)
        publish((peer_bases + (arrive_word + rank * AMAX + pid) * 8).to(tl.pointer_type(tl.int64)), ops + 1, peers)
    # ---- receive --------------------------------------------------------------------------------------------
    arrived = ctrl + arrive_word + ro * AMAX + 2 * q
    if ok:
        ok = wait_at_least(arrived, ops + 1, peers, ro, timeout_ns, status_ptr, WAIT_ROWS)
    if ok:
        ok = wait_at_least(arrived + 1, ops + 1, peers, ro, timeout_ns, status_ptr, WAIT_ROWS)
    tl.debug_barrier()   # every thread's reads of the slots follow the acquiring loads
    if ok:
        counts = tl.load(recv_count_ptr + ro * C + q, mask=peers, other=0)
        bases = tl.load(recv_base_ptr + ro * C + q, mask=peers, other=0)
        for s in tl.static_range(R):
            if s != rank:
                count = lane(counts, ro, s)
                base = lane(bases, ro, s)
                first_row = base + tl.where(half == 0, 0, (count + 1) // 2)
                end_row = base + tl.where(half == 0, (count + 1) // 2, count)
                for row in range(first_row, end_row, ROWS):
                    rows = row + to
                    live = rows < end_row
                    slots = own + 4 * (slot_word + (rows % capacity).to(tl.int64) * slot_words)
                    x, scales, ids, weights, tokens = load_slots(slots, live, xo, so, ko, XW, SW, K, HAS_W, ID_OFF,
                                                                 BLOCK_X, BLOCK_S, BLOCK_K, ROWS)
                    store_outputs(rows, live, x, scales, ids, weights, tokens, out_x_ptr, out_scales_ptr, out_idx_ptr,
                                  out_weights_ptr, out_src_ptr, expert_begin, experts_per_rank, xo, so, ko, XW, SW, K,
                                  HAS_W, BLOCK_X)
    end_operation(ctrl, ops_word, done_word, ticket_word, peer_bases, rank, peers, ops)


@triton.jit
def direct_combine_kernel(x_ptr, weights_ptr, in_rank_ptr, before_ptr, prefix_ptr, combine_row0_ptr, bias0_ptr,
                          bias1_ptr, out_ptr, out_weights_ptr, bases_ptr, status_ptr, num_tokens, num_rows, rank,
                          arrive_word, ops_word, done_word, ticket_word, slot_word, slot_words, capacity, timeout_ns,
                          AMAX: tl.constexpr, R: tl.constexpr, H: tl.constexpr, K: tl.constexpr, X_OFF: tl.constexpr,
                          HAS_BIAS0: tl.constexpr, HAS_BIAS1: tl.constexpr, BLOCK_H: tl.constexpr,
                          BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, ROWS: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    ro, peers, own, ctrl, peer_bases = peer_view(bases_ptr, rank, R, BLOCK_R)
    to = tl.arange(0, ROWS)
    ho = tl.arange(0, BLOCK_H)
    ko = tl.arange(0, BLOCK_K)
    ops, ok = begin_operation(ctrl, ops_word, done_word, peers, ro, timeout_ns, status_ptr)
    # ---- push: rows from peers, split evenly ------------------------------------------------------------------
    starts = tl.load(prefix_ptr + ro, mask=ro < R, other=0)
    own_first = tl.load(prefix_ptr + rank)
    own_rows = tl.load(prefix_ptr + rank + 1) - own_first
    peer_rows = tl.load(prefix_ptr + R) - own_rows
    per_program = tl.cdiv(peer_rows, programs)
    first = tl.minimum(pid * per_program, peer_rows)
    end = tl.minimum(first + per_program, peer_rows)
    if ok:
        for v in range(first, end, ROWS):
            live = v + to < end
            rows = v + to
            rows = tl.where(rows < own_first, rows, rows + own_rows)
            source = tl.zeros([ROWS], tl.int32)
            for s in tl.static_range(1, R):
                source += (rows >= lane(starts, ro, s)).to(tl.int32)
            rows64 = rows.to(tl.int64)
            tile = tl.load(x_ptr + rows64[:, None] * H + ho[None, :], mask=live[:, None] & (ho[None, :] < H),
                           other=0.0)
            weights = tl.load(weights_ptr + rows64[:, None] * K + ko[None, :], mask=live[:, None] & (ko[None, :] < K),
                              other=0.0)
            slot = (tl.load(combine_row0_ptr + source, mask=live, other=0)
                    + rows - tl.load(prefix_ptr + source, mask=live, other=0))
            slots = (tl.load(bases_ptr + source, mask=live, other=0)
                     + 4 * (slot_word + (slot % capacity).to(tl.int64) * slot_words))
            store_combine_slots(slots, live, tile, weights, ho, ko, H, K, X_OFF, BLOCK_H)
        publish((peer_bases + (arrive_word + rank * AMAX + pid) * 8).to(tl.pointer_type(tl.int64)), ops + 1, peers)
    # ---- reduce: wait for every program of every peer --------------------------------------------------------
    lanes = tl.arange(0, BLOCK_R * BLOCK_P)
    sources = lanes // BLOCK_P
    senders = lanes % BLOCK_P
    if ok:
        ok = wait_at_least(ctrl + arrive_word + sources * AMAX + senders, ops + 1,
                           (sources < R) & (sources != rank) & (senders < programs), sources, timeout_ns, status_ptr,
                           WAIT_ROWS)
    tl.debug_barrier()   # every thread's reads of the slots follow the acquiring loads
    if ok:
        per_destination = tl.load(before_ptr + num_tokens * R + ro, mask=ro < R, other=0).to(tl.int64)
        slot_of = tl.cumsum(per_destination, axis=0) - per_destination   # rows from d start after those before d
        regions = tl.full([BLOCK_R], slot_word, tl.int64)
        self_row0 = tl.load(prefix_ptr + rank).to(tl.int64)
        t0, t1 = channel_tokens(pid, num_tokens, programs)
        for first_token in range(t0, t1, ROWS):
            reduce_tokens(first_token + to, first_token + to < t1, x_ptr, weights_ptr, in_rank_ptr, before_ptr,
                          bias0_ptr, bias1_ptr, out_ptr, out_weights_ptr, own, regions, slot_of, capacity, slot_words,
                          self_row0, num_rows, rank, ro, ho, ko, R, H, K, X_OFF, HAS_BIAS0, HAS_BIAS1, BLOCK_H,
                          BLOCK_K, ROWS)
    end_operation(ctrl, ops_word, done_word, ticket_word, peer_bases, rank, peers, ops)
