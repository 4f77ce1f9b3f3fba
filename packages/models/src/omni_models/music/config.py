"""Shape and constants of the music family (Music-3-style: a Qwen3 AR backbone with a depth decoder, then a
flow-matching acoustic transformer and an oscillator decoder), at configurable size.

Music 3 itself runs 25 frames/s, 8 codebooks, 200-frame windows with a 100-frame hop, 32 kHz stereo. The
shipped ``omni-tones-tiny`` keeps the structure and scales the numbers down: 16 frames/s, 8 codebooks,
32-frame windows with a 16-frame hop (2 s windows, 1 s hop), 16 kHz mono output.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from omni_models.config import check_known_fields

# Special tokens of the backbone vocabulary (ids 0..len-1), in this order.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<pad>",
    "<unk>",
    "<|im_start|>",
    "<|im_end|>",
    "<|audio_cfg|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<|caption_start|>",
    "<|caption_end|>",
    "<|lyrics_start|>",
    "<|lyrics_end|>",
    "<|audio_hold|>",
)
PAD_ID, UNK_ID, IM_START, IM_END, AUDIO_CFG, AUDIO_START, AUDIO_END = range(7)
CAPTION_START, CAPTION_END, LYRICS_START, LYRICS_END, AUDIO_HOLD = range(7, 12)

NUM_CODEBOOKS = 8


@dataclass(frozen=True)
class MusicConfig:
    """Everything that fixes the shapes of a music checkpoint (not request parameters).

    Backbone vocabulary: special tokens, then ``words`` (caption and lyrics words), then ``c0_vocab_size`` audio
    codes starting at ``audio_code_offset``. Codebooks 1..7 have ``codebook_size`` codes each.
    """

    name: str
    words: tuple[str, ...]
    # backbone (Qwen3)
    hidden_size: int = 192
    num_layers: int = 4
    num_heads: int = 6
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 512
    # codebooks
    c0_vocab_size: int = 37
    codebook_size: int = 16
    # depth decoder
    depth_hidden_size: int = 128
    depth_layers: int = 2
    depth_heads: int = 4
    # acoustic stage (a causal-prefix DiT over windows; latent channels per frame)
    latent_channels: int = 8
    acoustic_width: int = 128
    acoustic_depth: int = 4
    acoustic_heads: int = 4
    acoustic_steps: int = 12
    acoustic_guidance: float = 1.0
    # timing
    frame_rate: int = 16
    window_frames: int = 32
    hop_frames: int = 16
    sample_rate: int = 16000
    channels: int = 1
    # requests
    max_frames: int = 160
    default_frames: int = 96
    max_prompt_tokens: int = 96
    ar_guidance: float = 1.5
    ar_top_k: int = 8

    def __post_init__(self) -> None:
        if self.hidden_size != self.num_heads * self.head_dim:
            raise ValueError(f"hidden_size {self.hidden_size} != num_heads {self.num_heads} x head_dim {self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}")
        if not 0 < self.hop_frames <= self.window_frames:
            raise ValueError(f"hop_frames {self.hop_frames} must be in [1, window_frames {self.window_frames}]")
        if self.sample_rate % self.frame_rate:
            raise ValueError(f"sample_rate {self.sample_rate} must be a multiple of frame_rate {self.frame_rate}")
        if self.max_prompt_tokens + self.max_frames + 2 > self.max_position_embeddings:
            raise ValueError("max_prompt_tokens + max_frames + 2 must fit max_position_embeddings")

    @property
    def word_offset(self) -> int:
        return len(SPECIAL_TOKENS)

    @property
    def audio_code_offset(self) -> int:
        return self.word_offset + len(self.words)

    @property
    def vocab_size(self) -> int:
        return self.audio_code_offset + self.c0_vocab_size

    @property
    def samples_per_frame(self) -> int:
        return self.sample_rate // self.frame_rate

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MusicConfig:
        check_known_fields(cls, data)
        data = dict(data)
        data["words"] = tuple(data["words"])
        return cls(**data)

    def hf_config(self) -> dict[str, Any]:
        """The backbone's Hugging Face ``config.json`` (a Qwen3 config plus the music fields), for vLLM."""
        return {
            "architectures": ["OmniMusicTalkerForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "tie_word_embeddings": False,
            "attention_bias": False,
            "torch_dtype": "float32",
            "bos_token_id": IM_START,
            "eos_token_id": AUDIO_END,
            "omni_music": self.to_dict(),
        }
