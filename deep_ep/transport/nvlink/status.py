"""The status words that the NVLink kernels write for the host: their codes, their layout and their errors.

One pinned int32 tensor per Buffer, shared by every kernel of its transport (normal and low-latency):
  [0] TIMEOUT: the code of the first wait that gave up (0: none);  [1] its peer;
  [2] BAD_INPUT: the code of the first bad input a low-latency kernel saw (0: none);  [3] its value;
  [4 + r] why shrink mode masked rank r (a wait code, or MASKED_BY_PEER; 0: not masked).
Kernels set a code with a compare-and-swap from 0, so the first report wins; the host reads the words
without a wait (pinned memory) at the start of each call (StatusWords) and raises or warns with the messages
below.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton.language as tl

from ...checks import too_many_rows_message
from ...group import CommTimeoutError, Group, warn_caller

# wait codes (TIMEOUT, and the per-rank mask words); each names what the rank waited for
WAIT_NOTIFY = tl.constexpr(1)
WAIT_ROWS = tl.constexpr(2)
WAIT_SPACE = tl.constexpr(3)
WAIT_LL_DISPATCH = tl.constexpr(4)
WAIT_LL_COMBINE = tl.constexpr(5)
WAIT_LL_FREE = tl.constexpr(6)
WAIT_FREE = tl.constexpr(7)
MASKED_BY_PEER = tl.constexpr(8)   # (mask words only: that rank had gone on without this one)
NO_PEER = tl.constexpr(1 << 30)    # a peer index that no rank has (the minimum over ranks that did not wait)

# bad-input codes (BAD_INPUT)
BAD_IDS = tl.constexpr(1)          # an expert id outside [-1, E)
TOO_MANY_ROWS = tl.constexpr(2)    # a local expert sent more rows than its R * N (an expert listed several times)

# positions of the words
TIMEOUT, TIMEOUT_PEER, BAD_INPUT, BAD_INPUT_VALUE, MASKS = 0, 1, 2, 3, 4

_WAITED_FOR = {
    WAIT_NOTIFY.value: "its dispatch counts (notify)",
    WAIT_ROWS.value: "its rows",
    WAIT_SPACE.value: "it to read the rows already in its receive ring (ring slots to free up)",
    WAIT_LL_DISPATCH.value: "its low-latency dispatch rows",
    WAIT_LL_COMBINE.value: "its low-latency combine rows",
    WAIT_LL_FREE.value: "it to finish receiving the previous low-latency call on the same buffer half",
    WAIT_FREE.value: "it to finish reading the previous operation out of its buffer",
}


def waited_for(code: int) -> str:
    """What a wait with `code` waited for, as the object of "waited for rank r to send ..."."""
    return _WAITED_FOR.get(code, "a signal")


def timeout_error_message(rank: int, peer: int, code: int, timeout_s: float) -> str:
    """The error of a wait (code, peer) that gave up after `timeout_s`."""
    return (f"rank {rank}: waited more than {timeout_s:g} s for rank {peer} to send {waited_for(code)}; this Buffer "
            "cannot be used any more")


def mask_warning(rank: int, peer: int, code: int, timeout_s: float) -> str:
    """The warning for a rank that shrink mode masked with mask word `code`."""
    if code == MASKED_BY_PEER.value:
        why = "finding that it had gone on without this rank (it had masked this rank)"
    else:
        why = f"waiting more than {timeout_s:g} s for {waited_for(code)}"
    return f"deep_ep: rank {rank} masked rank {peer} after {why} (enable_shrink)"


def bad_input_error(rank: int, code: int, value: int) -> Optional[ValueError]:
    """The error for bad input a low-latency kernel reported (None for code 0)."""
    if code == 0:
        return None
    if code == TOO_MANY_ROWS.value:
        return ValueError(too_many_rows_message(rank, value, "checked on the GPU; the rows past that were not written"))
    return ValueError(f"topk_idx of an earlier low-latency call on rank {rank}: entries must be -1 or in "
                      f"[0, num_experts), found {value} (checked on the GPU; those entries were treated as no "
                      "selection)")


class StatusWords:
    """A Buffer's status words in pinned host memory, and the errors and warnings they hold."""

    def __init__(self, group: Group, timeout_ns: int) -> None:
        self.group, self.rank, self.timeout_ns = group, group.rank, timeout_ns
        self.tensor = torch.zeros(MASKS + group.size, dtype=torch.int32, device="cpu")
        if torch.cuda.is_available():   # (kernels write it; the transport only runs on CUDA devices)
            self.tensor = self.tensor.pin_memory()
        self._words = self.tensor.numpy()   # (the same memory, read without torch's per-call overhead)

    def raise_timeout(self) -> None:
        """CommTimeoutError if a wait of a kernel gave up; the group is then marked broken."""
        code = int(self._words[TIMEOUT])
        if code:
            peer = int(self._words[TIMEOUT_PEER])
            self.group.mark_broken(f"a GPU wait for rank {peer}")
            raise CommTimeoutError(timeout_error_message(self.rank, peer, code, self.timeout_ns / 1e9))

    def mark_broken_after_timeout(self) -> None:
        """After the GPU's work is done: a wait that gave up after the last call leaves the ranks out of step."""
        if self._words[TIMEOUT]:
            self.group.mark_broken(f"a GPU wait for rank {int(self._words[TIMEOUT_PEER])}")

    def report_low_latency(self, warn_masked: bool) -> None:
        """Warn about ranks masked since the last call (shrink mode, where `warn_masked`), then raise the bad
        input an earlier low-latency kernel saw."""
        words = self._words
        if warn_masked:
            for peer in words[MASKS:].nonzero()[0].tolist():
                code = int(words[MASKS + peer])
                words[MASKS + peer] = 0
                warn_caller(mask_warning(self.rank, peer, code, self.timeout_ns / 1e9))
        if words[BAD_INPUT]:
            error = bad_input_error(self.rank, int(words[BAD_INPUT]), int(words[BAD_INPUT_VALUE]))
            words[BAD_INPUT] = 0
            raise error
