"""Random-weight FLUX.1, Qwen-Image and Wan pipelines for tests and benchmarks, built without the Hugging Face Hub.

Test and benchmark tooling (it needs the ``diffusers`` extra, like ``omni_models.diffusers_adapter``):

- tokenizers written from a word list: a CLIP BPE vocabulary, a T5 Unigram model (``tokenizers``) wrapped in
  ``T5TokenizerFast``, and a Qwen2 byte-level BPE. Their vocabularies hold the given words (T5 as whole
  pieces; the BPEs merge letters towards them, so a word may still come out as a few tokens);
- ``flux_components`` / ``qwen_image_components``: the diffusers pipeline's constructor arguments with random
  weights, at ``"tiny"`` size (for CPU tests) or ``"full"`` size (FLUX.1-dev / Qwen-Image transformers and VAEs,
  CLIP-L whole; T5-XXL and Qwen2.5-VL-7B keep their width but only ``text_encoder_layers`` layers);
- ``wan_components``: ``WanPipeline``'s arguments, tiny, for Wan2.1, Wan2.2 A14B (two experts) and Wan2.2 TI2V;
- ``random_parameters``: build a model with parameters on the meta device, then fill them with cheap random
  values on the target device (no CPU initialisation of billions of parameters);
- ``save_checkpoint``: the diffusers layout (``save_pretrained``), sharded when asked;
- ``random_lora`` / ``save_lora``: a PEFT LoRA adapter for a family transformer (PEFT injects the layers into a
  meta-device copy, so its key names, shapes and config are PEFT's own; the values are random), written with the
  pipeline's own ``save_lora_weights`` (needs ``peft``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from omni_models.diffusers_adapter import library_class, parameters_on_meta

Size = Literal["tiny", "full"]
# The Qwen-Image pipeline's prompt template words, so the synthetic tokenizer splits it into whole words too.
QWEN_TEMPLATE_WORDS = (
    "system Describe the image by detailing the color shape size texture quantity text spatial "
    "relationships of the objects and background user assistant"
).split()
DEFAULT_WORDS = tuple(
    "a an the red orange yellow green blue purple white black circle square triangle diamond cat dog fox photo "
    "of in on at top left right bottom center background snow forest city night bad quality blurry".split()
)


def _words(extra: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(w.lower() for w in (*DEFAULT_WORDS, *QWEN_TEMPLATE_WORDS, *extra)))


# --- tokenizers --------------------------------------------------------------------------------------------------


def _word_merges(symbols: list[str], vocab: dict[str, int], merges: list[tuple[str, str]]) -> None:
    """Left-to-right merges that build ``symbols`` into one token."""
    while len(symbols) > 1:
        merged = symbols[0] + symbols[1]
        merges.append((symbols[0], symbols[1]))
        vocab.setdefault(merged, len(vocab))
        symbols = [merged, *symbols[2:]]


def clip_tokenizer(words: Iterable[str] = ()) -> Any:
    """A CLIP BPE tokenizer (``</w>`` word ends): every letter, and merges towards each given word."""
    letters = "abcdefghijklmnopqrstuvwxyz0123456789.,:;!?'-"
    vocab: dict[str, int] = {}
    for c in letters:
        vocab[c] = len(vocab)
    for c in letters:
        vocab[c + "</w>"] = len(vocab)
    merges: list[tuple[str, str]] = []
    for word in _words(words):
        if word.isalnum() and len(word) > 1:
            _word_merges([*word[:-1], word[-1] + "</w>"], vocab, merges)
    merges = list(dict.fromkeys(merges))
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return library_class("transformers", "CLIPTokenizer")(vocab=vocab, merges=merges, model_max_length=77)


def t5_tokenizer(words: Iterable[str] = ()) -> Any:
    """A T5 Unigram tokenizer: ``<pad>``=0, ``</s>``=1, ``<unk>``=2, then ``▁word`` pieces and single letters."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -3.0)]
    pieces += [("▁" + w, -1.0) for w in _words(words)]
    pieces += [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:;!?'-"]
    tokenizer = Tokenizer(models.Unigram(pieces, unk_id=2, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
    )
    return library_class("transformers", "T5TokenizerFast")(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        extra_ids=0,
        model_max_length=512,
    )


def qwen2_tokenizer(words: Iterable[str] = ()) -> Any:
    """A Qwen2 byte-level BPE tokenizer (all 256 byte symbols), merges towards each word, and the chat specials."""
    from tokenizers import pre_tokenizers

    vocab = {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges: list[tuple[str, str]] = []
    for word in _words(words):
        for form in (word, "Ġ" + word, word.capitalize(), "Ġ" + word.capitalize()):
            _word_merges(list(form), vocab, merges)
    tokenizer = library_class("transformers", "Qwen2Tokenizer")(
        vocab=vocab,
        merges=list(dict.fromkeys(merges)),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return tokenizer


# --- random parameters -------------------------------------------------------------------------------------------


def random_parameters(
    build: Callable[[], nn.Module],
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    seed: int = 0,
    std: float | None = None,
) -> nn.Module:
    """``build()`` with parameters drawn on ``device``: N(0, 1/fan_in) for weights (``std`` overrides), 0 for
    biases, 1 for norm scales. Buffers are built as the model builds them and moved to ``device``."""
    with parameters_on_meta():
        model = build()
    generator = torch.Generator(device).manual_seed(seed)
    drawn: dict[int, nn.Parameter] = {}  # tied parameters (one object in several modules) stay tied
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) in drawn:
                module._parameters[name] = drawn[id(param)]
                continue
            value = torch.empty(param.shape, dtype=dtype, device=device)
            if name == "bias":
                value.zero_()
            elif param.ndim == 1:
                value.fill_(1.0)
            else:
                fan_in = math.prod(param.shape[1:])
                value.normal_(0.0, std if std is not None else fan_in**-0.5, generator=generator)
            module._parameters[name] = drawn[id(param)] = nn.Parameter(value, requires_grad=False)
    return nn.Module.to(model, device=device, dtype=dtype).eval()


def _make(library: str, name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    return lambda: library_class(library, name)(**kwargs)


def _make_text_model(model: str, config: str, **kwargs: Any) -> Callable[[], nn.Module]:
    return lambda: library_class("transformers", model)(library_class("transformers", config)(**kwargs))


# --- family components -------------------------------------------------------------------------------------------


def flux_components(
    size: Size = "tiny",
    *,
    guidance_embeds: bool = True,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    text_encoder_layers: int = 2,
    words: Iterable[str] = (),
    seed: int = 0,
) -> dict[str, Any]:
    """``FluxPipeline`` constructor arguments with random weights (``guidance_embeds``: dev; without: schnell)."""
    clip, t5 = clip_tokenizer(words), t5_tokenizer(words)
    if size == "tiny":
        transformer = _make(
            "diffusers",
            "FluxTransformer2DModel",
            patch_size=1,
            in_channels=16,
            num_layers=1,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            axes_dims_rope=[4, 4, 8],
            guidance_embeds=guidance_embeds,
        )
        vae = _make(
            "diffusers",
            "AutoencoderKL",
            in_channels=3,
            out_channels=3,
            block_out_channels=(4,),
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=1,
            sample_size=32,
            use_quant_conv=False,
            use_post_quant_conv=False,
            shift_factor=0.0609,
            scaling_factor=1.5035,
        )
        clip_config = dict(
            hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4, projection_dim=32
        )
        t5_config = dict(d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4)
    else:  # FLUX.1-dev's transformer and VAE, CLIP-L whole; T5-XXL's width with ``text_encoder_layers`` layers
        transformer = _make("diffusers", "FluxTransformer2DModel", guidance_embeds=guidance_embeds)
        vae = _make(
            "diffusers",
            "AutoencoderKL",
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(128, 256, 512, 512),
            layers_per_block=2,
            latent_channels=16,
            norm_num_groups=32,
            sample_size=1024,
            use_quant_conv=False,
            use_post_quant_conv=False,
            shift_factor=0.1159,
            scaling_factor=0.3611,
        )
        clip_config = dict(
            hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, projection_dim=768
        )
        t5_config = dict(
            d_model=4096,
            d_kv=64,
            d_ff=10240,
            num_layers=text_encoder_layers,
            num_heads=64,
            feed_forward_proj="gated-gelu",
        )
    eos = len(clip) - 1
    text_encoder = _make_text_model(
        "CLIPTextModel",
        "CLIPTextConfig",
        vocab_size=len(clip),
        bos_token_id=eos - 1,
        eos_token_id=eos,
        pad_token_id=eos,
        max_position_embeddings=77,
        **clip_config,
    )
    text_encoder_2 = _make_text_model(
        "T5EncoderModel", "T5Config", vocab_size=len(t5), decoder_start_token_id=0, **t5_config
    )
    built = {
        name: random_parameters(make, device=device, dtype=dtype, seed=seed + i)
        for i, (name, make) in enumerate(
            (
                ("transformer", transformer),
                ("vae", vae),
                ("text_encoder", text_encoder),
                ("text_encoder_2", text_encoder_2),
            )
        )
    }
    scheduler = library_class("diffusers", "FlowMatchEulerDiscreteScheduler")(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    return {**built, "tokenizer": clip, "tokenizer_2": t5, "scheduler": scheduler}


# Qwen2.5-VL's vision special tokens and the config fields naming their ids.
VISION_TOKENS = {
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
    "vision_token_id": "<|vision_pad|>",
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
}


def qwen_image_components(
    size: Size = "tiny",
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    text_encoder_layers: int = 2,
    words: Iterable[str] = (),
    seed: int = 0,
) -> dict[str, Any]:
    """``QwenImagePipeline`` constructor arguments with random weights."""
    tokenizer = qwen2_tokenizer(words)
    # The vision tokens' ids come right after the vocabulary, in VISION_TOKENS' order.
    tokenizer.add_tokens(list(VISION_TOKENS.values()), special_tokens=True)
    specials = {name: tokenizer.convert_tokens_to_ids(token) for name, token in VISION_TOKENS.items()}
    vocab_size = len(tokenizer)
    token_ids = {
        "bos_token_id": None,
        "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
        "pad_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    }
    if size == "tiny":
        transformer = _make(
            "diffusers",
            "QwenImageTransformer2DModel",
            patch_size=2,
            in_channels=16,
            out_channels=4,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=3,
            joint_attention_dim=16,
            axes_dims_rope=(8, 4, 4),
        )
        vae = _make(
            "diffusers",
            "AutoencoderKLQwenImage",
            base_dim=24,
            z_dim=4,
            dim_mult=[1, 2, 4],
            num_res_blocks=1,
            temperal_downsample=[False, True],
            latents_mean=[0.0] * 4,
            latents_std=[1.0] * 4,
        )
        text = dict(
            hidden_size=16,
            intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default"},
        )
        vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16)
    else:  # Qwen-Image's transformer and VAE; Qwen2.5-VL-7B's text width with fewer layers, a 1-block vision tower
        transformer = _make("diffusers", "QwenImageTransformer2DModel")
        vae = _make("diffusers", "AutoencoderKLQwenImage")
        text = dict(
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=text_encoder_layers,
            num_attention_heads=28,
            num_key_value_heads=4,
            rms_norm_eps=1e-6,
            rope_scaling={"mrope_section": [16, 24, 24], "rope_type": "default"},
        )
        vision = dict(depth=1, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584)
    text_encoder = _make_text_model(
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen2_5_VLConfig",
        text_config={**text, **token_ids, "vocab_size": vocab_size, "rope_theta": 1000000.0},
        vision_config=vision,
        vocab_size=vocab_size,
        **specials,
        **token_ids,
    )
    built = {
        name: random_parameters(make, device=device, dtype=dtype, seed=seed + i)
        for i, (name, make) in enumerate((("transformer", transformer), ("vae", vae), ("text_encoder", text_encoder)))
    }
    # A dynamic-shift flow-matching schedule like the published Qwen-Image one (it sets sigmas only, not cost).
    scheduler = library_class("diffusers", "FlowMatchEulerDiscreteScheduler")(
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        base_image_seq_len=256,
        max_image_seq_len=8192,
        shift_terminal=0.02,
        time_shift_type="exponential",
    )
    return {**built, "tokenizer": tokenizer, "scheduler": scheduler}


WanVariant = Literal["wan2.1", "wan2.2-a14b", "wan2.2-ti2v"]
WanSize = Literal["tiny", "1.3b", "14b"]
# The released Wan2.1 / Wan2.2-A14B transformers (1.3B: Wan2.1-T2V-1.3B; 14B: Wan2.1-T2V-14B and each A14B expert).
WAN_TRANSFORMERS: dict[str, dict[str, Any]] = {
    "1.3b": dict(num_attention_heads=12, ffn_dim=8960, num_layers=30),
    "14b": dict(num_attention_heads=40, ffn_dim=13824, num_layers=40),
}


def wan_components(
    variant: WanVariant = "wan2.1",
    *,
    size: WanSize = "tiny",
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    text_encoder_layers: int = 2,
    words: Iterable[str] = (),
    boundary_ratio: float = 0.875,
    seed: int = 0,
) -> dict[str, Any]:
    """``WanPipeline`` constructor arguments with random weights: ``"wan2.1"`` (one transformer),
    ``"wan2.2-a14b"`` (two experts switched at ``boundary_ratio``), ``"wan2.2-ti2v"`` (``expand_timesteps``, a
    48-channel residual VAE with 2x2 patches; tiny only). ``size="tiny"``: 2 blocks of width 32, a 4-level VAE of
    base width 3, UMT5 of width 32 (CPU tests); ``"1.3b"`` / ``"14b"``: the released transformers and VAE, UMT5-XXL's
    width with ``text_encoder_layers`` layers (benchmarks). The scheduler is the released checkpoints' UniPC (flow
    prediction, flow sigmas, shift 3)."""
    t5 = t5_tokenizer(words)
    ti2v = variant == "wan2.2-ti2v"
    if ti2v and size != "tiny":
        raise ValueError("wan2.2-ti2v components come in the tiny size only")
    z_dim = 48 if ti2v else 16
    if size == "tiny":
        blocks: dict[str, Any] = dict(
            num_attention_heads=2,
            attention_head_dim=16,  # width 32: FP8 linears need multiples of 16
            text_dim=32,
            freq_dim=32,
            ffn_dim=32,
            num_layers=2,
            rope_max_seq_len=32,
        )
        text = dict(d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4, relative_attention_num_buckets=8)
    else:
        blocks = dict(attention_head_dim=128, text_dim=4096, freq_dim=256, rope_max_seq_len=1024)
        blocks.update(WAN_TRANSFORMERS[size])
        text = dict(
            d_model=4096,
            d_kv=64,
            d_ff=10240,
            num_layers=text_encoder_layers,
            num_heads=64,
            relative_attention_num_buckets=32,
            feed_forward_proj="gated-gelu",
        )
    transformer = _make(
        "diffusers",
        "WanTransformer3DModel",
        patch_size=(1, 2, 2),
        in_channels=z_dim,
        out_channels=z_dim,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        **blocks,
    )
    vae_config: dict[str, Any] = dict(base_dim=3, z_dim=z_dim, dim_mult=[1, 1, 1, 1], num_res_blocks=1)
    if size != "tiny":  # AutoencoderKLWan's defaults are Wan2.1's VAE
        vae_config = dict(z_dim=z_dim)
    if ti2v:  # Wan2.2's VAE layout: residual blocks, 2x2 pixel patches in and out, 16x spatial compression
        vae_config.update(
            is_residual=True,
            patch_size=2,
            in_channels=12,
            out_channels=12,
            scale_factor_spatial=16,
            latents_mean=[0.0] * z_dim,
            latents_std=[1.0] * z_dim,
        )
    vae = _make("diffusers", "AutoencoderKLWan", temperal_downsample=[False, True, True], **vae_config)
    text_encoder = _make_text_model(
        "UMT5EncoderModel",
        "UMT5Config",
        vocab_size=len(t5),
        decoder_start_token_id=0,
        **text,
    )
    makers = [("transformer", transformer), ("vae", vae), ("text_encoder", text_encoder)]
    if variant == "wan2.2-a14b":
        makers.append(("transformer_2", transformer))
    built = {
        name: random_parameters(make, device=device, dtype=dtype, seed=seed + i)
        for i, (name, make) in enumerate(makers)
    }
    scheduler = library_class("diffusers", "UniPCMultistepScheduler")(
        prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=3.0
    )
    return {
        "transformer_2": None,
        **built,
        "tokenizer": t5,
        "scheduler": scheduler,
        "boundary_ratio": boundary_ratio if variant == "wan2.2-a14b" else None,
        "expand_timesteps": ti2v,
    }


def qwen_image_edit_components(
    size: Size = "tiny",
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    text_encoder_layers: int = 2,
    words: Iterable[str] = (),
    seed: int = 0,
    native_side: int | None = None,
) -> dict[str, Any]:
    """``QwenImageEditPlusPipeline`` (and ``QwenImageEditPipeline``) constructor arguments with random weights:
    Qwen-Image's, plus the Qwen2-VL processor (Qwen2-VL's image processor defaults over the same tokenizer; built
    without torchvision). ``native_side`` (default: 64 for ``"tiny"``, the published 1024 for ``"full"``) is written
    into the VAE config as ``sample_size``: the references are encoded at the VAE area ``native_side²`` (diffusers'
    1024² scaled), so a tiny checkpoint's stay a few tokens."""
    if native_side is None and size == "tiny":
        native_side = 64
    from omni_models.diffusers_adapter import qwen2_vl_processor

    components = qwen_image_components(
        size, device=device, dtype=dtype, text_encoder_layers=text_encoder_layers, words=words, seed=seed
    )
    if native_side is not None:
        components["vae"].register_to_config(sample_size=native_side)  # read by omni as the native side
    return {**components, "processor": qwen2_vl_processor(components["tokenizer"])}


PIPELINE_CLASSES = {
    "flux": "FluxPipeline",
    "flux-kontext": "FluxKontextPipeline",
    "qwen-image": "QwenImagePipeline",
    "qwen-image-edit-plus": "QwenImageEditPlusPipeline",
    "qwen-image-edit": "QwenImageEditPipeline",
    "wan": "WanPipeline",
}


def diffusers_pipeline(family: str, components: dict[str, Any]) -> Any:
    """diffusers' own pipeline over ``components`` (the reference the parity tests and benchmarks compare with)."""
    return library_class("diffusers", PIPELINE_CLASSES[family])(**components)


def save_checkpoint(
    family: str, components: dict[str, Any], directory: Path, *, max_shard_size: str | None = None
) -> Path:
    """Write ``components`` as a diffusers-layout checkpoint (``model_index.json`` and one folder per component)."""
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    diffusers_pipeline(family, components).save_pretrained(str(directory), **kwargs)
    index = json.loads((directory / "model_index.json").read_text())  # written and well-formed
    if "processor" in index:
        # The torchvision-free processor classes are transformers' Qwen2-VL ones by name: record them so, as the
        # published checkpoints do (transformers' own Qwen2VLProcessor reads the folder where torchvision loads).
        index["processor"] = ["transformers", "Qwen2VLProcessor"]
        (directory / "model_index.json").write_text(json.dumps(index, indent=2))
        config_path = directory / "processor" / "processor_config.json"
        config = json.loads(config_path.read_text())
        config["processor_class"] = "Qwen2VLProcessor"
        config_path.write_text(json.dumps(config, indent=2))
    return directory


def random_lora(
    transformer: nn.Module,
    *,
    rank: int,
    target_modules: Iterable[str] | str,
    lora_alpha: float | None = None,
    seed: int = 0,
    std: float = 0.05,
    dtype: torch.dtype = torch.float32,
    **config: Any,
) -> tuple[dict[str, torch.Tensor], Any]:
    """(PEFT state dict, ``peft.LoraConfig``) of a LoRA on ``transformer``'s ``target_modules`` (PEFT's matching:
    module-name suffixes or a regex), with N(0, ``std``) factors. ``transformer`` is not modified."""
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

    lora_config = LoraConfig(
        r=rank,
        lora_alpha=rank if lora_alpha is None else lora_alpha,
        target_modules=target_modules if isinstance(target_modules, str) else list(target_modules),
        **config,
    )
    with parameters_on_meta():
        skeleton = type(transformer).from_config(transformer.config)
    inject_adapter_in_model(lora_config, skeleton)
    shapes = get_peft_model_state_dict(skeleton)
    generator = torch.Generator("cpu").manual_seed(seed)
    state = {name: (torch.randn(t.shape, generator=generator) * std).to(dtype) for name, t in shapes.items()}
    return state, lora_config


def save_lora(family: str, directory: Path, state: dict[str, torch.Tensor], config: Any) -> Path:
    """Write a transformer LoRA as diffusers does (``pytorch_lora_weights.safetensors`` with its PEFT config in the
    file's ``lora_adapter_metadata``); returns the file."""
    pipeline = library_class("diffusers", PIPELINE_CLASSES[family])
    pipeline.save_lora_weights(
        str(directory), transformer_lora_layers=state, transformer_lora_adapter_metadata=config.to_dict()
    )
    return directory / "pytorch_lora_weights.safetensors"
