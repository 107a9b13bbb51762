"""Low-latency mode on one rank: dispatch (FP8, BF16) and combine, and on GPUs their CUDA-graph replays and
the two phases of a call with a receive hook."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .baseline import Baseline
from .context import NUM_INPUTS, RankContext, calc_diff, random_routing, record, same_output


def bench_low_latency(ctx: RankContext, results: Dict[str, Any], info: Dict[str, Any]) -> None:
    from .. import Buffer
    from ..fp8 import num_scale_groups, per_token_cast_back, per_token_cast_to_fp8
    plan, device, R, rank = ctx.plan, ctx.device, ctx.world, ctx.rank
    N, H, K, E = plan["ll_tokens"], plan["hidden"], plan["topk"], plan["ll_experts"]
    E_loc = E // R
    base = Baseline(ctx)

    ctx.phase(f"low-latency: Buffer and inputs ({N} tokens/rank, hidden {H}, top-{K}, {E} experts)")
    gen = torch.Generator().manual_seed(plan["seed"] * 7919 + 104729 + rank)
    x = torch.randn(N, H, generator=gen).to(torch.bfloat16).to(device)
    topk_idx, topk_weights = random_routing(gen, N, K, E, device)
    # the timed dispatches take turns over these inputs (one routing, other values)
    xs = [x] + [torch.randn(N, H, generator=gen).to(torch.bfloat16).to(device) for _ in range(NUM_INPUTS - 1)]
    num_rdma_bytes = Buffer.get_low_latency_rdma_size_hint(N, H, R, E)
    buffer = Buffer(ctx.group, 0, num_rdma_bytes, low_latency_mode=True, num_qps_per_rank=max(1, E_loc),
                    explicitly_destroy=True, transport=plan["transport"], device=device)
    info.setdefault("transport", buffer.transport_name)
    info["ll_transport"] = buffer.transport_name

    num_valid = int((topk_idx >= 0).sum())
    all_xs = [ctx.all_gather(v) for v in xs]   # [R, N, H] each
    all_idx = ctx.all_gather(topk_idx)   # [R, N, K]
    # expected (local expert, source rank, token) keys of this rank's received rows, sorted
    sources, tokens, slots = (all_idx >= rank * E_loc).logical_and(all_idx < (rank + 1) * E_loc).nonzero(as_tuple=True)
    local_expert = all_idx[sources, tokens, slots] - rank * E_loc
    expected_keys = torch.sort((local_expert * R + sources) * N + tokens).values
    expected_count = torch.bincount(local_expert, minlength=E_loc).to(torch.int32)
    valid_weight = torch.where(topk_idx >= 0, topk_weights, torch.zeros_like(topk_weights)).sum(1, keepdim=True)
    combine_expected = x.float() * valid_weight

    def check_ll_dispatch(name: str, out, use_fp8: bool) -> torch.Tensor:
        """Check a low-latency dispatch of `x`; return identity expert outputs (bf16 `[E_loc, R*N, H]`)."""
        ctx.verify(name, ll_dispatch_problems(out, use_fp8, all_xs[0]))
        return _identity_expert_outputs(out[0]) if use_fp8 else out[0]

    def ll_dispatch_problems(out, use_fp8: bool, all_x: torch.Tensor) -> List[str]:
        """What is wrong with a low-latency dispatch of the inputs whose every rank's rows are `all_x`."""
        recv_x, recv_count, handle, _, _ = out
        problems = []
        data = recv_x[0] if use_fp8 else recv_x
        if tuple(data.shape) != (E_loc, R * N, H):
            problems.append(f"recv_x has shape {tuple(data.shape)}, expected ({E_loc}, {R * N}, {H})")
        elif not torch.equal(recv_count.cpu(), expected_count.cpu()):
            problems.append(f"recv_count {recv_count.tolist()} != selections of the local experts "
                            f"{expected_count.tolist()}")
        else:
            src_info, layout_range = handle[0].cpu(), handle[1].cpu()
            src_rank = torch.full((E_loc, R * N), -1, dtype=torch.int64)
            begins, counts = (layout_range >> 32).tolist(), (layout_range & 0xFFFFFFFF).tolist()
            for e in range(E_loc):
                for s in range(R):
                    src_rank[e, begins[e][s]:begins[e][s] + counts[e][s]] = s
            valid = torch.arange(R * N).unsqueeze(0) < recv_count.cpu().unsqueeze(1).long()
            got_keys = (torch.arange(E_loc).unsqueeze(1) * R + src_rank) * N + src_info.long()
            if [sum(c) for c in counts] != recv_count.tolist() or bool((src_rank[valid] < 0).any()):
                problems.append("layout_range blocks do not tile [0, recv_count) of every local expert")
            elif not torch.equal(torch.sort(got_keys[valid]).values, expected_keys.cpu()):
                problems.append("the (source rank, src_info) of the received rows are not the selected tokens")
            else:
                valid_d = valid.to(device)
                rows = all_x[src_rank[valid].to(device), src_info[valid].long().to(device)]
                if use_fp8:
                    ref_data, ref_scales = per_token_cast_to_fp8(rows)
                    got = recv_x[0].view(torch.uint8)[valid_d]   # (as bytes: older torch cannot index float8 on CPU)
                    if tuple(recv_x[1].shape) != (E_loc, R * N, num_scale_groups(H)):
                        problems.append(f"scales have shape {tuple(recv_x[1].shape)}")
                    elif not (torch.equal(got, ref_data.view(torch.uint8))
                              and torch.equal(recv_x[1][valid_d], ref_scales)):
                        diff = calc_diff(per_token_cast_back(got.view(recv_x[0].dtype), recv_x[1][valid_d]),
                                         rows.float())
                        problems.append(f"FP8 rows differ from per_token_cast_to_fp8 of the source rows "
                                        f"(calc_diff of the dequantised rows {diff:.3g})")
                elif not torch.equal(recv_x[valid_d], rows):
                    problems.append("BF16 rows differ from the source rows")
        return problems

    def check_ll_combine(name: str, combined: torch.Tensor, tolerance: float,
                         expected: Optional[torch.Tensor] = None) -> None:
        problems = []
        expected = combine_expected if expected is None else expected
        if tuple(combined.shape) != tuple(expected.shape) or combined.dtype != torch.bfloat16:
            problems.append(f"combined_x is {tuple(combined.shape)} {combined.dtype}, expected "
                            f"{tuple(expected.shape)} bfloat16")
        else:
            diff = calc_diff(combined, expected)
            if torch.isnan(combined).any() or not diff < tolerance:
                problems.append(f"combine of identity experts != x * sum of valid weights: calc_diff {diff:.3g} "
                                f"(tolerance {tolerance:g})")
        ctx.verify(name, problems)

    ll_dispatch_bytes_fp8 = num_valid * (H + num_scale_groups(H) * 4 + 16)
    ll_bf16_bytes = num_valid * H * 2

    # ---- FP8 dispatch --------------------------------------------------------------------------------
    ctx.phase("low-latency: dispatch FP8 (+ baseline cast + permute + all_to_all_single + pack)")

    def ll_dispatch(use_fp8: bool, values: torch.Tensor = x):
        return buffer.low_latency_dispatch(values, topk_idx, N, E, use_fp8=use_fp8)

    def time_ll_dispatch(name: str, use_fp8: bool):
        return ctx.time_pair(name, lambda i: ll_dispatch(use_fp8, xs[i]),
                             lambda i: base.ll_dispatch(xs[i], topk_idx, E, N, use_fp8), NUM_INPUTS,
                             lambda i, output: [f"input {i}: {p}" for p in ll_dispatch_problems(output, use_fp8,
                                                                                                 all_xs[i])])

    def baseline_round_trip(name: str, use_fp8: bool, tolerance: float):
        """Run the baseline once and check it like ours (a failure here is a bench bug, not a library bug)."""
        recv, per_expert, state = base.ll_dispatch(x, topk_idx, E, N, use_fp8)
        expert_out = _identity_expert_outputs(recv) if use_fp8 else recv
        combined = base.ll_combine(expert_out, topk_weights, state)
        problems = []
        if not torch.equal(per_expert.to(torch.int32).cpu(), expected_count.cpu()):
            problems.append("baseline: per-expert counts differ (bench bug)")
        diff = calc_diff(combined, combine_expected)
        if torch.isnan(combined).any() or not diff < tolerance:
            problems.append(f"baseline: round trip calc_diff {diff:.3g} (bench bug)")
        ctx.verify(name, problems)
        return expert_out, state

    out = ll_dispatch(True)
    expert_out = check_ll_dispatch("LL dispatch FP8", out, True)
    combined = buffer.low_latency_combine(expert_out, topk_idx, topk_weights, out[2])[0]
    check_ll_combine("LL combine of FP8-dispatched rows", combined, 9e-4)
    baseline_round_trip("baseline LL FP8 round trip", True, 9e-4)
    del out, expert_out, combined
    ours, baseline = time_ll_dispatch("LL dispatch FP8", True)
    record(results, "ll_dispatch_fp8", ours, ll_dispatch_bytes_fp8, baseline)

    # ---- BF16 dispatch -------------------------------------------------------------------------------
    ctx.phase("low-latency: dispatch BF16 (+ baseline)")
    out = ll_dispatch(False)
    expert_out, handle = check_ll_dispatch("LL dispatch BF16", out, False), out[2]
    base_out, base_state = baseline_round_trip("baseline LL BF16 round trip", False, 1e-5)
    expert_out = expert_out.clone()   # (a later dispatch may reuse the memory it received into)
    ours, baseline = time_ll_dispatch("LL dispatch BF16", False)
    record(results, "ll_dispatch_bf16", ours, ll_bf16_bytes, baseline)

    # ---- combine -------------------------------------------------------------------------------------
    ctx.phase("low-latency: combine BF16 (+ baseline all_to_all_single back + weighted index_add)")
    combined = buffer.low_latency_combine(expert_out, topk_idx, topk_weights, handle)[0].clone()
    check_ll_combine("LL combine BF16", combined, 1e-5)
    # the timed combines take turns over the expert outputs scaled by powers of two, which scale every product
    # and sum exactly: each input's combine is the first one scaled, bit for bit
    scales = [2.0 ** i for i in range(NUM_INPUTS)]
    expert_outs = [expert_out * c for c in scales]
    base_outs = [base_out * c for c in scales]
    ours, baseline = ctx.time_pair(
        "LL combine BF16", lambda i: buffer.low_latency_combine(expert_outs[i], topk_idx, topk_weights, handle),
        lambda i: base.ll_combine(base_outs[i], topk_weights, base_state), NUM_INPUTS,
        lambda i, output: [] if same_output(output[0], combined * scales[i]) else
        [f"input {i}: combined rows differ from the first combine times {scales[i]:g}"])
    record(results, "ll_combine", ours, ll_bf16_bytes, baseline)
    del out, expert_out, handle, combined
    if device.type == "cuda" and buffer.transport_name == "nvlink":
        _bench_low_latency_graphs(ctx, results, buffer, base, x, topk_idx, topk_weights, check_ll_dispatch,
                                  check_ll_combine, ll_dispatch_bytes_fp8, ll_bf16_bytes)
    ctx.barrier()
    buffer.destroy()


def _identity_expert_outputs(recv: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """What identity experts return for FP8-dispatched rows `(data [E_loc, R*N, H], scales)`: the rows
    dequantised, in bf16, shaped like `data`."""
    from ..fp8 import per_token_cast_back
    data, scales = recv
    return per_token_cast_back(data.reshape(-1, data.shape[-1]), scales.reshape(-1, scales.shape[-1])) \
        .to(torch.bfloat16).view(data.shape)


def _capture(fn: Callable[[], Any]) -> Tuple["torch.cuda.CUDAGraph", Any]:
    """`fn` captured in a CUDA graph (run once eagerly first: kernels compile outside the capture), and what
    the captured call returned (the tensors every replay writes)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn()
    torch.cuda.synchronize()
    return graph, captured


def _replay_into_garbage(graph: "torch.cuda.CUDAGraph", outputs: List[torch.Tensor]) -> None:
    """Fill the graph's outputs with garbage, then replay it once: a check afterwards sees what the replay
    wrote, not what the eager call or the capture left there."""
    for t in outputs:
        if t.element_size() == 1:
            t.view(torch.uint8).fill_(0x7F)   # (NaN as float8 e4m3fn)
        elif t.is_floating_point():
            t.fill_(float("nan"))
        else:
            t.fill_(-1)
    graph.replay()
    torch.cuda.synchronize()


def _bench_low_latency_graphs(ctx: RankContext, results: Dict[str, Any], buffer, base: "Baseline", x: torch.Tensor,
                              topk_idx: torch.Tensor, topk_weights: torch.Tensor, check_dispatch: Callable,
                              check_combine: Callable, dispatch_bytes: int, combine_bytes: int) -> None:
    """Decode as serving engines run it: FP8 dispatch and BF16 combine replayed from CUDA graphs (also with one
    token per rank), and the two phases of a dispatch with a receive hook. Baseline: one all_to_all_single
    of a padded buffer each way."""
    from ..fp8 import per_token_cast_to_fp8
    plan = ctx.plan
    N, H, E = plan["ll_tokens"], plan["hidden"], plan["ll_experts"]
    ctx.phase("low-latency: CUDA graphs (dispatch FP8, combine, both; 1 token), hook phases, padded baseline")

    fp8_rows = torch.cat([t.view(torch.uint8).view(N, -1) for t in per_token_cast_to_fp8(x)], dim=1)
    to_every_rank = fp8_rows.repeat(ctx.world, 1)
    back_to_sources = torch.zeros((ctx.world * N, H), dtype=torch.bfloat16, device=x.device)
    padded_dispatch = ctx.time(lambda: base.ll_padded(to_every_rank))
    padded_combine = ctx.time(lambda: base.ll_padded(back_to_sources))
    for suffix, tokens in (("graph", N), ("1_token", 1)):
        xs, idx, weights = x[:tokens].contiguous(), topk_idx[:tokens].contiguous(), topk_weights[:tokens].contiguous()
        out = torch.empty((tokens, H), dtype=torch.bfloat16, device=x.device)
        recv, _, handle, _, _ = buffer.low_latency_dispatch(xs, idx, N, E, use_fp8=True)
        experts = _identity_expert_outputs(recv)   # the expert outputs the combine graphs send back
        dispatch_graph, captured = _capture(lambda: buffer.low_latency_dispatch(xs, idx, N, E, use_fp8=True))
        combine_graph, _ = _capture(lambda: buffer.low_latency_combine(experts, idx, weights, handle, out=out))
        full = tokens == N
        if full:   # (check_dispatch expects every rank's N tokens)
            (data, scales), count, (src_info, layout_range) = captured[0], captured[1], captured[2][:2]
            _replay_into_garbage(dispatch_graph, [data, scales, count, src_info, layout_range])
            check_dispatch("LL dispatch FP8 replayed from a CUDA graph", captured, True)
        _replay_into_garbage(combine_graph, [out])
        expected = xs.float() * torch.where(idx >= 0, weights, torch.zeros_like(weights)).sum(1, keepdim=True)
        check_combine(f"LL combine replayed from a CUDA graph ({tokens} tokens)", out, 9e-4, expected)
        record(results, f"ll_dispatch_{suffix}", ctx.time(dispatch_graph.replay), dispatch_bytes if full else None,
                padded_dispatch if full else None)
        record(results, f"ll_combine_{suffix}", ctx.time(combine_graph.replay), combine_bytes if full else None,
                padded_combine if full else None)
        if full:
            def round_trip() -> None:
                received, _, h, _, _ = buffer.low_latency_dispatch(xs, idx, N, E, use_fp8=True)
                buffer.low_latency_combine(experts, idx, weights, h, out=out)
            round_trip_graph, _ = _capture(round_trip)
            _replay_into_garbage(round_trip_graph, [out])
            check_combine("LL dispatch + combine replayed from a CUDA graph", out, 9e-4, expected)
            both = {k: [a + b for a, b in zip(padded_dispatch[k], padded_combine[k])] for k in padded_dispatch}
            record(results, "ll_round_trip_graph", ctx.time(round_trip_graph.replay), dispatch_bytes + combine_bytes,
                    both)
        del dispatch_graph, combine_graph
    send, receive = _hook_phases(ctx, lambda: buffer.low_latency_dispatch(x, topk_idx, N, E, use_fp8=True,
                                                                          return_recv_hook=True)[4])
    record(results, "ll_send_phase", send, dispatch_bytes)
    record(results, "ll_recv_phase", receive, None)
    recv, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, N, E, use_fp8=True)
    experts = _identity_expert_outputs(recv)
    send, receive = _hook_phases(ctx, lambda: buffer.low_latency_combine(experts, topk_idx, topk_weights, handle,
                                                                         return_recv_hook=True)[2])
    record(results, "ll_combine_send_phase", send, combine_bytes)
    record(results, "ll_combine_recv_phase", receive, None)


# GPU cycles slept before each phase (about 1 ms): the host's work for the call is done meanwhile, and before
# the receive phase the peers' rows have landed, so each phase times its kernels, as DeepEP's kernel durations do
_HIDE_HOST_CYCLES = 2_000_000


def _hook_phases(ctx: RankContext, send: Callable[[], Callable[[], None]]) -> Tuple[Dict[str, List[float]], ...]:
    """GPU seconds of the send call and of its hook, each bracketed by events behind a GPU sleep (so neither
    includes host time or a wait for a later peer), every pair after a barrier."""
    for _ in range(max(1, ctx.plan["warmup"])):   # (at least one: a hook's kernels compile at their first call)
        send()()
    events = []
    for _ in range(ctx.plan["iters"]):
        ctx.barrier()
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        torch.cuda._sleep(_HIDE_HOST_CYCLES)
        marks[0].record()
        hook = send()
        marks[1].record()
        torch.cuda._sleep(_HIDE_HOST_CYCLES)
        marks[2].record()
        hook()
        marks[3].record()
        events.append(marks)
    ctx.sync()
    ctx.barrier()
    send_times = [m[0].elapsed_time(m[1]) / 1e3 for m in events]
    receive_times = [m[2].elapsed_time(m[3]) / 1e3 for m in events]
    return dict(streamed=send_times, isolated=send_times), dict(streamed=receive_times, isolated=receive_times)
