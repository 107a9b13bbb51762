"""deep_ep.utils.check_nvlink_connections (DeepEP's PCIe rule) with the GPUs and the group stood in for."""
from typing import List, Optional

import pytest
import torch
import torch.distributed as dist

import deep_ep.utils as utils


class FakeGroup:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def fake_gpus(monkeypatch, name: str, visible: List[str], current: int, ranks_gpus: List[str],
              nvlinked: Optional[set] = None) -> List[tuple]:
    """This process sees GPUs `visible` (UUIDs by index) and uses `visible[current]`; the group's ranks use
    `ranks_gpus`; `nvlinked` holds the pairs of local indices with native peer atomics. Returns the pairs
    the check asked about."""
    asked: List[tuple] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: name)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(visible))
    monkeypatch.setattr(utils, "gpu_uuid", lambda index: visible[index])

    def gather(out: list, obj, group=None) -> None:
        assert obj == visible[current], "each rank contributes the UUID of its own GPU"
        out[:] = ranks_gpus

    def atomics(a: int, b: int) -> bool:
        asked.append((a, b))
        return (min(a, b), max(a, b)) in (nvlinked or set())

    monkeypatch.setattr(dist, "all_gather_object", gather)
    monkeypatch.setattr(utils, "native_peer_atomics", atomics)
    return asked


def test_gpus_without_pcie_in_their_name_are_not_checked(monkeypatch):
    asked = fake_gpus(monkeypatch, "NVIDIA H200", ["A", "B", "C"], 0, ["A", "B", "C"])
    utils.check_nvlink_connections(FakeGroup(3))
    assert asked == []


def test_more_than_two_pcie_ranks_are_refused(monkeypatch):
    fake_gpus(monkeypatch, "NVIDIA H100 PCIe", ["A", "B", "C"], 0, ["A", "B", "C"])
    with pytest.raises(AssertionError, match="pairwise NVLink.*3 ranks"):
        utils.check_nvlink_connections(FakeGroup(3))


def test_gpus_are_compared_by_uuid_not_by_index(monkeypatch):
    # this rank sees the GPUs in the order B, A; its peer uses A: the pair checked is local (0, 1)
    asked = fake_gpus(monkeypatch, "NVIDIA A100-PCIE-40GB", ["B", "A"], 0, ["B", "A"], nvlinked={(0, 1)})
    utils.check_nvlink_connections(FakeGroup(2))
    assert set(asked) == {(0, 1), (1, 0)}


def test_a_pair_without_nvlink_is_named(monkeypatch):
    fake_gpus(monkeypatch, "NVIDIA H100 PCIe", ["A", "B"], 1, ["B", "A"], nvlinked=set())
    with pytest.raises(AssertionError, match="GPUs (A and B|B and A) are not connected by NVLink"):
        utils.check_nvlink_connections(FakeGroup(2))


def test_ranks_sharing_one_gpu_need_no_peer_check(monkeypatch):
    asked = fake_gpus(monkeypatch, "NVIDIA H100 PCIe", ["A"], 0, ["A", "A"])
    utils.check_nvlink_connections(FakeGroup(2))
    assert asked == []


def test_a_peer_gpu_hidden_from_this_process_is_named(monkeypatch):
    # every process sees only its own GPU (index 0 everywhere): the indices alone would look like one GPU
    fake_gpus(monkeypatch, "NVIDIA H100 PCIe", ["A"], 0, ["A", "B"])
    with pytest.raises(AssertionError, match="rank 1 \\(B\\) is not visible"):
        utils.check_nvlink_connections(FakeGroup(2))
