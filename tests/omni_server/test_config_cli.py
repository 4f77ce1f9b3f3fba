"""Config model and CLI parsing: precedence, validation messages, grouped help. No model is loaded."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

from omni_server.cli import build_parser, config_from_args
from omni_server.config import ConfigError, ServerConfig, build_config, load_config_file, parse_human_int


def _config(argv: list[str]) -> ServerConfig:
    return config_from_args(build_parser().parse_args(argv))


@pytest.mark.parametrize(
    ("text", "value"),
    [("4096", 4096), ("1k", 1000), ("1K", 1024), ("512M", 512 * 2**20), ("1.5g", 1_500_000_000), ("0", 0)],
)
def test_human_readable_ints(text: str, value: int) -> None:
    assert parse_human_int(text) == value


@pytest.mark.parametrize("text", ["1.5G", "lots", "1e9", "12.5", ""])
def test_human_readable_ints_reject_ambiguous_input(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_human_int(text)


def test_flags_override_yaml_which_overrides_defaults(tmp_path) -> None:
    path = tmp_path / "server.yaml"
    path.write_text("max_num_seqs: 4\nkv_cache_memory_bytes: 64M\nport: 9000\ndevice: cpu\n")
    config = _config(["serve", "--config", str(path), "--port", "9100"])
    assert config.max_num_seqs == 4  # from the file
    assert config.kv_cache_memory_bytes == 64 * 2**20  # human-readable in YAML too
    assert config.port == 9100  # the flag wins
    assert config.block_size == ServerConfig().block_size  # the default
    assert config.model == "omni-shapes-tiny"


def test_yaml_accepts_dashed_keys_and_empty_files(tmp_path) -> None:
    path = tmp_path / "a.yaml"
    path.write_text("max-num-seqs: 3\n")
    assert load_config_file(path) == {"max_num_seqs": 3}
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config_file(empty) == {}


@pytest.mark.parametrize(
    ("yaml_text", "fragment"),
    [
        ("max_num_seq: 4\n", "unknown setting(s) in config file: max_num_seq"),
        ("- 1\n- 2\n", "must contain a mapping"),
        ("port: [\n", "not valid YAML"),
        ("port: eighty\n", "$.port"),
    ],
)
def test_bad_config_files_name_the_problem(tmp_path, yaml_text: str, fragment: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError, match=None) as info:
        _config(["serve", "--config", str(path)])
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (
            ["--gpu-memory-utilization", "1.5"],
            "gpu_memory_utilization must be <= 1.0; got 1.5 (--gpu-memory-utilization)",
        ),
        (["--gpu-memory-utilization", "0"], "gpu_memory_utilization must be > 0.0"),
        (["--kv-cache-memory-bytes", "-1"], "kv_cache_memory_bytes must be >= 0; got -1"),
        (["--max-model-len", "0"], "max_model_len must be positive or -1"),
        (["--max-num-seqs", "0"], "max_num_seqs must be >= 1; got 0 (--max-num-seqs)"),
        (["--block-size", "12"], "block_size must be a positive power of two"),
        (["--device", "tpu"], "device must be 'auto', 'cpu', 'cuda' or 'cuda:N'"),
        (["--kv-cache-memory-bytes", "1.5G"], "decimals are not allowed"),
        (["--api-key", " "], "api_key must be a key that is not blank"),
        (["--offload-allgather", "--enable-layerwise-offload"], "needs --sequence-parallel-size >= 2"),
        (["--enforce-eager", "--compile-cache-dir", "/tmp/c"], "--enforce-eager compiles nothing"),
        (["--prompt-embed-cache-size", "-1"], "prompt_embed_cache_size must be >= 0"),
    ],
)
def test_invalid_settings_fail_at_start_with_what_to_change(argv: list[str], fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        _config(["serve", *argv])
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (
            ["--offload-resident-blocks", "2"],
            "apply to layerwise offload; turn on layerwise_offload "
            "(--enable-layerwise-offload, --offload-resident-blocks",
        ),
        (["--fp8-cache-dir", "/tmp/x"], "needs quantization='fp8' (--quantization, --fp8-cache-dir)"),
        (
            [
                "--enable-layerwise-offload",
                "--offload-resident-blocks",
                "1",
                "--offload-allgather",
                "--sequence-parallel-size",
                "5",
            ],
            "use_allgather",
        ),
        (["--sequence-parallel-size", "3"], "--sequence-parallel-size: "),  # 5 heads: 3 does not divide them
        (
            ["omni-tones-tiny", "--quantization", "fp8"],
            "--quantization: omni-tones-tiny (omni-music) does not support it",
        ),
        (  # the shipped default, the causal-prefix DiT, attends through its paged K/V cache
            ["--attention-dtype", "fp8"],
            "--attention-dtype: omni-shapes-tiny (omni-dit) does not support it; drop --attention-dtype",
        ),
    ],
)
def test_library_rules_are_checked_with_the_library_before_anything_starts(argv: list[str], fragment: str) -> None:
    from omni_server.startup import check_startup

    with pytest.raises(ConfigError) as info:
        check_startup(_config(["serve", *argv]))
    assert fragment in str(info.value)


def test_every_setting_is_a_flag_declared_once() -> None:
    """The CLI is generated from ServerConfig: each field has its flag, type and group, and a YAML key."""
    from omni_server.config import FIELD_NAMES, flag

    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore[union-attr]
    for name in FIELD_NAMES:
        if name != "model":
            assert flag(name) in help_text, name
    config = _config(
        ["serve", "--cfg-parallel-size", "2", "--no-warmup", "--allowed-origins", "a,b", "--request-timeout", "5"]
    )
    assert (config.cfg_parallel_size, config.warmup, config.allowed_origins, config.request_timeout_s) == (
        2,
        False,
        ["a", "b"],
        5.0,
    )
    with pytest.raises(SystemExit):  # choices come from the field's Literal
        _config(["serve", "--cfg-parallel-size", "3"])


def test_valid_combinations_are_accepted() -> None:
    config = _config(
        [
            "serve",
            "my-model",
            "--device",
            "cuda:1",
            "--enable-layerwise-offload",
            "--offload-resident-blocks",
            "2",
            "--quantization",
            "fp8",
            "--fp8-cache-dir",
            "/tmp/fp8",
            "--max-model-len",
            "-1",
            "--served-model-name",
            "shapes",
        ]
    )
    assert (config.model, config.device, config.offload_resident_blocks) == ("my-model", "cuda:1", 2)
    assert config.max_model_len == -1
    assert config.model_name == "shapes"


def test_config_travels_to_the_engine_process_as_msgpack() -> None:
    config = build_config(None, max_num_seqs=3, kv_cache_memory_bytes="1M")
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(config), type=ServerConfig) == config


def test_cli_exits_2_with_the_message_on_a_bad_combination() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "omni_server", "serve", "--fp8-cache-dir", "/tmp/x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "needs quantization='fp8' (--quantization, --fp8-cache-dir)" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_help_is_grouped_like_vllm_serve() -> None:
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore[union-attr]
    for group in (
        "ModelConfig:",
        "CacheConfig:",
        "SchedulerConfig:",
        "OffloadConfig:",
        "QuantizationConfig:",
        "Frontend:",
    ):
        assert group in help_text
    for flag in (
        "--kv-cache-memory-bytes",
        "--gpu-memory-utilization",
        "--max-model-len",
        "--max-num-seqs",
        "--enable-layerwise-offload",
        "--quantization",
        "--fp8-cache-dir",
        "--host",
        "--port",
    ):
        assert flag in help_text


def test_the_server_compiles_only_on_cuda_for_kinds_that_can_and_never_under_offload() -> None:
    from omni_models import Capabilities, ModelSpec
    from omni_server.startup import compiles, serving_options

    spec = ModelSpec(
        kind="flux",
        directory="/x",
        info=None,
        capabilities=Capabilities(
            fp8=True,
            layerwise_offload=True,
            offload_allgather=False,
            cfg_parallel=True,
            sequence_parallel=True,
            compile=True,
            prompt_embed_cache=True,
            batched_image_tokens=True,
        ),
    )
    cuda = build_config(None, device="cuda")
    assert compiles(cuda, spec)  # the default: compiled
    assert not compiles(build_config(None, device="cuda", enforce_eager=True), spec)
    assert not compiles(build_config(None, device="cuda", enable_layerwise_offload=True), spec)
    assert not compiles(build_config(None, device="cpu"), spec)  # CPU (CI) stays eager
    music = msgspec.structs.replace(spec, capabilities=msgspec.structs.replace(spec.capabilities, compile=False))
    assert not compiles(cuda, music)
    options = serving_options(build_config(None, device="cuda", compile_cache_dir="/c"), spec)
    assert options == {
        "compile": True,
        "compile_cache_dir": "/c",
        "prompt_embed_cache_size": 32,
        "max_batched_image_tokens": 4096,
        "attention_dtype": "auto",
    }
    cpu = serving_options(build_config(None, device="cpu", compile_cache_dir="/c", attention_dtype="fp8"), music)
    assert cpu == {
        "compile": False,
        "compile_cache_dir": None,
        "prompt_embed_cache_size": 32,
        "max_batched_image_tokens": 4096,
        "attention_dtype": "fp8",
    }
    plain = msgspec.structs.replace(
        music, capabilities=msgspec.structs.replace(music.capabilities, batched_image_tokens=False)
    )
    assert (
        serving_options(build_config(None, device="cpu", max_batched_image_tokens=64), plain)[
            "max_batched_image_tokens"
        ]
        == 0
    )


FRONT_PROCESS = """
import sys
from omni_server.api import create_app
from omni_server.config import ServerConfig
from omni_server.startup import check_startup

config = ServerConfig(device="cpu")
check_startup(config)
create_app(config)
print(sorted(m for m in ("torch", "numpy", "PIL", "safetensors", "vllm", "diffusers") if m in sys.modules))
"""


def test_the_api_process_checks_the_model_and_builds_its_app_without_torch() -> None:
    """`serve --device cpu`: the front process reads the model's metadata only; torch loads in the engine process."""
    done = subprocess.run([sys.executable, "-c", FRONT_PROCESS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
