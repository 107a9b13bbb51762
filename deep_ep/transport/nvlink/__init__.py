"""NVLink transport: every operation as Triton kernels on buffers that every rank of one node maps (CUDA IPC).

It is composed of two parts, each on its own peer-mapped memory, and the reference transport:
  normal mode (normal.py): layout, dispatch, combine, on the Buffer's `num_nvl_bytes`;
  low-latency mode (low_latency.py): low_latency_dispatch / low_latency_combine, on its `num_rdma_bytes`.
A part whose buffer size is 0 is not built, and its operations run on the reference transport. Both parts
report waits that timed out, masked ranks and bad input through one set of status words (status.py).
"""
from __future__ import annotations

from typing import Optional

import torch

from ...group import Group, Topology
from ...streams import capturing
from ..base import Transport
from ..reference import ReferenceTransport
from . import settings
from .low_latency import NVLinkLowLatency
from .normal import NVLinkNormal
from .status import StatusWords


def _agree_on_settings(group: Group) -> None:
    """The settings that both ends of an exchange use must be the same on every rank (a sender and a receiver
    that disagree would garble rows or wait forever): a difference raises ValueError on every rank, naming the
    variable."""
    group.agree_on({"$DEEP_EP_NVLINK_DIRECT": int(settings.DIRECT)}, "NVLink transport settings")


class NVLinkTransport(Transport):
    name = "nvlink"

    def __init__(self, group: Group, topology: Topology, device: torch.device, num_nvl_bytes: int,
                 num_low_latency_bytes: int, timeout_s: float) -> None:
        super().__init__(group, topology, device)
        if topology.is_internode:
            raise ValueError("transport='nvlink' needs every rank of the group on one node")
        _agree_on_settings(group)
        self._released = False
        self.reference = ReferenceTransport(group, topology, device)
        self.status = StatusWords(group, int(timeout_s * 1e9))
        self.normal: Optional[NVLinkNormal] = None
        if num_nvl_bytes > 0:
            self.normal = NVLinkNormal.open_on_group(group, topology, device, num_nvl_bytes, self.status)
            self.local_buffer = self.normal.local_buffer
        self.low_latency: Optional[NVLinkLowLatency] = None
        if num_low_latency_bytes > 0:
            self.low_latency = NVLinkLowLatency.open_on_group(group, topology, device, num_low_latency_bytes,
                                                              self.status.tensor, self.status.timeout_ns)
            self.low_latency_buffer = self.low_latency.area
        self.checks_values_on_device = self.graph_capturable = self.normal is not None
        self.low_latency_checks_values_on_device = self.low_latency_graph_capturable = self.low_latency is not None
        torch.cuda.synchronize(device)   # (the zeroed tensors above are complete before a call on any stream)
        group.barrier("NVLink transport set-up")

    # ---- normal mode -----------------------------------------------------------------------------------------
    def capture_host_wait(self, num_channels):
        return None if self.normal is None else self.normal.capture_host_wait(num_channels)

    def get_dispatch_layout(self, topk_idx, num_experts):
        if self.normal is None:
            return self.reference.get_dispatch_layout(topk_idx, num_experts)
        return self.normal.get_dispatch_layout(topk_idx, num_experts)

    def dispatch(self, x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                 num_tokens_per_expert, expert_alignment, num_worst_tokens, num_channels, check_values=None):
        path = self.reference if self.normal is None else self.normal
        return path.dispatch(x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                             num_tokens_per_expert, expert_alignment, num_worst_tokens, num_channels, check_values)

    def cached_dispatch(self, x, x_scales, handle, num_channels):
        path = self.reference if self.normal is None else self.normal
        return path.cached_dispatch(x, x_scales, handle, num_channels)

    def combine(self, x, handle, topk_weights, biases, num_channels):
        path = self.reference if self.normal is None else self.normal
        return path.combine(x, handle, topk_weights, biases, num_channels)

    # ---- low-latency mode ------------------------------------------------------------------------------------
    def low_latency_dispatch(self, x, topk_idx, num_max_tokens, num_experts, options, mask, wait_stats, half, hook,
                             check_values=None):
        path = self.reference.low_latency_dispatch if self.low_latency is None else self.low_latency.dispatch
        return path(x, topk_idx, num_max_tokens, num_experts, options, mask, wait_stats, half, hook, check_values)

    def low_latency_combine(self, x, topk_idx, topk_weights, src_info, layout_range, num_max_tokens, use_logfmt,
                            mask, out, wait_stats, half, hook, check_values=None):
        path = self.reference.low_latency_combine if self.low_latency is None else self.low_latency.combine
        return path(x, topk_idx, topk_weights, src_info, layout_range, num_max_tokens, use_logfmt, mask, out,
                    wait_stats, half, hook, check_values)

    def check_low_latency_errors(self) -> None:
        """Report a timeout, or bad input seen by an earlier low-latency kernel; warn about ranks that shrink
        mode masked since the last call."""
        if self.low_latency is not None:
            self.status.raise_timeout()
            self.status.report_low_latency(warn_masked=self.low_latency.auto_mask)

    def clean_low_latency(self, num_max_tokens, hidden, num_experts) -> None:
        self.reference.clean_low_latency(num_max_tokens, hidden, num_experts)
        if self.low_latency is not None:
            self.low_latency.clean(num_max_tokens, hidden, num_experts)

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def destroy(self, wait_for_gpu: bool = True) -> None:
        self._released = True
        if wait_for_gpu:
            torch.cuda.synchronize(self.device)
            self.status.mark_broken_after_timeout()
        if self.normal is not None:
            self.normal.close()
        if self.low_latency is not None:
            self.low_latency.close()

    def __del__(self) -> None:
        """Dropped without destroy() (a Buffer with explicitly_destroy=False; clients replace one that way):
        wait for this rank's kernels before the memory goes, as DeepEP's destructor does. They may still run on
        streams that the allocator does not track, on this rank's memory or on a peer's mapped here (PyTorch
        releases a mapping after waiting for the current stream only). Skipped after destroy(), after a failed
        collective or timeout (one that never finishes may hold the GPU), and while this thread captures a graph
        on the Buffer's device or the current one (a wait would end the capture; one on another thread cannot be
        seen, as in DeepEP)."""
        if getattr(self, "_released", True) or self.group.broken:
            return
        try:
            if not capturing(self.device) and not torch.cuda.is_current_stream_capturing():
                torch.cuda.synchronize(self.device)
        except Exception:   # (at interpreter exit CUDA may be gone already)
            pass


__all__ = ["NVLinkTransport"]
