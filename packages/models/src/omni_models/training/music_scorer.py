"""Reads a waveform back into caption attributes with numpy FFTs: tonic and mode (chroma against key
profiles), tempo (onset-envelope autocorrelation), timbre (spectral shape and envelope, nearest calibrated
centroid) and loudness (RMS). Calibrated on ground-truth renders of the procedural world, never on model output.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from omni_models.music.decoder import decode
from omni_models.training.music_data import LOUDNESS, TEMPI, TIMBRES, SongSpec, compose

# Krumhansl-Kessler key profiles.
MAJOR_PROFILE = np.array([6.35, 2.23, 3.48, 2.33, 4.38, 4.09, 2.52, 5.19, 2.39, 3.66, 2.29, 2.88])
MINOR_PROFILE = np.array([6.33, 2.68, 3.52, 5.38, 2.60, 3.53, 2.54, 4.75, 3.98, 2.69, 3.34, 3.17])


def _stft_mag(x: np.ndarray, n_fft: int, hop: int) -> np.ndarray:
    if x.shape[0] < n_fft:
        x = np.pad(x, (0, n_fft - x.shape[0]))
    frames = 1 + (x.shape[0] - n_fft) // hop
    idx = np.arange(n_fft)[None] + hop * np.arange(frames)[:, None]
    return np.abs(np.fft.rfft(x[idx] * np.hanning(n_fft), axis=1))


def _harmonic_salience(mag: np.ndarray, freqs: np.ndarray, midis: np.ndarray, harmonics: int) -> np.ndarray:
    """Per frame and candidate note: summed magnitude at the note's first ``harmonics`` harmonics."""
    bin_hz = freqs[1]
    out = np.zeros((mag.shape[0], midis.shape[0]))
    for j, midi in enumerate(midis):
        f0 = 440.0 * 2 ** ((midi - 69) / 12)
        for h in range(1, harmonics + 1):
            b = int(round(h * f0 / bin_hz))
            if b + 1 < mag.shape[1]:
                out[:, j] += mag[:, b - 1 : b + 2].max(1) / h**0.5
    return out


def key_of(x: np.ndarray, sample_rate: int) -> tuple[int, str]:
    """Tonic and mode: the melody's pitch-class histogram against the 24 scales, the bass roots for the tonic."""
    mag = _stft_mag(x, 4096, 1024)
    freqs = np.fft.rfftfreq(4096, 1 / sample_rate)
    energy = mag.sum(1)
    voiced = energy > 0.1 * energy.max()
    melody_notes = np.arange(48, 84)
    sal = _harmonic_salience(mag[voiced], freqs, melody_notes, 4)
    melody_hist = np.zeros(12)
    np.add.at(melody_hist, melody_notes[sal.argmax(1)] % 12, 1.0)
    bass_band = mag[:, (freqs > 60) & (freqs < 127)]
    bass_freqs = freqs[(freqs > 60) & (freqs < 127)]
    bass_pcs = (np.round(12 * np.log2(bass_freqs[bass_band.argmax(1)] / 440.0) + 69).astype(int)) % 12
    bass_hist = np.bincount(bass_pcs, minlength=12).astype(float)
    melody_hist /= melody_hist.sum() + 1e-9
    bass_hist /= bass_hist.sum() + 1e-9
    best, best_score = (0, "major"), -np.inf
    for tonic in range(12):
        for mode, steps in (("major", (0, 2, 4, 5, 7, 9, 11)), ("minor", (0, 2, 3, 5, 7, 8, 10))):
            in_scale = melody_hist[[(tonic + s) % 12 for s in steps]].sum()
            score = in_scale + 2.0 * bass_hist[tonic] + 0.2 * melody_hist[tonic]
            if score > best_score:
                best, best_score = (tonic, mode), score
    return best


def onset_envelope(x: np.ndarray, sample_rate: int, hop_s: float = 0.01) -> np.ndarray:
    hop = int(sample_rate * hop_s)
    mag = _stft_mag(x, 1024, hop)
    logmag = np.log1p(100 * mag)
    flux = np.maximum(np.diff(logmag, axis=0), 0).sum(1)
    return flux - flux.mean()


def tempo_of(x: np.ndarray, sample_rate: int) -> int:
    """The candidate tempo whose beat comb (best phase) lands on the onsets; the fastest near-best one wins, so
    half tempo (which also lands on onsets) is not mistaken for the tempo."""
    env = np.maximum(onset_envelope(x, sample_rate), 0)
    env = np.max(np.stack([np.roll(env, s) for s in range(-3, 4)]), axis=0)
    base = env.mean() + 1e-9
    scores = {}
    for bpm in TEMPI:
        period = 6000.0 / bpm
        best = 0.0
        for phase in range(int(period)):
            idx = np.round(phase + period * np.arange(int((env.shape[0] - phase) / period))).astype(int)
            idx = idx[idx < env.shape[0]]
            if idx.size >= 2:
                best = max(best, float(env[idx].mean()) / base)
        scores[bpm] = best
    top = max(scores.values())
    return max(bpm for bpm, score in scores.items() if score >= 0.75 * top)


def _timbre_features(x: np.ndarray, sample_rate: int) -> np.ndarray:
    mag = _stft_mag(x, 2048, 512)
    freqs = np.fft.rfftfreq(2048, 1 / sample_rate)
    energy = mag.sum(1)
    loud = energy > 0.2 * energy.max()
    m = mag[loud]
    centroid = (m * freqs).sum(1) / (m.sum(1) + 1e-9)
    low = (m[:, (freqs > 200) & (freqs < 1000)] ** 2).sum(1)
    high = (m[:, freqs >= 1500] ** 2).sum(1)
    flatness = np.exp(np.log(m + 1e-6).mean(1)) / (m.mean(1) + 1e-9)
    env = onset_envelope(x, sample_rate) + 1e-9
    rms = np.sqrt(np.convolve(x**2, np.ones(160) / 160, mode="valid")[::160])
    decay = np.mean(np.abs(np.diff(np.log(rms + 1e-4))))
    return np.array(
        [
            np.log(np.median(centroid) + 1),
            np.log(np.median(high / (low + 1e-9)) + 1e-6),
            np.log(np.median(flatness) + 1e-6),
            decay * 10,
            np.std(env) / (np.mean(np.abs(env))),
        ]
    )


def _level(x: np.ndarray) -> float:
    """The 90th percentile of 20 ms RMS: the playing level, little affected by rests and decays."""
    rms = np.sqrt(np.convolve(x**2, np.ones(320) / 320, mode="valid")[::320])
    return float(np.percentile(rms, 90))


@dataclass
class MusicScorer:
    sample_rate: int
    frame_rate: int
    timbre_centroids: np.ndarray
    timbre_scale: np.ndarray
    loudness_thresholds: np.ndarray  # per timbre

    @classmethod
    def calibrated(
        cls, sample_rate: int = 16000, frame_rate: int = 16, per_class: int = 6, seed: int = 1234
    ) -> MusicScorer:
        rng = random.Random(seed)
        feats: dict[str, list[np.ndarray]] = {t: [] for t in TIMBRES}
        rms: dict[tuple[str, str], list[float]] = {(t, v): [] for t in TIMBRES for v in LOUDNESS}
        for timbre in TIMBRES:
            for i in range(per_class):
                spec = SongSpec(
                    rng.randrange(12),
                    rng.choice(("major", "minor")),
                    rng.choice(TEMPI),
                    timbre,
                    LOUDNESS[i % 2],
                    ("verse", "chorus"),
                )
                _, latents = compose(spec, rng)
                audio = decode(latents, sample_rate=sample_rate, frame_rate=frame_rate)
                feats[timbre].append(_timbre_features(audio, sample_rate))
                rms[timbre, spec.loudness].append(_level(audio))
        all_feats = np.stack([f for fs in feats.values() for f in fs])
        scale = all_feats.std(0) + 1e-6
        centroids = np.stack([np.mean(feats[t], axis=0) for t in TIMBRES])
        thresholds = np.array([np.sqrt(max(rms[t, "soft"]) * min(rms[t, "loud"])) for t in TIMBRES])
        return cls(sample_rate, frame_rate, centroids, scale, thresholds)

    def read(self, x: np.ndarray) -> dict[str, object]:
        tonic, mode = key_of(x, self.sample_rate)
        f = _timbre_features(x, self.sample_rate)
        t = int(np.argmin((((self.timbre_centroids - f) / self.timbre_scale) ** 2).sum(1)))
        loudness = "loud" if _level(x) > self.loudness_thresholds[t] else "soft"
        timbre = TIMBRES[t]
        return {
            "tonic": tonic,
            "mode": mode,
            "bpm": tempo_of(x, self.sample_rate),
            "timbre": timbre,
            "loudness": loudness,
        }


def adherence(read: dict[str, object], wanted: dict[str, object]) -> tuple[int, int]:
    """(attributes read as asked, attributes asked)."""
    return sum(read[k] == v for k, v in wanted.items()), len(wanted)
