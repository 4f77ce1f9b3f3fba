"""One rank of the 2-process gloo scenarios run by test_two_ranks.py.

Launched as a plain script with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set; writes
``rank{RANK}.json`` with what it observed into the directory given as argv[1]. The
scenarios run in order and the wave-failure ones come last, since a failed wave
leaves its group unusable by design.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from dlo_test_models import make_model, tensor_bytes  # noqa: E402

from dlo_offload import (  # noqa: E402
    DPWaveCoordinator,
    OffloadPlan,
    WaveFailedError,
    WaveRefusedError,
    WaveRequest,
    enable_layerwise_offload,
)


def expect_error(kind: type[BaseException], fn, *args, **kwargs) -> str:  # type: ignore[no-untyped-def]
    try:
        fn(*args, **kwargs)
    except kind as exc:
        return str(exc)
    return "<no error>"


def main() -> None:
    out_dir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    report: dict[str, object] = {}

    group = dist.new_group([0, 1], backend="gloo")  # the group to shard over: both ranks hold the same model

    # AllGather reconstruction: each rank holds half of every block; outputs and bytes exact.
    model = make_model(num_blocks=5)
    reference = copy.deepcopy(model)
    plan = OffloadPlan("blocks", resident_modules=("embed", "head"))
    rank_local_bytes = enable_layerwise_offload(copy.deepcopy(model), plan, device="cpu").host_nbytes
    handle = enable_layerwise_offload(model, plan, device="cpu", group=group)
    report["mode"] = handle.mode
    report["host_fraction"] = handle.host_nbytes / rank_local_bytes
    mismatched: list[str] = []

    def capture(index: int):  # type: ignore[no-untyped-def]
        def hook(module: torch.nn.Module, args: object) -> None:
            want = dict(reference.blocks[index].named_parameters()) | dict(reference.blocks[index].named_buffers())
            got = dict(module.named_parameters()) | dict(module.named_buffers())
            for name, w in want.items():
                g = got[name]
                if (g.dtype, g.shape, g.stride()) != (w.dtype, w.shape, w.stride()) or tensor_bytes(g) != tensor_bytes(
                    w
                ):
                    mismatched.append(f"blocks.{index}.{name}")

        return hook

    hooks = [model.blocks[i].register_forward_pre_hook(capture(i)) for i in range(5)]
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(100 + rank))  # each DP rank its own request
    equal = []
    with torch.inference_mode():
        for _ in range(3):
            equal.append(torch.equal(model(x), reference(x)))
    for h in hooks:
        h.remove()
    report["outputs_equal"] = equal
    report["mismatched_tensors"] = mismatched
    report["fp8_checked"] = str(reference.blocks[0].proj.weight.dtype)
    handle.remove()
    report["restored_equal"] = all(
        tensor_bytes(a) == tensor_bytes(b) and a.stride() == b.stride()
        for a, b in zip(model.state_dict().values(), reference.state_dict().values(), strict=True)
    )

    local_model = make_model(num_blocks=4)
    local_reference = copy.deepcopy(local_model)
    local = enable_layerwise_offload(
        local_model, OffloadPlan("blocks", resident_blocks=1), device="cpu", group=group, use_allgather=False
    )
    with torch.inference_mode():
        report["rank_local"] = [local.mode, local.world_size, torch.equal(local_model(x), local_reference(x))]
    local.remove()

    report["resident_with_allgather"] = expect_error(
        ValueError,
        enable_layerwise_offload,
        make_model(),
        OffloadPlan("blocks", resident_blocks=1),
        device="cpu",
        group=group,
    )
    odd = make_model(hidden=32 if rank == 0 else 16)
    report["layout_disagreement"] = expect_error(
        RuntimeError, enable_layerwise_offload, odd, OffloadPlan("blocks"), device="cpu", group=group
    )
    report["layout_disagreement_left_model"] = odd.blocks[0].qkv.weight.numel() > 0

    # DP waves, exchanged on a CPU group of their own.
    wave_group = dist.new_group([0, 1], backend="gloo")
    coordinator = DPWaveCoordinator(wave_group, timeout_s=30)
    good = coordinator.form_wave(WaveRequest(f"req-{rank}", 4, "a cat", schedule_key=[256, 256, True]))
    report["wave_ids"] = [r.request_id for r in good]
    report["refused_steps"] = expect_error(
        WaveRefusedError, coordinator.form_wave, WaveRequest(f"req-{rank}", 4 if rank == 0 else 6, "a cat")
    )
    report["refused_empty_prompt"] = expect_error(
        WaveRefusedError, coordinator.form_wave, WaveRequest(f"req-{rank}", 4, "" if rank == 1 else "a cat")
    )
    report["refused_extra_args"] = expect_error(
        WaveRefusedError, coordinator.form_wave, WaveRequest(f"req-{rank}", 4, "x", extra_args={"seed_mode": rank})
    )
    report["after_refusals"] = [r.request_id for r in coordinator.form_wave(WaveRequest(f"ok-{rank}", 2, "x"))]

    # Failure scenarios: rank 1 stops participating, then exits.
    timeout_group = dist.new_group([0, 1], backend="gloo")
    death_group = dist.new_group([0, 1], backend="gloo")
    dist.barrier()
    if rank == 1:
        (out_dir / "rank1.json").write_text(json.dumps(report))
        time.sleep(3.0)  # never joins the timed wave, then dies without joining the next one
        os._exit(0)
    failures: list[str] = []
    timed = DPWaveCoordinator(
        timeout_group, timeout_s=1.5, on_failure=[lambda exc: failures.append(type(exc).__name__)]
    )
    start = time.monotonic()
    report["timeout_error"] = expect_error(WaveFailedError, timed.form_wave, WaveRequest("late", 4, "x"))
    report["timeout_elapsed_s"] = time.monotonic() - start
    report["failure_callbacks"] = failures
    start = time.monotonic()
    report["after_failure"] = expect_error(WaveFailedError, timed.form_wave, WaveRequest("again", 4, "x"))
    report["after_failure_elapsed_s"] = time.monotonic() - start
    dying = DPWaveCoordinator(death_group, timeout_s=30)
    start = time.monotonic()
    report["peer_death_error"] = expect_error(WaveFailedError, dying.form_wave, WaveRequest("orphan", 4, "x"))
    report["peer_death_elapsed_s"] = time.monotonic() - start
    (out_dir / "rank0.json").write_text(json.dumps(report))
    os._exit(0)  # the failed groups cannot be torn down cleanly; that is what failing closed means


if __name__ == "__main__":
    main()
