"""The music family (MiniMax Music 3's two-stage design, at configurable size) and the shipped
``omni-tones-tiny``: a Qwen3 AR backbone with a depth decoder on vLLM's engine (CFG pairs kept step-locked by
cfg-pairing), then a flow-matching acoustic transformer over carried windows and an oscillator decoder.

Importing this package needs torch only; the AR stage imports vLLM on first use (``omni_models.music._vllm``,
the ``music`` extra).
"""

from __future__ import annotations

from omni_models.music.config import MusicConfig
from omni_models.music.pipeline import MusicJob, MusicPipeline, Song, load_music, music_info

__all__ = ["MusicConfig", "MusicJob", "MusicPipeline", "Song", "load_music", "music_info"]
