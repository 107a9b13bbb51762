"""NVLink transport: normal dispatch/combine as Triton kernels on peer-mapped buffers (one node).

Each operation takes the next epoch (a device counter, so CUDA graph replays advance it) and runs:
  non-cached dispatch: notify kernel -> counts to the host (the API's receive-count wait; skipped with
  num_worst_tokens) -> send kernel -> DATA signal -> receive kernel -> CONSUMED signal;
  cached dispatch and combine: the same without the notify.
An operation whose rows would not fit the staging area in one round goes through the reference
transport instead; every rank takes the same decision from values all ranks share (the largest token
count, or num_worst_tokens), so the group never splits. Low-latency calls use the reference transport.
"""
from __future__ import annotations

import weakref
from typing import Dict

import torch

from ...group import CommTimeoutError, Group, Topology
from ..base import DispatchOutput, Transport
from ...config import _round_up
from ..reference import ReferenceTransport, _channel_counts, _exclusive_cumsum, _positions

_FLAG_SETS = 3                 # NOTIFY, DATA, CONSUMED: one int64 slot per peer each
_MAX_RECORD_EXTRA = 1024 + 128  # experts per rank + channels, bound of a notify record
_ALIGN = 256


def _next_pow2(value: int) -> int:
    return 1 << max(value - 1, 0).bit_length()


class NVLinkTransport(Transport):
    name = "nvlink"

    def __init__(self, group: Group, topology: Topology, device: torch.device, nvl_buffer: torch.Tensor,
                 timeout_s: float) -> None:
        super().__init__(group, topology, device)
        from .peer_memory import PeerBuffers
        if topology.is_internode:
            raise ValueError("transport='nvlink' needs every rank of the group on one node")
        self.reference = ReferenceTransport(group, topology, device)
        num_ranks = topology.num_ranks
        self.notify_flag_word, self.data_flag_word, self.consumed_flag_word = 0, num_ranks, 2 * num_ranks
        flag_bytes = _round_up(_FLAG_SETS * num_ranks * 8, _ALIGN)
        self.notify_word = flag_bytes // 4
        self.max_record = 2 + num_ranks + _MAX_RECORD_EXTRA
        self.staging_offset = _round_up(flag_bytes + num_ranks * self.max_record * 4, _ALIGN)
        if nvl_buffer.numel() <= self.staging_offset:
            raise ValueError(f"num_nvl_bytes={nvl_buffer.numel()} is too small for the NVLink transport: need more "
                             f"than {self.staging_offset} bytes")
        nvl_buffer[:self.staging_offset].zero_()
        torch.cuda.synchronize(device)
        self.peers = PeerBuffers(nvl_buffer, group)
        self.own_base = nvl_buffer.data_ptr()
        self.epoch = torch.zeros(1, dtype=torch.int64, device=device)
        self.status = torch.zeros(4, dtype=torch.int32).pin_memory()
        self.timeout_ns = int(timeout_s * 1e9)
        self.staging_bytes = nvl_buffer.numel() - self.staging_offset
        self._row_bounds: Dict[int, int] = {}   # id(handle[3]) -> bound on the rows of any (source, destination)
        group.barrier("NVLink transport set-up")

    # ---- bookkeeping -------------------------------------------------------------------------------
    def _check_status(self) -> None:
        code = int(self.status[0])
        if code:
            from .sync import STATUS_WHAT
            peer = int(self.status[1])
            raise CommTimeoutError(f"rank {self.topology.rank}: waited more than {self.timeout_ns / 1e9:g} s for rank "
                                   f"{peer} to send {STATUS_WHAT.get(code, 'a signal')}; this Buffer cannot be used "
                                   "any more")

    def _remember_bound(self, rows: torch.Tensor, bound: int) -> None:
        """A handle's rows per (source, destination) are at most `bound`; forgotten with the handle."""
        key = id(rows)
        self._row_bounds[key] = bound
        weakref.finalize(rows, self._row_bounds.pop, key, None)

    def _capacity(self, slot_bytes: int) -> int:
        return self.staging_bytes // (self.topology.num_ranks * slot_bytes)

    def _next_epoch(self) -> None:
        self._check_status()
        self.epoch.add_(1)

    @staticmethod
    def _dispatch_slot(hidden_words: int, scale_words: int, topk: int):
        x_offset = _round_up(3 * topk + 1, 4)
        return x_offset, _round_up(x_offset + hidden_words + scale_words, 4)

    @staticmethod
    def _combine_slot(hidden: int, topk: int):
        x_offset = _round_up(topk, 4)
        return x_offset, _round_up(x_offset + hidden // 2, 4)

    def _programs(self, num_channels: int) -> int:
        return 2 * num_channels

    # ---- layout: local torch ops -----------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx, num_experts):
        return self.reference.get_dispatch_layout(topk_idx, num_experts)

    # ---- dispatch ------------------------------------------------------------------------------------------
    def dispatch(self, x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                 num_tokens_per_expert, expert_alignment, num_worst_tokens, num_channels):
        from .notify import notify_kernel
        topo, dev = self.topology, self.device
        num_ranks, num_experts = topo.num_ranks, num_tokens_per_expert.numel()
        experts_per_rank = num_experts // num_ranks
        num_tokens = x.shape[0]
        self._next_epoch()
        channel_counts = _channel_counts(is_token_in_rank, num_channels)
        record = torch.cat([
            torch.full((num_ranks, 1), num_tokens, dtype=torch.int32, device=dev),
            num_tokens_per_rank.view(num_ranks, 1),
            num_tokens_per_rank.view(1, num_ranks).expand(num_ranks, num_ranks),
            num_tokens_per_expert.view(num_ranks, experts_per_rank),
            channel_counts.to(torch.int32)], dim=1).contiguous()
        record_len = record.shape[1]
        received = torch.empty_like(record)
        notify_kernel[(num_ranks,)](record, received, self.peers.bases, self.notify_flag_word, self.notify_word,
                                    self.epoch, self.status, topo.rank, self.timeout_ns, REC=record_len,
                                    BLOCK=_next_pow2(record_len))
        largest_source = received[:, 0].max()
        recv_per_source = received[:, 1]
        sent_matrix = received[:, 2:2 + num_ranks]                        # [source, destination]
        per_expert = received[:, 2 + num_ranks:2 + num_ranks + experts_per_rank].sum(0)
        recv_channel_counts = received[:, 2 + num_ranks + experts_per_rank:]
        if num_worst_tokens:
            bound, aligned_list, num_rows = num_worst_tokens, [], num_worst_tokens
        else:
            host = torch.cat([largest_source.view(1), recv_per_source.sum().view(1), per_expert]).cpu()
            self._check_status()
            bound, num_recv = int(host[0]), int(host[1])
            aligned = (host[2:] + expert_alignment - 1) // expert_alignment * expert_alignment
            aligned_list, num_rows = aligned.tolist(), num_recv
        hidden_words = x.shape[1] * x.element_size() // 4
        scale_words = 0 if x_scales is None else x_scales.shape[1]
        topk = 0 if topk_idx is None else topk_idx.shape[1]
        x_offset, slot_words = self._dispatch_slot(hidden_words, scale_words, topk)
        capacity = self._capacity(slot_words * 4)
        if bound > capacity:
            # Every rank takes this branch (bound and capacity are the same everywhere). The notify of this
            # epoch has been read, so close the epoch for the next operation's CONSUMED wait.
            from .sync import signal_peers_kernel
            signal_peers_kernel[(num_ranks,)](self.peers.bases, self.consumed_flag_word, self.epoch, topo.rank)
            return self.reference.dispatch(x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                                           num_tokens_per_expert, expert_alignment, num_worst_tokens, num_channels)
        send_head = _positions(is_token_in_rank)
        prefix = torch.zeros(num_ranks + 1, dtype=torch.int32, device=dev)
        prefix[1:] = torch.cumsum(recv_per_source, 0)
        out = self._move(x, x_scales, topk_idx, topk_weights, is_token_in_rank, send_head, prefix, num_rows,
                         experts_per_rank, num_channels)
        rank_prefix_matrix = torch.cumsum(sent_matrix, dim=0).to(torch.int32)
        channel_prefix = torch.cumsum(channel_counts, dim=1).to(torch.int32)
        recv_channel_prefix = _exclusive_cumsum(recv_channel_counts, dim=1).to(torch.int32)
        out.handle = (rank_prefix_matrix, channel_prefix, recv_channel_prefix, out.handle, is_token_in_rank, send_head)
        out.num_recv_tokens_per_expert_list = aligned_list
        self._remember_bound(out.handle[3], bound)
        return out

    def cached_dispatch(self, x, x_scales, handle, num_channels):
        bound = self._row_bounds.get(id(handle[3]))
        hidden_words = x.shape[1] * x.element_size() // 4
        scale_words = 0 if x_scales is None else x_scales.shape[1]
        _, slot_words = self._dispatch_slot(hidden_words, scale_words, 0)
        if bound is None or bound > self._capacity(slot_words * 4):
            return self.reference.cached_dispatch(x, x_scales, handle, num_channels)
        self._next_epoch()
        prefix = self._prefix_from_handle(handle)
        out = self._move(x, x_scales, None, None, handle[4], handle[5], prefix, handle[3].shape[0], 0, num_channels)
        out.handle = None
        return out

    def _move(self, x, x_scales, topk_idx, topk_weights, is_token_in_rank, send_head, prefix, num_rows,
              experts_per_rank, num_channels) -> DispatchOutput:
        """Send kernel, DATA signal, receive kernel, CONSUMED signal; returns the outputs (handle slot =
        the received source indices)."""
        from .dispatch import dispatch_recv_kernel, dispatch_send_kernel
        from .sync import signal_peers_kernel
        topo, dev = self.topology, self.device
        num_ranks = topo.num_ranks
        words = x.view(torch.uint8).view(torch.int32) if x.numel() else torch.empty((0,), dtype=torch.int32, device=dev)
        hidden_words = x.shape[1] * x.element_size() // 4
        scales = None if x_scales is None else x_scales.contiguous()
        scale_words = 0 if scales is None else scales.shape[1]
        topk = 0 if topk_idx is None else topk_idx.shape[1]
        x_offset, slot_words = self._dispatch_slot(hidden_words, scale_words, topk)
        capacity = self._capacity(slot_words * 4)
        recv_x = x.new_empty((num_rows, x.shape[1]))
        recv_scales = None if scales is None else scales.new_empty((num_rows, scale_words))
        recv_idx = None if topk_idx is None else torch.empty((num_rows, topk), dtype=topk_idx.dtype, device=dev)
        recv_weights = None if topk_weights is None else torch.empty((num_rows, topk), dtype=torch.float32, device=dev)
        recv_src = torch.empty(num_rows, dtype=torch.int32, device=dev)
        dummy = recv_src
        programs = self._programs(num_channels)
        blocks = dict(BLOCK_X=_next_pow2(max(hidden_words, 1)), BLOCK_S=_next_pow2(max(scale_words, 1)),
                      BLOCK_K=_next_pow2(max(topk, 1)))
        in_rank = is_token_in_rank.view(torch.int8)
        consumed = self.peers.local.view(torch.int64)[self.consumed_flag_word:self.consumed_flag_word + num_ranks]
        dispatch_send_kernel[(programs,)](
            words, dummy if scales is None else scales.view(torch.int32), dummy if topk_idx is None else topk_idx,
            dummy if topk_weights is None else topk_weights, in_rank, send_head, self.peers.bases, consumed,
            self.epoch, self.status, x.shape[0], topo.rank, self.staging_offset // 4, slot_words, capacity,
            self.timeout_ns, R=num_ranks, XW=hidden_words, SW=scale_words, K=topk, X_OFF=x_offset, **blocks)
        signal_peers_kernel[(num_ranks,)](self.peers.bases, self.data_flag_word, self.epoch, topo.rank)
        dispatch_recv_kernel[(programs,)](
            self.own_base, self.data_flag_word, prefix, recv_x.view(torch.uint8).view(torch.int32)
            if recv_x.numel() else dummy, dummy if recv_scales is None else recv_scales.view(torch.int32),
            dummy if recv_idx is None else recv_idx, dummy if recv_weights is None else recv_weights, recv_src,
            num_rows, topo.rank * experts_per_rank, experts_per_rank, self.epoch, self.status,
            self.staging_offset // 4, slot_words, capacity, self.timeout_ns, R=num_ranks, XW=hidden_words,
            SW=scale_words, K=topk, X_OFF=x_offset, HAS_WEIGHTS=topk_weights is not None,
            BLOCK_R=_next_pow2(num_ranks), **blocks)
        signal_peers_kernel[(num_ranks,)](self.peers.bases, self.consumed_flag_word, self.epoch, topo.rank)
        return DispatchOutput(recv_x, recv_scales, recv_idx, recv_weights, None, recv_src)

    def _prefix_from_handle(self, handle) -> torch.Tensor:
        prefix = torch.zeros(self.topology.num_ranks + 1, dtype=torch.int32, device=self.device)
        prefix[1:] = handle[0][:, self.topology.rank]
        return prefix

    # ---- combine ---------------------------------------------------------------------------------------------
    def combine(self, x, handle, topk_weights, biases, num_channels):
        from .combine import combine_reduce_kernel, combine_send_kernel
        from .sync import signal_peers_kernel
        topo, dev = self.topology, self.device
        num_ranks, hidden = topo.num_ranks, x.shape[1]
        topk = 0 if topk_weights is None else topk_weights.shape[1]
        x_offset, slot_words = self._combine_slot(hidden, topk)
        capacity = self._capacity(slot_words * 4)
        bound = self._row_bounds.get(id(handle[3]))
        if bound is None or bound > capacity:
            return self.reference.combine(x, handle, topk_weights, biases, num_channels)
        self._next_epoch()
        is_token_in_rank, send_head = handle[4], handle[5]
        num_tokens = is_token_in_rank.shape[0]
        prefix = self._prefix_from_handle(handle)
        combined = torch.empty((num_tokens, hidden), dtype=torch.bfloat16, device=dev)
        combined_weights = None if topk_weights is None else torch.empty((num_tokens, topk), dtype=torch.float32,
                                                                         device=dev)
        dummy = prefix
        programs = self._programs(num_channels)
        blocks = dict(BLOCK_H=_next_pow2(hidden), BLOCK_K=_next_pow2(max(topk, 1)))
        consumed = self.peers.local.view(torch.int64)[self.consumed_flag_word:self.consumed_flag_word + num_ranks]
        combine_send_kernel[(programs,)](
            x, dummy if topk_weights is None else topk_weights, prefix, self.peers.bases, consumed, self.epoch,
            self.status, topo.rank, self.staging_offset // 4, slot_words, capacity, self.timeout_ns, R=num_ranks,
            H=hidden, K=topk, X_OFF=x_offset, BLOCK_R=_next_pow2(num_ranks), **blocks)
        signal_peers_kernel[(num_ranks,)](self.peers.bases, self.data_flag_word, self.epoch, topo.rank)
        bias0, bias1 = biases
        combine_reduce_kernel[(programs,)](
            self.own_base, self.data_flag_word, is_token_in_rank.view(torch.int8), send_head,
            dummy if bias0 is None else bias0, dummy if bias1 is None else bias1, combined,
            dummy if combined_weights is None else combined_weights, num_tokens, self.epoch, self.status,
            self.staging_offset // 4, slot_words, capacity, self.timeout_ns, R=num_ranks, H=hidden, K=topk,
            X_OFF=x_offset, HAS_BIAS0=bias0 is not None, HAS_BIAS1=bias1 is not None, **blocks)
        signal_peers_kernel[(num_ranks,)](self.peers.bases, self.consumed_flag_word, self.epoch, topo.rank)
        return combined, combined_weights

    # ---- low latency: the reference transport for now ------------------------------------------------------
    def low_latency_dispatch(self, *args, **kwargs):
        return self.reference.low_latency_dispatch(*args, **kwargs)

    def low_latency_combine(self, *args, **kwargs):
        return self.reference.low_latency_combine(*args, **kwargs)

    def destroy(self) -> None:
        torch.cuda.synchronize(self.device)
        self.peers.close()
