"""The caption grammar of the shapes world and the vocabulary it spans.

A full caption reads ``"a red circle at the top left on a blue background"``. Training also shows the two
shorter forms without the position clause or without the background clause, so prompts such as
``"a red circle"`` are in-distribution. ``VOCABULARY`` (padding and BOS first, see ``omni_models.tokenizer``) is
what training writes to a model directory's ``vocab.json``. The name tables live in the runtime module
``omni_models.shapes_grammar``, which also reads prompts with the clauses in any order.
"""

from __future__ import annotations

from dataclasses import dataclass

from omni_models.shapes_grammar import COLOR_NAMES, GRAMMAR_WORDS, POSITION_NAMES, SHAPE_NAMES
from omni_models.tokenizer import BOS_TOKEN, PAD_TOKEN

VOCABULARY: tuple[str, ...] = (
    PAD_TOKEN,
    BOS_TOKEN,
    *GRAMMAR_WORDS,
    *COLOR_NAMES,
    *SHAPE_NAMES,
    *sorted({word for name in POSITION_NAMES for word in name.split()}),
)


def _article(next_word: str) -> str:
    return "an" if next_word[0] in "aeiou" else "a"


@dataclass(frozen=True)
class SceneSpec:
    """One scene of the shapes world: indices into the name tables above.

    Invariant: ``color != background`` (a shape is never drawn in its background colour).
    """

    shape: int
    color: int
    position: int
    background: int

    def caption(self, *, with_position: bool = True, with_background: bool = True) -> str:
        color, background = COLOR_NAMES[self.color], COLOR_NAMES[self.background]
        words = [_article(color), color, SHAPE_NAMES[self.shape]]
        if with_position:
            words += ["at", "the", POSITION_NAMES[self.position]]
        if with_background:
            words += ["on", _article(background), background, "background"]
        return " ".join(words)
