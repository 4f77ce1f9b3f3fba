"""The caption grammar of the shapes world and its word-level tokenizer.

A full caption reads ``"a red circle at the top left on a blue background"``. Training also shows the two
shorter forms without the position clause or without the background clause, so prompts such as
``"a red circle"`` are in-distribution. Token id 0 is padding, id 1 is BOS; every tokenized prompt starts with
BOS, and the null prompt of classifier-free guidance is BOS alone.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from omni_models.errors import InvalidRequestError

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
PAD_ID = 0
BOS_ID = 1

COLOR_NAMES: tuple[str, ...] = ("red", "orange", "yellow", "green", "blue", "purple", "white", "black")
SHAPE_NAMES: tuple[str, ...] = ("circle", "square", "triangle", "diamond")
# Row-major 3x3 grid: index = 3 * row + column.
POSITION_NAMES: tuple[str, ...] = (
    "top left", "top", "top right",
    "left", "center", "right",
    "bottom left", "bottom", "bottom right",
)
_GRAMMAR_WORDS: tuple[str, ...] = ("a", "at", "the", "on", "background")

VOCABULARY: tuple[str, ...] = (
    PAD_TOKEN,
    BOS_TOKEN,
    *_GRAMMAR_WORDS,
    *COLOR_NAMES,
    *SHAPE_NAMES,
    *sorted({word for name in POSITION_NAMES for word in name.split()}),
)

# Words are runs of letters; any other run of characters (except the punctuation .,!) is an unknown "word", so
# special tokens such as "<bos>" can never be typed into a prompt.
_WORD_PATTERN = re.compile(r"[a-z]+|[^\sa-z.,!]+")
# Spellings that mean the same token: "an orange" is read as "a orange" (the vocabulary has the article once).
WORD_ALIASES: dict[str, str] = {"an": "a"}


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


class Tokenizer:
    """Word-level tokenizer over a fixed vocabulary; unknown words are a request error that names them."""

    def __init__(self, vocabulary: Sequence[str] = VOCABULARY, *, max_tokens: int = 16) -> None:
        if len(vocabulary) < 2 or vocabulary[PAD_ID] != PAD_TOKEN or vocabulary[BOS_ID] != BOS_TOKEN:
            raise ValueError(f"vocabulary must start with {PAD_TOKEN!r}, {BOS_TOKEN!r}; got {list(vocabulary[:2])}")
        self.vocabulary = tuple(vocabulary)
        self.max_tokens = max_tokens
        self._ids = {word: index for index, word in enumerate(self.vocabulary)}

    @property
    def null_ids(self) -> list[int]:
        """Token ids of the null (unconditional) prompt."""
        return [BOS_ID]

    def encode(self, prompt: str, *, param: str = "prompt") -> list[int]:
        """Lower-cases, drops ``.,!``, reads ``WORD_ALIASES`` and maps each word to its id, with BOS first.

        Raises InvalidRequestError naming every unknown word, or when the prompt is longer than ``max_tokens``.
        """
        if not isinstance(prompt, str):
            raise InvalidRequestError(f"{param} must be a string, got {type(prompt).__name__}", param=param)
        words = [WORD_ALIASES.get(word, word) for word in _WORD_PATTERN.findall(prompt.lower())]
        unknown = [word for word in words if word not in self._ids]
        if unknown:
            known = ", ".join(self.vocabulary[2:])
            raise InvalidRequestError(
                f"{param} contains words outside the model's vocabulary: {', '.join(map(repr, unknown))}; "
                f"known words: {known}",
                param=param,
            )
        ids = [BOS_ID] + [self._ids[word] for word in words]
        if len(ids) > self.max_tokens:
            raise InvalidRequestError(
                f"{param} has {len(words)} words; this model accepts at most {self.max_tokens - 1}", param=param
            )
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self.vocabulary[i] for i in ids if i not in (PAD_ID, BOS_ID))
