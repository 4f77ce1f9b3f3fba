"""One rank of a multi-rank family forward (run by test_family_parallel.py as real processes over gloo).

argv: MODE CHECKPOINT OUT_DIR; MODE ``{flux,qwen}-{cfg2,sp2}[-cache]`` (``-cache``: every job with the step cache
``family_parallel_cases.CACHE``). Writes ``rank{R}.pt`` (final latents per job) or
``rank{R}.err``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from family_parallel_cases import CACHE, run_family_jobs_with_decisions  # noqa: E402
from rank_process import run_rank  # noqa: E402


def main() -> None:
    mode, checkpoint, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])

    def compute() -> dict[str, Any]:
        import omni_models
        from omni_models.family_parallel import enable_family_parallel
        from omni_models.parallel import init_parallel

        state = init_parallel(
            cfg_parallel_size=2 if "cfg2" in mode else 1, sequence_parallel_size=2 if "sp2" in mode else 1
        )
        pipe = omni_models.load(checkpoint, max_sequence_length=16)
        enable_family_parallel(pipe, state)
        latents, decisions = run_family_jobs_with_decisions(
            pipe, mode.split("-")[0], CACHE if mode.endswith("-cache") else None
        )
        return {"latents": latents, "decisions": decisions}

    run_rank(out, compute)


if __name__ == "__main__":
    main()
