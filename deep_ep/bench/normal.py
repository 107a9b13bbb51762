"""Normal mode on one rank: layout, dispatch (BF16, FP8), cached dispatch, combine, each verified and timed
beside its baseline; on GPUs also the copy engine's peer bandwidth (the ceiling)."""
from __future__ import annotations

from typing import Any, Dict

import torch

from .baseline import Baseline, copy_engine_peer_gbps
from .context import FP8_FACTOR, NUM_INPUTS, RankContext, calc_diff, random_routing, record, same_output


def bench_normal(ctx: RankContext, results: Dict[str, Any], info: Dict[str, Any]) -> None:
    from .. import Buffer
    from ..fp8 import per_token_cast_to_fp8
    plan, device, R, rank = ctx.plan, ctx.device, ctx.world, ctx.rank
    T, H, K, E = plan["tokens"], plan["hidden"], plan["topk"], plan["experts"]
    E_loc = E // R
    base = Baseline(ctx)

    ctx.phase(f"normal: Buffer and inputs ({T} tokens/rank, hidden {H}, top-{K}, {E} experts)")
    gen = torch.Generator().manual_seed(plan["seed"] * 7919 + rank)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(device)
    topk_idx, topk_weights = random_routing(gen, T, K, E, device)
    # the timed calls take turns over these inputs (one routing, other values)
    xs = [x] + [torch.randn(T, H, generator=gen).to(torch.bfloat16).to(device) for _ in range(NUM_INPUTS - 1)]

    def as_fp8(values: torch.Tensor):
        data, scales = per_token_cast_to_fp8(values)
        return data, scales.T.contiguous().T   # column-major scales, as DeepEP's test passes them
    xs_fp8 = [as_fp8(v) for v in xs]
    x_fp8 = xs_fp8[0]
    if plan["num_sms"] is not None:
        Buffer.set_num_sms(plan["num_sms"])
    dispatch_config, combine_config = Buffer.get_dispatch_config(R), Buffer.get_combine_config(R)
    num_nvl_bytes = plan["nvl_bytes"] or max(c.get_nvl_buffer_size_hint(H * 2, R)
                                             for c in (dispatch_config, combine_config))
    info["nvl_bytes"] = num_nvl_bytes
    buffer = Buffer(ctx.group, num_nvl_bytes, 0, explicitly_destroy=True, transport=plan["transport"],
                    device=device)
    info["transport"] = buffer.transport_name
    info["num_sms"] = dispatch_config.num_sms

    # ---- layout --------------------------------------------------------------------------------------
    ctx.phase("normal: get_dispatch_layout")
    layout = buffer.get_dispatch_layout(topk_idx, E)
    num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, _ = layout
    owner = torch.where(topk_idx >= 0, topk_idx // E_loc, torch.full_like(topk_idx, R))
    ref_in_rank = torch.zeros(T, R + 1, dtype=torch.bool, device=device)
    ref_in_rank.scatter_(1, owner, True)
    ref_in_rank = ref_in_rank[:, :R]
    ref_per_expert = torch.bincount(topk_idx[topk_idx >= 0], minlength=E).to(torch.int32)
    problems = []
    if not torch.equal(is_token_in_rank.cpu(), ref_in_rank.cpu()):
        problems.append("is_token_in_rank differs from topk_idx // experts_per_rank")
    if not torch.equal(num_tokens_per_rank.cpu(), ref_in_rank.sum(0).to(torch.int32).cpu()):
        problems.append(f"num_tokens_per_rank {num_tokens_per_rank.tolist()} != column sums of is_token_in_rank")
    if not torch.equal(num_tokens_per_expert.cpu(), ref_per_expert.cpu()):
        problems.append("num_tokens_per_expert differs from the bincount of topk_idx")
    ctx.verify("get_dispatch_layout", problems)
    record(results, "layout", ctx.time(lambda: buffer.get_dispatch_layout(topk_idx, E)), None)

    # what every rank should receive, from all ranks' routing
    all_in_rank = ctx.all_gather(is_token_in_rank)            # [R, T, R]
    all_idx = ctx.all_gather(topk_idx)                        # [R, T, K]
    all_weights = ctx.all_gather(topk_weights)                # [R, T, K]
    all_per_expert = ctx.all_gather(num_tokens_per_expert)    # [R, E]
    mine = all_in_rank[:, :, rank]
    num_recv = int(mine.sum())
    expected_list = all_per_expert[:, rank * E_loc:(rank + 1) * E_loc].sum(0).tolist()
    exp_idx = all_idx[mine]
    local = (exp_idx >= rank * E_loc) & (exp_idx < (rank + 1) * E_loc)
    exp_idx = torch.where(local, exp_idx - rank * E_loc, torch.full_like(exp_idx, -1))
    exp_weights = torch.where(local, all_weights[mine], torch.zeros_like(all_weights[mine]))

    layout_kwargs = dict(num_tokens_per_rank=num_tokens_per_rank, num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
                         is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert,
                         topk_idx=topk_idx, topk_weights=topk_weights, config=dispatch_config)

    def check_dispatch(name, out, baseline_out) -> None:
        recv_x, recv_idx, recv_w, recv_list, handle, _ = out
        b_x, b_idx, b_w, _ = baseline_out
        data = recv_x[0] if isinstance(recv_x, tuple) else recv_x
        problems = []
        if tuple(data.shape) != (num_recv, H):
            problems.append(f"received {tuple(data.shape)} rows, the layouts of all ranks say ({num_recv}, {H})")
        elif recv_list != expected_list:
            problems.append(f"num_recv_tokens_per_expert_list {recv_list} != {expected_list}")
        elif not (torch.equal(recv_idx, exp_idx) and torch.equal(recv_w, exp_weights)):
            problems.append("recv_topk_idx / recv_topk_weights differ from the senders' routing")
        elif isinstance(recv_x, tuple):
            if not (torch.equal(recv_x[0].view(torch.uint8), b_x[0].view(torch.uint8))
                    and torch.equal(recv_x[1], b_x[1])):
                problems.append("received FP8 data / scales differ from a plain all_to_all_single of the rows")
        elif not torch.equal(recv_x, b_x):
            problems.append("received rows differ from a plain all_to_all_single of the rows")
        if handle is None:
            problems.append("no handle returned")
        if not (torch.equal(b_idx, exp_idx) and torch.equal(b_w, exp_weights)):
            problems.append("baseline: received top-k differs from the senders' routing (bench bug)")
        ctx.verify(name, problems)

    if rank == 0:
        ceiling = copy_engine_peer_gbps(device)
        if ceiling is not None:
            info["copy_engine_peer_gbps"], info["copy_engine_peer_gbps_both_ways"] = ceiling
    ctx.barrier()
    # bytes this rank moves to other ranks (the NVLink traffic of an intranode transport)
    rows_out = int(is_token_in_rank.sum()) - int(is_token_in_rank[:, rank].sum())
    rows_back = num_recv - int(is_token_in_rank[:, rank].sum())

    # ---- BF16 dispatch -------------------------------------------------------------------------------
    ctx.phase("normal: dispatch BF16 (+ baseline permute + all_to_all_single)")
    out = buffer.dispatch(x, **layout_kwargs)
    recv_x, handle = out[0], out[4]
    baseline_out = base.dispatch_with_topk(x, topk_idx, topk_weights, is_token_in_rank, E_loc)
    base_state = baseline_out[3]
    check_dispatch("dispatch BF16", out, baseline_out)
    bf16_bytes = num_recv * H * 2
    # what every input's dispatch receives: the baseline's rows (checked above against the routing for input 0)
    expected_rows = [baseline_out[0]] + [base.dispatch([v], is_token_in_rank, base_state)[0][0] for v in xs[1:]]

    def rows_are(expected, what: str):
        """The check of a timed call: its first output is `expected[input]`, bit for bit."""
        return lambda i, output: [] if same_output(output[0], expected[i]) else \
            [f"input {i}: {what} differ from the baseline's"]
    ours, baseline = ctx.time_pair(
        "dispatch BF16", lambda i: buffer.dispatch(xs[i], **layout_kwargs),
        lambda i: base.dispatch_with_topk(xs[i], topk_idx, topk_weights, is_token_in_rank, E_loc), NUM_INPUTS,
        rows_are(expected_rows, "received rows"))
    record(results, "dispatch_bf16", ours, bf16_bytes, baseline, rows_out * H * 2)

    # ---- FP8 dispatch --------------------------------------------------------------------------------
    ctx.phase("normal: dispatch FP8 with per-128 scales (+ baseline)")
    out_fp8 = buffer.dispatch(x_fp8, **layout_kwargs)
    check_dispatch("dispatch FP8", out_fp8,
                   base.dispatch_with_topk(x_fp8, topk_idx, topk_weights, is_token_in_rank, E_loc))
    expected_fp8 = [tuple(base.dispatch(list(v), is_token_in_rank, base_state)[0]) for v in xs_fp8]
    ours, baseline = ctx.time_pair(
        "dispatch FP8", lambda i: buffer.dispatch(xs_fp8[i], **layout_kwargs),
        lambda i: base.dispatch_with_topk(xs_fp8[i], topk_idx, topk_weights, is_token_in_rank, E_loc), NUM_INPUTS,
        rows_are(expected_fp8, "received FP8 rows or scales"))
    record(results, "dispatch_fp8", ours, int(bf16_bytes * FP8_FACTOR), baseline, int(rows_out * H * 2 * FP8_FACTOR))

    # ---- cached dispatch -----------------------------------------------------------------------------
    ctx.phase("normal: cached dispatch BF16 (+ baseline without the count exchange)")
    cached = buffer.dispatch(x, handle=handle, config=dispatch_config)
    problems = []
    if not (isinstance(cached, tuple) and len(cached) == 6 and cached[1:5] == (None, None, None, None)):
        problems.append("cached dispatch must return (recv_x, None, None, None, None, event)")
    elif not torch.equal(cached[0], recv_x):
        problems.append("cached dispatch rows differ from the first dispatch")
    ctx.verify("cached dispatch BF16", problems)
    ours, baseline = ctx.time_pair(
        "cached dispatch BF16", lambda i: buffer.dispatch(xs[i], handle=handle, config=dispatch_config),
        lambda i: base.dispatch([xs[i]], is_token_in_rank, base_state), NUM_INPUTS,
        rows_are(expected_rows, "received rows"))
    record(results, "dispatch_cached", ours, bf16_bytes, baseline, rows_out * H * 2)
    cached_fp8 = buffer.dispatch(x_fp8, handle=handle, config=dispatch_config)
    problems = []
    if not (torch.equal(cached_fp8[0][0].view(torch.uint8), out_fp8[0][0].view(torch.uint8))
            and torch.equal(cached_fp8[0][1], out_fp8[0][1])):
        problems.append("cached FP8 dispatch rows / scales differ from the first FP8 dispatch")
    ctx.verify("cached dispatch FP8", problems)
    ours, baseline = ctx.time_pair(
        "cached dispatch FP8", lambda i: buffer.dispatch(xs_fp8[i], handle=handle, config=dispatch_config),
        lambda i: base.dispatch(list(xs_fp8[i]), is_token_in_rank, base_state), NUM_INPUTS,
        rows_are(expected_fp8, "received FP8 rows or scales"))
    record(results, "dispatch_cached_fp8", ours, int(bf16_bytes * FP8_FACTOR), baseline,
           int(rows_out * H * 2 * FP8_FACTOR))
    del out_fp8, cached_fp8, expected_fp8

    # ---- combine -------------------------------------------------------------------------------------
    ctx.phase("normal: combine BF16 (+ baseline all_to_all_single back + index_add)")
    destinations = is_token_in_rank.sum(1, keepdim=True).float()
    expected_combined = []
    for i, rows in enumerate(expected_rows):   # every input's rows, combined back: input * destination ranks
        combined, combined_w, _ = buffer.combine(rows, handle, topk_weights=out[2], config=combine_config)
        expected = xs[i].float() * destinations
        baseline_combined = base.combine(rows, base_state, T)
        problems = []
        if tuple(combined.shape) != (T, H) or combined.dtype != torch.bfloat16:
            problems.append(f"combined_x is {tuple(combined.shape)} {combined.dtype}, expected ({T}, {H}) bfloat16")
        else:
            error = (combined.float() - expected).abs()
            bound = expected.abs() * 2.0 ** -8  # one bf16 rounding of an exact fp32 sum
            if torch.isnan(combined).any() or bool((error > bound).any()):
                problems.append(f"input {i}: combine(dispatch(x)) != x * number of destination ranks: max error "
                                f"{float(error.max()):.3g}, calc_diff {calc_diff(combined, expected):.3g}")
            masked_w = torch.where(topk_idx >= 0, topk_weights, torch.zeros_like(topk_weights))
            if combined_w is None or not torch.equal(combined_w, masked_w):
                problems.append("combined_topk_weights != the original weights (of the valid selections)")
        if bool(((baseline_combined.float() - expected).abs() > expected.abs() * 2.0 ** -8).any()):
            problems.append("baseline combine != x * number of destination ranks (bench bug)")
        ctx.verify("combine BF16", problems)
        expected_combined.append(combined)
    ours, baseline = ctx.time_pair(
        "combine BF16", lambda i: buffer.combine(expected_rows[i], handle, config=combine_config),
        lambda i: base.combine(expected_rows[i], base_state, T), NUM_INPUTS,
        lambda i, output: [] if same_output(output[0], expected_combined[i]) else
        [f"input {i}: combined rows differ from the same input's first combine"])
    record(results, "combine", ours, bf16_bytes, baseline, rows_back * H * 2)

    del out, recv_x, handle, cached, combined, expected_rows, expected_combined
    ctx.barrier()
    buffer.destroy()
