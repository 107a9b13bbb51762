"""Output hashes of fixed-seed runs of every `deep_ep` operation, to show that a change keeps behaviour.

Spawns `--ranks` rank processes (gloo group on 127.0.0.1; on a GPU machine every rank uses cuda:0, so the
NVLink transport runs with the ranks sharing one GPU) once per configuration, runs a fixed sequence of
calls with inputs from a fixed seed, and prints one line per (configuration, rank, operation, output):
`<config> r<rank> <case>.<operation>.<output> <sha256[:16]> <dtype[shape]>`. Only defined content is
hashed (docs/DESIGN.md): a low-latency expert's first `recv_count` rows (data, scales, `src_info`), a
`num_worst_tokens` dispatch's received rows. Then, on CUDA, `regs` lines (registers, spills and warps of
every Triton kernel of `deep_ep` that ran, for a human to compare), and a last `summary` line.

Covered: `get_dispatch_layout`; `dispatch` BF16 and FP8 (column-major scales) with top-k (-1 entries,
skewed routing, uneven tokens per rank, a rank with none), with `expert_alignment`, with
`num_worst_tokens`; cached BF16 and FP8 dispatch; `combine` with top-k weights, with one and two biases,
of the `num_worst_tokens` handle; the handles' tensors; all of it on a buffer of the size hint (the
direct protocol when DIRECT=1) and on one too small for a rank's share (always the rings). Low latency:
dispatch BF16, FP8, FP8 `round_scale`, FP8 `use_ue8m0`; combine BF16, LogFMT, zero-copy; each without and
with a receive hook, at up to 128 tokens and at up to 4 (the fused kernel), twice, the second round
shifted by one call so that every call also runs on the other buffer half.

Configurations (environment set before `deep_ep` is imported): `reference` (the only one on CPU);
on CUDA also `nvlink-direct` (DEEP_EP_NVLINK_DIRECT=1, DEEP_EP_LL_FUSED=1), `nvlink-rings`
(DEEP_EP_NVLINK_DIRECT=0, DEEP_EP_LL_FUSED=0) and `nvlink-stage16` (DIRECT=1,
DEEP_EP_NVLINK_STAGE_TOKENS=16; normal mode only).

    PYTHONPATH=.baseline python benchmarks/output_hashes.py --ranks 2 > before.txt
    PYTHONPATH=. python benchmarks/output_hashes.py --ranks 2 > after.txt
    python benchmarks/output_hashes.py --compare before.txt after.txt   # exit 1 if any line differs
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import queue
import socket
import sys
import time
import traceback
from collections import defaultdict
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.multiprocessing as mp

CONFIGS: Dict[str, Tuple[Dict[str, str], Tuple[str, ...]]] = {   # name: (environment, parts)
    "reference": ({"DEEP_EP_TRANSPORT": "reference"}, ("normal", "low_latency")),
    "nvlink-direct": ({"DEEP_EP_TRANSPORT": "nvlink", "DEEP_EP_NVLINK_DIRECT": "1", "DEEP_EP_LL_FUSED": "1"},
                      ("normal", "low_latency")),
    "nvlink-rings": ({"DEEP_EP_TRANSPORT": "nvlink", "DEEP_EP_NVLINK_DIRECT": "0", "DEEP_EP_LL_FUSED": "0"},
                     ("normal", "low_latency")),
    "nvlink-stage16": ({"DEEP_EP_TRANSPORT": "nvlink", "DEEP_EP_NVLINK_DIRECT": "1",
                        "DEEP_EP_NVLINK_STAGE_TOKENS": "16"}, ("normal",)),
}
FORCED = ("DEEP_EP_TRANSPORT", "DEEP_EP_NVLINK_DIRECT", "DEEP_EP_NVLINK_STAGE_TOKENS", "DEEP_EP_LL_FUSED")

# normal mode: (name, tokens per rank (rank r takes entry r % 4), hidden, experts, top-k, last rank without tokens)
NORMAL_CASES = [("main", (192, 320, 96, 256), 7168, 64, 8, False),
                ("zero", (128, 64, 200, 80), 2048, 48, 6, True)]
SMALL_CONFIG = dict(num_sms=8, num_max_nvl_chunked_send_tokens=4, num_max_nvl_chunked_recv_tokens=16)
# low latency: one buffer of N tokens per rank; (name, tokens per rank (entry r % 4))
LL_N, LL_HIDDEN, LL_EXPERTS, LL_TOPK = 128, 7168, 32, 8
LL_CASES = [("ll", (100, 128, 37, 77)), ("ll_small", (3, 0, 4, 1))]


def digest(values: Sequence[Any]) -> Tuple[str, str]:
    """(sha256[:16] of the values' dtypes, shapes and bytes, a description: dtype[shape], or for several
    tensors (an expert's rows each) dtype[total rows in count,...])."""
    h, rows = hashlib.sha256(), 0
    for v in values:
        if isinstance(v, torch.Tensor):
            t = v.detach().to("cpu").contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
            rows += t.shape[0]
        else:
            h.update(repr(v).encode())
    last = values[-1]
    if not isinstance(last, torch.Tensor):
        return h.hexdigest()[:16], type(last).__name__
    dims = list(map(str, last.shape))
    if len(values) > 1:
        dims[0] = f"{rows} rows in {len(values)}"
    return h.hexdigest()[:16], f"{str(last.dtype).replace('torch.', '')}[{','.join(dims)}]"


class Recorder:
    def __init__(self, config: str, rank: int) -> None:
        self.prefix, self.lines = f"{config} r{rank}", []

    def add(self, name: str, *values: Any) -> None:
        value_hash, description = digest(values)
        self.lines.append(f"{self.prefix} {name} {value_hash} {description}")


def routing(g: torch.Generator, rank: int, tokens: int, experts: int, topk: int) -> torch.Tensor:
    """Skewed top-k routing (expert e drawn with weight 1 / (1 + (e + 7 rank) mod E)), ~10% of the entries -1
    and every 17th token routed nowhere."""
    weight = 1.0 / (1.0 + (torch.arange(experts) + 7 * rank) % experts)
    if tokens == 0:
        return torch.empty((0, topk), dtype=torch.int64)
    idx = torch.multinomial(weight.expand(tokens, experts), topk, replacement=False, generator=g)
    idx[torch.rand(tokens, topk, generator=g) < 0.1] = -1
    idx[::17] = -1
    return idx


def generator(seed: int, rank: int, case: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + rank * 1009 + sum(map(ord, case)))


def run_normal(deep_ep: Any, group: Any, rank: int, R: int, dev: torch.device, seed: int, rec: Recorder) -> None:
    Buffer, Config = deep_ep.Buffer, deep_ep.Config
    idx_t = getattr(deep_ep, "topk_idx_t", torch.int64)
    hidden_bytes = max(c[2] for c in NORMAL_CASES) * 2
    hint = max(Buffer.get_dispatch_config(R).get_nvl_buffer_size_hint(hidden_bytes, R),
               Buffer.get_combine_config(R).get_nvl_buffer_size_hint(hidden_bytes, R))
    small = Config(**SMALL_CONFIG)
    # the hint holds every rank's whole share (direct protocol); the small buffer's rings, 4 channels x R x 16
    # rows, hold less than a rank receives (so the rings even with DEEP_EP_NVLINK_DIRECT=1)
    setups = [("", hint, None, NORMAL_CASES), ("small.", small.get_nvl_buffer_size_hint(hidden_bytes, R), small,
                                               NORMAL_CASES[:1])]
    for label, nvl_bytes, config, cases in setups:
        buf = Buffer(group, nvl_bytes, 0, explicitly_destroy=True)
        for name, token_list, H, E, K, last_empty in cases:
            case = label + name
            g = generator(seed, rank, case)
            T = 0 if last_empty and rank == R - 1 else token_list[rank % 4]
            x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev)
            idx = routing(g, rank, T, E, K).to(idx_t).to(dev)
            w = torch.rand(T, K, generator=g).to(dev)
            fp8 = (torch.randn(T, H, generator=g) * 4).to(torch.float8_e4m3fn).to(dev)
            scales = (torch.rand(T, (H + 127) // 128, generator=g) + 0.5).to(dev).T.contiguous().T
            x2 = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev)
            bias = [torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev) for _ in range(2)]

            per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
            rec.add(f"{case}.layout.num_tokens_per_rank", per_rank)
            rec.add(f"{case}.layout.num_tokens_per_rdma_rank", per_rdma)
            rec.add(f"{case}.layout.num_tokens_per_expert", per_expert)
            rec.add(f"{case}.layout.is_token_in_rank", in_rank)
            layout = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                          num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, config=config)

            def record(op: str, out: tuple, rows: Optional[int] = None) -> None:
                recv_x, recv_idx, recv_w, counts, handle, _ = out
                for part, v in zip(("x", "scales"), recv_x if isinstance(recv_x, tuple) else (recv_x,)):
                    rec.add(f"{case}.{op}.recv_{part}", v[:rows])
                if recv_idx is not None:
                    rec.add(f"{case}.{op}.recv_topk_idx", recv_idx)   # (-1 past the rows: spec 5.7)
                    rec.add(f"{case}.{op}.recv_topk_weights", recv_w[:rows])
                    rec.add(f"{case}.{op}.num_recv_tokens_per_expert_list", counts)
                if handle is not None:
                    for i, part in enumerate(("rank_prefix_matrix", "channel_prefix_matrix",
                                              "recv_channel_prefix_matrix", "recv_src_idx", "is_token_in_rank",
                                              "send_head")):
                        rec.add(f"{case}.{op}.handle.{part}", handle[i][:rows] if i == 3 else handle[i])

            bf16 = buf.dispatch(x, **layout)
            record("dispatch_bf16", bf16)
            record("dispatch_fp8", buf.dispatch((fp8, scales), **layout))
            record("dispatch_align128", buf.dispatch(x, expert_alignment=128, **layout))
            worst_rows = sum(0 if last_empty and r == R - 1 else token_list[r % 4] for r in range(R)) + 8
            worst = buf.dispatch(x, num_worst_tokens=worst_rows, **layout)
            received = int(worst[4][0][R - 1, rank])
            record("dispatch_worst", worst, received)
            record("dispatch_cached_bf16", buf.dispatch(x2, handle=bf16[4], config=config))
            record("dispatch_cached_fp8", buf.dispatch((fp8, scales), handle=bf16[4], config=config))

            y = torch.randn(bf16[0].shape[0], H, generator=g).to(torch.bfloat16).to(dev)
            for op, kwargs in (("combine", dict(topk_weights=bf16[2])), ("combine_no_weights", {}),
                               ("combine_bias", dict(topk_weights=bf16[2], bias=bias[0])),
                               ("combine_bias2", dict(bias=(bias[0], bias[1])))):
                combined, combined_w, _ = buf.combine(y, bf16[4], config=config, **kwargs)
                rec.add(f"{case}.{op}.combined_x", combined)
                rec.add(f"{case}.{op}.combined_topk_weights", combined_w)
            y_worst = torch.randn(worst_rows, H, generator=g).to(torch.bfloat16).to(dev)
            w_worst = worst[2].clone()
            w_worst[received:] = 0   # (rows past the received ones are undefined)
            combined, combined_w, _ = buf.combine(y_worst, worst[4], topk_weights=w_worst, config=config)
            rec.add(f"{case}.combine_worst.combined_x", combined)
            rec.add(f"{case}.combine_worst.combined_topk_weights", combined_w)
        buf.destroy()


def run_low_latency(deep_ep: Any, group: Any, rank: int, R: int, dev: torch.device, seed: int,
                    rec: Recorder) -> None:
    N, H, E, K = LL_N, LL_HIDDEN, LL_EXPERTS, LL_TOPK
    idx_t = getattr(deep_ep, "topk_idx_t", torch.int64)
    buf = deep_ep.Buffer(group, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(N, H, R, E),
                         low_latency_mode=True, num_qps_per_rank=max(1, E // R), explicitly_destroy=True)
    for case, token_list in LL_CASES:
        g = generator(seed, rank, case)
        T = token_list[rank % 4]
        x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev)
        idx = routing(g, rank, T, E, K).to(idx_t).to(dev)
        w = torch.rand(T, K, generator=g).to(dev)
        # (the even experts' rows, below 1 in magnitude, are the ones LogFMT encodes; the others travel as BF16)
        scale = torch.tensor([0.05, 1.0]).repeat(E // R)[:E // R].view(-1, 1, 1)
        expert_out = (torch.randn(E // R, R * N, H, generator=g) * scale).to(torch.bfloat16).to(dev)

        def dispatch(name: str, hook: bool, **kwargs: Any) -> tuple:
            stats = torch.zeros(E // R, dtype=torch.int32, device=dev)
            recv, count, handle, _, receive = buf.low_latency_dispatch(
                x, idx, N, E, cumulative_local_expert_recv_stats=stats, return_recv_hook=hook, **kwargs)
            if hook:
                receive()
            rows = count.tolist()
            for part, v in zip(("x", "scales"), recv if isinstance(recv, tuple) else (recv,)):
                rec.add(f"{name}.recv_{part}", *[v[e, :c] for e, c in enumerate(rows)])
            rec.add(f"{name}.recv_count", count)
            rec.add(f"{name}.src_info", *[handle[0][e, :c] for e, c in enumerate(rows)])
            rec.add(f"{name}.layout_range", handle[1])
            rec.add(f"{name}.cumulative_local_expert_recv_stats", stats)
            return handle

        def combine(name: str, handle: tuple, hook: bool, **kwargs: Any) -> None:
            if kwargs.get("zero_copy"):
                buf.get_next_low_latency_combine_buffer(handle).copy_(expert_out)
            out, _, receive = buf.low_latency_combine(expert_out, idx, w, handle, return_recv_hook=hook, **kwargs)
            if hook:
                receive()
            rec.add(f"{name}.combined_x", out)

        for round_ in range(2):
            if round_ == 1:   # (one call more: this round's calls use the other buffer halves)
                dispatch(f"{case}.round1.shift.dispatch_bf16", False, use_fp8=False)
            for hook in (False, True):
                tag = f"{case}.round{round_}.{'hook' if hook else 'nohook'}"
                handle = dispatch(f"{tag}.dispatch_bf16", hook, use_fp8=False)
                combine(f"{tag}.combine_bf16", handle, hook)
                combine(f"{tag}.combine_logfmt", handle, hook, use_logfmt=True)
                combine(f"{tag}.combine_zero_copy", handle, hook, zero_copy=True)
                dispatch(f"{tag}.dispatch_fp8", hook, use_fp8=True)
                dispatch(f"{tag}.dispatch_fp8_round", hook, use_fp8=True, round_scale=True)
                handle = dispatch(f"{tag}.dispatch_fp8_ue8m0", hook, use_fp8=True, round_scale=True, use_ue8m0=True)
                combine(f"{tag}.combine_after_fp8", handle, hook)
    buf.destroy()


def kernel_registers(config: str) -> List[str]:
    """`regs` lines: each compiled specialisation of every Triton kernel of `deep_ep` that was loaded."""
    try:
        from triton.runtime.jit import JITFunction
        found: Dict[int, Any] = {}
        for name, module in list(sys.modules.items()):
            if name.startswith("deep_ep") and module is not None:
                for value in list(vars(module).values()):
                    while not isinstance(value, JITFunction) and hasattr(value, "fn"):   # (autotune, heuristics)
                        value = value.fn
                    if isinstance(value, JITFunction):
                        found[id(value)] = value
        lines = []
        for fn in found.values():
            for caches in fn.device_caches.values():   # (Triton 3.6 to 3.9: (kernels by key, ...) per device)
                for kernel in caches[0].values():
                    if getattr(kernel, "n_regs", None) is None:
                        continue   # (compiled, never loaded)
                    lines.append(f"regs {config} {getattr(kernel, 'name', fn.__name__)} n_regs={kernel.n_regs} "
                                 f"n_spills={kernel.n_spills} num_warps={kernel.metadata.num_warps}")
        return sorted(lines) or [f"regs {config} (no Triton kernel ran)"]
    except Exception as error:  # noqa: BLE001 - informational only
        return [f"regs {config} unavailable: {type(error).__name__}: {error}"]


def rank_main(rank: int, R: int, port: int, config: str, seed: int, timeout_s: float, results: Any) -> None:
    import torch.distributed as dist
    try:
        os.environ.update(CONFIGS[config][0])   # (also inherited; before deep_ep is imported)
        import deep_ep
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // R))
        dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=R,
                                timeout=datetime.timedelta(seconds=timeout_s))
        rec = Recorder(config, rank)
        parts = CONFIGS[config][1]
        if "normal" in parts:
            run_normal(deep_ep, dist.group.WORLD, rank, R, dev, seed, rec)
        if "low_latency" in parts:
            run_low_latency(deep_ep, dist.group.WORLD, rank, R, dev, seed, rec)
        regs = kernel_registers(config) if dev.type == "cuda" and rank == 0 else []
        if rank == 0:
            print(f"# {config}: deep_ep from {os.path.dirname(deep_ep.__file__)}, {dev}", file=sys.stderr)
        dist.barrier()
        results.put((rank, True, rec.lines, regs))
    except BaseException:  # noqa: BLE001 - reported by the parent
        results.put((rank, False, traceback.format_exc(), []))


def run_config(config: str, R: int, seed: int, timeout_s: float) -> Tuple[List[str], List[str]]:
    for key in FORCED:
        os.environ.pop(key, None)
    os.environ.update(CONFIGS[config][0])
    os.environ.setdefault("DEEP_EP_TIMEOUT_S", "60")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, R, port, config, seed, timeout_s, results), daemon=True)
             for r in range(R)]
    for p in procs:
        p.start()
    deadline, answers, failure = time.monotonic() + timeout_s, {}, None
    while len(answers) < R and failure is None:
        try:
            rank, ok, lines, regs = results.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            failure = f"ranks {sorted(set(range(R)) - set(answers))} did not finish within {timeout_s:.0f} s"
            break
        if ok:
            answers[rank] = (lines, regs)
        else:
            failure = f"rank {rank} failed:\n{lines}"
    for p in procs:
        p.join(timeout=10 if failure is None else 1)
        if p.is_alive():
            p.kill()
    if failure is not None:
        sys.exit(f"output_hashes: configuration {config}: {failure}")
    return ([line for r in range(R) for line in answers[r][0]], [line for r in range(R) for line in answers[r][1]])


def parse(path: str) -> Dict[Tuple[str, str, str], str]:
    lines = {}
    with open(path) as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 4 and not line.startswith(("regs", "summary", "#")):
                lines[tuple(fields[:3])] = " ".join(fields[3:])
    return lines


def compare(path_a: str, path_b: str) -> int:
    a, b = parse(path_a), parse(path_b)
    table: Dict[str, List[int]] = defaultdict(lambda: [0, 0, 0])
    differing = []
    for key in sorted(set(a) | set(b)):
        row = table[key[0]]
        row[0] += 1
        same = a.get(key) == b.get(key)
        row[1 if same else 2] += 1
        if not same:
            differing.append(f"  {' '.join(key)}: {a.get(key, '(missing)')} | {b.get(key, '(missing)')}")
    print(f"{'configuration':<16} {'lines':>6} {'identical':>9} {'differing':>9}")
    for config, (n, same, diff) in table.items():
        print(f"{config:<16} {n:>6} {same:>9} {diff:>9}")
    for line in differing[:20]:
        print(line)
    if len(differing) > 20:
        print(f"  ... {len(differing) - 20} more")
    print("identical" if not differing and table else "DIFFERENT" if differing else "no hash lines")
    return 0 if table and not differing else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="rank processes (1, 2 or 4; default 2)")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=None,
                        help="default: reference on CPU; every configuration on CUDA")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per configuration (default 300)")
    parser.add_argument("--compare", nargs=2, metavar=("FILE_A", "FILE_B"), help="diff two outputs and exit")
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    cuda = torch.cuda.is_available()
    configs = args.configs or (list(CONFIGS) if cuda else ["reference"])
    if not cuda and configs != ["reference"]:
        parser.error("without CUDA only the reference configuration runs")
    count, regs, hashes = 0, [], defaultdict(set)
    for config in configs:
        start = time.monotonic()
        lines, config_regs = run_config(config, args.ranks, args.seed, args.timeout)
        print("\n".join(lines), flush=True)
        print(f"# {config}: {len(lines)} lines in {time.monotonic() - start:.1f} s", file=sys.stderr)
        count, regs = count + len(lines), regs + config_regs
        for line in lines:
            fields = line.split()
            hashes[(fields[1], fields[2])].add(fields[3])
    if regs:
        print("\n".join(regs))
    spread = sum(len(v) > 1 for v in hashes.values())
    print(f"summary: {count} hash lines, configs {','.join(configs)}, {args.ranks} ranks, seed {args.seed}; "
          f"{spread} of {len(hashes)} outputs differ between configurations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
