"""The NVLink transport on the GPU machine (skipped elsewhere).

Run with `DEEP_EP_TEST_DEVICE=cuda python -m pytest tests/test_nvlink.py`: 2 ranks on 2 GPUs, and 3, 4 and 8
ranks with several processes per GPU (a gloo control plane, CUDA IPC between the processes). On GPUs the
rest of the suite runs on the NVLink transport too ("auto" picks it); these tests add the comparison with
the reference transport at large shapes, small buffers (rows stream through the rings in many rounds),
8 ranks, CUDA-graph capture, a long stress run and the NVLink-specific errors.
"""
from dataclasses import replace
from typing import Dict, List, Optional, Tuple

import pytest
import torch

from cases import CASES_4, ReferenceShape, random_normal_cases
from compare import assert_no_wrong_tokens, record_difference, report_mismatches
from dist_utils import run_script
from inputs import make_routing, make_x, to_device, wide_random
from normal_mode import run_cases
from randomness import base_seed, generator

pytestmark = [pytest.mark.gpu, pytest.mark.nvlink_kernels]


# ---------------------------------------------------------------------------------------------------
# NVLink against the reference transport, same inputs, same group
# ---------------------------------------------------------------------------------------------------
def _inputs(seed: int, shape: ReferenceShape, rank: int, device):
    """This rank's (BF16 x, FP8 x, top-k ids, top-k weights, bias) of `shape`, on `device`."""
    gen = generator(seed, shape.name, rank)
    num_tokens, num_experts = shape.tokens[rank], shape.experts
    hot_expert = int(generator(seed, shape.name).initial_seed() % num_experts)
    idx, weights = make_routing(gen, num_tokens, shape.topk, num_experts, shape.routing, shape.mask_frac, hot_expert)
    x = make_x(gen, num_tokens, shape.hidden, "bf16")
    x_fp8 = make_x(gen, num_tokens, shape.hidden, "fp8_col")
    bias = torch.randn(num_tokens, shape.hidden, generator=gen).to(torch.bfloat16)
    move = lambda t: t.to(device)  # noqa: E731
    return move(x), tuple(map(move, x_fp8)), move(idx), move(weights), move(bias)


def _fresh(seed: int, shape: ReferenceShape, rank: int, what: str, *size: int, device, kind: str = "wide"):
    """Inputs drawn after the dispatch (the same on both transports): `wide` rows whose fp32 sums show the
    summation order, `weights`, or x of a make_x kind."""
    gen = generator(seed, shape.name, rank, what)
    if kind == "wide":
        return wide_random(gen, *size).to(device)
    if kind == "weights":
        return torch.rand(*size, generator=gen).to(device)
    return to_device(make_x(gen, size[0], size[1], kind), device)


def run_compare(ctx, seed: int, shapes: List[ReferenceShape], num_nvl_bytes: Optional[int] = None) -> List[str]:
    """Every normal-mode operation on the NVLink transport and on the reference transport: bitwise equal.
    Cached dispatches send new data (BF16, and FP8 with int32 scales); combines get new rows and weights
    (wide values, so that the fp32 summation order shows) and two biases, also through a num_worst_tokens
    handle, and again through the same handle with other rows. A shape with with_topk=False dispatches without
    top-k ids and weights (the layout still comes from them) and combines without weights."""
    from deep_ep import Buffer, Config
    errors: List[str] = []
    for shape in shapes:
        config = Config(shape.num_sms, 4, shape.ring_tokens)
        nvl = num_nvl_bytes or config.get_nvl_buffer_size_hint(shape.hidden * 2, ctx.world_size)
        fast = Buffer(ctx.group, nvl, 0, transport="nvlink", explicitly_destroy=True, timeout_s=60)
        ref = Buffer(ctx.group, nvl, 0, transport="reference", explicitly_destroy=True, timeout_s=60)
        x, x_fp8, idx, weights, bias = _inputs(seed, shape, ctx.rank, ctx.device)
        rank, hidden, topk = ctx.rank, shape.hidden, shape.topk
        num_tokens = x.shape[0]
        fresh = lambda what, *size, kind="wide": _fresh(seed, shape, rank, what, *size,  # noqa: E731
                                                        device=ctx.device, kind=kind)
        new_x, new_fp8 = fresh("cached x", num_tokens, hidden, kind="bf16"), fresh("cached fp8", num_tokens, hidden,
                                                                                   kind="fp8_i32_col")
        biases = (bias, fresh("bias 1", num_tokens, hidden))
        name = f"rank {rank} {shape.name}"
        layouts = [b.get_dispatch_layout(idx, shape.experts)[:4] for b in (fast, ref)]
        for i, field in enumerate(("num_tokens_per_rank", "num_tokens_per_rdma_rank", "num_tokens_per_expert",
                                   "is_token_in_rank")):
            record_difference(errors, f"{name} layout {field}", layouts[0][i], layouts[1][i])
        per_rank, _, per_expert, in_rank = layouts[1]
        with_topk = shape.with_topk
        kwargs = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                      topk_idx=idx if with_topk else None, topk_weights=weights if with_topk else None, config=config,
                      expert_alignment=shape.alignment)
        worst_rows = sum(shape.tokens) + 3
        outs = {}
        for label, b in (("fast", fast), ("ref", ref)):
            bf16 = b.dispatch(x, **kwargs)
            fp8 = b.dispatch(x_fp8, **kwargs)
            cached = b.dispatch(new_x, handle=bf16[4], config=config)
            cached_fp8 = b.dispatch(new_fp8, handle=bf16[4], config=config)
            worst = b.dispatch(x_fp8, num_worst_tokens=worst_rows, **kwargs)
            outs[label] = dict(bf16=bf16, fp8=fp8, cached=cached, cached_fp8=cached_fp8, worst=worst)
        num_recv = outs["ref"]["bf16"][0].shape[0]
        got, exp = outs["fast"], outs["ref"]
        # a row count that differs from the reference's on any rank: every rank skips the combines (sized by it)
        differs = torch.tensor([int(got["bf16"][0].shape[0] != num_recv)],
                               device=ctx.device if torch.distributed.get_backend(ctx.group) == "nccl" else "cpu")
        torch.distributed.all_reduce(differs, group=ctx.group)
        if int(differs):
            if got["bf16"][0].shape[0] != num_recv:
                errors.append(f"{name}: {got['bf16'][0].shape[0]} rows received, the reference {num_recv}")
            fast.destroy()
            ref.destroy()
            continue
        rows = fresh("combine rows", num_recv, hidden)
        rows_weights = fresh("combine weights", num_recv, topk, kind="weights") if with_topk else None
        other_rows = fresh("combine rows again", num_recv, hidden)
        worst_input = fresh("worst combine rows", worst_rows, hidden)
        for label, b in (("fast", fast), ("ref", ref)):
            out = outs[label]
            out["combined"] = b.combine(rows, out["bf16"][4], topk_weights=rows_weights, bias=biases, config=config)
            out["again"] = b.combine(other_rows, out["bf16"][4], config=config)
            out["worst combined"] = b.combine(worst_input, out["worst"][4], bias=bias, config=config)
        for what in ("bf16", "fp8"):
            g, e = got[what], exp[what]
            data, rdata = g[0], e[0]
            if isinstance(data, tuple):
                record_difference(errors, f"{name} {what} recv_x", data[0], rdata[0])
                record_difference(errors, f"{name} {what} recv_scales", data[1], rdata[1])
            else:
                record_difference(errors, f"{name} {what} recv_x", data, rdata)
            record_difference(errors, f"{name} {what} recv_topk_idx", g[1], e[1])
            record_difference(errors, f"{name} {what} recv_topk_weights", g[2], e[2])
            if g[3] != e[3]:
                errors.append(f"{name} {what} num_recv_tokens_per_expert_list {g[3]} vs {e[3]}")
            for i in range(6):
                record_difference(errors, f"{name} {what} handle[{i}]", g[4][i], e[4][i])
        record_difference(errors, f"{name} cached recv_x", got["cached"][0], exp["cached"][0])
        record_difference(errors, f"{name} cached fp8 recv_x", got["cached_fp8"][0][0], exp["cached_fp8"][0][0])
        record_difference(errors, f"{name} cached fp8 recv_scales", got["cached_fp8"][0][1], exp["cached_fp8"][0][1])
        for what in ("combined", "again", "worst combined"):
            record_difference(errors, f"{name} {what} x", got[what][0], exp[what][0])
            record_difference(errors, f"{name} {what} weights", got[what][1], exp[what][1])
        worst, rworst = got["worst"], exp["worst"]
        record_difference(errors, f"{name} worst recv_x", worst[0][0], rworst[0][0], rows=num_recv)
        record_difference(errors, f"{name} worst recv_scales", worst[0][1], rworst[0][1], rows=num_recv)
        record_difference(errors, f"{name} worst recv_topk_idx", worst[1], rworst[1])
        record_difference(errors, f"{name} worst recv_topk_weights", worst[2], rworst[2])
        record_difference(errors, f"{name} worst recv_src_idx", worst[4][3], rworst[4][3])
        fast.destroy()
        ref.destroy()
    return errors


SWEEP = [  # hidden 1024..8192, tokens 0/1/4096/8192 (uneven), top-k 1/8/32, 1024 experts a rank, no top-k
    ReferenceShape(name="deepseek-bf16-h7168-top8-rank1-empty", tokens=[4096, 0], hidden=7168, topk=8, experts=256,
                   num_sms=24),
    ReferenceShape(name="h2880-top32-one-token", tokens=[1, 4096], hidden=2880, topk=32, experts=64, num_sms=24,
                   mask_frac=0.2),
    ReferenceShape(name="h4096-top1-8192-tokens", tokens=[8192, 8192], hidden=4096, topk=1, experts=16, num_sms=16),
    ReferenceShape(name="h1024-top8-tiny", tokens=[0, 1], hidden=1024, topk=8, experts=32, num_sms=8),
    ReferenceShape(name="h8192-skewed-align128", tokens=[4096, 3000], hidden=8192, topk=8, experts=64, num_sms=24,
                   routing="skewed", alignment=128),
    ReferenceShape(name="h1024-top32-masked-8192", tokens=[8192, 17], hidden=1024, topk=32, experts=128, num_sms=20,
                   mask_frac=0.3),
    ReferenceShape(name="h1024-1024-experts-per-rank", tokens=[600, 1500], hidden=1024, topk=8, experts=2048,
                   num_sms=12, mask_frac=0.1),
    ReferenceShape(name="h2048-no-topk-skewed", tokens=[900, 0], hidden=2048, topk=6, experts=64, num_sms=10,
                   routing="skewed", with_topk=False),
]

# Rings of a few rows: every (source, channel) streams in many rounds of flow control.
SMALL_RINGS = [
    ReferenceShape(name="small-rings-bf16", tokens=[700, 513, 300, 0], hidden=2048, topk=8, experts=32, num_sms=4,
                   ring_tokens=16, mask_frac=0.1),
    ReferenceShape(name="small-rings-skewed", tokens=[64, 900, 1, 450], hidden=1024, topk=4, experts=16, num_sms=8,
                   ring_tokens=8, routing="skewed"),
    # only the first half of the ranks receive anything
    ReferenceShape(name="small-rings-first-half", tokens=[300, 77, 0, 200], hidden=1024, topk=4, experts=16,
                   num_sms=4, ring_tokens=8, routing="first_half", mask_frac=0.1),
]


def test_nvlink_matches_reference_sweep(pool):
    seed = base_seed()
    report_mismatches(seed, lambda: pool(2).run(run_compare, seed, SWEEP))


@pytest.mark.parametrize("world_size", [2, 4])
def test_nvlink_small_rings_match_reference(pool, world_size):
    seed = base_seed()
    shapes = [replace(s, tokens=s.tokens[:world_size]) for s in SMALL_RINGS]
    report_mismatches(seed, lambda: pool(world_size).run(run_compare, seed, shapes))


def run_compare_staged(ctx, seed: int, shapes: List[ReferenceShape], stage_tokens: List[int]) -> List[str]:
    """run_compare with a buffer that every share fits (the direct protocol), this rank's direct kernels
    copying out or reducing what has arrived after every stage_tokens[rank] tokens (rows per peer) they push
    (0: after all); the ranks' stages may differ. Also checks that the direct dispatch and combine ran."""
    from deep_ep.transport.nvlink import settings
    from deep_ep.transport.nvlink.normal import NVLinkNormal
    launches = (NVLinkNormal._dispatch_launch, NVLinkNormal._combine_launch)
    direct: Dict[str, List[bool]] = {"dispatch": [], "combine": []}

    def spy(kind: str, make_launch):
        def launch(self, is_direct, *args):
            direct[kind].append(is_direct)
            return make_launch(self, is_direct, *args)
        return launch

    saved, settings.STAGE_TOKENS = settings.STAGE_TOKENS, stage_tokens[ctx.rank]
    NVLinkNormal._dispatch_launch, NVLinkNormal._combine_launch = spy("dispatch", launches[0]), spy("combine",
                                                                                                   launches[1])
    try:
        errors = run_compare(ctx, seed, shapes, num_nvl_bytes=1 << 30)
    finally:
        settings.STAGE_TOKENS, (NVLinkNormal._dispatch_launch, NVLinkNormal._combine_launch) = saved, launches
    errors += [f"rank {ctx.rank}: no {kind} used the direct protocol" for kind, flags in direct.items()
               if True not in flags]
    return errors


@pytest.mark.parametrize("world_size", [2, 4])
def test_nvlink_staged_direct_protocol_matches_reference(pool, world_size):
    """The direct dispatch and combine copying out or reducing rows between stages of their pushes
    (DEEP_EP_NVLINK_STAGE_TOKENS): stages of 1 to 16 tokens and one stage, different on every rank, against the
    reference."""
    seed = base_seed()
    shapes = SWEEP if world_size == 2 else SMALL_RINGS
    report_mismatches(seed, lambda: pool(world_size).run(run_compare_staged, seed, shapes, [1, 7, 0, 16][:world_size]))


# 3 and 8 ranks (several per GPU): the sweep's kinds of case at sizes that many ranks' buffers hold at once, and
# rings of a few rows (every (source, channel) in many rounds of flow control) with tokens that list an expert
# twice; 48 experts divide among 3 and 8 ranks, and one rank has no tokens
MANY_RANKS = [
    ReferenceShape(name="many-ranks-h7168-top8", tokens=[1024, 0, 517, 1, 300, 64, 999, 128], hidden=7168, topk=8,
                   experts=48, num_sms=24),
    ReferenceShape(name="many-ranks-h2880-top32-skewed-masked", tokens=[200, 1, 0, 333, 64, 512, 7, 90], hidden=2880,
                   topk=32, experts=48, num_sms=16, routing="skewed", mask_frac=0.2),
    ReferenceShape(name="many-ranks-small-rings-dup", tokens=[300, 0, 77, 450, 1, 128, 64, 200], hidden=1024, topk=4,
                   experts=48, num_sms=4, ring_tokens=8, routing="dup", mask_frac=0.1),
    ReferenceShape(name="many-ranks-no-topk", tokens=[50, 333, 0, 120, 7, 256, 90, 1], hidden=512, topk=3, experts=48,
                   num_sms=6, mask_frac=0.2, with_topk=False),
]


@pytest.mark.parametrize("world_size", [3, 8])
def test_nvlink_matches_reference_many_ranks(pool, world_size):
    seed = base_seed()
    shapes = [replace(s, tokens=s.tokens[:world_size]) for s in MANY_RANKS]
    report_mismatches(seed, lambda: pool(world_size).run(run_compare, seed, shapes))


@pytest.mark.parametrize("world_size", [3, 8])
def test_nvlink_matches_model(pool, world_size):
    """3 and 8 ranks on 2 GPUs (2 and 4 processes per GPU), against the independent model."""
    seed = base_seed()
    cases = random_normal_cases(seed, world_size, 3)
    if world_size == 8:
        cases += [replace(c, name=c.name.replace("4r", "8r"), tokens=list(c.tokens) * 2) for c in CASES_4[:2]]
    report_mismatches(seed, lambda: pool(world_size).run(run_cases, seed, cases, None, "nvlink"))


# ---------------------------------------------------------------------------------------------------
# Ranks agree on the protocol (direct or rings) when only some pass num_worst_tokens or rebuild a handle
# ---------------------------------------------------------------------------------------------------
def run_protocol_agreement(ctx, seed: int, transport: str = "nvlink") -> List[str]:
    from deep_ep import Buffer, Config
    errors: List[str] = []
    shape = ReferenceShape(name="agreement", tokens=[300, 211, 97, 0][:ctx.world_size], hidden=1024, topk=8,
                           experts=32)
    config = Config(8, 4, 256)
    fast = Buffer(ctx.group, 1 << 28, 0, transport=transport, explicitly_destroy=True, timeout_s=60)
    ref = Buffer(ctx.group, 1 << 28, 0, transport="reference", explicitly_destroy=True, timeout_s=60)
    x, _, idx, weights, _ = _inputs(seed, shape, ctx.rank, ctx.device)
    per_rank, _, per_expert, in_rank = ref.get_dispatch_layout(idx, shape.experts)[:4]
    kwargs = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  topk_idx=idx, topk_weights=weights, config=config)
    worst = sum(shape.tokens) if ctx.rank == 0 else 0   # only rank 0 skips the count wait
    outs = {}
    for label, b in (("fast", fast), ("ref", ref)):
        mixed = b.dispatch(x, num_worst_tokens=worst, **kwargs)
        mixed_combined = b.combine(mixed[0], mixed[4], topk_weights=mixed[2], config=config)[0]
        plain = b.dispatch(x, **kwargs)
        handle = plain[4]
        if ctx.rank == 0:   # a handle rebuilt from copies of its tensors: its plan is derived afresh
            handle = tuple(t.clone() for t in handle)
        cached = b.dispatch(x, handle=handle, config=config)[0]
        combined = b.combine(plain[0], handle, topk_weights=plain[2], config=config)[0]
        outs[label] = (mixed, mixed_combined, cached, combined)
    (mixed, mixed_combined, cached, combined), (rmixed, rmixed_combined, rcached, rcombined) = outs["fast"], outs["ref"]
    name = f"rank {ctx.rank}"
    record_difference(errors, f"{name} mixed num_worst_tokens recv_x", mixed[0], rmixed[0], rows=rcached.shape[0])
    record_difference(errors, f"{name} mixed num_worst_tokens recv_topk_idx", mixed[1], rmixed[1])
    record_difference(errors, f"{name} mixed num_worst_tokens combine", mixed_combined, rmixed_combined)
    record_difference(errors, f"{name} rebuilt handle cached recv_x", cached, rcached)
    record_difference(errors, f"{name} rebuilt handle combine", combined, rcombined)
    fast.destroy()
    ref.destroy()
    return errors


@pytest.mark.parametrize("world_size", [2, 4])
def test_nvlink_ranks_agree_on_protocol(pool, world_size):
    seed = base_seed()
    report_mismatches(seed, lambda: pool(world_size).run(run_protocol_agreement, seed))


# ---------------------------------------------------------------------------------------------------
# "auto" picks the NVLink transport on the GPU machine
# ---------------------------------------------------------------------------------------------------
def run_auto(ctx) -> str:
    from deep_ep import Buffer
    buffer = Buffer(ctx.group, 1 << 24, 0, explicitly_destroy=True)
    name = buffer.transport_name
    buffer.destroy()
    small = Buffer(ctx.group, 0, 0, explicitly_destroy=True)   # no NVLink buffer: the reference transport
    assert small.transport_name == "reference", small.transport_name
    small.destroy()
    return name


def test_auto_picks_nvlink_on_one_node(pool):
    assert pool(2).run(run_auto) == ["nvlink", "nvlink"]


# ---------------------------------------------------------------------------------------------------
# Memory: destroy() and dropping a Buffer give its GPU memory back at once
# ---------------------------------------------------------------------------------------------------
def run_buffer_memory(ctx, destroy: bool = True) -> Tuple[int, int]:
    """(bytes a Buffer holds, bytes still held once it is gone) on this rank's device, after normal and
    low-latency calls (with receive hooks, the last one never called): gone means destroy(), or with
    `destroy=False` its last reference dropped while Python's cycle collector is off (one rank: with peers, a
    dropped buffer stays until the peers drop theirs)."""
    import gc
    from deep_ep import Buffer
    T, H, E = 16, 1024, 8 * ctx.world_size
    gen = generator(base_seed(), "buffer memory", ctx.rank)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(ctx.device)
    topk_idx, topk_weights = to_device(make_routing(gen, T, 2, E), ctx.device)
    torch.cuda.synchronize(ctx.device)
    before = torch.cuda.memory_allocated(ctx.device)
    gc.disable()
    try:
        buffer = Buffer(ctx.group, 1 << 26, Buffer.get_low_latency_rdma_size_hint(T, H, ctx.world_size, E),
                        low_latency_mode=True, num_qps_per_rank=8, explicitly_destroy=destroy, transport="nvlink")
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
        received = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                   num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights)
        buffer.combine(received[0], received[4], received[2])
        recv_x, _, handle, _, hook = buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False,
                                                                 return_recv_hook=True)
        hook()
        _, _, hook = buffer.low_latency_combine(recv_x, topk_idx, topk_weights, handle, return_recv_hook=True)
        hook()
        unheard = buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False, return_recv_hook=True)
        torch.cuda.synchronize(ctx.device)
        held = torch.cuda.memory_allocated(ctx.device) - before
        del received, recv_x, handle, hook, unheard   # (the last dispatch's hook is never called)
        if destroy:
            buffer.destroy()
        del buffer
        return held, torch.cuda.memory_allocated(ctx.device) - before
    finally:
        gc.enable()


@pytest.mark.parametrize("world_size", [2, 3])
def test_nvlink_destroy_frees_the_gpu_memory(pool, world_size):
    """destroy() gives the NVLink and low-latency buffers back at once, with peers that opened them through
    CUDA IPC."""
    for rank, (held, left) in enumerate(pool(world_size).run(run_buffer_memory)):
        assert held >= 1 << 26 and left < 1 << 20, f"rank {rank}: held {held} bytes, {left} after destroy()"


def test_nvlink_one_rank_buffer_frees_its_memory_and_exits_quietly(tmp_path):
    """One-rank NVLink Buffers in one process: destroy() frees the memory (twice), so does dropping a Buffer
    without destroy() (no cycle keeps it), and the process exits without PyTorch reporting CUDA IPC shares
    that nobody released."""
    import textwrap
    script = tmp_path / "one_rank.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist
        from dist_utils import RankContext
        from test_nvlink import run_buffer_memory
        torch.cuda.set_device(0)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        ctx = RankContext(0, 1, dist.group.WORLD, torch.device("cuda", 0))
        for destroy in (True, True, False):
            held, left = run_buffer_memory(ctx, destroy)
            assert held >= 1 << 26 and left < 1 << 20, (destroy, held, left)
        dist.destroy_process_group()
        print("ok")
    """))
    done = run_script(script, 300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
    assert "shared CUDA tensors" not in done.stderr, done.stderr[-3000:]


# ---------------------------------------------------------------------------------------------------
# Stream order: every call runs on the comm stream, so a synchronous call made right after an
# asynchronous one (without waiting for its event) still runs after it
# ---------------------------------------------------------------------------------------------------
def run_async_then_sync(ctx, seed: int, rounds: int) -> List[str]:
    from deep_ep import Buffer, Config
    num_tokens, hidden, topk, num_experts = 2048, 2048, 8, 32
    config = Config(8, 4, 64)
    buffer = Buffer(ctx.group, 1 << 26, 0, transport="nvlink", explicitly_destroy=True, timeout_s=60)
    errors: List[str] = []
    for i in range(rounds):
        gen = generator(seed, "async-then-sync", i, ctx.rank)
        idx, weights = make_routing(gen, num_tokens, topk, num_experts, "skewed" if i % 2 else "uniform", 0.1)
        x = make_x(gen, num_tokens, hidden, "bf16").to(ctx.device)
        idx, weights = idx.to(ctx.device), weights.to(ctx.device)
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, num_experts, async_finish=True)
        recv_x, _, _, _, handle, _ = buffer.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=idx, topk_weights=weights, config=config, async_finish=True)
        again = buffer.dispatch(x, handle=handle, config=config, async_finish=True)[0]
        combined = buffer.combine(again, handle, config=config)[0]       # synchronous, no event waited for
        # the synchronous combine made this stream wait for the comm stream, so in_rank is complete here
        expected = (x.float() * in_rank.sum(1, keepdim=True).float()).to(torch.bfloat16)
        if not torch.equal(combined, expected):
            errors.append(f"rank {ctx.rank} round {i}: combine after asynchronous calls differs from x times "
                          "the number of destination ranks")
            break
    buffer.destroy()
    return errors


def test_nvlink_async_then_sync_keeps_stream_order(pool):
    seed = base_seed()
    report_mismatches(seed, lambda: pool(2).run(run_async_then_sync, seed, 20))


def run_compute_stream_stays_free(ctx) -> Dict[str, str]:
    """With async_finish, a call that needs no received count on the host (cached dispatch, num_worst_tokens
    dispatch, combine) neither waits on the host nor makes the compute stream wait: with the comm stream held
    up by a long sleep kernel, work queued on the compute stream after the call completes first."""
    from deep_ep import Buffer, Config
    num_tokens, hidden, topk, num_experts = 512, 1024, 8, 32
    config = Config(8, 4, 64)
    buffer = Buffer(ctx.group, 1 << 26, 0, transport="nvlink", explicitly_destroy=True, timeout_s=60)
    gen = generator(0, "stream-free", ctx.rank)
    idx, weights = make_routing(gen, num_tokens, topk, num_experts, "uniform", 0.1)
    x = make_x(gen, num_tokens, hidden, "bf16").to(ctx.device)
    idx, weights = idx.to(ctx.device), weights.to(ctx.device)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, num_experts)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  topk_idx=idx, topk_weights=weights, config=config)
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, **layout)
    calls = {
        "cached dispatch": lambda: buffer.dispatch(x, handle=handle, config=config, async_finish=True)[-1],
        "num_worst_tokens dispatch": lambda: buffer.dispatch(x, num_worst_tokens=num_tokens * ctx.world_size,
                                                             async_finish=True, **layout)[-1],
        "combine": lambda: buffer.combine(recv_x, handle, config=config, async_finish=True)[-1],
    }
    comm = buffer.get_comm_stream()
    out: Dict[str, str] = {}
    for name, call in calls.items():
        call().current_stream_wait()   # compiled before the timed round
        torch.cuda.synchronize()
        with torch.cuda.stream(comm):
            torch.cuda._sleep(2_000_000_000)   # about a second
        event = call()
        marker = torch.cuda.Event()
        marker.record()
        marker.synchronize()
        out[name] = "comm stream still busy" if not comm.query() else "waited for the comm stream"
        event.current_stream_wait()
        torch.cuda.synchronize()
    buffer.destroy()
    return out


def test_nvlink_async_calls_leave_the_compute_stream_free(pool):
    for rank, result in enumerate(pool(2).run(run_compute_stream_stays_free)):
        for name, verdict in result.items():
            assert verdict == "comm stream still busy", f"rank {rank}: asynchronous {name}: {verdict}"


# ---------------------------------------------------------------------------------------------------
# CUDA graph: layout + num_worst_tokens dispatch + combine captured once, replayed with new inputs
# ---------------------------------------------------------------------------------------------------
def run_graph(ctx, seed: int, replays: int) -> List[str]:
    from deep_ep import Buffer, Config
    num_tokens, hidden, topk, num_experts = 256, 1024, 8, 32
    worst = num_tokens * ctx.world_size
    config = Config(8, 4, 64)
    fast = Buffer(ctx.group, 1 << 26, 0, transport="nvlink", explicitly_destroy=True, timeout_s=60)
    ref = Buffer(ctx.group, 1 << 26, 0, transport="reference", explicitly_destroy=True, timeout_s=60)
    static_x = torch.zeros(num_tokens, hidden, dtype=torch.bfloat16, device=ctx.device)
    static_idx = torch.zeros(num_tokens, topk, dtype=torch.int64, device=ctx.device)
    static_w = torch.zeros(num_tokens, topk, dtype=torch.float32, device=ctx.device)

    def step():
        per_rank, _, per_expert, in_rank, _ = fast.get_dispatch_layout(static_idx, num_experts)
        recv_x, recv_idx, recv_w, _, handle, _ = fast.dispatch(
            static_x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=static_idx, topk_weights=static_w, num_worst_tokens=worst, config=config)
        combined, combined_w, _ = fast.combine(recv_x, handle, topk_weights=recv_w, config=config)
        return recv_x, recv_idx, recv_w, handle[3], combined, combined_w

    def load(i: int):
        gen = generator(seed, "graph", i, ctx.rank)
        idx, w = make_routing(gen, num_tokens, topk, num_experts, "skewed" if i % 2 else "uniform", 0.1 * (i % 3))
        static_x.copy_(make_x(gen, num_tokens, hidden, "bf16"))
        static_idx.copy_(idx)
        static_w.copy_(w)

    load(-1)
    step()                                # compile the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            outputs = step()
    torch.cuda.current_stream().wait_stream(stream)
    errors: List[str] = []
    for i in range(replays):
        load(i)
        graph.replay()
        recv_x, recv_idx, recv_w, recv_src, combined, combined_w = outputs
        per_rank, _, per_expert, in_rank, _ = ref.get_dispatch_layout(static_idx, num_experts)
        rx, ridx, rw, _, rhandle, _ = ref.dispatch(static_x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                   num_tokens_per_expert=per_expert, topk_idx=static_idx,
                                                   topk_weights=static_w, num_worst_tokens=worst, config=config)
        rcombined, rcombined_w, _ = ref.combine(rx, rhandle, topk_weights=rw, config=config)
        rows = int(rhandle[0][-1, ctx.rank])
        name = f"rank {ctx.rank} replay {i}"
        record_difference(errors, f"{name} recv_x", recv_x, rx, rows=rows)
        record_difference(errors, f"{name} recv_topk_idx", recv_idx, ridx)
        record_difference(errors, f"{name} recv_topk_weights", recv_w, rw)
        record_difference(errors, f"{name} recv_src_idx", recv_src, rhandle[3])
        record_difference(errors, f"{name} combined", combined, rcombined)
        record_difference(errors, f"{name} combined weights", combined_w, rcombined_w)
        if errors:
            break
    del graph
    fast.destroy()
    ref.destroy()
    return errors


def test_nvlink_cuda_graph_replays(pool):
    seed = base_seed()
    report_mismatches(seed, lambda: pool(2).run(run_graph, seed, 20))


# ---------------------------------------------------------------------------------------------------
# 10,000 back-to-back iterations with changing routing
# ---------------------------------------------------------------------------------------------------
STRESS_ITERATIONS = 10_000


def run_stress(ctx, seed: int, iterations: int) -> Dict[str, int]:
    """Each iteration: new data and routing (on the GPU), layout, dispatch (plain, num_worst_tokens or cached in
    turn; every fourth FP8, its received rows cast back to BF16), combine; combine(dispatch(x)) must equal x (or
    x's FP8 cast back) times the number of ranks the token went to (exact in fp32), counted from the top-k ids
    themselves. Mismatches are counted on the GPU and read once at the end."""
    from deep_ep import Buffer, Config
    from deep_ep.fp8 import per_token_cast_back, per_token_cast_to_fp8
    num_tokens, hidden, topk, num_experts = 96, 512, 4, 16
    config = Config(8, 4, 32)
    buffer = Buffer(ctx.group, Config(8, 4, 32).get_nvl_buffer_size_hint(hidden * 2, ctx.world_size), 0,
                    transport="nvlink", explicitly_destroy=True, timeout_s=60)
    gen = torch.Generator(device=ctx.device)
    gen.manual_seed(seed + ctx.rank)
    wrong = torch.zeros((), dtype=torch.int64, device=ctx.device)
    handle = None
    experts_per_rank = num_experts // ctx.world_size
    for i in range(iterations):
        x = torch.randn(num_tokens, hidden, generator=gen, device=ctx.device).to(torch.bfloat16)
        scores = torch.rand(num_tokens, num_experts, generator=gen, device=ctx.device)
        idx = scores.topk(topk, dim=1).indices
        idx = torch.where(torch.rand(idx.shape, generator=gen, device=ctx.device) < 0.1, -1, idx)
        mode = i % 3 if handle is not None else 0
        if i % 4 == 3:
            fp8 = per_token_cast_to_fp8(x)
            x, sent = per_token_cast_back(*fp8).to(torch.bfloat16), fp8
        else:
            sent = x
        if mode == 2:   # (the routing of the last non-cached dispatch)
            recv_x = buffer.dispatch(sent, handle=handle, config=config)[0]
        else:
            per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, num_experts)
            weights = torch.ones(idx.shape, dtype=torch.float32, device=ctx.device)
            recv_x, _, _, _, handle, _ = buffer.dispatch(
                sent, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=idx, topk_weights=weights, num_worst_tokens=num_tokens * ctx.world_size if mode else 0,
                config=config)
            hits = torch.zeros((num_tokens, ctx.world_size + 1), dtype=torch.bool, device=ctx.device)
            hits.scatter_(1, torch.where(idx >= 0, idx // experts_per_rank, ctx.world_size), True)
            destinations = hits[:, :ctx.world_size].sum(1, keepdim=True)   # ranks each token goes to
        if isinstance(recv_x, tuple):
            recv_x = per_token_cast_back(*recv_x).to(torch.bfloat16)
        combined = buffer.combine(recv_x, handle, config=config)[0]
        expected = (x.float() * destinations).to(torch.bfloat16)
        wrong += (combined != expected).any(dim=1).sum()
    result = dict(wrong_tokens=int(wrong))
    buffer.destroy()
    return result


@pytest.mark.timeout(660)   # (the ranks' own limit below is 600 s)
@pytest.mark.parametrize("world_size,iterations", [(2, STRESS_ITERATIONS), (4, STRESS_ITERATIONS // 4)])
def test_nvlink_stress_10000_iterations(pool, world_size, iterations):
    """10,000 iterations at 2 ranks; 2,500 at 4 ranks (two processes on each GPU)."""
    seed = base_seed()
    assert_no_wrong_tokens(seed, pool(world_size).run(run_stress, seed, iterations, timeout=600))


# ---------------------------------------------------------------------------------------------------
# NVLink-specific errors
# ---------------------------------------------------------------------------------------------------
def run_errors(ctx) -> Dict[str, str]:
    import deep_ep
    from deep_ep import Buffer, Config
    from dist_utils import outcome
    out: Dict[str, str] = {}
    num_tokens, hidden, num_experts = 8, 256, 4
    buffer = Buffer(ctx.group, 1 << 24, 0, transport="nvlink", explicitly_destroy=True, timeout_s=3)
    x = torch.randn(num_tokens, hidden, device=ctx.device).to(torch.bfloat16)
    idx = torch.tensor([[0, 2]] * num_tokens, dtype=torch.int64, device=ctx.device)
    layout = buffer.get_dispatch_layout(idx, num_experts)
    kwargs = dict(num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2])

    def round_trip_ok(b, config=None) -> str:
        """Whether a dispatch and combine on `b` give back every token times its two destination ranks."""
        recv_x, _, _, _, handle, _ = b.dispatch(x, **kwargs, config=config)
        return str(bool(torch.equal(b.combine(recv_x, handle, config=config)[0], (2 * x.float()).to(torch.bfloat16))))

    # ranks calling with different hidden sizes: ValueError on every rank
    other = x if ctx.rank == 0 else torch.cat([x, x], dim=1)
    out["mismatch"] = outcome(lambda: buffer.dispatch(other, **kwargs), ValueError)
    # an expert id out of range in get_dispatch_layout: reported by the next dispatch, on the rank that made it
    bad = idx.clone()
    if ctx.rank == 1:
        bad[3, 1] = num_experts + 5
    bad_layout = buffer.get_dispatch_layout(bad, num_experts)
    out["bad_expert"] = outcome(lambda: buffer.dispatch(x, num_tokens_per_rank=bad_layout[0],
                                                        is_token_in_rank=bad_layout[3],
                                                        num_tokens_per_expert=bad_layout[2]), ValueError)
    # the Buffer still works afterwards
    out["after"] = round_trip_ok(buffer)
    # a buffer too small for this shape's rings: a ValueError at the call on every rank, and a shape it holds
    # still runs on it
    tiny = Buffer(ctx.group, 1 << 17, 0, transport="nvlink", explicitly_destroy=True, timeout_s=60)
    out["too_small"] = outcome(lambda: tiny.dispatch(torch.cat([x] * 28, dim=1), **kwargs, config=Config(24, 4, 256)),
                               ValueError)
    out["too_small_after"] = round_trip_ok(tiny, Config(8, 4, 16))
    tiny.destroy()
    # more channels than the transport's counters hold: a ValueError naming num_sms, before anything is sent
    out["too_many_sms"] = outcome(lambda: buffer.dispatch(x, **kwargs, config=Config(130, 4, 16)), ValueError)
    out["too_many_sms_after"] = round_trip_ok(buffer)
    # a peer that never comes: rank 0 waits, gives up after timeout_s with an error naming rank and peer
    if ctx.rank == 0:
        def dispatch_alone() -> None:
            buffer.dispatch(x, **kwargs)
            torch.cuda.synchronize()
        out["timeout"] = outcome(dispatch_alone, deep_ep.CommTimeoutError)
    return out


def test_nvlink_errors(pool):
    results = pool(2).run_then_restart(run_errors, timeout=120)   # (rank 0's Buffer is broken after the timeout)
    for rank, r in enumerate(results):
        assert r["mismatch"].startswith("ValueError: dispatch: hidden is ") and "256 on rank" in r["mismatch"] \
            and "512 on rank" in r["mismatch"], r["mismatch"]
        assert r["bad_expert"].startswith("ValueError"), r["bad_expert"]
        if rank == 1:
            assert "topk_idx" in r["bad_expert"] and "9" in r["bad_expert"], r["bad_expert"]
        else:
            assert "rank(s) [1]" in r["bad_expert"], r["bad_expert"]
        assert r["after"] == "True", f"rank {rank}: the Buffer is broken after refused calls"
        assert r["too_small"].startswith("ValueError") and "num_nvl_bytes=131072" in r["too_small"], r["too_small"]
        assert r["too_small_after"] == "True", f"rank {rank}: a shape that fits failed after the refused one"
        assert r["too_many_sms"].startswith("ValueError") and "num_sms must be <= 128" in r["too_many_sms"], \
            r["too_many_sms"]
        assert r["too_many_sms_after"] == "True", f"rank {rank}: the Buffer is broken after a refused num_sms"
    assert "rank 0" in results[0]["timeout"] and "rank 1" in results[0]["timeout"], results[0]["timeout"]
    assert results[0]["timeout"].startswith("CommTimeoutError"), results[0]["timeout"]
