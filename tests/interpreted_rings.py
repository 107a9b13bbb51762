"""The NVLink rings protocol's waits under Triton's CPU interpreter (run by test_nvlink_interpreted.py with
TRITON_INTERPRET=1 set): once a wait of the Buffer has timed out (status[0] set), every later wait gives up
after STALE_NS instead of its whole timeout, so that work queued behind a timeout, or a CUDA graph replayed
without a host check, ends quickly. Rank 0 of 2 runs alone with status[0] set and a timeout of 60 s; rank 1
never sends rows (dispatch: the receiving program waits for them) and never frees ring slots (combine: the
sending program waits for room). Each kernel must end within a fraction of the timeout. Prints "ok", or what
took too long."""
import sys
import time
from typing import List

import torch

from deep_ep.transport.nvlink.header import CMAX, Header
from deep_ep.transport.nvlink.combine import combine_kernel
from deep_ep.transport.nvlink.dispatch import dispatch_kernel

R, C, RANK, T, H = 2, 1, 0, 4, 64
TIMEOUT_S = 60.0
LIMIT_S = 20.0   # a third of TIMEOUT_S: room for the interpreter's slow polls, far below the timeout
WAIT_ROWS = 2    # sync.WAIT_ROWS: the code of the earlier timeout


def setting():
    """Both ranks' areas (header, then 64 KiB of rings), the peer table, and rank 0's status with an earlier
    timeout recorded."""
    words = Header.for_ranks(R)
    areas = [torch.zeros(words.ring_word * 4 + (1 << 16), dtype=torch.uint8) for _ in range(R)]
    bases = torch.tensor([a.data_ptr() for a in areas], dtype=torch.int64)
    status = torch.zeros(4 + R, dtype=torch.int32)
    status[0], status[1] = WAIT_ROWS, 1
    return words, areas, bases, status


def routing():
    """Every token of each rank goes to both ranks: in_rank, the per-rank positions, and T rows per (rank,
    channel) each way."""
    in_rank = torch.ones(T, R, dtype=torch.int8)
    before = torch.cat([torch.zeros(1, R, dtype=torch.int32), in_rank.int().cumsum(0).int()])
    counts = torch.full((R, C), T, dtype=torch.int32)
    bases = torch.tensor([[0], [T]], dtype=torch.int32)
    prefix = torch.tensor([0, T, 2 * T], dtype=torch.int32)
    return in_rank, before, counts, bases, prefix


def run_dispatch() -> float:
    words, areas, bases, status = setting()
    in_rank, before, counts, recv_base, prefix = routing()
    xw = H // 2                      # int32 words of a bf16 row
    slot_words = (xw + 1 + 3) // 4 * 4
    ring_words = (areas[0].numel() // 4 - words.ring_word) // (R * C) // 4 * 4
    x = torch.randn(T, H).to(torch.bfloat16).view(torch.int32)
    out_x = torch.zeros(2 * T, xw, dtype=torch.int32)
    out_src = torch.zeros(2 * T, dtype=torch.int32)
    unused = torch.zeros(1, dtype=torch.int32)
    start = time.monotonic()
    dispatch_kernel[(2 * C,)](
        x, unused, unused, unused, in_rank, before, counts, recv_base, prefix, out_x, unused, unused, unused, out_src,
        bases, status, T, 2 * T, RANK, 0, 1, words.tail_word, words.head_word, words.sent_word,
        words.recvd_word, words.ops_word, words.done_word, words.ticket_word, words.ring_word,
        ring_words, slot_words, ring_words // slot_words, 8, int(TIMEOUT_S * 1e9), C=C, CMAX=CMAX, R=R, XW=xw, SW=0,
        K=0, HAS_W=False, ID_OFF=xw, BLOCK_X=xw, BLOCK_S=1, BLOCK_K=1, BLOCK_R=R, ROWS=4)
    return time.monotonic() - start


def run_combine() -> float:
    words, areas, bases, status = setting()
    in_rank, before, counts, recv_base, prefix = routing()
    slot_words = H // 2
    ring_slots = 2                   # fewer than the T rows to return: the sender must wait for room
    x = torch.randn(2 * T, H).to(torch.bfloat16)
    out = torch.zeros(T, H, dtype=torch.bfloat16)
    unused = torch.zeros(1, dtype=torch.float32)
    start = time.monotonic()
    combine_kernel[(2 * C,)](
        x, unused, in_rank, before, counts, recv_base, prefix, unused, unused, out, unused, bases, status, T, 2 * T,
        RANK, words.tail_word, words.head_word, words.sent_word, words.recvd_word, words.ops_word,
        words.done_word, words.ticket_word, words.ring_word, slot_words * ring_slots, slot_words, ring_slots,
        2, int(TIMEOUT_S * 1e9), C=C, CMAX=CMAX, R=R, H=H, K=0, X_OFF=0, HAS_BIAS0=False, HAS_BIAS1=False,
        BLOCK_H=H, BLOCK_K=1, BLOCK_R=R, ROWS=4)
    return time.monotonic() - start


if __name__ == "__main__":
    failures: List[str] = []
    for name, run in (("dispatch receive waiting for rows", run_dispatch),
                      ("combine send waiting for ring room", run_combine)):
        took = run()
        if took > LIMIT_S:
            failures.append(f"{name}: {took:.1f} s after an earlier timeout (timeout {TIMEOUT_S:g} s)")
    print("\n".join(failures) if failures else "ok")
    sys.exit(1 if failures else 0)
