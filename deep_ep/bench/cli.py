"""The command: arguments, the spawned ranks and what each runs, the launcher that waits for them."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import queue
import socket
import sys
import time
import traceback
from typing import Any, Dict, Optional, Sequence, Tuple

import torch

from .context import PREFIX, RankContext, VerificationError
from .low_latency import bench_low_latency
from .normal import bench_normal
from .report import format_functions, format_kernels, format_table, summarise, write_plot

# Shapes: DeepSeek-V3 training (normal) and decoding (low-latency) on GPU; small enough for a laptop on CPU.
GPU_DEFAULTS = dict(tokens=4096, hidden=7168, topk=8, experts=256, ll_tokens=128, ll_experts=288, warmup=10,
                    iters=30)
CPU_DEFAULTS = dict(tokens=512, hidden=1024, topk=8, experts=64, ll_tokens=64, ll_experts=64, warmup=3, iters=10)


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m deep_ep.bench",
        description="Time and verify deep_ep dispatch/combine round trips (normal and low-latency modes) "
                    "against a plain all_to_all_single baseline. Spawns its own ranks.")
    p.add_argument("--num-ranks", type=_positive, default=2, help="number of rank processes to spawn (default 2)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto (default): CUDA (NCCL) when a GPU is visible, else CPU (gloo)")
    p.add_argument("--mode", choices=("normal", "low-latency", "all"), default="all", help="default all")
    shape = p.add_argument_group("shape (defaults: DeepSeek-V3 on GPU; 512 tokens, hidden 1024, top-8, "
                                 "64 experts, LL 64 tokens / 64 experts on CPU)")
    shape.add_argument("--tokens", type=_positive, default=None, help="tokens per rank (normal mode)")
    shape.add_argument("--hidden", type=_positive, default=None, help="hidden size (multiple of 16)")
    shape.add_argument("--topk", type=_positive, default=None, help="experts per token")
    shape.add_argument("--experts", type=_positive, default=None, help="total experts (normal mode)")
    shape.add_argument("--ll-tokens", type=_positive, default=None,
                       help="tokens per rank = num_max_dispatch_tokens_per_rank (low-latency mode)")
    shape.add_argument("--ll-experts", type=_positive, default=None, help="total experts (low-latency mode)")
    p.add_argument("--transport", default=None, help="Buffer(transport=...); default: the library's choice")
    p.add_argument("--num-sms", type=_positive, default=None,
                   help="Buffer.set_num_sms (even); default: the library's default")
    p.add_argument("--nvl-bytes", type=_positive, default=None,
                   help="num_nvl_bytes of the normal-mode Buffer (default: the larger of the dispatch and combine "
                        "configs' size hints)")
    p.add_argument("--warmup", type=_non_negative, default=None,
                   help="untimed calls per operation (default 10 on GPU, 3 on CPU)")
    p.add_argument("--iters", type=_positive, default=None,
                   help="timed calls per operation (default 30 on GPU, 10 on CPU)")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs (default 0)")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="seconds before the whole run is abandoned (default 1800)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (configuration, figures, verification) on stdout; "
                        "the table then goes to stderr")
    p.add_argument("--kernels", action="store_true",
                   help="after the table, each operation's kernels and copies with their microseconds per call (GPU)")
    p.add_argument("--profile", action="store_true",
                   help="after the timed calls, as many more of each operation (ours and the baseline) under "
                        "cProfile, one counting its tensor operations and as many again under torch.profiler; after "
                        "the table, rank 0's host time per call by function, its tensor operations per call and "
                        "their own time by operator")
    p.add_argument("--no-isolated", action="store_true",
                   help="skip the series of calls each after a barrier (half the timed calls; the isolated column "
                        "shows '-')")
    p.add_argument("--plot", metavar="FILE.png", default=None, help="bar chart of the times (needs matplotlib)")
    return p


def _resolve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Dict[str, Any]:
    """Everything the ranks need, as a picklable dict."""
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = args.device
    if device == "auto":
        device = "cuda" if num_gpus > 0 else "cpu"
    if device == "cuda" and num_gpus == 0:
        parser.error("--device cuda: no CUDA device is visible")
    defaults = GPU_DEFAULTS if device == "cuda" else CPU_DEFAULTS
    plan: Dict[str, Any] = {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in defaults.items()}
    num_ranks = args.num_ranks
    backend = "nccl" if device == "cuda" and num_ranks <= num_gpus else "gloo"
    modes = ["normal", "low-latency"] if args.mode == "all" else [args.mode]
    if plan["hidden"] % 16:
        parser.error(f"--hidden must be a multiple of 16 (16-byte FP8 rows), got {plan['hidden']}")
    if "normal" in modes:
        if plan["experts"] % num_ranks:
            parser.error(f"--experts ({plan['experts']}) must be a multiple of --num-ranks ({num_ranks})")
        if plan["topk"] > plan["experts"]:
            parser.error(f"--topk ({plan['topk']}) must be <= --experts ({plan['experts']})")
    if "low-latency" in modes:
        if plan["ll_experts"] % num_ranks:
            parser.error(f"--ll-experts ({plan['ll_experts']}) must be a multiple of --num-ranks ({num_ranks})")
        if plan["topk"] > plan["ll_experts"]:
            parser.error(f"--topk ({plan['topk']}) must be <= --ll-experts ({plan['ll_experts']})")
    if args.num_sms is not None and args.num_sms % 2:
        parser.error(f"--num-sms must be even, got {args.num_sms}")
    plan.update(num_ranks=num_ranks, device=device, backend=backend, num_gpus=num_gpus, modes=modes,
                transport=args.transport, num_sms=args.num_sms, nvl_bytes=args.nvl_bytes, seed=args.seed,
                profile=args.profile, isolated=not args.no_isolated)
    return plan


def _num_phases(plan: Dict[str, Any]) -> int:
    graphs = plan["device"] == "cuda" and plan["transport"] != "reference"   # the NVLink path: CUDA graphs
    return (6 if "normal" in plan["modes"] else 0) + ((4 + graphs) if "low-latency" in plan["modes"] else 0)


def _run_rank(ctx: RankContext) -> Dict[str, Any]:
    results: Dict[str, Any] = {}
    info: Dict[str, Any] = {}
    if "normal" in ctx.plan["modes"]:
        bench_normal(ctx, results, info)
    if "low-latency" in ctx.plan["modes"]:
        bench_low_latency(ctx, results, info)
    everyone = ctx.all_gather_object(results)
    return dict(per_rank=everyone, info=info, checks=list(ctx.checks))


def _setup_env(plan: Dict[str, Any]) -> None:
    if sys.platform.startswith("linux") and os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks all run on this host
    if "OMP_NUM_THREADS" not in os.environ:
        # Share the cores between the ranks (as torchrun does): with every rank using all cores, the small
        # host-side tensor ops of a call wait for oversubscribed OpenMP threads (milliseconds each).
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // plan["num_ranks"]))


def _worker(rank: int, plan: Dict[str, Any], port: int, reports: Any) -> None:
    """Entry point of a spawned rank: reports ("ok", result) / ("verify", message) / ("error", traceback)."""
    import torch.distributed as dist
    clean = False
    try:
        _setup_env(plan)
        if plan["device"] == "cuda":
            device = torch.device("cuda", rank % plan["num_gpus"])
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        kwargs: Dict[str, Any] = dict(init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                      world_size=plan["num_ranks"], timeout=datetime.timedelta(seconds=300))
        if plan["backend"] == "nccl":
            kwargs["device_id"] = device
        try:
            dist.init_process_group(plan["backend"], **kwargs)
        except TypeError:  # torch without device_id
            kwargs.pop("device_id", None)
            dist.init_process_group(plan["backend"], **kwargs)
        ctx = RankContext(rank, plan, dist.group.WORLD, device)
        result = _run_rank(ctx)
        reports.put((rank, "ok", result if rank == 0 else None))
        clean = True
    except VerificationError as error:
        reports.put((rank, "verify", str(error)))
    except BaseException:  # noqa: BLE001 - every failure goes back to the launcher
        reports.put((rank, "error", traceback.format_exc()))
    finally:
        if clean and dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(plan: Dict[str, Any], timeout: float) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    """Spawn the ranks and wait for them; returns (rank 0's result, None) or (None, failure text)."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    reports = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(rank, plan, port, reports), daemon=True)
             for rank in range(plan["num_ranks"])]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    got: Dict[int, Tuple[str, Any]] = {}
    failure: Optional[str] = None
    try:
        while len(got) < len(procs):
            try:
                rank, status, payload = reports.get(timeout=0.5)
                got[rank] = (status, payload)
                if status != "ok" and failure is None:
                    failure = payload if status == "verify" else f"rank {rank} raised:\n{payload}"
                    # a verification failure is agreed by all ranks; give them a moment to report
                    deadline = min(deadline, time.monotonic() + (10 if status == "verify" else 3))
                continue
            except queue.Empty:
                pass
            if failure is not None and time.monotonic() > deadline:
                break
            dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode is not None]
            if dead:
                failure = failure or f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} without a report"
                break
            if time.monotonic() > deadline:
                failure = failure or (f"timed out after {timeout:g} s waiting for ranks "
                                      f"{[r for r in range(len(procs)) if r not in got]}")
                break
    finally:
        for p in procs:
            p.join(timeout=30 if failure is None else 2)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if failure is not None:
        return None, failure
    return got[0][1], None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the benchmark; returns the exit code (0 = every check passed)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(f"{PREFIX} --plot needs matplotlib, which is not installed: pip install matplotlib "
                  "(or pip install 'deep-ep-triton[plot]')", file=sys.stderr)
            return 2
    plan = _resolve(args, parser)
    plan["num_phases"] = _num_phases(plan)
    print(f"{PREFIX} spawning {plan['num_ranks']} ranks: {plan['device']} tensors, {plan['backend']} group, "
          f"mode {'+'.join(plan['modes'])}", file=sys.stderr, flush=True)
    start = time.monotonic()
    result, failure = _launch(plan, args.timeout)
    wall_s = time.monotonic() - start
    if failure is not None:
        print(f"{PREFIX} FAILED: {failure}", file=sys.stderr, flush=True)
        if args.json:
            print(json.dumps(dict(ok=False, error=failure, verification=dict(passed=False)), indent=2), flush=True)
        return 1
    report = summarise(plan, result, wall_s)
    table = format_table(report)
    if args.kernels:
        table += "\n" + format_kernels(report)
    if args.profile:
        table += "\n" + format_functions(report)
    if args.json:
        print(table, file=sys.stderr, flush=True)
        print(json.dumps(report, indent=2), flush=True)
    else:
        print(table, flush=True)
    if args.plot is not None:
        write_plot(report, args.plot)
        print(f"{PREFIX} wrote {args.plot}", file=sys.stderr, flush=True)
    return 0
