"""Every kernel launch the NVLink transport prepares binds to its kernel, built on the CPU (no GPU, no kernel
runs): each name it passes is a parameter of the kernel or a launch option, and every parameter gets a value.
A name that drifted from the kernel's signature fails here instead of at the first call on a GPU."""
from types import SimpleNamespace

import pytest
import torch
from dist_utils import SUPPORTED_TRITON

pytest.importorskip("triton", minversion=SUPPORTED_TRITON)

from deep_ep.group import Topology  # noqa: E402
from deep_ep.transport.base import LowLatencyOptions  # noqa: E402
from deep_ep.transport.nvlink import launcher  # noqa: E402
from deep_ep.transport.nvlink.header import Header  # noqa: E402
from deep_ep.transport.nvlink.low_latency import NVLinkLowLatency  # noqa: E402
from deep_ep.transport.nvlink.normal import DispatchGeometry, NVLinkNormal, PlanTables  # noqa: E402
from deep_ep.transport.nvlink.status import StatusWords  # noqa: E402

R = 2


def _normal_mode(num_ranks: int = R, rows_bytes: int = 1 << 20) -> NVLinkNormal:
    """Rank 0's normal mode on CPU memory, its peer table and group stood in for (no launch runs)."""
    group = SimpleNamespace(rank=0, size=num_ranks)
    memory = torch.zeros(Header.for_ranks(num_ranks).nbytes + rows_bytes, dtype=torch.uint8)
    peers = SimpleNamespace(bases=torch.zeros(num_ranks, dtype=torch.int64))
    return NVLinkNormal(group, Topology(0, num_ranks, num_ranks), memory, peers, rows_bytes,
                        StatusWords(group, 10 ** 9))


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("scale_words", [0, 56])
def test_normal_dispatch_launches_bind(direct, scale_words):
    normal = _normal_mode()
    hidden_words, topk, channels = 7168 // 2 if not scale_words else 7168 // 4, 8, 12
    id_offset = (hidden_words + scale_words + 1) // 2 * 2
    slot_words = (id_offset + 3 * topk + 1 + 3) // 4 * 4
    geometry = DispatchGeometry(hidden_words, scale_words, topk, id_offset, slot_words,
                                *normal._rings(slot_words, channels, "dispatch"))
    relaunch = normal._dispatch_launch(direct, geometry, channels, True, 0, 4)
    assert isinstance(relaunch, launcher.Relaunch)


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("biases", [(False, False), (True, True)])
def test_normal_combine_layout_and_notify_launches_bind(direct, biases):
    normal = _normal_mode()
    assert isinstance(normal._combine_launch(direct, 7168, 8, *biases, 12), launcher.Relaunch)
    assert isinstance(normal._layout_launch(8, 64), launcher.Relaunch)
    prepare, notify, tables = normal._notify_launches(12, 64, no_wait=False)
    assert all(isinstance(launch, launcher.Relaunch) for launch in (prepare, notify))
    assert tables == PlanTables.for_shape(R, 12, 2 + R + 64 // R + 12)


@pytest.mark.parametrize("num_ranks, num_channels, record_len", [(2, 12, 48), (3, 5, 31), (8, 24, 66)])
def test_plan_tables_do_not_overlap_and_start_on_16_byte_boundaries(num_ranks, num_channels, record_len):
    R, C = num_ranks, num_channels
    tables = PlanTables.for_shape(R, C, record_len)
    sizes = [R + 1, R * C, R * C, R, R, R * C, R * C, R * R, R * C, R * record_len]
    offsets = list(tables[:-1])
    assert all(offset % 4 == 0 for offset in offsets), offsets
    ends = [offset + size for offset, size in zip(offsets, sizes)]
    assert all(end <= start for end, start in zip(ends, offsets[1:] + [tables.size])), (offsets, sizes)
    assert tables.size - ends[-1] < 4


@pytest.mark.parametrize("use_fp8", [False, True])
@pytest.mark.parametrize("use_logfmt", [False, True])
def test_low_latency_launches_bind(use_fp8, use_logfmt):
    peers = SimpleNamespace(bases=torch.zeros(R, dtype=torch.int64))
    ll = NVLinkLowLatency(Topology(0, R, R), torch.zeros(64 << 20, dtype=torch.uint8), peers,
                          torch.zeros(4 + R, dtype=torch.int32), 10 ** 9, 132)
    options = LowLatencyOptions(use_fp8=use_fp8, round_scale=False, use_ue8m0=False)
    supported = launcher.launch_options() or ()
    ll.can_fuse = "launch_cooperative_grid" in supported   # (as on a GPU: the fused and chained launches too)
    if "launch_pdl" in supported:
        ll._chained = dict(PDL=True, launch_pdl=True)
    dispatch = ll._dispatch_plan(128, 7168, 32, 8, options, None, False, 0)
    combine = ll._combine_plan(128, 7168, 32 // R, 8, use_logfmt, None, False, 1, (128 * R * 7168, 7168, 1),
                               own_from_x=not use_logfmt)
    for plan in (dispatch, combine):
        assert isinstance(plan.send, launcher.Relaunch) and isinstance(plan.receive, launcher.Relaunch)
        assert (plan.fused is not None) == ll.can_fuse
