"""Low-latency dispatch over peer-mapped buffers: one kernel, ll_dispatch_kernel, launched as a send (returns
at once), a receive (the hook), or both in one launch (without a hook, with few tokens: Note [fused] in
low_latency.py).

Areas of one buffer half, identical in every rank's low-latency buffer (byte offsets from the host):
  ARRIVED[src]         int64 (signal area): arrivals claimed by send programs of `src`, NUM_SENDERS per call
  RECEIVED             int64 (signal area): RECEIVED_UNIT (sync.py) per call on this half whose receive has
                       finished here; "calls received" below is RECEIVED // RECEIVED_UNIT
  MASKS[e][src][t]     int32: bit k set when token t of rank `src` selected local expert e in top-k slot k
  SLOTS[src][t]        token t of rank `src`: [payload words | scale words], 16-byte aligned
  OWN[t * K + k]       int32, in the route tensor after its E_loc * R * N entries: where this rank's own
                       selection (t, k) landed here (e * R * N + p), -1 if not here
Send (NUM_SENDERS programs; token t by program t mod NUM_SENDERS), in this order:
  1. a program with a token (program 0 also without) waits until every unmasked rank has received as many
     calls on this half as this rank (it has read what the previous call left there; the combine waits alike);
  2. per token: load the row, cast it to e4m3 once if asked, store it once into SLOTS[me][t] of every unmasked
     rank d that holds one of the token's valid experts (one copy per rank, not per expert), the slot bits
     of every distinct such expert e into MASKS[e][me][t] of rank d, and OWN[t * K + k] = -1 for every slot
     k that no local expert keeps (so the combine's receive finds every entry defined without the ids);
  3. the programs that waited add shares summing to NUM_SENDERS (sync.send_share) to ARRIVED[me] of every
     unmasked rank (release, after a barrier over the program's stores): few tokens, few atomics.
Receive (programs over local experts), in this order:
  1. wait until ARRIVED[s] >= NUM_SENDERS * (calls received + 1) for every unmasked source s (counters only
     grow; a half serves dispatches and combines alike);
  2. per expert e: read MASKS[e]; write recv_count and layout_range; expand the bits in the reference order
     (source, token, slot) into rows: row p copies SLOTS[s][t] (a token listing e twice gets two rows),
     src_info[e, p] = t, route[e, p] = (s, t * K + k) for the combine, OWN[t * K + k] = e * R * N + p for
     this rank's own tokens; src_info = -1 past the rows; then clear MASKS[e] for the next use of the half;
  3. every program adds its share of RECEIVED_UNIT to RECEIVED (release; the shares sum to it).
Note [timeouts]: a wait that exceeds the timeout records (code, peer) in the host-visible status and skips the
copies (a timed-out receive leaves empty outputs; a timed-out sender claims no arrival). In shrink mode the
rank waited for is masked instead, and the call goes on without it (sync.py).
Note [too many rows]: an expert sent more rows than its R * N (only tokens listing it several times can) gets
its first R * N rows, and counts (recv_count, layout_range) that describe those rows only, so that the combine
never reads past them; the receive reports it in the status (sync.report_bad_input) for the host's error.
"""
import triton
import triton.language as tl

from .intrinsics import follow_previous_kernel, popcount, to_e4m3
from .launcher import profiler_name
from .status import TOO_MANY_ROWS, WAIT_LL_DISPATCH
from .sync import (begin_send, claim_arrival, finish_receive, in_rank_bits, rank_bits, report_bad_ids, report_bad_input,
                   row_pointer, send_share, wait_for_senders)

FP8_MAX = tl.constexpr(448.0)


@triton.jit(repr=profiler_name("deep_ep", "low_latency", "dispatch"))
def ll_dispatch_kernel(x_ptr, idx_ptr, bases_ptr, mask_ptr, shrink_ptr, status_ptr, num_tokens, rank, num_experts,
                       experts_per_rank, num_max_tokens, masks_offset, slots_offset, arrived_offset,
                       received_offset, timeout_ns,
                       masks_ptr, slots_ptr, arrived_ptr, received_ptr, stats_ptr,
                       out_x_ptr, out_scales_ptr, src_info_ptr, route_ptr, layout_ptr, count_ptr, num_senders,
                       H: tl.constexpr, K: tl.constexpr, R: tl.constexpr, FP8: tl.constexpr,
                       ROUND: tl.constexpr, UE8M0: tl.constexpr, XW: tl.constexpr, SW: tl.constexpr,
                       SLOT_W: tl.constexpr, HAS_MASK: tl.constexpr, AUTO_MASK: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr,
                       HAS_STATS: tl.constexpr, BLOCK_RN: tl.constexpr, BLOCK_X: tl.constexpr,
                       BLOCK_S: tl.constexpr, ROWS: tl.constexpr, AHEAD: tl.constexpr,
                       SEND: tl.constexpr, RECEIVE: tl.constexpr, PDL: tl.constexpr):
    """The send (SEND), the receive (RECEIVE), or both: then the NUM_SENDERS programs that sent wait for every
    source and copy their share of the local experts; the grid is cooperative (all resident at once), so a
    program that waits never keeps one that has yet to send from starting. Parameters up to `timeout_ns` are
    the send's, the others the receive's (route_ptr, mask_ptr and the scalars serve both); a launch passes
    anything for those of the phase it leaves out. PDL: wait for the previous kernel's writes first."""
    if PDL:
        follow_previous_kernel()
    if SEND:
        _send(x_ptr, idx_ptr, route_ptr, bases_ptr, mask_ptr, shrink_ptr, status_ptr, num_tokens, rank, num_experts,
              experts_per_rank, num_max_tokens, masks_offset, slots_offset, arrived_offset, received_offset,
              timeout_ns, H, K, R, FP8, ROUND, UE8M0, XW, SW, SLOT_W, HAS_MASK, AUTO_MASK, BLOCK_H, BLOCK_K, BLOCK_R,
              BLOCK_G)
    if RECEIVE:
        _receive(masks_ptr, slots_ptr, arrived_ptr, received_ptr, mask_ptr, shrink_ptr, stats_ptr, status_ptr,
                 out_x_ptr, out_scales_ptr, src_info_ptr, route_ptr, layout_ptr, count_ptr, rank, experts_per_rank,
                 num_max_tokens, num_senders, timeout_ns, K, R, XW, SW, SLOT_W, HAS_MASK, AUTO_MASK, HAS_STATS,
                 BLOCK_RN, BLOCK_R, BLOCK_X, BLOCK_S, ROWS, AHEAD)


# ---- send ---------------------------------------------------------------------------------------------------------


@triton.jit
def _send(x_ptr, idx_ptr, route_ptr, bases_ptr, mask_ptr, shrink_ptr, status_ptr, num_tokens, rank, num_experts,
          experts_per_rank, num_max_tokens, masks_offset, slots_offset, arrived_offset, received_offset, timeout_ns,
          H: tl.constexpr, K: tl.constexpr, R: tl.constexpr, FP8: tl.constexpr, ROUND: tl.constexpr,
          UE8M0: tl.constexpr, XW: tl.constexpr, SW: tl.constexpr, SLOT_W: tl.constexpr, HAS_MASK: tl.constexpr,
          AUTO_MASK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
          BLOCK_G: tl.constexpr):
    """Send steps 1-3 (module docstring)."""
    pid = tl.program_id(0)
    num_senders = tl.num_programs(0)
    ko = tl.arange(0, BLOCK_K)
    ro = tl.arange(0, BLOCK_R)
    ho = tl.arange(0, BLOCK_H)
    # the first token's ids and row are loaded before the wait for the half, so that their latency overlaps it
    # (and its send peeled from the loop: carrying the next token's ids through the loop instead does not compile
    # with Triton 3.6 at top-32)
    has_first = pid < num_tokens
    ids = tl.load(idx_ptr + tl.cast(pid, tl.int64) * K + ko, mask=(ko < K) & has_first, other=-1)
    row = tl.load(x_ptr + tl.cast(pid, tl.int64) * H + ho, mask=(ho < H) & has_first, other=0.0)
    senders = tl.maximum(tl.minimum(num_tokens, num_senders), 1)
    rank_open, free, bases = begin_send(bases_ptr, mask_ptr, shrink_ptr, rank, received_offset, ro, pid < senders,
                                        timeout_ns, status_ptr, R, HAS_MASK, AUTO_MASK)
    open_bits = rank_bits(rank_open, ro)
    if free & has_first:
        _send_token(pid, ids, row, route_ptr, bases_ptr, open_bits, status_ptr, rank, num_experts,
                    experts_per_rank, num_max_tokens, masks_offset, slots_offset, H, K, R, FP8, ROUND, UE8M0, XW, SW,
                    SLOT_W, HAS_MASK, BLOCK_H, BLOCK_K, BLOCK_G)
    for t in range(pid + num_senders, tl.where(free, num_tokens, 0), num_senders):
        token = tl.cast(t, tl.int64)
        ids = tl.load(idx_ptr + token * K + ko, mask=ko < K, other=-1)
        row = tl.load(x_ptr + token * H + ho, mask=ho < H, other=0.0)
        _send_token(t, ids, row, route_ptr, bases_ptr, open_bits, status_ptr, rank, num_experts,
                    experts_per_rank, num_max_tokens, masks_offset, slots_offset, H, K, R, FP8, ROUND, UE8M0, XW, SW,
                    SLOT_W, HAS_MASK, BLOCK_H, BLOCK_K, BLOCK_G)
    # a program whose wait timed out claims no share: the receivers time out too
    claim_arrival(bases, rank_open & free, send_share(senders), arrived_offset, rank)


@triton.jit
def _send_token(t, ids, row, route_ptr, bases_ptr, open_bits, status_ptr, rank, num_experts, experts_per_rank,
                num_max_tokens, masks_offset, slots_offset, H: tl.constexpr, K: tl.constexpr, R: tl.constexpr,
                FP8: tl.constexpr, ROUND: tl.constexpr, UE8M0: tl.constexpr, XW: tl.constexpr, SW: tl.constexpr,
                SLOT_W: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                BLOCK_G: tl.constexpr):
    """Send step 2 for token t (its top-k `ids` and `row`, loaded by the caller) to the ranks in `open_bits`
    (rank_bits; with HAS_MASK)."""
    ko = tl.arange(0, BLOCK_K)
    ho = tl.arange(0, BLOCK_H)
    so = tl.arange(0, BLOCK_G)
    token = tl.cast(t, tl.int64)   # (a cast, not .to: the interpreter's loop counters are ints)
    in_range = (ids >= 0) & (ids < num_experts)
    report_bad_ids(status_ptr, (ko < K) & ((ids < -1) | (ids >= num_experts)), ids)
    owner = tl.where(in_range, ids // experts_per_rank, 0)
    if HAS_MASK:
        valid = in_range & in_rank_bits(open_bits, owner)
    else:
        valid = in_range
    same = (ids[:, None] == ids[None, :]) & valid[:, None] & valid[None, :]
    earlier = ko[None, :] < ko[:, None]
    first = valid & (tl.sum((same & earlier).to(tl.int32), axis=1) == 0)
    same_rank = (owner[:, None] == owner[None, :]) & valid[:, None] & valid[None, :]
    first_of_rank = valid & (tl.sum((same_rank & earlier).to(tl.int32), axis=1) == 0)
    slot_bits = tl.sum(tl.where(same, 1 << ko[None, :], 0), axis=1)
    own_table = route_ptr + experts_per_rank * R * num_max_tokens   # (this rank's receive fills the others)
    tl.store(own_table + token * K + ko, tl.full([BLOCK_K], -1, tl.int32),
             mask=(ko < K) & ~(valid & (owner == rank)))
    if FP8:
        data, scale_words = _quantize(row, H, ROUND, UE8M0, BLOCK_H)
    # where each distinct expert's bits and each distinct rank's row go, for all slots at once (no memory
    # access in the loop below)
    dest = tl.where(valid, owner, 0)
    entry = (((ids - dest * experts_per_rank) * R + rank) * num_max_tokens + t).to(tl.int64)
    bases = tl.load(bases_ptr + dest, mask=valid, other=0)
    tl.store((bases + masks_offset + entry * 4).to(tl.pointer_type(tl.int32)), slot_bits, mask=first)
    slots = bases + slots_offset + (rank * num_max_tokens + t).to(tl.int64) * (SLOT_W * 4)
    for k in tl.static_range(K):
        pick = ko == k
        if tl.sum((pick & first_of_rank).to(tl.int32)) > 0:
            slot = tl.sum(tl.where(pick, slots, 0))
            if FP8:
                tl.store(row_pointer(slot, ho, tl.float8e4nv, BLOCK_H), data, mask=ho < H)
                tl.store((slot + XW * 4).to(tl.pointer_type(tl.int32)) + so, scale_words, mask=so < SW)
            else:
                tl.store(row_pointer(slot, ho, tl.bfloat16, BLOCK_H), row, mask=ho < H)


@triton.jit
def _quantize(row, H: tl.constexpr, ROUND: tl.constexpr, UE8M0: tl.constexpr, BLOCK_H: tl.constexpr):
    """e4m3 values and per-128-channel scales of one bf16 row (the rules of deep_ep.fp8, bit for bit).
    Returns (data [BLOCK_H] e4m3, scale words [BLOCK_H // 128] or [BLOCK_H // 512] packed UE8M0)."""
    G: tl.constexpr = BLOCK_H // 128
    v = row.to(tl.float32)
    groups = tl.reshape(v, [G, 128])
    amax = tl.maximum(tl.max(tl.abs(groups), axis=1), 1e-4)
    if ROUND:
        bits = (amax * (1.0 / 448.0)).to(tl.int32, bitcast=True)
        exponent = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)   # ceil(log2(amax / 448))
        scale_inv = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
        multiplier = ((127 - exponent) << 23).to(tl.float32, bitcast=True)
    else:
        scale_inv = amax * (1.0 / 448.0)
        multiplier = tl.div_rn(tl.full([G], 448.0, tl.float32), amax)
    scaled = tl.reshape(groups * multiplier[:, None], [BLOCK_H])
    data = to_e4m3(tl.clamp(scaled, -FP8_MAX, FP8_MAX))
    if UE8M0:   # groups past the end of the row pack as 0, as deep_ep.fp8.pack_ue8m0 does
        exponent_bytes = tl.where(tl.arange(0, G) < (H + 127) // 128,
                                  (scale_inv.to(tl.int32, bitcast=True) >> 23) & 0xFF, 0)
        exponent_bytes = tl.reshape(exponent_bytes, [G // 4, 4])
        shifts = tl.arange(0, 4) * 8
        words = tl.sum(exponent_bytes << shifts[None, :], axis=1)
    else:
        words = scale_inv.to(tl.int32, bitcast=True)
    return data, words


# ---- receive ------------------------------------------------------------------------------------------------------


@triton.jit
def _receive(masks_ptr, slots_ptr, arrived_ptr, received_ptr, mask_ptr, shrink_ptr, stats_ptr, status_ptr,
             out_x_ptr, out_scales_ptr, src_info_ptr, route_ptr, layout_ptr, count_ptr, rank, experts_per_rank,
             num_max_tokens, num_senders, timeout_ns, K: tl.constexpr, R: tl.constexpr, XW: tl.constexpr,
             SW: tl.constexpr, SLOT_W: tl.constexpr, HAS_MASK: tl.constexpr, AUTO_MASK: tl.constexpr,
             HAS_STATS: tl.constexpr, BLOCK_RN: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_X: tl.constexpr,
             BLOCK_S: tl.constexpr, ROWS: tl.constexpr, AHEAD: tl.constexpr):
    """Receive steps 1-3 (module docstring)."""
    pid = tl.program_id(0)
    ro = tl.arange(0, BLOCK_R)
    ok, sources = wait_for_senders(arrived_ptr, received_ptr, mask_ptr, shrink_ptr, stats_ptr, num_senders, timeout_ns,
                                   status_ptr, WAIT_LL_DISPATCH, R, HAS_MASK, AUTO_MASK, HAS_STATS, BLOCK_R)
    if ok:
        _receive_experts(sources, masks_ptr, slots_ptr, status_ptr, out_x_ptr, out_scales_ptr, src_info_ptr,
                         route_ptr, layout_ptr, count_ptr, rank, experts_per_rank, num_max_tokens, K, R, XW, SW,
                         SLOT_W, HAS_MASK, BLOCK_RN, BLOCK_R, BLOCK_X, BLOCK_S, ROWS, AHEAD)
    else:   # timed out: empty outputs, so that a combine enqueued before the host sees the error sends nothing
        for e in range(pid, experts_per_rank, tl.num_programs(0)):
            tl.store(layout_ptr + e * R + ro, tl.zeros([BLOCK_R], tl.int64), mask=ro < R)
            tl.store(count_ptr + e, 0)
    finish_receive(received_ptr)


@triton.jit
def _receive_experts(sources, masks_ptr, slots_ptr, status_ptr, out_x_ptr, out_scales_ptr, src_info_ptr, route_ptr,
                     layout_ptr, count_ptr, rank, experts_per_rank, num_max_tokens, K: tl.constexpr,
                     R: tl.constexpr, XW: tl.constexpr, SW: tl.constexpr, SLOT_W: tl.constexpr,
                     HAS_MASK: tl.constexpr, BLOCK_RN: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_X: tl.constexpr,
                     BLOCK_S: tl.constexpr, ROWS: tl.constexpr, AHEAD: tl.constexpr):
    """Receive step 2 for this program's experts (e = program, program + grid, ...), from the sources whose
    bits are set in `sources`."""
    pid = tl.program_id(0)
    RN = R * num_max_tokens
    jo = tl.arange(0, BLOCK_RN)            # entry j = source * N + token
    source_of = jo // num_max_tokens
    in_table = jo < RN
    if HAS_MASK:
        in_table = in_table & in_rank_bits(sources, source_of)
    if AHEAD:   # a program with several experts loads each table one expert ahead (one load to wait for)
        next_bits = tl.load(masks_ptr + tl.cast(pid, tl.int64) * RN + jo,
                            mask=in_table & (pid < experts_per_rank), other=0)
    for e in range(pid, experts_per_rank, tl.num_programs(0)):
        out_base = tl.cast(e, tl.int64) * RN   # (a cast, not .to: the interpreter's loop counters are ints)
        table = masks_ptr + out_base
        if AHEAD:
            bits = next_bits
            after = e + tl.num_programs(0)
            next_bits = tl.load(masks_ptr + tl.cast(after, tl.int64) * RN + jo,
                                mask=in_table & (after < experts_per_rank), other=0)
        else:
            bits = tl.load(table + jo, mask=in_table, other=0)
        ends, total, written = _count_rows(e, bits, source_of, RN, status_ptr, layout_ptr, count_ptr, R, BLOCK_R)
        for p0 in range(0, written, ROWS):
            _copy_rows(p0, written, ends, jo, table, out_base, slots_ptr, out_x_ptr, out_scales_ptr, src_info_ptr,
                       route_ptr, rank, experts_per_rank, num_max_tokens, RN, K, XW, SW, SLOT_W, BLOCK_X, BLOCK_S,
                       ROWS)
        for p0 in range(total, RN, BLOCK_RN):   # rows past the count: src_info -1, as the reference has
            p = p0 + jo
            tl.store(src_info_ptr + out_base + p, tl.full([BLOCK_RN], -1, tl.int32), mask=p < RN)
        tl.debug_barrier()   # every thread has read the table before it is cleared
        tl.store(table + jo, tl.zeros([BLOCK_RN], tl.int32), mask=jo < RN)


@triton.jit
def _count_rows(e, bits, source_of, RN, status_ptr, layout_ptr, count_ptr, R: tl.constexpr, BLOCK_R: tl.constexpr):
    """Expert e's rows from its table `bits` (entry j: the slot bits of source j // N's token j % N): writes
    recv_count and layout_range of the rows written (Note [too many rows]). Returns (rows up to and including
    each entry, rows sent, rows written)."""
    ro = tl.arange(0, BLOCK_R)
    rows_of = popcount(bits)
    ends = tl.cumsum(rows_of, axis=0)
    total = tl.sum(rows_of)
    if total > RN:   # (only tokens listing expert e several times can send it more rows than it has)
        report_bad_input(status_ptr, TOO_MANY_ROWS, e)
    written = tl.minimum(total, RN)
    per_source = tl.sum(tl.where(source_of[None, :] == ro[:, None], rows_of[None, :], 0), axis=1)
    begins = tl.cumsum(per_source, axis=0) - per_source
    per_source = tl.minimum(per_source, tl.maximum(written - begins, 0))
    begins = tl.minimum(begins, written)
    tl.store(layout_ptr + e * R + ro, (begins.to(tl.int64) << 32) | per_source.to(tl.int64), mask=ro < R)
    tl.store(count_ptr + e, written)
    return ends, total, written


@triton.jit
def _copy_rows(p0, written, ends, jo, table, out_base, slots_ptr, out_x_ptr, out_scales_ptr, src_info_ptr, route_ptr,
               rank, experts_per_rank, num_max_tokens, RN, K: tl.constexpr, XW: tl.constexpr, SW: tl.constexpr,
               SLOT_W: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_S: tl.constexpr, ROWS: tl.constexpr):
    """Output rows p0 .. p0 + ROWS - 1 (below `written`) of the expert whose table is at `table`: their slots'
    payloads and scales, src_info, route and OWN."""
    p = p0 + tl.arange(0, ROWS)
    live = p < written
    entry, k = _find_rows(p, live, ends, jo, table, RN)
    source = entry // num_max_tokens
    token = entry - source * num_max_tokens
    slot = entry.to(tl.int64) * SLOT_W
    xo = tl.arange(0, BLOCK_X)
    payload = tl.load(slots_ptr + slot[:, None] + xo[None, :], mask=live[:, None] & (xo[None, :] < XW))
    tl.store(out_x_ptr + (out_base + p)[:, None] * XW + xo[None, :], payload, mask=live[:, None] & (xo[None, :] < XW))
    if SW > 0:   # scales are column-major: [E_loc, SW, R * N]
        so = tl.arange(0, BLOCK_S)
        scales = tl.load(slots_ptr + slot[:, None] + XW + so[None, :], mask=live[:, None] & (so[None, :] < SW))
        tl.store(out_scales_ptr + out_base * SW + so[None, :] * RN + p[:, None], scales,
                 mask=live[:, None] & (so[None, :] < SW))
    tl.store(src_info_ptr + out_base + p, token, mask=live)
    tl.store(route_ptr + out_base + p, source * (num_max_tokens * K) + token * K + k, mask=live)
    # this rank's own selections, the other way round: OWN[t * K + k] = e * R * N + p
    tl.store(route_ptr + experts_per_rank * RN + token * K + k, out_base + p, mask=live & (source == rank))


@triton.jit
def _find_rows(p, live, ends, jo, table, RN):
    """Where output rows `p` come from: (their table entry j = source * N + token, their top-k slot k, the
    (p - first row of the entry))-th bit set in the entry's word)."""
    bo = tl.arange(0, 32)
    entry = tl.sum(((ends[None, :] <= p[:, None]) & (jo[None, :] < RN)).to(tl.int32), axis=1)
    first_row = tl.max(tl.where(ends[None, :] <= p[:, None], ends[None, :], 0), axis=1)
    word = tl.load(table + entry, mask=live, other=0)
    bit = (word[:, None] >> bo[None, :]) & 1
    before = tl.cumsum(bit, axis=1) - bit
    k = tl.sum(tl.where((bit == 1) & (before == (p - first_row)[:, None]), bo[None, :], 0), axis=1)
    return entry, k
