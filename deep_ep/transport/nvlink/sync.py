"""Counters between ranks: int64 words that only grow, written with release stores or atomic adds and read with
acquire loads at system scope, and bounded spins.

A wait gives up after `timeout_ns` (measured with the GPU's global timer): it records (code, peer) in the
host-visible status words and returns False; the host turns that into an error naming rank and peer. A
program whose wait failed skips the rest of its work, so a kernel always finishes. Once a wait has timed
out, every later wait of the Buffer gives up after STALE_NS (status[0] is set): work already queued on the
GPU, or a CUDA graph replayed without a host check, then finishes quickly instead of waiting out the
timeout at every step.

Every value that steers a program's branches and loops is the same in all of its threads. A thread that reads
the clock or a volatile word for itself may see another value than its neighbours; if it then leaves a loop
that they stay in, the threads meet at different barriers (Triton's reductions use them) and the program
computes garbage. So a wait decides with cta_any (one barrier that ORs every thread's view), and reads words
that other programs change with atomics (Triton hands the one result to every thread that holds the value).

Low-latency waits in shrink mode (enable_shrink, with roll calls through the store on the host) do not fail: a
rank they give up on is masked instead, in the call's mask, in the Buffer's (so later calls skip it) and in
status[4 + rank] (the host warns), and the call goes on without it, as DeepEP masks a rank on a timeout. Such a
wait also stops waiting for a rank that another kernel of the Buffer has masked meanwhile (looked at, like
status[0], after STALE_NS).
"""
import triton
import triton.language as tl

from .intrinsics import clock_ns, cta_any
from .status import BAD_IDS, MASKED_BY_PEER, NO_PEER, WAIT_FREE, WAIT_LL_FREE

STALE_NS = tl.constexpr(1_000_000)   # how long a wait runs before it also looks for an earlier timeout
IDLE_POLLS = tl.constexpr(256)   # polls without progress between two looks at the clock (gave_up)
# a low-latency half's RECEIVED grows by this per call: every receive program adds its share (finish_receive),
# and readers count the calls as RECEIVED // RECEIVED_UNIT (a call whose programs have not all added counts
# as not received). Every share must be at least 1 (a program that added nothing could read its own call as
# received), so a receive grid has at most RECEIVED_UNIT programs (NVLinkLowLatency checks its largest); an
# int64 holds 2^47 calls
RECEIVED_UNIT = tl.constexpr(1 << 16)


@triton.jit
def report_timeout(status_ptr, code, peer):
    if tl.atomic_cas(status_ptr, 0, code, sem="relaxed", scope="sys") == 0:
        tl.atomic_xchg(status_ptr + 1, peer, sem="relaxed", scope="sys")


@triton.jit
def time_passed(start, limit_ns):
    """Whether more than `limit_ns` have passed since `start` (a clock_ns reading), the same answer in every
    thread of the program (each reads the clock for itself)."""
    return cta_any(clock_ns() - start > limit_ns)


@triton.jit
def gave_up(start, idle, timeout_ns, status_ptr):
    """Whether a program that has polled `idle` times without progress since `start` (a clock_ns reading) stops
    waiting: every IDLE_POLLS-th poll, once STALE_NS have passed, if `timeout_ns` have or an earlier wait of the
    Buffer timed out (status[0]), as _spin does. The same answer in every thread."""
    stop = idle < 0
    if idle % IDLE_POLLS == 0:
        if time_passed(start, STALE_NS):
            stop = cta_any(tl.load(status_ptr, volatile=True)) | time_passed(start, timeout_ns)
    return stop


@triton.jit
def read_words(ptrs, where, other):
    """Words that other programs may change, read so that every thread holding one gets the same value (a
    relaxed atomic read, as Triton lowers it: one thread reads, the others get its result); `other` where not
    `where`."""
    return tl.where(where, tl.atomic_add(ptrs, 0, mask=where, sem="relaxed", scope="gpu"), other)


@triton.jit
def _spin(ptrs, targets, mask, timeout_ns, status_ptr, shrink_ptrs, SHRINK: tl.constexpr):
    """Spin until every counter `ptrs[i]` (where `mask`) is >= `targets[i]`, polling only the lanes still behind,
    until the timeout or an earlier timeout of the Buffer (status[0]); with SHRINK, a lane also stops once its
    rank is masked at `shrink_ptrs[i]`. Returns (lanes given up on, waited, stale, seen): waited[i] is the
    nanoseconds from the start until lane i was seen ready; stale: it stopped for an earlier timeout; seen[i]:
    the last value read of `ptrs[i]` (0 where not `mask`)."""
    start = clock_ns()
    values = tl.atomic_add(ptrs, 0, mask=mask, sem="acquire", scope="sys")
    seen = tl.where(mask, values, 0)
    lagging = (mask & (values < targets)).to(tl.int32)
    masked = tl.zeros_like(lagging)
    waited = tl.where(mask, clock_ns() - start, 0)
    stale = tl.zeros([], tl.int32)
    polls = tl.zeros([], tl.int32)
    waiting = tl.sum(lagging) > 0
    while waiting:
        values = tl.atomic_add(ptrs, 0, mask=lagging > 0, sem="acquire", scope="sys")
        seen = tl.where(lagging > 0, values, seen)
        waited = tl.where(lagging > 0, clock_ns() - start, waited)
        lagging = tl.where(lagging > 0, (values < targets).to(tl.int32), 0)
        polls += 1
        # (status and the mask are read only in a long wait, and then every 256th poll; status is host memory)
        if (polls & 255) == 0:
            if time_passed(start, STALE_NS):
                stale = cta_any(tl.load(status_ptr, volatile=True)).to(tl.int32)
                if SHRINK:
                    gone = (lagging > 0) & (read_words(shrink_ptrs, lagging > 0, 0) != 0)
                    masked = tl.where(gone, 1, masked)
                    lagging = tl.where(gone, 0, lagging)
        # (the clock is read afresh here: a clock value carried through the loop crashes the Triton 3.6 compiler)
        waiting = (tl.sum(lagging) > 0) & (stale == 0) & ~time_passed(start, timeout_ns)
    return tl.maximum(lagging, masked), waited, stale, seen


@triton.jit
def wait_counters(ptrs, targets, mask, peers, timeout_ns, status_ptr, code):
    """Spin until every counter `ptrs[i]` (where `mask`) is >= `targets[i]`; returns (ok, waited): waited[i] is
    the nanoseconds from the start until lane i was seen ready. On timeout the first lagging lane's `peers[i]`
    is reported."""
    lagging, waited, _, _ = _spin(ptrs, targets, mask, timeout_ns, status_ptr, ptrs, False)
    ok = tl.sum(lagging) == 0
    if not ok:
        report_timeout(status_ptr, code, tl.min(tl.where(lagging > 0, peers, NO_PEER)))
    return ok, waited


@triton.jit
def wait_ranks(ptrs, targets, ranks, lanes, timeout_ns, status_ptr, code, mask_ptr, shrink_ptr,
               AUTO_MASK: tl.constexpr):
    """A low-latency wait until `ptrs[i]` >= `targets[i]` for every rank i in `ranks` (lane i: rank i). Without
    AUTO_MASK as wait_counters. With AUTO_MASK (shrink mode) a rank given up on is masked in this call's mask
    (`mask_ptr`), in the Buffer's (`shrink_ptr`) and in status[4 + rank] (= `code`, for the host's warning),
    and the wait succeeds without it; after an earlier timeout of the Buffer (status[0]) it fails instead.
    Returns (ranks still open, ok, waited, seen) (_spin's waited and seen)."""
    lagging, waited, stale, seen = _spin(ptrs, targets, ranks, timeout_ns, status_ptr, shrink_ptr + lanes, AUTO_MASK)
    gone = lagging > 0
    ok = tl.sum(lagging) == 0
    if AUTO_MASK:
        gone = gone & (stale == 0)
        mask_ranks(gone, lanes, code, mask_ptr, shrink_ptr, status_ptr)
        ranks = ranks & ~gone
        ok = stale == 0
    elif not ok:
        report_timeout(status_ptr, code, tl.min(tl.where(gone, lanes, NO_PEER)))
    return ranks, ok, waited, seen


@triton.jit
def mask_ranks(gone, lanes, code, mask_ptr, shrink_ptr, status_ptr):
    """Shrink mode: mask the ranks `gone` (lane i: rank i) in this call's mask, in the Buffer's (later calls skip
    them) and in status[4 + rank] (= `code`, for the host's warning)."""
    tl.atomic_xchg(mask_ptr + lanes, 1, mask=gone, sem="relaxed", scope="gpu")
    tl.atomic_xchg(shrink_ptr + lanes, 1, mask=gone, sem="relaxed", scope="gpu")
    tl.atomic_xchg(status_ptr + 4 + lanes, code, mask=gone, sem="relaxed", scope="sys")


@triton.jit
def wait_at_least(ptrs, targets, mask, peers, timeout_ns, status_ptr, code):
    """wait_counters without the wait times; returns ok."""
    ok, _ = wait_counters(ptrs, targets, mask, peers, timeout_ns, status_ptr, code)
    return ok


@triton.jit
def publish(ptrs, values, mask):
    """Set the counters `ptrs[i]` to `values[i]` (where `mask`) after every access this program made so far:
    the barrier orders all threads' accesses before the releasing store (release is cumulative), so one
    release per counter suffices; a fence in every thread would stall each of them on its NVLink stores."""
    tl.debug_barrier()
    tl.atomic_xchg(ptrs, values, mask=mask, sem="release", scope="sys")


@triton.jit
def peer_view(bases_ptr, rank, R: tl.constexpr, BLOCK_R: tl.constexpr):
    """Lanes over ranks, which of them are peers, this rank's buffer address (and as int64 counter
    words) and every rank's buffer address, from the table of peer-mapped base addresses."""
    ro = tl.arange(0, BLOCK_R)
    peers = (ro < R) & (ro != rank)
    own = tl.load(bases_ptr + rank)
    peer_bases = tl.load(bases_ptr + ro, mask=ro < R, other=0)
    return ro, peers, own, own.to(tl.pointer_type(tl.int64)), peer_bases


@triton.jit
def lane(values, lanes, i):
    """Lane i of a per-rank vector, as a scalar."""
    return tl.sum(tl.where(lanes == i, values, 0))


@triton.jit
def channel_tokens(q, num_tokens, C):
    """The tokens [first, end) of channel q: each channel takes ceil(T / C) consecutive tokens."""
    per_channel = tl.cdiv(num_tokens, C)
    first = tl.minimum(q * per_channel, num_tokens)
    return first, tl.minimum(first + per_channel, num_tokens)


@triton.jit
def row_pointers(addresses, offsets, dtype: tl.constexpr, BLOCK: tl.constexpr):
    """[ROWS, BLOCK] pointers: row r at byte address addresses[r] (16-byte aligned), element offsets."""
    ptrs = tl.multiple_of(addresses, 16).to(tl.pointer_type(dtype))[:, None] + offsets[None, :]
    return tl.max_contiguous(tl.multiple_of(ptrs, [1, 16]), [1, BLOCK])


@triton.jit
def row_pointer(address, offsets, dtype: tl.constexpr, BLOCK: tl.constexpr):
    """[BLOCK] pointers: one row at byte address `address` (16-byte aligned), element offsets. The hints let
    stores through an address computed on the GPU use 16-byte accesses."""
    ptrs = tl.multiple_of(address, 16).to(tl.pointer_type(dtype)) + offsets
    return tl.max_contiguous(tl.multiple_of(ptrs, 16), BLOCK)


@triton.jit
def report_bad_input(status_ptr, code, value):
    """Record bad input in status[2:4] (the first report wins): `code` and `value` (clamped to int32)."""
    if tl.atomic_cas(status_ptr + 2, 0, code, sem="relaxed", scope="sys") == 0:
        tl.atomic_xchg(status_ptr + 3, tl.minimum(tl.maximum(value, -(1 << 31)), (1 << 31) - 1).to(tl.int32),
                       sem="relaxed", scope="sys")


@triton.jit
def report_bad_ids(status_ptr, bad, ids):
    """Record that expert ids outside [-1, E) were seen (they count as no selection)."""
    if tl.sum(bad.to(tl.int32)) > 0:
        report_bad_input(status_ptr, BAD_IDS, tl.max(tl.where(bad, ids, -(1 << 40))))


@triton.jit
def calls_received(received_ptr):
    """The calls a low-latency half has received: RECEIVED // RECEIVED_UNIT, RECEIVED read with an acquire
    atomic, as the waits read the other counters: a plain load may be served from this SM's L1, which atomics
    elsewhere do not update, and receive programs add their shares to RECEIVED as they finish."""
    return tl.atomic_add(received_ptr, 0, sem="acquire", scope="sys") // RECEIVED_UNIT


@triton.jit
def wait_for_senders(arrived_ptr, received_ptr, mask_ptr, shrink_ptr, stats_ptr, num_senders, timeout_ns, status_ptr,
                     code, R: tl.constexpr, HAS_MASK: tl.constexpr, AUTO_MASK: tl.constexpr,
                     HAS_STATS: tl.constexpr, BLOCK_R: tl.constexpr):
    """The start of a low-latency receive program: wait until ARRIVED[s] >= num_senders * (calls received + 1)
    for every source s its shrink mask leaves open (AUTO_MASK: a source given up on is masked, wait_ranks);
    with HAS_STATS, program 0 adds to stats[s] how long source s was waited for (also for a source given up
    on). Returns (ok, the sources it did not give up on as rank_bits), after a barrier (every thread's later
    reads follow the wait)."""
    lanes = tl.arange(0, BLOCK_R)
    received = calls_received(received_ptr)
    sources = open_ranks(mask_ptr, lanes, R, HAS_MASK)
    still_open, ok, waited, _ = wait_ranks(arrived_ptr + lanes, (received + 1) * num_senders, sources, lanes,
                                           timeout_ns, status_ptr, code, mask_ptr, shrink_ptr, AUTO_MASK)
    if HAS_STATS:
        if tl.program_id(0) == 0:
            tl.atomic_add(stats_ptr + lanes, waited, mask=sources, sem="relaxed")
    tl.debug_barrier()
    return ok, rank_bits(still_open, lanes)


@triton.jit
def open_ranks(mask_ptr, lanes, R: tl.constexpr, HAS_MASK: tl.constexpr):
    """Lanes of the ranks this rank exchanges with: every rank, less those its shrink mask marks failed (read
    from memory every time: a wait of this call may have masked a rank since the last read)."""
    if HAS_MASK:
        return (lanes < R) & (read_words(mask_ptr + lanes, lanes < R, 1) == 0)
    return lanes < R


@triton.jit
def rank_bits(ranks, lanes):
    """The lanes set in `ranks` as the bits of an int64 (bit r: rank r; at most 64 ranks with a shrink mask)."""
    return tl.sum(tl.where(ranks, tl.full(lanes.shape, 1, tl.int64) << lanes.to(tl.int64), 0))


@triton.jit
def in_rank_bits(bits, ranks):
    """Whether each rank of `ranks` is set in `bits` (rank_bits)."""
    return ((bits >> ranks.to(tl.int64)) & 1) != 0


@triton.jit
def even_share(total, part, parts):
    """Part `part` of `total` split into `parts` nearly equal integers that sum to it exactly (int64: total *
    parts may not fit an int32)."""
    part = part.to(tl.int64)
    return total * (part + 1) // parts - total * part // parts


@triton.jit
def send_share(senders):
    """How many of the grid's arrivals this send program claims: the first `senders` programs (those with
    something to send, at least one) claim them all between them, so a receiver always counts NUM_SENDERS
    (the grid) per source and call, while the programs with nothing to send touch no peer's counters."""
    pid = tl.program_id(0)
    return tl.where(pid < senders, even_share(tl.num_programs(0), pid, senders), 0)


@triton.jit
def claim_arrival(bases, ranks, share, arrived_offset, rank):
    """A low-latency send program is done: add its `share` (send_share) to ARRIVED[rank] of every rank in
    `ranks` (`bases`: their buffer addresses; release, after a barrier over every thread's stores: release
    is cumulative)."""
    tl.debug_barrier()
    tl.atomic_add((bases + arrived_offset + rank * 8).to(tl.pointer_type(tl.int64)), share, mask=ranks & (share > 0),
                  sem="release", scope="sys")


@triton.jit
def begin_send(bases_ptr, mask_ptr, shrink_ptr, rank, received_offset, lanes, sending, timeout_ns, status_ptr,
               R: tl.constexpr, HAS_MASK: tl.constexpr, AUTO_MASK: tl.constexpr):
    """The start of a low-latency send program (the twin of wait_for_senders): the ranks it exchanges with (none
    unless `sending`), and whether all of them have freed the buffer half (wait_half_free); if not, it sends
    nothing and the host reports the timeout (AUTO_MASK: a rank given up on is masked instead). Returns (open
    ranks, ok, every rank's buffer address where open)."""
    ranks = open_ranks(mask_ptr, lanes, R, HAS_MASK) & sending
    return wait_half_free(bases_ptr, rank, received_offset, ranks, lanes, timeout_ns, status_ptr, mask_ptr,
                          shrink_ptr, HAS_MASK, AUTO_MASK)


@triton.jit
def wait_half_free(bases_ptr, rank, received_offset, ranks, lanes, timeout_ns, status_ptr, mask_ptr, shrink_ptr,
                   HAS_MASK: tl.constexpr, AUTO_MASK: tl.constexpr):
    """Before a low-latency send into a buffer half: wait until every rank in `ranks` has received as many
    calls on this half as this rank has (RECEIVED at `received_offset` of each buffer), so nothing it has not
    read yet is overwritten. With a shrink mask, a rank that has received more (some of this call, or later
    ones) went on without this rank: it masked this rank (by hand, or after its wait for it timed out), and
    its half may hold a later call's rows, so nothing is sent to it (AUTO_MASK: it is masked here too, and
    the receive does not wait for it). Returns (ranks still open, ok, bases) (wait_ranks; bases: the buffer
    addresses of `ranks`)."""
    own = calls_received((tl.load(bases_ptr + rank) + received_offset).to(tl.pointer_type(tl.int64))) * RECEIVED_UNIT
    bases = tl.load(bases_ptr + lanes, mask=ranks, other=0)
    counters = (bases + received_offset).to(tl.pointer_type(tl.int64))
    ranks, ok, waited, seen = wait_ranks(counters, own, ranks, lanes, timeout_ns, status_ptr, WAIT_LL_FREE, mask_ptr,
                                         shrink_ptr, AUTO_MASK)
    if HAS_MASK:
        # after a long wait for some rank, the others are looked at again: one may have gone on meanwhile
        if cta_any(tl.max(waited) > STALE_NS):
            seen = tl.where(ranks, tl.atomic_add(counters, 0, mask=ranks, sem="acquire", scope="sys"), seen)
        ahead = ranks & (seen > own) & (lanes != rank)
        if AUTO_MASK:
            mask_ranks(ahead, lanes, MASKED_BY_PEER, mask_ptr, shrink_ptr, status_ptr)
        ranks = ranks & ~ahead
    tl.debug_barrier()   # every thread's stores into the half come after the acquiring loads
    return ranks, ok, bases


@triton.jit
def is_last_program(ticket_ptr):
    """Take a ticket (after a barrier over this program's accesses; acq_rel): True in the last program of the
    grid to get here, which then sees every other program's accesses and has reset the ticket counter to 0
    for the next kernel. Two kernels sharing a counter must not run at once."""
    tl.debug_barrier()
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
    last = ticket == tl.num_programs(0) - 1
    if last:
        tl.atomic_xchg(ticket_ptr, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def finish_receive(received_ptr):
    """The end of every low-latency receive program: add its share of RECEIVED_UNIT to RECEIVED (the shares of
    the grid's programs sum to it; release, after a barrier over every thread's reads of the half), so that
    RECEIVED reaches the next multiple once every program is done, without a ticket."""
    share = even_share(RECEIVED_UNIT, tl.program_id(0), tl.num_programs(0))
    tl.debug_barrier()
    tl.atomic_add(received_ptr, share, sem="release", scope="sys")


@triton.jit
def begin_operation(ctrl, ops_word, done_word, peers, lanes, timeout_ns, status_ptr):
    """Before a normal-mode kernel stores into any peer's buffer: wait until every peer has finished reading
    all earlier operations (DONE[peer] >= OPS; the previous kernel on each rank may have used another
    protocol or row layout). Returns (OPS, ok), after a barrier (every thread's stores follow the wait)."""
    ops = tl.load(ctrl + ops_word)
    ok = wait_at_least(ctrl + done_word + lanes, ops, peers, lanes, timeout_ns, status_ptr, WAIT_FREE)
    tl.debug_barrier()
    return ops, ok


@triton.jit
def end_operation(ctrl, ops_word, done_word, ticket_word, peer_bases, rank, peers, ops):
    """The end of every program of a normal-mode kernel: the last one sets OPS = ops + 1 and publishes
    DONE[rank] = ops + 1 in every peer's buffer (release: every program's reads of this buffer came first)."""
    if is_last_program(ctrl + ticket_word):
        tl.store(ctrl + ops_word, ops + 1)
        tl.atomic_xchg((peer_bases + (done_word + rank) * 8).to(tl.pointer_type(tl.int64)), ops + 1, mask=peers,
                       sem="release", scope="sys")
