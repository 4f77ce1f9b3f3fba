"""The oscillator decoder: per-frame synthesis latents -> mono waveform (DDSP-style, no learned weights).

Latent channels per frame (the acoustic transformer predicts them):
0 melody pitch ``(midi - 66) / 12``; 1 melody amplitude; 2 bass pitch ``(midi - 42) / 12``; 3 bass amplitude;
4 harmonic roll-off (0 bright .. 1 pure); 5 odd-harmonic emphasis; 6 vibrato depth; 7 breath noise.
Controls are linearly interpolated from the frame rate to the sample rate; phases accumulate, so pitch changes
are click-free. Deterministic: the same latents give the same samples (the noise is seeded).
"""

from __future__ import annotations

import numpy as np

NUM_HARMONICS = 12
VIBRATO_HZ = 5.5


def midi_to_hz(midi: np.ndarray) -> np.ndarray:
    return 440.0 * 2.0 ** ((midi - 69.0) / 12.0)


def _upsample(control: np.ndarray, samples_per_frame: int) -> np.ndarray:
    frames = control.shape[0]
    x = (np.arange(frames * samples_per_frame) + 0.5) / samples_per_frame - 0.5
    return np.interp(x, np.arange(frames), control)


def decode(latents: np.ndarray, *, sample_rate: int, frame_rate: int, seed: int = 0) -> np.ndarray:
    """Waveform float32 [frames * sample_rate / frame_rate] in [-1, 1] for latents [frames, 8]."""
    latents = np.asarray(latents, dtype=np.float64)
    if latents.ndim != 2 or latents.shape[1] != 8:
        raise ValueError(f"latents must be [frames, 8], got {latents.shape}")
    spf = sample_rate // frame_rate
    up = [_upsample(latents[:, c], spf) for c in range(8)]
    t = np.arange(up[0].shape[0]) / sample_rate
    vibrato = np.clip(up[6], 0, 1) * 0.35 * np.sin(2 * np.pi * VIBRATO_HZ * t)
    f0 = midi_to_hz(66.0 + 12.0 * up[0] + vibrato)
    rolloff = 0.3 + 2.7 * np.clip(up[4], 0, 1)
    odd = np.clip(up[5], 0, 1)
    melody = np.zeros_like(t)
    phase = 2 * np.pi * np.cumsum(f0) / sample_rate
    for h in range(1, NUM_HARMONICS + 1):
        weight = h ** (-rolloff) * ((1.0 + odd) if h % 2 else (1.0 - 0.8 * odd))
        weight = np.where(f0 * h < sample_rate / 2 - 200, weight, 0.0)
        melody += weight * np.sin(h * phase)
    melody *= np.clip(up[1], 0, 1.5) * 0.35
    bass_f0 = midi_to_hz(42.0 + 12.0 * up[2])
    bass_phase = 2 * np.pi * np.cumsum(bass_f0) / sample_rate
    bass = (np.sin(bass_phase) + 0.3 * np.sin(2 * bass_phase)) * np.clip(up[3], 0, 1.5) * 0.25
    noise = (
        np.random.default_rng(seed).standard_normal(t.shape[0]) * np.clip(up[7], 0, 1) * 0.05 * np.clip(up[1], 0, 1.5)
    )
    return np.clip(melody + bass + noise, -1.0, 1.0).astype(np.float32)


def to_wav_bytes(samples: np.ndarray, sample_rate: int) -> bytes:
    """16-bit PCM mono WAV."""
    import io
    import wave

    pcm = (np.clip(samples, -1, 1) * 32767).astype("<i2")
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm.tobytes())
    return buffer.getvalue()
