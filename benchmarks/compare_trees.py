"""This tree against an earlier one, in one run on one GPU: identical outputs, kernel time and host time.

  python benchmarks/compare_trees.py OLD_ROOT [--parts hashes host ll normal] [--rounds 3]

OLD_ROOT holds an earlier commit's `deep_ep/` (e.g. `git worktree add OLD_ROOT COMMIT`, or `git archive COMMIT
deep_ep | tar -x -C OLD_ROOT`). Both packages run this tree's scripts, which use only the public API, so any
difference comes from the package:
  hashes: benchmarks/output_hashes.py on each package (fixed seed; every operation, both transports, the NVLink
          protocols forced each way), the two outputs compared line by line;
  host:   benchmarks/host_overhead.py --ranks 1 (host time to enqueue each call, per form of its stream arguments);
  ll:     benchmarks/ll_kernel_times.py (one rank: low-latency kernels per operation, graph replays);
  normal: python -m deep_ep.bench --mode normal, 2 ranks sharing the GPU, kernel time per operation, with a
          buffer that every share fits (direct protocol) and with the size hint's (rings).
Timed parts run `--rounds` times, the two packages alternating; each figure is the median over rounds, and
the table gives new / old. Prints the table last; exits 1 if the hashes differ.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Tuple

HERE = Path(__file__).resolve().parent
NEW_ROOT = HERE.parent
PARTS = ("hashes", "host", "ll", "normal")


def _run(root: Path, args: List[str], timeout_s: float) -> str:
    """stdout of `python args...` run in `root`, with its deep_ep first on the path (stderr passed through);
    script paths are this tree's."""
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    args = [str(NEW_ROOT / arg) if arg.endswith(".py") else arg for arg in args]
    done = subprocess.run([sys.executable, *args], cwd=root, env=env, stdout=subprocess.PIPE, text=True,
                          timeout=timeout_s)
    if done.returncode:
        raise RuntimeError(f"{' '.join(args)} with {root} exited {done.returncode}:\n{done.stdout[-2000:]}")
    return done.stdout


_HOST_JSON = Path(tempfile.gettempdir()) / f"deep_ep_compare_trees_host_{os.getpid()}.json"


def _host_figures(_text: str) -> Dict[str, float]:
    """host_overhead.py's records (its --json file): host us per call by operation and stream arguments."""
    records = json.loads(_HOST_JSON.read_text())["records"]
    return {f"{r['operation']} ({r['flags']}): host": r["host_us"] for r in records if r["host_us"] is not None}


def _ll_figures(text: str) -> Dict[str, float]:
    """ll_kernel_times.py's rows: graph replay time and kernel time per operation, per token count."""
    figures: Dict[str, float] = {}
    for line in text.splitlines():
        words = line.split()
        if len(words) < 2 or not words[0].isdigit():
            continue
        tokens = words[0]
        figures[f"LL {tokens} tokens: graph replay"] = float(words[1])
        for name, value in zip(words[2::2], words[3::2]):
            if name in ("dispatch", "combine"):
                figures[f"LL {tokens} tokens: {name} kernels"] = float(value)
    return figures


def _normal_figures(text: str, label: str) -> Dict[str, float]:
    """The benchmark's JSON: kernel time per call of each normal-mode operation (rank 0)."""
    report = json.loads(text[text.index("{"):])
    return {f"{label}: {entry['label']} kernels": entry["kernel_us"]
            for entry in report.get("ops", {}).values() if entry.get("kernel_us")}


def _ratio_table(figures: Dict[str, Dict[str, List[float]]]) -> List[str]:
    """One line per figure measured in both trees: medians over the rounds and new / old."""
    if not figures["new"]:
        return []
    lines = [f"{'figure (us, median of rounds)':52s} {'old':>9s} {'new':>9s} {'new/old':>8s}"]
    for name, values in figures["new"].items():
        old = figures["old"].get(name)
        if old:
            before, after = statistics.median(old), statistics.median(values)
            lines.append(f"{name:52s} {before:9.1f} {after:9.1f} {after / before:8.3f}")
    return lines


def _timed_parts(parts: List[str]) -> List[Tuple[str, List[str], float, object]]:
    runs = []
    if "host" in parts:
        host = ["benchmarks/host_overhead.py", "--ranks", "1", "--calls", "200", "--json", str(_HOST_JSON)]
        runs.append(("host", host, 600, _host_figures))
    if "ll" in parts:
        runs.append(("ll", ["benchmarks/ll_kernel_times.py", "--replays", "100"], 300, _ll_figures))
    if "normal" in parts:
        bench = ["-m", "deep_ep.bench", "--num-ranks", "2", "--mode", "normal", "--num-sms", "24", "--kernels",
                 "--json", "--warmup", "3", "--iters", "20"]
        runs.append(("normal direct", bench + ["--nvl-bytes", "2000000000"], 400,
                     lambda text: _normal_figures(text, "direct")))
        runs.append(("normal rings", bench, 400, lambda text: _normal_figures(text, "rings")))
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old_root", type=Path)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keep", type=Path, help="a folder to keep the two hash outputs in (old.txt, new.txt)")
    args = parser.parse_args()
    roots = {"old": args.old_root.resolve(), "new": NEW_ROOT}
    lines: List[str] = []
    failed = False
    if "hashes" in args.parts:
        with tempfile.TemporaryDirectory() as scratch:
            folder = args.keep or Path(scratch)
            folder.mkdir(parents=True, exist_ok=True)
            outputs = {}
            for which, root in roots.items():
                outputs[which] = folder / f"{which}.txt"
                outputs[which].write_text(_run(root, ["benchmarks/output_hashes.py"], 600))
                print(f"hashes ({which}): {outputs[which].read_text().splitlines()[-1]}", flush=True)
            compared = subprocess.run([sys.executable, str(HERE / "output_hashes.py"), "--compare",
                                       str(outputs["old"]), str(outputs["new"])], stdout=subprocess.PIPE, text=True)
            lines.append(compared.stdout.rstrip())
            failed = compared.returncode != 0
    figures: Dict[str, Dict[str, List[float]]] = {"old": {}, "new": {}}
    for round_ in range(args.rounds):
        for title, command, timeout_s, parse in _timed_parts(args.parts):
            for which in (("old", "new") if round_ % 2 == 0 else ("new", "old")):
                text = _run(roots[which], command, timeout_s)
                for name, value in parse(text).items():
                    figures[which].setdefault(name, []).append(value)
            print(f"round {round_ + 1} {title} done; so far:\n" + "\n".join(_ratio_table(figures)), flush=True)
    lines += _ratio_table(figures)
    print("\n".join(lines))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
