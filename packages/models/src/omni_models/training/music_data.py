"""The procedural music world of omni-tones-tiny: captions, structure-tagged lyrics, and the songs they describe
as frame codes (8 codebooks) and oscillator latents.

Attributes of a caption: tonic (12 pitch classes), mode (major/minor), tempo (60/90/120/150 BPM), timbre (piano,
organ, flute, strings) and loudness (soft/loud). Lyrics carry the structure: each ``[section]`` tag is 2 s of
music (32 frames at 16 frames/s), so a song is 2-5 sections long.

Frame codes: c0 melody note (0 rest, 1..36 = MIDI 48..83); c1 onset; c2 chord root pitch class; c3 chord
quality; c4 timbre; c5 dynamics; c6 section; c7 beat in bar.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

TONIC_NAMES = ("c", "c sharp", "d", "e flat", "e", "f", "f sharp", "g", "a flat", "a", "b flat", "b")
MODES = ("major", "minor")
TEMPI = (60, 90, 120, 150)
TIMBRES = ("piano", "organ", "flute", "strings")
LOUDNESS = ("soft", "loud")
MOOD_WORDS = {"soft": ("calm", "gentle", "soft", "quiet"), "loud": ("energetic", "loud", "powerful", "bold")}
SECTIONS = ("intro", "verse", "chorus", "bridge", "outro")
LYRIC_WORDS = (
    "la",
    "na",
    "oh",
    "love",
    "night",
    "light",
    "sky",
    "home",
    "road",
    "heart",
    "rain",
    "sun",
    "fire",
    "dream",
    "we",
    "run",
    "fly",
    "shine",
    "stay",
    "go",
    "hold",
    "on",
    "the",
    "my",
    "your",
    "in",
    "to",
)
FILLER = (
    "a",
    "an",
    "melody",
    "piece",
    "tune",
    "song",
    "at",
    "bpm",
    "with",
    "tempo",
    "key",
    "of",
    "and",
    "played",
    "on",
    "in",
    "sharp",
    "flat",
)
FRAMES_PER_SECTION = 32
FRAME_RATE = 16

VOCABULARY: tuple[str, ...] = tuple(
    dict.fromkeys(
        [
            *(w for name in TONIC_NAMES for w in name.split()),
            *MODES,
            *(str(t) for t in TEMPI),
            *TIMBRES,
            *(w for words in MOOD_WORDS.values() for w in words),
            *FILLER,
            *LYRIC_WORDS,
            "[start]",
            *(f"[{s}]" for s in SECTIONS),
        ]
    )
)

MAJOR = (0, 2, 4, 5, 7, 9, 11)
MINOR = (0, 2, 3, 5, 7, 8, 10)
# Chord progressions in scale degrees (0-based), one chord per 2 beats from the section's start.
PROGRESSIONS = {
    "intro": (0, 4),
    "verse": (0, 3, 0, 4),
    "chorus": (0, 3, 4, 0),
    "bridge": (0, 5, 4, 0),
    "outro": (0, 4, 0),
}
TIMBRE_LATENTS = {  # roll-off, odd emphasis, vibrato, breath
    "piano": (0.45, 0.0, 0.0, 0.0),
    "organ": (0.05, 0.8, 0.0, 0.0),
    "flute": (1.0, 0.0, 0.5, 0.8),
    "strings": (0.25, 0.0, 1.0, 0.0),
}


@dataclass(frozen=True)
class SongSpec:
    tonic: int
    mode: str
    bpm: int
    timbre: str
    loudness: str
    sections: tuple[str, ...]

    def attributes(self) -> dict[str, object]:
        return {
            "tonic": self.tonic,
            "mode": self.mode,
            "bpm": self.bpm,
            "timbre": self.timbre,
            "loudness": self.loudness,
        }


def caption_for(spec: SongSpec, rng: random.Random) -> str:
    mood = rng.choice(MOOD_WORDS[spec.loudness])
    key = f"{TONIC_NAMES[spec.tonic]} {spec.mode}"
    forms = (
        f"a {mood} {spec.timbre} melody at {spec.bpm} bpm in {key}",
        f"{mood} {spec.timbre} piece in {key} at {spec.bpm} bpm",
        f"a {spec.bpm} bpm {spec.timbre} tune in the key of {key}, {mood}",
        f"{key} {mood} song played on {spec.timbre} with tempo {spec.bpm} bpm",
    )
    return rng.choice(forms)


def lyrics_for(spec: SongSpec, rng: random.Random) -> str:
    lines = []
    for section in spec.sections:
        lines.append(f"[{section.capitalize()}]")
        lines.append(" ".join(rng.choice(LYRIC_WORDS) for _ in range(rng.randint(3, 6))))
    return "\n".join(lines)


def random_spec(rng: random.Random) -> SongSpec:
    body = rng.choice(
        (
            ("verse", "chorus"),
            ("verse", "chorus", "verse"),
            ("verse", "chorus", "bridge"),
            ("chorus", "verse", "chorus"),
        )
    )
    sections = (("intro",) if rng.random() < 0.3 else ()) + body + (("outro",) if rng.random() < 0.3 else ())
    return SongSpec(
        rng.randrange(12), rng.choice(MODES), rng.choice(TEMPI), rng.choice(TIMBRES), rng.choice(LOUDNESS), sections[:5]
    )


def is_held_out(spec: SongSpec) -> bool:
    """Held-out attribute combinations (about 1 in 8), never shown in training."""
    return (
        spec.tonic * 7
        + MODES.index(spec.mode) * 3
        + TEMPI.index(spec.bpm) * 5
        + TIMBRES.index(spec.timbre) * 11
        + LOUDNESS.index(spec.loudness) * 2
    ) % 8 == 0


def compose(spec: SongSpec, rng: random.Random) -> tuple[np.ndarray, np.ndarray]:
    """(codes int64 [T, 8], latents float32 [T, 8]) of a song, ``T = 32 * len(sections)``."""
    frames = FRAMES_PER_SECTION * len(spec.sections)
    scale = MAJOR if spec.mode == "major" else MINOR
    beat_frames = FRAME_RATE * 60.0 / spec.bpm
    base = 60 + spec.tonic if spec.tonic < 6 else 48 + spec.tonic  # melody home note in MIDI 54..65
    codes = np.zeros((frames, 8), dtype=np.int64)
    latents = np.zeros((frames, 8), dtype=np.float32)
    roll, odd, vib, breath = TIMBRE_LATENTS[spec.timbre]
    level = 0.45 if spec.loudness == "soft" else 1.0
    degree = 0
    num_beats = int(np.ceil(frames / beat_frames)) + 1
    onsets = [int(round(b * beat_frames)) for b in range(num_beats)]
    for b in range(num_beats - 1):
        start, end = onsets[b], min(onsets[b + 1], frames)
        if start >= frames:
            break
        section_index = min(start // FRAMES_PER_SECTION, len(spec.sections) - 1)
        section = spec.sections[section_index]
        progression = PROGRESSIONS[section]
        section_first_beat = int(np.ceil(section_index * FRAMES_PER_SECTION / beat_frames - 1e-9))
        chord_degree = progression[((b - section_first_beat) // 2) % len(progression)]
        chord_root = (spec.tonic + scale[chord_degree]) % 12
        third = scale[(chord_degree + 2) % 7] - scale[chord_degree]
        quality = 0 if third % 12 == 4 else 1
        if (b - section_first_beat) % 2 == 0:  # a chord change: a chord tone
            degree = chord_degree + rng.choice((0, 2, 4))
        else:
            degree += rng.choice((-2, -1, -1, 1, 1, 2))
        degree = max(-3, min(9, degree))
        octave, step = divmod(degree, 7)
        midi = base + 12 * octave + scale[step]
        rest = rng.random() < 0.04 and b % 4 != 0
        c0 = 0 if rest else int(np.clip(midi - 47, 1, 36))
        dynamics = (0 if spec.loudness == "soft" else 2) + (1 if section == "chorus" else 0)
        for f in range(start, end):
            age = (f - start) / FRAME_RATE  # seconds since the onset
            codes[f] = (
                c0,
                int(f == start),
                chord_root,
                quality,
                TIMBRES.index(spec.timbre),
                dynamics,
                SECTIONS.index(section),
                b % 4,
            )
            if spec.timbre == "piano":
                env = np.exp(-age * 3.0)
            elif spec.timbre == "flute":
                env = min(1.0, 0.15 + age * 8)
            elif spec.timbre == "strings":
                env = min(1.0, 0.15 + age * 8)
            else:
                env = 1.0
            if f == end - 1 and end - start > 2:
                env *= 0.3  # a short release before the next note keeps onsets audible for sustained timbres
            amp = 0.0 if rest else level * (1.1 if section == "chorus" else 1.0) * env
            bass_midi = 36 + chord_root
            latents[f] = (
                (midi - 66) / 12 if not rest else 0.0,
                amp,
                (bass_midi - 42) / 12,
                level * 0.8 * (0.6 + 0.4 * np.exp(-age * 6.0)),
                roll,
                odd,
                vib,
                breath,
            )
    return codes, latents
