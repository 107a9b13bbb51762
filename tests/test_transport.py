"""The NVLink transport's eligibility check (`nvlink_fits`) and peer-access set-up, seen from one rank, with the
GPUs and the group stood in for: GPUs are compared by UUID, and every rank's verdict counts."""
from typing import List, Optional, Set, Tuple

import pytest
import torch

import deep_ep.transport as transport
import deep_ep.utils as utils
from deep_ep.group import Topology

pytest.importorskip("triton")


class OneRankOfGroup:
    """This rank's view of a group whose other ranks contribute `others_gpus` and `others_verdicts`."""

    def __init__(self, rank: int, others_gpus: List[str], others_verdicts: Optional[List[int]] = None) -> None:
        self.rank = rank
        self.others_gpus = others_gpus
        self.others_verdicts = others_verdicts if others_verdicts is not None else [1] * len(others_gpus)
        self.gathered_verdicts: Optional[List[int]] = None

    @staticmethod
    def _insert(values: list, rank: int, own) -> list:
        return values[:rank] + [own] + values[rank:]

    def all_gather_object(self, obj, what: str) -> list:
        return self._insert(self.others_gpus, self.rank, obj)

    def gather_ints(self, value: int, what: str) -> List[int]:
        self.gathered_verdicts = self._insert(self.others_verdicts, self.rank, value)
        return self.gathered_verdicts


def fake_gpus(monkeypatch, visible: List[str], nvlinked: Set[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """This process sees GPUs `visible` (UUIDs by index); `nvlinked` holds the pairs of local indices (low,
    high) with native peer atomics. Returns the pairs asked about."""
    asked: List[Tuple[int, int]] = []

    def atomics(a: int, b: int) -> bool:
        asked.append((a, b))
        return a == b or (min(a, b), max(a, b)) in nvlinked

    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(visible))
    monkeypatch.setattr(transport, "triton_supported", lambda: True)
    for module in (transport, utils):   # (the transport imports gpu_uuid by name)
        monkeypatch.setattr(module, "gpu_uuid", lambda index: visible[index])
    monkeypatch.setattr(utils, "native_peer_atomics", atomics)
    return asked


def fits(group: OneRankOfGroup, device_index: int) -> bool:
    num_ranks = len(group.others_gpus) + 1
    topology = Topology(rank=group.rank, num_ranks=num_ranks, ranks_per_node=num_ranks)
    return transport.nvlink_fits(group, topology, torch.device("cuda", device_index), num_bytes=1 << 20)


def test_gpus_seen_in_another_order_are_compared_by_uuid(monkeypatch):
    # this rank (1) sees B at index 0 and its peer's GPU A at index 1 (the peer sees them as A, B)
    asked = fake_gpus(monkeypatch, ["B", "A"], nvlinked={(0, 1)})
    group = OneRankOfGroup(rank=1, others_gpus=["A"])
    assert fits(group, device_index=0)
    assert {(0, 1), (1, 0)} <= set(asked)
    assert group.gathered_verdicts == [1, 1]


def test_without_native_atomics_to_a_peer_this_rank_says_no(monkeypatch):
    fake_gpus(monkeypatch, ["A", "B", "C"], nvlinked={(0, 1)})
    group = OneRankOfGroup(rank=0, others_gpus=["B", "C"])
    assert not fits(group, device_index=0)
    assert group.gathered_verdicts == [0, 1, 1]


def test_a_peer_gpu_this_process_cannot_see_means_no(monkeypatch):
    # every process restricted to its own GPU: all would report device index 0, yet the GPUs differ
    asked = fake_gpus(monkeypatch, ["A"], nvlinked=set())
    group = OneRankOfGroup(rank=0, others_gpus=["B"])
    assert not fits(group, device_index=0)
    assert asked == [] and group.gathered_verdicts == [0, 1]


def test_another_rank_saying_no_is_heard(monkeypatch):
    fake_gpus(monkeypatch, ["A", "B"], nvlinked={(0, 1)})
    group = OneRankOfGroup(rank=0, others_gpus=["B"], others_verdicts=[0])
    assert not fits(group, device_index=0)


def test_a_rank_that_cannot_use_the_transport_ends_the_check(monkeypatch):
    # a peer without Triton or CUDA contributes no GPU: no second exchange (every rank sees the same list)
    fake_gpus(monkeypatch, ["A", "B"], nvlinked={(0, 1)})
    group = OneRankOfGroup(rank=0, others_gpus=[""])
    assert not fits(group, device_index=0)
    assert group.gathered_verdicts is None


def test_ranks_sharing_one_gpu_fit(monkeypatch):
    asked = fake_gpus(monkeypatch, ["A"], nvlinked=set())
    group = OneRankOfGroup(rank=2, others_gpus=["A", "A", "A"])
    assert fits(group, device_index=0)
    assert all(a == b for a, b in asked)


def test_two_visible_gpus_with_one_uuid_mean_no(monkeypatch):
    # distinct GPUs must not pass for one shared GPU (whose peer check is skipped)
    fake_gpus(monkeypatch, ["A", "A"], nvlinked=set())
    group = OneRankOfGroup(rank=0, others_gpus=["A"])
    assert not fits(group, device_index=0)
    assert group.gathered_verdicts == [0, 1]


def test_a_failing_peer_check_is_a_no_in_the_exchange(monkeypatch):
    # the other ranks wait in the second exchange: this rank must take part in it, with a no
    fake_gpus(monkeypatch, ["A", "B"], nvlinked={(0, 1)})

    def broken(a: int, b: int) -> bool:
        raise RuntimeError("driver says no")

    monkeypatch.setattr(utils, "native_peer_atomics", broken)
    group = OneRankOfGroup(rank=0, others_gpus=["B"])
    with pytest.warns(UserWarning, match="driver says no"):
        assert not fits(group, device_index=0)
    assert group.gathered_verdicts == [0, 1]


def test_peer_access_is_enabled_to_each_ranks_gpu_by_uuid(monkeypatch):
    from deep_ep.transport.nvlink import peer_memory

    enabled: List[Tuple[int, int]] = []
    monkeypatch.setattr(peer_memory, "visible_gpus", lambda: {"B": 0, "A": 1})
    monkeypatch.setattr(peer_memory, "_enable_peer_access", lambda own, other: enabled.append((own, other)))
    peer_memory.reach_peers(own_device=1, gpus=["A", "B", "B"], rank=0)
    assert enabled == [(1, 1), (1, 0), (1, 0)]
    with pytest.raises(RuntimeError, match="GPU of rank 1 \\(C\\) is not visible to rank 0"):
        peer_memory.reach_peers(own_device=1, gpus=["A", "C"], rank=0)
