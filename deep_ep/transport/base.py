"""The interface every data path implements.

The `Buffer` validates arguments, handles streams and events, and calls one of these methods with
checked tensors. A transport returns fresh outputs; it never sees `previous_event`/`async_finish`.
Low-latency calls return a `receive` callable that completes the call (the hook, or called at once).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from ..group import Group, Topology


@dataclass
class DispatchOutput:
    recv_x: torch.Tensor
    recv_scales: Optional[torch.Tensor]
    recv_topk_idx: Optional[torch.Tensor]
    recv_topk_weights: Optional[torch.Tensor]
    num_recv_tokens_per_expert_list: Optional[List[int]]
    handle: Optional[tuple]


@dataclass
class LowLatencyDispatchOutput:
    recv_x: torch.Tensor                 # [E_loc, R*N, H], bf16 or float8_e4m3fn
    recv_scales: Optional[torch.Tensor]  # [E_loc, R*N, G] column-major in the last two dims, or None
    recv_count: torch.Tensor             # [E_loc] int32
    src_info: torch.Tensor               # [E_loc, R*N] int32
    layout_range: torch.Tensor           # [E_loc, R] int64


@dataclass
class LowLatencyOptions:
    use_fp8: bool
    round_scale: bool
    use_ue8m0: bool


class Transport(ABC):
    """One data path for all of the Buffer's operations."""

    name: str
    # the memory `Buffer.get_local_buffer_tensor` shows: the NVLink rows area (`num_nvl_bytes`) and the low-latency
    # area (`num_rdma_bytes`), where the transport has them
    local_buffer: Optional[torch.Tensor] = None
    low_latency_buffer: Optional[torch.Tensor] = None
    # True: the transport checks input values (expert ids, layout consistency) itself, without an extra host
    # wait, and reports them by the next call that waits on the host; the Buffer then skips its own checks.
    checks_values_on_device = False
    # the same for the expert ids of low-latency calls (reported at the next low-latency call)
    low_latency_checks_values_on_device = False
    # True: normal-mode calls without a host wait (all but a non-cached dispatch without num_worst_tokens) can be
    # captured in a CUDA graph; False: every call waits on the host, and the Buffer refuses them inside a capture
    graph_capturable = False
    # the same for the low-latency calls
    low_latency_graph_capturable = False

    def __init__(self, group: Group, topology: Topology, device: torch.device) -> None:
        self.group, self.topology, self.device = group, topology, device

    # ---- DeepEP's runtime queries (`Buffer.runtime` is the transport; scripts ask it these) ------------------
    def is_available(self) -> bool:
        return True

    def get_num_rdma_ranks(self) -> int:
        """Nodes in the group."""
        return self.topology.num_nodes

    def get_rdma_rank(self) -> int:
        """This rank's node."""
        return self.topology.node

    def is_internode_available(self) -> bool:
        """Whether the group spans several nodes."""
        return self.topology.is_internode

    def get_root_rdma_rank(self, global_: bool) -> int:
        """As DeepEP's: this rank's index in its node with `global_`, else 0."""
        return self.topology.local_rank if global_ else 0

    def get_local_device_id(self) -> int:
        """The CUDA device index (-1 on the CPU)."""
        return self.device.index if self.device.type == "cuda" and self.device.index is not None else -1

    def low_latency_receive_capturable(self, launched_in_capture: bool) -> bool:
        """Whether the receive hook of a low-latency call (launched inside a CUDA graph capture or not) may run
        inside a capture."""
        return self.low_latency_graph_capturable

    def capture_host_wait(self, num_channels: int) -> Optional[str]:
        """Why a normal-mode call with `num_channels` would wait on the host even without a count to wait for
        (inside a CUDA graph capture the Buffer refuses it with this), or None."""
        return None

    @abstractmethod
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int
                            ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
        """(num_tokens_per_rank, num_tokens_per_rdma_rank or None, num_tokens_per_expert, is_token_in_rank)."""

    @abstractmethod
    def dispatch(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], topk_idx: Optional[torch.Tensor],
                 topk_weights: Optional[torch.Tensor], num_tokens_per_rank: torch.Tensor,
                 is_token_in_rank: torch.Tensor, num_tokens_per_expert: torch.Tensor, expert_alignment: int,
                 num_worst_tokens: int, num_channels: int, check_values: Optional[Callable[[], None]] = None
                 ) -> DispatchOutput:
        """Send each token once to every rank in `is_token_in_rank`; rows ordered by (source rank, token).
        `check_values` (given where `checks_values_on_device` is False) raises ValueError for bad input values:
        the transport runs it before its first exchange and makes every rank refuse the call together."""

    @abstractmethod
    def cached_dispatch(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], handle: tuple,
                        num_channels: int) -> DispatchOutput:
        """Dispatch new data along the routing of `handle` (no layout step, no host wait for counts)."""

    @abstractmethod
    def combine(self, x: torch.Tensor, handle: tuple, topk_weights: Optional[torch.Tensor],
                biases: Tuple[Optional[torch.Tensor], Optional[torch.Tensor]], num_channels: int
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Sum each token's rows back from its destination ranks (fp32, fixed order) plus the biases."""

    @abstractmethod
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_tokens: int, num_experts: int,
                             options: LowLatencyOptions, mask: Optional[torch.Tensor],
                             wait_stats: Optional[torch.Tensor], half: int, hook: bool,
                             check_values: Optional[Callable[[], None]] = None
                             ) -> Tuple[LowLatencyDispatchOutput, Callable[[], None]]:
        """Send every selection to its expert's rank; returns the outputs and the receive step. `half`: the
        buffer half of this call (calls alternate between the two). `hook`: the receive step runs later, as
        a receive hook; otherwise right after this returns (a transport may then receive here already).
        `mask`: the Buffer's shrink mask (None without shrink mode). The call uses it as it is now, and marks
        in it every rank that a wait of this call gave up on (the rank is skipped from there on). `check_values`
        as in `dispatch`."""

    @abstractmethod
    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            src_info: torch.Tensor, layout_range: torch.Tensor, num_max_tokens: int,
                            use_logfmt: bool, mask: Optional[torch.Tensor], out: torch.Tensor,
                            wait_stats: Optional[torch.Tensor], half: int, hook: bool,
                            check_values: Optional[Callable[[], None]] = None) -> Callable[[], None]:
        """Send expert outputs back; the receive step writes the weighted sums into `out` (`hook` and
        `check_values` as in `low_latency_dispatch`)."""

    def check_low_latency_errors(self) -> None:
        """Raise what an earlier low-latency call found on the GPU (called before each low-latency call)."""

    def clean_low_latency(self, num_max_tokens: int, hidden: int, num_experts: int) -> None:
        """Reset the transport's low-latency state (every rank, between two barriers, nothing in flight)."""

    def destroy(self, wait_for_gpu: bool = True) -> None:
        """Release what the transport holds (collective), after the GPU's work unless `wait_for_gpu` is False
        (the group failed: its unfinished work may never finish). A wait of that work that timed out marks the
        group broken."""
