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
from typing import Any, Dict, List, Optional

import pytest
import torch

import model_low_latency as M
from dist_utils import run_on_another_thread
from randomness import base_seed, bits, generator

# ---------------------------------------------------------------------------------------------------
# seeds and random inputs (identical on every rank)
# ---------------------------------------------------------------------------------------------------


def make_routing(gen: torch.Generator, num_tokens: int, num_topk: int, num_experts: int, style: str,
                 mask_frac: float, hot_expert: int):
    """(topk_idx int64 [T, K], topk_weights float32 [T, K]).

    styles: "uniform" (K distinct experts; K may exceed E only with "dup"), "skewed" (most tokens pick the hot
    expert, scores favour the hot expert's rank), "dup" (half of the tokens repeat their first expert in slot 1,
    and some in the last slot too), "first_half" (only the experts of the first half of the ranks, K <= E / 2:
    the other ranks receive nothing). `mask_frac` of the entries become -1; token 0 then selects nothing.
    """
    if num_topk <= num_experts:
        scores = torch.rand(num_tokens, num_experts, generator=gen)
        if style == "skewed":
            hot = torch.rand(num_tokens, generator=gen) < 0.85
            scores[hot, hot_expert] += 10.0
        if style == "first_half":
            scores[:, num_experts // 2:] = -1.0
        idx = scores.topk(num_topk, dim=1).indices.to(torch.int64)
    else:
        idx = torch.randint(num_experts, (num_tokens, num_topk), generator=gen, dtype=torch.int64)
    if style == "dup" and num_topk > 1 and num_tokens > 0:
        dup = torch.rand(num_tokens, generator=gen) < 0.5
        idx[dup, 1] = idx[dup, 0]
        dup2 = torch.rand(num_tokens, generator=gen) < 0.3
        idx[dup2, num_topk - 1] = idx[dup2, 0]
    if mask_frac > 0 and num_tokens > 0:
        idx[torch.rand(num_tokens, num_topk, generator=gen) < mask_frac] = -1
        idx[0] = -1
    weights = torch.randn(num_tokens, num_topk, generator=gen, dtype=torch.float32)
    return idx.contiguous(), weights.contiguous()


def make_x(gen: torch.Generator, num_tokens: int, hidden: int) -> torch.Tensor:
    """bf16 tokens with per-token and per-128-group magnitudes spread over many octaves (exercises the FP8
    scales); token 1 is all zeros and token 2 tiny (both hit the amax floor 1e-4)."""
    x = torch.randn(num_tokens, hidden, generator=gen)
    x *= torch.pow(2.0, torch.randint(-12, 9, (num_tokens, 1), generator=gen).float())
    groups = M.ceil_div(hidden, 128)
    group_scale = torch.pow(2.0, torch.randint(-4, 5, (num_tokens, groups), generator=gen).float())
    x *= group_scale.repeat_interleave(128, dim=1)[:, :hidden]
    if num_tokens > 1:
        x[1] = 0
    if num_tokens > 2:
        x[2] *= 1e-7 / max(float(x[2].abs().max()), 1e-30)
    return x.to(torch.bfloat16).contiguous()


def wide_rows(gen: torch.Generator, rows: int, hidden: int) -> torch.Tensor:
    """bf16 values spread over 2^-16..2^16: fp32 sums of a few are inexact, so the order shows in the bits."""
    scale = torch.pow(2.0, torch.randint(-16, 17, (rows, hidden), generator=gen).float())
    return (torch.randn(rows, hidden, generator=gen) * scale).to(torch.bfloat16)


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


def make_sources(seed: int, case: Dict[str, Any], num_ranks: int, tag: str = "") -> List[M.Source]:
    num_experts = num_ranks * case["experts_per_rank"]
    hot = int(torch.randint(num_experts, (1,), generator=generator(seed, case["name"], tag, "hot")))
    sources = []
    for s in range(num_ranks):
        gen = generator(seed, case["name"], tag, "source", s)
        idx, w = make_routing(gen, case["tokens"][s], case["topk"], num_experts, case.get("routing", "uniform"),
                              case.get("mask_frac", 0.0), hot)
        sources.append(M.Source(make_x(gen, case["tokens"][s], case["hidden"]), idx, w))
    return sources


def expert_outputs(seed: int, key: Any, regions: List[M.Region], num_max_tokens: int, hidden: int,
                   logfmt: bool) -> List[torch.Tensor]:
    """Combine inputs of every rank: [E_loc, R*N, H] bf16, random in the valid rows, NaN elsewhere (the
    contract says rows >= recv_count are ignored)."""
    out = []
    for reg in regions:
        gen = generator(seed, key, "y", reg.rank)
        rows = reg.row.numel()
        vals = logfmt_rows(gen, rows, hidden) if logfmt else wide_rows(gen, rows, hidden)
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
class Checker:
    def __init__(self, seed: int, rank: int) -> None:
        self.seed, self.rank = seed, rank
        self.where = ""
        self.errors: List[str] = []
        self.wait_checks = 0      # wait-cost stats observed
        self.wait_grew = 0        # ... of which some entry strictly grew
        self.wait_grew_sources: set = set()   # the source ranks whose entry grew in some call

    def at(self, where: str) -> "Checker":
        self.where = where
        return self

    def fail(self, what: str, detail: str) -> None:
        if len(self.errors) < 60:
            self.errors.append(f"[seed={self.seed} rank={self.rank} {self.where}] {what}: {detail}")

    def true(self, what: str, cond: Any, detail: str = "") -> bool:
        if not cond:
            self.fail(what, detail or "condition is false")
        return bool(cond)

    def meta(self, what: str, t: Any, dtype: torch.dtype, shape: tuple) -> bool:
        if not self.true(f"{what} type", isinstance(t, torch.Tensor), f"expected a tensor, got {type(t).__name__}"):
            return False
        ok = self.true(f"{what} dtype", t.dtype == dtype, f"got {t.dtype}, expected {dtype}")
        ok &= self.true(f"{what} shape", tuple(t.shape) == tuple(shape), f"got {tuple(t.shape)}, expected {shape}")
        return ok

    def equal(self, what: str, got: torch.Tensor, expected: torch.Tensor) -> bool:
        got = got.detach().cpu()
        if got.dtype != expected.dtype or tuple(got.shape) != tuple(expected.shape):
            self.fail(what, f"{got.dtype}{tuple(got.shape)} vs expected {expected.dtype}{tuple(expected.shape)}")
            return False
        a, b = bits(got), bits(expected)
        if not torch.equal(a, b):
            diff = (a != b).nonzero()
            first = tuple(diff[0].tolist())
            self.fail(what, f"{diff.size(0)} of {a.numel()} elements differ, first at {first}: got "
                            f"{got[first].item()!r}, expected {expected[first].item()!r}")
            return False
        return True

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


def dup_note(cidx: torch.Tensor, got: torch.Tensor, expected: torch.Tensor) -> str:
    """Diagnosis for a combine mismatch: do the wrong tokens select one expert in several slots?"""
    if got.shape != expected.shape or got.numel() == 0:
        return ""
    bad = (bits(got) != bits(expected)).any(1)
    dup = torch.tensor([len(set(v for v in row.tolist() if v >= 0)) < int((row >= 0).sum()) for row in cidx],
                       dtype=torch.bool)
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


def check_dispatch(chk: Checker, out: tuple, reg: M.Region, sources: List[M.Source], opts: Dict[str, Any],
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
    e_idx, j_idx = reg.expert, reg.row
    chk.equal("src_info of the valid rows", src_info.cpu()[e_idx, j_idx], reg.src_info)
    if opts["fp8"]:
        if not chk.true("FP8 recv_x is a (data, scales) tuple", isinstance(recv_x, tuple) and len(recv_x) == 2,
                        f"got {type(recv_x).__name__}"):
            return handle
        data, scales = recv_x
        groups = M.ceil_div(hidden, 128)
        if chk.meta("FP8 data", data, torch.float8_e4m3fn, (e_loc, slots, hidden)):
            expected = reg.payload_fp8(sources, opts["round_scale"])
            chk.equal("FP8 data bytes of the valid rows", data.cpu().view(torch.uint8)[e_idx, j_idx], expected.data)
            if opts["ue8m0"]:
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
    elif chk.meta("BF16 recv_x", recv_x, torch.bfloat16, (e_loc, slots, hidden)):
        chk.equal("BF16 rows", recv_x.cpu()[e_idx, j_idx], reg.payload_bf16(sources))
    return handle


# ---------------------------------------------------------------------------------------------------
# one dispatch + combine round
# ---------------------------------------------------------------------------------------------------
DISPATCH_KINDS = [dict(fp8=False, round_scale=False, ue8m0=False), dict(fp8=True, round_scale=False, ue8m0=False),
                  dict(fp8=True, round_scale=True, ue8m0=False), dict(fp8=True, round_scale=True, ue8m0=True)]
MODES = ["sync", "async", "hook"]
COMBINE_KINDS = ["plain", "out", "zero_copy", "logfmt"]


def round_options(i: int) -> Dict[str, Any]:
    """Round i of a cycle that covers every dispatch kind x mode (12 rounds) with every combine kind x mode."""
    opts = dict(DISPATCH_KINDS[i % 4])
    opts["dmode"] = MODES[(i // 4 + i) % 3]
    opts["ckind"] = COMBINE_KINDS[(i // 3) % 4]
    opts["cmode"] = MODES[(i + 1) % 3]
    opts["stats"] = i % 2 == 0
    opts["drop"] = i % 5 == 3
    return opts


def ll_dispatch(buf, ctx, src: M.Source, n: int, num_experts: int, opts: Dict[str, Any], cum=None, wait=None):
    ignored = not opts["fp8"] and ctx.rank % 2 == 1   # (BF16 ignores both flags: ranks may differ in them)
    out = buf.low_latency_dispatch(src.x.to(ctx.device), src.topk_idx.to(ctx.device), n, num_experts,
                                   cumulative_local_expert_recv_stats=cum, dispatch_wait_recv_cost_stats=wait,
                                   use_fp8=opts["fp8"], round_scale=opts["round_scale"] or ignored,
                                   use_ue8m0=opts["ue8m0"] or ignored,
                                   async_finish=opts["dmode"] == "async", return_recv_hook=opts["dmode"] == "hook")
    return out


def finish_dispatch(chk: Checker, out: tuple, opts: Dict[str, Any]) -> None:
    data = out[0][0] if isinstance(out[0], tuple) else out[0]
    chk.event("dispatch", out[3], opts["dmode"] == "async", {2: data, 4: out[1], 5: out[2][0], 6: out[2][1]}, 8)
    chk.hook("dispatch", out[4], opts["dmode"] == "hook")
    if opts["dmode"] == "hook" and callable(out[4]):
        out[4]()


def check_wait_stats(chk: Checker, what: str, stats: torch.Tensor, before: torch.Tensor, num_ranks: int,
                     masked: Optional[List[int]] = None) -> None:
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


def run_round(chk: Checker, ctx, buf, seed: int, key: Any, sources: List[M.Source], regions: List[M.Region],
              n: int, num_experts: int, opts: Dict[str, Any], masks: M.Masks = None) -> None:
    """Dispatch with `opts`, check it; combine, check it."""
    rank, num_ranks = ctx.rank, ctx.world_size
    e_loc = num_experts // num_ranks
    hidden = sources[0].x.shape[1]
    reg, src = regions[rank], sources[rank]
    masked_sources = [s for s in range(num_ranks) if not M.delivers(masks, s, rank)]
    gen = generator(seed, key, "stats", rank)
    cum = cum0 = wait = wait0 = None
    if opts["stats"]:
        cum0 = torch.randint(0, 1000, (e_loc,), generator=gen, dtype=torch.int32)
        cum = cum0.clone().to(ctx.device)
        wait0 = torch.randint(0, 10 ** 6, (num_ranks,), generator=gen, dtype=torch.int64)
        wait = wait0.clone().to(ctx.device)
    out = ll_dispatch(buf, ctx, src, n, num_experts, opts, cum, wait)
    finish_dispatch(chk, out, opts)
    handle = check_dispatch(chk, out, reg, sources, opts, n, hidden, num_experts)
    if opts["stats"]:
        if chk.meta("cumulative_local_expert_recv_stats", cum, torch.int32, (e_loc,)):
            chk.equal("cumulative_local_expert_recv_stats == before + recv_count", cum.cpu(), cum0 + reg.count)
        check_wait_stats(chk, "dispatch_wait_recv_cost_stats", wait, wait0, num_ranks, masked_sources)
    if handle is None:
        handle = out[2]

    # ---- combine --------------------------------------------------------------------------------------
    ckind, cmode = opts["ckind"], opts["cmode"]
    logfmt = ckind == "logfmt"
    ys = expert_outputs(seed, key, regions, n, hidden, logfmt)
    rows_sel = M.selection_rows(sources, regions)
    cidx = drop_some(seed, key, rank, src.topk_idx) if opts["drop"] else src.topk_idx
    x_arg = ys[rank].to(ctx.device)
    if ckind == "zero_copy":
        view = buf.get_next_low_latency_combine_buffer(handle)
        if chk.meta("get_next_low_latency_combine_buffer", view, torch.bfloat16, (e_loc, num_ranks * n, hidden)):
            chk.true("combine buffer: last dim contiguous", view.stride(2) == 1, f"strides {view.stride()}")
            if hidden % 128 == 0:
                lm = hidden + hidden // 64
                chk.true("combine buffer strides (R*N*Lm, Lm, 1) with Lm = H + H/64",
                         view.stride() == (num_ranks * n * lm, lm, 1), f"strides {view.stride()}, Lm={lm}")
            view.copy_(x_arg)
        x_arg = torch.full_like(x_arg, float("nan"))        # zero_copy: x is shape-checked only
    out_t = torch.full((src.x.shape[0], hidden), float("nan"), dtype=torch.bfloat16, device=ctx.device) \
        if ckind == "out" else None
    cwait = cwait0 = None
    if opts["stats"]:
        cwait0 = torch.randint(0, 10 ** 6, (num_ranks,), generator=gen, dtype=torch.int64)
        cwait = cwait0.clone().to(ctx.device)
    cidx_arg, weights_arg = cidx.to(ctx.device), src.topk_weights.to(ctx.device)
    res = buf.low_latency_combine(x_arg, cidx_arg, weights_arg, handle,
                                  use_logfmt=logfmt, zero_copy=ckind == "zero_copy", async_finish=cmode == "async",
                                  return_recv_hook=cmode == "hook", out=out_t, combine_wait_recv_cost_stats=cwait)
    if not chk.true("combine returns a 3-tuple", isinstance(res, tuple) and len(res) == 3, f"got {res!r:.200}"):
        return
    combined, cev, chook = res
    chk.event("combine", cev, cmode == "async", {1: cidx_arg, 2: weights_arg, 3: handle[0], 4: handle[1],
                                                 5: combined}, 6)
    chk.hook("combine", chook, cmode == "hook")
    if cmode == "hook" and callable(chook):
        chook()
    if not chk.meta("combined_x", combined, torch.bfloat16, (src.x.shape[0], hidden)):
        return
    if out_t is not None:
        chk.true("out= is filled in place and returned", combined.data_ptr() == out_t.data_ptr() or combined.numel() == 0,
                 "combined_x is not the out tensor")
    if opts["stats"]:
        check_wait_stats(chk, "combine_wait_recv_cost_stats", cwait, cwait0, num_ranks, masked_sources)
    if logfmt:
        exact, mag, row_mag = M.combine_exact(rank, cidx, src.topk_weights, rows_sel[rank], ys, e_loc, masks)
        # channels where no summed row was encoded add up exactly as without LogFMT; encoded ones change
        plain = M.combine(rank, cidx, src.topk_weights, rows_sel[rank], ys, e_loc, masks)
        touched = torch.zeros(plain.shape, dtype=torch.bool)
        for _, valid, vals in M._combine_terms(rank, cidx, rows_sel[rank], ys, e_loc, masks):
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
            dup = torch.tensor([len(set(v for v in r.tolist() if v >= 0)) < int((r >= 0).sum()) for r in cidx],
                               dtype=torch.bool)
            worst = int(torch.argmax(err - bound))
            chk.fail("LogFMT combine within tolerance", f"{int((err > bound).sum())} elements out of bound; worst "
                     f"flat index {worst}: got {got.flatten()[worst].item()}, exact {exact.flatten()[worst].item()}, "
                     f"bound {bound.flatten()[worst].item()} [{int(bad.sum())} wrong tokens, {int((bad & dup).sum())} "
                     f"of them select one expert in several slots]")
    else:
        expected = M.combine(rank, cidx, src.topk_weights, rows_sel[rank], ys, e_loc, masks)
        chk.equal("combined_x (bitwise, fp32 sum over ascending k of w*row)" + dup_note(cidx, combined.cpu(), expected),
                  combined, expected)


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


def case_key(case: Dict[str, Any], i: int) -> tuple:
    return (case["name"], i)


def run_case(chk: Checker, ctx, seed: int, case: Dict[str, Any]) -> None:
    num_ranks = ctx.world_size
    num_experts = num_ranks * case["experts_per_rank"]
    n, hidden = case["N"], case["hidden"]
    buf = make_buffer(ctx, n, hidden, num_experts)
    sources = make_sources(seed, case, num_ranks)
    regions = [M.dispatch_region(sources, g, num_experts) for g in range(num_ranks)]
    for i in case["rounds"]:
        opts = round_options(i)
        opts.update(case.get("force", {}))
        chk.at(f"case={case['name']} round={i} opts={opts}")
        run_round(chk, ctx, buf, seed, case_key(case, i), sources, regions, n, num_experts, opts)


# ---------------------------------------------------------------------------------------------------
# scenarios: micro-batch overlap, misuse, normal/LL switching, shrink masks
# ---------------------------------------------------------------------------------------------------

def _expect_runtime_error(chk: Checker, what: str, fn) -> None:
    try:
        fn()
    except RuntimeError:
        return
    except Exception as exc:  # noqa: BLE001
        chk.fail(what, f"expected RuntimeError, got {type(exc).__name__}: {exc}")
        return
    chk.fail(what, "expected RuntimeError, nothing was raised")


def run_pipeline(chk: Checker, ctx, seed: int, misuse: bool) -> None:
    """Two micro-batches A and B with both dispatches and both combines in flight (hooks), as in DeepEP's
    two-micro-batch overlap: dA dB hA cA(zero-copy) hB cB(out=) then the combine hooks. Shared stats tensors
    accumulate over both batches. Without `misuse`, dispatch B (the call and its hook) and combine A's hook run
    on other threads (vLLM's dual-batch overlap; on a rank of another GPU than the first, a thread that has not
    set its device). With `misuse`: a third LL call while the call two before still has an un-run hook, and
    hooks called twice, must raise RuntimeError and leave the buffer usable."""
    num_ranks, rank = ctx.world_size, ctx.rank
    e_loc, n, hidden, topk = 3, 8, 256, 4
    num_experts = e_loc * num_ranks
    buf = make_buffer(ctx, n, hidden, num_experts)
    case_a = dict(name=f"pipe-A-{misuse}", tokens=[n] * num_ranks, hidden=hidden, topk=topk, experts_per_rank=e_loc,
                  mask_frac=0.1)
    case_b = dict(name=f"pipe-B-{misuse}", tokens=[(3 + s) % (n + 1) for s in range(num_ranks)], hidden=hidden,
                  topk=topk, experts_per_rank=e_loc, routing="dup")
    srcs = {k: make_sources(seed, c, num_ranks) for k, c in (("A", case_a), ("B", case_b))}
    regs = {k: [M.dispatch_region(srcs[k], g, num_experts) for g in range(num_ranks)] for k in srcs}
    opts = {"A": dict(fp8=True, round_scale=False, ue8m0=False, dmode="hook"),
            "B": dict(fp8=False, round_scale=False, ue8m0=False, dmode="hook")}
    cum = torch.zeros(e_loc, dtype=torch.int32, device=ctx.device)
    wait = torch.zeros(num_ranks, dtype=torch.int64, device=ctx.device)
    call_elsewhere = (lambda fn: fn()) if misuse else run_on_another_thread
    chk.at(f"pipeline misuse={misuse}")
    out = {"A": ll_dispatch(buf, ctx, srcs["A"][rank], n, num_experts, opts["A"], cum, wait),
           "B": call_elsewhere(lambda: ll_dispatch(buf, ctx, srcs["B"][rank], n, num_experts, opts["B"], cum, wait))}
    for k in ("A", "B"):
        chk.hook(f"dispatch {k}", out[k][4], True)
        chk.event(f"dispatch {k}", out[k][3], False)
    if misuse:
        _expect_runtime_error(chk, "third LL call (dispatch) while the call two before has an un-run hook",
                              lambda: ll_dispatch(buf, ctx, srcs["A"][rank], n, num_experts,
                                                  dict(opts["B"], dmode="sync")))
        _expect_runtime_error(chk, "third LL call (combine) while the call two before has an un-run hook",
                              lambda: buf.low_latency_combine(torch.zeros(e_loc, num_ranks * n, hidden,
                                                                          dtype=torch.bfloat16, device=ctx.device),
                                                              srcs["A"][rank].topk_idx.to(ctx.device),
                                                              srcs["A"][rank].topk_weights.to(ctx.device), out["A"][2]))
    wait_before = wait.cpu().clone()
    out["A"][4]()
    if misuse:
        _expect_runtime_error(chk, "dispatch hook called twice", out["A"][4])
    # cA: the call two before it is dA, whose hook ran
    ys = {k: expert_outputs(seed, ("pipe", misuse, k), regs[k], n, hidden, False) for k in srcs}
    rows = {k: M.selection_rows(srcs[k], regs[k]) for k in srcs}
    view = buf.get_next_low_latency_combine_buffer(out["A"][2])
    view.copy_(ys["A"][rank].to(ctx.device))
    ca = buf.low_latency_combine(torch.full_like(ys["A"][rank], float("nan")).to(ctx.device),
                                 srcs["A"][rank].topk_idx.to(ctx.device), srcs["A"][rank].topk_weights.to(ctx.device),
                                 out["A"][2], zero_copy=True, return_recv_hook=True)
    if misuse:
        # cB now would be the third call after dB, whose hook has not run
        _expect_runtime_error(chk, "third LL call (combine) while dispatch B's hook is pending",
                              lambda: buf.low_latency_combine(ys["B"][rank].to(ctx.device),
                                                              srcs["B"][rank].topk_idx.to(ctx.device),
                                                              srcs["B"][rank].topk_weights.to(ctx.device), out["B"][2]))
    call_elsewhere(out["B"][4])
    check_dispatch(chk, out["A"], regs["A"][rank], srcs["A"], opts["A"], n, hidden, num_experts)
    check_dispatch(chk, out["B"], regs["B"][rank], srcs["B"], opts["B"], n, hidden, num_experts)
    chk.equal("cumulative stats over two in-flight dispatches", cum.cpu(),
              regs["A"][rank].count + regs["B"][rank].count)
    check_wait_stats(chk, "dispatch_wait_recv_cost_stats (two dispatches)", wait, wait_before, num_ranks)
    tb = srcs["B"][rank].x.shape[0]
    out_b = torch.full((tb, hidden), float("nan"), dtype=torch.bfloat16, device=ctx.device)
    cb = buf.low_latency_combine(ys["B"][rank].to(ctx.device), srcs["B"][rank].topk_idx.to(ctx.device),
                                 srcs["B"][rank].topk_weights.to(ctx.device), out["B"][2], out=out_b,
                                 return_recv_hook=True)
    if misuse:
        # a third call while cA's hook is pending
        _expect_runtime_error(chk, "third LL call (dispatch) while combine A's hook is pending",
                              lambda: ll_dispatch(buf, ctx, srcs["A"][rank], n, num_experts,
                                                  dict(opts["B"], dmode="sync")))
    call_elsewhere(ca[2])
    cb[2]()
    if misuse:
        _expect_runtime_error(chk, "combine hook called twice", cb[2])
    for k, res in (("A", ca), ("B", cb)):
        expected = M.combine(rank, srcs[k][rank].topk_idx, srcs[k][rank].topk_weights, rows[k][rank], ys[k],
                             e_loc)
        chk.equal(f"in-flight combine {k}" + dup_note(srcs[k][rank].topk_idx, res[0].cpu(), expected), res[0], expected)
    chk.true("combine B returned out=", cb[0].data_ptr() == out_b.data_ptr() or out_b.numel() == 0)
    # returned dispatch tensors are fresh: still intact after both combines reused the buffer halves
    check_dispatch(chk.at(f"pipeline misuse={misuse} dispatch A after the combines"), out["A"], regs["A"][rank],
                   srcs["A"], opts["A"], n, hidden, num_experts)
    # the buffer is still usable: one more synchronous round
    run_round(chk.at(f"pipeline misuse={misuse} after"), ctx, buf, seed, ("pipe-after", misuse), srcs["A"], regs["A"],
              n, num_experts, dict(fp8=False, round_scale=False, ue8m0=False, dmode="sync", ckind="plain",
                                   cmode="sync", stats=True, drop=False))


def run_switch(chk: Checker, ctx, seed: int) -> None:
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
        case = dict(name=f"switch-normal-{tag}", tokens=[5 + 3 * s for s in range(num_ranks)], hidden=shape["hidden"],
                    topk=2, experts_per_rank=shape["experts_per_rank"], mask_frac=0.2)
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
        case = dict(name=f"switch-ll-{tag}", tokens=[shape["N"] - s for s in range(num_ranks)], hidden=shape["hidden"],
                    topk=3, experts_per_rank=shape["experts_per_rank"], mask_frac=0.1)
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


def shrink_rounds(chk: Checker, ctx, buf, seed: int, srcs: List[M.Source], n: int, num_experts: int, label: str):
    """rounds(tag, masks, ids): dispatch + combine rounds with wait statistics, checked against the model under
    `masks`."""
    def rounds(tag: str, mask_state: M.Masks, ids: List[int]) -> None:
        regs = [M.dispatch_region(srcs, g, num_experts, mask_state) for g in range(ctx.world_size)]
        for i in ids:
            opts = round_options(i)
            opts["stats"] = True
            chk.at(f"{label} {tag} opts={opts}")
            run_round(chk, ctx, buf, seed, (label, tag, i), srcs, regs, n, num_experts, opts, mask_state)
    return rounds


def run_shrink(chk: Checker, ctx, seed: int, masked: List[int]) -> None:
    """enable_shrink: unmasked ranks mask `masked`; a masked rank masks every rank (it is cut off). Then
    the mask is cleared and full results come back."""
    num_ranks, rank = ctx.world_size, ctx.rank
    e_loc, n, hidden = 2, 8, 256
    num_experts = e_loc * num_ranks
    buf = make_buffer(ctx, n, hidden, num_experts, enable_shrink=True)
    case = dict(name=f"shrink-{masked}", tokens=[n - s for s in range(num_ranks)], hidden=hidden, topk=3,
                experts_per_rank=e_loc, mask_frac=0.1)
    srcs = make_sources(seed, case, num_ranks)
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


def run_shrink_masks_change(chk: Checker, ctx, seed: int) -> None:
    """Masks that change over time: the others mask the last rank and clean without it (it sits that out),
    then everyone clears the masks and cleans together, then the others mask rank 1 (which masks everyone)
    and go on without it while it makes no call, then everyone clears the masks and cleans again: the
    exchanges stay matched after a rank sat out a clean, and a rank that sat out calls rejoins."""
    num_ranks, rank = ctx.world_size, ctx.rank
    if num_ranks < 3:
        return
    e_loc, n, hidden = 2, 8, 256
    num_experts = e_loc * num_ranks
    buf = make_buffer(ctx, n, hidden, num_experts, enable_shrink=True, explicitly_destroy=True)
    case = dict(name="shrink-masks-change", tokens=[n - s for s in range(num_ranks)], hidden=hidden, topk=3,
                experts_per_rank=e_loc, mask_frac=0.1)
    rounds = shrink_rounds(chk, ctx, buf, seed, make_sources(seed, case, num_ranks), n, num_experts,
                           "shrink, masks change,")

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


def run_shrink_absent(chk: Checker, ctx, seed: int) -> None:
    """enable_shrink with a rank that fails for good: after one full round the last rank stops calling; the
    others mask it and go on (dispatch, combine, clean_low_latency_buffer, destroy) without waiting for it."""
    num_ranks, rank = ctx.world_size, ctx.rank
    absent = num_ranks - 1
    e_loc, n, hidden = 2, 8, 256
    num_experts = e_loc * num_ranks
    buf = make_buffer(ctx, n, hidden, num_experts, enable_shrink=True, explicitly_destroy=True)
    case = dict(name="shrink-absent", tokens=[n - s for s in range(num_ranks)], hidden=hidden, topk=3,
                experts_per_rank=e_loc, mask_frac=0.1)
    srcs = make_sources(seed, case, num_ranks)

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


def _shrink_automatic(ctx, seed: int, timeout_s: float, caught: List[warnings.WarningMessage]) -> List[str]:
    chk = Checker(seed, ctx.rank)
    num_ranks, rank = ctx.world_size, ctx.rank
    e_loc, n, hidden = 2, 8, 256
    num_experts = e_loc * num_ranks
    buf = make_buffer(ctx, n, hidden, num_experts, enable_shrink=True, explicitly_destroy=True, timeout_s=timeout_s)
    case = dict(name="shrink-automatic", tokens=[n - s for s in range(num_ranks)], hidden=hidden, topk=3,
                experts_per_rank=e_loc, mask_frac=0.1)
    srcs = make_sources(seed, case, num_ranks)

    def masks_of(gone: List[int]) -> M.Masks:
        return [[int(g in gone) for g in range(num_ranks)] for _ in range(num_ranks)]

    def query(gone: List[int], what: str) -> None:
        status = torch.full((num_ranks,), -7, dtype=torch.int32, device=ctx.device)
        buf.low_latency_query_mask_buffer(status)
        chk.equal(f"mask after {what}", status.cpu(), torch.tensor([int(g in gone) for g in range(num_ranks)],
                                                                   dtype=torch.int32))

    def dispatch(tag: str, i: int, masks: M.Masks):
        regions = [M.dispatch_region(srcs, g, num_experts, masks) for g in range(num_ranks)]
        opts = round_options(i)
        chk.at(f"automatic shrink, {tag}, dispatch opts={opts}")
        out = ll_dispatch(buf, ctx, srcs[rank], n, num_experts, opts)
        finish_dispatch(chk, out, opts)
        handle = check_dispatch(chk, out, regions[rank], srcs, opts, n, hidden, num_experts)
        return regions, out[2] if handle is None else handle

    def combine(tag: str, i: int, regions, handle, masks: M.Masks) -> None:
        chk.at(f"automatic shrink, {tag}, combine")
        mode = ("sync", "hook", "async")[i % 3]
        ys = expert_outputs(seed, ("automatic", tag), regions, n, hidden, False)
        src = srcs[rank]
        combined, event, hook = buf.low_latency_combine(ys[rank].to(ctx.device), src.topk_idx.to(ctx.device),
                                                        src.topk_weights.to(ctx.device), handle,
                                                        async_finish=mode == "async", return_recv_hook=mode == "hook")
        if hook is not None:
            hook()
        if mode == "async":
            event.current_stream_wait()
        rows = M.selection_rows(srcs, regions)
        chk.equal("combined_x", combined, M.combine(rank, src.topk_idx, src.topk_weights, rows[rank], ys, e_loc, masks))

    # every kind of call made below, first with everyone (its kernels are then compiled on every rank: a rank
    # still compiling when the others' timeout ends would be masked)
    for i in range(6):
        regions, handle = dispatch("everyone", i, None)
        combine("everyone", i, regions, handle, None)
    # a clean while the ranks' masks differ (rank 0 alone masks rank 2): everyone still meets, nobody is masked
    # by a timeout; then rank 0 unmasks it and everyone cleans again
    if rank == 0:
        buf.low_latency_update_mask_buffer(2, mask=True)
    buf.clean_low_latency_buffer(n, hidden, num_experts)
    query([2] if rank == 0 else [], "a clean with different masks")
    if rank == 0:
        buf.low_latency_update_mask_buffer(2, mask=False)
    buf.clean_low_latency_buffer(n, hidden, num_experts)
    regions, handle = dispatch("everyone after the cleans", 0, None)
    combine("everyone after the cleans", 0, regions, handle, None)
    if rank == 1:                                   # gone at its next dispatch
        buf.destroy()
        return chk.errors
    regions, handle = dispatch("without rank 1", 1, masks_of([1]))
    query([1], "the dispatch rank 1 missed")
    if rank == 3:                                   # gone at its next combine
        buf.destroy()
        return chk.errors
    combine("without ranks 1 and 3", 2, regions, handle, masks_of([1, 3]))
    query([1, 3], "the combine rank 3 missed")
    if rank == 4:                                   # gone at its next clean
        buf.destroy()
        return chk.errors
    buf.clean_low_latency_buffer(n, hidden, num_experts)
    query([1, 3, 4], "the clean rank 4 missed")
    gone = [1, 3, 4]
    for i in (3, 4, 5):
        regions, handle = dispatch(f"without {gone}", i, masks_of(gone))
        combine(f"without {gone}", i, regions, handle, masks_of(gone))
    query(gone, "rounds without them")
    buf.destroy()
    said = " | ".join(str(w.message) for w in caught)
    chk.at("automatic shrink, warnings").true("a warning names every rank masked after a timeout",
                                              all(f"masked rank {g}" in said for g in gone), said)
    return chk.errors


# ---------------------------------------------------------------------------------------------------
# the cases of each world size
# ---------------------------------------------------------------------------------------------------
ALL_ROUNDS = list(range(12))


def cases_for(num_ranks: int) -> List[Dict[str, Any]]:
    if num_ranks == 2:
        return [
            dict(name="basic", tokens=[16, 5], N=16, hidden=256, topk=4, experts_per_rank=4, mask_frac=0.1,
                 rounds=ALL_ROUNDS),
            dict(name="tokens-0-1-h384", tokens=[0, 1], N=4, hidden=384, topk=3, experts_per_rank=2,
                 rounds=[0, 1, 2, 3, 7]),
            dict(name="topk32-dup", tokens=[12, 7], N=12, hidden=128, topk=32, experts_per_rank=16, routing="dup",
                 mask_frac=0.2, rounds=[0, 3, 6, 9]),
            dict(name="experts-per-rank-1024", tokens=[4, 3], N=4, hidden=128, topk=8, experts_per_rank=1024,
                 rounds=[0, 5]),
            dict(name="h2880", tokens=[8, 3], N=8, hidden=2880, topk=2, experts_per_rank=2, rounds=[0, 4, 3, 11]),
        ]
    if num_ranks == 3:
        return [
            dict(name="uneven-zero-skewed", tokens=[20, 0, 9], N=20, hidden=512, topk=6, experts_per_rank=3,
                 routing="skewed", mask_frac=0.1, rounds=ALL_ROUNDS),
            dict(name="h384-dup", tokens=[1, 8, 8], N=8, hidden=384, topk=5, experts_per_rank=4, routing="dup",
                 rounds=[1, 2, 3, 10]),
            dict(name="h200-short-group", tokens=[3, 4, 2], N=4, hidden=200, topk=2, experts_per_rank=2,
                 rounds=[0, 1, 3, 8]),
        ]
    if num_ranks > 4:   # more ranks than GPUs are lent: zero-token ranks, skewed routing, top-k above the rank count
        return [
            dict(name=f"{num_ranks}r-uneven-skewed", tokens=[(17 * r) % 24 for r in range(num_ranks)], N=24, hidden=256,
                 topk=num_ranks + 1, experts_per_rank=3, routing="skewed", mask_frac=0.1, rounds=[0, 1, 2, 3, 5, 9]),
            dict(name=f"{num_ranks}r-one-token-dup", tokens=[1] * num_ranks, N=2, hidden=384, topk=2,
                 experts_per_rank=2, routing="dup", rounds=[4, 7]),
        ]
    return [
        dict(name="skewed", tokens=[32, 17, 0, 32], N=32, hidden=256, topk=8, experts_per_rank=4, routing="skewed",
             mask_frac=0.1, rounds=ALL_ROUNDS),
        dict(name="first-half-ranks-2-3-receive-nothing", tokens=[20, 7, 0, 13], N=20, hidden=256, topk=4,
             experts_per_rank=4, routing="first_half", rounds=[0, 3, 6, 9]),
        dict(name="full-N64", tokens=[64, 64, 64, 1], N=64, hidden=128, topk=4, experts_per_rank=8,
             rounds=[1, 6, 8]),
        dict(name="mostly-minus-one", tokens=[9, 12, 1, 5], N=12, hidden=256, topk=9, experts_per_rank=5,
             routing="dup", mask_frac=0.6, rounds=[0, 3, 9]),
    ]


def run_all(ctx, seed: int, names: List[str]) -> List[str]:
    chk = Checker(seed, ctx.rank)
    torch.manual_seed(seed + ctx.rank)
    steps = [(f"case {c['name']}", lambda c=c: run_case(chk, ctx, seed, c)) for c in cases_for(ctx.world_size)]
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
    results = pool(world_size).run(run_all, seed, names)
    errors = [e for per_rank in results for e in per_rank]
    assert not errors, f"seed={seed}: {len(errors)} mismatches\n" + "\n".join(errors[:40])


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
    problems = [p for per_rank in pool(2).run(run_too_many_rows, base_seed()) for p in per_rank]
    assert not problems, problems


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
    problems = [p for per_rank in pool(2).run(run_inference_mode, seed) for p in per_rank]
    assert not problems, f"seed={seed}: {problems}"


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
    problems = [p for per_rank in pool(2).run(run_no_autograd_history, seed) for p in per_rank]
    assert not problems, f"seed={seed}: {problems}"


def test_low_latency_shrink_masks_ranks_that_stop_calling(pool):
    seed = base_seed()
    print(f"seed={seed} (replay: DEEP_EP_TEST_SEED={seed})")
    timeout_s = float(os.environ.get("DEEP_EP_TEST_SHRINK_TIMEOUT_S", "5"))
    results = pool(5).run(run_shrink_automatic, seed, timeout_s)
    errors = [e for per_rank in results for e in per_rank]
    assert not errors, f"seed={seed}: {len(errors)} mismatches\n" + "\n".join(errors[:40])


@pytest.mark.nvlink_kernels
def test_nvlink_masking_is_reported_as_a_warning_at_the_callers_line():
    """The NVLink kernels record a rank they masked in shrink mode in the pinned status words (4 + rank: what
    they waited for); the next low-latency call's check turns each into one warning, attributed to the
    caller's code, and clears it."""
    import numpy as np
    from types import SimpleNamespace
    from deep_ep.transport.nvlink import NVLinkTransport
    words = np.array([0, 0, 0, 0, 0, 4, 0, 5], dtype=np.int32)
    transport = SimpleNamespace(low_latency=SimpleNamespace(auto_mask=True), _status_words=words,
                                topology=SimpleNamespace(rank=2), timeout_ns=3 * 10 ** 9, _check_status=lambda: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        NVLinkTransport.check_low_latency_errors(transport)
    assert [str(w.message) for w in caught] == [
        "deep_ep: rank 2 masked rank 1 after waiting more than 3 s for its low-latency dispatch rows (enable_shrink)",
        "deep_ep: rank 2 masked rank 3 after waiting more than 3 s for its low-latency combine rows (enable_shrink)"]
    assert all(w.filename == __file__ for w in caught), [w.filename for w in caught]
    assert not words.any()


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
    ((9, 0), "0", False), ((10, 0), "1", True), ((8, 0), "1", False)])
def test_nvlink_low_latency_chains_launches_where_asked_and_supported(monkeypatch, capability, asked, chained):
    """Programmatic dependent launches (griddepcontrol: sm_90 and later) by default only on sm_90, where they
    are tested; DEEP_EP_LL_PDL=1 asks for them on later GPUs, 0 turns them off."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    from deep_ep.transport.nvlink import low_latency
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(low_latency, "PDL", None if asked is None else asked == "1")   # ($DEEP_EP_LL_PDL)
    assert low_latency._chain_launches(torch.device("cuda", 0)) == chained


def test_low_latency_in_deterministic_mode(pool):
    """The 2-rank cases and the pipeline with torch's deterministic algorithms on and new tensors filled with
    NaN / the largest integer (the transport may rely on no value of memory it did not write)."""
    from dist_utils import run_deterministic
    seed = base_seed()
    names = [f"case {c['name']}" for c in cases_for(2)] + ["pipeline"]
    results = pool(2).run(run_deterministic, run_all, seed, names)
    errors = [e for per_rank in results for e in per_rank]
    assert not errors, f"seed={seed}: {len(errors)} mismatches\n" + "\n".join(errors[:40])


def test_low_latency_under_a_default_device_and_dtype(pool):
    """The 2-rank cases and the pipeline with every Buffer call (and receive hook) made under a default device
    (meta) and dtype (bfloat16) that the library must not use (dist_utils.run_under_defaults)."""
    from dist_utils import run_under_defaults
    seed = base_seed()
    names = [f"case {c['name']}" for c in cases_for(2)] + ["pipeline", "shrink"]
    results = pool(2).run(run_under_defaults, run_all, seed, names)
    errors = [e for per_rank in results for e in per_rank]
    assert not errors, f"seed={seed}: {len(errors)} mismatches\n" + "\n".join(errors[:40])


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
