#!/usr/bin/env bash
# omni-flux-shapes-tiny retrain (issue 25), one nvidia-h200 call: train + held-out evaluation through diffusers
# (train_flux), then benchmarks/quality.py (FP8 online, FP8 cache, layerwise offload) on 200 held-out scenes, the
# three in parallel, in what is left of a DEADLINE-second call. Runs the code snapshot in .snap/flux (HEAD's
# packages plus this session's training files and quality.py, taken just before the call, so that other helpers'
# edits in progress elsewhere in the tree are not on the path). Everything lands in $OUT (at most 8 files).
set -uo pipefail
T0=$SECONDS
S=.snap/flux
export PYTHONPATH=$(ls -d $S/packages/*/src | tr '\n' ':')
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PYTHONPATH
LOG=$OUT/call_log.txt
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv;
  python3 -c "import torch, diffusers, transformers, sys; print(sys.version.split()[0], torch.__version__, diffusers.__version__, transformers.__version__)"; } >"$LOG" 2>&1
M=/tmp/run/omni-flux-shapes-tiny
timeout -s INT "${TRAIN_LIMIT:-470}" python3 -m omni_models.training.train_flux --out $M --time-budget-s "${BUDGET:-380}" --seed 0 ${TRAIN_ARGS:-} >$OUT/train_full_log.txt 2>&1
echo "train: exit $? at $((SECONDS - T0))s" >>"$LOG"
tar -cf /tmp/model.tar -C /tmp/run omni-flux-shapes-tiny && split -b 15M /tmp/model.tar $OUT/model.tar.part-
echo "packed $(du -b /tmp/model.tar | cut -f1) bytes at $((SECONDS - T0))s" >>"$LOG"
mkdir -p /tmp/q
LEFT=$(( ${DEADLINE:-575} - (SECONDS - T0) - 10 ))
echo "quality: $LEFT s left" >>"$LOG"
q() { name=$1; shift; OMP_NUM_THREADS=4 timeout -s KILL "$LEFT" python3 $S/quality.py $M "$@" --num-scenes 200 --batch-size 100 --out /tmp/q/$name >/tmp/q/$name.log 2>&1; echo "quality $name: exit $? at $((SECONDS - T0))s" >>"$LOG"; }
if [ "$LEFT" -gt 30 ]; then
  q fp8_online --quantization fp8 &
  q fp8_cache --quantization fp8 --fp8-cache-dir /tmp/fp8cache &
  q offload --enable-layerwise-offload &
  wait
fi
tar -czf $OUT/quality.tar.gz -C /tmp q
grep -v " step .* loss " $M/train_stdout.txt | tail -30; grep -h "Error\|error" $OUT/train_full_log.txt | tail -5
tail -n 6 /tmp/q/*.log
cat "$LOG"
