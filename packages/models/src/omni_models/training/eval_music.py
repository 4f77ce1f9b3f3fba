"""Caption adherence of a trained music model on held-out captions, in plain torch (no vLLM).

    python -m omni_models.training.eval_music --model DIR --scales 1.5,1.0 --songs 40 [--out adherence.json]
    python -m omni_models.training.eval_music --model DIR --served --songs 40     (vLLM AR stage, default guidance)

The same held-out songs (seed 1) and scorer as ``train_music``'s own evaluation.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from omni_models.model import CausalPrefixDiT
from omni_models.music.acoustic import acoustic_config
from omni_models.music.backbone import MusicBackbone
from omni_models.music.config import MusicConfig
from omni_models.training.music_scorer import MusicScorer, adherence
from omni_models.training.train_music import held_out_adherence, make_dataset


def evaluate(model_dir: Path, scales: list[float], songs: int, seed: int = 0) -> dict:
    config = MusicConfig.from_dict(json.loads((model_dir / "config.json").read_text()))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = MusicBackbone(config)
    model.load_state_dict({k: v.float() for k, v in load_file(str(model_dir / "ar.safetensors")).items()})
    dit = CausalPrefixDiT(acoustic_config(config))
    dit.load_state_dict({k: v.float() for k, v in load_file(str(model_dir / "acoustic.safetensors")).items()})
    model, dit = model.to(device).eval(), dit.to(device).eval()
    held = make_dataset(config, songs, seed + 1, held_out=True)
    scorer = MusicScorer.calibrated(config.sample_rate, config.frame_rate)
    results = {}
    for scale in scales:
        results[str(scale)] = held_out_adherence(model, dit, config, held, scale, scorer, device)
        print(scale, results[str(scale)], flush=True)
    return results


def evaluate_served(model_dir: Path, songs: int, seed: int = 0) -> dict:
    """Adherence of the served path (vLLM AR stage at the model's default guidance, paged acoustic stage)."""
    from omni_models.music import MusicRequest, load_music

    pipeline = load_music(str(model_dir))
    config = pipeline.config
    held = make_dataset(config, songs, seed + 1, held_out=True)
    generated = pipeline.generate([MusicRequest(h["lyrics"], h["caption"], seed=i) for i, h in enumerate(held)])
    scorer = MusicScorer.calibrated(config.sample_rate, config.frame_rate)
    got = total = 0
    per: dict[str, list[int]] = {}
    for h, song in zip(held, generated, strict=True):
        wanted = h["spec"].attributes()
        total += len(wanted)
        if song.samples.shape[0] == 0:
            continue
        read = scorer.read(song.samples)
        got += adherence(read, wanted)[0]
        for k in wanted:
            per.setdefault(k, [0, 0])
            per[k][0] += read[k] == wanted[k]
            per[k][1] += 1
    result = {
        "guidance": config.ar_guidance,
        "adherence": got / total,
        "per_attribute": per,
        "mean_frames": float(np.mean([s.codes.shape[0] for s in generated])),
    }
    print("served", result, flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--scales", default="1.5,1.0")
    parser.add_argument("--songs", type=int, default=40)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--served", action="store_true", help="evaluate the served path (vLLM AR stage) instead")
    args = parser.parse_args()
    if args.served:
        results = {"served": evaluate_served(args.model, args.songs)}
    else:
        results = evaluate(args.model, [float(s) for s in args.scales.split(",")], args.songs)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
