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
from deep_ep.transport.nvlink.mailbox import CountsMailbox, payload_words
from deep_ep.transport.nvlink.status import TIMEOUT, TIMEOUT_PEER, StatusWords


def _mailbox(rank: int = 3, words: int = 16):
    broken = []
    group = SimpleNamespace(rank=rank, size=4, mark_broken=broken.append)
    status = StatusWords(group, 10 ** 9)
    return CountsMailbox(group, status, words), status, broken


def _post(mailbox: CountsMailbox, ticket: int, payload) -> None:
    """What the plan kernel does: the payload, then the ticket."""
    mailbox.tensor[1:1 + len(payload)] = torch.tensor(payload, dtype=torch.int64)
    mailbox.tensor[0] = ticket


def test_payload_words_matches_the_layout():
    assert payload_words(num_ranks=4, experts_per_rank=8) == 1 + 8 + 2 * 4 + 6


def test_wait_returns_the_payload_of_its_own_ticket():
    mailbox, _, broken = _mailbox()
    first, second = mailbox.next_ticket(), mailbox.next_ticket()
    assert (first, second) == (1, 2)
    payload = torch.randint(-2 ** 40, 2 ** 40, (7,)).tolist()
    _post(mailbox, second, payload)
    assert mailbox.wait(second, 7, timeout_s=1.0) == payload
    assert mailbox.wait(second, 3, timeout_s=1.0) == payload[:3]
    assert not broken


def test_wait_spins_until_the_ticket_comes():
    mailbox, _, _ = _mailbox()
    _post(mailbox, 1, [5, 6])   # an earlier dispatch's
    ticket = mailbox.next_ticket() + 1
    payload = torch.randint(0, 1000, (5,)).tolist()
    writer = threading.Timer(0.05, _post, (mailbox, ticket, payload))
    writer.start()
    start = time.monotonic()
    try:
        assert mailbox.wait(ticket, 5, timeout_s=5.0) == payload
    finally:
        writer.join()
    assert time.monotonic() - start >= 0.04


def test_wait_without_the_ticket_gives_up_naming_rank_and_counts():
    mailbox, _, broken = _mailbox(rank=3)
    _post(mailbox, 4, [1, 2, 3])   # the previous dispatch's ticket is not this one's
    start = time.monotonic()
    with pytest.raises(CommTimeoutError, match=r"rank 3: waited more than 0.2 s for the received counts"):
        mailbox.wait(5, 3, timeout_s=0.1)
    assert 0.2 <= time.monotonic() - start < 5
    assert broken == ["the wait for a dispatch's counts"]


def test_wait_reports_a_gpu_wait_that_gave_up():
    mailbox, status, broken = _mailbox(rank=1)
    status.tensor[TIMEOUT], status.tensor[TIMEOUT_PEER] = 1, 2   # WAIT_NOTIFY on rank 2
    with pytest.raises(CommTimeoutError, match=r"rank 1: waited more than 1 s for rank 2 to send its dispatch counts"):
        mailbox.wait(1, 3, timeout_s=30.0)
    assert broken == ["a GPU wait for rank 2"]
