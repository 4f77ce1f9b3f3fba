"""One rank of a multi-rank family forward (run by test_family_parallel.py as real processes over gloo).

argv: MODE CHECKPOINTS OUT_DIR; MODE ``FAMILIES-{cfg2,sp2}[-cache]`` with FAMILIES one or more of ``flux``,
``qwen``, ``wan`` joined by ``+`` (run one after the other in the same processes, to start them once), CHECKPOINTS
theirs in that order joined by ``os.pathsep`` (``-cache``: every job with the step cache
``family_parallel_cases.CACHE``). Writes ``rank{R}.pt`` (per family: final latents per job, decisions) or
``rank{R}.err``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from family_parallel_cases import CACHE, run_family_jobs_with_decisions  # noqa: E402
from rank_process import run_rank  # noqa: E402


def main() -> None:
    mode, checkpoints, out = sys.argv[1], sys.argv[2].split(os.pathsep), Path(sys.argv[3])

    def compute() -> dict[str, Any]:
        import omni_models
        from omni_models.family_parallel import enable_family_parallel
        from omni_models.parallel import init_parallel

        state = init_parallel(
            cfg_parallel_size=2 if "cfg2" in mode else 1, sequence_parallel_size=2 if "sp2" in mode else 1
        )
        report: dict[str, Any] = {}
        for family, checkpoint in zip(mode.split("-")[0].split("+"), checkpoints, strict=True):
            pipe = omni_models.load(checkpoint, max_sequence_length=16)
            enable_family_parallel(pipe, state)
            latents, decisions = run_family_jobs_with_decisions(
                pipe, family, CACHE if mode.endswith("-cache") else None
            )
            report[family] = {"latents": latents, "decisions": decisions}
        return report

    run_rank(out, compute)


if __name__ == "__main__":
    main()
