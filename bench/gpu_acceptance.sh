#!/bin/bash
# The GPU checks of the acceptance ops in one go, for a machine with an NVIDIA GPU, torch with
# CUDA, nvcc, pytest, Nsight Compute and compute-sanitizer (about 100 s on an H100):
#   build, the CUDA tests, memcheck over them, bench/bench_acceptance.py --device cuda, and an
#   ncu profile of the stochastic chain at B=64 K=8 vocab 128256.
#     bash bench/gpu_acceptance.sh [OUT_DIR]     # default bench/results
# Builds with the system compiler: a second GCC first on PATH made a module that crashed on
# its first error message (README, "CUDA kernels").
set -u
out=${1:-bench/results}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
step() { echo "== $* ($(date +%T))"; }

step build
CC=/usr/bin/gcc CXX=/usr/bin/g++ LDSHARED="/usr/bin/g++ -shared" MAX_JOBS=${MAX_JOBS:-16} \
  timeout 300 python3 setup.py -q build_ext --inplace >"$out/gpu_build.log" 2>&1 || { tail -40 "$out/gpu_build.log"; exit 1; }

step "the CUDA tests (-m gpu)"
timeout 240 python3 -m pytest -q -p no:cacheprovider --tb=short -m gpu tests/test_acceptance_cuda.py 2>&1 |
  tee "$out/gpu_tests.log" | tail -15

step "compute-sanitizer memcheck (float32 cases below vocab 128256, tree, errors)"
timeout 180 compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 20 \
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_acceptance_cuda.py -k "float32 and not 128256 or tree or errors" \
  2>&1 | tee "$out/gpu_memcheck.log" | tail -8
echo "memcheck exit status ${PIPESTATUS[0]}"

step bench
timeout 240 python3 bench/bench_acceptance.py --device cuda --repeats 20
cp bench/results/acceptance_cuda.json "$out/" 2>/dev/null

step "ncu: stochastic chain B=64 K=8 vocab 128256"
timeout 120 ncu --kernel-name regex:"row_stats|chain|typical|tree" --section SpeedOfLight --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis \
  --section ComputeWorkloadAnalysis --section WarpStateStats \
  python3 bench/bench_acceptance.py --device cuda --vocab 128256 --repeats 1 \
  --only "stochastic_chain B=64 K=8" >"$out/ncu_stochastic_chain_B64_K8_V128256.txt" 2>&1
grep -E "^  [a-z_]+.*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy" \
  "$out/ncu_stochastic_chain_B64_K8_V128256.txt" | head -60
step done
