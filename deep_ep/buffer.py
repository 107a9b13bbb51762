"""The public `Buffer`: DeepEP V1's API. It validates arguments and routes each call to a transport.

Handles are the plain tuples of DeepEP's positions (clients index them); inside they are unpacked by name.

Note [collective construction]: construction's first collective gathers every rank's arguments (and host,
for the node layout): ranks that passed different ones all get a ValueError naming the argument, instead of a
failure at the first call on some ranks and a timeout on the others.

Note [state outside inference mode]: the Buffer's state is made outside inference mode even when it is built
inside it (frameworks build it lazily in a forward), so that calls outside that mode can update it in place
(e.g. the shrink mask).

Note [checked handles]: a handle reused call after call (cached dispatches, combines) is checked once per
(tokens, channels), a low-latency handle once; the Buffer keeps the last handle of each mode it checked alive
until it checks another.

Note [hooks hold no Buffer]: a receive hook refers to the transport and its call's tensors, never to the
Buffer, so a Buffer dropped with hooks never called goes at once (see `ReceiveHook._release`).
"""
from __future__ import annotations

import os
import secrets
import warnings
from typing import Any, Callable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from .checks import check_expert_ids, check_int, check_tensor
from .config import (Config, LowLatencyLayout, default_combine_config, default_dispatch_config,
                     low_latency_area_bytes, low_latency_size_hint, nvl_bytes_needed, topk_idx_t)
from .group import Group, Topology, host_id, unmasked_ranks
from .low_latency import LowLatencySlots, ReceiveHook
from .streams import CommStream, capturing, stream_of, without_autograd
from .transport import TRANSPORTS, select_transport, transport_name
from .transport.base import LowLatencyOptions
from .utils import EventHandle, EventOverlap

DEFAULT_TIMEOUT_S = 100.0
MAX_TIMEOUT_S = 1e6   # about 11 days, well within the GPU waits' 64-bit nanosecond clocks
MAX_TOPK = 32
MAX_EXPERTS_PER_RANK = 1024

Tensors = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


def _timeout_setting(timeout_s: Optional[float]) -> float:
    """`timeout_s`, else $DEEP_EP_TIMEOUT_S, else the default; ValueError naming the setting unless it is a number
    of seconds in (0, MAX_TIMEOUT_S]."""
    name = "timeout_s"
    if timeout_s is None:
        name, setting = "$DEEP_EP_TIMEOUT_S", os.environ.get("DEEP_EP_TIMEOUT_S")
        try:
            timeout_s = DEFAULT_TIMEOUT_S if setting is None else float(setting)
        except ValueError:
            raise ValueError(f"{name} must be a number of seconds, got {setting!r}") from None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise ValueError(f"{name} must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], got {timeout_s!r}")
    return float(timeout_s)


def _refuse_capture(device: torch.device, what: str, reason: str) -> None:
    """RuntimeError (saying `reason`) if the current stream of `device` is capturing a CUDA graph."""
    if capturing(device):
        raise RuntimeError(f"{what} cannot run inside a CUDA graph capture: {reason}")


_LOW_LATENCY_HOST_WAIT = ("this Buffer's low-latency calls exchange with the other ranks on the host (those of the "
                          "NVLink transport do not: ranks of one node, num_rdma_bytes > 0 and "
                          "allow_nvlink_for_low_latency_mode)")


def _shown_argument(name: str, value: int) -> Any:
    """A Buffer argument as gathered (an int) back in the caller's terms, for error messages."""
    if name == "transport":
        return TRANSPORTS[value]
    return None if name == "num_ranks_per_node" and value == -1 else value


class _DestroyedTransport:
    """Stands in for the transport of a destroyed Buffer: every use is an error that says so."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"{name}: this Buffer was destroyed; create a new one")


class Buffer:
    """Expert-parallel communication buffer: normal (high-throughput) and low-latency all-to-all.

    Class attribute `num_sms` (default 20) is the number of SMs the normal kernels may use; change it with
    `Buffer.set_num_sms`. Construction is collective: every rank of the group must call it with the same
    arguments.
    """

    num_sms: int = 20

    @torch.inference_mode(False)   # Note [state outside inference mode]
    def __init__(self, group: Optional[dist.ProcessGroup], num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 use_fabric: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False,
                 comm: Optional[Any] = None, *, num_ranks_per_node: Optional[int] = None,
                 transport: Optional[str] = None, timeout_s: Optional[float] = None,
                 device: Optional[Union[torch.device, str]] = None) -> None:
        """
        Args:
            group: the communication group (NCCL, gloo or mixed); its rank order is the EP rank order.
            num_nvl_bytes: bytes of the buffer shared with the ranks of the same node (normal mode), a
                multiple of 128. `Buffer.get_dispatch_config(R).get_nvl_buffer_size_hint(hidden_bytes, R)` (and
                the combine config's) gives a size every call accepts; a call refuses a buffer below DeepEP's
                rule for its config and row size. On the NVLink transport a buffer that holds every row a call
                moves lets it move them at once instead of in rounds (docs/DESIGN.md, "NVLink transport").
            num_rdma_bytes: bytes of the low-latency area, a multiple of 128; `Buffer.get_low_latency_rdma_size_hint`
                gives the size. DeepEP also uses it for internode normal mode; this library needs none there.
            low_latency_mode: enable `low_latency_dispatch` / `low_latency_combine`.
            num_qps_per_rank: RDMA queue pairs per peer in DeepEP; accepted as a hint (must be > 0 in
                low-latency mode, as DeepEP asserts there).
            allow_nvlink_for_low_latency_mode: let low-latency traffic between ranks of a node use NVLink.
            allow_mnnvl: allow multi-node NVLink (accepted; single-node transports ignore it).
            use_fabric: allocate shareable memory through fabric handles (accepted; ignored here).
            explicitly_destroy: the user will call `destroy()`; otherwise resources go with the object.
            enable_shrink: keep a mask of failed ranks that low-latency calls skip.
            comm: an mpi4py communicator, used when `group` is None.
            num_ranks_per_node: ranks per node (contiguous in group order). Default: from the ranks' hosts.
            transport: "auto" (default, or $DEEP_EP_TRANSPORT), "reference" or "nvlink".
            timeout_s: bound of every wait in seconds (default 100, or $DEEP_EP_TIMEOUT_S); the construction's
                first exchange waits as long as the group's own timeout where that is longer (docs/DESIGN.md).
            device: where the tensors live; default the current CUDA device, else the CPU.
        """
        if torch.cuda.is_available() and capturing(torch.device(device if device is not None else "cuda")):
            raise RuntimeError("Buffer cannot be constructed inside a CUDA graph capture (it allocates memory and "
                               "exchanges it with the other ranks on the host): create it before capturing")
        check_int("num_nvl_bytes", num_nvl_bytes, minimum=0, multiple_of=128)
        check_int("num_rdma_bytes", num_rdma_bytes, minimum=0, multiple_of=128)
        check_int("num_qps_per_rank", num_qps_per_rank, minimum=1 if low_latency_mode else 0)
        timeout_s = _timeout_setting(timeout_s)
        requested_transport = transport_name(transport)
        self.device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
        if self.device.type == "cuda" and self.device.index is None:   # fixed now, not whatever is current later
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._group = Group(group, comm, timeout_s, self.device)
        self.group = group if group is not None else comm
        self.rank, self.group_size = self._group.rank, self._group.size
        if num_ranks_per_node is not None:
            check_int("num_ranks_per_node", num_ranks_per_node, minimum=1, maximum=self.group_size)
            if self.group_size % num_ranks_per_node:
                raise ValueError(f"num_ranks_per_node must divide the group size {self.group_size}, "
                                 f"got {num_ranks_per_node}")
        # Note [collective construction]
        with self._group.awaiting_arrivals():
            gathered = self._group.agree_on(dict(
                num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=num_rdma_bytes, low_latency_mode=bool(low_latency_mode),
                enable_shrink=bool(enable_shrink),
                allow_nvlink_for_low_latency_mode=bool(allow_nvlink_for_low_latency_mode),
                num_ranks_per_node=-1 if num_ranks_per_node is None else num_ranks_per_node,
                transport=TRANSPORTS.index(requested_transport)), "Buffer construction",
                [host_id(), secrets.randbits(62)], _shown_argument)
        hosts = [row[0] for row in gathered]
        if num_ranks_per_node is None:
            num_ranks_per_node = self._group.ranks_per_node_of(hosts)
        self.topology = Topology(self.rank, self.group_size, num_ranks_per_node)
        if self.topology.is_internode and num_ranks_per_node > 32:
            raise ValueError(f"num_ranks_per_node must be <= 32 across nodes (a 32-bit rank mask), got {num_ranks_per_node}")
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode, self.explicitly_destroy = low_latency_mode, explicitly_destroy
        self.enable_shrink = enable_shrink
        self.num_qps_per_rank = num_qps_per_rank
        self.allow_nvlink_for_low_latency_mode, self.allow_mnnvl, self.use_fabric = (
            allow_nvlink_for_low_latency_mode, allow_mnnvl, use_fabric)
        self._mask = torch.zeros(self.group_size, dtype=torch.int32, device=self.device) if enable_shrink else None
        if enable_shrink:   # rank 0's random number names this Buffer's roll calls
            self._group.open_roll_call(f"deep_ep/shrink/{gathered[0][1]:x}")
        self._comm_stream = CommStream(self.device)
        self._default_configs: dict = {}   # see _default_config
        self._slots = LowLatencySlots()
        self._low_latency_async = False   # the last low-latency call ran asynchronously on the comm stream
        # per buffer half, the stream (id triple) that the receive of its last low-latency call runs on
        self._receive_streams: List[Optional[tuple]] = [None, None]
        # the last handle checked and its results per (num_tokens, num_channels): Note [checked handles]
        self._checked_handle: Tuple[Optional[tuple], dict] = (None, {})
        # the last low-latency handle checked and its parts (Note [checked handles]); the (N, hidden, experts)
        # that fit the buffer
        self._checked_low_latency_handle: Tuple[Optional[tuple], Optional[tuple]] = (None, None)
        self._low_latency_sizes_that_fit: set = set()
        low_latency_bytes = num_rdma_bytes if low_latency_mode and allow_nvlink_for_low_latency_mode else 0
        self._transport = select_transport(requested_transport, self._group, self.topology, self.device,
                                           num_nvl_bytes, low_latency_bytes, timeout_s)
        if group is None and self._transport.name == "reference":
            raise ValueError("comm: with an mpi4py communicator and no torch.distributed group only the NVLink "
                             "transport can run (the reference transport exchanges tensors through "
                             "torch.distributed), and it does not fit here (it needs one node of NVLink-connected "
                             "GPUs, each rank's process seeing every rank's GPU); pass group= a torch.distributed "
                             "process group")
        # the NVLink transport owns its buffers (they are mapped into the peers)
        self._nvl_buffer = self._transport.local_buffer
        if self._nvl_buffer is None:
            self._nvl_buffer = torch.empty(num_nvl_bytes, dtype=torch.uint8, device=self.device)
        self._rdma_buffer = self._transport.low_latency_buffer
        if self._rdma_buffer is None:
            self._rdma_buffer = torch.empty(num_rdma_bytes, dtype=torch.uint8, device=self.device)
        self.transport_name = self._transport.name
        if low_latency_mode or self.topology.is_internode:   # where DeepEP starts NVSHMEM
            self.nvshmem_qp_depth = int(os.environ.get("NVSHMEM_QP_DEPTH", "1024"))
        self._group.barrier("Buffer construction")
        self.runtime: Optional[object] = self._transport   # set last: a Buffer whose construction failed has none

    def __del__(self) -> None:
        if getattr(self, "explicitly_destroy", False) and getattr(self, "runtime", None) is not None:
            try:   # may run at interpreter exit, when warnings can no longer be issued
                warnings.warn(f"deep_ep.Buffer of rank {self.rank} was created with explicitly_destroy=True and "
                              "dropped without destroy(): call destroy() on every rank before releasing it",
                              RuntimeWarning, stacklevel=2)
            except Exception:
                pass

    # ---- lifecycle --------------------------------------------------------------------------------------
    def destroy(self) -> None:
        """Release the buffers (collective). Requires `explicitly_destroy=True`.

        Their GPU memory is free when this returns, except what tensors the caller still holds view
        (`get_local_buffer_tensor`, a zero-copy combine buffer); any later use of this Buffer raises RuntimeError.
        Receive hooks not yet called are discarded (docs/DESIGN.md, "Errors")."""
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        self._live("destroy")
        self._refuse_capture("destroy", "it waits for the GPU and the other ranks on the host")
        self._slots.reset("destroy()")
        # after a failed collective or a timeout (also a GPU wait that timed out after the last call) the ranks
        # are out of step: release locally, waiting neither for the GPU (it may never finish) nor for the ranks
        try:
            self._transport.destroy(wait_for_gpu=not self._group.broken)
            if not self._group.broken:
                if self._group.roll_call is not None:
                    self._group.gather_at_destroy(self._mask)
                else:
                    self._group.barrier("destroy", unmasked_ranks(self._mask, self.rank))
        finally:   # even if the barrier times out; the transport's GPU memory goes now, not with this Buffer
            self._transport = _DestroyedTransport()
            self._nvl_buffer = self._rdma_buffer = None
            self._checked_handle = (None, {})
            self._checked_low_latency_handle = (None, None)
            self.runtime = None

    def _live(self, what: str) -> None:
        if self.runtime is None:
            raise RuntimeError(f"{what}: this Buffer was destroyed; create a new one")

    def _refuse_capture(self, what: str, reason: str) -> None:
        """RuntimeError (saying `reason`) if the caller's stream is capturing a CUDA graph."""
        _refuse_capture(self.device, what, reason)

    def _refuse_host_wait_in_capture(self, what: str, low_latency: bool = False, host_wait: Optional[str] = None,
                                     num_channels: Optional[int] = None) -> None:
        """Refuse a data call inside a CUDA graph capture if it would wait on the host: every call of a path
        that cannot be captured, a call with `host_wait` (why it waits), or a normal-mode call that the
        transport must prepare on the host for `num_channels`. Runs before anything is queued or exchanged."""
        transport = self._transport
        if low_latency and transport.low_latency_graph_capturable:
            return
        if not capturing(self.device):
            return
        if low_latency:   # capturable low-latency paths returned above
            host_wait = _LOW_LATENCY_HOST_WAIT
        elif not transport.graph_capturable:
            host_wait = ("this Buffer's normal-mode calls exchange with the other ranks on the host (those of the "
                         "NVLink transport do not: ranks of one node)")
        elif host_wait is None and num_channels is not None:
            host_wait = transport.capture_host_wait(num_channels)
        if host_wait is not None:
            self._refuse_capture(what, host_wait)

    # ---- class helpers ------------------------------------------------------------------------------------
    @staticmethod
    def is_sm90_compiled() -> bool:
        """Whether the FP8 paths are available: always True (nothing is compiled ahead of time)."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set the number of SMs the normal kernels use by default.

        Args:
            new_num_sms: a positive even number; every default config made afterwards uses it (a handle must be
                used with the `num_sms` of its dispatch)."""
        assert isinstance(new_num_sms, int) and new_num_sms % 2 == 0 and new_num_sms > 0, \
            f"The SM count must be even (and positive), got {new_num_sms}"
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """Returns an `EventOverlap` holding an event recorded on the current stream (a completed host event on
        the CPU), e.g. for `previous_event`."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """The `num_rdma_bytes` a Buffer needs for low-latency calls of these sizes (DeepEP's formula).

        Args:
            num_max_dispatch_tokens_per_rank: N, the most tokens a rank passes to one low-latency call.
            hidden: the hidden size.
            num_ranks: the group size.
            num_experts: the total number of experts.

        Returns the size in bytes, a multiple of 128."""
        return low_latency_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """DeepEP's tuned dispatch `Config` for a group of `num_ranks` at `Buffer.num_sms` (a rank count DeepEP
        never tuned gets the entry of the nearest tuned count above it: docs/DESIGN.md)."""
        return default_dispatch_config(num_ranks, Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """DeepEP's tuned combine `Config` for a group of `num_ranks`, as `get_dispatch_config`."""
        return default_combine_config(num_ranks, Buffer.num_sms)

    def get_comm_stream(self) -> Optional["torch.cuda.Stream"]:
        """Returns the communication stream (None on the CPU). From this call on, synchronous calls of this Buffer
        run on it too, as in DeepEP, so that work ordered after it follows them; until then they run on the
        caller's stream (Note [synchronous calls on the caller's stream] in streams.py). Calls with a receive
        hook run on the caller's stream either way."""
        self._live("get_comm_stream")
        self._comm_stream.exposed = True   # Note [synchronous calls on the caller's stream]
        return self._comm_stream.stream

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """A view of this rank's raw buffer.

        Args:
            dtype: the element type of the view.
            size: the shape of the view (its first `size.numel()` elements); default every whole element to the end.
            offset: bytes into the buffer where the view starts, a multiple of `dtype`'s size.
            use_rdma_buffer: view the low-latency (`num_rdma_bytes`) buffer instead of the normal-mode
                (`num_nvl_bytes`) one.

        Returns the view (it keeps the memory alive after `destroy()`)."""
        self._live("get_local_buffer_tensor")
        raw = self._rdma_buffer if use_rdma_buffer else self._nvl_buffer
        check_int("offset", offset, minimum=0, maximum=raw.numel())
        element = dtype.itemsize
        if offset % element:
            raise ValueError(f"offset must be a multiple of the element size {element}, got {offset}")
        usable = (raw.numel() - offset) // element * element
        view = raw[offset:offset + usable].view(dtype)
        if size is None:
            return view
        needed = torch.Size(size).numel()
        if needed > view.numel():
            raise ValueError(f"size {tuple(size)} needs {needed} elements but the buffer holds {view.numel()}")
        return view[:needed].view(size)

    # ---- normal mode ---------------------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False
                            ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor, EventOverlap]:
        """Count tokens per rank, per node and per expert from `topk_idx` `[T, K]` (`-1` = no selection).

        Args:
            topk_idx: `[T, K]` `topk_idx_t`, entries in `[0, num_experts)` or -1; `K <= 32`.
            num_experts: total experts, a multiple of the group size (at most 1024 per rank).
            previous_event, async_finish, allocate_on_comm_stream: as in `dispatch`.

        Returns `(num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank [nodes] int32 or None within one
        node, num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool, event)`."""
        self._live("get_dispatch_layout")
        self._refuse_host_wait_in_capture("get_dispatch_layout")
        self._check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
        self._check_topk_idx("topk_idx", topk_idx, num_experts)
        validate = None if self._transport.checks_values_on_device else (
            lambda: check_expert_ids("topk_idx", topk_idx, num_experts))
        result, event = self._comm_stream.run(lambda: self._transport.get_dispatch_layout(topk_idx, num_experts),
                                              (topk_idx,), previous_event, async_finish, validate=validate)
        return (*result, event)

    def dispatch(self, x: Tensors, handle: Optional[tuple] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False
                 ) -> Tuple[Tensors, Optional[torch.Tensor], Optional[torch.Tensor], Optional[List[int]],
                            Optional[tuple], EventOverlap]:
        """Send each token to every rank that holds one of its experts (one copy per rank).

        Args:
            x: `[T, H]` tensor (any dtype with 16-byte rows), or `(data [T, H] 1-byte dtype, scales [T, S]
                float32 or int32, any strides)` for FP8.
            handle: a handle from an earlier dispatch: reuse its routing (cached mode; no top-k arguments).
            num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank, num_tokens_per_expert: the
                outputs of `get_dispatch_layout` (non-cached mode).
            topk_idx: `[T, K]` `topk_idx_t`, entries in `[0, E)` or -1; topk_weights: `[T, K]` float32.
            expert_alignment: round each entry of the per-expert count list up to this multiple.
            num_worst_tokens: if > 0, allocate exactly this many receive rows; the NVLink transport then
                never waits on the host (the reference transport always does).
            config: performance config (default `get_dispatch_config(group_size)`).
            previous_event: run after this event instead of after the current stream's work (so the inputs
                must be complete when it is recorded: later work of the current stream is not waited for).
            async_finish: return without making the current stream wait; wait on the returned event.
            allocate_on_comm_stream: allocate outputs on the comm stream (needs previous_event and async).

        Returns:
            `(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event)`;
            in cached mode `(recv_x, None, None, None, None, event)`. Rows are ordered by (source rank,
            source token); top-k ids are local expert ids or -1 (weight 0).
        """
        self._live("dispatch")
        config = config if config is not None else self._default_config(self.get_dispatch_config)
        num_channels = self._check_config(config)
        self._refuse_host_wait_in_capture("dispatch", host_wait=None if handle is not None or num_worst_tokens else (
            "the host waits for the received count; pass num_worst_tokens (receive buffers of that many rows, "
            "no host wait) or the handle of an earlier dispatch"), num_channels=num_channels)
        self._check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
        data, scales = self._check_dispatch_x(x)
        num_tokens = data.shape[0]
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("dispatch: pass either handle (cached dispatch) or topk_idx/topk_weights, not both")
            handle = tuple(handle) if isinstance(handle, list) else handle   # DeepEP takes a list too
            self._check_handle("handle", handle, num_tokens, num_channels)
            self._check_nvl_capacity("dispatch", config, self._dispatch_row_bytes(data, scales, None))
            run = lambda: self._transport.cached_dispatch(data, scales, handle, num_channels)  # noqa: E731
            inputs: tuple = (data, scales, handle)
        else:
            num_experts = self._check_layout_args(num_tokens, num_tokens_per_rank, num_tokens_per_rdma_rank,
                                                  is_token_in_rank, num_tokens_per_expert)
            if (topk_idx is None) != (topk_weights is None):
                raise ValueError("dispatch: topk_idx and topk_weights must be given together (or both None)")
            if topk_idx is not None:
                self._check_topk_idx("topk_idx", topk_idx, num_experts, num_tokens)
                check_tensor("topk_weights", topk_weights, device=self.device, dtype=torch.float32,
                             shape=tuple(topk_idx.shape))
            check_int("expert_alignment", expert_alignment, minimum=1)
            check_int("num_worst_tokens", num_worst_tokens, minimum=0)
            self._check_nvl_capacity("dispatch", config, self._dispatch_row_bytes(data, scales, topk_idx),
                                     num_experts)

            def check_values() -> None:   # run by the transport on the comm stream, once it has waited
                if topk_idx is not None:
                    check_expert_ids("topk_idx", topk_idx, num_experts)
                if not torch.equal(is_token_in_rank.sum(0, dtype=torch.int32), num_tokens_per_rank):
                    raise ValueError("num_tokens_per_rank must equal the column sums of is_token_in_rank "
                                     "(pass the outputs of one get_dispatch_layout call)")
            run = lambda: self._transport.dispatch(  # noqa: E731
                data, scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                expert_alignment, num_worst_tokens, num_channels,
                check_values=None if self._transport.checks_values_on_device else check_values)
            inputs = (data, scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                      num_tokens_per_expert)
        out, event = self._comm_stream.run(run, inputs, previous_event, async_finish)
        recv_x = (out.recv_x, out.recv_scales) if scales is not None else out.recv_x
        if handle is not None:
            return recv_x, None, None, None, None, event
        return (recv_x, out.recv_topk_idx, out.recv_topk_weights, out.num_recv_tokens_per_expert_list, out.handle,
                event)

    def internode_dispatch(self, x: Tensors, handle: Optional[tuple] = None, num_tokens_per_rank=None,
                           num_tokens_per_rdma_rank=None, is_token_in_rank=None, num_tokens_per_expert=None,
                           topk_idx=None, topk_weights=None, expert_alignment: int = 1, num_worst_tokens: int = 0,
                           config: Optional[Config] = None, previous_event=None, async_finish: bool = False,
                           allocate_on_comm_stream: bool = False):
        """`dispatch` for a group spanning several nodes (kept for DeepEP compatibility; use `dispatch`).
        `config` is required here, as in DeepEP."""
        assert config is not None, "internode_dispatch: config must be given"
        return self.dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                             num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
                             config, previous_event, async_finish, allocate_on_comm_stream)

    def combine(self, x: torch.Tensor, handle: tuple, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[None, torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = None,
                config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        """Send each received row back to its source rank and add up the rows of every token.

        Args:
            x: `[M, H]` bfloat16, rows aligned with the dispatch's `recv_x`.
            handle: the handle of the matching (non-cached) dispatch.
            topk_weights: optional `[M, K]` float32, summed the same way (e.g. gradients of the weights).
            bias: None, a `[T, H]` bfloat16 tensor, or a pair of them, added to the output.
            config, previous_event, async_finish, allocate_on_comm_stream: as in `dispatch`.

        Returns:
            `(combined_x [T, H] bf16, combined_topk_weights [T, K] float32 or None, event)`: fp32 sums,
            starting from the biases, of the rows from the destination ranks in ascending rank order,
            rounded once (across nodes each node's partial sum is rounded first, as DeepEP does).
        """
        self._live("combine")
        config = config if config is not None else self._default_config(self.get_combine_config)
        num_channels = self._check_config(config)
        self._refuse_host_wait_in_capture("combine", num_channels=num_channels)
        self._check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
        handle = tuple(handle) if isinstance(handle, list) else handle   # DeepEP takes a list too
        num_tokens, num_rows = self._check_handle("handle", handle, None, num_channels)
        check_tensor("x", x, device=self.device, dtype=torch.bfloat16, shape=(num_rows, None))
        if x.shape[1] % 8:
            raise ValueError(f"x: hidden size must be a multiple of 8 (16-byte rows), got {x.shape[1]}")
        if topk_weights is not None:
            check_tensor("topk_weights", topk_weights, device=self.device, dtype=torch.float32, shape=(num_rows, None))
            check_int("topk_weights.shape[1]", topk_weights.shape[1], maximum=MAX_TOPK)
        if bias is None:
            biases: Tuple[Optional[torch.Tensor], Optional[torch.Tensor]] = (None, None)
        elif isinstance(bias, torch.Tensor):
            biases = (bias, None)
        else:
            if not isinstance(bias, tuple) or len(bias) != 2:
                raise ValueError("bias must be None, a tensor or a tuple of 2 tensors")
            biases = bias
        for i, b in enumerate(biases):
            if b is not None:
                check_tensor(f"bias[{i}]", b, device=self.device, dtype=torch.bfloat16, shape=(num_tokens, x.shape[1]))
        topk = 0 if topk_weights is None else topk_weights.shape[1]
        self._check_nvl_capacity("combine", config, x.shape[1] * 2 + 4 + topk * 4)
        run = lambda: self._transport.combine(x, handle, topk_weights, biases, num_channels)  # noqa: E731
        (combined, combined_weights), event = self._comm_stream.run(run, (x, topk_weights, biases, handle),
                                                                     previous_event, async_finish)
        return combined, combined_weights, event

    def internode_combine(self, x: torch.Tensor, handle: tuple, topk_weights=None, bias=None,
                          config: Optional[Config] = None, previous_event=None, async_finish: bool = False,
                          allocate_on_comm_stream: bool = False):
        """`combine` for a group spanning several nodes (kept for DeepEP compatibility; use `combine`).
        `config` is required here, as in DeepEP."""
        assert config is not None, "internode_combine: config must be given"
        return self.combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                            allocate_on_comm_stream)

    # ---- low-latency mode ---------------------------------------------------------------------------------
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Reset the low-latency area (collective). Receive hooks not yet called are discarded (calling one
        afterwards raises).

        Args:
            num_max_dispatch_tokens_per_rank, hidden, num_experts: the sizes of the low-latency calls that follow."""
        self._live("clean_low_latency_buffer")
        self._refuse_capture("clean_low_latency_buffer", "it waits for the GPU and the other ranks on the host")
        self._require_low_latency("clean_low_latency_buffer")
        self._check_low_latency_capacity(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        self._slots.reset("clean_low_latency_buffer")   # refused here, before any collective, if a hook runs
        self._receive_streams = [None, None]   # the clean waits for the GPU: nothing earlier is left to order
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)   # nothing of this rank in flight once the barrier passes
        self._transport.check_low_latency_errors()   # a GPU wait that timed out names its peer, not the barrier
        if self._group.roll_call is not None:   # shrink mode: ranks that do not come are masked
            self._group.clean_roll_call(self._mask)
            self._transport.clean_low_latency(num_max_dispatch_tokens_per_rank, hidden, num_experts)
            self._group.mask_absent("clean_low_latency_buffer", self._mask)
            return
        ranks = unmasked_ranks(self._mask, self.rank)   # ranks masked as failed may no longer call
        self._group.barrier("clean_low_latency_buffer", ranks)
        self._transport.clean_low_latency(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        self._group.barrier("clean_low_latency_buffer", ranks)

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False
                             ) -> Tuple[Tensors, torch.Tensor, tuple, EventOverlap, Optional[Callable[[], None]]]:
        """Send every (token, top-k slot) to its expert, packed per local expert (decode path).

        Args:
            x: `[T, H]` bfloat16 with `T <= num_max_dispatch_tokens_per_rank`.
            topk_idx: `[T, K]` `topk_idx_t`, entries in `[0, num_experts)` or -1; `K <= 32`.
            num_max_dispatch_tokens_per_rank: N, the same on every rank.
            num_experts: total experts, a multiple of the group size.
            cumulative_local_expert_recv_stats: optional int32 `[E_loc]`, incremented by the rows received.
            dispatch_wait_recv_cost_stats: optional int64 `[R]`, incremented by the wait per source rank.
            use_fp8: quantise to e4m3 with per-128-channel scales; round_scale: power-of-two scales;
                use_ue8m0: return the scales as packed exponents (needs round_scale).
            async_finish: return an event to wait on instead of making the current stream wait.
            return_recv_hook: only send now; the returned hook completes the receive (no resident kernel).
                Not together with async_finish.

        Returns:
            `(recv_x, recv_count, handle, event, hook)`: recv_x is `[E_loc, R*N, H]` bf16 or a tuple
            `(e4m3 data, scales)` with scales column-major in the last two dims; rows of an expert are
            grouped by source rank (then source token), `recv_count[e]` of them valid. handle =
            `(src_info, layout_range, N, H, E)`.
        """
        self._live("low_latency_dispatch")
        self._refuse_host_wait_in_capture("low_latency_dispatch", low_latency=True)
        self._require_low_latency("low_latency_dispatch")
        num_tokens, hidden = self._check_low_latency_x(x, num_max_dispatch_tokens_per_rank)
        self._check_low_latency_flags(async_finish, return_recv_hook)
        experts_per_rank = self._check_num_experts(num_experts)
        self._check_topk_idx("topk_idx", topk_idx, num_experts, num_tokens)
        if use_fp8 and hidden % 8:
            raise ValueError(f"x: hidden size must be a multiple of 8 for FP8, got {hidden}")
        if use_fp8 and use_ue8m0 and not round_scale:   # BF16 ignores both, as in DeepEP
            raise ValueError("use_ue8m0=True requires round_scale=True")
        if cumulative_local_expert_recv_stats is not None:
            check_tensor("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats,
                         device=self.device, dtype=torch.int32, shape=(experts_per_rank,))
        self._check_wait_stats("dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats)
        self._check_low_latency_capacity(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        self._transport.check_low_latency_errors()
        half = self._slots.next_free("low_latency_dispatch")
        # BF16 ignores round_scale and use_ue8m0: ranks may differ in them
        options = LowLatencyOptions(use_fp8, use_fp8 and round_scale, use_fp8 and use_ue8m0)
        check_values = self._low_latency_check_values(topk_idx, num_experts)

        def launch():
            result = self._transport.low_latency_dispatch(
                x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, options, self._mask,
                dispatch_wait_recv_cost_stats, half, return_recv_hook, check_values=check_values)
            self._slots.take(half)   # a call refused before it sent leaves the halves as they were
            return result

        def finish(out):
            if cumulative_local_expert_recv_stats is not None:
                cumulative_local_expert_recv_stats.add_(out.recv_count)

        out, event, hook = self._run_low_latency(launch, finish, half, "low_latency_dispatch", async_finish,
                                                 return_recv_hook, (x, topk_idx))
        recv_x = (out.recv_x, out.recv_scales) if use_fp8 else out.recv_x
        handle = (out.src_info, out.layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts)
        if hook is not None:
            hook.output = out.src_info
        if async_finish:
            event.extra_tensors = (x, topk_idx, out.recv_x, out.recv_scales, out.recv_count, out.src_info,
                                   out.layout_range, cumulative_local_expert_recv_stats)
        return recv_x, out.recv_count, handle, event, hook

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: tuple, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None
                            ) -> Tuple[torch.Tensor, EventOverlap, Optional[Callable[[], None]]]:
        """Send expert outputs back and reduce them per token, weighted by `topk_weights`.

        Args:
            x: `[E_loc, R*N, H]` bfloat16 expert outputs, rows aligned with the dispatch.
            topk_idx, topk_weights: `[T, K]` routing of the matching dispatch (entries may become -1).
            handle: from `low_latency_dispatch`.
            use_logfmt: compress the returned rows with LogFMT-10 (lossy).
            zero_copy: the outputs were already written into `get_next_low_latency_combine_buffer(handle)`
                (not together with use_logfmt).
            async_finish, return_recv_hook: as in `low_latency_dispatch` (not both).
            out: optional `[T, H]` bfloat16 tensor to write the result into (returned).
            combine_wait_recv_cost_stats: optional int64 `[R]` wait statistics.

        Returns:
            `(combined_x [T, H] bf16, event, hook)`: bf16 of the fp32 sum over k of `w[t, k] * row`.
        """
        self._live("low_latency_combine")
        self._refuse_host_wait_in_capture("low_latency_combine", low_latency=True)
        self._require_low_latency("low_latency_combine")
        self._check_low_latency_flags(async_finish, return_recv_hook)
        if zero_copy and use_logfmt:
            raise ValueError("low_latency_combine: zero_copy and use_logfmt cannot be combined")
        src_info, layout_range, num_max_tokens, hidden, num_experts = self._check_low_latency_handle(handle)
        self._slots.check_next("low_latency_combine")   # that misuse first: it is reported as such
        receiving = self._slots.receiving(src_info)
        if receiving is not None:
            raise ValueError(f"handle: {receiving.describe()} before low_latency_combine (it returned this handle)")
        experts_per_rank = num_experts // self.group_size
        check_tensor("x", x, device=self.device, dtype=torch.bfloat16,
                     shape=(experts_per_rank, self.group_size * num_max_tokens, hidden))
        check_tensor("topk_idx", topk_idx, device=self.device, dtype=topk_idx_t, dim=2)
        num_tokens = topk_idx.shape[0]
        if num_tokens > num_max_tokens:
            raise ValueError(f"topk_idx: at most num_max_dispatch_tokens_per_rank={num_max_tokens} rows, got {num_tokens}")
        check_tensor("topk_weights", topk_weights, device=self.device, dtype=torch.float32, shape=tuple(topk_idx.shape))
        if out is not None:
            check_tensor("out", out, device=self.device, dtype=torch.bfloat16, shape=(num_tokens, hidden))
        self._check_wait_stats("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats)
        self._check_low_latency_capacity(num_max_tokens, hidden, num_experts)
        source = self._combine_send_view(self._slots.next_half, experts_per_rank, num_max_tokens, hidden) \
            if zero_copy else x
        self._transport.check_low_latency_errors()
        half = self._slots.next_free("low_latency_combine")
        result = out if out is not None else torch.empty((num_tokens, hidden), dtype=torch.bfloat16, device=self.device)
        check_values = self._low_latency_check_values(topk_idx, num_experts)

        def launch():
            receive = self._transport.low_latency_combine(source, topk_idx, topk_weights, src_info, layout_range,
                                                          num_max_tokens, use_logfmt, self._mask, result,
                                                          combine_wait_recv_cost_stats, half, return_recv_hook,
                                                          check_values=check_values)
            self._slots.take(half)
            return result, receive

        # `result` is allocated on the caller's stream and written on the comm stream: an input to mark for it
        _, event, hook = self._run_low_latency(launch, None, half, "low_latency_combine", async_finish,
                                               return_recv_hook, (x, topk_idx, topk_weights, result))
        if async_finish:
            event.extra_tensors = (x, topk_idx, topk_weights, src_info, layout_range, result)
        return result, event, hook

    def get_next_low_latency_combine_buffer(self, handle: tuple) -> torch.Tensor:
        """The area the next low-latency combine sends from: write the expert outputs there and call
        `low_latency_combine(..., zero_copy=True)`.

        Args:
            handle: from the `low_latency_dispatch` the combine belongs to.

        Returns a bf16 `[E_loc, R*N, H]` view whose rows are `H + 2 * (H // 128)` elements apart (DeepEP's
        `H + H/64` for multiples of 128; docs/DESIGN.md)."""
        self._live("get_next_low_latency_combine_buffer")
        self._require_low_latency("get_next_low_latency_combine_buffer")
        _, _, num_max_tokens, hidden, num_experts = self._check_low_latency_handle(handle)
        self._check_low_latency_capacity(num_max_tokens, hidden, num_experts)
        return self._combine_send_view(self._slots.next_half, num_experts // self.group_size, num_max_tokens, hidden)

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mark or unmark a rank as failed; low-latency calls skip masked ranks. Shrink mode only
        (`enable_shrink=True`), as the two methods below.

        Args:
            rank_to_mask: the group rank.
            mask: True marks it, False unmarks it (unmasking wants a `clean_low_latency_buffer` on every rank
                before the next low-latency call: docs/DESIGN.md, "NVLink low-latency path")."""
        self._require_shrink("low_latency_update_mask_buffer")
        check_int("rank_to_mask", rank_to_mask, minimum=0, maximum=self.group_size - 1)
        self._mask[rank_to_mask] = 1 if mask else 0

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Copy the mask into `mask_status`.

        Args:
            mask_status: an int32 tensor of `group_size` elements, any layout; receives 1 per masked rank, else 0."""
        self._require_shrink("low_latency_query_mask_buffer")
        check_tensor("mask_status", mask_status, device=mask_status.device, dtype=torch.int32, contiguous=False)
        if mask_status.numel() != self.group_size:
            raise ValueError(f"mask_status must have {self.group_size} elements, got {mask_status.numel()}")
        mask_status.copy_(self._mask.view(mask_status.shape))

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank (as unmasking one rank, it wants a `clean_low_latency_buffer` afterwards)."""
        self._require_shrink("low_latency_clean_mask_buffer")
        self._mask.zero_()

    # ---- low-latency plumbing -----------------------------------------------------------------------------
    def _run_low_latency(self, launch, finish, half: int, name: str, async_finish: bool, return_recv_hook: bool,
                         inputs: tuple):
        """Launch, then either return a hook, or receive at once on the comm stream (async) / current stream."""

        def receive_and_finish(out, receive):
            receive()
            if finish is not None:
                finish(out)
            return out

        ordered = self.device.type == "cuda" and not capturing(self.device)
        if ordered:   # inside a CUDA-graph capture the captured order holds
            self._order_after_last_receive(
                half, return_recv_hook or self._comm_stream.runs_on_caller(None, async_finish))
        if return_recv_hook:
            stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
            if self._low_latency_async and ordered:
                # an asynchronous low-latency call before this one may still run on the comm stream: calls
                # must reach the GPU in order (they share the buffer halves)
                stream.wait_stream(self._comm_stream.stream)
            self._low_latency_async = False
            if stream is not None and torch._C._cuda_getDevice() != self.device.index:
                with torch.cuda.stream(stream):   # a caller whose current device is another (a fresh thread)
                    out, receive = without_autograd(launch)
            else:
                out, receive = without_autograd(launch)

            def complete():
                if stream is None:
                    without_autograd(lambda: receive_and_finish(out, receive))
                    return
                with torch.cuda.stream(stream):   # also when the hook runs on another thread
                    without_autograd(lambda: receive_and_finish(out, receive))

            # Note [hooks hold no Buffer]
            device = self.device
            capturable = self._transport.low_latency_receive_capturable(not ordered and device.type == "cuda")
            hook = ReceiveHook(complete, name, None if capturable else (
                lambda: _refuse_capture(device, f"the receive hook of {name}", _LOW_LATENCY_HOST_WAIT)))
            self._slots.hold(half, hook)
            return out, EventOverlap(None), hook

        out, event = self._comm_stream.run(lambda: receive_and_finish(*launch()), inputs, None, async_finish)
        self._low_latency_async = async_finish
        return out, event, None

    def _order_after_last_receive(self, half: int, on_caller: bool) -> None:
        """The send of a low-latency call overwrites what the last call on its half received: if that receive
        was issued on another stream than this call's, the caller's stream (which the comm stream waits for)
        waits for it. A call runs on the caller's stream (`on_caller`: with a hook, whose receive runs there too,
        or synchronously, Note [synchronous calls on the caller's stream]) or on the comm stream, in order."""
        comm = self._comm_stream
        current, current_stream = comm.caller()
        issued_on = current if on_caller else comm.stream_ids
        previous = self._receive_streams[half]
        if previous is not None and previous not in (current, issued_on):
            current_stream.wait_stream(stream_of(previous))
        self._receive_streams[half] = issued_on

    def _combine_send_view(self, half: int, experts_per_rank: int, num_max_tokens: int, hidden: int) -> torch.Tensor:
        layout = LowLatencyLayout(num_max_tokens, hidden, experts_per_rank * self.group_size)
        row = hidden + 2 * (hidden // 128)   # a combine message is 2 * H + 4 * (H // 128) bytes
        slots = self.group_size * num_max_tokens
        start = layout.send_offset(half)
        area = self._rdma_buffer[start:start + experts_per_rank * slots * row * 2].view(torch.bfloat16)
        return area.view(experts_per_rank, slots, row)[:, :, :hidden]

    def _require_low_latency(self, what: str) -> None:
        if not self.low_latency_mode:
            raise ValueError(f"{what}: the Buffer was built with low_latency_mode=False; pass low_latency_mode=True")

    def _require_shrink(self, what: str) -> None:
        self._live(what)
        if not self.enable_shrink:
            raise ValueError(f"{what}: Shrink mode must be enabled (Buffer(..., enable_shrink=True))")

    def _check_low_latency_flags(self, async_finish: bool, return_recv_hook: bool) -> None:
        if async_finish and return_recv_hook:
            raise ValueError("async_finish and return_recv_hook cannot both be True")

    def _check_low_latency_x(self, x: torch.Tensor, num_max_tokens: int) -> Tuple[int, int]:
        check_int("num_max_dispatch_tokens_per_rank", num_max_tokens, minimum=1)
        check_tensor("x", x, device=self.device, dtype=torch.bfloat16, dim=2)
        num_tokens, hidden = x.shape
        if num_tokens > num_max_tokens:
            raise ValueError(f"x: at most num_max_dispatch_tokens_per_rank={num_max_tokens} tokens, got {num_tokens}")
        if hidden % 8 or hidden == 0:
            raise ValueError(f"x: hidden size must be a positive multiple of 8, got {hidden}")
        return num_tokens, hidden

    def _check_low_latency_capacity(self, num_max_tokens: int, hidden: int, num_experts: int) -> None:
        key = (num_max_tokens, hidden, num_experts)
        if type(num_max_tokens) is int and type(hidden) is int and type(num_experts) is int \
                and key in self._low_latency_sizes_that_fit:
            return
        self._check_num_experts(num_experts)
        needed = low_latency_area_bytes(num_max_tokens, hidden, num_experts)   # what DeepEP asserts
        if self.num_rdma_bytes >= needed:
            self._low_latency_sizes_that_fit.add(key)
        else:
            raise ValueError(f"num_rdma_bytes={self.num_rdma_bytes} is too small for low-latency calls with N="
                             f"{num_max_tokens}, hidden={hidden}, num_experts={num_experts}: need >= {needed} "
                             "(Buffer.get_low_latency_rdma_size_hint)")

    def _low_latency_check_values(self, topk_idx: torch.Tensor, num_experts: int) -> Optional[Callable[[], None]]:
        """The expert-id check the transport runs before its first exchange, unless its kernels check them."""
        if self._transport.low_latency_checks_values_on_device:
            return None
        return lambda: check_expert_ids("topk_idx", topk_idx, num_experts)

    def _check_low_latency_handle(self, handle) -> Tuple[torch.Tensor, torch.Tensor, int, int, int]:
        """The handle's parts, checked; a tuple checked by the call before is not checked again (a tuple's
        items cannot change; the tensors' shapes could only through in-place resizing)."""
        checked, parts = self._checked_low_latency_handle
        if handle is checked and isinstance(handle, tuple):
            return parts
        if not isinstance(handle, (tuple, list)) or len(handle) != 5:
            raise ValueError("handle must be the 5-tuple returned by low_latency_dispatch")
        src_info, layout_range, num_max_tokens, hidden, num_experts = handle
        experts_per_rank = self._check_num_experts(num_experts)
        check_tensor("handle[0] (src_info)", src_info, device=self.device, dtype=torch.int32,
                     shape=(experts_per_rank, self.group_size * num_max_tokens))
        check_tensor("handle[1] (layout_range)", layout_range, device=self.device, dtype=torch.int64,
                     shape=(experts_per_rank, self.group_size))
        parts = (src_info, layout_range, num_max_tokens, hidden, num_experts)
        self._checked_low_latency_handle = (handle, parts)
        return parts

    def _check_wait_stats(self, name: str, stats: Optional[torch.Tensor]) -> None:
        if stats is not None:
            check_tensor(name, stats, device=self.device, dtype=torch.int64, shape=(self.group_size,))

    # ---- shared checks ------------------------------------------------------------------------------------
    def _check_num_experts(self, num_experts: int, name: str = "num_experts") -> int:
        """Experts per rank; ValueError naming `name` (what gave the expert count)."""
        check_int(name, num_experts, minimum=1)
        if num_experts % self.group_size:
            raise ValueError(f"{name}: the expert count must be a multiple of the group size {self.group_size}, "
                             f"got {num_experts}")
        experts_per_rank = num_experts // self.group_size
        if experts_per_rank > MAX_EXPERTS_PER_RANK:
            raise ValueError(f"{name}: at most {MAX_EXPERTS_PER_RANK} experts per rank, got {experts_per_rank}")
        return experts_per_rank

    def _check_topk_idx(self, name: str, topk_idx: torch.Tensor, num_experts: int,
                        num_tokens: Optional[int] = None, values: bool = False) -> None:
        """Dtype, shape and top-k width; with `values`, also the expert ids (reads the tensor: only where it is
        complete on the current stream)."""
        self._check_num_experts(num_experts)
        check_tensor(name, topk_idx, device=self.device, dtype=topk_idx_t, dim=2)
        if num_tokens is not None and topk_idx.shape[0] != num_tokens:
            raise ValueError(f"{name} must have {num_tokens} rows (one per token of x), got {topk_idx.shape[0]}")
        if topk_idx.shape[1] > MAX_TOPK or topk_idx.shape[1] < 1:
            raise ValueError(f"{name}: top-k must be in [1, {MAX_TOPK}], got {topk_idx.shape[1]}")
        if values:
            check_expert_ids(name, topk_idx, num_experts)

    def _default_config(self, make: Callable[[int], Config]) -> Config:
        """`make(group size)` for the current `Buffer.num_sms`, built once (never handed to the caller, who
        could change it)."""
        key = (make, Buffer.num_sms)
        config = self._default_configs.get(key)
        if config is None:
            config = self._default_configs[key] = make(self.group_size)
        return config

    def _check_config(self, config: Config) -> int:
        if not isinstance(config, Config):
            raise TypeError(f"config must be a deep_ep.Config, got {type(config).__name__}")
        if config.num_sms < 2 or config.num_sms % 2:
            raise ValueError(f"config.num_sms must be even and >= 2, got {config.num_sms}")
        return config.num_channels

    def _check_stream_args(self, previous_event, async_finish: bool, allocate_on_comm_stream: bool) -> None:
        if previous_event is not None and not isinstance(previous_event, EventOverlap):
            raise TypeError(f"previous_event must be an EventOverlap or None, got {type(previous_event).__name__}")
        if allocate_on_comm_stream and (previous_event is None or previous_event.event is None or not async_finish):
            raise ValueError("allocate_on_comm_stream=True requires previous_event (an EventOverlap holding an "
                             "event) and async_finish=True")

    def _check_dispatch_x(self, x: Tensors) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if isinstance(x, tuple):
            if len(x) != 2:
                raise ValueError("x must be a tensor or a (data, scales) tuple")
            data, scales = x
            check_tensor("x[0] (data)", data, device=self.device, dim=2)
            if data.element_size() != 1:
                raise TypeError(f"x[0] (data) must have a 1-byte dtype (e.g. torch.float8_e4m3fn), got {data.dtype}")
            check_tensor("x[1] (scales)", scales, device=self.device, dtype=(torch.float32, torch.int32), dim=2,
                         contiguous=False)
            if scales.shape[0] != data.shape[0]:
                raise ValueError(f"x[1] (scales) must have {data.shape[0]} rows, got {scales.shape[0]}")
            if scales.shape[1] == 0:   # any other count will do: scales are moved, never interpreted
                raise ValueError("x[1] (scales): at least one scale per token, got 0")
        else:
            data, scales = check_tensor("x", x, device=self.device, dim=2), None
        if (data.shape[1] * data.element_size()) % 16 or data.shape[1] == 0:
            raise ValueError(f"x: a row must be a positive multiple of 16 bytes, got hidden={data.shape[1]} "
                             f"of {data.dtype}")
        return data, scales

    @staticmethod
    def _dispatch_row_bytes(data: torch.Tensor, scales: Optional[torch.Tensor], topk_idx: Optional[torch.Tensor]) -> int:
        """Bytes one token occupies in a dispatch ring slot: payload, source index, top-k ids and weights, scales."""
        topk = 0 if topk_idx is None else topk_idx.shape[1]
        num_scales = 0 if scales is None else scales.shape[1]
        return data.shape[1] * data.element_size() + 4 + topk * (topk_idx_t.itemsize + 4) + num_scales * 4

    def _check_layout_args(self, num_tokens, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                           num_tokens_per_expert) -> int:
        for name, value in (("num_tokens_per_rank", num_tokens_per_rank), ("is_token_in_rank", is_token_in_rank),
                            ("num_tokens_per_expert", num_tokens_per_expert)):
            if value is None:
                raise ValueError(f"dispatch: {name} is required without a handle (from get_dispatch_layout)")
        check_tensor("num_tokens_per_rank", num_tokens_per_rank, device=self.device, dtype=torch.int32,
                     shape=(self.group_size,))
        check_tensor("is_token_in_rank", is_token_in_rank, device=self.device, dtype=torch.bool,
                     shape=(num_tokens, self.group_size))
        check_tensor("num_tokens_per_expert", num_tokens_per_expert, device=self.device, dtype=torch.int32, dim=1)
        num_experts = num_tokens_per_expert.numel()
        self._check_num_experts(num_experts, "num_tokens_per_expert (one entry per expert)")
        if self.topology.is_internode:
            if num_tokens_per_rdma_rank is None:
                raise ValueError("dispatch: num_tokens_per_rdma_rank is required across nodes (from get_dispatch_layout)")
            check_tensor("num_tokens_per_rdma_rank", num_tokens_per_rdma_rank, device=self.device, dtype=torch.int32,
                         shape=(self.topology.num_nodes,))
        return num_experts

    def _check_nvl_capacity(self, what: str, config: Config, row_bytes: int, num_experts: int = 0) -> None:
        needed = nvl_bytes_needed(config, row_bytes, self.group_size, self.topology.ranks_per_node, num_experts)
        if self.num_nvl_bytes < needed:
            raise ValueError(f"num_nvl_bytes={self.num_nvl_bytes} is too small for this {what}: need >= {needed} "
                             "(Config.get_nvl_buffer_size_hint gives a size that fits)")

    def _check_handle(self, name: str, handle, num_tokens: Optional[int], num_channels: int) -> Tuple[int, int]:
        """Check a normal-mode handle; returns (tokens of the source batch, received rows)."""
        checked, results = self._checked_handle
        if checked is handle and (num_tokens, num_channels) in results:
            return results[(num_tokens, num_channels)]
        num_ranks, topo = self.group_size, self.topology
        expected_len = 10 if topo.is_internode else 6
        if not isinstance(handle, tuple) or len(handle) != expected_len:
            raise ValueError(f"{name} must be the {expected_len}-tuple returned by a non-cached dispatch of this Buffer")
        if not all(isinstance(t, torch.Tensor) for t in handle):
            raise ValueError(f"{name} must be the {expected_len}-tuple of tensors returned by a non-cached dispatch")
        # the prefix tensors as (position in the handle, tensor, expected shape), and the tensor with a row per
        # received row
        if topo.is_internode:
            (is_token_in_rank, rdma_channel_prefix_matrix, gbl_channel_prefix_matrix, recv_rdma_channel_prefix_matrix,
             recv_rdma_rank_prefix_sum, recv_gbl_channel_prefix_matrix, recv_gbl_rank_prefix_sum, recv_src_meta,
             _send_rdma_head, _send_nvl_head) = handle
            prefixes = ((1, rdma_channel_prefix_matrix, (topo.num_nodes, num_channels)),
                        (2, gbl_channel_prefix_matrix, (num_ranks, num_channels)),
                        (3, recv_rdma_channel_prefix_matrix, (topo.num_nodes, num_channels)),
                        (4, recv_rdma_rank_prefix_sum, (topo.num_nodes,)),
                        (5, recv_gbl_channel_prefix_matrix, (num_ranks, num_channels)),
                        (6, recv_gbl_rank_prefix_sum, (num_ranks,)))
            received_rows = recv_src_meta
        else:
            (rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank,
             _send_head) = handle
            prefixes = ((0, rank_prefix_matrix, (num_ranks, num_ranks)),
                        (1, channel_prefix_matrix, (num_ranks, num_channels)),
                        (2, recv_channel_prefix_matrix, (num_ranks, num_channels)))
            received_rows = recv_src_idx
        if is_token_in_rank.dim() == 2 and num_tokens is not None and is_token_in_rank.shape[0] != num_tokens:
            raise ValueError(f"x has {num_tokens} tokens but the dispatch that made {name} had "
                             f"{is_token_in_rank.shape[0]}: pass the tokens of that batch")
        check_tensor(f"{name} (is_token_in_rank)", is_token_in_rank, device=self.device, dtype=torch.bool,
                     shape=(num_tokens, num_ranks))
        for index, tensor, shape in prefixes:
            if tensor.dim() == 2 and len(shape) == 2 and tensor.shape[0] == shape[0] and tensor.shape[1] != shape[1]:
                raise ValueError(f"{name} was made with config.num_sms={2 * tensor.shape[1]} but this call uses "
                                 f"num_sms={2 * num_channels}; use the same num_sms for a handle's dispatch, cached "
                                 "dispatches and combines")
            check_tensor(f"{name}[{index}]", tensor, device=self.device, dtype=torch.int32, shape=shape)
        if received_rows.dim() < 1:
            raise ValueError(f"{name} does not hold the received rows")
        if not topo.is_internode:   # the NVLink combine reads the source token of every received row
            check_tensor(f"{name}[3] (recv_src_idx)", recv_src_idx, device=self.device, dtype=torch.int32, dim=1)
        if checked is not handle:
            self._checked_handle = (handle, {})
        result = (is_token_in_rank.shape[0], received_rows.shape[0])
        self._checked_handle[1][(num_tokens, num_channels)] = result
        return result

    def __repr__(self) -> str:
        state = "destroyed" if self.runtime is None else self.transport_name
        return (f"Buffer(rank={self.rank}, group_size={self.group_size}, ranks_per_node="
                f"{self.topology.ranks_per_node}, device={self.device}, transport={state}, "
                f"low_latency_mode={self.low_latency_mode})")
