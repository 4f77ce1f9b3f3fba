"""Reading and writing a model directory: config.json, vocab.json and safetensors weights (sharded if large).

Layout (Hugging Face style, written by huggingface_hub): either ``model.safetensors`` or
``model-0000i-of-0000n.safetensors`` files plus ``model.safetensors.index.json`` (``{"metadata": {...},
"weight_map": {tensor name: file name}}``). Every file stays at or under ``max_shard_bytes`` (16 MiB by default), so
the weights can live inside a package. Reading keeps its own few lines: huggingface_hub's ``load_torch_model``
copies into existing parameters and has no ``assign`` mode, so it cannot fill a model built on the meta device.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from omni_models.config import DiTConfig

if TYPE_CHECKING:  # reading a model's metadata (config, vocabulary, file list) needs neither
    import torch

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
VOCAB_NAME = "vocab.json"
MAX_SHARD_BYTES = 16 * 1024 * 1024
_HEADER_SLACK = 64 * 1024  # safetensors JSON header: room for names, dtypes and offsets


def save_weights(
    state: dict[str, torch.Tensor], directory: Path, *, max_shard_bytes: int = MAX_SHARD_BYTES
) -> list[Path]:
    """Write ``state`` as one file or as shards of at most ``max_shard_bytes`` each (huggingface_hub's own
    ``save_torch_state_dict``: ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` plus the index);
    returns the files written."""
    from huggingface_hub import save_torch_state_dict

    # huggingface_hub counts tensor bytes only and gives a tensor larger than the limit a shard of its own; the
    # limit here is on files, so the header gets its room and such a tensor is refused.
    budget = max_shard_bytes - _HEADER_SLACK
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > budget:
            raise ValueError(f"tensor {name} has {nbytes} bytes, more than one shard may hold ({budget})")
    directory.mkdir(parents=True, exist_ok=True)
    save_torch_state_dict({name: t.detach().cpu() for name, t in state.items()}, directory, max_shard_size=budget)
    return weight_files(directory)


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a model directory (``model.safetensors``, or the shards its index names)."""
    single = directory / WEIGHTS_NAME
    if single.is_file():
        return [single]
    index_path = directory / INDEX_NAME
    if not index_path.is_file():
        raise FileNotFoundError(f"{directory} has neither {WEIGHTS_NAME} nor {INDEX_NAME}")
    weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
    return [directory / name for name in sorted(set(weight_map.values()))]


def load_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Read the weights of a model directory (single file or sharded with an index)."""
    from safetensors.torch import load_file

    single = directory / WEIGHTS_NAME
    if single.is_file():
        return load_file(str(single))
    index_path = directory / INDEX_NAME
    if not index_path.is_file():
        raise FileNotFoundError(f"{directory} has neither {WEIGHTS_NAME} nor {INDEX_NAME}")
    weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
    state: dict[str, torch.Tensor] = {}
    for file_name in sorted(set(weight_map.values())):
        state.update(load_file(str(directory / file_name)))
    missing = sorted(set(weight_map) - set(state))
    if missing:
        raise ValueError(f"{index_path} lists tensors missing from its shards: {missing[:5]}")
    return state


def load_weights_into(model: torch.nn.Module, directory: Path, *, name: str) -> None:
    """Adopt the weights of ``directory`` into ``model`` (built on the meta device or not), by assignment.

    The key sets must match exactly; otherwise a ValueError names the first missing and unexpected keys
    and ``model`` is left untouched. ``name`` (the model's config name) is only used in that message.
    """
    state = load_weights(directory)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(
            f"weights in {directory} do not match {name}: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    model.load_state_dict(state, assign=True)


def save_config(config: DiTConfig, vocabulary: tuple[str, ...], directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_NAME).write_text(json.dumps(config.to_dict(), indent=1))
    (directory / VOCAB_NAME).write_text(json.dumps(list(vocabulary), indent=1))


def load_config(directory: Path) -> tuple[DiTConfig, tuple[str, ...]]:
    config = DiTConfig.from_dict(json.loads((directory / CONFIG_NAME).read_text()))
    vocabulary = tuple(json.loads((directory / VOCAB_NAME).read_text()))
    if len(vocabulary) != config.vocab_size:
        raise ValueError(f"{directory / VOCAB_NAME} has {len(vocabulary)} words but config says {config.vocab_size}")
    return config, vocabulary


def save_model(
    model: torch.nn.Module, vocabulary: tuple[str, ...], directory: Path, *, max_shard_bytes: int = MAX_SHARD_BYTES
) -> list[Path]:
    """Write a causal-prefix DiT (``model.config``, its vocabulary and weights) as a loadable model directory."""
    save_config(model.config, vocabulary, directory)
    return save_weights(model.state_dict(), directory, max_shard_bytes=max_shard_bytes)
