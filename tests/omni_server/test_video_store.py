"""``omni_server.video_store``: the videos kept in ``--video-dir``, on real files, with explicit clocks.

Each bound (``--video-ttl``, ``--max-videos-kept``, ``--max-video-storage-bytes``) removes the oldest finished videos,
files and records together; a store opened on a directory again serves what was finished, fails what was not,
and removes what no record holds.
"""

from __future__ import annotations

from pathlib import Path

from omni_server.config import ServerConfig
from omni_server.video_store import VideoRecord, VideoStore, new_video_id

T0 = 1_800_000_000


def config(directory: Path, **bounds) -> ServerConfig:
    return ServerConfig(video_dir=str(directory), **bounds)


def record(created: int, status: str = "queued") -> VideoRecord:
    return VideoRecord(
        id=new_video_id(),
        model="wan",
        prompt="a clip",
        status=status,
        created_at=created,
        created_ns=created * 10**9,
        size="48x32",
        num_frames=5,
        fps=16,
        seed=0,
        num_inference_steps=3,
    )


def completed(store: VideoStore, at: int, size: int) -> VideoRecord:
    job = record(at)
    store.save(job)
    store.write_video(job.id, b"x" * size)
    job.status, job.bytes = "completed", size
    store.finish(job, now=at)
    return job


def files(directory: Path) -> set[str]:
    return {path.name for path in directory.iterdir()}


def test_each_bound_removes_the_oldest_finished_videos_with_their_files(tmp_path: Path) -> None:
    store = VideoStore(config(tmp_path, max_videos_kept=3, max_video_storage_bytes=250, video_ttl_s=100), now=T0)
    first, second, third = (completed(store, T0 + i, 100) for i in range(3))
    # 300 bytes > 250: the oldest goes at once
    assert set(store.records) == {second.id, third.id} and store.stored_bytes() == 200
    assert files(tmp_path) == {f"{v.id}.{ext}" for v in (second, third) for ext in ("json", "mp4")}
    running = record(T0 + 3)
    store.save(running)  # unfinished jobs are never evicted
    failed = record(T0 + 4, status="failed")
    store.save(failed)
    store.finish(failed, now=T0 + 4)
    extra = completed(store, T0 + 5, 10)  # 4 finished > 3 kept: the oldest finished goes
    assert set(store.records) == {third.id, running.id, failed.id, extra.id}
    assert third.expires_at == T0 + 2 + 100
    assert store.sweep(now=T0 + 102) == [third.id]  # expired
    assert store.sweep(now=T0 + 1000) == [failed.id, extra.id]
    assert set(store.records) == {running.id} and files(tmp_path) == {f"{running.id}.json"}
    assert first.id not in store.records


def test_a_store_opened_again_keeps_the_finished_fails_the_unfinished_and_removes_strays(tmp_path: Path) -> None:
    store = VideoStore(config(tmp_path, video_ttl_s=100), now=T0)
    kept = completed(store, T0, 64)
    running, lost = record(T0), completed(store, T0, 8)
    store.save(running)
    store.video_path(lost.id).unlink()  # its file is gone
    (tmp_path / f"{new_video_id()}.mp4").write_bytes(b"no record")
    (tmp_path / f".{kept.id}.mp4.1234.tmp").write_bytes(b"half written")
    (tmp_path / f"{new_video_id()}.json").write_text("{not json")
    again = VideoStore(config(tmp_path, video_ttl_s=100), now=T0 + 10)
    assert again.records[kept.id] == kept and again.video_path(kept.id).read_bytes() == b"x" * 64
    restarted = again.records[running.id]
    assert (restarted.status, restarted.error.code, restarted.expires_at) == ("failed", "server_restarted", T0 + 110)
    assert (again.records[lost.id].status, again.records[lost.id].error.code) == ("failed", "video_file_missing")
    assert files(tmp_path) == {f"{kept.id}.json", f"{kept.id}.mp4", f"{running.id}.json", f"{lost.id}.json"}
    assert VideoStore(config(tmp_path, video_ttl_s=100), now=T0 + 1000).records == {}  # all expired meanwhile
    assert files(tmp_path) == set()


def test_serving_a_video_model_checks_the_video_dir_before_anything_loads(tmp_path: Path) -> None:
    import pytest

    from omni_server.config import ConfigError
    from omni_server.startup import check_video_dir

    check_video_dir(config(tmp_path / "not" / "yet"))  # created when the first video is written
    (tmp_path / "file").write_text("")
    for directory, words in (
        (tmp_path / "file" / "videos", "is not a directory"),
        (Path("/proc/1/videos"), "not writable"),
    ):
        with pytest.raises(ConfigError, match=words) as raised:
            check_video_dir(config(directory))
        assert str(raised.value).startswith(f"--video-dir {directory}")


def test_the_videos_routes_sit_behind_the_guard(tmp_path: Path) -> None:
    """The app without its engine (no lifespan): what the guard answers comes before any route or model."""
    import asyncio

    import httpx

    from omni_server.api import create_app
    from omni_server.http_guard import unguarded_routes

    app = create_app(config(tmp_path, api_key="secret"))
    assert unguarded_routes(app) == []
    assert {"/v1/videos", "/v1/videos/{video_id}", "/v1/videos/{video_id}/content"} <= {
        getattr(route, "path", None) for route in app.router.routes
    }

    async def calls() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            key = {"Authorization": "Bearer secret"}
            return [
                await client.post("/v1/videos", json={"prompt": "a cat"}),
                await client.get("/v1/videos"),
                await client.post("/v1/videos", content=b"prompt=a cat", headers={**key, "content-type": "text/plain"}),
                await client.get("/v1/videos", headers=key),
                await client.get("/v1/videos/video_" + "0" * 32, headers=key),
                await client.post("/v1/videos", json={"prompt": "a cat"}, headers=key),
            ]

    unauthorized, listed_without_key, plain, listed, missing, no_engine = asyncio.run(calls())
    assert unauthorized.status_code == listed_without_key.status_code == 401
    assert plain.status_code == 415
    assert listed.status_code == 200 and listed.json() == {
        "object": "list",
        "data": [],
        "first_id": None,
        "last_id": None,
        "has_more": False,
    }
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "video_not_found"
    assert no_engine.status_code == 503  # the engine never started: nothing was created
    assert list(tmp_path.iterdir()) == []
