"""The per-rank driver of the normal-mode conformance cases (tests/test_normal.py, test_nvlink.py,
test_autograd.py): each rank draws every rank's inputs of a case (cases.NormalCase) from the seed, feeds its
own to the library and compares what comes back bitwise with the single-process model of tests/model.py.

`run_cases` runs many cases on one Buffer; `run_case` makes one case's calls in order, each checked by a
function named after what it checks. A rank records mismatches (NormalChecker) instead of raising, so that
every rank keeps taking part in the collectives; an exception from the library stops that rank's remaining
cases."""
from __future__ import annotations

import os
import traceback
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

import model
from cases import NormalCase
from compare import Mismatches
from inputs import make_routing, make_x, to_device, wide_random
from randomness import generator

HIDDEN_MAX = 512
# bounds the wait of ranks left in a collective by a rank that failed alone; many ranks time-sharing one
# GPU on a loaded machine need more (DEEP_EP_TEST_BUFFER_TIMEOUT_S)
BUFFER_TIMEOUT_S = float(os.environ.get("DEEP_EP_TEST_BUFFER_TIMEOUT_S", "15"))
NUM_SMS_MAX = 24
ROW_FIELDS = ("recv_src_idx", "recv_src_meta")  # one entry per received row (num_worst_tokens rows then)


def make_sources(seed: int, case: NormalCase, num_ranks: int, ranks_per_node: Optional[int]) -> List[model.Source]:
    """Every rank's inputs of `case` (the same on every rank) with their layouts."""
    num_experts = num_ranks * case.experts_per_rank
    sources = []
    hot = int(torch.randint(num_experts, (1,), generator=generator(seed, case.name, "hot")))
    for s in range(num_ranks):
        gen = generator(seed, case.name, "source", s)
        idx, weights = make_routing(gen, case.tokens[s], case.topk, num_experts, case.routing, case.mask_frac, hot)
        x = make_x(gen, case.tokens[s], case.hidden, case.x)
        sources.append(model.Source(x, idx, weights, model.layout(idx, num_experts, num_ranks, ranks_per_node)))
    return sources


def nvl_bytes() -> int:
    """An NVLink buffer size that every case's hidden size and channel count fits."""
    from deep_ep import Config
    return Config(NUM_SMS_MAX, 8, 256, 16, 128).get_nvl_buffer_size_hint(HIDDEN_MAX * 2, 8)


def configs(case: NormalCase, internode: bool) -> Tuple[Any, Any, int]:
    """(dispatch config, combine config, channels). num_sms None = the library's default configs."""
    from deep_ep import Buffer, Config
    num_sms = case.num_sms
    if num_sms is None:
        return None, None, Buffer.num_sms // 2
    if internode:  # 2 nodes: DeepEP's internode combine rules need rdma_send >= 12
        return Config(num_sms, 8, 256, 16, 128), Config(num_sms, 4, 256, 16, 128), num_sms // 2
    return Config(num_sms, 8, 256), Config(num_sms, 4, 256), num_sms // 2


def stream_arguments(mode: str, last_event: Any = None) -> Tuple[Dict[str, Any], bool]:
    """(stream arguments of a call in `mode`, whether it finishes asynchronously); `last_event` is the event
    the case's previous call returned."""
    from deep_ep import Buffer
    if mode == "chain":  # synchronous, after the previous call's event (EventOverlap(None): Megatron, slime)
        return dict(previous_event=last_event), False
    if mode == "chain_async_alloc":   # (safe here: the inputs come from host-waited copies, see to_device)
        return dict(previous_event=last_event, async_finish=True, allocate_on_comm_stream=last_event is not None), True
    if mode == "sync":
        return {}, False
    if mode == "async":
        return dict(async_finish=True), True
    if mode == "prev":  # synchronous, ordered after a captured event
        return dict(previous_event=Buffer.capture()), False
    if mode == "prev_async_alloc":
        return dict(previous_event=Buffer.capture(), async_finish=True, allocate_on_comm_stream=True), True
    raise ValueError(mode)


class NormalChecker(Mismatches):
    """The mismatches of one case on one rank."""

    def __init__(self, seed: int, case: str, rank: int) -> None:
        super().__init__()
        self.prefix = f"[seed={seed} case={case} rank={rank}]"
        self.last_event: Any = None   # the event the last checked call returned

    def label(self) -> str:
        return self.prefix

    def x_equal(self, what: str, got: Any, expected: model.XLike, rows: Optional[int] = None) -> None:
        """Payload equality; `rows` limits the comparison to a prefix (num_worst_tokens)."""
        if isinstance(expected, tuple):
            if not self.true(f"{what} kind", isinstance(got, tuple) and len(got) == 2,
                             f"expected a (data, scales) tuple, got {type(got).__name__}"):
                return
            self.true(f"{what} scales contiguous (row-major)", got[1].is_contiguous(), f"strides {got[1].stride()}")
            for part, g, e in (("data", got[0], expected[0]), ("scales", got[1], expected[1])):
                self.prefix_equal(f"{what} {part}", g, e, rows)
        else:
            if not self.true(f"{what} kind", isinstance(got, torch.Tensor),
                             f"expected a tensor, got {type(got).__name__}"):
                return
            self.prefix_equal(what, got, expected, rows)

    def prefix_equal(self, what: str, got: Any, expected: torch.Tensor, rows: Optional[int]) -> bool:
        """`got` equals `expected`; with `rows`, `got` has that many rows and its first ones equal `expected`.
        Returns whether `got` has the rows asked for."""
        if rows is None:
            self.equal(what, got, expected)
            return True
        if not self.true(f"{what} rows", isinstance(got, torch.Tensor) and got.size(0) == rows,
                         f"expected {rows} rows, got {getattr(got, 'shape', None)}"):
            return False
        self.equal(f"{what} (real prefix)", got[:expected.size(0)], expected)
        return True

    def event(self, what: str, event: Any, async_finish: bool) -> None:
        """The call's EventOverlap: an event where `async_finish`, else EventOverlap(None), which cannot be
        waited for."""
        from deep_ep import EventOverlap
        self.last_event = event
        if not self.true(f"{what} event type", isinstance(event, EventOverlap), f"got {type(event).__name__}"):
            return
        if async_finish:
            if self.true(f"{what} event", event.event is not None, "async_finish=True must return an event"):
                event.current_stream_wait()
        elif self.true(f"{what} event", event.event is None, f"a synchronous call must return EventOverlap(None), "
                       f"got event={event.event!r}"):
            try:
                event.current_stream_wait()
                self.fail(f"{what} event", "current_stream_wait() on EventOverlap(None) must raise AssertionError")
            except AssertionError:
                pass

    def arity(self, what: str, out: Any, length: int) -> bool:
        return self.true(f"{what} arity", isinstance(out, tuple) and len(out) == length, f"got {type(out).__name__}")


def handle_fields(internode: bool) -> Tuple[str, ...]:
    return model.INTERNODE_HANDLE_FIELDS if internode else model.INTRANODE_HANDLE_FIELDS


def check_handle(chk: NormalChecker, what: str, handle: Any, expected: model.DispatchResult, internode: bool,
                 worst_rows: Optional[int] = None) -> None:
    """Every field of the handle, against the model's (a num_worst_tokens handle has `worst_rows` rows)."""
    names = handle_fields(internode)
    if not chk.true(f"{what} arity", isinstance(handle, tuple) and len(handle) == len(names),
                    f"expected a {len(names)}-tuple, got {type(handle).__name__} of length "
                    f"{len(handle) if isinstance(handle, tuple) else '-'}"):
        return
    for name, got in zip(names, handle):
        exp = expected.handle[name]
        if worst_rows is not None and name in ROW_FIELDS:
            chk.prefix_equal(f"{what}.{name}", got, exp, worst_rows)
        elif worst_rows is not None and name == "send_nvl_head":
            # the RDMA-received count is set to num_worst_tokens (spec 5.7): the real rows, then rows of -1
            if chk.prefix_equal(f"{what}.{name}", got, exp, worst_rows):
                chk.true(f"{what}.{name} (tail)", bool((got[exp.size(0):] == -1).all()),
                         "rows past the real ones must be -1")
        else:
            chk.equal(f"{what}.{name}", got, exp)


def run_cases(ctx, seed: int, cases: List[NormalCase], ranks_per_node: Optional[int] = None,
              transport: Optional[str] = None, num_nvl_bytes: Optional[int] = None) -> List[str]:
    """Every case on one Buffer of this rank; returns the mismatches (raises after the first exception)."""
    from deep_ep import Buffer
    kwargs: Dict[str, Any] = dict(explicitly_destroy=True, timeout_s=BUFFER_TIMEOUT_S)
    if ranks_per_node is not None:
        kwargs["num_ranks_per_node"] = ranks_per_node
    if transport is not None:
        kwargs["transport"] = transport
    buffer = Buffer(ctx.group, num_nvl_bytes or nvl_bytes(), 0, **kwargs)
    errors = buffer_problems(ctx, buffer, ranks_per_node, transport)
    for case in cases:
        chk = NormalChecker(seed, case.name, ctx.rank)
        try:
            run_case(ctx, buffer, seed, case, ranks_per_node, chk)
        except Exception:  # noqa: BLE001
            # Stop here and fail this rank (the pool then restarts its processes): a rank that raised alone
            # leaves the others inside a collective (they time out and stop too), and later cases would
            # only report the resulting confusion.
            chk.fail("exception (remaining cases skipped)", traceback.format_exc())
            raise AssertionError("\n".join(errors + chk.errors)) from None
        errors.extend(chk.errors)
    buffer.destroy()
    return errors


def buffer_problems(ctx, buffer, ranks_per_node: Optional[int], transport: Optional[str]) -> List[str]:
    """The transport that "auto" picked, and nvshmem_qp_depth where DeepEP starts NVSHMEM (spec 1.6)."""
    problems = []
    internode = model.num_nodes_of(ctx.world_size, ranks_per_node) > 1
    if transport is None and os.environ.get("DEEP_EP_TRANSPORT", "auto") == "auto" and ctx.device.type == "cuda" \
            and not internode and buffer.transport_name != "nvlink":
        problems.append(f"rank {ctx.rank}: transport 'auto' picked {buffer.transport_name} for ranks of one node on "
                        "GPUs; these tests are meant to run the NVLink transport there")
    if hasattr(buffer, "nvshmem_qp_depth") != internode:
        problems.append(f"rank {ctx.rank}: nvshmem_qp_depth {'missing' if internode else 'set'} on a buffer of "
                        f"{'several nodes' if internode else 'one node'}")
    return problems


@dataclass
class CaseRun:
    """One case on one rank: its inputs, the model's expectations, and what the calls so far returned."""
    ctx: Any
    buffer: Any
    seed: int
    case: NormalCase
    ranks_per_node: Optional[int]
    chk: NormalChecker
    layout: Dict[str, Any] = field(default_factory=dict)   # the layout arguments of a non-cached dispatch
    handle: Any = None
    recv: Any = None                  # the non-cached dispatch's outputs
    worst_handle: Any = None

    def __post_init__(self) -> None:
        num_ranks, rank = self.ctx.world_size, self.ctx.rank
        self.internode = model.num_nodes_of(num_ranks, self.ranks_per_node) > 1
        self.num_experts = num_ranks * self.case.experts_per_rank
        self.dispatch_config, self.combine_config, num_channels = configs(self.case, self.internode)
        self.sources = make_sources(self.seed, self.case, num_ranks, self.ranks_per_node)
        self.me = self.sources[rank]
        self.expected = model.dispatch(self.sources, rank, self.num_experts, num_channels=num_channels,
                                       ranks_per_node=self.ranks_per_node, expert_alignment=self.case.alignment,
                                       with_topk=self.case.with_topk)
        self.rows_of = [self.expected.rows if g == rank else model.received_rows(self.sources, g)
                        for g in range(num_ranks)]
        self.worst_rows = sum(self.case.tokens) + 3   # num_worst_tokens where the case asks for it

    def dev(self, value: Any) -> Any:
        return to_device(value, self.ctx.device)

    def streams(self) -> Tuple[Dict[str, Any], bool]:
        return stream_arguments(self.case.events, self.chk.last_event)

    def topk_args(self) -> Dict[str, Any]:
        if not self.case.with_topk:
            return {}
        return dict(topk_idx=self.dev(self.me.topk_idx), topk_weights=self.dev(self.me.topk_weights))

    def dispatch(self, **kwargs: Any) -> Any:
        """A non-cached dispatch of this rank's x."""
        return self.buffer.dispatch(self.dev(self.me.x), **self.layout, **self.topk_args(),
                                    expert_alignment=self.case.alignment, config=self.dispatch_config, **kwargs)


def run_case(ctx, buffer, seed: int, case: NormalCase, ranks_per_node: Optional[int], chk: NormalChecker) -> None:
    """The case's calls in order (a "chain" mode orders each after the previous one's event), each checked."""
    run = CaseRun(ctx, buffer, seed, case, ranks_per_node, chk)
    if not check_layout(run) or not check_dispatch(run):
        return
    if case.repeat:
        check_repeated_dispatch_is_identical(run)
    if case.worst:
        check_num_worst_tokens_dispatch(run)
    for i, kind in enumerate(case.cached):
        check_cached_dispatch(run, i, kind)
    if case.cached:
        check_copied_handle_moves_the_same_rows(run)
    for j, bias_mode in enumerate(case.biases):
        check_combine(run, j, bias_mode)
    if case.with_topk:
        check_combine_of_received_weights(run, len(case.biases) - 1)
    check_handle(chk, "handle after combines", run.handle, run.expected, run.internode)


def check_layout(run: CaseRun) -> bool:
    """get_dispatch_layout's counts and token-in-rank map; keeps them for the dispatches."""
    chk, expected = run.chk, run.me.layout
    kwargs, is_async = run.streams()
    out = run.buffer.get_dispatch_layout(run.dev(run.me.topk_idx), run.num_experts, **kwargs)
    if not chk.arity("layout", out, 5):
        return False
    per_rank, per_rdma, per_expert, in_rank, event = out
    chk.event("layout", event, is_async)
    chk.equal("layout num_tokens_per_rank", per_rank, expected.num_tokens_per_rank)
    if expected.num_tokens_per_rdma_rank is None:
        chk.true("layout num_tokens_per_rdma_rank", per_rdma is None, f"expected None (one node), got {per_rdma!r}")
    else:
        chk.equal("layout num_tokens_per_rdma_rank", per_rdma, expected.num_tokens_per_rdma_rank)
    chk.equal("layout num_tokens_per_expert", per_expert, expected.num_tokens_per_expert)
    chk.equal("layout is_token_in_rank", in_rank, expected.is_token_in_rank)
    run.layout = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                      num_tokens_per_expert=per_expert)
    return True


def check_dispatch(run: CaseRun) -> bool:
    """A non-cached dispatch: received rows, top-k ids and weights, per-expert counts and handle; keeps the
    handle (whose is_token_in_rank is the layout's tensor itself)."""
    chk, expected = run.chk, run.expected
    kwargs, is_async = run.streams()
    out = run.dispatch(**kwargs)
    if not chk.arity("dispatch", out, 6):
        return False
    recv_x, recv_idx, recv_w, counts, handle, event = out
    chk.event("dispatch", event, is_async)
    chk.x_equal("dispatch recv_x", recv_x, expected.recv_x)
    if run.case.with_topk:
        chk.equal("dispatch recv_topk_idx", recv_idx, expected.recv_topk_idx)
        chk.equal("dispatch recv_topk_weights", recv_w, expected.recv_topk_weights)
    else:
        chk.true("dispatch recv_topk_idx", recv_idx is None, "expected None without top-k")
        chk.true("dispatch recv_topk_weights", recv_w is None, "expected None without top-k")
    chk.true("dispatch num_recv_tokens_per_expert_list",
             type(counts) is list and counts == expected.num_recv_tokens_per_expert_list,
             f"got {counts!r}, expected {expected.num_recv_tokens_per_expert_list!r}")
    check_handle(chk, "dispatch handle", handle, expected, run.internode)
    if not isinstance(handle, tuple):
        return False
    in_rank_slot = handle[0] if run.internode else handle[4]
    chk.equal("handle is_token_in_rank is the layout tensor", in_rank_slot, run.layout["is_token_in_rank"])
    run.handle, run.recv = handle, out
    return True


def check_repeated_dispatch_is_identical(run: CaseRun) -> None:
    """The same dispatch again gives the same bits."""
    chk = run.chk
    recv_x, recv_idx, recv_w = run.recv[:3]
    again = run.dispatch()
    chk.x_equal("repeated dispatch recv_x", again[0], recv_x)
    if run.case.with_topk:
        chk.equal("repeated dispatch recv_topk_idx", again[1], recv_idx)
        chk.equal("repeated dispatch recv_topk_weights", again[2], recv_w)
    for name, a, b in zip(handle_fields(run.internode), again[4], run.handle):
        chk.equal(f"repeated dispatch handle.{name}", a, b)


def check_num_worst_tokens_dispatch(run: CaseRun) -> None:
    """num_worst_tokens: the real rows first, -1 ids in the tail, an empty count list; keeps its handle."""
    chk, expected, worst = run.chk, run.expected, run.worst_rows
    kwargs, is_async = run.streams()
    w_x, w_idx, w_w, w_counts, run.worst_handle, event = run.dispatch(num_worst_tokens=worst, **kwargs)
    chk.event("worst dispatch", event, is_async)
    chk.x_equal("worst dispatch recv_x", w_x, expected.recv_x, rows=worst)
    real = len(expected.rows)
    if run.case.with_topk:
        chk.prefix_equal("worst dispatch recv_topk_idx", w_idx, expected.recv_topk_idx, worst)
        chk.prefix_equal("worst dispatch recv_topk_weights", w_w, expected.recv_topk_weights, worst)
        if isinstance(w_idx, torch.Tensor) and w_idx.size(0) == worst:
            chk.true("worst dispatch tail ids are -1", bool((w_idx[real:].cpu() == -1).all()),
                     f"tail {w_idx[real:].cpu().tolist()[:4]}...")
    chk.true("worst dispatch list", w_counts == [], f"expected [], got {w_counts!r}")
    check_handle(chk, "worst dispatch handle", run.worst_handle, expected, run.internode, worst_rows=worst)


def has_worst_handle(run: CaseRun) -> bool:
    return isinstance(run.worst_handle, tuple)


def check_cached_dispatch(run: CaseRun, i: int, kind: str) -> None:
    """Cached dispatch #i of new payloads of `kind` moves the same rows in the same order (through the
    num_worst_tokens handle too)."""
    chk, num_ranks = run.chk, run.ctx.world_size
    new_xs = [make_x(generator(run.seed, run.case.name, "cached", i, s), run.case.tokens[s], run.case.hidden, kind)
              for s in range(num_ranks)]
    mine = run.dev(new_xs[run.ctx.rank])
    kwargs, is_async = run.streams()
    out = run.buffer.dispatch(mine, handle=run.handle, config=run.dispatch_config, **kwargs)
    if not chk.arity(f"cached dispatch #{i}", out, 6):
        return
    chk.true(f"cached dispatch #{i} returns (recv_x, None, None, None, None, event)",
             all(v is None for v in out[1:5]), f"got {[type(v).__name__ for v in out[1:5]]}")
    chk.event(f"cached dispatch #{i}", out[5], is_async)
    expected = model.cached_dispatch(new_xs, run.expected.rows)
    chk.x_equal(f"cached dispatch #{i} ({kind}) recv_x", out[0], expected)
    if has_worst_handle(run):
        # the row count comes from the handle (spec 6.3): num_worst_tokens rows, the real ones first
        out = run.buffer.dispatch(mine, handle=run.worst_handle, config=run.dispatch_config)
        chk.x_equal(f"worst-handle cached dispatch #{i} ({kind}) recv_x", out[0], expected, rows=run.worst_rows)


def check_copied_handle_moves_the_same_rows(run: CaseRun) -> None:
    """A copied handle (nothing of its dispatch is known for it) moves the same rows."""
    copied = tuple(t.clone() for t in run.handle)
    out = run.buffer.dispatch(run.dev(run.me.x), handle=copied, config=run.dispatch_config)
    run.chk.x_equal("cached dispatch through a copied handle recv_x", out[0], run.expected.recv_x)


def expert_outputs(run: CaseRun, j: int) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """Combine #j's inputs of every rank: rows and top-k weights (wide values: the summation order shows)."""
    ys, yws = [], []
    for g in range(run.ctx.world_size):
        gen = generator(run.seed, run.case.name, "combine", j, g)
        ys.append(wide_random(gen, len(run.rows_of[g]), run.case.hidden))
        yws.append(wide_random(gen, len(run.rows_of[g]), run.case.topk, dtype=torch.float32))
    return ys, yws


def make_bias(gen: torch.Generator, run: CaseRun, bias_mode: str) -> Any:
    """This rank's bias in `bias_mode` (ranks may differ in passing it: "by rank")."""
    b = [wide_random(gen, run.me.num_tokens, run.case.hidden) for _ in range(2)]
    # -0 in both biases at some places: bf16(f32(b0) + f32(b1)) keeps it where no row is added (masked
    # tokens); one -0 bias alone gives +0 (an absent bias counts as +0)
    negative_zero = torch.rand(run.me.num_tokens, run.case.hidden, generator=gen) < 0.1
    for one in b:
        one[negative_zero] = -0.0
    return {"none": None, "one": b[0], "two": (b[0], b[1]), "by rank": [None, b[0], (b[0], b[1])][run.ctx.rank % 3]}[
        bias_mode]


def check_combine(run: CaseRun, j: int, bias_mode: str) -> None:
    """Combine #j with random rows, with or without top-k weights, with the bias of `bias_mode`: bitwise the
    model's sums; again (where the case repeats) and through the num_worst_tokens handle, the same."""
    chk, rank, combine_config = run.chk, run.ctx.rank, run.combine_config
    ys, yws = expert_outputs(run, j)
    use_w = run.case.with_topk and run.case.combine_weights
    gen = generator(run.seed, run.case.name, "bias", j, rank)
    bias = make_bias(gen, run, bias_mode)
    exp_x, exp_w = model.combine(rank, run.me.layout.is_token_in_rank, run.rows_of, ys, yws if use_w else None, bias,
                                 run.ranks_per_node)
    kwargs, is_async = run.streams()
    weights = run.dev(yws[rank]) if use_w else None
    out = run.buffer.combine(run.dev(ys[rank]), run.handle, topk_weights=weights, bias=run.dev(bias),
                             config=combine_config, **kwargs)
    what = f"combine #{j} (bias={bias_mode}, weights={use_w})"
    if not chk.arity(what, out, 3):
        return
    chk.event(what, out[2], is_async)
    check_combined(chk, what, out, exp_x, exp_w, use_w)
    if not use_w:
        chk.true(f"{what} combined_topk_weights", out[1] is None, f"expected None, got {type(out[1]).__name__}")
    if run.case.repeat:
        again = run.buffer.combine(run.dev(ys[rank]), run.handle, topk_weights=weights, bias=run.dev(bias),
                                   config=combine_config)
        check_combined(chk, f"repeated {what}", again, out[0], out[1], use_w)
    if has_worst_handle(run):
        # the num_worst_tokens handle: M rows in, only the real ones read
        pad_rows = run.worst_rows - len(run.rows_of[rank])
        pad = torch.randn(pad_rows, run.case.hidden, generator=gen).to(torch.bfloat16)
        pad_w = torch.randn(pad_rows, run.case.topk, generator=gen, dtype=torch.float32)
        out = run.buffer.combine(run.dev(torch.cat([ys[rank], pad])), run.worst_handle,
                                 topk_weights=run.dev(torch.cat([yws[rank], pad_w])) if use_w else None,
                                 bias=run.dev(bias), config=combine_config)
        check_combined(chk, f"worst-handle {what}", out, exp_x, exp_w, use_w)


def check_combined(chk: NormalChecker, what: str, out: tuple, exp_x: torch.Tensor, exp_w: Any, use_w: bool) -> None:
    """combined_x, and combined_topk_weights where the combine was given weights."""
    chk.equal(f"{what} combined_x", out[0], exp_x)
    if use_w:
        chk.equal(f"{what} combined_topk_weights", out[1], exp_w)


def check_combine_of_received_weights(run: CaseRun, j: int) -> None:
    """Combining the received top-k weights gives back the original weights (0 where masked); the rows are
    combine #j's."""
    ys, _ = expert_outputs(run, j)
    me = run.me
    out = run.buffer.combine(run.dev(ys[run.ctx.rank]), run.handle, topk_weights=run.recv[2],
                             config=run.combine_config)
    exp_w = torch.where(me.topk_idx >= 0, me.topk_weights, torch.zeros_like(me.topk_weights))
    run.chk.equal("combine of recv_topk_weights", out[1], exp_w)
