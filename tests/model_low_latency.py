"""Independent single-process model of the low-latency (LL) mode: `low_latency_dispatch` and
`low_latency_combine` (DeepEP V1 contract, sections 9 and 17, plus the choices of docs/DESIGN.md).

The model sees the inputs of ALL ranks and computes what every rank must receive. It deliberately does
not use `deep_ep` (in particular not `deep_ep.fp8`): the FP8 e4m3 cast, the power-of-two scale rounding
and the UE8M0 packing are re-derived here from the bit-level rules of the contract (section 9.3) with
integer arithmetic, so that a bug shared by the library and its helper cannot hide.

Conventions (R ranks, E experts, E_loc = E // R, N = num_max_dispatch_tokens_per_rank):
- Expert `e` lives on rank `e // E_loc` at local index `e % E_loc`.
- The rows of local expert `e` on rank `g` are the selections `(s, t, k)` with `idx_s[t, k] == g*E_loc + e`,
  ordered by (source rank s, source token t, top-k slot k) (DESIGN.md: deterministic order). A duplicated
  expert in one row of `topk_idx` is delivered twice, once per slot.
- `layout_range[e, s] = (begin << 32) | count`, begin = rows of sources `< s` (only meaningful when count > 0).
- Combine on rank s: `out[t] = bf16(acc)` with `acc = 0 (fp32); for k ascending, valid: acc = fp32(acc +
  fp32(w[t, k] * f32(y_o[e % E_loc, j])))`, where (o, j) is the owner rank and row of selection (s, t, k).
  The product and the sum are rounded separately (no fused multiply-add).

Shrink masks (section 9.9): `masks[r]` is rank r's own mask vector (1 = masked) or None (all zero).
- a sender s does not send to an owner o with `masks[s][o] == 1`;
- a receiver g drops every row of a source s with `masks[g][s] == 1` (count 0);
- hence rank g receives (s, t, k) iff neither masks the other;
- combine on rank s skips every slot whose owner o has `masks[s][o] == 1` (contributes nothing);
- wait-cost statistics are only added to the entries of unmasked source ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

FP8_MAX = 448.0
GROUP = 128


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------------------------
# bit-level FP8 e4m3 (round to nearest even, saturate to +-448), power-of-two scales, UE8M0 packing
# ---------------------------------------------------------------------------------------------------

def f32_bits(t: torch.Tensor) -> torch.Tensor:
    """int64 bit pattern (0 .. 2^32-1) of float32 values."""
    return t.to(torch.float32).contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def e4m3_encode(f: torch.Tensor) -> torch.Tensor:
    """float32 -> e4m3fn byte codes (uint8), round-to-nearest-even, saturating finite values to +-448.

    Works on the float's bits: |f| = M * 2^(ex - 150) (M with the implicit bit); the e4m3 quantum is
    2^(max(E, -6) - 3) with E the unbiased exponent (subnormal e4m3 below 2^-6 have the quantum 2^-9).
    The significand is shifted right to that quantum with round-half-even on the dropped bits; the rounded
    magnitude q * quantum maps onto the code `(exponent + 7) << 3 | mantissa` seamlessly (code = q for
    subnormals, and a carry into the next binade just increments the code). Inputs must be finite.
    """
    bits = f32_bits(f)
    sign = (bits >> 31) & 1
    mag = bits & 0x7FFFFFFF
    ex = mag >> 23
    man = mag & 0x7FFFFF
    significand = torch.where(ex > 0, man | (1 << 23), man)
    ex_eff = torch.where(ex > 0, ex, torch.ones_like(ex))          # fp32 subnormals: exponent of 2^-126
    unbiased = ex_eff - 127
    quantum_exp = torch.clamp(unbiased, min=-6) - 3                 # log2 of the e4m3 quantum at |f|
    shift = (quantum_exp - (ex_eff - 150)).clamp(min=0, max=40)     # >= 20 for normal e4m3 range; 40 = "all dropped"
    q = significand >> shift
    rem = significand - (q << shift)
    half = (torch.ones_like(shift) << shift) >> 1
    round_up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    q = q + round_up.to(torch.int64)
    # q * 2^quantum_exp is the rounded magnitude. Express it as a code.
    # subnormal band (quantum_exp == -9): code = q (q == 8 is 2^-6, the first normal: code 8, also right).
    # normal band: q in [8, 16]; code = (unbiased + 7) << 3 | (q - 8), q == 16 gives the next exponent, mant 0,
    # which is again (unbiased + 7) << 3 + q - 8.
    code = torch.where(quantum_exp <= -9, q, ((unbiased + 7) << 3) + (q - 8))
    code = torch.where(mag == 0, torch.zeros_like(code), code)
    code = torch.clamp(code, max=0x7E)                              # 0x7E = 448; 0x7F would be NaN: saturate
    return (code | (sign << 7)).to(torch.uint8)


def e4m3_decode(code: torch.Tensor) -> torch.Tensor:
    """e4m3fn byte codes -> float32 (finite codes only; 0x7F/0xFF are NaN)."""
    c = code.to(torch.int64)
    sign = torch.where((c >> 7) & 1 == 1, -1.0, 1.0).to(torch.float64)
    e = (c >> 3) & 0xF
    m = c & 7
    val = torch.where(e == 0, m.to(torch.float64) * 2.0 ** -9,
                      (8 + m).to(torch.float64) * torch.pow(2.0, (e - 10).to(torch.float64)))
    val = torch.where((c & 0x7F) == 0x7F, torch.full_like(val, float("nan")), val)
    return (sign * val).to(torch.float32)


def ceil_log2_bits(p: torch.Tensor) -> torch.Tensor:
    """Exact ceil(log2(p)) of positive normal float32 values from the bits: the unbiased exponent, plus one
    unless the mantissa field is zero (an exact power of two)."""
    bits = f32_bits(p)
    ex = (bits >> 23) & 0xFF
    man = bits & 0x7FFFFF
    assert bool((ex > 0).all() and (ex < 255).all()), "ceil_log2_bits expects positive normal floats"
    return torch.where(man == 0, ex - 127, ex - 126)


def pow2_f32(e: torch.Tensor) -> torch.Tensor:
    """2^e as float32, built from the bits (normal range only)."""
    assert bool(((e > -127) & (e < 128)).all())
    return ((e + 127) << 23).to(torch.int32).view(torch.float32)


@dataclass
class Fp8Rows:
    data: torch.Tensor          # uint8 [M, H] e4m3 codes
    scale_inv: torch.Tensor     # float32 [M, G] dequantisation factors
    exponent: Optional[torch.Tensor]   # int64 [M, G] e with scale_inv = 2^e (round_scale only)

    def ue8m0_bytes(self) -> torch.Tensor:
        """uint8 [M, G]: the biased exponent byte e + 127 of every group."""
        assert self.exponent is not None
        return (self.exponent + 127).to(torch.uint8)

    def ue8m0_words(self) -> torch.Tensor:
        """int32 [M, ceil(G/4)]: byte b (little-endian) of word j = exponent byte of group 4j + b; groups past
        the end count as 0 here (the contract leaves those padding bytes open: compare ue8m0_bytes)."""
        b = self.ue8m0_bytes().to(torch.int64)
        m, g = b.shape
        words = ceil_div(g, 4)
        padded = torch.zeros(m, words * 4, dtype=torch.int64)
        padded[:, :g] = b
        padded = padded.view(m, words, 4)
        w = padded[..., 0] | (padded[..., 1] << 8) | (padded[..., 2] << 16) | (padded[..., 3] << 24)
        w = torch.where(w >= 2 ** 31, w - 2 ** 32, w)
        return w.to(torch.int32)


def quantize_fp8(x: torch.Tensor, round_scale: bool) -> Fp8Rows:
    """Per-token, per-128-channel e4m3 cast of bf16 rows `x` [M, H] (last group shorter when H % 128 != 0).

    amax = max(1e-4, max |v|) with v = f32(x); round_scale=False: scale_inv = fp32(amax * fp32(1/448)),
    q = e4m3(fp32(v * fp32(448 / amax))); round_scale=True: e = ceil(log2(fp32(amax * fp32(1/448)))) exactly,
    scale_inv = 2^e, q = e4m3(v * 2^-e) (exact scaling).
    """
    m, h = x.shape
    g = ceil_div(h, GROUP)
    v = x.to(torch.float32)
    padded = torch.zeros(m, g * GROUP, dtype=torch.float32)
    padded[:, :h] = v
    groups = padded.view(m, g, GROUP)
    amax = torch.maximum(groups.abs().amax(dim=-1), torch.tensor(1e-4, dtype=torch.float32))   # [M, G] fp32
    inv_448 = torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)
    if round_scale:
        e = ceil_log2_bits(amax * inv_448) if m else torch.zeros(m, g, dtype=torch.int64)
        scale_inv = pow2_f32(e) if m else torch.zeros(m, g, dtype=torch.float32)
        factor = pow2_f32(-e) if m else torch.zeros(m, g, dtype=torch.float32)
        exponent = e
    else:
        scale_inv = amax * inv_448
        factor = torch.tensor(FP8_MAX, dtype=torch.float32) / amax
        exponent = None
    scaled = (groups * factor.unsqueeze(-1)).view(m, g * GROUP)[:, :h]
    return Fp8Rows(e4m3_encode(scaled).view(m, h), scale_inv, exponent)


def dequantize_fp8(rows: Fp8Rows) -> torch.Tensor:
    m, h = rows.data.shape
    g = rows.scale_inv.shape[1]
    vals = e4m3_decode(rows.data)
    padded = torch.zeros(m, g * GROUP, dtype=torch.float32)
    padded[:, :h] = vals
    return (padded.view(m, g, GROUP) * rows.scale_inv.unsqueeze(-1)).view(m, -1)[:, :h]


# ---------------------------------------------------------------------------------------------------
# inputs and masks
# ---------------------------------------------------------------------------------------------------

@dataclass
class Source:
    x: torch.Tensor              # bf16 [T_s, H]
    topk_idx: torch.Tensor       # int64 [T_s, K], -1 = no selection
    topk_weights: torch.Tensor   # float32 [T_s, K]


Masks = Optional[Sequence[Optional[Sequence[int]]]]


def is_masked(masks: Masks, viewer: int, target: int) -> bool:
    if masks is None or masks[viewer] is None:
        return False
    return bool(masks[viewer][target])


def delivers(masks: Masks, s: int, g: int) -> bool:
    """Rank g receives rows of source s (and returns combine rows to it) iff neither masks the other."""
    return not is_masked(masks, s, g) and not is_masked(masks, g, s)


# ---------------------------------------------------------------------------------------------------
# LL dispatch
# ---------------------------------------------------------------------------------------------------

@dataclass
class Region:
    """What rank `rank` receives: every valid row of every local expert, in region order
    (local expert ascending, row ascending)."""
    rank: int
    num_ranks: int
    experts_per_rank: int
    count: torch.Tensor          # int32 [E_loc]
    block_count: torch.Tensor    # int64 [E_loc, R] rows per (local expert, source)
    block_begin: torch.Tensor    # int64 [E_loc, R] first row of each block
    expert: torch.Tensor         # int64 [M] local expert of each valid row
    row: torch.Tensor            # int64 [M] row index j inside the expert's region
    src_rank: torch.Tensor       # int64 [M]
    src_token: torch.Tensor      # int64 [M]
    src_slot: torch.Tensor       # int64 [M]

    @property
    def layout_range(self) -> torch.Tensor:
        """int64 [E_loc, R]: (begin << 32) | count (begin is only meaningful where count > 0)."""
        return (self.block_begin << 32) | self.block_count

    @property
    def src_info(self) -> torch.Tensor:
        """int32 [M]: source token of every valid row (region order)."""
        return self.src_token.to(torch.int32)

    def payload_bf16(self, sources: Sequence[Source]) -> torch.Tensor:
        """bf16 [M, H]: the rows, bit copies of the source tokens."""
        hidden = sources[0].x.shape[1]
        out = torch.empty(self.row.numel(), hidden, dtype=torch.bfloat16)
        for s, src in enumerate(sources):
            sel = (self.src_rank == s).nonzero(as_tuple=True)[0]
            if sel.numel():
                out[sel] = src.x[self.src_token[sel]]
        return out

    def payload_fp8(self, sources: Sequence[Source], round_scale: bool) -> Fp8Rows:
        """The FP8 rows (quantised per source token; the cast only depends on the token)."""
        hidden = sources[0].x.shape[1]
        g = ceil_div(hidden, GROUP)
        m = self.row.numel()
        data = torch.empty(m, hidden, dtype=torch.uint8)
        scale_inv = torch.empty(m, g, dtype=torch.float32)
        exponent = torch.empty(m, g, dtype=torch.int64) if round_scale else None
        for s, src in enumerate(sources):
            sel = (self.src_rank == s).nonzero(as_tuple=True)[0]
            if not sel.numel():
                continue
            q = quantize_fp8(src.x, round_scale)
            tok = self.src_token[sel]
            data[sel] = q.data[tok]
            scale_inv[sel] = q.scale_inv[tok]
            if round_scale:
                exponent[sel] = q.exponent[tok]
        return Fp8Rows(data, scale_inv, exponent)


def dispatch_region(sources: Sequence[Source], g: int, num_experts: int, masks: Masks = None) -> Region:
    """LL dispatch as seen by rank g (section 17 + DESIGN.md row order + section 9.9 masks)."""
    num_ranks = len(sources)
    e_loc = num_experts // num_ranks
    lo, hi = g * e_loc, (g + 1) * e_loc
    keys, toks, slots, srcs = [], [], [], []
    for s, src in enumerate(sources):
        if not delivers(masks, s, g):
            continue
        idx = src.topk_idx
        hit = (idx >= lo) & (idx < hi)
        t, k = hit.nonzero(as_tuple=True)      # row-major: by token, then slot
        keys.append((idx[t, k] - lo) * num_ranks + s)
        toks.append(t)
        slots.append(k)
        srcs.append(torch.full_like(t, s))
    if keys:
        key = torch.cat(keys)
        tok, slot, src_rank = torch.cat(toks), torch.cat(slots), torch.cat(srcs)
    else:
        key = tok = slot = src_rank = torch.zeros(0, dtype=torch.int64)
    order = torch.sort(key, stable=True).indices   # by (local expert, source), then (token, slot)
    key, tok, slot, src_rank = key[order], tok[order], slot[order], src_rank[order]
    expert = key // num_ranks
    block_count = torch.bincount(key, minlength=e_loc * num_ranks).view(e_loc, num_ranks).to(torch.int64)
    count = block_count.sum(1)
    block_begin = torch.cumsum(block_count, dim=1) - block_count
    expert_start = torch.cumsum(count, 0) - count
    row = torch.arange(key.numel(), dtype=torch.int64) - expert_start[expert]
    return Region(g, num_ranks, e_loc, count.to(torch.int32), block_count, block_begin, expert, row, src_rank, tok,
                  slot)


def selection_rows(sources: Sequence[Source], regions: Sequence[Region]) -> List[torch.Tensor]:
    """Per source s: int64 [T_s, K] row index j of selection (s, t, k) in its owner's region, -1 if the
    selection was not delivered (idx -1, or masked)."""
    out = [torch.full_like(src.topk_idx, -1) for src in sources]
    for reg in regions:
        for s in range(len(sources)):
            sel = (reg.src_rank == s).nonzero(as_tuple=True)[0]
            if sel.numel():
                out[s][reg.src_token[sel], reg.src_slot[sel]] = reg.row[sel]
    return out


# ---------------------------------------------------------------------------------------------------
# LL combine
# ---------------------------------------------------------------------------------------------------

def _combine_terms(s: int, combine_idx: torch.Tensor, rows_s: torch.Tensor, expert_outputs: Sequence[torch.Tensor],
                   experts_per_rank: int, masks: Masks):
    """Per slot k: (valid [T], values f32 [T, H]) for rank s's combine."""
    num_tokens, topk = combine_idx.shape
    hidden = expert_outputs[0].shape[-1]
    num_ranks = len(expert_outputs)
    for k in range(topk):
        e = combine_idx[:, k]
        valid = e >= 0
        owner = torch.where(valid, e // experts_per_rank, torch.zeros_like(e))
        for o in range(num_ranks):
            if is_masked(masks, s, o):
                valid &= owner != o
        if bool((valid & (rows_s[:, k] < 0)).any()):
            raise ValueError(f"model: rank {s} combines slot {k} of a token that the dispatch did not deliver")
        vals = torch.zeros(num_tokens, hidden, dtype=torch.float32)
        sel = valid.nonzero(as_tuple=True)[0]
        for o in range(num_ranks):
            mine = sel[owner[sel] == o]
            if mine.numel():
                vals[mine] = expert_outputs[o][e[mine] % experts_per_rank, rows_s[mine, k]].float()
        yield k, valid, vals


def combine(s: int, combine_idx: torch.Tensor, weights: torch.Tensor, rows_s: torch.Tensor,
            expert_outputs: Sequence[torch.Tensor], experts_per_rank: int, masks: Masks = None) -> torch.Tensor:
    """LL combine on rank s: bf16 of the fp32 sum over ascending k of fp32(w * row) (no FMA).

    combine_idx: the routing passed to combine (the dispatch's, some entries possibly set to -1);
    rows_s: selection_rows(...)[s] from the dispatch; expert_outputs[o]: rank o's combine input
    [E_loc, R*N, H] bf16 (only the delivered rows are read).
    """
    num_tokens = combine_idx.shape[0]
    hidden = expert_outputs[0].shape[-1]
    acc = torch.zeros(num_tokens, hidden, dtype=torch.float32)
    for k, valid, vals in _combine_terms(s, combine_idx, rows_s, expert_outputs, experts_per_rank, masks):
        term = weights[:, k:k + 1].to(torch.float32) * vals          # fp32 product, rounded
        acc = torch.where(valid[:, None], acc + term, acc)          # fp32 sum, rounded
    return acc.to(torch.bfloat16)


def combine_exact(s: int, combine_idx: torch.Tensor, weights: torch.Tensor, rows_s: torch.Tensor,
                  expert_outputs: Sequence[torch.Tensor], experts_per_rank: int, masks: Masks = None
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For tolerance checks (LogFMT), float64: (exact sum of w * row, sum of |w * row|, sum over k of
    |w| * max |row| (one value per token, broadcast over the hidden dim))."""
    num_tokens = combine_idx.shape[0]
    hidden = expert_outputs[0].shape[-1]
    exact = torch.zeros(num_tokens, hidden, dtype=torch.float64)
    mag = torch.zeros(num_tokens, hidden, dtype=torch.float64)
    row_mag = torch.zeros(num_tokens, 1, dtype=torch.float64)
    for k, valid, vals in _combine_terms(s, combine_idx, rows_s, expert_outputs, experts_per_rank, masks):
        w = torch.where(valid, weights[:, k].to(torch.float64), torch.zeros(()))[:, None]
        term = w * vals.to(torch.float64)
        exact += term
        mag += term.abs()
        row_mag += w.abs() * vals.to(torch.float64).abs().amax(dim=1, keepdim=True)
    return exact, mag, row_mag.expand(num_tokens, hidden)


# LogFMT-10 tolerance (section 9.5), derived from the format, not from any implementation:
# - A 128-channel group travels either as BF16 (exact) or as sign + 9-bit code on a log2 grid of 511 levels
#   (code 0 = zero) spanning [log_amin, log_amax] with log_amax - log_amin <= 32, so step <= 32/510 octaves.
# - Rounding |v| to the nearer (in linear space) of neighbouring levels L and L*2^step errs by at most
#   L*(2^step - 1)/2, a relative error of at most r_code = (2^step - 1)/(2^step + 1) = 0.02175.
# - Magnitudes below the lowest level 2^log_amin (only when amin < amax*2^-32) snap to 0 or to that level: an
#   absolute error <= 2^log_amin / 2 = amax * 2^-33 <= max|row| * 2^-33.
# - The receiver may round the decoded value to BF16: relative error <= 2^-8 (half an ulp of an 8-bit
#   significand), so per element |decoded - v| <= r_elem*|v| + max|row|*2^-33 with
#   r_elem = (1 + r_code)(1 + 2^-8) - 1 = 0.02574.
# - Weights are exact; the fp32 accumulation of <= 32 terms adds < 32*2^-24 (2e-6) of sum|w v|; the final BF16
#   rounding adds <= 2^-8 of |result| <= 2^-8 * (|exact| + (r_elem + 2e-6) * sum|w v|).
# => |got - exact| <= LOGFMT_REL * sum_k |w_k v_k| + 2^-8 * |exact| + 2^-32 * sum_k |w_k| max|row_k|.
_STEP = 32.0 / 510.0
_R_CODE = (2.0 ** _STEP - 1.0) / (2.0 ** _STEP + 1.0)
_R_ELEM = (1.0 + _R_CODE) * (1.0 + 2.0 ** -8) - 1.0
LOGFMT_REL = (_R_ELEM + 2e-6) * (1.0 + 2.0 ** -8)


def logfmt_bound(exact: torch.Tensor, mag: torch.Tensor, row_mag: torch.Tensor) -> torch.Tensor:
    return LOGFMT_REL * mag + 2.0 ** -8 * exact.abs() + 2.0 ** -32 * row_mag + 1e-38


# ---------------------------------------------------------------------------------------------------
# misc
# ---------------------------------------------------------------------------------------------------

def size_hint(n: int, hidden: int, num_experts: int) -> int:
    """Section 9.1 formula (independent copy)."""
    s = hidden // 128
    dm = 16 + max(2 * hidden, hidden + 4 * s)
    cm = 4 * s + 2 * hidden
    send = max(n * dm, num_experts * n * cm)
    recv = max(num_experts * n * dm, num_experts * n * cm)
    sig = ceil_div(4 * num_experts, 128) * 128
    total = 2 * send + 2 * recv + 2 * sig
    return (total + 128) // 128 * 128
