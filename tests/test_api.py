"""The public API surface, exactly as the client frameworks touch it (DeepEP V1's names and shapes).

Single-process checks (imports, Config, size hints, default configs, set_num_sms, events, signatures) run in
the test process. Everything that needs a Buffer runs in ONE `pool(2).run` (spawning ranks is the expensive
part): every rank records failures per named check instead of raising, and the module fixture hands the
results to one small pytest test per check.

Contract sources: the spec (/work/shared/spec/deepep_v1_api.md sections 1, 2, 3), the client checklist
(/work/shared/research/clients.md section 1) and docs/DESIGN.md (extra keyword-only Buffer options, error
types: ValueError for values, RuntimeError after destroy).
"""
from __future__ import annotations

import contextlib
import gc
import inspect
import os
import re
import subprocess
import sys
import traceback
import warnings
import weakref
from typing import Dict, List

import pytest
import torch
import torch.distributed as dist

import deep_ep
from deep_ep import Buffer, Config, EventHandle, EventOverlap

# ---------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------
_EMPTY = inspect.Parameter.empty


def names_in(message: str, *names: str) -> bool:
    """True when every name occurs in `message` as a whole identifier (not inside a longer one)."""
    return all(re.search(rf"(?<![A-Za-z0-9_]){re.escape(n)}(?![A-Za-z0-9_])", message) for n in names)


def nvl_formula(num_sms, nvl_recv, hidden_bytes, num_ranks):
    """Spec 1.5, written independently of the library."""
    rr, rn, c, q, i, m = max(num_ranks // 8, 1), min(num_ranks, 8), num_sms // 2, nvl_recv, 8, 8
    total = (c * rn * (2 * rr + 3) * 4 + c * rn * q * hidden_bytes + c * rn * q * m + c * rn * q * 128 * i
             + c * rn * q * 128 * 4 + c * rn * q * 128 * 4)
    return (total + 127) // 128 * 128


def rdma_formula(num_sms, rdma_send, rdma_recv, hidden_bytes, num_ranks):
    """Spec 1.5 (rdma_recv rounded up to a multiple of rdma_send first)."""
    if num_ranks <= 8:
        return 0
    q = (rdma_recv + rdma_send - 1) // rdma_send * rdma_send
    rr, c, i = num_ranks // 8, num_sms // 2, 8
    total = (c * rr * (8 * 2 + 2) * 2 * 4 + c * rr * q * hidden_bytes * 2 + c * rr * q * 8 * 2
             + c * rr * q * 128 * i * 2 + c * rr * q * 128 * 4 * 2 + c * rr * q * 128 * 4 * 2 + c * rr * q * 16 * 2)
    return (total + 127) // 128 * 128


def ll_formula(n, hidden, num_experts):
    """Spec 9.1."""
    s = hidden // 128
    dm, cm = 16 + max(2 * hidden, hidden + 4 * s), 4 * s + 2 * hidden
    send, recv = max(n * dm, num_experts * n * cm), max(num_experts * n * dm, num_experts * n * cm)
    sig = (4 * num_experts + 127) // 128 * 128
    total = 2 * send + 2 * recv + 2 * sig
    return (total + 128) // 128 * 128


# DeepEP's tuned table (spec 2.3): (nvl_send, nvl_recv, rdma_send, rdma_recv)
DISPATCH_TABLE = {
    2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
    24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 48: (32, 288, 8, 128), 64: (32, 288, 8, 128),
    96: (20, 480, 12, 128), 128: (20, 560, 12, 128), 144: (32, 720, 12, 128), 160: (28, 720, 12, 128),
}
COMBINE_TABLE = {
    2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
    24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 48: (1, 288, 8, 128), 64: (1, 288, 8, 128),
    96: (1, 480, 8, 128), 128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128),
}


@pytest.fixture
def restore_num_sms():
    before = Buffer.num_sms
    yield
    Buffer.num_sms = before


# ---------------------------------------------------------------------------------------------------
# 1. imports (clients.md 1.1)
# ---------------------------------------------------------------------------------------------------
def test_imports_as_clients_do():
    from deep_ep import Buffer as B, Config as C, EventHandle as EH, EventOverlap as EO  # noqa: F401
    import deep_ep.utils
    from deep_ep.utils import EventHandle as UEH, EventOverlap as UEO
    assert UEH is EH and UEO is EO, "deep_ep.utils.EventHandle/EventOverlap must be the top-level classes"
    assert deep_ep.utils.EventOverlap is deep_ep.EventOverlap
    assert deep_ep.buffer.EventHandle is EH, "spec 1.1: EventHandle reachable as deep_ep.buffer.EventHandle"
    assert callable(deep_ep.utils.check_nvlink_connections)
    assert B is deep_ep.Buffer and C is deep_ep.Config
    for cls in (B, C, EH, EO):
        assert inspect.isclass(cls), f"{cls!r} must be a plain Python class"
    assert deep_ep.topk_idx_t is torch.int64 and isinstance(deep_ep.topk_idx_t, torch.dtype)
    # VL evaluates `deep_ep.Config | None` at import time; PT rejects a uccl-backed module
    assert (deep_ep.Config | None) is not None
    assert not Config.__module__.startswith("uccl") and not Buffer.__module__.startswith("uccl")
    # importing must not initialise torch.distributed
    assert not dist.is_initialized()


def test_version_is_the_installed_packages():
    from importlib import metadata
    assert re.fullmatch(r"\d+\.\d+\.\d+", deep_ep.__version__), deep_ep.__version__
    try:
        installed = metadata.version("deep-ep-triton")
    except metadata.PackageNotFoundError:
        pytest.skip("deep-ep-triton is not installed (tests run from the source tree)")
    assert installed == deep_ep.__version__


def test_no_v2_or_hybrid_symbols():
    for name in ("ElasticBuffer", "HybridEPBuffer"):
        assert not hasattr(deep_ep, name), f"deep_ep.{name} must not exist (clients would take the V2/HybridEP path)"
    with pytest.raises(ImportError):
        from deep_ep import HybridEPBuffer  # noqa: F401
    with pytest.raises(ImportError):
        from deep_ep import ElasticBuffer  # noqa: F401


def test_comm_timeout_error_is_runtime_error():
    assert issubclass(deep_ep.CommTimeoutError, RuntimeError)


class _FailedWork:
    """A collective whose wait raises what a backend raised."""

    def __init__(self, message: str) -> None:
        self.message = message

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout=None):
        raise RuntimeError(self.message)


class _OneRank:
    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 1


@pytest.mark.parametrize("message,timed_out", [("Timed out waiting 20000ms for recv operation to complete", True),
                                                ("Connection reset by peer", False)])
def test_a_failed_collective_is_a_timeout_only_when_it_timed_out(message, timed_out):
    from deep_ep.group import Group
    group = Group(None, _OneRank(), timeout_s=20)
    with pytest.raises(RuntimeError) as caught:
        group.wait([(_FailedWork(message), None)], "dispatch (data exchange)", torch.zeros(1))
    assert isinstance(caught.value, deep_ep.CommTimeoutError) == timed_out, caught.value
    assert "rank 0: dispatch (data exchange)" in str(caught.value) and message in str(caught.value)
    assert group.broken   # the ranks may be out of step either way


@pytest.mark.parametrize("version, supported", [("3.5.1", False), ("3.6.0", True), ("3.10.0+git1a2b3c", True),
                                                ("4.0", True), ("2.9.9", False), ("unknown", False)])
def test_auto_transport_needs_a_tested_triton(version, supported):
    from deep_ep.transport import triton_supported
    assert triton_supported(version) is supported


# ---------------------------------------------------------------------------------------------------
# 2. Config (spec 1.5)
# ---------------------------------------------------------------------------------------------------
def test_config_constructor_positional_and_keyword():
    params = list(inspect.signature(Config).parameters.values())
    assert [(p.name, p.default) for p in params[:5]] == [
        ("num_sms", 20), ("num_max_nvl_chunked_send_tokens", 6), ("num_max_nvl_chunked_recv_tokens", 256),
        ("num_max_rdma_chunked_send_tokens", 6), ("num_max_rdma_chunked_recv_tokens", 256)]
    hb = 7168 * 2
    positional = Config(24, 8, 256, 16, 128)
    keyword = Config(num_sms=24, num_max_nvl_chunked_send_tokens=8, num_max_nvl_chunked_recv_tokens=256,
                     num_max_rdma_chunked_send_tokens=16, num_max_rdma_chunked_recv_tokens=128)
    for num_ranks in (2, 8, 16, 32):
        assert positional.get_nvl_buffer_size_hint(hb, num_ranks) == keyword.get_nvl_buffer_size_hint(hb, num_ranks)
        assert positional.get_rdma_buffer_size_hint(hb, num_ranks) == keyword.get_rdma_buffer_size_hint(hb, num_ranks)
    # the shipped intranode test builds Config(24, 8, 256); the defaults fill the rest
    assert Config(24, 8, 256).get_nvl_buffer_size_hint(hb, 8) == nvl_formula(24, 256, hb, 8)
    assert Config().get_nvl_buffer_size_hint(hb, 8) == Config(20, 6, 256, 6, 256).get_nvl_buffer_size_hint(hb, 8)
    assert Config().get_rdma_buffer_size_hint(hb, 16) == rdma_formula(20, 6, 256, hb, 16)
    # hint methods accept DeepEP's keyword names
    assert Config().get_nvl_buffer_size_hint(hidden_bytes=hb, num_ranks=8) == nvl_formula(20, 256, hb, 8)
    assert Config().get_rdma_buffer_size_hint(hidden_bytes=hb, num_ranks=16) == rdma_formula(20, 6, 256, hb, 16)
    # DeepEP only checks num_sms >= 0 at construction; odd and zero are accepted there
    Config(21)
    Config(0)


def test_config_rdma_recv_rounded_up_to_multiple_of_send():
    hb = 4096 * 2
    # 128 -> 140 (multiple of 20): the hint must use 140, exactly as Config(.., 20, 140) does
    rounded = Config(20, 6, 256, 20, 128)
    assert rounded.get_rdma_buffer_size_hint(hb, 16) == Config(20, 6, 256, 20, 140).get_rdma_buffer_size_hint(hb, 16)
    assert rounded.get_rdma_buffer_size_hint(hb, 16) == rdma_formula(20, 20, 128, hb, 16)
    unrounded = Config(20, 6, 256, 20, 120)   # already a multiple: stays 120
    assert rounded.get_rdma_buffer_size_hint(hb, 16) != unrounded.get_rdma_buffer_size_hint(hb, 16)
    if hasattr(rounded, "num_max_rdma_chunked_recv_tokens"):  # fields are optional (not readable in DeepEP)
        assert rounded.num_max_rdma_chunked_recv_tokens == 140
    # 128 -> 200 with send 100: then send <= recv / 2 holds, so DeepEP accepts it
    assert Config(20, 6, 256, 100, 128).get_rdma_buffer_size_hint(hb, 16) == rdma_formula(20, 100, 200, hb, 16)
    Config(20, 6, 256, 7, 8)  # 8 -> 14, 7 <= 7


@pytest.mark.parametrize("args,names", [
    ((-2,), ["num_sms"]),
    ((20, 0, 256), ["num_max_nvl_chunked_send_tokens"]),
    ((20, 6, 0), ["num_max_nvl_chunked_recv_tokens"]),
    ((20, 256, 256), ["num_max_nvl_chunked_send_tokens"]),   # send must be < recv
    ((20, 300, 256), ["num_max_nvl_chunked_send_tokens"]),
    ((20, 6, 256, 0, 128), ["num_max_rdma_chunked_send_tokens"]),
    ((20, 6, 256, 6, 0), ["num_max_rdma_chunked_recv_tokens"]),
    ((20, 6, 256, 8, 8), ["num_max_rdma_chunked_send_tokens"]),   # 8 > 8 / 2
    ((20, 6, 256, 128, 128), ["num_max_rdma_chunked_send_tokens"]),
], ids=lambda v: str(v) if isinstance(v, tuple) else "")
def test_config_validation(args, names):
    with pytest.raises(ValueError) as info:
        Config(*args)
    assert names_in(str(info.value), *names), f"message must name {names}: {info.value}"


def test_nvl_size_hint_worked_example_and_formula():
    assert Config(20, 6, 256, 6, 128).get_nvl_buffer_size_hint(7168 * 2, 8) == 335709824
    for num_sms in (2, 20, 24, 32):
        for nvl_recv in (64, 256, 720):
            for hidden_bytes in (256, 4096 * 2, 7168 * 2):
                for num_ranks in (2, 4, 8, 16, 64):
                    got = Config(num_sms, 4, nvl_recv, 6, 128).get_nvl_buffer_size_hint(hidden_bytes, num_ranks)
                    assert got == nvl_formula(num_sms, nvl_recv, hidden_bytes, num_ranks), \
                        (num_sms, nvl_recv, hidden_bytes, num_ranks, got)
                    assert isinstance(got, int) and got % 128 == 0


def test_rdma_size_hint_formula():
    for num_ranks in (2, 4, 8):
        assert Config().get_rdma_buffer_size_hint(7168 * 2, num_ranks) == 0
    for num_sms in (20, 24):
        for send, recv in ((6, 128), (20, 128), (12, 128), (16, 128)):
            for num_ranks in (16, 32, 64, 160):
                got = Config(num_sms, 6, 256, send, recv).get_rdma_buffer_size_hint(7168 * 2, num_ranks)
                assert got == rdma_formula(num_sms, send, recv, 7168 * 2, num_ranks), (num_sms, send, recv, num_ranks)


def test_low_latency_size_hint():
    assert Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 288) == 2146961792
    assert Buffer.get_low_latency_rdma_size_hint(16, 5120, 8, 256) == 170395776
    assert Buffer.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank=128, hidden=7168, num_ranks=8,
                                                 num_experts=288) == 2146961792
    assert isinstance(inspect.getattr_static(Buffer, "get_low_latency_rdma_size_hint"), staticmethod)
    for n in (1, 8, 128, 256):
        for hidden in (128, 2048, 7168, 8192):
            for experts in (2, 16, 288):
                assert Buffer.get_low_latency_rdma_size_hint(n, hidden, 8, experts) == ll_formula(n, hidden, experts)
    # num_ranks is not used by the formula
    assert Buffer.get_low_latency_rdma_size_hint(128, 7168, 2, 288) == \
        Buffer.get_low_latency_rdma_size_hint(128, 7168, 64, 288)


# ---------------------------------------------------------------------------------------------------
# 3. Buffer class helpers (spec 2.3, clients.md 1.3)
# ---------------------------------------------------------------------------------------------------
def _config_hints(config: Config, num_ranks: int) -> tuple:
    hb = 7168 * 2
    return (config.get_nvl_buffer_size_hint(hb, num_ranks), config.get_rdma_buffer_size_hint(hb, max(num_ranks, 16)),
            config.get_nvl_buffer_size_hint(hb, 2), config.get_rdma_buffer_size_hint(hb, 16))


@pytest.mark.parametrize("num_ranks", sorted(DISPATCH_TABLE))
def test_default_configs_follow_deepep_table(num_ranks, restore_num_sms):
    Buffer.num_sms = 20
    for getter, table in ((Buffer.get_dispatch_config, DISPATCH_TABLE), (Buffer.get_combine_config, COMBINE_TABLE)):
        config = getter(num_ranks)
        assert isinstance(config, Config)
        assert _config_hints(config, num_ranks) == _config_hints(Config(20, *table[num_ranks]), num_ranks)
        assert getter(num_ranks=num_ranks) is not config, "a fresh Config per call"
        if hasattr(config, "num_sms"):
            assert config.num_sms == 20


@pytest.mark.parametrize("num_ranks", [3, 5, 6, 12, 256])
def test_default_configs_for_untuned_rank_counts(num_ranks):
    # no whitelist: clients call these for any EP size
    for getter in (Buffer.get_dispatch_config, Buffer.get_combine_config):
        config = getter(num_ranks)
        assert isinstance(config, Config)
        hint = config.get_nvl_buffer_size_hint(7168 * 2, num_ranks)
        assert isinstance(hint, int) and hint > 0


@pytest.mark.parametrize("num_ranks", [2, 4, 8, 12, 16, 24, 32])
def test_the_clients_size_hint_is_enough_for_any_node_size(num_ranks):
    # clients size num_nvl_bytes as the larger hint of the default dispatch and combine configs; every call
    # must accept it, also on a node of more than DeepEP's 8 ranks (all ranks of one host are one node here)
    from deep_ep.config import nvl_bytes_needed, topk_idx_t
    dispatch_config, combine_config = Buffer.get_dispatch_config(num_ranks), Buffer.get_combine_config(num_ranks)
    for hidden, topk, num_experts in ((1024, 8, 64), (2880, 4, 128), (7168, 8, 256), (4096, 32, 512)):
        hint = max(c.get_nvl_buffer_size_hint(hidden * 2, num_ranks) for c in (dispatch_config, combine_config))
        num_experts = max(num_experts, num_ranks)
        bf16 = hidden * 2 + 4 + topk * (topk_idx_t.itemsize + 4)
        fp8 = hidden + 4 + topk * (topk_idx_t.itemsize + 4) + hidden // 128 * 4
        back = hidden * 2 + 4 + topk * 4
        for ranks_per_node in sorted({min(num_ranks, 8), num_ranks}):
            for config, row_bytes in ((dispatch_config, bf16), (dispatch_config, fp8), (combine_config, back)):
                needed = nvl_bytes_needed(config, row_bytes, num_ranks, ranks_per_node, num_experts)
                assert needed <= hint, (hidden, topk, ranks_per_node, row_bytes)


def test_set_num_sms(restore_num_sms):
    assert isinstance(inspect.getattr_static(Buffer, "set_num_sms"), staticmethod)
    Buffer.set_num_sms(20)
    assert Buffer.num_sms == 20
    hint20 = Buffer.get_dispatch_config(8).get_nvl_buffer_size_hint(7168 * 2, 8)
    assert hint20 == Config(20, 6, 256, 6, 128).get_nvl_buffer_size_hint(7168 * 2, 8)
    for odd in (1, 21, 25):
        with pytest.raises(AssertionError):
            Buffer.set_num_sms(odd)
        assert Buffer.num_sms == 20, "a refused set_num_sms must not change num_sms"
    Buffer.set_num_sms(24)
    assert Buffer.num_sms == 24
    # later default configs use the new count (V1 reads the class attribute at call time)
    for num_ranks in (2, 8, 16):
        got = Buffer.get_dispatch_config(num_ranks).get_nvl_buffer_size_hint(7168 * 2, num_ranks)
        assert got == Config(24, *DISPATCH_TABLE[num_ranks]).get_nvl_buffer_size_hint(7168 * 2, num_ranks)
        got = Buffer.get_combine_config(num_ranks).get_nvl_buffer_size_hint(7168 * 2, num_ranks)
        assert got == Config(24, *COMBINE_TABLE[num_ranks]).get_nvl_buffer_size_hint(7168 * 2, num_ranks)
    Buffer.set_num_sms(new_num_sms=20) if "new_num_sms" in inspect.signature(Buffer.set_num_sms).parameters \
        else Buffer.set_num_sms(20)
    assert Buffer.get_dispatch_config(8).get_nvl_buffer_size_hint(7168 * 2, 8) == hint20


def test_static_helpers():
    assert Buffer.num_sms == 20, "DeepEP's default class attribute"
    assert Buffer.is_sm90_compiled() is True
    for name in ("is_sm90_compiled", "set_num_sms", "capture", "get_low_latency_rdma_size_hint",
                 "get_dispatch_config", "get_combine_config"):
        assert isinstance(inspect.getattr_static(Buffer, name), staticmethod), f"Buffer.{name} must be a staticmethod"
    ev = Buffer.capture()
    assert isinstance(ev, EventOverlap) and isinstance(ev.event, EventHandle)
    ev.current_stream_wait()
    with Buffer.capture() as inner:
        assert isinstance(inner, EventOverlap)


# ---------------------------------------------------------------------------------------------------
# 4. EventOverlap / EventHandle on CPU (spec 1.3, 1.4; DESIGN "CPU")
# ---------------------------------------------------------------------------------------------------
def test_event_overlap_semantics():
    empty = EventOverlap()
    assert empty.event is None and empty.extra_tensors is None
    with pytest.raises(AssertionError):
        empty.current_stream_wait()
    with empty as entered:          # __enter__ returns self; __exit__ without an event does nothing
        assert entered is empty
    assert EventOverlap(None).event is None

    handle = EventHandle()
    handle.current_stream_wait()
    t = torch.ones(3)
    ev = EventOverlap(handle, (t,))
    assert ev.event is handle and ev.extra_tensors[0] is t
    ev.current_stream_wait()
    with ev as entered:
        assert entered is ev
    kw = EventOverlap(event=handle, extra_tensors=(t, t))
    assert kw.event is handle and len(kw.extra_tensors) == 2
    # an exception inside `with` propagates
    with pytest.raises(KeyError):
        with EventOverlap(handle):
            raise KeyError("x")


# ---------------------------------------------------------------------------------------------------
# 5. Buffer signature and class shape (clients.md 1.1/1.2)
# ---------------------------------------------------------------------------------------------------
BUFFER_PARAMS = [("group", _EMPTY), ("num_nvl_bytes", 0), ("num_rdma_bytes", 0), ("low_latency_mode", False),
                 ("num_qps_per_rank", 24), ("allow_nvlink_for_low_latency_mode", True), ("allow_mnnvl", False),
                 ("use_fabric", False), ("explicitly_destroy", False), ("enable_shrink", False), ("comm", None)]

METHOD_PARAMS = {
    "get_dispatch_layout": [("topk_idx", _EMPTY), ("num_experts", _EMPTY), ("previous_event", None),
                            ("async_finish", False), ("allocate_on_comm_stream", False)],
    "dispatch": [("x", _EMPTY), ("handle", None), ("num_tokens_per_rank", None), ("num_tokens_per_rdma_rank", None),
                 ("is_token_in_rank", None), ("num_tokens_per_expert", None), ("topk_idx", None),
                 ("topk_weights", None), ("expert_alignment", 1), ("num_worst_tokens", 0), ("config", None),
                 ("previous_event", None), ("async_finish", False), ("allocate_on_comm_stream", False)],
    "combine": [("x", _EMPTY), ("handle", _EMPTY), ("topk_weights", None), ("bias", None), ("config", None),
                ("previous_event", None), ("async_finish", False), ("allocate_on_comm_stream", False)],
    "clean_low_latency_buffer": [("num_max_dispatch_tokens_per_rank", _EMPTY), ("hidden", _EMPTY),
                                 ("num_experts", _EMPTY)],
    "low_latency_dispatch": [("x", _EMPTY), ("topk_idx", _EMPTY), ("num_max_dispatch_tokens_per_rank", _EMPTY),
                             ("num_experts", _EMPTY), ("cumulative_local_expert_recv_stats", None),
                             ("dispatch_wait_recv_cost_stats", None), ("use_fp8", True), ("round_scale", False),
                             ("use_ue8m0", False), ("async_finish", False), ("return_recv_hook", False)],
    "low_latency_combine": [("x", _EMPTY), ("topk_idx", _EMPTY), ("topk_weights", _EMPTY), ("handle", _EMPTY),
                            ("use_logfmt", False), ("zero_copy", False), ("async_finish", False),
                            ("return_recv_hook", False), ("out", None), ("combine_wait_recv_cost_stats", None)],
    "get_next_low_latency_combine_buffer": [("handle", _EMPTY)],
    "get_local_buffer_tensor": [("dtype", _EMPTY), ("size", None), ("offset", 0), ("use_rdma_buffer", False)],
    "low_latency_update_mask_buffer": [("rank_to_mask", _EMPTY), ("mask", False)],
    "low_latency_query_mask_buffer": [("mask_status", _EMPTY)],
    "low_latency_clean_mask_buffer": [],
    "get_comm_stream": [],
    "destroy": [],
    "get_dispatch_config": [("num_ranks", _EMPTY)],
    "get_combine_config": [("num_ranks", _EMPTY)],
    "get_low_latency_rdma_size_hint": [("num_max_dispatch_tokens_per_rank", _EMPTY), ("hidden", _EMPTY),
                                       ("num_ranks", _EMPTY), ("num_experts", _EMPTY)],
}
METHOD_PARAMS["internode_dispatch"] = METHOD_PARAMS["dispatch"]
METHOD_PARAMS["internode_combine"] = METHOD_PARAMS["combine"]


def _positional(sig: inspect.Signature, skip_self: bool) -> List[inspect.Parameter]:
    params = list(sig.parameters.values())
    if skip_self and params and params[0].name == "self":
        params = params[1:]
    return params


def test_buffer_signature():
    sig = inspect.signature(Buffer)           # PT: inspect.signature(Buffer) must work and show real names
    params = list(sig.parameters.values())
    head = params[:len(BUFFER_PARAMS)]
    assert [(p.name, p.default) for p in head] == BUFFER_PARAMS
    assert all(p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD for p in head)
    # DESIGN: the extra options are keyword-only; no **kwargs (LM relies on TypeError for unknown ones)
    for p in params[len(BUFFER_PARAMS):]:
        assert p.kind == inspect.Parameter.KEYWORD_ONLY, f"extra Buffer option {p.name} must be keyword-only"
    assert {"num_ranks_per_node", "transport", "timeout_s", "device"} <= {p.name for p in params}
    assert "is_intranode" not in sig.parameters


@pytest.mark.parametrize("method", sorted(METHOD_PARAMS))
def test_method_signatures(method):
    fn = getattr(Buffer, method)
    params = _positional(inspect.signature(fn), skip_self=True)
    assert [(p.name, p.default) for p in params] == METHOD_PARAMS[method]
    assert all(p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)


def test_buffer_is_plain_monkeypatchable_class():
    # slime replaces Buffer.__init__ around construction
    original = Buffer.__init__
    calls = []

    def patched(self, *args, **kwargs):
        calls.append(args)
        return original(self, *args, **kwargs)

    Buffer.__init__ = patched
    try:
        with pytest.raises(ValueError) as info:
            Buffer(None)
        assert calls == [(None,)]
        assert names_in(str(info.value), "group", "comm")
    finally:
        Buffer.__init__ = original
    assert Buffer.__init__ is original


def test_buffer_bad_construction_without_group():
    with pytest.raises(ValueError) as info:
        Buffer(None)
    assert names_in(str(info.value), "group", "comm")
    with pytest.raises(ValueError):
        Buffer(None, 0, 0, comm=None)
    with pytest.raises(TypeError) as info:
        Buffer(None, 0, 0, bogus_option=1)
    assert "bogus_option" in str(info.value)
    with pytest.raises(TypeError):      # LM retries without allow_mnnvl/explicitly_destroy on TypeError
        Buffer(None, 0, 0, is_intranode=True)
    with pytest.raises(TypeError):      # the extras are keyword-only
        Buffer(None, 0, 0, False, 24, True, False, False, False, False, None, 2)


# ---------------------------------------------------------------------------------------------------
# 6. Buffers on 2 ranks: one pool run, many named checks
# ---------------------------------------------------------------------------------------------------
T, H, E, K, N = 4, 128, 4, 2, 8      # tokens, hidden, experts, top-k, LL max tokens per rank


class Checks:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.results: Dict[str, List[str]] = {}

    @contextlib.contextmanager
    def check(self, name: str):
        self.results.setdefault(name, [])
        try:
            yield
        except Exception:  # noqa: BLE001 - recorded, reported by the pytest test of that name
            self.results[name].append(f"rank {self.rank}:\n{traceback.format_exc()}")

    def expect(self, name: str, exc_type, fn, *names: str, label: str = "") -> None:
        """`fn()` must raise `exc_type` (or a subclass) whose message names every entry of `names`."""
        self.results.setdefault(name, [])
        where = f"rank {self.rank}{' [' + label + ']' if label else ''}"
        try:
            fn()
        except exc_type as error:
            if not names_in(str(error), *names):
                self.results[name].append(f"{where}: {exc_type.__name__} message must name {names}: {error}")
        except Exception as error:  # noqa: BLE001
            self.results[name].append(f"{where}: expected {exc_type.__name__}, got {type(error).__name__}: {error}")
        else:
            self.results[name].append(f"{where}: expected {exc_type.__name__}, nothing was raised")


def nvl_size() -> int:
    hb = H * 2
    return max(Config(20, *DISPATCH_TABLE[2]).get_nvl_buffer_size_hint(hb, 2),
               Config(20, *COMBINE_TABLE[2]).get_nvl_buffer_size_hint(hb, 2))


def ll_size() -> int:
    return ll_formula(N, H, E)


def routing(ctx):
    """Every token picks expert 0 (rank 0) and expert 2 (rank 1); x[t] = 100 * rank + t."""
    topk_idx = torch.tensor([[0, 2]] * T, dtype=torch.int64, device=ctx.device)
    topk_weights = torch.full((T, K), 0.5, dtype=torch.float32, device=ctx.device)
    x = (100 * ctx.rank + torch.arange(T, dtype=torch.float32)).view(T, 1).expand(T, H)
    return x.to(torch.bfloat16).contiguous().to(ctx.device), topk_idx, topk_weights


def tiny_dispatch(ctx, buf, config=None, async_finish=False, previous_event=None, allocate_on_comm_stream=False,
                  combine=True):
    """dispatch (+ combine) of `routing`, results checked; returns (handle, dispatch event)."""
    x, topk_idx, topk_weights = routing(ctx)
    num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, _ = \
        buf.get_dispatch_layout(topk_idx, E)
    assert num_tokens_per_rdma_rank is None
    assert num_tokens_per_rank.tolist() == [T, T]
    out = buf.dispatch(x, num_tokens_per_rank=num_tokens_per_rank, num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
                       is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert,
                       topk_idx=topk_idx, topk_weights=topk_weights, config=config, async_finish=async_finish,
                       previous_event=previous_event, allocate_on_comm_stream=allocate_on_comm_stream)
    assert isinstance(out, tuple) and len(out) == 6
    recv_x, recv_topk_idx, recv_topk_weights, counts, handle, event = out
    if async_finish:
        event.current_stream_wait()
    expected = torch.cat([(100 * s + torch.arange(T, dtype=torch.float32)).view(T, 1).expand(T, H) for s in range(2)])
    assert torch.equal(recv_x.cpu().float(), expected), "dispatch rows"
    local = [0, -1] if ctx.rank == 0 else [-1, 0]
    assert recv_topk_idx.cpu().tolist() == [local] * (2 * T)
    assert counts == [2 * T, 0]
    assert isinstance(handle, tuple) and len(handle) == 6
    if combine:
        combined, combined_weights, cev = buf.combine(recv_x, handle, topk_weights=recv_topk_weights,
                                                      async_finish=async_finish)
        if async_finish:
            cev.current_stream_wait()
        assert torch.equal(combined.cpu().float(), 2 * x.cpu().float()), "combine = sum over the 2 ranks"
        assert torch.equal(combined_weights.cpu(), topk_weights.cpu())
    return handle, event


def tiny_low_latency(ctx, buf):
    x, topk_idx, topk_weights = routing(ctx)
    recv_x, recv_count, handle, event, hook = buf.low_latency_dispatch(x, topk_idx, N, E, use_fp8=False)
    assert hook is None and event.event is None
    assert tuple(recv_x.shape) == (E // 2, 2 * N, H) and recv_x.dtype == torch.bfloat16
    assert recv_count.cpu().tolist() == [2 * T, 0]
    assert len(handle) == 5 and tuple(handle[2:]) == (N, H, E)
    combined, cevent, chook = buf.low_latency_combine(recv_x, topk_idx, topk_weights, handle)
    assert chook is None
    assert torch.equal(combined.cpu().float(), x.cpu().float()), "LL combine = sum_k w * x = x"


class _CommOver:
    """The mpi4py communicator methods Buffer uses, over a torch.distributed group."""

    def __init__(self, group) -> None:
        self.group = group

    def Get_rank(self) -> int:  # noqa: N802 (mpi4py's names)
        return dist.get_rank(self.group)

    def Get_size(self) -> int:  # noqa: N802
        return dist.get_world_size(self.group)

    def allgather(self, obj):
        out = [None] * self.Get_size()
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def Barrier(self) -> None:  # noqa: N802
        dist.barrier(self.group)


def run_api_checks(ctx) -> Dict[str, List[str]]:
    c = Checks(ctx.rank)
    group = ctx.group
    nvl, rdma = nvl_size(), ll_size()
    other = 1 - ctx.rank

    # -- local constructor errors on ONE rank only: the group must stay in step --------------------------
    if ctx.rank == 0:
        c.expect("constructor_errors_local", TypeError, lambda: Buffer(group, nvl, 0, bogus_option=1), "bogus_option")
        c.expect("constructor_errors_local", ValueError, lambda: Buffer(None), "group", "comm")
        c.expect("constructor_errors_local", ValueError, lambda: Buffer(None, nvl, 0, comm=None), "group", "comm")
    else:
        c.expect("constructor_errors_local", TypeError, lambda: Buffer(group, nvl, 0, is_intranode=True),
                 "is_intranode")

    # -- positional construction + attributes ------------------------------------------------------------
    buf = None
    with c.check("positional_construction_and_attributes"):
        buf = Buffer(group, nvl, 0)
        assert buf.rank == ctx.rank and buf.group_size == 2
        assert buf.group is group
        assert buf.num_nvl_bytes == nvl and buf.num_rdma_bytes == 0
        assert buf.low_latency_mode is False and buf.explicitly_destroy is False and buf.enable_shrink is False
        assert getattr(buf, "runtime", None) is not None
        assert not hasattr(buf, "nvshmem_qp_depth"), "spec 1.6: set only with low_latency_mode or R > 8"
        assert buf.num_sms == 20
        # DeepEP's runtime queries, which scripts ask `buffer.runtime`: one node here, and two of one rank each
        rt = buf.runtime
        assert rt.is_available() and not rt.is_internode_available()
        assert (rt.get_num_rdma_ranks(), rt.get_rdma_rank()) == (1, 0)
        assert (rt.get_root_rdma_rank(True), rt.get_root_rdma_rank(False)) == (ctx.rank, 0)
        assert rt.get_local_device_id() == (ctx.device.index if ctx.device.type == "cuda" else -1)
        nodes = Buffer(group, nvl, 0, num_ranks_per_node=1).runtime
        assert nodes.is_internode_available() and (nodes.get_num_rdma_ranks(), nodes.get_rdma_rank()) == (2, ctx.rank)
        assert nodes.get_root_rdma_rank(True) == 0
        tiny_dispatch(ctx, buf)
    with c.check("constructor_errors_local"):
        tiny_dispatch(ctx, buf)   # after the one-rank errors above the group still works

    with c.check("keyword_construction_and_attributes"):
        kw = Buffer(group=group, num_nvl_bytes=nvl, num_rdma_bytes=rdma, low_latency_mode=True, num_qps_per_rank=E // 2,
                    allow_nvlink_for_low_latency_mode=True, allow_mnnvl=True, use_fabric=False,
                    explicitly_destroy=True, enable_shrink=True, comm=None)
        assert (kw.rank, kw.group_size, kw.group) == (ctx.rank, 2, group)
        assert (kw.num_nvl_bytes, kw.num_rdma_bytes) == (nvl, rdma)
        assert kw.low_latency_mode is True and kw.explicitly_destroy is True and kw.enable_shrink is True
        assert kw.nvshmem_qp_depth == int(os.environ.get("NVSHMEM_QP_DEPTH", "1024"))
        tiny_low_latency(ctx, kw)
        tiny_dispatch(ctx, kw)    # normal kernels stay usable in LL mode
        kw.destroy()

    # -- weakref, isinstance (VL WeakValueDictionary, LM isinstance) ------------------------------------
    with c.check("weakref_and_isinstance"):
        assert isinstance(buf, Buffer) and isinstance(buf, deep_ep.Buffer)
        ref = weakref.ref(buf)
        assert ref() is buf
        cache = weakref.WeakValueDictionary()
        temp = Buffer(group, nvl, 0)
        cache[("k",)] = temp
        temp_ref = weakref.ref(temp)
        del temp
        gc.collect()
        assert temp_ref() is None and ("k",) not in cache, "a dropped Buffer must be collectable"

    # -- the construction-time object exchange: bounded collectives, objects of different sizes by rank ------
    with c.check("object_exchange"):
        from deep_ep.group import Group
        with torch.device("meta"):   # (a default device the caller set must not matter)
            objects = Group(group, None, timeout_s=20).all_gather_object(
                ("rank", ctx.rank, "x" * (3 + 5000 * ctx.rank)), "test exchange")
        assert objects == [("rank", r, "x" * (3 + 5000 * r)) for r in range(2)], objects

    # -- static helpers through an instance --------------------------------------------------------------
    with c.check("helpers_on_instance"):
        assert buf.is_sm90_compiled() is True
        ev = buf.capture()                     # VL passes the bound `self.buffer.capture`
        assert isinstance(ev, EventOverlap) and ev.event is not None
        assert isinstance(buf.get_dispatch_config(2), Config) and isinstance(buf.get_combine_config(2), Config)
        assert buf.get_low_latency_rdma_size_hint(N, H, 2, E) == ll_formula(N, H, E)

    # -- set_num_sms on an instance changes later default configs (handle matrices have num_sms/2 columns) --
    with c.check("set_num_sms_on_instance"):
        try:
            refused = False
            try:
                buf.set_num_sms(23)
            except AssertionError:
                refused = True
            assert refused, "set_num_sms(23) must raise AssertionError (odd)"
            assert Buffer.num_sms == 20
            buf.set_num_sms(22)
            assert Buffer.num_sms == 22 and buf.num_sms == 22
            handle, _ = tiny_dispatch(ctx, buf)
            assert tuple(handle[1].shape) == (2, 11) and tuple(handle[2].shape) == (2, 11), \
                f"channel matrices must have num_sms/2 = 11 columns, got {tuple(handle[1].shape)}"
        finally:
            Buffer.set_num_sms(20)
        handle, _ = tiny_dispatch(ctx, buf)
        assert tuple(handle[1].shape) == (2, 10)

    # -- events of real calls on CPU ---------------------------------------------------------------------
    with c.check("events_of_calls"):
        _, event = tiny_dispatch(ctx, buf)
        assert isinstance(event, EventOverlap) and event.event is None
        try:
            event.current_stream_wait()
            raise RuntimeError("current_stream_wait on a synchronous call's EventOverlap must raise AssertionError")
        except AssertionError:
            pass
        _, event = tiny_dispatch(ctx, buf, async_finish=True)
        assert isinstance(event, EventOverlap) and event.event is not None
        with event:
            pass
        # the clients' overlapped form: previous_event=capture(), async, allocate on the comm stream
        _, event = tiny_dispatch(ctx, buf, async_finish=True, previous_event=Buffer.capture(),
                                 allocate_on_comm_stream=True)
        event.current_stream_wait()
        x, topk_idx, _ = routing(ctx)
        layout = buf.get_dispatch_layout(topk_idx, E, previous_event=buf.capture(), async_finish=True,
                                         allocate_on_comm_stream=True)
        assert len(layout) == 5 and isinstance(layout[4], EventOverlap) and layout[4].event is not None
        layout[4].current_stream_wait()
        assert layout[0].tolist() == [T, T]

    with c.check("get_comm_stream"):
        stream = buf.get_comm_stream()
        if ctx.device.type == "cpu":
            assert stream is None, f"no streams on CPU, got {stream!r}"
        else:
            assert isinstance(stream, torch.cuda.Stream)

    # -- get_local_buffer_tensor -------------------------------------------------------------------------
    with c.check("get_local_buffer_tensor"):
        raw = buf.get_local_buffer_tensor(torch.uint8)
        assert raw.dtype == torch.uint8 and raw.numel() == nvl and raw.device.type == ctx.device.type
        assert buf.get_local_buffer_tensor(torch.int32).numel() == nvl // 4
        assert buf.get_local_buffer_tensor(torch.bfloat16).dtype == torch.bfloat16
        view = buf.get_local_buffer_tensor(torch.float32, torch.Size([4, 8]))
        assert tuple(view.shape) == (4, 8) and view.dtype == torch.float32
        view.fill_(1.5)
        again = buf.get_local_buffer_tensor(torch.float32, torch.Size([32]))
        assert torch.equal(again, torch.full((32,), 1.5, device=again.device)), "views must share the buffer"
        # offset is in bytes (spec 2.3)
        shifted = buf.get_local_buffer_tensor(torch.int32, torch.Size([2]), offset=8)
        shifted.copy_(torch.tensor([7, 9], dtype=torch.int32))
        ints = buf.get_local_buffer_tensor(torch.int32, torch.Size([4]), 0, False)
        assert ints[2:].tolist() == [7, 9], f"offset=8 must start 8 bytes in, got {ints.tolist()}"
        assert buf.get_local_buffer_tensor(torch.uint8, use_rdma_buffer=True).numel() == 0
    c.expect("get_local_buffer_tensor_too_big", ValueError,
             lambda: buf.get_local_buffer_tensor(torch.int32, torch.Size([nvl])), "size")

    # -- num_qps_per_rank: DeepEP asserts > 0 only where it initialises NVSHMEM (low-latency mode here) --------
    with c.check("num_qps_per_rank_0_without_low_latency"):
        Buffer(group, nvl, 0, num_qps_per_rank=0, explicitly_destroy=True).destroy()
    c.expect("num_qps_per_rank_0_in_low_latency_mode", ValueError,
             lambda: Buffer(group, 0, rdma, low_latency_mode=True, num_qps_per_rank=0), "num_qps_per_rank")

    # -- a low-latency area of exactly DeepEP's layout total is enough (spec 9.1: total <= num_rdma_bytes; the
    # hint adds up to 128 bytes) ---------------------------------------------------------------------------
    with c.check("low_latency_area_of_the_layout_total"):
        total = Buffer.get_low_latency_rdma_size_hint(N, H, 2, E) - 128   # (the layout total is 128-aligned here)
        exact = Buffer(group, 0, total, low_latency_mode=True, num_qps_per_rank=E // 2, explicitly_destroy=True)
        tiny_low_latency(ctx, exact)
        exact.get_next_low_latency_combine_buffer(exact.low_latency_dispatch(*routing(ctx)[:2], N, E)[2])
        exact.clean_low_latency_buffer(N, H, E)
        # use_ue8m0 without round_scale matters only with FP8 (DeepEP checks it there): BF16 comes back
        plain = exact.low_latency_dispatch(*routing(ctx)[:2], N, E, use_fp8=False, use_ue8m0=True)[0]
        assert plain.dtype == torch.bfloat16, plain.dtype
        exact.destroy()
    c.expect("low_latency_area_below_the_layout_total", ValueError,
             lambda: Buffer(group, 0, total - 128, low_latency_mode=True,
                            num_qps_per_rank=E // 2).low_latency_dispatch(*routing(ctx)[:2], N, E),
             "num_rdma_bytes")

    # -- several Buffers in one process, interleaved (LM keeps three) -----------------------------------
    with c.check("several_buffers"):
        normal2 = Buffer(group, nvl, 0)
        ll = Buffer(group, 0, rdma, low_latency_mode=True, num_qps_per_rank=E // 2)
        common = Buffer(group, nvl, rdma, low_latency_mode=True, num_qps_per_rank=E // 2)
        h_main, _ = tiny_dispatch(ctx, buf, combine=False)
        tiny_low_latency(ctx, ll)
        tiny_dispatch(ctx, normal2)
        tiny_low_latency(ctx, common)
        tiny_dispatch(ctx, common)
        x, _, _ = routing(ctx)
        recv = torch.cat([(100 * s + torch.arange(T, dtype=torch.float32)).view(T, 1).expand(T, H)
                          for s in range(2)]).to(torch.bfloat16).to(ctx.device)
        combined, _, _ = buf.combine(recv, h_main)           # a handle survives other Buffers' calls
        assert torch.equal(combined.cpu().float(), 2 * x.cpu().float())
        tiny_low_latency(ctx, ll)
        ll_buf = ll.get_local_buffer_tensor(torch.uint8, use_rdma_buffer=True)
        assert ll_buf.numel() == rdma
        assert ll.get_local_buffer_tensor(torch.bfloat16, use_rdma_buffer=True).numel() == rdma // 2
        # Megatron/AM replace a buffer without destroy(): drop and rebuild
        del normal2, ll, common
        gc.collect()
        rebuilt = Buffer(group, nvl, 0)
        tiny_dispatch(ctx, rebuilt)
        del rebuilt
        gc.collect()

    # -- destroy -----------------------------------------------------------------------------------------
    if ctx.rank == 0:  # AssertionError without the flag, raised on one rank only: no collective started
        c.expect("destroy_requires_flag", AssertionError, buf.destroy, "explicitly_destroy")
    with c.check("destroy_requires_flag"):
        tiny_dispatch(ctx, buf)       # still usable, group in step

    with c.check("destroy_then_api_raises_runtime_error"):
        victim = Buffer(group, nvl, rdma, low_latency_mode=True, num_qps_per_rank=E // 2, explicitly_destroy=True,
                        enable_shrink=True)
        handle, _ = tiny_dispatch(ctx, victim, combine=False)
        x, topk_idx, topk_weights = routing(ctx)
        _, _, ll_handle, _, _ = victim.low_latency_dispatch(x, topk_idx, N, E, use_fp8=False)
        _, _, _, _, pending_hook = victim.low_latency_dispatch(x, topk_idx, N, E, use_fp8=False,
                                                               return_recv_hook=True)
        victim.destroy()
        assert victim.runtime is None, "spec 1.6: runtime is None after destroy()"
        assert victim.rank == ctx.rank and victim.group_size == 2   # plain attributes stay readable
    calls = {
        "get_dispatch_layout": lambda: victim.get_dispatch_layout(topk_idx, E),
        "dispatch": lambda: victim.dispatch(x, handle=handle),
        "combine": lambda: victim.combine(torch.zeros(2 * T, H, dtype=torch.bfloat16, device=ctx.device), handle),
        "internode_dispatch": lambda: victim.internode_dispatch(x, handle=handle, config=Buffer.get_dispatch_config(2)),
        "internode_combine": lambda: victim.internode_combine(torch.zeros(2 * T, H, dtype=torch.bfloat16,
                                                                          device=ctx.device), handle,
                                                              config=Buffer.get_combine_config(2)),
        "clean_low_latency_buffer": lambda: victim.clean_low_latency_buffer(N, H, E),
        "low_latency_dispatch": lambda: victim.low_latency_dispatch(x, topk_idx, N, E),
        "low_latency_combine": lambda: victim.low_latency_combine(
            torch.zeros(E // 2, 2 * N, H, dtype=torch.bfloat16, device=ctx.device), topk_idx, topk_weights, ll_handle),
        "get_next_low_latency_combine_buffer": lambda: victim.get_next_low_latency_combine_buffer(ll_handle),
        "get_local_buffer_tensor": lambda: victim.get_local_buffer_tensor(torch.uint8),
        "get_comm_stream": lambda: victim.get_comm_stream(),
        "low_latency_update_mask_buffer": lambda: victim.low_latency_update_mask_buffer(other, True),
        "low_latency_query_mask_buffer": lambda: victim.low_latency_query_mask_buffer(
            torch.zeros(2, dtype=torch.int32, device=ctx.device)),
        "low_latency_clean_mask_buffer": lambda: victim.low_latency_clean_mask_buffer(),
        "destroy (twice)": lambda: victim.destroy(),
        "a receive hook still pending at destroy()": pending_hook,
    }
    for what, call in calls.items():
        c.expect("destroy_then_api_raises_runtime_error", RuntimeError, call, label=what)
    with c.check("destroy_then_api_raises_runtime_error"):
        tiny_dispatch(ctx, buf)       # none of the refused calls started a collective

    with c.check("new_buffer_after_destroy"):
        again = Buffer(group, nvl, rdma, low_latency_mode=True, num_qps_per_rank=E // 2, explicitly_destroy=True)
        tiny_dispatch(ctx, again)
        tiny_low_latency(ctx, again)
        again.destroy()
        again = Buffer(group, nvl, 0, explicitly_destroy=True)
        tiny_dispatch(ctx, again)
        again.destroy()

    with c.check("leak_warning"):   # spec 2.2: a Buffer with explicitly_destroy=True dropped without destroy()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            leak = Buffer(group, nvl, 0, explicitly_destroy=True)
            tiny_dispatch(ctx, leak)
            del leak
            gc.collect()
        assert any(issubclass(w.category, RuntimeWarning) and "destroy()" in str(w.message) for w in caught), \
            [str(w.message) for w in caught]

    with c.check("dropped_buffer_is_freed_at_once"):
        # clients replace a Buffer by dropping it (no destroy()): its memory must go with the last reference,
        # not wait for Python's cycle collector, also after calls with receive hooks
        gc.disable()
        try:
            dropped = Buffer(group, nvl, rdma, low_latency_mode=True, num_qps_per_rank=E // 2)
            tiny_dispatch(ctx, dropped)
            x, topk_idx, topk_weights = routing(ctx)
            recv_x, _, handle, _, hook = dropped.low_latency_dispatch(x, topk_idx, N, E, use_fp8=False,
                                                                      return_recv_hook=True)
            hook()
            _, _, hook = dropped.low_latency_combine(recv_x, topk_idx, topk_weights, handle, return_recv_hook=True)
            hook()
            alive = weakref.ref(dropped)
            del dropped, recv_x, handle, hook
            assert alive() is None, "a dropped Buffer is only freed by the cycle collector"
            # a hook never called (every rank drops it) goes with its Buffer too
            unheard = Buffer(group, 0, rdma, low_latency_mode=True, num_qps_per_rank=E // 2)
            hook = unheard.low_latency_dispatch(x, topk_idx, N, E, use_fp8=False, return_recv_hook=True)[4]
            alive = weakref.ref(unheard)
            del unheard, hook
            assert alive() is None, "a Buffer dropped with a hook never called is only freed by the cycle collector"
        finally:
            gc.enable()

    with c.check("low_latency_combine_of_fewer_tokens"):   # spec 9.4: the combine's T defines the output rows
        short = Buffer(group, 0, rdma, low_latency_mode=True, num_qps_per_rank=E // 2)
        x = (100 * ctx.rank + torch.arange(T, dtype=torch.float32)).view(T, 1).expand(T, H)
        x = x.to(torch.bfloat16).contiguous().to(ctx.device)
        topk_idx = torch.tensor([[1, -1], [3, -1], [0, -1], [2, -1]], dtype=torch.int64, device=ctx.device)
        ones = torch.ones((T, K), dtype=torch.float32, device=ctx.device)
        recv_x, _, handle, _, _ = short.low_latency_dispatch(x, topk_idx, N, E, use_fp8=False)
        combined, _, _ = short.low_latency_combine(recv_x, topk_idx[:2].contiguous(), ones[:2].contiguous(), handle)
        assert torch.equal(combined.cpu().float(), x[:2].cpu().float()), combined[:, 0].tolist()

    # spec 2.1: construction is collective; ranks passing different sizes or modes are told so on every rank
    c.expect("construction_arguments_agree", ValueError,
             lambda: Buffer(group, nvl + 128 * ctx.rank, 0), "num_nvl_bytes")
    c.expect("construction_arguments_agree", ValueError,
             lambda: Buffer(group, 0, rdma, low_latency_mode=True, num_qps_per_rank=E // 2,
                            enable_shrink=ctx.rank == 1), "enable_shrink")
    c.expect("construction_arguments_agree", ValueError,   # (one rank detects the layout, the other is told it)
             lambda: Buffer(group, nvl, 0, num_ranks_per_node=2 if ctx.rank == 0 else None), "num_ranks_per_node")
    with c.check("construction_arguments_agree"):
        tiny_dispatch(ctx, buf)   # the group is still in step

    with c.check("num_worst_tokens_per_rank"):   # each rank sizes its own receive rows
        x, topk_idx, topk_weights = routing(ctx)
        layout = buf.get_dispatch_layout(topk_idx, E)
        worst = 2 * T + 3 * ctx.rank
        recv_x, recv_idx, _, counts, _, _ = buf.dispatch(
            x, num_tokens_per_rank=layout[0], num_tokens_per_rdma_rank=layout[1], is_token_in_rank=layout[3],
            num_tokens_per_expert=layout[2], topk_idx=topk_idx, topk_weights=topk_weights, num_worst_tokens=worst)
        assert recv_x.shape[0] == worst and counts == [], (tuple(recv_x.shape), counts)
        assert bool((recv_idx[2 * T:] == -1).all())

    # an mpi4py communicator instead of a group (TensorRT-LLM): only the NVLink transport can serve it; on the
    # reference transport the constructor says so (every later call would fail)
    if ctx.device.type == "cuda":
        with c.check("comm_without_group"):
            over_comm = Buffer(None, nvl, 0, comm=_CommOver(group), explicitly_destroy=True)
            assert over_comm.transport_name == "nvlink", over_comm.transport_name
            tiny_dispatch(ctx, over_comm)
            over_comm.destroy()
    else:
        c.expect("comm_without_group", ValueError, lambda: Buffer(None, nvl, 0, comm=_CommOver(group)), "comm")
    with c.check("comm_without_group"):
        tiny_dispatch(ctx, buf)

    # vLLM passes its CPU (gloo) group, and its tests a "cpu:gloo,cuda:nccl" one (ranks with a GPU each)
    with c.check("groups_of_other_backends"):
        backends = ["gloo"] + (["cpu:gloo,cuda:nccl"] if torch.distributed.get_backend(group) == "nccl" else [])
        for backend in backends:
            other_group = torch.distributed.new_group(backend=backend)
            over = Buffer(other_group, nvl, rdma, low_latency_mode=True, num_qps_per_rank=E // 2,
                          explicitly_destroy=True)
            assert ctx.device.type != "cuda" or over.transport_name == "nvlink", (backend, over.transport_name)
            tiny_dispatch(ctx, over)
            tiny_low_latency(ctx, over)
            over.destroy()

    with c.check("fp8_scales_of_any_count"):   # spec 5.1: S is arbitrary (here one scale per 32 channels and more)
        x, topk_idx, topk_weights = routing(ctx)
        data = x.to(torch.float8_e4m3fn)
        scales = (torch.arange(T * 224, dtype=torch.float32, device=ctx.device).view(T, 224) + 1000 * ctx.rank)
        layout = buf.get_dispatch_layout(topk_idx, E)
        (recv_data, recv_scales), _, _, _, _, _ = buf.dispatch(
            (data, scales), num_tokens_per_rank=layout[0], num_tokens_per_rdma_rank=layout[1],
            is_token_in_rank=layout[3], num_tokens_per_expert=layout[2], topk_idx=topk_idx, topk_weights=topk_weights)
        assert tuple(recv_scales.shape) == (2 * T, 224), tuple(recv_scales.shape)
        expected = torch.cat([torch.arange(T * 224, dtype=torch.float32).view(T, 224) + 1000 * r for r in range(2)])
        assert torch.equal(recv_scales.cpu(), expected)

    with c.check("combine_before_receive_hook"):   # spec 9.6: the rows arrive when the hook runs
        early = Buffer(group, 0, rdma, low_latency_mode=True, num_qps_per_rank=E // 2)
        x, topk_idx, topk_weights = routing(ctx)
        recv_x, _, handle, _, hook = early.low_latency_dispatch(x, topk_idx, N, E, use_fp8=False, return_recv_hook=True)
    c.expect("combine_before_receive_hook", ValueError,
             lambda: early.low_latency_combine(recv_x, topk_idx, topk_weights, handle), "handle")
    with c.check("combine_before_receive_hook"):   # refused on both ranks before any exchange: still in step
        hook()
        combined, _, _ = early.low_latency_combine(recv_x, topk_idx, topk_weights, handle)
        assert torch.equal(combined.cpu().float(), x.cpu().float())

    # -- shrink-mode mask API (local) -------------------------------------------------------------------
    with c.check("mask_api"):
        shrink = Buffer(group, 0, rdma, low_latency_mode=True, num_qps_per_rank=E // 2, enable_shrink=True)
        status = torch.full((2,), 7, dtype=torch.int32, device=ctx.device)
        shrink.low_latency_query_mask_buffer(status)
        assert status.tolist() == [0, 0]
        shrink.low_latency_update_mask_buffer(other, True)
        shrink.low_latency_query_mask_buffer(status)
        assert status.tolist() == [1 if r == other else 0 for r in range(2)]
        strided = torch.full((2, 2), 7, dtype=torch.int32, device=ctx.device)[:, 1]   # (any layout)
        shrink.low_latency_query_mask_buffer(strided)
        assert strided.tolist() == [1 if r == other else 0 for r in range(2)]
        shrink.low_latency_update_mask_buffer(other)            # mask=False by default
        shrink.low_latency_query_mask_buffer(status)
        assert status.tolist() == [0, 0]
        shrink.low_latency_update_mask_buffer(rank_to_mask=other, mask=True)
        shrink.low_latency_clean_mask_buffer()
        shrink.low_latency_query_mask_buffer(status)
        assert status.tolist() == [0, 0]
        tiny_low_latency(ctx, shrink)

    return c.results


@pytest.fixture(scope="module")
def api_results():
    from dist_utils import get_pool
    per_rank = get_pool(2).run(run_api_checks, timeout=180)
    merged: Dict[str, List[str]] = {}
    for results in per_rank:
        for name, failures in results.items():
            merged.setdefault(name, []).extend(failures)
    return merged


API_CHECKS = ["constructor_errors_local", "positional_construction_and_attributes", "object_exchange",
              "keyword_construction_and_attributes", "weakref_and_isinstance", "helpers_on_instance",
              "set_num_sms_on_instance", "events_of_calls", "get_comm_stream", "get_local_buffer_tensor",
              "get_local_buffer_tensor_too_big", "num_qps_per_rank_0_without_low_latency",
              "num_qps_per_rank_0_in_low_latency_mode", "low_latency_area_of_the_layout_total",
              "low_latency_area_below_the_layout_total", "several_buffers", "destroy_requires_flag",
              "destroy_then_api_raises_runtime_error", "new_buffer_after_destroy", "leak_warning",
              "dropped_buffer_is_freed_at_once",
              "low_latency_combine_of_fewer_tokens", "construction_arguments_agree", "num_worst_tokens_per_rank",
              "comm_without_group", "groups_of_other_backends",
              "fp8_scales_of_any_count", "combine_before_receive_hook", "mask_api"]


@pytest.mark.parametrize("check", API_CHECKS)
def test_buffer_on_two_ranks(api_results, check):
    assert check in api_results, f"check {check} did not run"
    failures = api_results[check]
    assert not failures, f"{check}: {len(failures)} failure(s):\n" + "\n".join(failures)


def _start_call(slots, name: str, hook) -> int:
    """What a low-latency call does with the halves: the next free one, taken once sent, held by its hook."""
    half = slots.next_free(name)
    slots.take(half)
    slots.hold(half, hook)
    return half


def test_clean_or_destroy_refused_while_a_hook_runs():
    """A hook running on another thread holds its buffer half: reset (clean_low_latency_buffer, destroy)
    waits for nobody and is refused, discarding nothing (the other half's un-run hook still works); once the
    hook has finished it goes ahead."""
    import threading
    from deep_ep.low_latency import LowLatencySlots, ReceiveHook
    slots, started, release = LowLatencySlots(), threading.Event(), threading.Event()

    def receive() -> None:
        started.set()
        release.wait(timeout=30)

    ran = []
    waiting = ReceiveHook(lambda: ran.append("waiting"), "low_latency_dispatch")
    _start_call(slots, "low_latency_dispatch", waiting)
    hook = ReceiveHook(receive, "low_latency_combine")
    _start_call(slots, "low_latency_combine", hook)
    worker = threading.Thread(target=hook)
    worker.start()
    assert started.wait(timeout=30)
    with pytest.raises(RuntimeError, match="destroy.*low_latency_combine is still running .*on another thread"):
        slots.reset("destroy()")
    waiting()
    assert ran == ["waiting"]
    release.set()
    worker.join(timeout=30)
    slots.reset("destroy()")
    other = ReceiveHook(lambda: None, "low_latency_combine")
    _start_call(slots, "low_latency_combine", other)
    slots.reset("destroy()")
    with pytest.raises(RuntimeError, match="discarded by destroy"):
        other()


def test_third_call_before_a_hook_is_refused_until_the_hook_runs_or_is_discarded():
    """Two low-latency results may be pending; the third call is refused with the two ways out, and
    goes ahead once the hook two calls before has run, or after a reset discarded it. A call refused before it
    sent (next_free without take) leaves the halves as they were."""
    from deep_ep.low_latency import LowLatencySlots, ReceiveHook
    slots = LowLatencySlots()
    ran = []
    first = ReceiveHook(lambda: ran.append("first"), "low_latency_dispatch")
    assert _start_call(slots, "low_latency_dispatch", first) == 0
    assert slots.next_free("low_latency_combine") == 1 and slots.next_free("low_latency_combine") == 1
    _start_call(slots, "low_latency_combine", ReceiveHook(lambda: None, "low_latency_combine"))
    with pytest.raises(RuntimeError, match=r"low_latency_dispatch: .*the receive hook of low_latency_dispatch has "
                                           r"not been called; call it first .*clean_low_latency_buffer"):
        slots.next_free("low_latency_dispatch")
    first()
    assert ran == ["first"] and slots.next_free("low_latency_dispatch") == 0
    _start_call(slots, "low_latency_dispatch", ReceiveHook(lambda: None, "low_latency_dispatch"))
    with pytest.raises(RuntimeError, match="call it first"):
        slots.check_next("low_latency_combine")   # (the combine's hook, two calls before, has not run)
    slots.reset("clean_low_latency_buffer")
    assert slots.next_free("low_latency_dispatch") == 0


# ---------------------------------------------------------------------------------------------------
# CUDA graph capture: calls that would wait on the host are refused with a RuntimeError saying why
# ---------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _capturing_graph(ctx):
    """A CUDA graph capture on the caller's stream; on CPU, the Buffer is told that one is under way."""
    if ctx.device.type == "cuda":
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            yield
        return
    import deep_ep.buffer as buffer_module
    real = buffer_module.capturing
    buffer_module.capturing = lambda device: True
    try:
        yield
    finally:
        buffer_module.capturing = real


def run_capture_refusals(ctx, transport: str) -> Dict[str, str]:
    """Each call that waits on the host, inside a capture: its error message ("no error" if none). After the
    refusals the Buffer still works (nothing was queued or exchanged). The reference transport waits on the host
    in every call; the NVLink one only in a non-cached dispatch without num_worst_tokens, a change of num_sms,
    clean_low_latency_buffer and destroy. On an NCCL group the reference transport's low-latency dispatch is
    captured too (its receive hook and combine of an earlier call are refused)."""
    n, hidden, experts = 8, 256, 4
    buf = Buffer(ctx.group, 1 << 24, Buffer.get_low_latency_rdma_size_hint(n, hidden, 2, experts),
                 low_latency_mode=True, num_qps_per_rank=2, transport=transport, explicitly_destroy=True,
                 timeout_s=30)
    g = torch.Generator().manual_seed(1000 + ctx.rank)
    x = torch.randn((n, hidden), generator=g).to(torch.bfloat16).to(ctx.device)
    idx = torch.randint(0, experts, (n, 2), generator=g).to(ctx.device)
    weights = torch.rand((n, 2), generator=g).to(ctx.device)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  topk_idx=idx, topk_weights=weights)
    config = Config(8, 4, 64)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, config=config, **layout)
    before = buf.combine(recv_x, handle, config=config)[0]
    ll_x, _, ll_handle, _, _ = buf.low_latency_dispatch(x, idx, n, experts, use_fp8=False)
    hook = buf.low_latency_dispatch(x, idx, n, experts, use_fp8=False, return_recv_hook=True)[4]
    # normal mode without a ring buffer: the NVLink transport hands it to the reference transport
    no_rings = Buffer(ctx.group, 0, Buffer.get_low_latency_rdma_size_hint(n, hidden, 2, experts),
                      low_latency_mode=True, num_qps_per_rank=2, transport=transport, explicitly_destroy=True,
                      timeout_s=30)
    calls = {
        "dispatch": lambda: buf.dispatch(x, config=config, **layout),
        "dispatch with num_worst_tokens": lambda: buf.dispatch(x, num_worst_tokens=2 * n, config=config, **layout),
        "dispatch with num_worst_tokens, other num_sms": lambda: buf.dispatch(x, num_worst_tokens=2 * n,
                                                                               config=Config(4, 4, 64), **layout),
        "get_dispatch_layout": lambda: buf.get_dispatch_layout(idx, experts),
        "combine": lambda: buf.combine(recv_x, handle, config=config),
        "low_latency_dispatch": lambda: buf.low_latency_dispatch(x, idx, n, experts, use_fp8=False),
        "low_latency_combine": lambda: buf.low_latency_combine(ll_x, idx, weights, ll_handle),
        "receive hook": hook,
        "get_dispatch_layout without a ring buffer": lambda: no_rings.get_dispatch_layout(idx, experts),
        "clean_low_latency_buffer": lambda: buf.clean_low_latency_buffer(n, hidden, experts),
        "destroy": buf.destroy,
    }
    if ctx.device.type == "cuda":
        calls["Buffer"] = lambda: Buffer(ctx.group, 1 << 24, 0, transport=transport)
    captured = []   # these would be captured: leave them out
    if transport == "nvlink":
        captured = ["dispatch with num_worst_tokens", "get_dispatch_layout", "combine", "low_latency_dispatch",
                    "low_latency_combine", "receive hook"]
    elif buf._transport.low_latency_graph_capturable:   # (on an NCCL group: a fixed-size exchange)
        captured = ["low_latency_dispatch"]
    for name in captured:
        del calls[name]
    out: Dict[str, str] = {}
    for name, call in calls.items():
        try:
            with _capturing_graph(ctx):
                call()
            out[name] = "no error"
        except RuntimeError as error:
            out[name] = str(error)
    hook()   # (refused above on the reference transport, the hook can still run)
    after = buf.combine(buf.dispatch(x, config=config, **layout)[0], handle, config=config)[0]
    out["combine after the refusals equals the one before"] = str(torch.equal(after, before))
    buf.destroy()
    no_rings.destroy()
    return out


# per refused call: (the operation the message names, a word of the reason), by transport
_REFUSALS = {
    "dispatch": ("dispatch", "num_worst_tokens"),
    "dispatch with num_worst_tokens": ("dispatch", "normal-mode"),
    "dispatch with num_worst_tokens, other num_sms": ("dispatch", "num_sms"),
    "get_dispatch_layout": ("get_dispatch_layout", "normal-mode"),
    "combine": ("combine", "normal-mode"),
    "low_latency_dispatch": ("low_latency_dispatch", "low-latency"),
    "low_latency_combine": ("low_latency_combine", "low-latency"),
    "receive hook": ("the receive hook of low_latency_dispatch", "low-latency"),
    "get_dispatch_layout without a ring buffer": ("get_dispatch_layout", "normal-mode"),
    "clean_low_latency_buffer": ("clean_low_latency_buffer", "waits"),
    "destroy": ("destroy", "waits"),
}


@pytest.mark.parametrize("transport", ["reference", pytest.param("nvlink", marks=pytest.mark.gpu)])
def test_calls_that_wait_on_the_host_are_refused_inside_a_graph_capture(pool, transport):
    for out in pool(2).run(run_capture_refusals, transport):
        assert out.pop("combine after the refusals equals the one before") == "True"
        if "Buffer" in out:
            assert "Buffer cannot be constructed inside a CUDA graph capture" in out.pop("Buffer")
        assert out, "no call was tried"
        for name, message in out.items():
            operation, reason = _REFUSALS[name]
            if transport == "reference" and name.startswith("dispatch"):
                reason = "normal-mode"   # (refused as every call of the transport is)
            assert f"{operation} cannot run inside a CUDA graph capture" in message and reason in message, \
                f"{name}: {message}"


@pytest.mark.parametrize("variable, value, expected", [
    ("DEEP_EP_NVLINK_STAGE_TOKENS", "-1", "must be in [0, 1073741824], got -1"),
    ("DEEP_EP_NVLINK_STAGE_TOKENS", "4e3", "must be an integer, got '4e3'"),
    ("DEEP_EP_NVLINK_STAGE_TOKENS", "1073741825", "must be in [0, 1073741824], got 1073741825"),
    ("DEEP_EP_NVLINK_STAGE_TOKENS", "", "must be an integer, got ''"),
    ("DEEP_EP_NVLINK_DIRECT", "false", "must be 0 (off) or 1 (on), got 'false'"),
    ("DEEP_EP_NVLINK_DIRECT", "2", "must be 0 (off) or 1 (on), got '2'"),
    ("DEEP_EP_NVLINK_DIRECT", "on", "must be 0 (off) or 1 (on), got 'on'"),
    ("DEEP_EP_LL_FUSED", "yes", "must be 0 (off) or 1 (on), got 'yes'"),
    ("DEEP_EP_LL_FUSED", "", "must be 0 (off) or 1 (on), got ''"),
    ("DEEP_EP_LL_FUSED", "-1", "must be 0 (off) or 1 (on), got '-1'"),
])
def test_a_bad_transport_setting_is_an_error_naming_the_variable(variable, value, expected):
    done = subprocess.run([sys.executable, "-c", "import deep_ep.transport.nvlink.low_latency"],
                          env=dict(os.environ, **{variable: value}), capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"ValueError: {variable} {expected}" in done.stderr, done.stderr[-2000:]
