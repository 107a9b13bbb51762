#!/usr/bin/env bash
# One call on the GPU machine: the benchmark (alone on the GPUs), then the GPU tests in concurrent groups
# (Triton compiles on many CPU cores at once); a short table last. Installs nothing (the machine's torch and
# Triton are used); run from the repository root.
# Usage: bash benchmarks/gpu_run.sh [seconds for the tests, default 500] [parts, default "bench normal ll other"]
#   bench: on 2 GPUs (transport forced to nvlink, a 60 s timeout for the library's waits, 240 s a run, so a
#          hang costs one run, not the call), in order of need: normal and low-latency mode at 24 SMs, low-latency
#          normal mode on the rings (hint-sized buffer), at 16 and 8 SMs, then the direct protocol's stage sizes (benchmarks/sweep_normal.py).
#          On one GPU: low-latency kernel times on one rank (benchmarks/ll_kernel_times.py), their
#          synchronisation steps (benchmarks/ll_fixed_costs.py),
#          and short runs with both ranks on the GPU, which check the benchmark's code paths (their times say
#          nothing of NVLink)
#   normal: tests/test_nvlink.py and test_nvlink_launch.py in groups (the stress runs apart: on one GPU each of
#   its two runs takes 2.5 minutes alone), and the comparisons again with the rings only; ll: the
#   low-latency tests (ll-compare: the comparisons with the reference; ll-variants: the 2-rank comparison with
#   DEEP_EP_LL_FUSED=0, part of ll on 2 GPUs; ll-other: the rest; on one GPU they run one
#   after the other, so there a call of at most 10 minutes takes one of them);
#   other: the rest of the suite (on one GPU, beside normal, tests/test_normal.py does not finish within 10 minutes)
#   shrink: the automatic-masking test of tests/test_low_latency.py fifteen times, three at once, each with a
#           fresh seed (its timing differs from run to run; three at once made a since-fixed race show up in 5 of
#           18 runs instead of 1 in 5)
#   clients: the tests of the frameworks' call patterns, in one group (Megatron's autograd functions, slime's
#            32-byte rows, DeepGEMM's padded scales and chained events in the 2-rank normal cases, Buffers over
#            gloo groups (and mixed-backend ones on 2 GPUs), calls and hooks on other threads (a device change
#            on 2 GPUs only), a low-latency graph between normal calls)
#   deepep: DeepEP's own V1 test scripts against this package (benchmarks/deepep_tests.py; a copy of DeepEP's V1
#           tests folder in _deepep_tests/), after the benchmark and before the tests: test_intranode and
#           test_low_latency at 2 ranks (2 GPUs; on one GPU both ranks share it, small shapes),
#           test_low_latency --shrink-test at 8 ranks sharing the GPUs
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" DEEP_EP_TEST_TIMEOUT_S=500 DEEP_EP_TEST_BUFFER_TIMEOUT_S=60
out="${OUT:-$(mktemp -d)}"
limit="${1:-500}"
parts="${2:-bench normal ll other}"
has() { [[ " $parts " == *" $1 "* ]]; }

nvidia-smi topo -m 2>&1 | head -n 4
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', $gpus)"
if [ "$gpus" -ge 2 ]; then   # the NVLink transport needs native peer atomics ('auto' falls back to the reference)
    python3 -c "from deep_ep.utils import native_peer_atomics as ok; print('peer atomics 0-1:', ok(0, 1))"
fi

bench_status=0
bench() {   # title, then benchmark arguments; every run appends to bench.txt (with the settings in $bench_env)
    echo "=== $1" >> "$out/bench.txt"
    shift
    timeout "$run_limit" env $bench_env python3 -m deep_ep.bench "$@" >> "$out/bench.txt" 2>&1 || bench_status=$?
}
if has bench && [ "$gpus" -lt 2 ]; then
    run_limit=$limit bench_env=""
    echo "=== low-latency kernel times, one rank" >> "$out/bench.txt"
    timeout "$limit" python3 benchmarks/ll_kernel_times.py --replays 100 >> "$out/bench.txt" 2>&1 || bench_status=$?
    echo "=== low-latency synchronisation steps, one rank" >> "$out/bench.txt"
    timeout "$limit" python3 benchmarks/ll_fixed_costs.py >> "$out/bench.txt" 2>&1 || bench_status=$?
    echo "one GPU: the benchmark as a smoke test only (both ranks on this GPU)"
    bench "low-latency, both ranks on one GPU" --mode low-latency --warmup 2 --iters 5
    bench "normal, both ranks on one GPU, 2 GB buffer (direct)" --mode normal --num-sms 24 --nvl-bytes 2000000000 \
        --warmup 2 --iters 10
    bench "normal, both ranks on one GPU, hint-sized buffer (rings)" --mode normal --num-sms 24 --warmup 2 --iters 10
elif has bench; then
    run_limit=240
    bench_env="DEEP_EP_TRANSPORT=nvlink DEEP_EP_TIMEOUT_S=60"
    # a 2 GB buffer (DeepEP's own test passes 2e9): every row fits, the direct protocol serves dispatch and combine
    bench "24 SMs, 2 GB buffer" --mode all --num-sms 24 --nvl-bytes 2000000000 --kernels
    # the size hint's buffer: the rows stream through the rings
    bench "24 SMs, hint-sized buffer (rings)" --mode normal --num-sms 24 --kernels
    bench "16 SMs, 2 GB buffer" --mode normal --num-sms 16 --nvl-bytes 2000000000
    bench "8 SMs, 2 GB buffer" --mode normal --num-sms 8 --nvl-bytes 2000000000
    # the direct protocol's stages: a few tokens at a time against one stage (push all, then copy out / reduce:
    # the default, timed above)
    echo "=== direct protocol stages, 2 GB buffer" >> "$out/bench.txt"
    timeout "$limit" env $bench_env python3 benchmarks/sweep_normal.py --num-sms 24 --nvl-bytes 2000000000 \
        --timeout 200 --setting DEEP_EP_NVLINK_STAGE_TOKENS=16 --setting DEEP_EP_NVLINK_STAGE_TOKENS=64 \
        >> "$out/bench.txt" 2>&1 || bench_status=$?
fi

if has deepep; then
    if [ -d _deepep_tests ]; then
        if [ "$gpus" -ge 2 ]; then
            for script in test_intranode test_low_latency; do
                timeout "$limit" python3 benchmarks/deepep_tests.py _deepep_tests $script --num-processes 2 \
                    > "$out/deepep_$script.log" 2>&1
                echo "deepep $script exit $?" >> "$out/deepep_$script.log"
            done
        else   # both ranks on the one GPU, small shapes (the checks; the times say nothing of NVLink)
            for run in "test_intranode --num-tokens 256 --hidden 1024 --num-experts 32" \
                       "test_low_latency --num-tokens 32 --hidden 1024 --num-experts 16"; do
                script=${run%% *}
                timeout "$limit" python3 benchmarks/deepep_tests.py --share-gpus _deepep_tests $run --num-processes 2 \
                    > "$out/deepep_$script.log" 2>&1
                echo "deepep $script exit $?" >> "$out/deepep_$script.log"
            done
        fi
        # shrink mode: 8 ranks sharing the GPUs, three of which stop calling (each costs the others a timeout)
        DEEP_EP_TIMEOUT_S=25 timeout "$limit" python3 benchmarks/deepep_tests.py --share-gpus _deepep_tests \
            test_low_latency --num-processes 8 --shrink-test > "$out/deepep_shrink_test.log" 2>&1
        echo "deepep shrink-test exit $?" >> "$out/deepep_shrink_test.log"
    else
        echo "deepep: needs DeepEP's V1 tests in _deepep_tests/" > "$out/deepep_skipped.log"
    fi
fi

run_tests() {   # log name, then pytest arguments
    local log=$1
    shift
    DEEP_EP_TEST_DEVICE=cuda timeout "$limit" python3 -m pytest -p no:cacheprovider -vv --tb=short "$@" \
        > "$out/$log.log" 2>&1
    echo "$log exit $?" >> "$out/$log.log"
}
if has normal; then
    run_tests tests_nvlink_sweep tests/test_nvlink.py -k "sweep" &
    run_tests tests_nvlink_rings tests/test_nvlink.py -k "small_rings" &
    run_tests tests_nvlink_model tests/test_nvlink.py -k "matches_model or many_ranks" &
    run_tests tests_nvlink_stress tests/test_nvlink.py -k "stress" &
    run_tests tests_nvlink_other tests/test_nvlink.py tests/test_nvlink_launch.py \
        -k "not (sweep or small_rings or matches_model or many_ranks or stress)" &
    DEEP_EP_NVLINK_DIRECT=0 run_tests tests_rings_only tests/test_nvlink.py \
        -k "sweep or small_rings" &
fi
ll_compare() { run_tests tests_ll_compare tests/test_nvlink_low_latency.py -k "matches_reference"; }
ll_variants() {   # the 2-rank comparison without the fused kernel
    DEEP_EP_LL_FUSED=0 run_tests tests_ll_variants tests/test_nvlink_low_latency.py \
        -k "matches_reference and 2"
}
ll_other() { run_tests tests_ll_other tests/test_nvlink_low_latency.py tests/test_low_latency.py -k "not matches_reference"; }
if has ll && [ "$gpus" -lt 2 ]; then   # on one GPU every rank's 1 GiB low-latency buffers share it: one at a time
    (ll_compare; ll_other) &
elif has ll; then
    (ll_compare; ll_variants) &
    ll_other &
else
    if has ll-compare; then ll_compare & fi
    if has ll-other; then ll_other & fi
fi
if has ll-variants; then ll_variants & fi
if has shrink; then   # automatic masking (5 ranks, three stop calling) again and again, each run a fresh seed
    for stream in 1 2 3; do
        (for i in 1 2 3 4 5; do run_tests "tests_shrink_${stream}_$i" tests/test_low_latency.py -k stop_calling; done) &
    done
fi
if has clients; then
    run_tests tests_clients "tests/test_normal.py::test_intranode[2ranks]" tests/test_autograd.py \
        "tests/test_low_latency.py::test_low_latency[2]" tests/test_api.py::test_buffer_on_two_ranks \
        tests/test_nvlink_low_latency.py::test_ll_nvlink_graph_replays_between_normal_calls &
fi
if has other; then
    run_tests tests_other tests --ignore=tests/test_nvlink.py --ignore=tests/test_nvlink_launch.py \
        --ignore=tests/test_nvlink_low_latency.py --ignore=tests/test_low_latency.py &
fi
wait

# the benchmark's figures first, the tests' summary last (a long output keeps its end)
if [ -f "$out/bench.txt" ]; then
    grep -v -E '^\[|CudaIPCTypes|UserWarning|_warn_once' "$out/bench.txt"
    echo "bench exit $bench_status"
fi
for log in tests_nvlink_sweep tests_nvlink_rings tests_nvlink_model tests_nvlink_stress tests_nvlink_other \
           tests_rings_only tests_ll_compare tests_ll_variants tests_ll_other tests_clients tests_other; do
    [ -f "$out/$log.log" ] || continue
    echo "--- $log"
    grep -v "CudaIPCTypes" "$out/$log.log" | grep -E "(PASSED|FAILED|ERROR)( |$)|^(FAILED|ERROR) |passed|failed| exit " \
        | grep -v "^tests/test_[a-z_]*.py::.* PASSED" | tail -n 12
    echo "PASSED: $(grep -c ' PASSED' "$out/$log.log")"
done
shrink_runs=$(ls "$out"/tests_shrink_*.log 2>/dev/null | wc -l)
if [ "$shrink_runs" -gt 0 ]; then
    echo "--- tests_shrink: $(grep -l ' PASSED' "$out"/tests_shrink_*.log | wc -l) of $shrink_runs runs passed"
    grep -h -E "^E .*seed=|^FAILED" "$out"/tests_shrink_*.log | cut -c1-240 | head -n 6
    grep -l ' PASSED' "$out"/tests_shrink_*.log | xargs -r rm --   # only failing runs' logs come back
fi
for log in "$out"/deepep_*.log; do
    [ -f "$log" ] || continue
    echo "--- $(basename "$log" .log)"
    grep -v "CudaIPCTypes" "$log" | grep -E "passed|Error|error|Kernel performance|Best|bandwidth|send/recv| exit " | tail -n 20
done

