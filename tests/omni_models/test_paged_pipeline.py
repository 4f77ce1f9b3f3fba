"""Paged generation through diffusion_kv against the dense reference, on a random-weight model directory."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import omni_models
from omni_models import paged
from omni_models.runner import ScheduledJob

PROMPTS = ["a red circle at the top left on a blue background", "a green square", "a white diamond at the center"]


@pytest.fixture(scope="module")
def pipes(random_model_dir):
    return omni_models.load(str(random_model_dir)), omni_models.load(str(random_model_dir), attention_backend="dense")


def _pixels(images) -> np.ndarray:
    return np.stack([np.asarray(image, dtype=np.int16) for image in images])


def test_paged_equals_dense_and_batch_equals_single_calls(pipes):
    paged_pipe, dense_pipe = pipes
    batch = paged_pipe(PROMPTS, num_inference_steps=4, guidance_scale=4.0, seed=11)
    dense = dense_pipe(PROMPTS, num_inference_steps=4, guidance_scale=4.0, seed=11)
    assert all(image.size == (32, 32) and image.mode == "RGB" for image in batch)
    assert np.abs(_pixels(batch) - _pixels(dense)).max() <= 1  # fp32 noise can flip a rounding
    singles = [paged_pipe(prompt, num_inference_steps=4, guidance_scale=4.0, seed=11 + i)[0]
               for i, prompt in enumerate(PROMPTS)]
    assert np.array_equal(_pixels(singles), _pixels(batch))
    assert len({image.tobytes() for image in batch}) == len(PROMPTS)


def test_fixed_seed_reproduces_and_seed_and_guidance_matter(pipes):
    pipe = pipes[0]
    first = _pixels(pipe("a red circle", num_inference_steps=3, seed=5))
    assert np.array_equal(first, _pixels(pipe("a red circle", num_inference_steps=3, seed=5)))
    assert not np.array_equal(first, _pixels(pipe("a red circle", num_inference_steps=3, seed=6)))
    assert not np.array_equal(first, _pixels(pipe("a red circle", num_inference_steps=3, seed=5, guidance_scale=1.0)))
    negative = _pixels(pipe("a red circle", negative_prompt="a blue square", num_inference_steps=3, seed=5))
    assert not np.array_equal(first, negative)


def test_stepwise_api_with_scattered_blocks_and_interleaved_jobs(pipes):
    """Engine-style use: a shared pool, non-contiguous block tables, jobs joining at different steps."""
    pipe = pipes[0]
    expected = _pixels(pipe(PROMPTS[:2], num_inference_steps=4, guidance_scale=3.0, seed=21))
    pipe.allocate_kv_caches(num_blocks=48, block_size=8)
    first = pipe.prepare(PROMPTS[0], num_inference_steps=4, guidance_scale=3.0, seed=21)
    second = pipe.prepare(PROMPTS[1], num_inference_steps=4, guidance_scale=3.0, seed=22)
    assert [row.role for row in first.rows] == ["cond", "uncond"]
    assert first.rows[0].prefix_len == 12 and first.rows[1].prefix_len == 1 and first.rows[0].target_len == 64
    need = -(-first.rows[0].num_tokens // 8)
    free = list(range(47, -1, -1))  # hand out blocks in reverse order: tables are not contiguous ranges
    tables_a = tuple([free.pop(0) for _ in range(-(-row.num_tokens // 8))] for row in first.rows)
    tables_b = tuple([free.pop(0) for _ in range(-(-row.num_tokens // 8))] for row in second.rows)
    assert len(tables_a[0]) == need
    a, b = ScheduledJob(first, tables_a), ScheduledJob(second, tables_b)
    pipe.run_prefix([a])
    pipe.run_denoise_step([a])
    pipe.run_prefix([b])  # joins while the first job is one step ahead
    while not second.finished:
        pipe.run_denoise_step([a, b] if not first.finished else [b])
    assert first.finished and first.step_index == 4
    assert np.array_equal(_pixels([pipe.decode(first), pipe.decode(second)]), expected)


def test_recomputing_the_prefix_every_step_gives_the_same_image(pipes):
    pipe = pipes[0]
    caches = pipe.allocate_kv_caches(num_blocks=12, block_size=16)
    results = []
    for recompute in (False, True):
        job = pipe.prepare(PROMPTS[0], num_inference_steps=3, seed=2)
        tables = tuple(list(range(i * 6, i * 6 + 6)) for i in range(len(job.rows)))
        batch = [ScheduledJob(job, tables)]
        if not recompute:
            pipe.run_prefix(batch)
        for _ in range(3):
            paged.denoise_step(pipe.model, batch, caches, recompute_prefix=recompute)
        results.append(job.latents)
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-5)


def test_stepwise_misuse_is_refused_with_a_reason(pipes):
    pipe = pipes[0]
    pipe.allocate_kv_caches(num_blocks=8, block_size=16)
    job = pipe.prepare("a red circle", num_inference_steps=2, guidance_scale=1.0, seed=0)
    assert len(job.rows) == 1
    with pytest.raises(ValueError, match="run_prefix must run"):
        pipe.run_denoise_step([ScheduledJob(job, (list(range(5)),))])
    with pytest.raises(ValueError, match="needs 68 slots"):
        pipe.run_prefix([ScheduledJob(job, (list(range(4)),))])
    with pytest.raises(ValueError, match="outside the pool"):
        pipe.run_prefix([ScheduledJob(job, (list(range(4, 9)),))])
    with pytest.raises(ValueError, match="1 rows but 2 block tables"):
        pipe.run_prefix([ScheduledJob(job, ([0], [1]))])
    with pytest.raises(ValueError, match="decode needs a finished job"):
        pipe.decode(job)
    assert job.step_index == 0 and not job.prefix_written
