# The one device call of 2026-12-02c (nvidia-h200, tool timeout 350 s; wall 295.5 s; the session's lease 449 s of
# device time with the machine's start). Run from a copy of the checkout at d78459d with .gpu/overlay = the
# benchmarks/ files of branch gpu-lora at 01a652c, and .whl = a stripped diffusers 0.42.1 zip, peft 0.21.2 and
# msgspec 0.23.0 (cp312) wheels.
cp -r .gpu/overlay/. . && CALL_BUDGET=330 LORA_DEADLINE=170 GPU_RESULTS=/tmp/gpu_res/gpu bash benchmarks/gpu_session.sh env lora step_cache
