"""Where the normal mode's counters, notify records and rows sit in a rank's NVLink buffer.

Every rank's buffer has the same layout, so a kernel finds a peer's counter at the peer's base address plus
the same offset as its own. One table lists the regions in order; offsets and the total size both come from
it, by advancing a cursor through the buffer:

  counters (int64): NOTIFY[R] | TAIL[R][CMAX] | HEAD[R][CMAX] | SENT[R][CMAX] | RECVD[R][CMAX] |
                    ARRIVE[R][2 CMAX] | DONE[R] | OPS | TICKET
  records (int32):  [2][R][record_max]      (notify.py: two tables used alternately)
  rows:             the Buffer's num_nvl_bytes (rings, or the direct protocol's slots)

Regions start on 256-byte boundaries where the table says so. The kernels take counter positions in int64
words and record and row positions in int32 words, as the fields below give them.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...config import _round_up

CMAX = 64                      # most channels (num_sms / 2) an operation may use
MAX_EXPERTS_PER_RANK = 1024
_REGION_ALIGN = 256


def record_max(num_ranks: int) -> int:
    """int32 words of one notify record: signature, flags, R tokens per destination, the tokens per expert
    of the receiving rank, C tokens per channel (notify.py)."""
    return 2 + num_ranks + MAX_EXPERTS_PER_RANK + CMAX


def _counter_regions(num_ranks: int):
    """(name, int64 words) of the counters, in buffer order."""
    R = num_ranks
    return (("notify", R), ("tail", R * CMAX), ("head", R * CMAX), ("sent", R * CMAX), ("recvd", R * CMAX),
            ("arrive", 2 * R * CMAX), ("done", R), ("ops", 1), ("ticket", 1))


@dataclass(frozen=True)
class Header:
    """Positions in the NVLink buffer: counters in int64 words, records and rows in int32 words."""
    notify_word: int
    tail_word: int
    head_word: int
    sent_word: int
    recvd_word: int
    arrive_word: int
    done_word: int
    ops_word: int
    ticket_word: int
    record_word: int
    record_max: int
    ring_word: int

    @classmethod
    def for_ranks(cls, num_ranks: int) -> "Header":
        cursor, words = 0, {}
        for name, size in _counter_regions(num_ranks):
            words[f"{name}_word"] = cursor // 8
            cursor += size * 8
        cursor = _round_up(cursor, _REGION_ALIGN)
        words["record_word"] = cursor // 4
        records = record_max(num_ranks)
        cursor = _round_up(cursor + 2 * num_ranks * records * 4, _REGION_ALIGN)
        return cls(**words, record_max=records, ring_word=cursor // 4)

    @property
    def nbytes(self) -> int:
        """Bytes before the rows."""
        return self.ring_word * 4
