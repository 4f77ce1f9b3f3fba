"""The music pipeline: lyrics + caption -> WAV, through the AR stage on vLLM's engine (CFG pairs step-locked by
cfg-pairing) and the acoustic stage (flow matching over carried windows, paged prefix K/V), then the oscillator
decoder. Same lyrics, caption, seed and frame cap give the same bytes.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from safetensors.torch import load_file

from omni_models.model import CausalPrefixDiT
from omni_models.music.acoustic import (
    PagedAcoustic,
    acoustic_config,
    generate_latents,
    generate_latents_paged,
)
from omni_models.music.config import NUM_CODEBOOKS, MusicConfig
from omni_models.music.decoder import decode, to_wav_bytes
from omni_models.music.payload import Span
from omni_models.music.prompt import MusicTokenizer
from omni_models.request import GenerationRequest, ResolvedRequest, resolve_request
from omni_models.spec import AudioLimits, ModelInfo

MAX_SEED = 2**31 - 1
MUSIC_ACCEPTS = ("prompt", "lyrics", "seed", "max_new_tokens")


@dataclass(frozen=True)
class Song:
    codes: torch.Tensor  # [T, 8]
    samples: np.ndarray  # float32 mono
    sample_rate: int

    @property
    def seconds(self) -> float:
        return self.samples.shape[0] / self.sample_rate

    def wav(self) -> bytes:
        return to_wav_bytes(self.samples, self.sample_rate)


def codes_from_spans(spans: list[Span]) -> torch.Tensor:
    """A song's codes [T, 8] from its released spans (each span's part after the previous span's end)."""
    parts, end = [], 0
    for span in sorted(spans, key=lambda s: s.start):
        if span.start + span.codes.shape[0] > end:
            parts.append(span.codes[end - span.start :])
            end = span.start + span.codes.shape[0]
    return torch.cat(parts) if parts else torch.empty(0, NUM_CODEBOOKS, dtype=torch.long)


def music_info(config: MusicConfig, name: str) -> ModelInfo:
    """The ``ModelInfo`` of a music model, from its config alone: ``prompt`` is the caption."""
    return ModelInfo(
        name=name,
        family="omni-music",
        variant=config.name,
        task="text-to-music",
        accepts=MUSIC_ACCEPTS,
        audio=AudioLimits(
            sample_rate=config.sample_rate,
            channels=config.channels,
            frame_rate=config.frame_rate,
            max_frames=config.max_frames,
            max_seed=MAX_SEED,
        ),
    )


@dataclass(eq=False)
class MusicJob:
    """One song: its AR rows run on vLLM's engine (``started`` once added), then the acoustic stage renders it.

    Steps: one per AR frame (``max_new_tokens`` at most; the song may end earlier), then one that renders.
    """

    request: ResolvedRequest
    prompt_ids: list[int]
    pair_id: str
    request_id: str | None = None
    started: bool = False
    ar_done: bool = False
    song: Song | None = None
    step_index: int = 0

    @property
    def num_steps(self) -> int:
        assert self.request.max_new_tokens is not None
        return self.request.max_new_tokens + 1

    @property
    def finished(self) -> bool:
        return self.song is not None

    @property
    def num_rows(self) -> int:
        return 2  # the cond row and its CFG twin


class MusicPipeline:
    """A loaded music model implementing ``omni_models.contract.StepwisePipeline``. Not thread-safe."""

    def __init__(
        self,
        model_dir: Path,
        *,
        name: str | None = None,
        device: str = "cpu",
        acoustic_attention: Literal["paged", "dense"] = "paged",
        quantization: Literal["fp8"] | None = None,
        max_num_seqs: int = 8,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.config = MusicConfig.from_dict(json.loads((self.model_dir / "config.json").read_text()))
        self.info = music_info(self.config, name or self.config.name)
        self.tokenizer = MusicTokenizer(self.config)
        self.device = torch.device(device)
        with torch.device("meta"):
            dit = CausalPrefixDiT(acoustic_config(self.config))
        state = {k: v.float() for k, v in load_file(str(self.model_dir / "acoustic.safetensors")).items()}
        dit.load_state_dict(state, assign=True)
        self.dit = dit.to(device).eval()
        if quantization == "fp8":
            from omni_models.integrations import quantize_fp8

            quantize_fp8(self.dit)
        self.acoustic_attention = acoustic_attention
        self._paged = PagedAcoustic(self.dit, self.config, device=device) if acoustic_attention == "paged" else None
        self._max_num_seqs = max_num_seqs
        self._ar = None
        self._songs = itertools.count()

    @property
    def paged_acoustic(self) -> PagedAcoustic | None:
        """The paged acoustic runner (None with ``acoustic_attention="dense"``)."""
        return self._paged

    @property
    def ar(self):  # noqa: ANN201 - the vLLM-backed stage, built on first use
        if self._ar is None:
            from omni_models.music._vllm import ARStage

            self._ar = ARStage(self.model_dir, self.config, max_num_seqs=self._max_num_seqs)
        return self._ar

    # --- the stepwise contract ----------------------------------------------------------------------------------

    def prepare(self, request: ResolvedRequest, *, request_id: str | None = None) -> list[MusicJob]:
        """The song's job; tokenizes only. InvalidRequestError (``prompt``: the caption, ``lyrics``) on bad input."""
        assert request.lyrics is not None and request.max_new_tokens is not None
        ids = self.tokenizer.encode(request.prompt, request.lyrics)
        return [MusicJob(request, ids, f"song-{next(self._songs)}", request_id=request_id)]

    def start(self, jobs: Sequence[MusicJob]) -> None:
        """Add each job's cond/uncond pair to the AR stage."""
        from omni_models.music._vllm import SongRequest

        for job in jobs:
            if not job.started:
                self.ar.add(SongRequest(job.pair_id, job.prompt_ids, job.request.seed, job.request.max_new_tokens))
                job.started = True

    def step(self, jobs: Sequence[MusicJob]) -> None:
        """Render the jobs whose AR rows had finished before this call; then one AR engine step, which advances the
        AR rows of every started song (vLLM's scheduler batches them), named in ``jobs`` or not. A song whose AR
        rows finish in a step that does not name it is seen as finished by the next call that does."""
        for job in jobs:
            if job.ar_done and job.song is None:
                job.song = self.render(codes_from_spans(self.ar.take_spans(job.pair_id)), job.request.seed)
                job.step_index = job.num_steps
        waiting = [job for job in jobs if not job.ar_done]
        if not waiting:
            return
        if not all(self.ar.finished.get(job.pair_id) for job in waiting):
            self.ar.step()
        for job in waiting:
            if self.ar.finished.get(job.pair_id):
                job.ar_done = True
                job.step_index = job.num_steps - 1
            else:
                job.step_index = min(job.step_index + 1, job.num_steps - 2)

    def decode(self, jobs: Sequence[MusicJob]) -> list[Song]:
        songs = []
        for job in jobs:
            if job.song is None:
                raise ValueError(f"song {job.pair_id} is not finished (step {job.step_index} of {job.num_steps})")
            songs.append(job.song)
        return songs

    def release(self, jobs: Sequence[MusicJob]) -> None:
        """Abort the AR rows of songs still running and drop what the AR stage kept for them."""
        for job in jobs:
            if job.started and not job.ar_done:
                self.ar.abort(job.pair_id)
                job.ar_done = True
            if job.started:
                self.ar.take_spans(job.pair_id)

    def close(self) -> None:
        """The AR stage's engine lives as long as the process (``load_music`` caches one per model)."""

    # --- one-call generation ------------------------------------------------------------------------------------

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Song]:
        """Songs for ``requests`` (each checked first: a bad one raises before any work); AR rows run batched."""
        resolved = [resolve_request(self.info, request) for request in requests]
        jobs = [job for request in resolved for job in self.prepare(request)]
        self.start(jobs)
        while not all(job.finished for job in jobs):
            self.step([job for job in jobs if not job.finished])
        return self.decode(jobs)

    def render(self, codes: torch.Tensor, seed: int) -> Song:
        """Acoustic stage + decoder for a song's codes."""
        if codes.shape[0] == 0:
            return Song(codes, np.zeros(0, dtype=np.float32), self.config.sample_rate)
        if self._paged is not None:
            latents = generate_latents_paged(self._paged, codes, seed=seed)
        else:
            latents = generate_latents(self.dit, self.config, codes, seed=seed, device=self.device)
        samples = decode(
            latents.numpy(), sample_rate=self.config.sample_rate, frame_rate=self.config.frame_rate, seed=seed
        )
        return Song(codes, samples, self.config.sample_rate)


_LOADED: dict[str, MusicPipeline] = {}


def load_music(name_or_path: str = "omni-tones-tiny", *, name: str | None = None, **kwargs) -> MusicPipeline:  # noqa: ANN003
    """Load a music model by shipped name or directory (cached per process: one vLLM engine per model); ``name``
    is what its ``info`` reports (default: ``name_or_path``)."""
    from omni_models.hub import resolve_model_dir

    directory = resolve_model_dir(name_or_path)
    if not (directory / "ar.safetensors").exists():
        raise FileNotFoundError(f"no music model at {name_or_path!r} (looked in {directory})")
    key = str(directory.resolve())
    if key not in _LOADED:
        _LOADED[key] = MusicPipeline(directory, name=name or name_or_path, **kwargs)
    return _LOADED[key]
