"""The music pipeline: lyrics + caption -> WAV, through the AR stage on vLLM's engine (CFG pairs step-locked by
cfg-pairing) and the acoustic stage (flow matching over carried windows, paged prefix K/V), then the oscillator
decoder. Same lyrics, caption, seed and frame cap give the same bytes.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from safetensors.torch import load_file

from omni_models.errors import InvalidRequestError
from omni_models.model import CausalPrefixDiT
from omni_models.music.acoustic import (
    PagedAcoustic, acoustic_config, generate_latents, generate_latents_paged,
)
from omni_models.music.config import MusicConfig, NUM_CODEBOOKS
from omni_models.music.decoder import decode, to_wav_bytes
from omni_models.music.payload import Span
from omni_models.music.prompt import MusicTokenizer

MAX_SEED = 2**31 - 1


@dataclass(frozen=True)
class MusicRequest:
    lyrics: str
    caption: str
    seed: int = 0
    max_frames: int | None = None


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
            parts.append(span.codes[end - span.start:])
            end = span.start + span.codes.shape[0]
    return torch.cat(parts) if parts else torch.empty(0, NUM_CODEBOOKS, dtype=torch.long)


class MusicPipeline:
    """A loaded music model. Thread-safe: one generation at a time (a lock serializes callers)."""

    def __init__(self, model_dir: Path, *, device: str = "cpu", acoustic_attention: Literal["paged", "dense"] = "paged",
                 quantization: Literal["fp8"] | None = None, max_num_seqs: int = 8) -> None:
        self.model_dir = Path(model_dir)
        self.config = MusicConfig.from_dict(json.loads((self.model_dir / "config.json").read_text()))
        self.tokenizer = MusicTokenizer(self.config)
        self.device = device
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
        self._lock = threading.Lock()
        self._counter = 0

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

    def validate(self, request: MusicRequest) -> tuple[list[int], int]:
        """Prompt ids and frame cap; InvalidRequestError (naming the field) on bad input."""
        ids = self.tokenizer.encode(request.caption, request.lyrics)
        seed = request.seed
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
            raise InvalidRequestError(f"'seed' must be an integer in [0, {MAX_SEED}], got {seed!r}", param="seed")
        frames = self.config.max_frames if request.max_frames is None else request.max_frames
        if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1:
            raise InvalidRequestError("'max_new_tokens' must be at least 1", param="max_new_tokens")
        if frames > self.config.max_frames:
            raise InvalidRequestError(
                f"'max_new_tokens' counts audio frames at {self.config.frame_rate} per second and cannot exceed "
                f"{self.config.max_frames}", param="max_new_tokens")
        return ids, frames

    def generate(self, requests: list[MusicRequest]) -> list[Song]:
        """Songs for ``requests`` (validated first: a bad one raises before any work). AR rows run batched."""
        from omni_models.music._vllm import SongRequest

        checked = [self.validate(r) for r in requests]
        with self._lock:
            songs = []
            for request, (ids, frames) in zip(requests, checked):
                self._counter += 1
                songs.append(SongRequest(f"song-{self._counter}", ids, request.seed, frames))
            spans = self.ar.run(songs)
            return [self.render(codes_from_spans(spans[s.pair_id]), s.seed) for s in songs]

    def render(self, codes: torch.Tensor, seed: int) -> Song:
        """Acoustic stage + decoder for a song's codes."""
        if codes.shape[0] == 0:
            return Song(codes, np.zeros(0, dtype=np.float32), self.config.sample_rate)
        if self._paged is not None:
            latents = generate_latents_paged(self._paged, codes, seed=seed)
        else:
            latents = generate_latents(self.dit, self.config, codes, seed=seed, device=self.device)
        samples = decode(latents.numpy(), sample_rate=self.config.sample_rate, frame_rate=self.config.frame_rate,
                         seed=seed)
        return Song(codes, samples, self.config.sample_rate)


_LOADED: dict[str, MusicPipeline] = {}


def load_music(name_or_path: str = "omni-tones-tiny", **kwargs) -> MusicPipeline:  # noqa: ANN003
    """Load a music model by shipped name or directory (cached per process: one vLLM engine per model)."""
    directory = Path(name_or_path)
    if not (directory / "config.json").exists():
        directory = Path(__file__).resolve().parent.parent / "weights" / name_or_path
    if not (directory / "ar.safetensors").exists():
        raise FileNotFoundError(f"no music model at {name_or_path!r} (looked in {directory})")
    key = str(directory.resolve())
    if key not in _LOADED:
        _LOADED[key] = MusicPipeline(directory, **kwargs)
    return _LOADED[key]
