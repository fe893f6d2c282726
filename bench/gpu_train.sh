#!/usr/bin/env bash
# Train a recipe on a lent GPU inside one call and bring the trained draft back.
#
#   bash bench/gpu_train.sh --recipe recipes/dflash_smollm2.yaml [--minutes 7] [--out DIR]
#                           [--dry-run] [key=value ...]
#
# On the GPU machine the wheels and SmolLM2 come from .whl/ (bench/gpu_setup.sh; SmolLM2 in
# parts, bench/gpu_model_parts.py). The trainer stops at --minutes
# (training.exit_duration_mins: it checkpoints the step and writes final/) or at training.steps;
# the draft is
# exported in bf16 files of at most 15 MB to $OUT/export with the run's train_log.jsonl,
# recipe.yaml and summary.json. Checkpoints stay on the machine: they are larger than what a
# call brings back. key=value overrides go to the recipe (output_dir is the script's).
# --dry-run trains 2 steps at length 64 on the CPU, so CI proves the script still runs
# (tests/test_gpu_train.py).
set -u
recipe="" minutes=7 out=${OUT:-runs/gpu_train} dry=0 overrides=()
while [ $# -gt 0 ]; do
  case $1 in
    --recipe) recipe=$2; shift 2 ;;
    --minutes) minutes=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --dry-run) dry=1; shift ;;
    *=*) overrides+=("$1"); shift ;;
    *) echo "gpu_train.sh: unknown argument '$1' (expected --recipe FILE, --minutes M, --out DIR, --dry-run, key=value)" >&2; exit 2 ;;
  esac
done
[ -f "$recipe" ] || { echo "gpu_train.sh: --recipe '$recipe' is not a file" >&2; exit 2; }
cd "$(dirname "$0")/.."
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
run_dir=/tmp/gpu_train_run
if [ $dry = 1 ]; then
  run_dir=$out/run
  overrides+=(training.steps=2 training.global_batch_size=2 data.seq_length=64 checkpointing.interval=1)
else
  . bench/gpu_setup.sh
  "$py" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null ||
    { echo "gpu_train.sh: torch sees no CUDA device (use --dry-run on a CPU)" >&2; exit 2; }
  nvidia-smi --query-gpu=name,memory.total --format=csv > "$out/gpu.txt" 2>&1
fi
rm -rf "$run_dir"
"$py" -m megatron_specdec.cli.train --config "$recipe" output_dir="$run_dir" \
  training.exit_duration_mins="$minutes" "${overrides[@]}" 2>&1 | tail -n 40 > "$out/train.log"
status=${PIPESTATUS[0]}
cp "$run_dir"/train_log.jsonl "$run_dir"/recipe.yaml "$out"/ 2>/dev/null
cp "$run_dir"/summary.json "$out"/ 2>/dev/null
if [ "$status" != 0 ]; then
  echo "gpu_train.sh: training failed (exit $status): see $out/train.log"; tail -n 15 "$out/train.log"; exit 1
fi
"$py" checkpoint_tools/export_draft.py --model "$run_dir/final" --out "$out/export" \
  --dtype bfloat16 --max-shard-mb 15 --overwrite > "$out/export.log" 2>&1 ||
  { echo "gpu_train.sh: export failed: see $out/export.log"; tail -n 15 "$out/export.log"; exit 1; }
echo "gpu_train.sh: $(wc -l < "$out/train_log.jsonl") log lines; draft in $out/export"
