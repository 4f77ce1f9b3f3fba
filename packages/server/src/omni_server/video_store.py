"""The video jobs of one server and their files: ``VideoStore`` (``--video-dir``).

Each job is a ``VideoRecord`` written as ``<id>.json`` beside its file ``<id>.mp4`` (both written to a temporary
name and renamed, so a crash never leaves half a file under a real name). At start the store reads the directory
back: finished videos are served again until they expire; a job that was queued or running when the server
stopped is marked failed (``server_restarted``); a file without its record, a temporary file, a record that cannot
be read, and whatever has expired are removed.

Bounds (``ServerConfig``): a finished video (completed or failed) expires ``--video-ttl`` after it finished
(``expires_at``); at most ``--max-videos-kept`` finished videos and ``--max-video-storage-bytes`` MP4 bytes are
kept, the oldest finished first out. ``sweep`` applies them (after every finished job, at start, and every
``SWEEP_INTERVAL_S`` while the server runs).

Not thread-safe: the event loop owns it (file writes run in a thread through ``asyncio.to_thread`` by the caller).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any, Literal

import msgspec

from omni_server.config import ServerConfig

logger = logging.getLogger("omni_server.videos")

Status = Literal["queued", "in_progress", "completed", "failed"]
FINISHED = ("completed", "failed")
ID_PATTERN = re.compile(r"^video_[0-9a-f]{32}$")
SWEEP_INTERVAL_S = 30.0


class VideoError(msgspec.Struct, frozen=True, kw_only=True):
    """Why a job failed (the Video object's ``error``)."""

    code: str
    message: str
    param: str | None = None
    type: str | None = None


class VideoRecord(msgspec.Struct, kw_only=True):
    """One job as stored: the Video object's fields and what the server needs to serve it again."""

    id: str
    model: str
    prompt: str
    status: Status
    created_at: int
    created_ns: int  # time.time_ns() at creation: the list's order (created_at has whole seconds)
    size: str  # WIDTHxHEIGHT
    num_frames: int
    fps: int
    seed: int
    num_inference_steps: int
    completed_at: int | None = None
    expires_at: int | None = None
    error: VideoError | None = None
    bytes: int = 0  # the MP4's size once completed

    @property
    def seconds(self) -> str:
        """The clip's length by the videos API's rule, ``(num_frames - 1) / fps`` (81 frames at 16 fps: "5")."""
        return f"{(self.num_frames - 1) / self.fps:g}"


def new_video_id() -> str:
    return f"video_{secrets.token_hex(16)}"


class VideoStore:
    """The records of one server's video jobs, in ``directory`` (see the module docstring)."""

    def __init__(self, config: ServerConfig, *, now: float | None = None) -> None:
        self.directory = config.resolved_video_dir()
        self._ttl_s = config.video_ttl_s
        self._max_kept = config.max_videos_kept
        self._max_bytes = config.max_video_storage_bytes
        self.records: dict[str, VideoRecord] = {}
        self._load(time.time() if now is None else now)

    # -- files ----------------------------------------------------------------------------------------------------

    def video_path(self, video_id: str) -> Path:
        return self.directory / f"{video_id}.mp4"

    def _record_path(self, video_id: str) -> Path:
        return self.directory / f"{video_id}.json"

    def _write_atomically(self, path: Path, data: bytes) -> None:
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            with open(temporary, "wb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, path)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise

    def save(self, record: VideoRecord) -> None:
        """Keep ``record`` (in memory and as ``<id>.json``); ``OSError`` when the directory cannot be written."""
        self.records[record.id] = record
        self._write_atomically(self._record_path(record.id), msgspec.json.encode(record))

    def write_video(self, video_id: str, data: bytes) -> None:
        """Write a job's MP4 (call it from a thread: it may be large)."""
        self._write_atomically(self.video_path(video_id), data)

    def delete(self, video_id: str) -> VideoRecord | None:
        """Forget a job and remove its files; the record it was, or None."""
        record = self.records.pop(video_id, None)
        for path in (self.video_path(video_id), self._record_path(video_id)):
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                logger.warning("cannot remove %s: %s", path, exc)
        return record

    # -- bounds ---------------------------------------------------------------------------------------------------

    def finish(self, record: VideoRecord, *, now: float | None = None) -> None:
        """Stamp a finished job (completed_at, expires_at), save it and apply the bounds."""
        finished = int(time.time() if now is None else now)
        record.completed_at = finished
        record.expires_at = finished + int(round(self._ttl_s))
        self.save(record)
        self.sweep(now=finished)

    def sweep(self, *, now: float | None = None) -> list[str]:
        """Remove what expired, then the oldest finished videos beyond the count and byte bounds; their ids."""
        now = time.time() if now is None else now
        removed = [r.id for r in self.records.values() if r.status in FINISHED and (r.expires_at or now + 1) <= now]
        for video_id in removed:
            self.delete(video_id)
        finished = sorted(
            (r for r in self.records.values() if r.status in FINISHED), key=lambda r: (r.completed_at or 0, r.id)
        )
        total = sum(r.bytes for r in finished)
        while finished and (len(finished) > self._max_kept or total > self._max_bytes):
            oldest = finished.pop(0)
            total -= oldest.bytes
            self.delete(oldest.id)
            removed.append(oldest.id)
        if removed:
            logger.info("removed %d finished video(s) (expired, or beyond the kept count or bytes)", len(removed))
        return removed

    def stored_bytes(self) -> int:
        return sum(r.bytes for r in self.records.values() if r.status == "completed")

    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(("queued", "in_progress", "completed", "failed"), 0)
        for record in self.records.values():
            counts[record.status] += 1
        return counts

    # -- start-up -------------------------------------------------------------------------------------------------

    def _load(self, now: float) -> None:
        if not self.directory.is_dir():
            return
        decoder = msgspec.json.Decoder(VideoRecord)
        known: set[str] = set()
        for path in sorted(self.directory.glob("video_*.json")):
            video_id = path.stem
            try:
                record = decoder.decode(path.read_bytes())
            except (OSError, msgspec.DecodeError) as exc:
                logger.warning("removing unreadable video record %s: %s", path, exc)
                path.unlink(missing_ok=True)
                continue
            if record.id != video_id or not ID_PATTERN.match(video_id):
                logger.warning("removing video record %s: it names another id (%r)", path, record.id)
                path.unlink(missing_ok=True)
                continue
            if record.status == "completed" and not self.video_path(video_id).is_file():
                record = msgspec.structs.replace(
                    record,
                    status="failed",
                    bytes=0,
                    error=VideoError(code="video_file_missing", message="the video file is gone from --video-dir"),
                )
                self._write_atomically(path, msgspec.json.encode(record))
            elif record.status not in FINISHED:
                record = msgspec.structs.replace(
                    record,
                    status="failed",
                    completed_at=int(now),
                    expires_at=int(now) + int(round(self._ttl_s)),
                    error=VideoError(
                        code="server_restarted",
                        message="the server stopped before this video finished; create it again",
                        type="server_error",
                    ),
                )
                self._write_atomically(path, msgspec.json.encode(record))
            self.records[video_id] = record
            known.add(video_id)
        for path in self.directory.iterdir():
            stray = path.name.endswith(".tmp") or (path.suffix == ".mp4" and path.stem not in known)
            if stray and path.is_file():
                logger.info("removing %s (no video record holds it)", path)
                path.unlink(missing_ok=True)
        self.sweep(now=now)
        if self.records:
            logger.info("%d video(s) kept from before the start in %s", len(self.records), self.directory)


def record_object(record: VideoRecord, progress: int) -> dict[str, Any]:
    """The OpenAI Video object of ``record`` (omni adds ``num_frames``, ``fps``, ``seed``, ``num_inference_steps``)."""
    return {
        "id": record.id,
        "object": "video",
        "model": record.model,
        "status": record.status,
        "progress": 100 if record.status == "completed" else progress,
        "created_at": record.created_at,
        "completed_at": record.completed_at,
        "expires_at": record.expires_at,
        "prompt": record.prompt,
        "size": record.size,
        "seconds": record.seconds,
        "remixed_from_video_id": None,
        "error": None if record.error is None else msgspec.structs.asdict(record.error),
        "num_frames": record.num_frames,
        "fps": record.fps,
        "seed": record.seed,
        "num_inference_steps": record.num_inference_steps,
    }


__all__ = ["FINISHED", "ID_PATTERN", "VideoError", "VideoRecord", "VideoStore", "new_video_id", "record_object"]
