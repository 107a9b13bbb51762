"""The reference transport against the hand-written baseline (permute + `all_to_all_single`), CPU tensors on
a gloo group: `python -m deep_ep.bench` run several times per shape and rank count, each row's ratio
ours / baseline taken within a run (the two take turns call by call), then the median over runs with the
spread. The ratios come from the calls timed back to back; the benchmark's series of calls each after a
barrier, which they do not use, is skipped (`--no-isolated`: half the time of a run).

  python benchmarks/reference_vs_baseline.py [--runs 5] [--iters 100] [--ranks 2 4 8] [--shapes cpu large]
                                             [--json FILE]

Shapes: `cpu` is the benchmark's CPU default (512 tokens, hidden 1024, top-8, 64 experts; low latency 64
tokens, 64 experts), `large` 2048 tokens and hidden 4096 (low latency 128 tokens). Threads as the benchmark
sets them (the cores shared between the ranks). Prints one table per (shape, ranks) and exits 1 if a run failed
or a row's median ratio is above `--limit` (default 1.15). With `--json FILE`, the figures go into FILE after each
(shape, ranks), merged with what it holds: a record per (shape, ranks, operation), each with its commit, date,
machine, torch version and command, replacing an older one of the same key (so one file gathers the latest
figures of calls made at different times; `--commit` names the code where `git` cannot, e.g. in a copy of
the tree). With `--add-runs` the runs join those of the file's record of the same key where it names the same
commit, machine and timed calls (a set of runs longer than one invocation may take, made in parts), and the
median is taken over all of them.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

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
    parser.add_argument("--json", type=Path, help="merge the figures into this file (see above)")
    parser.add_argument("--commit", help="the commit the records name (default: git rev-parse --short HEAD)")
    parser.add_argument("--machine", help="the machine the records name (default: its processor and cores)")
    parser.add_argument("--add-runs", action="store_true",
                        help="join the runs of --json's records of the same commit and machine (see above)")
    args = parser.parse_args()
    if args.add_runs and not args.json:
        parser.error("--add-runs needs --json FILE (the records whose runs it joins)")
    over = False
    about = _about(args) if args.json else {}
    for shape in args.shapes:
        for ranks in args.ranks:
            ratios: Dict[str, List[float]] = {}
            for _ in range(args.runs):
                for label, ratio in _run(ranks, shape, args.iters).items():
                    ratios.setdefault(label, []).append(round(ratio, 3))
            earlier = _earlier_records(args.json, about, shape, ranks) if args.add_runs else {}
            records = []
            for label, values in ratios.items():
                before = earlier.get(label, {})
                values = before.get("runs", []) + values
                median = statistics.median(values)
                over |= median > args.limit
                record = dict(shape=shape, ranks=ranks, operation=label, median=round(median, 3), runs=values)
                if about:   # (the command of joined runs: each invocation's in turn)
                    record.update(about, command=" && ".join(filter(None, [before.get("command"), about["command"]])))
                records.append(record)
            print(f"\nshape {shape}, {ranks} ranks: ours / baseline, median of "
                  f"{max(len(r['runs']) for r in records)} runs ({args.iters} timed calls each)")
            print(f"{'operation':22s} {'median':>7s} {'min':>6s} {'max':>6s}  runs")
            for record in records:
                values = record["runs"]
                print(f"{record['operation']:22s} {record['median']:7.2f} {min(values):6.2f} {max(values):6.2f}  "
                      + " ".join(f"{v:.2f}" for v in values))
            if args.json:
                _merge(args.json, records)
    return 1 if over else 0


def _about(args: argparse.Namespace) -> Dict[str, object]:
    """What every record of this invocation names besides its figures."""
    import torch
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                           stdout=subprocess.PIPE, text=True).stdout.strip()
    machine = args.machine or f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    return dict(commit=commit, date=datetime.date.today().isoformat(), machine=machine, cpus=os.cpu_count(),
                torch=torch.__version__, iters=args.iters,
                command=shlex.join(["python", "benchmarks/reference_vs_baseline.py", *sys.argv[1:]]))


_FIGURE = "reference transport time / baseline time per call (ours and the baseline taking turns)"


def _records(path: Optional[Path]) -> List[Dict[str, object]]:
    """The records of the file at `path` (none if there is none); records of a file written before records
    carried their own commit get the file's."""
    if path is None or not path.exists():
        return []
    old = json.loads(path.read_text())
    shared = {k: v for k, v in old.items() if k in ("commit", "date", "machine", "cpus", "torch", "iters", "command")}
    return [{**shared, **record} for record in old.get("records", [])]


def _earlier_records(path: Optional[Path], about: Dict[str, object], shape: str, ranks: int
                     ) -> Dict[str, Dict[str, object]]:
    """The records of `path` for (shape, ranks) by operation whose runs `--add-runs` joins: those of the same
    commit, machine and timed calls as this invocation's."""
    same = ("commit", "machine", "iters")
    return {r["operation"]: r for r in _records(path)
            if r["shape"] == shape and r["ranks"] == ranks and all(r.get(k) == about[k] for k in same)}


def _merge(path: Path, records: List[Dict[str, object]]) -> None:
    """`records` into the file at `path`, replacing its records of the same (shape, ranks, operation)."""
    new_keys = {(r["shape"], r["ranks"], r["operation"]) for r in records}
    kept = [r for r in _records(path) if (r["shape"], r["ranks"], r["operation"]) not in new_keys] + records
    kept.sort(key=lambda r: (str(r["shape"]), int(r["ranks"])))
    path.write_text(json.dumps(dict(figure=_FIGURE, records=kept), indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
