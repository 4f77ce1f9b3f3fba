"""AR stage of the music family on vLLM's engine (CPU): time per guided frame with cfg-pairing's scheduler vs the
same traffic on vLLM's own scheduler, plus the shipped model's real-time factor end to end on CPU.

The GPU machine has no vLLM, so the AR stage is timed here, on CPU. Both sides run the same songs (same
prompts, seeds, frame caps) on the same engine settings; only ``scheduler_cls`` differs. On vLLM's own
scheduler nothing keeps a pair's rows together, so a row whose partner is not at its sampling position emits a
hold token instead of a frame: "frames" counts guided frames actually drawn, and the ratio is time per frame.

Usage:  python benchmarks/music_ar.py --out DIR [--songs 8 --frames 96 --repeats 3]
Smoke:  python benchmarks/music_ar.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path[:] = [p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent]

import omni_models  # noqa: E402
from omni_models import GenerationRequest  # noqa: E402
from omni_models.music import load_music  # noqa: E402
from omni_models.music._vllm import ARStage, SongRequest  # noqa: E402
from omni_models.music.prompt import MusicTokenizer  # noqa: E402

CAPTIONS = (
    "a calm piano melody at 90 bpm in c major",
    "loud organ piece in a minor at 150 bpm",
    "a gentle flute tune at 60 bpm in the key of e flat major",
    "energetic strings song in d minor, 120 bpm",
)
LYRICS = "[verse]\nla la love\n[chorus]\noh oh shine\n[verse]\nrun to the sky"


def run_side(stage: ARStage, songs: list[SongRequest]) -> dict[str, float]:
    runtime = stage.runtime
    drawn_before, lone_before = len(runtime.pair_steps), runtime.lone_rows
    start = time.perf_counter()
    stage.run(songs)
    seconds = time.perf_counter() - start
    frames = len(runtime.pair_steps) - drawn_before
    return {
        "seconds": seconds,
        "frames": frames,
        "lone_row_steps": runtime.lone_rows - lone_before,
        "ms_per_frame": 1000 * seconds / max(frames, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    parser.add_argument("--songs", type=int, default=8)
    parser.add_argument("--frames", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.songs, args.frames, args.repeats = 2, 16, 1
    model_dir = Path(omni_models.__file__).parent / "weights" / "omni-tones-tiny"
    pipeline = load_music(str(model_dir))
    config, tokenizer = pipeline.config, MusicTokenizer(pipeline.config)
    stages = {
        "paired": ARStage(model_dir, config, max_num_seqs=2 * args.songs),
        "unpaired": ARStage(model_dir, config, max_num_seqs=2 * args.songs, paired=False),
    }
    runs: dict[str, list[dict[str, float]]] = {"paired": [], "unpaired": []}
    for side, stage in stages.items():  # warm-up, not recorded
        run_side(
            stage,
            [
                SongRequest(f"warm-{side}-{i}", tokenizer.encode(CAPTIONS[i % 4], LYRICS), i, 8)
                for i in range(args.songs)
            ],
        )
    for repeat in range(args.repeats):
        for side in ("paired", "unpaired") if repeat % 2 == 0 else ("unpaired", "paired"):
            songs = [
                SongRequest(
                    f"{side}-{repeat}-{i}", tokenizer.encode(CAPTIONS[i % len(CAPTIONS)], LYRICS), i, args.frames
                )
                for i in range(args.songs)
            ]
            runs[side].append(run_side(stages[side], songs))
            print(side, runs[side][-1], flush=True)
    ratios = [p["ms_per_frame"] / u["ms_per_frame"] for p, u in zip(runs["paired"], runs["unpaired"], strict=True)]
    ratio = statistics.median(
        p["ms_per_frame"] / u["ms_per_frame"] for p, u in zip(runs["paired"], runs["unpaired"], strict=True)
    )
    # Real-time factor of the whole shipped model on CPU: one song, AR + acoustic + decoder.
    start = time.perf_counter()
    song = pipeline.generate(
        [GenerationRequest(prompt=CAPTIONS[0], lyrics=LYRICS, seed=0, max_new_tokens=args.frames)]
    )[0]
    seconds = time.perf_counter() - start
    result = {
        "runs": runs,
        "paired_over_unpaired_ms_per_frame": ratio,
        "per_run_ratios": ratios,
        "rtf": {"seconds": seconds, "audio_seconds": song.seconds, "rtf": seconds / max(song.seconds, 1e-9)},
        "cpu_threads": int(os.environ.get("OMP_NUM_THREADS", "0") or 0),
    }
    print(
        f"AR ms per guided frame: paired {statistics.median(r['ms_per_frame'] for r in runs['paired']):.2f}, "
        f"unpaired {statistics.median(r['ms_per_frame'] for r in runs['unpaired']):.2f}, ratio {ratio:.3f}"
    )
    print(f"real-time factor on CPU: {result['rtf']['rtf']:.3f} ({seconds:.2f} s for {song.seconds:.2f} s of audio)")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "music_ar.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
