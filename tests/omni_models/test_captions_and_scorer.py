from __future__ import annotations

import numpy as np
import pytest
import torch

from omni_models import InvalidRequestError
from omni_models.images import to_uint8_images
from omni_models.tokenizer import BOS_ID, Tokenizer
from omni_models.training.captions import COLOR_NAMES, POSITION_NAMES, SHAPE_NAMES, VOCABULARY, SceneSpec
from omni_models.training.scorer import adherence, read_scenes
from omni_models.training.shapes import NUM_HELD_OUT, all_scenes, render, scenes_to_tensor, split_scenes


def test_tokenizer_round_trips_every_caption_form():
    tokenizer = Tokenizer(VOCABULARY)
    scene = SceneSpec(shape=2, color=0, position=6, background=4)
    for with_position in (True, False):
        for with_background in (True, False):
            caption = scene.caption(with_position=with_position, with_background=with_background)
            ids = tokenizer.encode(caption)
            assert ids[0] == BOS_ID and len(ids) <= tokenizer.max_tokens
            assert tokenizer.decode(ids) == caption
    assert scene.caption() == "a red triangle at the bottom left on a blue background"
    assert tokenizer.encode("A Red Circle.") == tokenizer.encode("a red circle")


def test_unknown_words_are_named():
    with pytest.raises(InvalidRequestError) as info:
        Tokenizer(VOCABULARY).encode("a crimson hexagon at the top")
    assert info.value.param == "prompt"
    assert "'crimson'" in str(info.value) and "'hexagon'" in str(info.value)
    with pytest.raises(InvalidRequestError, match="'<', 'bos', '>'"):
        Tokenizer(VOCABULARY).encode("a <bos> circle")


def test_too_long_prompt_is_rejected():
    with pytest.raises(InvalidRequestError, match="at most 15"):
        Tokenizer(VOCABULARY).encode(" ".join(["red"] * 16))


def test_held_out_split_is_deterministic_and_disjoint():
    train, held_out = split_scenes()
    assert len(held_out) == NUM_HELD_OUT
    assert len(train) + len(held_out) == len(all_scenes()) == 4 * 8 * 9 * 7
    assert not set(train) & set(held_out)
    assert split_scenes()[1] == held_out
    # Every attribute value still appears in training, so held-out scenes are new combinations only.
    for name, count in (
        ("shape", len(SHAPE_NAMES)),
        ("color", len(COLOR_NAMES)),
        ("position", len(POSITION_NAMES)),
        ("background", len(COLOR_NAMES)),
    ):
        assert {getattr(s, name) for s in train} == set(range(count))


def test_scorer_reads_every_rendered_scene_exactly():
    scenes = all_scenes()
    index = scenes_to_tensor(scenes)
    generator = torch.Generator().manual_seed(0)
    for jitter in (None, torch.randint(-1, 2, (len(scenes), 2), generator=generator)):
        images = render(index[:, 0], index[:, 1], index[:, 2], index[:, 3], jitter)
        assert images.shape == (len(scenes), 3, 32, 32)
        score = adherence(read_scenes(to_uint8_images(images)), scenes)
        assert score["scene"] == 1.0


def test_scorer_detects_wrong_attributes_and_empty_images():
    scene = SceneSpec(shape=0, color=1, position=4, background=3)
    wrong = SceneSpec(shape=1, color=2, position=8, background=3)
    index = scenes_to_tensor([wrong])
    images = to_uint8_images(render(index[:, 0], index[:, 1], index[:, 2], index[:, 3]))
    score = adherence(read_scenes(images), [scene])
    assert score == {"shape": 0.0, "color": 0.0, "position": 0.0, "background": 1.0, "attributes": 0.25, "scene": 0.0}
    blank = np.full((1, 32, 32, 3), 20, dtype=np.uint8)  # all black
    reading = read_scenes(blank)[0]
    assert reading.shape == -1 and COLOR_NAMES[reading.background] == "black"
    assert reading.describe() == "no shape on a black background"


def test_an_reads_as_the_article_and_captions_use_it_before_vowels() -> None:
    tokenizer = Tokenizer(VOCABULARY)
    assert tokenizer.encode("an orange circle on an orange background") == tokenizer.encode(
        "a orange circle on a orange background"
    )
    scene = SceneSpec(shape=0, color=COLOR_NAMES.index("orange"), position=0, background=COLOR_NAMES.index("blue"))
    assert scene.caption().startswith("an orange ")
    assert scene.caption().endswith(" on a blue background")
