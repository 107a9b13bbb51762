"""Low-latency combine over peer-mapped buffers: one kernel, ll_combine_kernel, launched as a send at the
experts' ranks (returns at once), a receive at the tokens' ranks (the hook), or both in one launch (without a
hook, with few tokens: Note [fused] in low_latency.py).

Areas of one buffer half, identical in every rank's low-latency buffer (byte offsets from the host):
  ARRIVED[src]     int64 (signal area, shared with the dispatch): arrivals claimed by send programs of `src`
  RECEIVED         int64 (signal area): RECEIVED_UNIT per call received on this half (as in the dispatch)
  ROWS[t * K + k]  bf16 [H]: the expert output for this rank's selection (token t, top-k slot k)
Send (NUM_SENDERS programs over blocks of received rows, all local experts laid end to end), in this order:
  1. a program with rows (program 0 also without) waits until every unmasked rank has received as many calls
     on this half as this rank (as in the dispatch);
  2. row j of local expert e came from (source s, token t, slot k), as the dispatch's route table says: store
     x[e, j] into ROWS[t * K + k] of rank s unless s is masked (or s is this rank and OWN_FROM_X: Note [own
     rows]). With LogFMT the row is first rounded to what a LogFMT-10 receiver decodes
     (deep_ep.fp8.logfmt_roundtrip's rules, computed here); it still travels as bf16;
  3. the programs that waited add shares summing to NUM_SENDERS (sync.send_share) to ARRIVED[me] of every
     unmasked rank (release, after a barrier over the program's stores).
Receive (programs over (token, chunk of CHUNK channels) items), in this order:
  1. wait until ARRIVED[r] >= NUM_SENDERS * (calls received + 1) for every unmasked rank r;
  2. per item: load the chunk of every one of the token's K rows (used or not, so the loads need not wait for
     the ids; an unused slot's stale values are dropped), then out[t] = bf16(acc) with acc = 0; for k
     ascending over valid selections whose rank is not masked: acc = f32(acc + f32(w[t, k] * row k)), row k
     being ROWS[t * K + k] (or the own row in x), the reference's rounding (compiled without fused
     multiply-adds);
  3. every program adds its share of RECEIVED_UNIT to RECEIVED.
Timeouts as in the dispatch (Note [timeouts] in ll_dispatch.py); in shrink mode the selections of a rank masked
by a timeout of the receive contribute nothing.
Note [own rows]: with OWN_FROM_X the send skips the rows of this rank's own tokens, and the receive reads them
from x itself, where the dispatch's OWN table (after its route entries) says they are. The host sets it only
without a hook and without LogFMT: the receive then runs right after the send, so x is still what the caller
passed (with a hook the caller may change x before calling it; LogFMT rounds rows in the send). The dispatch
defines every entry of its tokens (-1: not kept here), so the receive reads OWN without waiting for the ids;
entries a timed-out dispatch receive did not write are undefined and only bounded to x.
"""
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from .intrinsics import follow_previous_kernel, to_bf16
from .launcher import profiler_name
from .status import WAIT_LL_COMBINE
from .sync import (begin_send, claim_arrival, finish_receive, in_rank_bits, rank_bits, report_bad_ids, row_pointers,
                   send_share, wait_for_senders)


@triton.jit(repr=profiler_name("deep_ep", "low_latency", "combine"))
def ll_combine_kernel(x_ptr, layout_ptr, route_ptr, bases_ptr, mask_ptr, shrink_ptr, status_ptr, rank,
                      experts_per_rank, num_max_tokens, x_expert_stride, x_row_stride, rows_offset, arrived_offset,
                      received_offset, timeout_ns,
                      rows_ptr, arrived_ptr, received_ptr, idx_ptr, weights_ptr, out_ptr, stats_ptr,
                      num_tokens, num_experts, num_senders,
                      H: tl.constexpr, K: tl.constexpr, R: tl.constexpr, HAS_MASK: tl.constexpr,
                      AUTO_MASK: tl.constexpr,
                      LOGFMT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_R: tl.constexpr,
                      ROWS: tl.constexpr, HAS_STATS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr,
                      OWN_FROM_X: tl.constexpr, SEND: tl.constexpr, RECEIVE: tl.constexpr, PDL: tl.constexpr):
    """The send (SEND), the receive (RECEIVE), or both (as ll_dispatch_kernel). Parameters up to `timeout_ns`
    are the send's, the others the receive's (x_ptr, route_ptr, mask_ptr and the scalars serve both: the
    receive reads own rows from x with OWN_FROM_X); a launch passes anything for those of the phase it leaves
    out. PDL: wait for the previous kernel's writes first."""
    if PDL:
        follow_previous_kernel()
    if SEND:
        _send(x_ptr, layout_ptr, route_ptr, bases_ptr, mask_ptr, shrink_ptr, status_ptr, rank, experts_per_rank,
              num_max_tokens, x_expert_stride, x_row_stride, rows_offset, arrived_offset, received_offset, timeout_ns,
              H, K, R, HAS_MASK, AUTO_MASK, LOGFMT, BLOCK_H, BLOCK_E, BLOCK_R, ROWS, OWN_FROM_X)
    if RECEIVE:
        _receive(rows_ptr, arrived_ptr, received_ptr, idx_ptr, weights_ptr, mask_ptr, shrink_ptr, out_ptr,
                 stats_ptr, status_ptr, x_ptr, route_ptr, num_max_tokens, x_expert_stride, x_row_stride, num_tokens,
                 num_experts, experts_per_rank, num_senders, timeout_ns, H, K, R, HAS_MASK, AUTO_MASK, HAS_STATS,
                 CHUNK, BLOCK_K, BLOCK_R, OWN_FROM_X)


# ---- send ---------------------------------------------------------------------------------------------------------


@triton.jit
def _send(x_ptr, layout_ptr, route_ptr, bases_ptr, mask_ptr, shrink_ptr, status_ptr, rank, experts_per_rank,
          num_max_tokens, x_expert_stride, x_row_stride, rows_offset, arrived_offset, received_offset, timeout_ns,
          H: tl.constexpr, K: tl.constexpr, R: tl.constexpr, HAS_MASK: tl.constexpr, AUTO_MASK: tl.constexpr,
          LOGFMT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_R: tl.constexpr, ROWS: tl.constexpr,
          OWN_FROM_X: tl.constexpr):
    """Send steps 1-3 (module docstring)."""
    pid = tl.program_id(0)
    num_senders = tl.num_programs(0)
    ro = tl.arange(0, BLOCK_R)
    eo = tl.arange(0, BLOCK_E)
    RN = R * num_max_tokens
    ranges = tl.load(layout_ptr + eo[:, None] * R + ro[None, :],
                     mask=(eo[:, None] < experts_per_rank) & (ro[None, :] < R), other=0)
    per_expert = tl.sum((ranges & 0xFFFFFFFF).to(tl.int32), axis=1)
    ends = tl.cumsum(per_expert, axis=0)          # rows of experts 0..e, all experts laid end to end
    total = tl.sum(per_expert)
    senders = tl.maximum(tl.minimum(tl.cdiv(total, ROWS), num_senders), 1)
    rank_open, free, bases = begin_send(bases_ptr, mask_ptr, shrink_ptr, rank, received_offset, ro, pid < senders,
                                        timeout_ns, status_ptr, R, HAS_MASK, AUTO_MASK)
    total = tl.where(free, total, 0)
    open_bits = rank_bits(rank_open, ro)
    for g0 in range(pid * ROWS, total, num_senders * ROWS):
        _send_rows(g0, total, ends, x_ptr, route_ptr, bases_ptr, open_bits, rank, num_max_tokens, RN,
                   x_expert_stride, x_row_stride, rows_offset, H, K, R, HAS_MASK, LOGFMT, BLOCK_H, ROWS, OWN_FROM_X)
    # a program whose wait timed out claims no share: the receivers time out too
    claim_arrival(bases, rank_open & free, send_share(senders), arrived_offset, rank)


@triton.jit
def _send_rows(g0, total, ends, x_ptr, route_ptr, bases_ptr, open_bits, rank, num_max_tokens, RN, x_expert_stride,
               x_row_stride, rows_offset, H: tl.constexpr, K: tl.constexpr, R: tl.constexpr, HAS_MASK: tl.constexpr,
               LOGFMT: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr, OWN_FROM_X: tl.constexpr):
    """Send step 2 for rows g0 .. g0 + ROWS - 1 (below `total`) of the local experts laid end to end (`ends`:
    rows of experts 0..e; RN = R * num_max_tokens)."""
    ho = tl.arange(0, BLOCK_H)
    g = g0 + tl.arange(0, ROWS)
    live = g < total
    expert = tl.sum((ends[None, :] <= g[:, None]).to(tl.int32), axis=1)
    row = g - tl.max(tl.where(ends[None, :] <= g[:, None], ends[None, :], 0), axis=1)
    route = tl.load(route_ptr + expert.to(tl.int64) * RN + row, mask=live, other=0)
    source = route // (num_max_tokens * K)   # (a negative route truncates to source 0: tested as a route)
    live = live & (route >= 0) & (source < R)   # never store through a route the dispatch did not write
    if OWN_FROM_X:   # this rank's own rows: its receive reads them from x (Note [own rows])
        live = live & (source != rank)
    if HAS_MASK:
        live = live & in_rank_bits(open_bits, source)
    values = tl.load(x_ptr + (expert.to(tl.int64) * x_expert_stride + row.to(tl.int64) * x_row_stride)[:, None]
                     + ho[None, :], mask=live[:, None] & (ho[None, :] < H), other=0.0)
    if LOGFMT:
        values = to_bf16(_logfmt_roundtrip(values, H, ROWS, BLOCK_H))
    base = tl.load(bases_ptr + source, mask=live, other=0)
    dest = base + rows_offset + (route - source * (num_max_tokens * K)).to(tl.int64) * (2 * H)
    tl.store(row_pointers(dest, ho, tl.bfloat16, BLOCK_H), values, mask=live[:, None] & (ho[None, :] < H))


@triton.jit
def _logfmt_roundtrip(values, H: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    """[ROWS, BLOCK_H] bf16 rows (zeros past H) -> what a LogFMT-10 receiver reconstructs, in float32: per
    128-channel group a 9-bit code on a log2 grid between max(log2(amin), log2(amax) - 32) and log2(amax)
    (amin over the channels below H), rounded to the nearer level in linear space; a chunk of 1024 channels
    (512 unless H % 1024 == 0) is encoded only if all its groups have amax < 1 and amin < amax. Compiled
    without fused multiply-adds and with correctly rounded log2/exp2/division, as torch computes it."""
    G: tl.constexpr = BLOCK_H // 128
    CHUNK_GROUPS: tl.constexpr = 8 if H % 1024 == 0 else 4
    v = tl.reshape(values.to(tl.float32), [ROWS, G, 128])
    mag = tl.abs(v)
    amax = tl.max(mag, axis=2)
    channel = tl.arange(0, G)[None, :, None] * 128 + tl.arange(0, 128)[None, None, :]
    amin = tl.min(tl.where(channel < H, mag, float("inf")), axis=2)   # (a short last group's padding excluded)
    log_amax = libdevice.log2(amax)
    log_amin = tl.maximum(libdevice.log2(amin), log_amax - 32.0)
    step = (log_amax - log_amin) * (1.0 / 510.0)   # float32 reciprocal, as deep_ep.fp8 does
    safe_step = tl.where(step > 0, step, 1.0)[:, :, None]
    low_amin = log_amin[:, :, None]
    position = tl.div_rn(libdevice.log2(mag) - low_amin, safe_step + tl.zeros_like(mag))
    low = tl.minimum(tl.maximum(libdevice.floor(position), -1.0), 510.0)
    high = tl.minimum(low + 1.0, 510.0)
    below = tl.where(low < 0, 0.0, libdevice.exp2(low * safe_step + low_amin))
    above = tl.where(high < 0, 0.0, libdevice.exp2(high * safe_step + low_amin))
    decoded = tl.where(tl.abs(mag - below) <= tl.abs(above - mag), below, above)
    decoded = tl.where(mag == 0, 0.0, decoded)
    sign = v.to(tl.int32, bitcast=True) & (-2147483648)
    decoded = (decoded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    group = tl.arange(0, G)[None, :]
    group_ok = ((log_amax < 0) & (amin < amax)) | (group >= (H + 127) // 128)   # groups past the end never veto
    chunk_ok = tl.min(tl.reshape(group_ok.to(tl.int32), [ROWS, G // CHUNK_GROUPS, CHUNK_GROUPS]), axis=2)
    encoded = tl.reshape(tl.broadcast_to(chunk_ok[:, :, None], [ROWS, G // CHUNK_GROUPS, CHUNK_GROUPS]), [ROWS, G])
    out = tl.where(encoded[:, :, None] > 0, decoded, v)
    return tl.reshape(out, [ROWS, BLOCK_H])


# ---- receive ------------------------------------------------------------------------------------------------------


@triton.jit
def _receive(rows_ptr, arrived_ptr, received_ptr, idx_ptr, weights_ptr, mask_ptr, shrink_ptr, out_ptr,
             stats_ptr, status_ptr, x_ptr, route_ptr, num_max_tokens, x_expert_stride, x_row_stride, num_tokens,
             num_experts, experts_per_rank, num_senders, timeout_ns,
             H: tl.constexpr, K: tl.constexpr, R: tl.constexpr, HAS_MASK: tl.constexpr, AUTO_MASK: tl.constexpr,
             HAS_STATS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
             OWN_FROM_X: tl.constexpr):
    """Receive steps 1-3 (module docstring)."""
    CHUNKS: tl.constexpr = (H + CHUNK - 1) // CHUNK
    pid = tl.program_id(0)
    ok, sources = wait_for_senders(arrived_ptr, received_ptr, mask_ptr, shrink_ptr, stats_ptr, num_senders, timeout_ns,
                                   status_ptr, WAIT_LL_COMBINE, R, HAS_MASK, AUTO_MASK, HAS_STATS, BLOCK_R)
    if ok:
        # contiguous items per program: a token's chunks mostly stay in one program (its ids and weights
        # are then read from L1 after the first chunk)
        per_program = tl.cdiv(num_tokens * CHUNKS, tl.num_programs(0))
        for item in range(pid * per_program, tl.minimum((pid + 1) * per_program, num_tokens * CHUNKS)):
            t = item // CHUNKS
            ho = (item - t * CHUNKS) * CHUNK + tl.arange(0, CHUNK)
            token_k = tl.cast(t, tl.int64) * K   # (a cast, not .to: the interpreter's loop counters are ints)
            acc = _sum_chunk(token_k, ho, sources, rows_ptr, idx_ptr, weights_ptr, status_ptr, x_ptr, route_ptr,
                             num_max_tokens, x_expert_stride, x_row_stride, num_experts, experts_per_rank, H, K, R,
                             HAS_MASK, CHUNK, BLOCK_K, OWN_FROM_X)
            tl.store(out_ptr + tl.cast(t, tl.int64) * H + ho, to_bf16(acc), mask=ho < H)
    finish_receive(received_ptr)


@triton.jit
def _sum_chunk(token_k, ho, sources, rows_ptr, idx_ptr, weights_ptr, status_ptr, x_ptr, route_ptr, num_max_tokens,
               x_expert_stride, x_row_stride, num_experts, experts_per_rank, H: tl.constexpr, K: tl.constexpr,
               R: tl.constexpr, HAS_MASK: tl.constexpr, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr,
               OWN_FROM_X: tl.constexpr):
    """Receive step 2 for channels `ho` of the token whose top-k entries start at `token_k`: the float32 sum."""
    ko = tl.arange(0, BLOCK_K)
    ids = tl.load(idx_ptr + token_k + ko, mask=ko < K, other=-1)
    weights = tl.load(weights_ptr + token_k + ko, mask=ko < K, other=0.0)
    report_bad_ids(status_ptr, (ko < K) & ((ids < -1) | (ids >= num_experts)), ids)
    valid = (ids >= 0) & (ids < num_experts)
    if HAS_MASK:
        valid = valid & in_rank_bits(sources, tl.where(valid, ids // experts_per_rank, 0))
    acc = tl.zeros([CHUNK], tl.float32)
    for k in tl.static_range(K):   # no branch: the K loads can all be in flight at once
        use = tl.sum((valid & (ko == k)).to(tl.int32)) > 0
        w = tl.sum(tl.where(valid & (ko == k), weights, 0.0))
        # loaded whether or not the slot is used (an unused slot's stale bits are dropped below), so the load
        # need not wait for the ids
        row = rows_ptr + (token_k + k) * H
        if OWN_FROM_X:
            row = _own_row(row, token_k, k, x_ptr, route_ptr, num_max_tokens, x_expert_stride, x_row_stride,
                           experts_per_rank, R)
        values = tl.load(row + ho, mask=ho < H, other=0.0)
        acc = acc + tl.where(use, w * values.to(tl.float32), 0.0)
    return acc


@triton.jit
def _own_row(row, token_k, k, x_ptr, route_ptr, num_max_tokens, x_expert_stride, x_row_stride, experts_per_rank,
             R: tl.constexpr):
    """The row of selection (t, k) (token_k = t * K): in x where OWN says it is an own selection, else `row`
    (Note [own rows])."""
    RN = R * num_max_tokens
    place = tl.load(route_ptr + experts_per_rank * RN + token_k + k)
    own = (place >= 0) & (place < experts_per_rank * RN)   # never read outside x
    expert = place // RN
    # (a scalar pointer from scalar offsets: the row loads keep their 16-byte accesses)
    return tl.where(own, x_ptr + expert.to(tl.int64) * x_expert_stride
                    + (place - expert * RN).to(tl.int64) * x_row_stride, row)
