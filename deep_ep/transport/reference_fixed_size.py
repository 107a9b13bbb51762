"""The reference transport's low-latency calls as fixed-size exchanges: no host wait, so they can be captured
in a CUDA graph (on an NCCL group) and replayed with new inputs.

Protocol (every size follows from the call's shapes and `num_max_dispatch_tokens_per_rank` N, never from the
routing):
  dispatch: every rank all-gathers N rows of [its tokens' data | FP8 scales | top-k ids] (rows past its
    token count carry ids -1). Each rank keeps the (source, token, top-k slot) entries whose expert is one of
    its own, in that order, and places them by expert exactly as the exchange of the counted rows does
    (recv_x, recv_count, src_info, layout_range equal bit for bit); entries past an expert's R * N slots and
    ids out of range are dropped (no host check can run here). It remembers, for each of its slots, the
    (source, token, slot) entry it holds, under the handle's `src_info`.
  combine: each rank sends each source rank a block of N * top-k rows, row (token, slot) holding its expert's
    output for that selection where the expert is its own (other rows are never read, whatever they hold), in
    one all-to-all of equal blocks. The source takes each selection's row from the block of the rank that owns
    its expert and sums them in ascending slot order, as the other path does, so the results are equal bit for
    bit.
A combine runs this way when its handle's dispatch did; shapes are not compared between ranks (that needs the
host), so every rank must make the same calls, as inside a capture anyway.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Tuple

import torch

from ..fp8 import logfmt_roundtrip, pack_ue8m0, per_token_cast_to_fp8
from ..group import Group
from .base import LowLatencyDispatchOutput
from .kept import Keeper
from .reference_rows import (exclusive_cumsum, gather_side_by_side, low_latency_receive_buffers, side_by_side,
                             weighted_sum_in_slot_order)


class _Received(NamedTuple):
    """Where a fixed-size dispatch placed each (source, token, top-k slot) entry: its row of recv_x viewed as
    `[E_loc * R * N, H]` (0 for entries of other ranks' experts, whose rows are never read)."""
    slot_of_entry: torch.Tensor
    num_max_tokens: int
    topk: int


class FixedSizeLowLatency:
    """Low-latency dispatch and combine of the reference transport without host waits."""

    def __init__(self, group: Group, rank: int, num_ranks: int) -> None:
        self.group, self.rank, self.num_ranks = group, rank, num_ranks
        self._received = Keeper()   # a dispatch's _Received, kept with the handle's src_info

    def knows(self, src_info: torch.Tensor) -> bool:
        """Whether `src_info` is the handle of a dispatch made here (its combine then runs here too)."""
        return self._received.get(src_info) is not None

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_tokens: int, num_experts: int,
                 options) -> Tuple[LowLatencyDispatchOutput, Callable[[], None]]:
        R, N, rank = self.num_ranks, num_max_tokens, self.rank
        num_tokens, hidden = x.shape
        experts_per_rank, topk, dev = num_experts // R, topk_idx.shape[1], x.device
        slots = R * N
        parts = list(per_token_cast_to_fp8(x, round_scale=options.round_scale)) if options.use_fp8 else [x]
        # (ids as int32: a row's byte count is a multiple of 4, not always of 8)
        layout = [(part.dtype, part.shape[1]) for part in parts] + [(torch.int32, topk)]
        # rows past this rank's token count: all bytes 0xFF, so ids -1
        rows = torch.full((N, sum(dtype.itemsize * columns for dtype, columns in layout)), 0xFF, dtype=torch.uint8,
                          device=dev)
        rows[:num_tokens] = gather_side_by_side(parts, torch.arange(num_tokens, device=dev),
                                                [topk_idx.to(torch.int32)])
        pending = self.group.start_all_gather(rows, "low_latency_dispatch (fixed-size exchange)")

        # (the spare last row takes the dropped entries)
        placed, recv_x, recv_scales = low_latency_receive_buffers(experts_per_rank, slots, hidden, options, dev,
                                                                  spare_rows=1)
        recv_count = torch.empty(experts_per_rank, dtype=torch.int32, device=dev)
        layout_range = torch.empty((experts_per_rank, R), dtype=torch.int64, device=dev)
        src_info = torch.empty((experts_per_rank, slots), dtype=torch.int32, device=dev)
        output = LowLatencyDispatchOutput(recv_x, recv_scales, recv_count, src_info, layout_range)
        slot_of_entry = torch.empty(R * N * topk, dtype=torch.int64, device=dev)
        self._received.keep(src_info, _Received(slot_of_entry, N, topk))

        def receive() -> None:
            gathered = pending.wait().view(R * N, -1)
            data, *scales, every_ids = side_by_side(gathered, layout)
            local = every_ids.reshape(-1).long() - rank * experts_per_rank
            # one entry per (source, token, top-k slot), in that order; entries of other ranks' experts go last
            expert = torch.where((local >= 0) & (local < experts_per_rank), local, experts_per_rank)
            entry = torch.arange(expert.numel(), device=dev)
            key = expert * R + entry // (N * topk)                                    # (expert, source)
            order = torch.sort(key, stable=True).indices
            sorted_key = key[order]
            first = torch.searchsorted(sorted_key, torch.arange((experts_per_rank + 1) * R + 1, device=dev))
            per_expert_source = torch.diff(first).view(experts_per_rank + 1, R)[:experts_per_rank]
            position = torch.empty_like(expert)
            position[order] = entry - first[(sorted_key // R) * R]                     # within the expert
            kept = (expert < experts_per_rank) & (position < slots)
            slot = torch.where(kept, expert * slots + position, experts_per_rank * slots)
            token_row = entry // topk                                                  # source * N + token
            placed[slot] = data[token_row]
            slot_of_entry.copy_(torch.where(kept, slot, 0))
            source_token = torch.empty(experts_per_rank * slots + 1, dtype=torch.int32, device=dev)
            source_token[slot] = (token_row % N).to(torch.int32)
            src_info.copy_(source_token[:-1].view(experts_per_rank, slots))
            if options.use_fp8:
                raw = scales[0][token_row]
                if options.use_ue8m0:
                    raw = pack_ue8m0(raw)
                scale_rows = torch.empty((experts_per_rank * slots + 1, raw.shape[1]), dtype=raw.dtype, device=dev)
                scale_rows[slot] = raw
                recv_scales.copy_(scale_rows[:-1].view(experts_per_rank, slots, -1))
            counts = per_expert_source.clamp(max=slots)
            begin = exclusive_cumsum(counts, dim=1)
            recv_count.copy_(counts.sum(1).clamp(max=slots).to(torch.int32))
            layout_range.copy_((begin << 32) | counts)
        return output, receive

    def combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, src_info: torch.Tensor,
                use_logfmt: bool, out: torch.Tensor) -> Callable[[], None]:
        R = self.num_ranks
        received = self._received.get(src_info)
        N, topk = received.num_max_tokens, received.topk
        experts_per_rank, slots, hidden = x.shape
        blocks = x.reshape(-1, hidden).index_select(0, received.slot_of_entry)
        if use_logfmt:
            blocks = logfmt_roundtrip(blocks)
        back = torch.empty_like(blocks)
        pending = self.group.all_to_all(back, blocks, None, None, "low_latency_combine (fixed-size exchange)")
        num_tokens = topk_idx.shape[0]

        def receive() -> None:
            values = pending.wait()
            valid = topk_idx >= 0
            owner = (topk_idx // experts_per_rank).clamp(0, R - 1)
            token = torch.arange(num_tokens, device=x.device)[:, None]
            slot = torch.arange(topk, device=x.device)[None, :]
            row = (owner * N + token) * topk + slot
            rows = torch.where(valid[:, :, None], values[row.view(-1)].view(num_tokens, topk, hidden), 0)
            weights = torch.where(valid, topk_weights.float(), 0.0)
            out.copy_(weighted_sum_in_slot_order(rows, weights))
        return receive
