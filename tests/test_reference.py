"""The reference transport's exchanges per call: a call with a handle that repeats the handle's previous call
of its operation exchanges no header (Note [checked once per handle] in deep_ep/transport/reference.py), and
what it returns does not depend on whether it did; the low-latency calls as fixed-size exchanges
(reference_fixed_size.py) give what the counted ones give, also replayed from a CUDA graph. Results themselves
are compared with the models in test_normal.py and test_low_latency.py."""
from __future__ import annotations

from typing import Callable, Dict, List

import pytest
import torch

from compare import report_mismatches
from dist_utils import run_deterministic, run_under_defaults
from randomness import base_seed, bits, generator


def _counting_exchanges(transport) -> Dict[str, int]:
    """Count the transport's header exchanges (all-gathers) and data exchanges (all-to-alls) from now on."""
    counts = {"headers": 0, "exchanges": 0}
    group = transport.group
    start_all_gather, all_to_all = group.start_all_gather, group.all_to_all

    def counted_all_gather(*args, **kwargs):
        counts["headers"] += 1
        return start_all_gather(*args, **kwargs)

    def counted_all_to_all(*args, **kwargs):
        counts["exchanges"] += 1
        return all_to_all(*args, **kwargs)
    group.start_all_gather, group.all_to_all = counted_all_gather, counted_all_to_all
    return counts


def _expect(counts: Dict[str, int], what: str, call: Callable[[], object], headers: int, problems: List[str],
            rank: int) -> object:
    """Run `call`; note a problem unless it made `headers` header exchanges and at least one data exchange."""
    before = dict(counts)
    out = call()
    made = counts["headers"] - before["headers"]
    if made != headers or counts["exchanges"] == before["exchanges"]:
        problems.append(f"rank {rank}: {what}: {made} header exchanges (expected {headers}), "
                        f"{counts['exchanges'] - before['exchanges']} data exchanges")
    return out


def run_normal_calls(ctx, seed: int) -> List[str]:
    from deep_ep import Buffer
    T, H, E, K = 24, 64, 4 * ctx.world_size, 2
    gen = generator(seed, "reference calls", ctx.rank)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(ctx.device)
    wide = torch.randn(T, 2 * H, generator=gen).to(torch.bfloat16).to(ctx.device)
    topk_idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices.to(ctx.device)
    topk_weights = torch.rand(T, K, generator=gen).to(ctx.device)
    buffer = Buffer(ctx.group, 1 << 24, transport="reference")
    counts = _counting_exchanges(buffer._transport)
    problems: List[str] = []
    layout = buffer.get_dispatch_layout(topk_idx, E)
    recv_x, _, recv_weights, _, handle, _ = _expect(counts, "dispatch", lambda: buffer.dispatch(
        x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2],
        topk_idx=topk_idx, topk_weights=topk_weights), 1, problems, ctx.rank)
    first = _expect(counts, "first cached dispatch", lambda: buffer.dispatch(x, handle=handle)[0], 1, problems,
                    ctx.rank)
    again = _expect(counts, "repeated cached dispatch", lambda: buffer.dispatch(x, handle=handle)[0], 0, problems,
                    ctx.rank)
    _expect(counts, "cached dispatch with a new hidden size", lambda: buffer.dispatch(wide, handle=handle), 1,
            problems, ctx.rank)
    _expect(counts, "cached dispatch with the new hidden size again", lambda: buffer.dispatch(wide, handle=handle),
            0, problems, ctx.rank)
    _expect(counts, "cached dispatch back at the first hidden size", lambda: buffer.dispatch(x, handle=handle), 1,
            problems, ctx.rank)
    if not (torch.equal(bits(first), bits(recv_x)) and torch.equal(bits(again), bits(recv_x))):
        problems.append(f"rank {ctx.rank}: cached dispatches differ from the dispatch")
    combined = _expect(counts, "first combine", lambda: buffer.combine(recv_x, handle, topk_weights=recv_weights),
                       1, problems, ctx.rank)
    repeated = _expect(counts, "repeated combine", lambda: buffer.combine(recv_x, handle, topk_weights=recv_weights),
                       0, problems, ctx.rank)
    _expect(counts, "combine without weights", lambda: buffer.combine(recv_x, handle), 1, problems, ctx.rank)
    if not all(torch.equal(bits(a), bits(b)) for a, b in zip(combined[:2], repeated[:2])):
        problems.append(f"rank {ctx.rank}: the repeated combine differs from the first")
    return problems


def run_low_latency_calls(ctx, seed: int) -> List[str]:
    from deep_ep import Buffer
    N, H, E, K = 8, 128, 4 * ctx.world_size, 3
    gen = generator(seed, "reference low-latency calls", ctx.rank)
    x = torch.randn(N - 1, H, generator=gen).to(torch.bfloat16).to(ctx.device)
    topk_idx = torch.rand(N - 1, E, generator=gen).topk(K, dim=1).indices.to(ctx.device)
    topk_idx[0, 1] = -1
    topk_weights = torch.rand(N - 1, K, generator=gen).to(ctx.device)
    hint = Buffer.get_low_latency_rdma_size_hint(N, H, ctx.world_size, E)
    buffer = Buffer(ctx.group, 0, hint, low_latency_mode=True, num_qps_per_rank=E // ctx.world_size,
                    transport="reference")
    counts = _counting_exchanges(buffer._transport)
    problems: List[str] = []
    recv_x, _, handle, _, _ = _expect(counts, "dispatch", lambda: buffer.low_latency_dispatch(
        x, topk_idx, N, E, use_fp8=False), 1, problems, ctx.rank)
    first = _expect(counts, "first combine", lambda: buffer.low_latency_combine(
        recv_x, topk_idx, topk_weights, handle)[0], 1, problems, ctx.rank)
    again = _expect(counts, "repeated combine", lambda: buffer.low_latency_combine(
        recv_x, topk_idx, topk_weights, handle)[0], 0, problems, ctx.rank)
    _expect(counts, "combine with LogFMT", lambda: buffer.low_latency_combine(
        recv_x, topk_idx, topk_weights, handle, use_logfmt=True), 1, problems, ctx.rank)
    _expect(counts, "combine without LogFMT again", lambda: buffer.low_latency_combine(
        recv_x, topk_idx, topk_weights, handle), 1, problems, ctx.rank)
    if not torch.equal(bits(first), bits(again)):
        problems.append(f"rank {ctx.rank}: the repeated combine differs from the first")
    # ids out of range on one rank, in a repeated combine: that rank refuses after the exchange, the others
    # return their rows, and the next call finds every rank in step
    bad = topk_idx.clone()
    bad[0, 0] = E if ctx.rank == 0 else bad[0, 0]
    try:
        buffer.low_latency_combine(recv_x, bad, topk_weights, handle)
        if ctx.rank == 0:
            problems.append("rank 0: no error for an expert id equal to num_experts")
    except ValueError as error:
        if ctx.rank != 0 or "topk_idx" not in str(error):
            problems.append(f"rank {ctx.rank}: {error}")
    after = buffer.low_latency_combine(recv_x, topk_idx, topk_weights, handle)[0]
    if not torch.equal(bits(after), bits(first)):
        problems.append(f"rank {ctx.rank}: the combine after a refused one differs from the first")
    return problems


def test_a_repeated_cached_dispatch_or_combine_exchanges_no_header(pool):
    seed = base_seed()
    report_mismatches(seed, lambda: pool(2).run(run_normal_calls, seed))


def test_a_repeated_low_latency_combine_exchanges_no_header(pool):
    seed = base_seed()
    report_mismatches(seed, lambda: pool(2).run(run_low_latency_calls, seed))


def _valid_slots(count: torch.Tensor, slots: int) -> torch.Tensor:
    """[E_loc, slots] True where a slot holds a received row."""
    return torch.arange(slots, device=count.device)[None, :] < count[:, None]


def run_fixed_size_low_latency(ctx, seed: int) -> List[str]:
    """The fixed-size low-latency exchange (what runs inside a CUDA graph capture) against the counted one: the
    same outputs bit for bit, on uneven token counts (one rank with none), dropped selections (-1) and an
    expert listed twice by one token, in BF16, FP8 and FP8 with UE8M0 scales, and their combines (with LogFMT)."""
    from deep_ep import Buffer
    N, H, K = 8, 384, 4   # (3 scale groups: a row of FP8 data, scales and ids is not a multiple of 8 bytes)
    E = 4 * ctx.world_size
    gen = generator(seed, "fixed-size low latency", ctx.rank)
    hint = Buffer.get_low_latency_rdma_size_hint(N, H, ctx.world_size, E)
    buffer = Buffer(ctx.group, 0, hint, low_latency_mode=True, num_qps_per_rank=E // ctx.world_size,
                    transport="reference")
    transport = buffer._transport
    problems: List[str] = []
    for round_ in range(3):
        num_tokens = 0 if (round_ == 1 and ctx.rank == 1) else int(torch.randint(1, N + 1, (1,), generator=gen))
        x = (torch.randn(num_tokens, H, generator=gen) * 4).to(torch.bfloat16).to(ctx.device)
        topk_idx = torch.rand(num_tokens, E, generator=gen).topk(K, dim=1).indices
        topk_idx[torch.rand(num_tokens, K, generator=gen) < 0.2] = -1
        if num_tokens and round_ == 2:
            topk_idx[0, 1] = topk_idx[0, 0] = 0   # one token lists expert 0 twice: two rows
        topk_idx = topk_idx.to(ctx.device)
        weights = torch.rand(num_tokens, K, generator=gen).to(ctx.device)
        use_fp8, ue8m0 = round_ > 0, round_ == 2
        outputs = []
        for fixed in (False, True):
            transport.fixed_size_low_latency = fixed
            recv_x, count, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, N, E, use_fp8=use_fp8,
                                                                     round_scale=ue8m0, use_ue8m0=ue8m0)
            outputs.append((recv_x, count, handle))
        (eager_x, eager_count, eager_handle), (fixed_x, fixed_count, fixed_handle) = outputs
        valid = _valid_slots(eager_count, eager_handle[0].shape[1])
        where = f"rank {ctx.rank} round {round_}"
        if not (torch.equal(eager_count, fixed_count) and torch.equal(eager_handle[1], fixed_handle[1])):
            problems.append(f"{where}: recv_count / layout_range differ")
            continue
        if not torch.equal(eager_handle[0][valid], fixed_handle[0][valid]):
            problems.append(f"{where}: src_info differs")
        pairs = list(zip(eager_x, fixed_x)) if use_fp8 else [(eager_x, fixed_x)]
        for a, b in pairs:
            if not torch.equal(bits(a[valid]), bits(b[valid])):
                problems.append(f"{where}: received rows or scales differ")
        # (|values| < 1: LogFMT encodes them, rather than passing them as they are)
        experts = (torch.randn(eager_handle[0].shape + (H,), generator=gen) / 8).to(torch.bfloat16).to(ctx.device)
        for use_logfmt in (False, True):
            combined = []
            for fixed, handle in ((False, eager_handle), (True, fixed_handle)):
                transport.fixed_size_low_latency = fixed
                combined.append(buffer.low_latency_combine(experts, topk_idx, weights, handle,
                                                           use_logfmt=use_logfmt)[0])
            if not torch.equal(bits(combined[0]), bits(combined[1])):
                problems.append(f"{where}: combine (use_logfmt={use_logfmt}) differs")
    return problems


def test_fixed_size_low_latency_matches_the_counted_exchange(pool):
    seed = base_seed()
    report_mismatches(seed, lambda: pool(3).run(run_fixed_size_low_latency, seed))


def test_fixed_size_low_latency_in_deterministic_mode(pool):
    """As above on 2 ranks with torch's deterministic algorithms on and new tensors filled with NaN / the
    largest integer (the exchange may rely on no value of memory it did not write)."""
    seed = base_seed()
    report_mismatches(seed, lambda: pool(2).run(run_deterministic, run_fixed_size_low_latency, seed))


def test_fixed_size_low_latency_under_a_default_device_and_dtype(pool):
    """As above on 2 ranks, every Buffer call under a default device (meta) and dtype (bfloat16) that the
    library must not use (dist_utils.run_under_defaults)."""
    seed = base_seed()
    report_mismatches(seed, lambda: pool(2).run(run_under_defaults, run_fixed_size_low_latency, seed))


def run_low_latency_graph(ctx, seed: int) -> List[str]:
    """One rank of an NCCL group: low-latency dispatch and combine captured in one CUDA graph, replayed with
    new inputs (new values and routing in the same tensors), give what eager calls give for those inputs."""
    from deep_ep import Buffer
    N, H, K, E = 16, 256, 4, 8
    gen = generator(seed, "low-latency graph", ctx.rank)
    hint = Buffer.get_low_latency_rdma_size_hint(N, H, ctx.world_size, E)
    buffer = Buffer(ctx.group, 0, hint, low_latency_mode=True, num_qps_per_rank=E // ctx.world_size,
                    transport="reference")
    if not buffer._transport.low_latency_graph_capturable:
        return [f"rank {ctx.rank}: the reference transport on this group says it cannot be captured"]

    def new_inputs():
        x = (torch.randn(N, H, generator=gen) / 8).to(torch.bfloat16)
        topk_idx = torch.rand(N, E, generator=gen).topk(K, dim=1).indices
        topk_idx[torch.rand(N, K, generator=gen) < 0.2] = -1
        return x.to(ctx.device), topk_idx.to(ctx.device), torch.rand(N, K, generator=gen).to(ctx.device)

    x, topk_idx, weights = new_inputs()
    out = torch.empty((N, H), dtype=torch.bfloat16, device=ctx.device)

    def step():
        recv_x, count, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, N, E, use_fp8=False)
        buffer.low_latency_combine(recv_x, topk_idx, weights, handle, out=out)
        return recv_x, count, handle
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured_x, captured_count, captured_handle = step()
    problems: List[str] = []
    for replay in range(3):
        for static, fresh in zip((x, topk_idx, weights), new_inputs()):
            static.copy_(fresh)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        replayed = out.clone()
        recv_x, count, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, N, E, use_fp8=False)
        eager = buffer.low_latency_combine(recv_x, topk_idx, weights, handle)[0]
        valid = _valid_slots(count, handle[0].shape[1])
        where = f"rank {ctx.rank} replay {replay}"
        if not (torch.equal(count, captured_count) and torch.equal(handle[1], captured_handle[1])):
            problems.append(f"{where}: recv_count / layout_range differ from an eager dispatch's")
        elif not (torch.equal(bits(recv_x[valid]), bits(captured_x[valid]))
                  and torch.equal(handle[0][valid], captured_handle[0][valid])):
            problems.append(f"{where}: received rows or src_info differ from an eager dispatch's")
        if not torch.equal(bits(replayed), bits(eager)):
            problems.append(f"{where}: the replayed combine differs from an eager one")
    return problems


@pytest.mark.gpu
def test_low_latency_replays_from_a_cuda_graph_on_an_nccl_group(pool):
    seed = base_seed()
    report_mismatches(seed, lambda: pool(1).run(run_low_latency_graph, seed))
