"""Run DeepEP V1's own test scripts against this package: `tests/test_intranode.py`,
`tests/test_internode.py` and `tests/test_low_latency.py` (with their `tests/utils.py`) of a DeepEP
checkout of the V1 line (e.g. commit 567632d, the last before V2), which exercise the public API the way DeepEP's authors do and
print DeepEP's own figures.

    python benchmarks/deepep_tests.py DEEPEP_TESTS_DIR test_low_latency --num-processes 2 [script arguments]
    python benchmarks/deepep_tests.py DEEPEP_TESTS_DIR test_intranode --num-processes 2 --num-tokens 256 --hidden 1024

On GPUs the script runs as it is (NCCL, `cuda:local_rank`), DeepEP's kernel timing (`bench_kineto`, which
wants one profiler row per kernel name: `dispatch`, `combine`, and with receive hooks finds the two phases'
kernels by `::dispatch`, `::combine`) included: each low-latency operation here launches one kernel, which
profilers show as `deep_ep::low_latency::dispatch()` (or `combine`). DeepEP's timing reports a name's mean
time per launch: with receive hooks that is per phase, as for DeepEP; without, a low-latency call here is two
launches (send, receive; one up to 4 tokens) where DeepEP's is one, so its figure is half the call's kernel
time. Only `test_internode` gets a replacement timing: its groups span nodes, where this package runs the
reference transport (torch collectives, no kernel of those names), so the replacement gives the whole call's
GPU time to the first name. Nodes there are DeepEP's: WORLD_SIZE and RANK name this host's node among several
hosts.

Without GPUs, or with `--cpu` before the tests folder, it runs on CPU tensors over gloo with what the script
cannot do there replaced: tensors it creates with `device='cuda'` are made on the CPU, `init_dist` starts a
gloo group (and sets the default dtype to bfloat16 as the script's does), `dist.all_gather_into_tensor`
gathers through a list (gloo takes no stacked output), `bench` times with `time.perf_counter`, and
`bench_kineto` gives the host time of one call for every kernel name, or NaN without running the calls that
use receive hooks (each of them multiplies two 8192 x 8192 matrices). Its checks are unchanged, so a run
that ends without an error has passed them. As in DeepEP, WORLD_SIZE and RANK (environment) give the
number of nodes and this node's index, so two runs with WORLD_SIZE=2 and RANK=0 / 1 (same MASTER_PORT)
are two nodes of `--num-processes` ranks each (`test_internode` wants 8 a node); on one host the Buffers
then get `num_ranks_per_node` so that each run's ranks form a node.

With `--share-gpus` the ranks run as processes that share the GPUs (rank i on GPU i mod count) in a gloo
group, with the script's CUDA tensors, so more ranks than GPUs run (NCCL takes one rank a GPU); `init_dist`
and `dist.all_gather_into_tensor` (through host memory) are replaced; `bench_kineto` as on GPUs.
"""
import argparse
import functools
import importlib
import math
import os
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _CudaOnCpu(TorchFunctionMode):
    """Factory calls that name a CUDA device make their tensors on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def _init_dist(local_rank: int, num_local_ranks: int, on_gpus: bool = False):
    """DeepEP's init_dist on gloo: WORLD_SIZE nodes of `num_local_ranks` ranks, this one node RANK; `on_gpus`:
    on GPU local_rank mod count, CUDA the default device (as DeepEP's)."""
    address, port = os.getenv("MASTER_ADDR", "127.0.0.1"), int(os.getenv("MASTER_PORT", "8361"))
    num_nodes, node = int(os.getenv("WORLD_SIZE", "1")), int(os.getenv("RANK", "0"))
    dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", world_size=num_nodes * num_local_ranks,
                            rank=node * num_local_ranks + local_rank)
    torch.set_default_dtype(torch.bfloat16)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // num_local_ranks))
    if on_gpus:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        torch.set_default_device("cuda")
    return dist.get_rank(), dist.get_world_size(), dist.new_group(list(range(num_nodes * num_local_ranks)))


def _bench(fn: Callable[[], Any], num_warmups: int = 2, num_tests: int = 5, post_fn=None):
    for _ in range(num_warmups):
        fn()
    times = []
    for _ in range(num_tests):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        if post_fn is not None:
            post_fn()
    return sum(times) / len(times), min(times), max(times)


def _bench_kineto(fn, kernel_names, num_tests: int = 30, suppress_kineto_output: bool = False, trace_path=None,
                  barrier_comm_profiling: bool = False, num_kernels_per_period: int = 1):
    """The host time of one call for every kernel name (no kernel times on a CPU; the tuning loops only need
    numbers to compare); NaN without running it for a call with receive hooks."""
    if isinstance(fn, functools.partial) and fn.keywords.get("return_recv_hook"):
        seconds = math.nan
    else:
        start = time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
    one = [seconds] * num_kernels_per_period if num_kernels_per_period > 1 else seconds
    return tuple(one for _ in kernel_names) if isinstance(kernel_names, tuple) else one


def _kernel_times(fn, kernel_names, num_tests: int = 30, suppress_kineto_output: bool = False, trace_path=None,
                  barrier_comm_profiling: bool = False, num_kernels_per_period: int = 1):
    """DeepEP's bench_kineto for test_internode (the reference transport), which times whole calls (no receive
    hooks, so one phase): the GPU seconds per call of all kernels whose names contain each of `kernel_names`.

    Calls with no kernel of a name (the reference transport, e.g. test_internode's, runs torch ops and
    collectives): the whole call's GPU time, timed with events, goes to the first such name and 0 to the
    others (test_internode's `notify`), so that the script's tuning loops still compare configurations."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    if num_kernels_per_period != 1:
        raise NotImplementedError(f"num_kernels_per_period must be 1 here, got {num_kernels_per_period}")
    for _ in range(num_tests):   # (DeepEP's profiles a second round: the first warms up)
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        if barrier_comm_profiling:   # as DeepEP's: a long kernel, then a barrier, evens out the ranks' launches
            lhs = torch.randn((8192, 8192), dtype=torch.float, device="cuda")
            lhs @ lhs
            if dist.get_backend() == "nccl":   # (queued behind the product, as DeepEP's)
                dist.all_reduce(torch.ones(1, dtype=torch.float, device="cuda"))
            else:                               # (gloo: the host waits)
                dist.barrier()
        start.record()
        for _ in range(num_tests):
            fn()
        end.record()
        torch.cuda.synchronize()
    if trace_path is not None:
        prof.export_chrome_trace(trace_path)
    kernels = sorted((event for event in prof.events() if event.device_type == DeviceType.CUDA),
                     key=lambda event: event.time_range.start)
    names = (kernel_names,) if isinstance(kernel_names, str) else kernel_names
    unmatched_seconds = start.elapsed_time(end) / 1e3 / num_tests   # (per call, given to one name only)
    results = []
    for name in names:
        seconds = [(event.time_range.end - event.time_range.start) / 1e6 for event in kernels if name in event.name]
        if not seconds:
            results.append(unmatched_seconds)
            unmatched_seconds = 0.0
            continue
        if len(seconds) % num_tests:
            raise AssertionError(f"{len(seconds)} kernels named *{name}* in {num_tests} calls")
        results.append(sum(seconds) / num_tests)
    return tuple(results) if isinstance(kernel_names, tuple) else results[0]


def _gather_into(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """all_gather_into_tensor through a list, in host memory (gloo)."""
    if not output.is_cuda:
        return dist.all_gather(list(output.view(-1, *input.shape).unbind(0)), input, group=group, async_op=async_op)
    staged = output.cpu()
    dist.all_gather(list(staged.view(-1, *input.shape).unbind(0)), input.cpu(), group=group)
    output.copy_(staged)


def _run_rank(local_rank: int, num_local_ranks: int, args: argparse.Namespace, tests_dir: str, script: str,
              mode: str) -> None:
    """One rank of the script's `test_loop`. `mode`: "gpus" (the script's own NCCL set-up), "share" (ranks
    sharing the GPUs over gloo) or "cpu"."""
    sys.path[:0] = [tests_dir, REPO]
    import utils
    if mode == "cpu":
        utils.bench, utils.bench_kineto = _bench, _bench_kineto
    elif script == "test_internode":
        utils.bench_kineto = _kernel_times
    if mode != "gpus":
        utils.init_dist = functools.partial(_init_dist, on_gpus=mode == "share")
    import deep_ep
    if mode != "gpus" and int(os.getenv("WORLD_SIZE", "1")) > 1:   # every host is this one: nodes of
        buffer_init = deep_ep.Buffer.__init__                         # num_local_ranks ranks, as DeepEP's

        def init_with_nodes(self, *init_args, **init_kwargs):
            buffer_init(self, *init_args, **dict(init_kwargs, num_ranks_per_node=num_local_ranks))
        deep_ep.Buffer.__init__ = init_with_nodes
    module = importlib.import_module(script)   # (its `from utils import ...` binds the replacements above)
    if mode != "gpus":
        dist.all_gather_into_tensor = _gather_into
    if mode != "cpu":
        module.test_loop(local_rank, num_local_ranks, args)
        return
    with _CudaOnCpu():
        module.test_loop(local_rank, num_local_ranks, args)


def _script_arguments(tests_dir: str, script: str, argv) -> argparse.Namespace:
    """The script's own arguments: the statements of its `__main__` block from its parser up to the spawn,
    applied to argv."""
    source = open(os.path.join(tests_dir, script + ".py")).read()
    start = source.index("    parser = argparse.ArgumentParser")
    end = source.index("    num_processes = args.num_processes")
    body = source[start:end].replace("parser.parse_args()", "parser.parse_args(argv)")
    namespace = {"argparse": argparse, "os": os}
    exec("def arguments(argv):\n" + body + "    return args\n", namespace)
    return namespace["arguments"](argv)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="run on CPU tensors over gloo even with GPUs")
    parser.add_argument("--share-gpus", action="store_true",
                        help="on GPUs, ranks as processes sharing them (rank i on GPU i mod count), gloo group")
    parser.add_argument("tests_dir", help="DeepEP's tests folder (V1 line: test_*.py and utils.py)")
    parser.add_argument("script", choices=["test_intranode", "test_internode", "test_low_latency"])
    ours, rest = parser.parse_known_args()
    tests_dir = os.path.abspath(ours.tests_dir)
    on_gpus = not ours.cpu and torch.cuda.is_available()
    mode = ("share" if ours.share_gpus else "gpus") if on_gpus else "cpu"
    args = _script_arguments(tests_dir, ours.script, rest)
    if not on_gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""   # (the ranks' Buffers would otherwise pick a GPU)
    if mode != "gpus" and int(os.getenv("WORLD_SIZE", "1")) == 1:   # (several nodes share MASTER_PORT, DeepEP's
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))   # default 8361)
    torch.multiprocessing.spawn(_run_rank, args=(args.num_processes, args, tests_dir, ours.script, mode),
                                nprocs=args.num_processes)
    where = f"{torch.cuda.device_count()} GPUs" if on_gpus else "CPU"
    group = "NCCL" if mode == "gpus" else "gloo"
    print(f"{ours.script}: every check passed on {where} ({args.num_processes} ranks, node {os.getenv('RANK', '0')} "
          f"of {os.getenv('WORLD_SIZE', '1')}, {group})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
