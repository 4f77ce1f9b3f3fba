"""Step caching per request: what a request asks for (presets and knobs) and when a step reuses its residual.

A transformer's repeated blocks (the DiT's ``blocks``; FLUX.1's ``transformer_blocks`` then
``single_transformer_blocks``; Qwen-Image's ``transformer_blocks``) are cut, per request, into the first ``F``
blocks, the middle and the last ``B`` blocks. Every step of every row runs the first and the last blocks; the
middle runs only on the steps the policy *computes*. On a *cached* step a row adds the middle's residual (its
output minus its input) as its last computed step left it, or a Taylor forecast of it (TaylorSeer: finite
differences over the computed steps, order 1 or 2).

Methods (``StepCacheConfig.method``):
- ``"residual"`` (the FBCache/DBCache test): after the first ``F`` blocks, the relative L1 change of their
  residual against the row's last *computed* step, ``sum |r_t - r_c| / sum |r_c|``, decides: below
  ``threshold`` the step is cached;
- ``"mask"``: a static step mask, a named preset or the list of step indices that compute;
- ``"magcache"`` (MagCache-style): ``ratios[t]`` is the model's calibrated ratio of the middle residual's mean
  magnitude at step ``t`` to step ``t - 1`` (``python -m omni_models.step_cache_calibrate``). Since the last
  computed step ``c``, the error of reusing its residual at step ``t`` is estimated as
  ``sum_{k=c+1..t} |1 - prod_{j=c+1..k} ratios[j]|``; below ``threshold`` the step is cached. No measurement runs
  in the forward, so ``first_blocks`` may be 0.

Guards common to both: the first ``warmup_steps`` compute; a step computes when the job has cached
``max_consecutive_cached`` steps in a row or ``max_cached_steps`` in all; with ``compute_last_step`` the last
step always computes.

A job's rows (cond and uncond under CFG) decide together: the job's change is the sum of its rows' numerators
over the sum of their denominators. This module is the policy: plain numbers, no tensors (``omni_models.request``
imports it); the tensors a cached row holds and the batched forward that gathers the computing rows are
``omni_models.step_cache_blocks``.

``parse_step_cache(value, ...)`` turns what a request or the server's ``--step-cache``/``--step-cache-config``
give (a preset name, an object of knobs, or a preset name plus knobs) into a ``StepCacheConfig``, checked against
the model's block count and the request's steps; a bad value raises ``InvalidRequestError`` with ``param="cache"``
and a message naming the knob.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from omni_models.errors import InvalidRequestError

Method = Literal["off", "residual", "mask", "magcache"]
MaskPreset = Literal["medium", "fast", "ultra"]
MAX_TAYLOR_ORDER = 2
PARAM = "cache"


class StepCacheConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One request's step cache (every knob concrete; see the module docstring).

    ``mask``: for ``method="mask"``, a preset (``medium``: compute every 2nd step after the warm-up, ``fast``:
    every 3rd, ``ultra``: every 4th) or the indices of the steps that compute. ``ratios``: for
    ``method="magcache"``, one calibrated magnitude ratio per step of the request.
    """

    method: Method = "residual"
    first_blocks: Annotated[int, Meta(ge=0, le=1000)] = 1
    last_blocks: Annotated[int, Meta(ge=0, le=1000)] = 0
    threshold: Annotated[float, Meta(ge=0.0, le=10.0)] = 0.08
    warmup_steps: Annotated[int, Meta(ge=0, le=1000)] = 2
    max_cached_steps: Annotated[int, Meta(ge=0, le=1000)] | None = None
    max_consecutive_cached: Annotated[int, Meta(ge=1, le=1000)] | None = 3
    compute_last_step: bool = True
    taylor_order: Annotated[int, Meta(ge=0, le=MAX_TAYLOR_ORDER)] = 0
    mask: MaskPreset | list[Annotated[int, Meta(ge=0)]] | None = None
    ratios: list[Annotated[float, Meta(gt=0.0, le=100.0)]] | None = None

    @property
    def enabled(self) -> bool:
        return self.method != "off"


OFF = StepCacheConfig(method="off")
# Tuned on the two trained models (benchmarks/RESULTS.md, 2026-12-02: omni-shapes-tiny at 20 steps and
# omni-flux-shapes-tiny at 28, on CPU): ``safe`` keeps the median image >= 35 dB from the uncached one with adherence
# unchanged, ``fast`` >= 30 dB within 2 points.
PRESETS: dict[str, StepCacheConfig] = {
    "off": OFF,
    "safe": StepCacheConfig(method="residual", first_blocks=1, threshold=0.1, warmup_steps=3, max_consecutive_cached=2),
    "fast": StepCacheConfig(method="residual", first_blocks=1, threshold=0.2, warmup_steps=2, max_consecutive_cached=3),
}
KNOBS: tuple[str, ...] = StepCacheConfig.__struct_fields__


def _describe(config: StepCacheConfig) -> dict[str, Any]:
    return msgspec.to_builtins(config)


def preset_table() -> dict[str, dict[str, Any]]:
    """Every preset's knobs (``/v1/models`` lists them)."""
    return {name: _describe(config) for name, config in PRESETS.items()}


def _invalid(message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=PARAM)


def _from_knobs(base: StepCacheConfig, knobs: Mapping[str, Any], where: str) -> StepCacheConfig:
    unknown = sorted(set(knobs) - set(KNOBS))
    if unknown:
        raise _invalid(f"{where} has unknown knob(s) {', '.join(unknown)}; the knobs are {', '.join(KNOBS)}")
    merged = {**_describe(base), **knobs}
    try:
        return msgspec.convert(merged, StepCacheConfig, strict=True)
    except msgspec.ValidationError as exc:
        # msgspec names the knob as a path ("Expected `float` <= 10.0 - at `$.threshold`"): say it as the field.
        text, _, path = str(exc).partition(" - at `$")
        knob = path.rstrip("`").lstrip(".").split("[")[0]
        raise _invalid(f"{where}.{knob}: {text}" if knob else f"{where}: {text}") from None


def parse_step_cache(
    value: Any,
    *,
    num_blocks: int | None,
    num_steps: int | None,
    default: StepCacheConfig = OFF,
    where: str = PARAM,
) -> StepCacheConfig:
    """``value`` (None: ``default``; a preset name; an object of knobs over the ``residual`` defaults, or over the
    preset it names as ``{"preset": "fast", ...}``) as a config checked for a model of ``num_blocks`` repeated
    blocks and a request of ``num_steps`` steps (None: not checked against that).
    ``InvalidRequestError(param="cache")`` names the knob."""
    if value is None:
        config = default
    elif isinstance(value, str):
        if value not in PRESETS:
            raise _invalid(
                f"{where} must be one of the presets {', '.join(PRESETS)} or an object of knobs, got {value!r}"
            )
        config = PRESETS[value]
    elif isinstance(value, Mapping):
        knobs = dict(value)
        preset = knobs.pop("preset", None)
        if preset is not None and (not isinstance(preset, str) or preset not in PRESETS):
            raise _invalid(f"{where}.preset must be one of {', '.join(PRESETS)}, got {preset!r}")
        config = _from_knobs(PRESETS[preset] if preset else StepCacheConfig(), knobs, where)
    else:
        raise _invalid(f"{where} must be a preset name or an object of knobs, got {type(value).__name__}")
    check_config(config, num_blocks=num_blocks, num_steps=num_steps, where=where)
    return config


def check_config(config: StepCacheConfig, *, num_blocks: int | None, num_steps: int | None, where: str = PARAM) -> None:
    """The rules between knobs and against the model's ``num_blocks`` and the request's ``num_steps`` (None: that
    check is left out); ``InvalidRequestError`` naming the knob."""
    if not config.enabled:
        return
    if num_blocks is None:
        pass
    elif num_blocks < 1:
        raise _invalid(f'{where}: this model has no repeated blocks to cache; use "off"')
    elif num_blocks - config.first_blocks - config.last_blocks < 1:
        raise _invalid(
            f"{where}.first_blocks + {where}.last_blocks = {config.first_blocks + config.last_blocks} leaves no "
            f"middle block to cache of the model's {num_blocks}; their sum must be at most {num_blocks - 1}"
        )
    if config.method == "residual":
        if config.first_blocks < 1:
            raise _invalid(f"{where}.first_blocks must be >= 1 for the residual test (its residual decides)")
    if config.method != "mask" and config.mask is not None:
        raise _invalid(f'{where}.mask applies to method "mask" only')
    if config.method != "magcache" and config.ratios is not None:
        raise _invalid(f'{where}.ratios applies to method "magcache" only')
    if config.method == "magcache":
        if config.ratios is None:
            raise _invalid(
                f'{where}.ratios is required for method "magcache": one magnitude ratio per step, as '
                "python -m omni_models.step_cache_calibrate records them for the model and steps count"
            )
        if num_steps is not None and len(config.ratios) != num_steps:
            raise _invalid(
                f"{where}.ratios has {len(config.ratios)} entries but the request has {num_steps} steps; calibrate "
                "for this steps count"
            )
    if config.method == "mask":
        if config.mask is None:
            raise _invalid(f'{where}.mask is required for method "mask": a preset (medium, fast, ultra) or steps')
        if not isinstance(config.mask, str) and num_steps is not None:
            bad = [step for step in config.mask if step >= num_steps]
            if bad:
                raise _invalid(
                    f"{where}.mask names step(s) {bad} of a {num_steps}-step request (steps 0..{num_steps - 1})"
                )


def server_default(preset: str, knobs: Mapping[str, Any] | None, *, where: str) -> StepCacheConfig:
    """A server's default step cache: ``preset``, with ``knobs`` over it (over the ``residual`` defaults when the
    preset is ``off``, so knobs alone name a config), checked without a model."""
    if not knobs:
        return parse_step_cache(preset, num_blocks=None, num_steps=None, where=where)
    value = {**knobs} if preset == "off" else {"preset": preset, **knobs}
    return parse_step_cache(value, num_blocks=None, num_steps=None, where=where)


def mask_computes(mask: MaskPreset | Sequence[int], step: int, warmup_steps: int) -> bool:
    """Whether the static mask computes ``step`` (the warm-up and the guards are the caller's)."""
    if isinstance(mask, str):
        period = {"medium": 2, "fast": 3, "ultra": 4}[mask]
        return (step - warmup_steps) % period == 0
    return step in mask


class Decisions(msgspec.Struct, kw_only=True):
    """One job's step-cache history: the policy's state (plain numbers). ``diffs[i]`` is step ``i``'s relative
    change (None where none was measured: a warm-up step, a mask, the first step); ``computed[i]`` its decision."""

    num_steps: int
    computed: list[bool] = msgspec.field(default_factory=list)
    diffs: list[float | None] = msgspec.field(default_factory=list)
    consecutive_cached: int = 0

    @property
    def cached_steps(self) -> int:
        return len(self.computed) - sum(self.computed)

    @property
    def last_computed(self) -> int | None:
        for index in range(len(self.computed) - 1, -1, -1):
            if self.computed[index]:
                return index
        return None

    def record(self, computed: bool, diff: float | None) -> None:
        self.computed.append(computed)
        self.diffs.append(None if diff is None or not math.isfinite(diff) else diff)
        self.consecutive_cached = 0 if computed else self.consecutive_cached + 1


def must_compute(config: StepCacheConfig, decisions: Decisions, step: int) -> bool:
    """The guards every method shares: warm-up, the limits on cached steps, the last step, nothing to reuse yet."""
    if step < config.warmup_steps or decisions.last_computed is None:
        return True
    if config.compute_last_step and step == decisions.num_steps - 1:
        return True
    if config.max_consecutive_cached is not None and decisions.consecutive_cached >= config.max_consecutive_cached:
        return True
    return config.max_cached_steps is not None and decisions.cached_steps >= config.max_cached_steps


def needs_probe(config: StepCacheConfig) -> bool:
    """Whether the decision reads the first blocks' residual (the residual test) or only the step index."""
    return config.method == "residual"


def magnitude_error(ratios: Sequence[float], last_computed: int, step: int) -> float:
    """MagCache's estimate of the error of reusing step ``last_computed``'s residual at ``step``: the accumulated
    ``|1 - product of the ratios since then|`` over the skipped steps and this one."""
    product, error = 1.0, 0.0
    for k in range(last_computed + 1, step + 1):
        product *= ratios[k]
        error += abs(1.0 - product)
    return error


def decide(config: StepCacheConfig, decisions: Decisions, step: int, diff: float | None) -> bool:
    """True: ``step`` computes the middle blocks; False: it reuses the cached residual. ``diff`` is the job's
    relative L1 change of the first blocks' residual (residual test; None when not measured)."""
    if must_compute(config, decisions, step):
        return True
    if config.method == "mask":
        return mask_computes(config.mask, step, config.warmup_steps)
    if config.method == "magcache":
        return magnitude_error(config.ratios, decisions.last_computed, step) >= config.threshold
    return diff is None or not math.isfinite(diff) or diff >= config.threshold


def relative_change(numerators: Sequence[float], denominators: Sequence[float]) -> float:
    """A job's relative L1 change from its rows' ``sum |r - r_prev|`` and ``sum |r_prev|``."""
    total = sum(denominators)
    return math.inf if total <= 0 else sum(numerators) / total


class StepCacheStats(msgspec.Struct, frozen=True, kw_only=True):
    """What one image's step cache did: steps that ran the middle blocks, the decisions and measured changes."""

    method: Method
    num_steps: int
    computed_steps: int
    middle_blocks: int
    num_blocks: int
    decisions: str  # one letter per step: C computed, S skipped (the cached residual reused)
    residual_diffs: list[float | None]

    @property
    def computed_fraction(self) -> float:
        return self.computed_steps / self.num_steps if self.num_steps else 1.0

    @property
    def block_fraction(self) -> float:
        """Block evaluations run over an uncached run's (the FLOP fraction of the repeated blocks)."""
        if not self.num_steps or not self.num_blocks:
            return 1.0
        skipped = (self.num_steps - self.computed_steps) * self.middle_blocks
        return 1.0 - skipped / (self.num_steps * self.num_blocks)


def stats_of(config: StepCacheConfig, decisions: Decisions, num_blocks: int) -> StepCacheStats:
    return StepCacheStats(
        method=config.method,
        num_steps=decisions.num_steps,
        computed_steps=sum(decisions.computed),
        middle_blocks=num_blocks - config.first_blocks - config.last_blocks,
        num_blocks=num_blocks,
        decisions="".join("C" if c else "S" for c in decisions.computed),
        residual_diffs=list(decisions.diffs),
    )


__all__ = [
    "KNOBS",
    "OFF",
    "PRESETS",
    "Decisions",
    "StepCacheConfig",
    "StepCacheStats",
    "check_config",
    "decide",
    "magnitude_error",
    "mask_computes",
    "must_compute",
    "needs_probe",
    "parse_step_cache",
    "preset_table",
    "relative_change",
    "server_default",
    "stats_of",
]
