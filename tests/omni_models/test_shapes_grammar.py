"""The shapes prompt grammar: any clause order is read as the trained order; conflicts and two objects are refused."""

from __future__ import annotations

import pytest

import omni_models
from omni_models import GenerationRequest, InvalidRequestError, resolve_request
from omni_models.shapes_grammar import canonicalize
from omni_models.training.captions import VOCABULARY, SceneSpec
from omni_models.training.shapes import split_scenes

CANONICAL = "a black square at the top right on a green background"


def _prepare(pipeline, prompt: str, **fields):
    """The one job of a one-image request, checked as every entry point checks it."""
    [job] = pipeline.prepare(resolve_request(pipeline.info, GenerationRequest(prompt=prompt, **fields)))
    return job


@pytest.mark.parametrize(
    "prompt",
    [
        "on a green background, a black square at the top right",
        "at the top right, a black square on a green background",
        "a black square on a green background at the top right",
        "on a green background at the top right, a black square",
        "At the top right on a green background: a black square!",
    ],
)
def test_reordered_clauses_read_as_the_canonical_caption(prompt: str) -> None:
    assert canonicalize(prompt.replace(":", ",")) == CANONICAL


def test_canonical_captions_are_returned_unchanged() -> None:
    _, held_out = split_scenes()
    for scene in held_out[:50]:
        for kwargs in ({}, {"with_position": False}, {"with_background": False}):
            caption = scene.caption(**kwargs)
            assert canonicalize(caption) is caption


@pytest.mark.parametrize(
    ("prompt", "fragment"),
    [
        ("a red circle on a red background", "invisible"),
        ("a red circle and a blue square", "more than one object"),
        ("a red circle a blue square", "more than one object"),
        ("a red circle square", "two shapes"),
        ("a red blue circle", "two colours"),
        ("a red circle at the top at the left", "two positions"),
        ("a red circle on a blue background on a green background", "two backgrounds"),
        ("a red circle the", "'the' outside the clauses"),
    ],
)
def test_conflicts_and_two_objects_are_refused_with_the_accepted_form(prompt: str, fragment: str) -> None:
    with pytest.raises(InvalidRequestError, match=fragment) as info:
        canonicalize(prompt)
    assert info.value.param == "prompt"
    if fragment != "invisible":
        assert "a COLOR SHAPE [at the POSITION] [on a COLOR background]" in str(info.value)


@pytest.mark.parametrize("prompt", ["...", "!", ".,!", "  ", " . "])
def test_prompts_without_words_are_refused(prompt: str) -> None:
    pipeline = omni_models.load("omni-shapes-tiny", device="cpu")
    with pytest.raises(InvalidRequestError, match="no words|non-empty") as info:
        _prepare(pipeline, prompt)
    assert info.value.param == "prompt"


def test_the_shipped_model_reads_reordered_prompts_as_canonical_tokens() -> None:
    pipeline = omni_models.load("omni-shapes-tiny", device="cpu")
    assert pipeline.prompt_grammar is canonicalize
    reordered = _prepare(pipeline, "on a green background, a black square at the top right", seed=3)
    canonical = _prepare(pipeline, CANONICAL, seed=3)
    assert reordered.rows[0].token_ids == canonical.rows[0].token_ids
    assert SceneSpec(1, 7, 2, 3).caption() == CANONICAL
    assert VOCABULARY[2:] == tuple(pipeline.info.vocabulary)


def test_the_model_info_alone_reads_prompts_as_the_pipeline_does() -> None:
    """``PromptReader.from_info``: the metadata's vocabulary (``omni_models.inspect``, no weights) gives every row's
    token ids and every refusal the loaded pipeline gives."""
    from omni_models import PromptReader

    pipeline = omni_models.load("omni-shapes-tiny", device="cpu")
    reader = PromptReader.from_info(omni_models.inspect("omni-shapes-tiny").info)
    for prompt, fields in (
        ("on a green background, a black square at the top right", {}),
        (CANONICAL, {"guidance_scale": 4.0, "negative_prompt": "a red circle"}),
        ("a blue triangle", {"guidance_scale": 4.0}),
    ):
        resolved = resolve_request(pipeline.info, GenerationRequest(prompt=prompt, **fields))
        [job] = pipeline.prepare(resolved)
        assert [(role, tuple(ids)) for role, ids in reader.rows(resolved)] == [
            (row.role, row.token_ids) for row in job.rows
        ]
    for prompt, fields, param in (
        ("a zebra", {}, "prompt"),
        ("a red circle and a blue square", {}, "prompt"),
        ("...", {}, "prompt"),
        ("a red circle", {"guidance_scale": 4.0, "negative_prompt": "a zebra"}, "negative_prompt"),
    ):
        resolved = resolve_request(pipeline.info, GenerationRequest(prompt=prompt, **fields))
        with pytest.raises(InvalidRequestError) as from_pipeline:
            pipeline.prepare(resolved)
        with pytest.raises(InvalidRequestError) as from_info:
            reader.rows(resolved)
        assert (str(from_info.value), from_info.value.param) == (str(from_pipeline.value), param)
