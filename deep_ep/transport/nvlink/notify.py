"""Dispatch notify: every rank learns each source's counts for this dispatch.

Buffers: each rank's notify area holds two record tables (int32 [2][R][STRIDE]), used alternately by
successive notifies (parity of the notify epoch e, a device counter advanced by every non-cached dispatch).
Protocol (one program per peer d): program d of rank s stores s's record for d into table e % 2, row s, of
d's notify area, fences, and raises d's NOTIFY[s] to e. Then it waits until this rank's NOTIFY[d] reaches e
and copies row d of its own table e % 2 into `received[d]`.
Reuse: rank s writes table e % 2 again at notify e + 2, after its notify e + 1 saw NOTIFY[d] >= e + 1, which
d raised after it had read table e % 2 in notify e; so a row is never overwritten before it is read.
Then every program takes a ticket (sync.is_last_program, on this rank's TICKET counter, which the normal-mode
kernels on the same stream use in turn); the last one, which sees every copied record, computes the
dispatch's plan and posts its counts to the host (plan.plan_tables): one launch for the notify and the plan.
"""
import triton
import triton.language as tl

from .intrinsics import fence_sys
from .plan import plan_tables
from .sync import is_last_program, wait_at_least
from .status import WAIT_NOTIFY


@triton.jit(do_not_specialize=["counts_ticket"])   # (one compiled kernel for every ticket)
def notify_kernel(colsum_ptr, per_expert_ptr, channel_counts_ptr, signature, received_ptr, prefix_ptr, recv_count_ptr,
                  recv_base_ptr, rank_prefix_ptr, channel_prefix_ptr, recv_channel_prefix_ptr, push_row0_ptr,
                  combine_row0_ptr, counts_ticket, expert_alignment, mismatch_ptr, checks_ptr, mailbox_ptr, bases_ptr,
                  notify_flag_word, notify_word, ticket_word, epoch_ptr, status_ptr, rank, timeout_ns,
                  experts_per_rank, C: tl.constexpr, R: tl.constexpr, REC: tl.constexpr, STRIDE: tl.constexpr,
                  BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr):
    """Record for d: [signature of the call's shapes | flags of invalid input (plan.prepare_kernel) | tokens
    per destination (R) | tokens per expert of d | tokens for d per channel (C)]. Rows of the tables are
    STRIDE apart and start with the signature, so ranks that disagree on the shapes still read each
    other's signatures. `counts_ticket`: the host's mailbox ticket (0: the host does not wait)."""
    dest = tl.program_id(0)
    epoch = tl.load(epoch_ptr)
    table = notify_word + (epoch % 2) * R * STRIDE
    offs = tl.arange(0, BLOCK)
    in_record = offs < REC
    r = offs - 2
    values = tl.load(colsum_ptr + r, mask=(r >= 0) & (r < R), other=0)
    e = r - R
    is_expert = (e >= 0) & (e < experts_per_rank)
    values = tl.where(is_expert, tl.load(per_expert_ptr + dest * experts_per_rank + e, mask=is_expert, other=0), values)
    c = e - experts_per_rank
    is_channel = (c >= 0) & (c < C)
    values = tl.where(is_channel, tl.load(channel_counts_ptr + dest * C + c, mask=is_channel, other=0), values)
    ro = tl.arange(0, BLOCK_R)
    mismatched = tl.sum(tl.load(mismatch_ptr + ro, mask=ro < R, other=0), axis=0) > 0
    flags = tl.load(checks_ptr) | 4 * mismatched.to(tl.int64)
    values = tl.where(offs == 0, signature, values)
    values = tl.where(offs == 1, flags.to(tl.int32), values)
    peer = tl.load(bases_ptr + dest)
    tl.store(peer.to(tl.pointer_type(tl.int32)) + table + rank * STRIDE + offs, values, mask=in_record)
    tl.debug_barrier()
    fence_sys()
    tl.atomic_xchg(peer.to(tl.pointer_type(tl.int64)) + notify_flag_word + rank, epoch, sem="release", scope="sys")
    own = tl.load(bases_ptr + rank)
    lane = tl.arange(0, 1)
    ok = wait_at_least(own.to(tl.pointer_type(tl.int64)) + notify_flag_word + dest + lane, epoch + lane, lane == 0,
                       dest + lane, timeout_ns, status_ptr, WAIT_NOTIFY)
    if ok:
        tl.debug_barrier()
        got = tl.load(own.to(tl.pointer_type(tl.int32)) + table + dest * STRIDE + offs, mask=in_record, volatile=True)
        tl.store(received_ptr + dest * REC + offs, got, mask=in_record)
    # (a program whose wait gave up takes its ticket too: the plan then runs on what arrived, and the host,
    # which reads the status words once it has the counts, raises the timeout)
    if is_last_program(own.to(tl.pointer_type(tl.int64)) + ticket_word):
        plan_tables(received_ptr, channel_counts_ptr, prefix_ptr, recv_count_ptr, recv_base_ptr, rank_prefix_ptr,
                    channel_prefix_ptr, recv_channel_prefix_ptr, push_row0_ptr, combine_row0_ptr, mailbox_ptr,
                    checks_ptr, counts_ticket, rank, experts_per_rank, expert_alignment, REC, R, C, BLOCK_R, BLOCK_C,
                    BLOCK_E)
