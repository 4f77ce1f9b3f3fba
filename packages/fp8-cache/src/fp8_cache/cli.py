"""``fp8-cache build|inspect|verify``.

Exit codes: 0 success; 1 the artifact is missing/invalid (inspect, verify) or the build failed; 2 bad usage.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import msgspec

from fp8_cache.artifact import DEFAULT_COMPONENT, check_artifact, dump_json, verify_artifact
from fp8_cache.build import DEFAULT_MAX_SHARD_BYTES, build_fp8_cache

EXIT_OK = 0
EXIT_INVALID = 1
EXIT_USAGE = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fp8-cache", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="quantize a component's safetensors and publish the cache")
    build.add_argument("src", help="a .safetensors file or a directory of them (one model component)")
    build.add_argument("dst", help="cache directory to publish (created atomically)")
    build.add_argument("--component", default=DEFAULT_COMPONENT, help="component name (default: %(default)s)")
    build.add_argument(
        "--ignore",
        action="append",
        default=[],
        metavar="PATTERN",
        help="fnmatch pattern of module names to keep in high precision (repeatable)",
    )
    build.add_argument("--device", default="cpu", help="device to quantize on (default: %(default)s)")
    build.add_argument("--max-shard-bytes", type=int, default=DEFAULT_MAX_SHARD_BYTES)
    for name, text in (
        ("inspect", "print the manifest summary of a valid cache"),
        ("verify", "check a cache fully, including every shard's SHA-256"),
    ):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("dst", help="cache directory")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on bad usage and 0 on --help
        return int(exc.code or 0)
    if args.command == "build":
        try:
            result = build_fp8_cache(
                args.src,
                args.dst,
                component=args.component,
                ignore=args.ignore,
                device=args.device,
                max_shard_bytes=args.max_shard_bytes,
            )
        except (OSError, ValueError, TypeError, RuntimeError) as exc:
            print(f"fp8-cache build failed: {exc}", file=sys.stderr)
            return EXIT_INVALID
        manifest = result.manifest
        print(
            f"{result.action}: {result.cache_dir} ({manifest.tensor_count} tensors, "
            f"{len(manifest.quantized_tensors)} FP8, {manifest.total_size} bytes)"
        )
        return EXIT_OK
    if args.command == "inspect":
        manifest, reason = check_artifact(args.dst)
    else:
        manifest, reason = verify_artifact(args.dst)
    if manifest is None:
        print(f"invalid FP8 cache at {args.dst}: {reason}", file=sys.stderr)
        return EXIT_INVALID
    if args.command == "inspect":
        summary = msgspec.structs.asdict(manifest)
        summary["shards"] = len(manifest.shards)
        summary["quantized_tensor_count"] = len(summary.pop("quantized_tensors"))
        print(dump_json(summary).decode(), end="")
    else:
        print(f"ok: {args.dst} ({manifest.tensor_count} tensors, {len(manifest.shards)} shards verified)")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
