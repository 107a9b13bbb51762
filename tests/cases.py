"""The cases of the multi-process tests, as frozen dataclasses built with keyword arguments, and the
normal-mode case tables (tests/test_normal.py runs them all; tests/test_nvlink.py some of them).

A case's name keys its random inputs (randomness.generator), so a name change draws other inputs."""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence


@dataclass(frozen=True, kw_only=True)
class CaseInputs:
    """What every rank's random inputs of a case are drawn from (its name keys them)."""
    name: str
    tokens: Sequence[int]              # tokens of each rank
    hidden: int
    topk: int
    experts_per_rank: int
    routing: str = "uniform"           # the routing style (inputs.make_routing)
    mask_frac: float = 0.0


@dataclass(frozen=True, kw_only=True)
class NormalCase(CaseInputs):
    """One normal-mode case: the inputs of every rank, and which calls are made and checked."""
    x: str = "bf16"                    # the payload kind (inputs.make_x)
    alignment: int = 1                 # expert_alignment
    num_sms: Optional[int] = None      # None: the library's default configs
    events: str = "sync"               # how the calls are ordered on the streams (normal_mode.stream_arguments)
    with_topk: bool = True             # dispatch with top-k ids and weights
    combine_weights: bool = True       # combine with top-k weights (where with_topk)
    worst: bool = False                # also dispatch with num_worst_tokens (and use its handle)
    cached: Sequence[str] = ()         # the payload kinds of the cached dispatches
    biases: Sequence[str] = ("none",)  # the combines' bias modes: "none", "one", "two", "by rank"
    repeat: bool = False               # repeat dispatch and combines: the same bits again
    async_finish: bool = False         # (test_autograd: its functions' async_finish)


ALL_BIASES = ["none", "one", "two", "by rank"]

CASES_1 = [   # one rank: every row stays here, through the same exchanges
    NormalCase(name="1r-bf16-worst-cached", tokens=[41], hidden=144, topk=3, experts_per_rank=5, mask_frac=0.2,
               num_sms=4, worst=True, cached=["fp8_col", "bf16"], biases=["none", "one"], repeat=True),
    NormalCase(name="1r-fp8-skewed-async", tokens=[17], hidden=256, topk=2, experts_per_rank=3, x="fp8",
               routing="skewed", alignment=4, num_sms=2, events="async", biases=["two"]),
]

CASES_2 = [
    NormalCase(name="2r-bf16-worst-cached-biases", tokens=[37, 64], hidden=128, topk=4, experts_per_rank=8, x="bf16",
               mask_frac=0.2, num_sms=8, worst=True, cached=["fp8_col", "bf16", "fp8_i32"], biases=ALL_BIASES,
               repeat=True),
    NormalCase(name="2r-zero-tokens-skewed-align128-h72", tokens=[0, 50], hidden=72, topk=2, experts_per_rank=4,
               routing="skewed", alignment=128, num_sms=2, events="async", biases=["two"]),
    NormalCase(name="2r-fp8-top32-worst-prevasync", tokens=[120, 7], hidden=256, topk=32, experts_per_rank=16,
               x="fp8", mask_frac=0.3, num_sms=24, worst=True, cached=["bf16", "fp8_i32_col"],
               events="prev_async_alloc", biases=["one"]),
    NormalCase(name="2r-1024-experts-per-rank-default-config", tokens=[20, 33], hidden=64, topk=8,
               experts_per_rank=1024, mask_frac=0.1, num_sms=None, events="prev", biases=["none"]),
    NormalCase(name="2r-no-topk-fp8i32col-h208", tokens=[45, 19], hidden=208, topk=3, experts_per_rank=4,
               x="fp8_i32_col", with_topk=False, num_sms=6, cached=["bf16"], biases=["none", "one"]),
    NormalCase(name="2r-duplicate-experts-h512", tokens=[30, 31], hidden=512, topk=3, experts_per_rank=2,
               routing="dup", mask_frac=0.1, num_sms=4, alignment=4, biases=["two"], repeat=True),
    NormalCase(name="2r-fewer-tokens-than-channels", tokens=[5, 3], hidden=96, topk=2, experts_per_rank=3, num_sms=24,
               worst=True, biases=["one"]),
    # slime's metadata dispatch: 32-byte rows (16 bf16), top-1, the sync layout's event passed on
    NormalCase(name="2r-32-byte-rows-top1", tokens=[10, 8], hidden=16, topk=1, experts_per_rank=4, events="chain",
               cached=["bf16"], repeat=True, biases=["none"]),
    NormalCase(name="2r-fp8-tma-aligned-scales", tokens=[13, 6], hidden=640, topk=4, experts_per_rank=4,
               x="fp8_i32_tma", mask_frac=0.1, num_sms=4, cached=["fp8_i32_tma"], events="chain_async_alloc",
               biases=["none"]),
]

CASES_3 = [
    NormalCase(name="3r-zero-tokens-worst-cached-biases", tokens=[50, 0, 77], hidden=192, topk=6, experts_per_rank=5,
               routing="skewed", mask_frac=0.15, num_sms=6, worst=True, cached=["fp8_col", "bf16"],
               biases=ALL_BIASES, events="async", repeat=True),
    NormalCase(name="3r-fp8col-align128-prevasync", tokens=[16, 90, 33], hidden=128, topk=8, experts_per_rank=4,
               x="fp8_col", mask_frac=0.25, alignment=128, num_sms=20, events="prev_async_alloc", biases=["two"]),
    NormalCase(name="3r-first-half-rank2-receives-nothing", tokens=[30, 12, 9], hidden=256, topk=3,
               experts_per_rank=4, routing="first_half", num_sms=4, worst=True, cached=["bf16"], biases=["two"]),
    NormalCase(name="3r-top32-h136", tokens=[11, 40, 25], hidden=136, topk=32, experts_per_rank=11, num_sms=2,
               events="prev", biases=["none"], cached=["bf16"]),
]

CASES_4 = [
    NormalCase(name="4r-200-tokens", tokens=[200, 150, 199, 60], hidden=64, topk=6, experts_per_rank=6,
               mask_frac=0.1, num_sms=12, biases=["two"], cached=["bf16"]),
    NormalCase(name="4r-bf16-worst-cached-biases", tokens=[40, 0, 100, 13], hidden=256, topk=8, experts_per_rank=4,
               mask_frac=0.2, num_sms=8, worst=True, cached=["fp8_i32_col", "bf16"], biases=ALL_BIASES,
               repeat=True),
    NormalCase(name="4r-skewed-top1-align128", tokens=[64, 64, 64, 1], hidden=80, topk=1, experts_per_rank=8,
               routing="skewed", alignment=128, num_sms=4, events="async", biases=["one"]),
    NormalCase(name="4r-fp8-top32-worst", tokens=[20, 30, 0, 10], hidden=384, topk=32, experts_per_rank=8, x="fp8",
               mask_frac=0.3, num_sms=10, worst=True, events="prev", cached=["fp8_col"], biases=["two"]),
    NormalCase(name="4r-no-topk-default-config", tokens=[9, 17, 3, 28], hidden=128, topk=2, experts_per_rank=2,
               with_topk=False, num_sms=None, events="prev_async_alloc", biases=["none"]),
]

# more ranks than the GPU machines lend GPUs (non-powers of two among them): ranks with nothing to send,
# FP8 and top-32 at 6 ranks; 8 ranks with uneven counts
CASES_6 = [
    NormalCase(name="6r-zero-tokens-fp8-worst-cached", tokens=[33, 0, 71, 5, 0, 128], hidden=256, topk=8,
               experts_per_rank=4, x="fp8", mask_frac=0.1, num_sms=12, worst=True, cached=["bf16", "fp8_col"],
               biases=["two"]),
    NormalCase(name="6r-top32-skewed-align128", tokens=[40, 41, 1, 0, 90, 12], hidden=136, topk=32,
               experts_per_rank=7, routing="skewed", alignment=128, num_sms=4, events="async", biases=["one"]),
]
CASES_8 = [
    NormalCase(name="8r-bf16-uneven-cached-biases", tokens=[64, 3, 0, 120, 17, 1, 80, 44], hidden=128, topk=8,
               experts_per_rank=4, mask_frac=0.2, num_sms=8, worst=True, cached=["fp8"], biases=ALL_BIASES,
               repeat=True),
    NormalCase(name="8r-fp8i32col-dup-prevasync", tokens=[10, 20, 30, 40, 0, 5, 15, 25], hidden=512, topk=3,
               experts_per_rank=2, x="fp8_i32_col", routing="dup", num_sms=24, events="prev_async_alloc",
               biases=["none"]),
]

# Edge cases where ranks receive nothing; they run last so that a failure (which stops a rank's remaining
# cases) hides nothing else.
EDGE_CASES = {
    2: [NormalCase(name="2r-no-tokens-anywhere", tokens=[0, 0], hidden=64, topk=2, experts_per_rank=2, num_sms=2,
                   worst=True, cached=["bf16"], biases=["two"])],
    3: [NormalCase(name="3r-everything-masked", tokens=[12, 0, 9], hidden=64, topk=3, experts_per_rank=2,
                   mask_frac=1.0, num_sms=4, worst=True, cached=["bf16"], biases=["none", "two"])],
    4: [NormalCase(name="4r-no-tokens-anywhere", tokens=[0, 0, 0, 0], hidden=128, topk=2, experts_per_rank=2,
                   num_sms=4, worst=True, cached=["fp8_col"], biases=["one"])],
}

CASES_2X2 = [
    NormalCase(name="2x2-bf16-worst-cached-biases", tokens=[40, 0, 65, 23], hidden=256, topk=8, experts_per_rank=4,
               mask_frac=0.2, num_sms=8, worst=True, cached=["fp8_col", "bf16"], biases=ALL_BIASES, repeat=True),
    NormalCase(name="2x2-fp8i32-skewed-align128", tokens=[10, 70, 5, 0], hidden=512, topk=4, experts_per_rank=16,
               x="fp8_i32", routing="skewed", alignment=128, num_sms=4, events="async", cached=["bf16"],
               biases=["two"]),
    NormalCase(name="2x2-no-topk", tokens=[33, 12, 0, 48], hidden=256, topk=2, experts_per_rank=2, with_topk=False,
               num_sms=2, events="prev_async_alloc", cached=["fp8_col"], biases=["one"]),
    NormalCase(name="2x2-top32-fp8col-worst-manychannels", tokens=[25, 19, 31, 4], hidden=256, topk=32,
               experts_per_rank=8, x="fp8_col", mask_frac=0.3, num_sms=24, worst=True, events="prev",
               biases=["none", "two"]),
]


def random_normal_cases(seed: int, world_size: int, count: int, internode: bool = False) -> List[NormalCase]:
    """`count` cases with every parameter drawn from the seed (fresh each run); each is named after them all."""
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
        drawn: Dict[str, Any] = dict(
            tokens=tokens, hidden=hidden, topk=rng.randint(1, min(32, num_experts)), experts_per_rank=experts_per_rank,
            x=x, routing=rng.choice(["uniform", "skewed", "dup"]), mask_frac=rng.choice([0.0, 0.1, 0.5, 1.0]),
            alignment=rng.choice([1, 2, 128]),
            num_sms=rng.choice([None, 2, 4, 6, 8, 12, 20, 24]) if not internode else rng.choice([2, 4, 8, 24]),
            events=rng.choice(["sync", "async", "prev", "prev_async_alloc"]), with_topk=with_topk,
            worst=with_topk and rng.random() < 0.5, cached=cached, biases=rng.sample(ALL_BIASES, rng.randint(1, 3)),
            repeat=rng.random() < 0.3)
        name = f"random{i}:" + ",".join(f"{k}={v}" for k, v in drawn.items())
        cases.append(NormalCase(name=name, **drawn))
    return cases


@dataclass(frozen=True, kw_only=True)
class LowLatencyCase(CaseInputs):
    """Low-latency inputs, the buffer's token bound and the rounds run on them (test_low_latency.round_options)."""
    num_max_tokens: int                # num_max_dispatch_tokens_per_rank
    rounds: Sequence[int]
    forced_options: Dict[str, Any] = field(default_factory=dict)   # RoundOptions fields every round sets so


@dataclass(frozen=True, kw_only=True)
class RoundOptions:
    """How one low-latency dispatch + combine round calls the library."""
    fp8: bool = False
    round_scale: bool = False
    ue8m0: bool = False
    dispatch_mode: str = "sync"        # "sync", "async" (async_finish) or "hook" (return_recv_hook)
    combine_kind: str = "plain"        # "plain", "out" (out=), "zero_copy" or "logfmt"
    combine_mode: str = "sync"
    stats: bool = False                # pass the receive and wait statistics tensors
    drop: bool = False                 # the combine drops some of the dispatch's top-k entries


@dataclass(frozen=True, kw_only=True)
class ReferenceShape:
    """A normal-mode shape that tests/test_nvlink.py runs on the NVLink and the reference transport."""
    name: str
    tokens: Sequence[int]              # tokens of each rank
    hidden: int
    topk: int
    experts: int
    num_sms: Optional[int] = None      # the comparison's Config (every shape it runs sets it)
    ring_tokens: int = 256             # Config's num_max_nvl_chunked_recv_tokens
    routing: str = "uniform"
    mask_frac: float = 0.0
    alignment: int = 1
    with_topk: bool = True


@dataclass(frozen=True, kw_only=True)
class LowLatencyShape:
    """A low-latency shape that tests/test_nvlink_low_latency.py runs on the NVLink and the reference transport."""
    name: str
    tokens: Sequence[int]              # tokens of the first ranks, repeated over more (rank 3 has none)
    num_max_tokens: int                # num_max_dispatch_tokens_per_rank
    hidden: int
    topk: int
    experts: int
    fp8: bool = False
    round_scale: bool = False
    ue8m0: bool = False
    routing: str = "uniform"
    mask_frac: float = 0.0
