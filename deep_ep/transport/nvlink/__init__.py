"""NVLink transport: layout, normal dispatch and combine as Triton kernels on peer-mapped buffers (one node).

  get_dispatch_layout: one local kernel, no host wait;
  non-cached dispatch: notify kernel (counts to every rank) -> counts to the host (the API's receive-count
    wait; skipped with num_worst_tokens) -> streaming dispatch kernel;
  cached dispatch, combine: the streaming kernel alone, with the routing kept from the handle.
When the largest share any rank receives (dispatch) or sent in the dispatch (combine) fits its buffer
whole, one kernel pushes every row straight to its final slot with all programs (direct.py); otherwise
the rows stream through per-(source, channel) rings with flow control (dispatch.py, combine.py), so any
buffer that holds one row per ring works. The direct protocol needs the counts the non-cached dispatch
waits for; a num_worst_tokens dispatch on any rank, and its handle, use the rings. Nothing else waits on
the host.
Low-latency calls run on a second peer-mapped area (low_latency.py). An operation whose buffer size is 0
goes to the reference transport. Every kernel is launched through a launcher.Relaunch per kernel and shape,
which packs the arguments that do not change from call to call once (a fraction of Triton's host time per
launch).

Buffer layout (identical on every rank; counters int64, records int32):
  [NOTIFY[R] | TAIL[R][CMAX] | HEAD[R][CMAX] | SENT[R][CMAX] | RECVD[R][CMAX] | ARRIVE[R][2 CMAX] | DONE[R] |
   OPS | TICKET | records [2][R][REC_MAX] | rows area]
The rows area is the `num_nvl_bytes` of the Buffer (what get_local_buffer_tensor shows), split evenly into
R x C rings (C = channels of the operation), or slots of the direct protocol; the header before it is extra.
Set DEEP_EP_NVLINK_DIRECT=0 (on every rank) to always use the rings, DEEP_EP_NVLINK_STAGE_TOKENS=n to have
every direct-protocol program copy out (dispatch) or reduce (combine) what has arrived after every n tokens
(rows per peer) it pushes (default: after all).
"""
from __future__ import annotations

import os
import weakref
import zlib
from typing import Any, Callable, Dict, List, NamedTuple, Optional

import torch

from ...checks import disagreement, flag_setting, int_setting
from ...config import _round_up
from ...group import CommTimeoutError, Group, Topology, warn_caller
from ...streams import allocate_outputs, capturing
from ..base import DispatchOutput, Transport
from ..reference import ReferenceTransport, dispatch_fields
from .launcher import Pointer, Relaunch
from .status import (BAD_INPUT, BAD_INPUT_VALUE, MASKS, TIMEOUT, TIMEOUT_PEER, bad_input_error, mask_warning,
                     timeout_error_message)

CMAX = 64                      # most channels (num_sms / 2) an operation may use
MAX_EXPERTS_PER_RANK = 1024
BATCH = int_setting("DEEP_EP_NVLINK_BATCH", 64, minimum=1, maximum=1 << 20)   # tokens (rows per ring) per step
NUM_WARPS = int_setting("DEEP_EP_NVLINK_NUM_WARPS", 16, minimum=1, maximum=32)
DISPATCH_TILE = int_setting("DEEP_EP_NVLINK_DISPATCH_TILE", 16384, minimum=1, maximum=1 << 20)   # int32 words a step
COMBINE_TILE = int_setting("DEEP_EP_NVLINK_COMBINE_TILE", 32768, minimum=1, maximum=1 << 20)     # bf16 values a step
# which program copies a rank's own tokens to its outputs in dispatch: "sender" (the measured default) or
# "receiver" (senders then only push to peers; correct on the GPU, its speed not yet measured on 2 GPUs)
OWN_ROWS = os.environ.get("DEEP_EP_NVLINK_OWN_ROWS", "sender")
if OWN_ROWS not in ("sender", "receiver"):
    raise ValueError(f"DEEP_EP_NVLINK_OWN_ROWS must be 'sender' or 'receiver', got {OWN_ROWS!r}")
DIRECT = flag_setting("DEEP_EP_NVLINK_DIRECT", True)   # the direct protocol where the rows fit
# tokens a direct dispatch program pushes (rows per peer, in a direct combine) between two looks at what has
# arrived, to copy out or reduce (direct.py); 0: all of them first
STAGE_TOKENS = int_setting("DEEP_EP_NVLINK_STAGE_TOKENS", 0, minimum=0, maximum=1 << 30)
LAYOUT_TOKENS = 64             # tokens per layout program
_ALIGN = 256


def _stage_tokens() -> int:
    """The direct kernels' stage (STAGE_TOKENS; one stage as 2^30 tokens)."""
    return STAGE_TOKENS or 1 << 30


def _ctrl_bytes(num_ranks: int) -> int:
    return _round_up((num_ranks + 6 * num_ranks * CMAX + num_ranks + 2) * 8, _ALIGN)


def _record_max(num_ranks: int) -> int:
    return 2 + num_ranks + MAX_EXPERTS_PER_RANK + CMAX   # see notify.py


def control_words(num_ranks: int) -> Dict[str, int]:
    """Where the counters and records sit in the NVLink buffer's header, in 8-byte words (ring_word: where the
    rings start, in 4-byte words); the same in every rank's buffer."""
    R = num_ranks
    arrive_word = R + 4 * R * CMAX
    done_word = arrive_word + 2 * R * CMAX
    return dict(notify_word=0, tail_word=R, head_word=R + R * CMAX, sent_word=R + 2 * R * CMAX,
                recvd_word=R + 3 * R * CMAX, arrive_word=arrive_word, done_word=done_word, ops_word=done_word + R,
                ticket_word=done_word + R + 1, record_word=_ctrl_bytes(R) // 4, ring_word=header_bytes(R) // 4)


def header_bytes(num_ranks: int) -> int:
    """Bytes of the NVLink buffer before the rings: counters and notify records."""
    return _round_up(_ctrl_bytes(num_ranks) + 2 * num_ranks * _record_max(num_ranks) * 4, _ALIGN)


def _next_pow2(value: int) -> int:
    return 1 << max(value - 1, 0).bit_length()


class _Plan(NamedTuple):
    """Where every row goes, on the device: enough to run a streaming kernel without the host. The tables are
    kernel arguments only: int32 tensors, or Pointers into a dispatch's table memory."""
    before: torch.Tensor      # [T + 1, R] int32: tokens before t that go to rank d (exclusive prefix)
    recv_count: Any           # [R, C] int32: rows this rank receives from (source, channel)
    recv_base: Any            # [R, C] int32: first output row of (source, channel)
    prefix: Any               # [R + 1] int32: first output row per source; prefix[R] = rows received
    push_row0: Any            # [R] int32: first row of this rank's rows in each destination's outputs
    combine_row0: Any         # [R] int32: first slot of this rank's rows in each source's combine area
    num_channels: int
    max_recv_rows: Optional[int]  # most rows any rank receives, most any rank sends (None: unknown to the
    max_send_rows: Optional[int]  # host, so the rings serve this routing)


def _agree_on_settings(group: Group) -> None:
    """The environment settings that both ends of an exchange use must be the same on every rank (a sender
    and a receiver that disagree would garble rows or wait forever): a difference raises ValueError on every
    rank, naming the variable."""
    from .low_latency import NUM_SENDERS
    group.agree_on({"$DEEP_EP_NVLINK_DIRECT": int(DIRECT), "$DEEP_EP_NVLINK_OWN_ROWS": int(OWN_ROWS == "receiver"),
                    "$DEEP_EP_NVLINK_BATCH": BATCH, "$DEEP_EP_LL_SENDERS": NUM_SENDERS}, "NVLink transport settings")


class NVLinkTransport(Transport):
    name = "nvlink"
    checks_values_on_device = True
    graph_capturable = True

    def __init__(self, group: Group, topology: Topology, device: torch.device, num_nvl_bytes: int,
                 num_low_latency_bytes: int, timeout_s: float) -> None:
        super().__init__(group, topology, device)
        from .low_latency import NVLinkLowLatency
        from .peer_memory import PeerBuffers
        if topology.is_internode:
            raise ValueError("transport='nvlink' needs every rank of the group on one node")
        _agree_on_settings(group)
        self.reference = ReferenceTransport(group, topology, device)
        self.has_rings = num_nvl_bytes > 0
        if not self.has_rings:   # normal mode without a ring buffer (num_nvl_bytes == 0): the reference serves it
            for name in ("get_dispatch_layout", "dispatch", "cached_dispatch", "combine"):
                setattr(self, name, getattr(self.reference, name))
        self.checks_values_on_device = self.graph_capturable = self.has_rings
        R = topology.num_ranks
        for name, word in control_words(R).items():   # (self.tail_word, self.head_word, ..., self.ring_word)
            setattr(self, name, word)
        self.record_max = _record_max(R)
        # [counters and records | rings]: the rings are the `num_nvl_bytes` users see (get_local_buffer_tensor);
        # what they write there only meets rows in transit, never the counters
        memory = torch.empty(self.ring_word * 4 + _round_up(num_nvl_bytes, 16), dtype=torch.uint8, device=device)
        memory[:self.ring_word * 4].zero_()
        self._released = False
        self.local_buffer = memory[self.ring_word * 4:self.ring_word * 4 + num_nvl_bytes]
        self.total_words = memory.numel() // 4
        torch.cuda.synchronize(device)
        self.peers = PeerBuffers(memory, group)
        self.epoch = torch.zeros(1, dtype=torch.int64, device=device)
        # [timeout code, its peer, bad expert id seen, the id | per rank: why shrink mode masked it (0: it was not)]
        self.status = torch.zeros(4 + R, dtype=torch.int32, device="cpu").pin_memory()
        self._status_words = self.status.numpy()   # the same pinned memory, read without torch overhead
        self.layout_bad = torch.zeros(2, dtype=torch.int64, device=device)
        # layout.py's DONE and SUMS, zeros between calls; SUMS is set up at the first call
        self.layout_done = torch.zeros(1, dtype=torch.int32, device=device)
        self.layout_sums = torch.zeros(0, dtype=torch.int32, device=device)
        self._retired_layout_sums: List[torch.Tensor] = []
        scratch = torch.zeros(4 + R, dtype=torch.int64, device=device)   # value checks of a dispatch
        self.checks, self.mismatch = scratch[:4], scratch[4:]
        self._no_ids = torch.zeros(1, dtype=torch.int64, device=device)   # topk_idx of a dispatch without one
        self._signatures: Dict[tuple, int] = {}   # _signature's results
        self.timeout_ns = int(timeout_s * 1e9)
        self._channels: Optional[int] = None
        self._plans: Dict[int, _Plan] = {}   # id(handle[3]) -> plan, forgotten with the handle
        self._launches: Dict[tuple, Any] = {}   # per kernel and shape (_launch)
        self._geometries: Dict[tuple, tuple] = {}    # _dispatch_geometry's results
        self.low_latency: Optional[NVLinkLowLatency] = None
        if num_low_latency_bytes > 0:   # else the class's methods hand low-latency calls to the reference
            self.low_latency = NVLinkLowLatency.open_on_group(group, topology, device, num_low_latency_bytes,
                                                              self.status, self.timeout_ns)
            self.low_latency_buffer = self.low_latency.area
            self.low_latency_checks_values_on_device = self.low_latency_graph_capturable = True
            self.low_latency_dispatch = self.low_latency.dispatch
            self.low_latency_combine = self.low_latency.combine
        torch.cuda.synchronize(device)   # (the zeroed tensors above are complete before a call on any stream)
        group.barrier("NVLink transport set-up")

    # ---- bookkeeping -------------------------------------------------------------------------------
    def _check_status(self) -> None:
        if self._status_words[TIMEOUT]:
            peer = int(self._status_words[TIMEOUT_PEER])
            self.group.mark_broken(f"a GPU wait for rank {peer}")
            raise CommTimeoutError(timeout_error_message(self.topology.rank, peer, int(self._status_words[TIMEOUT]),
                                                         self.timeout_ns / 1e9))

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
        self._check_status()
        if num_channels > CMAX:
            raise ValueError(f"config.num_sms must be <= {2 * CMAX} for the NVLink transport, got {2 * num_channels}")
        if self._channels != num_channels:
            if self._channels is not None:
                torch.cuda.synchronize(self.device)
                self._check_status()
                self.group.barrier("NVLink transport channel change")
            self._channels = num_channels

    def _rings(self, slot_words: int, num_channels: int, what: str):
        """(words per ring, slots per ring, tokens per flow-control step) for slots of `slot_words`."""
        R = self.topology.num_ranks
        ring_words = (self.total_words - self.ring_word) // (R * num_channels) // 4 * 4
        slots = ring_words // slot_words
        if slots < 1:
            have = (self.total_words - self.ring_word) * 4
            need = R * num_channels * slot_words * 4
            raise ValueError(f"{what}: num_nvl_bytes={have} is too small for the NVLink transport with {num_channels} "
                             f"channels and rows of {slot_words * 4} bytes: need at least {need} (one row per ring)")
        return ring_words, slots, min(BATCH, slots)

    def _fits_whole(self, most_rows: Optional[int], slot_words: int) -> bool:
        """Whether the direct protocol serves an operation: its largest per-rank share (the same on every rank)
        is known and fits the rows area whole."""
        return DIRECT and most_rows is not None and most_rows <= self._capacity(slot_words)

    def _capacity(self, slot_words: int) -> int:
        """Slots of `slot_words` words in the rows area."""
        return (self.total_words - self.ring_word) // slot_words

    def _remember(self, rows: torch.Tensor, plan: _Plan) -> None:
        key = id(rows)
        self._plans[key] = plan
        weakref.finalize(rows, self._plans.pop, key, None)

    def _plan(self, handle) -> _Plan:
        """The plan of a handle: kept from its dispatch, else rebuilt from the handle's tensors (with one host
        wait for the largest shares, so that this rank picks the protocol its peers pick with the original
        handle; inside a CUDA-graph capture, which cannot wait, a rebuilt plan uses the rings)."""
        plan = self._plans.get(id(handle[3]))
        if plan is None:
            plan = plan_from_handle(handle, self.topology.rank,
                                    read_shares=not torch.cuda.is_current_stream_capturing())
            self._remember(handle[3], plan)
        return plan

    # ---- layout ----------------------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx, num_experts):
        R, dev = self.topology.num_ranks, self.device
        num_tokens, topk = topk_idx.shape
        key = ("layout", topk, num_experts)
        relaunch = self._launch(key, lambda: self._layout_launch(topk, num_experts))
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
            if torch.cuda.is_current_stream_capturing():   # its zero-fill would only run at the first replay
                raise RuntimeError(f"get_dispatch_layout: call it once with num_experts={num_experts} outside CUDA "
                                   "graph capture first (it sets up the kernel's accumulator, which a capture cannot)")
            self._retired_layout_sums.append(self.layout_sums)   # graphs captured with it still use it
            self.layout_sums = torch.zeros(R + num_experts, dtype=torch.int32, device=self.device)
        return Relaunch(
            layout_kernel, (1,), ("idx_ptr", "per_rank_ptr", "per_expert_ptr", "in_rank_ptr", "num_tokens"),
            sums_ptr=self.layout_sums, done_ptr=self.layout_done, bad_ptr=self.layout_bad, num_experts=num_experts,
            experts_per_rank=num_experts // R, K=topk, R=R, BLOCK_T=LAYOUT_TOKENS, BLOCK_K=_next_pow2(topk),
            BLOCK_R=_next_pow2(R), BLOCK_E=_next_pow2(num_experts + 1) if num_experts <= HISTOGRAM_MAX else 0,
            COPY=COPY_BLOCK, num_warps=4)

    # ---- dispatch ------------------------------------------------------------------------------------------
    def dispatch(self, x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                 num_tokens_per_expert, expert_alignment, num_worst_tokens, num_channels, check_values=None):
        # (check_values is None: the kernels check the values and every rank raises at this dispatch's count wait;
        # with num_worst_tokens there is no wait and no check)
        topo, dev = self.topology, self.device
        R, C, rank = topo.num_ranks, num_channels, topo.rank
        num_tokens, num_experts = x.shape[0], num_tokens_per_expert.numel()
        experts_per_rank = num_experts // R
        self._begin(C)
        geometry = self._dispatch_geometry(x, x_scales, topk_idx, C)
        call = dispatch_fields(x, x_scales, topk_idx, C, num_experts=num_experts,
                               has_weights=int(topk_weights is not None))
        key = tuple(call.values())
        signature = self._signatures.get(key)
        if signature is None:
            signature = self._signatures[key] = _signature("dispatch", *key, self.total_words)
        key = ("notify", C, num_experts, bool(num_worst_tokens))
        prepare, notify, fill_plan, plan_tables = self._launch(key, lambda: self._notify_launches(key))
        before = torch.empty((num_tokens + 1, R), dtype=torch.int32, device=dev)
        send_head = torch.empty((num_tokens, R), dtype=torch.int32, device=dev)
        channel_counts = torch.empty((R, C), dtype=torch.int32, device=dev)
        prepare(Pointer(is_token_in_rank, torch.int8), num_tokens_per_rank,
                self._no_ids if topk_idx is None else topk_idx, before, send_head, channel_counts, num_tokens,
                0 if topk_idx is None else topk_idx.numel())
        record_len = 2 + R + experts_per_rank + C
        received = torch.empty((R, record_len), dtype=torch.int32, device=dev)
        notify(Pointer(before, torch.int32, num_tokens * R * 4), num_tokens_per_expert, channel_counts, signature,
               received)
        # the plan's tables in one allocation: [prefix | recv_count | recv_base | push_row0 | combine_row0 |
        # recv_channel_prefix | channel_prefix | rank_prefix_matrix] (the last three are the handle's tensors)
        tables = torch.empty(R + 1 + 2 * R * C + 2 * R + 2 * R * C + R * R, dtype=torch.int32, device=dev)
        prefix, recv_count, recv_base, push_row0, combine_row0 = (Pointer(tables, torch.int32, 4 * offset)
                                                                  for offset in plan_tables[:5])
        handle_tables = tables[plan_tables[5]:]
        recv_channel_prefix = handle_tables[:R * C].view(R, C)
        channel_prefix = handle_tables[R * C:2 * R * C].view(R, C)
        rank_prefix_matrix = handle_tables[2 * R * C:].view(R, R)
        payload = torch.empty(1 + experts_per_rank + 2 * R + 6, dtype=torch.int64, device=dev)
        fill_plan(received, channel_counts, prefix, recv_count, recv_base, rank_prefix_matrix, channel_prefix,
                  recv_channel_prefix, push_row0, combine_row0, payload, expert_alignment)
        if num_worst_tokens:
            num_rows, aligned_list, most = num_worst_tokens, [], (None, None)
        else:
            num_rows, aligned_list, most = self._wait_counts(payload, signature, call)
        plan = _Plan(before, recv_count, recv_base, prefix, push_row0, combine_row0, C, *most)
        out = self._run_dispatch(x, x_scales, topk_idx, topk_weights, is_token_in_rank, plan, num_rows,
                                 rank * experts_per_rank, experts_per_rank, geometry)
        out.handle = (rank_prefix_matrix, channel_prefix, recv_channel_prefix, out.handle, is_token_in_rank, send_head)
        out.num_recv_tokens_per_expert_list = aligned_list
        self._remember(out.handle[3], plan)
        return out

    def _notify_launches(self, key: tuple):
        """The prepare, notify and plan kernels of a non-cached dispatch for (channels, experts, no host wait),
        and the word offsets of the plan's tables (prefix, recv_count, recv_base, push_row0, combine_row0, then
        where the handle's tables start)."""
        from .notify import notify_kernel
        from .plan import plan_kernel, prepare_kernel
        _, C, num_experts, no_wait = key
        R, rank = self.topology.num_ranks, self.topology.rank
        experts_per_rank = num_experts // R
        record_len = 2 + R + experts_per_rank + C
        prepare = Relaunch(prepare_kernel, (R + 1,), ("in_rank_ptr", "per_rank_ptr", "idx_ptr", "before_ptr",
                                                     "send_head_ptr", "channel_counts_ptr", "num_tokens", "num_ids"),
                           layout_bad_ptr=self.layout_bad, mismatch_ptr=self.mismatch, checks_ptr=self.checks,
                           epoch_ptr=self.epoch, num_experts=num_experts, C=C, no_wait=1 if no_wait else 0, R=R,
                           BLOCK=1024, BLOCK_C=_next_pow2(C), BLOCK_IDS=8192, num_warps=8)
        notify = Relaunch(notify_kernel, (R,), ("colsum_ptr", "per_expert_ptr", "channel_counts_ptr", "signature",
                                                "received_ptr"),
                          mismatch_ptr=self.mismatch, checks_ptr=self.checks, bases_ptr=self.peers.bases,
                          notify_flag_word=self.notify_word, notify_word=self.record_word, epoch_ptr=self.epoch,
                          status_ptr=self.status, rank=rank, timeout_ns=self.timeout_ns,
                          experts_per_rank=experts_per_rank, C=C, R=R, REC=record_len, STRIDE=self.record_max,
                          BLOCK=_next_pow2(record_len), BLOCK_R=_next_pow2(R), num_warps=4)
        plan = Relaunch(plan_kernel, (1,), ("received_ptr", "channel_counts_ptr", "prefix_ptr", "recv_count_ptr",
                                            "recv_base_ptr", "rank_prefix_ptr", "channel_prefix_ptr",
                                            "recv_channel_prefix_ptr", "push_row0_ptr", "combine_row0_ptr",
                                            "payload_ptr", "expert_alignment"),
                        checks_ptr=self.checks, rank=rank, experts_per_rank=experts_per_rank, REC=record_len, R=R,
                        C=C, BLOCK_R=_next_pow2(R), BLOCK_C=_next_pow2(C), BLOCK_E=_next_pow2(experts_per_rank),
                        num_warps=4)
        sizes = (R + 1, R * C, R * C, R, R)
        offsets = tuple(sum(sizes[:i]) for i in range(len(sizes) + 1))
        return prepare, notify, plan, offsets

    def _wait_counts(self, payload, signature: int, call: Dict[str, int]):
        """The API's host wait for the received counts; with it, every rank learns whether all ranks called
        with the same shapes and valid values, and if not, all of them raise before any row moves."""
        host = payload.cpu().tolist()
        self._check_status()
        R, rank = self.topology.num_ranks, self.topology.rank
        num_experts = call["num_experts"]
        E_loc = len(host) - 1 - 2 * R - 6
        num_recv, aligned = host[0], host[1:1 + E_loc]
        signatures, flags = host[1 + E_loc:1 + E_loc + R], host[1 + E_loc + R:1 + E_loc + 2 * R]
        _own_flags, low, high, layout_value, max_recv_rows, max_send_rows = host[1 + E_loc + 2 * R:]
        others = [r for r, s in enumerate(signatures) if s != signature]
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
                             f"{layout_value} (the NVLink transport checks expert ids on the GPU and reports them "
                             "at the next dispatch)")
        if flags[rank] & 2:
            raise ValueError(f"topk_idx entries must be -1 or in [0, {num_experts}), found {low if low < -1 else high}")
        if flags[rank] & 4:
            raise ValueError("num_tokens_per_rank must equal the column sums of is_token_in_rank "
                             "(pass the outputs of one get_dispatch_layout call)")
        failed = [r for r, f in enumerate(flags) if f & 7]
        if failed:
            raise ValueError(f"dispatch: rank(s) {failed} passed invalid inputs (see the errors there); no rank "
                             "sent anything")
        if any(f & 8 for f in flags):   # a rank that does not wait cannot know the shares: all use the rings
            return num_recv, aligned, (None, None)
        return num_recv, aligned, (max_recv_rows, max_send_rows)

    def cached_dispatch(self, x, x_scales, handle, num_channels):
        plan = self._plan(handle)
        self._begin(plan.num_channels)
        geometry = self._dispatch_geometry(x, x_scales, None, plan.num_channels)
        out = self._run_dispatch(x, x_scales, None, None, handle[4], plan, handle[3].shape[0], 0, 0, geometry)
        out.handle = None
        return out

    def _dispatch_geometry(self, x, x_scales, topk_idx, num_channels):
        """(hidden words, scale words, top-k, id offset, slot words, ring words, ring slots, batch) of a dispatch."""
        key = (x.shape[1] * x.element_size(), 0 if x_scales is None else x_scales.shape[1],
               0 if topk_idx is None else topk_idx.shape[1], num_channels)
        geometry = self._geometries.get(key)
        if geometry is None:
            row_bytes, scale_words, topk, _ = key
            hidden_words = row_bytes // 4
            id_offset = _round_up(hidden_words + scale_words, 2)
            slot_words = _round_up(id_offset + 3 * topk + 1, 4)
            geometry = self._geometries[key] = (hidden_words, scale_words, topk, id_offset, slot_words,
                                                *self._rings(slot_words, num_channels, "dispatch"))
        return geometry

    def _run_dispatch(self, x, x_scales, topk_idx, topk_weights, is_token_in_rank, plan: _Plan, num_rows,
                      expert_begin, experts_per_rank, geometry) -> DispatchOutput:
        dev = self.device
        scale_words, topk, slot_words = geometry[1], geometry[2], geometry[4]
        if x.data_ptr() % 16:
            x = x.clone()      # the kernel moves rows in 16-byte vectors
        scales = None if x_scales is None else x_scales.contiguous()
        recv_x, recv_scales, recv_idx, recv_weights, recv_src = allocate_outputs(lambda: (
            x.new_empty((num_rows, x.shape[1])),
            None if scales is None else scales.new_empty((num_rows, scale_words)),
            None if topk_idx is None else torch.empty((num_rows, topk), dtype=topk_idx.dtype, device=dev),
            None if topk_weights is None else torch.empty((num_rows, topk), dtype=torch.float32, device=dev),
            torch.empty(num_rows, dtype=torch.int32, device=dev)))
        direct = self._fits_whole(plan.max_recv_rows, slot_words)
        key = ("dispatch", direct, geometry, plan.num_channels, topk_weights is not None, expert_begin,
               experts_per_rank)
        relaunch = self._launch(key, lambda: self._dispatch_launch(direct, geometry, plan.num_channels,
                                                                   topk_weights is not None, expert_begin,
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

    def _dispatch_launch(self, direct: bool, geometry: tuple, C: int, has_weights: bool, expert_begin: int,
                         experts_per_rank: int) -> Relaunch:
        """The dispatch kernel with what stays the same for a shape (the rest: _DISPATCH_VARY)."""
        hidden_words, scale_words, topk, id_offset, slot_words, ring_words, ring_slots, batch = geometry
        R = self.topology.num_ranks
        fixed = dict(bases_ptr=self.peers.bases, status_ptr=self.status, rank=self.topology.rank,
                     expert_begin=expert_begin, experts_per_rank=max(experts_per_rank, 1), ops_word=self.ops_word,
                     done_word=self.done_word, ticket_word=self.ticket_word, slot_words=slot_words,
                     timeout_ns=self.timeout_ns, C=C, R=R, XW=hidden_words, SW=scale_words, K=topk, HAS_W=has_weights,
                     ID_OFF=id_offset, BLOCK_X=_next_pow2(max(hidden_words, 1)),
                     BLOCK_S=_next_pow2(max(scale_words, 1)),
                     BLOCK_K=_next_pow2(max(topk, 1)), BLOCK_R=_next_pow2(R),
                     ROWS=_rows_per_step(hidden_words, DISPATCH_TILE), num_warps=NUM_WARPS)
        if direct:
            from .direct import direct_dispatch_kernel
            vary = _DISPATCH_VARY[:9] + ("push_row0_ptr",) + _DISPATCH_VARY[9:]
            return Relaunch(direct_dispatch_kernel, (2 * C,), vary,
                            arrive_word=self.arrive_word, slot_word=self.ring_word,
                            capacity=self._capacity(slot_words), stage_tokens=_stage_tokens(),
                            AMAX=2 * CMAX, **fixed)
        from .dispatch import dispatch_kernel
        return Relaunch(dispatch_kernel, (2 * C,), _DISPATCH_VARY, tail_word=self.tail_word, head_word=self.head_word,
                        sent_word=self.sent_word, recvd_word=self.recvd_word, ring_word=self.ring_word,
                        ring_words=ring_words, ring_slots=ring_slots, batch=batch, CMAX=CMAX,
                        OWN_BY_SENDER=OWN_ROWS == "sender", **fixed)

    # ---- combine ---------------------------------------------------------------------------------------------
    def combine(self, x, handle, topk_weights, biases, num_channels):
        plan = self._plan(handle)
        C, hidden = plan.num_channels, x.shape[1]
        self._begin(C)
        topk = 0 if topk_weights is None else topk_weights.shape[1]
        bias0, bias1 = biases
        direct = self._fits_whole(plan.max_send_rows, _combine_slot(topk, hidden)[1])
        key = ("combine", hidden, topk, bias0 is not None, bias1 is not None, C, direct)
        relaunch = self._launch(key, lambda: self._combine_launch(direct, hidden, topk, bias0 is not None,
                                                                  bias1 is not None, C))
        in_rank = handle[4]
        num_tokens = in_rank.shape[0]
        combined, combined_weights = allocate_outputs(lambda: (
            torch.empty((num_tokens, hidden), dtype=torch.bfloat16, device=self.device),
            None if topk_weights is None else torch.empty((num_tokens, topk), dtype=torch.float32, device=self.device)))
        dummy = plan.prefix
        inputs = (x, dummy if topk_weights is None else topk_weights, Pointer(in_rank, torch.int8), plan.before)
        outputs = (dummy if bias0 is None else bias0, dummy if bias1 is None else bias1, combined,
                   dummy if combined_weights is None else combined_weights, num_tokens, x.shape[0])
        tables = (plan.recv_count, plan.recv_base, plan.prefix) + ((plan.combine_row0,) if direct else ())
        relaunch(*inputs, *tables, *outputs)
        return combined, combined_weights

    def _combine_launch(self, direct: bool, hidden: int, topk: int, has_bias0: bool, has_bias1: bool,
                        C: int) -> Relaunch:
        """The combine kernel with what stays the same for a shape (the rest: _COMBINE_VARY and the plan's
        tables)."""
        R = self.topology.num_ranks
        x_offset, slot_words = _combine_slot(topk, hidden)
        ring_words, ring_slots, batch = self._rings(slot_words, C, "combine")
        vary = _COMBINE_VARY[:4] + ("recv_count_ptr", "recv_base_ptr", "prefix_ptr") + _COMBINE_VARY[4:]
        fixed = dict(bases_ptr=self.peers.bases, status_ptr=self.status, rank=self.topology.rank,
                     ops_word=self.ops_word, done_word=self.done_word, ticket_word=self.ticket_word,
                     slot_words=slot_words, timeout_ns=self.timeout_ns, R=R, H=hidden, K=topk, X_OFF=x_offset,
                     HAS_BIAS0=has_bias0, HAS_BIAS1=has_bias1, BLOCK_H=_next_pow2(hidden),
                     BLOCK_K=_next_pow2(max(topk, 1)), BLOCK_R=_next_pow2(R),
                     ROWS=_rows_per_step(hidden, COMBINE_TILE), num_warps=NUM_WARPS)
        if direct:
            # (its reduce takes tiles of half a push step's rows: their f32 sums then stay in registers beside the
            # kernel's other live values, where full tiles spill to local memory in the sm_90 code)
            from .direct import direct_combine_kernel
            return Relaunch(direct_combine_kernel, (2 * C,), vary[:7] + ("combine_row0_ptr",) + vary[7:],
                            arrive_word=self.arrive_word, slot_word=self.ring_word,
                            capacity=self._capacity(slot_words), stage_tokens=_stage_tokens(), C=C,
                            AMAX=2 * CMAX, REDUCE_ROWS=max(1, fixed["ROWS"] // 2), **fixed)
        from .combine import combine_kernel
        return Relaunch(combine_kernel, (2 * C,), vary, tail_word=self.tail_word, head_word=self.head_word,
                        sent_word=self.sent_word, recvd_word=self.recvd_word, ring_word=self.ring_word,
                        ring_words=ring_words, ring_slots=ring_slots, batch=batch, C=C, CMAX=CMAX, **fixed)

    # ---- low latency (low_latency.py) ----------------------------------------------------------------------
    def check_low_latency_errors(self) -> None:
        """Report a timeout, or expert ids out of range seen by an earlier low-latency kernel; warn about ranks
        that shrink mode masked after a timeout since the last call."""
        if self.low_latency is None:
            return
        self._check_status()
        words = self._status_words
        masked = words[MASKS:].nonzero()[0] if self.low_latency.auto_mask else ()   # (only shrink mode's waits mask)
        for peer in masked.tolist() if len(masked) else ():
            code = int(words[MASKS + peer])
            words[MASKS + peer] = 0
            warn_caller(mask_warning(self.topology.rank, peer, code, self.timeout_ns / 1e9))
        if words[BAD_INPUT]:
            error = bad_input_error(self.topology.rank, int(words[BAD_INPUT]), int(words[BAD_INPUT_VALUE]))
            words[BAD_INPUT] = 0
            raise error

    def low_latency_dispatch(self, *args, **kwargs):   # without a low-latency area (__init__ rebinds it otherwise)
        return self.reference.low_latency_dispatch(*args, **kwargs)

    def low_latency_combine(self, *args, **kwargs):
        return self.reference.low_latency_combine(*args, **kwargs)

    def clean_low_latency(self, num_max_tokens, hidden, num_experts) -> None:
        self.reference.clean_low_latency(num_max_tokens, hidden, num_experts)
        if self.low_latency is not None:
            self.low_latency.clean(num_max_tokens, hidden, num_experts)

    def destroy(self, wait_for_gpu: bool = True) -> None:
        self._released = True
        if wait_for_gpu:
            torch.cuda.synchronize(self.device)
            if int(self._status_words[0]):   # a wait that timed out after the last call: the ranks are out of step
                self.group.mark_broken(f"a GPU wait for rank {int(self._status_words[1])}")
        self.peers.close()
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


# the dispatch kernels' arguments that change from call to call (the direct kernel also has push_row0_ptr after
# prefix_ptr)
_DISPATCH_VARY = ("x_ptr", "scales_ptr", "idx_ptr", "weights_ptr", "in_rank_ptr", "before_ptr", "recv_count_ptr",
                  "recv_base_ptr", "prefix_ptr", "out_x_ptr", "out_scales_ptr", "out_idx_ptr", "out_weights_ptr",
                  "out_src_ptr", "num_tokens", "num_rows")


# the combine kernels' arguments that change from call to call, less the plan's tables in the middle
_COMBINE_VARY = ("x_ptr", "weights_ptr", "in_rank_ptr", "before_ptr", "bias0_ptr", "bias1_ptr", "out_ptr",
                 "out_weights_ptr", "num_tokens", "num_rows")


def _combine_slot(topk: int, hidden: int):
    """(word offset of the row in a combine slot, words per slot): top-k weights first, then the bf16 row."""
    x_offset = _round_up(topk, 4)
    return x_offset, _round_up(x_offset + hidden // 2, 4)


def _rows_per_step(row_elements: int, tile_elements: int) -> int:
    """Rows a program moves at once: about `tile_elements` values in flight, 1 to 8 rows."""
    return max(1, min(8, _next_pow2(tile_elements // _next_pow2(max(row_elements, 1)) + 1) // 2))


def plan_from_handle(handle, rank: int, read_shares: bool) -> _Plan:
    """Where every row of a dispatch went, from its intranode handle alone (torch operations); with
    `read_shares`, also the largest shares (one host wait), else they stay unknown. They also stay unknown
    (the rings, as with the original handle) for a handle of a num_worst_tokens dispatch: its rows are not
    the rows received."""
    rank_prefix_matrix, channel_prefix, recv_channel_prefix, recv_src_idx, in_rank, _ = handle
    num_ranks, num_channels = channel_prefix.shape
    prefix = torch.zeros(num_ranks + 1, dtype=torch.int32, device=in_rank.device)
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
    return _Plan(_before(in_rank), (ends - recv_channel_prefix).to(torch.int32),
                 (prefix[:num_ranks].view(num_ranks, 1) + recv_channel_prefix).to(torch.int32), prefix, push_row0,
                 combine_row0, num_channels, *shares)


def _before(is_token_in_rank: torch.Tensor) -> torch.Tensor:
    """[T + 1, R] int32: for each token t and rank d, how many tokens before t go to d."""
    counts = torch.zeros((is_token_in_rank.shape[0] + 1, is_token_in_rank.shape[1]), dtype=torch.int32,
                         device=is_token_in_rank.device)
    torch.cumsum(is_token_in_rank, dim=0, dtype=torch.int32, out=counts[1:])
    return counts


def _signature(*fields) -> int:
    """An int32 that differs when ranks call with different shapes (compared across ranks)."""
    return zlib.crc32(repr(fields).encode()) & 0x7FFFFFFF
