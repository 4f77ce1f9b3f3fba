"""The videos API (issue 29): a tiny random-weight Wan2.1 checkpoint behind ``/v1/videos``, the official OpenAI
SDK as the client of real ``omni-server serve`` processes, ``omni-server generate`` a real subprocess.

The reference is omni's own Wan pipeline in this process at the same seed (its frames equal diffusers'
``WanPipeline``'s: ``tests/omni_models/test_video_family.py``); an MP4 is decoded by FFmpeg (PyAV) and its
``yuv420p`` planes compared with the frames converted by the same swscale call (the codec's loss alone: PSNR >= 40 dB
at ``--video-crf 10``; ``test_video_io`` bounds the conversion itself).
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

pytest.importorskip("diffusers")
pytest.importorskip("av")

from omni_server import video_io  # noqa: E402

# The SDK marks its videos methods deprecated (the Sora API's shutdown); the methods are what clients call.
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
TARGET_DB = 40.0
SHAPE = dict(size="48x32", extra_body={"num_frames": 5, "num_inference_steps": 3})
SERVER_FLAGS = (
    "--max-video-jobs",
    "2",
    "--max-video-frames",
    "13",
    "--max-video-pixels",
    "100000",
    "--video-crf",
    "10",
    "--shutdown-timeout",
    "1",
)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omni_models import synthetic

    directory = tmp_path_factory.mktemp("wan2.1")
    return synthetic.save_checkpoint("wan", synthetic.wan_components("wan2.1"), directory)


@pytest.fixture(scope="module")
def pipeline(wan_dir):
    import omni_models

    return omni_models.load(str(wan_dir))


@pytest.fixture(scope="module")
def video_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("videos")


@pytest.fixture(scope="module")
def server(wan_dir, video_dir, server_factory):
    handle = server_factory(str(wan_dir), "--served-model-name", "wan", "--video-dir", str(video_dir), *SERVER_FLAGS)
    yield handle
    handle.stop()


def sdk(handle, **kwargs):
    from openai import OpenAI

    return OpenAI(base_url=f"{handle.url}/v1", api_key="unused", timeout=120, **kwargs)


def wait_until(client, video_id: str, done=("completed", "failed"), timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while True:
        video = client.videos.retrieve(video_id)
        if video.status in done:
            return video
        assert time.monotonic() < deadline, f"video {video_id} still {video.status} after {timeout_s} s"
        time.sleep(0.05)


def long_job(client, seed: int):
    """A job that runs for a long while (the most steps the model takes): to delete or to fill the queue."""
    return client.videos.create(prompt="a long clip", extra_body={"num_inference_steps": 1000, "seed": seed})


def test_sdk_creates_polls_downloads_and_the_mp4_holds_the_pipelines_frames(server, pipeline, tools) -> None:
    client = sdk(server)
    created = client.videos.create(
        prompt="a red fox in the snow", **{**SHAPE, "extra_body": {**SHAPE["extra_body"], "seed": 7}}
    )
    assert (created.object, created.status, created.model, created.size) == ("video", "queued", "wan", "48x32")
    assert created.seconds == "0.25" and created.progress == 0 and created.id.startswith("video_")
    video = wait_until(client, created.id)
    assert (video.status, video.progress, video.error) == ("completed", 100, None), video
    assert video.completed_at >= video.created_at and video.expires_at == video.completed_at + 24 * 3600
    data = client.videos.download_content(created.id).content
    decoded = video_io.decode_mp4(data, pixel_format="yuv420p")
    assert (decoded.codec, decoded.pix_fmt, decoded.width, decoded.height, decoded.fps) == (
        "h264",
        "yuv420p",
        48,
        32,
        16,
    )
    expected = pipeline("a red fox in the snow", seed=7, height=32, width=48, num_frames=5, num_inference_steps=3)[0]
    assert decoded.frames.shape[0] == expected.frames.shape[0] == 5
    codec_db = psnr(decoded.frames, video_io.yuv420p(expected.frames))
    rgb_db = psnr(video_io.decode_mp4(data).frames, expected.frames)
    print(f"MP4 vs the pipeline's frames: {codec_db:.1f} dB in yuv420p, {rgb_db:.1f} dB in RGB (4:2:0 included)")
    assert codec_db >= TARGET_DB
    partial = httpx.get(f"{server.url}/v1/videos/{created.id}/content", headers={"Range": "bytes=0-99"}, timeout=30)
    assert (partial.status_code, partial.content) == (206, data[:100])  # a player seeks with range requests
    # The same request through JSON (curl's way) and seconds instead of num_frames: the same file.
    body = {"prompt": "a red fox in the snow", "size": "48x32", "seconds": "0.25", "num_inference_steps": 3, "seed": 7}
    again = httpx.post(f"{server.url}/v1/videos", json=body, timeout=60).json()
    assert again["num_frames"] == 5 and again["seconds"] == "0.25"
    wait_until(client, again["id"])
    assert client.videos.download_content(again["id"]).content == data
    metrics = server.metrics()
    assert tools.metric(metrics, "omni:video_jobs", status="completed") >= 2
    assert tools.metric(metrics, "omni:video_storage_bytes") >= 2 * len(data)
    assert tools.metric(metrics, "omni:request_finished_total", outcome="success") >= 2


def test_list_pages_like_the_sdk_expects(server) -> None:
    client = sdk(server)
    (model,) = client.models.list().data
    described = {key: getattr(model, key) for key in ("task", "family", "default_num_frames", "frame_multiple")}
    assert described == {"task": "text-to-video", "family": "wan", "default_num_frames": 9, "frame_multiple": 4}
    assert (model.default_fps, model.default_size) == (16, "64x64")
    # The third with a step cache: an object field, which the SDK's multipart body carries as cache[knob] parts.
    cached = {**SHAPE["extra_body"], "cache": {"preset": "fast", "warmup_steps": 1}}
    ids = [client.videos.create(prompt=f"clip {i}", **SHAPE).id for i in range(2)]
    ids.append(client.videos.create(prompt="clip 2", size=SHAPE["size"], extra_body=cached).id)
    for video_id in ids:
        assert wait_until(client, video_id).status == "completed"
    listed = [v.id for v in client.videos.list(limit=2)]  # the SDK follows last_id / has_more through every page
    assert set(ids) <= set(listed) and len(listed) == len(set(listed))
    page = client.videos.list(limit=2, order="asc")
    assert len(page.data) == 2 and page.has_more and page.last_id == page.data[-1].id
    newest = client.videos.list(limit=1).data[0]
    assert newest.id == ids[-1]


def test_delete_while_running_aborts_the_job_in_the_engine(server, tools) -> None:
    client = sdk(server)
    aborted = tools.metric(server.metrics(), "omni:request_finished_total", outcome="aborted")
    job = long_job(client, seed=1)
    running = wait_until(client, job.id, done=("in_progress",), timeout_s=60)
    deadline = time.monotonic() + 30
    while running.progress == 0 and time.monotonic() < deadline:
        running = client.videos.retrieve(job.id)
    assert running.status == "in_progress" and 0 < running.progress < 100, running
    deleted = client.videos.delete(job.id)
    assert (deleted.id, deleted.deleted, deleted.object) == (job.id, True, "video.deleted")
    from openai import NotFoundError

    with pytest.raises(NotFoundError):
        client.videos.retrieve(job.id)
    deadline = time.monotonic() + 30
    while True:  # the engine dropped it: nothing runs or waits, and it was counted as aborted
        metrics = server.metrics()
        idle = (
            tools.metric(metrics, "omni:num_requests_running")
            == 0
            == tools.metric(metrics, "omni:num_requests_waiting")
        )
        if idle and tools.metric(metrics, "omni:request_finished_total", outcome="aborted") == aborted + 1:
            break
        assert time.monotonic() < deadline, metrics
        time.sleep(0.05)
    assert tools.metric(metrics, "omni:video_jobs", status="in_progress") == 0
    assert not list(server_video_dir(server).glob(f"{job.id}*"))
    assert wait_until(client, client.videos.create(prompt="after", **SHAPE).id).status == "completed"


def server_video_dir(handle) -> Path:
    return Path(handle.args[handle.args.index("--video-dir") + 1])


def test_a_full_queue_gets_429_and_nothing_changes(server, tools) -> None:
    from openai import RateLimitError

    client = sdk(server, max_retries=0)
    jobs = [long_job(client, seed=10 + i) for i in range(2)]  # --max-video-jobs 2
    before = [v.id for v in client.videos.list(limit=100)]
    with pytest.raises(RateLimitError) as raised:
        client.videos.create(prompt="one too many", **SHAPE)
    error = raised.value.body
    assert error["code"] == "queue_full" and "--max-video-jobs" in error["message"]
    assert raised.value.response.headers["retry-after"] and raised.value.response.headers["x-should-retry"] == "true"
    assert [v.id for v in client.videos.list(limit=100)] == before
    for job in jobs:
        client.videos.delete(job.id)


def test_bad_inputs_get_a_400_naming_the_field_and_change_nothing(server) -> None:
    from openai import BadRequestError, NotFoundError

    client = sdk(server, max_retries=0)
    before = [v.id for v in client.videos.list(limit=100)]
    for kwargs, param in (
        ({"size": "33x32"}, "size"),
        ({"size": "large"}, "size"),
        ({"seconds": "3"}, "seconds"),  # 49 frames > the model's 17
        ({"seconds": "0.3"}, "seconds"),  # 0.3 s at 16 fps is 6 frames, not 4k+1
        ({"seconds": "0.25", "extra_body": {"num_frames": 9}}, "seconds"),
        ({"extra_body": {"num_frames": 6}}, "num_frames"),
        ({"extra_body": {"num_frames": 17}}, "num_frames"),  # > --max-video-frames 13
        ({"size": "128x128", "extra_body": {"num_frames": 9}}, "size"),  # > --max-video-pixels 100000
        ({"extra_body": {"guidance_scale_2": 3.0}}, "guidance_scale_2"),  # Wan2.1 has one expert
        ({"extra_body": {"fps": 0}}, "fps"),
        ({"extra_body": {"seed": "x"}}, "seed"),
        ({"extra_body": {"num_inference_steps": 0}}, "num_inference_steps"),
        ({"extra_body": {"guidance_scale": -1}}, "guidance_scale"),
        ({"extra_body": {"cache": "fastest"}}, "cache"),
        ({"extra_body": {"cache": {"preset": "fast", "threshold": -1}}}, "cache"),  # sent as cache[...] parts
        ({"extra_body": {"nmu_frames": 5}}, "nmu_frames"),
        ({"input_reference": ("ref.png", b"\x89PNG not really", "image/png")}, "input_reference"),
        ({"prompt": " "}, "prompt"),
    ):
        with pytest.raises(BadRequestError) as raised:
            client.videos.create(**{"prompt": "a cat", **kwargs})
        assert raised.value.body["param"] == param, (kwargs, raised.value.body)
    with pytest.raises(NotFoundError) as raised:
        client.videos.create(prompt="a cat", model="sora-2")
    assert raised.value.body["param"] == "model"
    for video_id in ("video_" + "0" * 32, "../../etc/passwd"):
        with pytest.raises(NotFoundError):
            client.videos.retrieve(video_id)
    with pytest.raises(NotFoundError):
        client.videos.delete("video_" + "0" * 32)
    done = wait_until(client, client.videos.create(prompt="a cat", **SHAPE).id)
    with pytest.raises(BadRequestError) as raised:
        client.videos.download_content(done.id, variant="thumbnail")
    assert raised.value.body["param"] == "variant"
    for query, param in (({"limit": 0}, "limit"), ({"order": "up"}, "order"), ({"after": "video_x"}, "after")):
        with pytest.raises(BadRequestError) as raised:
            client.videos.list(**query)
        assert raised.value.body["param"] == param
    assert [v.id for v in client.videos.list(limit=100)] == [done.id, *before]


def test_playground_shows_progress_and_plays_the_video(server, browser) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver = browser
    driver.get(server.url + "/")
    WebDriverWait(driver, 30).until(lambda d: d.find_element(By.ID, "family").text == "(wan, wan2.1)")
    assert driver.find_element(By.ID, "frames").get_attribute("placeholder") == "9"
    # 400 steps: the job must outlast several of the page's 250 ms polls for its progress to show. At 40 steps a
    # quiet machine finished it between two polls (the page went from "Queued (0%)" straight to "Done").
    for field, value in (("prompt", "a red fox"), ("size", "48x32"), ("frames", "5"), ("steps", "400"), ("seed", "4")):
        driver.find_element(By.ID, field).send_keys(value)
    driver.find_element(By.ID, "generate").click()
    seen: set[str] = set()

    def finished(d) -> bool:
        text = d.find_element(By.ID, "status").text
        seen.add(text)
        return text.startswith(("Done", "Error"))

    WebDriverWait(driver, 120, poll_frequency=0.05).until(finished)
    status = driver.find_element(By.ID, "status").text
    assert status == "Done: 48x32, 5 frames at 16 fps (0.25 s), seed 4.", status
    assert any(text.startswith("Generating (") and not text.startswith("Generating (0%") for text in seen), seen
    player = driver.find_element(By.ID, "player")
    assert player.get_attribute("src").startswith("blob:")
    video_id = driver.find_element(By.CSS_SELECTOR, "#videos li").text.split(":")[0]
    assert sdk(server).videos.retrieve(video_id).seed == 4  # the page's video is the job it created
    if driver.execute_script("return document.createElement('video').canPlayType('video/mp4; codecs=\"avc1.64000d\"')"):
        WebDriverWait(driver, 30).until(lambda d: d.execute_script("return arguments[0].readyState", player) >= 2)
        duration = driver.execute_script("return arguments[0].duration", player)
        assert abs(duration - 5 / 16) < 0.05, duration  # the browser decoded it: 5 frames at 16 fps
    else:
        print("this Chromium has no H.264 decoder: the player's playback is not checked")


def test_generate_cli_writes_the_same_mp4_as_the_server(server, wan_dir, tmp_path) -> None:
    client = sdk(server)
    video = wait_until(
        client,
        client.videos.create(prompt="a green field", **{**SHAPE, "extra_body": {**SHAPE["extra_body"], "seed": 3}}).id,
    )
    served = client.videos.download_content(video.id).content
    out = tmp_path / "clip.mp4"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "omni_server",
            "generate",
            "a green field",
            "--model",
            str(wan_dir),
            "--device",
            "cpu",
            "--size",
            "48x32",
            "--num-frames",
            "5",
            "--steps",
            "3",
            "--image-seed",
            "3",
            "--video-crf",
            "10",
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.split()[-1]) == out and out.read_bytes() == served


def test_serve_refuses_a_video_dir_it_cannot_write_before_loading(wan_dir, tmp_path) -> None:
    (tmp_path / "file").write_text("")
    result = subprocess.run(
        [sys.executable, "-m", "omni_server", "serve", str(wan_dir), "--video-dir", str(tmp_path / "file" / "v")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and f"--video-dir {tmp_path / 'file' / 'v'}: " in result.stderr, result.stderr


def test_finished_videos_survive_a_restart_and_unfinished_ones_fail(server, wan_dir, server_factory) -> None:
    client = sdk(server)
    done = wait_until(client, client.videos.create(prompt="kept", **SHAPE).id)
    data = client.videos.download_content(done.id).content
    running = long_job(client, seed=20)
    wait_until(client, running.id, done=("in_progress",), timeout_s=60)
    server.stop()  # SIGTERM: the drain (--shutdown-timeout 1) ends the running job
    directory = str(server_video_dir(server))
    again = server_factory(str(wan_dir), "--served-model-name", "wan", "--video-dir", directory, "--no-warmup")
    try:
        client = sdk(again)
        kept = client.videos.retrieve(done.id)
        assert (kept.status, kept.completed_at, kept.expires_at) == ("completed", done.completed_at, done.expires_at)
        assert client.videos.download_content(done.id).content == data
        ended = client.videos.retrieve(running.id)
        assert ended.status == "failed" and ended.error.code in ("server_shutting_down", "server_restarted"), ended
        assert done.id in [v.id for v in client.videos.list(limit=100)]
    finally:
        again.stop()


def test_wan22_a14b_through_the_sdk_and_the_cli_equals_diffusers(server_factory, tmp_path_factory, tmp_path) -> None:
    """Wan2.2 A14B end to end (two experts switched at ``boundary_ratio``, ``guidance_scale_2`` for the second):
    the SDK's MP4 and ``generate``'s hold diffusers' ``WanPipeline`` frames at the same seed (the codec's loss
    alone: >= 40 dB in yuv420p), the two files are the same bytes, and the low-noise scale reaches the model."""
    import diffusers
    import torch

    from omni_models import synthetic
    from omni_models.video import Video

    a14b = synthetic.save_checkpoint(
        "wan", synthetic.wan_components("wan2.2-a14b"), tmp_path_factory.mktemp("wan2.2-a14b")
    )
    handle = server_factory(str(a14b), "--served-model-name", "a14b", *SERVER_FLAGS)
    client = sdk(handle)
    extra = {**SHAPE["extra_body"], "seed": 11, "guidance_scale": 5.0, "guidance_scale_2": 2.0}
    video = wait_until(client, client.videos.create(prompt="a red fox in the snow", size="48x32", extra_body=extra).id)
    assert video.status == "completed", video
    served = client.videos.download_content(video.id).content
    reference = diffusers.WanPipeline.from_pretrained(str(a14b), dtype=torch.float32)
    frames = reference(
        prompt="a red fox in the snow",
        height=32,
        width=48,
        num_frames=5,
        num_inference_steps=3,
        guidance_scale=5.0,
        guidance_scale_2=2.0,
        generator=torch.Generator("cpu").manual_seed(11),
        output_type="np",
    ).frames[0]
    expected = Video.from_float(frames, 16).frames
    figure = psnr(video_io.decode_mp4(served, pixel_format="yuv420p").frames, video_io.yuv420p(expected))
    print(f"Wan2.2 A14B over /v1/videos vs diffusers: {figure:.1f} dB (yuv420p)")
    assert figure >= TARGET_DB
    other = wait_until(
        client,
        client.videos.create(
            prompt="a red fox in the snow", size="48x32", extra_body={**extra, "guidance_scale_2": 6.0}
        ).id,
    )
    assert psnr(video_io.decode_mp4(client.videos.download_content(other.id).content).frames, expected) < TARGET_DB
    handle.stop()
    out = tmp_path / "a14b.mp4"
    command = [sys.executable, "-m", "omni_server", "generate", "a red fox in the snow", "--model", str(a14b)]
    command += ["--device", "cpu", "--size", "48x32", "--num-frames", "5", "--steps", "3", "--image-seed", "11"]
    command += ["--guidance-scale", "5.0", "--guidance-scale-2", "2.0", "--video-crf", "10", "-o", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert out.read_bytes() == served
