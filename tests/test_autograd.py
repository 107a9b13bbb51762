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
from dataclasses import dataclass
from typing import Any, List, Tuple

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


@dataclass
class AutogradRun:
    """One autograd case on one rank: every rank's inputs, the model's dispatch to every rank, and this rank's
    token destinations."""
    ctx: Any
    buffer: Any
    seed: int
    case: NormalCase
    chk: NormalChecker

    def __post_init__(self) -> None:
        num_ranks, rank = self.ctx.world_size, self.ctx.rank
        self.num_experts = num_ranks * self.case.experts_per_rank
        self.sources = make_sources(self.seed, self.case, num_ranks, None)
        self.expected = [model.dispatch(self.sources, g, self.num_experts, num_channels=Buffer_channels())
                         for g in range(num_ranks)]
        self.rows_of = [e.rows for e in self.expected]
        self.me = self.sources[rank]
        self.in_rank = self.me.layout.is_token_in_rank
        self.num_dest = self.in_rank.sum(dim=1, keepdim=True)
        self.idx = self.me.topk_idx.to(self.ctx.device)

    def random(self, what: str, shapes: List[Tuple[int, ...]], dtype: torch.dtype = torch.bfloat16) \
            -> List[torch.Tensor]:
        """Every rank's wide_random tensor of its shape in `shapes`, drawn from the generator keyed `what`."""
        return [wide_random(generator(self.seed, self.case.name, what, g), *shape, dtype=dtype)
                for g, shape in enumerate(shapes)]

    def times_num_dest(self, v: torch.Tensor) -> torch.Tensor:
        """`v` times the number of destination ranks of each token; a token sent nowhere comes back as +0."""
        return torch.where(self.num_dest > 0, v.float() * self.num_dest, torch.zeros(())).to(torch.bfloat16)

    def fused_dispatch(self, x: torch.Tensor, probs: torch.Tensor) -> tuple:
        """FusedDispatch of `x` with this rank's top-k ids and `probs`, in the case's async_finish mode."""
        return FusedDispatch.apply(x, self.idx, probs, self.num_experts, self.buffer, self.case.async_finish)


def autograd_case(ctx, buffer, seed: int, case: NormalCase, chk: NormalChecker) -> None:
    """The round trip forward and backward, then the gradients of dispatch and of combine, each checked."""
    run = AutogradRun(ctx, buffer, seed, case, chk)
    x, probs, out = check_round_trip_forward(run)
    check_round_trip_backward(run, x, probs, out)
    recv_x, handle = check_grad_of_dispatch(run)
    check_grad_of_combine(run, recv_x, handle)


def check_round_trip_forward(run: AutogradRun) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """combine(dispatch(x)) == x * (number of destination ranks): small integers keep it exact. Returns the
    leaves x and probs and the round trip's output."""
    chk, rank, expected = run.chk, run.ctx.rank, run.expected[run.ctx.rank]
    xs = [torch.randint(-8, 9, (s.num_tokens, run.case.hidden),
                        generator=generator(run.seed, run.case.name, "int-x", g)).to(torch.bfloat16)
          for g, s in enumerate(run.sources)]
    x = xs[rank].to(run.ctx.device).requires_grad_()
    probs = run.me.topk_weights.to(run.ctx.device).requires_grad_()
    recv_x, recv_idx, recv_probs, counts, handle = run.fused_dispatch(x, probs)
    chk.equal("forward dispatch recv_x", recv_x, model.cached_dispatch(xs, run.rows_of[rank]))
    chk.equal("forward dispatch recv_topk_idx", recv_idx, expected.recv_topk_idx)
    chk.equal("forward dispatch recv_topk_weights", recv_probs, expected.recv_topk_weights)
    chk.equal("forward dispatch counts", counts, torch.tensor(expected.num_recv_tokens_per_expert_list))
    out = FusedCombine.apply(recv_x, run.buffer, handle)  # identity experts
    chk.equal("combine(dispatch(x)) == x * num_destinations", out, run.times_num_dest(xs[rank]))
    return x, probs, out


def check_round_trip_backward(run: AutogradRun, x: torch.Tensor, probs: torch.Tensor, out: torch.Tensor) -> None:
    """Backward through both: d/dx sum(out * G) = G * num_destinations (identity experts), and no gradient
    reaches probs."""
    g_out = run.random("g-out", [(s.num_tokens, run.case.hidden) for s in run.sources])
    (out.float() * g_out[run.ctx.rank].to(run.ctx.device).float()).sum().backward()
    run.chk.equal("round-trip grad x == G * num_destinations", x.grad, run.times_num_dest(g_out[run.ctx.rank]))
    run.chk.equal("round-trip grad probs (no prob path) == 0", probs.grad, torch.zeros_like(run.me.topk_weights))


def check_grad_of_dispatch(run: AutogradRun) -> Tuple[torch.Tensor, Any]:
    """The gradient of dispatch (x and probs) == combine of the gradient; returns recv_x and the handle."""
    chk, rank, device = run.chk, run.ctx.rank, run.ctx.device
    x = run.me.x.to(device).requires_grad_()
    probs = run.me.topk_weights.to(device).requires_grad_()
    recv_x, recv_idx, recv_probs, counts, handle = run.fused_dispatch(x, probs)
    chk.equal("dispatch recv_x", recv_x, run.expected[rank].recv_x)
    received = [len(rows) for rows in run.rows_of]
    g_recv = run.random("g-recv", [(num_rows, run.case.hidden) for num_rows in received])
    g_probs = run.random("g-probs", [(num_rows, run.case.topk) for num_rows in received], dtype=torch.float32)
    loss = (recv_x.float() * g_recv[rank].to(device).float()).sum() + (recv_probs * g_probs[rank].to(device)).sum()
    loss.backward()
    masked = [torch.where(e.recv_topk_idx >= 0, gp, torch.zeros_like(gp)) for e, gp in zip(run.expected, g_probs)]
    exp_gx, exp_gp = model.combine(rank, run.in_rank, run.rows_of, g_recv, masked)
    chk.equal("grad x of dispatch == combine(grad)", x.grad, exp_gx)
    chk.equal("grad probs of dispatch == combine(masked grad)", probs.grad, exp_gp)
    chk.equal("grad probs == analytic gradient", probs.grad, analytic_probs_grad(run, g_probs))
    return recv_x, handle


def analytic_probs_grad(run: AutogradRun, g_probs: List[torch.Tensor]) -> torch.Tensor:
    """The gradient of probs stated directly: d recv_probs[i, k] / d probs[t, k] = 1 on the rank owning the
    expert, so probs[t, k] gets that rank's g_probs entry of the row (this rank, t)."""
    rank, me = run.ctx.rank, run.me
    analytic = torch.zeros(me.num_tokens, run.case.topk)
    for t in range(me.num_tokens):
        for k in range(run.case.topk):
            e = int(me.topk_idx[t, k])
            if e >= 0:
                g = e // run.case.experts_per_rank
                analytic[t, k] = g_probs[g][run.rows_of[g].index((rank, t)), k]
    return analytic


def check_grad_of_combine(run: AutogradRun, recv_x: torch.Tensor, handle: Any) -> None:
    """The gradient of combine == dispatch of the gradient, and the combine's forward against the model."""
    rank = run.ctx.rank
    y = recv_x.detach().clone().requires_grad_()
    out = FusedCombine.apply(y, run.buffer, handle)
    g_comb = run.random("g-comb", [(s.num_tokens, run.case.hidden) for s in run.sources])
    (out.float() * g_comb[rank].to(run.ctx.device).float()).sum().backward()
    run.chk.equal("grad of combine == dispatch(grad)", y.grad, model.cached_dispatch(g_comb, run.rows_of[rank]))
    exp_out, _ = model.combine(rank, run.in_rank, run.rows_of, [e.recv_x for e in run.expected])
    run.chk.equal("combine forward", out, exp_out)


def Buffer_channels() -> int:  # noqa: N802 - the default config's channel count
    from deep_ep import Buffer
    return Buffer.num_sms // 2


def test_autograd_two_ranks(pool):
    seed = base_seed()
    report_mismatches(seed, lambda: pool(2).run(run_autograd, seed, CASES))
