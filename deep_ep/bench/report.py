"""The report: rank 0's figures gathered into one dict (printed as JSON with --json), as a table, as a bar chart."""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

# (name, label, mode) of every reported operation, in report order.
OPS = [
    ("layout", "get_dispatch_layout", "normal"),
    ("dispatch_bf16", "dispatch BF16", "normal"),
    ("dispatch_fp8", "dispatch FP8", "normal"),
    ("dispatch_cached", "cached dispatch BF16", "normal"),
    ("dispatch_cached_fp8", "cached dispatch FP8", "normal"),
    ("combine", "combine BF16", "normal"),
    ("ll_dispatch_fp8", "LL dispatch FP8", "low-latency"),
    ("ll_dispatch_bf16", "LL dispatch BF16", "low-latency"),
    ("ll_combine", "LL combine BF16", "low-latency"),
    # CUDA-graph replays and hook phases (GPU, with a transport that needs no host wait: NVLink)
    ("ll_dispatch_graph", "LL dispatch FP8 graph", "low-latency"),
    ("ll_combine_graph", "LL combine graph", "low-latency"),
    ("ll_round_trip_graph", "LL disp+comb graph", "low-latency"),
    ("ll_send_phase", "LL dispatch send/hook", "low-latency"),
    ("ll_recv_phase", "LL dispatch hook()", "low-latency"),
    ("ll_combine_send_phase", "LL combine send/hook", "low-latency"),
    ("ll_combine_recv_phase", "LL combine hook()", "low-latency"),
    ("ll_dispatch_1_token", "LL 1-token dispatch", "low-latency"),
    ("ll_combine_1_token", "LL 1-token combine", "low-latency"),
]


def summarise(plan: Dict[str, Any], result: Dict[str, Any], wall_s: float) -> Dict[str, Any]:
    """The JSON report: configuration, rank 0's figures (and every rank's times), verification."""
    per_rank = result["per_rank"]
    info = result["info"]
    ops: Dict[str, Any] = {}
    for name, label, mode in OPS:
        if name not in per_rank[0]:
            continue
        mine = per_rank[0][name]
        entry: Dict[str, Any] = dict(label=label, mode=mode, time_us=mine["time_us"], isolated_us=mine["isolated_us"],
                                     host_us=mine.get("host_us"), kernel_us=mine.get("kernel_us"),
                                     kernel_us_max_rank=max((r[name].get("kernel_us") or 0 for r in per_rank),
                                                            default=0) or None, kernels=mine.get("kernels"),
                                     functions=mine.get("functions"),
                                     baseline_functions=mine.get("baseline_functions"),
                                     tensor_ops=mine.get("tensor_ops"),
                                     baseline_tensor_ops=mine.get("baseline_tensor_ops"),
                                     tensor_op_times=mine.get("tensor_op_times"),
                                     baseline_tensor_op_times=mine.get("baseline_tensor_op_times"),
                                     time_us_max_rank=max(r[name]["time_us"] for r in per_rank),
                                     time_us_per_rank=[r[name]["time_us"] for r in per_rank],
                                     bytes=mine["bytes"],
                                     gbps=(mine["bytes"] / 1e9 / (mine["time_us"] / 1e6)) if mine["bytes"] else None,
                                     link_gbps=(mine["link_bytes"] / 1e9 / (mine["time_us"] / 1e6))
                                     if mine.get("link_bytes") else None)
        if mine["baseline_time_us"] is not None:
            b = mine["baseline_time_us"]
            entry["baseline"] = dict(time_us=b, time_us_max_rank=max(r[name]["baseline_time_us"] for r in per_rank),
                                     gbps=(mine["bytes"] / 1e9 / (b / 1e6)) if mine["bytes"] else None)
            entry["ratio_vs_baseline"] = mine["time_us"] / b
        else:
            entry["baseline"] = None
            entry["ratio_vs_baseline"] = None
        ops[name] = entry
    device_name = "cpu"
    if plan["device"] == "cuda":
        device_name = f"cuda ({torch.cuda.get_device_name(0)}, {min(plan['num_gpus'], plan['num_ranks'])} GPU(s))"
    config = dict(num_ranks=plan["num_ranks"], device=plan["device"], device_name=device_name,
                  backend=plan["backend"], transport=info.get("transport"), modes=plan["modes"],
                  tokens=plan["tokens"], hidden=plan["hidden"], topk=plan["topk"], experts=plan["experts"],
                  ll_tokens=plan["ll_tokens"], ll_experts=plan["ll_experts"],
                  num_sms=info.get("num_sms", plan["num_sms"]), nvl_bytes=info.get("nvl_bytes"),
                  copy_engine_peer_gbps=info.get("copy_engine_peer_gbps"),
                  copy_engine_peer_gbps_both_ways=info.get("copy_engine_peer_gbps_both_ways"),
                  warmup=plan["warmup"], iters=plan["iters"],
                  seed=plan["seed"], torch=torch.__version__)
    return dict(ok=True, config=config, ops=ops,
                verification=dict(passed=True, checks=result["checks"]),
                units=dict(time="microseconds, median over iters of calls back to back after one L2 flush, "
                                "the first call left out, as DeepEP's benchmark times them (rank 0 unless stated); "
                                "isolated_us: each call after a barrier; host_us: host time of a call; kernel_us: "
                                "GPU busy time per call (profiler)",
                           bandwidth="GB/s = DeepEP logical bytes / 1e9 / time"),
                wall_s=round(wall_s, 3))


def format_table(report: Dict[str, Any]) -> str:
    c = report["config"]
    lines = [f"deep_ep.bench: {c['num_ranks']} ranks on {c['device_name']}, group {c['backend']}, "
             f"transport {c['transport']}, torch {c['torch']}"]
    if "normal" in c["modes"]:
        lines.append(f"  normal:      {c['tokens']} tokens/rank, hidden {c['hidden']}, top-{c['topk']}, "
                     f"{c['experts']} experts, num_sms {c['num_sms']}, num_nvl_bytes {c['nvl_bytes']}")
    if "low-latency" in c["modes"]:
        lines.append(f"  low-latency: {c['ll_tokens']} tokens/rank, hidden {c['hidden']}, top-{c['topk']}, "
                     f"{c['ll_experts']} experts")
    flush = " and one L2 flush, first call left out (DeepEP's method)" if c["device"] == "cuda" else ""
    lines.append(f"  time: median of {c['iters']} calls back to back after {c['warmup']} warm-up{flush}, rank 0 (max "
                 "over ranks in brackets); kernel: GPU busy time per call (profiler, max over ranks); host: host "
                 "time of a call; isolated: calls each after a barrier")
    lines.append("  GB/s: DeepEP's logical bytes / 1e9 / time; baseline: permute + all_to_all_single, its calls "
                 "taking turns with ours")
    if c.get("copy_engine_peer_gbps"):
        both = c.get("copy_engine_peer_gbps_both_ways")
        both = f"{both:.0f} GB/s" if both else "not measured (the two copies did not overlap)"
        lines.append(f"  ceiling: copy engine to the peer GPU {c['copy_engine_peer_gbps']:.0f} GB/s one way alone, "
                     f"per direction both ways at once {both}; link GB/s = bytes sent to other ranks / time")
    header = ("operation", "time us", "(max rank)", "kernel us", "host us", "isolated us", "GB/s", "link GB/s",
              "baseline us", "base GB/s", "ours/baseline")
    widths = (22, 9, 11, 10, 9, 12, 9, 10, 12, 10, 14)
    fmt = lambda cells: "".join(str(v).rjust(w) if i else str(v).ljust(w)  # noqa: E731
                                for i, (v, w) in enumerate(zip(cells, widths)))
    lines.append(fmt(header))
    lines.append("-" * sum(widths))

    def num(value: Optional[float], digits: int = 1) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    for entry in report["ops"].values():
        b = entry["baseline"] or {}
        lines.append(fmt((entry["label"], num(entry["time_us"]), f"({num(entry['time_us_max_rank'])})",
                          num(entry.get("kernel_us_max_rank")), num(entry.get("host_us")), num(entry["isolated_us"]),
                          num(entry["gbps"], 2), num(entry.get("link_gbps"), 1), num(b.get("time_us")),
                          num(b.get("gbps"), 2), num(entry["ratio_vs_baseline"], 2))))
    v = report["verification"]
    lines.append(f"verification: {'passed' if v['passed'] else 'FAILED'} ({len(v['checks'])} checks); "
                 f"wall time {report['wall_s']:.1f} s")
    return "\n".join(lines)


def format_kernels(report: Dict[str, Any]) -> str:
    """Rank 0's kernels per operation, longest first (GPU runs; empty on CPU)."""
    lines = []
    for entry in report["ops"].values():
        kernels = entry.get("kernels")
        if kernels:
            parts = sorted(kernels.items(), key=lambda item: -item[1])
            lines.append(f"{entry['label']}: " + ", ".join(f"{name} {us:.1f}" for name, us in parts))
    return "\n".join(lines)


def format_functions(report: Dict[str, Any], top: int = 8) -> str:
    """Rank 0's host time per operation by function (cProfile's own time, us per call), its tensor operations
    per call and their own time by operator (torch.profiler), ours beside the baseline's (runs with --profile)."""
    lines = []
    for entry in report["ops"].values():
        for who, functions, tensor_ops in (("ours", entry.get("functions"), entry.get("tensor_ops")),
                                           ("baseline", entry.get("baseline_functions"),
                                            entry.get("baseline_tensor_ops"))):
            if not functions:
                continue
            total, *rest = functions
            parts = ", ".join(f"{name} {us:.0f} ({calls:g}x)" for name, us, calls in rest[:top])
            others = total[1] - sum(us for _, us, _ in rest[:top])
            lines.append(f"{entry['label']} [{who}] {total[1]:.0f} us/call, {tensor_ops} tensor operations: {parts}; "
                         f"all other functions {others:.0f}")
        for who, op_times in (("ours", entry.get("tensor_op_times")),
                              ("baseline", entry.get("baseline_tensor_op_times"))):
            if not op_times:
                continue
            total, *rest = op_times
            parts = ", ".join(f"{name} {us:.0f} ({calls:g}x)" for name, us, calls in rest[:top])
            lines.append(f"{entry['label']} [{who}] tensor operations' own time {total[1]:.0f} us/call: {parts}")
    return "\n".join(lines)


def write_plot(report: Dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    entries = list(report["ops"].values())
    labels = [e["label"] for e in entries]
    ours = [e["time_us"] for e in entries]
    baseline = [e["baseline"]["time_us"] if e["baseline"] else 0.0 for e in entries]
    positions = range(len(entries))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(entries)), 4.5))
    width = 0.4
    ax.bar([p - width / 2 for p in positions], ours, width, label="deep_ep")
    ax.bar([p + width / 2 for p in positions], baseline, width, label="permute + all_to_all_single")
    ax.set_xticks(list(positions))
    ax.set_xticklabels(labels, rotation=30, ha="right")
    ax.set_ylabel("time per call, us (median, rank 0)")
    c = report["config"]
    ax.set_title(f"deep_ep.bench: {c['num_ranks']} ranks, {c['device']} / {c['backend']}, transport {c['transport']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
