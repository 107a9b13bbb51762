"""The NVLink normal-mode combine's reduction (combine.reduce_tokens) under Triton's CPU interpreter (run by
test_nvlink_interpreted.py with TRITON_INTERPRET=1 set). The combine kernel itself waits for other ranks'
kernels, which the interpreter cannot run alongside it, so a small kernel calls its reduction on rows laid
out as the senders leave them: the peers' rows in ring slots of this rank's area (weights first, then the
bf16 row, wrapping around each ring), its own rows in x. The outputs are compared bit for bit with the
reference transport's order: f32(bias0) + f32(bias1), then the rows of ranks d ascending that the token went
to, rounded to bf16 once. Also the direct protocol's reading of its ARRIVE words (direct.rows_arrived) around
the operation counts where (OPS << 32) wraps. Prints "ok", or the mismatches."""
import sys
from typing import List

import torch
import triton
import triton.language as tl
from randomness import base_seed, generator

from deep_ep.transport.nvlink.launcher import next_pow2
from deep_ep.transport.nvlink.normal import combine_slot
from deep_ep.transport.nvlink.combine import reduce_tokens
from deep_ep.transport.nvlink.direct import rows_arrived


@triton.jit
def reduce_all(x_ptr, weights_ptr, in_rank_ptr, before_ptr, bias0_ptr, bias1_ptr, out_ptr, out_weights_ptr, own,
               regions_ptr, index0_ptr, modulo, slot_words, self_row0, num_rows, num_tokens, rank,
               R: tl.constexpr, H: tl.constexpr, K: tl.constexpr, X_OFF: tl.constexpr, HAS_BIAS0: tl.constexpr,
               HAS_BIAS1: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
               ROWS: tl.constexpr):
    ro = tl.arange(0, BLOCK_R)
    regions = tl.load(regions_ptr + ro, mask=ro < R, other=0)
    index0 = tl.load(index0_ptr + ro, mask=ro < R, other=0)
    tokens = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    reduce_tokens(tokens, tokens < num_tokens, x_ptr, weights_ptr, in_rank_ptr, before_ptr, bias0_ptr, bias1_ptr,
                  out_ptr, out_weights_ptr, own, regions, index0, modulo, slot_words, self_row0, num_rows, rank, ro,
                  R, H, K, X_OFF, HAS_BIAS0, HAS_BIAS1, BLOCK_H, BLOCK_K, ROWS)


@triton.jit
def read_arrivals(words_ptr, out_ptr, ops, n, BLOCK: tl.constexpr):
    lanes = tl.arange(0, BLOCK)
    tl.store(out_ptr + lanes, rows_arrived(words_ptr + lanes, ops.to(tl.int64) << 32, lanes < n), mask=lanes < n)


def wrapped(value: int) -> int:
    """`value` as the int64 that holds its low 64 bits."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def run_arrivals() -> List[str]:
    """ARRIVE words of the current operation give their row count; words last written by an earlier operation,
    up to 2^32 - 1 operations earlier, or never written, give 0, also after OPS << 32 has wrapped."""
    errors: List[str] = []
    for ops in (1, 5, 2 ** 31 - 1, 2 ** 31, 2 ** 31 + 7, 2 ** 32 - 1, 2 ** 32 + 3, 2 ** 40 + 2 ** 31):
        cases = [(ops, 0), (ops, 1), (ops, 12345), (ops, 2 ** 31 - 1), (None, 0)]   # (operation, rows); None: never
        cases += [(ops - gap, 77) for gap in (1, 2, 2 ** 31 - 1, 2 ** 31, 2 ** 31 + 1, 2 ** 32 - 1) if ops - gap >= 1]
        words = torch.tensor([0 if op is None else wrapped((op << 32) + rows) for op, rows in cases], dtype=torch.int64)
        out = torch.full((len(cases),), -1, dtype=torch.int32)
        read_arrivals[(1,)](words, out, ops, len(cases), BLOCK=next_pow2(len(cases)))
        expected = [rows if op == ops else 0 for op, rows in cases]
        if out.tolist() != expected:
            errors.append(f"rows_arrived at OPS={ops}: got {out.tolist()} for {cases}, expected {expected}")
    return errors


def wide(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """bf16 values over 2^-12..2^12 (fp32 sums of a few are inexact: the order shows), a tenth of them -0."""
    values = torch.randn(*shape, generator=gen) * 2.0 ** torch.randint(-12, 13, shape, generator=gen)
    values[torch.rand(*shape, generator=gen) < 0.1] = -0.0
    return values.to(torch.bfloat16)


def run(R: int, rank: int, T: int, H: int, K: int, biases: int, seed: int) -> List[str]:
    gen = generator(seed, "interpreted combine", R, rank, biases)
    in_rank = torch.rand(T, R, generator=gen) < 0.5
    in_rank[::5] = False                                   # tokens that went nowhere: the biases alone
    before = torch.zeros(T + 1, R, dtype=torch.int32)
    before[1:] = in_rank.to(torch.int32).cumsum(0)
    counts = before[T].tolist()
    x_off, slot_words = combine_slot(K, H)
    modulo = max(counts) + 3
    index0 = torch.tensor([(5 * d + 2) % modulo for d in range(R)], dtype=torch.int64)   # rings that wrap around
    regions = torch.tensor([d * modulo * slot_words for d in range(R)], dtype=torch.int64)
    area = torch.zeros(R * modulo * slot_words, dtype=torch.int32)
    self_row0 = 3
    num_rows = self_row0 + counts[rank] + 2
    x, weights = wide(gen, num_rows, H), torch.rand(num_rows, K, generator=gen)
    rows = [x[self_row0:self_row0 + counts[rank]] if d == rank else wide(gen, counts[d], H) for d in range(R)]
    row_weights = [weights[self_row0:self_row0 + counts[rank]] if d == rank else torch.rand(counts[d], K, generator=gen)
                   for d in range(R)]
    for d in range(R):   # the peers' rows where their senders store them: slot (index0[d] + position) % modulo
        if d == rank:
            continue
        for position in range(counts[d]):
            slot = int(regions[d]) + (int(index0[d]) + position) % modulo * slot_words
            area[slot:slot + K] = row_weights[d][position].view(torch.int32)
            area[slot + x_off:slot + x_off + H // 2] = rows[d][position].view(torch.int32)
    bias = [wide(gen, T, H) if i < biases else None for i in range(2)]
    if biases == 2:
        bias[1][bias[0].view(torch.int16) == bias[0].new_tensor(-0.0).view(torch.int16)] = -0.0   # -0 in both
    out = torch.full((T, H), float("nan"), dtype=torch.bfloat16)
    out_weights = torch.full((T, K), float("nan"))
    rows_per_step = 4
    reduce_all[(triton.cdiv(T, rows_per_step),)](
        x, weights, in_rank.to(torch.int8), before, bias[0] if bias[0] is not None else x, bias[1]
        if bias[1] is not None else x, out, out_weights, area.data_ptr(), regions, index0, modulo, slot_words,
        self_row0, num_rows, T, rank, R=R, H=H, K=K, X_OFF=x_off, HAS_BIAS0=bias[0] is not None,
        HAS_BIAS1=bias[1] is not None, BLOCK_H=next_pow2(H), BLOCK_K=next_pow2(K), BLOCK_R=next_pow2(R),
        ROWS=rows_per_step)
    # the reference transport's order
    first, second = (torch.zeros(T, H) if b is None else b.float() for b in bias)
    expected, expected_weights = first + second, torch.zeros(T, K)
    for d in range(R):
        went = in_rank[:, d].nonzero().flatten()
        expected[went] += rows[d].float()
        expected_weights[went] += row_weights[d]
    errors: List[str] = []
    what = f"R={R} rank={rank} T={T} H={H} K={K} biases={biases}"
    if not torch.equal(out.view(torch.int16), expected.to(torch.bfloat16).view(torch.int16)):
        bad = (out.view(torch.int16) != expected.to(torch.bfloat16).view(torch.int16)).nonzero()[0].tolist()
        errors.append(f"{what}: out differs first at {bad}: got {out[tuple(bad)].item()!r}, expected "
                      f"{expected.to(torch.bfloat16)[tuple(bad)].item()!r}")
    if not torch.equal(out_weights.view(torch.int32), expected_weights.view(torch.int32)):
        errors.append(f"{what}: combined weights differ")
    return errors


if __name__ == "__main__":
    failures: List[str] = []
    seed = base_seed()   # (the test passes its own as DEEP_EP_TEST_SEED)
    for R, rank, biases in ((2, 0, 2), (3, 1, 1), (3, 2, 0), (4, 1, 2)):
        failures += run(R, rank, T=23, H=256, K=3, biases=biases, seed=seed)
    failures += run_arrivals()
    print("\n".join(failures) if failures else "ok")
    sys.exit(1 if failures else 0)
