"""The reference transport against the hand-written baseline (permute + `all_to_all_single`), CPU tensors on
a gloo group: `python -m deep_ep.bench` run several times per shape and rank count, each row's ratio
ours / baseline taken within a run (the two take turns call by call), then the median over runs with the
spread. The ratios come from the calls timed back to back; the benchmark's series of calls each after a
barrier, which they do not use, is skipped (`--no-isolated`: half the time of a run).

  python benchmarks/reference_vs_baseline.py [--runs 5] [--iters 100] [--ranks 2 4 8] [--shapes cpu large]
                                             [--json FILE]

Shapes: `cpu` is the benchmark's CPU default (512 tokens, hidden 1024, top-8, 64 experts; low latency 64
tokens, 64 experts), `large` 2048 tokens and hidden 4096 (low latency 128 tokens). Threads as the benchmark
sets them (the cores shared between the ranks). Prints one table per (shape, ranks), writes the figures to
`--json` if given, and exits 1 if a run failed or a row's median ratio is above `--limit` (default 1.15).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {"cpu": [], "large": ["--tokens", "2048", "--hidden", "4096", "--ll-tokens", "128"]}


def _run(ranks: int, shape: str, iters: int) -> Dict[str, float]:
    """One benchmark run: ratio ours / baseline by row label."""
    command = [sys.executable, "-m", "deep_ep.bench", "--device", "cpu", "--transport", "reference", "--json",
               "--no-isolated", "--num-ranks", str(ranks), "--iters", str(iters), *SHAPES[shape]]
    done = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    report = json.loads(done.stdout)
    return {entry["label"]: entry["ratio_vs_baseline"] for entry in report["ops"].values()
            if entry.get("ratio_vs_baseline") is not None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--iters", type=int, default=100, help="timed calls per row and run (default 100)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--limit", type=float, default=1.15, help="the highest median ratio that passes")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    over = False
    records = []
    for shape in args.shapes:
        for ranks in args.ranks:
            ratios: Dict[str, List[float]] = {}
            for _ in range(args.runs):
                for label, ratio in _run(ranks, shape, args.iters).items():
                    ratios.setdefault(label, []).append(ratio)
            print(f"\nshape {shape}, {ranks} ranks: ours / baseline, median of {args.runs} runs "
                  f"({args.iters} timed calls each)")
            print(f"{'operation':22s} {'median':>7s} {'min':>6s} {'max':>6s}  runs")
            for label, values in ratios.items():
                median = statistics.median(values)
                over |= median > args.limit
                records.append(dict(shape=shape, ranks=ranks, operation=label, median=median, runs=values))
                print(f"{label:22s} {median:7.2f} {min(values):6.2f} {max(values):6.2f}  "
                      + " ".join(f"{v:.2f}" for v in values))
    if args.json:
        import torch
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, stdout=subprocess.PIPE,
                                text=True).stdout.strip()
        args.json.write_text(json.dumps(dict(
            figure="reference transport time / baseline time per call (ours and the baseline taking turns)",
            date=datetime.date.today().isoformat(), commit=commit, cpus=os.cpu_count(),
            machine=platform.processor() or platform.machine(), torch=torch.__version__,
            command="python benchmarks/reference_vs_baseline.py " + " ".join(sys.argv[1:]),
            runs=args.runs, iters=args.iters, records=records), indent=1) + "\n")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
