#!/usr/bin/env bash
# omni-flux-shapes-tiny retrain (issue 25), one nvidia-h200 call: train + held-out evaluation through diffusers
# (train_flux), pack the model, then benchmarks/quality.py (FP8 online, FP8 cache, layerwise offload) on 200
# held-out scenes, the three in parallel. Everything lands in $OUT (at most 8 files).
set -uo pipefail
export PYTHONPATH=packages/diffusion-kv/src:packages/dlo-offload/src:packages/fp8-cache/src:packages/cfg-pairing/src:packages/models/src:packages/server/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PYTHONPATH
LOG=$OUT/call_log.txt
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv;
  python3 -c "import torch, diffusers, transformers, sys; print(sys.version.split()[0], torch.__version__, diffusers.__version__, transformers.__version__)"; } >"$LOG" 2>&1
M=/tmp/run/omni-flux-shapes-tiny
t0=$SECONDS
timeout -s INT "${TRAIN_LIMIT:-400}" python3 -m omni_models.training.train_flux --out $M --time-budget-s "${BUDGET:-320}" --seed 0 ${TRAIN_ARGS:-} >$OUT/train_full_log.txt 2>&1
echo "train: exit $? in $((SECONDS - t0))s" >>"$LOG"
tar -cf $OUT/model.tar -C /tmp/run omni-flux-shapes-tiny && echo "packed $(du -b $OUT/model.tar | cut -f1) bytes" >>"$LOG"
mkdir -p /tmp/q
t0=$SECONDS
q() { name=$1; shift; timeout -s KILL "${Q_LIMIT:-70}" python3 benchmarks/quality.py $M "$@" --num-scenes 200 --batch-size 50 --out /tmp/q/$name >/tmp/q/$name.log 2>&1; echo "quality $name: exit $? in $((SECONDS - t0))s" >>"$LOG"; }
q fp8_online --quantization fp8 &
q fp8_cache --quantization fp8 --fp8-cache-dir /tmp/fp8cache &
q offload --enable-layerwise-offload &
wait
tar -czf $OUT/quality.tar.gz -C /tmp q
grep -h "held-out\|teacher\|vae:\|distilled" $OUT/train_full_log.txt | grep -v "step " | tail -20
tail -n 8 /tmp/q/*.log
cat "$LOG"
