"""Train omni-flux-shapes-tiny (``training.flux_shapes``): the VAE, then the transformer as FLUX.1-dev is made.

    python -m omni_models.training.train_flux --out OUTDIR --time-budget-s 330 --seed 0

Phases, within ``--time-budget-s`` of training time (the evaluations between them are not counted):
1. VAE (at most ``--vae-share`` of the budget, or ``--vae-steps``): reconstruction (MSE + L1, learning rate
   decaying linearly to a tenth) plus a small KL term on random training scenes at 64x64. Every
   ``--vae-check-every`` steps the round trip decode(encode(render)) of 256 training scenes is read by the
   scorer; the phase ends early once every attribute reads back at ``--vae-target`` or better (held-out scenes
   play no part in that decision). Then every training scene at every jitter is encoded once (posterior mode) and
   the VAE's ``shift_factor``/``scaling_factor`` are set to the latents' mean and inverse standard deviation, as
   FLUX's VAE config carries them.
2. Teacher (``--teacher-share`` of the time the VAE left): rectified flow on the normalised latents
   (``x_t = (1 - s) x0 + s eps``, target ``eps - x0``), s drawn logit-normal and then shifted with the scheduler's
   dynamic shift for 64 image tokens (diffusers' ``calculate_shift``), so training sees the sigmas sampling
   visits. The text encoders train with the transformer; ``--prompt-dropout`` of the captions are replaced by the
   empty prompt, so the model is also an unconditional one and classifier-free guidance works. The guidance input
   is held at 1.
3. Guidance distillation (the rest): the text encoders freeze; the student (initialised from the teacher) learns,
   for g drawn uniformly from [1, ``--max-guidance``] and fed as its guidance input, the teacher's CFG velocity
   ``v(empty) + g * (v(caption) - v(empty))`` in one forward. The teacher reads the captions at 16 T5 positions.

Prompt length: both pipelines pad T5 ids to 512 and the pads are most of a 512-token step's work, so each
transformer step pads to ``flux_shapes.SHORT_SEQUENCE_LENGTH`` (16) and ``--batch-size`` samples, except
``--long-share`` of the steps (drawn from a seeded host generator: no device sync), which pad to 512 with a
quarter of the batch: the model learns the images from many cheap samples and reads the pipelines' 512-token
input too. The transformer phases warm up, hold their learning rate and decay it linearly to a tenth over the
last ``--cooldown`` of their time; each keeps an EMA of the weights, and what is saved (fp16,
``FluxPipeline.save_pretrained``) and evaluated is the EMA. A checkpoint is written after the teacher phase and
replaced after distillation (through a directory renamed into place), so a run cut short still leaves a
loadable model. The held-out scenes of ``training.shapes`` never enter training (VAE or transformer, in any
caption form); they are what the evaluations score, through diffusers' own ``FluxPipeline`` loaded from the
written directory at its default 512 T5 positions. Seeded: initial weights, data stream and evaluation noise
follow ``--seed``; the steps reached are logged, so ``--vae-steps/--teacher-steps/--distill-steps`` repeat a run
(up to GPU kernel nondeterminism). OUTDIR gets the pipeline, ``train_log.json`` and ``train_stdout.txt``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.nn.functional as F
from torch import nn

from omni_models.training import flux_shapes as fs
from omni_models.training.captions import SceneSpec
from omni_models.training.scorer import ATTRIBUTES, adherence, read_scenes
from omni_models.training.shapes import MAX_JITTER, scenes_to_tensor, split_scenes

EVAL_SEED = 10_000  # held-out scene i is drawn from noise seed EVAL_SEED + i, as omni-shapes-tiny's evaluation
JITTERS = torch.tensor(
    [(dx, dy) for dy in range(-MAX_JITTER, MAX_JITTER + 1) for dx in range(-MAX_JITTER, MAX_JITTER + 1)]
)


class RunLog:
    """Lines to stdout and to ``train_stdout.txt`` beside the weights (flushed per line: a killed run keeps them)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO = path.open("w")

    def __call__(self, line: str) -> None:
        print(line, flush=True)
        self._file.write(line + "\n")
        self._file.flush()


@dataclass
class Phase:
    """One training phase's budget and record: it runs while ``steps < max_steps`` and within ``seconds``."""

    name: str
    seconds: float
    max_steps: int | None
    steps: int = 0
    elapsed_s: float = 0.0
    losses: list[tuple[int, float]] = field(default_factory=list)
    checks: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    long_steps: int = 0

    def run(
        self,
        step: Callable[[int, float], torch.Tensor],
        log: RunLog,
        every: int,
        done: Callable[[int], bool] | None = None,
    ) -> None:
        """Calls ``step(i, progress)`` (returning the loss; progress in [0, 1): the larger of the time and step
        fractions spent) until the budget is spent or ``done(steps)`` says so (asked after every step); records
        mean losses every ``every`` steps."""
        start = time.perf_counter()
        running, count = None, 0
        while (self.max_steps is None or self.steps < self.max_steps) and time.perf_counter() - start < self.seconds:
            progress = max((time.perf_counter() - start) / self.seconds, self.steps / (self.max_steps or math.inf))
            loss = step(self.steps, progress).detach()
            running = loss if running is None else running + loss
            count += 1
            self.steps += 1
            if self.steps % every == 0:
                self.losses.append((self.steps, running.item() / count))
                running, count = None, 0
                log(
                    f"{self.name} step {self.steps:6d}  loss {self.losses[-1][1]:.5f}  "
                    f"{time.perf_counter() - start:6.1f}s"
                )
            if done is not None and done(self.steps):
                break
        if count:
            self.losses.append((self.steps, running.item() / count))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.elapsed_s = time.perf_counter() - start

    def record(self) -> dict[str, Any]:
        record = {"steps": self.steps, "seconds": round(self.elapsed_s, 2), "losses": self.losses}
        if self.checks:
            record["roundtrip_checks"] = self.checks
        if self.long_steps:
            record["steps_at_512_t5_positions"] = self.long_steps
        return record


class EMA:
    """Exponential moving average of ``parameters`` in fp32 (decay warmed up as ``(1 + n) / (10 + n)``)."""

    def __init__(self, parameters: Sequence[nn.Parameter], decay: float) -> None:
        self.parameters = list(parameters)
        self.shadow = [p.detach().clone().float() for p in self.parameters]
        self.decay = decay

    @torch.no_grad()
    def update(self, step: int) -> None:
        decay = min(self.decay, (1 + step) / (10 + step))
        torch._foreach_lerp_(self.shadow, [p.detach().float() for p in self.parameters], 1.0 - decay)

    @torch.no_grad()
    def copy_to_parameters(self) -> None:
        for p, s in zip(self.parameters, self.shadow, strict=True):
            p.copy_(s)


class CaptionTable:
    """Token ids of every training phrasing of every training scene, as diffusers' ``encode_prompt`` pads them.

    ``clip`` int64 [S, V, 77], ``t5`` int64 [S, V, 16] on the device, V = ``len(flux_shapes.phrasings(scene))``;
    ``weights`` [V] the phrasing shares; ``empty_*`` [1, L]: the empty prompt (dropout and the unconditional
    branch of CFG). ``pad_t5`` lengthens T5 ids to 512 exactly as the tokenizer pads them (checked).
    """

    def __init__(self, scenes: Sequence[SceneSpec], clip: Any, t5: Any, device: torch.device) -> None:
        table = [fs.phrasings(scene) for scene in scenes]
        texts = [text for row in table for text, _ in row]
        variants = len(table[0])
        self.clip = self._ids(clip, texts, fs.CLIP_LENGTH).view(len(scenes), variants, -1).to(device)
        self.t5 = self._ids(t5, texts, fs.SHORT_SEQUENCE_LENGTH).view(len(scenes), variants, -1).to(device)
        self.weights = torch.tensor([w for _, w in table[0]], device=device)
        self.empty_clip = self._ids(clip, [""], fs.CLIP_LENGTH).to(device)
        self.empty_t5 = self._ids(t5, [""], fs.SHORT_SEQUENCE_LENGTH).to(device)
        self.t5_pad_id = t5.pad_token_id
        reference = self._ids(t5, texts[-1:], fs.MAX_SEQUENCE_LENGTH).to(device)
        assert torch.equal(self.pad_t5(self.t5[-1:, -1]), reference), "T5 padding differs from the tokenizer's"

    def pad_t5(self, ids: torch.Tensor, length: int = fs.MAX_SEQUENCE_LENGTH) -> torch.Tensor:
        """T5 ids [B, 16] right-padded with the pad id to [B, length]."""
        return F.pad(ids, (0, length - ids.shape[1]), value=self.t5_pad_id)

    @staticmethod
    def _ids(tokenizer: Any, texts: list[str], length: int) -> torch.Tensor:
        """Unpadded tokenization right-padded with the pad id: what ``padding="max_length"`` gives (checked on
        the first text), several times faster for tens of thousands of captions."""
        rows = tokenizer(texts).input_ids
        if max(map(len, rows)) > length:
            raise ValueError(f"a caption is longer than {length} tokens")
        ids = torch.full((len(rows), length), tokenizer.pad_token_id, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
        reference = tokenizer(
            texts[:1], padding="max_length", max_length=length, truncation=True, return_tensors="pt"
        ).input_ids
        assert torch.equal(ids[:1], reference), "padding differs from the tokenizer's own"
        return ids


def encode_text(
    text_encoder: nn.Module, text_encoder_2: nn.Module, clip_ids: torch.Tensor, t5_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(T5 token embeddings [B, L, D], CLIP pooled [B, D]), exactly the calls FluxPipeline.encode_prompt makes."""
    return text_encoder_2(t5_ids, output_hidden_states=False)[0], text_encoder(clip_ids).pooler_output


class Batches:
    """Seeded training batches on the device: training scenes, jitters, phrasings, noise and shifted sigmas."""

    def __init__(self, scenes: Sequence[SceneSpec], captions: CaptionTable, device: torch.device, seed: int) -> None:
        self.scene_list = list(scenes)
        self.scenes = scenes_to_tensor(scenes, device)
        self.captions = captions
        self.jitters = JITTERS.to(device)
        self.generator = torch.Generator(device).manual_seed(seed)
        self.device = device
        self.mu = fs.dynamic_shift_mu()

    def images(self, size: int) -> torch.Tensor:
        """Renders [B, 3, 64, 64] of random training scenes at random jitters."""
        g = self.generator
        index = torch.randint(len(self.scenes), (size,), generator=g, device=self.device)
        jitter = torch.randint(len(self.jitters), (size,), generator=g, device=self.device)
        return fs.render(self.scenes[index], self.jitters[jitter])

    def flow(self, latents: torch.Tensor, size: int, dropout: float) -> dict[str, torch.Tensor]:
        """A flow-matching batch over a latent table [S, 9, C, H, W]: x_t, target, sigma and caption ids (T5 ids
        at 16 positions; ``CaptionTable.pad_t5`` lengthens them)."""
        g, device = self.generator, self.device
        index = torch.randint(latents.shape[0], (size,), generator=g, device=device)
        jitter = torch.randint(latents.shape[1], (size,), generator=g, device=device)
        x0 = latents[index, jitter]
        variant = torch.multinomial(self.captions.weights, size, replacement=True, generator=g)
        clip_ids = self.captions.clip[index, variant]
        t5_ids = self.captions.t5[index, variant]
        drop = (torch.rand(size, generator=g, device=device) < dropout).unsqueeze(1)
        clip_ids = torch.where(drop, self.captions.empty_clip, clip_ids)
        t5_ids = torch.where(drop, self.captions.empty_t5, t5_ids)
        noise = torch.randn(x0.shape, generator=g, device=device)
        sigma = fs.shift_sigmas(torch.sigmoid(torch.randn(size, generator=g, device=device)), self.mu)
        s = sigma.view(-1, 1, 1, 1)
        return {
            "x_t": fs.pack_latents((1 - s) * x0 + s * noise),
            "target": fs.pack_latents(noise - x0),
            "sigma": sigma,
            "clip_ids": clip_ids,
            "t5_ids": t5_ids,
        }


def transformer_velocity(
    transformer: nn.Module,
    x_t: torch.Tensor,
    sigma: torch.Tensor,
    guidance: torch.Tensor,
    embeds: torch.Tensor,
    pooled: torch.Tensor,
    img_ids: torch.Tensor,
) -> torch.Tensor:
    """One FluxTransformer2DModel forward as FluxPipeline calls it (timestep and guidance in sigma units)."""
    txt_ids = torch.zeros(embeds.shape[1], 3, device=x_t.device)
    return transformer(
        hidden_states=x_t,
        timestep=sigma,
        guidance=guidance,
        pooled_projections=pooled,
        encoder_hidden_states=embeds,
        txt_ids=txt_ids,
        img_ids=img_ids,
        return_dict=False,
    )[0]


def cooldown_factor(progress: float, cooldown: float) -> float:
    """1 until the last ``cooldown`` of a phase, then linearly down to 0.1 at its end."""
    if cooldown <= 0 or progress < 1 - cooldown:
        return 1.0
    return 1.0 - 0.9 * (progress - (1 - cooldown)) / cooldown


class PromptLengths:
    """Which transformer steps pad T5 ids to 512 (``share`` of them, seeded host draws) and their batch size."""

    def __init__(self, share: float, batch_size: int, seed: int) -> None:
        self.share, self.batch_size, self._draws = share, batch_size, random.Random(seed)
        self.long_steps = 0

    def next(self) -> tuple[bool, int]:
        """(long, batch size) of the next step: long steps take a quarter of the batch."""
        long = self._draws.random() < self.share
        self.long_steps += long
        return long, max(1, self.batch_size // 4) if long else self.batch_size


def _adamw(parameters: Sequence[nn.Parameter], lr: float, device: torch.device) -> torch.optim.AdamW:
    return torch.optim.AdamW(parameters, lr=lr, betas=(0.9, 0.999), weight_decay=0.0, fused=device.type == "cuda")


def _optimizer_step(
    optimizer: torch.optim.Optimizer,
    loss: torch.Tensor,
    parameters: Sequence[nn.Parameter],
    lr: float,
    step: int,
    warmup: int,
) -> None:
    """Linear warm-up over ``warmup`` steps to ``lr``, gradient clipping at norm 1."""
    for group in optimizer.param_groups:
        group["lr"] = lr * min(1.0, (step + 1) / warmup)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(parameters, 1.0)
    optimizer.step()


def train_vae(vae: nn.Module, batches: Batches, phase: Phase, args: argparse.Namespace, log: RunLog) -> None:
    parameters = list(vae.parameters())
    optimizer = _adamw(parameters, args.vae_lr, batches.device)
    vae.train()

    def step(i: int, progress: float) -> torch.Tensor:
        images = batches.images(args.vae_batch_size)
        with _autocast(batches.device, args):
            posterior = vae.encode(images).latent_dist
            recon = vae.decode(posterior.sample(batches.generator)).sample.float()
        kl = posterior.kl().mean() / (fs.LATENT_CHANNELS * fs.LATENT_SIZE**2)
        # L1 beside MSE keeps edges sharp; the learning rate decays linearly to a tenth, which settles them.
        loss = F.mse_loss(recon, images) + F.l1_loss(recon, images) + args.kl_weight * kl.float()
        _optimizer_step(optimizer, loss, parameters, args.vae_lr * (1 - 0.9 * progress), i, args.warmup_steps)
        return loss

    def done(steps: int) -> bool:
        if steps % args.vae_check_every:
            return False
        check = vae_roundtrip_adherence(vae, probe_scenes, batches.device)
        checks.append((steps, check))
        log(f"vae step {steps:6d}  round trip of {len(probe_scenes)} training scenes: " + _scores(check))
        return min(check[name] for name in ATTRIBUTES) >= args.vae_target

    checks: list[tuple[int, dict[str, float]]] = []
    probe_scenes = batches.scene_list[:: max(1, len(batches.scene_list) // 256)][:256]
    phase.run(step, log, args.log_every, done)
    phase.checks = checks
    vae.eval()


@torch.no_grad()
def latent_table(vae: nn.Module, scenes: Sequence[SceneSpec], device: torch.device) -> tuple[torch.Tensor, dict]:
    """Normalised latents [S, 9, 16, 8, 8] of every scene at every jitter; sets the VAE's shift and scale.

    ``shift_factor`` and ``scaling_factor`` become the raw latents' mean and 1 / std, so the transformer's
    targets have unit variance, and FluxPipeline's ``latents / scaling_factor + shift_factor`` undoes exactly this.
    """
    table = scenes_to_tensor(scenes, device)
    jitters = JITTERS.to(device)
    rows = []
    for start in range(0, len(scenes), 256):
        chunk = table[start : start + 256]
        images = fs.render(chunk.repeat_interleave(len(jitters), 0), jitters.repeat(len(chunk), 1))
        rows.append(
            vae.encode(images)
            .latent_dist.mode()
            .view(len(chunk), len(jitters), fs.LATENT_CHANNELS, fs.LATENT_SIZE, fs.LATENT_SIZE)
        )
    raw = torch.cat(rows)
    shift, scale = raw.mean().item(), 1.0 / raw.std().item()
    vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    return (raw - shift) * scale, {"shift_factor": shift, "scaling_factor": scale}


@torch.no_grad()
def vae_roundtrip_adherence(vae: nn.Module, scenes: Sequence[SceneSpec], device: torch.device) -> dict[str, float]:
    """Scorer adherence of decode(encode(render)) on ``scenes`` (the VAE's ceiling for the whole model)."""
    from PIL import Image

    images = fs.render(scenes_to_tensor(scenes, device))
    recon = vae.decode(vae.encode(images).latent_dist.mode()).sample
    pixels = ((recon.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return adherence(read_scenes(fs.scorer_images([Image.fromarray(p) for p in pixels])), scenes)


def _autocast(device: torch.device, args: argparse.Namespace) -> Any:
    """bf16 autocast on CUDA unless ``--precision fp32``; the weights stay fp32 either way."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda" and args.precision == "bf16")


def select_sdpa_backends(choice: str) -> None:
    """``"no-cudnn"``: torch's SDPA without its cuDNN backend (on the H200 with torch 2.11, the first teacher
    backward failed with CUBLAS_STATUS_EXECUTION_FAILED with every backend allowed and ran without cuDNN's);
    ``"math"``: the reference kernel only; ``"all"``: torch's own choice."""
    torch.backends.cuda.enable_cudnn_sdp(choice == "all")
    torch.backends.cuda.enable_flash_sdp(choice != "math")
    torch.backends.cuda.enable_mem_efficient_sdp(choice != "math")


def train_teacher(
    components: dict[str, Any],
    latents: torch.Tensor,
    batches: Batches,
    phase: Phase,
    args: argparse.Namespace,
    log: RunLog,
) -> EMA:
    """Phase 2: transformer and both text encoders, guidance input 1, prompt dropout, T5 ids at 16 or (in
    ``--long-share`` of the steps) 512 positions. Returns the EMA."""
    transformer, clip_model, t5_model = (components[k] for k in ("transformer", "text_encoder", "text_encoder_2"))
    parameters = [p for m in (transformer, clip_model, t5_model) for p in m.parameters()]
    optimizer = _adamw(parameters, args.lr, batches.device)
    ema = EMA(parameters, args.ema_decay)
    img_ids = fs.latent_image_ids(batches.device)
    ones = torch.ones(args.batch_size, device=batches.device)
    lengths = PromptLengths(args.long_share, args.batch_size, args.seed + 2)
    for module in (transformer, clip_model, t5_model):
        module.train()

    def step(i: int, progress: float) -> torch.Tensor:
        long, size = lengths.next()
        b = batches.flow(latents, size, args.prompt_dropout)
        t5_ids = batches.captions.pad_t5(b["t5_ids"]) if long else b["t5_ids"]
        with _autocast(batches.device, args):
            embeds, pooled = encode_text(clip_model, t5_model, b["clip_ids"], t5_ids)
            prediction = transformer_velocity(transformer, b["x_t"], b["sigma"], ones[:size], embeds, pooled, img_ids)
        loss = F.mse_loss(prediction.float(), b["target"])
        lr = args.lr * cooldown_factor(progress, args.cooldown)
        _optimizer_step(optimizer, loss, parameters, lr, i, args.warmup_steps)
        ema.update(i)
        return loss

    phase.run(step, log, args.log_every)
    phase.long_steps = lengths.long_steps
    return ema


def distil_guidance(
    components: dict[str, Any],
    latents: torch.Tensor,
    batches: Batches,
    phase: Phase,
    args: argparse.Namespace,
    log: RunLog,
) -> EMA:
    """Phase 3: the student transformer learns the teacher's CFG velocity for guidance g as its guidance input.

    The teacher reads the caption and the empty prompt at 16 T5 positions; the student reads the caption at 16
    or, in ``--long-share`` of the steps (a quarter of the batch), at 512."""
    student = components["transformer"]
    teacher = copy.deepcopy(student).eval().requires_grad_(False)
    clip_model, t5_model = components["text_encoder"].eval(), components["text_encoder_2"].eval()
    clip_model.requires_grad_(False)
    t5_model.requires_grad_(False)
    parameters = list(student.parameters())
    optimizer = _adamw(parameters, args.distill_lr, batches.device)
    ema = EMA(parameters, args.ema_decay)
    img_ids = fs.latent_image_ids(batches.device)
    ones = torch.ones(2 * args.distill_batch_size, device=batches.device)
    lengths = PromptLengths(args.long_share, args.distill_batch_size, args.seed + 3)
    student.train()

    def step(i: int, progress: float) -> torch.Tensor:
        long, n = lengths.next()
        empty_clip = batches.captions.empty_clip.expand(n, -1)
        empty_t5 = batches.captions.empty_t5.expand(n, -1)
        b = batches.flow(latents, n, dropout=0.0)
        g = 1 + (args.max_guidance - 1) * torch.rand(n, generator=batches.generator, device=batches.device)
        with torch.no_grad(), _autocast(batches.device, args):
            embeds, pooled = encode_text(
                clip_model, t5_model, torch.cat([b["clip_ids"], empty_clip]), torch.cat([b["t5_ids"], empty_t5])
            )
            both = transformer_velocity(
                teacher, b["x_t"].repeat(2, 1, 1), b["sigma"].repeat(2), ones[: 2 * n], embeds, pooled, img_ids
            ).float()
            cond, uncond = both[:n], both[n:]
            target = uncond + g.view(-1, 1, 1) * (cond - uncond)
            if long:
                student_embeds = t5_model(batches.captions.pad_t5(b["t5_ids"]), output_hidden_states=False)[0]
            else:
                student_embeds = embeds[:n]
        with _autocast(batches.device, args):
            prediction = transformer_velocity(student, b["x_t"], b["sigma"], g, student_embeds, pooled[:n], img_ids)
        loss = F.mse_loss(prediction.float(), target)
        lr = args.distill_lr * cooldown_factor(progress, args.cooldown)
        _optimizer_step(optimizer, loss, parameters, lr, i, args.warmup_steps)
        ema.update(i)
        return loss

    phase.run(step, log, args.log_every)
    phase.long_steps = lengths.long_steps
    return ema


def write_checkpoint(components: dict[str, Any], emas: Sequence[EMA], out: Path) -> None:
    """Save the pipeline with the EMA weights in place (stored in fp16). The live weights are not needed
    afterwards; the modules stay where they are."""
    for ema in emas:
        ema.copy_to_parameters()
    fs.save_pipeline(components, out)


@torch.no_grad()
def evaluate(
    directory: Path,
    scenes: Sequence[SceneSpec],
    *,
    steps: Sequence[int],
    guidances: Sequence[float],
    device: torch.device,
    batch_size: int,
    true_cfg_scale: float = 1.0,
) -> dict[str, dict[str, float]]:
    """Held-out adherence of the written checkpoint through diffusers' own FluxPipeline (fp32, no TF32).

    ``true_cfg_scale > 1`` adds classifier-free guidance against the empty prompt (how the teacher is judged).
    Scene i uses ``generator=torch.Generator("cpu").manual_seed(EVAL_SEED + i)`` (omni's seed ``EVAL_SEED``
    for a batch draws the same latents). Keys ``"steps_S_guidance_G"``.
    """
    from diffusers import FluxPipeline

    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    pipe = FluxPipeline.from_pretrained(str(directory), dtype=torch.float32).to(device)
    pipe.set_progress_bar_config(disable=True)
    prompts = [scene.caption() for scene in scenes]
    results = {}
    for num_steps in steps:
        for guidance in guidances:
            images = []
            for start in range(0, len(scenes), batch_size):
                chunk = range(start, min(start + batch_size, len(scenes)))
                images += pipe(
                    [prompts[i] for i in chunk],
                    height=fs.IMAGE_SIZE,
                    width=fs.IMAGE_SIZE,
                    num_inference_steps=num_steps,
                    guidance_scale=guidance,
                    true_cfg_scale=true_cfg_scale,
                    negative_prompt="" if true_cfg_scale > 1 else None,
                    generator=[torch.Generator("cpu").manual_seed(EVAL_SEED + i) for i in chunk],
                ).images
            results[f"steps_{num_steps}_guidance_{guidance:g}"] = adherence(
                read_scenes(fs.scorer_images(images)), scenes
            )
    torch.backends.cuda.matmul.allow_tf32 = tf32
    return results


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def _scores(scores: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:.4f}" for k, v in scores.items())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--config", choices=sorted(fs.CONFIGS), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-budget-s", type=float, default=330.0, help="training seconds, all phases")
    parser.add_argument("--vae-share", type=float, default=0.2, help="of the budget, at most, for the VAE")
    parser.add_argument(
        "--teacher-share", type=float, default=0.6, help="of what the VAE left; distillation gets the rest"
    )
    parser.add_argument("--vae-steps", type=int, default=None)
    parser.add_argument("--teacher-steps", type=int, default=None)
    parser.add_argument("--distill-steps", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=1024, help="teacher samples a step (16 T5 positions)")
    parser.add_argument("--distill-batch-size", type=int, default=512)
    parser.add_argument("--vae-batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=4e-4)
    parser.add_argument("--distill-lr", type=float, default=2e-4)
    parser.add_argument("--vae-lr", type=float, default=1e-3)
    parser.add_argument("--kl-weight", type=float, default=1e-3)
    parser.add_argument("--vae-check-every", type=int, default=200, help="VAE steps between round-trip checks")
    parser.add_argument(
        "--vae-target", type=float, default=0.995, help="the VAE stops once every attribute reads back this well"
    )
    parser.add_argument("--warmup-steps", type=int, default=200)
    parser.add_argument("--cooldown", type=float, default=0.3, help="last share of a transformer phase: lr to 0.1x")
    parser.add_argument(
        "--long-share", type=float, default=0.2, help="transformer steps with T5 ids padded to 512 (else 16)"
    )
    parser.add_argument("--ema-decay", type=float, default=0.999)
    parser.add_argument("--prompt-dropout", type=float, default=0.1)
    parser.add_argument("--max-guidance", type=float, default=5.0)
    parser.add_argument("--eval-scenes", type=int, default=200)
    parser.add_argument("--eval-steps", type=int, nargs="+", default=[fs.DEFAULT_STEPS, 8, 4])
    parser.add_argument("--eval-guidance", type=float, nargs="+", default=[fs.DEFAULT_GUIDANCE, 1.0])
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16", help="CUDA autocast (fp32 masters)")
    parser.add_argument(
        "--sdpa",
        choices=["no-cudnn", "math", "all"],
        default="no-cudnn",
        help="torch SDPA backends allowed on CUDA (see select_sdpa_backends)",
    )
    parser.add_argument(
        "--probe",
        action="store_true",
        help="GPU check of the real sizes in seconds: 32 training scenes, 3 steps a phase, 2 scenes",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="CPU check in seconds: smoke config, 16 training scenes, batch 4, 3 steps a phase, 2 held-out scenes",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.config, args.batch_size, args.vae_batch_size, args.warmup_steps, args.log_every = "smoke", 4, 4, 5, 1
        args.distill_batch_size, args.vae_check_every = 4, 2
        args.eval_scenes, args.eval_steps, args.eval_guidance = 2, [2], [fs.DEFAULT_GUIDANCE]
        args.vae_steps = args.vae_steps or 3
        args.teacher_steps = args.teacher_steps or 3
        args.distill_steps = args.distill_steps or 3
    if args.probe:
        args.vae_steps = args.teacher_steps = args.distill_steps = 3
        args.eval_scenes, args.eval_steps, args.eval_guidance, args.log_every = 2, [2], [fs.DEFAULT_GUIDANCE], 1
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    wall_start = time.perf_counter()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        select_sdpa_backends(args.sdpa)
    args.out.mkdir(parents=True, exist_ok=True)
    log = RunLog(args.out / "train_stdout.txt")
    train_scenes, held_out = split_scenes()
    assert not set(train_scenes) & set(held_out)
    if args.smoke or args.probe:
        train_scenes = train_scenes[: 16 if args.smoke else 32]
    held_out = held_out[: args.eval_scenes]
    config = fs.CONFIGS[args.config]

    components = fs.build_components(config, seed=args.seed)
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        components[name].to(device)
    captions = CaptionTable(train_scenes, components["tokenizer"], components["tokenizer_2"], device)
    batches = Batches(train_scenes, captions, device, seed=args.seed + 1)
    log(
        f"{fs.NAME}: {len(train_scenes)} training scenes x {captions.weights.numel()} phrasings, "
        f"mu {batches.mu:.4f}, device {device}"
    )
    record: dict[str, Any] = {
        "model": fs.NAME,
        "config": config.to_dict(),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "dynamic_shift_mu": fs.dynamic_shift_mu(),
        "train_scenes": len(train_scenes),
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "device": _device_name(device),
        },
        # As typed, whichever way it was started (a script path, -m): the run is reproducible from it.
        "command": "python -m omni_models.training.train_flux " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    phases: list[Phase] = []

    def save_record(**entries: Any) -> None:
        """Adds ``entries`` and rewrites ``train_log.json`` (after every stage: a run cut short keeps its log)."""
        record.update(entries, phases={p.name: p.record() for p in phases})
        (args.out / "train_log.json").write_text(json.dumps(record, indent=1) + "\n")

    training_start = time.perf_counter()
    vae_phase = Phase("vae", args.time_budget_s * args.vae_share, args.vae_steps)
    phases.append(vae_phase)
    train_vae(components["vae"], batches, vae_phase, args, log)
    latents, latent_stats = latent_table(components["vae"], train_scenes, device)
    vae_check = vae_roundtrip_adherence(components["vae"], held_out, device)
    log(f"vae: {vae_phase.steps} steps in {vae_phase.elapsed_s:.1f}s, {latent_stats}")
    log(f"vae: held-out round trip (the ceiling): {_scores(vae_check)}")
    save_record(latents=latent_stats, vae_roundtrip_held_out=vae_check)

    # The transformer phases share the time the VAE left (the VAE may stop early at its target).
    left = max(0.0, args.time_budget_s - (time.perf_counter() - training_start))
    teacher_phase = Phase("teacher", left * args.teacher_share, args.teacher_steps)
    distill_phase = Phase("distill", left * (1 - args.teacher_share), args.distill_steps)
    phases += [teacher_phase, distill_phase]
    teacher_ema = train_teacher(components, latents, batches, teacher_phase, args, log)
    write_checkpoint(components, [teacher_ema], args.out)
    log(f"teacher: {teacher_phase.steps} steps in {teacher_phase.elapsed_s:.1f}s; checkpoint written")
    eval_start = time.perf_counter()
    teacher_check = {}
    for cfg in (fs.DEFAULT_GUIDANCE, 1.0):
        scores = evaluate(
            args.out,
            held_out,
            steps=[args.eval_steps[0]],
            guidances=[1.0],
            device=device,
            batch_size=200,
            true_cfg_scale=cfg,
        )
        key = f"true_cfg_{cfg:g}"
        teacher_check[key] = next(iter(scores.values()))
        log(f"teacher held-out, {args.eval_steps[0]} steps, true CFG {cfg:g}: {_scores(teacher_check[key])}")
    teacher_eval_s = time.perf_counter() - eval_start
    save_record(teacher_held_out=teacher_check)

    distill_phase.seconds = max(0.0, args.time_budget_s - (time.perf_counter() - training_start - teacher_eval_s))
    student_ema = distil_guidance(components, latents, batches, distill_phase, args, log)
    write_checkpoint(components, [student_ema], args.out)
    log(f"distilled: {distill_phase.steps} steps in {distill_phase.elapsed_s:.1f}s; checkpoint written to {args.out}")
    train_seconds = time.perf_counter() - wall_start
    del components, latents, captions, batches
    if device.type == "cuda":
        torch.cuda.empty_cache()

    eval_start = time.perf_counter()
    results = evaluate(
        args.out, held_out, steps=args.eval_steps, guidances=args.eval_guidance, device=device, batch_size=200
    )
    for key, scores in results.items():
        log(f"held-out {key}: {_scores(scores)}")
    # The same evaluation on training scenes says how much of any shortfall is generalisation.
    seen = train_scenes[:: max(1, len(train_scenes) // len(held_out))][: len(held_out)]
    seen_results = evaluate(
        args.out, seen, steps=args.eval_steps[:1], guidances=args.eval_guidance[:1], device=device, batch_size=200
    )
    for key, scores in seen_results.items():
        log(f"training scenes {key}: {_scores(scores)}")
    save_record(
        held_out_adherence={
            "scenes": len(held_out),
            "noise_seed_base": EVAL_SEED,
            "pipeline": "diffusers.FluxPipeline fp32",
            "results": results,
        },
        training_scene_adherence={"scenes": len(seen), "results": seen_results},
        seconds={
            "setup_and_training": round(train_seconds - teacher_eval_s, 1),
            "teacher_evaluation": round(teacher_eval_s, 1),
            "evaluation": round(time.perf_counter() - eval_start, 1),
            "wall": round(time.perf_counter() - wall_start, 1),
        },
    )
    log(f"wrote {args.out} in {record['seconds']['wall']:.0f}s")
    return record


if __name__ == "__main__":
    main()
