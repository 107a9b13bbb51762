"""Conformance tests of the normal (high-throughput) mode: get_dispatch_layout, dispatch, combine.

Every rank generates the inputs of ALL ranks from one random base seed (drawn fresh each run, printed in
every failure; set DEEP_EP_TEST_SEED to replay one), feeds its own to the library and compares its results
bitwise with the single-process model of tests/model.py, which sees every rank's inputs.

Many cases run inside one `pool.run` per world size (spawning rank processes is the expensive part):
fixed cases, three cases with every parameter drawn from the seed, then edge cases where ranks receive
nothing. A rank records mismatches instead of raising, so that every rank keeps taking part in the
collectives, and the test reports every mismatch of every rank; an exception from the library stops that
rank's remaining cases (and fails the pool run, which restarts its processes).
"""
from __future__ import annotations

import os
import traceback
from typing import Any, Dict, List, Optional

import pytest
import torch

import model
from randomness import base_seed, bits, generator

# ---------------------------------------------------------------------------------------------------
# seeds and random inputs (identical on every rank)
# ---------------------------------------------------------------------------------------------------


def make_routing(gen: torch.Generator, num_tokens: int, num_topk: int, num_experts: int, style: str = "uniform",
                 mask_frac: float = 0.0, hot_expert: int = 0):
    """`(topk_idx int64 [T, K], topk_weights float32 [T, K])`.

    styles: "uniform" (K distinct experts per token), "first_half" (uniform over the experts of the first
    half of the ranks), "skewed" (90% of the tokens pick `hot_expert` first,
    the rest of the scores favour the experts of the hot expert's rank), "dup" (half of the tokens list
    their first expert twice). `mask_frac` of the entries become -1, and token 0 is then sent nowhere.
    """
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    if style == "skewed":
        hot_tokens = torch.rand(num_tokens, generator=gen) < 0.9
        scores[hot_tokens, hot_expert] += 10.0
        per_rank = max(1, num_experts // 8)
        start = hot_expert // per_rank * per_rank
        scores[:, start:start + per_rank] += 0.5
    if style == "first_half":  # only the experts of the first half of the ranks (e.g. node 0)
        scores[:, num_experts // 2:] = -1.0
    idx = scores.topk(num_topk, dim=1).indices.to(torch.int64)
    if style == "dup" and num_topk > 1:
        dup = torch.rand(num_tokens, generator=gen) < 0.5
        idx[dup, 1] = idx[dup, 0]
    if mask_frac > 0:
        idx[torch.rand(num_tokens, num_topk, generator=gen) < mask_frac] = -1
        if num_tokens > 0:
            idx[0] = -1
    weights = torch.randn(num_tokens, num_topk, generator=gen, dtype=torch.float32)
    return idx.contiguous(), weights.contiguous()


def make_x(gen: torch.Generator, num_tokens: int, hidden: int, kind: str):
    """kinds: bf16; fp8 (float32 scales) / fp8_col (column-major float32 scales) / fp8_i32 (int32 scales) /
    fp8_i32_col / fp8_i32_tma (column-major, the token dimension padded to a multiple of 4, as DeepGEMM's
    TMA-aligned UE8M0 scales). FP8 data are random bytes (every bit pattern, NaNs included: dispatch copies
    bits)."""
    if kind == "bf16":
        return torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16)
    data = torch.randint(0, 256, (num_tokens, hidden), generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn)
    num_scales = model.ceil_div(hidden, 128)
    if kind.startswith("fp8_i32"):
        scales = torch.randint(-2 ** 31, 2 ** 31 - 1, (num_tokens, model.ceil_div(num_scales, 4)), generator=gen,
                               dtype=torch.int32)
    else:
        scales = torch.randn(num_tokens, num_scales, generator=gen, dtype=torch.float32)
    if kind.endswith("_col"):
        scales = scales.T.contiguous().T
    if kind.endswith("_tma"):
        padded = torch.empty(scales.size(1), model.ceil_div(num_tokens, 4) * 4, dtype=scales.dtype)
        padded[:, :num_tokens] = scales.T
        scales = padded.T[:num_tokens]
    return data, scales


def wide_random(gen: torch.Generator, *shape: int, dtype=torch.bfloat16) -> torch.Tensor:
    """Random values spread over 2^-16..2^16, so that fp32 sums of a few of them are inexact and the
    summation order (and any extra rounding) shows in the result bits."""
    scale = torch.pow(2.0, torch.randint(-16, 17, shape, generator=gen).float())
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def to_device(x, device):
    """`x` on `device` with its strides (`.to` would make a padded layout, such as TMA-aligned scales, dense)."""
    if x is None:
        return None
    if isinstance(x, tuple):
        return tuple(to_device(v, device) for v in x)
    if x.is_contiguous():
        return x.to(device)
    # one host-waited copy of the memory the view spans, then the same view of it: a strided copy_ ends in a
    # device copy kernel that the host does not wait for, which calls ordered only after a previous_event
    # recorded earlier would race with
    span = 1 + sum((n - 1) * stride for n, stride in zip(x.shape, x.stride())) if x.numel() else 0
    return torch.as_strided(x, (span,), (1,), x.storage_offset()).to(device, copy=True).as_strided(
        x.shape, x.stride())


def make_sources(seed: int, case: Dict[str, Any], num_ranks: int, ranks_per_node: Optional[int]) -> List[model.Source]:
    num_experts = num_ranks * case["experts_per_rank"]
    sources = []
    hot = int(torch.randint(num_experts, (1,), generator=generator(seed, case["name"], "hot")))
    for s in range(num_ranks):
        gen = generator(seed, case["name"], "source", s)
        idx, weights = make_routing(gen, case["tokens"][s], case["topk"], num_experts, case.get("routing", "uniform"),
                                    case.get("mask_frac", 0.0), hot)
        x = make_x(gen, case["tokens"][s], case["hidden"], case.get("x", "bf16"))
        sources.append(model.Source(x, idx, weights, model.layout(idx, num_experts, num_ranks, ranks_per_node)))
    return sources


# ---------------------------------------------------------------------------------------------------
# bitwise comparison
# ---------------------------------------------------------------------------------------------------
class Checker:
    def __init__(self, seed: int, case: str, rank: int) -> None:
        self.prefix = f"[seed={seed} case={case} rank={rank}]"
        self.errors: List[str] = []
        self.last_event: Any = None   # the event the last checked call returned

    def fail(self, what: str, detail: str) -> None:
        self.errors.append(f"{self.prefix} {what}: {detail}")

    def true(self, what: str, cond: bool, detail: str = "") -> bool:
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
        if got.dtype != expected.dtype:
            self.fail(what, f"dtype {got.dtype}, expected {expected.dtype}")
            return False
        if tuple(got.shape) != tuple(expected.shape):
            self.fail(what, f"shape {tuple(got.shape)}, expected {tuple(expected.shape)}")
            return False
        a, b = bits(got), bits(expected)
        if not torch.equal(a, b):
            diff = (a != b).nonzero()
            first = tuple(diff[0].tolist())
            self.fail(what, f"{diff.size(0)} differing elements, first at {first}: got "
                      f"{got.detach().cpu()[first].item()!r}, expected {expected[first].item()!r}")
            return False
        return True

    def x_equal(self, what: str, got: Any, expected: model.XLike, rows: Optional[int] = None) -> None:
        """Payload equality; `rows` limits the comparison to a prefix (num_worst_tokens)."""
        if isinstance(expected, tuple):
            if not self.true(f"{what} kind", isinstance(got, tuple) and len(got) == 2,
                             f"expected a (data, scales) tuple, got {type(got).__name__}"):
                return
            self.true(f"{what} scales contiguous (row-major)", got[1].is_contiguous(), f"strides {got[1].stride()}")
            for part, g, e in (("data", got[0], expected[0]), ("scales", got[1], expected[1])):
                self._prefix_equal(f"{what} {part}", g, e, rows)
        else:
            if not self.true(f"{what} kind", isinstance(got, torch.Tensor), f"expected a tensor, got {type(got).__name__}"):
                return
            self._prefix_equal(what, got, expected, rows)

    def _prefix_equal(self, what: str, got: torch.Tensor, expected: torch.Tensor, rows: Optional[int]) -> None:
        if rows is None:
            self.equal(what, got, expected)
            return
        if self.true(f"{what} rows", isinstance(got, torch.Tensor) and got.size(0) == rows,
                     f"expected {rows} rows, got {getattr(got, 'shape', None)}"):
            self.equal(f"{what} (real prefix)", got[:expected.size(0)], expected)

    def event(self, what: str, event: Any, async_finish: bool) -> None:
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


# ---------------------------------------------------------------------------------------------------
# the per-rank driver
# ---------------------------------------------------------------------------------------------------
HIDDEN_MAX = 512
# bounds the wait of ranks left in a collective by a rank that failed alone; many ranks time-sharing one
# GPU on a loaded machine need more (DEEP_EP_TEST_BUFFER_TIMEOUT_S)
BUFFER_TIMEOUT_S = float(os.environ.get("DEEP_EP_TEST_BUFFER_TIMEOUT_S", "15"))
NUM_SMS_MAX = 24


def nvl_bytes() -> int:
    from deep_ep import Config
    return Config(NUM_SMS_MAX, 8, 256, 16, 128).get_nvl_buffer_size_hint(HIDDEN_MAX * 2, 8)


def event_kwargs(mode: str, last_event: Any = None):
    """Stream arguments of a call in `mode`; `last_event` is the event the case's previous call returned."""
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


def configs(case: Dict[str, Any], internode: bool):
    """(dispatch config, combine config, channels). num_sms None = the library's default configs."""
    from deep_ep import Buffer, Config
    num_sms = case.get("num_sms")
    if num_sms is None:
        return None, None, Buffer.num_sms // 2
    if internode:  # 2 nodes: DeepEP's internode combine rules need rdma_send >= 12
        return Config(num_sms, 8, 256, 16, 128), Config(num_sms, 4, 256, 16, 128), num_sms // 2
    return Config(num_sms, 8, 256), Config(num_sms, 4, 256), num_sms // 2


def handle_fields(internode: bool):
    return model.INTERNODE_HANDLE_FIELDS if internode else model.INTRANODE_HANDLE_FIELDS


ROW_FIELDS = ("recv_src_idx", "recv_src_meta")  # one entry per received row (num_worst_tokens rows then)


def check_handle(chk: Checker, what: str, handle: Any, expected: model.DispatchResult, internode: bool,
                 worst_rows: Optional[int] = None) -> None:
    names = handle_fields(internode)
    if not chk.true(f"{what} arity", isinstance(handle, tuple) and len(handle) == len(names),
                    f"expected a {len(names)}-tuple, got {type(handle).__name__} of length "
                    f"{len(handle) if isinstance(handle, tuple) else '-'}"):
        return
    for name, got in zip(names, handle):
        exp = expected.handle[name]
        if worst_rows is not None and name in ROW_FIELDS:
            chk._prefix_equal(f"{what}.{name}", got, exp, worst_rows)
        elif worst_rows is not None and name == "send_nvl_head":
            # the RDMA-received count is set to num_worst_tokens (spec 5.7): the real rows, then rows of -1
            if chk.true(f"{what}.{name} rows", isinstance(got, torch.Tensor) and got.size(0) == worst_rows,
                        f"expected {worst_rows} rows, got {getattr(got, 'shape', None)}"):
                chk.equal(f"{what}.{name} (real prefix)", got[:exp.size(0)], exp)
                chk.true(f"{what}.{name} (tail)", bool((got[exp.size(0):] == -1).all()),
                         "rows past the real ones must be -1")
        else:
            chk.equal(f"{what}.{name}", got, exp)


def run_cases(ctx, seed: int, cases: List[Dict[str, Any]], ranks_per_node: Optional[int] = None,
              transport: Optional[str] = None, num_nvl_bytes: Optional[int] = None) -> List[str]:
    from deep_ep import Buffer
    kwargs = dict(explicitly_destroy=True, timeout_s=BUFFER_TIMEOUT_S)
    if ranks_per_node is not None:
        kwargs["num_ranks_per_node"] = ranks_per_node
    if transport is not None:
        kwargs["transport"] = transport
    buffer = Buffer(ctx.group, num_nvl_bytes or nvl_bytes(), 0, **kwargs)
    errors: List[str] = []
    internode = model.num_nodes_of(ctx.world_size, ranks_per_node) > 1
    if transport is None and os.environ.get("DEEP_EP_TRANSPORT", "auto") == "auto" and ctx.device.type == "cuda" \
            and not internode and buffer.transport_name != "nvlink":
        errors.append(f"rank {ctx.rank}: transport 'auto' picked {buffer.transport_name} for ranks of one node on "
                      "GPUs; these tests are meant to run the NVLink transport there")
    if hasattr(buffer, "nvshmem_qp_depth") != internode:   # (spec 1.6: where DeepEP starts NVSHMEM)
        errors.append(f"rank {ctx.rank}: nvshmem_qp_depth {'missing' if internode else 'set'} on a buffer of "
                      f"{'several nodes' if internode else 'one node'}")
    for case in cases:
        chk = Checker(seed, case["name"], ctx.rank)
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


def run_case(ctx, buffer, seed: int, case: Dict[str, Any], ranks_per_node: Optional[int], chk: Checker) -> None:
    num_ranks, rank, device = ctx.world_size, ctx.rank, ctx.device
    internode = model.num_nodes_of(num_ranks, ranks_per_node) > 1
    num_experts = num_ranks * case["experts_per_rank"]
    hidden, num_topk = case["hidden"], case["topk"]
    with_topk = case.get("with_topk", True)
    alignment = case.get("alignment", 1)
    mode = case.get("events", "sync")
    dispatch_config, combine_config, num_channels = configs(case, internode)
    dev = lambda v: to_device(v, device)  # noqa: E731

    sources = make_sources(seed, case, num_ranks, ranks_per_node)
    me = sources[rank]
    expected = model.dispatch(sources, rank, num_experts, num_channels=num_channels, ranks_per_node=ranks_per_node,
                              expert_alignment=alignment, with_topk=with_topk)
    rows_of = [expected.rows if g == rank else model.received_rows(sources, g) for g in range(num_ranks)]

    # ---- get_dispatch_layout
    kw, is_async = event_kwargs(mode, chk.last_event)
    out = buffer.get_dispatch_layout(dev(me.topk_idx), num_experts, **kw)
    if not chk.true("layout arity", isinstance(out, tuple) and len(out) == 5, f"got {type(out).__name__}"):
        return
    per_rank, per_rdma, per_expert, in_rank, event = out
    chk.event("layout", event, is_async)
    chk.equal("layout num_tokens_per_rank", per_rank, me.layout.num_tokens_per_rank)
    if me.layout.num_tokens_per_rdma_rank is None:
        chk.true("layout num_tokens_per_rdma_rank", per_rdma is None, f"expected None (one node), got {per_rdma!r}")
    else:
        chk.equal("layout num_tokens_per_rdma_rank", per_rdma, me.layout.num_tokens_per_rdma_rank)
    chk.equal("layout num_tokens_per_expert", per_expert, me.layout.num_tokens_per_expert)
    chk.equal("layout is_token_in_rank", in_rank, me.layout.is_token_in_rank)

    # ---- non-cached dispatch
    def layout_args():
        return dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                    num_tokens_per_expert=per_expert)

    def topk_args():
        return dict(topk_idx=dev(me.topk_idx), topk_weights=dev(me.topk_weights)) if with_topk else {}

    kw, is_async = event_kwargs(mode, chk.last_event)
    out = buffer.dispatch(dev(me.x), **layout_args(), **topk_args(), expert_alignment=alignment,
                          config=dispatch_config, **kw)
    if not chk.true("dispatch arity", isinstance(out, tuple) and len(out) == 6, f"got {type(out).__name__}"):
        return
    recv_x, recv_idx, recv_w, counts, handle, event = out
    chk.event("dispatch", event, is_async)
    chk.x_equal("dispatch recv_x", recv_x, expected.recv_x)
    if with_topk:
        chk.equal("dispatch recv_topk_idx", recv_idx, expected.recv_topk_idx)
        chk.equal("dispatch recv_topk_weights", recv_w, expected.recv_topk_weights)
    else:
        chk.true("dispatch recv_topk_idx", recv_idx is None, "expected None without top-k")
        chk.true("dispatch recv_topk_weights", recv_w is None, "expected None without top-k")
    chk.true("dispatch num_recv_tokens_per_expert_list", type(counts) is list and counts == expected.num_recv_tokens_per_expert_list,
             f"got {counts!r}, expected {expected.num_recv_tokens_per_expert_list!r}")
    check_handle(chk, "dispatch handle", handle, expected, internode)
    if not isinstance(handle, tuple):
        return
    in_rank_slot = handle[0] if internode else handle[4]
    chk.equal("handle is_token_in_rank is the layout tensor", in_rank_slot, in_rank)

    # ---- determinism: the same dispatch again gives the same bits
    if case.get("repeat"):
        again = buffer.dispatch(dev(me.x), **layout_args(), **topk_args(), expert_alignment=alignment,
                                config=dispatch_config)
        chk.x_equal("repeated dispatch recv_x", again[0], recv_x)
        if with_topk:
            chk.equal("repeated dispatch recv_topk_idx", again[1], recv_idx)
            chk.equal("repeated dispatch recv_topk_weights", again[2], recv_w)
        for name, a, b in zip(handle_fields(internode), again[4], handle):
            chk.equal(f"repeated dispatch handle.{name}", a, b)

    # ---- num_worst_tokens: exact prefix, -1 tail ids, empty list
    worst_handle = None
    if case.get("worst"):
        worst = sum(case["tokens"]) + 3
        kw, is_async = event_kwargs(mode, chk.last_event)
        out = buffer.dispatch(dev(me.x), **layout_args(), **topk_args(), expert_alignment=alignment,
                              num_worst_tokens=worst, config=dispatch_config, **kw)
        w_x, w_idx, w_w, w_counts, worst_handle, event = out
        chk.event("worst dispatch", event, is_async)
        chk.x_equal("worst dispatch recv_x", w_x, expected.recv_x, rows=worst)
        real = len(expected.rows)
        if with_topk:
            chk._prefix_equal("worst dispatch recv_topk_idx", w_idx, expected.recv_topk_idx, worst)
            chk._prefix_equal("worst dispatch recv_topk_weights", w_w, expected.recv_topk_weights, worst)
            if isinstance(w_idx, torch.Tensor) and w_idx.size(0) == worst:
                chk.true("worst dispatch tail ids are -1", bool((w_idx[real:].cpu() == -1).all()),
                         f"tail {w_idx[real:].cpu().tolist()[:4]}...")
        chk.true("worst dispatch list", w_counts == [], f"expected [], got {w_counts!r}")
        check_handle(chk, "worst dispatch handle", worst_handle, expected, internode, worst_rows=worst)

    # ---- cached dispatch with new payloads (same rows, same order), several times
    for i, kind in enumerate(case.get("cached", [])):
        new_xs = [make_x(generator(seed, case["name"], "cached", i, s), case["tokens"][s], hidden, kind)
                  for s in range(num_ranks)]
        kw, is_async = event_kwargs(mode, chk.last_event)
        out = buffer.dispatch(dev(new_xs[rank]), handle=handle, config=dispatch_config, **kw)
        if not chk.true(f"cached dispatch #{i} arity", isinstance(out, tuple) and len(out) == 6, f"got {type(out).__name__}"):
            continue
        chk.true(f"cached dispatch #{i} returns (recv_x, None, None, None, None, event)",
                 all(v is None for v in out[1:5]), f"got {[type(v).__name__ for v in out[1:5]]}")
        chk.event(f"cached dispatch #{i}", out[5], is_async)
        chk.x_equal(f"cached dispatch #{i} ({kind}) recv_x", out[0], model.cached_dispatch(new_xs, expected.rows))
        if worst_handle is not None and isinstance(worst_handle, tuple):
            # the row count comes from the handle (spec 6.3): num_worst_tokens rows, the real ones first
            out = buffer.dispatch(dev(new_xs[rank]), handle=worst_handle, config=dispatch_config)
            chk.x_equal(f"worst-handle cached dispatch #{i} ({kind}) recv_x", out[0],
                        model.cached_dispatch(new_xs, expected.rows), rows=worst)

    # ---- a copied handle (nothing of its dispatch is known for it) moves the same rows
    if case.get("cached"):
        copied = tuple(t.clone() for t in handle)
        out = buffer.dispatch(dev(me.x), handle=copied, config=dispatch_config)
        chk.x_equal("cached dispatch through a copied handle recv_x", out[0], expected.recv_x)

    # ---- combine: random per-rank inputs, with/without top-k weights, bias None / one / two / by rank (the
    # bias is each rank's own: ranks may differ in passing it)
    for j, bias_mode in enumerate(case.get("biases", ["none"])):
        ys, yws = [], []
        for g in range(num_ranks):
            gen = generator(seed, case["name"], "combine", j, g)
            ys.append(wide_random(gen, len(rows_of[g]), hidden))
            yws.append(wide_random(gen, len(rows_of[g]), num_topk, dtype=torch.float32))
        use_w = with_topk and case.get("combine_weights", True)
        gen = generator(seed, case["name"], "bias", j, rank)
        b = [wide_random(gen, me.num_tokens, hidden) for _ in range(2)]
        # -0 in both biases at some places: bf16(f32(b0) + f32(b1)) keeps it where no row is added (masked
        # tokens); one -0 bias alone gives +0 (an absent bias counts as +0)
        negative_zero = torch.rand(me.num_tokens, hidden, generator=gen) < 0.1
        for one in b:
            one[negative_zero] = -0.0
        bias = {"none": None, "one": b[0], "two": (b[0], b[1]),
                "by rank": [None, b[0], (b[0], b[1])][rank % 3]}[bias_mode]
        exp_x, exp_w = model.combine(rank, me.layout.is_token_in_rank, rows_of, ys, yws if use_w else None, bias,
                                     ranks_per_node)
        kw, is_async = event_kwargs(mode, chk.last_event)
        out = buffer.combine(dev(ys[rank]), handle, topk_weights=dev(yws[rank]) if use_w else None, bias=dev(bias),
                             config=combine_config, **kw)
        what = f"combine #{j} (bias={bias_mode}, weights={use_w})"
        if not chk.true(f"{what} arity", isinstance(out, tuple) and len(out) == 3, f"got {type(out).__name__}"):
            continue
        chk.event(what, out[2], is_async)
        chk.equal(f"{what} combined_x", out[0], exp_x)
        if use_w:
            chk.equal(f"{what} combined_topk_weights", out[1], exp_w)
        else:
            chk.true(f"{what} combined_topk_weights", out[1] is None, f"expected None, got {type(out[1]).__name__}")
        if case.get("repeat"):
            again = buffer.combine(dev(ys[rank]), handle, topk_weights=dev(yws[rank]) if use_w else None,
                                   bias=dev(bias), config=combine_config)
            chk.equal(f"repeated {what} combined_x", again[0], out[0])
            if use_w:
                chk.equal(f"repeated {what} combined_topk_weights", again[1], out[1])

        # the num_worst_tokens handle: M rows in, only the real ones read
        if worst_handle is not None and isinstance(worst_handle, tuple):
            pad = torch.randn(worst - len(rows_of[rank]), hidden, generator=gen).to(torch.bfloat16)
            pad_w = torch.randn(worst - len(rows_of[rank]), num_topk, generator=gen, dtype=torch.float32)
            out = buffer.combine(dev(torch.cat([ys[rank], pad])), worst_handle,
                                 topk_weights=dev(torch.cat([yws[rank], pad_w])) if use_w else None,
                                 bias=dev(bias), config=combine_config)
            chk.equal(f"worst-handle {what} combined_x", out[0], exp_x)
            if use_w:
                chk.equal(f"worst-handle {what} combined_topk_weights", out[1], exp_w)

    # ---- combine of the received weights gives back the original weights (0 where masked)
    if with_topk:
        out = buffer.combine(dev(ys[rank]), handle, topk_weights=recv_w, config=combine_config)
        exp_w = torch.where(me.topk_idx >= 0, me.topk_weights, torch.zeros_like(me.topk_weights))
        chk.equal("combine of recv_topk_weights", out[1], exp_w)

    # ---- the handle is not modified by combine / cached dispatch
    check_handle(chk, "handle after combines", handle, expected, internode)


# ---------------------------------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------------------------------
ALL_BIASES = ["none", "one", "two", "by rank"]

CASES_2 = [
    dict(name="2r-bf16-worst-cached-biases", tokens=[37, 64], hidden=128, topk=4, experts_per_rank=8, x="bf16",
         mask_frac=0.2, num_sms=8, worst=True, cached=["fp8_col", "bf16", "fp8_i32"], biases=ALL_BIASES, repeat=True),
    dict(name="2r-zero-tokens-skewed-align128-h72", tokens=[0, 50], hidden=72, topk=2, experts_per_rank=4,
         routing="skewed", alignment=128, num_sms=2, events="async", biases=["two"]),
    dict(name="2r-fp8-top32-worst-prevasync", tokens=[120, 7], hidden=256, topk=32, experts_per_rank=16, x="fp8",
         mask_frac=0.3, num_sms=24, worst=True, cached=["bf16", "fp8_i32_col"], events="prev_async_alloc",
         biases=["one"]),
    dict(name="2r-1024-experts-per-rank-default-config", tokens=[20, 33], hidden=64, topk=8, experts_per_rank=1024,
         mask_frac=0.1, num_sms=None, events="prev", biases=["none"]),
    dict(name="2r-no-topk-fp8i32col-h208", tokens=[45, 19], hidden=208, topk=3, experts_per_rank=4, x="fp8_i32_col",
         with_topk=False, num_sms=6, cached=["bf16"], biases=["none", "one"]),
    dict(name="2r-duplicate-experts-h512", tokens=[30, 31], hidden=512, topk=3, experts_per_rank=2, routing="dup",
         mask_frac=0.1, num_sms=4, alignment=4, biases=["two"], repeat=True),
    dict(name="2r-fewer-tokens-than-channels", tokens=[5, 3], hidden=96, topk=2, experts_per_rank=3, num_sms=24,
         worst=True, biases=["one"]),
    # slime's metadata dispatch: 32-byte rows (16 bf16), top-1, the sync layout's event passed on
    dict(name="2r-32-byte-rows-top1", tokens=[10, 8], hidden=16, topk=1, experts_per_rank=4, events="chain",
         cached=["bf16"], repeat=True, biases=["none"]),
    dict(name="2r-fp8-tma-aligned-scales", tokens=[13, 6], hidden=640, topk=4, experts_per_rank=4,
         x="fp8_i32_tma", mask_frac=0.1, num_sms=4, cached=["fp8_i32_tma"], events="chain_async_alloc",
         biases=["none"]),
]

CASES_3 = [
    dict(name="3r-zero-tokens-worst-cached-biases", tokens=[50, 0, 77], hidden=192, topk=6, experts_per_rank=5,
         routing="skewed", mask_frac=0.15, num_sms=6, worst=True, cached=["fp8_col", "bf16"], biases=ALL_BIASES,
         events="async", repeat=True),
    dict(name="3r-fp8col-align128-prevasync", tokens=[16, 90, 33], hidden=128, topk=8, experts_per_rank=4,
         x="fp8_col", mask_frac=0.25, alignment=128, num_sms=20, events="prev_async_alloc", biases=["two"]),
    dict(name="3r-first-half-rank2-receives-nothing", tokens=[30, 12, 9], hidden=256, topk=3, experts_per_rank=4,
         routing="first_half", num_sms=4, worst=True, cached=["bf16"], biases=["two"]),
    dict(name="3r-top32-h136", tokens=[11, 40, 25], hidden=136, topk=32, experts_per_rank=11, num_sms=2,
         events="prev", biases=["none"], cached=["bf16"]),
]

CASES_4 = [
    dict(name="4r-200-tokens", tokens=[200, 150, 199, 60], hidden=64, topk=6, experts_per_rank=6, mask_frac=0.1,
         num_sms=12, biases=["two"], cached=["bf16"]),
    dict(name="4r-bf16-worst-cached-biases", tokens=[40, 0, 100, 13], hidden=256, topk=8, experts_per_rank=4,
         mask_frac=0.2, num_sms=8, worst=True, cached=["fp8_i32_col", "bf16"], biases=ALL_BIASES, repeat=True),
    dict(name="4r-skewed-top1-align128", tokens=[64, 64, 64, 1], hidden=80, topk=1, experts_per_rank=8,
         routing="skewed", alignment=128, num_sms=4, events="async", biases=["one"]),
    dict(name="4r-fp8-top32-worst", tokens=[20, 30, 0, 10], hidden=384, topk=32, experts_per_rank=8, x="fp8",
         mask_frac=0.3, num_sms=10, worst=True, events="prev", cached=["fp8_col"], biases=["two"]),
    dict(name="4r-no-topk-default-config", tokens=[9, 17, 3, 28], hidden=128, topk=2, experts_per_rank=2,
         with_topk=False, num_sms=None, events="prev_async_alloc", biases=["none"]),
]

# more ranks than the GPU machines lend GPUs (non-powers of two among them): ranks with nothing to send,
# FP8 and top-32 at 6 ranks; 8 ranks with uneven counts
CASES_6 = [
    dict(name="6r-zero-tokens-fp8-worst-cached", tokens=[33, 0, 71, 5, 0, 128], hidden=256, topk=8, experts_per_rank=4,
         x="fp8", mask_frac=0.1, num_sms=12, worst=True, cached=["bf16", "fp8_col"], biases=["two"]),
    dict(name="6r-top32-skewed-align128", tokens=[40, 41, 1, 0, 90, 12], hidden=136, topk=32, experts_per_rank=7,
         routing="skewed", alignment=128, num_sms=4, events="async", biases=["one"]),
]
CASES_8 = [
    dict(name="8r-bf16-uneven-cached-biases", tokens=[64, 3, 0, 120, 17, 1, 80, 44], hidden=128, topk=8,
         experts_per_rank=4, mask_frac=0.2, num_sms=8, worst=True, cached=["fp8"], biases=ALL_BIASES, repeat=True),
    dict(name="8r-fp8i32col-dup-prevasync", tokens=[10, 20, 30, 40, 0, 5, 15, 25], hidden=512, topk=3,
         experts_per_rank=2, x="fp8_i32_col", routing="dup", num_sms=24, events="prev_async_alloc", biases=["none"]),
]

# Edge cases where ranks receive nothing; they run last so that a failure (which stops a rank's remaining
# cases) hides nothing else.
EDGE_CASES = {
    2: [dict(name="2r-no-tokens-anywhere", tokens=[0, 0], hidden=64, topk=2, experts_per_rank=2, num_sms=2,
             worst=True, cached=["bf16"], biases=["two"])],
    3: [
        dict(name="3r-everything-masked", tokens=[12, 0, 9], hidden=64, topk=3, experts_per_rank=2, mask_frac=1.0,
             num_sms=4, worst=True, cached=["bf16"], biases=["none", "two"]),
    ],
    4: [
        dict(name="4r-no-tokens-anywhere", tokens=[0, 0, 0, 0], hidden=128, topk=2, experts_per_rank=2, num_sms=4,
             worst=True, cached=["fp8_col"], biases=["one"]),
    ],
}

CASES_2X2 = [
    dict(name="2x2-bf16-worst-cached-biases", tokens=[40, 0, 65, 23], hidden=256, topk=8, experts_per_rank=4,
         mask_frac=0.2, num_sms=8, worst=True, cached=["fp8_col", "bf16"], biases=ALL_BIASES, repeat=True),
    dict(name="2x2-fp8i32-skewed-align128", tokens=[10, 70, 5, 0], hidden=512, topk=4, experts_per_rank=16,
         x="fp8_i32", routing="skewed", alignment=128, num_sms=4, events="async", cached=["bf16"], biases=["two"]),
    dict(name="2x2-no-topk", tokens=[33, 12, 0, 48], hidden=256, topk=2, experts_per_rank=2, with_topk=False,
         num_sms=2, events="prev_async_alloc", cached=["fp8_col"], biases=["one"]),
    dict(name="2x2-top32-fp8col-worst-manychannels", tokens=[25, 19, 31, 4], hidden=256, topk=32, experts_per_rank=8,
         x="fp8_col", mask_frac=0.3, num_sms=24, worst=True, events="prev", biases=["none", "two"]),
]


def random_cases(seed: int, world_size: int, count: int, internode: bool = False) -> List[Dict[str, Any]]:
    """`count` cases with every parameter drawn from the seed (fresh each run)."""
    import random
    rng = random.Random(seed ^ (world_size * 7919 + internode))
    cases = []
    for i in range(count):
        experts_per_rank = rng.choice([1, 2, 3, 8, 32])
        num_experts = experts_per_rank * world_size
        x = rng.choice(["bf16", "fp8", "fp8_col", "fp8_i32", "fp8_i32_col"])
        cached = rng.sample(["bf16", "fp8", "fp8_col", "fp8_i32_col"], rng.randint(0, 2))
        any_fp8 = x != "bf16" or any(kind != "bf16" for kind in cached)
        if internode:
            hidden = rng.choice([256, 512])
        else:  # rows are multiples of 16 bytes: FP8 needs hidden % 16 == 0, BF16 hidden % 8 == 0
            hidden = rng.randrange(64, 513, 16 if any_fp8 else 8)
        with_topk = rng.random() < 0.8
        tokens = [rng.choice([0, rng.randrange(1, 40), rng.randrange(1, 201)]) for _ in range(world_size)]
        case = dict(tokens=tokens, hidden=hidden, topk=rng.randint(1, min(32, num_experts)),
                    experts_per_rank=experts_per_rank, x=x, routing=rng.choice(["uniform", "skewed", "dup"]),
                    mask_frac=rng.choice([0.0, 0.1, 0.5, 1.0]), alignment=rng.choice([1, 2, 128]),
                    num_sms=rng.choice([None, 2, 4, 6, 8, 12, 20, 24]) if not internode else rng.choice([2, 4, 8, 24]),
                    events=rng.choice(["sync", "async", "prev", "prev_async_alloc"]), with_topk=with_topk,
                    worst=with_topk and rng.random() < 0.5,
                    cached=cached,
                    biases=rng.sample(ALL_BIASES, rng.randint(1, 3)), repeat=rng.random() < 0.3)
        case["name"] = f"random{i}:" + ",".join(f"{k}={v}" for k, v in case.items())
        cases.append(case)
    return cases


def _report(seed: int, run) -> None:
    try:
        results = run()
    except AssertionError as error:  # a rank raised: the message holds every rank's report
        raise AssertionError(f"seed={seed} (replay with DEEP_EP_TEST_SEED={seed}):\n{error}") from None
    errors = [e for per_rank in results for e in per_rank]
    assert not errors, f"seed={seed}: {len(errors)} mismatches (replay with DEEP_EP_TEST_SEED={seed}):\n" + \
        "\n".join(errors[:40])


@pytest.mark.parametrize("world_size,cases", [(2, CASES_2), (3, CASES_3), (4, CASES_4), (6, CASES_6), (8, CASES_8)],
                         ids=["2ranks", "3ranks", "4ranks", "6ranks", "8ranks"])
def test_intranode(pool, world_size, cases):
    seed = base_seed()
    cases = cases + random_cases(seed, world_size, 3 if world_size <= 4 else 2) + EDGE_CASES.get(world_size, [])
    _report(seed, lambda: pool(world_size).run(run_cases, seed, cases))


def test_intranode_in_deterministic_mode(pool):
    """The 2-rank cases with torch's deterministic algorithms on and new tensors filled with NaN / the
    largest integer (the transport may rely on no value of memory it did not write)."""
    from dist_utils import run_deterministic
    seed = base_seed()
    _report(seed, lambda: pool(2).run(run_deterministic, run_cases, seed, CASES_2))


def test_intranode_under_a_default_device_and_dtype(pool):
    """The 2-rank cases with every Buffer call made under a default device (meta) and dtype (bfloat16) that
    the library must not use (dist_utils.run_under_defaults)."""
    from dist_utils import run_under_defaults
    seed = base_seed()
    _report(seed, lambda: pool(2).run(run_under_defaults, run_cases, seed, CASES_2))


def test_internode_under_a_default_device_and_dtype(pool):
    """As above, for 2 nodes x 2 ranks (the internode handle and the two-level combine)."""
    from dist_utils import run_under_defaults
    seed = base_seed()
    _report(seed, lambda: pool(4).run(run_under_defaults, run_cases, seed, CASES_2X2[:2], 2))


def test_internode_2_nodes_x_2_ranks(pool):
    seed = base_seed()
    cases = CASES_2X2 + random_cases(seed, 4, 3, internode=True) + [
        dict(name="2x2-nothing-to-node-1", tokens=[30, 0, 17, 0], hidden=256, topk=2, experts_per_rank=2, num_sms=4,
             mask_frac=0.1, worst=True, cached=["fp8"], biases=["one"], routing="first_half")]
    _report(seed, lambda: pool(4).run(run_cases, seed, cases, 2))


def test_internode_3_nodes_x_2_ranks(pool):
    """An odd number of nodes: the per-node counts and the node-level forwarding have three nodes to serve."""
    seed = base_seed()
    cases = random_cases(seed, 6, 2, internode=True) + [
        dict(name="3x2-fp8-worst-cached", tokens=[30, 0, 17, 64, 5, 40], hidden=256, topk=6, experts_per_rank=3,
             x="fp8", mask_frac=0.1, num_sms=4, worst=True, cached=["bf16"], biases=["two"]),
        dict(name="3x2-nothing-to-node-2", tokens=[12, 9, 0, 33, 0, 0], hidden=256, topk=2, experts_per_rank=2,
             num_sms=2, routing="first_half", biases=["none"])]
    _report(seed, lambda: pool(6).run(run_cases, seed, cases, 2))


# ---------------------------------------------------------------------------------------------------
# dispatch moves raw bytes: any dtype with 16-byte rows (spec 5.1)
# ---------------------------------------------------------------------------------------------------
RAW_DTYPES = [getattr(torch, name) for name in (
    "float32", "float16", "float64", "int8", "uint8", "int16", "int32", "int64", "complex64", "uint16", "uint32",
    "uint64", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, name)]


def raw_rows(seed: int, s: int, num_tokens: int, row_bytes: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank s's rows for `dtype`: random bytes (every bit pattern), viewed as `dtype`."""
    gen = generator(seed, "raw", str(dtype), s)
    return torch.randint(0, 256, (num_tokens, row_bytes), generator=gen, dtype=torch.uint8).view(dtype)


def run_raw_dtypes(ctx, seed: int, case: Dict[str, Any]) -> List[str]:
    from deep_ep import Buffer
    num_ranks, rank = ctx.world_size, ctx.rank
    num_experts = num_ranks * case["experts_per_rank"]
    sources = make_sources(seed, case, num_ranks, None)
    rows = model.received_rows(sources, rank)
    me = sources[rank]
    buffer = Buffer(ctx.group, nvl_bytes(), 0, explicitly_destroy=True, timeout_s=BUFFER_TIMEOUT_S)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(me.topk_idx.to(ctx.device), num_experts)
    chk = Checker(seed, case["name"], rank)
    row_bytes = 64
    for dtype in RAW_DTYPES:
        xs = [raw_rows(seed, s, case["tokens"][s], row_bytes, dtype) for s in range(num_ranks)]
        expected = model.cached_dispatch([x.view(torch.uint8) for x in xs], rows)
        recv_x, _, _, _, handle, _ = buffer.dispatch(
            xs[rank].to(ctx.device), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=me.topk_idx.to(ctx.device),
            topk_weights=me.topk_weights.to(ctx.device))
        chk.true(f"{dtype} recv_x dtype", recv_x.dtype == dtype, f"got {recv_x.dtype}")
        chk.equal(f"{dtype} recv_x bytes", recv_x.cpu().view(torch.uint8), expected)
        cached = buffer.dispatch(xs[rank].to(ctx.device), handle=handle)[0]
        chk.equal(f"{dtype} cached recv_x bytes", cached.cpu().view(torch.uint8), expected)
        if dtype.itemsize == 1 and dtype.is_floating_point:   # the FP8 form: (1-byte data, scales)
            scales = [torch.randn(case["tokens"][s], 1, generator=generator(seed, "scales", s)) for s in range(num_ranks)]
            data, got_scales = buffer.dispatch(
                (xs[rank].to(ctx.device), scales[rank].to(ctx.device)), num_tokens_per_rank=per_rank,
                is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=me.topk_idx.to(ctx.device),
                topk_weights=me.topk_weights.to(ctx.device))[0]
            chk.equal(f"({dtype}, scales) data bytes", data.cpu().view(torch.uint8), expected)
            chk.equal(f"({dtype}, scales) scales", got_scales.cpu(), model.cached_dispatch(scales, rows))
    buffer.destroy()
    return chk.errors


@pytest.mark.parametrize("world_size", [2, 3])
def test_dispatch_moves_any_dtype_bit_for_bit(pool, world_size):
    """Plain x of every dtype (64-byte rows of random bytes, also dtypes a gloo or NCCL collective cannot carry),
    and the FP8 tuple with other 1-byte float data, arrive bit for bit, in cached dispatch too."""
    seed = base_seed()
    case = dict(name=f"raw-dtypes-{world_size}", tokens=[13, 0, 21][:world_size], hidden=64, topk=3,
                experts_per_rank=3, mask_frac=0.2)
    _report(seed, lambda: pool(world_size).run(run_raw_dtypes, seed, case))


def run_argument_semantics(ctx, seed: int, case: Dict[str, Any]) -> List[str]:
    from deep_ep import Buffer
    num_ranks, rank, dev = ctx.world_size, ctx.rank, ctx.device
    num_experts = num_ranks * case["experts_per_rank"]
    sources = make_sources(seed, case, num_ranks, None)
    me = sources[rank]
    expected = model.dispatch(sources, rank, num_experts, num_channels=configs(case, False)[2])
    buffer = Buffer(ctx.group, nvl_bytes(), 0, explicitly_destroy=True, timeout_s=BUFFER_TIMEOUT_S)
    chk = Checker(seed, case["name"], rank)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(me.topk_idx.to(dev), num_experts)
    topk = dict(topk_idx=me.topk_idx.to(dev), topk_weights=me.topk_weights.to(dev))
    # the per-expert list sums the callers' num_tokens_per_expert (spec 5.5), not what arrives
    padded = buffer.dispatch(me.x.to(dev), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                             num_tokens_per_expert=per_expert + 3, **topk)
    chk.true("list from the callers' num_tokens_per_expert + 3",
             padded[3] == [c + 3 * num_ranks for c in expected.num_recv_tokens_per_expert_list],
             f"got {padded[3]}, expected {expected.num_recv_tokens_per_expert_list} each + {3 * num_ranks}")
    chk.x_equal("recv_x with padded counts", padded[0], expected.recv_x)
    # a cached dispatch ignores the layout arguments, expert_alignment and num_worst_tokens (spec 5.1, 6.3)
    ignored = buffer.dispatch(me.x.to(dev), handle=padded[4], num_tokens_per_rank=torch.zeros(7), expert_alignment=0,
                              num_worst_tokens=-5)
    chk.x_equal("cached dispatch with ignored arguments recv_x", ignored[0], expected.recv_x)
    chk.true("cached dispatch with ignored arguments: (recv_x, None, None, None, None, event)",
             all(v is None for v in ignored[1:5]), f"got {[type(v).__name__ for v in ignored[1:5]]}")
    # a handle kept as a list serves as the tuple does (DeepEP only unpacks it)
    chk.x_equal("cached dispatch through a list handle recv_x", buffer.dispatch(me.x.to(dev), handle=list(padded[4]))[0],
                expected.recv_x)
    chk.equal("combine through a list handle", buffer.combine(padded[0], list(padded[4]))[0].cpu(),
              buffer.combine(padded[0], padded[4])[0].cpu())
    # ranks passing rows of different dtypes (same hidden, same element size) are refused together, naming
    # both; a cached dispatch too where it waits for the host (the reference transport: the NVLink one does not)
    odd = me.x.view(torch.int16).to(torch.int32 if rank == 0 else torch.float32).to(dev)
    calls = {"dispatch": lambda: buffer.dispatch(odd, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                 num_tokens_per_expert=per_expert)}
    if buffer.transport_name == "reference":
        calls["cached dispatch"] = lambda: buffer.dispatch(odd, handle=padded[4])
    for what, call in calls.items():
        try:
            call()
            chk.fail(f"{what}: dtypes differing between ranks", "nothing was raised")
        except ValueError as error:
            chk.true(f"{what}: dtypes differing between ranks: the message names them",
                     all(part in str(error) for part in ("dtype is torch.", "torch.int32", "torch.float32")),
                     str(error))
    # combine weights of top-k 1 whose one column has a stride other than 1 (contiguous all the same)
    num_recv = padded[0].shape[0]
    column = torch.rand(num_recv, generator=generator(seed, "column", rank)).reshape(1, num_recv).t()
    got = buffer.combine(padded[0], padded[4], topk_weights=column.to(dev))[1]
    same = buffer.combine(padded[0], padded[4], topk_weights=column.reshape(-1).clone().view(num_recv, 1).to(dev))[1]
    chk.equal("combined top-k 1 weights of a strided column", got.cpu(), same.cpu())
    buffer.destroy()
    return chk.errors


def test_dispatch_argument_semantics(pool):
    """Caller-supplied per-expert counts make the count list; a cached dispatch ignores the layout arguments."""
    seed = base_seed()
    case = dict(name="argument-semantics", tokens=[17, 9], hidden=128, topk=4, experts_per_rank=3, mask_frac=0.1)
    _report(seed, lambda: pool(2).run(run_argument_semantics, seed, case))


# ---------------------------------------------------------------------------------------------------
# the model itself, on hand-made cases (no library involved)
# ---------------------------------------------------------------------------------------------------
def _src(idx, num_experts, num_ranks, ranks_per_node=None, hidden=8):
    idx = torch.tensor(idx, dtype=torch.int64).reshape(-1, len(idx[0]) if idx else 2)
    x = torch.arange(idx.size(0) * hidden, dtype=torch.float32).reshape(-1, hidden).to(torch.bfloat16)
    w = torch.arange(1, idx.numel() + 1, dtype=torch.float32).reshape(idx.shape)
    return model.Source(x, idx, w, model.layout(idx, num_experts, num_ranks, ranks_per_node))


def test_model_handmade_intranode():
    # R=2, E=4 (2 per rank), K=2, C=2
    s0 = _src([[0, 3], [1, -1], [-1, -1]], 4, 2)
    s1 = _src([[2, 2], [3, 0]], 4, 2)
    assert s0.layout.num_tokens_per_rank.tolist() == [2, 1]
    assert s0.layout.num_tokens_per_expert.tolist() == [1, 1, 0, 1]
    assert s0.layout.is_token_in_rank.tolist() == [[True, True], [True, False], [False, False]]
    assert s0.layout.num_tokens_per_rdma_rank is None
    assert s1.layout.num_tokens_per_expert.tolist() == [1, 0, 2, 1]
    assert s1.layout.num_tokens_per_rank.tolist() == [1, 2]

    r0 = model.dispatch([s0, s1], 0, 4, num_channels=2)
    assert r0.rows == [(0, 0), (0, 1), (1, 1)]
    assert r0.recv_topk_idx.tolist() == [[0, -1], [1, -1], [-1, 0]]
    assert r0.recv_topk_weights.tolist() == [[1, 0], [3, 0], [0, 4]]
    assert r0.num_recv_tokens_per_expert_list == [2, 1]
    assert torch.equal(r0.recv_x, torch.stack([s0.x[0], s0.x[1], s1.x[1]]))
    h = r0.handle
    assert h["rank_prefix_matrix"].tolist() == [[2, 1], [3, 3]]
    assert h["channel_prefix_matrix"].tolist() == [[2, 2], [1, 1]]        # rank 0: tokens 0,1 | 2
    assert h["recv_channel_prefix_matrix"].tolist() == [[0, 2], [0, 0]]
    assert h["recv_src_idx"].tolist() == [0, 1, 1]
    assert h["send_head"].tolist() == [[0, 0], [1, -1], [-1, -1]]
    assert model.dispatch([s0, s1], 0, 4, num_channels=2, expert_alignment=4).num_recv_tokens_per_expert_list == [4, 4]

    r1 = model.dispatch([s0, s1], 1, 4, num_channels=2)
    assert r1.rows == [(0, 0), (1, 0), (1, 1)]
    assert r1.recv_topk_idx.tolist() == [[-1, 1], [0, 0], [1, -1]]
    assert r1.num_recv_tokens_per_expert_list == [2, 2]
    assert r1.handle["channel_prefix_matrix"].tolist() == [[0, 1], [1, 2]]  # rank 1: token 0 | 1
    assert r1.handle["recv_channel_prefix_matrix"].tolist() == [[0, 1], [0, 1]]
    assert r1.handle["send_head"].tolist() == [[-1, 0], [0, 1]]

    # combine on rank 0: token 0 <- ranks 0, 1; token 1 <- rank 0; token 2 <- nobody (bias only)
    bf = lambda v: torch.tensor(v, dtype=torch.float32).to(torch.bfloat16)  # noqa: E731
    big = 2.0 ** 24
    y0 = bf([[1.0], [5.0], [7.0]])
    y1 = bf([[3.0], [-1.0], [2.0]])
    b0, b1 = bf([[big], [0.5], [2.0]]), bf([[-big], [0.25], [-8.0]])
    out, _ = model.combine(0, s0.layout.is_token_in_rank, [r0.rows, r1.rows], [y0, y1], bias=(b0, b1))
    # (b0 + b1) first, then ranks ascending: big - big + 1 + 3 = 4 (adding 1 to big first would lose it)
    assert out.float().flatten().tolist() == [4.0, 5.75, -6.0]
    out, _ = model.combine(0, s0.layout.is_token_in_rank, [r0.rows, r1.rows], [y0, y1])
    assert out.float().flatten().tolist() == [1.0 + 3.0, 5.0, 0.0]  # (0, 0) is row 0 of both ranks
    w0 = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    w1 = torch.tensor([[10.0, 20.0], [30.0, 40.0], [50.0, 60.0]])
    _, out_w = model.combine(0, s0.layout.is_token_in_rank, [r0.rows, r1.rows], [y0, y1], [w0, w1])
    assert out_w.tolist() == [[11.0, 22.0], [3.0, 4.0], [0.0, 0.0]]


def test_model_handmade_internode():
    # R=4 as 2 nodes x 2 ranks, E=4 (1 per rank), C=1
    srcs = [_src([[1, 2], [3, -1]], 4, 4, 2), _src([[0, 0]], 4, 4, 2), _src([[0, 3], [2, -1]], 4, 4, 2),
            _src([], 4, 4, 2)]
    assert srcs[0].layout.num_tokens_per_rdma_rank.tolist() == [1, 2]
    assert srcs[2].layout.num_tokens_per_rdma_rank.tolist() == [1, 2]
    assert srcs[3].layout.num_tokens_per_rdma_rank.tolist() == [0, 0]
    r2 = model.dispatch(srcs, 2, 4, num_channels=1, ranks_per_node=2)
    assert r2.rows == [(0, 0), (2, 1)]
    h = r2.handle
    assert h["rdma_channel_prefix_matrix"].tolist() == [[1], [2]]
    assert h["gbl_channel_prefix_matrix"].tolist() == [[1], [0], [1], [1]]
    assert h["recv_rdma_channel_prefix_matrix"].tolist() == [[2], [2]]
    assert h["recv_rdma_rank_prefix_sum"].tolist() == [2, 4]
    assert h["recv_gbl_channel_prefix_matrix"].tolist() == [[0], [1], [1], [2]]
    assert h["recv_gbl_rank_prefix_sum"].tolist() == [1, 1, 2, 2]
    assert h["recv_src_meta"].view(torch.int32).tolist() == [[0, 1], [1, 1]]
    assert h["send_rdma_head"].tolist() == [[0, 0], [-1, 1]]
    assert h["send_nvl_head"].tolist() == [[0, -1], [-1, 0], [-1, 0], [0, -1]]
    assert r2.num_rdma_recv_tokens == 4
    assert r2.recv_topk_idx.tolist() == [[-1, 0], [0, -1]]

    # two-level rounding: rank 0's token -> rank 1 (node 0) and ranks 2, 3 (node 1)
    s = _src([[1, 2, 3]], 4, 4, 2)
    rows = [[], [(0, 0)], [(0, 0)], [(0, 0)]]
    bf = lambda v: torch.tensor([[v]], dtype=torch.float32).to(torch.bfloat16)  # noqa: E731
    ys = [bf(0.0)[:0], bf(1.0), bf(256.0), bf(1.0)]
    out, _ = model.combine(0, s.layout.is_token_in_rank, rows, ys, ranks_per_node=2)
    assert out.item() == 256.0  # bf16(1 + bf16(256 + 1)) = bf16(1 + 256); one level would give 258
    out, _ = model.combine(0, s.layout.is_token_in_rank, rows, ys)
    assert out.item() == 258.0
