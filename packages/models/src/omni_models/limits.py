"""Request limits shared by every pipeline of omni_models, and the validators that enforce them.

Each validator returns the checked value or raises ``InvalidRequestError`` whose ``param`` names the field.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from omni_models.errors import InvalidRequestError

MAX_INFERENCE_STEPS = 1000
MAX_GUIDANCE_SCALE = 100.0
MAX_SEED = 2**63 - 1


def check_prompt(value: Any, param: str = "prompt") -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequestError(f"{param} must be a non-empty string, got {value!r}", param=param)
    return value


def check_steps(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_INFERENCE_STEPS:
        raise InvalidRequestError(
            f"num_inference_steps must be an integer in [1, {MAX_INFERENCE_STEPS}], got {value!r}",
            param="num_inference_steps",
        )
    return value


def check_scale(value: Any, param: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0.0 <= value <= MAX_GUIDANCE_SCALE:
        raise InvalidRequestError(f"{param} must be a finite number in [0, {MAX_GUIDANCE_SCALE:g}], got {value!r}",
                                  param=param)
    return float(value)


def check_seed(value: Any, *, reserve: int = 0) -> int:
    """A seed such that ``seed + reserve`` (the last image of a multi-image request) is still a valid seed."""
    top = MAX_SEED - reserve
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
        bound = "2**63 - 1" if reserve == 0 else f"2**63 - 1 - {reserve}"
        raise InvalidRequestError(f"seed must be an integer in [0, {bound}], got {value!r}", param="seed")
    return value


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
        raise InvalidRequestError(f"got {len(negatives)} negative prompts for {len(prompts)} prompts",
                                  param="negative_prompt")
    return prompts, negatives
