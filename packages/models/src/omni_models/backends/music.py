"""The two-stage music family (the shipped ``omni-tones-tiny``): a directory of ``config.json``,
``ar.safetensors`` (the AR stage, run on vLLM's engine) and ``acoustic.safetensors`` (the flow-matching stage).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from omni_models.errors import CheckpointError
from omni_models.spec import Capabilities, ModelSpec

if TYPE_CHECKING:
    from omni_models.music import MusicPipeline
    from omni_models.registry import LoadOptions


def inspect(directory: Path, name: str) -> ModelSpec:
    from omni_models.music.config import MusicConfig
    from omni_models.music.pipeline import music_info

    try:
        config = MusicConfig.from_dict(json.loads((directory / "config.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(directory / "config.json", f"not a loadable music model: {exc}") from None
    for file in ("ar.safetensors", "acoustic.safetensors"):
        if not (directory / file).is_file():
            raise CheckpointError(directory / file, "missing: a music model has its AR and acoustic weights")
    return ModelSpec(
        kind="omni-music",
        directory=str(directory),
        info=music_info(config, name),
        capabilities=Capabilities(
            fp8=False, layerwise_offload=False, offload_allgather=False, cfg_parallel=False, sequence_parallel=False
        ),
    )


def load(directory: Path, name: str, options: LoadOptions) -> MusicPipeline:
    unsupported = [
        option
        for option, given in (
            ("quantization", options.quantization is not None),
            ("layerwise_offload", options.layerwise_offload),
            ("attention_backend", options.attention_backend is not None),
            ("cuda_graphs", options.cuda_graphs),
            ("compile", options.compile),
            ("prompt_embed_cache_size", options.prompt_embed_cache_size > 0),
            ("max_batched_image_tokens", options.max_batched_image_tokens > 0),
            ("max_sequence_length", options.max_sequence_length is not None),
            ("lora", options.lora is not None),
            ("attention_dtype", options.attention_dtype != "auto"),
        )
        if given
    ]
    if unsupported:
        raise ValueError(f"{', '.join(unsupported)}: not supported by the music family ({name})")
    inspect(directory, name)
    from omni_models.music import load_music

    return load_music(str(directory), name=name, device=str(options.device))
