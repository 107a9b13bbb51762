"""Random inputs of the multi-process tests, drawn from CPU generators (tests/randomness.py) so that every rank
draws every rank's inputs alike: routing (top-k ids and weights), token payloads and expert outputs."""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple, Union

import torch

import model

Payload = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]   # BF16 x, or FP8 (data, scales)


def make_routing(gen: torch.Generator, num_tokens: int, num_topk: int, num_experts: int, style: str = "uniform",
                 mask_frac: float = 0.0, hot_expert: int = 0, *, hot_share: float = 0.9,
                 favour_hot_rank: bool = True, dup_last_slot: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """`(topk_idx int64 [T, K], topk_weights float32 [T, K])`.

    styles: "uniform" (K distinct experts per token; K may exceed E, then drawn with repeats), "first_half"
    (only the experts of the first half of the ranks, K <= E / 2: the other ranks receive nothing), "skewed"
    (`hot_share` of the tokens pick `hot_expert` first; with `favour_hot_rank` the rest of the scores favour
    the experts of the hot expert's rank), "dup" (half of the tokens list their first expert twice, in slot
    1; with `dup_last_slot` some also in the last slot). `mask_frac` of the entries become -1, and token 0
    is then sent nowhere. The keyword-only defaults are the normal-mode tests'; LOW_LATENCY_ROUTING holds the
    low-latency tests'.
    """
    if num_topk <= num_experts:
        scores = torch.rand(num_tokens, num_experts, generator=gen)
        if style == "skewed":
            hot_tokens = torch.rand(num_tokens, generator=gen) < hot_share
            scores[hot_tokens, hot_expert] += 10.0
            if favour_hot_rank:
                per_rank = max(1, num_experts // 8)
                start = hot_expert // per_rank * per_rank
                scores[:, start:start + per_rank] += 0.5
        if style == "first_half":
            scores[:, num_experts // 2:] = -1.0
        idx = scores.topk(num_topk, dim=1).indices.to(torch.int64)
    else:
        idx = torch.randint(num_experts, (num_tokens, num_topk), generator=gen, dtype=torch.int64)
    if style == "dup" and num_topk > 1:
        dup = torch.rand(num_tokens, generator=gen) < 0.5
        idx[dup, 1] = idx[dup, 0]
        if dup_last_slot:
            dup_last = torch.rand(num_tokens, generator=gen) < 0.3
            idx[dup_last, num_topk - 1] = idx[dup_last, 0]
    if mask_frac > 0:
        idx[torch.rand(num_tokens, num_topk, generator=gen) < mask_frac] = -1
        if num_tokens > 0:
            idx[0] = -1
    weights = torch.randn(num_tokens, num_topk, generator=gen, dtype=torch.float32)
    return idx.contiguous(), weights.contiguous()


# the low-latency tests' routing: a smaller hot share, no favoured rank, duplicates in the last slot too
LOW_LATENCY_ROUTING: Dict[str, Any] = dict(hot_share=0.85, favour_hot_rank=False, dup_last_slot=True)


def make_x(gen: torch.Generator, num_tokens: int, hidden: int, kind: str) -> Payload:
    """Normal-mode payloads. kinds: bf16; fp8 (float32 scales) / fp8_col (column-major float32 scales) /
    fp8_i32 (int32 scales) / fp8_i32_col / fp8_i32_tma (column-major, the token dimension padded to a multiple
    of 4, as DeepGEMM's TMA-aligned UE8M0 scales). FP8 data are random bytes (every bit pattern, NaNs
    included: dispatch copies bits)."""
    if kind == "bf16":
        return torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16)
    data = torch.randint(0, 256, (num_tokens, hidden), generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn)
    num_scales = model.ceil_div(hidden, 128)
    if kind.startswith("fp8_i32"):
        scales = torch.randint(-2 ** 31, 2 ** 31 - 1, (num_tokens, model.ceil_div(num_scales, 4)), generator=gen,
                               dtype=torch.int32)
    else:
        scales = torch.randn(num_tokens, num_scales, generator=gen, dtype=torch.float32)
    if kind.endswith("_col"):
        scales = scales.T.contiguous().T
    if kind.endswith("_tma"):
        padded = torch.empty(scales.size(1), model.ceil_div(num_tokens, 4) * 4, dtype=scales.dtype)
        padded[:, :num_tokens] = scales.T
        scales = padded.T[:num_tokens]
    return data, scales


def make_octave_spread_x(gen: torch.Generator, num_tokens: int, hidden: int) -> torch.Tensor:
    """Low-latency tokens: bf16 with per-token and per-128-group magnitudes spread over many octaves
    (exercises the FP8 scales); token 1 is all zeros and token 2 tiny (both hit the amax floor 1e-4)."""
    x = torch.randn(num_tokens, hidden, generator=gen)
    x *= torch.pow(2.0, torch.randint(-12, 9, (num_tokens, 1), generator=gen).float())
    groups = model.ceil_div(hidden, 128)
    group_scale = torch.pow(2.0, torch.randint(-4, 5, (num_tokens, groups), generator=gen).float())
    x *= group_scale.repeat_interleave(128, dim=1)[:, :hidden]
    if num_tokens > 1:
        x[1] = 0
    if num_tokens > 2:
        x[2] *= 1e-7 / max(float(x[2].abs().max()), 1e-30)
    return x.to(torch.bfloat16).contiguous()


def wide_random(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Random values spread over 2^-16..2^16, so that fp32 sums of a few of them are inexact and the
    summation order (and any extra rounding) shows in the result bits."""
    scale = torch.pow(2.0, torch.randint(-16, 17, shape, generator=gen).float())
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def to_device(x: Optional[Payload], device: torch.device) -> Optional[Payload]:
    """`x` on `device` with its strides (`.to` would make a padded layout, such as TMA-aligned scales, dense)."""
    if x is None:
        return None
    if isinstance(x, tuple):
        return tuple(to_device(v, device) for v in x)
    if x.is_contiguous():
        return x.to(device)
    # one host-waited copy of the memory the view spans, then the same view of it: a strided copy_ ends in a
    # device copy kernel that the host does not wait for, which calls ordered only after a previous_event
    # recorded earlier would race with
    span = 1 + sum((n - 1) * stride for n, stride in zip(x.shape, x.stride())) if x.numel() else 0
    return torch.as_strided(x, (span,), (1,), x.storage_offset()).to(device, copy=True).as_strided(
        x.shape, x.stride())
