"""Conformance tests of the low-latency (LL) mode: low_latency_dispatch / low_latency_combine and friends.

Every rank generates the inputs of ALL ranks from one random base seed (drawn fresh each run from
os.urandom, printed in every failure message; set DEEP_EP_TEST_SEED to replay one), feeds its own to the
library and compares its results with the independent single-process model of tests/model_low_latency.py.

Comparisons:
- dispatch: bitwise (BF16 payload, e4m3 bytes, float32 scales, UE8M0 exponent bytes), recv_count,
  layout_range (count always; begin where count > 0), src_info of every valid row (row order is
  (source rank, source token, top-k slot), docs/DESIGN.md).
- combine: bitwise against the model, whose fp32 order is the library's documented one (acc = 0; for k
  ascending: acc = fp32(acc + fp32(w * row)); bf16(acc)). Expert outputs span 2^-16..2^16 so that any other
  summation order or a fused multiply-add would show in the bits. LogFMT: within the bound derived in
  model_low_latency.LOGFMT_REL (9-bit log2 codes, range <= 32 octaves: 2.58% of
  sum|w*v| plus BF16 rounding of the result).

All cases of one world size run inside one `pool.run` (spawning ranks is the expensive part). A rank
records mismatches instead of raising, so that every rank keeps taking part in the collectives.
"""
from __future__ import annotations

import os
import traceback
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch

import model_low_latency as M
from cases import CaseInputs, LowLatencyCase, RoundOptions
from compare import Mismatches, report_mismatches
from dist_utils import run_deterministic, run_on_another_thread, run_under_defaults
from inputs import LOW_LATENCY_ROUTING, make_octave_spread_x, make_routing, wide_random
from randomness import base_seed, bits, generator

# ---------------------------------------------------------------------------------------------------
# seeds and random inputs (identical on every rank)
# ---------------------------------------------------------------------------------------------------


def logfmt_rows(gen: torch.Generator, rows: int, hidden: int) -> torch.Tensor:
    """bf16 rows for LogFMT: mostly |x| < 1 (encoded chunks), some rows larger (BF16 chunks), some zeros."""
    scale = torch.tensor([0.02, 0.2, 0.6, 3.0])[torch.randint(4, (rows, 1), generator=gen)]
    x = torch.randn(rows, hidden, generator=gen) * scale
    x[torch.rand(rows, hidden, generator=gen) < 0.02] = 0
    return x.to(torch.bfloat16)


def logfmt_encoded(rows: torch.Tensor) -> torch.Tensor:
    """Spec 9.5: which channels of each row travel LogFMT-encoded ([T, H] bool): those of a chunk (1024
    channels, 512 unless H % 1024 == 0) whose every 128-channel group has amax < 1 and amin < amax."""
    num_rows, hidden = rows.shape
    mag = rows.float().abs()
    group_ok = []
    for g in range(0, hidden, 128):
        amax, amin = mag[:, g:g + 128].amax(1), mag[:, g:g + 128].amin(1)
        group_ok.append((amax < 1) & (amin < amax))
    per_chunk = 8 if hidden % 1024 == 0 else 4
    encoded = torch.zeros(num_rows, hidden, dtype=torch.bool)
    for c in range(0, len(group_ok), per_chunk):
        chunk_ok = torch.stack(group_ok[c:c + per_chunk]).all(0)
        encoded[:, c * 128:(c + per_chunk) * 128] = chunk_ok[:, None]
    return encoded


def make_sources(seed: int, case: CaseInputs, num_ranks: int) -> List[M.Source]:
    """Every rank's inputs of `case` (the same on every rank)."""
    num_experts = num_ranks * case.experts_per_rank
    # (the "" key keeps the inputs that earlier seeds drew)
    hot = int(torch.randint(num_experts, (1,), generator=generator(seed, case.name, "", "hot")))
    sources = []
    for s in range(num_ranks):
        gen = generator(seed, case.name, "", "source", s)
        idx, w = make_routing(gen, case.tokens[s], case.topk, num_experts, case.routing, case.mask_frac, hot,
                              **LOW_LATENCY_ROUTING)
        sources.append(M.Source(make_octave_spread_x(gen, case.tokens[s], case.hidden), idx, w))
    return sources


def expert_outputs(seed: int, key: Any, regions: List[M.Region], num_max_tokens: int, hidden: int,
                   logfmt: bool) -> List[torch.Tensor]:
    """Combine inputs of every rank: [E_loc, R*N, H] bf16, random in the valid rows, NaN elsewhere (the
    contract says rows >= recv_count are ignored)."""
    out = []
    for reg in regions:
        gen = generator(seed, key, "y", reg.rank)
        rows = reg.row.numel()
        vals = logfmt_rows(gen, rows, hidden) if logfmt else wide_random(gen, rows, hidden)
        full = torch.full((reg.experts_per_rank, reg.num_ranks * num_max_tokens, hidden), float("nan"),
                          dtype=torch.bfloat16)
        full[reg.expert, reg.row] = vals
        out.append(full)
    return out


def drop_some(seed: int, key: Any, rank: int, idx: torch.Tensor) -> torch.Tensor:
    """The combine may replace entries of the dispatch's topk_idx by -1 (contribution dropped).

    A duplicated expert of one token is dropped in all its slots or in none: the handle does not say which
    slot a row came from, so dropping only some copies would make the pairing of the remaining slots with
    the rows ambiguous."""
    gen = generator(seed, key, "drop", rank)
    drop = torch.rand(idx.shape, generator=gen) < 0.25
    for t in range(idx.shape[0]):
        first: Dict[int, bool] = {}
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e >= 0:
                drop[t, k] = first.setdefault(e, bool(drop[t, k]))
    out = idx.clone()
    out[drop] = -1
    return out


# ---------------------------------------------------------------------------------------------------
# checking
# ---------------------------------------------------------------------------------------------------
class LowLatencyChecker(Mismatches):
    """The mismatches of one rank over all its steps (the first 60), labelled with where they arose (`at`),
    and the wait-cost statistics it observed."""

    def __init__(self, seed: int, rank: int) -> None:
        super().__init__(max_errors=60)
        self.seed, self.rank = seed, rank
        self.where = ""
        self.wait_checks = 0      # wait-cost stats observed
        self.wait_grew = 0        # ... of which some entry strictly grew
        self.wait_grew_sources: set = set()   # the source ranks whose entry grew in some call

    def label(self) -> str:
        return f"[seed={self.seed} rank={self.rank} {self.where}]"

    def at(self, where: str) -> "LowLatencyChecker":
        self.where = where
        return self

    def meta(self, what: str, t: Any, dtype: torch.dtype, shape: tuple) -> bool:
        if not self.true(f"{what} type", isinstance(t, torch.Tensor), f"expected a tensor, got {type(t).__name__}"):
            return False
        ok = self.true(f"{what} dtype", t.dtype == dtype, f"got {t.dtype}, expected {dtype}")
        ok &= self.true(f"{what} shape", tuple(t.shape) == tuple(shape), f"got {tuple(t.shape)}, expected {shape}")
        return ok

    def event(self, what: str, ev: Any, async_finish: bool, kept: Optional[Dict[int, Any]] = None,
              num_kept: int = 0) -> None:
        """The call's EventOverlap; when async, its extra_tensors has `num_kept` entries, entry i being the
        object kept[i] (spec 9.3, 9.4)."""
        from deep_ep import EventOverlap
        if not self.true(f"{what} event type", isinstance(ev, EventOverlap), f"got {type(ev).__name__}"):
            return
        if async_finish:
            if self.true(f"{what} event", ev.event is not None, "async_finish=True must return an event"):
                extra = ev.extra_tensors
                if self.true(f"{what} extra_tensors", isinstance(extra, tuple) and len(extra) == num_kept,
                             f"expected a tuple of {num_kept}, got {extra!r:.200}"):
                    for i, obj in (kept or {}).items():
                        self.true(f"{what} extra_tensors[{i}]", extra[i] is obj, "not the call's tensor")
                with ev:
                    pass
                ev.current_stream_wait()
        else:
            self.true(f"{what} event", ev.event is None, f"expected EventOverlap(None) without async_finish, "
                                                         f"got event={ev.event!r}")

    def hook(self, what: str, hook: Any, return_recv_hook: bool) -> None:
        if return_recv_hook:
            self.true(f"{what} hook", callable(hook), f"return_recv_hook=True must return a callable, got {hook!r}")
        else:
            self.true(f"{what} hook", hook is None, f"expected hook None without return_recv_hook, got {hook!r}")


def selects_an_expert_twice(cidx: torch.Tensor) -> torch.Tensor:
    """[T] bool: which tokens list one expert in several top-k slots."""
    return torch.tensor([len(set(v for v in row.tolist() if v >= 0)) < int((row >= 0).sum()) for row in cidx],
                        dtype=torch.bool)


def dup_note(cidx: torch.Tensor, got: torch.Tensor, expected: torch.Tensor) -> str:
    """Diagnosis for a combine mismatch: do the wrong tokens select one expert in several slots?"""
    if got.shape != expected.shape or got.numel() == 0:
        return ""
    bad = (bits(got) != bits(expected)).any(1)
    dup = selects_an_expert_twice(cidx)
    if not bool(bad.any()):
        return ""
    return (f" [{int(bad.sum())} wrong tokens, {int((bad & dup).sum())} of them select one expert in several slots; "
            f"{int((~bad & dup).sum())} such tokens are right]")


def col_major_ok(t: torch.Tensor) -> bool:
    """Last two dims column-major (storage [E_loc, G, R*N] transposed); strides of size-1 dims are free."""
    e, rows, g = t.shape
    ok = True
    if rows > 1:
        ok &= t.stride(1) == 1
    if g > 1:
        ok &= t.stride(2) == rows
    if e > 1:
        ok &= t.stride(0) == rows * g
    return ok


def check_dispatch(chk: LowLatencyChecker, out: tuple, reg: M.Region, sources: List[M.Source], opts: RoundOptions,
                   num_max_tokens: int, hidden: int, num_experts: int) -> Optional[tuple]:
    """Check the 5-tuple of low_latency_dispatch (after the hook/event). Returns the handle."""
    r, e_loc = reg.num_ranks, reg.experts_per_rank
    slots = r * num_max_tokens
    if not chk.true("dispatch returns a 5-tuple", isinstance(out, tuple) and len(out) == 5, f"got {out!r:.200}"):
        return None
    recv_x, recv_count, handle, _, _ = out
    if not chk.true("handle", isinstance(handle, tuple) and len(handle) == 5, f"got {type(handle).__name__}"):
        return None
    src_info, layout_range = handle[0], handle[1]
    chk.true("handle[2:]", tuple(handle[2:]) == (num_max_tokens, hidden, num_experts),
             f"got {tuple(handle[2:])}, expected {(num_max_tokens, hidden, num_experts)}")
    ok = chk.meta("recv_count", recv_count, torch.int32, (e_loc,))
    ok &= chk.meta("src_info", src_info, torch.int32, (e_loc, slots))
    ok &= chk.meta("layout_range", layout_range, torch.int64, (e_loc, r))
    if not ok:
        return None
    chk.equal("recv_count", recv_count, reg.count)
    lr = layout_range.cpu()
    chk.equal("layout_range count (low 32 bits)", lr & 0xFFFFFFFF, reg.block_count)
    nonempty = reg.block_count > 0
    chk.equal("layout_range begin (high 32 bits) of non-empty blocks", (lr >> 32)[nonempty], reg.block_begin[nonempty])
    chk.equal("src_info of the valid rows", src_info.cpu()[reg.expert, reg.row], reg.src_info)
    if opts.fp8:
        check_fp8_payload(chk, recv_x, reg, sources, opts, slots, hidden)
    elif chk.meta("BF16 recv_x", recv_x, torch.bfloat16, (e_loc, slots, hidden)):
        chk.equal("BF16 rows", recv_x.cpu()[reg.expert, reg.row], reg.payload_bf16(sources))
    return handle


def check_fp8_payload(chk: LowLatencyChecker, recv_x: Any, reg: M.Region, sources: List[M.Source],
                      opts: RoundOptions, slots: int, hidden: int) -> None:
    """FP8 recv_x: e4m3 bytes of the valid rows, and their scales (float32, or UE8M0 packed in int32),
    column-major in the last two dims."""
    e_loc, e_idx, j_idx = reg.experts_per_rank, reg.expert, reg.row
    if not chk.true("FP8 recv_x is a (data, scales) tuple", isinstance(recv_x, tuple) and len(recv_x) == 2,
                    f"got {type(recv_x).__name__}"):
        return
    data, scales = recv_x
    groups = M.ceil_div(hidden, 128)
    if not chk.meta("FP8 data", data, torch.float8_e4m3fn, (e_loc, slots, hidden)):
        return
    expected = reg.payload_fp8(sources, opts.round_scale)
    chk.equal("FP8 data bytes of the valid rows", data.cpu().view(torch.uint8)[e_idx, j_idx], expected.data)
    if opts.ue8m0:
        if chk.meta("UE8M0 scales", scales, torch.int32, (e_loc, slots, M.ceil_div(groups, 4))):
            chk.true("UE8M0 scales column-major in the last two dims", col_major_ok(scales),
                     f"strides {scales.stride()}")
            got = scales.cpu()[e_idx, j_idx].contiguous().view(torch.uint8)[:, :groups]
            chk.equal("UE8M0 exponent bytes (byte b of word j = group 4j+b)", got, expected.ue8m0_bytes())
            if groups % 4 == 0:
                chk.equal("UE8M0 int32 words", scales.cpu()[e_idx, j_idx], expected.ue8m0_words())
    elif chk.meta("FP8 scales", scales, torch.float32, (e_loc, slots, groups)):
        chk.true("FP8 scales column-major in the last two dims", col_major_ok(scales), f"strides {scales.stride()}")
        chk.equal("FP8 scales of the valid rows", scales.cpu()[e_idx, j_idx], expected.scale_inv)


# ---------------------------------------------------------------------------------------------------
# one dispatch + combine round
# ---------------------------------------------------------------------------------------------------
DISPATCH_KINDS = [dict(fp8=False, round_scale=False, ue8m0=False), dict(fp8=True, round_scale=False, ue8m0=False),
                  dict(fp8=True, round_scale=True, ue8m0=False), dict(fp8=True, round_scale=True, ue8m0=True)]
MODES = ["sync", "async", "hook"]
COMBINE_KINDS = ["plain", "out", "zero_copy", "logfmt"]


def round_options(i: int) -> RoundOptions:
    """Round i of a cycle that covers every dispatch kind x mode (12 rounds) with every combine kind x mode."""
    return RoundOptions(**DISPATCH_KINDS[i % 4], dispatch_mode=MODES[(i // 4 + i) % 3],
                        combine_kind=COMBINE_KINDS[(i // 3) % 4], combine_mode=MODES[(i + 1) % 3],
                        stats=i % 2 == 0, drop=i % 5 == 3)


def ll_dispatch(buf, ctx, src: M.Source, n: int, num_experts: int, opts: RoundOptions, cum=None, wait=None):
    ignored = not opts.fp8 and ctx.rank % 2 == 1   # (BF16 ignores both flags: ranks may differ in them)
    return buf.low_latency_dispatch(src.x.to(ctx.device), src.topk_idx.to(ctx.device), n, num_experts,
                                    cumulative_local_expert_recv_stats=cum, dispatch_wait_recv_cost_stats=wait,
                                    use_fp8=opts.fp8, round_scale=opts.round_scale or ignored,
                                    use_ue8m0=opts.ue8m0 or ignored, async_finish=opts.dispatch_mode == "async",
                                    return_recv_hook=opts.dispatch_mode == "hook")


def finish_dispatch(chk: LowLatencyChecker, out: tuple, opts: RoundOptions) -> None:
    """The dispatch's event and hook for its mode; runs the hook."""
    data = out[0][0] if isinstance(out[0], tuple) else out[0]
    chk.event("dispatch", out[3], opts.dispatch_mode == "async", {2: data, 4: out[1], 5: out[2][0], 6: out[2][1]}, 8)
    chk.hook("dispatch", out[4], opts.dispatch_mode == "hook")
    if opts.dispatch_mode == "hook" and callable(out[4]):
        out[4]()


def check_wait_stats(chk: LowLatencyChecker, what: str, stats: torch.Tensor, before: torch.Tensor, num_ranks: int,
                     masked: Optional[List[int]] = None) -> None:
    """Wait-cost statistics accumulate (never decrease), and not for masked sources."""
    if not chk.meta(what, stats, torch.int64, (num_ranks,)):
        return
    now = stats.cpu()
    chk.wait_checks += 1
    chk.wait_grew += int(bool((now > before).any()))
    chk.wait_grew_sources.update((now > before).nonzero().flatten().tolist())
    chk.true(f"{what} non-negative", bool((now >= 0).all()), f"{now.tolist()}")
    chk.true(f"{what} accumulates (never decreases)", bool((now >= before).all()),
             f"before {before.tolist()}, after {now.tolist()}")
    for s in masked or []:
        chk.true(f"{what} of masked source {s} unchanged", int(now[s]) == int(before[s]),
                 f"before {int(before[s])}, after {int(now[s])}")


@dataclass
class Round:
    """One dispatch + combine round on one rank: its inputs, the model's regions and the options."""
    chk: LowLatencyChecker
    ctx: Any
    buf: Any
    seed: int
    key: Any                           # keys the round's random combine inputs
    sources: List[M.Source]
    regions: List[M.Region]
    n: int                             # num_max_dispatch_tokens_per_rank
    num_experts: int
    opts: RoundOptions
    masks: M.Masks = None

    def __post_init__(self) -> None:
        rank, num_ranks = self.ctx.rank, self.ctx.world_size
        self.e_loc = self.num_experts // num_ranks
        self.hidden = self.sources[0].x.shape[1]
        self.reg, self.src = self.regions[rank], self.sources[rank]
        self.masked_sources = [s for s in range(num_ranks) if not M.delivers(self.masks, s, rank)]
        self.stats_gen = generator(self.seed, self.key, "stats", rank)

    def random_stats(self, size: int, high: int, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """(statistics before the call on the CPU, the tensor passed to it) where the round passes them."""
        if not self.opts.stats:
            return None, None
        before = torch.randint(0, high, (size,), generator=self.stats_gen, dtype=dtype)
        return before, before.clone().to(self.ctx.device)


def run_round(chk: LowLatencyChecker, ctx, buf, seed: int, key: Any, sources: List[M.Source],
              regions: List[M.Region], n: int, num_experts: int, opts: RoundOptions, masks: M.Masks = None) -> None:
    """Dispatch with `opts`, check it; combine, check it."""
    rnd = Round(chk, ctx, buf, seed, key, sources, regions, n, num_experts, opts, masks)
    handle = dispatch_and_check(rnd)
    combine_and_check(rnd, handle)


def dispatch_and_check(rnd: Round) -> tuple:
    """The round's dispatch: outputs, event, hook and statistics; returns the handle for the combine."""
    chk, num_ranks = rnd.chk, rnd.ctx.world_size
    cum0, cum = rnd.random_stats(rnd.e_loc, 1000, torch.int32)
    wait0, wait = rnd.random_stats(num_ranks, 10 ** 6, torch.int64)
    out = ll_dispatch(rnd.buf, rnd.ctx, rnd.src, rnd.n, rnd.num_experts, rnd.opts, cum, wait)
    finish_dispatch(chk, out, rnd.opts)
    handle = check_dispatch(chk, out, rnd.reg, rnd.sources, rnd.opts, rnd.n, rnd.hidden, rnd.num_experts)
    if rnd.opts.stats:
        if chk.meta("cumulative_local_expert_recv_stats", cum, torch.int32, (rnd.e_loc,)):
            chk.equal("cumulative_local_expert_recv_stats == before + recv_count", cum.cpu(), cum0 + rnd.reg.count)
        check_wait_stats(chk, "dispatch_wait_recv_cost_stats", wait, wait0, num_ranks, rnd.masked_sources)
    return out[2] if handle is None else handle


def fill_zero_copy_buffer(rnd: Round, handle: tuple, x: torch.Tensor) -> None:
    """get_next_low_latency_combine_buffer's view (its shape and strides checked) filled with `x`."""
    chk, num_ranks, hidden = rnd.chk, rnd.ctx.world_size, rnd.hidden
    view = rnd.buf.get_next_low_latency_combine_buffer(handle)
    if chk.meta("get_next_low_latency_combine_buffer", view, torch.bfloat16, (rnd.e_loc, num_ranks * rnd.n, hidden)):
        chk.true("combine buffer: last dim contiguous", view.stride(2) == 1, f"strides {view.stride()}")
        if hidden % 128 == 0:
            lm = hidden + hidden // 64
            chk.true("combine buffer strides (R*N*Lm, Lm, 1) with Lm = H + H/64",
                     view.stride() == (num_ranks * rnd.n * lm, lm, 1), f"strides {view.stride()}, Lm={lm}")
        view.copy_(x)


def combine_and_check(rnd: Round, handle: tuple) -> None:
    """The round's combine of random expert outputs: its event, hook, out= and statistics, then the result
    against the model (bitwise, or within LogFMT's bound)."""
    chk, ctx, opts, rank = rnd.chk, rnd.ctx, rnd.opts, rnd.ctx.rank
    kind, mode = opts.combine_kind, opts.combine_mode
    ys = expert_outputs(rnd.seed, rnd.key, rnd.regions, rnd.n, rnd.hidden, kind == "logfmt")
    cidx = drop_some(rnd.seed, rnd.key, rank, rnd.src.topk_idx) if opts.drop else rnd.src.topk_idx
    x_arg = ys[rank].to(ctx.device)
    if kind == "zero_copy":
        fill_zero_copy_buffer(rnd, handle, x_arg)
        x_arg = torch.full_like(x_arg, float("nan"))        # zero_copy: x is shape-checked only
    num_tokens = rnd.src.x.shape[0]
    out_t = torch.full((num_tokens, rnd.hidden), float("nan"), dtype=torch.bfloat16, device=ctx.device) \
        if kind == "out" else None
    cwait0, cwait = rnd.random_stats(ctx.world_size, 10 ** 6, torch.int64)
    cidx_arg, weights_arg = cidx.to(ctx.device), rnd.src.topk_weights.to(ctx.device)
    res = rnd.buf.low_latency_combine(x_arg, cidx_arg, weights_arg, handle, use_logfmt=kind == "logfmt",
                                      zero_copy=kind == "zero_copy", async_finish=mode == "async",
                                      return_recv_hook=mode == "hook", out=out_t, combine_wait_recv_cost_stats=cwait)
    if not chk.true("combine returns a 3-tuple", isinstance(res, tuple) and len(res) == 3, f"got {res!r:.200}"):
        return
    combined, event, hook = res
    chk.event("combine", event, mode == "async", {1: cidx_arg, 2: weights_arg, 3: handle[0], 4: handle[1],
                                                  5: combined}, 6)
    chk.hook("combine", hook, mode == "hook")
    if mode == "hook" and callable(hook):
        hook()
    if not chk.meta("combined_x", combined, torch.bfloat16, (num_tokens, rnd.hidden)):
        return
    if out_t is not None:
        chk.true("out= is filled in place and returned",
                 combined.data_ptr() == out_t.data_ptr() or combined.numel() == 0, "combined_x is not the out tensor")
    if opts.stats:
        check_wait_stats(chk, "combine_wait_recv_cost_stats", cwait, cwait0, ctx.world_size, rnd.masked_sources)
    rows = M.selection_rows(rnd.sources, rnd.regions)[rank]
    if kind == "logfmt":
        check_logfmt_combine(rnd, combined, cidx, rows, ys)
    else:
        expected = M.combine(rank, cidx, rnd.src.topk_weights, rows, ys, rnd.e_loc, rnd.masks)
        chk.equal("combined_x (bitwise, fp32 sum over ascending k of w*row)" + dup_note(cidx, combined.cpu(), expected),
                  combined, expected)


def check_logfmt_combine(rnd: Round, combined: torch.Tensor, cidx: torch.Tensor, rows: torch.Tensor,
                         ys: List[torch.Tensor]) -> None:
    """A LogFMT combine: exact where no summed row was encoded, changed where some were, and within the bound
    of model_low_latency.logfmt_bound of the exact sum everywhere."""
    chk, rank, weights, e_loc, masks = rnd.chk, rnd.ctx.rank, rnd.src.topk_weights, rnd.e_loc, rnd.masks
    exact, mag, row_mag = M.combine_exact(rank, cidx, weights, rows, ys, e_loc, masks)
    plain = M.combine(rank, cidx, weights, rows, ys, e_loc, masks)
    touched = torch.zeros(plain.shape, dtype=torch.bool)
    for _, valid, vals in M._combine_terms(rank, cidx, rows, ys, e_loc, masks):
        touched |= valid[:, None] & logfmt_encoded(vals)
    same = combined.cpu().view(torch.int16) == plain.view(torch.int16)
    chk.true("LogFMT leaves channels without encoded rows exact", bool(same[~touched].all()),
             f"{int((~same & ~touched).sum())} such elements differ from the BF16 sum")
    if int(touched.sum()) > 64:
        chk.true("LogFMT changes channels with encoded rows", not bool(same[touched].all()),
                 f"all {int(touched.sum())} are as without LogFMT")
    got = combined.cpu().double()
    chk.true("LogFMT combine has no NaN/inf", bool(torch.isfinite(got).all()))
    err = (got - exact).abs()
    bound = M.logfmt_bound(exact, mag, row_mag)
    if not bool((err <= bound).all()):
        bad = (err > bound).any(1)
        dup = selects_an_expert_twice(cidx)
        worst = int(torch.argmax(err - bound))
        chk.fail("LogFMT combine within tolerance", f"{int((err > bound).sum())} elements out of bound; worst "
                 f"flat index {worst}: got {got.flatten()[worst].item()}, exact {exact.flatten()[worst].item()}, "
                 f"bound {bound.flatten()[worst].item()} [{int(bad.sum())} wrong tokens, {int((bad & dup).sum())} "
                 f"of them select one expert in several slots]")


def make_buffer(ctx, n: int, hidden: int, num_experts: int, **kwargs):
    from deep_ep import Buffer
    hint = Buffer.get_low_latency_rdma_size_hint(n, hidden, ctx.world_size, num_experts)
    buffer = Buffer(ctx.group, 0, hint, low_latency_mode=True, num_qps_per_rank=num_experts // ctx.world_size,
                    **kwargs)
    if ctx.device.type == "cuda" and "transport" not in kwargs and \
            os.environ.get("DEEP_EP_TRANSPORT", "auto") == "auto":   # (these tests are meant to run it on GPUs)
        assert buffer.transport_name == "nvlink" and buffer._transport.low_latency is not None, \
            f"rank {ctx.rank}: transport 'auto' did not give the NVLink low-latency path ({buffer.transport_name})"
    return buffer


def run_case(chk: LowLatencyChecker, ctx, seed: int, case: LowLatencyCase) -> None:
    """The case's rounds on one Buffer."""
    num_ranks = ctx.world_size
    num_experts = num_ranks * case.experts_per_rank
    n = case.num_max_tokens
    buf = make_buffer(ctx, n, case.hidden, num_experts)
    sources = make_sources(seed, case, num_ranks)
    regions = [M.dispatch_region(sources, g, num_experts) for g in range(num_ranks)]
    for i in case.rounds:
        opts = replace(round_options(i), **case.forced_options)
        chk.at(f"case={case.name} round={i} opts={opts}")
        run_round(chk, ctx, buf, seed, (case.name, i), sources, regions, n, num_experts, opts)

# ---------------------------------------------------------------------------------------------------
# scenarios: micro-batch overlap, misuse, normal/LL switching, shrink masks
# ---------------------------------------------------------------------------------------------------

def _expect_runtime_error(chk: LowLatencyChecker, what: str, fn) -> None:
    try:
        fn()
    except RuntimeError:
        return
    except Exception as exc:  # noqa: BLE001
        chk.fail(what, f"expected RuntimeError, got {type(exc).__name__}: {exc}")
        return
    chk.fail(what, "expected RuntimeError, nothing was raised")


@dataclass
class Pipeline:
    """The two micro-batches A and B of run_pipeline on one rank: their inputs, the model's regions, the
    dispatch options, the shared statistics tensors and what the calls so far returned."""
    chk: LowLatencyChecker
    ctx: Any
    buf: Any
    seed: int
    misuse: bool
    e_loc: int
    n: int                             # num_max_dispatch_tokens_per_rank
    hidden: int
    num_experts: int
    srcs: Dict[str, List[M.Source]]
    regs: Dict[str, List[M.Region]]
    opts: Dict[str, RoundOptions]
    cum: torch.Tensor                  # cumulative_local_expert_recv_stats of both dispatches
    wait: torch.Tensor                 # dispatch_wait_recv_cost_stats of both dispatches
    call_elsewhere: Callable[[Callable[[], Any]], Any]
    out: Dict[str, tuple] = field(default_factory=dict)            # the dispatches' outputs
    ys: Dict[str, List[torch.Tensor]] = field(default_factory=dict)   # every rank's expert outputs
    rows: Dict[str, List[torch.Tensor]] = field(default_factory=dict)

    def src(self, k: str) -> M.Source:
        """This rank's inputs of micro-batch `k`."""
        return self.srcs[k][self.ctx.rank]

    def dispatch(self, k: str, opts: RoundOptions, *stats: torch.Tensor) -> tuple:
        """ll_dispatch of micro-batch `k`'s tokens with `opts` (and the statistics tensors given)."""
        return ll_dispatch(self.buf, self.ctx, self.src(k), self.n, self.num_experts, opts, *stats)

    def dispatch_a_synchronously(self) -> tuple:
        """A synchronous dispatch of micro-batch A's tokens (the misuse checks' third call)."""
        return self.dispatch("A", replace(self.opts["B"], dispatch_mode="sync"))

    def check_dispatch(self, k: str) -> None:
        check_dispatch(self.chk, self.out[k], self.regs[k][self.ctx.rank], self.srcs[k], self.opts[k], self.n,
                       self.hidden, self.num_experts)


def start_pipeline(chk: LowLatencyChecker, ctx, seed: int, misuse: bool) -> Pipeline:
    """A Buffer and the inputs of micro-batches A (FP8, some entries masked) and B (BF16, duplicated experts);
    without `misuse`, calls "elsewhere" run on another thread."""
    num_ranks = ctx.world_size
    e_loc, n, hidden, topk = 3, 8, 256, 4
    num_experts = e_loc * num_ranks
    buf = make_buffer(ctx, n, hidden, num_experts)
    case_a = CaseInputs(name=f"pipe-A-{misuse}", tokens=[n] * num_ranks, hidden=hidden, topk=topk,
                        experts_per_rank=e_loc, mask_frac=0.1)
    case_b = CaseInputs(name=f"pipe-B-{misuse}", tokens=[(3 + s) % (n + 1) for s in range(num_ranks)],
                        hidden=hidden, topk=topk, experts_per_rank=e_loc, routing="dup")
    srcs = {k: make_sources(seed, c, num_ranks) for k, c in (("A", case_a), ("B", case_b))}
    regs = {k: [M.dispatch_region(srcs[k], g, num_experts) for g in range(num_ranks)] for k in srcs}
    opts = {"A": RoundOptions(fp8=True, dispatch_mode="hook"), "B": RoundOptions(dispatch_mode="hook")}
    cum = torch.zeros(e_loc, dtype=torch.int32, device=ctx.device)
    wait = torch.zeros(num_ranks, dtype=torch.int64, device=ctx.device)
    call_elsewhere = (lambda fn: fn()) if misuse else run_on_another_thread
    chk.at(f"pipeline misuse={misuse}")
    return Pipeline(chk, ctx, buf, seed, misuse, e_loc, n, hidden, num_experts, srcs, regs, opts, cum, wait,
                    call_elsewhere)


def dispatch_both_micro_batches(pipe: Pipeline) -> None:
    """dA here, dB elsewhere, both with hooks and the shared statistics: hooks returned, no events."""
    pipe.out = {"A": pipe.dispatch("A", pipe.opts["A"], pipe.cum, pipe.wait),
                "B": pipe.call_elsewhere(lambda: pipe.dispatch("B", pipe.opts["B"], pipe.cum, pipe.wait))}
    for k in ("A", "B"):
        pipe.chk.hook(f"dispatch {k}", pipe.out[k][4], True)
        pipe.chk.event(f"dispatch {k}", pipe.out[k][3], False)


def check_third_call_refused_while_dispatch_a_hook_pends(pipe: Pipeline) -> None:
    """A third LL call, dispatch or combine, while dA (the call two before) has an un-run hook raises."""
    chk, ctx, src = pipe.chk, pipe.ctx, pipe.src("A")
    _expect_runtime_error(chk, "third LL call (dispatch) while the call two before has an un-run hook",
                          pipe.dispatch_a_synchronously)
    _expect_runtime_error(chk, "third LL call (combine) while the call two before has an un-run hook",
                          lambda: pipe.buf.low_latency_combine(
                              torch.zeros(pipe.e_loc, ctx.world_size * pipe.n, pipe.hidden, dtype=torch.bfloat16,
                                          device=ctx.device),
                              src.topk_idx.to(ctx.device), src.topk_weights.to(ctx.device), pipe.out["A"][2]))


def combine_a_zero_copy(pipe: Pipeline) -> tuple:
    """cA through the zero-copy buffer with a hook (the call two before it is dA, whose hook ran); draws both
    micro-batches' expert outputs first. Returns cA's outputs."""
    ctx, rank, src = pipe.ctx, pipe.ctx.rank, pipe.src("A")
    pipe.ys = {k: expert_outputs(pipe.seed, ("pipe", pipe.misuse, k), pipe.regs[k], pipe.n, pipe.hidden, False)
               for k in pipe.srcs}
    pipe.rows = {k: M.selection_rows(pipe.srcs[k], pipe.regs[k]) for k in pipe.srcs}
    view = pipe.buf.get_next_low_latency_combine_buffer(pipe.out["A"][2])
    view.copy_(pipe.ys["A"][rank].to(ctx.device))
    return pipe.buf.low_latency_combine(torch.full_like(pipe.ys["A"][rank], float("nan")).to(ctx.device),
                                        src.topk_idx.to(ctx.device), src.topk_weights.to(ctx.device),
                                        pipe.out["A"][2], zero_copy=True, return_recv_hook=True)


def combine_b(pipe: Pipeline, **kwargs: Any) -> tuple:
    """low_latency_combine of micro-batch B's expert outputs with `kwargs`."""
    ctx, src = pipe.ctx, pipe.src("B")
    return pipe.buf.low_latency_combine(pipe.ys["B"][ctx.rank].to(ctx.device), src.topk_idx.to(ctx.device),
                                        src.topk_weights.to(ctx.device), pipe.out["B"][2], **kwargs)


def check_both_dispatches(pipe: Pipeline, wait_before: torch.Tensor) -> None:
    """Both dispatches' outputs, and the shared statistics accumulated over both."""
    rank, num_ranks = pipe.ctx.rank, pipe.ctx.world_size
    pipe.check_dispatch("A")
    pipe.check_dispatch("B")
    pipe.chk.equal("cumulative stats over two in-flight dispatches", pipe.cum.cpu(),
                   pipe.regs["A"][rank].count + pipe.regs["B"][rank].count)
    check_wait_stats(pipe.chk, "dispatch_wait_recv_cost_stats (two dispatches)", pipe.wait, wait_before, num_ranks)


def check_in_flight_combines(pipe: Pipeline, ca: tuple, cb: tuple, out_b: torch.Tensor) -> None:
    """Both combines against the model, and cB's result is its out= tensor."""
    rank, chk = pipe.ctx.rank, pipe.chk
    for k, res in (("A", ca), ("B", cb)):
        src = pipe.src(k)
        expected = M.combine(rank, src.topk_idx, src.topk_weights, pipe.rows[k][rank], pipe.ys[k], pipe.e_loc)
        chk.equal(f"in-flight combine {k}" + dup_note(src.topk_idx, res[0].cpu(), expected), res[0], expected)
    chk.true("combine B returned out=", cb[0].data_ptr() == out_b.data_ptr() or out_b.numel() == 0)


def check_buffer_after_the_pipeline(pipe: Pipeline) -> None:
    """The returned dispatch tensors are fresh (dispatch A still intact after both combines reused the buffer
    halves), and the buffer is still usable: one more synchronous round."""
    misuse = pipe.misuse
    pipe.chk.at(f"pipeline misuse={misuse} dispatch A after the combines")
    pipe.check_dispatch("A")
    run_round(pipe.chk.at(f"pipeline misuse={misuse} after"), pipe.ctx, pipe.buf, pipe.seed, ("pipe-after", misuse),
              pipe.srcs["A"], pipe.regs["A"], pipe.n, pipe.num_experts, RoundOptions(stats=True))


def run_pipeline(chk: LowLatencyChecker, ctx, seed: int, misuse: bool) -> None:
    """Two micro-batches A and B with both dispatches and both combines in flight (hooks), as in DeepEP's
    two-micro-batch overlap: dA dB hA cA(zero-copy) hB cB(out=) then the combine hooks. Shared stats tensors
    accumulate over both batches. Without `misuse`, dispatch B (the call and its hook) and combine A's hook run
    on other threads (vLLM's dual-batch overlap; on a rank of another GPU than the first, a thread that has not
    set its device). With `misuse`: a third LL call while the call two before still has an un-run hook, and
    hooks called twice, must raise RuntimeError and leave the buffer usable."""
    pipe = start_pipeline(chk, ctx, seed, misuse)
    dispatch_both_micro_batches(pipe)
    if misuse:
        check_third_call_refused_while_dispatch_a_hook_pends(pipe)
    wait_before = pipe.wait.cpu().clone()
    pipe.out["A"][4]()
    if misuse:
        _expect_runtime_error(chk, "dispatch hook called twice", pipe.out["A"][4])
    ca = combine_a_zero_copy(pipe)
    if misuse:   # cB now would be the third call after dB, whose hook has not run
        _expect_runtime_error(chk, "third LL call (combine) while dispatch B's hook is pending",
                              lambda: combine_b(pipe))
    pipe.call_elsewhere(pipe.out["B"][4])
    check_both_dispatches(pipe, wait_before)
    out_b = torch.full((pipe.src("B").x.shape[0], pipe.hidden), float("nan"), dtype=torch.bfloat16, device=ctx.device)
    cb = combine_b(pipe, out=out_b, return_recv_hook=True)
    if misuse:
        _expect_runtime_error(chk, "third LL call (dispatch) while combine A's hook is pending",
                              pipe.dispatch_a_synchronously)
    pipe.call_elsewhere(ca[2])
    cb[2]()
    if misuse:
        _expect_runtime_error(chk, "combine hook called twice", cb[2])
    check_in_flight_combines(pipe, ca, cb, out_b)
    check_buffer_after_the_pipeline(pipe)


def run_switch(chk: LowLatencyChecker, ctx, seed: int) -> None:
    """One Buffer alternating normal dispatch/combine and LL calls, with clean_low_latency_buffer and a change
    of (N, H, E) in between."""
    from deep_ep import Buffer, Config
    num_ranks, rank = ctx.world_size, ctx.rank
    shapes = [dict(N=8, hidden=256, experts_per_rank=2), dict(N=12, hidden=384, experts_per_rank=3)]
    rdma = max(Buffer.get_low_latency_rdma_size_hint(s["N"], s["hidden"], num_ranks, s["experts_per_rank"] * num_ranks)
               for s in shapes)
    nvl = Config().get_nvl_buffer_size_hint(384 * 2, num_ranks)
    buf = Buffer(ctx.group, nvl, rdma, low_latency_mode=True, num_qps_per_rank=3)

    def normal(tag: str, shape: Dict[str, Any]) -> None:
        chk.at(f"switch normal {tag}")
        num_experts = shape["experts_per_rank"] * num_ranks
        case = CaseInputs(name=f"switch-normal-{tag}", tokens=[5 + 3 * s for s in range(num_ranks)],
                          hidden=shape["hidden"], topk=2, experts_per_rank=shape["experts_per_rank"], mask_frac=0.2)
        srcs = make_sources(seed, case, num_ranks)
        src = srcs[rank]
        idx = src.topk_idx.to(ctx.device)
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, num_experts)
        recv_x, _, _, _, handle, _ = buf.dispatch(src.x.to(ctx.device), num_tokens_per_rank=per_rank,
                                                  num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                                                  num_tokens_per_expert=per_expert, topk_idx=idx,
                                                  topk_weights=src.topk_weights.to(ctx.device))
        e_loc = shape["experts_per_rank"]

        def dests(s_idx: torch.Tensor) -> torch.Tensor:    # [T, R] bool
            owner = torch.where(s_idx >= 0, s_idx // e_loc, torch.full_like(s_idx, -1))
            return torch.stack([(owner == g).any(1) for g in range(num_ranks)], 1)
        expected = torch.cat([s.x[dests(s.topk_idx)[:, rank]] for s in srcs])
        chk.equal("normal dispatch rows (source rank, token order)", recv_x, expected)
        combined, _, _ = buf.combine(recv_x, handle)
        n_dest = dests(src.topk_idx).sum(1, keepdim=True).float()
        expected = torch.where(n_dest > 0, src.x.float() * n_dest, torch.zeros(()))   # sent nowhere: +0
        chk.equal("normal combine = bf16(#destinations * x)", combined, expected.to(torch.bfloat16))

    def ll(tag: str, shape: Dict[str, Any], i: int) -> None:
        num_experts = shape["experts_per_rank"] * num_ranks
        case = CaseInputs(name=f"switch-ll-{tag}", tokens=[shape["N"] - s for s in range(num_ranks)],
                          hidden=shape["hidden"], topk=3, experts_per_rank=shape["experts_per_rank"], mask_frac=0.1)
        srcs = make_sources(seed, case, num_ranks)
        regs = [M.dispatch_region(srcs, g, num_experts) for g in range(num_ranks)]
        opts = round_options(i)
        chk.at(f"switch ll {tag} opts={opts}")
        run_round(chk, ctx, buf, seed, ("switch", tag), srcs, regs, shape["N"], num_experts, opts)

    ll("first", shapes[0], 1)
    normal("a", shapes[0])
    ll("after-normal", shapes[0], 6)
    buf.clean_low_latency_buffer(shapes[1]["N"], shapes[1]["hidden"], shapes[1]["experts_per_rank"] * num_ranks)
    ll("after-clean-new-shape", shapes[1], 7)
    normal("b", shapes[1])
    buf.clean_low_latency_buffer(shapes[0]["N"], shapes[0]["hidden"], shapes[0]["experts_per_rank"] * num_ranks)
    ll("after-clean-back", shapes[0], 2)


SHRINK_E_LOC, SHRINK_N, SHRINK_HIDDEN = 2, 8, 256   # experts a rank, N and hidden of the shrink scenarios


def shrink_sources(seed: int, name: str, num_ranks: int) -> List[M.Source]:
    """A shrink scenario's inputs: rank s has N - s tokens, each selecting 3 experts, some entries masked."""
    case = CaseInputs(name=name, tokens=[SHRINK_N - s for s in range(num_ranks)], hidden=SHRINK_HIDDEN, topk=3,
                      experts_per_rank=SHRINK_E_LOC, mask_frac=0.1)
    return make_sources(seed, case, num_ranks)


def shrink_rounds(chk: LowLatencyChecker, ctx, buf, seed: int, srcs: List[M.Source], n: int, num_experts: int,
                  label: str):
    """rounds(tag, masks, ids): dispatch + combine rounds with wait statistics, checked against the model under
    `masks`."""
    def rounds(tag: str, mask_state: M.Masks, ids: List[int]) -> None:
        regs = [M.dispatch_region(srcs, g, num_experts, mask_state) for g in range(ctx.world_size)]
        for i in ids:
            opts = replace(round_options(i), stats=True)
            chk.at(f"{label} {tag} opts={opts}")
            run_round(chk, ctx, buf, seed, (label, tag, i), srcs, regs, n, num_experts, opts, mask_state)
    return rounds


def run_shrink(chk: LowLatencyChecker, ctx, seed: int, masked: List[int]) -> None:
    """enable_shrink: unmasked ranks mask `masked`; a masked rank masks every rank (it is cut off). Then
    the mask is cleared and full results come back."""
    num_ranks, rank = ctx.world_size, ctx.rank
    e_loc, n, hidden = SHRINK_E_LOC, SHRINK_N, SHRINK_HIDDEN
    num_experts = e_loc * num_ranks
    buf = make_buffer(ctx, n, hidden, num_experts, enable_shrink=True)
    srcs = shrink_sources(seed, f"shrink-{masked}", num_ranks)
    masks = [[1] * num_ranks if r in masked else [int(g in masked) for g in range(num_ranks)]
             for r in range(num_ranks)]

    rounds = shrink_rounds(chk, ctx, buf, seed, srcs, n, num_experts, f"shrink masked={masked}")

    def query(expected: List[int], what: str) -> None:
        status = torch.full((num_ranks,), -7, dtype=torch.int32, device=ctx.device)
        buf.low_latency_query_mask_buffer(status)
        chk.equal(f"low_latency_query_mask_buffer {what}", status.cpu(), torch.tensor(expected, dtype=torch.int32))

    chk.at(f"shrink masked={masked} setup")
    query([0] * num_ranks, "initially")
    rounds("unmasked", None, [0])
    for g in range(num_ranks):
        if masks[rank][g]:
            buf.low_latency_update_mask_buffer(g, mask=True)
    # mask then unmask one more rank: update(rank, mask=False) clears an entry
    extra = (masked[0] + 1) % num_ranks
    if not masks[rank][extra]:
        buf.low_latency_update_mask_buffer(extra, True)
        query([1 if (masks[rank][g] or g == extra) else 0 for g in range(num_ranks)], "with an extra entry")
        buf.low_latency_update_mask_buffer(extra, False)
    query(masks[rank], "after update")
    rounds("masked", masks, [1, 2, 3, 5, 11])
    buf.low_latency_clean_mask_buffer()
    query([0] * num_ranks, "after clean")
    buf.clean_low_latency_buffer(n, hidden, num_experts)
    rounds("cleared", None, [4])
    # vLLM's fault-tolerance clean-up instead: every rank zeroes its whole low-latency buffer (nothing in
    # flight), then clears the masks (docs/DESIGN.md)
    for g in range(num_ranks):
        if masks[rank][g]:
            buf.low_latency_update_mask_buffer(g, mask=True)
    rounds("masked again", masks, [6])
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    torch.distributed.barrier(group=ctx.group)
    buf.get_local_buffer_tensor(torch.int8, use_rdma_buffer=True).zero_()
    buf.low_latency_clean_mask_buffer()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    torch.distributed.barrier(group=ctx.group)
    query([0] * num_ranks, "after zeroing the buffer")
    rounds("zeroed", None, [7, 8])


def run_shrink_masks_change(chk: LowLatencyChecker, ctx, seed: int) -> None:
    """Masks that change over time: the others mask the last rank and clean without it (it sits that out),
    then everyone clears the masks and cleans together, then the others mask rank 1 (which masks everyone)
    and go on without it while it makes no call, then everyone clears the masks and cleans again: the
    exchanges stay matched after a rank sat out a clean, and a rank that sat out calls rejoins."""
    num_ranks, rank = ctx.world_size, ctx.rank
    if num_ranks < 3:
        return
    e_loc, n, hidden = SHRINK_E_LOC, SHRINK_N, SHRINK_HIDDEN
    num_experts = e_loc * num_ranks
    buf = make_buffer(ctx, n, hidden, num_experts, enable_shrink=True, explicitly_destroy=True)
    rounds = shrink_rounds(chk, ctx, buf, seed, shrink_sources(seed, "shrink-masks-change", num_ranks), n,
                           num_experts, "shrink, masks change,")

    def without(gone: int) -> M.Masks:
        return [[1] * num_ranks if r == gone else [int(g == gone) for g in range(num_ranks)] for r in range(num_ranks)]

    last = num_ranks - 1
    rounds("everyone", None, [0])
    if rank != last:
        buf.low_latency_update_mask_buffer(last, mask=True)
        buf.clean_low_latency_buffer(n, hidden, num_experts)
        buf.low_latency_clean_mask_buffer()
    buf.clean_low_latency_buffer(n, hidden, num_experts)
    rounds("everyone again", None, [2])
    for g in range(num_ranks):
        if without(1)[rank][g]:
            buf.low_latency_update_mask_buffer(g, mask=True)
    if rank != 1:   # (a masked rank takes no part: it may make no call)
        rounds("without rank 1", without(1), [3, 4])
    buf.low_latency_clean_mask_buffer()
    buf.clean_low_latency_buffer(n, hidden, num_experts)
    rounds("everyone at the end", None, [5])
    buf.destroy()


def run_shrink_absent(chk: LowLatencyChecker, ctx, seed: int) -> None:
    """enable_shrink with a rank that fails for good: after one full round the last rank stops calling; the
    others mask it and go on (dispatch, combine, clean_low_latency_buffer, destroy) without waiting for it."""
    num_ranks, rank = ctx.world_size, ctx.rank
    absent = num_ranks - 1
    e_loc, n, hidden = SHRINK_E_LOC, SHRINK_N, SHRINK_HIDDEN
    num_experts = e_loc * num_ranks
    buf = make_buffer(ctx, n, hidden, num_experts, enable_shrink=True, explicitly_destroy=True)
    srcs = shrink_sources(seed, "shrink-absent", num_ranks)

    rounds = shrink_rounds(chk, ctx, buf, seed, srcs, n, num_experts, f"shrink, rank {absent} absent,")

    rounds("everyone", None, [0])
    if rank == absent:
        return   # (its Buffer is left as it is: a failed rank does nothing more)
    masks = [[int(g == absent) for g in range(num_ranks)] for _ in range(num_ranks)]
    masks[absent] = [1] * num_ranks
    buf.low_latency_update_mask_buffer(absent, mask=True)
    rounds("masked", masks, [1, 2, 3])
    buf.clean_low_latency_buffer(n, hidden, num_experts)
    rounds("masked, after a clean", masks, [4, 5])
    buf.destroy()


def run_shrink_automatic(ctx, seed: int, timeout_s: float) -> List[str]:
    """enable_shrink with ranks that stop calling and are masked by the others' timeouts, as DeepEP's
    --shrink-test does: after rounds with everyone (and two cleans, one while the ranks' masks differ), rank 1
    stops at its next dispatch, rank 3 at the combine after it, rank 4 at the clean after that. The others mask
    each one when their wait for it gives up, all in the same way, and carry on with correct results among
    themselves; each gone rank destroys its Buffer."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        return _shrink_automatic(ctx, seed, timeout_s, caught)


@dataclass
class AutomaticShrink:
    """The automatic shrink scenario on one rank: its Buffer (with the scenario's timeout), every rank's inputs
    and the scenario's calls, each checked against the model under the masks expected by then."""
    chk: LowLatencyChecker
    ctx: Any
    buf: Any
    seed: int
    srcs: List[M.Source]
    e_loc: int = SHRINK_E_LOC
    n: int = SHRINK_N                  # num_max_dispatch_tokens_per_rank
    hidden: int = SHRINK_HIDDEN

    def __post_init__(self) -> None:
        self.num_experts = self.e_loc * self.ctx.world_size

    def masks_of(self, gone: List[int]) -> M.Masks:
        """Every rank masks the ranks in `gone`."""
        return [[int(g in gone) for g in range(self.ctx.world_size)] for _ in range(self.ctx.world_size)]

    def query(self, gone: List[int], what: str) -> None:
        """low_latency_query_mask_buffer reports the ranks in `gone` masked, and no other."""
        num_ranks = self.ctx.world_size
        status = torch.full((num_ranks,), -7, dtype=torch.int32, device=self.ctx.device)
        self.buf.low_latency_query_mask_buffer(status)
        self.chk.equal(f"mask after {what}", status.cpu(),
                       torch.tensor([int(g in gone) for g in range(num_ranks)], dtype=torch.int32))

    def dispatch(self, tag: str, i: int, masks: M.Masks) -> Tuple[List[M.Region], tuple]:
        """A checked dispatch with round i's options; returns the model's regions and the handle."""
        rank, num_experts = self.ctx.rank, self.num_experts
        regions = [M.dispatch_region(self.srcs, g, num_experts, masks) for g in range(self.ctx.world_size)]
        opts = round_options(i)
        self.chk.at(f"automatic shrink, {tag}, dispatch opts={opts}")
        out = ll_dispatch(self.buf, self.ctx, self.srcs[rank], self.n, num_experts, opts)
        finish_dispatch(self.chk, out, opts)
        handle = check_dispatch(self.chk, out, regions[rank], self.srcs, opts, self.n, self.hidden, num_experts)
        return regions, out[2] if handle is None else handle

    def combine(self, tag: str, i: int, regions: List[M.Region], handle: tuple, masks: M.Masks) -> None:
        """A combine (synchronous, with a hook or async as i says) of random expert outputs, checked."""
        rank, device = self.ctx.rank, self.ctx.device
        self.chk.at(f"automatic shrink, {tag}, combine")
        mode = ("sync", "hook", "async")[i % 3]
        ys = expert_outputs(self.seed, ("automatic", tag), regions, self.n, self.hidden, False)
        src = self.srcs[rank]
        combined, event, hook = self.buf.low_latency_combine(
            ys[rank].to(device), src.topk_idx.to(device), src.topk_weights.to(device), handle,
            async_finish=mode == "async", return_recv_hook=mode == "hook")
        if hook is not None:
            hook()
        if mode == "async":
            event.current_stream_wait()
        rows = M.selection_rows(self.srcs, regions)
        self.chk.equal("combined_x", combined,
                       M.combine(rank, src.topk_idx, src.topk_weights, rows[rank], ys, self.e_loc, masks))

    def round(self, tag: str, i: int, masks: M.Masks) -> None:
        """A dispatch and its combine, both under `masks`."""
        regions, handle = self.dispatch(tag, i, masks)
        self.combine(tag, i, regions, handle, masks)

    def clean(self) -> None:
        """clean_low_latency_buffer for the scenario's shape."""
        self.buf.clean_low_latency_buffer(self.n, self.hidden, self.num_experts)

    def leave(self) -> List[str]:
        """A rank gone for good destroys its Buffer; returns its mismatches."""
        self.buf.destroy()
        return self.chk.errors


def start_automatic_shrink(ctx, seed: int, timeout_s: float) -> AutomaticShrink:
    """A shrink-mode Buffer that gives up on a rank after `timeout_s`, and the scenario's inputs."""
    chk = LowLatencyChecker(seed, ctx.rank)
    num_experts = SHRINK_E_LOC * ctx.world_size
    buf = make_buffer(ctx, SHRINK_N, SHRINK_HIDDEN, num_experts, enable_shrink=True, explicitly_destroy=True,
                      timeout_s=timeout_s)
    srcs = shrink_sources(seed, "shrink-automatic", ctx.world_size)
    return AutomaticShrink(chk, ctx, buf, seed, srcs)


def check_cleans_while_masks_differ(shrink: AutomaticShrink) -> None:
    """A clean while the ranks' masks differ (rank 0 alone masks rank 2): everyone still meets, nobody is masked
    by a timeout; then rank 0 unmasks it and everyone cleans again."""
    rank = shrink.ctx.rank
    if rank == 0:
        shrink.buf.low_latency_update_mask_buffer(2, mask=True)
    shrink.clean()
    shrink.query([2] if rank == 0 else [], "a clean with different masks")
    if rank == 0:
        shrink.buf.low_latency_update_mask_buffer(2, mask=False)
    shrink.clean()


def check_rounds_without(shrink: AutomaticShrink, gone: List[int]) -> None:
    """The clean the last of `gone` missed masks it, then rounds among the others."""
    shrink.clean()
    shrink.query(gone, f"the clean rank {gone[-1]} missed")
    for i in (3, 4, 5):
        shrink.round(f"without {gone}", i, shrink.masks_of(gone))
    shrink.query(gone, "rounds without them")


def check_timeouts_warned(chk: LowLatencyChecker, caught: List[warnings.WarningMessage], gone: List[int]) -> None:
    """A warning names every rank masked after a timeout."""
    said = " | ".join(str(w.message) for w in caught)
    chk.at("automatic shrink, warnings").true("a warning names every rank masked after a timeout",
                                              all(f"masked rank {g}" in said for g in gone), said)


def _shrink_automatic(ctx, seed: int, timeout_s: float, caught: List[warnings.WarningMessage]) -> List[str]:
    """run_shrink_automatic's calls on one rank, the `caught` warnings recorded; returns the mismatches."""
    shrink = start_automatic_shrink(ctx, seed, timeout_s)
    rank = ctx.rank
    # every kind of call made below, first with everyone (its kernels are then compiled on every rank: a rank
    # still compiling when the others' timeout ends would be masked)
    for i in range(6):
        shrink.round("everyone", i, None)
    check_cleans_while_masks_differ(shrink)
    shrink.round("everyone after the cleans", 0, None)
    if rank == 1:                                   # gone at its next dispatch
        return shrink.leave()
    regions, handle = shrink.dispatch("without rank 1", 1, shrink.masks_of([1]))
    shrink.query([1], "the dispatch rank 1 missed")
    if rank == 3:                                   # gone at its next combine
        return shrink.leave()
    shrink.combine("without ranks 1 and 3", 2, regions, handle, shrink.masks_of([1, 3]))
    shrink.query([1, 3], "the combine rank 3 missed")
    if rank == 4:                                   # gone at its next clean
        return shrink.leave()
    gone = [1, 3, 4]
    check_rounds_without(shrink, gone)
    shrink.buf.destroy()
    check_timeouts_warned(shrink.chk, caught, gone)
    return shrink.chk.errors


# ---------------------------------------------------------------------------------------------------
# the cases of each world size
# ---------------------------------------------------------------------------------------------------
ALL_ROUNDS = list(range(12))


def cases_for(num_ranks: int) -> List[LowLatencyCase]:
    if num_ranks == 2:
        return [
            LowLatencyCase(name="basic", tokens=[16, 5], num_max_tokens=16, hidden=256, topk=4, experts_per_rank=4,
                           mask_frac=0.1, rounds=ALL_ROUNDS),
            LowLatencyCase(name="tokens-0-1-h384", tokens=[0, 1], num_max_tokens=4, hidden=384, topk=3,
                           experts_per_rank=2, rounds=[0, 1, 2, 3, 7]),
            LowLatencyCase(name="topk32-dup", tokens=[12, 7], num_max_tokens=12, hidden=128, topk=32,
                           experts_per_rank=16, routing="dup", mask_frac=0.2, rounds=[0, 3, 6, 9]),
            LowLatencyCase(name="experts-per-rank-1024", tokens=[4, 3], num_max_tokens=4, hidden=128, topk=8,
                           experts_per_rank=1024, rounds=[0, 5]),
            LowLatencyCase(name="h2880", tokens=[8, 3], num_max_tokens=8, hidden=2880, topk=2, experts_per_rank=2,
                           rounds=[0, 4, 3, 11]),
        ]
    if num_ranks == 3:
        return [
            LowLatencyCase(name="uneven-zero-skewed", tokens=[20, 0, 9], num_max_tokens=20, hidden=512, topk=6,
                           experts_per_rank=3, routing="skewed", mask_frac=0.1, rounds=ALL_ROUNDS),
            LowLatencyCase(name="h384-dup", tokens=[1, 8, 8], num_max_tokens=8, hidden=384, topk=5,
                           experts_per_rank=4, routing="dup", rounds=[1, 2, 3, 10]),
            LowLatencyCase(name="h200-short-group", tokens=[3, 4, 2], num_max_tokens=4, hidden=200, topk=2,
                           experts_per_rank=2, rounds=[0, 1, 3, 8]),
        ]
    if num_ranks > 4:   # more ranks than GPUs are lent: zero-token ranks, skewed routing, top-k above the rank count
        return [
            LowLatencyCase(name=f"{num_ranks}r-uneven-skewed", tokens=[(17 * r) % 24 for r in range(num_ranks)],
                           num_max_tokens=24, hidden=256, topk=num_ranks + 1, experts_per_rank=3, routing="skewed",
                           mask_frac=0.1, rounds=[0, 1, 2, 3, 5, 9]),
            LowLatencyCase(name=f"{num_ranks}r-one-token-dup", tokens=[1] * num_ranks, num_max_tokens=2, hidden=384,
                           topk=2, experts_per_rank=2, routing="dup", rounds=[4, 7]),
        ]
    return [
        LowLatencyCase(name="skewed", tokens=[32, 17, 0, 32], num_max_tokens=32, hidden=256, topk=8,
                       experts_per_rank=4, routing="skewed", mask_frac=0.1, rounds=ALL_ROUNDS),
        LowLatencyCase(name="first-half-ranks-2-3-receive-nothing", tokens=[20, 7, 0, 13], num_max_tokens=20,
                       hidden=256, topk=4, experts_per_rank=4, routing="first_half", rounds=[0, 3, 6, 9]),
        LowLatencyCase(name="full-N64", tokens=[64, 64, 64, 1], num_max_tokens=64, hidden=128, topk=4,
                       experts_per_rank=8, rounds=[1, 6, 8]),
        LowLatencyCase(name="mostly-minus-one", tokens=[9, 12, 1, 5], num_max_tokens=12, hidden=256, topk=9,
                       experts_per_rank=5, routing="dup", mask_frac=0.6, rounds=[0, 3, 9]),
    ]


def run_all(ctx, seed: int, names: List[str]) -> List[str]:
    chk = LowLatencyChecker(seed, ctx.rank)
    torch.manual_seed(seed + ctx.rank)
    steps = [(f"case {c.name}", lambda c=c: run_case(chk, ctx, seed, c)) for c in cases_for(ctx.world_size)]
    steps += [("pipeline", lambda: run_pipeline(chk, ctx, seed, False)),
              ("misuse", lambda: run_pipeline(chk, ctx, seed, True)),
              ("switch", lambda: run_switch(chk, ctx, seed)),
              ("shrink", lambda: run_shrink(chk, ctx, seed, [ctx.world_size - 1] if ctx.world_size < 4 else [1, 3])),
              ("shrink-masks-change", lambda: run_shrink_masks_change(chk, ctx, seed)),
              ("shrink-absent", lambda: run_shrink_absent(chk, ctx, seed))]   # (last: one rank leaves early)
    unknown = sorted(set(names) - {name for name, _ in steps})
    if unknown:
        chk.errors.append(f"rank {ctx.rank}: no step is named {unknown}; the steps are {[n for n, _ in steps]}")
    for name, step in steps:
        if names and name not in names:
            continue
        try:
            step()
        except Exception:  # noqa: BLE001 - report, keep going (later steps still run on every rank)
            chk.errors.append(f"[seed={seed} rank={ctx.rank} {chk.where}] {name} raised:\n{traceback.format_exc()}")
    if not names:
        # a rank always waits some nanoseconds for a receive over gloo: over dozens of calls the stats must grow
        # (and per source rank: every source's entry, not just some entry)
        chk.at("wait-cost stats overall").true(
            "wait-cost stats grow for every source rank",
            chk.wait_checks == 0 or chk.wait_grew_sources == set(range(ctx.world_size)),
            f"{chk.wait_checks} dispatch/combine wait-stat tensors observed; the entries of sources "
            f"{sorted(chk.wait_grew_sources)} grew, of {ctx.world_size} ranks (unit: ns, DESIGN.md)")
    return chk.errors


def run_hook_flags(ctx, seed: int) -> List[tuple]:
    """The transport learns whether the receive runs later (a hook) or right away: the NVLink path then
    chooses two kernels or one, so a wrong flag would keep a kernel resident until the hook, or make the
    hook do nothing while the receive already ran. Returns (operation, flag) per call."""
    seen: List[tuple] = []
    buffer = make_buffer(ctx, 8, 256, 2 * ctx.world_size, explicitly_destroy=True)
    transport = buffer._transport
    dispatch, combine = transport.low_latency_dispatch, transport.low_latency_combine
    transport.low_latency_dispatch = lambda *a, **k: seen.append(("dispatch", a[-1])) or dispatch(*a, **k)
    transport.low_latency_combine = lambda *a, **k: seen.append(("combine", a[-1])) or combine(*a, **k)
    g = generator(seed, ctx.rank)
    x = torch.randn((4, 256), generator=g).to(ctx.device, torch.bfloat16)
    topk_idx = torch.randint(0, 2 * ctx.world_size, (4, 2), generator=g).to(ctx.device)
    weights = torch.rand((4, 2), generator=g).to(ctx.device)
    try:
        for mode in ("sync", "hook", "async"):
            flags = dict(return_recv_hook=mode == "hook", async_finish=mode == "async")
            _, _, handle, event, hook = buffer.low_latency_dispatch(x, topk_idx, 8, 2 * ctx.world_size,
                                                                    use_fp8=False, **flags)
            if hook is not None:
                hook()
            if mode == "async":
                event.current_stream_wait()
            experts = torch.randn((2, 8 * ctx.world_size, 256), generator=g).to(ctx.device, torch.bfloat16)
            _, event, hook = buffer.low_latency_combine(experts, topk_idx, weights, handle, **flags)
            if hook is not None:
                hook()
            if mode == "async":
                event.current_stream_wait()
    finally:
        buffer.destroy()
    return seen


# ---------------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------------

def test_low_latency_transport_told_about_hooks(pool):
    for seen in pool(2).run(run_hook_flags, base_seed()):
        assert seen == [("dispatch", False), ("combine", False), ("dispatch", True), ("combine", True),
                        ("dispatch", False), ("combine", False)], seen


@pytest.mark.parametrize("world_size", [2, 3, 4, 6])
def test_low_latency(pool, world_size):
    seed = base_seed()
    print(f"test_low_latency world_size={world_size} seed={seed} (replay: DEEP_EP_TEST_SEED={seed})")
    names = [s for s in os.environ.get("DEEP_EP_LL_STEPS", "").split(",") if s]
    report_mismatches(seed, lambda: pool(world_size).run(run_all, seed, names))


def run_too_many_rows(ctx, seed: int) -> List[str]:
    """Every rank's one token lists rank 0's first expert twice: 4 rows for its 2 (R * N) slots. Rank 0's
    dispatch raises a ValueError naming topk_idx and the repeated expert; rank 1's does not; the next call
    works on both (the reference transport: the NVLink kernels report it to the host instead, see
    interpreted_low_latency.py)."""
    N, H, E = 1, 128, 4
    buf = make_buffer(ctx, N, H, E, transport="reference")
    x = torch.randn(1, H, generator=generator(seed, "too many rows", ctx.rank)).to(torch.bfloat16).to(ctx.device)
    problems = []
    try:
        buf.low_latency_dispatch(x, torch.tensor([[0, 0]], device=ctx.device), N, E, use_fp8=False)
        if ctx.rank == 0:
            problems.append("rank 0: no error for 4 rows into 2 slots")
    except ValueError as error:
        if ctx.rank != 0 or "topk_idx" not in str(error) or "several times" not in str(error):
            problems.append(f"rank {ctx.rank}: {error}")
    _, count, _, _, _ = buf.low_latency_dispatch(x, torch.tensor([[0, 1]], device=ctx.device), N, E, use_fp8=False)
    expected = [2, 2] if ctx.rank == 0 else [0, 0]
    if count.tolist() != expected:
        problems.append(f"rank {ctx.rank}: the next call's recv_count {count.tolist()}, expected {expected}")
    return problems


def test_low_latency_too_many_rows_for_an_expert_is_an_error(pool):
    seed = base_seed()
    report_mismatches(seed, lambda: pool(2).run(run_too_many_rows, seed))


def run_combines_of_other_topk_widths(ctx, seed: int) -> List[str]:
    """Combines repeated on one handle with topk_idx of the dispatch's width, one -1 column wider, then the
    dispatch's again, then without its last column (whose selections are then not combined): each equals the
    weighted sum over the selections it lists, in slot order from +0 (the reference transport keeps an order for
    repeated combines; another width must not reuse it)."""
    N, H, E, K = 6, 128, 8, 3
    buf = make_buffer(ctx, N, H, E, transport="reference")
    gen = generator(seed, "topk widths", ctx.rank)
    x = torch.randn(N, H, generator=gen).to(torch.bfloat16).to(ctx.device)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(N)]).to(ctx.device)
    idx[1, 2] = -1
    weights = torch.rand((N, K), generator=gen).to(ctx.device)
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, N, E, use_fp8=False)
    rows = torch.randn(recv_x.shape, generator=gen).to(torch.bfloat16).to(ctx.device)   # expert outputs
    # every rank's handle and expert outputs: a selection's row is found by (local expert, source token); the
    # owner's rows of a local expert from this rank are those of its layout_range entry
    gathered = [[torch.empty_like(t) for _ in range(ctx.world_size)] for t in (handle[0], handle[1], rows)]
    for parts, mine in zip(gathered, (handle[0], handle[1], rows)):
        torch.distributed.all_gather(parts, mine, group=ctx.group)
    gathered_src, gathered_layout, gathered_rows = gathered
    E_loc = E // ctx.world_size
    problems = []
    pad_idx = torch.full((N, 1), -1, dtype=idx.dtype, device=ctx.device)
    pad_w = torch.full((N, 1), float("nan"), device=ctx.device)
    for name, cidx, cw in [("the dispatch's width", idx, weights),
                           ("one -1 column wider", torch.cat([idx, pad_idx], 1), torch.cat([weights, pad_w], 1)),
                           ("the dispatch's width again", idx, weights),
                           ("one column narrower", idx[:, :K - 1].contiguous(), weights[:, :K - 1].contiguous())]:
        combined = buf.low_latency_combine(rows, cidx, cw, handle)[0]
        expected = torch.zeros((N, H), dtype=torch.float32, device=ctx.device)
        for t in range(N):
            for k in range(cidx.shape[1]):
                e = int(cidx[t, k])
                if e < 0:
                    continue
                owner, local = divmod(e, E_loc)
                packed = int(gathered_layout[owner][local, ctx.rank])
                block = slice(packed >> 32, (packed >> 32) + (packed & 0xFFFFFFFF))
                where = (gathered_src[owner][local, block] == t).nonzero()
                row = gathered_rows[owner][local, block][int(where[0])]
                expected[t] = expected[t] + row.float() * cw[t, k]
        if not torch.equal(bits(combined), bits(expected.to(torch.bfloat16))):
            problems.append(f"rank {ctx.rank}: combine with topk_idx {name} differs from the sum of its selections")
    return problems


def test_low_latency_combines_of_other_topk_widths(pool):
    seed = base_seed()
    report_mismatches(seed, lambda: pool(2).run(run_combines_of_other_topk_widths, seed))


def _refused_on(rank: int, ctx, what: str, fn, expect: str, problems: List[str]) -> None:
    """`fn()` raises a ValueError containing `expect` on `rank` (every rank where `rank` is None), else returns."""
    try:
        fn()
        if rank is None or ctx.rank == rank:
            problems.append(f"rank {ctx.rank}: {what}: no error")
    except ValueError as error:
        if (rank is not None and ctx.rank != rank) or expect not in str(error):
            problems.append(f"rank {ctx.rank}: {what}: {error}")


def run_combine_matching(ctx, seed: int) -> List[str]:
    """The reference combine returns rows without their (expert, token) ids when every rank remembers the
    dispatch of its handle (Note [returned in sent order]) and with them otherwise: both give the same bits;
    handles of different dispatches are refused on every rank; a top-k entry that names an expert the dispatch
    did not send the token to is refused on its rank, on both paths."""
    from deep_ep.transport.kept import Keeper
    N, H, E, K = 6, 128, 4 * ctx.world_size, 3
    buf = make_buffer(ctx, N, H, E, transport="reference")
    x, idx, weights = _small_inputs(ctx, seed, "combine matching a", 5, H, E, K)
    x_b, idx_b, weights_b = _small_inputs(ctx, seed, "combine matching b", 4, H, E, K)
    idx[0, 1] = -1
    recv_a, _, handle_a, _, _ = buf.low_latency_dispatch(x, idx, N, E, use_fp8=False)
    recv_b, _, handle_b, _, _ = buf.low_latency_dispatch(x_b, idx_b, N, E, use_fp8=False)
    problems: List[str] = []
    # (before either handle's first combine: a combine that repeats its handle's agreed call on some ranks only
    # is not detected, Note [checked once per handle])
    mixed = (recv_a, handle_a) if ctx.rank == 0 else (recv_b, handle_b)
    _refused_on(None, ctx, "handles of different dispatches",
                lambda: buf.low_latency_combine(mixed[0], idx, weights, mixed[1]), "different dispatches", problems)
    remembered = buf.low_latency_combine(recv_a, idx, weights, handle_a)[0]
    for path in ("sent order", "ids"):
        if path == "ids":   # the same dispatch again, whose selections one rank forgets: every rank takes the ids
            recv_a, _, handle_a, _, _ = buf.low_latency_dispatch(x, idx, N, E, use_fp8=False)
            if ctx.rank == 0:
                buf._transport._sent_selections = Keeper()   # a new keeper: every selection kept so far forgotten
        again = buf.low_latency_combine(recv_a, idx, weights, handle_a)[0]
        if not torch.equal(bits(again), bits(remembered)):
            problems.append(f"rank {ctx.rank}: combine by {path} differs from the first combine")
        wrong = idx.clone()
        wrong[0, 1] = (idx[0, 0] + 1) % E if ctx.rank == 1 else -1   # (slot 1 of token 0 was not sent)
        if ctx.rank == 1 and bool((wrong[0, 1] == idx[0]).any()):
            wrong[0, 1] = (idx[0].max() + 1) % E
        _refused_on(1, ctx, f"an expert not sent to ({path})",
                    lambda: buf.low_latency_combine(recv_a, wrong, weights, handle_a), "did not send", problems)
    return problems


def test_low_latency_combine_matches_rows_with_and_without_their_ids(pool):
    seed = base_seed()
    report_mismatches(seed, lambda: pool(2).run(run_combine_matching, seed))


def _small_inputs(ctx, seed: int, what: str, num_tokens: int, hidden: int, num_experts: int, topk: int):
    """Random BF16 x, top-k ids (distinct experts) and weights on the rank's device."""
    gen = generator(seed, what, ctx.rank)
    x = torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16).to(ctx.device)
    idx = torch.rand(num_tokens, num_experts, generator=gen).topk(topk, dim=1).indices.to(ctx.device)
    return x, idx, torch.rand(num_tokens, topk, generator=gen).to(ctx.device)


def run_inference_mode(ctx, seed: int) -> List[str]:
    """A Buffer built inside torch.inference_mode() (frameworks build theirs lazily in a forward) and used
    outside it, and calls made inside it whose receive hooks run outside it (on another thread, where the mode
    is not set, and on this thread after leaving it): the results of plain calls, and the shrink mask updated
    outside the mode."""
    N, H, E = 8, 256, 4 * ctx.world_size
    x, idx, weights = _small_inputs(ctx, seed, "inference mode", 5, H, E, 2)
    with torch.inference_mode():
        buf = make_buffer(ctx, N, H, E, enable_shrink=True, explicitly_destroy=True)
    problems = []
    plain_x, plain_count, plain_handle, _, _ = buf.low_latency_dispatch(x, idx, N, E, use_fp8=False)
    plain_combined = buf.low_latency_combine(plain_x, idx, weights, plain_handle)[0]
    with torch.inference_mode():
        recv_x, count, handle, _, hook = buf.low_latency_dispatch(x, idx, N, E, use_fp8=False,
                                                                  return_recv_hook=True)
    run_on_another_thread(hook)
    if not torch.equal(count, plain_count):
        problems.append(f"rank {ctx.rank}: recv_count {count.tolist()}, plainly {plain_count.tolist()}")
    else:
        for e, rows in enumerate(count.tolist()):
            if not torch.equal(bits(recv_x[e, :rows]), bits(plain_x[e, :rows])):
                problems.append(f"rank {ctx.rank}: expert {e}'s rows differ from a plain dispatch's")
    with torch.inference_mode():
        combined, _, hook = buf.low_latency_combine(recv_x, idx, weights, handle, return_recv_hook=True)
    hook()   # this thread, out of the mode again
    if not torch.equal(bits(combined), bits(plain_combined)):
        problems.append(f"rank {ctx.rank}: the combine differs from a plain combine's")
    peer = (ctx.rank + 1) % ctx.world_size
    buf.low_latency_update_mask_buffer(peer, True)
    mask = torch.zeros(ctx.world_size, dtype=torch.int32, device=ctx.device)
    buf.low_latency_query_mask_buffer(mask)
    if mask.tolist() != [int(r == peer) for r in range(ctx.world_size)]:
        problems.append(f"rank {ctx.rank}: mask {mask.tolist()} after masking rank {peer}")
    buf.low_latency_clean_mask_buffer()
    buf.destroy()
    return problems


def test_low_latency_buffer_and_hooks_across_inference_mode(pool):
    seed = base_seed()
    report_mismatches(seed, lambda: pool(2).run(run_inference_mode, seed))


def run_no_autograd_history(ctx, seed: int) -> List[str]:
    """Top-k weights that require grad (grad mode on): no output of a combine carries autograd history (as
    DeepEP's), with and without a hook, in normal mode too; a hook writing `out=`, a view made under no_grad,
    from a call made inside an autograd.Function's forward (grad off) and called outside it."""
    from deep_ep import Buffer, Config
    N, H, E, T = 8, 256, 4 * ctx.world_size, 6
    x, idx, weights = _small_inputs(ctx, seed, "no autograd history", T, H, E, 2)
    weights.requires_grad_()
    buf = Buffer(ctx.group, Config().get_nvl_buffer_size_hint(H * 2, ctx.world_size),
                 Buffer.get_low_latency_rdma_size_hint(N, H, ctx.world_size, E), low_latency_mode=True,
                 num_qps_per_rank=E // ctx.world_size, explicitly_destroy=True)
    problems = []

    def history(what: str, tensor: torch.Tensor) -> None:
        if tensor.requires_grad or tensor.grad_fn is not None:
            problems.append(f"rank {ctx.rank}: {what} carries autograd history ({tensor.grad_fn})")

    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, N, E, use_fp8=False)
    history("low_latency_combine", buf.low_latency_combine(recv_x, idx, weights, handle)[0])
    combined, _, hook = buf.low_latency_combine(recv_x, idx, weights, handle, return_recv_hook=True)
    hook()
    history("low_latency_combine with a hook", combined)
    with torch.no_grad():
        out = torch.empty(T + 1, H, dtype=torch.bfloat16, device=ctx.device)[1:]

    class Combine(torch.autograd.Function):
        @staticmethod
        def forward(fn_ctx, expert_x, topk_weights):
            return buf.low_latency_combine(expert_x, idx, topk_weights, handle, return_recv_hook=True, out=out)[2]

    hook = Combine.apply(recv_x, weights)
    hook()
    history("low_latency_combine into out=", out)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    rows, _, recv_weights, _, normal_handle, _ = buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=idx, topk_weights=weights)
    history("dispatch recv_topk_weights", recv_weights)
    for i, t in enumerate(buf.combine(rows, normal_handle, topk_weights=recv_weights.clone().requires_grad_())[:2]):
        history(f"combine output {i}", t)
    buf.destroy()
    return problems


def test_outputs_carry_no_autograd_history(pool):
    seed = base_seed()
    report_mismatches(seed, lambda: pool(2).run(run_no_autograd_history, seed))


def test_low_latency_shrink_masks_ranks_that_stop_calling(pool):
    seed = base_seed()
    print(f"seed={seed} (replay: DEEP_EP_TEST_SEED={seed})")
    timeout_s = float(os.environ.get("DEEP_EP_TEST_SHRINK_TIMEOUT_S", "5"))
    report_mismatches(seed, lambda: pool(5).run(run_shrink_automatic, seed, timeout_s))


@pytest.mark.nvlink_kernels
def test_nvlink_masking_is_reported_as_a_warning_at_the_callers_line():
    """The NVLink kernels record a rank they masked in shrink mode in the pinned status words (4 + rank: what
    they waited for); the next low-latency call's check turns each into one warning, attributed to the
    caller's code, and clears it."""
    from types import SimpleNamespace
    from deep_ep.transport.nvlink.status import MASKS, StatusWords
    status = StatusWords(SimpleNamespace(rank=2, size=4), 3 * 10 ** 9)
    status.tensor[MASKS + 1], status.tensor[MASKS + 3] = 4, 5   # what ranks 1 and 3 were waited for
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        status.report_low_latency(warn_masked=True)
    assert [str(w.message) for w in caught] == [
        "deep_ep: rank 2 masked rank 1 after waiting more than 3 s for its low-latency dispatch rows (enable_shrink)",
        "deep_ep: rank 2 masked rank 3 after waiting more than 3 s for its low-latency combine rows (enable_shrink)"]
    assert all(w.filename == __file__ for w in caught), [w.filename for w in caught]
    assert not status.tensor.any()


def _nvlink_low_latency(num_ranks: int, num_sms: int = 1, auto_mask: bool = False):
    """An NVLinkLowLatency of rank 0 on CPU tensors, for the checks its constructor makes (no kernel runs)."""
    from types import SimpleNamespace
    from deep_ep.group import Topology
    from deep_ep.transport.nvlink.low_latency import NVLinkLowLatency
    peers = SimpleNamespace(bases=torch.zeros(num_ranks, dtype=torch.int64))
    return NVLinkLowLatency(Topology(0, num_ranks, num_ranks), torch.zeros(64, dtype=torch.uint8), peers,
                            torch.zeros(4 + num_ranks, dtype=torch.int32), 10 ** 9, num_sms, auto_mask=auto_mask)


@pytest.mark.nvlink_kernels
def test_nvlink_shrink_mode_refuses_more_ranks_than_its_rank_bits_hold():
    """Shrink mode's NVLink kernels pass the ranks a call exchanges with as the bits of an int64: a larger group
    is refused when the Buffer is built, naming enable_shrink and the limit, rather than masking the wrong ranks."""
    from deep_ep.transport.nvlink.low_latency import MAX_SHRINK_RANKS
    limit = MAX_SHRINK_RANKS
    _nvlink_low_latency(limit, auto_mask=True)
    _nvlink_low_latency(limit + 1, auto_mask=False)
    with pytest.raises(ValueError, match=f"enable_shrink.*at most {limit} ranks.*has {limit + 1}"):
        _nvlink_low_latency(limit + 1, auto_mask=True)


@pytest.mark.nvlink_kernels
def test_nvlink_low_latency_refuses_receive_grids_larger_than_the_finish_unit():
    """Every receive program adds a share of RECEIVED_UNIT of at least 1 (sync.finish_receive), so a grid
    may have at most RECEIVED_UNIT programs."""
    from deep_ep.transport.nvlink.low_latency import RECV_PROGRAMS_PER_SM
    from deep_ep.transport.nvlink.sync import RECEIVED_UNIT
    most = RECEIVED_UNIT.value // RECV_PROGRAMS_PER_SM
    _nvlink_low_latency(2, num_sms=most)
    with pytest.raises(ValueError, match=f"num_sms.*{most + 1} SMs.*at most {RECEIVED_UNIT.value}"):
        _nvlink_low_latency(2, num_sms=most + 1)


@pytest.mark.nvlink_kernels
@pytest.mark.parametrize("capability, asked, chained", [
    ((9, 0), None, True), ((10, 0), None, False), ((12, 0), None, False), ((8, 0), None, False),
    ((9, 0), False, False), ((10, 0), True, True), ((8, 0), True, False)])
def test_nvlink_low_latency_chains_launches_where_asked_and_supported(monkeypatch, capability, asked, chained):
    """Programmatic dependent launches (griddepcontrol: sm_90 and later) by default only on sm_90, where they
    are tested; low_latency.PDL forces them on later GPUs (True) or off (False)."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    from deep_ep.transport.nvlink import low_latency
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(low_latency, "PDL", asked)
    assert low_latency._chain_launches(torch.device("cuda", 0)) == chained


def test_low_latency_in_deterministic_mode(pool):
    """The 2-rank cases and the pipeline with torch's deterministic algorithms on and new tensors filled with
    NaN / the largest integer (the transport may rely on no value of memory it did not write)."""
    seed = base_seed()
    names = [f"case {c.name}" for c in cases_for(2)] + ["pipeline"]
    report_mismatches(seed, lambda: pool(2).run(run_deterministic, run_all, seed, names))


def test_low_latency_under_a_default_device_and_dtype(pool):
    """The 2-rank cases and the pipeline with every Buffer call (and receive hook) made under a default device
    (meta) and dtype (bfloat16) that the library must not use (dist_utils.run_under_defaults)."""
    seed = base_seed()
    names = [f"case {c.name}" for c in cases_for(2)] + ["pipeline", "shrink"]
    report_mismatches(seed, lambda: pool(2).run(run_under_defaults, run_all, seed, names))


def test_model_e4m3_encoder_matches_torch_cast():
    """The model's bit-level e4m3 cast agrees with torch's float8 conversion (RNE) on many values, including
    every midpoint between neighbouring e4m3 values and its float32 neighbours (ties to even)."""
    gen = generator(base_seed(), "e4m3")
    v = torch.randn(200_000, generator=gen) * torch.pow(2.0, torch.randint(-16, 10, (200_000,), generator=gen).float())
    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    grid = M.e4m3_decode(codes)
    finite = torch.unique(grid[~grid.isnan()].abs()).sort().values.double()
    mid = ((finite[1:] + finite[:-1]) / 2).float()
    extra = torch.cat([mid, torch.nextafter(mid, torch.tensor(0.0)), torch.nextafter(mid, torch.tensor(1e9)),
                       finite.float(), torch.tensor([0.0, 448.0, 449.0, 464.0, 470.0, 1e-30, 2.0 ** -10])])
    vals = torch.cat([v.clamp(-448, 448), extra, -extra])
    assert torch.equal(M.e4m3_encode(vals), vals.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8))
    # saturation above 448 (satfinite), and -0 keeps its sign
    assert M.e4m3_encode(torch.tensor([500.0, -1e6, -0.0])).tolist() == [0x7E, 0xFE, 0x80]
    assert torch.equal(M.e4m3_decode(codes)[~grid.isnan()], codes.view(torch.float8_e4m3fn).float()[~grid.isnan()])


def test_model_scales_and_ue8m0_by_hand():
    """Hand-computed power-of-two scales and UE8M0 packing (group 4j+b in byte b of word j)."""
    h = 640                                       # 5 groups: 2 words, the second with one valid byte
    x = torch.zeros(1, h)
    amaxes = [448.0, 450.0, 1.0, 0.0, 3 * 2.0 ** -20]   # all exact in bf16
    for gi, a in enumerate(amaxes):
        x[0, gi * 128] = a
    q = M.quantize_fp8(x.to(torch.bfloat16), round_scale=True)
    e = q.exponent[0].tolist()
    import math
    inv = torch.tensor(1 / 448, dtype=torch.float32)
    for gi, a in enumerate(amaxes):
        p = float(torch.tensor(max(a, float(torch.tensor(1e-4, dtype=torch.float32))), dtype=torch.float32) * inv)
        assert e[gi] == math.ceil(math.log2(p)), (gi, e, p)
    assert e[1] == 1 and e[0] == (0 if float(torch.tensor(448.0) * inv) <= 1.0 else 1)
    assert q.scale_inv[0].tolist() == [2.0 ** v for v in e]
    words = q.ue8m0_words()[0].tolist()
    b = [v + 127 for v in e]
    w0 = b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24
    assert words == [w0 - 2 ** 32 if w0 >= 2 ** 31 else w0, b[4]]
    # the FP8 codes: the group maximum maps to 448 * amax / 2^e ... and dequantises back within e4m3 precision
    back = M.dequantize_fp8(q)
    assert torch.allclose(back, x, rtol=2 ** -3, atol=0)
    # non-rounded scales: the amax element becomes exactly 448 (0x7E)
    q2 = M.quantize_fp8(torch.tensor([[3.0] + [1.0] * 127], dtype=torch.bfloat16), round_scale=False)
    assert q2.data[0, 0].item() == 0x7E and q2.scale_inv[0, 0].item() == float(torch.tensor(3.0) * inv)


def test_model_dispatch_combine_by_hand():
    """R=2, E=4: rows ordered by (source, token, slot); a duplicated expert is delivered twice; masks."""
    h = 128
    srcs = [M.Source(torch.arange(2 * h).view(2, h).to(torch.bfloat16), torch.tensor([[1, 2], [1, 1]]),
                     torch.tensor([[0.5, 0.25], [1.0, 2.0]])),
            M.Source(torch.full((1, h), 1000.0).to(torch.bfloat16), torch.tensor([[0, -1]]), torch.tensor([[3.0, 9.0]]))]
    r0, r1 = M.dispatch_region(srcs, 0, 4), M.dispatch_region(srcs, 1, 4)
    assert r0.count.tolist() == [1, 3] and r1.count.tolist() == [1, 0]
    assert r0.block_count.tolist() == [[0, 1], [3, 0]]
    assert (r0.layout_range & 0xFFFFFFFF).tolist() == [[0, 1], [3, 0]]
    assert int(r0.layout_range[0, 1] >> 32) == 0
    assert list(zip(r0.expert.tolist(), r0.row.tolist(), r0.src_rank.tolist(), r0.src_token.tolist(),
                    r0.src_slot.tolist())) == [(0, 0, 1, 0, 0), (1, 0, 0, 0, 0), (1, 1, 0, 1, 0), (1, 2, 0, 1, 1)]
    assert r1.src_slot.tolist() == [1]
    assert torch.equal(r0.payload_bf16(srcs)[1:], srcs[0].x[[0, 1, 1]])
    rows = M.selection_rows(srcs, [r0, r1])
    assert rows[0].tolist() == [[0, 0], [1, 2]] and rows[1].tolist() == [[0, -1]]
    ys = [torch.full((2, 8, h), float("nan")).to(torch.bfloat16) for _ in range(2)]
    ys[0][0, 0], ys[0][1, 0], ys[0][1, 1], ys[0][1, 2], ys[1][0, 0] = 7.0, 1.0, 2.0, 3.0, 5.0
    out0 = M.combine(0, srcs[0].topk_idx, srcs[0].topk_weights, rows[0], ys, 2)
    assert out0[:, 0].tolist() == [0.5 * 1 + 0.25 * 5, 1 * 2 + 2 * 3]      # the duplicate reads its own row
    assert M.combine(1, srcs[1].topk_idx, srcs[1].topk_weights, rows[1], ys, 2)[0, 0].item() == 21.0
    masks = [[0, 1], [1, 1]]                      # rank 1 cut off: rank 0 masks it, it masks everyone
    m0, m1 = M.dispatch_region(srcs, 0, 4, masks), M.dispatch_region(srcs, 1, 4, masks)
    assert m0.count.tolist() == [0, 3] and m1.count.tolist() == [0, 0]
    rows_m = M.selection_rows(srcs, [m0, m1])
    assert M.combine(0, srcs[0].topk_idx, srcs[0].topk_weights, rows_m[0], ys, 2, masks)[:, 0].tolist() == [0.5, 8.0]
    assert M.combine(1, srcs[1].topk_idx, srcs[1].topk_weights, rows_m[1], ys, 2, masks)[0, 0].item() == 0.0
    # the fp32 order: product rounded, then the sum rounded, k ascending
    w = torch.tensor([[1.0, 1.0, -1.0]])
    big = [2.0 ** 24, 1.0, 2.0 ** 24]
    yy = [torch.zeros(3, 8, h).to(torch.bfloat16)]
    for k, v in enumerate(big):
        yy[0][k, 0] = v
    one = M.Source(torch.zeros(1, h).to(torch.bfloat16), torch.tensor([[0, 1, 2]]), w)
    reg = M.dispatch_region([one], 0, 3)
    res = M.combine(0, one.topk_idx, w, M.selection_rows([one], [reg])[0], yy, 3)
    assert res[0, 0].item() == 0.0                # (2^24 + 1) rounds to 2^24 in fp32, then - 2^24
    assert M.size_hint(128, 7168, 288) == 2146961792 and M.size_hint(16, 5120, 256) == 170395776
