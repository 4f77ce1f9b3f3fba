"""Train omni-tones-tiny (AR backbone + depth decoder, and the acoustic flow-matching transformer) on the
procedural music world, then measure caption adherence on held-out captions at two guidance scales.

    python -m omni_models.training.train_music --out OUTDIR --ar-seconds 200 --acoustic-seconds 80

Plain torch only (no vLLM): the backbone's weights use Hugging Face Qwen3 names and load unchanged into the
vLLM-registered model. Writes OUTDIR/{config.json, ar.safetensors, acoustic.safetensors, train_log.json,
adherence.json}; weights in bf16.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from omni_models.config import DiTConfig
from omni_models.flow import noisy_sample, sample_training_times
from omni_models.model import CausalPrefixDiT
from omni_models.music.acoustic import acoustic_config, acoustic_prefix_ids, generate_latents
from omni_models.music.backbone import MusicBackbone
from omni_models.music.config import AUDIO_END, NUM_CODEBOOKS, MusicConfig
from omni_models.music.decoder import decode
from omni_models.music.guidance import sample_frames
from omni_models.music.prompt import MusicTokenizer, build_cfg_null_token_ids
from omni_models.training.music_data import VOCABULARY, caption_for, compose, is_held_out, lyrics_for, random_spec
from omni_models.training.music_scorer import MusicScorer, adherence


def tiny_music_config() -> MusicConfig:
    return MusicConfig(
        name="omni-tones-tiny",
        words=VOCABULARY,
        hidden_size=256,
        num_layers=6,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=768,
    )


def make_dataset(config: MusicConfig, count: int, seed: int, held_out: bool) -> list[dict]:
    rng = random.Random(seed)
    tok = MusicTokenizer(config)
    out = []
    while len(out) < count:
        spec = random_spec(rng)
        if is_held_out(spec) != held_out:
            continue
        caption, lyrics = caption_for(spec, rng), lyrics_for(spec, rng)
        codes, latents = compose(spec, rng)
        out.append(
            {
                "spec": spec,
                "caption": caption,
                "lyrics": lyrics,
                "ids": tok.encode(caption, lyrics),
                "codes": codes,
                "latents": latents,
            }
        )
    return out


def ar_batch(config: MusicConfig, items: list[dict], drop: float, rng: random.Random, device: str):
    """Left-padded prompts + audio frames; returns tensors for the AR loss."""
    off = config.audio_code_offset
    prompts = [build_cfg_null_token_ids(it["ids"]) if rng.random() < drop else it["ids"] for it in items]
    P = max(len(p) for p in prompts)
    T = max(it["codes"].shape[0] for it in items)
    B, S = len(items), P + T
    ids = torch.zeros(B, S, dtype=torch.long)
    frame_codes = torch.full((B, S, NUM_CODEBOOKS - 1), -1, dtype=torch.long)
    pad = torch.zeros(B, S, dtype=torch.bool)
    target = torch.full((B, S), -100, dtype=torch.long)
    depth_pos = torch.zeros(B, T, dtype=torch.long)
    depth_codes = torch.zeros(B, T, NUM_CODEBOOKS, dtype=torch.long)
    depth_valid = torch.zeros(B, T, dtype=torch.bool)
    for b, (p, it) in enumerate(zip(prompts, items, strict=True)):
        codes = torch.from_numpy(it["codes"])
        t = codes.shape[0]
        start = P - len(p)
        ids[b, start:P] = torch.tensor(p)
        pad[b, start : P + t] = True
        ids[b, P : P + t] = codes[:, 0] + off
        frame_codes[b, P : P + t] = codes[:, 1:]
        target[b, P - 1 : P - 1 + t] = codes[:, 0] + off
        target[b, P - 1 + t] = AUDIO_END
        depth_pos[b, :t] = torch.arange(P - 1, P - 1 + t)
        depth_codes[b, :t] = codes
        depth_valid[b, :t] = True
    pad[:, P:] |= ~pad[:, P:]  # positions after a short song are causal tail: harmless, excluded from the loss
    return [x.to(device) for x in (ids, frame_codes, pad, target, depth_pos, depth_codes, depth_valid)]


def ar_loss(model: MusicBackbone, batch) -> tuple[torch.Tensor, torch.Tensor]:
    ids, frame_codes, pad, target, depth_pos, depth_codes, depth_valid = batch
    hidden = model.hidden(model.embed(ids, frame_codes), pad)
    logits = model.lm_head(hidden)
    c0_loss = F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), ignore_index=-100)
    h = torch.gather(hidden, 1, depth_pos[..., None].expand(-1, -1, hidden.shape[-1]))[depth_valid]
    codes = depth_codes[depth_valid]
    dlogits = model.depth.logits(h, codes[:, 0], codes[:, 1 : NUM_CODEBOOKS - 1])
    depth_loss = F.cross_entropy(dlogits.flatten(0, 1).float(), codes[:, 1:].flatten())
    return c0_loss, depth_loss


def acoustic_batch(config: MusicConfig, dit: DiTConfig, items: list[dict], rng: random.Random, device: str):
    ids, lat = [], []
    w = config.window_frames
    for it in items:
        t = it["codes"].shape[0]
        start = rng.randrange(0, max(1, t - w + 1))
        start -= start % config.hop_frames if rng.random() < 0.5 else 0
        codes = it["codes"][start : start + w]
        latents = it["latents"][start : start + w]
        ids.append(acoustic_prefix_ids(torch.from_numpy(codes), config))
        lat.append(torch.from_numpy(latents).T[:, None, :])  # [C, 1, W]
    return torch.stack(ids).to(device), torch.stack(lat).to(device)


@torch.no_grad()
def generate_codes(
    model: MusicBackbone,
    config: MusicConfig,
    prompts: list[list[int]],
    seeds: list[int],
    frames: int,
    scale: float,
    device: str,
) -> list[np.ndarray]:
    """Guided AR generation in plain torch (recomputes the sequence each frame; fine for evaluation)."""
    n = len(prompts)
    rows = prompts + [build_cfg_null_token_ids(p) for p in prompts]
    P = max(len(p) for p in rows)
    ids = torch.zeros(2 * n, P, dtype=torch.long)
    pad = torch.zeros(2 * n, P, dtype=torch.bool)
    for r, p in enumerate(rows):
        ids[r, P - len(p) :] = torch.tensor(p)
        pad[r, P - len(p) :] = True
    ids, pad = ids.to(device), pad.to(device)
    fcodes = torch.full((2 * n, P, NUM_CODEBOOKS - 1), -1, dtype=torch.long, device=device)
    songs: list[list[list[int]]] = [[] for _ in range(n)]
    alive = [True] * n
    for f in range(frames):
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
            hidden = model.hidden(model.embed(ids, fcodes), pad)[:, -1].float()
            logits = model.lm_head(hidden.to(model.lm_head.weight.dtype)).float()
        results = sample_frames(
            config,
            model.depth,
            logits[:n],
            logits[n:],
            hidden[:n],
            hidden[n:],
            seeds,
            [f * NUM_CODEBOOKS] * n,
            scale,
            config.ar_top_k,
        )
        nxt = torch.zeros(2 * n, dtype=torch.long)
        nc = torch.full((2 * n, NUM_CODEBOOKS - 1), -1, dtype=torch.long)
        for i, (token, codes) in enumerate(results):
            if codes is None or not alive[i]:
                alive[i] = False
                nxt[i] = nxt[n + i] = AUDIO_END
                continue
            songs[i].append(codes)
            nxt[i] = nxt[n + i] = token
            nc[i] = nc[n + i] = torch.tensor(codes[1:])
        if not any(alive):
            break
        ids = torch.cat([ids, nxt[:, None].to(device)], 1)
        pad = torch.cat([pad, torch.ones(2 * n, 1, dtype=torch.bool, device=device)], 1)
        fcodes = torch.cat([fcodes, nc[:, None].to(device)], 1)
    return [np.array(s, dtype=np.int64).reshape(-1, NUM_CODEBOOKS) for s in songs]


def held_out_adherence(
    model: MusicBackbone,
    dit: CausalPrefixDiT,
    config: MusicConfig,
    held: list[dict],
    scale: float,
    scorer: MusicScorer,
    device: str,
) -> dict:
    """Generate every held-out song at AR guidance ``scale`` (seed i for song i, acoustic seed 0) and score it.

    Returns ``{"adherence", "per_attribute": {name: [right, asked]}, "mean_frames"}``; a song that ends before its
    first frame counts every wanted attribute as missed.
    """
    codes = generate_codes(
        model, config, [h["ids"] for h in held], list(range(len(held))), config.max_frames, scale, device
    )
    got = total = 0
    per: dict[str, list[int]] = {}
    for h, c in zip(held, codes, strict=True):
        wanted = h["spec"].attributes()
        if c.shape[0] == 0:
            total += len(wanted)
            continue
        latents = generate_latents(dit, config, torch.from_numpy(c), seed=0, device=device)
        read = scorer.read(decode(latents.numpy(), sample_rate=config.sample_rate, frame_rate=config.frame_rate))
        g, n = adherence(read, wanted)
        got, total = got + g, total + n
        for k in wanted:
            per.setdefault(k, [0, 0])
            per[k][0] += read[k] == wanted[k]
            per[k][1] += 1
    return {"adherence": got / total, "per_attribute": per, "mean_frames": float(np.mean([c.shape[0] for c in codes]))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ar-seconds", type=float, default=200)
    parser.add_argument("--acoustic-seconds", type=float, default=80)
    parser.add_argument("--train-songs", type=int, default=12000)
    parser.add_argument("--eval-songs", type=int, default=40)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--eval-scales", default="", help="comma-separated AR guidance scales (default: the config's, then 1.0)"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny sizes for a CPU check")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(args.seed)
    config = tiny_music_config()
    if args.smoke:
        config = MusicConfig(
            name="omni-tones-smoke",
            words=VOCABULARY,
            hidden_size=64,
            num_layers=2,
            num_heads=2,
            num_kv_heads=1,
            head_dim=32,
            intermediate_size=128,
            depth_hidden_size=32,
            acoustic_width=32,
            acoustic_depth=1,
            acoustic_heads=2,
            acoustic_steps=2,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    log: dict = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "config": config.to_dict(),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    t0 = time.time()
    train = make_dataset(config, args.train_songs, args.seed, held_out=False)
    held = make_dataset(config, args.eval_songs, args.seed + 1, held_out=True)
    log["data_seconds"] = time.time() - t0
    rng = random.Random(args.seed)

    # --- AR backbone + depth decoder
    model = MusicBackbone(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.98), weight_decay=0.01)
    step, t0, ar_log = 0, time.time(), []
    while time.time() - t0 < args.ar_seconds:
        frac = (time.time() - t0) / args.ar_seconds
        for g in opt.param_groups:
            g["lr"] = 1e-3 * min(1.0, step / 200) * (0.5 * (1 + np.cos(np.pi * min(frac, 1.0))) * 0.95 + 0.05)
        batch = ar_batch(config, rng.sample(train, args.batch), 0.15, rng, device)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
            c0_loss, depth_loss = ar_loss(model, batch)
        loss = c0_loss + depth_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0:
            ar_log.append(
                {
                    "step": step,
                    "s": round(time.time() - t0, 1),
                    "c0": round(c0_loss.item(), 4),
                    "depth": round(depth_loss.item(), 4),
                }
            )
            print("ar", ar_log[-1], flush=True)
        step += 1
    log["ar"] = {"steps": step, "seconds": time.time() - t0, "curve": ar_log}

    # --- acoustic flow-matching transformer
    dit_config = acoustic_config(config)
    dit = CausalPrefixDiT(dit_config).to(device)
    dit.set_fused_ops(False)  # plain torch ops for autograd
    opt = torch.optim.AdamW(dit.parameters(), lr=5e-4, weight_decay=0.01)
    step, t0, ac_log = 0, time.time(), []
    gen = torch.Generator(device=device).manual_seed(args.seed)
    while time.time() - t0 < args.acoustic_seconds:
        ids, x0 = acoustic_batch(config, dit_config, rng.sample(train, args.batch), rng, device)
        t = sample_training_times(x0.shape[0], gen, device)
        noise = torch.randn(x0.shape, generator=gen, device=device)
        xt, v = noisy_sample(x0, noise, t)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
            pred = dit(ids, xt, t)
        loss = F.mse_loss(pred.float(), v)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(dit.parameters(), 1.0)
        opt.step()
        if step % 100 == 0:
            ac_log.append({"step": step, "s": round(time.time() - t0, 1), "loss": round(loss.item(), 4)})
            print("acoustic", ac_log[-1], flush=True)
        step += 1
    log["acoustic"] = {"steps": step, "seconds": time.time() - t0, "curve": ac_log}

    # --- save
    model.eval(), dit.eval()
    save_file(
        {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in model.state_dict().items()},
        str(args.out / "ar.safetensors"),
    )
    save_file(
        {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in dit.state_dict().items()},
        str(args.out / "acoustic.safetensors"),
    )
    (args.out / "config.json").write_text(json.dumps(config.to_dict(), indent=1))

    # --- held-out adherence (plain torch; bf16 weights as shipped)
    for module in (model, dit):
        module.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in module.state_dict().items()})
    scorer = MusicScorer.calibrated(config.sample_rate, config.frame_rate)
    results = {}
    t0 = time.time()
    scales = [float(x) for x in args.eval_scales.split(",")] if args.eval_scales else [config.ar_guidance, 1.0]
    for scale in scales:
        results[str(scale)] = held_out_adherence(model, dit, config, held, scale, scorer, device)
        print("guidance", scale, results[str(scale)], flush=True)
    # ground truth through the same scorer: the ceiling
    got = total = 0
    for h in held:
        audio = decode(h["latents"], sample_rate=config.sample_rate, frame_rate=config.frame_rate)
        g, n = adherence(scorer.read(audio), h["spec"].attributes())
        got, total = got + g, total + n
    results["ground_truth"] = {"adherence": got / total}
    log["eval_seconds"] = time.time() - t0
    (args.out / "adherence.json").write_text(json.dumps(results, indent=1))
    (args.out / "train_log.json").write_text(json.dumps(log, indent=1))
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
