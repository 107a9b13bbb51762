"""Conformance tests of the normal (high-throughput) mode: get_dispatch_layout, dispatch, combine.

Every rank generates the inputs of ALL ranks from one random base seed (drawn fresh each run, printed in
every failure; set DEEP_EP_TEST_SEED to replay one), feeds its own to the library and compares its results
bitwise with the single-process model of tests/model.py, which sees every rank's inputs.

Many cases (tests/cases.py) run inside one `pool.run` per world size (spawning rank processes is the expensive
part): fixed cases, three cases with every parameter drawn from the seed, then edge cases where ranks receive
nothing. tests/normal_mode.py makes and checks each case's calls. A rank records mismatches instead of
raising, so that every rank keeps taking part in the collectives, and the test reports every mismatch of every
rank; an exception from the library stops that rank's remaining cases (and fails the pool run, which restarts
its processes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List

import pytest
import torch

import model
from cases import CASES_1, CASES_2, CASES_2X2, CASES_3, CASES_4, CASES_6, CASES_8, EDGE_CASES, NormalCase, random_normal_cases
from compare import report_mismatches
from dist_utils import run_deterministic, run_under_defaults
from normal_mode import BUFFER_TIMEOUT_S, NormalChecker, configs, make_sources, nvl_bytes, run_cases
from randomness import base_seed, generator


@pytest.mark.parametrize("world_size,cases", [(1, CASES_1), (2, CASES_2), (3, CASES_3), (4, CASES_4), (6, CASES_6),
                                              (8, CASES_8)], ids=["1rank", "2ranks", "3ranks", "4ranks", "6ranks", "8ranks"])
def test_intranode(pool, world_size, cases):
    seed = base_seed()
    cases = cases + random_normal_cases(seed, world_size, 3 if world_size <= 4 else 2) + EDGE_CASES.get(world_size, [])
    report_mismatches(seed, lambda: pool(world_size).run(run_cases, seed, cases))


def test_intranode_in_deterministic_mode(pool):
    """The 2-rank cases with torch's deterministic algorithms on and new tensors filled with NaN / the
    largest integer (the transport may rely on no value of memory it did not write)."""
    seed = base_seed()
    report_mismatches(seed, lambda: pool(2).run(run_deterministic, run_cases, seed, CASES_2))


def test_intranode_under_a_default_device_and_dtype(pool):
    """The 2-rank cases with every Buffer call made under a default device (meta) and dtype (bfloat16) that
    the library must not use (dist_utils.run_under_defaults)."""
    seed = base_seed()
    report_mismatches(seed, lambda: pool(2).run(run_under_defaults, run_cases, seed, CASES_2))


def test_internode_under_a_default_device_and_dtype(pool):
    """As above, for 2 nodes x 2 ranks (the internode handle and the two-level combine)."""
    seed = base_seed()
    report_mismatches(seed, lambda: pool(4).run(run_under_defaults, run_cases, seed, CASES_2X2[:2], 2))


def test_internode_2_nodes_x_2_ranks(pool):
    seed = base_seed()
    cases = CASES_2X2 + random_normal_cases(seed, 4, 3, internode=True) + [
        NormalCase(name="2x2-nothing-to-node-1", tokens=[30, 0, 17, 0], hidden=256, topk=2, experts_per_rank=2,
                   num_sms=4, mask_frac=0.1, worst=True, cached=["fp8"], biases=["one"], routing="first_half")]
    report_mismatches(seed, lambda: pool(4).run(run_cases, seed, cases, 2))


def test_internode_3_nodes_x_2_ranks(pool):
    """An odd number of nodes: the per-node counts and the node-level forwarding have three nodes to serve."""
    seed = base_seed()
    cases = random_normal_cases(seed, 6, 2, internode=True) + [
        NormalCase(name="3x2-fp8-worst-cached", tokens=[30, 0, 17, 64, 5, 40], hidden=256, topk=6, experts_per_rank=3,
                   x="fp8", mask_frac=0.1, num_sms=4, worst=True, cached=["bf16"], biases=["two"]),
        NormalCase(name="3x2-nothing-to-node-2", tokens=[12, 9, 0, 33, 0, 0], hidden=256, topk=2, experts_per_rank=2,
                   num_sms=2, routing="first_half", biases=["none"])]
    report_mismatches(seed, lambda: pool(6).run(run_cases, seed, cases, 2))


# ---------------------------------------------------------------------------------------------------
# dispatch moves raw bytes: any dtype with 16-byte rows (spec 5.1)
# ---------------------------------------------------------------------------------------------------
RAW_DTYPES = [getattr(torch, name) for name in (
    "float32", "float16", "float64", "int8", "uint8", "int16", "int32", "int64", "complex64", "uint16", "uint32",
    "uint64", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, name)]


def raw_rows(seed: int, s: int, num_tokens: int, row_bytes: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank s's rows for `dtype`: random bytes (every bit pattern), viewed as `dtype`."""
    gen = generator(seed, "raw", str(dtype), s)
    return torch.randint(0, 256, (num_tokens, row_bytes), generator=gen, dtype=torch.uint8).view(dtype)


def run_raw_dtypes(ctx, seed: int, case: NormalCase) -> List[str]:
    from deep_ep import Buffer
    num_ranks, rank = ctx.world_size, ctx.rank
    num_experts = num_ranks * case.experts_per_rank
    sources = make_sources(seed, case, num_ranks, None)
    rows = model.received_rows(sources, rank)
    me = sources[rank]
    buffer = Buffer(ctx.group, nvl_bytes(), 0, explicitly_destroy=True, timeout_s=BUFFER_TIMEOUT_S)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(me.topk_idx.to(ctx.device), num_experts)
    chk = NormalChecker(seed, case.name, rank)
    row_bytes = 64
    for dtype in RAW_DTYPES:
        xs = [raw_rows(seed, s, case.tokens[s], row_bytes, dtype) for s in range(num_ranks)]
        expected = model.cached_dispatch([x.view(torch.uint8) for x in xs], rows)
        recv_x, _, _, _, handle, _ = buffer.dispatch(
            xs[rank].to(ctx.device), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=me.topk_idx.to(ctx.device),
            topk_weights=me.topk_weights.to(ctx.device))
        chk.true(f"{dtype} recv_x dtype", recv_x.dtype == dtype, f"got {recv_x.dtype}")
        chk.equal(f"{dtype} recv_x bytes", recv_x.cpu().view(torch.uint8), expected)
        cached = buffer.dispatch(xs[rank].to(ctx.device), handle=handle)[0]
        chk.equal(f"{dtype} cached recv_x bytes", cached.cpu().view(torch.uint8), expected)
        if dtype.itemsize == 1 and dtype.is_floating_point:   # the FP8 form: (1-byte data, scales)
            scales = [torch.randn(case.tokens[s], 1, generator=generator(seed, "scales", s))
                      for s in range(num_ranks)]
            data, got_scales = buffer.dispatch(
                (xs[rank].to(ctx.device), scales[rank].to(ctx.device)), num_tokens_per_rank=per_rank,
                is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=me.topk_idx.to(ctx.device),
                topk_weights=me.topk_weights.to(ctx.device))[0]
            chk.equal(f"({dtype}, scales) data bytes", data.cpu().view(torch.uint8), expected)
            chk.equal(f"({dtype}, scales) scales", got_scales.cpu(), model.cached_dispatch(scales, rows))
    buffer.destroy()
    return chk.errors


@pytest.mark.parametrize("world_size", [2, 3])
def test_dispatch_moves_any_dtype_bit_for_bit(pool, world_size):
    """Plain x of every dtype (64-byte rows of random bytes, also dtypes a gloo or NCCL collective cannot carry),
    and the FP8 tuple with other 1-byte float data, arrive bit for bit, in cached dispatch too."""
    seed = base_seed()
    case = NormalCase(name=f"raw-dtypes-{world_size}", tokens=[13, 0, 21][:world_size], hidden=64, topk=3,
                      experts_per_rank=3, mask_frac=0.2)
    report_mismatches(seed, lambda: pool(world_size).run(run_raw_dtypes, seed, case))


@dataclass
class ArgumentSemanticsRun:
    """The argument-semantics checks' state on one rank: its inputs, the model's dispatch, the Buffer and the
    layout of this rank's top-k ids."""
    buffer: Any
    chk: NormalChecker
    seed: int
    rank: int
    dev: torch.device
    num_ranks: int
    me: model.Source
    expected: model.DispatchResult
    layout: Dict[str, Any]            # the layout arguments of a non-cached dispatch
    topk: Dict[str, torch.Tensor]     # this rank's top-k ids and weights on its device


def start_argument_semantics(ctx, seed: int, case: NormalCase) -> ArgumentSemanticsRun:
    """The case's inputs, the model's dispatch for this rank, a Buffer and get_dispatch_layout's counts."""
    from deep_ep import Buffer
    num_ranks, rank, dev = ctx.world_size, ctx.rank, ctx.device
    num_experts = num_ranks * case.experts_per_rank
    sources = make_sources(seed, case, num_ranks, None)
    me = sources[rank]
    expected = model.dispatch(sources, rank, num_experts, num_channels=configs(case, False)[2])
    buffer = Buffer(ctx.group, nvl_bytes(), 0, explicitly_destroy=True, timeout_s=BUFFER_TIMEOUT_S)
    chk = NormalChecker(seed, case.name, rank)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(me.topk_idx.to(dev), num_experts)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    topk = dict(topk_idx=me.topk_idx.to(dev), topk_weights=me.topk_weights.to(dev))
    return ArgumentSemanticsRun(buffer, chk, seed, rank, dev, num_ranks, me, expected, layout, topk)


def check_expert_list_sums_the_callers_counts(run: ArgumentSemanticsRun) -> tuple:
    """The per-expert list sums the callers' num_tokens_per_expert (spec 5.5), not what arrives; returns the
    dispatch's outputs (their handle serves the checks after)."""
    chk, expected, layout = run.chk, run.expected, run.layout
    padded = run.buffer.dispatch(run.me.x.to(run.dev), num_tokens_per_rank=layout["num_tokens_per_rank"],
                                 is_token_in_rank=layout["is_token_in_rank"],
                                 num_tokens_per_expert=layout["num_tokens_per_expert"] + 3, **run.topk)
    chk.true("list from the callers' num_tokens_per_expert + 3",
             padded[3] == [c + 3 * run.num_ranks for c in expected.num_recv_tokens_per_expert_list],
             f"got {padded[3]}, expected {expected.num_recv_tokens_per_expert_list} each + {3 * run.num_ranks}")
    chk.x_equal("recv_x with padded counts", padded[0], expected.recv_x)
    return padded


def check_cached_dispatch_ignores_layout_arguments(run: ArgumentSemanticsRun, handle: tuple) -> None:
    """A cached dispatch ignores the layout arguments, expert_alignment and num_worst_tokens (spec 5.1, 6.3)."""
    chk = run.chk
    ignored = run.buffer.dispatch(run.me.x.to(run.dev), handle=handle, num_tokens_per_rank=torch.zeros(7),
                                  expert_alignment=0, num_worst_tokens=-5)
    chk.x_equal("cached dispatch with ignored arguments recv_x", ignored[0], run.expected.recv_x)
    chk.true("cached dispatch with ignored arguments: (recv_x, None, None, None, None, event)",
             all(v is None for v in ignored[1:5]), f"got {[type(v).__name__ for v in ignored[1:5]]}")


def check_list_handle_serves_as_the_tuple(run: ArgumentSemanticsRun, recv_x: torch.Tensor, handle: tuple) -> None:
    """A handle kept as a list serves as the tuple does (DeepEP only unpacks it)."""
    chk, buffer = run.chk, run.buffer
    chk.x_equal("cached dispatch through a list handle recv_x",
                buffer.dispatch(run.me.x.to(run.dev), handle=list(handle))[0], run.expected.recv_x)
    chk.equal("combine through a list handle", buffer.combine(recv_x, list(handle))[0].cpu(),
              buffer.combine(recv_x, handle)[0].cpu())


def check_dtypes_differing_between_ranks_are_refused(run: ArgumentSemanticsRun, handle: tuple) -> None:
    """Ranks passing rows of different dtypes (same hidden, same element size) are refused together, naming
    both; a cached dispatch too where it waits for the host (the reference transport: the NVLink one does not)."""
    chk, buffer = run.chk, run.buffer
    odd = run.me.x.view(torch.int16).to(torch.int32 if run.rank == 0 else torch.float32).to(run.dev)
    calls = {"dispatch": lambda: buffer.dispatch(odd, **run.layout)}
    if buffer.transport_name == "reference":
        calls["cached dispatch"] = lambda: buffer.dispatch(odd, handle=handle)
    for what, call in calls.items():
        try:
            call()
            chk.fail(f"{what}: dtypes differing between ranks", "nothing was raised")
        except ValueError as error:
            chk.true(f"{what}: dtypes differing between ranks: the message names them",
                     all(part in str(error) for part in ("dtype is torch.", "torch.int32", "torch.float32")),
                     str(error))


def check_strided_top1_combine_weights(run: ArgumentSemanticsRun, recv_x: torch.Tensor, handle: tuple) -> None:
    """Combine weights of top-k 1 whose one column has a stride other than 1 (contiguous all the same) combine
    as a dense copy of them does."""
    buffer, dev = run.buffer, run.dev
    num_recv = recv_x.shape[0]
    column = torch.rand(num_recv, generator=generator(run.seed, "column", run.rank)).reshape(1, num_recv).t()
    got = buffer.combine(recv_x, handle, topk_weights=column.to(dev))[1]
    same = buffer.combine(recv_x, handle, topk_weights=column.reshape(-1).clone().view(num_recv, 1).to(dev))[1]
    run.chk.equal("combined top-k 1 weights of a strided column", got.cpu(), same.cpu())


def run_argument_semantics(ctx, seed: int, case: NormalCase) -> List[str]:
    """Caller-supplied counts, ignored arguments of a cached dispatch, list handles, dtypes differing between
    ranks and strided combine weights, in that order on one Buffer; returns the mismatches."""
    run = start_argument_semantics(ctx, seed, case)
    padded = check_expert_list_sums_the_callers_counts(run)
    recv_x, handle = padded[0], padded[4]
    check_cached_dispatch_ignores_layout_arguments(run, handle)
    check_list_handle_serves_as_the_tuple(run, recv_x, handle)
    check_dtypes_differing_between_ranks_are_refused(run, handle)
    check_strided_top1_combine_weights(run, recv_x, handle)
    run.buffer.destroy()
    return run.chk.errors


def test_dispatch_argument_semantics(pool):
    """Caller-supplied per-expert counts make the count list; a cached dispatch ignores the layout arguments."""
    seed = base_seed()
    case = NormalCase(name="argument-semantics", tokens=[17, 9], hidden=128, topk=4, experts_per_rank=3,
                      mask_frac=0.1)
    report_mismatches(seed, lambda: pool(2).run(run_argument_semantics, seed, case))


# ---------------------------------------------------------------------------------------------------
# the model itself, on hand-made cases (no library involved)
# ---------------------------------------------------------------------------------------------------
def _src(idx, num_experts, num_ranks, ranks_per_node=None, hidden=8):
    idx = torch.tensor(idx, dtype=torch.int64).reshape(-1, len(idx[0]) if idx else 2)
    x = torch.arange(idx.size(0) * hidden, dtype=torch.float32).reshape(-1, hidden).to(torch.bfloat16)
    w = torch.arange(1, idx.numel() + 1, dtype=torch.float32).reshape(idx.shape)
    return model.Source(x, idx, w, model.layout(idx, num_experts, num_ranks, ranks_per_node))


def test_model_handmade_intranode():
    # R=2, E=4 (2 per rank), K=2, C=2
    s0 = _src([[0, 3], [1, -1], [-1, -1]], 4, 2)
    s1 = _src([[2, 2], [3, 0]], 4, 2)
    assert s0.layout.num_tokens_per_rank.tolist() == [2, 1]
    assert s0.layout.num_tokens_per_expert.tolist() == [1, 1, 0, 1]
    assert s0.layout.is_token_in_rank.tolist() == [[True, True], [True, False], [False, False]]
    assert s0.layout.num_tokens_per_rdma_rank is None
    assert s1.layout.num_tokens_per_expert.tolist() == [1, 0, 2, 1]
    assert s1.layout.num_tokens_per_rank.tolist() == [1, 2]

    r0 = model.dispatch([s0, s1], 0, 4, num_channels=2)
    assert r0.rows == [(0, 0), (0, 1), (1, 1)]
    assert r0.recv_topk_idx.tolist() == [[0, -1], [1, -1], [-1, 0]]
    assert r0.recv_topk_weights.tolist() == [[1, 0], [3, 0], [0, 4]]
    assert r0.num_recv_tokens_per_expert_list == [2, 1]
    assert torch.equal(r0.recv_x, torch.stack([s0.x[0], s0.x[1], s1.x[1]]))
    h = r0.handle
    assert h["rank_prefix_matrix"].tolist() == [[2, 1], [3, 3]]
    assert h["channel_prefix_matrix"].tolist() == [[2, 2], [1, 1]]        # rank 0: tokens 0,1 | 2
    assert h["recv_channel_prefix_matrix"].tolist() == [[0, 2], [0, 0]]
    assert h["recv_src_idx"].tolist() == [0, 1, 1]
    assert h["send_head"].tolist() == [[0, 0], [1, -1], [-1, -1]]
    assert model.dispatch([s0, s1], 0, 4, num_channels=2, expert_alignment=4).num_recv_tokens_per_expert_list == [4, 4]

    r1 = model.dispatch([s0, s1], 1, 4, num_channels=2)
    assert r1.rows == [(0, 0), (1, 0), (1, 1)]
    assert r1.recv_topk_idx.tolist() == [[-1, 1], [0, 0], [1, -1]]
    assert r1.num_recv_tokens_per_expert_list == [2, 2]
    assert r1.handle["channel_prefix_matrix"].tolist() == [[0, 1], [1, 2]]  # rank 1: token 0 | 1
    assert r1.handle["recv_channel_prefix_matrix"].tolist() == [[0, 1], [0, 1]]
    assert r1.handle["send_head"].tolist() == [[-1, 0], [0, 1]]

    # combine on rank 0: token 0 <- ranks 0, 1; token 1 <- rank 0; token 2 <- nobody (bias only)
    bf = lambda v: torch.tensor(v, dtype=torch.float32).to(torch.bfloat16)  # noqa: E731
    big = 2.0 ** 24
    y0 = bf([[1.0], [5.0], [7.0]])
    y1 = bf([[3.0], [-1.0], [2.0]])
    b0, b1 = bf([[big], [0.5], [2.0]]), bf([[-big], [0.25], [-8.0]])
    out, _ = model.combine(0, s0.layout.is_token_in_rank, [r0.rows, r1.rows], [y0, y1], bias=(b0, b1))
    # (b0 + b1) first, then ranks ascending: big - big + 1 + 3 = 4 (adding 1 to big first would lose it)
    assert out.float().flatten().tolist() == [4.0, 5.75, -6.0]
    out, _ = model.combine(0, s0.layout.is_token_in_rank, [r0.rows, r1.rows], [y0, y1])
    assert out.float().flatten().tolist() == [1.0 + 3.0, 5.0, 0.0]  # (0, 0) is row 0 of both ranks
    w0 = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    w1 = torch.tensor([[10.0, 20.0], [30.0, 40.0], [50.0, 60.0]])
    _, out_w = model.combine(0, s0.layout.is_token_in_rank, [r0.rows, r1.rows], [y0, y1], [w0, w1])
    assert out_w.tolist() == [[11.0, 22.0], [3.0, 4.0], [0.0, 0.0]]


def test_model_handmade_internode():
    # R=4 as 2 nodes x 2 ranks, E=4 (1 per rank), C=1
    srcs = [_src([[1, 2], [3, -1]], 4, 4, 2), _src([[0, 0]], 4, 4, 2), _src([[0, 3], [2, -1]], 4, 4, 2),
            _src([], 4, 4, 2)]
    assert srcs[0].layout.num_tokens_per_rdma_rank.tolist() == [1, 2]
    assert srcs[2].layout.num_tokens_per_rdma_rank.tolist() == [1, 2]
    assert srcs[3].layout.num_tokens_per_rdma_rank.tolist() == [0, 0]
    r2 = model.dispatch(srcs, 2, 4, num_channels=1, ranks_per_node=2)
    assert r2.rows == [(0, 0), (2, 1)]
    h = r2.handle
    assert h["rdma_channel_prefix_matrix"].tolist() == [[1], [2]]
    assert h["gbl_channel_prefix_matrix"].tolist() == [[1], [0], [1], [1]]
    assert h["recv_rdma_channel_prefix_matrix"].tolist() == [[2], [2]]
    assert h["recv_rdma_rank_prefix_sum"].tolist() == [2, 4]
    assert h["recv_gbl_channel_prefix_matrix"].tolist() == [[0], [1], [1], [2]]
    assert h["recv_gbl_rank_prefix_sum"].tolist() == [1, 1, 2, 2]
    assert h["recv_src_meta"].view(torch.int32).tolist() == [[0, 1], [1, 1]]
    assert h["send_rdma_head"].tolist() == [[0, 0], [-1, 1]]
    assert h["send_nvl_head"].tolist() == [[0, -1], [-1, 0], [-1, 0], [0, -1]]
    assert r2.num_rdma_recv_tokens == 4
    assert r2.recv_topk_idx.tolist() == [[-1, 0], [0, -1]]

    # two-level rounding: rank 0's token -> rank 1 (node 0) and ranks 2, 3 (node 1)
    s = _src([[1, 2, 3]], 4, 4, 2)
    rows = [[], [(0, 0)], [(0, 0)], [(0, 0)]]
    bf = lambda v: torch.tensor([[v]], dtype=torch.float32).to(torch.bfloat16)  # noqa: E731
    ys = [bf(0.0)[:0], bf(1.0), bf(256.0), bf(1.0)]
    out, _ = model.combine(0, s.layout.is_token_in_rank, rows, ys, ranks_per_node=2)
    assert out.item() == 256.0  # bf16(1 + bf16(256 + 1)) = bf16(1 + 256); one level would give 258
    out, _ = model.combine(0, s.layout.is_token_in_rank, rows, ys)
    assert out.item() == 258.0
