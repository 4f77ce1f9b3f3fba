"""Train omni-shapes-tiny on procedurally drawn batches, then measure prompt adherence on held-out scenes.

    python -m omni_models.training.train --config tiny --out OUTDIR --time-budget-s 360

Writes to OUTDIR: model.safetensors (EMA weights, bf16; sharded under 16 MiB per file if ever larger),
config.json, vocab.json, train_log.json and samples/*.png. Seeded: the initial weights, the data stream and the
evaluation noise follow ``--seed``. Training stops at ``--max-steps`` or when ``--time-budget-s`` of training
time is spent, whichever comes first; the step count reached is logged, and rerunning with ``--max-steps`` set
to it repeats the run (up to GPU kernel nondeterminism).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import Image

from omni_models.checkpoint import save_config, save_weights
from omni_models.config import DiTConfig, tiny_config
from omni_models.flow import noisy_sample, sample_training_times
from omni_models.images import to_uint8_images
from omni_models.model import CausalPrefixDiT
from omni_models.sampling import generate_dense
from omni_models.tokenizer import BOS_ID, PAD_ID, Tokenizer
from omni_models.training.captions import VOCABULARY, SceneSpec
from omni_models.training.scorer import adherence, read_scenes
from omni_models.training.shapes import IMAGE_SIZE, MAX_JITTER, render, scenes_to_tensor, split_scenes

CONFIGS = {"tiny": tiny_config}
# Caption forms shown in training: full, without position, without background, shape and colour only.
CAPTION_FORMS: tuple[tuple[bool, bool], ...] = ((True, True), (False, True), (True, False), (False, False))
CAPTION_FORM_WEIGHTS = (0.7, 0.1, 0.1, 0.1)


class SceneStream:
    """Draws training batches on the device: scenes from the training split, rendered and captioned on the fly."""

    def __init__(
        self, scenes: list[SceneSpec], tokenizer: Tokenizer, device: torch.device, seed: int, null_prompt_rate: float
    ) -> None:
        self.scenes = scenes_to_tensor(scenes, device)
        tokens = torch.full((len(scenes), len(CAPTION_FORMS), tokenizer.max_tokens), PAD_ID, dtype=torch.long)
        for i, scene in enumerate(scenes):
            for form, (with_position, with_background) in enumerate(CAPTION_FORMS):
                ids = tokenizer.encode(scene.caption(with_position=with_position, with_background=with_background))
                tokens[i, form, : len(ids)] = torch.tensor(ids)
        self.tokens = tokens.to(device)
        self.form_weights = torch.tensor(CAPTION_FORM_WEIGHTS, device=device)
        self.null_prompt_rate = null_prompt_rate
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.device = device

    def batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(token_ids [B, L], images [B, 3, 32, 32], noise like images, t [B])."""
        g, device = self.generator, self.device
        index = torch.randint(len(self.scenes), (size,), generator=g, device=device)
        scene = self.scenes[index]
        jitter = torch.randint(-MAX_JITTER, MAX_JITTER + 1, (size, 2), generator=g, device=device)
        images = render(scene[:, 0], scene[:, 1], scene[:, 2], scene[:, 3], jitter)
        form = torch.multinomial(self.form_weights, size, replacement=True, generator=g)
        token_ids = self.tokens[index, form]
        drop = torch.rand(size, generator=g, device=device) < self.null_prompt_rate
        null = torch.full_like(token_ids, PAD_ID)
        null[:, 0] = BOS_ID
        token_ids = torch.where(drop.unsqueeze(1), null, token_ids)
        noise = torch.randn(images.shape, generator=g, device=device)
        t = sample_training_times(size, g, device)
        return token_ids, images, noise, t


def evaluate(
    model: CausalPrefixDiT,
    scenes: list[SceneSpec],
    tokenizer: Tokenizer,
    *,
    guidance_scale: float,
    num_steps: int,
    seed: int,
    batch_size: int,
    autocast_dtype: torch.dtype | None,
) -> tuple[dict, torch.Tensor]:
    """Adherence of full-caption generations for ``scenes`` (image i uses noise seed ``seed + i``)."""
    images = []
    for start in range(0, len(scenes), batch_size):
        chunk = scenes[start : start + batch_size]
        cond = [tokenizer.encode(scene.caption()) for scene in chunk]
        images.append(
            generate_dense(
                model,
                cond,
                [tokenizer.null_ids] * len(chunk),
                [seed + start + i for i in range(len(chunk))],
                num_steps=num_steps,
                guidance_scale=guidance_scale,
                height=IMAGE_SIZE,
                width=IMAGE_SIZE,
                autocast_dtype=autocast_dtype,
            )
        )
    images = torch.cat(images)
    return adherence(read_scenes(to_uint8_images(images)), scenes), images


def save_samples(images: torch.Tensor, directory: Path, tag: str, upscale: int = 4) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    names = []
    for i, pixels in enumerate(to_uint8_images(images)):
        name = f"{tag}_{i:02d}.png"
        image = Image.fromarray(pixels)
        image.resize((image.width * upscale, image.height * upscale), Image.NEAREST).save(directory / name)
        names.append(name)
    return names


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--time-budget-s", type=float, default=360.0, help="stop training after this many seconds")
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=4e-4)
    parser.add_argument("--warmup-steps", type=int, default=300)
    parser.add_argument("--ema-decay", type=float, default=0.999)
    parser.add_argument("--null-prompt-rate", type=float, default=0.1)
    parser.add_argument("--eval-prompts", type=int, default=200)
    parser.add_argument("--eval-steps", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smoke", action="store_true", help="CPU check: batch 4, 4 eval prompts, 2 eval steps")
    args = parser.parse_args(argv)
    if args.smoke:
        args.batch_size, args.eval_prompts, args.eval_steps, args.warmup_steps = 4, 4, 2, 10

    wall_start = time.perf_counter()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    autocast_dtype = torch.bfloat16 if device.type == "cuda" else None
    tokenizer = Tokenizer(VOCABULARY)
    config: DiTConfig = CONFIGS[args.config](len(VOCABULARY), tokenizer.max_tokens)
    train_scenes, held_out = split_scenes()
    held_out = held_out[: args.eval_prompts]

    torch.manual_seed(args.seed)
    model = CausalPrefixDiT(config).to(device)
    parameters = [p for p in model.parameters()]
    ema = [p.detach().clone().float() for p in parameters]
    optimizer = torch.optim.AdamW(
        parameters, lr=args.lr, betas=(0.9, 0.999), weight_decay=0.0, fused=device.type == "cuda"
    )
    stream = SceneStream(train_scenes, tokenizer, device, args.seed + 1, args.null_prompt_rate)

    losses: list[tuple[int, float]] = []
    running = torch.zeros((), device=device)
    running_count = 0
    step = 0
    train_start = time.perf_counter()
    model.train()
    while (args.max_steps is None or step < args.max_steps) and time.perf_counter() - train_start < args.time_budget_s:
        for group in optimizer.param_groups:
            group["lr"] = args.lr * min(1.0, (step + 1) / args.warmup_steps)
        token_ids, images, noise, t = stream.batch(args.batch_size)
        x_t, target = noisy_sample(images, noise, t)
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            prediction = model(token_ids, x_t, t)
        loss = F.mse_loss(prediction.float(), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        decay = min(args.ema_decay, (1 + step) / (10 + step))
        with torch.no_grad():
            torch._foreach_lerp_(ema, [p.detach() for p in parameters], 1.0 - decay)
        running += loss.detach()
        running_count += 1
        step += 1
        if step % 100 == 0:
            losses.append((step, running.item() / running_count))
            running.zero_()
            running_count = 0
            print(f"step {step:6d}  loss {losses[-1][1]:.4f}  {time.perf_counter() - train_start:6.1f}s", flush=True)
    if running_count:
        losses.append((step, running.item() / running_count))
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_seconds = time.perf_counter() - train_start

    # Ship (and evaluate) exactly what is saved: the EMA weights rounded to bfloat16.
    with torch.no_grad():
        for p, e in zip(parameters, ema, strict=True):
            p.copy_(e.to(torch.bfloat16).float())
    model.eval()
    state = {name: tensor.to(torch.bfloat16) for name, tensor in model.state_dict().items()}
    args.out.mkdir(parents=True, exist_ok=True)
    weight_files = save_weights(state, args.out)
    save_config(config, tokenizer.vocabulary, args.out)

    eval_start = time.perf_counter()
    results = {}
    sample_files = {}
    for guidance in (1.0, 4.0):
        scores, images = evaluate(
            model,
            held_out,
            tokenizer,
            guidance_scale=guidance,
            num_steps=args.eval_steps,
            seed=10_000,
            batch_size=100,
            autocast_dtype=autocast_dtype,
        )
        results[f"guidance_{guidance:g}"] = scores
        sample_files[f"guidance_{guidance:g}"] = save_samples(images[:8], args.out / "samples", f"g{guidance:g}")
        print(f"guidance {guidance:g}: " + "  ".join(f"{k} {v:.3f}" for k, v in scores.items()), flush=True)
    eval_seconds = time.perf_counter() - eval_start

    log = {
        "config": config.to_dict(),
        "parameters": sum(p.numel() for p in parameters),
        "seed": args.seed,
        "steps": step,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "warmup_steps": args.warmup_steps,
        "ema_decay": args.ema_decay,
        "null_prompt_rate": args.null_prompt_rate,
        "time_budget_s": args.time_budget_s,
        "train_seconds": train_seconds,
        "eval_seconds": eval_seconds,
        "wall_seconds": time.perf_counter() - wall_start,
        "losses": losses,
        "eval": {
            "num_prompts": len(held_out),
            "num_steps": args.eval_steps,
            "noise_seed_base": 10_000,
            "split": "held-out scenes (smallest SHA-256 of their names), full captions",
            "accuracy": results,
            "sample_prompts": [scene.caption() for scene in held_out[:8]],
            "sample_files": sample_files,
        },
        "weight_files": [path.name for path in weight_files],
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "command": "python -m omni_models.training.train " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    (args.out / "train_log.json").write_text(json.dumps(log, indent=1))
    print(f"trained {step} steps in {train_seconds:.0f}s; wrote {args.out}", flush=True)
    return log


if __name__ == "__main__":
    main()
