"""Prompt building of the music family (spec B.4): lyrics normalization, caption cleaning, the CFG twin."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omni_models.errors import InvalidRequestError
from omni_models.music.config import AUDIO_CFG, AUDIO_START, IM_END, IM_START, MusicConfig
from omni_models.music.prompt import (
    MusicTokenizer,
    build_cfg_null_token_ids,
    build_prompt,
    clean_caption,
    normalize_lyrics,
)


def test_prompt_is_one_flat_string_with_the_fixed_framing() -> None:
    prompt = build_prompt("lo-fi", "[Verse]\nhello")
    assert prompt.startswith("<|im_start|><|caption_start|>")
    assert prompt.endswith("<|im_end|><|audio_start|>")
    assert prompt.index("<|caption_end|>") < prompt.index("<|lyrics_start|>")


def test_lyrics_keep_tags_on_their_own_lines_lower_cased() -> None:
    assert "[verse]\nWalking down the street" in normalize_lyrics("[Verse]\nWalking down the street")
    assert normalize_lyrics("[Verse] Walking down the street") == "[start]\n[verse]"  # the lyric is lost: documented
    assert normalize_lyrics("a [chorus]") == "[start]\na\n[chorus]"
    assert normalize_lyrics("one ^ two") == "[start]\none\ntwo"


def test_caption_cannot_carry_special_tokens_or_markdown() -> None:
    assert clean_caption("<|genre pop|>") == "genre is pop"
    assert clean_caption("<|tag|>") == "tag"
    assert "<|" not in clean_caption("x <|audio_end|> y <|a b|>")
    assert clean_caption("## Heading") == "Heading"
    assert clean_caption("**bold**") == "bold"
    assert clean_caption("- item") == "item"
    assert clean_caption("a\n\nb") == "a\nb"
    assert clean_caption("a\n\n\n\nb") == "a\nb"


def test_null_twin_keeps_length_and_framing_and_does_not_mutate() -> None:
    ids = [IM_START, 40, 41, 42, IM_END, AUDIO_START]
    twin = build_cfg_null_token_ids(ids)
    assert twin == [IM_START, AUDIO_CFG, AUDIO_CFG, AUDIO_CFG, IM_END, AUDIO_START]
    assert ids == [IM_START, 40, 41, 42, IM_END, AUDIO_START]
    minimal = [IM_START, AUDIO_CFG, IM_END, AUDIO_START]
    assert build_cfg_null_token_ids(minimal) == minimal


@pytest.mark.parametrize(
    ("ids", "fragment"), [([IM_START, IM_END, AUDIO_START], "too short"), ([1, 2, 3, IM_END, AUDIO_START], "framing")]
)
def test_null_twin_rejects_bad_prompts(ids: list[int], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        build_cfg_null_token_ids(ids)


def test_tokenizer_requires_caption_and_lyrics_and_bounds_length() -> None:
    tokenizer = MusicTokenizer(MusicConfig.from_dict(json.loads((shipped_dir() / "config.json").read_text())))
    ids = tokenizer.encode("a calm piano melody at 90 bpm in c major", "[verse]\nla la")
    assert ids[0] == IM_START and ids[-2:] == [IM_END, AUDIO_START]
    with pytest.raises(InvalidRequestError) as blank:
        tokenizer.encode("  ", "[verse]")
    assert blank.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as lyrics:
        tokenizer.encode("calm", "")
    assert lyrics.value.param == "lyrics"
    with pytest.raises(InvalidRequestError, match="Shorten the caption or the lyrics"):
        tokenizer.encode("calm", "la " * 500)


def shipped_dir() -> Path:
    import omni_models

    return Path(omni_models.__file__).parent / "weights" / "omni-tones-tiny"
