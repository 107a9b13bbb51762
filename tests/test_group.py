"""deep_ep.group: the all-gather of the whole group stacks every rank's tensor in rank order (on gloo an
all-to-all of copies); point-to-point exchanges (low-latency steps under a shrink mask): the ranks that never come
are named (alone: not the ranks that came), within one timeout for the whole exchange; a failed exchange is not
waited on again; a backend that refuses to start one leaves the group refused too; works of backends whose wait
ignores its timeout are polled; rows of any layout as bytes."""
import math
import time
from typing import Any, Dict

import pytest
import torch
import torch.distributed as dist

from deep_ep.group import CommTimeoutError, Group, rows_as_bytes

TIMEOUT_S = 2.0
ABSENT = 3


def run_with_an_absent_rank(ctx, absent=(ABSENT,)) -> Dict[str, Any]:
    """The ranks not in `absent` exchange with every rank of the group; those in `absent` never call."""
    if ctx.rank in absent:
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


def run_all_gathers(ctx) -> Dict[str, Any]:
    """Every rank gathers tensors of its own values (several dtypes and shapes, one empty) from the whole group."""
    group = Group(ctx.group, None, TIMEOUT_S, ctx.device)
    cases = {"int64 row": torch.arange(5, dtype=torch.int64) * 10 + ctx.rank,
             "uint8 2-D": torch.full((2, 3), 7 * ctx.rank + 1, dtype=torch.uint8),
             "one value": torch.tensor([float(ctx.rank) + 0.5]),
             "empty": torch.empty(0, 4, dtype=torch.int32)}
    return {name: group.all_gather(t.to(ctx.device), name).cpu() for name, t in cases.items()}


def test_all_gather_stacks_the_ranks_tensors_in_rank_order(pool):
    results = pool(3).run(run_all_gathers, timeout=60)
    expected = {"int64 row": torch.stack([torch.arange(5, dtype=torch.int64) * 10 + r for r in range(3)]),
                "uint8 2-D": torch.stack([torch.full((2, 3), 7 * r + 1, dtype=torch.uint8) for r in range(3)]),
                "one value": torch.tensor([[0.5], [1.5], [2.5]]),
                "empty": torch.empty(3, 0, 4, dtype=torch.int32)}
    for rank, out in enumerate(results):
        for name, want in expected.items():
            got = out[name]
            assert got.dtype == want.dtype and torch.equal(got, want), f"rank {rank}, {name}: {got} != {want}"


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


def test_every_absent_rank_is_named(pool):
    absent = (1, 3)
    results = pool(4).run_then_restart(run_with_an_absent_rank, absent, timeout=60)
    for rank in (0, 2):
        message = results[rank].get("gather_error")
        assert message is not None, f"rank {rank}: the gather did not fail"
        assert "waiting for ranks 1, 3:" in message, f"rank {rank}: {message}"


class _StandInGroup:
    """What Group asks of a process group, for tests without one: rank 0 of 2."""

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 2


def _stand_in_group(monkeypatch, backend: str) -> Group:
    monkeypatch.setattr(dist, "get_backend", lambda group: backend)
    monkeypatch.setattr(dist, "get_global_rank", lambda group, rank: rank)
    monkeypatch.setattr(dist, "P2POp", lambda *args: args)
    return Group(_StandInGroup(), None, 0.2)


def test_a_backend_that_refuses_to_start_an_exchange_leaves_the_group_refused(monkeypatch):
    group = _stand_in_group(monkeypatch, "gloo")

    def refuse(ops):
        raise RuntimeError("[pair.cc] Connection closed by peer")
    monkeypatch.setattr(dist, "batch_isend_irecv", refuse)
    rows = torch.arange(4, dtype=torch.float32).view(-1, 1)
    with pytest.raises(RuntimeError, match=r"rank 0: the step failed to start: \[pair.cc\] Connection closed"):
        group.all_to_all(torch.empty_like(rows), rows, [2, 2], [2, 2], "the step", [0, 1])
    assert group.broken
    with pytest.raises(RuntimeError, match=r"an earlier collective \(the step\) failed"):
        group.all_gather(torch.zeros(1), "the next step", [0, 1])


class _NeverFinishing:
    """A work whose blocking wait would not return (MPI's ignores its timeout)."""

    def is_completed(self) -> bool:
        return False

    def wait(self, timeout=None):
        raise AssertionError("a blocking wait on a work that never finishes")


def test_works_of_a_backend_without_timed_waits_are_polled(monkeypatch):
    group = _stand_in_group(monkeypatch, "mpi")
    assert not group.timed_cpu_waits
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: [_NeverFinishing() for _ in ops])
    start = time.monotonic()
    with pytest.raises(CommTimeoutError, match="waiting for rank 1:"):
        group.all_gather(torch.zeros(1), "the step", [0, 1])
    assert time.monotonic() - start < 5.0
    assert _stand_in_group(monkeypatch, "gloo").timed_cpu_waits


@pytest.mark.parametrize("make", [
    lambda: torch.arange(-5, 5, dtype=torch.int32),                 # 1-D
    lambda: torch.randn(3, 4).to(torch.bfloat16),                    # 2-D
    lambda: torch.randn(3, 1, 4),                                    # more dims
    lambda: torch.empty(0, 3, dtype=torch.int64),                    # no rows
    lambda: torch.randn(4)[::2][:1],                                 # one element, stride 2 (contiguous)
    lambda: torch.randn(4, 2)[:1, :1],                               # 2-D, one element, strides (2, 1)
    lambda: torch.randn(5, 1)[:, :1].as_strided((5, 1), (1, 7)),     # size-1 last dim with another stride
])
def test_rows_as_bytes_gives_each_rows_bytes(make):
    rows = make()
    got = rows_as_bytes(rows)
    width = rows.element_size() * math.prod(rows.shape[1:])
    expected = torch.tensor(bytearray(rows.contiguous().numpy().tobytes()) if rows.dtype != torch.bfloat16 else
                            bytearray(rows.contiguous().view(torch.int16).numpy().tobytes()), dtype=torch.uint8)
    assert got.dtype == torch.uint8 and tuple(got.shape) == (rows.shape[0], width)
    assert torch.equal(got.reshape(-1), expected)
