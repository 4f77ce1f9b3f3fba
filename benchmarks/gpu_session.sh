#!/usr/bin/env bash
# One device-tool call that checks and times everything GPU-side, writing under $OUT.
#   bash benchmarks/gpu_session.sh [STEP ...]    (default: every step)
# Issue 14 (Hopper speed), about 4 minutes:
#   bash benchmarks/gpu_session.sh env dit_step modulation fp8_gemm paged_attention tests_hopper
# Each step has its own time limit so one hang cannot eat the call; logs and JSON land in $OUT/gpu/, packed at
# the end into $OUT/gpu_results.tar.gz (the device tool returns at most 8 files).
# CALL_BUDGET=SECONDS caps every step's limit at what is left of that budget (from the script's start) less 10 s,
# skips the steps that would get under 20 s, and packs the results after every step, so that a call cut short
# still brings back what finished. GPU_RESULTS=DIR keeps the logs outside $OUT (only the packed file and the
# summary come back then, whatever the number of logs).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=packages/diffusion-kv/src:packages/dlo-offload/src:packages/fp8-cache/src:packages/cfg-pairing/src:packages/models/src:packages/server/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/gpu_out}
R=${GPU_RESULTS:-$OUT/gpu}
mkdir -p "$R" "$OUT"

pack() {
  tar -czf "$OUT/gpu_results.tar.gz" -C "$(dirname "$R")" "$(basename "$R")"
  cp "$R/summary.txt" "$OUT/summary.txt" 2>/dev/null
}

step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  if [ -n "${CALL_BUDGET:-}" ]; then
    local left=$((CALL_BUDGET - SECONDS - 10))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 20 ]; then echo "$name: skipped (${left}s left of CALL_BUDGET)" | tee -a "$R/summary.txt"; return; fi
  fi
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s) ==="
  timeout --signal=KILL "$limit" "$@" >"$R/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc in $((SECONDS - t0))s" | tee -a "$R/summary.txt"
  tail -n 40 "$R/$name.log"
  [ -n "${CALL_BUDGET:-}" ] && pack
}

install_carried_wheels() {  # every call: a warm machine keeps /tmp/site from the last call, whose wheels may differ
  rm -rf /tmp/site
  step server_install 60 python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  # Every zip there (a stripped diffusers: benchmarks/README.md, "Compiled serving") is unpacked beside them, and
  # all of it byte-compiled, as pip's own install does: imported from a zip, diffusers' modules were compiled from
  # source in every process of every start (the server's API and engine processes both import it).
  for z in .whl/*.zip; do [ -e "$z" ] && python3 -m zipfile -e "$z" /tmp/site; done
  python3 -m compileall -q -j 0 /tmp/site >/dev/null
}

# Carried wheels (.whl/: msgspec for fp8_cache's manifest, the web stack, diffusers) go on the path of every step.
if [ -d .whl ]; then install_carried_wheels; export PYTHONPATH=/tmp/site:$PYTHONPATH; fi
# The step cache's static mask at the 9 of 28 steps its `fast` preset computes on the trained FLUX-architecture
# model (benchmarks/real_models.py FAST_ON_TRAINED): random weights never trip the residual test.
FAST_MASK='{"method": "mask", "mask": [0, 1, 5, 8, 12, 16, 20, 24, 27], "first_blocks": 1, "max_consecutive_cached": null}'
WAN_MASK_20='{"method": "mask", "mask": [0, 1, 3, 5, 8, 12, 15, 18, 19], "first_blocks": 1, "max_consecutive_cached": null}'
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(env tests_kv tests_other paged_attention fp8_cache dlo_offload prefix_reuse)
# A snapshot (benchmarks/README.md) names its commit in COMMIT; the device copy of a working tree has no .git.
cat COMMIT >"$R/commit.txt" 2>/dev/null || git rev-parse --short HEAD >"$R/commit.txt" 2>/dev/null || echo "working tree, commit unknown" >"$R/commit.txt"
for s in "${steps[@]}"; do
  case $s in
    # Which of the server's and the families' packages the image has (the rest must be carried in .whl/).
    env) step env 30 bash -c 'nvidia-smi; python3 -c "import torch, triton, sys; print(sys.version); print(torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name())"
          python3 -c "import importlib.util as u; print({m: u.find_spec(m) is not None for m in \"anyio click h11 idna sniffio typing_extensions pydantic pydantic_core typing_inspection annotated_types fastapi starlette uvicorn multipart msgspec yaml prometheus_client PIL peft diffusers transformers av\".split()})"' ;;
    tests_kv) step tests_kv 120 python3 -m pytest tests/diffusion_kv -q -x -p no:cacheprovider ;;
    tests_other) step tests_other 80 python3 -m pytest tests/fp8_cache tests/dlo_offload -q -p no:cacheprovider ;;
    paged_attention) step paged_attention 300 python3 benchmarks/paged_attention.py --out "$R" ;;
    fp8_cache) step fp8_cache 120 python3 benchmarks/fp8_cache.py --out "$R" ;;
    fp8_gemm) step fp8_gemm 60 python3 benchmarks/fp8_cache.py --gemm-only --out "$R" ;;
    modulation) step modulation 60 python3 benchmarks/modulation.py --out "$R" ;;
    dit_step) step dit_step 180 python3 benchmarks/dit_step.py --out "$R" ;;
    # The DiT step twice more, for the spread of the same-run eager-vs-graphs ratio (JSON and logs per run).
    dit_step_repeats) for n in 2 3; do step "dit_step_run$n" 180 python3 benchmarks/dit_step.py --out "$R/dit_step_run$n"; done ;;
    tests_hopper) step tests_hopper 150 python3 -m pytest -q -p no:cacheprovider tests/diffusion_kv/test_ops_flash.py tests/diffusion_kv/test_ops_sdpa_gather.py \
                    tests/diffusion_kv/test_ops_cudnn_paged.py \
                    tests/omni_models/test_fused_triton.py \
                    tests/omni_models/test_paged_pipeline.py::test_cuda_graph_steps_equal_eager_steps ;;
    dlo_offload) step dlo_offload 90 python3 benchmarks/dlo_offload.py --out "$R" ;;
    prefix_reuse) step prefix_reuse 150 python3 benchmarks/prefix_reuse.py --out "$R" ;;
    # The GPU image lacks the server's web stack: carry cp312 wheels in .whl/ (benchmarks/README.md says how).
    server_overhead) step server_overhead 240 python3 benchmarks/server_overhead.py --out "$R" ;;
    composed) step composed 200 python3 benchmarks/composed_pipeline.py --out "$R" ;;
    # The real families need diffusers (and requests), carried in .whl/ too; one family per device call.
    real_flux) step real_flux 560 python3 benchmarks/real_models.py --family flux --out "$R" ;;
    # Only the server-engine concurrency figure (4 requests at once vs one after another), FLUX.1-dev at 1024^2.
    real_engine) step real_engine 560 python3 benchmarks/real_models.py --family flux --phases engine --repeats 1 --baseline none --out "$R" ;;
    # Issue 27: LoRA per request at FLUX.1-dev size, rank 64 (carry diffusers, peft and msgspec in .whl/): compiled
    # as served, then eager unless the compiled mode ended past LORA_DEADLINE (200 s); the step's limit is LORA_LIMIT
    # (300 s; two compiled modes take about 310 s); the 4 x 0.5 GB adapters go to /tmp.
    lora) step lora "${LORA_LIMIT:-300}" python3 benchmarks/lora.py --out "$R" --adapter-dir /tmp/lora_adapters \
            --deadline "${LORA_DEADLINE:-200}" ${LORA_FLAGS:-} ;;
    # Issue 26: the step cache's wall time, FLUX.1-dev size, 1024^2, 28 steps, eager; then compiled when 90 s of
    # CALL_BUDGET (default 400) are left after the eager configs.
    step_cache) step step_cache 200 python3 benchmarks/real_models.py --family flux --baseline none --phases step_cache \
                  --repeats 1 --step-cache-repeats 5 --step-cache-compiled --deadline $(( ${CALL_BUDGET:-400} - SECONDS - 90 )) --out "$R" ;;
    # Issue 26 on Qwen-Image (50 steps, true CFG, eager): off against the mask of the 15 of 50 steps `fast`
    # computes on the trained model at 50 steps (benchmarks/real_models.py FAST_ON_TRAINED), 5 images each.
    step_cache_qwen) step step_cache_qwen 300 python3 benchmarks/real_models.py --family qwen-image --baseline none \
                       --phases step_cache --repeats 1 --step-cache-repeats 5 --step-cache-configs off fast_mask --out "$R" ;;
    real_qwen) step real_qwen 560 python3 benchmarks/real_models.py --family qwen-image --out "$R" ;;
    # Shorter re-measurements of omni's own phases (no diffusers run for FLUX; Qwen keeps diffusers eager and
    # compiled as the baseline for the ragged-attention change), FP8 online so no 24-41 GB checkpoint is written.
    real_flux_omni) step real_flux_omni 420 python3 benchmarks/real_models.py --family flux \
                      --baseline none --fp8-source online --phases compiled fp8 fp8_compiled offload offload_batched --out "$R" ;;
    real_flux_fp8) step real_flux_fp8 300 python3 benchmarks/real_models.py --family flux \
                     --baseline none --fp8-source online --fp8-compiled-scaling row tensor --phases compiled fp8 fp8_compiled --out "$R" ;;
    real_qwen_cfg) step real_qwen_cfg 420 python3 benchmarks/real_models.py --family qwen-image \
                     --fp8-source online --fp8-compiled-scaling row --phases compiled fp8 fp8_compiled --out "$R" ;;
    # Issue 29: Wan2.1-1.3B at 832x480, 81 frames, 50 steps vs diffusers' WanPipeline (diffusers carried in .whl/);
    # the 14B: ms/step over 4 steps, resident vs layerwise offload, peak memory.
    video_wan) step video_wan 560 python3 benchmarks/video_wan.py --out "$R" ;;
    # Issues 24 and 26 through the product: FLUX.1-dev size over HTTP, default flags and FP8 (1024^2, 5 repeats each),
    # each also with the step cache's mask at the steps `fast` computes on the trained model (9 of 28), vs diffusers
    # eager and compiled; cold and warm starts. Issue 28: the same for FLUX.1-Kontext edits (1024^2 in and out).
    # SERVING_CONFIGS (default "default fp8") and SERVING_FLAGS (more serving.py flags, e.g. --no-baseline) split it
    # over two calls: one server's cold start, repeats and warm start take about 300 s at this size.
    # The servers log dynamo's recompiles and graph breaks (TORCH_LOGS), to name the graph a GPU start compiles
    # beyond the CPU's count (4 at ready on 2026-12-03e, 3 in test_compiled_serving.py at the same shapes).
    serving_flux) TORCH_LOGS=${TORCH_LOGS:-recompiles,graph_breaks} step serving_flux 560 python3 benchmarks/serving.py --out "$R/serving_flux" --work-dir /tmp \
                    --sizes 1024 --concurrent 0 --configs ${SERVING_CONFIGS:-default fp8} --request-cache "$FAST_MASK" \
                    ${SERVING_FLAGS:-} \
                    --deadline $(( ${CALL_BUDGET:-560} - SECONDS - 30 )) ;;
    serving_kontext) step serving_kontext 560 python3 benchmarks/serving.py --out "$R/serving_kontext" --work-dir /tmp \
                       --family flux-kontext --sizes 1024 --concurrent 0 --configs default fp8 --no-diffusers-compile --no-warm-start \
                       --deadline $(( ${CALL_BUDGET:-560} - SECONDS - 30 )) ;;
    # Issue 29 through the product: Wan2.1-1.3B over /v1/videos (PyAV carried: benchmarks/README.md, "Videos through
    # the server"), 832x480, 81 frames, SERVING_STEPS steps (20), 5 repeats, vs diffusers' WanPipeline eager.
    # With the step cache's mask at the 9 of 20 steps `fast` computes on the trained FLUX-architecture model at 20
    # steps (benchmarks/results/2026-12-02g/composition_20_steps.json; random weights never trip the residual test).
    serving_wan) step serving_wan 560 python3 benchmarks/serving.py --family wan --out "$R/serving_wan" --work-dir /tmp \
                   --concurrent 0 --steps "${SERVING_STEPS:-20}" --configs ${SERVING_CONFIGS:-default} --no-diffusers-compile \
                   --no-warm-start --request-cache "$WAN_MASK_20" ${SERVING_FLAGS:-} --deadline $(( ${CALL_BUDGET:-560} - SECONDS - 30 )) ;;
    video_wan_14b) step video_wan_14b 560 python3 benchmarks/video_wan.py --size 14b --steps 4 --phases omni,offload --out "$R" ;;
    # Issues 24 and 29: every SDPA backend alone, omni's attention and its FP8 attention (--attention-dtype fp8) at
    # FLUX.1's and Wan2.1-1.3B's shapes, with each one's error (no carried wheels needed).
    attention) step attention 150 python3 benchmarks/fast_paths.py --sections attention --out "$R" ;;
    tests_compile) step tests_compile 120 python3 -m pytest -q -p no:cacheprovider \
                     "tests/fp8_cache/test_quant_linear.py::test_fp8_linear_under_torch_compile_matches_eager" ;;
    # The music family's acoustic stage (paged code K/V vs recompute, FP8), no vLLM needed.
    music_acoustic) step music_acoustic 180 python3 benchmarks/music_acoustic.py --out "$R" ;;
    # Issue 15, on nvidia-h200-x2 (one rank per GPU; msgspec carried in .whl/): CFG-parallel, Ulysses, DLO AllGather
    # inside the engine vs one GPU, NCCL bandwidth; the 4.4 GB random model is written outside $OUT.
    multi_gpu) step multi_gpu 340 python3 benchmarks/multi_gpu.py --out "$R" --model-dir /tmp/multi_gpu_model ;;
    *) echo "unknown step $s" ;;
  esac
done
pack
