"""One rank of a multi-rank family forward (run by test_family_parallel.py as real processes over gloo).

argv: MODE CHECKPOINT OUT_DIR; MODE ``{flux,qwen}-{cfg2,sp2}``. Writes ``rank{R}.pt`` (final latents per job) or
``rank{R}.err``.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from family_parallel_cases import run_family_jobs  # noqa: E402


def main() -> None:
    mode, checkpoint, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    try:
        import omni_models
        from omni_models.family_parallel import enable_family_parallel
        from omni_models.parallel import init_parallel

        state = init_parallel(cfg_parallel_size=2 if "cfg2" in mode else 1,
                              sequence_parallel_size=2 if "sp2" in mode else 1)
        pipe = omni_models.load(checkpoint, max_sequence_length=16)
        enable_family_parallel(pipe, state)
        torch.save({"latents": run_family_jobs(pipe, mode.split("-")[0])}, out / f"rank{rank}.pt")
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        from dlo_offload import destroy_model_parallel

        destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
