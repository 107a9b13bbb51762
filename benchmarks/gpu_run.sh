#!/usr/bin/env bash
# One call on the GPU machine: the benchmark (24, 16 and 8 SMs, alone on the GPUs), then the GPU tests in
# three concurrent groups (Triton compiles on many CPU cores at once); a short table last.
# Installs nothing (the machine's torch and Triton are used); run from the repository root.
# Usage: bash benchmarks/gpu_run.sh [seconds for the tests, default 300]
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-$(mktemp -d)}"
limit="${1:-300}"

nvidia-smi topo -m 2>&1 | head -n 4
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
git rev-parse --short HEAD 2>/dev/null || true

bench_status=0
if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -lt 2 ]; then
    echo "one GPU: no benchmark (it measures NVLink between 2 GPUs); the tests place all ranks on this GPU"
    for sms in 24 24_own_receiver 16 8; do echo "skipped: benchmark needs 2 GPUs" > "$out/bench_sms$sms.txt"; done
else
    python3 -m deep_ep.bench --mode all --num-sms 24 --json > "$out/bench_sms24.json" 2> "$out/bench_sms24.txt" \
        || bench_status=$?
    # the same with the rank's own rows copied by the dispatch receivers instead of the senders
    DEEP_EP_NVLINK_OWN_ROWS=receiver python3 -m deep_ep.bench --mode normal --num-sms 24 \
        > "$out/bench_sms24_own_receiver.txt" 2>&1 || bench_status=$?
    for sms in 16 8; do
        python3 -m deep_ep.bench --mode normal --num-sms "$sms" > "$out/bench_sms$sms.txt" 2>&1 || bench_status=$?
    done
fi

run_tests() {   # log name, then pytest arguments
    local log=$1
    shift
    DEEP_EP_TEST_DEVICE=cuda timeout "$limit" python3 -m pytest -p no:cacheprovider -vv --tb=short "$@" \
        > "$out/$log.log" 2>&1
    echo "$log exit $?" >> "$out/$log.log"
}
run_tests tests_nvlink_compare tests/test_nvlink.py -k "sweep or small_rings or matches_model" &
run_tests tests_nvlink_other tests/test_nvlink.py -k "not (sweep or small_rings or matches_model)" &
run_tests tests_other tests --ignore=tests/test_nvlink.py &
DEEP_EP_NVLINK_OWN_ROWS=receiver run_tests tests_own_receiver tests/test_nvlink.py -k "sweep or small_rings" &
wait

for log in tests_nvlink_compare tests_nvlink_other tests_other tests_own_receiver; do
    echo "--- $log"
    grep -v "CudaIPCTypes" "$out/$log.log" | grep -E "(PASSED|FAILED|ERROR)( |$)|^(FAILED|ERROR) |passed|failed| exit " \
        | grep -v "^tests/test_[a-z_]*.py::.* PASSED" | tail -n 12
    echo "PASSED: $(grep -c ' PASSED' "$out/$log.log")"
done

for sms in 24 24_own_receiver 16 8; do
    grep -v '^\[' "$out/bench_sms$sms.txt" | grep -v CudaIPCTypes | tail -n 15
done
echo "bench exit $bench_status"
