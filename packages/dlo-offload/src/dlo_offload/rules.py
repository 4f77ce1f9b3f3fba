"""Rules on an offload configuration that are checkable before any model, device or group exists (no torch import:
a server's front process checks its flags with them)."""

from __future__ import annotations

RESIDENT_ALLGATHER_ERROR = (
    "OffloadPlan(resident_blocks={n}) was combined with use_allgather=True: resident blocks keep the weights the "
    "model's own loader put on each rank, which only rank-local mode streams alongside. Pass use_allgather=False "
    "or resident_blocks=0."
)


def check_allgather_plan(resident_blocks: int, *, use_allgather: bool) -> None:
    """The rule sharding over a group imposes on a plan, checkable before any model or group exists.

    Resident blocks keep the weights the model's own loader put on each rank, which only rank-local mode streams
    alongside, so ``resident_blocks > 0`` with ``use_allgather=True`` is a ``ValueError`` saying what to change.
    ``enable_layerwise_offload`` applies it whenever it is given a group.
    """
    if use_allgather and resident_blocks > 0:
        raise ValueError(RESIDENT_ALLGATHER_ERROR.format(n=resident_blocks))
