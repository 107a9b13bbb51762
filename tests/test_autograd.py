"""Dispatch / combine inside torch.autograd, the way Megatron-LM wraps DeepEP (spec section 7.5).

FusedDispatch: forward = get_dispatch_layout + dispatch; backward = combine of the output gradient,
with the gradient of the received probabilities as top-k weights (zeroed where the received expert id
is -1, as the contract advises: those weights are constants).
FusedCombine: forward = combine; backward = cached dispatch of the output gradient.

Checked on 2 ranks, bitwise against tests/model.py and against the round-trip identities:
combine(dispatch(x)) = x * (number of destination ranks of the token), grad of dispatch = combine of the
grad, grad of combine = dispatch of the grad.
"""
from __future__ import annotations

import traceback
from typing import List

import torch

import model
from cases import NormalCase
from compare import report_mismatches
from inputs import wide_random
from normal_mode import BUFFER_TIMEOUT_S, NormalChecker, make_sources, nvl_bytes
from randomness import base_seed, generator


class FusedDispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, token_indices, token_probs, num_experts, buffer, async_finish=False):
        # Megatron's sequence: the layout's own event (EventOverlap(None) when synchronous) orders the dispatch,
        # with no wait between the two; the compute stream waits once, on the dispatch's event
        from deep_ep.utils import EventHandle, EventOverlap
        previous_event = EventOverlap(EventHandle()) if async_finish else None
        per_rank, per_rdma, per_expert, in_rank, event = buffer.get_dispatch_layout(
            token_indices, num_experts, previous_event=previous_event, async_finish=async_finish,
            allocate_on_comm_stream=async_finish)
        recv_x, recv_idx, recv_probs, counts, handle, event = buffer.dispatch(
            x, topk_idx=token_indices, topk_weights=token_probs.float(), num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            previous_event=event, async_finish=async_finish, allocate_on_comm_stream=async_finish)
        if async_finish:
            event.current_stream_wait()
        ctx.buffer, ctx.handle, ctx.async_finish = buffer, handle, async_finish
        ctx.save_for_backward(recv_idx)
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_idx, recv_probs, torch.tensor(counts), handle

    @staticmethod
    def backward(ctx, grad_x, grad_idx, grad_probs, grad_counts, grad_handle):
        from deep_ep.utils import EventHandle, EventOverlap
        (recv_idx,) = ctx.saved_tensors
        grad_probs = grad_probs.masked_fill(recv_idx < 0, 0.0).float().contiguous()
        extra = {}
        if ctx.async_finish:
            extra = dict(previous_event=EventOverlap(EventHandle()), async_finish=True, allocate_on_comm_stream=True)
        grad_x, grad_token_probs, event = ctx.buffer.combine(grad_x.contiguous(), ctx.handle,
                                                             topk_weights=grad_probs, **extra)
        if ctx.async_finish:
            event.current_stream_wait()
        return grad_x, None, grad_token_probs, None, None, None


class FusedCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, buffer, handle):
        combined_x, _, _ = buffer.combine(x, handle=handle)
        ctx.buffer, ctx.handle = buffer, handle
        return combined_x

    @staticmethod
    def backward(ctx, grad_output):
        grad_x, _, _, _, _, _ = ctx.buffer.dispatch(grad_output.contiguous(), handle=ctx.handle)
        return grad_x, None, None


CASES = [
    NormalCase(name="ag-masked", tokens=[50, 80], hidden=256, topk=4, experts_per_rank=4, mask_frac=0.2, x="bf16"),
    NormalCase(name="ag-zero-tokens-async", tokens=[0, 64], hidden=128, topk=2, experts_per_rank=3, routing="skewed",
               x="bf16", async_finish=True),
    NormalCase(name="ag-top8-h200", tokens=[33, 21], hidden=200, topk=8, experts_per_rank=8, mask_frac=0.1, x="bf16"),
]


def run_autograd(ctx, seed: int, cases: List[NormalCase]) -> List[str]:
    from deep_ep import Buffer
    buffer = Buffer(ctx.group, nvl_bytes(), 0, explicitly_destroy=True, timeout_s=BUFFER_TIMEOUT_S)
    errors: List[str] = []
    for case in cases:
        chk = NormalChecker(seed, case.name, ctx.rank)
        try:
            autograd_case(ctx, buffer, seed, case, chk)
        except Exception:  # noqa: BLE001 - stop and fail the rank (see normal_mode.run_cases)
            chk.fail("exception (remaining cases skipped)", traceback.format_exc())
            raise AssertionError("\n".join(errors + chk.errors)) from None
        errors.extend(chk.errors)
    buffer.destroy()
    return errors


def autograd_case(ctx, buffer, seed: int, case: NormalCase, chk: NormalChecker) -> None:
    num_ranks, rank, device = ctx.world_size, ctx.rank, ctx.device
    num_experts = num_ranks * case.experts_per_rank
    hidden, num_topk = case.hidden, case.topk
    async_finish = case.async_finish
    sources = make_sources(seed, case, num_ranks, None)
    expected = [model.dispatch(sources, g, num_experts, num_channels=Buffer_channels()) for g in range(num_ranks)]
    rows_of = [e.rows for e in expected]
    me = sources[rank]
    in_rank = me.layout.is_token_in_rank
    num_dest = in_rank.sum(dim=1, keepdim=True)

    def times_num_dest(v: torch.Tensor) -> torch.Tensor:  # a token sent nowhere comes back as +0
        return torch.where(num_dest > 0, v.float() * num_dest, torch.zeros(())).to(torch.bfloat16)

    # ---- 1. combine(dispatch(x)) == x * (number of destination ranks): small integers keep it exact
    xs = [torch.randint(-8, 9, (s.num_tokens, hidden), generator=generator(seed, case.name, "int-x", g))
          .to(torch.bfloat16) for g, s in enumerate(sources)]
    x = xs[rank].to(device).requires_grad_()
    idx = me.topk_idx.to(device)
    probs = me.topk_weights.to(device).requires_grad_()
    recv_x, recv_idx, recv_probs, counts, handle = FusedDispatch.apply(x, idx, probs, num_experts, buffer, async_finish)
    chk.equal("forward dispatch recv_x", recv_x, model.cached_dispatch(xs, rows_of[rank]))
    chk.equal("forward dispatch recv_topk_idx", recv_idx, expected[rank].recv_topk_idx)
    chk.equal("forward dispatch recv_topk_weights", recv_probs, expected[rank].recv_topk_weights)
    chk.equal("forward dispatch counts", counts, torch.tensor(expected[rank].num_recv_tokens_per_expert_list))
    out = FusedCombine.apply(recv_x, buffer, handle)  # identity experts
    chk.equal("combine(dispatch(x)) == x * num_destinations", out, times_num_dest(xs[rank]))

    # ---- 2. backward through both: d/dx sum(out * G) = G * num_destinations (identity experts)
    g_out = [wide_random(generator(seed, case.name, "g-out", g), s.num_tokens, hidden)
             for g, s in enumerate(sources)]
    (out.float() * g_out[rank].to(device).float()).sum().backward()
    chk.equal("round-trip grad x == G * num_destinations", x.grad, times_num_dest(g_out[rank]))
    chk.equal("round-trip grad probs (no prob path) == 0", probs.grad, torch.zeros_like(me.topk_weights))

    # ---- 3. grad of dispatch == combine of the grad (x and probs)
    x = me.x.to(device).requires_grad_()
    probs = me.topk_weights.to(device).requires_grad_()
    recv_x, recv_idx, recv_probs, counts, handle = FusedDispatch.apply(x, idx, probs, num_experts, buffer, async_finish)
    chk.equal("dispatch recv_x", recv_x, expected[rank].recv_x)
    g_recv = [wide_random(generator(seed, case.name, "g-recv", g), len(rows_of[g]), hidden)
              for g in range(num_ranks)]
    g_probs = [wide_random(generator(seed, case.name, "g-probs", g), len(rows_of[g]), num_topk, dtype=torch.float32)
               for g in range(num_ranks)]
    loss = (recv_x.float() * g_recv[rank].to(device).float()).sum() + (recv_probs * g_probs[rank].to(device)).sum()
    loss.backward()
    masked = [torch.where(expected[g].recv_topk_idx >= 0, g_probs[g], torch.zeros_like(g_probs[g]))
              for g in range(num_ranks)]
    exp_gx, exp_gp = model.combine(rank, in_rank, rows_of, g_recv, masked)
    chk.equal("grad x of dispatch == combine(grad)", x.grad, exp_gx)
    chk.equal("grad probs of dispatch == combine(masked grad)", probs.grad, exp_gp)
    # the same, stated directly: d recv_probs[i, k] / d probs[t, k] = 1 on the rank owning the expert
    analytic = torch.zeros(me.num_tokens, num_topk)
    experts_per_rank = case.experts_per_rank
    for t in range(me.num_tokens):
        for k in range(num_topk):
            e = int(me.topk_idx[t, k])
            if e >= 0:
                g = e // experts_per_rank
                analytic[t, k] = g_probs[g][rows_of[g].index((rank, t)), k]
    chk.equal("grad probs == analytic gradient", probs.grad, analytic)

    # ---- 4. grad of combine == dispatch of the grad
    y = recv_x.detach().clone().requires_grad_()
    out = FusedCombine.apply(y, buffer, handle)
    g_comb = [wide_random(generator(seed, case.name, "g-comb", g), s.num_tokens, hidden)
              for g, s in enumerate(sources)]
    (out.float() * g_comb[rank].to(device).float()).sum().backward()
    chk.equal("grad of combine == dispatch(grad)", y.grad, model.cached_dispatch(g_comb, rows_of[rank]))
    exp_out, _ = model.combine(rank, in_rank, rows_of, [e.recv_x for e in expected])
    chk.equal("combine forward", out, exp_out)


def Buffer_channels() -> int:  # noqa: N802 - the default config's channel count
    from deep_ep import Buffer
    return Buffer.num_sms // 2


def test_autograd_two_ranks(pool):
    seed = base_seed()
    report_mismatches(seed, lambda: pool(2).run(run_autograd, seed, CASES))
