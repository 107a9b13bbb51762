"""The NVLink low-latency path on the GPU machine (skipped elsewhere).

Run with `DEEP_EP_TEST_DEVICE=cuda python -m pytest tests/test_nvlink_low_latency.py`. Ranks share the GPUs
when there are more ranks than GPUs (gloo control plane, CUDA IPC between the processes). On GPUs,
tests/test_low_latency.py also runs on this path ("auto" picks it) against the model; these tests add the
bitwise comparison with the reference transport at decode shapes, 8 ranks, CUDA-graph replays with
changing routing, hooks called from another thread, and the errors found on the GPU.
"""
import time
from dataclasses import replace
from typing import Any, Callable, Dict, List

import pytest
import torch

from cases import LowLatencyShape
from compare import assert_no_wrong_tokens, record_difference, report_mismatches
from dist_utils import outcome, run_on_another_thread
from inputs import LOW_LATENCY_ROUTING, make_octave_spread_x, make_routing
from randomness import base_seed, generator

pytestmark = [pytest.mark.gpu, pytest.mark.nvlink_kernels]


def _valid_rows(t: torch.Tensor, counts: List[int]) -> List[torch.Tensor]:
    return [t[e, :c] for e, c in enumerate(counts)]


def _tokens(shape: LowLatencyShape, rank: int) -> int:
    """Tokens of a rank: the shape's list, repeated over more ranks; rank 3 has none."""
    return 0 if rank == 3 else shape.tokens[rank % len(shape.tokens)]


def _expert_outputs(seed: int, key: Any, rows: int, hidden: int, device, logfmt: bool) -> torch.Tensor:
    """bf16 expert outputs, made on the GPU (decode shapes have hundreds of MB of them): values over
    2^-16..2^16 (fp32 sums of a few are inexact, so the order shows in the bits), or for LogFMT rows of
    mostly |x| < 1 (encoded chunks) and some larger ones (sent as BF16)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(generator(seed, key).initial_seed())
    if logfmt:
        choice = torch.randint(4, (rows, 1), generator=gen, device=device)
        scale = torch.tensor([0.02, 0.2, 0.6, 3.0], device=device)[choice]
    else:
        scale = torch.exp2(torch.randint(-16, 17, (rows, hidden), generator=gen, device=device).float())
    return (torch.randn((rows, hidden), generator=gen, device=device) * scale).to(torch.bfloat16)


MODES = [  # (dispatch mode, combine kind, combine mode)
    ("sync", "plain", "sync"), ("hook", "out", "hook"), ("async", "zero_copy", "async"), ("sync", "logfmt", "hook")]


def _dispatch(buf, x, idx, shape, mode, cum=None, wait=None):
    out = buf.low_latency_dispatch(x, idx, shape.num_max_tokens, shape.experts, cumulative_local_expert_recv_stats=cum,
                                   dispatch_wait_recv_cost_stats=wait, use_fp8=shape.fp8, round_scale=shape.round_scale,
                                   use_ue8m0=shape.ue8m0, async_finish=mode == "async", return_recv_hook=mode == "hook")
    _complete(out[3], out[4], mode)
    return out


def _complete(event, hook, mode) -> None:
    if mode == "hook":   # from another thread, as vLLM's dual-batch overlap does
        run_on_another_thread(hook)
    elif mode == "async":
        event.current_stream_wait()


def _combine(buf, y, idx, weights, handle, kind, mode):
    out = torch.full((idx.shape[0], y.shape[2]), float("nan"), dtype=torch.bfloat16, device=y.device) \
        if kind == "out" else None
    if kind == "zero_copy":
        buf.get_next_low_latency_combine_buffer(handle).copy_(y)
        y = torch.full_like(y, float("nan"))
    combined, event, hook = buf.low_latency_combine(y, idx, weights, handle, use_logfmt=kind == "logfmt",
                                                    zero_copy=kind == "zero_copy", async_finish=mode == "async",
                                                    return_recv_hook=mode == "hook", out=out)
    _complete(event, hook, mode)
    return combined


def run_compare(ctx, seed: int, shapes: List[LowLatencyShape]) -> List[str]:
    """Low-latency dispatch and combine on the NVLink path and on the reference transport: bitwise equal."""
    from deep_ep import Buffer
    errors: List[str] = []
    R, rank = ctx.world_size, ctx.rank
    for shape in shapes:
        n, hidden, num_experts = shape.num_max_tokens, shape.hidden, shape.experts
        e_loc = num_experts // R
        hint = Buffer.get_low_latency_rdma_size_hint(n, hidden, R, num_experts)
        buffers = {label: Buffer(ctx.group, 0, hint, low_latency_mode=True, num_qps_per_rank=e_loc,
                                 transport=label, explicitly_destroy=True, timeout_s=60)
                   for label in ("nvlink", "reference")}
        for i, (dmode, ckind, cmode) in enumerate(MODES):
            name = f"rank {rank} {shape.name} round {i} ({dmode}/{ckind}/{cmode})"
            gen = generator(seed, shape.name, i, rank)
            num_tokens = _tokens(shape, rank)
            hot = generator(seed, shape.name).initial_seed() % num_experts
            idx, weights = make_routing(gen, num_tokens, shape.topk, num_experts, shape.routing, shape.mask_frac, hot,
                                        **LOW_LATENCY_ROUTING)
            x = make_octave_spread_x(gen, num_tokens, hidden).to(ctx.device)
            idx, weights = idx.to(ctx.device), weights.to(ctx.device)
            y = _expert_outputs(seed, (shape.name, i, rank), e_loc * R * n, hidden, ctx.device,
                                ckind == "logfmt").view(e_loc, R * n, hidden)
            y_again = _expert_outputs(seed, (shape.name, i, rank, "again"), e_loc * R * n, hidden, ctx.device,
                                      False).view(e_loc, R * n, hidden)
            outs = {}
            for label, buf in buffers.items():
                cum = torch.full((e_loc,), 7, dtype=torch.int32, device=ctx.device)
                recv_x, count, handle, _, _ = _dispatch(buf, x, idx, shape, dmode, cum=cum)
                combined = _combine(buf, y, idx, weights, handle, ckind, cmode)
                again = _combine(buf, y_again, idx, weights, handle, "plain", "sync")   # (the handle reused)
                torch.cuda.synchronize()
                outs[label] = (recv_x, count, handle, combined, cum, again)
            (recv_x, count, handle, combined, cum, again), (r_recv_x, r_count, r_handle, r_combined, r_cum, r_again) = \
                outs["nvlink"], outs["reference"]
            record_difference(errors, f"{name} combined again through the same handle", again, r_again)
            record_difference(errors, f"{name} recv_count", count, r_count)
            record_difference(errors, f"{name} cumulative stats", cum, r_cum)
            record_difference(errors, f"{name} layout_range", handle[1], r_handle[1])
            record_difference(errors, f"{name} src_info", handle[0], r_handle[0])
            counts = r_count.tolist()
            data, r_data = (recv_x, r_recv_x) if isinstance(recv_x, tuple) else ((recv_x,), (r_recv_x,))
            for j, (got, expected) in enumerate(zip(data, r_data)):
                for e, (g, x_) in enumerate(zip(_valid_rows(got, counts), _valid_rows(expected, counts))):
                    record_difference(errors, f"{name} recv_x[{j}] expert {e}", g, x_)
            record_difference(errors, f"{name} combined", combined, r_combined)
        for buf in buffers.values():
            buf.destroy()
    return errors


LL_SWEEP = [  # tokens 0/1/128/512/1024, hidden 2048/2880/4096/7168/8320, top-k 1/8/32, skewed, masked, dups
    LowLatencyShape(name="deepseek-decode-fp8", tokens=[128, 128], num_max_tokens=128, hidden=7168, topk=8,
                    experts=288, fp8=True),
    LowLatencyShape(name="h4096-top32-skewed-bf16", tokens=[512, 300], num_max_tokens=512, hidden=4096, topk=32,
                    experts=64, routing="skewed", mask_frac=0.1),
    LowLatencyShape(name="h2880-top1-one-token-ue8m0", tokens=[1, 0], num_max_tokens=8, hidden=2880, topk=1,
                    experts=16, fp8=True, round_scale=True, ue8m0=True),
    LowLatencyShape(name="h2048-top8-round-scale-masked", tokens=[0, 128], num_max_tokens=128, hidden=2048, topk=8,
                    experts=32, fp8=True, round_scale=True, mask_frac=0.3),
    LowLatencyShape(name="h7168-top32-duplicates-bf16", tokens=[64, 37], num_max_tokens=64, hidden=7168, topk=32,
                    experts=32, routing="dup"),
    # the most tokens
    LowLatencyShape(name="n1024-fp8", tokens=[1024, 1000], num_max_tokens=1024, hidden=2048, topk=8, experts=64,
                    fp8=True),
    # wider than 8192 and not a power of two: 65 scale groups, 17 packed ue8m0 words with one group in the last
    LowLatencyShape(name="h8320-top8-ue8m0", tokens=[32, 5], num_max_tokens=32, hidden=8320, topk=8, experts=16,
                    fp8=True, round_scale=True, ue8m0=True, mask_frac=0.1),
]
# at 4 and 8 ranks (several per GPU): the second case's top-32 skewed routing at a size their buffers hold
MANY_RANKS_TOP32 = replace(LL_SWEEP[1], name="h4096-top32-skewed-bf16-n128", tokens=[128, 100], num_max_tokens=128)


@pytest.mark.timeout(960)   # (the ranks' own limit below is 900 s)
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_ll_nvlink_matches_reference(pool, world_size):
    seed = base_seed()
    # more ranks share the GPUs here: the decode shape with N=64 keeps 8 ranks' buffers in memory
    decode = replace(LL_SWEEP[0], name="deepseek-decode-fp8-n64", tokens=[64, 64], num_max_tokens=64)
    shapes = LL_SWEEP if world_size == 2 else [decode, MANY_RANKS_TOP32] + LL_SWEEP[2:4]
    report_mismatches(seed, lambda: pool(world_size).run(run_compare, seed, shapes, timeout=900))


# ---------------------------------------------------------------------------------------------------
# CUDA graph: dispatch + combine captured once, replayed with new routing and data every time
# ---------------------------------------------------------------------------------------------------
GRAPH_REPLAYS = 10_000


class _GraphedRoundTrip:
    """Low-latency dispatch + combine of `num_tokens` tokens on this rank, captured in a CUDA graph, with its
    input and output buffers. The experts multiply by 2^(expert id mod 4) (exact in bf16, and different for
    the slots of a token), so combine(dispatch(x)) must be bf16(sum over valid k of w * 2^(id mod 4) * x) in
    the library's order."""

    def __init__(self, ctx, buffer, n: int, hidden: int, topk: int, num_experts: int, num_tokens: int, hook: bool,
                 gen: torch.Generator) -> None:
        dev = ctx.device
        self.buffer, self.n, self.topk, self.num_experts, self.hook, self.gen = buffer, n, topk, num_experts, hook, gen
        self.num_tokens, self.dev = num_tokens, dev
        experts_per_rank = num_experts // ctx.world_size
        expert_ids = torch.arange(experts_per_rank, device=dev) + ctx.rank * experts_per_rank
        self.expert_scale = torch.pow(2.0, (expert_ids % 4).float()).to(torch.bfloat16).view(-1, 1, 1)
        self.x = torch.empty((num_tokens, hidden), dtype=torch.bfloat16, device=dev)
        self.idx = torch.empty((num_tokens, topk), dtype=torch.int64, device=dev)
        self.weights = torch.empty((num_tokens, topk), dtype=torch.float32, device=dev)
        self.out = torch.empty((num_tokens, hidden), dtype=torch.bfloat16, device=dev)
        self.graph = torch.cuda.CUDAGraph()

    def refill(self) -> None:
        gen, dev = self.gen, self.dev
        self.x.copy_(torch.randn(self.x.shape, generator=gen, device=dev))
        scores = torch.rand(self.num_tokens, self.num_experts, generator=gen, device=dev)
        chosen = scores.topk(self.topk, dim=1).indices
        self.idx.copy_(torch.where(torch.rand(chosen.shape, generator=gen, device=dev) < 0.1, -1, chosen))
        self.weights.copy_(torch.randn(self.weights.shape, generator=gen, device=dev))

    def step(self) -> None:
        buffer, hook = self.buffer, self.hook
        recv_x, _, handle, _, dispatch_hook = buffer.low_latency_dispatch(self.x, self.idx, self.n, self.num_experts,
                                                                           use_fp8=False, return_recv_hook=hook)
        if hook:
            dispatch_hook()
        _, _, combine_hook = buffer.low_latency_combine(recv_x * self.expert_scale, self.idx, self.weights, handle,
                                                        out=self.out, return_recv_hook=hook)
        if hook:
            combine_hook()

    def capture(self) -> None:
        self.refill()
        self.step()   # compiles the kernels outside the capture
        torch.cuda.synchronize()
        with torch.cuda.graph(self.graph):
            self.step()

    def replay(self, wrong: torch.Tensor) -> None:
        """New inputs, a replay, and the count of wrong tokens added to `wrong` (on the GPU)."""
        self.refill()
        self.graph.replay()
        x, idx, weights = self.x, self.idx, self.weights
        acc = torch.zeros(x.shape, dtype=torch.float32, device=self.dev)
        for k in range(self.topk):
            scaled = x.float() * torch.pow(2.0, (idx[:, k:k + 1] % 4).float())
            acc = torch.where((idx[:, k] >= 0)[:, None], acc + weights[:, k:k + 1] * scaled, acc)
        wrong += (self.out != acc.to(torch.bfloat16)).any(dim=1).sum()


def _graph_buffer(ctx, n: int, hidden: int, num_experts: int):
    from deep_ep import Buffer
    return Buffer(ctx.group, 0, Buffer.get_low_latency_rdma_size_hint(n, hidden, ctx.world_size, num_experts),
                  low_latency_mode=True, transport="nvlink", explicitly_destroy=True, timeout_s=60)


def run_graph(ctx, seed: int, replays: int, hook: bool, few_tokens: bool = False) -> Dict[str, int]:
    """One captured round trip replayed `replays` times with new data and routing; mismatching tokens are
    counted on the GPU and read once at the end. `few_tokens`: 4 tokens on rank 0 and none on the others
    (without a hook, the single fused kernel)."""
    n, hidden, topk, num_experts = 64, 2048, 8, 8 * ctx.world_size
    buffer = _graph_buffer(ctx, n, hidden, num_experts)
    gen = torch.Generator(device=ctx.device)
    gen.manual_seed(seed + ctx.rank)
    num_tokens = (4 if ctx.rank == 0 else 0) if few_tokens else n - 7 * ctx.rank
    trip = _GraphedRoundTrip(ctx, buffer, n, hidden, topk, num_experts, num_tokens, hook, gen)
    trip.capture()
    wrong = torch.zeros((), dtype=torch.int64, device=ctx.device)
    for _ in range(replays):
        trip.replay(wrong)
    result = dict(wrong_tokens=int(wrong))
    buffer.destroy()
    return result


@pytest.mark.timeout(960)   # (the ranks' own limit below is 900 s)
@pytest.mark.parametrize("hook,few_tokens", [(False, False), (True, False), (False, True)],
                         ids=["plain", "hooks", "fused-few-tokens"])
def test_ll_nvlink_cuda_graph_replays(pool, hook, few_tokens):
    seed = base_seed()
    replays = GRAPH_REPLAYS if not (hook or few_tokens) else 200 if hook else 2000
    assert_no_wrong_tokens(seed, pool(2).run(run_graph, seed, replays, hook, few_tokens, timeout=900))


def run_graphs_interleaved(ctx, seed: int, replays: int) -> Dict[str, int]:
    """Several graphs on one Buffer, as serving engines capture one per batch size: a full batch, a batch of a
    few tokens (the fused kernel) and a batch with hooks, each captured once, then replayed in an order drawn
    at random (the same on every rank) with new data every time."""
    n, hidden, topk, num_experts = 64, 1024, 8, 8 * ctx.world_size
    buffer = _graph_buffer(ctx, n, hidden, num_experts)
    gen = torch.Generator(device=ctx.device)
    gen.manual_seed(seed + ctx.rank)
    trips = [_GraphedRoundTrip(ctx, buffer, n, hidden, topk, num_experts, tokens, hook, gen)
             for tokens, hook in ((n - 5 * ctx.rank, False), (3 - ctx.rank % 2, False), (17 + ctx.rank, True))]
    for trip in trips:
        trip.capture()
    order = torch.randint(len(trips), (replays,), generator=torch.Generator().manual_seed(seed)).tolist()
    wrong = torch.zeros((), dtype=torch.int64, device=ctx.device)
    for which in order:
        trips[which].replay(wrong)
    result = dict(wrong_tokens=int(wrong))
    buffer.destroy()
    return result


def test_ll_nvlink_several_graphs_on_one_buffer(pool):
    seed = base_seed()
    assert_no_wrong_tokens(seed, pool(2).run(run_graphs_interleaved, seed, 600, timeout=600))


def run_graph_between_normal_calls(ctx, seed: int, cycles: int, replays: int) -> Dict[str, int]:
    """SGLang's and lmdeploy's use of one `low_latency_mode=True` Buffer with both buffer sizes: eager
    normal-mode layout + dispatch + combine (prefill), then `clean_low_latency_buffer`, then replays of a
    low-latency graph captured once (decode), and again. The normal round trip sends small integers, so
    combine(dispatch(x)) must be exactly x times the token's number of destination ranks."""
    from deep_ep import Buffer, Config
    n, hidden, topk, num_experts = 32, 1024, 8, 8 * ctx.world_size
    num_tokens = 96 - 11 * ctx.rank
    nvl = Config(24, 8, 256).get_nvl_buffer_size_hint(hidden * 2, ctx.world_size)
    buffer = Buffer(ctx.group, nvl, Buffer.get_low_latency_rdma_size_hint(n, hidden, ctx.world_size, num_experts),
                    low_latency_mode=True, num_qps_per_rank=num_experts // ctx.world_size, transport="nvlink",
                    explicitly_destroy=True, timeout_s=60)
    gen = torch.Generator(device=ctx.device)
    gen.manual_seed(seed + ctx.rank)
    trip = _GraphedRoundTrip(ctx, buffer, n, hidden, topk, num_experts, n - 3 * ctx.rank, False, gen)
    trip.capture()
    wrong = dict(normal=torch.zeros((), dtype=torch.int64, device=ctx.device),
                 graph=torch.zeros((), dtype=torch.int64, device=ctx.device))
    for _ in range(cycles):
        x = torch.randint(-8, 9, (num_tokens, hidden), generator=gen, device=ctx.device).to(torch.bfloat16)
        scores = torch.rand(num_tokens, num_experts, generator=gen, device=ctx.device)
        idx = scores.topk(topk, dim=1).indices
        idx = torch.where(torch.rand(idx.shape, generator=gen, device=ctx.device) < 0.2, -1, idx)
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, num_experts)
        recv_x, _, _, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                     num_tokens_per_expert=per_expert, topk_idx=idx,
                                                     topk_weights=torch.ones(idx.shape, device=ctx.device))
        combined, _, _ = buffer.combine(recv_x, handle)
        expected = (x.float() * in_rank.sum(dim=1, keepdim=True).float()).to(torch.bfloat16)
        wrong["normal"] += (combined != expected).any(dim=1).sum()
        buffer.clean_low_latency_buffer(n, hidden, num_experts)
        for _ in range(replays):
            trip.replay(wrong["graph"])
    result = {f"wrong_{k}_tokens": int(v) for k, v in wrong.items()}
    buffer.destroy()
    return result


def test_ll_nvlink_graph_replays_between_normal_calls(pool):
    seed = base_seed()
    results = pool(2).run(run_graph_between_normal_calls, seed, 20, 25, timeout=600)
    for rank, r in enumerate(results):
        assert r == dict(wrong_normal_tokens=0, wrong_graph_tokens=0), f"seed {seed}: rank {rank}: {r}"


# ---------------------------------------------------------------------------------------------------
# A call on a buffer half whose last receive (a hook) was issued on another stream
# ---------------------------------------------------------------------------------------------------
def run_hook_on_another_stream(ctx, seed: int) -> List[str]:
    """Dispatch A's hook runs on stream S1 behind a long sleep; meanwhile dispatches B (the other half) and C
    (A's half) are issued on stream S2. C's send must wait for A's receive, on every rank: otherwise its rows
    and masks land in a half that A has not read yet. Every result is compared with the reference."""
    from deep_ep import Buffer
    shape = dict(N=64, hidden=1024, topk=4, experts=8)
    R = ctx.world_size
    hint = Buffer.get_low_latency_rdma_size_hint(shape["N"], shape["hidden"], R, shape["experts"])
    buffers = {label: Buffer(ctx.group, 0, hint, low_latency_mode=True, num_qps_per_rank=shape["experts"] // R,
                             transport=label, explicitly_destroy=True, timeout_s=60)
               for label in ("nvlink", "reference")}
    inputs = []
    for call in range(3):
        gen = generator(seed, "hook-on-another-stream", call, ctx.rank)
        idx, _ = make_routing(gen, shape["N"] - call, shape["topk"], shape["experts"], "uniform", 0.1, 0,
                              **LOW_LATENCY_ROUTING)
        x = make_octave_spread_x(gen, shape["N"] - call, shape["hidden"])
        inputs.append((x.to(ctx.device), idx.to(ctx.device)))
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    fast = buffers["nvlink"]
    for held in (False, True):   # the first round compiles what the second launches while S1 is held
        with torch.cuda.stream(s1):
            a = fast.low_latency_dispatch(*inputs[0], shape["N"], shape["experts"], use_fp8=False,
                                          return_recv_hook=True)
            if held:
                torch.cuda._sleep(2_000_000_000)   # about a second
            a[4]()
        with torch.cuda.stream(s2):
            b = fast.low_latency_dispatch(*inputs[1], shape["N"], shape["experts"], use_fp8=False)
            c = fast.low_latency_dispatch(*inputs[2], shape["N"], shape["experts"], use_fp8=False)
        torch.cuda.synchronize()
    errors: List[str] = []
    for name, got, (x, idx) in zip("ABC", (a, b, c), inputs):
        expected = buffers["reference"].low_latency_dispatch(x, idx, shape["N"], shape["experts"], use_fp8=False)
        record_difference(errors, f"rank {ctx.rank} dispatch {name} recv_count", got[1], expected[1])
        counts = expected[1].tolist()
        for e, (g, x_) in enumerate(zip(_valid_rows(got[0], counts), _valid_rows(expected[0], counts))):
            record_difference(errors, f"rank {ctx.rank} dispatch {name} expert {e}", g, x_)
    for buf in buffers.values():
        buf.destroy()
    return errors


def test_ll_nvlink_hook_on_another_stream(pool):
    seed = base_seed()
    report_mismatches(seed, lambda: pool(2).run(run_hook_on_another_stream, seed, timeout=300))


# ---------------------------------------------------------------------------------------------------
# enable_shrink with a rank that never calls (its process died): the others mask it and carry on
# ---------------------------------------------------------------------------------------------------
def _absent_rank_inputs(seed: int, round_: int, rank: int, n: int, hidden: int, topk: int, num_experts: int):
    gen = generator(seed, "absent-rank", round_, rank)
    idx, weights = make_routing(gen, n - rank, topk, num_experts, "uniform", 0.1, 0, **LOW_LATENCY_ROUTING)
    return make_octave_spread_x(gen, n - rank, hidden), idx, weights


def run_absent_rank(ctx, seed: int) -> List[str]:
    """The last rank constructs its Buffer and then makes no low-latency call. The others mask it: their
    dispatches receive the rows of the live ranks only (bitwise, in source-then-token order) and their
    combines sum only the selections of live experts (identity experts: the weighted sum of x, in the
    reference's fp32 order). Nothing waits for the absent rank (a wait would time out after timeout_s)."""
    from deep_ep import Buffer
    R, rank = ctx.world_size, ctx.rank
    absent = R - 1
    n, hidden, topk, num_experts = 32, 1024, 4, 4 * R
    buffer = Buffer(ctx.group, 0, Buffer.get_low_latency_rdma_size_hint(n, hidden, R, num_experts),
                    low_latency_mode=True, num_qps_per_rank=num_experts // R, enable_shrink=True, transport="nvlink",
                    explicitly_destroy=True, timeout_s=10)
    errors: List[str] = []
    try:
        if rank != absent:
            _absent_rank_rounds(ctx, seed, buffer, errors, absent, n, hidden, topk, num_experts)
            buffer.destroy()   # (waits for the live ranks only)
    finally:   # (the absent rank waits here, unbounded, until the live ones are done with its memory; a live rank
        # whose rounds failed comes straight here, and the others' destroy gives up on it after timeout_s)
        torch.distributed.barrier(group=ctx.group)
    if rank == absent:   # the test's clean-up: in its view every other rank has gone, so destroy waits for none
        for other in range(R - 1):
            buffer.low_latency_update_mask_buffer(other, True)
        buffer.destroy()
    return errors


def _absent_rank_rounds(ctx, seed: int, buffer, errors: List[str], absent: int, n: int, hidden: int, topk: int,
                        num_experts: int) -> None:
    """Three rounds of dispatch and combine on a live rank, with the absent rank masked."""
    rank, e_loc = ctx.rank, num_experts // ctx.world_size
    buffer.low_latency_update_mask_buffer(absent, True)
    for i in range(3):
        inputs = {r: _absent_rank_inputs(seed, i, r, n, hidden, topk, num_experts) for r in range(absent)}
        x, idx, weights = (t.to(ctx.device) for t in inputs[rank])
        recv_x, count, handle, _, _ = buffer.low_latency_dispatch(x, idx, n, num_experts, use_fp8=False)
        combined = buffer.low_latency_combine(recv_x, idx, weights, handle)[0]
        torch.cuda.synchronize()
        name = f"rank {rank} round {i}"
        for e in range(e_loc):   # the rows this expert gets from the live ranks, in order
            expert = rank * e_loc + e
            rows = [inputs[r][0][t] for r in range(absent) for t, k in (inputs[r][1] == expert).nonzero().tolist()]
            expected = torch.stack(rows) if rows else torch.empty(0, hidden, dtype=torch.bfloat16)
            if int(count[e]) != len(rows):
                errors.append(f"{name} expert {expert}: recv_count {int(count[e])}, expected {len(rows)}")
            else:
                record_difference(errors, f"{name} expert {expert} rows", recv_x[e, :len(rows)].cpu(), expected)
        x_cpu, idx_cpu, w_cpu = inputs[rank]
        acc = torch.zeros(x_cpu.shape, dtype=torch.float32)
        for k in range(topk):
            live = ((idx_cpu[:, k] >= 0) & (idx_cpu[:, k] // e_loc != absent)).unsqueeze(1)
            acc = torch.where(live, acc + w_cpu[:, k:k + 1] * x_cpu.float(), acc)
        record_difference(errors, f"{name} combined", combined.cpu(), acc.to(torch.bfloat16))


@pytest.mark.parametrize("world_size", [2, 4])
def test_ll_nvlink_shrink_with_an_absent_rank(pool, world_size):
    seed = base_seed()
    report_mismatches(seed, lambda: pool(world_size).run(run_absent_rank, seed, timeout=300))


# ---------------------------------------------------------------------------------------------------
# Errors found on the GPU: bad expert ids (reported at the next call), a peer that never comes
# ---------------------------------------------------------------------------------------------------
def _small_ll_buffer(ctx):
    """A 2-rank NVLink low-latency Buffer with a 3 s timeout and its inputs: 8 BF16 tokens of hidden 256, each
    to expert 0 (rank 0) and expert 5 (rank 1) of 8, weights 1. Returns (buffer, x, idx, weights, n, experts)."""
    from deep_ep import Buffer
    n, hidden, num_experts = 8, 256, 8
    buffer = Buffer(ctx.group, 0, Buffer.get_low_latency_rdma_size_hint(n, hidden, 2, num_experts),
                    low_latency_mode=True, transport="nvlink", explicitly_destroy=True, timeout_s=3)
    x = torch.randn(n, hidden, device=ctx.device).to(torch.bfloat16)
    idx = torch.tensor([[0, 5]] * n, dtype=torch.int64, device=ctx.device)
    weights = torch.ones((n, 2), dtype=torch.float32, device=ctx.device)
    return buffer, x, idx, weights, n, num_experts


def _seconds_until_done(calls: Callable[[], Any]) -> str:
    """How long `calls()` and the GPU work it queued take, in seconds (as a string a rank can return)."""
    start = time.monotonic()
    calls()
    torch.cuda.synchronize()
    return f"{time.monotonic() - start:.3f}"


def _next_dispatch_outcome(buffer, x: torch.Tensor, idx: torch.Tensor, n: int, num_experts: int) -> str:
    """What the next low-latency dispatch comes to: "no error" or the CommTimeoutError it raises."""
    import deep_ep
    return outcome(lambda: buffer.low_latency_dispatch(x, idx, n, num_experts, use_fp8=False), deep_ep.CommTimeoutError)


def run_ll_errors(ctx) -> Dict[str, str]:
    out: Dict[str, str] = {}
    buffer, x, idx, weights, n, num_experts = _small_ll_buffer(ctx)
    bad = idx.clone()
    if ctx.rank == 1:
        bad[3, 1] = num_experts + 5
    recv_x, _, handle, _, _ = buffer.low_latency_dispatch(x, bad, n, num_experts, use_fp8=False)
    torch.cuda.synchronize()
    if ctx.rank == 1:   # its next call raises before it sends anything (rank 0 skips that combine too)
        out["bad_expert"] = outcome(lambda: buffer.low_latency_combine(recv_x, bad, weights, handle), ValueError)
    recv_x, _, handle, _, _ = buffer.low_latency_dispatch(x, idx, n, num_experts, use_fp8=False)
    combined = buffer.low_latency_combine(recv_x, idx, weights, handle)[0]
    out["after"] = str(bool(torch.equal(combined, (2 * x.float()).to(torch.bfloat16))))
    if ctx.rank == 0:   # rank 1 never comes: rank 0's receive gives up after timeout_s
        def two_dispatches() -> None:
            buffer.low_latency_dispatch(x, idx, n, num_experts, use_fp8=False)
            # queued behind it before the host has seen the timeout: its waits give up soon after they begin
            buffer.low_latency_dispatch(x, idx, n, num_experts, use_fp8=False)
        out["two_queued_seconds"] = _seconds_until_done(two_dispatches)
        out["timeout"] = _next_dispatch_outcome(buffer, x, idx, n, num_experts)
    return out


def test_ll_nvlink_errors(pool):
    results = pool(2).run_then_restart(run_ll_errors, timeout=120)   # (rank 0's Buffer is broken after the timeout)
    assert results[1]["bad_expert"].startswith("ValueError") and "13" in results[1]["bad_expert"] \
        and "topk_idx" in results[1]["bad_expert"], results[1]["bad_expert"]
    for rank, r in enumerate(results):
        assert r["after"] == "True", f"rank {rank}: wrong result after the refused call"
    timeout = results[0]["timeout"]
    assert timeout.startswith("CommTimeoutError") and "rank 0" in timeout and "rank 1" in timeout, timeout
    # timeout_s is 3: the first call waits it out, the one queued behind it not again
    assert float(results[0]["two_queued_seconds"]) < 4.5, results[0]["two_queued_seconds"]


def run_ll_combine_timeout(ctx) -> Dict[str, str]:
    """Both ranks dispatch, then only rank 0 combines: its receive gives up after timeout_s, and its next call
    raises CommTimeoutError naming the rank and what it waited for."""
    out: Dict[str, str] = {}
    buffer, x, idx, weights, n, num_experts = _small_ll_buffer(ctx)
    recv_x, _, handle, _, _ = buffer.low_latency_dispatch(x, idx, n, num_experts, use_fp8=False)
    torch.cuda.synchronize()
    if ctx.rank == 0:
        out["seconds"] = _seconds_until_done(lambda: buffer.low_latency_combine(recv_x, idx, weights, handle))
        out["timeout"] = _next_dispatch_outcome(buffer, x, idx, n, num_experts)
    return out


def test_ll_nvlink_combine_timeout_names_the_peer(pool):
    results = pool(2).run_then_restart(run_ll_combine_timeout, timeout=120)   # (rank 0's Buffer is broken)
    timeout = results[0]["timeout"]
    assert timeout.startswith("CommTimeoutError") and "rank 0" in timeout and "rank 1" in timeout \
        and "low-latency" in timeout, timeout
    assert 2.5 < float(results[0]["seconds"]) < 30, results[0]["seconds"]


def run_timeout_seen_by_destroy_or_clean(ctx) -> Dict[str, str]:
    """Rank 0 dispatches alone (rank 1 makes no call), so its GPU wait times out; no later call reports it.
    `destroy()` must see it and release locally (no barrier with a rank that is not coming), and
    `clean_low_latency_buffer()` must name the awaited rank instead of timing out in its barrier."""
    import torch.distributed as dist
    from deep_ep import Buffer
    out: Dict[str, str] = {}
    n, hidden, num_experts = 8, 256, 8
    size = Buffer.get_low_latency_rdma_size_hint(n, hidden, 2, num_experts)
    x = torch.randn(n, hidden, device=ctx.device).to(torch.bfloat16)
    idx = torch.tensor([[0, 5]] * n, dtype=torch.int64, device=ctx.device)
    for step in ("destroy", "clean"):
        buffer = Buffer(ctx.group, 0, size, low_latency_mode=True, transport="nvlink", explicitly_destroy=True,
                        timeout_s=2)
        if ctx.rank == 0:
            buffer.low_latency_dispatch(x, idx, n, num_experts, use_fp8=False)
            torch.cuda.synchronize()
            start = time.monotonic()
            try:
                if step == "clean":
                    buffer.clean_low_latency_buffer(n, hidden, num_experts)
                buffer.destroy()
                out[step] = "no error"
            except Exception as error:  # noqa: BLE001
                out[step] = f"{type(error).__name__}: {error}"
            out[step + "_seconds"] = f"{time.monotonic() - start:.3f}"
            if step == "clean":
                buffer.destroy()
        dist.barrier(group=ctx.group)   # (rank 1 keeps its Buffer, which rank 0 wrote to, until then)
    return out


def test_ll_nvlink_timeout_seen_by_destroy_and_clean(pool):
    results = pool(2).run_then_restart(run_timeout_seen_by_destroy_or_clean, timeout=120)
    got = results[0]
    assert got["destroy"] == "no error" and float(got["destroy_seconds"]) < 1.5, got
    assert got["clean"].startswith("CommTimeoutError") and "rank 1" in got["clean"], got
    assert float(got["clean_seconds"]) < 1.5, got
