"""Step caching per request (``omni_models.step_cache`` and ``step_cache_blocks``): the policy's rules, the knobs'
400s, the Taylor forecast, and rows of different caches in one batched forward giving each the image it gives
alone on a FLUX.1 checkpoint through diffusers' transformer (the shipped DiT's paged forward: in
tests/omni_server/test_step_cache_engine.py, through the engine)."""

from __future__ import annotations

import math

import pytest
import torch

from omni_models import GenerationRequest, InvalidRequestError, resolve_request
from omni_models.step_cache import PRESETS, Decisions, StepCacheConfig, decide, parse_step_cache, relative_change
from omni_models.step_cache_blocks import BatchedRows, CachedForward, JobStepCache, RowCache, RowSlot

CUSTOM = {"threshold": 1.5, "warmup_steps": 1, "max_consecutive_cached": 2, "taylor_order": 2}
CONFIGS = ("off", "safe", "fast", CUSTOM)


# --- the policy -------------------------------------------------------------------------------------------------


def test_guards_come_before_the_threshold() -> None:
    config = StepCacheConfig(threshold=0.1, warmup_steps=2, max_consecutive_cached=2, max_cached_steps=3)
    decisions = Decisions(num_steps=10)
    taken = []
    for step in range(10):
        computed = decide(config, decisions, step, 0.01)  # always below the threshold
        decisions.record(computed, 0.01)
        taken.append("C" if computed else "S")
    # warm-up (2), then at most 2 cached in a row, at most 3 cached in all, the last step computes
    assert "".join(taken) == "CCSSCSCCCC"
    assert not decide(config, Decisions(num_steps=10, computed=[True] * 3), 3, 0.09)
    assert decide(config, Decisions(num_steps=10, computed=[True] * 3), 3, 0.1)  # at the threshold: compute
    assert decide(config, Decisions(num_steps=10, computed=[True] * 3), 3, None)  # nothing measured: compute


def test_a_static_mask_and_a_job_deciding_from_all_its_rows() -> None:
    config = StepCacheConfig(method="mask", first_blocks=0, mask="fast", warmup_steps=2, max_consecutive_cached=None)
    decisions = Decisions(num_steps=9)
    for step in range(9):
        decisions.record(decide(config, decisions, step, None), None)
    assert "".join("C" if c else "S" for c in decisions.computed) == "CCCSSCSSC"
    listed = StepCacheConfig(method="mask", first_blocks=0, mask=[0, 3], warmup_steps=0, compute_last_step=False)
    assert [decide(listed, Decisions(num_steps=5, computed=[True]), s, None) for s in (1, 3)] == [False, True]
    # cond changed by 1 of 10, uncond by 3 of 10: the job's change is 4 of 20
    assert relative_change([1.0, 3.0], [10.0, 10.0]) == pytest.approx(0.2)
    assert math.isinf(relative_change([1.0], [0.0]))


def test_magcache_skips_while_the_accumulated_magnitude_error_stays_below_the_threshold() -> None:
    from omni_models.step_cache import magnitude_error

    ratios = [1.0, 1.2, 0.98, 0.97, 0.97, 0.97, 1.0]
    assert magnitude_error(ratios, 2, 4) == pytest.approx(0.03 + (1 - 0.97 * 0.97))
    config = StepCacheConfig(method="magcache", first_blocks=0, threshold=0.1, warmup_steps=2, ratios=ratios)
    decisions = Decisions(num_steps=7)
    for step in range(7):
        decisions.record(decide(config, decisions, step, None), None)
    # step 2: |1 - 0.98| = 0.02 -> skip; step 3: 0.02 + |1 - 0.98 * 0.97| = 0.069 -> skip; step 4: 0.165 -> compute
    assert "".join("C" if c else "S" for c in decisions.computed) == "CCSSCSC"


def test_the_calibration_records_one_ratio_per_step_that_serves_as_a_cache() -> None:
    import omni_models
    from omni_models.step_cache_calibrate import calibrate

    pipe = omni_models.load("omni-shapes-tiny", device="cpu")
    config = calibrate(pipe, ["a red circle"], steps=3, threshold=0.2)
    assert config["method"] == "magcache" and len(config["ratios"]) == 3 and config["ratios"][0] == 1.0
    assert all(0.5 < r < 2.0 for r in config["ratios"])
    resolved = resolve_request(pipe.info, GenerationRequest(prompt="red circle", num_inference_steps=3, cache=config))
    assert resolved.cache.ratios == config["ratios"]
    with pytest.raises(InvalidRequestError, match=r"cache.ratios has 3 entries but the request has 4 steps"):
        resolve_request(pipe.info, GenerationRequest(prompt="red circle", num_inference_steps=4, cache=config))


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("slow", "one of the presets off, safe, fast"),
        (3, "a preset name or an object"),
        ({"treshold": 0.1}, "unknown knob(s) treshold"),
        ({"threshold": -0.1}, "cache.threshold: Expected `float` >= 0.0"),
        ({"taylor_order": 3}, "cache.taylor_order"),
        ({"warmup_steps": "2"}, "cache.warmup_steps: Expected `int`, got `str`"),
        ({"first_blocks": 4, "last_blocks": 2}, "leaves no middle block"),
        ({"first_blocks": 0}, "cache.first_blocks must be >= 1"),
        ({"method": "mask"}, "cache.mask is required"),
        ({"method": "mask", "mask": [0, 8]}, "step(s) [8] of a 8-step request"),
        ({"preset": "faster"}, "cache.preset must be one of"),
        ({"method": "magcache", "first_blocks": 0}, "cache.ratios is required"),
        ({"ratios": [1.0] * 8}, 'cache.ratios applies to method "magcache" only'),
        ({"method": "magcache", "ratios": [1.0, 0.0] * 4}, "cache.ratios"),
    ],
)
def test_bad_knobs_are_refused_naming_the_field(value, needle: str) -> None:
    import omni_models

    info = omni_models.inspect("omni-shapes-tiny").info  # 6 blocks
    with pytest.raises(InvalidRequestError) as caught:
        resolve_request(info, GenerationRequest(prompt="red circle", num_inference_steps=8, cache=value))
    assert caught.value.param == "cache" and needle in str(caught.value)


def test_presets_resolve_and_off_is_no_cache() -> None:
    assert parse_step_cache("fast", num_blocks=6, num_steps=20) == PRESETS["fast"]
    over = parse_step_cache({"preset": "fast", "threshold": 0.3}, num_blocks=6, num_steps=20)
    assert over.threshold == 0.3 and over.taylor_order == PRESETS["fast"].taylor_order
    import omni_models

    info = omni_models.inspect("omni-shapes-tiny").info
    assert resolve_request(info, GenerationRequest(prompt="red circle", cache="off")).cache is None
    default = resolve_request(info, GenerationRequest(prompt="red circle"), default_cache=PRESETS["safe"])
    assert default.cache == PRESETS["safe"]


def test_taylor_factors_forecast_a_quadratic_exactly() -> None:
    row = RowCache()
    for step in (0, 2, 4):  # computed steps of r(t) = 1 + 2t + 3t^2, one stream
        row.update(step, [torch.tensor([1.0 + 2 * step + 3 * step**2])], order=2)
    # order 2 from three points of a quadratic: the backward differences give r'(4) - 3*2 and r'' exactly
    forecast = row.forecast(5)[0].item()
    first = (57.0 - 17.0) / 2  # (r(4) - r(2)) / 2
    second = (first - (17.0 - 1.0) / 2) / 2
    assert forecast == pytest.approx(57.0 + first * 1 + second / 2)
    assert JobStepCache.bytes_bound(StepCacheConfig(taylor_order=2), [(10, 4)] * 2, 4) == 2 * 4 * (3 * 14 + 10)


def test_rows_that_skip_never_enter_the_middle_and_get_their_own_residual() -> None:
    """Three rows through four toy blocks (x -> 2x + row): row 0 has no cache, row 1 computes, row 2 skips."""
    config = StepCacheConfig(threshold=0.5, warmup_steps=0, first_blocks=1, last_blocks=1)
    jobs = [JobStepCache.create(config, num_blocks=4, num_steps=4, num_rows=1) for _ in range(2)]
    seen: list[list[int]] = []

    def walk(x: Tensor, slots) -> Tensor:
        run = CachedForward(slots, 4, BatchedRows(3))
        for index in range(4):
            (x,) = run.at_boundary(index, [x])
            rows = run.computing(index)
            rows = torch.arange(3) if rows is None else rows
            seen.append(rows.tolist())
            x = x.index_copy(0, rows, 2 * x.index_select(0, rows) + rows.view(-1, 1).float())
        (x,) = run.at_boundary(4, [x])
        run.finish()
        return x

    Tensor = torch.Tensor  # noqa: N806
    x = torch.ones(3, 2)
    slots = [None, RowSlot(jobs[0], 0, 0), RowSlot(jobs[1], 0, 0)]
    first = walk(x, slots)
    assert all(rows == [0, 1, 2] for rows in seen)  # step 0: nothing cached yet, every row computes
    seen.clear()
    jobs[1].rows[0].probe = jobs[1].rows[0].probe * 1.0  # job 1's probe unchanged next step: it skips
    jobs[0].rows[0].probe = jobs[0].rows[0].probe * 10.0  # job 0's reference differs: it computes
    second = walk(x, [None, RowSlot(jobs[0], 0, 1), RowSlot(jobs[1], 0, 1)])
    assert seen == [[0, 1, 2], [0, 1], [0, 1], [0, 1, 2]]  # row 2 skips blocks 1 and 2
    assert torch.equal(second[:2], first[:2]) and torch.equal(second[2], first[2])  # same input: same residual
    assert jobs[1].decisions.computed == [True, False] and jobs[0].decisions.computed == [True, True]


# --- one batched forward, each request its own cache --------------------------------------------------------------


def _generate(pipe, configs, seed: int, steps: int, **fields):
    jobs = []
    for index, cache in enumerate(configs):
        request = GenerationRequest(
            prompt="a red circle at the top left on a white background" if index % 2 == 0 else "a blue square",
            seed=seed + index,
            num_inference_steps=steps,
            cache=cache,
            **fields,
        )
        jobs += pipe.prepare(resolve_request(pipe.info, request))
    if pipe.info.paged_kv:
        pipe.allocate_kv_caches_for(jobs, 16)
    pipe.start(jobs)
    while not jobs[0].finished:
        pipe.step(jobs)
    images = pipe.decode(jobs)
    stats = [None if job.step_cache is None else job.step_cache.stats() for job in jobs]
    pipe.release(jobs)
    assert all(job.step_cache is None or job.step_cache.nbytes() == 0 for job in jobs)  # freed at release
    return images, stats


def _check_batched_equals_alone(pipe, psnr, steps: int, **fields) -> list:
    batched, stats = _generate(pipe, CONFIGS, 3, steps, **fields)
    for index, config in enumerate(CONFIGS):
        alone, alone_stats = _generate(pipe, [None] * index + [config], 3, steps, **fields)
        if config != "off":  # the same decisions, step by step, from the same measured changes
            assert stats[index].decisions == alone_stats[index].decisions
            measured = [d for d in stats[index].residual_diffs if d is not None]
            assert measured == pytest.approx([d for d in alone_stats[index].residual_diffs if d is not None], rel=1e-4)
        assert psnr(batched[index], alone[index]) >= 40.0, config
    return stats


@pytest.mark.parametrize(("checkpoint", "side"), [("flux_dev_dir", 32), ("qwen_image_dir", 16)])
def test_family_rows_with_different_caches_in_one_forward_give_their_own_images(
    checkpoint, side, request, psnr
) -> None:
    """FLUX.1 (double and single block lists) and Qwen-Image (true CFG: a cond and an uncond row of different
    text lengths per job, padded to the forward's longest)."""
    import omni_models

    pipe = omni_models.load(str(request.getfixturevalue(checkpoint)), device="cpu")
    stats = _check_batched_equals_alone(pipe, psnr, 6, height=side, width=side)
    assert stats[3].computed_steps < stats[3].num_steps  # the custom config skipped on the random model
