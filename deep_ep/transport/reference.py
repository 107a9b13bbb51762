"""Reference transport: every operation as torch ops plus a few `torch.distributed` collectives.

It is the semantic oracle of the fast paths and the data path wherever they do not apply (CPU tensors on
a gloo group, CUDA tensors on an NCCL group, one node or many). Per call it runs:
  1. an all-gather of a fixed-size header (operation, call number, shapes) so that ranks calling with
     different shapes or different operations all get a clear error instead of a garbled exchange (calls
     with a handle: once per handle and shapes, Note [checked once per handle]);
  2. the data (Note [rows travel alone]; low latency: Note [one row exchange]): the rows each rank sends
     each rank travel with the header (cached calls take them from the handle), a normal dispatch's other
     counts beside the rows (Note [counts beside the rows]);
and then places the rows with vectorised index operations. Counts go to the host (`tolist`) to size the
variable all-to-all, so this transport always synchronises the host; that is its price, not its contract.

Note [rows travel alone]: the rows of x go in an all-to-all of their own, straight into the output where they
can, with no packing copy; the small per-row fields (scales, top-k ids, weights, metadata) travel packed beside
them in a second one.

Note [agreement overlaps]: a call starts its header exchange, then does the work that needs only this rank's
inputs (choosing and gathering the rows to send, packing their fields, zeroing the accumulator), then completes
the exchange: the headers travel while the rows are gathered. The data exchange itself starts only once every
header has been checked, since a backend given blocks of different sizes by two ranks may abort the process
(gloo does) instead of raising. A rank whose input values were refused completes the exchange at once.

Note [returned in sent order]: a low-latency combine returns each rank's rows grouped by destination rank, then
local expert, then slot, which is the order in which that rank's dispatch sent them (sorted by expert, then token
and top-k slot). A dispatch remembers that order under its `src_info` tensor, so when every rank remembers the
same dispatch (its call number travels with the header) the rows come back alone; otherwise (a handle made by
another Buffer, shrink mode) the (expert, token) ids of every row come back beside them and rows are matched
by key.

Note [one row exchange]: a low-latency dispatch sends each selected row with its FP8 scales, its token's index
and its group at the receiver (source rank * E_loc + local expert) beside it, in one exchange whose sizes (rows
for each rank) travel with the header: the receiver copies the rows into the expert-major output anyway, and
counts them per group itself (a source's rows come sorted by expert, so a group's rows are consecutive), so no
count exchange precedes them.

Note [checked once per handle]: a cached dispatch, a combine or a low-latency combine whose handle's previous
call of the same operation had the same shapes, agreed by every rank (with the handles coming from one
dispatch), moves its rows at once; any other call exchanges its header first. Every rank knows the same
agreed call, so when all ranks repeat it they all skip the header, and ranks that skip it pass the same
shapes. What is not detected is a call that repeats the agreed one on some ranks only, the others passing
other shapes or another dispatch's handle: the skipping ranks' data exchange meets the others' header
exchange, and every rank raises `CommTimeoutError` naming its exchange. On a repeated low-latency combine, a
rank whose ids are refused raises alone, after the exchange (the others do not wait for it).

Note [counts beside the rows]: a dispatch's counts for each destination rank (rows per expert of that rank, and
the inclusive prefix over channels of the rows for that rank and for its node) travel at the end of that rank's
block of per-row fields, as a few more byte rows: the header told every rank how many rows each rank sends it,
so the data exchange can start without a count exchange. The fields are packed side by side (FieldPacker), the
blocks and their tails joined by one cat on each side; the received fields are views of one copy of the rows.

Note [handle routes]: a dispatch keeps the route of its rows (`_Route`) under the handle's tensor with a row per
received row, so that its cached dispatches and combines need no host reads besides their own exchanges; a
handle without one (made by another Buffer) gets it rebuilt from its tensors.
"""
from __future__ import annotations

import functools
import itertools
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..checks import disagreement, dtype_code, too_many_rows_message
from ..fp8 import logfmt_roundtrip, pack_ue8m0, per_token_cast_to_fp8
from ..group import Group, Topology, unmasked_ranks
from ..streams import capturing
from .base import DispatchOutput, LowLatencyDispatchOutput, Transport
from .reference_fixed_size import FixedSizeLowLatency
from .kept import Keeper
from .reference_rows import (INT_OF_SIZE, FieldPacker, copy_rows, exclusive_cumsum, gather_side_by_side,
                             index_add_order, low_latency_receive_buffers, side_by_side, sum_in_index_order,
                             sum_laid_out, weighted_sum_of_selections)

_OPS = {"dispatch": 1, "dispatch (cached)": 2, "combine": 3, "low_latency_dispatch": 4, "low_latency_combine": 5}
_HEADER_FIELDS = 14
# rows of dtypes index_select has no kernel for (float8, unsigned ints in older releases) are selected as
# integers of their element size
_SELECTABLE = {torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int8, torch.int16, torch.int32,
               torch.int64, torch.uint8, torch.bool}


def _take(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`t.index_select(0, index)` for any dtype (rows of other dtypes moved as integers, except for tensors with
    autograd history)."""
    wider = t.element_size() == 16   # viewed as twice as many int64: needs a contiguous last dim
    if t.dtype in _SELECTABLE or t.requires_grad or (wider and t.stride(-1) != 1):
        return t.index_select(0, index)
    return t.view(INT_OF_SIZE[min(t.element_size(), 8)]).index_select(0, index).view(t.dtype)


def dispatch_fields(x, x_scales, topk_idx, num_channels: int, **more: int) -> Dict[str, int]:
    """What every rank's dispatch must agree on, as ints (dtypes as `checks.dtype_code`s; -1 or 0: absent)."""
    return dict(hidden=x.shape[1], dtype=dtype_code(x.dtype),
                num_scales=-1 if x_scales is None else x_scales.shape[1],
                scales_dtype=0 if x_scales is None else dtype_code(x_scales.dtype),
                topk=-1 if topk_idx is None else topk_idx.shape[1], num_channels=num_channels, **more)


def _prefix_by_channel(mask: torch.Tensor, num_channels: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """From one running count over the tokens of `mask` [T, cols]: the inclusive prefix over channels of each
    column's Trues ([cols, C] int32; channel = token // ceil(T / C)), and the index of each True among its
    column's Trues, -1 where False ([T, cols] int32)."""
    num_tokens, cols = mask.shape
    if not num_tokens:
        return (torch.zeros((cols, num_channels), dtype=torch.int32, device=mask.device),
                torch.empty((0, cols), dtype=torch.int32, device=mask.device))
    running = torch.cumsum(mask, dim=0, dtype=torch.int32)
    prefix = running.index_select(0, _last_token_of_channels(num_tokens, num_channels, mask.device)).t().contiguous()
    return prefix, running.mul_(mask).sub_(1)   # (`_positions` of the mask, from the count made here)


@functools.lru_cache(maxsize=16)
def _local_expert_ids(rank: int, num_ranks: int, experts_per_rank: int, device: torch.device) -> torch.Tensor:
    """[num_experts + 1] int64: at global expert id + 1 (0: no expert), the local id of the expert on `rank`, -1
    for the experts of other ranks (kept per shape: a lookup replaces a subtraction and two compares)."""
    local_ids = torch.full((experts_per_rank * num_ranks + 1,), -1, dtype=torch.int64, device=device)
    start = rank * experts_per_rank + 1
    local_ids[start:start + experts_per_rank] = torch.arange(experts_per_rank, device=device)
    return local_ids


@functools.lru_cache(maxsize=16)
def _expert_rows(experts_per_rank: int, num_ranks: int, slots: int) -> torch.Tensor:
    """[R * E_loc] int64 on the CPU: the first row of local expert e's receive rows (e * slots), for each (source
    rank, e) group in source-major order."""
    return torch.arange(experts_per_rank, device="cpu").repeat(num_ranks) * slots


@functools.lru_cache(maxsize=64)
def _last_token_of_channels(num_tokens: int, num_channels: int, device: torch.device) -> torch.Tensor:
    """The last token of each channel (channel = token // ceil(T / C)), clamped to the last token."""
    per_channel = -(-num_tokens // num_channels)
    return torch.tensor([min((c + 1) * per_channel, num_tokens) - 1 for c in range(num_channels)],
                        dtype=torch.int64, device=device)


def _exclusive(inclusive: torch.Tensor) -> torch.Tensor:
    """The exclusive prefix along dim 1 of an inclusive one (shifted right by one, 0 first)."""
    return torch.nn.functional.pad(inclusive[:, :-1], (1, 0))


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """Per column of `mask` [T, cols]: index of each True among that column's Trues, -1 where False."""
    return torch.cumsum(mask, dim=0, dtype=torch.int32).mul_(mask).sub_(1)   # (the running count, -1 where False)


class _Selections(NamedTuple):
    """The (token, top-k slot) selections a low-latency dispatch sent, in the order it sent their rows."""
    token: torch.Tensor
    slot: torch.Tensor
    expert: torch.Tensor
    send_splits: List[int]   # rows sent to each rank: what each rank's combine returns here
    dispatch: int            # the dispatch's call number (the same on every rank)
    agreed: List[tuple]      # the combine call the ranks last agreed on (Note [checked once per handle])
    received: List           # once received: the rows a combine returns, as `_rows_to_return` gives them
    topk_shape: Tuple[int, int]   # the dispatch's topk_idx shape
    sum_order: List          # once a combine summed them on the CPU: `index_add_order` of the rows sent


class _Route(NamedTuple):
    """Where the rows of one dispatch went: Note [handle routes]."""
    destination: torch.Tensor   # destination rank of each row sent, rows in (destination, token) order
    token: torch.Tensor         # source token of each row sent
    send_splits: List[int]      # rows sent to each rank
    recv_splits: List[int]      # rows received from each rank
    dispatch: int               # the dispatch's call number (the same on every rank), -1 if rebuilt from a handle
    agreed: List[tuple]         # the cached call the ranks last agreed on (Note [checked once per handle])


def _route(is_token_in_rank: torch.Tensor, recv_splits: Sequence[int]) -> _Route:
    """The route of a dispatch, rebuilt from its `is_token_in_rank` and the rows it received from each rank."""
    destination, token = is_token_in_rank.t().nonzero(as_tuple=True)
    return _Route(destination, token, is_token_in_rank.sum(0).tolist(), [int(n) for n in recv_splits], -1, [])


def _routing(handle: tuple, internode: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """A handle's `is_token_in_rank` and its tensor with a row per received row (recv_src_meta / recv_src_idx)."""
    if internode:
        is_token_in_rank, *_, recv_src_meta, _send_rdma_head, _send_nvl_head = handle
        return is_token_in_rank, recv_src_meta
    _rank_prefix_matrix, _channel_prefix_matrix, _recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, \
        _send_head = handle
    return is_token_in_rank, recv_src_idx


class ReferenceTransport(Transport):
    name = "reference"

    def __init__(self, group: Group, topology: Topology, device: torch.device) -> None:
        super().__init__(group, topology, device)
        self._call_number = 0
        self._routes = Keeper()   # Note [handle routes]: kept with the handle's tensor of received rows
        self._sent_selections = Keeper()   # Note [returned in sent order]: kept with the handle's src_info
        # low-latency calls as fixed-size exchanges (reference_fixed_size.py): inside a CUDA graph capture, which
        # NCCL groups allow, and wherever this is set (every rank alike)
        self._fixed_size = FixedSizeLowLatency(group, topology.rank, topology.num_ranks)
        self.fixed_size_low_latency = False
        self.low_latency_graph_capturable = device.type == "cuda" and group.cuda_native

    def _route_of(self, handle) -> _Route:
        """The route of a handle: kept from its dispatch, else rebuilt from the handle (host reads)."""
        is_token_in_rank, received_rows = _routing(handle, self.topology.is_internode)
        route = self._routes.get(received_rows)
        if route is None:
            route = _route(is_token_in_rank, self._recv_per_source(handle))
            self._routes.keep(received_rows, route)
        return route

    # ---- agreement --------------------------------------------------------------------------------
    def _start_agreement(self, op: str, fields: Dict[str, int], extra: Sequence[int] = (),
                         ranks: Optional[List[int]] = None, bad_input: Optional[ValueError] = None
                         ) -> Callable[[], torch.Tensor]:
        """Start all-gathering this rank's header (among `ranks`, default all); returns the function that
        completes it. That raises on every rank if any rank's operation or shapes differ, or if any rank refused
        its input values (`bad_input`, from `_refusal`: a rank that raised alone would pair its next call with
        the others' current one), and returns the gathered `extra` rows ([R, 2 * R + 1]: up to 2 * R + 1 values
        a rank, e.g. `num_tokens_per_rank`). Work of this rank alone can go between the two while the headers
        travel (Note [agreement overlaps])."""
        self._call_number += 1
        values = [_OPS[op], self._call_number] + list(fields.values())
        assert len(values) < _HEADER_FIELDS
        extra_len = 2 * self.topology.num_ranks + 1
        assert len(extra) <= extra_len
        header = (values + [0] * (_HEADER_FIELDS - 1 - len(values)) + [int(bad_input is not None)] + list(extra)
                  + [0] * (extra_len - len(extra)))
        pending = self.group.start_all_gather(torch.tensor(header, dtype=torch.int64, device="cpu"),
                                              f"{op} (header exchange)", ranks)

        def finish() -> torch.Tensor:
            gathered = pending.wait()
            if bad_input is not None:
                raise bad_input
            self._check_headers(op, fields, gathered[:, :_HEADER_FIELDS].tolist(), len(values), ranks)
            return gathered[:, _HEADER_FIELDS:]
        if bad_input is not None:   # nothing of this rank's may run on values it refused
            finish()
        return finish

    @staticmethod
    def _refusal(check_values: Optional[Callable[[], None]]) -> Optional[ValueError]:
        """The ValueError with which `check_values` refuses this rank's input values, if it does."""
        try:
            if check_values is not None:
                check_values()
        except ValueError as error:
            return error
        return None

    def _check_headers(self, op: str, fields: Dict[str, int], gathered: List[List[int]], num_values: int,
                       ranks: Optional[List[int]]) -> None:
        """Raise on every rank if a rank refused its input values or called with another operation or shapes
        (`gathered`: every rank's header fields, without the extra values)."""
        taking_part = list(range(self.topology.num_ranks)) if ranks is None else ranks
        refused = [rank for rank in taking_part if gathered[rank][_HEADER_FIELDS - 1]]
        if refused:
            raise ValueError(f"{op}: rank {refused[0]} passed invalid input values (it raised ValueError naming "
                             "them); every rank refuses the call")
        mine = gathered[self.topology.rank][:num_values]
        for rank in taking_part:
            theirs = gathered[rank][:num_values]
            if theirs == mine:
                continue
            if theirs[0] != mine[0]:
                ops = {v: k for k, v in _OPS.items()}
                raise ValueError(f"rank {self.topology.rank} called {op} while rank {rank} called "
                                 f"{ops.get(theirs[0], 'another operation')}: all ranks must make the same calls")
            raise ValueError(disagreement(op, ["call number"] + list(fields), mine[1:], theirs[1:],
                                          self.topology.rank, rank))

    def _start_agreement_on_route(self, op: str, fields: Dict[str, int], route: "_Route") -> Callable[[], None]:
        """`_start_agreement`, and on completion check that the ranks' handles come from the same dispatch: what
        each rank's handle says it sent to every rank is what that rank's handle says it received (else
        ValueError on every rank). A call the ranks agreed on before with this handle exchanges nothing (Note
        [checked once per handle])."""
        call = (op, *fields.values())
        if call in route.agreed:   # Note [checked once per handle]
            self._call_number += 1
            return lambda: None
        R = self.topology.num_ranks
        finish = self._start_agreement(op, fields, extra=route.send_splits + route.recv_splits + [route.dispatch])

        def check() -> None:
            gathered = finish()
            sent, received, dispatches = gathered[:, :R], gathered[:, R:2 * R], gathered[:, 2 * R]
            known = dispatches[dispatches >= 0]
            if known.numel() and not bool((known == known[0]).all()):
                raise ValueError(f"{op}: handle: the ranks passed handles of different dispatches (dispatch call "
                                 f"numbers {dispatches.tolist()} by rank, -1 where unknown); every rank must pass its "
                                 "handle of the same dispatch")
            if not torch.equal(sent, received.t()):
                source, destination = (int(i) for i in (sent != received.t()).nonzero()[0])
                raise ValueError(f"{op}: handle: the ranks passed handles of different dispatches (rank {source}'s "
                                 f"handle has {int(sent[source, destination])} rows for rank {destination}, whose "
                                 f"handle has {int(received[destination, source])} from rank {source}); every rank "
                                 "must pass its handle of the same dispatch")
            route.agreed[:] = [call]
        return check

    def _exchange_rows(self, packed: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
                       what: str, ranks: Optional[List[int]] = None):
        recv = packed.new_empty((sum(recv_splits), packed.shape[1]))
        return self.group.all_to_all(recv, packed, recv_splits, send_splits, what, ranks)

    def _exchange_rows_and_fields(self, rows: torch.Tensor, packer: FieldPacker, send_splits: Sequence[int],
                                  recv_splits: Sequence[int], what: str, ranks: Optional[List[int]]
                                  ) -> Callable[[], Tuple[torch.Tensor, Dict[str, torch.Tensor], int]]:
        """Start exchanging `rows` and the per-row fields of `packer` (Note [rows travel alone]). Returns the
        wait: (received rows, received fields by name, nanoseconds it waited)."""
        pending_rows = self._exchange_rows(rows, send_splits, recv_splits, what, ranks)
        pending_fields = None
        if packer.fields:
            pending_fields = self._exchange_rows(packer.pack(), send_splits, recv_splits, what, ranks)

        def wait() -> Tuple[torch.Tensor, Dict[str, torch.Tensor], int]:
            started = _now_ns()
            fields = {} if pending_fields is None else packer.unpack(pending_fields.wait())
            received = pending_rows.wait()
            waited = _now_ns() - started
            return received, fields, waited
        return wait

    # ---- layout -------------------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx, num_experts):
        topo = self.topology
        experts_per_rank = num_experts // topo.num_ranks
        valid = topk_idx >= 0
        shifted = torch.where(valid, topk_idx + 1, torch.zeros_like(topk_idx)).flatten()  # slot 0 = no expert
        num_tokens_per_expert = torch.zeros(num_experts + 1, dtype=torch.int32, device=topk_idx.device)
        num_tokens_per_expert.scatter_add_(0, shifted, torch.ones_like(shifted, dtype=torch.int32))
        num_tokens_per_expert = num_tokens_per_expert[1:]
        rank_of = torch.where(valid, topk_idx // experts_per_rank, torch.full_like(topk_idx, topo.num_ranks))
        hits = torch.zeros((topk_idx.shape[0], topo.num_ranks + 1), dtype=torch.bool, device=topk_idx.device)
        hits.scatter_(1, rank_of, True)
        is_token_in_rank = hits[:, :topo.num_ranks].contiguous()
        num_tokens_per_rank = is_token_in_rank.sum(0, dtype=torch.int32)
        num_tokens_per_rdma_rank = None
        if topo.is_internode:
            in_node = is_token_in_rank.view(-1, topo.num_nodes, topo.ranks_per_node).any(-1)
            num_tokens_per_rdma_rank = in_node.sum(0, dtype=torch.int32)
        return num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank

    # ---- normal dispatch ------------------------------------------------------------------------------
    def _node_masks(self, is_token_in_rank: torch.Tensor) -> torch.Tensor:
        """[T, nodes] int32 bitmask of the local ranks of each node that receive each token."""
        topo = self.topology
        bits = torch.ones(topo.ranks_per_node, dtype=torch.int64, device=is_token_in_rank.device)
        bits = bits << torch.arange(topo.ranks_per_node, device=is_token_in_rank.device)
        masks = (is_token_in_rank.view(-1, topo.num_nodes, topo.ranks_per_node).to(torch.int64) * bits).sum(-1)
        return torch.where(masks >= 2 ** 31, masks - 2 ** 32, masks).to(torch.int32)

    def dispatch(self, x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                 num_tokens_per_expert, expert_alignment, num_worst_tokens, num_channels, check_values=None):
        topo = self.topology
        num_ranks, num_experts = topo.num_ranks, num_tokens_per_expert.numel()
        experts_per_rank = num_experts // num_ranks
        extra = num_tokens_per_rank.tolist() + [num_worst_tokens]
        agreed = self._start_agreement("dispatch", dispatch_fields(
            x, x_scales, topk_idx, num_channels, num_experts=num_experts,
            has_weights=int(topk_weights is not None)), extra=extra, bad_input=self._refusal(check_values))
        # per destination: [per-expert counts of its experts | inclusive channel prefix | of its node's]
        channel_prefix, send_head = _prefix_by_channel(is_token_in_rank, num_channels)    # [R, C], [T, R]
        parts = [num_tokens_per_expert.view(num_ranks, experts_per_rank), channel_prefix]
        in_node = rdma_channel_prefix = send_rdma_head = None
        if topo.is_internode:
            in_node = is_token_in_rank.view(-1, topo.num_nodes, topo.ranks_per_node).any(-1)
            rdma_channel_prefix, send_rdma_head = _prefix_by_channel(in_node, num_channels)  # [nodes, C]
            parts.append(rdma_channel_prefix.repeat_interleave(topo.ranks_per_node, dim=0))
        destination, token = is_token_in_rank.t().nonzero(as_tuple=True)
        outgoing = self._dispatch_rows_to_send(x, x_scales, topk_idx, topk_weights, is_token_in_rank, destination,
                                               token, with_token=True, with_node_mask=topo.is_internode)
        gathered_per_rank = agreed()
        # num_tokens_per_rank, the column sums of is_token_in_rank, came to the host with the header: the rows
        # each rank sends to each rank; the counts travel beside the rows (Note [counts beside the rows])
        table = gathered_per_rank.tolist()
        if any(row[num_ranks] for row in table):
            self._check_worst_tokens(gathered_per_rank)
        route = _Route(destination, token, table[topo.rank][:num_ranks], [row[topo.rank] for row in table],
                       self._call_number, [])
        num_recv = sum(route.recv_splits)
        num_rows = num_worst_tokens or num_recv
        recv = self._exchange_dispatch_rows(outgoing, route, num_rows, "dispatch (data exchange)",
                                            per_destination=torch.cat(parts, dim=1))
        received = recv["per_source"]
        per_expert = received[:, :experts_per_rank].sum(0)
        if expert_alignment > 1:
            per_expert = (per_expert + expert_alignment - 1) // expert_alignment * expert_alignment
        recv_channel_prefix = received[:, experts_per_rank:experts_per_rank + num_channels]   # inclusive
        out = self._place_rows(recv, x, x_scales, topk_idx, topk_weights, num_recv, num_rows, experts_per_rank)

        rank_prefix_matrix = torch.cumsum(gathered_per_rank[:, :num_ranks], dim=0, dtype=torch.int32)
        dev = self.device
        recv_src_idx = _grown(recv["token"].to(dev), num_rows, -1)
        if not topo.is_internode:
            out.handle = (rank_prefix_matrix.to(dev), channel_prefix, _exclusive(recv_channel_prefix).to(dev),
                          recv_src_idx, is_token_in_rank, send_head)
        else:
            out.handle = self._internode_handle(received, in_node, rdma_channel_prefix, send_rdma_head,
                                                channel_prefix, recv_channel_prefix, rank_prefix_matrix, recv,
                                                num_recv, num_rows, is_token_in_rank, experts_per_rank, num_channels,
                                                worst_rows=num_worst_tokens)
        self._routes.keep(_routing(out.handle, topo.is_internode)[1], route)
        out.num_recv_tokens_per_expert_list = [] if num_worst_tokens else per_expert.tolist()
        return out

    @staticmethod
    def _check_worst_tokens(gathered_per_rank: torch.Tensor) -> None:
        """Every rank knows what every rank receives and every rank's num_worst_tokens (each rank may pass its
        own): a rank that would receive more than its value makes all of them refuse together."""
        num_ranks = gathered_per_rank.shape[0]
        receives, worst = gathered_per_rank[:, :num_ranks].sum(0), gathered_per_rank[:, num_ranks]
        over = ((worst > 0) & (receives > worst)).nonzero()
        if over.numel():
            r = int(over[0])
            raise ValueError(f"dispatch: num_worst_tokens={int(worst[r])} on rank {r} is smaller than the "
                             f"{int(receives[r])} tokens it receives")

    def _dispatch_rows_to_send(self, x, x_scales, topk_idx, topk_weights, is_token_in_rank, destination, token,
                               with_token, with_node_mask) -> Tuple[torch.Tensor, FieldPacker]:
        """The rows of x for token t to every rank d with is_token_in_rank[t, d], in (d, t) order, and the
        per-row fields packed beside them (Note [rows travel alone])."""
        packer = FieldPacker()
        if x_scales is not None:
            packer.add("scales", _take(x_scales, token))
        if topk_idx is not None:
            packer.add("topk_idx", _take(topk_idx, token))
        if topk_weights is not None:
            packer.add("topk_weights", _take(topk_weights, token))
        if with_token:
            packer.add("token", token.to(torch.int32))
        if with_node_mask:
            node_of_destination = destination // self.topology.ranks_per_node
            packer.add("node_mask", self._node_masks(is_token_in_rank)[token, node_of_destination])
        return _take(x, token), packer

    def _exchange_dispatch_rows(self, outgoing: Tuple[torch.Tensor, FieldPacker], route: _Route, num_rows: int,
                                what: str, per_destination: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
        """Send `_dispatch_rows_to_send`'s rows, and `per_destination` (an int32 row per destination rank, with
        fields to pack beside the rows) at the end of each rank's block of fields (Note [counts beside the
        rows]). Returns the received fields by name, `per_source` (a row per source rank) if sent; `x` has
        `num_rows` rows, the received ones first."""
        rows_x, packer = outgoing
        num_recv = sum(route.recv_splits)
        recv_x = rows_x.new_empty((num_rows, rows_x.shape[1]))
        pending_x = self.group.all_to_all(recv_x[:num_recv], rows_x, route.recv_splits, route.send_splits, what)
        rows: Dict[str, torch.Tensor] = {}
        if per_destination is not None:
            packed, k = packer.pack_with_counts(route.send_splits, per_destination)
            received = self._exchange_rows(packed, [n + k for n in route.send_splits],
                                           [n + k for n in route.recv_splits], what).wait()
            fields, per_source = packer.unpack_with_counts(received, route.recv_splits, k, per_destination.shape[1])
            rows.update(fields, per_source=per_source.cpu())
        elif packer.fields:
            received = self._exchange_rows(packer.pack(), route.send_splits, route.recv_splits, what).wait()
            rows.update(packer.unpack(received))
        pending_x.wait()
        rows["x"] = recv_x
        return rows

    def _place_rows(self, recv, x, x_scales, topk_idx, topk_weights, num_recv, num_rows, experts_per_rank):
        """Outputs of `num_rows` rows whose first `num_recv` are the received ones (worst-case tail: ids -1)."""
        recv_x = recv["x"]
        recv_scales = None
        if x_scales is not None:
            recv_scales = _grown(recv["scales"].to(x.device), num_rows, None)
        recv_topk_idx = recv_topk_weights = None
        if topk_idx is not None:
            local_ids = _local_expert_ids(self.topology.rank, self.topology.num_ranks, experts_per_rank, x.device)
            ids = recv["topk_idx"].to(x.device) + 1
            recv_topk_idx = _grown(local_ids.index_select(0, ids.view(-1)).view(ids.shape), num_rows, -1)
            if topk_weights is not None:
                recv_topk_weights = _grown(torch.where(recv_topk_idx[:num_recv] >= 0,
                                                       recv["topk_weights"].to(x.device), 0.0), num_rows, 0.0)
        return DispatchOutput(recv_x, recv_scales, recv_topk_idx, recv_topk_weights, None, None)

    def _internode_handle(self, received, in_node, rdma_channel_prefix, send_rdma_head, channel_prefix,
                          recv_channel_prefix, rank_prefix_matrix, recv, num_recv, num_rows, is_token_in_rank,
                          experts_per_rank, num_channels, worst_rows: int = 0):
        """The internode handle from what came beside the rows: each source rank's inclusive channel prefix of
        its rows here (`recv_channel_prefix` [R, C]) and of its node's rows towards this node (in `received`)."""
        topo, dev = self.topology, self.device
        column = experts_per_rank + num_channels
        # node-level prefix that the rank with our local index on each node sent towards our node
        same_local = torch.arange(topo.num_nodes, device=received.device) * topo.ranks_per_node + topo.local_rank
        recv_rdma_channel_prefix = received[same_local, column:column + num_channels]       # [nodes, C]
        recv_per_node = recv_rdma_channel_prefix[:, -1]
        recv_rdma_rank_prefix_sum = torch.cumsum(recv_per_node, dim=0).to(torch.int32)
        recv_per_rank = recv_channel_prefix[:, -1]
        rank_start = exclusive_cumsum(recv_per_rank)
        recv_gbl_channel_prefix = (rank_start[:, None] + _exclusive(recv_channel_prefix)).to(torch.int32)
        recv_gbl_rank_prefix_sum = rank_prefix_matrix[:, topo.rank].contiguous()
        meta = torch.zeros((num_rows, 2), dtype=torch.int32, device="cpu")
        source = _segment_ids(recv_per_rank.tolist())                                      # of each received row
        meta[:num_recv, 0] = (source // topo.ranks_per_node).to(torch.int32)
        meta[:num_recv, 1] = recv["node_mask"].cpu()
        recv_src_meta = meta.view(torch.uint8).view(num_rows, 8)
        send_nvl_head = self._send_nvl_head(is_token_in_rank, in_node, recv_per_node)
        if worst_rows > send_nvl_head.shape[0]:   # spec 5.7: the RDMA-received count is num_worst_tokens (rows of -1)
            padding = send_nvl_head.new_full((worst_rows - send_nvl_head.shape[0], send_nvl_head.shape[1]), -1)
            send_nvl_head = torch.cat([send_nvl_head, padding])
        return (is_token_in_rank, rdma_channel_prefix, channel_prefix, recv_rdma_channel_prefix.to(dev),
                recv_rdma_rank_prefix_sum.to(dev), recv_gbl_channel_prefix.to(dev), recv_gbl_rank_prefix_sum.to(dev),
                recv_src_meta.to(dev), send_rdma_head, send_nvl_head.to(dev))

    def _send_nvl_head(self, is_token_in_rank, in_node, recv_per_node):
        """Exchange node masks between ranks of equal local index and turn them into per-peer row offsets."""
        topo = self.topology
        masks = self._node_masks(is_token_in_rank)                                     # [T, nodes]
        node, token = in_node.t().nonzero(as_tuple=True)
        send_splits = [0] * topo.num_ranks
        recv_splits = [0] * topo.num_ranks
        per_node = in_node.sum(0).tolist()
        for n in range(topo.num_nodes):
            peer = n * topo.ranks_per_node + topo.local_rank
            send_splits[peer] = per_node[n]
            recv_splits[peer] = int(recv_per_node[n])
        packed = masks[token, node].contiguous().view(torch.uint8).view(-1, 4)
        recv_masks = self._exchange_rows(packed, send_splits, recv_splits,
                                         "dispatch (node mask exchange)").wait().view(torch.int32).view(-1).cpu()
        bits = ((recv_masks[:, None] >> torch.arange(topo.ranks_per_node, device="cpu")) & 1).bool()    # [n_rdma, L]
        head = torch.full(bits.shape, -1, dtype=torch.int32, device="cpu")
        start = 0
        for count in recv_splits:
            if count:
                block = bits[start:start + count]
                head[start:start + count] = _positions(block)
                start += count
        return head

    # ---- cached dispatch --------------------------------------------------------------------------------
    def cached_dispatch(self, x, x_scales, handle, num_channels):
        is_token_in_rank, received_rows = _routing(handle, self.topology.is_internode)
        route = self._route_of(handle)
        agreed = self._start_agreement_on_route("dispatch (cached)", dispatch_fields(x, x_scales, None, num_channels),
                                                route)
        outgoing = self._dispatch_rows_to_send(x, x_scales, None, None, is_token_in_rank, route.destination,
                                               route.token, with_token=False, with_node_mask=False)
        agreed()
        num_recv = sum(route.recv_splits)
        num_rows = received_rows.shape[0]
        recv = self._exchange_dispatch_rows(outgoing, route, num_rows, "cached dispatch (data exchange)")
        return self._place_rows(recv, x, x_scales, None, None, num_recv, num_rows, 0)

    def _recv_per_source(self, handle) -> List[int]:
        """Rows received from each source rank, from the handle's inclusive prefix over source ranks."""
        topo = self.topology
        if topo.is_internode:
            *_, recv_gbl_rank_prefix_sum, _recv_src_meta, _send_rdma_head, _send_nvl_head = handle
            inclusive = recv_gbl_rank_prefix_sum.to("cpu", torch.int64)
        else:
            rank_prefix_matrix, *_ = handle
            inclusive = rank_prefix_matrix[:, topo.rank].to("cpu", torch.int64)
        return torch.diff(inclusive, prepend=inclusive.new_zeros(1)).tolist()

    # ---- combine ----------------------------------------------------------------------------------------
    def combine(self, x, handle, topk_weights, biases, num_channels):
        topo = self.topology
        is_token_in_rank, _ = _routing(handle, topo.is_internode)
        num_tokens = is_token_in_rank.shape[0]
        route = self._route_of(handle)
        topk = -1 if topk_weights is None else topk_weights.shape[1]
        # the biases are this rank's own, added after the exchange: ranks may differ in passing them
        self._start_agreement_on_route("combine", dict(hidden=x.shape[1], topk=topk, num_channels=num_channels),
                                       route)()
        recv_per_source, send_back = route.recv_splits, route.send_splits
        num_recv = sum(recv_per_source)
        # the rows go back as they are (already grouped by source rank), the weights in a second exchange
        pending = self._exchange_rows(x[:num_recv], recv_per_source, send_back, "combine (data exchange)")
        pending_weights = None
        if topk_weights is not None:
            pending_weights = self._exchange_rows(topk_weights[:num_recv], recv_per_source, send_back,
                                                  "combine (weight exchange)")
        # the sums start while the rows travel: f32(bias0) + f32(bias1) in one add, an absent bias +0 (two -0
        # biases give -0, as in DeepEP)
        present = [bias.float() for bias in biases if bias is not None]
        if len(present) == 2:
            combined = present[0] + present[1]
        else:
            combined = torch.zeros((num_tokens, x.shape[1]), dtype=torch.float32, device=x.device)
            if present:
                combined += present[0]
        combined_weights = weights = None
        if topk_weights is not None:
            combined_weights = torch.zeros((num_tokens, topk_weights.shape[1]), dtype=torch.float32, device=x.device)
            weights = pending_weights.wait()
        values = pending.wait()
        token = route.token
        bounds = [0, *itertools.accumulate(send_back)]

        def add_rows_of(sources, into: torch.Tensor, into_weights: Optional[torch.Tensor]) -> None:
            for d in sources:   # one source's rows go to f32 at a time: less memory
                part = slice(bounds[d], bounds[d + 1])
                into.index_add_(0, token[part], values[part].float())
                if weights is not None:
                    into_weights.index_add_(0, token[part], weights[part])

        if not topo.is_internode:
            add_rows_of(range(topo.num_ranks), combined, combined_weights)
        else:
            in_node = is_token_in_rank.view(-1, topo.num_nodes, topo.ranks_per_node).any(-1)
            for n in range(topo.num_nodes):
                partial = torch.zeros_like(combined)
                partial_weights = None if weights is None else torch.zeros_like(combined_weights)
                add_rows_of(range(n * topo.ranks_per_node, (n + 1) * topo.ranks_per_node), partial, partial_weights)
                hit = in_node[:, n].nonzero(as_tuple=True)[0]
                combined.index_add_(0, hit, partial[hit].to(torch.bfloat16).float())
                if weights is not None:
                    combined_weights.index_add_(0, hit, partial_weights[hit])
        return combined.to(torch.bfloat16), combined_weights

    # ---- low-latency --------------------------------------------------------------------------------------
    def clean_low_latency(self, num_max_tokens: int, hidden: int, num_experts: int) -> None:
        # every rank that takes part restarts its call count, so that a rank that sat out calls while masked
        # agrees with the others again once the masks are cleared and the buffer cleaned
        self._call_number = 0

    def _roll_call(self, what: str, mask: Optional[torch.Tensor]):
        """Shrink mode: mask the ranks that do not reach this call within the timeout (Group.mask_absent).
        Returns the mask as of this call (a copy, also for its receive hook), the mask whose unmasked ranks the
        wait statistics count (before this roll call: a rank given up on gets the time it was waited for) and
        the nanoseconds the roll call waited."""
        if mask is None:
            return None, None, 0
        counted, started = mask.clone(), _now_ns()
        self.group.mask_absent(what, mask)
        return mask.clone(), counted, _now_ns() - started

    def low_latency_receive_capturable(self, launched_in_capture: bool) -> bool:
        # a counted exchange's receive waits on the host: only calls made as fixed-size exchanges
        return self.low_latency_graph_capturable and (launched_in_capture or self.fixed_size_low_latency)

    def _as_fixed_size(self, what: str, mask: Optional[torch.Tensor]) -> bool:
        """Whether a low-latency call runs as a fixed-size exchange (reference_fixed_size.py)."""
        if not (self.fixed_size_low_latency or capturing(self.device)):
            return False
        if mask is not None:
            raise RuntimeError(f"{what}: with enable_shrink the reference transport cannot run inside a CUDA graph "
                               "capture (finding the ranks that stopped calling waits on the host)")
        return True

    def low_latency_dispatch(self, x, topk_idx, num_max_tokens, num_experts, options, mask, wait_stats, half,
                             hook, check_values=None):
        if self._as_fixed_size("low_latency_dispatch", mask):   # (ids out of range: no selection, no host check)
            return self._fixed_size.dispatch(x, topk_idx, num_max_tokens, num_experts, options)
        mask, counted, roll_call_ns = self._roll_call("low_latency_dispatch", mask)
        topo = self.topology
        ranks = unmasked_ranks(mask, topo.rank)   # masked ranks take no part: they may no longer call
        num_ranks, hidden = topo.num_ranks, x.shape[1]
        experts_per_rank = num_experts // num_ranks
        fields = dict(hidden=hidden, num_max_dispatch_tokens_per_rank=num_max_tokens, num_experts=num_experts,
                      use_fp8=int(options.use_fp8), round_scale=int(options.round_scale),
                      use_ue8m0=int(options.use_ue8m0), topk=topk_idx.shape[1])
        bad_input = self._refusal(check_values)
        token = slot = expert = topk_idx.new_empty(0)
        send_splits = [0] * num_ranks
        if bad_input is None:   # (nothing may run on values this rank refused)
            token, slot, expert, send_splits = _selections_by_expert(topk_idx, mask, num_ranks, experts_per_rank)
        # the rows for each rank travel with the header (Note [one row exchange])
        agreed = self._start_agreement("low_latency_dispatch", fields, extra=send_splits, ranks=ranks,
                                       bad_input=bad_input)
        parts = [x]
        if options.use_fp8:
            parts = list(per_token_cast_to_fp8(x, round_scale=options.round_scale))
        # beside each row: its token, and its (source rank, local expert) group at the receiver
        group = torch.remainder(expert, experts_per_rank).add_(topo.rank * experts_per_rank)
        beside = torch.stack([token, group], dim=1).to(torch.int32)
        row_layout = [(part.dtype, part.shape[1]) for part in parts] + [(torch.int32, 2)]
        rows_to_send = gather_side_by_side(parts, token, [beside])
        recv_splits = agreed()[:, topo.rank].tolist()
        pending = self._exchange_rows(rows_to_send, send_splits, recv_splits, "low_latency_dispatch (data exchange)",
                                      ranks)

        slots = num_ranks * num_max_tokens
        dev = x.device
        recv_rows, recv_x, recv_scales = low_latency_receive_buffers(experts_per_rank, slots, hidden, options, dev)
        # filled by the receive, as the GPU transports' kernels fill them
        recv_count = torch.zeros(experts_per_rank, dtype=torch.int32, device=dev)
        layout_range = torch.zeros((experts_per_rank, num_ranks), dtype=torch.int64, device=dev)
        src_info = torch.full((experts_per_rank, slots), -1, dtype=torch.int32, device=dev)
        output = LowLatencyDispatchOutput(recv_x, recv_scales, recv_count, src_info, layout_range)
        remembered = None
        if mask is None:
            remembered = _Selections(token, slot, expert, send_splits, self._call_number, [], [],
                                     tuple(topk_idx.shape), [])
            self._sent_selections.keep(src_info, remembered)

        def receive() -> None:
            started = _now_ns()
            received = pending.wait()
            waited = _now_ns() - started
            data, *scales, ids = side_by_side(received, row_layout)
            token_index, group = ids[:, 0], ids[:, 1].long().cpu()    # group: source * E_loc + local expert
            if mask is not None:   # rows from masked sources are dropped
                keep = (mask.cpu()[group // experts_per_rank] == 0).nonzero(as_tuple=True)[0]
                group = group[keep]
                keep = keep.to(received.device)
                data, token_index, scales = data[keep], token_index[keep], [part[keep] for part in scales]
            per_group = torch.bincount(group, minlength=num_ranks * experts_per_rank)
            counts = per_group.view(num_ranks, experts_per_rank)
            rows_per_expert = counts.sum(0)
            if group.numel() and int(rows_per_expert.max()) > slots:
                # checked once every exchange of the call is complete, so no peer is left waiting
                over = int((rows_per_expert > slots).nonzero()[0])
                raise ValueError(too_many_rows_message(topo.rank, over, "checked on arrival; nothing was received"))
            begin = exclusive_cumsum(counts, dim=0)                                         # [R, E_loc]
            # a source's rows come by local expert, so received row i of group g goes to row
            # e * slots + begin[s, e] + i - (first received row of g): a value per group, plus i
            row_of_group = (_expert_rows(experts_per_rank, num_ranks, slots) + begin.view(-1)
                            - exclusive_cumsum(per_group))
            row = (row_of_group[group] + torch.arange(group.numel(), device="cpu")).to(dev)
            if remembered is not None:   # in the order a combine returns them: by source, expert, slot
                remembered.received[:] = [row, counts.sum(1).tolist()]
            copy_rows(recv_rows, row, data.to(dev))
            src_info.view(-1).index_copy_(0, row, token_index.to(dev))
            if options.use_fp8:
                e, p = row // slots, row % slots
                recv_scales[e, p] = pack_ue8m0(scales[0].to(dev)) if options.use_ue8m0 else scales[0].to(dev)
            recv_count.copy_(rows_per_expert)
            layout_range.copy_(torch.add(counts, begin, alpha=1 << 32).t())   # (begin << 32) | count
            if wait_stats is not None:
                _add_wait(wait_stats, waited + roll_call_ns, counted)
        return output, receive

    def low_latency_combine(self, x, topk_idx, topk_weights, src_info, layout_range, num_max_tokens, use_logfmt,
                            mask, out, wait_stats, half, hook, check_values=None):
        if self._fixed_size.knows(src_info):   # (its dispatch ran so, and refused a shrink mask)
            return self._fixed_size.combine(x, topk_idx, topk_weights, src_info, use_logfmt, out)
        if capturing(self.device):
            raise RuntimeError("low_latency_combine cannot run inside a CUDA graph capture: its handle comes from a "
                               "low-latency dispatch made outside one, whose exchange waits on the host; capture "
                               "the dispatch too")
        mask, counted, roll_call_ns = self._roll_call("low_latency_combine", mask)
        topo = self.topology
        ranks = unmasked_ranks(mask, topo.rank)
        num_ranks = topo.num_ranks
        experts_per_rank, hidden = x.shape[0], x.shape[2]
        num_experts = experts_per_rank * num_ranks
        sent = self._sent_selections.get(src_info) if mask is None else None
        row_index, per_source = sent.received if sent is not None and sent.received else \
            _rows_to_return(layout_range, x.shape[1])
        fields = dict(hidden=hidden, num_max_dispatch_tokens_per_rank=num_max_tokens, num_experts=num_experts,
                      use_logfmt=int(use_logfmt), topk=topk_idx.shape[1])
        call = tuple(fields.values())
        bad_input = self._refusal(check_values)
        agreed = None
        if sent is not None and call in sent.agreed:   # Note [checked once per handle]
            self._call_number += 1
        else:
            # every rank's rows per destination travel with the header (what comes back here is column `rank`),
            # and the call number of the dispatch whose selections it remembers (-1: none; Note [returned in
            # sent order])
            agreed = self._start_agreement("low_latency_combine", fields, extra=per_source + [
                -1 if sent is None else sent.dispatch], ranks=ranks, bad_input=bad_input)
        row_index = row_index.to(x.device)
        rows = _take(x.reshape(-1, hidden), row_index)
        if use_logfmt:
            rows = logfmt_roundtrip(rows)
        packer = FieldPacker()
        if agreed is None:
            recv_splits = sent.send_splits
        else:
            gathered = agreed()
            recv_splits = gathered[:, topo.rank].tolist()
            dispatches = gathered[ranks if ranks is not None else slice(None), num_ranks]
            if bool((dispatches >= 0).all()) and not bool((dispatches == dispatches[0]).all()):
                raise ValueError(f"low_latency_combine: handle: the ranks passed handles of different dispatches "
                                 f"(dispatch call numbers {dispatches.tolist()}); every rank must pass its handle of "
                                 "the same low_latency_dispatch")
            if not bool((dispatches >= 0).all()):   # some rank knows not what it sent: ids come back with the rows
                sent = None
                packer.add("token", _take(src_info.reshape(-1), row_index.to(src_info.device)))
                packer.add("expert", (row_index // x.shape[1] + topo.rank * experts_per_rank).to(torch.int32))
            elif sent is not None:
                sent.agreed[:] = [call]
        wait = self._exchange_rows_and_fields(rows, packer, per_source, recv_splits,
                                              "low_latency_combine (data exchange)", ranks)
        if bad_input is not None:   # an agreed call: the others do not wait for this rank's refusal
            wait()
            raise bad_input

        def receive() -> None:
            received_x, back, waited = wait()
            values = received_x.to(out.device)
            total = None if sent is None else _sum_of_sent_rows(sent, values, topk_idx, topk_weights.float())
            if total is None:
                valid = topk_idx >= 0
                if mask is not None:
                    owner = (topk_idx // experts_per_rank).clamp(0, num_ranks - 1)
                    valid &= mask.to(topk_idx.device)[owner] == 0
                if sent is not None:
                    token_of, slot_of, row = _rows_in_sent_order(sent, topk_idx, valid, values.shape[0])
                else:
                    token_of, slot_of, row = _rows_by_key(back, topk_idx, valid, num_max_tokens, out.device)
                total = weighted_sum_of_selections(values, row, token_of, slot_of, topk_weights.float())
            out.copy_(total)
            if wait_stats is not None:
                _add_wait(wait_stats, waited + roll_call_ns, counted)

        return receive


def _selections_by_expert(topk_idx: torch.Tensor, mask: Optional[torch.Tensor], num_ranks: int,
                          experts_per_rank: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, List[int]]:
    """The (token, top-k slot) selections of a low-latency dispatch, sorted by expert, then token and slot (the
    order in which their rows are sent): their tokens, slots and experts, and how many go to each rank. Ids
    -1, and under a shrink `mask` the ids of masked ranks' experts, select nothing."""
    flat = topk_idx.reshape(-1)
    if mask is not None:
        owner_masked = mask.to(flat.device)[(flat // experts_per_rank).clamp(0, num_ranks - 1)] != 0
        flat = torch.where(owner_masked, -1, flat)
    # (a stable sort of the flat ids keeps (token, slot) order within an expert; the unselected sort first)
    sorted_expert, order = torch.sort(flat, stable=True)
    first = torch.searchsorted(sorted_expert, _first_expert_of_ranks(num_ranks, experts_per_rank, flat.dtype,
                                                                     flat.device)).tolist()
    send_splits = [first[r + 1] - first[r] for r in range(num_ranks)]
    selection, expert = order[first[0]:first[-1]], sorted_expert[first[0]:first[-1]]
    token = selection.div(topk_idx.shape[1], rounding_mode="floor")
    return token, selection - token * topk_idx.shape[1], expert, send_splits


@functools.lru_cache(maxsize=16)
def _first_expert_of_ranks(num_ranks: int, experts_per_rank: int, dtype: torch.dtype, device: torch.device
                           ) -> torch.Tensor:
    """[R + 1]: the first expert id of each rank, then the number of experts."""
    return torch.arange(0, (num_ranks + 1) * experts_per_rank, experts_per_rank, dtype=dtype, device=device)


def _rows_to_return(layout_range: torch.Tensor, slots: int) -> Tuple[torch.Tensor, List[int]]:
    """From a low-latency handle's `layout_range` [E_loc, R]: the rows a combine returns, as indices into its
    x viewed as [E_loc * slots, hidden], grouped by source rank, then local expert (each block in slot order);
    and the number for each source rank."""
    experts_per_rank, num_ranks = layout_range.shape
    counts = (layout_range & 0xFFFFFFFF).cpu()
    begins = (layout_range >> 32).cpu()
    flat_counts = counts.t().flatten()                                                # [R * E_loc] source-major
    block = _segment_ids(flat_counts.tolist())
    offset_in_block = torch.arange(block.numel(), device="cpu") - exclusive_cumsum(flat_counts)[block]
    expert = torch.arange(experts_per_rank, device="cpu").repeat(num_ranks)[block]
    position = begins.t().flatten()[block] + offset_in_block
    return expert * slots + position, counts.sum(0).tolist()


def _grown(rows: torch.Tensor, num_rows: int, fill: Optional[float]) -> torch.Tensor:
    """`rows` with rows of `fill` (None: left as allocated) appended up to `num_rows` rows, contiguous."""
    if rows.shape[0] == num_rows:
        return rows.contiguous()
    shape = (num_rows, *rows.shape[1:])
    grown = rows.new_empty(shape) if fill is None else rows.new_full(shape, fill)
    grown[:rows.shape[0]] = rows
    return grown


_NOT_SENT = ("low_latency_combine: topk_idx names an expert that the matching low_latency_dispatch did not send "
             "the token to; pass the dispatch's topk_idx (entries may only become -1)")


def _sum_of_sent_rows(sent: _Selections, values: torch.Tensor, topk_idx: torch.Tensor, weights: torch.Tensor
                      ) -> Optional[torch.Tensor]:
    """`weighted_sum_of_selections` of the returned rows when the combine's `topk_idx` selects exactly what the
    dispatch sent (the common case; rows in sent order), summed in an order kept with the dispatch on the CPU;
    None otherwise (then `_rows_in_sent_order` finds the selections or the error)."""
    token, slot, expert = sent.token, sent.slot, sent.expert
    if tuple(topk_idx.shape) != sent.topk_shape or values.shape[0] != token.numel() or \
            token.device != topk_idx.device:
        return None
    if not torch.equal(topk_idx[token, slot], expert) or int((topk_idx >= 0).sum()) != token.numel():
        return None
    if values.device.type != "cpu":
        return sum_laid_out(values, torch.arange(token.numel(), device=values.device), token, slot, weights)
    if not sent.sum_order:
        sent.sum_order[:] = index_add_order(torch.arange(token.numel(), device="cpu"), token, slot,
                                             topk_idx.shape[1])
    return sum_in_index_order(values, *sent.sum_order, weights)


def _rows_in_sent_order(sent: _Selections, topk_idx: torch.Tensor, valid: torch.Tensor, num_rows: int
                        ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token, slot, returned row) of every valid selection, the rows numbered as the dispatch sent them
    (Note [returned in sent order]). ValueError if a valid selection was not sent."""
    if num_rows != sent.token.numel():
        raise ValueError(_NOT_SENT)
    token, slot, expert = (t.to(topk_idx.device) for t in sent[:3])
    # (a combine may pass fewer tokens, or fewer top-k columns: selections outside them are not combined)
    index = ((token < topk_idx.shape[0]) & (slot < topk_idx.shape[1])).nonzero(as_tuple=True)[0]
    token, slot, expert = token[index], slot[index], expert[index]
    now = topk_idx[token, slot]
    kept = valid[token, slot]
    if not bool(((now == expert) | ~kept).all()) or int(kept.sum()) != int(valid.sum()):
        raise ValueError(_NOT_SENT)
    return token[kept], slot[kept], index[kept]


def _rows_by_key(back: Dict[str, torch.Tensor], topk_idx: torch.Tensor, valid: torch.Tensor, num_max_tokens: int,
                 device: torch.device) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token, slot, returned row) of every valid selection, found by the (expert, token) ids returned with
    the rows. ValueError if a valid selection was not sent."""
    # every returned row's key expert * N + token (N, not this call's token count: the combine may pass
    # fewer tokens than the dispatch)
    keys = back["expert"].long().to(device) * num_max_tokens + back["token"].long().to(device)
    order = torch.argsort(keys, stable=True)
    sorted_keys = keys[order]
    token_of, slot_of = valid.nonzero(as_tuple=True)
    want = topk_idx[token_of, slot_of] * num_max_tokens + token_of
    # an expert listed twice for one token got two rows, returned in slot order: the n-th
    # listing of a key takes the n-th returned row of that key
    where = torch.searchsorted(sorted_keys, want) + _occurrence(want)
    where = where.clamp(max=max(sorted_keys.numel() - 1, 0))
    if want.numel() and (sorted_keys.numel() == 0 or not torch.equal(sorted_keys[where], want)):
        raise ValueError(_NOT_SENT)
    return token_of, slot_of, order[where]


def _occurrence(keys: torch.Tensor) -> torch.Tensor:
    """For each entry, how many earlier entries have the same key."""
    order = torch.argsort(keys, stable=True)
    sorted_keys = keys[order]
    rank_in_key = torch.arange(keys.numel(), device=keys.device) - torch.searchsorted(sorted_keys, sorted_keys)
    occurrence = torch.empty_like(rank_in_key)
    occurrence[order] = rank_in_key
    return occurrence


def _segment_ids(lengths: Sequence[int], device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """[sum(lengths)] int64: i repeated lengths[i] times."""
    return torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                   torch.tensor(list(lengths), dtype=torch.int64, device=device),
                                   output_size=sum(lengths))


def _now_ns() -> int:
    import time
    return time.perf_counter_ns()


def _add_wait(stats: torch.Tensor, waited_ns: int, mask: Optional[torch.Tensor]) -> None:
    add = torch.full_like(stats, waited_ns)
    if mask is not None:
        add[mask.to(stats.device) != 0] = 0
    stats += add
