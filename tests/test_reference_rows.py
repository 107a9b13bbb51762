"""The low-latency combine's weighted sums (deep_ep/transport/reference_rows.py) against a plain float32 loop:
every way of computing them gives the bits of adding, from +0, each selection's rounded product in slot order."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from deep_ep.transport.reference_rows import (sum_by_index_add, sum_laid_out, weighted_sum_in_slot_order,
                                              weighted_sum_of_selections)
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
