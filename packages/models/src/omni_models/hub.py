"""Resolving a model name or path to a local model directory. Never touches the network.

Accepted, in this order:
1. a shipped model name (``omni-shapes-tiny``): the directory inside this package;
2. an existing local directory holding ``config.json``;
3. a Hugging Face repo id (``owner/name``, optionally ``owner/name@revision``) already in the local Hugging Face
   cache (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``), read through its
   ``refs/<revision>`` file and ``snapshots/<commit>/`` directory (the cache layout huggingface_hub writes).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from omni_models.checkpoint import CONFIG_NAME
from omni_models.errors import InvalidRequestError

WEIGHTS_ROOT = Path(__file__).parent / "weights"
SHIPPED_MODELS: tuple[str, ...] = ("omni-shapes-tiny",)
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


def hf_hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def _from_hf_cache(repo_id: str) -> Path | None:
    repo, _, revision = repo_id.partition("@")
    revision = revision or "main"
    repo_dir = hf_hub_cache() / ("models--" + repo.replace("/", "--"))
    ref = repo_dir / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snapshot = repo_dir / "snapshots" / commit
    return snapshot if (snapshot / CONFIG_NAME).is_file() else None


def resolve_model_dir(name_or_path: str) -> Path:
    """The local directory of a model; InvalidRequestError (param "model") says what was tried."""
    if not isinstance(name_or_path, str) or not name_or_path:
        raise InvalidRequestError(f"model must be a non-empty string, got {name_or_path!r}", param="model")
    if name_or_path in SHIPPED_MODELS:
        directory = WEIGHTS_ROOT / name_or_path
        if not (directory / CONFIG_NAME).is_file():
            raise InvalidRequestError(
                f"model {name_or_path!r} is known but its weights are missing from this install "
                f"(expected {directory}/{CONFIG_NAME}); reinstall omni-models",
                param="model",
            )
        return directory
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / CONFIG_NAME).is_file():
            raise InvalidRequestError(f"directory {path} has no {CONFIG_NAME}; it is not a model directory",
                                      param="model")
        return path
    if _REPO_ID.match(name_or_path):
        snapshot = _from_hf_cache(name_or_path)
        if snapshot is not None:
            return snapshot
    raise InvalidRequestError(
        f"unknown model {name_or_path!r}: not a shipped model ({', '.join(SHIPPED_MODELS)}), not a local model "
        f"directory, and not a repo id present in the local Hugging Face cache {hf_hub_cache()} "
        "(nothing is downloaded)",
        param="model",
    )
