"""The one table of request limits every model kind, the server and the CLI share, and the one seed draw.

A model narrows these in its ``ModelInfo`` (its sizes, its prompt length); nothing widens them. Validation of a
request against them happens once, in ``omni_models.request.resolve_request``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from omni_models.errors import InvalidRequestError

MAX_INFERENCE_STEPS = 1000
MAX_GUIDANCE_SCALE = 100.0
MAX_SEED = 2**63 - 1
MAX_IMAGES_PER_REQUEST = 10
MAX_VIDEOS_PER_REQUEST = 4  # ``n`` of a video request: each video is a long sequence on its own
MAX_FPS = 60  # a video's frame rate (a label of the output: the model draws the same frames)
MAX_INPUT_IMAGES = 4  # input images of one edit request (a model may take fewer)
MAX_LORA_SCALE = 10.0  # |lora_scale|: diffusers takes any weight; past a few times the trained delta is noise
# A request that names no seed gets one drawn from [0, SEED_DRAW_RANGE), by ``draw_seed`` only.
SEED_DRAW_RANGE = 2**31 - 1


def draw_seed(rng: random.Random | None = None) -> int:
    """The seed of a request that names none: from ``rng`` (an engine's seeded stream) or the system's entropy."""
    return (rng or random.SystemRandom()).randrange(SEED_DRAW_RANGE)


def check_prompt_batch(
    prompt: str | Sequence[str], negative_prompt: str | Sequence[str | None] | None
) -> tuple[list[str], list[str | None]]:
    """The prompts of a one-call batch and one negative prompt per prompt (a single one is repeated).

    Raises InvalidRequestError for an empty prompt list (``param="prompt"``) or a negative-prompt list of
    another length (``param="negative_prompt"``). The prompts' contents are checked later, per request.
    """
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    if not prompts:
        raise InvalidRequestError("prompt list is empty", param="prompt")
    if negative_prompt is None or isinstance(negative_prompt, str):
        return prompts, [negative_prompt] * len(prompts)
    negatives = list(negative_prompt)
    if len(negatives) != len(prompts):
        raise InvalidRequestError(
            f"got {len(negatives)} negative prompts for {len(prompts)} prompts", param="negative_prompt"
        )
    return prompts, negatives
