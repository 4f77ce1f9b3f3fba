"""Paged generation through diffusion_kv against the dense reference, on a random-weight model directory."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import omni_models
from diffusion_kv import (
    PRIMARY_CACHE_ROLE,
    DiffusionKVMetadata,
    DiffusionKVSequenceMetadata,
    RowIdentity,
    WorkerRowTable,
    cdiv,
)
from omni_models import GenerationRequest, paged, resolve_request
from omni_models.runner import ScheduledJob, scheduled
from omni_models.sampling import pad_token_ids

PROMPTS = ["a red circle at the top left on a blue background", "a green square", "a white diamond at the center"]


@pytest.fixture(scope="module")
def pipes(random_model_dir):
    return omni_models.load(str(random_model_dir)), omni_models.load(str(random_model_dir), attention_backend="dense")


def _pixels(images) -> np.ndarray:
    return np.stack([np.asarray(image, dtype=np.int16) for image in images])


def _job(pipe, prompt, **fields):
    """The one job of a one-image request."""
    [job] = pipe.prepare(resolve_request(pipe.info, GenerationRequest(prompt=prompt, **fields)))
    return job


def test_paged_equals_dense_and_batch_equals_single_calls(pipes):
    paged_pipe, dense_pipe = pipes
    batch = paged_pipe(PROMPTS, num_inference_steps=4, guidance_scale=4.0, seed=11)
    dense = dense_pipe(PROMPTS, num_inference_steps=4, guidance_scale=4.0, seed=11)
    assert all(image.size == (32, 32) and image.mode == "RGB" for image in batch)
    assert np.abs(_pixels(batch) - _pixels(dense)).max() <= 1  # fp32 noise can flip a rounding
    singles = [
        paged_pipe(prompt, num_inference_steps=4, guidance_scale=4.0, seed=11 + i)[0]
        for i, prompt in enumerate(PROMPTS)
    ]
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


def _row_table(pipe, num_blocks, block_size, *, num_rows=4):
    """An engine's row table for the pipeline's bound pool (``allocate_kv_caches`` first)."""
    table = WorkerRowTable(
        num_rows=num_rows,
        max_rows_per_request=2,
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=128,
        registered_roles={PRIMARY_CACHE_ROLE},
        device=pipe.device,
    )
    pipe.bind_row_table(table)
    return table


def _install(table, request_id, job, block_ids, generation=1):
    """Install ``job``'s rows on the given blocks (one list per row) and bind them to it, as the engine would."""
    table.install(
        DiffusionKVMetadata(
            request_id,
            generation,
            tuple(
                DiffusionKVSequenceMetadata(i, row.prefix_len, row.target_len, row.num_tokens, (list(blocks),))
                for i, (row, blocks) in enumerate(zip(job.rows, block_ids, strict=True))
            ),
        )
    )
    job.kv_rows = tuple(RowIdentity(request_id, sequence_id=i) for i in range(len(job.rows)))
    return job


def test_stepwise_api_with_scattered_blocks_and_interleaved_jobs(pipes):
    """Engine-style use: a shared pool, non-contiguous block tables, jobs joining at different steps."""
    pipe = pipes[0]
    expected = _pixels(pipe(PROMPTS[:2], num_inference_steps=4, guidance_scale=3.0, seed=21))
    pipe.allocate_kv_caches(num_blocks=48, block_size=8)
    table = _row_table(pipe, 48, 8)
    first = _job(pipe, PROMPTS[0], num_inference_steps=4, guidance_scale=3.0, seed=21)
    second = _job(pipe, PROMPTS[1], num_inference_steps=4, guidance_scale=3.0, seed=22)
    assert [row.role for row in first.rows] == ["cond", "uncond"]
    assert first.rows[0].prefix_len == 12 and first.rows[1].prefix_len == 1 and first.rows[0].target_len == 64
    free = list(range(47, -1, -1))  # hand out blocks in reverse order: tables are not contiguous ranges
    a = _install(table, "a", first, [[free.pop(0) for _ in range(cdiv(row.num_tokens, 8))] for row in first.rows])
    pipe.start([a])
    pipe.step([a])
    b = _install(table, "b", second, [[free.pop(0) for _ in range(cdiv(row.num_tokens, 8))] for row in second.rows])
    pipe.start([b])  # joins while the first job is one step ahead
    while not second.finished:
        pipe.step([a, b] if not first.finished else [b])
    assert first.finished and first.step_index == 4
    assert np.array_equal(_pixels(pipe.decode([first, second])), expected)


def test_recomputing_the_prefix_every_step_gives_the_same_image(pipes):
    pipe = pipes[0]
    results = []
    for recompute in (False, True):
        job = _job(pipe, PROMPTS[0], num_inference_steps=3, seed=2)
        pipe.allocate_kv_caches_for([job], block_size=16)
        if not recompute:
            pipe.start([job])
        for _ in range(3):
            pipe.step([job], recompute_prefix=recompute)
        results.append(job.latents)
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-5)


def test_velocities_of_one_step_are_the_dense_models(pipes):
    """The attention plumbing alone: paged velocities of a two-job batch equal the dense model's, row by row."""
    pipe = pipes[0]
    jobs = [
        _job(pipe, prompt, num_inference_steps=2, guidance_scale=4.0, seed=3 + i)
        for i, prompt in enumerate(PROMPTS[:2])
    ]
    pipe.allocate_kv_caches_for(jobs, block_size=8)
    pipe.start(jobs)
    velocities = paged.predict_velocities(pipe.model, pipe._bound_kv(), scheduled(jobs))
    assert [job.step_index for job in jobs] == [0, 0]  # predicting does not step
    for job, rows in zip(jobs, velocities, strict=True):
        token_ids = pad_token_ids([row.token_ids for row in job.rows], pipe.device)
        images = job.latents.unsqueeze(0).expand(len(job.rows), -1, -1, -1)
        dense = pipe.model(token_ids, images, torch.full((len(job.rows),), job.times[0]))
        torch.testing.assert_close(torch.stack(rows), dense, rtol=1e-4, atol=1e-4)


def test_fused_token_ops_match_the_unfused_sequence(pipes):
    """The flat layout's fused, indexed ops against the unfused torch sequence, two jobs at different steps."""
    pipe = pipes[0]
    results = []
    for fused_ops in (True, False):
        pipe.model.set_fused_ops(fused_ops)
        jobs = [_job(pipe, PROMPTS[i], num_inference_steps=3, seed=4 + i) for i in range(2)]
        pipe.allocate_kv_caches_for(jobs, block_size=8)
        pipe.start(jobs)
        pipe.step(jobs[:1])  # from here on the rows of one forward sit at different timesteps
        while not jobs[1].finished:
            pipe.step([job for job in jobs if not job.finished])
        results.append(torch.stack([job.latents for job in jobs]))
    pipe.model.set_fused_ops(True)
    assert all(module.fused_ops for module in pipe.model.modules() if hasattr(module, "fused_ops"))
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_steps_equal_eager_steps(random_model_dir):
    pipe = omni_models.load(str(random_model_dir), device="cuda", dtype=torch.float32)
    graphed = omni_models.load(str(random_model_dir), device="cuda", dtype=torch.float32, cuda_graphs=True)
    expected = _pixels(pipe(PROMPTS, num_inference_steps=4, seed=3))
    assert np.array_equal(_pixels(graphed(PROMPTS, num_inference_steps=4, seed=3)), expected)
    jobs = [_job(graphed, prompt, num_inference_steps=4, seed=3 + i) for i, prompt in enumerate(PROMPTS)]
    graphed.allocate_kv_caches_for(jobs, block_size=16)
    graphed.start(jobs)
    while not jobs[0].finished:
        graphed.step(jobs)
    assert graphed.step_graphs.captures == 1 and graphed.step_graphs.replays == 3
    assert np.array_equal(_pixels(graphed.decode(jobs)), expected)


def test_step_graphs_refuse_bad_settings_and_cpu_tensors():
    from omni_models.graphs import StepGraphs

    with pytest.raises(ValueError, match="max_graphs"):
        StepGraphs(max_graphs=0)
    with pytest.raises(ValueError, match="CUDA tensors only"):
        StepGraphs().run("key", lambda: None, lambda plan, x: x, torch.zeros(2))
    with pytest.raises(ValueError, match="cuda_graphs must be a bool"):
        omni_models.Pipeline(
            torch.nn.Module(), None, device=torch.device("cpu"), dtype=torch.float32, cuda_graphs="yes"
        )


def test_stepwise_misuse_is_refused_with_a_reason(pipes):
    pipe = pipes[0]
    job = _job(pipe, "a red circle", num_inference_steps=2, guidance_scale=1.0, seed=0)
    assert len(job.rows) == 1
    with pytest.raises(ValueError, match="has no installed rows"):
        pipe.start([job])
    job.kv_rows = (RowIdentity("r", sequence_id=0),)
    pipe.allocate_kv_caches(num_blocks=8, block_size=16)  # unbinds the row table of the previous pool
    with pytest.raises(ValueError, match="no KV pool is bound"):
        pipe.start([job])
    with pytest.raises(ValueError, match="addresses 9 blocks of 16 tokens, but the cache of 'blocks.0.attn' holds 8"):
        _row_table(pipe, 9, 16)
    table = _row_table(pipe, 8, 16)
    with pytest.raises(ValueError, match=r"start\(\) must run"):
        pipe.step([job])
    with pytest.raises(KeyError, match="is not installed on this worker"):
        pipe.start([job])
    with pytest.raises(ValueError, match="1 rows but 2 row identities"):
        ScheduledJob(job, (RowIdentity("r", sequence_id=0), RowIdentity("r", sequence_id=1)))
    job.kv_rows = (RowIdentity("r", sequence_id=0), RowIdentity("r", sequence_id=1))
    with pytest.raises(ValueError, match="1 rows but 2 row identities"):
        pipe.start([job])
    # Installed for 12 tokens: the prompt fits, the image does not.
    table.install(DiffusionKVMetadata("short", 1, (DiffusionKVSequenceMetadata(0, 4, 8, 12, ([0],)),)))
    job.kv_rows = (RowIdentity("short", sequence_id=0),)
    pipe.start([job])
    with pytest.raises(ValueError, match="seq_len=68 is beyond its installed length of 12 tokens"):
        pipe.step([job])
    with pytest.raises(ValueError, match="decode needs a finished job"):
        pipe.decode([job])
    assert job.step_index == 0
