"""Normal-mode settings compared in one run: `python -m deep_ep.bench --mode normal` once per setting (a
setting is a set of environment variables, e.g. the NVLink transport's DEEP_EP_NVLINK_* knobs) and SM
count, then one line per run with the time (DeepEP's method) and the GPU time of each operation.

  python benchmarks/sweep_normal.py --num-sms 24 16 --setting "" --setting "DEEP_EP_NVLINK_DIRECT=0" \
      [--nvl-bytes 2000000000] [--iters 30] [--device auto|cpu|cuda] [--timeout 300]

A failed run (a verification error, a crash, or a run past --timeout, whose processes are then killed) prints its
last lines instead of figures, and the sweep goes on with the next.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from typing import Dict

OPS = (("dispatch_cached", "BF16"), ("dispatch_cached_fp8", "FP8"), ("combine", "combine"), ("layout", "layout"),
       ("dispatch_bf16", "BF16+wait"))


def _environment(setting: str) -> Dict[str, str]:
    env = dict(os.environ)
    for item in filter(None, setting.split(",")):
        name, _, value = item.partition("=")
        env[name.strip()] = value.strip()
    return env


def _run(setting: str, num_sms: int, args: argparse.Namespace) -> str:
    command = [sys.executable, "-m", "deep_ep.bench", "--mode", "normal", "--json", "--num-sms", str(num_sms),
               "--iters", str(args.iters), "--num-ranks", str(args.num_ranks), "--device", args.device]
    if args.nvl_bytes:
        command += ["--nvl-bytes", str(args.nvl_bytes)]
    label = f"{num_sms:3d} SMs  {setting or '(defaults)'}"
    # a session of its own: a run past the timeout is killed with the rank processes it started
    proc = subprocess.Popen(command, env=_environment(setting), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=args.timeout)
        status = f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=30)
        status = f"killed after {args.timeout:g} s"
    except BaseException:   # the sweep itself stopped (Ctrl-C, SIGTERM): its run must not go on without it
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    try:
        report = json.loads(stdout)
    except json.JSONDecodeError:
        report = None
    if proc.returncode or not report or not report.get("ok"):
        tail = "\n    ".join((stdout + stderr).strip().splitlines()[-6:])
        return f"{label}: FAILED ({status})\n    {tail}"
    cells = []
    for name, short in OPS:
        entry = report["ops"].get(name)
        if entry:
            kernel = entry.get("kernel_us_max_rank")
            cells.append(f"{short} {entry['time_us']:.1f}" + (f" [{kernel:.1f}]" if kernel else ""))
    return f"{label}: " + "  ".join(cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setting", action="append", default=None,
                        help="comma-separated NAME=VALUE environment variables; repeat for several (default: one "
                             "run with the defaults)")
    parser.add_argument("--num-sms", type=int, nargs="+", default=[24])
    parser.add_argument("--nvl-bytes", type=int, default=None)
    parser.add_argument("--num-ranks", type=int, default=2,
                        help="ranks (1: every row stays local, which isolates the kernels' local copies)")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="as the benchmark's")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # (as `timeout` stops it: the current run goes too)
    print("us per call: time (DeepEP's method, rank 0) [GPU busy time, max over ranks]", flush=True)
    for num_sms in args.num_sms:
        for setting in args.setting or [""]:
            print(_run(setting, num_sms, args), flush=True)


if __name__ == "__main__":
    main()
