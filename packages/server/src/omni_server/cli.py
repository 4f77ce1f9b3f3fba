"""``omni-server``: ``serve`` (the HTTP server) and ``generate`` (one request, in this process).

Every configuration flag is generated from ``ServerConfig``'s fields (``omni_server.config``: the flag, its type,
choices, help, default and ``--help`` group are declared once there), the way ``vllm serve`` builds its flags from
``EngineArgs``. Flags default to "not given", so a YAML file passed with ``--config`` fills in what the command
line leaves out and an explicit flag always wins. ``generate`` adds the request's own flags (prompt, size, steps,
...), which build the one request type (``omni_models.GenerationRequest``).

Start-up order: flags -> config (``ConfigError``: exit 2) -> ``check_startup`` (the model's metadata and the
libraries' rules: exit 2) -> for ``generate``, the request checked against the model's ``ModelInfo`` (exit 2) ->
only then anything is loaded. ``serve`` spawns its engine process before ``check_startup``: the process imports
what loading needs while the checks run, and is discarded, having loaded nothing, when they fail
(``omni_server.client.prestart_engine``).
"""

from __future__ import annotations

import argparse
import logging
import sys
import typing

import msgspec

from omni_server.config import (
    DEFAULT_MODEL,
    FIELD_NAMES,
    ConfigError,
    ServerConfig,
    build_config,
    declared,
    flag,
    load_config_file,
)

_DEFAULTS = ServerConfig()
GROUP_DESCRIPTIONS = {
    "ModelConfig": "which model to load and where",
    "OffloadConfig": "layerwise weight offload (dlo_offload)",
    "QuantizationConfig": "FP8 weights (fp8_cache)",
    "CompilationConfig": "compiled serving and what is cached around the model",
    "ParallelConfig": "one request on several GPUs: one process per GPU, world size = CFG x SP",
    "RuntimeConfig": None,
    "CacheConfig": "the paged KV cache pool",
    "SchedulerConfig": "admission and batching",
    "Frontend": "the HTTP server",
    "Limits": "everything a client controls is bounded; each answered in the OpenAI error shape",
    "VideoConfig": "the videos API (/v1/videos): jobs, their MP4 files on disk, and the bounds of both",
    "Supervision": "the engine process",
    "Security": "who may call the server",
    "LoRAConfig": "LoRA adapters, selected per request by model=<adapter name> (omni_models.lora)",
}


def _argument(name: str) -> dict[str, typing.Any]:
    """argparse keyword arguments of one config field, from its declaration."""
    info, extra, help_text = declared(name)
    default = getattr(_DEFAULTS, name)
    shown = "none" if default is None or default == [] else default
    if "(default:" not in help_text:  # a help text may say what its default means itself
        help_text = f"{help_text} (default: {shown})"
    kwargs: dict[str, typing.Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_text.lstrip()}
    if isinstance(info, msgspec.inspect.UnionType):  # an optional setting
        info = next(t for t in info.types if not isinstance(t, msgspec.inspect.NoneType))
    while isinstance(info, msgspec.inspect.Metadata):
        info = info.type
    if "metavar" in extra:
        kwargs["metavar"] = extra["metavar"]
    if isinstance(info, msgspec.inspect.BoolType):
        kwargs["action"] = argparse.BooleanOptionalAction
    elif isinstance(info, msgspec.inspect.LiteralType):
        kwargs["choices"] = list(info.values)
        kwargs["type"] = type(info.values[0])
    elif "parse" in extra:
        kwargs["type"] = str  # config.build_config parses 512M-style sizes and lists
        if extra["parse"] in ("lora_modules", "names"):
            kwargs["nargs"] = "+"  # vllm serve's --lora-modules a=PATH b=PATH, --lora-target-modules to_q to_k
    elif isinstance(info, msgspec.inspect.IntType):
        kwargs["type"] = int
    elif isinstance(info, msgspec.inspect.FloatType):
        kwargs["type"] = float
    return kwargs


def add_config_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    """Every ``ServerConfig`` field ``command`` takes, grouped as declared; the model is ``serve``'s positional
    argument and ``generate``'s ``--model`` (its positional argument is the prompt)."""
    model_help = f"model name or directory (default: the shipped {DEFAULT_MODEL})"
    if command == "serve":
        parser.add_argument("model", nargs="?", default=argparse.SUPPRESS, help=model_help)
    else:
        parser.add_argument("--model", default=argparse.SUPPRESS, help=model_help)
    parser.add_argument(
        "--config",
        dest="config_file",
        metavar="FILE",
        default=None,
        help="YAML file with any of the settings below (snake_case keys); flags override it",
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for name in FIELD_NAMES:
        extra = declared(name)[1]
        if name == "model" or command not in extra["commands"]:
            continue
        group = extra["group"]
        if group not in groups:
            groups[group] = parser.add_argument_group(group, GROUP_DESCRIPTIONS.get(group))
        groups[group].add_argument(flag(name), **_argument(name))


def _add_request_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="what the image shows (for a music model: the caption)")
    request = parser.add_argument_group("Request", "the request's fields (default: the model's)")
    request.add_argument(
        "-o",
        "--output",
        default=None,
        help="output path; with -n > 1, NAME-i.EXT (default: out.png, song.wav for music, clip.mp4 for video)",
    )
    request.add_argument("-n", type=int, default=1, help="number of images (default: 1)")
    request.add_argument(
        "--negative-prompt",
        dest="negative_prompt",
        default=msgspec.UNSET,
        help="what the image should not show (default: the model's)",
    )
    request.add_argument("--steps", dest="num_inference_steps", type=int, default=None, help="denoising steps")
    request.add_argument(
        "--guidance-scale",
        dest="guidance_scale",
        type=float,
        default=None,
        help="the model's guidance: CFG scale of omni models (1 disables it), FLUX.1-dev's embedded "
        "guidance, the true-CFG scale of Qwen-Image and FLUX.1-schnell",
    )
    request.add_argument(
        "--true-cfg-scale",
        dest="true_cfg_scale",
        type=float,
        default=None,
        help="true CFG with the negative prompt on top of FLUX.1-dev's embedded guidance",
    )
    request.add_argument("--size", default=None, help="WIDTHxHEIGHT")
    request.add_argument(
        "--image",
        dest="images",
        action="append",
        default=[],
        metavar="PATH",
        help="an input image to edit (an edit model, e.g. FLUX.1-Kontext); repeat for several",
    )
    request.add_argument(
        "--image-seed",
        dest="image_seed",
        type=int,
        default=None,
        help="seed of the request (image i uses seed + i; default: --seed)",
    )
    request.add_argument(
        "--lora",
        metavar="PATH[:SCALE]",
        default=None,
        help="apply a LoRA adapter (a .safetensors file or a directory holding one) at SCALE (default: 1); a "
        "diffusers family only",
    )
    request.add_argument(
        "--upscale",
        type=int,
        default=1,
        metavar="K",
        help="write each image K times larger (nearest neighbour), e.g. 8 for the 32x32 shipped model (default: 1)",
    )
    video = parser.add_argument_group("Video", "for a video model (e.g. a Wan checkpoint): writes an MP4")
    video.add_argument("--num-frames", dest="num_frames", type=int, default=None, help="frames of the clip (Wan: 4k+1)")
    video.add_argument("--fps", type=int, default=None, help="frame rate of the MP4 (default: the model's)")
    video.add_argument(
        "--guidance-scale-2",
        dest="guidance_scale_2",
        type=float,
        default=None,
        help="a two-expert model's (Wan2.2 A14B) low-noise guidance (default: --guidance-scale, else the model's)",
    )
    song = parser.add_argument_group("Music", "for a music model (e.g. --model omni-tones-tiny): writes a WAV")
    song.add_argument("--lyrics", default=None, help="structure-tagged lyrics, e.g. '[verse]\\nla la'")
    song.add_argument(
        "--max-new-tokens",
        dest="max_new_tokens",
        type=int,
        default=None,
        help="cap on audio frames (default: the model's maximum)",
    )


def build_parser() -> argparse.ArgumentParser:
    from omni_server import __version__

    parser = argparse.ArgumentParser(
        prog="omni-server", description="Serve diffusion models with an OpenAI-compatible API, or run one request."
    )
    parser.add_argument("--version", action="version", version=f"omni-server {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{serve,generate}")
    serve = commands.add_parser(
        "serve", help="start the HTTP server", description="Start the OpenAI-compatible HTTP server."
    )
    add_config_arguments(serve, "serve")
    generate = commands.add_parser(
        "generate",
        help="run one request in this process",
        description="Generate images (PNG), a song (WAV) or a video (MP4) for one prompt.",
    )
    _add_request_arguments(generate)
    add_config_arguments(generate, "generate")
    return parser


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    file_values = load_config_file(args.config_file) if args.config_file else {}
    flags = {key: value for key, value in vars(args).items() if key in FIELD_NAMES}
    return build_config(file_values, **flags)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
        if args.command == "generate" and args.lora is not None:
            from omni_server.generate import with_lora

            config = with_lora(config, args.lora)
    except ConfigError as exc:
        parser.exit(2, f"omni-server: error: {exc}\n")
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = None
    if args.command == "serve":
        from omni_server.client import prestart_engine

        engine = prestart_engine(config)
    from omni_models import CheckpointError, InvalidRequestError, MissingDependencyError
    from omni_server.startup import check_startup

    try:
        spec = check_startup(config)
        if args.command == "serve" and spec.info.task == "text-to-video":
            from omni_server.startup import check_video_dir

            check_video_dir(config)
    except (ConfigError, CheckpointError, InvalidRequestError, MissingDependencyError) as exc:
        if engine is not None:
            engine.stop(0.0)
        parser.exit(2, f"omni-server: error: {' '.join(str(exc).split())}\n")
    except BaseException:
        if engine is not None:
            engine.stop(0.0)
        raise
    if args.command == "serve":
        from omni_server.serve import serve

        return serve(config, engine=engine)
    from omni_server.generate import GenerateError, generate_to_files, request_from_args

    try:
        request = request_from_args(args, spec.info, config)
        paths = generate_to_files(config, spec, request, output=args.output, upscale=args.upscale)
    except GenerateError as exc:
        print(f"omni-server: error: {exc}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


__all__ = ["add_config_arguments", "build_parser", "config_from_args", "main"]
