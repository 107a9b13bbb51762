"""The NVLink transport's normal-mode host code and kernels end to end under Triton's CPU interpreter (run by
test_nvlink_interpreted.py with TRITON_INTERPRET=1 set), against the reference transport, bit for bit: one
rank whose buffer is CPU memory mapped to itself (so every row stays local; the interpreter runs one program
after another, so ranks that wait for each other cannot run here). The layout, a non-cached dispatch (its
prepare and notify kernels, the plan, the count wait, the handle), a cached dispatch and a combine, BF16 and FP8,
with the direct protocol and with the rings. Prints "ok", or the mismatches."""
import sys
from types import SimpleNamespace
from typing import List

import torch
import torch.distributed as dist

from compare import record_difference
from randomness import base_seed, generator
from deep_ep.fp8 import per_token_cast_to_fp8
from deep_ep.group import Group, Topology
from deep_ep.transport.nvlink import settings
from deep_ep.transport.nvlink.header import Header
from deep_ep.transport.nvlink.normal import NVLinkNormal
from deep_ep.transport.nvlink.status import StatusWords
from deep_ep.transport.reference import ReferenceTransport

T, H, K, E, C = 40, 256, 4, 8, 2
NUM_NVL_BYTES = 1 << 20   # every ring holds all rows: a sender never waits for a receiver still to run


def _same(failures: List[str], what: str, got, expected) -> None:
    """record_difference for tensors (or None), plain equality for the per-expert lists."""
    if isinstance(expected, list):
        if got != expected:
            failures.append(f"{what}: {got} != {expected}")
        return
    record_difference(failures, what, got, expected)


def _normal_mode(group: Group, topology: Topology) -> NVLinkNormal:
    memory = torch.zeros(Header.for_ranks(1).nbytes + NUM_NVL_BYTES, dtype=torch.uint8)
    peers = SimpleNamespace(bases=torch.tensor([memory.data_ptr()], dtype=torch.int64), close=lambda: None)
    return NVLinkNormal(group, topology, memory, peers, NUM_NVL_BYTES, StatusWords(group, 30 * 10 ** 9))


def _ticket_counter(ours: NVLinkNormal) -> int:
    """The TICKET word of this rank's buffer header (int64)."""
    words = torch.empty(0, dtype=torch.int64).set_(ours.local_buffer.untyped_storage())
    return int(words[ours.header.ticket_word])


def _round_trip(failures: List[str], label: str, ours, reference, x, scales, idx, weights) -> None:
    """Layout, dispatch, cached dispatch and combine on both transports, compared output by output."""
    layouts = [transport.get_dispatch_layout(idx, E) for transport in (ours, reference)]
    for name, got, expected in zip(("per_rank", "per_rdma_rank", "per_expert", "in_rank"), *layouts):
        _same(failures, f"{label} layout {name}", got, expected)
    per_rank, _, per_expert, in_rank = layouts[1]
    outs = [transport.dispatch(x, scales, idx, weights, per_rank, in_rank, per_expert, 1, 0, C)
            for transport in (ours, reference)]
    for name in ("recv_x", "recv_scales", "recv_topk_idx", "recv_topk_weights", "num_recv_tokens_per_expert_list"):
        _same(failures, f"{label} dispatch {name}", getattr(outs[0], name), getattr(outs[1], name))
    ticket = _ticket_counter(ours)
    if ticket:   # (the last program of the notify and of the dispatch kernel each resets it)
        failures.append(f"{label} dispatch: the programs' ticket counter is {ticket} after its kernels, not 0")
    for position, name in enumerate(("rank_prefix_matrix", "channel_prefix", "recv_channel_prefix", "recv_src_idx",
                                     "is_token_in_rank")):
        _same(failures, f"{label} handle {name}", outs[0].handle[position], outs[1].handle[position])
    x2 = x.flip(0).contiguous()
    cached = [transport.cached_dispatch(x2, scales, out.handle, C) for transport, out in zip((ours, reference), outs)]
    _same(failures, f"{label} cached dispatch recv_x", cached[0].recv_x, cached[1].recv_x)
    if scales is None:
        bias = torch.randn(x.shape, generator=generator(base_seed(), "bias")).to(torch.bfloat16)
        combined = [transport.combine(out.recv_x, out.handle, out.recv_topk_weights, (bias, None), C)
                    for transport, out in zip((ours, reference), outs)]
        _same(failures, f"{label} combine x", combined[0][0], combined[1][0])
        _same(failures, f"{label} combine weights", combined[0][1], combined[1][1])


def main() -> int:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group, topology = Group(dist.group.WORLD, None, 30.0, torch.device("cpu")), Topology(0, 1, 1)
    reference = ReferenceTransport(group, topology, torch.device("cpu"))
    gen = generator(base_seed(), "interpreted normal")
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
    idx[torch.rand(T, K, generator=gen) < 0.2] = -1
    weights = torch.rand(T, K, generator=gen)
    x_fp8, scales = per_token_cast_to_fp8(x)
    failures: List[str] = []
    for direct in (True, False):
        settings.DIRECT = direct
        ours = _normal_mode(group, topology)   # (a fresh buffer per protocol: its counters start at zero)
        protocol = "direct" if direct else "rings"
        _round_trip(failures, f"{protocol} BF16", ours, reference, x, None, idx, weights)
        _round_trip(failures, f"{protocol} FP8", ours, reference, x_fp8, scales, idx, weights)
        used = {(key[0], key[1] if key[0] == "dispatch" else key[-1]) for key in ours._launches
                if key[0] in ("dispatch", "combine")}
        if used != {("dispatch", direct), ("combine", direct)}:
            failures.append(f"{protocol}: the launches made were {sorted(used)}")
    dist.destroy_process_group()
    print("\n".join(failures) if failures else "ok")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
