"""The baseline: what a user writes with torch.distributed alone, and the copy engine's peer bandwidth."""
from __future__ import annotations

import statistics
import time
from typing import List, Optional, Tuple

import torch

from .context import RankContext


class Baseline:
    """Permute + `all_to_all_single` dispatch/combine, the plain-PyTorch way."""

    def __init__(self, ctx: RankContext) -> None:
        self.ctx = ctx

    def _exchange_counts(self, send_counts: torch.Tensor) -> Tuple[List[int], List[int], torch.Tensor]:
        """All-to-all of per-destination counts (`send_counts` [R * n], n values per destination)."""
        ctx = self.ctx
        send = send_counts.to(torch.int64)
        recv = torch.empty_like(send)
        ctx.a2a(recv, send, None, None)
        per_rank = torch.cat([send.view(ctx.world, -1).sum(1), recv.view(ctx.world, -1).sum(1)]).tolist()
        return per_rank[:ctx.world], per_rank[ctx.world:], recv

    def dispatch(self, tensors: List[torch.Tensor], is_token_in_rank: torch.Tensor,
                 state: Optional[tuple] = None) -> Tuple[List[torch.Tensor], tuple]:
        """Send each token once to every rank in `is_token_in_rank`; rows arrive by source rank, then token."""
        ctx = self.ctx
        if state is None:
            token = is_token_in_rank.t().nonzero()[:, 1]  # by destination rank, then token
            send_splits, recv_splits, _ = self._exchange_counts(is_token_in_rank.sum(0))
            state = (token, send_splits, recv_splits)
        token, send_splits, recv_splits = state
        outs = []
        for t in tensors:
            rows = t.index_select(0, token) if t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) else \
                t.view(torch.uint8).index_select(0, token).view(t.dtype)
            out = t.new_empty((sum(recv_splits), *t.shape[1:]))
            ctx.a2a(out, rows, recv_splits, send_splits)
            outs.append(out)
        return outs, state

    def dispatch_with_topk(self, x, topk_idx, topk_weights, is_token_in_rank, experts_per_rank: int):
        data = list(x) if isinstance(x, tuple) else [x]
        outs, state = self.dispatch(data + [topk_idx, topk_weights], is_token_in_rank)
        recv_idx, recv_w = outs[-2], outs[-1]
        lo = self.ctx.rank * experts_per_rank
        local = (recv_idx >= lo) & (recv_idx < lo + experts_per_rank)
        recv_idx = torch.where(local, recv_idx - lo, torch.full_like(recv_idx, -1))
        recv_w = torch.where(local, recv_w, torch.zeros_like(recv_w))
        recv_x = tuple(outs[:-2]) if isinstance(x, tuple) else outs[0]
        return recv_x, recv_idx, recv_w, state

    def combine(self, y: torch.Tensor, state: tuple, num_tokens: int) -> torch.Tensor:
        token, send_splits, recv_splits = state
        back = y.new_empty((len(token), y.shape[1]))
        self.ctx.a2a(back, y, send_splits, recv_splits)
        out = torch.zeros((num_tokens, y.shape[1]), dtype=torch.float32, device=y.device)
        out.index_add_(0, token, back.float())
        return out.to(torch.bfloat16)

    # ---- low-latency: one row per (token, top-k selection), packed per local expert ------------------
    def ll_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, num_max_tokens: int,
                    use_fp8: bool):
        from ..fp8 import per_token_cast_to_fp8
        ctx = self.ctx
        experts_per_rank = num_experts // ctx.world
        flat = topk_idx.view(-1)
        valid = (flat >= 0).nonzero().squeeze(1)
        experts = flat[valid]
        order = torch.argsort(experts, stable=True)  # by expert (so by destination rank), then token
        selection = valid[order]
        token = selection // topk_idx.shape[1]
        per_expert_sent = torch.bincount(experts, minlength=num_experts)
        send_splits, recv_splits, recv_per_expert = self._exchange_counts(per_expert_sent)
        payloads = list(per_token_cast_to_fp8(x)) if use_fp8 else [x]
        received = []
        for t in payloads:
            rows = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
            out = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
            ctx.a2a(out, rows.index_select(0, token), recv_splits, send_splits)
            received.append(out)
        # received rows: by source rank, then local expert, then token -> pack per local expert
        counts = recv_per_expert.view(ctx.world, experts_per_rank)
        row_expert = torch.repeat_interleave(torch.arange(experts_per_rank, device=x.device).repeat(ctx.world),
                                             counts.flatten())
        order2 = torch.argsort(row_expert, stable=True)
        per_expert = counts.sum(0)
        expert_sorted = row_expert[order2]
        slot = torch.arange(len(order2), device=x.device) - (torch.cumsum(per_expert, 0) - per_expert)[expert_sorted]
        packed = []
        for rows, t in zip(received, payloads):
            dest = rows.new_empty((experts_per_rank, ctx.world * num_max_tokens, *rows.shape[1:]))
            dest[expert_sorted, slot] = rows[order2]
            packed.append(dest.view(torch.float8_e4m3fn) if t.dtype == torch.float8_e4m3fn else dest)
        state = (selection, token, send_splits, recv_splits, expert_sorted, slot, order2)
        return (tuple(packed) if use_fp8 else packed[0]), per_expert, state

    def ll_padded(self, send: torch.Tensor) -> torch.Tensor:
        """What a user without a low-latency kernel does at decode: one `all_to_all_single` of a fixed-size
        buffer of `N` rows per rank (every token to every rank, or every token's partial result back to its
        rank), with no count exchange."""
        out = torch.empty_like(send)
        self.ctx.a2a(out, send, None, None)
        return out

    def ll_combine(self, y: torch.Tensor, topk_weights: torch.Tensor, state: tuple) -> torch.Tensor:
        selection, token, send_splits, recv_splits, expert_sorted, slot, order2 = state
        rows = torch.empty((len(order2), y.shape[-1]), dtype=y.dtype, device=y.device)
        rows[order2] = y[expert_sorted, slot]
        back = rows.new_empty((len(selection), y.shape[-1]))
        self.ctx.a2a(back, rows, send_splits, recv_splits)
        out = torch.zeros((topk_weights.shape[0], y.shape[-1]), dtype=torch.float32, device=y.device)
        out.index_add_(0, token, back.float() * topk_weights.view(-1)[selection].unsqueeze(1))
        return out.to(torch.bfloat16)


def copy_engine_peer_gbps(device: torch.device) -> Optional[Tuple[float, Optional[float]]]:
    """The ceiling: 1 GiB cudaMemcpys between this GPU and the next one (copy engines, no SMs), GB/s per
    direction: one way alone, and both ways at once (as dispatch and combine move rows: every rank sends while
    it receives). Timed on the host with both GPUs synchronised (events of one device do not bracket work the
    copy puts on the other); median of 5 after one left out."""
    if device.type != "cuda" or torch.cuda.device_count() < 2:
        return None
    peer = torch.device("cuda", (device.index + 1) % torch.cuda.device_count())
    here, there = (torch.empty(1 << 30, dtype=torch.uint8, device=d) for d in (device, peer))
    here_in, there_in = (torch.empty(1 << 30, dtype=torch.uint8, device=d) for d in (device, peer))
    streams = (torch.cuda.Stream(device), torch.cuda.Stream(peer))

    def seconds(both_ways: bool) -> float:
        times = []
        for _ in range(6):
            torch.cuda.synchronize(device)
            torch.cuda.synchronize(peer)
            start = time.perf_counter()
            with torch.cuda.stream(streams[0]):
                there_in.copy_(here, non_blocking=True)
            if both_ways:
                with torch.cuda.stream(streams[1]):
                    here_in.copy_(there, non_blocking=True)
            torch.cuda.synchronize(device)
            torch.cuda.synchronize(peer)
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])

    one_way, both_ways = seconds(False), seconds(True)
    del here, there, here_in, there_in
    torch.cuda.empty_cache()   # (else 2 GiB stay cached on the next GPU, which another rank uses)
    gigabytes = (1 << 30) / 1e9
    if both_ways > 1.9 * one_way:   # the two copies ran one after the other: no figure rather than a wrong one
        return gigabytes / one_way, None
    return gigabytes / one_way, gigabytes / both_ways
