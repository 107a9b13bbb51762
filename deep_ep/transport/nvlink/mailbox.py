"""The counts of a non-cached dispatch, from the GPU straight into pinned host memory.

Protocol (one mailbox per NVLink transport, pinned int64 words: [ticket | payload (Counts)]):
  the host numbers every dispatch that waits for its counts (tickets 1, 2, ...) and passes the number to the
  notify kernel (notify.py), whose last program computes the plan (plan.plan_tables), writes the payload into
  the mailbox, then (after a CTA barrier) stores the ticket with a system-scope release. The host spins on
  the ticket word and reads the payload once it holds this call's number. A dispatch that does not wait
  (num_worst_tokens: the only non-cached dispatch a CUDA graph may capture) passes ticket 0 and the kernel
  writes nothing here.
The host reads the ticket, then the payload, in two separate reads from Python: x86 keeps loads in order; an
Arm host may reorder loads only within a window far shorter than the interpreter's work between the two.
Only one dispatch waits at a time (the host reads its payload before it queues anything else), so one mailbox
serves them all. Against a device-to-host copy and a stream synchronisation this saves the copy, the host
tensor it fills and the wake-up of a blocked synchronisation: the host sees the counts as the kernel writes them.
"""
from __future__ import annotations

import time
from typing import List, NamedTuple

import torch

from ...group import CommTimeoutError
from .status import StatusWords

SPINS_PER_LOOK = 256   # reads of the ticket word between looks at the clock and the status words (~20-50 us)
_ABANDONED: List[torch.Tensor] = []   # mailboxes given up on: kernels still queued may write them


class Counts(NamedTuple):
    """A dispatch's payload, as plan.plan_tables writes it (int64 words in this order)."""
    num_recv: int           # rows this rank receives
    aligned: List[int]      # per local expert, rounded up to expert_alignment
    signatures: List[int]   # per rank: its call's signature
    flags: List[int]        # per rank: its check flags (plan.py's prepare_kernel)
    low: int                # smallest top-k id of this rank
    high: int               # largest top-k id of this rank
    layout_value: int       # an out-of-range id an earlier layout saw
    max_recv_rows: int      # most rows any rank receives
    max_send_rows: int      # most rows any rank sends

    @staticmethod
    def words(num_ranks: int, experts_per_rank: int) -> int:
        """int64 words of a payload."""
        return 1 + experts_per_rank + 2 * num_ranks + 6

    @classmethod
    def decode(cls, words: List[int], num_ranks: int, experts_per_rank: int) -> "Counts":
        E, R = experts_per_rank, num_ranks
        tail = words[1 + E + 2 * R:]   # (own flags, low, high, layout value, most received, most sent)
        return cls(words[0], words[1:1 + E], words[1 + E:1 + E + R], words[1 + E + R:1 + E + 2 * R], *tail[1:6])


class CountsMailbox:
    """A transport's mailbox for the counts of its non-cached dispatches (see the module's protocol)."""

    def __init__(self, status: StatusWords, max_payload_words: int) -> None:
        self.status = status
        self.tensor = torch.zeros(1 + max_payload_words, dtype=torch.int64)
        if torch.cuda.is_available():   # (kernels write it; without CUDA the interpreter writes host memory)
            self.tensor = self.tensor.pin_memory()
        self._words = self.tensor.numpy()   # (the same memory, read without torch's per-call overhead)
        self._last_ticket = 0

    def next_ticket(self) -> int:
        """The number of the next dispatch that waits for its counts."""
        self._last_ticket += 1
        return self._last_ticket

    def wait(self, ticket: int, num_ranks: int, experts_per_rank: int, timeout_s: float) -> Counts:
        """The counts of dispatch `ticket`, once its notify kernel wrote them. A kernel wait that gave up meanwhile
        raises its CommTimeoutError; a ticket that does not come within twice `timeout_s` raises one naming
        this rank and the counts (the GPU did not reach the dispatch: earlier work on its stream still runs;
        twice, so that the notify kernel's own wait, bounded by `timeout_s` from when the GPU reaches it,
        reports a peer that does not come first)."""
        if self._words[0] != ticket:
            self._spin(ticket, timeout_s)
        words = self._words[1:1 + Counts.words(num_ranks, experts_per_rank)].tolist()
        return Counts.decode(words, num_ranks, experts_per_rank)

    def _spin(self, ticket: int, timeout_s: float) -> None:
        words = self._words
        deadline = time.monotonic() + 2 * timeout_s
        while True:
            for _ in range(SPINS_PER_LOOK):
                if words[0] == ticket:
                    return
            self.status.raise_timeout()
            if time.monotonic() > deadline:
                _ABANDONED.append(self.tensor)
                self.status.group.mark_broken("the wait for a dispatch's counts")
                raise CommTimeoutError(
                    f"rank {self.status.rank}: waited more than {2 * timeout_s:g} s for the received counts of a "
                    "dispatch (its notify kernel had not finished: earlier work queued on its stream did not finish); "
                    "this Buffer cannot be used any more")
            time.sleep(0)   # (lets other Python threads run: the spin holds the GIL)
