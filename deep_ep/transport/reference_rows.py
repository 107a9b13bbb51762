"""Pieces of the reference transport (reference.py, reference_fixed_size.py): rows of several tensors side by
side as bytes (with counts between blocks of rows), the low-latency receive buffers and the combine's weighted
sum."""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..fp8 import num_scale_groups
from ..group import rows_as_bytes


def exclusive_cumsum(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    return torch.cumsum(t, dim=dim) - t


def weighted_sum_in_slot_order(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """float32 `[T, H]`: the sum over the top-k slots, in ascending slot order from +0, of each slot's row of
    `rows` (`[T, K, H]`, bfloat16) as float32 times its weight (`weights` `[T, K]` float32), each product
    rounded before its add: the low-latency combine's order. The products in one operation, then an add a
    slot."""
    num_tokens, topk, hidden = rows.shape
    if topk == 0:
        return torch.zeros((num_tokens, hidden), dtype=torch.float32, device=rows.device)
    products = rows.to(torch.float32, copy=True)   # (bfloat16 to float32 is exact)
    products.mul_(weights.unsqueeze(-1))
    total = products[:, 0] + 0.0   # (+0 first: a sum of -0 products is +0, as from +0)
    for k in range(1, topk):
        total += products[:, k]
    return total


def weighted_sum_of_selections(values: torch.Tensor, row: torch.Tensor, token: torch.Tensor, slot: torch.Tensor,
                               weights: torch.Tensor) -> torch.Tensor:
    """`weighted_sum_in_slot_order` of `[T, K, H]` rows that hold, for each selection i, `values[row[i]]` at
    (token[i], slot[i]), and zeros elsewhere (`weights` `[T, K]` float32; selections distinct). On the CPU by
    `sum_by_index_add`, elsewhere by `sum_laid_out`: both give these bits."""
    if values.device.type == "cpu":
        return sum_by_index_add(values, row, token, slot, weights)
    return sum_laid_out(values, row, token, slot, weights)


def sum_by_index_add(values: torch.Tensor, row: torch.Tensor, token: torch.Tensor, slot: torch.Tensor,
                     weights: torch.Tensor) -> torch.Tensor:
    """`weighted_sum_of_selections`: each selection's product, added into its token's row by one `index_add_`
    in (token, slot) order: torch documents its adds as made in the order of the index (a slot without a selection
    would add +0, which leaves a sum from +0 as it is). Not for GPUs, whose `index_add_` has no fixed order."""
    return sum_in_index_order(values, *index_add_order(row, token, slot, weights.shape[1]), weights)


def index_add_order(row: torch.Tensor, token: torch.Tensor, slot: torch.Tensor, topk: int
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The selections of `sum_by_index_add` in the order it adds them, (token, slot): their rows, tokens and
    flat keys token * topk + slot (a caller may keep these for repeated sums of the same selections)."""
    key = token * topk + slot
    order = torch.argsort(key)
    return row[order], token[order], key[order]


def sum_in_index_order(values: torch.Tensor, row: torch.Tensor, token: torch.Tensor, key: torch.Tensor,
                       weights: torch.Tensor) -> torch.Tensor:
    """`sum_by_index_add` of selections already in `index_add_order`."""
    products = values.index_select(0, row).to(torch.float32)
    products.mul_(weights.reshape(-1)[key].unsqueeze(1))
    total = torch.zeros((weights.shape[0], values.shape[1]), dtype=torch.float32, device=values.device)
    return total.index_add_(0, token, products)


def sum_laid_out(values: torch.Tensor, row: torch.Tensor, token: torch.Tensor, slot: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
    """`weighted_sum_of_selections` by laying the rows out as `[T, K, H]` (zeros, weight +0 where a slot has
    no selection) for `weighted_sum_in_slot_order`."""
    num_tokens, topk = weights.shape
    key = token * topk + slot
    rows = values.new_zeros((num_tokens * topk, values.shape[1]))
    rows[key] = values[row]
    used = torch.zeros(num_tokens * topk, dtype=torch.float32, device=values.device)
    used[key] = weights.reshape(-1)[key]
    return weighted_sum_in_slot_order(rows.view(num_tokens, topk, values.shape[1]), used.view(num_tokens, topk))


def gather_side_by_side(parts: List[torch.Tensor], index: torch.Tensor, beside: Sequence[torch.Tensor] = ()
                        ) -> torch.Tensor:
    """Rows `index` of each of `parts` (2-D, as many rows each), then `beside` (2-D, a row per index), side by
    side as bytes in one uint8 tensor of `len(index)` rows."""
    gathered = [rows_as_bytes(part.contiguous()) for part in parts]
    as_is = [rows_as_bytes(column.contiguous()) for column in beside]
    packed = torch.empty((index.numel(), sum(c.shape[1] for c in gathered + as_is)), dtype=torch.uint8,
                         device=parts[0].device)
    offset = 0
    for column in gathered:
        torch.index_select(column, 0, index, out=packed[:, offset:offset + column.shape[1]])
        offset += column.shape[1]
    for column in as_is:
        packed[:, offset:offset + column.shape[1]] = column
        offset += column.shape[1]
    return packed


def side_by_side(packed: torch.Tensor, layout: List[Tuple[torch.dtype, int]]) -> List[torch.Tensor]:
    """The parts of rows packed by `gather_side_by_side`, as views of the given (dtype, columns)."""
    parts, offset = [], 0
    for dtype, columns in layout:
        nbytes = columns * dtype.itemsize
        parts.append(packed[:, offset:offset + nbytes].view(dtype))
        offset += nbytes
    return parts


# the integer dtype of each element size (rows moved as integers: bit for bit, whatever their dtype)
INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def word_size(*matrices: torch.Tensor) -> int:
    """The widest integer size (1, 2, 4 or 8 bytes) that divides the row width, the row stride and the storage
    offset in bytes of each of these 2-D tensors (each with a contiguous last dim): all can be viewed as
    integers of that size."""
    return math.gcd(8, *(value * t.element_size() for t in matrices
                         for value in (t.shape[1], t.stride(0), t.storage_offset())))


def copy_rows(target: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """`target[index] = rows` for 2-D tensors of one dtype with a contiguous last dim, the rows moved as the widest
    integers that both layouts allow (`index_copy_` copies an element at a time: 8-byte elements move a
    bfloat16 row ~1.7x faster than its own)."""
    if rows.dtype != target.dtype:
        raise ValueError(f"copy_rows: rows of {rows.dtype} into a target of {target.dtype}")
    words = INT_OF_SIZE[word_size(target, rows)]
    target.view(words).index_copy_(0, index, rows.view(words))


class FieldPacker:
    """Per-row tensors side by side in one byte matrix, and back. The fields are laid out largest element first
    and each row is padded to a multiple of the largest element, so that every field of a packed matrix is a
    view of its own dtype: unpacking copies nothing (a field that must be contiguous is copied by its user)."""

    def __init__(self) -> None:
        self.fields: List[Tuple[str, torch.dtype, Tuple[int, ...], int, int]] = []   # name, dtype, shape, offset, bytes
        self.row_bytes = 0
        self._rows: List[torch.Tensor] = []

    def add(self, name: str, rows: torch.Tensor) -> None:
        """A field: `rows` has a row per packed row (any shape after it)."""
        self._rows.append(rows)
        nbytes = math.prod(rows.shape[1:]) * rows.element_size()
        self.fields.append((name, rows.dtype, tuple(rows.shape[1:]), 0, nbytes))
        order = sorted(range(len(self.fields)), key=lambda i: -self.fields[i][1].itemsize)
        self.fields = [self.fields[i] for i in order]
        self._rows = [self._rows[i] for i in order]
        offset = 0
        for i, (field, dtype, shape, _, nbytes) in enumerate(self.fields):
            self.fields[i] = (field, dtype, shape, offset, nbytes)
            offset += nbytes
        widest = self.fields[0][1].itemsize
        self.row_bytes = max(widest, -(-offset // widest) * widest)   # (at least one element: room for counts)

    def pack(self) -> torch.Tensor:
        """The fields' rows side by side: `[rows, row_bytes]` uint8 (at least one field added). Joined as the
        widest integers that every field's width divides (a copy of byte columns is several times slower)."""
        num_rows = self._rows[0].shape[0]
        padding = self.row_bytes - sum(nbytes for *_, nbytes in self.fields)
        if len(self._rows) == 1 and not padding:
            return rows_as_bytes(self._rows[0].contiguous())
        parts = [rows_as_bytes(rows.contiguous()) for rows in self._rows]
        unit = math.gcd(padding, word_size(*parts))
        as_units = INT_OF_SIZE[unit]
        parts = [part.view(as_units) for part in parts]
        if padding:
            parts.append(parts[0].new_zeros((num_rows, padding // unit)))
        joined = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return joined.view(torch.uint8)

    def pack_with_counts(self, send_splits: Sequence[int], counts: torch.Tensor) -> Tuple[torch.Tensor, int]:
        """`pack` in blocks of `send_splits` rows (one per destination), each block followed by its destination's
        row of `counts` (`[destinations, width]`, int32 values) as `k` more byte rows. Returns the matrix and k."""
        rows = self.pack()
        width = counts.shape[1]
        k = -(-width * 4 // self.row_bytes)
        tails = rows.new_zeros((len(send_splits), k * self.row_bytes))
        tails[:, :width * 4] = rows_as_bytes(counts.to(torch.int32).contiguous())
        tails = tails.view(len(send_splits), k, self.row_bytes)
        # (joined as words: a cat of over 32K elements with several threads copies each block by itself)
        words = INT_OF_SIZE[word_size(rows)]
        rows, tails = rows.view(words), tails.view(words)
        pieces, start = [], 0
        for destination, count in enumerate(send_splits):
            pieces += [rows[start:start + count], tails[destination]]
            start += count
        return torch.cat(pieces).view(torch.uint8), k

    def unpack(self, packed: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The fields of packed rows, as views of `packed` by name."""
        fields = {}
        for name, dtype, shape, offset, nbytes in self.fields:
            field = packed[:, offset:offset + nbytes].view(dtype)
            fields[name] = field if field.shape[1:] == shape else field.view(packed.shape[0], *shape)
        return fields

    def unpack_with_counts(self, received: torch.Tensor, recv_splits: Sequence[int], k: int, width: int
                           ) -> Tuple[Dict[str, torch.Tensor], torch.Tensor]:
        """The inverse of `pack_with_counts` on the receiving side (blocks of `recv_splits` rows, one per source):
        the fields of all blocks' rows (views of one copy of them), and the counts (`[sources, width]` int32)."""
        words = received.view(INT_OF_SIZE[word_size(received)])
        pieces, tails, start = [], [], 0
        for count in recv_splits:
            pieces.append(words[start:start + count])
            tails.append(words[start + count:start + count + k])
            start += count + k
        rows = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        counts = torch.cat(tails).view(torch.uint8).view(len(recv_splits), -1)[:, :width * 4].contiguous()
        return self.unpack(rows.view(torch.uint8)), counts.view(torch.int32)


def low_latency_receive_buffers(experts_per_rank: int, slots: int, hidden: int, options, device: torch.device,
                                spare_rows: int = 0) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """A low-latency dispatch's outputs to fill: rows `[E_loc * slots + spare_rows, H]` (FP8 or BF16), recv_x
    (`[E_loc, slots, H]`, a view of the first rows) and the scales (`[E_loc, slots, words]`, column-major in
    the last two dims; UE8M0 packs four to an int32) or None."""
    rows = torch.empty((experts_per_rank * slots + spare_rows, hidden),
                       dtype=torch.float8_e4m3fn if options.use_fp8 else torch.bfloat16, device=device)
    recv_x = rows[:experts_per_rank * slots].view(experts_per_rank, slots, hidden)
    if not options.use_fp8:
        return rows, recv_x, None
    groups = num_scale_groups(hidden)
    words = -(-groups // 4) if options.use_ue8m0 else groups
    recv_scales = torch.empty((experts_per_rank, words, slots), dtype=torch.int32 if options.use_ue8m0
                              else torch.float32, device=device).transpose(1, 2)
    return rows, recv_x, recv_scales
