"""The harness every multi-rank test worker shares: one real process per rank over gloo.

``run_rank(compute)`` joins the gloo group (``RANK``/``WORLD_SIZE``/``MASTER_*`` from the environment), saves what
``compute()`` returns as ``OUT_DIR/rank{R}.pt`` or, when it raises, the traceback as ``OUT_DIR/rank{R}.err`` (and
re-raises), and always tears down the process group (and the device mesh's groups with it).
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def run_rank(out_dir: Path, compute: Callable[[], dict[str, Any]]) -> None:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    try:
        torch.save(compute(), out_dir / f"rank{rank}.pt")
    except BaseException:
        (out_dir / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()  # WORLD and every group built on it (the device mesh's)
