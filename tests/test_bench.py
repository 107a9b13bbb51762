"""The benchmark command (`python -m deep_ep.bench`) on CPU with a tiny shape and 2 gloo ranks."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import textwrap
from typing import List

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--num-ranks", "2", "--device", "cpu", "--tokens", "64", "--hidden", "256", "--topk", "4",
        "--experts", "8", "--ll-tokens", "16", "--ll-experts", "8", "--warmup", "1", "--iters", "2"]
ALL_OPS = {"layout", "dispatch_bf16", "dispatch_fp8", "dispatch_cached", "dispatch_cached_fp8", "combine",
           "ll_dispatch_fp8", "ll_dispatch_bf16", "ll_combine"}


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("DEEP_EP_TRANSPORT", None)
    return env


def _bench(*extra: str, script: str = None, timeout: float = 120) -> subprocess.CompletedProcess:
    command = [sys.executable, script] if script else [sys.executable, "-m", "deep_ep.bench"]
    return subprocess.run(command + TINY + list(extra), capture_output=True, text=True, timeout=timeout,
                          env=_env(), cwd=ROOT)


def test_bench_json_cpu():
    proc = _bench("--json")
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    report = json.loads(proc.stdout)
    assert report["ok"] is True
    assert report["verification"]["passed"] is True
    assert len(report["verification"]["checks"]) >= 8
    config = report["config"]
    assert config["num_ranks"] == 2 and config["device"] == "cpu" and config["backend"] == "gloo"
    assert config["transport"] and config["tokens"] == 64 and config["hidden"] == 256
    assert set(report["ops"]) == ALL_OPS
    for name, op in report["ops"].items():
        assert op["time_us"] > 0 and op["time_us_max_rank"] >= op["time_us"] and op["isolated_us"] > 0, name
        assert len(op["time_us_per_rank"]) == 2 and all(t > 0 for t in op["time_us_per_rank"]), name
        # on CPU a call's host time is its time; GPU busy time exists only on GPUs
        assert op["host_us"] == pytest.approx(op["time_us"]) and op["kernel_us"] is None, name
        if name == "layout":
            assert op["bytes"] is None and op["baseline"] is None
            continue
        assert op["bytes"] > 0 and op["gbps"] > 0, name
        assert op["baseline"]["time_us"] > 0 and op["baseline"]["gbps"] > 0, name
        assert op["ratio_vs_baseline"] == pytest.approx(op["time_us"] / op["baseline"]["time_us"]), name
    # DeepEP's logical bytes: FP8 dispatch = BF16 bytes * (1 + 4/128) / 2; combine = BF16 dispatch bytes
    ops = report["ops"]
    assert ops["dispatch_fp8"]["bytes"] == int(ops["dispatch_bf16"]["bytes"] * (1 + 4 / 128) / 2)
    assert ops["dispatch_cached_fp8"]["bytes"] == ops["dispatch_fp8"]["bytes"]
    assert ops["combine"]["bytes"] == ops["dispatch_bf16"]["bytes"] == ops["dispatch_cached"]["bytes"]
    assert ops["ll_combine"]["bytes"] == ops["ll_dispatch_bf16"]["bytes"]
    selections = ops["ll_dispatch_bf16"]["bytes"] // (2 * 256)
    assert ops["ll_dispatch_fp8"]["bytes"] == selections * (256 + 2 * 4 + 16)
    # the table goes to stderr with --json, with one progress line per phase
    assert "ours/baseline" in proc.stderr and "verification: passed" in proc.stderr
    assert proc.stderr.count("[deep_ep.bench] [") == 10


def test_bench_without_the_isolated_series():
    """--no-isolated: the calls timed back to back and their ratios only; the isolated column is absent."""
    proc = _bench("--json", "--no-isolated", "--mode", "low-latency")
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    report = json.loads(proc.stdout)
    assert report["verification"]["passed"] is True
    for name, op in report["ops"].items():
        assert op["isolated_us"] is None and op["time_us"] > 0, name
        assert op["ratio_vs_baseline"] == pytest.approx(op["time_us"] / op["baseline"]["time_us"]), name


def test_bench_profile_cpu():
    """--profile: each timed operation's host time per call by function, ours beside the baseline's."""
    proc = _bench("--json", "--profile", "--mode", "normal")
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    ops = json.loads(proc.stdout)["ops"]
    for name in ("dispatch_bf16", "dispatch_cached", "combine"):
        for functions in (ops[name]["functions"], ops[name]["baseline_functions"]):
            (label, total, calls), *rest = functions
            assert label == "total" and total > 0 and calls == 1 and rest, name
            assert all(0 <= us <= total for _, us, _ in rest), name
            assert rest == sorted(rest, key=lambda row: -row[1]), name
    assert any("all_to_all_single" in row[0] for row in ops["combine"]["baseline_functions"])
    for name in ("dispatch_bf16", "dispatch_cached", "combine"):   # own time by tensor operation
        for op_times in (ops[name]["tensor_op_times"], ops[name]["baseline_tensor_op_times"]):
            (label, total, calls), *rest = op_times
            assert label == "total" and total > 0 and calls == 1 and rest, name
            assert all(0 <= us <= total + 1e-6 and count > 0 for _, us, count in rest), name
            assert rest == sorted(rest, key=lambda row: -row[1]), name
        assert any(row[0] == "c10d::alltoall_base_" for row in ops[name]["baseline_tensor_op_times"]), name
    for name in ("dispatch_bf16", "dispatch_cached", "combine"):   # the baseline's, at least: a gather, an exchange
        assert ops[name]["tensor_ops"] > 0 and ops[name]["baseline_tensor_ops"] >= 2, name
    assert "dispatch BF16 [ours]" in proc.stderr and "dispatch BF16 [baseline]" in proc.stderr
    assert "; all other functions" in proc.stderr.split("dispatch BF16 [ours]")[1].splitlines()[0]


def test_bench_plot(tmp_path):
    pytest.importorskip("matplotlib")
    target = tmp_path / "bench.png"
    proc = _bench("--mode", "normal", "--plot", str(target))
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "dispatch BF16" in proc.stdout
    assert target.exists() and target.stat().st_size > 1000
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_checks_the_outputs_of_the_timed_calls(tmp_path):
    # combine right for the untimed calls that check it (one per input), wrong from then on
    script = tmp_path / "late_broken_combine.py"
    script.write_text(textwrap.dedent("""
        import sys
        import deep_ep.buffer

        _combine = deep_ep.buffer.Buffer.combine
        calls = [0]

        def combine(self, *args, **kwargs):
            calls[0] += 1
            combined_x, combined_w, event = _combine(self, *args, **kwargs)
            return (combined_x if calls[0] <= 3 else combined_x + 1), combined_w, event

        deep_ep.buffer.Buffer.combine = combine

        if __name__ == "__main__":
            from deep_ep.bench import main
            sys.exit(main(sys.argv[1:]))
    """))
    proc = _bench("--mode", "normal", "--json", script=str(script))
    assert proc.returncode == 1, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "combine BF16: the outputs of the timed calls FAILED" in proc.stderr, proc.stderr


def test_bench_fails_loudly_on_a_wrong_result(tmp_path):
    # The spawned ranks re-import the launching script, so this patch reaches every rank.
    script = tmp_path / "broken_combine.py"
    script.write_text(textwrap.dedent("""
        import sys
        import deep_ep.buffer

        _combine = deep_ep.buffer.Buffer.combine

        def combine(self, *args, **kwargs):
            combined_x, combined_w, event = _combine(self, *args, **kwargs)
            return combined_x * 2, combined_w, event

        deep_ep.buffer.Buffer.combine = combine

        if __name__ == "__main__":
            from deep_ep.bench import main
            sys.exit(main(sys.argv[1:]))
    """))
    proc = _bench("--mode", "normal", "--json", script=str(script))
    assert proc.returncode == 1, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "combine BF16 FAILED" in proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is False and report["verification"]["passed"] is False


def test_bench_rejects_bad_arguments(capsys):
    from deep_ep.bench import main
    with pytest.raises(SystemExit) as exit_info:
        main(TINY + ["--experts", "7"])
    assert exit_info.value.code == 2
    assert "--experts (7) must be a multiple of --num-ranks (2)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(TINY + ["--num-sms", "3"])
    assert exit_info.value.code == 2


def test_bench_plot_without_matplotlib(tmp_path, monkeypatch, capsys):
    import builtins
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    from deep_ep.bench import main
    assert main(TINY + ["--plot", str(tmp_path / "x.png")]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err


def test_sweep_normal_cpu():
    """benchmarks/sweep_normal.py: one line of figures per setting; a setting that breaks the run says so, and so
    does one past the timeout (the sweep goes on)."""
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "sweep_normal.py"), "--iters", "2", "--device", "cpu",
               "--setting", "", "--setting", "DEEP_EP_TRANSPORT=no-such-transport"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    defaults = next(line for line in lines if "(defaults)" in line)
    for label in ("BF16", "FP8", "combine", "layout"):
        assert f"{label} " in defaults, defaults
    broken = next(line for line in lines if "no-such-transport" in line)
    assert "FAILED" in broken, broken
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "sweep_normal.py"), "--device", "cpu", "--timeout",
               "0.5", "--num-sms", "24", "16"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    killed = [line for line in proc.stdout.splitlines() if "FAILED (killed after 0.5 s)" in line]
    assert len(killed) == 2, proc.stdout


def test_reference_vs_baseline_merges_its_records(tmp_path):
    """benchmarks/reference_vs_baseline.py --json: each (shape, ranks, operation) record replaces an older one of
    the same key and names its own commit; records of other keys stay; --add-runs joins the runs of a record of
    the same commit (not of another)."""
    path = tmp_path / "rvb.json"
    other = dict(shape="large", ranks=8, operation="dispatch BF16", median=1.0, runs=[1.0])
    path.write_text(json.dumps(dict(commit="aaaaaaa", records=[other])))
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "reference_vs_baseline.py"), "--runs", "1",
               "--iters", "2", "--ranks", "2", "--shapes", "cpu", "--limit", "1000", "--json", str(path)]

    def run(*more: str) -> List[dict]:
        proc = subprocess.run(command + list(more), capture_output=True, text=True, timeout=300, env=_env(),
                              cwd=ROOT)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return json.loads(path.read_text())["records"]

    run("--commit", "bbbbbbb")
    records = run("--commit", "ccccccc", "--add-runs")   # (another commit's runs are not joined)
    assert [r for r in records if r["shape"] == "large"] == [dict(other, commit="aaaaaaa")]
    mine = [r for r in records if r["shape"] == "cpu"]
    assert {r["operation"] for r in mine} >= {"dispatch BF16", "cached dispatch BF16", "LL combine BF16"}
    assert len(mine) == len({r["operation"] for r in mine})
    assert all(r["commit"] == "ccccccc" and r["ranks"] == 2 and len(r["runs"]) == 1 and r["median"] > 0
               for r in mine)
    joined = [r for r in run("--commit", "ccccccc", "--add-runs") if r["shape"] == "cpu"]
    first = {r["operation"]: r for r in mine}
    for record in joined:
        runs = record["runs"]
        assert len(runs) == 2 and runs[0] == first[record["operation"]]["runs"][0], record
        assert record["median"] == round(statistics.median(runs), 3)
        assert record["command"].count("--add-runs") == 2, record["command"]
