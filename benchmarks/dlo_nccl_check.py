"""Two-rank correctness checks for dlo_offload's AllGather mode and DP waves (issue 9).

Run under ``torchrun --nproc-per-node 2`` (NCCL + one GPU per rank; set ``NCCL_NVLS_ENABLE=0``), or with
``--smoke`` on the CPU over gloo. Checks, each reported PASS/FAIL by rank 0:
  1. allgather_byte_exact: a stack whose blocks hold bf16 linears, a transposed float8_e4m3fn weight
     (stride (1, h)) with a float32 scale, a bool and an int64 buffer is offloaded in AllGather mode over the
     DLO group; inside every block's forward each tensor equals the resident reference byte for byte, with
     its dtype, shape and stride, and every forward output equals the resident output exactly. Each rank runs
     its own input (DP); each rank keeps half of every block on the host.
  2. wave_refused_mismatched_steps: rank 0 asks for 4 steps, rank 1 for 6; both ranks refuse the wave with
     the same error, before any weight collective; a matching wave then still forms.
  3. wave_timeout_fails_closed: rank 1 does not join; rank 0's wave fails after its timeout and the
     coordinator refuses every later wave at once.
  4. wave_peer_death_fails_closed: rank 1 exits; rank 0's wave fails within its timeout.
Wave metadata travels over a gloo group (the coordinator's contract), weights over the NCCL group.

Usage (GPU):  NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 benchmarks/dlo_nccl_check.py --out "$OUT"
Smoke (CPU):  torchrun --nproc-per-node 2 benchmarks/dlo_nccl_check.py --smoke
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from dlo_offload import (  # noqa: E402
    DPWaveCoordinator,
    OffloadPlan,
    WaveFailedError,
    WaveRefusedError,
    WaveRequest,
    enable_layerwise_offload,
)


class FP8Projection(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        weight = torch.randn(hidden, hidden) / math.sqrt(hidden)
        scale = weight.abs().max() / 448.0
        self.weight = nn.Parameter((weight / scale).to(torch.float8_e4m3fn).t().contiguous().t(), requires_grad=False)
        self.register_buffer("weight_scale", scale.reshape(1).float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.weight.to(x.dtype) * self.weight_scale.to(x.dtype)).t()


class Block(nn.Module):
    def __init__(self, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden).to(dtype)
        self.fc1 = nn.Linear(hidden, 2 * hidden).to(dtype)
        self.fc2 = nn.Linear(2 * hidden, hidden).to(dtype)
        self.proj = FP8Projection(hidden)
        self.register_buffer("keep", torch.rand(hidden) > 0.3)
        self.register_buffer("positions", torch.arange(hidden), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x)))) * self.keep
        return x + self.proj(x) + self.positions.to(x.dtype) * 1e-3


class Stack(nn.Module):
    def __init__(self, hidden: int, blocks: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(hidden, dtype) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


def check_allgather(group: dist.ProcessGroup, device: torch.device, hidden: int, blocks: int) -> dict:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = Stack(hidden, blocks, dtype).requires_grad_(False)
    reference = copy.deepcopy(model).to(device)
    rank = dist.get_rank(group)
    handle = enable_layerwise_offload(model, OffloadPlan("blocks"), device=device, group=group)
    mismatches: list[str] = []

    def checker(index: int):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: object) -> None:
            want = dict(reference.blocks[index].named_parameters()) | dict(reference.blocks[index].named_buffers())
            got = dict(module.named_parameters()) | dict(module.named_buffers())
            for name, w in want.items():
                g = got[name]
                same_meta = (g.dtype, g.shape, g.stride()) == (w.dtype, w.shape, w.stride())
                if not same_meta or tensor_bytes(g) != tensor_bytes(w):
                    mismatches.append(f"blocks.{index}.{name}")

        return hook

    hooks = [model.blocks[i].register_forward_pre_hook(checker(i)) for i in range(blocks)]
    x = torch.randn(4, 64, hidden, generator=torch.Generator().manual_seed(100 + rank)).to(device, dtype)
    outputs_equal = []
    with torch.inference_mode():
        for _ in range(3):
            outputs_equal.append(bool(torch.equal(model(x), reference(x))))
    for h in hooks:
        h.remove()
    result = {
        "mode": handle.mode,
        "mismatched_tensors": mismatches,
        "outputs_equal": outputs_equal,
        "fp8_weight_stride": list(reference.blocks[0].proj.weight.stride()),
        "host_bytes": handle.host_nbytes,
        "slot_bytes": handle.slot_nbytes,
    }
    handle.remove()
    result["restored_equal"] = all(
        tensor_bytes(a) == tensor_bytes(b) and a.stride() == b.stride()
        for a, b in zip(model.state_dict().values(), reference.state_dict().values(), strict=True)
    )
    result["pass"] = (
        result["mode"] == "allgather" and not mismatches and all(outputs_equal) and result["restored_equal"]
    )
    return result


def expect(kind: type[BaseException], fn, *args) -> tuple[str, float]:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    try:
        fn(*args)
    except kind as exc:
        return str(exc), time.monotonic() - start
    return "<no error>", time.monotonic() - start


def gather_rows(row: dict) -> list[dict]:
    rows: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(rows, row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="CPU + gloo")
    parser.add_argument("--timeout", type=float, default=3.0, help="wave timeout for the failure checks (s)")
    args = parser.parse_args()
    backend = "gloo" if args.smoke else "nccl"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        raise SystemExit(f"run with exactly 2 ranks (torchrun --nproc-per-node 2), got {world}")
    if args.smoke:
        device = torch.device("cpu")
    else:
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    hidden, blocks = (32, 5) if args.smoke else (1024, 7)
    checks: dict[str, dict] = {}

    ag_rows = gather_rows(check_allgather(dist.group.WORLD, device, hidden, blocks))
    checks["allgather_byte_exact"] = {"pass": all(r["pass"] for r in ag_rows), "per_rank": ag_rows}

    wave_group = dist.new_group([0, 1], backend="gloo")
    coordinator = DPWaveCoordinator(wave_group, timeout_s=60)
    refused, _ = expect(
        WaveRefusedError, coordinator.form_wave, WaveRequest(f"req-{rank}", 4 if rank == 0 else 6, "a cat")
    )
    later = [r.request_id for r in coordinator.form_wave(WaveRequest(f"ok-{rank}", 4, "a cat"))]
    rows = gather_rows({"error": refused, "later_wave": later})
    checks["wave_refused_mismatched_steps"] = {
        "pass": all("got [4, 6]" in r["error"] for r in rows)
        and rows[0]["error"] == rows[1]["error"]
        and all(r["later_wave"] == ["ok-0", "ok-1"] for r in rows),
        "per_rank": rows,
    }

    timeout_group = dist.new_group([0, 1], backend="gloo")
    death_group = dist.new_group([0, 1], backend="gloo")
    dist.barrier(group=wave_group)
    if rank == 1:
        time.sleep(args.timeout + 1.0)  # does not join the timed wave, then dies without joining the next
        os._exit(0)
    timed = DPWaveCoordinator(timeout_group, timeout_s=args.timeout)
    error, elapsed = expect(WaveFailedError, timed.form_wave, WaveRequest("late", 4, "x"))
    again, again_elapsed = expect(WaveFailedError, timed.form_wave, WaveRequest("again", 4, "x"))
    checks["wave_timeout_fails_closed"] = {
        "pass": "timed out after" in error
        and args.timeout * 0.95 <= elapsed < args.timeout + 2.0
        and "failed closed earlier" in again
        and again_elapsed < 0.1,
        "error": error,
        "elapsed_s": elapsed,
        "later_error": again,
        "later_elapsed_s": again_elapsed,
    }
    dying = DPWaveCoordinator(death_group, timeout_s=30.0)
    error, elapsed = expect(WaveFailedError, dying.form_wave, WaveRequest("orphan", 4, "x"))
    checks["wave_peer_death_fails_closed"] = {
        "pass": error != "<no error>" and elapsed < 30.0,
        "error": error,
        "elapsed_s": elapsed,
        "timeout_s": 30.0,
    }

    print(f"dlo_nccl_check  backend={backend} world={world} device={device}")
    for name, check in checks.items():
        detail = {k: v for k, v in check.items() if k not in ("pass", "per_rank")}
        if name == "allgather_byte_exact":
            detail = {
                "mismatched": [r["mismatched_tensors"] for r in check["per_rank"]],
                "outputs_equal": [r["outputs_equal"] for r in check["per_rank"]],
                "host_bytes_per_rank": check["per_rank"][0]["host_bytes"],
            }
        print(f"{'PASS' if check['pass'] else 'FAIL'}  {name:<32} {json.dumps(detail, default=str)[:300]}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "dlo_nccl_check.json").write_text(json.dumps(checks, indent=2, default=str))
    sys.stdout.flush()
    # The failed wave groups cannot be torn down cleanly (that is what failing closed means): exit hard.
    os._exit(0 if all(c["pass"] for c in checks.values()) else 1)


if __name__ == "__main__":
    main()
