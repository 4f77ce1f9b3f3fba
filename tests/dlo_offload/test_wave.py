from __future__ import annotations

import pytest

from dlo_offload import WaveRefusedError, WaveRequest, validate_wave
from dlo_offload.wave import WAVE_TIMEOUT_ENV, default_wave_timeout_s


def test_a_uniform_wave_is_accepted() -> None:
    validate_wave(
        [
            WaveRequest("a", 8, "cat", schedule_key=(512, 512, 2), extra_args={"x": 1, "y": 2}),
            WaveRequest("b", 8, {"prompt": "dog"}, schedule_key=(512, 512, 2), extra_args={"y": 2, "x": 1}),
        ]
    )


@pytest.mark.parametrize(
    ("requests", "match"),
    [
        ([WaveRequest("a", None, "cat"), WaveRequest("b", None, "dog")], r"got \[None, None\]"),
        (
            [WaveRequest("a", 8, "cat"), WaveRequest("b", 4, "dog")],
            r"same explicit num_inference_steps \(None is not allowed\), got \[8, 4\]",
        ),
        (
            [WaveRequest("a", 8, "cat", schedule_key=(512, 512)), WaveRequest("b", 8, "dog", schedule_key=(256, 256))],
            "compatible shape, CFG, denoise schedule, output count, and LoRA settings",
        ),
        (
            [WaveRequest("a", 8, "cat", extra_args={"mode": 1}), WaveRequest("b", 8, "dog", extra_args={"mode": 2})],
            "share identical extra_args. Different extra_args can change the forward schedule and cause AllGather "
            "deadlock",
        ),
        (
            [WaveRequest("a", 8, ""), WaveRequest("b", 8, {"prompt_embeds": None}), WaveRequest("c", 8, "x")],
            r"non-empty prompt for every request; empty prompt request IDs: \['a', 'b'\]",
        ),
    ],
)
def test_waves_that_cannot_run_collectively_are_refused(requests: list[WaveRequest], match: str) -> None:
    with pytest.raises(WaveRefusedError, match=match):
        validate_wave(requests)


def test_wave_timeout_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(WAVE_TIMEOUT_ENV, raising=False)
    assert default_wave_timeout_s() == 600.0
    monkeypatch.setenv(WAVE_TIMEOUT_ENV, "2.5")
    assert default_wave_timeout_s() == 2.5
    for bad, match in (("soon", "is not a number of seconds"), ("0", "must be > 0 seconds")):
        monkeypatch.setenv(WAVE_TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=match):
            default_wave_timeout_s()
