"""Resolving a model name, directory or Hugging Face repo id to a local model directory.

Accepted, in this order:
1. a shipped model name (``omni-shapes-tiny``, ``omni-tones-tiny``, ...: ``shipped_models()``): its directory
   inside this package;
2. an existing local directory holding ``config.json`` (an omni model) or ``model_index.json`` (a diffusers
   pipeline checkpoint);
3. a Hugging Face repo id (``owner/name``, optionally ``owner/name@revision``), resolved by huggingface_hub's own
   ``snapshot_download`` against the local cache (``HF_HUB_CACHE``/``HF_HOME``, as huggingface_hub reads them).
   Nothing is downloaded unless the caller passes ``allow_download=True``.
"""

from __future__ import annotations

import re
from pathlib import Path

from omni_models.checkpoint import CONFIG_NAME as OMNI_CONFIG_NAME
from omni_models.errors import CheckpointError, InvalidRequestError

WEIGHTS_ROOT = Path(__file__).parent / "weights"
DIFFUSERS_INDEX_NAME = "model_index.json"  # a diffusers pipeline checkpoint


def shipped_models() -> tuple[str, ...]:
    """The models inside this package (each a directory of ``weights/``), by name."""
    if not WEIGHTS_ROOT.is_dir():
        return ()
    return tuple(
        sorted(
            entry.name
            for entry in WEIGHTS_ROOT.iterdir()
            if (entry / OMNI_CONFIG_NAME).is_file() or (entry / DIFFUSERS_INDEX_NAME).is_file()
        )
    )


_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


def is_diffusers_checkpoint(directory: Path) -> bool:
    return (directory / DIFFUSERS_INDEX_NAME).is_file()


def _check_model_directory(directory: Path) -> Path:
    if not ((directory / OMNI_CONFIG_NAME).is_file() or is_diffusers_checkpoint(directory)):
        raise CheckpointError(
            directory,
            f"not a model directory: it has neither {DIFFUSERS_INDEX_NAME} (a diffusers pipeline checkpoint) nor "
            f"{OMNI_CONFIG_NAME} (an omni model)",
        )
    return directory


def _from_hugging_face(repo_id: str, *, allow_download: bool) -> Path | None:
    """The snapshot directory of ``repo_id[@revision]`` through huggingface_hub; None if it is not available."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    repo, _, revision = repo_id.partition("@")
    try:
        return Path(snapshot_download(repo, revision=revision or None, local_files_only=not allow_download))
    except (LocalEntryNotFoundError, HfHubHTTPError):
        return None


def hf_hub_cache() -> Path:
    """The local Hugging Face cache huggingface_hub uses (from its configuration)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def resolve_model_dir(name_or_path: str, *, allow_download: bool = False) -> Path:
    """The local directory of a model.

    Raises InvalidRequestError (param "model") saying what was tried when nothing matches, and CheckpointError
    when a directory exists but holds no model.
    """
    if not isinstance(name_or_path, str) or not name_or_path:
        raise InvalidRequestError(f"model must be a non-empty string, got {name_or_path!r}", param="model")
    shipped = shipped_models()
    if name_or_path in shipped:
        return WEIGHTS_ROOT / name_or_path
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return _check_model_directory(path)
    if _REPO_ID.match(name_or_path):
        snapshot = _from_hugging_face(name_or_path, allow_download=allow_download)
        if snapshot is not None:
            return _check_model_directory(snapshot)
    where = "downloading was not allowed" if not allow_download else "downloading it failed"
    raise InvalidRequestError(
        f"unknown model {name_or_path!r}: not a shipped model ({', '.join(shipped)}), not a local model "
        f"directory, and not a repo id present in the local Hugging Face cache {hf_hub_cache()} ({where})",
        param="model",
    )
