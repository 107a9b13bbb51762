"""Bad input: every case must raise the documented exception type with a message that names the argument.

Contract (docs/DESIGN.md "Errors"): wrong dtype -> TypeError; wrong shape, device, contiguity, value,
out-of-range expert, handle misuse, too-small buffer, too many tokens, ranks calling with different
shapes -> ValueError naming the argument; use after destroy() -> RuntimeError (tests/test_api.py); a wait
that does not complete within `timeout_s` -> deep_ep.CommTimeoutError naming the rank.

Errors that can be detected locally must be raised BEFORE any collective starts. Each such case is
therefore run on ONE rank only (alternating), and after every case both ranks make a valid call of the
same kind on the same Buffer: if the refused call had started a collective (or consumed a low-latency
buffer half), the group is out of step and that follow-up call fails or times out. Bad values that only
one rank's data may hold (expert ids) are checked once the inputs are complete, and every rank refuses the
call together (the rank with them names the argument, the others name that rank).

All cases run inside one `pool(2).run` (spawning ranks is the expensive part); the timeout case needs
its own run and restarts the pool afterwards (its group is left with an unmatched collective).
"""
from __future__ import annotations

import json
import os
import re
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple, Union
from unittest import mock

import pytest
import torch

import deep_ep
from deep_ep import Buffer, Config

T, H, E, K, N = 4, 128, 4, 2, 8          # tokens, hidden, experts, top-k, LL max tokens per rank
LL_MAX = dict(n=16, hidden=256, experts=8)  # the LL buffer fits these too (for the mismatch cases)
STEP_TIMEOUT_S = 5                       # bound of every wait of the test Buffers (an out-of-step group fails fast)
MAX_RESTARTS = 6                         # out-of-step runs are resumed after the failing case on fresh ranks

Names = List[Union[str, Tuple[str, ...]]]   # each entry: a name the message must contain, or a tuple of alternatives


def _mentions(message: str, name: str) -> bool:
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", message) is not None


def names_ok(message: str, names: Names) -> bool:
    return all(_mentions(message, n) if isinstance(n, str) else any(_mentions(message, a) for a in n) for n in names)


def ll_formula(n, hidden, num_experts):
    """Spec 9.1 (the low-latency size hint)."""
    s = hidden // 128
    dm, cm = 16 + max(2 * hidden, hidden + 4 * s), 4 * s + 2 * hidden
    send, recv = max(n * dm, num_experts * n * cm), max(num_experts * n * dm, num_experts * n * cm)
    total = 2 * send + 2 * recv + 2 * ((4 * num_experts + 127) // 128 * 128)
    return (total + 128) // 128 * 128


def nvl_size(hidden: int = 256) -> int:
    hb = hidden * 2
    return max(Buffer.get_dispatch_config(2).get_nvl_buffer_size_hint(hb, 2),
               Buffer.get_combine_config(2).get_nvl_buffer_size_hint(hb, 2))


def noncontig(t: torch.Tensor) -> torch.Tensor:
    """Same shape and values, not contiguous."""
    if t.dim() == 1:
        return torch.stack([t, t], dim=1)[:, 0]
    out = t.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert not out.is_contiguous() and out.shape == t.shape
    return out


@dataclass(frozen=True)
class Case:
    """One refused call: `fn()` must raise `exc` naming `names`; then a valid call of kind `sync` ("normal" or
    "ll") shows whether the group is still in step."""
    category: str
    name: str
    sync: str
    exc: type
    names: Names
    fn: Callable[[], Any]


class Results:
    def __init__(self, rank: int, progress_dir: str = "") -> None:
        self.rank = rank
        self.progress_path = os.path.join(progress_dir, f"rank{rank}.json") if progress_dir else ""
        self.failures: Dict[str, List[str]] = {}
        self.ran: Dict[str, int] = {}
        self.aborted = ""
        self.aborted_at = None

    def expect(self, category: str, name: str, exc: type, names: Names, fn: Callable[[], Any]) -> None:
        self.ran[category] = self.ran.get(category, 0) + 1
        self.failures.setdefault(category, [])
        where = f"rank {self.rank} [{name}]"
        try:
            fn()
        except exc as error:
            if not names_ok(str(error), names):
                self.failures[category].append(f"{where}: {exc.__name__} message must name {names}: {error}")
        except Exception as error:  # noqa: BLE001
            self.failures[category].append(f"{where}: expected {exc.__name__}, got {type(error).__name__}: {error}")
        else:
            self.failures[category].append(f"{where}: expected {exc.__name__}, nothing was raised")

    def as_dict(self) -> Dict[str, Any]:
        return dict(failures=self.failures, ran=self.ran, aborted=self.aborted, aborted_at=self.aborted_at)

    def checkpoint(self, index: int, category: str, name: str) -> None:
        """Save the results so far and the case about to run: if a rank process dies (gloo aborts the
        process on a mismatched collective) or hangs, the test still knows what ran and where it broke."""
        if not self.progress_path:
            return
        tmp = self.progress_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(dict(results=self.as_dict(), current=[index, category, name]), f)
        os.replace(tmp, self.progress_path)


# ---------------------------------------------------------------------------------------------------
# the rank function
# ---------------------------------------------------------------------------------------------------
def run_error_cases(ctx, start: int = 0, progress_dir: str = "") -> Dict[str, Any]:
    """Run the cases from index `start` on (the local cases, then the mismatch steps)."""
    res = Results(ctx.rank, progress_dir)
    dev, group = ctx.device, ctx.group
    # The reference transport checks values at the call; the NVLink transport's deferred checks are tested in
    # test_nvlink.py.
    timeout = dict(timeout_s=STEP_TIMEOUT_S, transport="reference")
    ll_bytes = ll_formula(LL_MAX["n"], LL_MAX["hidden"], LL_MAX["experts"])

    buf = Buffer(group, nvl_size(), 0, **timeout)
    ll = Buffer(group, 0, ll_bytes, low_latency_mode=True, num_qps_per_rank=LL_MAX["experts"] // 2, **timeout)
    shrink = Buffer(group, 0, ll_bytes, low_latency_mode=True, num_qps_per_rank=E // 2, enable_shrink=True, **timeout)
    zero_nvl = Buffer(group, 0, 0, **timeout)
    small_nvl = Buffer(group, 1 << 20, 0, **timeout)   # < DeepEP's intranode need for H=128, K=2 (~1.45 MB, spec 5.8)
    small_rdma = Buffer(group, 0, ll_formula(N, H, E) - 256, low_latency_mode=True, num_qps_per_rank=E // 2, **timeout)

    # valid inputs (every token goes to expert 0 on rank 0 and expert 2 on rank 1)
    x = (100 * ctx.rank + torch.arange(T, dtype=torch.float32)).view(T, 1).expand(T, H).to(torch.bfloat16).contiguous()
    x = x.to(dev)
    topk_idx = torch.tensor([[0, 2]] * T, dtype=torch.int64, device=dev)
    topk_weights = torch.full((T, K), 0.5, dtype=torch.float32, device=dev)
    ntpr, ntprr, ntpe, itir, _ = buf.get_dispatch_layout(topk_idx, E)

    def dispatch_kwargs(**over):
        kwargs = dict(x=x, num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=ntprr, is_token_in_rank=itir,
                      num_tokens_per_expert=ntpe, topk_idx=topk_idx, topk_weights=topk_weights)
        kwargs.update(over)
        return kwargs

    def D(target=buf, **over):
        return lambda: target.dispatch(**dispatch_kwargs(**over))

    recv_x, recv_topk_idx, recv_topk_weights, _, handle, _ = buf.dispatch(**dispatch_kwargs())
    M = recv_x.shape[0]
    assert M == 2 * T

    def C(**over):
        kwargs = dict(x=recv_x, handle=handle)
        kwargs.update(over)
        return lambda: buf.combine(**kwargs)

    ll_recv_x, _, ll_handle, _, _ = ll.low_latency_dispatch(x, topk_idx, N, E, use_fp8=False)
    E_loc = E // 2

    def LD(target=ll, **over):
        kwargs = dict(x=x, topk_idx=topk_idx, num_max_dispatch_tokens_per_rank=N, num_experts=E, use_fp8=False)
        kwargs.update(over)
        return lambda: target.low_latency_dispatch(**kwargs)

    def LC(target=ll, **over):
        kwargs = dict(x=ll_recv_x, topk_idx=topk_idx, topk_weights=topk_weights, handle=ll_handle)
        kwargs.update(over)
        return lambda: target.low_latency_combine(**kwargs)

    def ids_with(value):
        bad = topk_idx.clone()
        bad[T - 1, 1] = value
        return bad

    wide_idx = torch.full((T, 33), -1, dtype=torch.int64, device=dev)
    wide_idx[:, :2] = topk_idx
    wide_w = torch.zeros((T, 33), dtype=torch.float32, device=dev)
    fp8_x = torch.zeros((T, H), dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn)
    bias = torch.zeros((T, H), dtype=torch.bfloat16, device=dev)
    num_channels = handle[1].shape[1]
    handle_4_ranks = (torch.zeros((4, 4), dtype=torch.int32, device=dev),
                      torch.zeros((4, num_channels), dtype=torch.int32, device=dev),
                      torch.zeros((4, num_channels), dtype=torch.int32, device=dev),
                      handle[3], torch.zeros((T, 4), dtype=torch.bool, device=dev),
                      torch.full((T, 4), -1, dtype=torch.int32, device=dev))
    ll_handle_4_ranks = (torch.zeros((2, 4 * N), dtype=torch.int32, device=dev),
                         torch.zeros((2, 4), dtype=torch.int64, device=dev), N, H, 8)
    i32 = lambda t: t.to(torch.int32)  # noqa: E731
    meta = lambda t: t.to("meta")      # noqa: E731
    status = torch.zeros(2, dtype=torch.int32, device=dev)
    ll_out = torch.empty((T, H), dtype=torch.bfloat16, device=dev)

    # calls with one tensor argument spoiled: (sync, the argument, the call given `bad`, which spoils the argument)
    spoilable: Dict[str, Tuple[str, str, Callable[[Callable], Callable[[], Any]]]] = {
        "layout topk_idx": ("normal", "topk_idx", lambda bad: lambda: buf.get_dispatch_layout(bad(topk_idx), E)),
        "dispatch x": ("normal", "x", lambda bad: D(x=bad(x))),
        "dispatch topk_idx": ("normal", "topk_idx", lambda bad: D(topk_idx=bad(topk_idx))),
        "dispatch topk_weights": ("normal", "topk_weights", lambda bad: D(topk_weights=bad(topk_weights))),
        "dispatch is_token_in_rank": ("normal", "is_token_in_rank", lambda bad: D(is_token_in_rank=bad(itir))),
        "dispatch num_tokens_per_rank": ("normal", "num_tokens_per_rank", lambda bad: D(num_tokens_per_rank=bad(ntpr))),
        "combine x": ("normal", "x", lambda bad: C(x=bad(recv_x))),
        "combine topk_weights": ("normal", "topk_weights", lambda bad: C(topk_weights=bad(recv_topk_weights))),
        "combine bias": ("normal", "bias", lambda bad: C(bias=bad(bias))),
        "LL dispatch x": ("ll", "x", lambda bad: LD(x=bad(x))),
        "LL dispatch topk_idx": ("ll", "topk_idx", lambda bad: LD(topk_idx=bad(topk_idx))),
        "LL combine x": ("ll", "x", lambda bad: LC(x=bad(ll_recv_x))),
        "LL combine topk_idx": ("ll", "topk_idx", lambda bad: LC(topk_idx=bad(topk_idx))),
        "LL combine topk_weights": ("ll", "topk_weights", lambda bad: LC(topk_weights=bad(topk_weights))),
        "LL combine out": ("ll", "out", lambda bad: LC(out=bad(ll_out))),
    }

    def spoiled(category: str, bad: Callable[[torch.Tensor], torch.Tensor], names: List[str]) -> List[Case]:
        """The calls `names` of `spoilable` with their argument spoiled by `bad`: ValueError naming it."""
        return [Case(category, name, spoilable[name][0], ValueError, [spoilable[name][1]], spoilable[name][2](bad))
                for name in names]

    cases = [
        # ---- wrong dtype: TypeError ----
        Case("dtype", "layout topk_idx int32", "normal", TypeError, ["topk_idx"],
             lambda: buf.get_dispatch_layout(i32(topk_idx), E)),
        Case("dtype", "dispatch topk_idx int32", "normal", TypeError, ["topk_idx"], D(topk_idx=i32(topk_idx))),
        Case("dtype", "dispatch topk_weights bf16", "normal", TypeError, ["topk_weights"],
             D(topk_weights=topk_weights.bfloat16())),
        Case("dtype", "dispatch is_token_in_rank int32", "normal", TypeError, ["is_token_in_rank"],
             D(is_token_in_rank=i32(itir))),
        Case("dtype", "dispatch num_tokens_per_rank int64", "normal", TypeError, ["num_tokens_per_rank"],
             D(num_tokens_per_rank=ntpr.long())),
        Case("dtype", "dispatch num_tokens_per_expert int64", "normal", TypeError, ["num_tokens_per_expert"],
             D(num_tokens_per_expert=ntpe.long())),
        Case("dtype", "dispatch fp8 scales bf16", "normal", TypeError, [("x", "scales", "x_scales")],
             D(x=(fp8_x, torch.ones((T, 1), dtype=torch.bfloat16, device=dev)))),
        Case("dtype", "combine x float32", "normal", TypeError, ["x"], C(x=recv_x.float())),
        Case("dtype", "combine topk_weights bf16", "normal", TypeError, ["topk_weights"],
             C(topk_weights=recv_topk_weights.bfloat16())),
        Case("dtype", "combine bias float32", "normal", TypeError, ["bias"], C(bias=bias.float())),
        Case("dtype", "combine handle recv_src_idx int64", "normal", TypeError, ["handle[3]"],
             C(handle=handle[:3] + (handle[3].long(),) + handle[4:])),
        Case("dtype", "LL dispatch x float32", "ll", TypeError, ["x"], LD(x=x.float())),
        Case("dtype", "LL dispatch topk_idx int32", "ll", TypeError, ["topk_idx"], LD(topk_idx=i32(topk_idx))),
        Case("dtype", "LL dispatch cumulative stats int64", "ll", TypeError, ["cumulative_local_expert_recv_stats"],
             LD(cumulative_local_expert_recv_stats=torch.zeros(E_loc, dtype=torch.int64, device=dev))),
        Case("dtype", "LL dispatch wait stats int32", "ll", TypeError, ["dispatch_wait_recv_cost_stats"],
             LD(dispatch_wait_recv_cost_stats=torch.zeros(2, dtype=torch.int32, device=dev))),
        Case("dtype", "LL combine x float32", "ll", TypeError, ["x"], LC(x=ll_recv_x.float())),
        Case("dtype", "LL combine topk_idx int32", "ll", TypeError, ["topk_idx"], LC(topk_idx=i32(topk_idx))),
        Case("dtype", "LL combine topk_weights bf16", "ll", TypeError, ["topk_weights"],
             LC(topk_weights=topk_weights.bfloat16())),
        Case("dtype", "LL combine out float32", "ll", TypeError, ["out"],
             LC(out=torch.empty((T, H), dtype=torch.float32, device=dev))),
        Case("dtype", "LL combine wait stats int32", "ll", TypeError, ["combine_wait_recv_cost_stats"],
             LC(combine_wait_recv_cost_stats=torch.zeros(2, dtype=torch.int32, device=dev))),

        # ---- wrong shape: ValueError ----
        Case("shape", "layout topk_idx 1-D", "normal", ValueError, ["topk_idx"],
             lambda: buf.get_dispatch_layout(topk_idx[:, 0].contiguous(), E)),
        Case("shape", "dispatch topk_idx 1-D", "normal", ValueError, ["topk_idx"],
             D(topk_idx=topk_idx[:, 0].contiguous(), topk_weights=topk_weights[:, 0].contiguous())),
        Case("shape", "dispatch is_token_in_rank [T, 3]", "normal", ValueError, ["is_token_in_rank"],
             D(is_token_in_rank=torch.ones((T, 3), dtype=torch.bool, device=dev))),
        Case("shape", "dispatch is_token_in_rank [T+1, 2]", "normal", ValueError, ["is_token_in_rank"],
             D(is_token_in_rank=torch.ones((T + 1, 2), dtype=torch.bool, device=dev))),
        Case("shape", "dispatch topk_weights [T, K+1]", "normal", ValueError, ["topk_weights"],
             D(topk_weights=torch.zeros((T, K + 1), dtype=torch.float32, device=dev))),
        Case("shape", "dispatch topk_weights [T+1, K]", "normal", ValueError, ["topk_weights"],
             D(topk_weights=torch.zeros((T + 1, K), dtype=torch.float32, device=dev))),
        Case("shape", "dispatch topk_idx rows != x rows", "normal", ValueError, [("topk_idx", "x")],
             D(topk_idx=torch.cat([topk_idx, topk_idx[:1]]), topk_weights=torch.cat([topk_weights, topk_weights[:1]]))),
        Case("shape", "dispatch num_tokens_per_rank [3]", "normal", ValueError, ["num_tokens_per_rank"],
             D(num_tokens_per_rank=torch.zeros(3, dtype=torch.int32, device=dev))),
        Case("shape", "dispatch x 1-D", "normal", ValueError, ["x"], D(x=x[0].contiguous())),
        Case("shape", "dispatch x rows of 200 bytes", "normal", ValueError, ["x"], D(x=x[:, :100].contiguous())),
        Case("shape", "dispatch fp8 scales rows != x rows", "normal", ValueError, [("x", "scales", "x_scales")],
             D(x=(fp8_x, torch.ones((T + 1, 1), dtype=torch.float32, device=dev)))),
        Case("shape", "dispatch fp8 scales with no columns", "normal", ValueError, [("x", "scales", "x_scales")],
             D(x=(fp8_x, torch.ones((T, 0), dtype=torch.float32, device=dev)))),
        Case("shape", "combine x rows != handle rows", "normal", ValueError, ["x"],
             C(x=torch.cat([recv_x, recv_x[:1]]))),
        Case("shape", "combine x 1-D", "normal", ValueError, ["x"], C(x=recv_x[0].contiguous())),
        Case("shape", "combine bias [T+1, H]", "normal", ValueError, ["bias"],
             C(bias=torch.zeros((T + 1, H), dtype=torch.bfloat16, device=dev))),
        Case("shape", "combine bias [T, H+8]", "normal", ValueError, ["bias"],
             C(bias=torch.zeros((T, H + 8), dtype=torch.bfloat16, device=dev))),
        Case("shape", "combine bias pair [T, H] + [T+1, H]", "normal", ValueError, ["bias"],
             C(bias=(bias, torch.zeros((T + 1, H), dtype=torch.bfloat16, device=dev)))),
        Case("shape", "combine bias tuple of 3", "normal", ValueError, ["bias"], C(bias=(bias, bias, bias))),
        Case("shape", "combine topk_weights rows != handle rows", "normal", ValueError, ["topk_weights"],
             C(topk_weights=torch.zeros((M + 1, K), dtype=torch.float32, device=dev))),
        Case("shape", "LL dispatch x 1-D", "ll", ValueError, ["x"], LD(x=x[0].contiguous())),
        Case("shape", "LL dispatch topk_idx 1-D", "ll", ValueError, ["topk_idx"],
             LD(topk_idx=topk_idx[:, 0].contiguous())),
        Case("shape", "LL dispatch topk_idx rows != x rows", "ll", ValueError, ["topk_idx"],
             LD(topk_idx=topk_idx[:T - 1].contiguous())),
        Case("shape", "LL dispatch wait stats [R, R]", "ll", ValueError, ["dispatch_wait_recv_cost_stats"],
             LD(dispatch_wait_recv_cost_stats=torch.zeros((2, 2), dtype=torch.int64, device=dev))),
        Case("shape", "LL dispatch cumulative stats [E_loc+1]", "ll", ValueError,
             ["cumulative_local_expert_recv_stats"],
             LD(cumulative_local_expert_recv_stats=torch.zeros(E_loc + 1, dtype=torch.int32, device=dev))),
        Case("shape", "LL combine x hidden != handle hidden", "ll", ValueError, ["x"],
             LC(x=torch.zeros((E_loc, 2 * N, H + 8), dtype=torch.bfloat16, device=dev))),
        Case("shape", "LL combine x [E_loc+1, R*N, H]", "ll", ValueError, ["x"],
             LC(x=torch.zeros((E_loc + 1, 2 * N, H), dtype=torch.bfloat16, device=dev))),
        Case("shape", "LL combine topk_weights shape != topk_idx shape", "ll", ValueError, ["topk_weights"],
             LC(topk_weights=topk_weights[:, :1].contiguous())),
        Case("shape", "LL combine out wrong shape", "ll", ValueError, ["out"],
             LC(out=torch.empty((T, H + 8), dtype=torch.bfloat16, device=dev))),

        # ---- non-contiguous, wrong device ('meta'): ValueError ----
        *spoiled("contiguity", noncontig, [
            "layout topk_idx", "dispatch x", "dispatch topk_idx", "dispatch topk_weights", "dispatch is_token_in_rank",
            "combine x", "combine topk_weights", "combine bias", "LL dispatch x", "LL dispatch topk_idx",
            "LL combine x", "LL combine topk_idx", "LL combine topk_weights"]),
        *spoiled("device", meta, [
            "layout topk_idx", "dispatch x", "dispatch topk_idx", "dispatch topk_weights", "dispatch is_token_in_rank",
            "dispatch num_tokens_per_rank", "combine x", "combine topk_weights", "combine bias", "LL dispatch x",
            "LL dispatch topk_idx", "LL combine x", "LL combine topk_weights", "LL combine out"]),

        # ---- expert ids out of range: ValueError ----
        Case("expert_range", "layout id == num_experts", "normal", ValueError, ["topk_idx"],
             lambda: buf.get_dispatch_layout(ids_with(E), E)),
        Case("expert_range", "layout id -2", "normal", ValueError, ["topk_idx"],
             lambda: buf.get_dispatch_layout(ids_with(-2), E)),
        # (the calls that exchange data check the values once the inputs are complete, and every rank refuses
        # together: the steps below)

        # ---- top-k > 32: ValueError ----
        Case("topk_limit", "dispatch top-33", "normal", ValueError, ["topk_idx"],
             D(topk_idx=wide_idx, topk_weights=wide_w)),

        # ---- num_experts not divisible by the rank count: ValueError ----
        Case("num_experts", "layout num_experts=5", "normal", ValueError, ["num_experts"],
             lambda: buf.get_dispatch_layout(topk_idx, 5)),
        Case("num_experts", "layout num_experts=0", "normal", ValueError, ["num_experts"],
             lambda: buf.get_dispatch_layout(torch.full((T, K), -1, dtype=torch.int64, device=dev), 0)),
        Case("num_experts", "dispatch 5 experts", "normal", ValueError, ["num_tokens_per_expert"],
             D(num_tokens_per_expert=torch.zeros(5, dtype=torch.int32, device=dev))),
        Case("num_experts", "LL dispatch num_experts=5", "ll", ValueError, ["num_experts"], LD(num_experts=5)),

        # ---- handle misuse: ValueError ----
        Case("handle", "dispatch handle + topk_idx", "normal", ValueError, ["handle", "topk_idx"],
             lambda: buf.dispatch(x, handle=handle, topk_idx=topk_idx)),
        Case("handle", "dispatch handle + topk_idx + topk_weights", "normal", ValueError, ["handle", "topk_idx"],
             lambda: buf.dispatch(x, handle=handle, topk_idx=topk_idx, topk_weights=topk_weights)),
        Case("handle", "dispatch handle + topk_weights", "normal", ValueError, ["handle", "topk_weights"],
             lambda: buf.dispatch(x, handle=handle, topk_weights=topk_weights)),
        Case("handle", "cached dispatch garbage tuple", "normal", ValueError, ["handle"],
             lambda: buf.dispatch(x, handle=(1, 2, 3))),
        Case("handle", "cached dispatch x rows != handle tokens", "normal", ValueError, ["x", "handle"],
             lambda: buf.dispatch(torch.cat([x, x[:1]]), handle=handle)),
        Case("handle", "combine garbage tuple", "normal", ValueError, ["handle"], C(handle=(1, 2, 3))),
        Case("handle", "combine tuple of 6 ints", "normal", ValueError, ["handle"], C(handle=(1, 2, 3, 4, 5, 6))),
        Case("handle", "combine handle None", "normal", ValueError, ["handle"], C(handle=None)),
        Case("handle", "combine handle from 4 ranks", "normal", ValueError, ["handle"], C(handle=handle_4_ranks)),
        Case("handle", "combine internode-style 10-tuple", "normal", ValueError, ["handle"],
             C(handle=tuple(handle) + (None,) * 4)),
        Case("handle", "combine with another num_sms than the dispatch", "normal", ValueError,
             [("num_sms", "config", "handle")], C(config=Config(24, 6, 256, 6, 128))),
        Case("handle", "LL combine garbage tuple", "ll", ValueError, ["handle"], LC(handle=(1, 2, 3))),
        Case("handle", "LL combine handle from 4 ranks", "ll", ValueError, ["handle"], LC(handle=ll_handle_4_ranks)),
        Case("handle", "LL next combine buffer garbage", "ll", ValueError, ["handle"],
             lambda: ll.get_next_low_latency_combine_buffer((1, 2, 3))),

        # ---- buffer too small / wrong mode: ValueError ----
        Case("buffer_size", "dispatch with num_nvl_bytes=0", "normal", ValueError, ["num_nvl_bytes"], D(zero_nvl)),
        Case("buffer_size", "dispatch with num_nvl_bytes=1 MiB (DeepEP needs ~1.45 MB here)", "normal", ValueError,
             ["num_nvl_bytes"], D(small_nvl)),
        Case("buffer_size", "LL dispatch with num_rdma_bytes below the hint", "ll", ValueError, ["num_rdma_bytes"],
             LD(small_rdma)),
        Case("buffer_size", "LL dispatch N beyond the buffer", "ll", ValueError, ["num_rdma_bytes"],
             LD(num_max_dispatch_tokens_per_rank=64)),
        Case("buffer_size", "LL dispatch without low_latency_mode", "normal", ValueError, ["low_latency_mode"],
             LD(buf)),
        Case("buffer_size", "LL combine without low_latency_mode", "normal", ValueError, ["low_latency_mode"],
             LC(buf)),
        Case("buffer_size", "clean_low_latency_buffer without low_latency_mode", "normal", ValueError,
             ["low_latency_mode"], lambda: buf.clean_low_latency_buffer(N, H, E)),
        Case("buffer_size", "next LL combine buffer without low_latency_mode", "normal", ValueError,
             ["low_latency_mode"], lambda: buf.get_next_low_latency_combine_buffer(ll_handle)),

        # ---- more than N tokens in low-latency mode: ValueError ----
        Case("ll_tokens", "LL dispatch N+1 tokens", "ll", ValueError, [("x", "num_max_dispatch_tokens_per_rank")],
             LD(x=x[:1].expand(N + 1, H).contiguous(), topk_idx=topk_idx[:1].expand(N + 1, K).contiguous())),
        Case("ll_tokens", "LL combine N+1 tokens", "ll", ValueError,
             [("topk_idx", "topk_weights", "num_max_dispatch_tokens_per_rank")],
             LC(topk_idx=topk_idx[:1].expand(N + 1, K).contiguous(),
                topk_weights=topk_weights[:1].expand(N + 1, K).contiguous())),

        # ---- incompatible flags: ValueError ----
        Case("flags", "LL dispatch async_finish + return_recv_hook", "ll", ValueError,
             ["async_finish", "return_recv_hook"], LD(async_finish=True, return_recv_hook=True)),
        Case("flags", "LL combine async_finish + return_recv_hook", "ll", ValueError,
             ["async_finish", "return_recv_hook"], LC(async_finish=True, return_recv_hook=True)),
        Case("flags", "LL combine zero_copy + use_logfmt", "ll", ValueError, ["zero_copy", "use_logfmt"],
             LC(zero_copy=True, use_logfmt=True)),
        Case("flags", "LL dispatch use_ue8m0 without round_scale", "ll", ValueError, ["use_ue8m0", "round_scale"],
             LD(use_fp8=True, round_scale=False, use_ue8m0=True)),
        Case("flags", "layout allocate_on_comm_stream without previous_event", "normal", ValueError,
             ["allocate_on_comm_stream"],
             lambda: buf.get_dispatch_layout(topk_idx, E, async_finish=True, allocate_on_comm_stream=True)),
        Case("flags", "layout allocate_on_comm_stream with the event of a synchronous call", "normal", ValueError,
             ["allocate_on_comm_stream", "previous_event"],
             lambda: buf.get_dispatch_layout(topk_idx, E, previous_event=deep_ep.EventOverlap(None), async_finish=True,
                                             allocate_on_comm_stream=True)),
        Case("flags", "layout allocate_on_comm_stream without async_finish", "normal", ValueError,
             ["allocate_on_comm_stream"],
             lambda: buf.get_dispatch_layout(topk_idx, E, previous_event=Buffer.capture(),
                                             allocate_on_comm_stream=True)),
        Case("flags", "dispatch allocate_on_comm_stream without previous_event", "normal", ValueError,
             ["allocate_on_comm_stream"], D(async_finish=True, allocate_on_comm_stream=True)),
        Case("flags", "combine allocate_on_comm_stream without async_finish", "normal", ValueError,
             ["allocate_on_comm_stream"], C(previous_event=Buffer.capture(), allocate_on_comm_stream=True)),
        Case("flags", "dispatch expert_alignment=0", "normal", ValueError, ["expert_alignment"],
             D(expert_alignment=0)),
        Case("flags", "dispatch num_worst_tokens=-1", "normal", ValueError, ["num_worst_tokens"],
             D(num_worst_tokens=-1)),
        Case("flags", "dispatch config with odd num_sms", "normal", ValueError, [("num_sms", "config")],
             D(config=Config(21, 6, 256, 6, 128))),

        # ---- mask APIs: ValueError ----
        Case("mask", "update mask without enable_shrink", "normal", ValueError, ["enable_shrink"],
             lambda: buf.low_latency_update_mask_buffer(1 - ctx.rank, True)),
        Case("mask", "query mask without enable_shrink", "normal", ValueError, ["enable_shrink"],
             lambda: buf.low_latency_query_mask_buffer(status)),
        Case("mask", "clean mask without enable_shrink", "normal", ValueError, ["enable_shrink"],
             lambda: buf.low_latency_clean_mask_buffer()),
        Case("mask", "update mask on an LL buffer without enable_shrink", "ll", ValueError, ["enable_shrink"],
             lambda: ll.low_latency_update_mask_buffer(1 - ctx.rank, True)),
        Case("mask", "update mask rank 2 of 2", "ll", ValueError, ["rank_to_mask"],
             lambda: shrink.low_latency_update_mask_buffer(2, True)),
        Case("mask", "update mask rank -1", "ll", ValueError, ["rank_to_mask"],
             lambda: shrink.low_latency_update_mask_buffer(-1, True)),
        Case("mask", "query mask int64", "ll", TypeError, ["mask_status"],
             lambda: shrink.low_latency_query_mask_buffer(status.long())),
        Case("mask", "query mask of 3 elements", "ll", ValueError, ["mask_status"],
             lambda: shrink.low_latency_query_mask_buffer(torch.zeros(3, dtype=torch.int32, device=dev))),

        # ---- construction: ValueError ----
        Case("construction", "Buffer(None)", "normal", ValueError, ["group", "comm"], lambda: Buffer(None)),
        Case("construction", "num_nvl_bytes=100", "normal", ValueError, ["num_nvl_bytes"], lambda: Buffer(group, 100)),
        Case("construction", "num_nvl_bytes=-128", "normal", ValueError, ["num_nvl_bytes"],
             lambda: Buffer(group, -128)),
        Case("construction", "num_rdma_bytes=100", "normal", ValueError, ["num_rdma_bytes"],
             lambda: Buffer(group, 0, 100, low_latency_mode=True)),
        Case("construction", "num_qps_per_rank=0", "normal", ValueError, ["num_qps_per_rank"],
             lambda: Buffer(group, 0, ll_formula(N, H, E), low_latency_mode=True, num_qps_per_rank=0)),
        Case("construction", "timeout_s=0", "normal", ValueError, ["timeout_s"], lambda: Buffer(group, 0, timeout_s=0)),
        Case("construction", "transport='bogus'", "normal", ValueError, ["transport"],
             lambda: Buffer(group, 0, transport="bogus")),
        Case("construction", "num_ranks_per_node=3 of 2 ranks", "normal", ValueError, ["num_ranks_per_node"],
             lambda: Buffer(group, 0, num_ranks_per_node=3)),
        Case("construction", "timeout_s=inf", "normal", ValueError, ["timeout_s"],
             lambda: Buffer(group, 0, timeout_s=float("inf"))),
        Case("construction", "timeout_s=0", "normal", ValueError, ["timeout_s"], lambda: Buffer(group, 0, timeout_s=0)),
        Case("construction", "DEEP_EP_TIMEOUT_S=100s", "normal", ValueError, ["DEEP_EP_TIMEOUT_S"],
             mock.patch.dict(os.environ, DEEP_EP_TIMEOUT_S="100s")(lambda: Buffer(group, 0))),
    ]

    # ---- the follow-up calls that prove the group is still in step ----------------------------------------
    def sync_normal():
        layout = buf.get_dispatch_layout(topk_idx, E)
        got = buf.dispatch(x, num_tokens_per_rank=layout[0], num_tokens_per_rdma_rank=layout[1],
                           is_token_in_rank=layout[3], num_tokens_per_expert=layout[2], topk_idx=topk_idx,
                           topk_weights=topk_weights)[0]
        assert got.shape[0] == 2 * T and got[T, 0].item() == 100 and got[T - 1, 0].item() == T - 1, "wrong rows"

    def sync_ll():
        _, count, _, _, _ = ll.low_latency_dispatch(x, topk_idx, N, E, use_fp8=False)
        assert count.tolist() == [2 * T, 0], f"wrong recv_count {count.tolist()}"

    syncs = {"normal": sync_normal, "ll": sync_ll}

    def in_step(index: int, category: str, after: str, sync: str) -> bool:
        try:
            syncs[sync]()
            return True
        except Exception:  # noqa: BLE001
            res.failures.setdefault(category, []).append(
                f"rank {ctx.rank} [{after}]: the group is out of step after this call (it started a collective on "
                "one rank only, or consumed a low-latency buffer half); see test_refused_calls_leave_the_group_in_step")
            res.aborted = (f"rank {ctx.rank}: the group is out of step after [{after}] (the call started a "
                           f"collective on one rank only, or consumed a buffer half?); the follow-up {sync} call "
                           f"failed:\n{traceback.format_exc()}")
            res.aborted_at = index
            return False

    for i, case in enumerate(cases):
        if i < start:
            continue
        res.checkpoint(i, case.category, case.name)
        if i % 2 == ctx.rank:   # only one rank makes the bad call
            res.expect(case.category, case.name, case.exc, case.names, case.fn)
        else:
            res.ran[case.category] = res.ran.get(case.category, 0) + 1
            res.failures.setdefault(case.category, [])
        if not in_step(i, case.category, case.name, case.sync):
            return res.as_dict()

    # ---- ranks calling with different shapes: ValueError on every rank, no hang ---------------------------
    def mismatched(index, name, sync, fn0, fn1, names, category="mismatch"):
        if index < start:
            return True
        res.checkpoint(index, category, name)
        res.expect(category, name, ValueError, names, fn0 if ctx.rank == 0 else fn1)
        return in_step(index, category, name, sync)

    other_hidden = x[:, :1].expand(T, 2 * H).contiguous()
    topk_8 = torch.tensor([[0, 4]] * T, dtype=torch.int64, device=dev)
    layout_8 = buf.get_dispatch_layout(topk_8, 8)
    top1 = topk_idx[:, :1].contiguous()
    layout_top1 = buf.get_dispatch_layout(top1, E)
    to_rank_0 = torch.tensor([[0, 1]] * T, dtype=torch.int64, device=dev)   # rank 0 receives 2 * T tokens, rank 1 none
    layout_0 = buf.get_dispatch_layout(to_rank_0, E)
    worst_too_small = D(topk_idx=to_rank_0, num_tokens_per_rank=layout_0[0], num_tokens_per_expert=layout_0[2],
                        is_token_in_rank=layout_0[3], num_worst_tokens=T + 1)
    handle_b = buf.dispatch(**dispatch_kwargs())[4]   # another dispatch, with the same counts as `handle`'s
    steps = [
        ("dispatch hidden 128 vs 256", "normal", D(), D(x=other_hidden), [("hidden", "x")]),
        ("dispatch num_experts 4 vs 8", "normal", D(),
         D(topk_idx=topk_8, num_tokens_per_rank=layout_8[0], num_tokens_per_expert=layout_8[2],
           is_token_in_rank=layout_8[3]), ["num_experts"]),
        ("dispatch top-k 2 vs 1", "normal", D(),
         D(topk_idx=top1, topk_weights=topk_weights[:, :1].contiguous(), num_tokens_per_rank=layout_top1[0],
           num_tokens_per_expert=layout_top1[2], is_token_in_rank=layout_top1[3]), [("topk", "top-k", "topk_idx")]),
        # (the same call on both ranks; only rank 0 receives more than num_worst_tokens)
        ("dispatch num_worst_tokens below rank 0's count", "normal", worst_too_small, worst_too_small,
         ["num_worst_tokens"]),
        ("combine with handles of two dispatches", "normal", C(), C(handle=handle_b), ["handle"]),
        ("cached dispatch with handles of two dispatches", "normal", lambda: buf.dispatch(x, handle=handle),
         lambda: buf.dispatch(x, handle=handle_b), ["handle"]),
        ("combine hidden 128 vs 256", "normal", C(), C(x=recv_x[:, :1].expand(M, 2 * H).contiguous()),
         [("hidden", "x")]),
        ("LL dispatch hidden 128 vs 256", "ll", LD(), LD(x=other_hidden), [("hidden", "x")]),
        ("LL dispatch num_experts 4 vs 8", "ll", LD(), LD(topk_idx=topk_8, num_experts=8), ["num_experts"]),
        ("LL dispatch N 8 vs 16", "ll", LD(), LD(num_max_dispatch_tokens_per_rank=16),
         ["num_max_dispatch_tokens_per_rank"]),
    ]
    for j, (name, sync, fn0, fn1, names) in enumerate(steps):
        if not mismatched(len(cases) + j, name, sync, fn0, fn1, names):
            return res.as_dict()

    # ---- bad expert ids on one rank only: every rank refuses the call (the rank with them names topk_idx), so
    # that ranks which catch the error stay in step ----------------------------------------------------------
    refused_together = [
        ("dispatch id == num_experts", "normal", D(topk_idx=ids_with(E)), D()),
        ("dispatch id -2", "normal", D(), D(topk_idx=ids_with(-2))),
        ("LL dispatch id == num_experts", "ll", LD(topk_idx=ids_with(E)), LD()),
        ("LL dispatch id -2", "ll", LD(), LD(topk_idx=ids_with(-2))),
        ("LL combine id == num_experts", "ll", LC(topk_idx=ids_with(E)), LC()),
    ]
    for j, (name, sync, fn0, fn1) in enumerate(refused_together):
        bad_rank = 0 if "== num_experts" in name else 1
        names = ["topk_idx"] if ctx.rank == bad_rank else [f"rank {bad_rank}"]
        if not mismatched(len(cases) + len(steps) + j, name, sync, fn0, fn1, names, category="expert_range"):
            return res.as_dict()

    # ---- finally, the kept handles still work ----------------------------------------------------------
    try:
        combined = buf.combine(recv_x, handle)[0]
        assert torch.equal(combined.float().cpu(), 2 * x.float().cpu())
        _, _, h, _, _ = ll.low_latency_dispatch(x, topk_idx, N, E, use_fp8=False)
        got = ll.low_latency_combine(ll_recv_x, topk_idx, topk_weights, h)[0]
        assert got.shape == (T, H)
    except Exception:  # noqa: BLE001
        res.aborted = f"rank {ctx.rank}: final valid calls failed:\n{traceback.format_exc()}"
    return res.as_dict()


# ---------------------------------------------------------------------------------------------------
# pytest side
# ---------------------------------------------------------------------------------------------------
CATEGORIES = ["dtype", "shape", "contiguity", "device", "expert_range", "topk_limit", "num_experts", "handle",
              "buffer_size", "ll_tokens", "flags", "mask", "construction", "mismatch"]


RUN_TIMEOUT_S = 45   # a clean run takes a few seconds; only a dead or hung rank reaches this


def _merge(merged: Dict[str, Any], result: Dict[str, Any]) -> None:
    for category, failures in result["failures"].items():
        merged["failures"].setdefault(category, []).extend(failures)
    for category, count in result["ran"].items():
        merged["ran"][category] = merged["ran"].get(category, 0) + count
    if result["aborted"]:
        merged["aborted"].append(result["aborted"])


@pytest.fixture(scope="module")
def error_results(tmp_path_factory):
    """Run every case; when a case breaks the group (a refused call that started a collective on one rank),
    record it, start fresh ranks and resume after that case, so one bug does not hide the other cases."""
    from dist_utils import get_pool
    merged: Dict[str, Any] = dict(failures={}, ran={}, aborted=[])
    start = 0
    for attempt in range(MAX_RESTARTS + 1):
        progress = tmp_path_factory.mktemp(f"errors{attempt}")
        pool = get_pool(2)
        try:
            per_rank = pool.run(run_error_cases, start, str(progress), timeout=RUN_TIMEOUT_S)
        except TimeoutError:      # a rank died or hung (the pool is restarted): recover from the checkpoints
            snapshots = []
            for rank in range(2):
                path = progress / f"rank{rank}.json"
                if path.exists():
                    snapshots.append(json.loads(path.read_text()))
            for snap in snapshots:
                _merge(merged, snap["results"])
            if not snapshots:
                merged["aborted"].append(f"ranks died before the first case (resuming at {start})")
                break
            index, category, name = min(snap["current"] for snap in snapshots)
            merged["failures"].setdefault(category, []).append(
                f"[{name}] a rank process died or hung here (no answer within {RUN_TIMEOUT_S} s): the call "
                "started a collective on one rank only (gloo aborts on mismatched collectives)")
            merged["aborted"].append(f"the group broke at case {index} [{name}]")
            start = index + 1
            continue
        for result in per_rank:
            _merge(merged, result)
        stops = [r["aborted_at"] for r in per_rank if r["aborted_at"] is not None]
        if any(r["aborted"] for r in per_rank):
            pool.restart()        # the group holds an unmatched collective: fresh ranks for what follows
        if not stops:
            break
        start = max(stops) + 1    # resume after the case that broke the group
        if attempt == MAX_RESTARTS:
            merged["aborted"].append(f"gave up after {MAX_RESTARTS} restarts; cases from index {start} did not run")
    return merged


def test_refused_calls_leave_the_group_in_step(error_results):
    assert not error_results["aborted"], "\n".join(error_results["aborted"])


@pytest.mark.parametrize("category", CATEGORIES)
def test_bad_input(error_results, category):
    failures = error_results["failures"].get(category, [])
    assert not failures, f"{category}: {len(failures)} case(s) wrong:\n" + "\n".join(failures)
    assert error_results["ran"].get(category, 0) > 0, f"no {category} case ran"


# ---------------------------------------------------------------------------------------------------
# bounded waits: rank 1 skips a dispatch that rank 0 makes
# ---------------------------------------------------------------------------------------------------
TIMEOUT_S = 3


def run_timeout_case(ctx) -> Dict[str, Any]:
    buf = Buffer(ctx.group, nvl_size(), 0, timeout_s=TIMEOUT_S, transport="reference",
                 explicitly_destroy=ctx.rank == 0)
    x = torch.ones((T, H), dtype=torch.bfloat16, device=ctx.device)
    topk_idx = torch.tensor([[0, 2]] * T, dtype=torch.int64, device=ctx.device)
    ntpr, ntprr, ntpe, itir, _ = buf.get_dispatch_layout(topk_idx, E)
    if ctx.rank == 1:
        return {}
    out: Dict[str, Any] = {}
    start = time.monotonic()
    try:
        buf.dispatch(x, num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=ntprr, is_token_in_rank=itir,
                     num_tokens_per_expert=ntpe)
        out["error"] = None
    except Exception as error:  # noqa: BLE001
        out["error"], out["message"] = type(error), str(error)
        out["is_comm_timeout"] = isinstance(error, deep_ep.CommTimeoutError)
    out["elapsed"] = time.monotonic() - start
    start = time.monotonic()
    try:   # the Buffer is unusable afterwards: refused at once, without starting another collective
        buf.dispatch(x, num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=ntprr, is_token_in_rank=itir,
                     num_tokens_per_expert=ntpe)
        out["after"] = None
    except Exception as error:  # noqa: BLE001
        out["after"], out["after_message"] = type(error), str(error)
    out["after_elapsed"] = time.monotonic() - start
    try:   # a broken Buffer can still be destroyed (locally: its group is out of step)
        buf.destroy()
        out["destroyed"] = buf.runtime is None
    except Exception as error:  # noqa: BLE001
        out["destroyed"] = f"{type(error).__name__}: {error}"
    from deep_ep.group import Group
    try:   # a wait on some ranks only (shrink mode's exchanges) names them
        Group(ctx.group, None, timeout_s=1).barrier("a barrier of ranks 0 and 1", ranks=[0, 1])
        out["subset"] = "no error"
    except deep_ep.CommTimeoutError as error:
        out["subset"] = str(error)
    return out


def test_wait_times_out_with_comm_timeout_error():
    from dist_utils import get_pool
    # (rank 0's group is left with an unmatched collective)
    results = get_pool(2).run_then_restart(run_timeout_case, timeout=60)
    r0 = results[0]
    assert r0["error"] is not None, "rank 0's dispatch completed although rank 1 never called dispatch"
    assert r0["is_comm_timeout"], f"expected deep_ep.CommTimeoutError, got {r0['error'].__name__}: {r0['message']}"
    assert "rank 0" in r0["message"], f"the message must name the rank: {r0['message']}"
    assert r0["elapsed"] <= TIMEOUT_S + 10, f"took {r0['elapsed']:.1f} s with timeout_s={TIMEOUT_S}"
    assert r0["elapsed"] >= TIMEOUT_S * 0.8, f"gave up after {r0['elapsed']:.1f} s, before timeout_s={TIMEOUT_S}"
    assert r0["after"] is not None and issubclass(r0["after"], RuntimeError), \
        f"a call on the broken Buffer must raise RuntimeError, got {r0['after']}"
    assert r0["after_elapsed"] < TIMEOUT_S, "the broken Buffer must refuse at once, not wait again"
    assert r0["destroyed"] is True, f"destroy() of the broken Buffer: {r0['destroyed']}"
    assert "rank 0: a barrier of ranks 0 and 1 did not complete" in r0["subset"] \
        and "waiting for rank 1:" in r0["subset"], r0["subset"]


def run_group_timeout_case(ctx) -> Dict[str, Any]:
    """A Buffer with timeout_s=30 on a gloo group whose own timeout is 2 s: rank 1 skips a dispatch, so rank 0's
    wait ends when the group's timeout fires, and the error must say how long it waited, not timeout_s."""
    import datetime
    short_group = torch.distributed.new_group(backend="gloo", timeout=datetime.timedelta(seconds=2))
    buf = Buffer(short_group, nvl_size(), 0, timeout_s=30, transport="reference")
    topk_idx = torch.tensor([[0, 2]] * T, dtype=torch.int64, device=ctx.device)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, E)
    if ctx.rank == 1:
        return {}
    start = time.monotonic()
    try:
        buf.dispatch(torch.ones((T, H), dtype=torch.bfloat16, device=ctx.device), num_tokens_per_rank=per_rank,
                     is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
        return {"message": "no error", "elapsed": time.monotonic() - start}
    except deep_ep.CommTimeoutError as error:
        return {"message": str(error), "elapsed": time.monotonic() - start}


def test_timeout_error_reports_the_time_waited_when_the_groups_timeout_fires_first():
    from dist_utils import get_pool
    r0 = get_pool(2).run_then_restart(run_group_timeout_case, timeout=60)[0]
    assert r0["elapsed"] < 10, f"rank 0 waited {r0['elapsed']:.1f} s, beyond the group's 2 s timeout"
    waited = re.search(r"did not complete in ([0-9.]+) s \(timeout 30 s; waiting for", r0["message"])
    assert waited and abs(float(waited.group(1)) - r0["elapsed"]) < 1.0, r0["message"]


LATE_S = 4.0   # how late rank 1 comes to a Buffer's construction


def run_late_construction(ctx) -> Dict[str, Any]:
    """Rank 1 reaches the construction LATE_S after rank 0, with timeout_s well below it: on the pool's group
    (its own timeout 120 s) both ranks build the Buffer and a dispatch round trip runs; on a group whose own
    timeout (2 s) is shorter than the delay, rank 0 gives up after the group's timeout, not the Buffer's."""
    import datetime
    out: Dict[str, Any] = {}
    short_group = torch.distributed.new_group(backend="gloo", timeout=datetime.timedelta(seconds=2))
    if ctx.rank == 1:
        time.sleep(LATE_S)
    buf = Buffer(ctx.group, nvl_size(), 0, timeout_s=1.0, transport="reference", explicitly_destroy=True)
    x = torch.randn((T, H), device=ctx.device).to(torch.bfloat16)
    topk_idx = torch.randint(0, E, (T, 1), device=ctx.device)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, E)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                              num_tokens_per_expert=per_expert)
    combined = buf.combine(recv_x, handle)[0]
    out["round trip"] = bool(torch.equal(combined, x))   # (one expert each: every token comes back once)
    buf.destroy()
    if ctx.rank == 1:
        time.sleep(LATE_S)
    start = time.monotonic()
    try:
        Buffer(short_group, nvl_size(), 0, timeout_s=1.0, transport="reference")
        out["short group"] = "constructed"
    except Exception as error:  # noqa: BLE001
        out["short group"] = f"{type(error).__name__}: {error}"
    out["short group elapsed"] = time.monotonic() - start
    return out


def test_construction_waits_for_late_ranks_as_long_as_the_group_does():
    from dist_utils import get_pool
    results = get_pool(2).run_then_restart(run_late_construction, timeout=90)   # (the short group is left unmatched)
    for rank, r in enumerate(results):
        assert r["round trip"], f"rank {rank}: the round trip after a late construction differs"
    r0 = results[0]
    assert r0["short group"].startswith("CommTimeoutError") and "rank 0: Buffer construction" in r0["short group"] \
        and re.search(r"did not complete in 2\.\d s \(timeout 2 s;", r0["short group"]), r0["short group"]
    assert 1.5 <= r0["short group elapsed"] < LATE_S, r0["short group elapsed"]
