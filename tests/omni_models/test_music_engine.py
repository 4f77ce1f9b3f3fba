"""The music AR stage end to end on vLLM's real engine (CPU): the shipped omni-tones-tiny talker registered
out of tree, guided frames drawn per CFG pair, pairs kept step-locked by cfg-pairing's scheduler."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="the music AR stage runs on vLLM: pip install 'omni-models[music]'")

import omni_models  # noqa: E402
from omni_models.music._vllm import ARStage, SongRequest  # noqa: E402
from omni_models.music.backbone import MusicBackbone  # noqa: E402
from omni_models.music.config import MusicConfig  # noqa: E402
from omni_models.music.pipeline import codes_from_spans  # noqa: E402
from omni_models.music.prompt import MusicTokenizer  # noqa: E402

MODEL_DIR = Path(omni_models.__file__).parent / "weights" / "omni-tones-tiny"
CONFIG = MusicConfig.from_dict(json.loads((MODEL_DIR / "config.json").read_text()))
TOKENIZER = MusicTokenizer(CONFIG)
LYRICS = "[verse]\nla la love\n[chorus]\noh oh shine"


def song(
    pair_id: str, seed: int, caption: str = "a calm piano melody at 90 bpm in c major", frames: int = 40
) -> SongRequest:
    return SongRequest(pair_id, TOKENIZER.encode(caption, LYRICS), seed, frames)


@pytest.fixture(scope="module")
def stage() -> ARStage:
    return ARStage(MODEL_DIR, CONFIG, max_num_seqs=8)


def free_blocks(stage: ARStage) -> int:
    return stage.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def members(stage: ARStage, pair_id: str) -> dict[str, object]:
    """The pair's live requests in the scheduler by role (vLLM renames requests with a random tail)."""
    out = {}
    for request in stage.scheduler.requests.values():
        extra = request.sampling_params.extra_args or {}
        if extra.get("cfg_pair_id") == pair_id:
            out[extra["cfg_role"]] = request
    return out


def run_locked(stage: ARStage, songs: list[SongRequest]) -> dict[str, list]:
    """Run to completion asserting after every step that each pair's members stand at the same position."""
    for s in songs:
        stage.add(s)
    seen_running = set()
    while stage.has_unfinished():
        stage.step()
        for s in songs:
            pair = members(stage, s.pair_id)
            assert len(pair) in (0, 2), f"{s.pair_id}: one member finished alone"
            if pair:
                seen_running.add(s.pair_id)
                assert pair["cond"].num_computed_tokens == pair["uncond"].num_computed_tokens
                assert pair["cond"].num_tokens == pair["uncond"].num_tokens
    assert seen_running == {s.pair_id for s in songs}
    return {s.pair_id: stage.take_spans(s.pair_id) for s in songs}


def test_the_vllm_talker_matches_the_plain_torch_backbone(stage: ARStage) -> None:
    reference = MusicBackbone(CONFIG)
    from safetensors.torch import load_file

    reference.load_state_dict({k: v.float() for k, v in load_file(str(MODEL_DIR / "ar.safetensors")).items()})
    ids = song("ref", 0).prompt_ids
    stage.add(SongRequest("ref", ids, 0, 1))
    stage.step()  # prefill both rows and draw the first frame
    hidden = stage.runtime.sample_hidden
    with torch.no_grad():
        expected = reference.hidden(reference.embed(torch.tensor([ids])))[0, -1]
    assert torch.allclose(hidden[0].float(), expected, atol=2e-3), (hidden[0] - expected).abs().max()
    while stage.has_unfinished():
        stage.step()
    stage.take_spans("ref")


def test_concurrent_songs_never_cross(stage: ARStage) -> None:
    baseline = free_blocks(stage)
    alone = {seed: run_locked(stage, [song(f"alone-{seed}", seed, frames=56)])[f"alone-{seed}"] for seed in (3, 4)}
    together = run_locked(stage, [song("both-3", 3, frames=56), song("both-4", 4, frames=56)])
    for seed, key in ((3, "both-3"), (4, "both-4")):
        spans_alone, spans_together = alone[seed], together[key]
        assert [(s.start, s.codes.shape[0], s.last_chunk, s.audio_seed) for s in spans_together] == [
            (s.start, s.codes.shape[0], s.last_chunk, s.audio_seed) for s in spans_alone
        ]
        assert all(s.audio_seed == seed for s in spans_together)
        assert sum(s.last_chunk for s in spans_together) == 1 and spans_together[-1].last_chunk
        assert torch.equal(codes_from_spans(spans_together), codes_from_spans(spans_alone))
    assert not torch.equal(codes_from_spans(together["both-3"]), codes_from_spans(together["both-4"]))
    assert free_blocks(stage) == baseline


def test_every_draw_sees_both_rows_in_lockstep(stage: ARStage) -> None:
    runtime = stage.runtime
    first, lone_before = len(runtime.pair_steps), runtime.lone_rows
    run_locked(stage, [song("lock-a", 1), song("lock-b", 2, caption="loud organ piece in a minor at 150 bpm")])
    steps = runtime.pair_steps[first:]
    assert {p.pair_id for p in steps} == {"lock-a", "lock-b"}
    assert all(p.cond_tokens == p.uncond_tokens for p in steps)
    assert runtime.lone_rows == lone_before


def test_aborting_one_member_ends_the_pair_and_frees_both_rows(stage: ARStage) -> None:
    baseline = free_blocks(stage)
    stage.add(song("abort-me", 5, frames=120))
    stage.add(song("keep", 6, frames=24))
    for _ in range(4):
        stage.step()
    assert free_blocks(stage) < baseline
    assert set(members(stage, "abort-me")) == {"cond", "uncond"}
    cond = members(stage, "abort-me")["cond"]
    stage.engine.abort_request([cond.request_id], internal=True)  # one member only: the scheduler ends the pair
    scheduler = stage.scheduler
    assert members(stage, "abort-me") == {}
    assert set(members(stage, "keep")) == {"cond", "uncond"}
    stage.abort("abort-me")  # the front end forgets both ids
    while stage.has_unfinished():
        stage.step()
    assert stage.take_spans("keep")[-1].last_chunk
    assert free_blocks(stage) == baseline
    assert scheduler._cfg_pairs == {} and scheduler._cfg_req_to_pair == {}
    assert "abort-me" not in stage.runtime.songs


def test_preemption_does_not_leak_and_the_pool_returns_to_baseline() -> None:
    # 17 blocks of 32 tokens (one is vLLM's null block; 16 hold one 512-token row): three songs, six rows of
    # ~30 prompt + 150 frames, cannot all stay resident.
    small = ARStage(MODEL_DIR, CONFIG, max_num_seqs=6, num_blocks=17)
    baseline = free_blocks(small)
    songs = [song(f"tight-{i}", i, frames=150) for i in range(3)]
    for s in songs:
        small.add(s)
    preempted, steps = 0, 0
    while small.has_unfinished():
        small.step()
        steps += 1
        assert steps < 2000, "the engine stopped making progress"
        preempted = max(preempted, sum(r.num_preemptions for r in small.scheduler.requests.values()))
    assert preempted > 0, "the pool was large enough that nothing was preempted"
    for s in songs:
        small.take_spans(s.pair_id)
    assert free_blocks(small) == baseline
    assert small.scheduler._cfg_pairs == {} and small.scheduler._cfg_req_to_pair == {}
    assert small.runtime.songs == {} or all(state.finished for state in small.runtime.songs.values())
