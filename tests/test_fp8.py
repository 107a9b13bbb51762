"""deep_ep.fp8: the LogFMT-10 codec's grid of a short last group (hidden not a multiple of 128)."""
import torch

from deep_ep.fp8 import logfmt_roundtrip
from randomness import base_seed, generator


def _rows_without_zeros(gen: torch.Generator, rows: int, hidden: int) -> torch.Tensor:
    """|x| in [0.01, 0.9] (every group encoded: amax < 1, amin > 0), fresh signs."""
    mag = 0.01 + 0.89 * torch.rand(rows, hidden, generator=gen)
    sign = torch.where(torch.rand(rows, hidden, generator=gen) < 0.5, -1.0, 1.0)
    return (mag * sign).to(torch.bfloat16)


def test_a_short_group_decodes_as_a_full_group_with_the_same_range():
    seed = base_seed()
    gen = generator(seed, "logfmt short group")
    short = _rows_without_zeros(gen, 64, 72)
    # the same 72 channels, filled to 128 with copies of some of them: amax and amin stay those of the 72
    full = torch.cat([short, short[:, :56]], dim=1)
    assert torch.equal(logfmt_roundtrip(short), logfmt_roundtrip(full)[:, :72]), f"DEEP_EP_TEST_SEED={seed}"


def test_a_short_last_group_beside_full_ones():
    seed = base_seed()
    gen = generator(seed, "logfmt short last group")
    x = _rows_without_zeros(gen, 32, 200)   # one group of 128, one of 72: a 512-channel chunk
    tail = torch.cat([x[:, 128:], x[:, 128:184]], dim=1)
    expected = torch.cat([logfmt_roundtrip(x[:, :128]), logfmt_roundtrip(tail)[:, :72]], dim=1)
    assert torch.equal(logfmt_roundtrip(x), expected), f"DEEP_EP_TEST_SEED={seed}"
    # a fine grid (6.5 octaves: <= 0.45% plus bf16 rounding); the 32-octave grid zeros would force errs up to 2.6%
    err = (logfmt_roundtrip(x).float() - x.float()).abs() / x.float().abs()
    assert float(err.max()) < 0.01, f"DEEP_EP_TEST_SEED={seed}: {float(err.max())}"
