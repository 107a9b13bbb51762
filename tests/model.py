"""An independent, single-process model of DeepEP V1's normal (high-throughput) mode.

This is the oracle of the normal-mode conformance tests. It follows the contract
(/work/shared/spec/deepep_v1_api.md sections 4-7 and the reference model of section 17) and the choices
of docs/DESIGN.md (handle contents, channels, two-level internode combine). It is written plainly, with
loops over ranks and tokens, and shares no code with the library.

Every function takes the inputs of ALL ranks (a list indexed by source rank) and returns what ONE rank
must observe. Tensors are on the CPU.

Vocabulary: `R` ranks; `P` ranks per node (nodes are contiguous blocks of `P` ranks; one node when `P`
is None or equals `R`); `E` experts, `E_loc = E // R` per rank, expert `e` lives on rank `e // E_loc`;
`C` channels, channel `c` of a rank with `T` tokens holds tokens `[c * ceil(T/C), min((c+1) * ceil(T/C), T))`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

XLike = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]
Row = Tuple[int, int]  # (source rank, source token index)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return ceil_div(a, b) * b


def num_nodes_of(num_ranks: int, ranks_per_node: Optional[int]) -> int:
    if ranks_per_node is None:
        return 1
    assert num_ranks % ranks_per_node == 0
    return num_ranks // ranks_per_node


def channel_of_token(num_tokens: int, num_channels: int) -> List[int]:
    """DESIGN.md: channel `c` holds tokens `[c * ceil(T/C), min((c+1) * ceil(T/C), T))`."""
    per_channel = ceil_div(num_tokens, num_channels)
    return [t // per_channel for t in range(num_tokens)]


# ---------------------------------------------------------------------------------------------------
# get_dispatch_layout (spec section 4)
# ---------------------------------------------------------------------------------------------------
@dataclass
class Layout:
    num_tokens_per_rank: torch.Tensor            # [R] int32
    num_tokens_per_rdma_rank: Optional[torch.Tensor]  # [num_nodes] int32, None with one node
    num_tokens_per_expert: torch.Tensor          # [E] int32
    is_token_in_rank: torch.Tensor               # [T, R] bool


def layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int,
           ranks_per_node: Optional[int] = None) -> Layout:
    """The layout of ONE rank's `topk_idx` ([T, K], entries in [0, E) or -1)."""
    idx = topk_idx.tolist()
    experts_per_rank = num_experts // num_ranks
    num_nodes = num_nodes_of(num_ranks, ranks_per_node)
    per_expert = [0] * num_experts
    in_rank = [[False] * num_ranks for _ in idx]
    for t, row in enumerate(idx):
        for e in row:
            if e < 0:
                continue
            per_expert[e] += 1  # a token listing an expert twice counts twice
            in_rank[t][e // experts_per_rank] = True
    per_rank = [sum(1 for t in range(len(idx)) if in_rank[t][g]) for g in range(num_ranks)]
    per_rdma = None
    if num_nodes > 1:
        per_rdma = torch.tensor([sum(1 for t in range(len(idx))
                                     if any(in_rank[t][n * ranks_per_node:(n + 1) * ranks_per_node]))
                                 for n in range(num_nodes)], dtype=torch.int32)
    in_rank_t = torch.tensor(in_rank, dtype=torch.bool).reshape(len(idx), num_ranks)
    return Layout(torch.tensor(per_rank, dtype=torch.int32), per_rdma,
                  torch.tensor(per_expert, dtype=torch.int32), in_rank_t)


# ---------------------------------------------------------------------------------------------------
# dispatch (spec sections 5, 6; DESIGN.md handle contents)
# ---------------------------------------------------------------------------------------------------
@dataclass
class Source:
    """One source rank's dispatch inputs."""
    x: XLike                                  # [T, H] tensor or (data [T, H], scales [T, S]) (any strides)
    topk_idx: torch.Tensor                    # [T, K] (always present: it defines the routing)
    topk_weights: Optional[torch.Tensor]      # [T, K] float32
    layout: Layout                            # this source's layout (from `layout(...)`)

    @property
    def num_tokens(self) -> int:
        return self.topk_idx.size(0)

    @property
    def mask(self) -> List[List[bool]]:
        """`is_token_in_rank` as nested Python lists (fast to index in the loops below)."""
        if not hasattr(self, "_mask"):
            self._mask = self.layout.is_token_in_rank.tolist()
        return self._mask


@dataclass
class DispatchResult:
    rows: List[Row]                           # (source rank, source token) of each received row, in order
    recv_x: XLike                             # tensor, or (data, row-major contiguous scales)
    recv_topk_idx: Optional[torch.Tensor]
    recv_topk_weights: Optional[torch.Tensor]
    num_recv_tokens_per_expert_list: List[int]
    handle: Dict[str, torch.Tensor] = field(default_factory=dict)  # named fields, see the two lists below
    num_rdma_recv_tokens: int = 0             # internode only


INTRANODE_HANDLE_FIELDS = ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix",
                           "recv_src_idx", "is_token_in_rank", "send_head")
INTERNODE_HANDLE_FIELDS = ("is_token_in_rank", "rdma_channel_prefix_matrix", "gbl_channel_prefix_matrix",
                           "recv_rdma_channel_prefix_matrix", "recv_rdma_rank_prefix_sum",
                           "recv_gbl_channel_prefix_matrix", "recv_gbl_rank_prefix_sum", "recv_src_meta",
                           "send_rdma_head", "send_nvl_head")


def _gather_rows(tensors: Sequence[torch.Tensor], rows: List[Row], empty_like: torch.Tensor) -> torch.Tensor:
    """Stack `tensors[s][t]` for (s, t) in rows; an empty result keeps the trailing shape and dtype."""
    if not rows:
        return torch.empty((0,) + tuple(empty_like.shape[1:]), dtype=empty_like.dtype)
    return torch.stack([tensors[s][t] for s, t in rows]).contiguous()


def received_rows(sources: Sequence[Source], g: int) -> List[Row]:
    """Spec 17: rows of rank g, grouped by source rank ascending, then source token ascending."""
    return [(s, t) for s, src in enumerate(sources) for t in range(src.num_tokens) if src.mask[t][g]]


def sent_position(src: Source, t: int, d: int) -> int:
    """Position of token t among the tokens `src` sends to rank d, or -1 (DESIGN.md `send_head`)."""
    if not src.mask[t][d]:
        return -1
    return sum(1 for u in range(t) if src.mask[u][d])


def dispatch(sources: Sequence[Source], g: int, num_experts: int, *, num_channels: int,
             ranks_per_node: Optional[int] = None, expert_alignment: int = 1,
             with_topk: bool = True) -> DispatchResult:
    """What rank `g` receives from a non-cached dispatch of `sources` (all ranks' inputs)."""
    num_ranks = len(sources)
    experts_per_rank = num_experts // num_ranks
    rows = received_rows(sources, g)

    # ---- payload: bitwise copies in row order
    if isinstance(sources[0].x, tuple):
        data = _gather_rows([s.x[0] for s in sources], rows, sources[0].x[0])
        scales = _gather_rows([s.x[1] for s in sources], rows, sources[0].x[1])
        recv_x: XLike = (data, scales.contiguous())
    else:
        recv_x = _gather_rows([s.x for s in sources], rows, sources[0].x)

    # ---- top-k ids (local or -1) and weights (0 where -1)
    recv_idx = recv_w = None
    if with_topk:
        num_topk = sources[0].topk_idx.size(1)
        all_ids = [src.topk_idx.tolist() for src in sources]
        all_ws = [src.topk_weights.tolist() for src in sources]  # float32 -> Python float is exact
        idx_rows, w_rows = [], []
        for s, t in rows:
            ids, ws = [], []
            for k in range(num_topk):
                e = all_ids[s][t][k]
                if e >= 0 and e // experts_per_rank == g:
                    ids.append(e - g * experts_per_rank)
                    ws.append(all_ws[s][t][k])
                else:
                    ids.append(-1)
                    ws.append(0.0)
            idx_rows.append(ids)
            w_rows.append(ws)
        recv_idx = torch.tensor(idx_rows, dtype=sources[0].topk_idx.dtype).reshape(len(rows), num_topk)
        recv_w = torch.tensor(w_rows, dtype=torch.float32).reshape(len(rows), num_topk)

    # ---- per-local-expert counts from the caller-supplied per-expert counts, rounded up
    counts = []
    for j in range(experts_per_rank):
        total = sum(int(src.layout.num_tokens_per_expert[g * experts_per_rank + j]) for src in sources)
        counts.append(round_up(total, expert_alignment))

    result = DispatchResult(rows, recv_x, recv_idx, recv_w, counts)
    if num_nodes_of(num_ranks, ranks_per_node) == 1:
        result.handle = _intranode_handle(sources, g, rows, num_channels)
    else:
        result.handle, result.num_rdma_recv_tokens = _internode_handle(sources, g, rows, num_channels,
                                                                        ranks_per_node)
    return result


def _intranode_handle(sources: Sequence[Source], g: int, rows: List[Row], num_channels: int) -> Dict[str, torch.Tensor]:
    num_ranks = len(sources)
    me = sources[g]
    # rank_prefix_matrix[s, d]: tokens rank d receives from sources 0..s (every column filled)
    rank_prefix = [[0] * num_ranks for _ in range(num_ranks)]
    for d in range(num_ranks):
        running = 0
        for s in range(num_ranks):
            running += sum(1 for row in sources[s].mask if row[d])
            rank_prefix[s][d] = running
    # channel_prefix_matrix[d, c]: tokens this rank sends to d in channels 0..c (inclusive)
    my_channels = channel_of_token(me.num_tokens, num_channels)
    channel_prefix = [[0] * num_channels for _ in range(num_ranks)]
    for d in range(num_ranks):
        for c in range(num_channels):
            channel_prefix[d][c] = sum(1 for t in range(me.num_tokens)
                                       if my_channels[t] <= c and me.mask[t][d])
    # recv_channel_prefix_matrix[s, c]: offset, inside source s's group, of s's tokens in channel c (exclusive)
    recv_channel_prefix = [[0] * num_channels for _ in range(num_ranks)]
    for s in range(num_ranks):
        src_channels = channel_of_token(sources[s].num_tokens, num_channels)
        for c in range(num_channels):
            recv_channel_prefix[s][c] = sum(1 for t in range(sources[s].num_tokens)
                                            if src_channels[t] < c and sources[s].mask[t][g])
    send_head = [[sent_position(me, t, d) for d in range(num_ranks)] for t in range(me.num_tokens)]
    return dict(
        rank_prefix_matrix=torch.tensor(rank_prefix, dtype=torch.int32),
        channel_prefix_matrix=torch.tensor(channel_prefix, dtype=torch.int32).reshape(num_ranks, num_channels),
        recv_channel_prefix_matrix=torch.tensor(recv_channel_prefix, dtype=torch.int32).reshape(num_ranks, num_channels),
        recv_src_idx=torch.tensor([t for _, t in rows], dtype=torch.int32),
        is_token_in_rank=me.layout.is_token_in_rank.clone(),
        send_head=torch.tensor(send_head, dtype=torch.int32).reshape(me.num_tokens, num_ranks),
    )


def _goes_to_node(src: Source, t: int, n: int, ranks_per_node: int) -> bool:
    return any(src.mask[t][n * ranks_per_node:(n + 1) * ranks_per_node])


def _internode_handle(sources: Sequence[Source], g: int, rows: List[Row], num_channels: int,
                      ranks_per_node: int) -> Tuple[Dict[str, torch.Tensor], int]:
    num_ranks = len(sources)
    num_nodes = num_ranks // ranks_per_node
    my_node, my_local = g // ranks_per_node, g % ranks_per_node
    me = sources[g]
    my_channels = channel_of_token(me.num_tokens, num_channels)
    in_me = me.layout.is_token_in_rank
    mask_me = me.mask

    # sender side
    rdma_channel_prefix = [[sum(1 for t in range(me.num_tokens)
                                if my_channels[t] <= c and _goes_to_node(me, t, n, ranks_per_node))
                            for c in range(num_channels)] for n in range(num_nodes)]
    gbl_channel_prefix = [[sum(1 for t in range(me.num_tokens) if my_channels[t] <= c and mask_me[t][d])
                           for c in range(num_channels)] for d in range(num_ranks)]
    send_rdma_head = []
    for t in range(me.num_tokens):
        row = []
        for n in range(num_nodes):
            if _goes_to_node(me, t, n, ranks_per_node):
                row.append(sum(1 for u in range(t) if _goes_to_node(me, u, n, ranks_per_node)))
            else:
                row.append(-1)
        send_rdma_head.append(row)

    # receiver side, RDMA level: the rank with my local index on node n sends me its tokens for my node
    recv_rdma_channel_prefix, recv_rdma_rank_prefix, send_nvl_head = [], [], []
    running = 0
    for n in range(num_nodes):
        peer = sources[n * ranks_per_node + my_local]
        peer_channels = channel_of_token(peer.num_tokens, num_channels)
        recv_rdma_channel_prefix.append([sum(1 for t in range(peer.num_tokens)
                                             if peer_channels[t] <= c and _goes_to_node(peer, t, my_node, ranks_per_node))
                                         for c in range(num_channels)])
        for t in range(peer.num_tokens):
            if not _goes_to_node(peer, t, my_node, ranks_per_node):
                continue
            running += 1
            send_nvl_head.append([sent_position(peer, t, my_node * ranks_per_node + j) for j in range(ranks_per_node)])
        recv_rdma_rank_prefix.append(running)
    num_rdma_recv_tokens = running

    # receiver side, final rows
    recv_gbl_rank_prefix, recv_gbl_channel_prefix = [], []
    before = 0
    for s in range(num_ranks):
        src = sources[s]
        src_channels = channel_of_token(src.num_tokens, num_channels)
        recv_gbl_channel_prefix.append([before + sum(1 for t in range(src.num_tokens)
                                                     if src_channels[t] < c and src.mask[t][g])
                                        for c in range(num_channels)])
        before += sum(1 for row in src.mask if row[g])
        recv_gbl_rank_prefix.append(before)
    meta = []
    for s, t in rows:
        mask = 0
        for j in range(ranks_per_node):
            if sources[s].mask[t][my_node * ranks_per_node + j]:
                mask |= 1 << j
        meta.append([s // ranks_per_node, mask])
    recv_src_meta = torch.tensor(meta, dtype=torch.int32).reshape(len(rows), 2)  # little-endian int32 pairs
    recv_src_meta = recv_src_meta.view(torch.uint8).reshape(len(rows), 8)

    i32 = torch.int32
    handle = dict(
        is_token_in_rank=in_me.clone(),
        rdma_channel_prefix_matrix=torch.tensor(rdma_channel_prefix, dtype=i32).reshape(num_nodes, num_channels),
        gbl_channel_prefix_matrix=torch.tensor(gbl_channel_prefix, dtype=i32).reshape(num_ranks, num_channels),
        recv_rdma_channel_prefix_matrix=torch.tensor(recv_rdma_channel_prefix, dtype=i32).reshape(num_nodes, num_channels),
        recv_rdma_rank_prefix_sum=torch.tensor(recv_rdma_rank_prefix, dtype=i32),
        recv_gbl_channel_prefix_matrix=torch.tensor(recv_gbl_channel_prefix, dtype=i32).reshape(num_ranks, num_channels),
        recv_gbl_rank_prefix_sum=torch.tensor(recv_gbl_rank_prefix, dtype=i32),
        recv_src_meta=recv_src_meta,
        send_rdma_head=torch.tensor(send_rdma_head, dtype=i32).reshape(me.num_tokens, num_nodes),
        send_nvl_head=torch.tensor(send_nvl_head, dtype=i32).reshape(num_rdma_recv_tokens, ranks_per_node),
    )
    return handle, num_rdma_recv_tokens


def cached_dispatch(sources_x: Sequence[XLike], rows: List[Row]) -> XLike:
    """A cached dispatch moves the new payloads along the handle's rows (same order)."""
    if isinstance(sources_x[0], tuple):
        data = _gather_rows([x[0] for x in sources_x], rows, sources_x[0][0])
        scales = _gather_rows([x[1] for x in sources_x], rows, sources_x[0][1])
        return data, scales.contiguous()
    return _gather_rows(list(sources_x), rows, sources_x[0])


# ---------------------------------------------------------------------------------------------------
# combine (spec section 7.3 and 17; DESIGN.md two-level internode combine)
# ---------------------------------------------------------------------------------------------------
def combine(s: int, is_token_in_rank: torch.Tensor, rows_per_rank: Sequence[List[Row]],
            ys: Sequence[torch.Tensor], yws: Optional[Sequence[torch.Tensor]] = None,
            bias: Union[None, torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = None,
            ranks_per_node: Optional[int] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """What origin rank `s` gets back from combine.

    `is_token_in_rank` is rank s's mask [T, R]; `rows_per_rank[g]` and `ys[g]` ([>= len(rows), H] bf16;
    rows past the real ones are ignored) are rank g's received rows and its combine input; `yws[g]`
    ([>= len(rows), K] float32) its combine top-k weights.
    """
    num_tokens, num_ranks = is_token_in_rank.shape
    hidden = ys[0].size(1)
    num_nodes = num_nodes_of(num_ranks, ranks_per_node)
    per_node = num_ranks // num_nodes
    row_of = [{row: i for i, row in enumerate(rows)} for rows in rows_per_rank]
    mask = is_token_in_rank.tolist()
    if bias is None:
        biases: Tuple[Optional[torch.Tensor], ...] = ()
    elif isinstance(bias, torch.Tensor):
        biases = (bias,)
    else:
        biases = tuple(bias)

    out = torch.empty(num_tokens, hidden, dtype=torch.bfloat16)
    out_w = None
    if yws is not None:
        out_w = torch.empty(num_tokens, yws[0].size(1), dtype=torch.float32)
    biases = biases + (None,) * (2 - len(biases))
    for t in range(num_tokens):
        # f32(bias0) + f32(bias1), an absent bias +0
        first, second = (torch.zeros(hidden) if b is None else b[t].float() for b in biases)
        acc = first + second
        acc_w = torch.zeros(out_w.size(1), dtype=torch.float32) if out_w is not None else None
        for n in range(num_nodes):
            partial = torch.zeros(hidden, dtype=torch.float32)
            partial_w = torch.zeros_like(acc_w) if acc_w is not None else None
            contributed = False
            for g in range(n * per_node, (n + 1) * per_node):
                if not mask[t][g]:
                    continue
                i = row_of[g][(s, t)]
                contributed = True
                if num_nodes == 1:
                    acc = acc + ys[g][i].float()  # one node: a single fp32 sum, ascending rank
                else:
                    partial = partial + ys[g][i].float()
                if acc_w is not None:
                    partial_w = partial_w + yws[g][i]
            if contributed:
                if num_nodes > 1:
                    acc = acc + partial.to(torch.bfloat16).float()  # first rounding, per destination node
                if acc_w is not None:
                    acc_w = acc_w + partial_w
        out[t] = acc.to(torch.bfloat16)
        if out_w is not None:
            out_w[t] = acc_w
    return out, out_w
