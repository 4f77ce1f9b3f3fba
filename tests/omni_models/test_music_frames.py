"""Frame state, windows and payloads of the music AR stage (spec B.6-B.8), with the seed's examples."""

from __future__ import annotations

import pytest
import torch

from omni_models.music.frames import FrameBuffer, RequestARState, Window, chunk_windows, crop_sample_bounds
from omni_models.music.payload import Span, make_payload, payload_element


def frame(i: int) -> torch.Tensor:
    return torch.full((1, 10), float(i))


def test_frame_buffer_slices_absolute_ranges_and_clamps_discards() -> None:
    buffer = FrameBuffer()
    for i in range(10):
        buffer.append(frame(i))
    buffer.discard_before(4)
    assert buffer.slice(4, 6)[:, 0].tolist() == [4, 5]
    with pytest.raises(RuntimeError, match="unavailable"):
        buffer.slice(2, 5)
    with pytest.raises(RuntimeError, match="unavailable"):
        buffer.slice(8, 12)
    assert buffer.peak_frames == 10
    small = FrameBuffer()
    for i in range(5):
        small.append(frame(i))
    small.discard_before(-3)
    assert small.base_frame == 0
    small.discard_before(99)
    assert (small.base_frame, small.end_frame) == (5, 5)


def test_draw_slots_are_unique_per_song() -> None:
    state = RequestARState(seed=1, max_frames=64)
    slots = [state.advance_position() for _ in range(64)]
    assert slots[:3] == [0, 8, 16] and len(set(slots)) == 64
    assert len({s + k for s in slots for k in range(8)}) == 512


def test_a_window_is_released_only_once_a_frame_past_it_exists() -> None:
    state = RequestARState(seed=1, max_frames=1000)
    for i in range(200):
        state.frames.append(frame(i))
    assert state.ready_window() is None
    state.frames.append(frame(200))
    window = state.ready_window()
    assert (window.start, window.end, window.is_last) == (0, 200, False)
    taken = state.take_window(window, is_final=False)
    assert taken.shape[0] == 200 and state.frames.base_frame == 100 and state.emitted_windows == 1
    assert state.take_codes(150, 160).shape == (10, 8)
    assert state.take_codes(0, 10) is None


def simulate(total: int, window: int = 200, hop: int = 100) -> tuple[list[tuple[int, int, bool]], int]:
    state = RequestARState(seed=0, max_frames=total, window=window, hop=hop)
    spans = []
    for i in range(total):
        state.frames.append(frame(i))
        w = state.ready_window()
        if w is not None:
            state.take_window(w, is_final=False)
            spans.append((w.start, w.end, False))
    w = state.final_window()
    state.take_window(w, is_final=True)
    spans.append((w.start, w.end, True))
    return spans, state.frames.peak_frames


@pytest.mark.parametrize("total", [50, 250, 437, 600, 901])
def test_released_spans_cover_every_frame_once(total: int) -> None:
    spans, peak = simulate(total)
    covered, end = [], 0
    for start, stop, _ in spans:
        covered.extend(range(max(start, end), stop))
        end = max(end, stop)
    assert covered == list(range(total))
    for index, (start, stop, last) in enumerate(spans[:-1]):
        assert (start, stop - start, last) == (index * 100, 200, False) and stop - 1 < total - 1
    assert spans[-1][1] == total and spans[-1][1] - spans[-1][0] <= 300
    assert len(spans) <= len(chunk_windows(total)) and spans[0][0] == chunk_windows(total)[0].start
    assert peak <= 300
    if total == 50:
        assert spans == [(0, 50, True)]


def test_peak_buffer_does_not_grow_with_the_song() -> None:
    assert simulate(600)[1] == simulate(3000)[1] <= 300


def test_chunk_windows() -> None:
    assert chunk_windows(0) == []
    assert chunk_windows(150) == [Window(0, 150, True, True)]
    windows = chunk_windows(437)
    assert [w.start for w in windows] == [0, 100, 200, 300]
    assert windows[-1].end == 437 and [w.is_last for w in windows] == [False, False, False, True]
    assert [w.is_first for w in windows] == [True, False, False, False]
    tiny = chunk_windows(96, 32, 16)
    assert [(w.start, w.end) for w in tiny] == [(0, 32), (16, 48), (32, 64), (48, 80), (64, 96)]


def test_crop_bounds() -> None:
    assert crop_sample_bounds(Window(0, 150, True, True), 86, 344, 512) == (0, 0)
    assert crop_sample_bounds(Window(100, 300, False, False), 86, 344, 512) == (86 * 512, (344 - 86) * 512)


def span(start: int, frames: int, seed: int, last: bool) -> Span:
    return Span(start, torch.full((frames, 8), seed), torch.zeros(frames, 4), last, seed)


def test_payload_is_list_valued_per_row_and_consumed() -> None:
    infos = [{"span": span(0, 3, 11, False)}, {}, {"span": span(16, 2, 22, True)}]
    payload = make_payload(infos)
    assert all("span" not in info for info in infos)  # consume-on-emit
    assert make_payload(infos) is None
    rows = [payload_element(payload, row) for row in range(3)]
    assert [r["meta"]["audio_seed"] for r in rows] == [11, None, 22]
    assert [r["meta"]["last_chunk"] for r in rows] == [False, None, True]
    assert [r["meta"]["num_processed_tokens"] for r in rows] == [0, None, 16]
    assert rows[1]["latent"].numel() == 0
    assert rows[2]["codes"]["audio"].shape == (2, 8) and int(rows[2]["codes"]["audio"][0, 0]) == 22
    assert make_payload([{}, {}]) is None
