"""The shipped omni-tones-tiny end to end (vLLM AR stage, paged acoustic stage, decoder): the issue's example is
read back by the FFT scorer as the caption asked; the paged acoustic path equals the dense one."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="the music AR stage runs on vLLM: pip install 'omni-models[music]'")

from omni_models import GenerationRequest  # noqa: E402
from omni_models.music import load_music  # noqa: E402
from omni_models.music.acoustic import generate_latents, generate_latents_paged  # noqa: E402
from omni_models.training.music_scorer import MusicScorer  # noqa: E402

LYRICS = "[verse]\nla la love\n[chorus]\noh oh shine\n[verse]\nrun to the sky"


@pytest.fixture(scope="module")
def pipeline():
    """One loaded pipeline (its AR stage is a vLLM engine) for the module's songs."""
    return load_music("omni-tones-tiny")


def test_the_issue_example_is_read_back_as_asked(pipeline) -> None:
    song = pipeline.generate(
        [GenerationRequest(prompt="a calm piano melody at 90 BPM in C major", lyrics=LYRICS, seed=0)]
    )[0]
    assert song.sample_rate == 16000 and song.samples.ndim == 1
    assert 2.0 <= song.seconds <= pipeline.config.max_frames / pipeline.config.frame_rate
    read = MusicScorer.calibrated(song.sample_rate, pipeline.config.frame_rate).read(song.samples)
    assert read == {"tonic": 0, "mode": "major", "bpm": 90, "timbre": "piano", "loudness": "soft"}


def test_paged_acoustic_equals_dense(pipeline) -> None:
    codes = pipeline.generate(
        [GenerationRequest(prompt="loud organ piece in a minor at 150 bpm", lyrics=LYRICS, seed=3, max_new_tokens=64)]
    )[0].codes
    dense = generate_latents(pipeline.dit, pipeline.config, codes, seed=3, device="cpu")
    assert torch.allclose(generate_latents_paged(pipeline.paged_acoustic, codes, seed=3), dense, atol=1e-5)
