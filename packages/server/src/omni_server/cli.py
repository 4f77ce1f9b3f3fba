"""``omni-server``: ``serve`` (the HTTP server) and ``generate`` (one image, in this process).

Engine flags are shared by both commands and grouped in ``--help`` like
``vllm serve`` groups them. Flags default to "not given", so a YAML file passed
with ``--config`` fills in what the command line leaves out and an explicit
flag always wins.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from omni_server.config import DEFAULT_MODEL, ConfigError, ServerConfig, build_config, load_config_file

_DEFAULTS = ServerConfig()


def _default(name: str) -> str:
    return f"(default: {getattr(_DEFAULTS, name)})"


def _bool_flag(group: argparse._ArgumentGroup, flag: str, dest: str, help: str) -> None:
    group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                       help=f"{help} {_default(dest)}")


def _add_engine_arguments(parser: argparse.ArgumentParser, *, model_positional: bool) -> None:
    """Model, weights and runtime flags, shared by ``serve`` and ``generate``."""
    S = argparse.SUPPRESS
    model_help = f"model name or directory (default: the shipped {DEFAULT_MODEL})"
    if model_positional:
        parser.add_argument("model", nargs="?", default=S, help=model_help)
    else:  # the prompt is the positional argument of `generate`
        parser.add_argument("--model", default=S, help=model_help)
    parser.add_argument("--config", dest="config_file", metavar="FILE", default=None,
                        help="YAML file with any of the settings below (snake_case keys); flags override it")

    model = parser.add_argument_group("ModelConfig", "which model to load and where")
    model.add_argument("--device", default=S, help=f"auto, cpu, cuda or cuda:N {_default('device')}")
    model.add_argument("--dtype", default=S, choices=["auto", "float32", "bfloat16", "float16"],
                       help=f"weight and activation dtype; auto uses the model's own {_default('dtype')}")
    offload = parser.add_argument_group("OffloadConfig", "layerwise weight offload (dlo_offload)")
    _bool_flag(offload, "--enable-layerwise-offload", "enable_layerwise_offload",
               "keep transformer blocks in host memory and stream each to the device just in time")
    offload.add_argument("--offload-resident-layers", "--dlo-resident-layers", dest="offload_resident_layers",
                         type=int, default=S,
                         help=f"leading blocks that stay on the device {_default('offload_resident_layers')}")
    _bool_flag(offload, "--offload-allgather", "offload_allgather",
               "shard the streamed blocks across the sequence-parallel ranks' host memory and AllGather each "
               "block just in time (needs --enable-layerwise-offload and --sequence-parallel-size >= 2)")

    parallel = parser.add_argument_group(
        "ParallelConfig", "one request on several GPUs: one process per GPU, world size = CFG x SP")
    parallel.add_argument("--cfg-parallel-size", dest="cfg_parallel_size", type=int, choices=[1, 2], default=S,
                          help="run the cond and uncond rows of guided requests on two ranks "
                               f"{_default('cfg_parallel_size')}")
    parallel.add_argument("--sequence-parallel-size", dest="sequence_parallel_size", type=int, default=S,
                          metavar="N",
                          help="Ulysses sequence parallelism: split each forward's tokens over N ranks (all-to-all "
                               f"over heads; N must divide the model's heads) {_default('sequence_parallel_size')}")

    quant = parser.add_argument_group("QuantizationConfig", "FP8 weights (fp8_cache)")
    quant.add_argument("--quantization", default=S, choices=["fp8"], help="quantize eligible linears to FP8")
    quant.add_argument("--fp8-cache-dir", dest="fp8_cache_dir", default=S, metavar="DIR",
                       help="reuse FP8 weights quantized by an earlier start (needs --quantization fp8)")

    run = parser.add_argument_group("RuntimeConfig")
    run.add_argument("--seed", type=int, default=S, help=f"base seed for requests without one {_default('seed')}")
    run.add_argument("--log-level", dest="log_level", default=S, choices=["debug", "info", "warning", "error"],
                     help=f"{_default('log_level')}")


def _add_serving_arguments(parser: argparse.ArgumentParser) -> None:
    """KV pool, scheduler and frontend flags: only ``serve`` runs the engine that uses them."""
    S = argparse.SUPPRESS
    cache = parser.add_argument_group("CacheConfig", "the paged KV cache pool")
    cache.add_argument("--block-size", dest="block_size", type=int, default=S,
                       help=f"tokens per KV block {_default('block_size')}")
    cache.add_argument("--kv-cache-memory-bytes", dest="kv_cache_memory_bytes", default=S, metavar="BYTES",
                       help="explicit KV pool budget, e.g. 512M or 2G; 0 or unset sizes it from "
                            "--gpu-memory-utilization after profiling")
    cache.add_argument("--gpu-memory-utilization", dest="gpu_memory_utilization", type=float, default=S,
                       help=f"fraction of device memory the engine may use in total {_default('gpu_memory_utilization')}")
    cache.add_argument("--max-model-len", dest="max_model_len", default=S, metavar="TOKENS",
                       help="longest CFG row (prompt + image tokens) admitted; -1 or unset: the model's "
                            "longest row (longest prompt + largest image)")

    scheduler = parser.add_argument_group("SchedulerConfig", "admission and batching")
    scheduler.add_argument("--max-num-seqs", dest="max_num_seqs", type=int, default=S,
                           help="most requests denoising at once (their CFG rows share each forward) "
                                f"{_default('max_num_seqs')}")
    scheduler.add_argument("--max-rows-per-step", dest="max_rows_per_step", type=int, default=S,
                           help="CFG rows per forward; jobs with the fewest steps left go first, so a short request "
                                f"is not held behind long ones; 0: every running row in every forward "
                                f"{_default('max_rows_per_step')}")
    _bool_flag(scheduler, "--batch-invariant", "batch_invariant",
               "run each image's rows in a forward of their own, so an image of an n-image or concurrent request is "
               "bit-equal to the same image requested alone (slower: no batching across images)")

    frontend = parser.add_argument_group("Frontend", "the HTTP server")
    frontend.add_argument("--served-model-name", dest="served_model_name", default=S,
                          help="the name clients pass as `model` (default: the model argument)")
    frontend.add_argument("--host", default=S, help=f"{_default('host')}")
    frontend.add_argument("--port", type=int, default=S, help=f"{_default('port')}")
    frontend.add_argument("--engine-start-timeout", dest="engine_start_timeout_s", type=float, default=S,
                          metavar="SECONDS",
                          help=f"give up if the engine is not ready by then {_default('engine_start_timeout_s')}")
    _bool_flag(frontend, "--warmup", "warmup", "run one request through the engine before reporting ready")


def _add_robustness_arguments(parser: argparse.ArgumentParser) -> None:
    """Bounds on what clients control, engine supervision, HTTP security (``serve`` only)."""
    S = argparse.SUPPRESS
    limits = parser.add_argument_group("Limits", "everything a client controls is bounded; each answered in the "
                                                 "OpenAI error shape")
    limits.add_argument("--max-request-body-bytes", dest="max_request_body_bytes", default=S, metavar="BYTES",
                        help=f"larger bodies get 413, e.g. 1M {_default('max_request_body_bytes')}")
    limits.add_argument("--max-prompt-chars", dest="max_prompt_chars", type=int, default=S,
                        help=f"longer prompts get 400 before tokenizing {_default('max_prompt_chars')}")
    limits.add_argument("--max-error-message-chars", dest="max_error_message_chars", type=int, default=S,
                        help=f"error messages are cut to this length {_default('max_error_message_chars')}")
    limits.add_argument("--max-header-bytes", dest="max_header_bytes", default=S, metavar="BYTES",
                        help=f"request line + headers; larger gets 431 {_default('max_header_bytes')}")
    limits.add_argument("--max-header-count", dest="max_header_count", type=int, default=S,
                        help=f"more headers get 431 {_default('max_header_count')}")
    limits.add_argument("--header-timeout", dest="header_timeout_s", type=float, default=S, metavar="SECONDS",
                        help=f"the request head must arrive within this, else 408 {_default('header_timeout_s')}")
    limits.add_argument("--body-timeout", dest="body_timeout_s", type=float, default=S, metavar="SECONDS",
                        help=f"the body must arrive within this, else 408 {_default('body_timeout_s')}")
    limits.add_argument("--max-queued-requests", dest="max_queued_requests", type=int, default=S,
                        help="requests accepted beyond --max-num-seqs; more get 429 with Retry-After "
                             f"{_default('max_queued_requests')}")
    limits.add_argument("--request-timeout", dest="request_timeout_s", type=float, default=S, metavar="SECONDS",
                        help=f"a request still unfinished then is aborted with 504; 0: none {_default('request_timeout_s')}")
    limits.add_argument("--shutdown-timeout", dest="shutdown_timeout_s", type=float, default=S, metavar="SECONDS",
                        help="on SIGTERM/SIGINT, in-flight requests may finish within this; the rest get 503 "
                             f"{_default('shutdown_timeout_s')}")
    supervision = parser.add_argument_group("Supervision", "the engine process")
    supervision.add_argument("--engine-restarts", dest="engine_restarts", type=int, default=S,
                             help="restart a dead engine up to N times in a row, with backoff; 0: never "
                                  f"{_default('engine_restarts')}")
    supervision.add_argument("--engine-heartbeat-timeout", dest="engine_heartbeat_timeout_s", type=float, default=S,
                             metavar="SECONDS", help="an engine silent this long is stalled: /health 503 "
                                                     f"{_default('engine_heartbeat_timeout_s')}")
    security = parser.add_argument_group("Security", "who may call the server")
    security.add_argument("--api-key", dest="api_key", default=S,
                          help="require 'Authorization: Bearer KEY' on /v1/* (401 otherwise)")
    security.add_argument("--allowed-origins", dest="allowed_origins", default=S, metavar="LIST",
                          help="CORS origins, a JSON list or comma-separated (default: none, no CORS headers)")
    security.add_argument("--allowed-hosts", dest="allowed_hosts", default=S, metavar="LIST",
                          help="Host header values the server answers to, '*' for any (default: the loopback names "
                               "when bound to a loopback address, else any)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omni-server", description="Serve diffusion models with an OpenAI-compatible API, or generate one image.")
    from omni_server import __version__

    parser.add_argument("--version", action="version", version=f"omni-server {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{serve,generate}")

    serve = commands.add_parser("serve", help="start the HTTP server",
                                description="Start the OpenAI-compatible HTTP server (POST /v1/images/generations).")
    _add_engine_arguments(serve, model_positional=True)
    _add_serving_arguments(serve)
    _add_robustness_arguments(serve)

    generate = commands.add_parser("generate", help="generate one image in this process",
                                   description="Generate images for one prompt and write them as PNG.")
    generate.add_argument("prompt", help="what the image shows (for a music model: the caption)")
    request = generate.add_argument_group("Request")
    request.add_argument("-o", "--output", default="out.png", help="PNG path; with -n > 1, NAME-i.png (default: out.png)")
    request.add_argument("-n", type=int, default=1, help="number of images (default: 1)")
    request.add_argument("--negative-prompt", dest="negative_prompt", default=None)
    request.add_argument("--steps", dest="num_inference_steps", type=int, default=None,
                         help="denoising steps (default: the model's)")
    request.add_argument("--guidance-scale", dest="guidance_scale", type=float, default=None,
                         help="the model's guidance: CFG scale of omni models (1 disables it), FLUX.1-dev's embedded "
                              "guidance, the true-CFG scale of Qwen-Image and FLUX.1-schnell (default: the model's)")
    request.add_argument("--true-cfg-scale", dest="true_cfg_scale", type=float, default=None,
                         help="real families: classifier-free guidance with the negative prompt, e.g. on top of "
                              "FLUX.1-dev's embedded guidance (default: the model's)")
    request.add_argument("--size", default=None, help="WIDTHxHEIGHT (default: the model's)")
    request.add_argument("--image-seed", dest="image_seed", type=int, default=None,
                         help="seed of this image (default: --seed)")
    song = generate.add_argument_group("Music", "for a music model (e.g. --model omni-tones-tiny): writes a WAV")
    song.add_argument("--lyrics", default=None, help="structure-tagged lyrics, e.g. '[verse]\\nla la'")
    song.add_argument("--max-new-tokens", dest="max_new_tokens", type=int, default=None,
                      help="cap on audio frames (default: the model's maximum)")
    _add_engine_arguments(generate, model_positional=False)
    return parser


_ENGINE_KEYS = set(ServerConfig.__struct_fields__)


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    file_values = load_config_file(args.config_file) if args.config_file else {}
    flags = {key: value for key, value in vars(args).items() if key in _ENGINE_KEYS}
    return build_config(file_values, **flags)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
        if config.world_size > 1:
            from omni_server.workers import check_parallel_config

            check_parallel_config(config, serving=args.command == "serve")
    except ConfigError as exc:
        parser.exit(2, f"omni-server: error: {exc}\n")
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    problem = _model_problem(config)
    if problem is not None:
        parser.exit(2, f"omni-server: error: {problem}\n")
    if args.command == "serve":
        from omni_server.serve import serve

        return serve(config)
    return _generate(args, config)


def _model_problem(config: ServerConfig) -> str | None:
    """Why the model cannot be loaded (one line: the file and the problem), checked before anything starts."""
    from omni_models import CheckpointError, InvalidRequestError, MissingDependencyError

    from omni_server.audio import is_music_model
    from omni_server.loader import check_model

    if is_music_model(config.model):
        return None  # a music model: its pipeline checks its own files when it loads
    try:
        check_model(config)
    except (CheckpointError, InvalidRequestError, MissingDependencyError) as exc:
        return " ".join(str(exc).split())
    return None


def _generate(args: argparse.Namespace, config: ServerConfig) -> int:
    if args.lyrics is not None:
        from omni_server.audio import generate_song

        return generate_song(args, config)
    from omni_server.generate import GenerateError, generate_to_files

    try:
        paths = generate_to_files(
            config, prompt=args.prompt, output=Path(args.output), n=args.n, negative_prompt=args.negative_prompt,
            num_inference_steps=args.num_inference_steps, guidance_scale=args.guidance_scale,
            true_cfg_scale=args.true_cfg_scale, size=args.size,
            seed=args.image_seed if args.image_seed is not None else config.seed,
        )
    except GenerateError as exc:
        print(f"omni-server: error: {exc}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
