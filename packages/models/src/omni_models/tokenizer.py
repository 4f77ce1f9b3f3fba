"""The word-level tokenizer of the causal-prefix DiT family: a model directory's ``vocab.json`` maps words to ids.

Token id 0 is padding, id 1 is BOS; every tokenized prompt starts with BOS, and the null prompt of
classifier-free guidance is BOS alone.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from omni_models.errors import InvalidRequestError

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
PAD_ID = 0
BOS_ID = 1

# Words are runs of letters; any other run of characters (except the punctuation .,!) is an unknown "word", so
# special tokens such as "<bos>" can never be typed into a prompt.
_WORD_PATTERN = re.compile(r"[a-z]+|[^\sa-z.,!]+")
# Spellings that mean the same token: "an orange" is read as "a orange" (the vocabulary has the article once).
WORD_ALIASES: dict[str, str] = {"an": "a"}


def split_words(prompt: str) -> list[str]:
    """The words of a prompt as the tokenizer reads them: lower-cased, ``.,!`` dropped, aliases not yet applied."""
    return _WORD_PATTERN.findall(prompt.lower())


class Tokenizer:
    """Word-level tokenizer over a fixed vocabulary; unknown words are a request error that names them."""

    def __init__(self, vocabulary: Sequence[str], *, max_tokens: int = 16) -> None:
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
        words = [WORD_ALIASES.get(word, word) for word in split_words(prompt)]
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
