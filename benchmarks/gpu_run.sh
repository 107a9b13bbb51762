#!/usr/bin/env bash
# One call on the GPU machine: the benchmark (24, 16 and 8 SMs), then the GPU tests; a short table last.
# Installs nothing (the machine's torch and Triton are used); run from the repository root.
# Usage: bash benchmarks/gpu_run.sh [seconds for tests/test_nvlink.py, default 240] [seconds for the rest, default 240]
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-$(mktemp -d)}"

nvidia-smi topo -m > "$out/topology.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
git rev-parse --short HEAD 2>/dev/null || true

bench_status=0
python3 -m deep_ep.bench --mode all --num-sms 24 --json > "$out/bench_sms24.json" 2> "$out/bench_sms24.txt" \
    || bench_status=$?
# the same with the rank's own rows copied by the dispatch senders instead of the receivers
DEEP_EP_NVLINK_OWN_ROWS=sender python3 -m deep_ep.bench --mode normal --num-sms 24 > "$out/bench_sms24_own_sender.txt" \
    2>&1 || bench_status=$?
for sms in 16 8; do
    python3 -m deep_ep.bench --mode normal --num-sms "$sms" > "$out/bench_sms$sms.txt" 2>&1 || bench_status=$?
done

# the NVLink tests first (they matter most and the whole suite may not fit one call), then the rest
DEEP_EP_TEST_DEVICE=cuda timeout "${1:-240}" python3 -m pytest -p no:cacheprovider -v --tb=short tests/test_nvlink.py \
    > "$out/tests_nvlink.log" 2>&1
nvlink_status=$?
DEEP_EP_TEST_DEVICE=cuda timeout "${2:-240}" python3 -m pytest -p no:cacheprovider -q --tb=short tests \
    --ignore=tests/test_nvlink.py > "$out/tests.log" 2>&1
test_status=$?
for log in tests_nvlink tests; do
    grep -v "CudaIPCTypes" "$out/$log.log" | grep -E "^(FAILED|ERROR)|PASSED|passed|failed" | tail -n 12
done

for sms in 24 24_own_sender 16 8; do
    grep -v '^\[' "$out/bench_sms$sms.txt" | grep -v CudaIPCTypes | tail -n 15
done
echo "NVLink tests exit $nvlink_status, other tests exit $test_status, bench exit $bench_status"
