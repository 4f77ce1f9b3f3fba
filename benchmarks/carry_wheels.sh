#!/usr/bin/env bash
# Fill the ignored .whl/ with what a device call imports and the H200's image lacks (benchmarks/README.md):
#   bash benchmarks/carry_wheels.sh serving    # omni-server over HTTP: the web stack, msgspec, diffusers (FLUX.1
#                                              # and FLUX.1-Kontext pipelines only)           ~5.3 MB
#   bash benchmarks/carry_wheels.sh families   # in-process families, LoRA, video: msgspec, peft, diffusers (FLUX.1,
#                                              # Qwen-Image, Wan pipelines)                   ~3.6 MB
#   bash benchmarks/carry_wheels.sh video      # videos through omni-server: the serving set, PyAV, diffusers'
#                                              # FLUX.1 and Wan pipelines                     ~41 MB: only with the
#                                              # shipped weights out of the tree (benchmarks/README.md)
# The working tree (about 61 MB) plus what a call carries must stay under 64 MiB counted as a tar archive, so
# diffusers travels as a zip of the parts these pipelines import (checked on 2026-12-02: diffusers 0.42.1; PYTHON=...
# with torch and transformers re-checks the imports here).
set -euo pipefail
cd "$(dirname "$0")/.."
set_name=${1:?serving or families}
DIFFUSERS=${DIFFUSERS:-diffusers==0.42.1}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$work/w" "$@"
}
# The server's web stack and what fastapi 0.165 imports that the image lacks, plus msgspec.
web_stack="fastapi starlette pydantic pydantic-core typing-inspection annotated-types uvicorn python-multipart
  opentelemetry-api annotated-doc msgspec"
case $set_name in
  serving)
    download $web_stack "$DIFFUSERS"
    keep_pipelines="flux"; flux_files="__init__.py pipeline_flux.py pipeline_flux_kontext.py pipeline_output.py"
    schedulers="utils flow_match_euler_discrete unipc_multistep ddim dpmsolver_multistep edm_dpmsolver_multistep
      euler_ancestral_discrete euler_discrete heun_discrete lms_discrete pndm consistency_decoder" ;;
  families)
    download msgspec peft "$DIFFUSERS"
    keep_pipelines="flux qwenimage wan"; flux_files=""; schedulers="" ;;
  video)
    download $web_stack av "$DIFFUSERS"
    keep_pipelines="flux wan"; flux_files="__init__.py pipeline_flux.py pipeline_flux_kontext.py pipeline_output.py"
    schedulers="" ;;  # every scheduler: Wan's pipeline and omni's Wan backend import more than FLUX.1's
  *) echo "unknown set $set_name (serving, families, video)"; exit 2 ;;
esac
mkdir "$work/d"
(cd "$work/d" && python3 -m zipfile -e "$work"/w/diffusers-*.whl .)
rm "$work"/w/diffusers-*.whl
d="$work/d/diffusers"
for p in "$d"/pipelines/*/; do
  name=$(basename "$p")
  [[ " $keep_pipelines " == *" $name "* ]] || rm -rf "$p"
done
rm -rf "$d"/modular_pipelines/*/ "$d"/commands "$d"/models/controlnets
if [ -n "$flux_files" ]; then
  for f in "$d"/pipelines/flux/*.py; do [[ " $flux_files " == *" $(basename "$f") "* ]] || rm "$f"; done
fi
if [ -n "$schedulers" ]; then
  rm -rf "$d"/schedulers/deprecated
  for f in "$d"/schedulers/scheduling_*.py; do
    n=$(basename "$f" .py); n=${n#scheduling_}
    [[ " $(echo $schedulers) " == *" $n "* ]] || rm "$f"
  done
fi
rm -f "$work"/d/diffusers-*.dist-info/RECORD
rm -rf .whl && mkdir .whl
(cd "$work/d" && python3 -m zipfile -c "$OLDPWD/.whl/diffusers.zip" diffusers diffusers-*.dist-info)
cp "$work"/w/*.whl .whl/
if [ -n "${PYTHON:-}" ]; then
  probe="import diffusers; diffusers.FluxPipeline; diffusers.FluxKontextPipeline; diffusers.FlowMatchEulerDiscreteScheduler"
  [ "$set_name" = families ] && probe="$probe; diffusers.WanPipeline; diffusers.QwenImagePipeline; diffusers.QwenImageEditPlusPipeline"
  [ "$set_name" = video ] && probe="import diffusers; diffusers.FluxPipeline; diffusers.WanPipeline; diffusers.UniPCMultistepScheduler"
  PYTHONPATH=$PWD/.whl/diffusers.zip "$PYTHON" -c "$probe; import diffusers.loaders.lora_conversion_utils; from diffusers.loaders import FluxLoraLoaderMixin; print('diffusers imports: ok')"
fi
du -cb .whl/* | tail -1 | awk '{printf "%.2f MB in .whl/\n", $1 / 1e6}'
# What a device call would carry: the tree's files that are here (a tracked file deleted from the working tree does
# not travel, and tar skips it) plus .whl/, as a tar archive; the limit is 64 MiB.
git ls-files -z | tar --null --ignore-failed-read -cf - -T - .whl 2>/dev/null | wc -c |
  awk '{printf "%.1f MiB would travel (limit 64 MiB)\n", $1 / 2^20}'
