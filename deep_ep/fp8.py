"""FP8 (e4m3) per-128-channel casts, UE8M0 scale packing and the LogFMT-10 combine codec.

All functions are pure torch and bit-exact with the rules of the DeepEP contract, so every transport
(and every test) gets identical bits from them.
"""
from __future__ import annotations

from typing import Tuple

import torch

FP8_MAX = 448.0
GROUP = 128


def num_scale_groups(hidden: int) -> int:
    """Scales per token: one per 128 channels, the last group possibly shorter."""
    return -(-hidden // GROUP)


def _groups(x: torch.Tensor) -> torch.Tensor:
    """float32 view `[T, groups, 128]` of `x`, zero-padded to whole groups (zeros never change an amax)."""
    tokens, hidden = x.shape
    padded = num_scale_groups(hidden) * GROUP
    v = x.float()
    if padded != hidden:
        v = torch.nn.functional.pad(v, (0, padded - hidden))
    return v.view(tokens, padded // GROUP, GROUP)


def per_token_cast_to_fp8(x: torch.Tensor, round_scale: bool = False, use_ue8m0: bool = False
                          ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantise `x` `[T, H]` to e4m3 with one scale per token and 128 channels.

    Returns `(data [T, H] float8_e4m3fn, scales)`: float32 `[T, ceil(H/128)]` (value = dequantisation
    factor), or with `use_ue8m0` (requires `round_scale`) int32 `[T, ceil(H/512)]` packing 4 exponent
    bytes each. A hidden size that is not a multiple of 128 gets a shorter last group.
    """
    if use_ue8m0 and not round_scale:
        raise ValueError("use_ue8m0=True requires round_scale=True")
    v = _groups(x)
    amax = v.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4)
    if round_scale:
        exponent = ceil_log2(amax * torch.tensor(1.0 / FP8_MAX, dtype=torch.float32, device="cpu"))
        scaled = torch.ldexp(v, -exponent.to(torch.float32))
        scale_inv = torch.ldexp(torch.ones_like(amax), exponent.to(torch.float32))
    else:
        scaled = v * (torch.tensor(FP8_MAX, dtype=torch.float32, device="cpu") / amax)
        scale_inv = amax * torch.tensor(1.0 / FP8_MAX, dtype=torch.float32, device="cpu")
    tokens, hidden = x.shape
    data = scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).flatten(1)[:, :hidden].contiguous()
    scales = scale_inv.squeeze(-1)
    if use_ue8m0:
        scales = pack_ue8m0(scales)
    return data, scales


def ceil_log2(value: torch.Tensor) -> torch.Tensor:
    """Exact `ceil(log2(value))` of positive float32 values, as int32, from the float's bits."""
    mantissa, exponent = torch.frexp(value)  # value = mantissa * 2**exponent, mantissa in [0.5, 1)
    return torch.where(mantissa == 0.5, exponent - 1, exponent).to(torch.int32)


def pack_ue8m0(scales: torch.Tensor) -> torch.Tensor:
    """Pack power-of-two float32 scales `[..., G]` into int32 `[..., ceil(G/4)]`: byte b of word j is the
    biased exponent (`e + 127`) of group `4j + b`, little-endian; missing groups are 0."""
    groups = scales.shape[-1]
    words = -(-groups // 4)
    exponent_bytes = ((scales.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    padded = torch.zeros(*scales.shape[:-1], words * 4, dtype=torch.uint8, device=scales.device)
    padded[..., :groups] = exponent_bytes
    return padded.view(torch.int32)


def unpack_ue8m0(packed: torch.Tensor, groups: int) -> torch.Tensor:
    """Inverse of `pack_ue8m0`: float32 `[..., groups]` powers of two."""
    exponent_bytes = packed.contiguous().view(torch.uint8)[..., :groups].to(torch.int32)
    return (exponent_bytes << 23).view(torch.float32)


def per_token_cast_back(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Dequantise `(data [T, H], scales)` (float32 or packed UE8M0 int32) to float32 `[T, H]`."""
    tokens, hidden = data.shape
    groups = num_scale_groups(hidden)
    if scales.dtype == torch.int32:
        scales = unpack_ue8m0(scales, groups)
    values = _groups(data) * scales.float().reshape(tokens, groups, 1)
    return values.flatten(1)[:, :hidden]


# ---- LogFMT-10: sign + 9-bit code on a log2 grid per 128-channel group -----------------------------

_LOGFMT_CODES = 510  # codes 1..511 on the grid; 0 encodes zero


def logfmt_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """Encode and decode BF16 rows `[T, H]` with LogFMT-10, returning what the receiver reconstructs (BF16).

    Per 128-channel group the sender knows `amax`/`amin` of `|x|` (over the group's channels: a short last
    group's padding does not count). A chunk of 1024 channels (512 when
    `H % 1024 != 0`) is encoded only if every group in it has `amax < 1` and `amin < amax`; otherwise it
    travels as BF16 unchanged. Encoded values snap to the nearest (in linear space) of 511 log-spaced
    levels between `max(log2(amin), log2(amax) - 32)` and `log2(amax)`, or to zero.
    """
    tokens, hidden = x.shape
    chunk = 1024 if hidden % 1024 == 0 else 512
    groups = num_scale_groups(hidden)
    groups_per_chunk = chunk // GROUP
    v = _groups(x)
    mag = v.abs()
    amax = mag.amax(-1, keepdim=True)
    # the zero padding of a short last group must not lower its amin (that would widen its grid)
    channel = torch.arange(groups * GROUP, device=x.device).view(1, groups, GROUP)
    amin = torch.where(channel < hidden, mag, torch.full_like(mag, float("inf"))).amin(-1, keepdim=True)
    log_amax = torch.log2(amax)
    log_amin = torch.maximum(torch.log2(amin), log_amax - 32)
    # multiplied by the float32 reciprocal, not divided, as CUDA divides by a Python number: the same bits on
    # CPU, CUDA and in the NVLink kernel
    step = (log_amax - log_amin) * torch.tensor(1.0 / _LOGFMT_CODES, dtype=torch.float32, device="cpu")
    safe_step = torch.where(step > 0, step, torch.ones_like(step))
    position = (torch.log2(mag) - log_amin) / safe_step
    low_code = torch.floor(position).clamp(min=-1, max=_LOGFMT_CODES)

    def level(code: torch.Tensor) -> torch.Tensor:
        return torch.where(code < 0, torch.zeros_like(code), torch.exp2(code * safe_step + log_amin))

    below, above = level(low_code), level((low_code + 1).clamp(max=_LOGFMT_CODES))
    decoded = torch.where((mag - below).abs() <= (above - mag).abs(), below, above)
    decoded = torch.where(mag == 0, torch.zeros_like(decoded), decoded)
    decoded = torch.copysign(decoded, v)
    group_ok = ((log_amax < 0) & (amin < amax)).squeeze(-1)  # [T, groups]
    num_chunks = -(-groups // groups_per_chunk)
    padded_ok = torch.ones(tokens, num_chunks * groups_per_chunk, dtype=torch.bool, device=x.device)
    padded_ok[:, :groups] = group_ok  # groups past the end never veto a chunk
    chunk_ok = padded_ok.view(tokens, num_chunks, groups_per_chunk).all(-1, keepdim=True)
    group_encoded = chunk_ok.expand(-1, -1, groups_per_chunk).flatten(1)[:, :groups]
    out = torch.where(group_encoded.unsqueeze(-1), decoded, v)
    return out.flatten(1)[:, :hidden].to(torch.bfloat16)
