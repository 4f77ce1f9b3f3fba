"""Reading a diffusers-layout checkpoint's metadata without diffusers: the index, configs and safetensors headers.

Layout (what ``DiffusionPipeline.save_pretrained`` writes)::

    model_index.json                 {"_class_name": "FluxPipeline", "<component>": ["<library>", "<class>"], ...}
    <component>/config.json          (models; ``scheduler_config.json`` for schedulers)
    <component>/<weights>.safetensors or <weights>.safetensors.index.json + shards
    <component>/tokenizer*.json ...  (tokenizers)

Everything here reads metadata only (JSON and safetensors headers, through safetensors' own ``safe_open``) and
raises ``CheckpointError`` naming the file and the problem; no tensor data is read and nothing is allocated.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from omni_models.errors import CheckpointError

MODEL_INDEX = "model_index.json"
WEIGHT_STEMS = ("diffusion_pytorch_model", "model")  # diffusers models, transformers models
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})


@dataclass(frozen=True)
class ComponentEntry:
    """One ``model_index.json`` entry: ``<name>: [<library>, <class>]``."""

    name: str
    library: str
    class_name: str
    directory: Path


@dataclass(frozen=True)
class PipelineIndex:
    directory: Path
    class_name: str
    components: Mapping[str, ComponentEntry]  # entries that are not [null, null]
    settings: Mapping[str, Any]  # the pipeline's own config values (scalars: Wan's boundary_ratio, ...)

    @property
    def path(self) -> Path:
        return self.directory / MODEL_INDEX


@dataclass(frozen=True)
class TensorHeader:
    dtype: str  # safetensors dtype name: "BF16", "F32", ...
    shape: tuple[int, ...]
    file: Path


def _read_json(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(path, f"missing {what}")
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(path, f"unreadable {what}: {exc}") from None
    if not isinstance(value, dict):
        raise CheckpointError(path, f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def read_pipeline_index(directory: Path) -> PipelineIndex:
    """Parse ``model_index.json``; a directory without one is not a diffusers checkpoint."""
    path = directory / MODEL_INDEX
    if not path.is_file():
        raise CheckpointError(path, "not found: this directory is not a diffusers pipeline checkpoint")
    index = _read_json(path, "pipeline index")
    class_name = index.get("_class_name")
    if not isinstance(class_name, str):
        raise CheckpointError(path, "has no string _class_name naming the pipeline")
    components = {}
    settings = {}
    for name, value in index.items():
        if name.startswith("_"):
            continue
        if value is None or isinstance(value, (bool, int, float, str)):
            settings[name] = value  # a pipeline config value; the family says which it reads
            continue
        if isinstance(value, list) and len(value) == 2 and value[0] is None and value[1] is None:
            continue  # an optional component that is absent
        if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value)):
            raise CheckpointError(path, f"component {name!r} must be [library, class], got {value!r}")
        components[name] = ComponentEntry(name, value[0], value[1], directory / name)
    return PipelineIndex(directory, class_name, components, settings)


def read_config(entry: ComponentEntry, file_name: str = "config.json") -> dict[str, Any]:
    return _read_json(entry.directory / file_name, f"{entry.name} config")


def weight_files(entry: ComponentEntry) -> tuple[Path | None, list[Path]]:
    """(the index file or None, the safetensors files) of a model component, as its index or file names them."""
    directory = entry.directory
    for stem in WEIGHT_STEMS:
        index_path = directory / f"{stem}.safetensors.index.json"
        if index_path.is_file():
            weight_map = _read_json(index_path, "weight index").get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(index_path, "has no weight_map naming the shards")
            shards = sorted(set(weight_map.values()))
            for shard in shards:
                if not isinstance(shard, str) or Path(shard).name != shard:
                    raise CheckpointError(index_path, f"shard name {shard!r} is not a file name in {directory}")
                if not (directory / shard).is_file():
                    raise CheckpointError(directory / shard, f"missing shard (listed in {index_path.name})")
            return index_path, [directory / shard for shard in shards]
        single = directory / f"{stem}.safetensors"
        if single.is_file():
            return None, [single]
    others = sorted(p.name for p in directory.glob("*.bin")) if directory.is_dir() else []
    hint = f" (found {', '.join(others)}: only safetensors weights are supported)" if others else ""
    raise CheckpointError(
        directory,
        f"no weights: expected {WEIGHT_STEMS[0]}.safetensors, {WEIGHT_STEMS[1]}.safetensors or a "
        f"*.safetensors.index.json{hint}",
    )


def read_weight_headers(entry: ComponentEntry) -> dict[str, TensorHeader]:
    """Every tensor's dtype and shape from the safetensors headers; shards are checked against the index."""
    index_path, files = weight_files(entry)
    headers: dict[str, TensorHeader] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    tensor = handle.get_slice(name)
                    if name in headers:
                        raise CheckpointError(file, f"tensor {name!r} is also stored in {headers[name].file.name}")
                    headers[name] = TensorHeader(tensor.get_dtype(), tuple(tensor.get_shape()), file)
        except SafetensorError as exc:
            raise CheckpointError(file, f"corrupt or truncated safetensors file ({exc})") from None
        except OSError as exc:
            raise CheckpointError(file, f"unreadable safetensors file ({exc})") from None
    if index_path is not None:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        for name, shard in weight_map.items():
            header = headers.get(name)
            if header is None or header.file.name != shard:
                raise CheckpointError(
                    entry.directory / shard, f"does not hold tensor {name!r} that {index_path.name} places there"
                )
        strays = sorted(set(headers) - set(weight_map))
        if strays:
            raise CheckpointError(
                headers[strays[0]].file, f"holds tensors {index_path.name} does not list: {strays[:3]}"
            )
    return headers


@dataclass(frozen=True)
class ExpectedTensor:
    """What a model built from the component's config holds under one checkpoint name."""

    shape: tuple[int, ...]
    floating: bool
    dtype: str | None = None  # the safetensors dtype required for a non-floating tensor


def check_weights_match(
    entry: ComponentEntry,
    headers: Mapping[str, TensorHeader],
    expected: Mapping[str, ExpectedTensor],
    *,
    alternatives: Mapping[str, tuple[str, ...]] | None = None,
    ignore_unexpected: bool = False,
) -> list[str]:
    """Compare a component's headers with what its config implies; returns the unexpected names when ignored.

    ``alternatives[name]`` lists other names that may hold the same tensor (weights tied in the model): a name is
    satisfied when it or one of its alternatives is stored.
    """
    config_file = entry.directory / "config.json"
    for name, want in expected.items():
        candidates = (name, *(alternatives or {}).get(name, ()))
        stored = next((headers[c] for c in candidates if c in headers), None)
        if stored is None:
            raise CheckpointError(
                entry.directory, f"weights lack tensor {name!r} that a model built from {entry.name}/config.json needs"
            )
        if stored.shape != want.shape:
            raise CheckpointError(
                stored.file,
                f"tensor {name!r} has shape {list(stored.shape)} but "
                f"{entry.name}/{config_file.name} implies {list(want.shape)}",
            )
        if want.floating and stored.dtype not in FLOAT_DTYPES:
            raise CheckpointError(
                stored.file,
                f"tensor {name!r} is stored as {stored.dtype}; expected a floating "
                f"dtype ({', '.join(sorted(FLOAT_DTYPES))})",
            )
        if not want.floating and want.dtype is not None and stored.dtype != want.dtype:
            raise CheckpointError(stored.file, f"tensor {name!r} is stored as {stored.dtype}; expected {want.dtype}")
    unexpected = sorted(set(headers) - set(expected) - {a for alts in (alternatives or {}).values() for a in alts})
    if unexpected and not ignore_unexpected:
        raise CheckpointError(
            headers[unexpected[0]].file,
            f"holds tensors a model built from {entry.name}/config.json does not have: "
            f"{unexpected[:3]}{' ...' if len(unexpected) > 3 else ''}",
        )
    return unexpected
