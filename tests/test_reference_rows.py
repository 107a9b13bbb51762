"""Pieces of the reference transport (deep_ep/transport/reference_rows.py): the low-latency combine's weighted
sums against a plain float32 loop (every way of computing them gives the bits of adding, from +0, each
selection's rounded product in slot order), the field packer against the tensors it packed, and the row copy
against indexing."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from deep_ep.transport.reference_rows import (FieldPacker, copy_rows, sum_by_index_add, sum_laid_out,
                                              weighted_sum_in_slot_order, weighted_sum_of_selections)
from randomness import base_seed, bits, generator


def _inputs(seed: int, num_tokens: int, topk: int, hidden: int):
    """bfloat16 rows (some -0, some rows the negation of others), float32 weights (some -0 and 0, NaN where a
    slot has no selection) and a random subset of distinct (token, slot) selections, each reading a row."""
    gen = generator(seed, num_tokens, topk, hidden)
    selected = torch.rand((num_tokens, topk), generator=gen) < 0.7
    token, slot = selected.nonzero(as_tuple=True)
    shuffle = torch.randperm(token.numel(), generator=gen)
    token, slot = token[shuffle], slot[shuffle]   # in no particular order, as rows come back
    values = torch.randn((token.numel() + 3, hidden), generator=gen).to(torch.bfloat16)
    values[torch.rand(values.shape, generator=gen) < 0.1] = -0.0
    if values.shape[0] > 4:
        values[1] = -values[0]
    row = torch.randperm(values.shape[0], generator=gen)[:token.numel()]
    weights = torch.rand((num_tokens, topk), generator=gen)
    weights[torch.rand(weights.shape, generator=gen) < 0.1] = -0.0
    weights[torch.rand(weights.shape, generator=gen) < 0.1] = 0.0
    weights[~selected] = float("nan")
    return values, row, token, slot, weights


def _sequential(values, row, token, slot, weights) -> np.ndarray:
    """From +0, each selection's float32 product added in ascending slot order, one float32 add at a time."""
    num_tokens, topk = weights.shape
    by_key = {(int(t), int(k)): int(r) for t, k, r in zip(token, slot, row)}
    rows = values.float().numpy()
    w = weights.numpy()
    out = np.zeros((num_tokens, values.shape[1]), dtype=np.float32)
    for t in range(num_tokens):
        total = np.zeros(values.shape[1], dtype=np.float32)
        for k in range(topk):
            if (t, k) in by_key:
                total = (total + (rows[by_key[(t, k)]] * w[t, k]).astype(np.float32)).astype(np.float32)
        out[t] = total
    return out


@pytest.mark.parametrize("num_tokens,topk,hidden", [(1, 1, 16), (7, 3, 64), (33, 8, 40), (5, 32, 24), (0, 4, 8)])
def test_weighted_sums_add_in_slot_order(num_tokens, topk, hidden):
    seed = base_seed()
    inputs = _inputs(seed, num_tokens, topk, hidden)
    expected = torch.from_numpy(_sequential(*inputs))
    for way in (sum_by_index_add, sum_laid_out, weighted_sum_of_selections):
        got = way(*inputs)
        assert got.dtype == torch.float32 and got.shape == expected.shape, (seed, way.__name__)
        assert torch.equal(bits(got), bits(expected)), f"seed={seed}: {way.__name__} differs from the float32 loop"


def test_slot_order_sum_of_negative_zeros_is_positive_zero():
    rows = torch.full((2, 3, 8), -0.0, dtype=torch.bfloat16)
    weights = torch.tensor([[1.0, -0.0, 2.0], [-0.0, -0.0, -0.0]])
    total = weighted_sum_in_slot_order(rows, weights)
    assert torch.equal(bits(total), bits(torch.zeros(2, 8))), "a sum from +0 of -0 products must be +0"


def _fields(gen: torch.Generator, num_rows: int, topk: int, num_scales: int):
    """Per-row tensors of several dtypes and widths (odd ones included), random bits."""
    return {"scales": torch.randn((num_rows, num_scales), generator=gen),
            "token": torch.randint(-2 ** 31, 2 ** 31 - 1, (num_rows,), generator=gen, dtype=torch.int32),
            "topk_idx": torch.randint(-1, 1 << 40, (num_rows, topk), generator=gen),
            "flags": torch.randint(0, 256, (num_rows, 3), generator=gen, dtype=torch.uint8),
            "halves": torch.randn((num_rows, 5, 1), generator=gen).to(torch.bfloat16)}


@pytest.mark.parametrize("topk,num_scales,names", [(8, 4, None), (3, 7, None), (1, 1, ("token",)),
                                                   (2, 3, ("flags", "halves")), (5, 2, ("scales",))])
def test_field_packer_round_trip_in_blocks_with_counts(topk, num_scales, names):
    seed = base_seed()
    gen = generator(seed, topk, num_scales, names)
    splits = torch.randint(0, 6, (5,), generator=gen).tolist()
    splits[1] = 0   # a destination without rows
    fields = _fields(gen, sum(splits), topk, num_scales)
    fields = {name: fields[name] for name in (names or fields)}
    counts = torch.randint(-2 ** 31, 2 ** 31 - 1, (len(splits), 9), generator=gen, dtype=torch.int32)
    packer = FieldPacker()
    for name, rows in fields.items():
        packer.add(name, rows)
    widest = max(rows.element_size() for rows in fields.values())
    assert packer.row_bytes % widest == 0
    packed, k = packer.pack_with_counts(splits, counts)
    assert packed.shape == (sum(splits) + len(splits) * k, packer.row_bytes), seed
    # what the receiver sees is the sender's blocks; both sides know the layout from the same fields
    got, got_counts = packer.unpack_with_counts(packed, splits, k, counts.shape[1])
    assert torch.equal(got_counts, counts), f"seed={seed}: counts"
    for name, rows in fields.items():
        assert got[name].dtype == rows.dtype and got[name].shape == rows.shape, (seed, name)
        assert torch.equal(bits(got[name]), bits(rows)), f"seed={seed}: field {name}"
    plain = packer.unpack(packer.pack())
    for name, rows in fields.items():
        assert torch.equal(bits(plain[name]), bits(rows)), f"seed={seed}: field {name} without counts"


@pytest.mark.parametrize("dtype,columns,leading_bytes,trailing_bytes", [
    (torch.bfloat16, 1024, 0, 8),        # 8-byte words
    (torch.float8_e4m3fn, 1024, 0, 36),  # 4-byte words
    (torch.bfloat16, 7, 2, 4),           # 2-byte words (odd width, offset of one element)
    (torch.float8_e4m3fn, 5, 3, 0),      # bytes
    (torch.float32, 3, 4, 0),
])
def test_copy_rows_places_rows_of_a_packed_matrix(dtype, columns, leading_bytes, trailing_bytes):
    """Rows taken from the middle of packed byte rows (the widest word that the offsets allow), into rows of
    a target at random distinct indices; the other target rows keep their bits."""
    seed = base_seed()
    gen = generator(seed, str(dtype), columns, leading_bytes, trailing_bytes)
    num_rows, num_target_rows, width = 37, 50, columns * dtype.itemsize
    packed = torch.randint(0, 256, (num_rows, leading_bytes + width + trailing_bytes), generator=gen,
                           dtype=torch.uint8)
    rows = packed[:, leading_bytes:leading_bytes + width].view(dtype)
    target = torch.randint(0, 256, (num_target_rows, width), generator=gen, dtype=torch.uint8).view(dtype)
    index = torch.randperm(num_target_rows, generator=gen)[:num_rows]
    expected = bits(target).clone()
    expected[index] = bits(rows)
    copy_rows(target, index, rows)
    assert torch.equal(bits(target), expected), f"seed={seed}"


@pytest.mark.parametrize("offset", [1, 2, 3])
def test_field_packer_takes_fields_at_any_storage_offset(offset):
    """Fields that are views of a larger tensor starting at any element (their bytes not aligned to the words
    the packer joins them as) round-trip, alone and beside another field, in blocks with count rows."""
    seed = base_seed()
    gen = generator(seed, offset)
    ints = torch.randint(-2 ** 31, 2 ** 31 - 1, (offset + 14,), generator=gen, dtype=torch.int32)[offset:].view(7, 2)
    halves = torch.randn(offset + 28, generator=gen).to(torch.bfloat16)[offset:].view(7, 4)
    one_row = torch.randint(0, 100, (1, 7), generator=gen, dtype=torch.int32)[:, offset:offset + 4]
    counts = torch.randint(-2 ** 31, 2 ** 31 - 1, (2, 3), generator=gen, dtype=torch.int32)
    for fields, splits in (({"ints": ints}, [3, 4]), ({"ints": ints, "halves": halves}, [5, 2]),
                           ({"one_row": one_row}, [0, 1])):
        packer = FieldPacker()
        for name, rows in fields.items():
            packer.add(name, rows)
        packed, k = packer.pack_with_counts(splits, counts)
        got, got_counts = packer.unpack_with_counts(packed, splits, k, counts.shape[1])
        assert torch.equal(got_counts, counts), f"seed={seed}: counts"
        for name, rows in fields.items():
            assert torch.equal(bits(got[name]), bits(rows)), f"seed={seed}: field {name} of {list(fields)}"


def test_copy_rows_refuses_rows_of_another_dtype():
    target = torch.zeros((4, 8), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="float16"):
        copy_rows(target, torch.tensor([0]), torch.ones((1, 8), dtype=torch.float16))
