"""The counts of a non-cached dispatch, from the GPU straight into pinned host memory.

Protocol (one mailbox per NVLink transport, pinned int64 words: [ticket | payload]):
  the host numbers every dispatch that waits for its counts (tickets 1, 2, ...) and passes the number to the
  plan kernel (plan.py); the kernel writes the payload into the mailbox, makes the writes visible to the host
  (barrier, system-scope fence) and then stores the ticket with a system-scope release. The host spins on the
  ticket word and reads the payload once it holds this call's number (x86 and Arm hosts read the words in
  order after the ticket). A dispatch that does not wait (num_worst_tokens, or inside a CUDA graph) passes
  ticket 0 and its kernel writes nothing here.
Only one dispatch waits at a time (the host reads its payload before it queues anything else), so one mailbox
serves them all. Against a device-to-host copy and a stream synchronisation this saves the copy, the host
tensor it fills and the wake-up of a blocked synchronisation: the host sees the counts as the kernel writes them.
"""
from __future__ import annotations

import time
from typing import List

import torch

from ...group import CommTimeoutError, Group
from .status import StatusWords

SPINS_PER_CLOCK_READ = 256   # reads of the ticket word between looks at the clock and the status words


def payload_words(num_ranks: int, experts_per_rank: int) -> int:
    """int64 words of a payload: [rows received | per local expert, aligned | signatures (R) | flags (R) |
    checks (4) | most rows any rank receives | most rows any rank sends]."""
    return 1 + experts_per_rank + 2 * num_ranks + 6


class CountsMailbox:
    """A transport's mailbox for the counts of its non-cached dispatches (see the module's protocol)."""

    def __init__(self, group: Group, status: StatusWords, max_payload_words: int) -> None:
        self.group, self.status = group, status
        self.tensor = torch.zeros(1 + max_payload_words, dtype=torch.int64)
        if torch.cuda.is_available():   # (kernels write it; without CUDA the interpreter writes host memory)
            self.tensor = self.tensor.pin_memory()
        self._words = self.tensor.numpy()   # (the same memory, read without torch's per-call overhead)
        self._last_ticket = 0

    def next_ticket(self) -> int:
        """The number of the next dispatch that waits for its counts."""
        self._last_ticket += 1
        return self._last_ticket

    def wait(self, ticket: int, num_words: int, timeout_s: float) -> List[int]:
        """The first `num_words` payload words of dispatch `ticket`, once its plan kernel wrote them. A kernel
        wait that gave up meanwhile raises its CommTimeoutError; a ticket that does not come within twice
        `timeout_s` raises one naming this rank and the counts (the GPU did not reach the dispatch: earlier
        work on its stream still runs; twice, so that the notify kernel's own wait, bounded by `timeout_s` from
        when the GPU reaches it, reports a peer that does not come first)."""
        words = self._words
        if words[0] != ticket:
            self._spin(ticket, timeout_s)
        return words[1:1 + num_words].tolist()

    def _spin(self, ticket: int, timeout_s: float) -> None:
        words = self._words
        deadline = time.monotonic() + 2 * timeout_s
        while True:
            for _ in range(SPINS_PER_CLOCK_READ):
                if words[0] == ticket:
                    return
            self.status.raise_timeout()
            if time.monotonic() > deadline:
                self.group.mark_broken("the wait for a dispatch's counts")
                raise CommTimeoutError(
                    f"rank {self.group.rank}: waited more than {2 * timeout_s:g} s for the received counts of a "
                    "dispatch (its plan kernel had not run: earlier work queued on its stream did not finish); "
                    "this Buffer cannot be used any more")
