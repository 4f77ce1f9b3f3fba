"""One rank of a multi-rank paged forward (run by test_parallel.py as N real processes over gloo).

argv: MODE MODEL_DIR OUT_DIR, MODE one of cfg2, sp2, sp2-allgather, cfg2-unguided, sp2-cfg2, cfg2-cache (every job with
the step cache ``parallel_cases.CACHE``). Writes
``rank{R}.pt`` with every job's final latents, or ``rank{R}.err`` with the error.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from parallel_cases import CACHE, CASES, run_jobs  # noqa: E402
from rank_process import run_rank  # noqa: E402


def main() -> None:
    mode, model_dir, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])

    def compute() -> dict[str, Any]:
        from omni_models import load
        from omni_models.parallel import enable_parallel, init_parallel

        cfg = 2 if "cfg2" in mode else 1
        sp = 2 if "sp2" in mode else 1
        state = init_parallel(cfg_parallel_size=cfg, sequence_parallel_size=sp)
        allgather = "allgather" in mode  # the blocks sharded over the SP group, streamed by layerwise offload
        pipeline = load(
            str(model_dir),
            device="cpu",
            dtype=torch.float32,
            layerwise_offload=allgather,
            offload_allgather=allgather,
            offload_group=state.offload_group if allgather else None,
        )
        offload = pipeline.offload
        enable_parallel(pipeline, state)
        decisions: list = []
        cache = CACHE if mode.endswith("-cache") else None
        latents = run_jobs(pipeline, CASES["unguided" if "unguided" in mode else "mixed"], cache, decisions)
        return {
            "latents": latents,
            "decisions": decisions,
            "offload_mode": offload.mode if offload else None,
            "host_nbytes": offload.host_nbytes if offload else None,
            "kv_heads": pipeline.kv_caches[0].shape[-2],
        }

    run_rank(out, compute)


if __name__ == "__main__":
    main()
