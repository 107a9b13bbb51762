"""Normal mode on the NVLink transport: layout, dispatch and combine as Triton kernels on peer-mapped buffers.

  get_dispatch_layout: one local kernel, no host wait (layout.py);
  non-cached dispatch: prepare and notify kernels (counts to every rank; plan.py, notify.py; the notify's last
    program computes the plan and puts the counts into the host's mailbox: mailbox.py, the API's receive-count
    wait, skipped with num_worst_tokens) -> the dispatch kernel;
  cached dispatch, combine: the dispatch or combine kernel alone, with the routing kept from the handle.

Note [protocols]: where the largest share any rank receives (dispatch) or sent in the dispatch (combine) fits
the rows area whole, the kernel pushes every row straight to its final slot with all programs (direct.py);
otherwise the rows stream through per-(source, channel) rings with flow control (dispatch.py, combine.py),
so any buffer that holds one row per ring works. The direct protocol needs the shares, which only the
non-cached dispatch's count wait brings to the host: a num_worst_tokens dispatch, on any rank, and its
handle use the rings. `settings.DIRECT` turns the direct protocol off.

Every kernel is launched through a launcher.Relaunch per kernel and shape, which packs the arguments that
do not change from call to call once. The buffer's layout is header.py's.
"""
from __future__ import annotations

import zlib
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

from ...checks import disagreement
from ...config import _round_up
from ...group import Group, Topology
from ...streams import allocate_outputs
from ..base import DispatchOutput
from ..kept import Keeper
from ..reference import dispatch_fields
from . import settings
from .header import CMAX, MAX_EXPERTS_PER_RANK, Header
from .launcher import Pointer, Relaunch, current_raw_stream, next_pow2
from .mailbox import Counts, CountsMailbox
from .status import StatusWords

BATCH = 64              # tokens (rows per ring) per flow-control step
NUM_WARPS = 16
DISPATCH_TILE = 16384   # int32 words a dispatch program moves at once
COMBINE_TILE = 32768    # bf16 values a combine program moves at once
LAYOUT_TOKENS = 64      # tokens per layout program

# the arguments that change from call to call, in the order the launches take them
_DISPATCH_INPUTS = ("x_ptr", "scales_ptr", "idx_ptr", "weights_ptr", "in_rank_ptr", "before_ptr", "recv_count_ptr",
                    "recv_base_ptr", "prefix_ptr")
_DISPATCH_OUTPUTS = ("out_x_ptr", "out_scales_ptr", "out_idx_ptr", "out_weights_ptr", "out_src_ptr", "num_tokens",
                     "num_rows")
_RINGS_DISPATCH_VARY = _DISPATCH_INPUTS + _DISPATCH_OUTPUTS
_DIRECT_DISPATCH_VARY = _DISPATCH_INPUTS + ("push_row0_ptr",) + _DISPATCH_OUTPUTS
_COMBINE_INPUTS = ("x_ptr", "weights_ptr", "in_rank_ptr", "before_ptr", "recv_count_ptr", "recv_base_ptr",
                   "prefix_ptr")
_COMBINE_OUTPUTS = ("bias0_ptr", "bias1_ptr", "out_ptr", "out_weights_ptr", "num_tokens", "num_rows")
_RINGS_COMBINE_VARY = _COMBINE_INPUTS + _COMBINE_OUTPUTS
_DIRECT_COMBINE_VARY = _COMBINE_INPUTS + ("combine_row0_ptr",) + _COMBINE_OUTPUTS
_LAYOUT_VARY = ("idx_ptr", "per_rank_ptr", "per_expert_ptr", "in_rank_ptr", "num_tokens")
_PREPARE_VARY = ("in_rank_ptr", "per_rank_ptr", "idx_ptr", "before_ptr", "send_head_ptr", "channel_counts_ptr",
                 "num_tokens", "num_ids")
_NOTIFY_VARY = ("colsum_ptr", "per_expert_ptr", "channel_counts_ptr", "signature", "received_ptr", "prefix_ptr",
                "recv_count_ptr", "recv_base_ptr", "rank_prefix_ptr", "channel_prefix_ptr", "recv_channel_prefix_ptr",
                "push_row0_ptr", "combine_row0_ptr", "counts_ticket", "expert_alignment")


class DispatchGeometry(NamedTuple):
    """How a dispatch row sits in a ring slot, and the rings of its channel count (words are int32)."""
    hidden_words: int
    scale_words: int
    topk: int
    id_offset: int      # where the top-k ids, weights and source index start in a slot
    slot_words: int
    ring_words: int
    ring_slots: int
    batch: int          # tokens per flow-control step


class Plan(NamedTuple):
    """Where every row goes, on the device: enough to run a dispatch or combine kernel without the host. The
    tables are kernel arguments only: int32 tensors, or Pointers into a dispatch's table memory."""
    before: torch.Tensor      # [T + 1, R] int32: tokens before t that go to rank d (exclusive prefix)
    recv_count: Any           # [R, C] int32: rows this rank receives from (source, channel)
    recv_base: Any            # [R, C] int32: first output row of (source, channel)
    prefix: Any               # [R + 1] int32: first output row per source; prefix[R] = rows received
    push_row0: Any            # [R] int32: first row of this rank's rows in each destination's outputs
    combine_row0: Any         # [R] int32: first slot of this rank's rows in each source's combine area
    num_channels: int
    # most rows any rank receives, most any rank sends (None: unknown to the host, so the rings serve it)
    max_recv_rows: Optional[int]
    max_send_rows: Optional[int]


class PlanTables(NamedTuple):
    """int32 offsets of a non-cached dispatch's tables in their one allocation, and its size: the plan's, the
    handle's three matrices, then the prepare kernel's counts per channel and the notify's received records.
    Each starts on a 16-byte boundary (the kernels' pointers keep the alignment of an allocation of their own)."""
    prefix: int                  # [R + 1]
    recv_count: int              # [R, C]
    recv_base: int               # [R, C]
    push_row0: int               # [R]
    combine_row0: int            # [R]
    recv_channel_prefix: int     # [R, C]
    channel_prefix: int          # [R, C]
    rank_prefix_matrix: int      # [R, R]
    channel_counts: int          # [R, C]
    received: int                # [R, record_len]
    size: int

    @classmethod
    def for_shape(cls, num_ranks: int, num_channels: int, record_len: int) -> "PlanTables":
        R, C = num_ranks, num_channels
        offsets, cursor = [], 0
        for size in (R + 1, R * C, R * C, R, R, R * C, R * C, R * R, R * C, R * record_len):
            offsets.append(cursor)
            cursor += _round_up(size, 4)
        return cls(*offsets, size=cursor)


class NVLinkNormal:
    """Normal-mode calls of one rank over its peer-mapped NVLink buffer: [header | rows area]."""

    def __init__(self, group: Group, topology: Topology, memory: torch.Tensor, peers: Any, num_nvl_bytes: int,
                 status: StatusWords) -> None:
        """`memory`: this rank's buffer, [header (zeroed) | rows area]; `peers.bases`: every rank's buffer as
        mapped here (an int64 tensor on its device), `peers.close()` unmaps them. Use `open_on_group` on GPUs."""
        device = memory.device
        self.group, self.topology, self.device, self.status = group, topology, device, status
        self.timeout_ns = status.timeout_ns
        R = topology.num_ranks
        self.header = Header.for_ranks(R)
        # the rows area is the `num_nvl_bytes` users see (get_local_buffer_tensor); what they write there only meets
        # rows in transit, never the counters
        self.local_buffer = memory[self.header.nbytes:self.header.nbytes + num_nvl_bytes]
        self.rows_words = memory.numel() // 4 - self.header.ring_word   # int32 words of the rows area
        self.peers = peers
        self.epoch = torch.zeros(1, dtype=torch.int64, device=device)
        self.layout_bad = torch.zeros(2, dtype=torch.int64, device=device)
        # layout.py's DONE and SUMS, zeros between calls; SUMS is set up at the first call
        self.layout_done = torch.zeros(1, dtype=torch.int32, device=device)
        self.layout_sums = torch.zeros(0, dtype=torch.int32, device=device)
        self._retired_layout_sums: List[torch.Tensor] = []
        scratch = torch.zeros(4 + R, dtype=torch.int64, device=device)   # value checks of a dispatch
        self.checks, self.mismatch = scratch[:4], scratch[4:]
        self._no_ids = torch.zeros(1, dtype=torch.int64, device=device)   # topk_idx of a dispatch without one
        self.counts = CountsMailbox(status, Counts.words(R, MAX_EXPERTS_PER_RANK))
        self._signatures: Dict[tuple, int] = {}   # _call_signature's results
        self._channels: Optional[int] = None
        self._plans = Keeper()   # (a handle's plan, the raw streams it was made or used on), kept with recv_src_idx
        self._launches: Dict[tuple, Any] = {}   # per kernel and shape (_launch)
        self._geometries: Dict[tuple, DispatchGeometry] = {}

    @classmethod
    def open_on_group(cls, group: Group, topology: Topology, device: torch.device, num_nvl_bytes: int,
                      status: StatusWords) -> "NVLinkNormal":
        """A rank's normal mode with its buffer mapped into every rank of `group` (CUDA IPC; collective)."""
        from .peer_memory import PeerBuffers
        header_bytes = Header.for_ranks(topology.num_ranks).nbytes
        memory = torch.empty(header_bytes + _round_up(num_nvl_bytes, 16), dtype=torch.uint8, device=device)
        memory[:header_bytes].zero_()
        torch.cuda.synchronize(device)
        return cls(group, topology, memory, PeerBuffers(memory, group), num_nvl_bytes, status)

    # ---- bookkeeping -------------------------------------------------------------------------------
    def _launch(self, key: tuple, make: Callable[[], Any]) -> Any:
        """The launches kept for `key` (a kernel and shape), made by `make()` the first time."""
        launch = self._launches.get(key)
        if launch is None:
            launch = self._launches[key] = make()
        return launch

    def capture_host_wait(self, num_channels: int) -> Optional[str]:
        if self._channels in (None, num_channels):
            return None
        return (f"config.num_sms changes from {2 * self._channels} to {2 * num_channels}, which moves the rings: "
                "the host waits for the GPU and the other ranks first; capture calls with the num_sms of the calls "
                "before, or make one uncaptured call with the new num_sms first")

    def _begin(self, num_channels: int) -> None:
        """Every operation: report an earlier timeout; if the channel count changed, the rings move, so let
        every rank finish what is in flight first (host wait and barrier; not inside a CUDA graph)."""
        self.status.raise_timeout()
        if num_channels > CMAX:
            raise ValueError(f"config.num_sms must be <= {2 * CMAX} for the NVLink transport, got {2 * num_channels}")
        if self._channels != num_channels:
            if self._channels is not None:
                torch.cuda.synchronize(self.device)
                self.status.raise_timeout()
                self.group.barrier("NVLink transport channel change")
            self._channels = num_channels

    def _rings(self, slot_words: int, num_channels: int, what: str) -> Tuple[int, int, int]:
        """(words per ring, slots per ring, tokens per flow-control step) for slots of `slot_words`."""
        R = self.topology.num_ranks
        ring_words = self.rows_words // (R * num_channels) // 4 * 4
        slots = ring_words // slot_words
        if slots < 1:
            need = R * num_channels * slot_words * 4
            raise ValueError(f"{what}: num_nvl_bytes={self.rows_words * 4} is too small for the NVLink transport with "
                             f"{num_channels} channels and rows of {slot_words * 4} bytes: need at least {need} (one "
                             "row per ring)")
        return ring_words, slots, min(BATCH, slots)

    def _fits_whole(self, most_rows: Optional[int], slot_words: int) -> bool:
        """Whether the direct protocol serves an operation (Note [protocols]): its largest per-rank share (the
        same on every rank) is known and fits the rows area whole."""
        return settings.DIRECT and most_rows is not None and most_rows <= self._capacity(slot_words)

    def _capacity(self, slot_words: int) -> int:
        """Slots of `slot_words` words in the rows area."""
        return self.rows_words // slot_words

    def _capturing(self) -> bool:
        """Whether the current stream captures a CUDA graph (never on CPU memory: the interpreted tests)."""
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def _plan(self, handle: tuple) -> Plan:
        """The plan of a handle: kept from its dispatch, else rebuilt from the handle's tensors (with one host
        wait for the largest shares, so that this rank picks the protocol its peers pick with the original
        handle; inside a CUDA-graph capture, which cannot wait, a rebuilt plan uses the rings)."""
        recv_src_idx = handle[3]
        kept = self._plans.get(recv_src_idx)
        stream = current_raw_stream(self.device)
        if kept is None:
            plan = plan_from_handle(handle, self.topology.rank, read_shares=not self._capturing())
            self._plans.keep(recv_src_idx, (plan, {stream}))
            return plan
        plan, streams = kept
        if stream not in streams:
            # the plan's and the handle's memory came from another stream's pool: it must not go back to it while
            # this stream's kernels may still read it (Note [synchronous calls on the caller's stream])
            current = torch.cuda.current_stream(self.device)
            for tensor in (*handle, *plan):
                tensor = tensor.tensor if isinstance(tensor, Pointer) else tensor
                if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
                    tensor.record_stream(current)
            streams.add(stream)
        return plan

    # ---- layout ----------------------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx, num_experts):
        R, dev = self.topology.num_ranks, self.device
        num_tokens, topk = topk_idx.shape
        relaunch = self._launch(("layout", topk, num_experts), lambda: self._layout_launch(topk, num_experts))
        per_rank, per_expert, in_rank = allocate_outputs(lambda: (
            torch.empty(R, dtype=torch.int32, device=dev), torch.empty(num_experts, dtype=torch.int32, device=dev),
            torch.empty((num_tokens, R), dtype=torch.bool, device=dev)))
        relaunch(topk_idx, per_rank, per_expert, Pointer(in_rank, torch.int8), num_tokens,
                 grid=(max(1, -(-num_tokens // LAYOUT_TOKENS)),))
        return per_rank, None, per_expert, in_rank

    def _layout_launch(self, topk: int, num_experts: int) -> Relaunch:
        from .layout import COPY_BLOCK, HISTOGRAM_MAX, layout_kernel
        R = self.topology.num_ranks
        if self.layout_sums.numel() < R + num_experts:
            if self._capturing():   # its zero-fill would only run at the first replay
                raise RuntimeError(f"get_dispatch_layout: call it once with num_experts={num_experts} outside CUDA "
                                   "graph capture first (it sets up the kernel's accumulator, which a capture cannot)")
            self._retired_layout_sums.append(self.layout_sums)   # graphs captured with it still use it
            self.layout_sums = torch.zeros(R + num_experts, dtype=torch.int32, device=self.device)
        return Relaunch(
            layout_kernel, (1,), _LAYOUT_VARY, sums_ptr=self.layout_sums, done_ptr=self.layout_done,
            bad_ptr=self.layout_bad, num_experts=num_experts, experts_per_rank=num_experts // R, K=topk, R=R,
            BLOCK_T=LAYOUT_TOKENS, BLOCK_K=next_pow2(topk), BLOCK_R=next_pow2(R),
            BLOCK_E=next_pow2(num_experts + 1) if num_experts <= HISTOGRAM_MAX else 0, COPY=COPY_BLOCK, num_warps=4)

    # ---- dispatch ------------------------------------------------------------------------------------------
    def dispatch(self, x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                 num_tokens_per_expert, expert_alignment, num_worst_tokens, num_channels, check_values=None):
        # (check_values is None: the kernels check the values and every rank raises at this dispatch's count wait;
        # with num_worst_tokens there is no wait and no check)
        R, C, rank, dev = self.topology.num_ranks, num_channels, self.topology.rank, self.device
        num_tokens, num_experts = x.shape[0], num_tokens_per_expert.numel()
        experts_per_rank = num_experts // R
        self._begin(C)
        geometry = self._dispatch_geometry(x, x_scales, topk_idx, C)
        call = dispatch_fields(x, x_scales, topk_idx, C, num_experts=num_experts,
                               has_weights=int(topk_weights is not None))
        signature = self._call_signature(call)
        prepare, notify, tables_at = self._launch(
            ("notify", C, num_experts, bool(num_worst_tokens)),
            lambda: self._notify_launches(C, num_experts, bool(num_worst_tokens)))
        before = torch.empty((num_tokens + 1, R), dtype=torch.int32, device=dev)
        send_head = torch.empty((num_tokens, R), dtype=torch.int32, device=dev)
        tables = torch.empty(tables_at.size, dtype=torch.int32, device=dev)
        channel_counts = Pointer(tables, torch.int32, 4 * tables_at.channel_counts)
        prepare(Pointer(is_token_in_rank, torch.int8), num_tokens_per_rank,
                self._no_ids if topk_idx is None else topk_idx, before, send_head, channel_counts, num_tokens,
                0 if topk_idx is None else topk_idx.numel())
        prefix = Pointer(tables, torch.int32, 4 * tables_at.prefix)
        recv_count = Pointer(tables, torch.int32, 4 * tables_at.recv_count)
        recv_base = Pointer(tables, torch.int32, 4 * tables_at.recv_base)
        push_row0 = Pointer(tables, torch.int32, 4 * tables_at.push_row0)
        combine_row0 = Pointer(tables, torch.int32, 4 * tables_at.combine_row0)
        recv_channel_prefix = tables[tables_at.recv_channel_prefix:tables_at.recv_channel_prefix + R * C].view(R, C)
        channel_prefix = tables[tables_at.channel_prefix:tables_at.channel_prefix + R * C].view(R, C)
        rank_prefix_matrix = tables[tables_at.rank_prefix_matrix:tables_at.rank_prefix_matrix + R * R].view(R, R)
        ticket = 0 if num_worst_tokens else self.counts.next_ticket()
        notify(Pointer(before, torch.int32, num_tokens * R * 4), num_tokens_per_expert, channel_counts, signature,
               Pointer(tables, torch.int32, 4 * tables_at.received), prefix, recv_count, recv_base, rank_prefix_matrix,
               channel_prefix, recv_channel_prefix, push_row0, combine_row0, ticket, expert_alignment)
        if num_worst_tokens:
            num_rows, aligned_list, most = num_worst_tokens, [], (None, None)
        else:
            num_rows, aligned_list, most = self._wait_counts(ticket, experts_per_rank, signature, call)
        plan = Plan(before, recv_count, recv_base, prefix, push_row0, combine_row0, C, *most)
        out = self._run_dispatch(x, x_scales, topk_idx, topk_weights, is_token_in_rank, plan, num_rows,
                                 rank * experts_per_rank, experts_per_rank, geometry)
        recv_src_idx = out.handle
        out.handle = (rank_prefix_matrix, channel_prefix, recv_channel_prefix, recv_src_idx, is_token_in_rank,
                      send_head)
        out.num_recv_tokens_per_expert_list = aligned_list
        self._plans.keep(recv_src_idx, (plan, {current_raw_stream(self.device)}))
        return out

    def _call_signature(self, call: Dict[str, int]) -> int:
        """An int32 that differs when ranks call with different shapes (compared across ranks by the notify)."""
        key = tuple(call.values())
        signature = self._signatures.get(key)
        if signature is None:
            fields = ("dispatch", *key, self.rows_words)
            signature = self._signatures[key] = zlib.crc32(repr(fields).encode()) & 0x7FFFFFFF
        return signature

    def _notify_launches(self, C: int, num_experts: int, no_wait: bool):
        """The prepare and notify kernels of a non-cached dispatch (the notify's last program computes the plan),
        and where the plan's tables sit in their one allocation."""
        from .notify import notify_kernel
        from .plan import prepare_kernel
        R, rank = self.topology.num_ranks, self.topology.rank
        experts_per_rank = num_experts // R
        record_len = 2 + R + experts_per_rank + C
        prepare = Relaunch(prepare_kernel, (R + 1,), _PREPARE_VARY, layout_bad_ptr=self.layout_bad,
                           mismatch_ptr=self.mismatch, checks_ptr=self.checks, epoch_ptr=self.epoch,
                           num_experts=num_experts, C=C, no_wait=1 if no_wait else 0, R=R, BLOCK=1024,
                           BLOCK_C=next_pow2(C), BLOCK_IDS=8192, num_warps=8)
        notify = Relaunch(notify_kernel, (R,), _NOTIFY_VARY, mismatch_ptr=self.mismatch, checks_ptr=self.checks,
                          mailbox_ptr=self.counts.tensor, bases_ptr=self.peers.bases,
                          notify_flag_word=self.header.notify_word, notify_word=self.header.record_word,
                          ticket_word=self.header.ticket_word, epoch_ptr=self.epoch, status_ptr=self.status.tensor,
                          rank=rank, timeout_ns=self.timeout_ns, experts_per_rank=experts_per_rank, C=C, R=R,
                          REC=record_len, STRIDE=self.header.record_max, BLOCK=next_pow2(record_len),
                          BLOCK_R=next_pow2(R), BLOCK_C=next_pow2(C), BLOCK_E=next_pow2(experts_per_rank),
                          num_warps=4)
        return prepare, notify, PlanTables.for_shape(R, C, record_len)

    def _wait_counts(self, ticket: int, experts_per_rank: int, signature: int, call: Dict[str, int]):
        """The API's host wait for the received counts (mailbox.py); with it, every rank learns whether all ranks
        called with the same shapes and valid values, and if not, all of them raise before any row moves."""
        R, rank = self.topology.num_ranks, self.topology.rank
        counts = self.counts.wait(ticket, R, experts_per_rank, self.timeout_ns / 1e9)
        self.status.raise_timeout()
        num_experts, flags = call["num_experts"], counts.flags
        others = [r for r, s in enumerate(counts.signatures) if s != signature]
        if others:
            # every rank sees a difference; when all of them wait here they compare the calls to name it
            if not any(f & 8 for f in flags):
                mine = list(call.values())
                calls = self.group.gather_int_lists(mine, "dispatch (comparing the calls)")
                for other in others:
                    message = disagreement("dispatch", list(call), mine, calls[other], rank, other)
                    if message:
                        raise ValueError(message)
            raise ValueError(f"dispatch: rank(s) {others} called dispatch with a different hidden size, dtype, scales, "
                             f"top-k, num_experts or config than rank {rank}; every rank must pass the same shapes")
        if flags[rank] & 1:
            self.layout_bad.zero_()
            raise ValueError(f"topk_idx of get_dispatch_layout: entries must be -1 or in [0, {num_experts}), found "
                             f"{counts.layout_value} (the NVLink transport checks expert ids on the GPU and reports "
                             "them at the next dispatch)")
        if flags[rank] & 2:
            raise ValueError(f"topk_idx entries must be -1 or in [0, {num_experts}), found "
                             f"{counts.low if counts.low < -1 else counts.high}")
        if flags[rank] & 4:
            raise ValueError("num_tokens_per_rank must equal the column sums of is_token_in_rank "
                             "(pass the outputs of one get_dispatch_layout call)")
        failed = [r for r, f in enumerate(flags) if f & 7]
        if failed:
            raise ValueError(f"dispatch: rank(s) {failed} passed invalid inputs (see the errors there); no rank "
                             "sent anything")
        if any(f & 8 for f in flags):   # a rank that does not wait cannot know the shares: all use the rings
            return counts.num_recv, counts.aligned, (None, None)
        return counts.num_recv, counts.aligned, (counts.max_recv_rows, counts.max_send_rows)

    def cached_dispatch(self, x, x_scales, handle, num_channels):
        _, _, _, recv_src_idx, is_token_in_rank, _ = handle
        plan = self._plan(handle)
        self._begin(plan.num_channels)
        geometry = self._dispatch_geometry(x, x_scales, None, plan.num_channels)
        out = self._run_dispatch(x, x_scales, None, None, is_token_in_rank, plan, recv_src_idx.shape[0], 0, 0,
                                 geometry)
        out.handle = None
        return out

    def _dispatch_geometry(self, x, x_scales, topk_idx, num_channels) -> DispatchGeometry:
        key = (x.shape[1] * x.element_size(), 0 if x_scales is None else x_scales.shape[1],
               0 if topk_idx is None else topk_idx.shape[1], num_channels)
        geometry = self._geometries.get(key)
        if geometry is None:
            row_bytes, scale_words, topk, _ = key
            hidden_words = row_bytes // 4
            id_offset = _round_up(hidden_words + scale_words, 2)
            slot_words = _round_up(id_offset + 3 * topk + 1, 4)
            geometry = self._geometries[key] = DispatchGeometry(
                hidden_words, scale_words, topk, id_offset, slot_words,
                *self._rings(slot_words, num_channels, "dispatch"))
        return geometry

    def _run_dispatch(self, x, x_scales, topk_idx, topk_weights, is_token_in_rank, plan: Plan, num_rows,
                      expert_begin, experts_per_rank, geometry: DispatchGeometry) -> DispatchOutput:
        """The dispatch kernel; the output's handle field holds recv_src_idx."""
        dev = self.device
        if x.data_ptr() % 16:
            x = x.clone()      # the kernel moves rows in 16-byte vectors
        scales = None if x_scales is None else x_scales.contiguous()
        recv_x, recv_scales, recv_idx, recv_weights, recv_src = allocate_outputs(lambda: (
            x.new_empty((num_rows, x.shape[1])),
            None if scales is None else scales.new_empty((num_rows, geometry.scale_words)),
            None if topk_idx is None else torch.empty((num_rows, geometry.topk), dtype=topk_idx.dtype, device=dev),
            None if topk_weights is None else torch.empty((num_rows, geometry.topk), dtype=torch.float32,
                                                          device=dev),
            torch.empty(num_rows, dtype=torch.int32, device=dev)))
        direct = self._fits_whole(plan.max_recv_rows, geometry.slot_words)
        has_weights = topk_weights is not None
        relaunch = self._launch(
            ("dispatch", direct, geometry, plan.num_channels, has_weights, expert_begin, experts_per_rank),
            lambda: self._dispatch_launch(direct, geometry, plan.num_channels, has_weights, expert_begin,
                                          experts_per_rank))
        dummy = recv_src
        inputs = (Pointer(x, torch.int32) if x.numel() else dummy,
                  dummy if scales is None else Pointer(scales, torch.int32),
                  dummy if topk_idx is None else topk_idx, dummy if topk_weights is None else topk_weights,
                  Pointer(is_token_in_rank, torch.int8), plan.before, plan.recv_count, plan.recv_base, plan.prefix)
        outputs = (Pointer(recv_x, torch.int32) if recv_x.numel() else dummy,
                   dummy if recv_scales is None else Pointer(recv_scales, torch.int32),
                   dummy if recv_idx is None else recv_idx, dummy if recv_weights is None else recv_weights, recv_src,
                   x.shape[0], num_rows)
        if direct:
            relaunch(*inputs, plan.push_row0, *outputs)
        else:
            relaunch(*inputs, *outputs)
        return DispatchOutput(recv_x, recv_scales, recv_idx, recv_weights, None, recv_src)

    def _dispatch_launch(self, direct: bool, geometry: DispatchGeometry, C: int, has_weights: bool,
                         expert_begin: int, experts_per_rank: int) -> Relaunch:
        """The dispatch kernel with what stays the same for a shape."""
        R, header = self.topology.num_ranks, self.header
        fixed = dict(bases_ptr=self.peers.bases, status_ptr=self.status.tensor, rank=self.topology.rank,
                     expert_begin=expert_begin, experts_per_rank=max(experts_per_rank, 1), ops_word=header.ops_word,
                     done_word=header.done_word, ticket_word=header.ticket_word, slot_words=geometry.slot_words,
                     timeout_ns=self.timeout_ns, C=C, R=R, XW=geometry.hidden_words, SW=geometry.scale_words,
                     K=geometry.topk, HAS_W=has_weights, ID_OFF=geometry.id_offset,
                     BLOCK_X=next_pow2(max(geometry.hidden_words, 1)), BLOCK_S=next_pow2(max(geometry.scale_words, 1)),
                     BLOCK_K=next_pow2(max(geometry.topk, 1)), BLOCK_R=next_pow2(R),
                     ROWS=rows_per_step(geometry.hidden_words, DISPATCH_TILE), num_warps=NUM_WARPS)
        if direct:
            from .direct import direct_dispatch_kernel
            return Relaunch(direct_dispatch_kernel, (2 * C,), _DIRECT_DISPATCH_VARY, arrive_word=header.arrive_word,
                            slot_word=header.ring_word, capacity=self._capacity(geometry.slot_words),
                            stage_tokens=_stage_tokens(), AMAX=2 * CMAX, **fixed)
        from .dispatch import dispatch_kernel
        return Relaunch(dispatch_kernel, (2 * C,), _RINGS_DISPATCH_VARY, tail_word=header.tail_word,
                        head_word=header.head_word, sent_word=header.sent_word, recvd_word=header.recvd_word,
                        ring_word=header.ring_word, ring_words=geometry.ring_words, ring_slots=geometry.ring_slots,
                        batch=geometry.batch, CMAX=CMAX, **fixed)

    # ---- combine ---------------------------------------------------------------------------------------------
    def combine(self, x, handle, topk_weights, biases, num_channels):
        _, _, _, _, is_token_in_rank, _ = handle
        plan = self._plan(handle)
        C, hidden = plan.num_channels, x.shape[1]
        self._begin(C)
        topk = 0 if topk_weights is None else topk_weights.shape[1]
        bias0, bias1 = biases
        direct = self._fits_whole(plan.max_send_rows, combine_slot(topk, hidden)[1])
        key = ("combine", hidden, topk, bias0 is not None, bias1 is not None, C, direct)
        relaunch = self._launch(key, lambda: self._combine_launch(direct, hidden, topk, bias0 is not None,
                                                                  bias1 is not None, C))
        num_tokens = is_token_in_rank.shape[0]
        combined, combined_weights = allocate_outputs(lambda: (
            torch.empty((num_tokens, hidden), dtype=torch.bfloat16, device=self.device),
            None if topk_weights is None else torch.empty((num_tokens, topk), dtype=torch.float32, device=self.device)))
        dummy = plan.prefix
        inputs = (x, dummy if topk_weights is None else topk_weights, Pointer(is_token_in_rank, torch.int8),
                  plan.before, plan.recv_count, plan.recv_base, plan.prefix)
        outputs = (dummy if bias0 is None else bias0, dummy if bias1 is None else bias1, combined,
                   dummy if combined_weights is None else combined_weights, num_tokens, x.shape[0])
        if direct:
            relaunch(*inputs, plan.combine_row0, *outputs)
        else:
            relaunch(*inputs, *outputs)
        return combined, combined_weights

    def _combine_launch(self, direct: bool, hidden: int, topk: int, has_bias0: bool, has_bias1: bool,
                        C: int) -> Relaunch:
        """The combine kernel with what stays the same for a shape."""
        R, header = self.topology.num_ranks, self.header
        x_offset, slot_words = combine_slot(topk, hidden)
        ring_words, ring_slots, batch = self._rings(slot_words, C, "combine")
        rows = rows_per_step(hidden, COMBINE_TILE)
        fixed = dict(bases_ptr=self.peers.bases, status_ptr=self.status.tensor, rank=self.topology.rank,
                     ops_word=header.ops_word, done_word=header.done_word, ticket_word=header.ticket_word,
                     slot_words=slot_words, timeout_ns=self.timeout_ns, C=C, R=R, H=hidden, K=topk, X_OFF=x_offset,
                     HAS_BIAS0=has_bias0, HAS_BIAS1=has_bias1, BLOCK_H=next_pow2(hidden),
                     BLOCK_K=next_pow2(max(topk, 1)), BLOCK_R=next_pow2(R), ROWS=rows, num_warps=NUM_WARPS)
        if direct:
            # its reduce takes tiles of half a push step's rows: full tiles spill registers beside its other values
            from .direct import direct_combine_kernel
            return Relaunch(direct_combine_kernel, (2 * C,), _DIRECT_COMBINE_VARY, arrive_word=header.arrive_word,
                            slot_word=header.ring_word, capacity=self._capacity(slot_words),
                            stage_tokens=_stage_tokens(), AMAX=2 * CMAX, REDUCE_ROWS=max(1, rows // 2), **fixed)
        from .combine import combine_kernel
        return Relaunch(combine_kernel, (2 * C,), _RINGS_COMBINE_VARY, tail_word=header.tail_word,
                        head_word=header.head_word, sent_word=header.sent_word, recvd_word=header.recvd_word,
                        ring_word=header.ring_word, ring_words=ring_words, ring_slots=ring_slots, batch=batch,
                        CMAX=CMAX, **fixed)

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def close(self) -> None:
        self.peers.close()


def _stage_tokens() -> int:
    """The direct kernels' stage: settings.STAGE_TOKENS, or one stage (0) as 2^30 tokens."""
    return settings.STAGE_TOKENS or 1 << 30


def combine_slot(topk: int, hidden: int) -> Tuple[int, int]:
    """(word offset of the row in a combine slot, words per slot): top-k weights first, then the bf16 row."""
    x_offset = _round_up(topk, 4)
    return x_offset, _round_up(x_offset + hidden // 2, 4)


def rows_per_step(row_elements: int, tile_elements: int) -> int:
    """Rows a program moves at once: about `tile_elements` values in flight, 1 to 8 rows."""
    return max(1, min(8, next_pow2(tile_elements // next_pow2(max(row_elements, 1)) + 1) // 2))


def plan_from_handle(handle: tuple, rank: int, read_shares: bool) -> Plan:
    """Where every row of a dispatch went, from its intranode handle alone (torch operations); with
    `read_shares`, also the largest shares (one host wait), else they stay unknown. They also stay unknown
    (the rings, as with the original handle) for a handle of a num_worst_tokens dispatch: its rows are not
    the rows received."""
    rank_prefix_matrix, channel_prefix, recv_channel_prefix, recv_src_idx, is_token_in_rank, _ = handle
    num_ranks, num_channels = channel_prefix.shape
    prefix = torch.zeros(num_ranks + 1, dtype=torch.int32, device=is_token_in_rank.device)
    prefix[1:] = rank_prefix_matrix[:, rank]
    per_source = prefix[1:] - prefix[:-1]
    ends = torch.cat([recv_channel_prefix[:, 1:], per_source.view(num_ranks, 1)], dim=1)
    # rows source s sends to destination d (the matrix is their running sum over sources)
    counts = torch.diff(rank_prefix_matrix, dim=0, prepend=torch.zeros_like(rank_prefix_matrix[:1]))
    push_row0 = (rank_prefix_matrix[rank - 1] if rank else torch.zeros_like(rank_prefix_matrix[0])).to(torch.int32)
    combine_row0 = counts[:, :rank].sum(dim=1).to(torch.int32)
    shares = (None, None)
    if read_shares:   # most rows any rank receives, most any rank sends; rows this rank received
        most_received, most_sent, received = torch.stack(
            [rank_prefix_matrix[-1].max(), counts.sum(dim=1).max(), rank_prefix_matrix[-1, rank]]).tolist()
        if received == recv_src_idx.shape[0]:
            shares = (int(most_received), int(most_sent))
    return Plan(_before(is_token_in_rank), (ends - recv_channel_prefix).to(torch.int32),
                (prefix[:num_ranks].view(num_ranks, 1) + recv_channel_prefix).to(torch.int32), prefix, push_row0,
                combine_row0, num_channels, *shares)


def _before(is_token_in_rank: torch.Tensor) -> torch.Tensor:
    """[T + 1, R] int32: for each token t and rank d, how many tokens before t go to d."""
    counts = torch.zeros((is_token_in_rank.shape[0] + 1, is_token_in_rank.shape[1]), dtype=torch.int32,
                         device=is_token_in_rank.device)
    torch.cumsum(is_token_in_rank, dim=0, dtype=torch.int32, out=counts[1:])
    return counts
