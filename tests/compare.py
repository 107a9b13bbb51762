"""Comparing results bit for bit and reporting mismatches, shared by the multi-process tests.

A rank records mismatches instead of raising, so that it keeps taking part in the collectives; the test then
reports every rank's mismatches together with the seed that replays them (DEEP_EP_TEST_SEED)."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch

from randomness import bits


def bitwise_difference(got: torch.Tensor, expected: torch.Tensor) -> Optional[str]:
    """None where `got` equals `expected` bit for bit, dtype and shape included; else what differs."""
    got, expected = got.detach().cpu(), expected.detach().cpu()
    if got.dtype != expected.dtype:
        return f"dtype {got.dtype}, expected {expected.dtype}"
    if tuple(got.shape) != tuple(expected.shape):
        return f"shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    a, b = bits(got), bits(expected)
    if torch.equal(a, b):
        return None
    diff = (a != b).nonzero()
    first = tuple(diff[0].tolist())
    return (f"{diff.size(0)} of {a.numel()} elements differ, first at {first}: got {got[first].item()!r}, "
            f"expected {expected[first].item()!r}")


class Mismatches:
    """The mismatches one rank finds, each labelled by `label()` (seed, rank, case); at most `max_errors`
    are kept (None: all)."""

    def __init__(self, max_errors: Optional[int] = None) -> None:
        self.errors: List[str] = []
        self.max_errors = max_errors

    def label(self) -> str:
        raise NotImplementedError

    def fail(self, what: str, detail: str) -> None:
        if self.max_errors is None or len(self.errors) < self.max_errors:
            self.errors.append(f"{self.label()} {what}: {detail}")

    def true(self, what: str, cond: Any, detail: str = "") -> bool:
        if not cond:
            self.fail(what, detail or "condition is false")
        return bool(cond)

    def equal(self, what: str, got: Any, expected: Any) -> bool:
        """Bitwise equality of tensors (dtype and shape included), or plain equality of other values."""
        if not isinstance(expected, torch.Tensor):
            return self.true(what, got == expected, f"got {got!r}, expected {expected!r}")
        if not isinstance(got, torch.Tensor):
            self.fail(what, f"expected a tensor, got {type(got).__name__}")
            return False
        difference = bitwise_difference(got, expected)
        if difference is not None:
            self.fail(what, difference)
        return difference is None


def record_difference(errors: List[str], what: str, got: Optional[torch.Tensor], expected: Optional[torch.Tensor],
                      rows: Optional[int] = None) -> None:
    """Append to `errors` how `got` differs bit for bit from the reference transport's `expected` (both None
    is equal; `rows`: only the first rows are compared)."""
    if got is None or expected is None:
        if (got is None) != (expected is None):
            errors.append(f"{what}: one side is None")
        return
    if rows is not None:
        got, expected = got[:rows], expected[:rows]
    difference = bitwise_difference(got, expected)
    if difference is not None:
        errors.append(f"{what} differs from the reference: {difference}")


def report_mismatches(seed: int, run: Callable[[], List[List[str]]], limit: int = 40) -> None:
    """Fail with the mismatches that `run()` (a pool run whose ranks return their lists of mismatches) finds,
    the first `limit` of them, and the seed that replays them; a rank that raised fails it too, with the seed."""
    try:
        results = run()
    except AssertionError as error:  # a rank raised: the message holds every rank's report
        raise AssertionError(f"seed={seed} (replay with DEEP_EP_TEST_SEED={seed}):\n{error}") from None
    errors = [e for per_rank in results for e in per_rank]
    assert not errors, f"seed={seed}: {len(errors)} mismatches (replay with DEEP_EP_TEST_SEED={seed}):\n" + \
        "\n".join(errors[:limit])


def assert_no_wrong_tokens(seed: int, results: List[Dict[str, int]]) -> None:
    """Every rank counted 0 wrong tokens (`results[rank]["wrong_tokens"]`)."""
    for rank, counts in enumerate(results):
        assert counts["wrong_tokens"] == 0, f"seed {seed}: rank {rank}: {counts['wrong_tokens']} wrong tokens"
