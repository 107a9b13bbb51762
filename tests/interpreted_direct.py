"""The NVLink direct protocol's bound on the outputs, under Triton's CPU interpreter (run by
test_nvlink_interpreted.py with TRITON_INTERPRET=1 set). A num_worst_tokens dispatch may receive more rows
than its outputs hold; the transport serves such a dispatch and its handle with the rings, but the direct
kernels must keep within the outputs on their own too: received rows from `num_rows` on are dropped, and the
combine returns zeros for them instead of reading past `x`.

2 ranks, 1 channel; each rank sends its 3 tokens to rank 0 only, which holds 4 rows (num_worst_tokens = 4)
of the 6 that arrive. Rank 0 runs alone: rank 1's rows, and its word saying they have arrived, are put in
rank 0's buffer beforehand. Prints "ok", or what went wrong."""
import sys
from typing import List

import torch

from deep_ep.transport.nvlink.header import CMAX, Header
from deep_ep.transport.nvlink.normal import plan_from_handle
from deep_ep.transport.nvlink.direct import direct_combine_kernel, direct_dispatch_kernel

R, C, RANK, T, H = 2, 1, 0, 3, 16
NUM_ROWS = 4                      # num_worst_tokens: rows 4 and 5 of rank 0's received rows do not fit
XW = H // 2                       # int32 words of a bf16 row
CAPACITY = 16                     # slots of the direct protocol
GUARD = -7
TIMEOUT_NS = int(30e9)


def rank0_handle():
    """Rank 0's handle of the dispatch (recv_src_idx has NUM_ROWS rows) and its plan."""
    rank_prefix = torch.tensor([[T, 0], [2 * T, 0]], dtype=torch.int32)
    channel_prefix = torch.tensor([[T], [0]], dtype=torch.int32)
    recv_channel_prefix = torch.zeros(R, C, dtype=torch.int32)
    in_rank = torch.tensor([[True, False]] * T)
    handle = (rank_prefix, channel_prefix, recv_channel_prefix, torch.full((NUM_ROWS,), -1, dtype=torch.int32),
              in_rank, torch.zeros(T, R, dtype=torch.int32))
    return handle, plan_from_handle(handle, RANK, read_shares=False)


def areas(slot_words: int):
    words = Header.for_ranks(R)
    buffers = [torch.zeros(words.ring_word * 4 + CAPACITY * slot_words * 4, dtype=torch.uint8) for _ in range(R)]
    return words, buffers, torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)


def check_dispatch(failures: List[str]) -> None:
    handle, plan = rank0_handle()
    slot_words = (XW + 1 + 3) // 4 * 4          # [row | source token], 16-byte aligned
    words, buffers, bases = areas(slot_words)
    own32, own64 = buffers[0].view(torch.int32), buffers[0].view(torch.int64)
    for token in range(T):                      # rank 1's rows, in the slots of their output rows 3, 4, 5
        slot = words.ring_word + (T + token) * slot_words
        own32[slot:slot + XW] = 1000 + token
        own32[slot + XW] = token
    own64[words.arrive_word + 1 * 2 * CMAX] = T   # rank 1's program 0 has pushed its 3 rows (operation 0)
    x = torch.arange(T * XW, dtype=torch.int32).view(T, XW)
    x_guarded = torch.full((2 * T, XW), GUARD, dtype=torch.int32)
    src_guarded = torch.full((2 * T,), GUARD, dtype=torch.int32)
    out_x, out_src = x_guarded[:NUM_ROWS], src_guarded[:NUM_ROWS]
    status = torch.zeros(4 + R, dtype=torch.int32)
    unused = torch.zeros(4, dtype=torch.int32)
    in_rank = handle[4].view(torch.int8)
    direct_dispatch_kernel[(2 * C,)](
        x, unused, unused, unused, in_rank, plan.before, plan.recv_count, plan.recv_base, plan.prefix,
        plan.push_row0, out_x, unused, unused, unused, out_src, bases, status, T, NUM_ROWS, RANK, 0, 1,
        words.arrive_word, words.ops_word, words.done_word, words.ticket_word, words.ring_word,
        slot_words, CAPACITY, 1 << 30, TIMEOUT_NS, C=C, AMAX=2 * CMAX, R=R, XW=XW, SW=0, K=0, HAS_W=False,
        ID_OFF=XW, BLOCK_X=XW, BLOCK_S=1, BLOCK_K=1, BLOCK_R=R, ROWS=4)
    if status[0]:
        failures.append(f"dispatch: status {status.tolist()} (a wait gave up)")
    expected_x = torch.cat([x, torch.full((1, XW), 1000, dtype=torch.int32)])
    if not torch.equal(out_x, expected_x) or out_src.tolist() != [0, 1, 2, 0]:
        failures.append(f"dispatch: outputs {out_x[:, 0].tolist()} / {out_src.tolist()}, expected rows 0-2 of x "
                        "and rank 1's first row")
    if (x_guarded[NUM_ROWS:] != GUARD).any() or (src_guarded[NUM_ROWS:] != GUARD).any():
        failures.append(f"dispatch: rows past num_rows={NUM_ROWS} written: {src_guarded[NUM_ROWS:].tolist()}")


def check_combine(failures: List[str]) -> None:
    handle, plan = rank0_handle()
    slot_words = (H // 2 + 3) // 4 * 4          # [bf16 row] (no top-k weights)
    words, buffers, bases = areas(slot_words)
    x_guarded = torch.randn(2 * T, H).to(torch.bfloat16)
    x_guarded[NUM_ROWS:] = float("nan")         # what a read past x would return
    x = x_guarded[:NUM_ROWS]
    out = torch.zeros(T, H, dtype=torch.bfloat16)
    status = torch.zeros(4 + R, dtype=torch.int32)
    unused = torch.zeros(4, dtype=torch.float32)
    direct_combine_kernel[(2 * C,)](
        x, unused, handle[4].view(torch.int8), plan.before, plan.recv_count, plan.recv_base, plan.prefix,
        plan.combine_row0, unused, unused, out, unused, bases, status, T, NUM_ROWS, RANK, words.arrive_word,
        words.ops_word, words.done_word, words.ticket_word, words.ring_word, slot_words, CAPACITY,
        1 << 30, TIMEOUT_NS, C=C, AMAX=2 * CMAX, R=R, H=H, K=0, X_OFF=0, HAS_BIAS0=False, HAS_BIAS1=False,
        BLOCK_H=H, BLOCK_K=1, BLOCK_R=R, ROWS=4, REDUCE_ROWS=4)
    if status[0]:
        failures.append(f"combine: status {status.tolist()} (a wait gave up)")
    if not torch.equal(out.view(torch.int16), x[:T].view(torch.int16)):
        failures.append("combine: rank 0's tokens are not its own rows of x")
    # rank 1's slots 0-2 hold the rows of x it sent (rows 3-5): row 3, then zeros for the rows x does not hold
    slots = buffers[1].view(torch.int32)[words.ring_word:].view(CAPACITY, slot_words)[:T, :H // 2]
    returned = slots.contiguous().view(torch.bfloat16)
    expected = torch.cat([x[T:NUM_ROWS], torch.zeros(2 * T - NUM_ROWS, H, dtype=torch.bfloat16)])
    if not torch.equal(returned.view(torch.int16), expected.view(torch.int16)):
        failures.append(f"combine: rows returned to rank 1 {returned[:, 0].tolist()}, expected x's row {T} "
                        "and zeros (not rows read past x)")


if __name__ == "__main__":
    found: List[str] = []
    check_dispatch(found)
    check_combine(found)
    print("\n".join(found) if found else "ok")
    sys.exit(1 if found else 0)
