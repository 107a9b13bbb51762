"""The host side of the counts mailbox (deep_ep/transport/nvlink/mailbox.py): the host takes only its own
dispatch's ticket, reads the payload written before it, reports a GPU wait that gave up, and gives up itself
after twice the timeout naming the rank and the counts. The kernel side runs in test_nvlink_interpreted.py (every
non-cached dispatch there waits on the mailbox) and on GPUs in test_nvlink.py."""
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from deep_ep.group import CommTimeoutError
from deep_ep.transport.nvlink.mailbox import Counts, CountsMailbox
from deep_ep.transport.nvlink.status import TIMEOUT, TIMEOUT_PEER, StatusWords


R, E_LOC = 2, 3   # payloads of Counts.words(R, E_LOC) words


def _mailbox(rank: int = 1):
    broken = []
    group = SimpleNamespace(rank=rank, size=R, mark_broken=broken.append)
    status = StatusWords(group, 10 ** 9)
    return CountsMailbox(status, 16), status, broken


def _post(mailbox: CountsMailbox, ticket: int, payload) -> None:
    """What the notify kernel's last program does: the payload, then the ticket."""
    mailbox.tensor[1:1 + len(payload)] = torch.tensor(payload, dtype=torch.int64)
    mailbox.tensor[0] = ticket


def _payload():
    """Random words of a payload, and the Counts they decode to."""
    words = torch.randint(-2 ** 40, 2 ** 40, (Counts.words(R, E_LOC),)).tolist()
    tail = words[1 + E_LOC + 2 * R:]
    expected = Counts(words[0], words[1:1 + E_LOC], words[1 + E_LOC:1 + E_LOC + R],
                      words[1 + E_LOC + R:1 + E_LOC + 2 * R], *tail[1:])
    return words, expected


def test_counts_words_and_fields_follow_the_kernels_layout():
    assert Counts.words(num_ranks=4, experts_per_rank=8) == 1 + 8 + 2 * 4 + 6
    words = list(range(100, 100 + Counts.words(R, E_LOC)))
    counts = Counts.decode(words, R, E_LOC)
    assert counts.num_recv == 100 and counts.aligned == [101, 102, 103]
    assert counts.signatures == [104, 105] and counts.flags == [106, 107]
    # (word 108: this rank's own flags, which flags[rank] holds too)
    assert (counts.low, counts.high, counts.layout_value, counts.max_recv_rows, counts.max_send_rows) == \
        (109, 110, 111, 112, 113)


def test_wait_returns_the_payload_of_its_own_ticket():
    mailbox, _, broken = _mailbox()
    first, second = mailbox.next_ticket(), mailbox.next_ticket()
    assert (first, second) == (1, 2)
    words, expected = _payload()
    _post(mailbox, second, words)
    assert mailbox.wait(second, R, E_LOC, timeout_s=1.0) == expected
    assert not broken


def test_wait_spins_until_the_ticket_comes():
    mailbox, _, _ = _mailbox()
    earlier, ticket = mailbox.next_ticket(), mailbox.next_ticket()
    _post(mailbox, earlier, _payload()[0])
    words, expected = _payload()
    writer = threading.Timer(0.05, _post, (mailbox, ticket, words))
    writer.start()
    start = time.monotonic()
    try:
        assert mailbox.wait(ticket, R, E_LOC, timeout_s=5.0) == expected
    finally:
        writer.join()
    assert time.monotonic() - start >= 0.04


def test_wait_without_the_ticket_gives_up_naming_rank_and_counts():
    mailbox, _, broken = _mailbox(rank=1)
    _post(mailbox, 4, _payload()[0])   # the previous dispatch's ticket is not this one's
    start = time.monotonic()
    with pytest.raises(CommTimeoutError, match=r"rank 1: waited more than 0.2 s for the received counts"):
        mailbox.wait(5, R, E_LOC, timeout_s=0.1)
    assert 0.2 <= time.monotonic() - start < 5
    assert broken == ["the wait for a dispatch's counts"]


def test_wait_reports_a_gpu_wait_that_gave_up():
    mailbox, status, broken = _mailbox(rank=1)
    status.tensor[TIMEOUT], status.tensor[TIMEOUT_PEER] = 1, 0   # WAIT_NOTIFY on rank 0
    with pytest.raises(CommTimeoutError, match=r"rank 1: waited more than 1 s for rank 0 to send its dispatch counts"):
        mailbox.wait(1, R, E_LOC, timeout_s=30.0)
    assert broken == ["a GPU wait for rank 0"]
