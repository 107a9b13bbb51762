"""Dispatch notify: every rank learns each source's counts for this dispatch.

Protocol (epoch e, one program per peer d): program d of rank s stores s's record for d (int32[REC]:
its token count, its tokens for d, its counts per expert of d, per channel, ...) into row s of d's notify
area, fences, and raises d's NOTIFY flag slot s to e. Then program d waits until this rank's own NOTIFY
slot d reaches e and copies row d of its own notify area into `received[d]`.
Reuse: a rank starts its next notify only after its previous operation's data phase, which waited for
every peer to finish reading, so a row is never overwritten before it is read.
"""
import triton
import triton.language as tl

from .sync import WAIT_NOTIFY, fence_sys, wait_flag


@triton.jit
def notify_kernel(records_ptr, received_ptr, bases_ptr, notify_flag_word, notify_word, epoch_ptr, status_ptr,
                  rank, timeout_ns, REC: tl.constexpr, BLOCK: tl.constexpr):
    dest = tl.program_id(0)
    epoch = tl.load(epoch_ptr)
    offs = tl.arange(0, BLOCK)
    in_record = offs < REC
    values = tl.load(records_ptr + dest * REC + offs, mask=in_record)
    peer = tl.load(bases_ptr + dest)
    tl.store(peer.to(tl.pointer_type(tl.int32)) + notify_word + rank * REC + offs, values, mask=in_record)
    fence_sys()
    tl.debug_barrier()
    tl.atomic_xchg(peer.to(tl.pointer_type(tl.int64)) + notify_flag_word + rank, epoch, sem="release", scope="sys")
    own = tl.load(bases_ptr + rank)
    if wait_flag(own.to(tl.pointer_type(tl.int64)) + notify_flag_word + dest, epoch, timeout_ns, status_ptr,
                 WAIT_NOTIFY, dest):
        tl.debug_barrier()
        got = tl.load(own.to(tl.pointer_type(tl.int32)) + notify_word + dest * REC + offs, mask=in_record,
                      volatile=True)
        tl.store(received_ptr + dest * REC + offs, got, mask=in_record)
