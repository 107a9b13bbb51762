#!/usr/bin/env bash
# One call on the GPU machine: the test suite on GPUs, then the benchmark; a short table last.
# Installs nothing (the machine's torch and Triton are used); run from the repository root.
# Usage: bash benchmarks/gpu_run.sh [extra arguments for deep_ep.bench]
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-$(mktemp -d)}"

nvidia-smi topo -m > "$out/topology.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
git rev-parse --short HEAD 2>/dev/null || true

DEEP_EP_TEST_DEVICE=cuda python3 -m pytest -p no:cacheprovider tests 2>&1 | tee "$out/tests.log" | tail -n 25
test_status=${PIPESTATUS[0]}

python3 -m deep_ep.bench --json "$@" > "$out/bench.json" 2> "$out/bench.txt"
bench_status=$?
grep -v '^\[' "$out/bench.txt" | tail -n 20
python3 -m deep_ep.bench --transport nvlink --mode normal --num-sms 24 --json > "$out/bench_nvlink.json" \
    2> "$out/bench_nvlink.txt"
nvlink_status=$?
grep -v '^\[' "$out/bench_nvlink.txt" | tail -n 12
echo "tests exit $test_status, bench exit $bench_status, nvlink bench exit $nvlink_status"
