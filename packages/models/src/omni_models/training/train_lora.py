"""Train the colour-shift LoRA of omni-flux-shapes-tiny: every colour one palette step on, by prompt.

    python -m omni_models.training.train_lora --out OUTDIR [--model omni-flux-shapes-tiny] [--rank 8]

With the adapter, "a red circle ... on a blue background" is drawn as an orange circle on a purple background:
red -> orange -> yellow -> green -> blue -> purple -> red, white <-> black (``SHIFT``), the shape's colour and the
background's both (a bijection of the palette, so a shape never takes its background's colour). The scorer reads
it back (``shows_shift``).

Method (a few minutes on a CPU): the transformer sees the prompt only through two linears, ``context_embedder``
(T5 token embeddings) and ``time_text_embed.text_embedder.linear_1`` (CLIP's pooled embedding). For every training
scene the adapter is fitted so that each linear maps the prompt's embeddings to what it computes for the shifted
scene's prompt (word for word the same length): ``(W + B A) e = W e'``, by reduced-rank least squares over every
token of every training caption (ridge ``--ridge`` times the mean feature energy, then the best rank ``--rank``
solution of that regression: ``B`` the leading eigenvectors of the fitted deltas' covariance, ``A = B^T dW``).
Nothing is drawn at random: the same base model gives the same adapter. It is written as diffusers writes a PEFT
LoRA (``FluxPipeline.save_lora_weights``, ``lora_alpha = r``), so diffusers' ``load_lora_weights`` and omni's
``--lora-modules`` both load it.

Evaluation, through omni's pipeline: the first ``--eval-scenes`` held-out scenes (never in the fit, in any form),
each asked twice in one batched forward per step, with the adapter and without it (its batch neighbour); seeds
``EVAL_SEED + i``. Reported: the share of adapter rows showing the shift (shape colour and background both
shifted) and of neighbour rows showing it (the target is 0), and the neighbours' own adherence. OUTDIR gets
``pytorch_lora_weights.safetensors``, ``train_log.json`` and ``train_stdout.txt``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from omni_models.training import flux_shapes as fs
from omni_models.training.captions import SceneSpec
from omni_models.training.scorer import SceneReading, adherence, read_scenes
from omni_models.training.shapes import split_scenes
from omni_models.training.train_flux import EVAL_SEED, RunLog

# red -> orange -> yellow -> green -> blue -> purple -> red; white <-> black (indices into COLOR_NAMES).
SHIFT: tuple[int, ...] = (1, 2, 3, 4, 5, 0, 7, 6)
TARGETS = {"context_embedder": "tokens", "time_text_embed.text_embedder.linear_1": "pooled"}
ADAPTER_NAME = "colour-shift"


def shifted(scene: SceneSpec) -> SceneSpec:
    return SceneSpec(scene.shape, SHIFT[scene.color], scene.position, SHIFT[scene.background])


def shows_shift(reading: SceneReading, scene: SceneSpec) -> bool:
    """The image of ``scene`` has its shape colour and its background both one palette step on."""
    return reading.color == SHIFT[scene.color] and reading.background == SHIFT[scene.background]


class Regression:
    """Sufficient statistics of ``delta(e) = W (e' - e)`` regressed on ``e`` (float64)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.double()
        width = weight.shape[1]
        self.gram = torch.zeros(width, width, dtype=torch.float64)
        self.cross = torch.zeros(weight.shape[0], width, dtype=torch.float64)
        self.rows = 0

    def add(self, e: torch.Tensor, target_e: torch.Tensor) -> None:
        e = e.reshape(-1, e.shape[-1]).double()
        delta = (target_e.reshape(e.shape).double() - e) @ self.weight.T
        self.gram += e.T @ e
        self.cross += delta.T @ e
        self.rows += e.shape[0]

    def solve(self, rank: int, ridge: float) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(A [r, in], B [out, r], share of the fitted deltas' energy the rank keeps)."""
        gram = self.gram + ridge * self.gram.diagonal().mean() * torch.eye(self.gram.shape[0], dtype=torch.float64)
        full = self.cross @ torch.linalg.inv(gram)
        energy, vectors = torch.linalg.eigh(full @ self.gram @ full.T)
        up = vectors[:, -rank:]
        return (up.T @ full).float().contiguous(), up.float().contiguous(), float(energy[-rank:].sum() / energy.sum())


@torch.no_grad()
def encode(pipe: Any, captions: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(T5 token embeddings [N, 512, D], CLIP pooled [N, P]) as ``FluxPipeline.encode_prompt`` makes them."""
    tokens, pooled, _ = pipe.encode_prompt(
        prompt=list(captions), prompt_2=None, device="cpu", num_images_per_prompt=1, max_sequence_length=512
    )
    return tokens, pooled


@torch.no_grad()
def fit(pipe: Any, scenes: Sequence[SceneSpec], rank: int, ridge: float, log: RunLog) -> dict[str, Any]:
    transformer = pipe.transformer
    regressions = {name: Regression(transformer.get_submodule(name).weight) for name in TARGETS}
    for start in range(0, len(scenes), 64):
        chunk = scenes[start : start + 64]
        tokens, pooled = encode(pipe, [s.caption() for s in chunk])
        shifted_tokens, shifted_pooled = encode(pipe, [shifted(s).caption() for s in chunk])
        regressions["context_embedder"].add(tokens, shifted_tokens)
        regressions["time_text_embed.text_embedder.linear_1"].add(pooled, shifted_pooled)
        if start % 512 == 0:
            log(f"encoded {start + len(chunk)} of {len(scenes)} training captions (and their shifted ones)")
    factors, kept = {}, {}
    for name, regression in regressions.items():
        down, up, kept[name] = regression.solve(rank, ridge)
        factors[name] = (down, up)
        log(f"{name}: {regression.rows} rows, rank {rank} keeps {kept[name]:.4f} of the fitted delta's energy")
    return {"factors": factors, "energy_kept": kept, "rows": {n: r.rows for n, r in regressions.items()}}


@torch.no_grad()
def feature_residuals(pipe: Any, scenes: Sequence[SceneSpec], factors: dict) -> dict[str, float]:
    """Held-out ``|W e' - (W + BA) e| / |W e' - W e|`` per linear: 0 is a perfect map, 1 no change at all."""
    tokens, pooled = encode(pipe, [s.caption() for s in scenes])
    shifted_tokens, shifted_pooled = encode(pipe, [shifted(s).caption() for s in scenes])
    out = {}
    for name, (e, target) in {
        "context_embedder": (tokens, shifted_tokens),
        "time_text_embed.text_embedder.linear_1": (pooled, shifted_pooled),
    }.items():
        weight = pipe.transformer.get_submodule(name).weight
        down, up = factors[name]
        wanted = (target - e) @ weight.T
        out[name] = float((wanted - (e @ down.T) @ up.T).norm() / wanted.norm())
    return out


def save_adapter(factors: dict, rank: int, out: Path) -> Path:
    from peft import LoraConfig

    from omni_models.synthetic import save_lora

    state = {}
    for name, (down, up) in factors.items():
        state[f"{name}.lora_A.weight"] = down
        state[f"{name}.lora_B.weight"] = up
    config = LoraConfig(r=rank, lora_alpha=rank, target_modules=list(TARGETS))
    return save_lora("flux", out, state, config)


def evaluate(model: str, adapter: Path, scenes: Sequence[SceneSpec], steps: int, log: RunLog) -> dict[str, Any]:
    """Each scene with the adapter and without it, side by side in every batched forward (omni's pipeline)."""
    import omni_models
    from omni_models import GenerationRequest, resolve_request

    pipe = omni_models.load(model, lora=omni_models.LoRAOptions(max_loras=1, max_rank=16))
    pipe.lora.register(ADAPTER_NAME, adapter)
    jobs = []
    for i, scene in enumerate(scenes):
        for lora in (ADAPTER_NAME, None):
            request = GenerationRequest(
                prompt=scene.caption(), lora=lora, seed=EVAL_SEED + i, num_inference_steps=steps
            )
            jobs += pipe.prepare(resolve_request(pipe.info, request))
    start = time.perf_counter()
    pipe.start(jobs)
    while not jobs[0].finished:
        pipe.step(jobs)
    readings = read_scenes(fs.scorer_images(pipe.decode(jobs)))
    with_adapter, neighbours = readings[0::2], readings[1::2]
    result = {
        "scenes": len(scenes),
        "steps": steps,
        "guidance": pipe.info.image.default_guidance_scale,
        "rows_per_forward": len(jobs),
        "adapter_shows_shift": sum(map(shows_shift, with_adapter, scenes)) / len(scenes),
        "neighbours_show_shift": sum(map(shows_shift, neighbours, scenes)) / len(scenes),
        "adapter_adherence_to_shifted_scene": adherence(with_adapter, [shifted(s) for s in scenes]),
        "neighbours_adherence": adherence(neighbours, scenes),
        "seconds": round(time.perf_counter() - start, 1),
    }
    log(
        f"held-out, {steps} steps, {len(scenes)} scenes x (adapter, neighbour) in one batch: shift shown by "
        f"{result['adapter_shows_shift']:.3f} of adapter rows (target >= 0.90) and "
        f"{result['neighbours_show_shift']:.3f} of neighbours (target 0); neighbours' adherence "
        f"{result['neighbours_adherence']['attributes']:.4f} ({result['seconds']} s)"
    )
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default=fs.NAME, help="the base model (name or diffusers directory)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--ridge", type=float, default=1e-3)
    parser.add_argument("--eval-scenes", type=int, default=50)
    parser.add_argument("--eval-steps", type=int, nargs="+", default=[8])
    parser.add_argument("--smoke", action="store_true", help="64 training captions, 4 held-out scenes, 2 steps")
    args = parser.parse_args(argv)
    if args.smoke:
        args.eval_scenes, args.eval_steps = 4, [2]
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from diffusers import FluxPipeline

    from omni_models.hub import resolve_model_dir

    args = parse_args(argv)
    wall = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    log = RunLog(args.out / "train_stdout.txt")
    train, held_out = split_scenes()
    if args.smoke:
        train = train[:64]
    held_out = held_out[: args.eval_scenes]
    directory = resolve_model_dir(args.model)
    pipe = FluxPipeline.from_pretrained(str(directory), dtype=torch.float32)
    log(f"{ADAPTER_NAME} LoRA for {args.model} ({directory}): {len(train)} training scenes, rank {args.rank}")
    fitted = fit(pipe, train, args.rank, args.ridge, log)
    residuals = feature_residuals(pipe, held_out, fitted["factors"])
    log(f"held-out feature residuals (0: exact, 1: unchanged): {residuals}")
    adapter = save_adapter(fitted["factors"], args.rank, args.out)
    fit_seconds = time.perf_counter() - wall
    log(f"wrote {adapter} ({adapter.stat().st_size} bytes) after {fit_seconds:.0f} s")
    del pipe
    results = [evaluate(args.model, adapter, held_out, steps, log) for steps in args.eval_steps]
    record = {
        "adapter": ADAPTER_NAME,
        "base_model": args.model,
        "shift": {"color_indices": list(SHIFT), "rule": "shape colour and background one palette step on"},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "targets": TARGETS,
        "fit": {"energy_kept": fitted["energy_kept"], "rows": fitted["rows"], "train_scenes": len(train)},
        "held_out_feature_residuals": residuals,
        "evaluation": {"noise_seed_base": EVAL_SEED, "pipeline": "omni_models FamilyPipeline fp32", "runs": results},
        "seconds": {"fit": round(fit_seconds, 1), "wall": round(time.perf_counter() - wall, 1)},
        "environment": {"python": platform.python_version(), "torch": torch.__version__, "argv": sys.argv},
    }
    (args.out / "train_log.json").write_text(json.dumps(record, indent=1) + "\n")
    log(f"done in {record['seconds']['wall']:.0f} s")
    return record


if __name__ == "__main__":
    main()
