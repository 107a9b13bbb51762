"""Run DeepEP V1's own test scripts against this package: `tests/test_intranode.py` and
`tests/test_low_latency.py` (with their `tests/utils.py`) of a DeepEP checkout of the V1 line (e.g. tag
v1.2.1), which exercise the public API the way DeepEP's authors do and print DeepEP's own figures.

    python benchmarks/deepep_tests.py DEEPEP_TESTS_DIR test_low_latency --num-processes 2 [script arguments]
    python benchmarks/deepep_tests.py DEEPEP_TESTS_DIR test_intranode --num-processes 2 --num-tokens 256 --hidden 1024

On GPUs the script runs as it is (NCCL, `cuda:local_rank`). Without GPUs, or with `--cpu` before the
script's name, it runs on CPU tensors over gloo with what the script cannot do there replaced: tensors it
creates with `device='cuda'` are made on the CPU, `init_dist` starts a gloo group (and sets the default
dtype to bfloat16 as the script's does), `dist.all_gather_into_tensor` gathers through a list (gloo takes
no stacked output), `bench` times with `time.perf_counter` and `bench_kineto` (kernel times from the CUDA
profiler) reports NaN without running the calls that use receive hooks (each of them multiplies two
8192 x 8192 matrices). Its checks are unchanged, so a run that ends without an error has passed them.
"""
import argparse
import functools
import importlib
import math
import os
import subprocess
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


def _init_dist(local_rank: int, num_local_ranks: int):
    address, port = os.getenv("MASTER_ADDR", "127.0.0.1"), int(os.getenv("MASTER_PORT", "8361"))
    dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", world_size=num_local_ranks,
                            rank=local_rank)
    torch.set_default_dtype(torch.bfloat16)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // num_local_ranks))
    return dist.get_rank(), dist.get_world_size(), dist.new_group(list(range(num_local_ranks)))


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
    if not (isinstance(fn, functools.partial) and fn.keywords.get("return_recv_hook")):
        fn()
    one = [math.nan] * num_kernels_per_period if num_kernels_per_period > 1 else math.nan
    return tuple(one for _ in kernel_names) if isinstance(kernel_names, tuple) else one


def _gather_into(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    return dist.all_gather(list(output.view(-1, *input.shape).unbind(0)), input, group=group, async_op=async_op)


def _run_on_cpu(local_rank: int, num_local_ranks: int, args: argparse.Namespace, tests_dir: str, script: str) -> None:
    sys.path[:0] = [tests_dir, REPO]
    import utils
    utils.init_dist, utils.bench, utils.bench_kineto = _init_dist, _bench, _bench_kineto
    module = importlib.import_module(script)
    for name, replacement in (("init_dist", _init_dist), ("bench", _bench), ("bench_kineto", _bench_kineto)):
        if hasattr(module, name):
            setattr(module, name, replacement)
    dist.all_gather_into_tensor = _gather_into
    with _CudaOnCpu():
        module.test_loop(local_rank, num_local_ranks, args)


def _script_arguments(tests_dir: str, script: str, argv) -> argparse.Namespace:
    """The script's own argument parser (the statements that build it under `__main__`), applied to argv."""
    source = open(os.path.join(tests_dir, script + ".py")).read()
    start = source.index("    parser = argparse.ArgumentParser")
    end = source.index("    args = parser.parse_args()")
    namespace = {"argparse": argparse}
    exec("def make_parser():\n" + source[start:end] + "    return parser\n", namespace)
    return namespace["make_parser"]().parse_args(argv)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="run on CPU tensors over gloo even with GPUs")
    parser.add_argument("tests_dir", help="DeepEP's tests folder (V1 line: test_*.py and utils.py)")
    parser.add_argument("script", choices=["test_intranode", "test_low_latency"])
    ours, rest = parser.parse_known_args()
    tests_dir = os.path.abspath(ours.tests_dir)
    if not ours.cpu and torch.cuda.is_available():
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, tests_dir, os.environ.get("PYTHONPATH", "")]))
        return subprocess.call([sys.executable, os.path.join(tests_dir, ours.script + ".py"), *rest], env=env)
    args = _script_arguments(tests_dir, ours.script, rest)
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    torch.multiprocessing.spawn(_run_on_cpu, args=(args.num_processes, args, tests_dir, ours.script),
                                nprocs=args.num_processes)
    print(f"{ours.script}: every check passed on CPU ({args.num_processes} ranks, gloo)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
