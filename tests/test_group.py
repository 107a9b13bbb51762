"""deep_ep.group's point-to-point exchanges (low-latency steps under a shrink mask): a rank that never comes is
named alone, within one timeout for the whole exchange, and a failed exchange is not waited on again."""
import time
from typing import Any, Dict

import torch

from deep_ep.group import CommTimeoutError, Group

TIMEOUT_S = 2.0
ABSENT = 3


def run_with_an_absent_rank(ctx) -> Dict[str, Any]:
    """Ranks 0..2 exchange with every rank of the group; rank 3 never calls."""
    if ctx.rank == ABSENT:
        return {}
    group = Group(ctx.group, None, TIMEOUT_S, ctx.device)
    everyone = list(range(ctx.world_size))
    out: Dict[str, Any] = {}
    start = time.monotonic()
    try:
        group.all_gather(torch.full((4,), ctx.rank, device=ctx.device), "the gather", everyone)
    except CommTimeoutError as error:
        out["gather_error"] = str(error)
    out["gather_s"] = time.monotonic() - start
    return out


def run_all_to_all_with_an_absent_rank(ctx) -> Dict[str, Any]:
    if ctx.rank == ABSENT:
        return {}
    group = Group(ctx.group, None, TIMEOUT_S, ctx.device)
    rows = torch.arange(ctx.world_size * 2, dtype=torch.float32, device=ctx.device).view(-1, 1)
    pending = group.all_to_all(torch.empty_like(rows), rows, [2] * ctx.world_size, [2] * ctx.world_size,
                               "the all-to-all", list(range(ctx.world_size)))
    out: Dict[str, Any] = {}
    try:
        pending.wait()
    except CommTimeoutError as error:
        out["first"] = str(error)
    start = time.monotonic()
    try:
        pending.wait()
    except RuntimeError as error:
        out["again"], out["again_s"] = str(error), time.monotonic() - start
    return out


def test_an_absent_rank_is_named_alone_within_one_timeout(pool):
    results = pool(4).run_then_restart(run_with_an_absent_rank, timeout=60)
    for rank, out in enumerate(results[:ABSENT]):
        message = out.get("gather_error")
        assert message is not None, f"rank {rank}: the gather did not fail"
        assert f"waiting for rank {ABSENT}:" in message, f"rank {rank}: {message}"
        assert out["gather_s"] < 2 * TIMEOUT_S, f"rank {rank}: waited {out['gather_s']:.1f} s"


def test_a_failed_all_to_all_is_not_waited_on_again(pool):
    results = pool(4).run_then_restart(run_all_to_all_with_an_absent_rank, timeout=60)
    for rank, out in enumerate(results[:ABSENT]):
        assert f"waiting for rank {ABSENT}:" in out.get("first", ""), f"rank {rank}: {out}"
        assert "earlier collective" in out.get("again", ""), f"rank {rank}: {out}"
        assert out["again_s"] < 0.5 * TIMEOUT_S, f"rank {rank}: the second wait took {out['again_s']:.1f} s"
