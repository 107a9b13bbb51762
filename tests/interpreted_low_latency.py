"""The NVLink low-latency kernels under Triton's CPU interpreter (run by test_nvlink_interpreted.py with
TRITON_INTERPRET=1 set): R ranks in one process, each with its own area on the CPU and every area's address
in the peer table, as CUDA IPC maps them on GPUs. Every rank's send kernel runs before any receive kernel
(the interpreter runs one program after another, so a receive cannot wait for a send still to come); the
outputs are compared with the independent model, bit for bit. Prints "ok", or the mismatches."""
import sys
from types import SimpleNamespace
from typing import List

import torch

import model_low_latency as M
from interpreter_fix import keep_splatted_booleans_boolean
from randomness import base_seed, generator
from deep_ep.config import low_latency_size_hint
from deep_ep.group import Topology
from deep_ep.transport.base import LowLatencyOptions
from deep_ep.transport.nvlink import low_latency as ll
from deep_ep.transport.nvlink import status, sync
from deep_ep.transport.nvlink.low_latency import NVLinkLowLatency


MODES = [LowLatencyOptions(use_fp8=False, round_scale=False, use_ue8m0=False),
         LowLatencyOptions(use_fp8=True, round_scale=False, use_ue8m0=False),
         LowLatencyOptions(use_fp8=True, round_scale=True, use_ue8m0=False),
         LowLatencyOptions(use_fp8=True, round_scale=True, use_ue8m0=True)]


def make_ranks(R: int, N: int, H: int, E: int, automatic: bool = False) -> List[NVLinkLowLatency]:
    areas = [torch.zeros(low_latency_size_hint(N, H, R, E), dtype=torch.uint8) for _ in range(R)]
    peers = SimpleNamespace(bases=torch.tensor([a.data_ptr() for a in areas], dtype=torch.int64), close=lambda: None)
    timeout_ns = 200_000_000 if automatic else 10 ** 10
    return [NVLinkLowLatency(Topology(r, R, R), areas[r], peers, torch.zeros(4 + R, dtype=torch.int32), timeout_ns, 1,
                             auto_mask=automatic) for r in range(R)]


def make_sources(gen: torch.Generator, R: int, N: int, H: int, K: int, E: int) -> List[M.Source]:
    sources = []
    for r in range(R):
        T = [N, 1, 0, N - 3][r % 4]   # a full rank, a single token, an empty rank, an uneven one
        idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
        idx[torch.rand(T, K, generator=gen) < 0.2] = -1
        x = (torch.randn(T, H, generator=gen) * 2.0 ** torch.randint(-8, 8, (T, 1), generator=gen)).to(torch.bfloat16)
        sources.append(M.Source(x, idx, torch.rand(T, K, generator=gen)))
    return sources


def check(errors: List[str], what: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    if got.shape != expected.shape or not torch.equal(got.view(torch.uint8) if got.dtype == torch.bfloat16 else got,
                                                      expected.view(torch.uint8)
                                                      if expected.dtype == torch.bfloat16 else expected):
        errors.append(f"{what}: got {got.flatten()[:8].tolist()}..., expected {expected.flatten()[:8].tolist()}...")


def dispatch_all(ranks: List[NVLinkLowLatency], sources: List[M.Source], calling: List[int], N: int, E: int,
                 options: LowLatencyOptions, masks: List) -> dict:
    """Every calling rank's send (on buffer half 0, with a hook), then every receive: rank -> dispatch output."""
    outs, steps = {}, []
    for r in calling:
        outs[r], step = ranks[r].dispatch(sources[r].x, sources[r].topk_idx, N, E, options, masks[r], None, 0, True)
        steps.append(step)
    for step in steps:
        step()
    return outs


def run(R: int, N: int, H: int, K: int, E: int, rounds: int, masked: int, absent: bool = False,
        automatic: bool = False, seed: int = 0) -> List[str]:
    """`rounds` dispatch + combine rounds. Rank `masked` (if >= 0) is cut off in the last round: the others
    mask it, it masks everyone (as after a failure); with `absent` it makes no call at all in any round. With
    `automatic` (and `absent`) nobody masks it: the others' shrink masks start empty, and their kernels mask it
    when their waits for it time out (after 0.2 s)."""
    errors: List[str] = []
    gen = generator(seed, "interpreted low-latency", R, K, absent, automatic)
    ranks = make_ranks(R, N, H, E, automatic)
    e_loc = E // R
    shrink = [torch.zeros(R, dtype=torch.int32) for _ in range(R)]   # (automatic: every rank's shrink mask)
    for i in range(rounds):
        options = MODES[i % len(MODES)]
        sources = make_sources(gen, R, N, H, K, E)
        cut = masked >= 0 and (absent or i == rounds - 1)
        masks = [[int(g == masked or r == masked) for g in range(R)] for r in range(R)] if cut else None
        if automatic:
            mask_tensors = shrink
        else:
            mask_tensors = [torch.tensor(m, dtype=torch.int32) for m in masks] if cut else [None] * R
        calling = [r for r in range(R) if not (absent and r == masked)]
        hook = i % 2 == 0   # with a hook the combine sends every row; without, the own rows stay in x
        outs = dispatch_all(ranks, sources, calling, N, E, options, mask_tensors)
        regions = [M.dispatch_region(sources, g, E, masks) for g in range(R)]
        for g in calling:
            out, reg = outs[g], regions[g]
            name = f"R={R} K={K} round {i} rank {g}"
            check(errors, f"{name} recv_count", out.recv_count, reg.count)
            live = reg.block_count > 0
            check(errors, f"{name} layout_range counts", out.layout_range & 0xFFFFFFFF, reg.block_count)
            check(errors, f"{name} layout_range begins", (out.layout_range >> 32)[live], reg.block_begin[live])
            if options.use_fp8:
                expected = reg.payload_fp8(sources, options.round_scale)
                check(errors, f"{name} FP8 rows", out.recv_x[reg.expert, reg.row].view(torch.uint8), expected.data)
                scales = expected.ue8m0_words().to(torch.int32) if options.use_ue8m0 else expected.scale_inv
                check(errors, f"{name} FP8 scales", out.recv_scales[reg.expert, reg.row], scales)
            else:
                check(errors, f"{name} rows", out.recv_x[reg.expert, reg.row], reg.payload_bf16(sources))
            check(errors, f"{name} src_info", out.src_info[reg.expert, reg.row], reg.src_info)
            past = torch.arange(R * N)[None, :] >= reg.count[:, None]
            check(errors, f"{name} src_info past the count", out.src_info[past], torch.full((int(past.sum()),), -1,
                                                                                           dtype=torch.int32))
        rows = M.selection_rows(sources, regions)
        expert_outputs = [torch.randn(e_loc, R * N, H, generator=gen).to(torch.bfloat16) for _ in range(R)]
        combined = [torch.full((src.x.shape[0], H), float("nan"), dtype=torch.bfloat16) for src in sources]
        steps = [ranks[r].combine(expert_outputs[r], sources[r].topk_idx, sources[r].topk_weights, outs[r].src_info,
                                  outs[r].layout_range, N, False, mask_tensors[r], combined[r], None, 1, hook)
                 for r in calling]
        for step in steps:
            step()
        for s in calling:
            src = sources[s]
            expected = M.combine(s, src.topk_idx, src.topk_weights, rows[s], expert_outputs, e_loc, masks)
            check(errors, f"R={R} K={K} round {i} rank {s} combine (hook={hook})", combined[s], expected)
    for r in calling:   # every call's receive programs added shares summing to one unit (dispatch: half 0)
        for half in (0, 1):
            received = ranks[r]._counters(ranks[r].half_geometry(N, H, E, half))[1]
            check(errors, f"R={R} rank {r}: RECEIVED of half {half}", received,
                  torch.tensor([rounds * sync.RECEIVED_UNIT.value], dtype=torch.int64))
    if automatic:
        gone = torch.tensor([int(g == masked) for g in range(R)], dtype=torch.int32)
        for r in calling:
            check(errors, f"R={R} rank {r}: shrink mask after the timeouts", shrink[r], gone)
            # (the first wait that gave up on it: the dispatch's receive)
            check(errors, f"R={R} rank {r}: status names the masked rank", ranks[r].status[4:],
                  gone * status.WAIT_LL_DISPATCH.value)
    return errors


def run_unwritten_route(seed: int = 0) -> List[str]:
    """A combine whose route holds entries the dispatch did not write (negative ones here) stores no row for
    them: nothing in the peers' areas changes but the combine half's counters and ROWS."""
    R, N, H, K, E = 2, 8, 256, 4, 8
    gen = generator(seed, "interpreted low-latency, unwritten route")
    ranks = make_ranks(R, N, H, E)
    sources = make_sources(gen, R, N, H, K, E)
    outs = dispatch_all(ranks, sources, list(range(R)), N, E, MODES[0], [None] * R)
    full = int(outs[0].recv_count.argmax())   # an expert of rank 0 with rows: their route entries go negative
    route = ranks[0].routes.get(outs[0].src_info)[0]
    route[full * R * N:full * R * N + int(outs[0].recv_count[full])] = -5
    geometry = ranks[0].half_geometry(N, H, E, 1)
    kept = torch.ones(ranks[0].area.numel(), dtype=torch.bool)   # bytes the combine must leave alone
    kept[geometry.signal:geometry.signal + geometry.counter_bytes] = False
    kept[geometry.data:geometry.data + N * K * H * 2] = False
    before = [rank.area[kept].clone() for rank in ranks]
    expert_outputs = [torch.randn(E // R, R * N, H, generator=gen).to(torch.bfloat16) for _ in range(R)]
    steps = [ranks[r].combine(expert_outputs[r], sources[r].topk_idx, sources[r].topk_weights, outs[r].src_info,
                              outs[r].layout_range, N, False, None,
                              torch.empty(sources[r].x.shape[0], H, dtype=torch.bfloat16), None, 1, True)
             for r in range(R)]
    for step in steps:
        step()
    errors: List[str] = []
    for r in range(R):
        check(errors, f"unwritten route: rank {r}'s area outside the counters and ROWS", ranks[r].area[kept],
              before[r])
    return errors


def run_too_many_rows(seed: int = 0) -> List[str]:
    """Tokens that list one expert in every slot send it more rows than its R * N: the receive writes its first
    R * N rows (source 0's first token first), counts only those (recv_count, layout_range), and reports the
    expert in the status words for the host's error. The combine that follows reads no row past those: the
    expert is rank 0's last local one, and its expert output is followed in memory by rows of NaN, which would
    reach rank 0's second token if the combine read past the rows written."""
    R, N, H, K, E = 2, 2, 256, 4, 4
    gen = generator(seed, "interpreted low-latency, too many rows")
    ranks = make_ranks(R, N, H, E)
    e_loc = E // R
    idx = torch.full((N, K), e_loc - 1)   # every slot of every token: rank 0's last expert
    sources = [M.Source(torch.randn(N, H, generator=gen).to(torch.bfloat16), idx, torch.rand(N, K, generator=gen))
               for _ in range(R)]
    outs = dispatch_all(ranks, sources, list(range(R)), N, E, MODES[0], [None] * R)
    errors: List[str] = []
    out = outs[0]
    check(errors, "too many rows: recv_count", out.recv_count, torch.tensor([0, R * N], dtype=torch.int32))
    check(errors, "too many rows: layout_range", out.layout_range[e_loc - 1],
          torch.tensor([R * N, R * N << 32], dtype=torch.int64))
    check(errors, "too many rows: status (code, local expert)", ranks[0].status[2:4],
          torch.tensor([status.TOO_MANY_ROWS.value, e_loc - 1], dtype=torch.int32))
    check(errors, "too many rows: src_info of the rows written", out.src_info[e_loc - 1],
          torch.zeros(R * N, dtype=torch.int32))
    check(errors, "too many rows: rows written", out.recv_x[e_loc - 1], sources[0].x[0].expand(R * N, H))
    check(errors, "too many rows: rank 1's status", ranks[1].status[2:4], torch.zeros(2, dtype=torch.int32))
    with_nan = torch.randn(R, e_loc + 1, R * N, H, generator=gen).to(torch.bfloat16)
    with_nan[:, e_loc:] = float("nan")
    combined = [torch.empty(N, H, dtype=torch.bfloat16) for _ in range(R)]
    steps = [ranks[r].combine(with_nan[r, :e_loc], idx, sources[r].topk_weights, outs[r].src_info,
                              outs[r].layout_range, N, False, None, combined[r], None, 1, True) for r in range(R)]
    for step in steps:
        step()
    rows = with_nan[0, e_loc - 1, :K].float()   # rank 0's token 0 got the R * N = K rows written, slot k: row k
    expected = torch.zeros(H)
    for k in range(K):
        expected = expected + sources[0].topk_weights[0, k] * rows[k]
    check(errors, "too many rows: combine of the token whose rows were written", combined[0][0],
          expected.to(torch.bfloat16))
    # the others' rows were never written: their slots hold what the area held (zeros), never NaN
    check(errors, "too many rows: combine of rank 0's other token", combined[0][1],
          torch.zeros(H, dtype=torch.bfloat16))
    check(errors, "too many rows: combine of rank 1's tokens", combined[1], torch.zeros(N, H, dtype=torch.bfloat16))
    return errors


def run_late_sender(seed: int = 0) -> List[str]:
    """Shrink mode, a rank masked while alive: rank 1 misses round 1 of ranks 0 and 2, whose waits for it time out
    and mask it; they go on to round 2. Rank 1 then makes its round-1 calls late, between round 2's combine sends
    and receives: its sends find ranks 0 and 2 ahead of it and must send them nothing (its round-1 combine would
    otherwise store rows over those of round 2, which the late round-1 routes do not know), and it masks them.
    Round 2 routes every slot of rank 0's tokens away from where round 1 sent them (round 1: all to rank 1's
    experts; round 2: ranks 0 and 2's), so a late row would land on slots that round 2 reads."""
    R, N, H, K, E = 3, 4, 256, 2, 6
    e_loc = E // R
    gen = generator(seed, "interpreted low-latency, late sender")
    ranks = make_ranks(R, N, H, E, automatic=True)
    shrink = [torch.zeros(R, dtype=torch.int32) for _ in range(R)]
    errors: List[str] = []

    def sources_to(owners_of_rank0: List[int]) -> List[M.Source]:
        sources = make_sources(gen, R, N, H, K, E)
        experts = torch.tensor([o * e_loc + i for o in owners_of_rank0 for i in range(e_loc)])
        picks = torch.stack([torch.randperm(len(experts), generator=gen)[:K] for _ in range(N)])
        sources[0] = M.Source(sources[0].x, experts[picks], sources[0].topk_weights)
        return sources

    def combine_sends(calling, sources, outs, expert_outputs, combined):
        return [ranks[r].combine(expert_outputs[r], sources[r].topk_idx, sources[r].topk_weights, outs[r].src_info,
                                 outs[r].layout_range, N, False, shrink[r], combined[r], None, 1, True)
                for r in calling]

    # round 0: everyone (no masks yet)
    sources = make_sources(gen, R, N, H, K, E)
    outs = dispatch_all(ranks, sources, [0, 1, 2], N, E, MODES[0], shrink)
    combined = [torch.empty(src.x.shape[0], H, dtype=torch.bfloat16) for src in sources]
    expert_outputs = [torch.randn(e_loc, R * N, H, generator=gen).to(torch.bfloat16) for _ in range(R)]
    for step in combine_sends([0, 1, 2], sources, outs, expert_outputs, combined):
        step()
    # round 1 of ranks 0 and 2 (their dispatch receives mask rank 1 after 0.2 s); rank 1 makes its calls later
    late_sources = sources_to([1])
    late_sources[1] = M.Source(torch.randn(N, H, generator=gen).to(torch.bfloat16),
                               torch.rand(N, E, generator=gen).topk(K, dim=1).indices, torch.rand(N, K, generator=gen))
    outs = dispatch_all(ranks, late_sources, [0, 2], N, E, MODES[0], shrink)
    late_outputs = [torch.randn(e_loc, R * N, H, generator=gen).to(torch.bfloat16) for _ in range(R)]
    for step in combine_sends([0, 2], late_sources, outs, late_outputs, combined):
        step()
    # round 2 of ranks 0 and 2; rank 1's late round 1 between their combine's sends and receives
    sources = sources_to([0, 2])
    outs = dispatch_all(ranks, sources, [0, 2], N, E, MODES[0], shrink)
    expert_outputs = [torch.randn(e_loc, R * N, H, generator=gen).to(torch.bfloat16) for _ in range(R)]
    combined = [torch.full((src.x.shape[0], H), float("nan"), dtype=torch.bfloat16) for src in sources]
    steps = combine_sends([0, 2], sources, outs, expert_outputs, combined)
    late = dispatch_all(ranks, late_sources, [1], N, E, MODES[0], shrink)
    late_combined = torch.empty(late_sources[1].x.shape[0], H, dtype=torch.bfloat16)
    ranks[1].combine(late_outputs[1], late_sources[1].topk_idx, late_sources[1].topk_weights, late[1].src_info,
                     late[1].layout_range, N, False, shrink[1], late_combined, None, 1, True)()
    for step in steps:
        step()
    masks = [[int(g == 1 or r == 1) for g in range(R)] for r in range(R)]
    regions = [M.dispatch_region(sources, g, E, masks) for g in range(R)]
    rows = M.selection_rows(sources, regions)
    for s in (0, 2):
        expected = M.combine(s, sources[s].topk_idx, sources[s].topk_weights, rows[s], expert_outputs, e_loc, masks)
        check(errors, f"late sender: rank {s}'s combine of round 2", combined[s], expected)
    check(errors, "late sender: rank 1's shrink mask", shrink[1], torch.tensor([1, 0, 1], dtype=torch.int32))
    check(errors, "late sender: rank 1's status (why it masked each rank)", ranks[1].status[4:],
          torch.tensor([status.MASKED_BY_PEER.value, 0, status.MASKED_BY_PEER.value], dtype=torch.int32))
    own = M.dispatch_region(late_sources, 1, E, [None, [1, 0, 1], None])   # rank 1 receives its own tokens only
    check(errors, "late sender: rank 1's late recv_count", late[1].recv_count, own.count)
    return errors


if __name__ == "__main__":
    keep_splatted_booleans_boolean()
    failures: List[str] = []
    seed = base_seed()   # (the test passes its own as DEEP_EP_TEST_SEED)
    for R, K, masked in ((2, 3, -1), (3, 4, 2), (4, 8, 1)):
        failures += run(R, N=8, H=256, K=K, E=4 * R, rounds=4 if R == 2 else 3, masked=masked, seed=seed)
    # fewer send programs than tokens (uneven arrival shares), and receive programs with several experts each
    # (their tables loaded one ahead)
    senders, ll.NUM_SENDERS = ll.NUM_SENDERS, 3
    try:
        failures += run(2, N=8, H=256, K=4, E=16, rounds=2, masked=-1, seed=seed)
        # 16 ranks with an expert each: DeepEP's signal area (4 bytes per expert) is too small for the counters,
        # which then sit at the end of the area
        failures += run(16, N=4, H=128, K=2, E=16, rounds=2, masked=3, seed=seed)
    finally:
        ll.NUM_SENDERS = senders
    # three local experts: three receive programs, whose shares of RECEIVED_UNIT differ
    failures += run(2, N=8, H=256, K=3, E=6, rounds=2, masked=-1, seed=seed)
    # a rank that never calls: masked by hand, and masked by the others' timeouts
    failures += run(3, N=8, H=256, K=4, E=12, rounds=2, masked=1, absent=True, seed=seed)
    failures += run(3, N=8, H=256, K=4, E=12, rounds=2, masked=1, absent=True, automatic=True, seed=seed)
    failures += run_unwritten_route(seed)
    failures += run_too_many_rows(seed)
    failures += run_late_sender(seed)
    print("ok" if not failures else "\n".join(failures[:20]), flush=True)
    sys.exit(1 if failures else 0)
