"""Low-latency dispatch and combine over a peer-mapped area (ll_dispatch.py and ll_combine.py hold the
protocols).

Note [areas]: the area is the Buffer's `num_rdma_bytes`, laid out as config.LowLatencyLayout says (DeepEP's
`[signal0][signal1][send0][send1][recv0][recv1]`), so the size hint and the zero-copy combine view keep their
meaning. Inside a half: the signal area holds ARRIVED (R int64) and RECEIVED (int64); the receive area holds
MASKS, then SLOTS (dispatch) or ROWS (combine), which share the space because a half serves one call at a
time, and a sender waits until every destination has received the previous call on the half. The send areas
are only read (zero-copy combine input). DeepEP sizes the signal area from the expert count (4 bytes each,
rounded up to 128); where that is too small for the counters (16 ranks or more with at most 2 experts per
rank), both halves' counters sit at the end of the area instead, a place that does not depend on the call's
shape either, and the last receive area's use stops short of them.

Nothing waits on the host, so dispatch and combine can be captured in a CUDA graph. Expert ids are checked on
the GPU; bad ones count as no selection and are reported at the next low-latency call of the rank that passed
them, like timeouts.

Note [fused]: each operation is one kernel (ll_dispatch_kernel, ll_combine_kernel, which profilers show as
deep_ep::low_latency::dispatch() and ::combine(), one name per operation as DeepEP's), launched in one of three
ways. With a receive hook, a call is two launches: the send, which returns at once, and the receive, which the
hook launches. Without one, and with at most FUSED_MAX_TOKENS tokens, one launch sends and then receives (one
launch and one gap between graph nodes less, but the receive runs on the send's NUM_SENDERS programs of
NUM_WARPS warps); its programs wait for each other, so it is launched as a cooperative grid, which CUDA runs
only with all programs resident at once (settings.LL_FUSED off: never).

Note [receive grids]: a receive launch has up to RECV_PROGRAMS_PER_SM programs of RECV_WARPS warps per SM. The
dispatch receive takes one local expert per program, the combine receive a few (token, chunk) items: the
kernel lasts as long as its busiest program, and small programs keep their block-wide reductions cheap. A
dispatch receive program holds its expert's table of R * N entries and RECV_ROWS payload rows in registers:
above RECV_SMALL_TABLE entries or RECV_SMALL_TILE payload words it keeps NUM_WARPS warps (with RECV_WARPS,
ptxas spills registers there). How many programs an SM holds at once depends on their registers.

Note [PDL]: the send and receive launches are programmatic dependents of the stream's previous kernel: each
launches as the previous one's programs end and waits on the GPU for its writes. On sm_90 only, where it is
tested (CUDA-graph capture with PDL launches has failed on other architectures), and where Triton can ask for
it; PDL (a test's switch) forces it on (sm_90 and later) or off.
"""
from __future__ import annotations

from typing import Any, Dict, NamedTuple, Optional, Tuple

import torch

from ...config import LowLatencyLayout, _round_up
from ...fp8 import num_scale_groups
from ...group import Group, Topology
from ...streams import allocate_outputs
from ..base import LowLatencyDispatchOutput, LowLatencyOptions
from ..kept import Keeper
from . import settings
from .launcher import Pointer, Relaunch, current_raw_stream, launch_options, next_pow2

NUM_SENDERS = 128         # send programs (the grid of every send and fused launch); the same on all ranks
NUM_WARPS = 8             # warps of a send or fused program
RECV_ROWS = 4             # rows a dispatch receive program copies at once
COMBINE_SEND_ROWS = 4     # rows a combine send program moves at once
COMBINE_TILE = 8192       # values of the K rows a combine receive program loads at once
RECV_PROGRAMS_PER_SM = 4  # (Note [receive grids])
RECV_WARPS = 4
RECV_SMALL_TABLE = 256
RECV_SMALL_TILE = 8192
FUSED_MAX_TOKENS = 4      # most tokens for which a call without a hook is one launch (Note [fused])
PDL: Optional[bool] = None   # programmatic dependent launches: None where tested, True / False forced (Note [PDL])
MAX_SHRINK_RANKS = 64     # shrink mode: the open ranks travel as the bits of an int64 (sync.rank_bits)

# The kernel parameters that change from call to call, in the order each launch takes their values; the others
# are fixed per call shape (_dispatch_plan, _combine_plan).
_DISPATCH_SEND = ("x_ptr", "idx_ptr", "num_tokens", "mask_ptr", "route_ptr")
_DISPATCH_OUTPUTS = ("stats_ptr", "out_x_ptr", "out_scales_ptr", "src_info_ptr", "layout_ptr", "count_ptr")
_DISPATCH_RECEIVE = ("mask_ptr", "route_ptr") + _DISPATCH_OUTPUTS
_DISPATCH_FUSED = _DISPATCH_SEND + _DISPATCH_OUTPUTS
_COMBINE_SEND = ("x_ptr", "layout_ptr", "route_ptr", "mask_ptr")
_COMBINE_TOKENS = ("idx_ptr", "weights_ptr", "out_ptr", "num_tokens", "stats_ptr")
_COMBINE_RECEIVE = ("x_ptr", "route_ptr", "mask_ptr") + _COMBINE_TOKENS   # (x_ptr: the own rows, Note [own rows])
_COMBINE_FUSED = _COMBINE_SEND + _COMBINE_TOKENS


class _DispatchPlan(NamedTuple):
    """What a dispatch of one shape needs besides its tensors. The launches (Note [fused]) take the values of
    the parameters _DISPATCH_SEND, _DISPATCH_RECEIVE and _DISPATCH_FUSED name, in that order."""
    send: Relaunch
    receive: Relaunch
    fused: Optional[Relaunch]        # None where this GPU cannot fuse
    x_shape: Tuple[int, int, int]    # recv_x: [E_loc, R * N, hidden]
    scale_shape: Tuple[int, int, int]   # recv_scales before its transpose: [E_loc, scale words, R * N]
    count_shape: Tuple[int]          # recv_count: [E_loc]
    table_shape: Tuple[int, int]     # src_info: [E_loc, R * N]
    range_shape: Tuple[int, int]     # layout_range: [E_loc, R]
    route_size: int                  # the route: E_loc * R * N entries, then OWN (N * K; ll_dispatch.py)


class _CombinePlan(NamedTuple):
    """What a combine of one shape needs besides its tensors: launches as _DispatchPlan's (_COMBINE_SEND,
    _COMBINE_RECEIVE with its grid, _COMBINE_FUSED)."""
    send: Relaunch
    receive: Relaunch
    fused: Optional[Relaunch]        # None where this GPU cannot fuse
    chunk: int                       # channels of a receive program's item


def _nothing() -> None:
    """The receive step of a call whose kernel already received."""


def _chain_launches(device: torch.device) -> bool:
    """Whether the send and receive launches are programmatic dependents of the previous kernel (Note [PDL])."""
    major = torch.cuda.get_device_capability(device)[0]
    wanted = major == 9 if PDL is None else PDL and major >= 9
    return wanted and "launch_pdl" in (launch_options() or ())


class _Geometry:
    """Where a call's areas sit in a half, for (N, hidden, num_experts), this group and an area of `area_bytes`."""

    def __init__(self, num_ranks: int, num_max_tokens: int, hidden: int, num_experts: int, half: int,
                 area_bytes: int) -> None:
        layout = LowLatencyLayout(num_max_tokens, hidden, num_experts)
        self.layout = layout
        self.counter_bytes = 8 * num_ranks + 8
        self.masks = layout.recv_offset(half)
        end = self.masks + layout.recv_bytes
        if self.counter_bytes <= layout.signal_bytes:
            self.signal = layout.signal_offset(half)
        else:   # (Note [areas])
            stride = _round_up(self.counter_bytes, 16)
            top = (area_bytes - 2 * stride) // 16 * 16
            self.signal = top + half * stride
            end = min(end, top)
        self.arrived = self.signal                        # ARRIVED[R] int64
        self.received = self.signal + 8 * num_ranks       # RECEIVED int64
        self.masks_bytes = _round_up(num_experts * num_max_tokens * 4, 16)
        self.data = self.masks + self.masks_bytes
        self.data_bytes = end - self.data


class NVLinkLowLatency:
    """Low-latency calls of one rank: the peer-mapped area, the per-half receive counts and the routes that
    let a combine return every row to its (token, slot)."""

    def __init__(self, topology: Topology, area: torch.Tensor, peers: Any, status: torch.Tensor,
                 timeout_ns: int, num_sms: int, auto_mask: bool = False) -> None:
        """`area`: this rank's zeroed low-latency area; `peers.bases`: every rank's area as mapped here (an
        int64 tensor on the area's device), `peers.close()` unmaps them. Use `open_on_group` on GPUs.
        `auto_mask`: in shrink mode a wait that gives up on a rank masks it (the host steps can then go on
        without it: Group.roll_call); otherwise it fails, as without shrink mode."""
        if auto_mask and topology.num_ranks > MAX_SHRINK_RANKS:
            raise ValueError(f"enable_shrink: the NVLink low-latency kernels keep the ranks a call exchanges with as "
                             f"the bits of an int64, so at most {MAX_SHRINK_RANKS} ranks; this group has "
                             f"{topology.num_ranks} (transport='reference' has no such limit)")
        from .sync import RECEIVED_UNIT
        if RECV_PROGRAMS_PER_SM * num_sms > RECEIVED_UNIT.value:
            raise ValueError(f"num_sms: a GPU of {num_sms} SMs would launch low-latency receive grids of up to "
                             f"{RECV_PROGRAMS_PER_SM * num_sms} programs; at most {RECEIVED_UNIT.value} are supported")
        self.topology, self.device, self.status, self.timeout_ns = topology, area.device, status, timeout_ns
        self.auto_mask = auto_mask
        self.area, self.peers, self.num_sms = area, peers, num_sms
        # one launch that sends and receives (Note [fused]): a cooperative grid, so one program per SM at most
        self.can_fuse = (NUM_SENDERS <= self.num_sms and settings.LL_FUSED
                         and area.is_cuda and "launch_cooperative_grid" in (launch_options() or ()))
        # the send and receive launches' PDL constexpr and option (Note [PDL]; never the cooperative launch)
        self._chained = (dict(PDL=True, launch_pdl=True) if area.is_cuda and _chain_launches(area.device)
                         else dict(PDL=False))
        # kept with each dispatch's src_info: (route, top-k, the raw stream route was allocated on)
        self.routes = Keeper()
        self._plans: Dict[tuple, Any] = {}   # _DispatchPlan or _CombinePlan per call shape
        # stand-ins for pointer arguments that a launch never reads
        self._no_words = torch.zeros(4, dtype=torch.int32, device=area.device)
        self._no_longs = torch.zeros(4, dtype=torch.int64, device=area.device)
        self._no_rows = torch.zeros(8, dtype=torch.bfloat16, device=area.device)

    @classmethod
    def open_on_group(cls, group: Group, topology: Topology, device: torch.device, num_bytes: int,
                      status: torch.Tensor, timeout_ns: int) -> "NVLinkLowLatency":
        """A rank's low-latency path with its area mapped into every rank of `group` (CUDA IPC; collective)."""
        from .peer_memory import PeerBuffers
        area = torch.zeros(num_bytes, dtype=torch.uint8, device=device)
        torch.cuda.synchronize(device)
        return cls(topology, area, PeerBuffers(area, group), status, timeout_ns,
                   torch.cuda.get_device_properties(device).multi_processor_count,
                   auto_mask=group.roll_call is not None)

    # ---- views of the local area ---------------------------------------------------------------------------
    def _view(self, offset: int, num_bytes: int, dtype: torch.dtype) -> torch.Tensor:
        """`num_bytes` of the local area from `offset` (16-byte aligned) as `dtype`."""
        return self.area[offset:offset + num_bytes].view(dtype)

    def half_geometry(self, num_max_tokens: int, hidden: int, num_experts: int, half: int) -> _Geometry:
        """Where the areas of buffer half `half` sit for calls of this shape."""
        return _Geometry(self.topology.num_ranks, num_max_tokens, hidden, num_experts, half, self.area.numel())

    def _geometry(self, num_max_tokens: int, hidden: int, num_experts: int, half: int, data_bytes: int,
                  what: str) -> _Geometry:
        geometry = self.half_geometry(num_max_tokens, hidden, num_experts, half)
        if data_bytes > geometry.data_bytes:
            need = 2 * (geometry.layout.signal_bytes + geometry.layout.send_bytes + geometry.masks_bytes + data_bytes
                        + geometry.counter_bytes)
            raise ValueError(f"{what}: num_rdma_bytes={self.area.numel()} leaves too little room for the NVLink "
                             f"low-latency path with N={num_max_tokens}, hidden={hidden}, num_experts={num_experts} "
                             f"and this top-k: need about {need} bytes")
        return geometry

    # ---- dispatch ---------------------------------------------------------------------------------------------
    def _dispatch_plan(self, num_max_tokens: int, hidden: int, num_experts: int, topk: int,
                       options: LowLatencyOptions, shrink: Optional[torch.Tensor], has_stats: bool,
                       half: int) -> _DispatchPlan:
        """A dispatch's launches and output shapes, built once per shape (most of an eager call's host time went
        into recomputing them). `shrink`: the Buffer's shrink mask (None without shrink mode)."""
        has_mask = shrink is not None
        R, rank = self.topology.num_ranks, self.topology.rank
        experts_per_rank = num_experts // R
        slots = R * num_max_tokens
        groups = num_scale_groups(hidden)
        if options.use_fp8:
            payload_words = hidden // 4
            scale_words = -(-groups // 4) if options.use_ue8m0 else groups
            block_h = max(next_pow2(hidden), 512)
        else:
            payload_words, scale_words, block_h = hidden // 2, 0, next_pow2(hidden)
        slot_words = _round_up(payload_words + scale_words, 4)
        geometry = self._geometry(num_max_tokens, hidden, num_experts, half,
                                  R * num_max_tokens * slot_words * 4, "low_latency_dispatch")
        arrived, received = self._counters(geometry)
        fixed = dict(   # every parameter but the per-call ones, for all three launches
            bases_ptr=self.peers.bases, shrink_ptr=self._no_words if shrink is None else shrink,
            status_ptr=self.status, rank=rank, num_experts=num_experts,
            experts_per_rank=experts_per_rank, num_max_tokens=num_max_tokens, masks_offset=geometry.masks,
            slots_offset=geometry.data, arrived_offset=geometry.arrived, received_offset=geometry.received,
            timeout_ns=self.timeout_ns,
            masks_ptr=self._view(geometry.masks, geometry.masks_bytes, torch.int32),
            slots_ptr=self._view(geometry.data, geometry.data_bytes // 16 * 16, torch.int32), arrived_ptr=arrived,
            received_ptr=received, num_senders=NUM_SENDERS,
            H=hidden, K=topk, R=R, FP8=options.use_fp8, ROUND=options.round_scale,
            UE8M0=options.use_ue8m0, XW=payload_words, SW=scale_words, SLOT_W=slot_words, HAS_MASK=has_mask,
            AUTO_MASK=has_mask and self.auto_mask,
            BLOCK_H=block_h, BLOCK_K=next_pow2(topk), BLOCK_R=next_pow2(R),
            BLOCK_G=block_h // (512 if options.use_ue8m0 else 128) if options.use_fp8 else 1,
            HAS_STATS=has_stats, BLOCK_RN=next_pow2(slots), BLOCK_X=next_pow2(payload_words),
            BLOCK_S=next_pow2(max(scale_words, 1)), ROWS=RECV_ROWS)
        no_outputs = dict.fromkeys(_DISPATCH_OUTPUTS, self._no_words)   # (the send writes none)
        no_inputs = dict(x_ptr=self._no_rows, idx_ptr=self._no_longs, num_tokens=0)   # (the receive reads none)
        from .ll_dispatch import ll_dispatch_kernel as kernel
        small = slots <= RECV_SMALL_TABLE and RECV_ROWS * next_pow2(payload_words) <= RECV_SMALL_TILE
        receive_grid = max(1, min(experts_per_rank, RECV_PROGRAMS_PER_SM * self.num_sms))
        # (AHEAD: a program has several experts, so it loads their tables one ahead)
        return _DispatchPlan(
            send=Relaunch(kernel, (NUM_SENDERS,), _DISPATCH_SEND, **fixed, **no_outputs, AHEAD=False, SEND=True,
                          RECEIVE=False, num_warps=NUM_WARPS, **self._chained),
            receive=Relaunch(kernel, (receive_grid,), _DISPATCH_RECEIVE, **fixed, **no_inputs,
                             AHEAD=experts_per_rank > receive_grid, SEND=False, RECEIVE=True,
                             num_warps=RECV_WARPS if small else NUM_WARPS, **self._chained),
            fused=Relaunch(kernel, (NUM_SENDERS,), _DISPATCH_FUSED, **fixed, AHEAD=experts_per_rank > NUM_SENDERS,
                           SEND=True, RECEIVE=True, PDL=False, num_warps=NUM_WARPS, launch_cooperative_grid=True)
            if self.can_fuse else None,
            x_shape=(experts_per_rank, slots, hidden), scale_shape=(experts_per_rank, scale_words, slots),
            count_shape=(experts_per_rank,), table_shape=(experts_per_rank, slots), range_shape=(experts_per_rank, R),
            route_size=experts_per_rank * slots + num_max_tokens * topk)

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_tokens: int, num_experts: int,
                 options: LowLatencyOptions, mask: Optional[torch.Tensor], wait_stats: Optional[torch.Tensor],
                 half: int, hook: bool, check_values=None):
        # (check_values is None: the kernels check the expert ids; the rank that passed a bad one raises at its next
        # low-latency call, the others get no rows from those entries)
        dev = self.device
        num_tokens, hidden = x.shape
        topk = topk_idx.shape[1]
        key = ("dispatch", num_max_tokens, hidden, num_experts, topk, options.use_fp8, options.round_scale,
               options.use_ue8m0, None if mask is None else mask.data_ptr(), wait_stats is not None, half)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._dispatch_plan(num_max_tokens, hidden, num_experts, topk, options,
                                                          mask, wait_stats is not None, half)
        recv_x, recv_scales, recv_count, src_info, layout_range = allocate_outputs(lambda: (
            torch.empty(plan.x_shape, dtype=torch.float8_e4m3fn if options.use_fp8 else torch.bfloat16, device=dev),
            torch.empty(plan.scale_shape, dtype=torch.int32 if options.use_ue8m0 else torch.float32,
                        device=dev).transpose(1, 2) if options.use_fp8 else None,
            torch.empty(plan.count_shape, dtype=torch.int32, device=dev),
            torch.empty(plan.table_shape, dtype=torch.int32, device=dev),
            torch.empty(plan.range_shape, dtype=torch.int64, device=dev)))
        route = torch.empty(plan.route_size, dtype=torch.int32, device=dev)   # [route | OWN] (ll_dispatch.py)
        # the mask as of this call, also for its receive (the kernels mark ranks they give up on in it and in `mask`)
        mask = self._no_words if mask is None else mask.clone()
        outputs = (self._no_longs if wait_stats is None else wait_stats, Pointer(recv_x, torch.int32),
                   self._no_words if recv_scales is None else Pointer(recv_scales, torch.int32), src_info,
                   layout_range, recv_count)   # (_DISPATCH_OUTPUTS)
        output = LowLatencyDispatchOutput(recv_x, recv_scales, recv_count, src_info, layout_range)
        self.routes.keep(src_info, (route, topk, current_raw_stream(self.device)))
        if not hook and plan.fused is not None and num_tokens <= FUSED_MAX_TOKENS:
            plan.fused(x, topk_idx, num_tokens, mask, route, *outputs)
            return output, _nothing
        plan.send(x, topk_idx, num_tokens, mask, route)
        receive = plan.receive

        def receive_step() -> None:   # (keeps only the receive's arguments alive)
            receive(mask, route, *outputs)
        return output, receive_step

    def _counters(self, geometry: _Geometry):
        """ARRIVED and RECEIVED of a half (local views)."""
        R = self.topology.num_ranks
        return self._view(geometry.arrived, 8 * R, torch.int64), self._view(geometry.received, 8, torch.int64)

    # ---- combine ----------------------------------------------------------------------------------------------
    def combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, src_info: torch.Tensor,
                layout_range: torch.Tensor, num_max_tokens: int, use_logfmt: bool, mask: Optional[torch.Tensor],
                out: torch.Tensor, wait_stats: Optional[torch.Tensor], half: int, hook: bool, check_values=None):
        experts_per_rank, _, hidden = x.shape   # (check_values is None, as in dispatch)
        num_tokens, topk = topk_idx.shape
        known = self.routes.get(src_info)
        if known is None:
            raise ValueError("handle: pass the handle returned by a low_latency_dispatch of this Buffer (its "
                             "routes are kept with it)")
        route, dispatch_topk, route_stream = known
        if topk != dispatch_topk:
            raise ValueError(f"topk_idx must have the top-k of the matching low_latency_dispatch ({dispatch_topk} "
                             f"columns), got {topk}")
        if route_stream != current_raw_stream(self.device):   # its memory must outlive this stream's kernels
            route.record_stream(torch.cuda.current_stream(self.device))
        strides = x.stride()
        own_from_x = not hook and not use_logfmt   # (Note [own rows] in ll_combine.py)
        key = ("combine", num_max_tokens, hidden, experts_per_rank, topk, use_logfmt,
               None if mask is None else mask.data_ptr(), wait_stats is not None, half, strides, own_from_x)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._combine_plan(num_max_tokens, hidden, experts_per_rank, topk, use_logfmt,
                                                         mask, wait_stats is not None, half, strides, own_from_x)
        mask = self._no_words if mask is None else mask.clone()
        per_token = (topk_idx, topk_weights, out, num_tokens,
                     self._no_longs if wait_stats is None else wait_stats)   # (_COMBINE_TOKENS)
        if not hook and plan.fused is not None and num_tokens <= FUSED_MAX_TOKENS:
            plan.fused(x, layout_range, route, mask, *per_token)
            return _nothing
        plan.send(x, layout_range, route, mask)
        receive = plan.receive
        items = num_tokens * -(-hidden // plan.chunk)
        receive_grid = (max(1, min(items, RECV_PROGRAMS_PER_SM * self.num_sms)),)
        own_rows = x if own_from_x else self._no_rows   # (a hook's closure need not keep x alive)

        def receive_step() -> None:   # (keeps only the receive's arguments alive)
            receive(own_rows, route, mask, *per_token, grid=receive_grid)
        return receive_step

    def _combine_plan(self, num_max_tokens: int, hidden: int, experts_per_rank: int, topk: int, use_logfmt: bool,
                      shrink: Optional[torch.Tensor], has_stats: bool, half: int, strides: Tuple[int, ...],
                      own_from_x: bool) -> _CombinePlan:
        """A combine's launches, built once per shape (as _dispatch_plan)."""
        has_mask = shrink is not None
        R, rank = self.topology.num_ranks, self.topology.rank
        num_experts = experts_per_rank * R
        geometry = self._geometry(num_max_tokens, hidden, num_experts, half, num_max_tokens * topk * hidden * 2,
                                  "low_latency_combine")
        block_h = max(next_pow2(hidden), 1024) if use_logfmt else next_pow2(hidden)
        arrived, received = self._counters(geometry)
        # a receive program sums one chunk of a token's K rows, loaded at once (COMBINE_TILE values)
        chunk = min(next_pow2(hidden), max(128, COMBINE_TILE // next_pow2(topk)))
        fixed = dict(   # every parameter but the per-call ones, for all three launches
            bases_ptr=self.peers.bases, shrink_ptr=self._no_words if shrink is None else shrink,
            status_ptr=self.status, rank=rank, experts_per_rank=experts_per_rank,
            num_max_tokens=num_max_tokens, x_expert_stride=strides[0], x_row_stride=strides[1],
            rows_offset=geometry.data, arrived_offset=geometry.arrived, received_offset=geometry.received,
            timeout_ns=self.timeout_ns,
            rows_ptr=self._view(geometry.data, geometry.data_bytes // 16 * 16, torch.bfloat16), arrived_ptr=arrived,
            received_ptr=received, num_experts=num_experts, num_senders=NUM_SENDERS,
            H=hidden, K=topk, R=R, HAS_MASK=has_mask, AUTO_MASK=has_mask and self.auto_mask,
            LOGFMT=use_logfmt, BLOCK_H=block_h, BLOCK_E=next_pow2(experts_per_rank), BLOCK_R=next_pow2(R),
            ROWS=1 if use_logfmt else COMBINE_SEND_ROWS, HAS_STATS=has_stats, CHUNK=chunk, BLOCK_K=next_pow2(topk),
            OWN_FROM_X=own_from_x)
        no_tokens = dict(idx_ptr=self._no_longs, weights_ptr=self._no_words, out_ptr=self._no_rows, num_tokens=0,
                         stats_ptr=self._no_longs)   # (the send reads none)
        from .ll_combine import ll_combine_kernel as kernel
        # (the receive and the fused launch are compiled without FMA, as the reference sums)
        return _CombinePlan(
            send=Relaunch(kernel, (NUM_SENDERS,), _COMBINE_SEND, **fixed, **no_tokens, SEND=True, RECEIVE=False,
                          num_warps=NUM_WARPS, enable_fp_fusion=not use_logfmt, **self._chained),
            receive=Relaunch(kernel, (1,), _COMBINE_RECEIVE, **fixed, layout_ptr=self._no_longs, SEND=False,
                             RECEIVE=True, num_warps=RECV_WARPS, enable_fp_fusion=False, **self._chained),
            fused=Relaunch(kernel, (NUM_SENDERS,), _COMBINE_FUSED, **fixed, SEND=True, RECEIVE=True, PDL=False,
                           num_warps=NUM_WARPS, enable_fp_fusion=False, launch_cooperative_grid=True)
            if self.can_fuse else None,
            chunk=chunk)

    # ---- lifecycle ------------------------------------------------------------------------------------------
    def clean(self, num_max_tokens: int, hidden: int, num_experts: int) -> None:
        """Zero both halves' counters and slot bits and the receive counts (every rank, between barriers)."""
        for half in (0, 1):
            geometry = self.half_geometry(num_max_tokens, hidden, num_experts, half)
            self.area[geometry.signal:geometry.signal + geometry.counter_bytes].zero_()
            self.area[geometry.masks:geometry.masks + geometry.masks_bytes].zero_()
        if self.area.is_cuda:
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self.peers.close()
