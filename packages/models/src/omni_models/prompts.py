"""How a causal-prefix DiT reads a request's text, from its vocabulary alone (no torch, no weights).

- the prompt goes through the model's prompt grammar (``shapes_grammar.canonicalize`` when the vocabulary is the
  shapes world's: any clause order becomes the trained one), then the word-level tokenizer;
- the negative prompt goes through the tokenizer; without one, the unconditional row is BOS alone;
- every refusal is an ``InvalidRequestError`` whose ``param`` names the field.

The pipeline tokenizes with it; ``omni-server generate`` checks a request's words with it before loading anything.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from omni_models import shapes_grammar
from omni_models.errors import InvalidRequestError
from omni_models.tokenizer import BOS_TOKEN, PAD_TOKEN, Tokenizer

if TYPE_CHECKING:
    from omni_models.request import ResolvedRequest
    from omni_models.spec import ModelInfo

Grammar = Callable[[str], str]


class PromptReader:
    def __init__(self, tokenizer: Tokenizer, grammar: Grammar | Literal["auto"] | None = "auto") -> None:
        self.tokenizer = tokenizer
        if grammar == "auto":
            words = tokenizer.vocabulary[2:]
            grammar = shapes_grammar.canonicalize if shapes_grammar.is_shapes_vocabulary(words) else None
        self.grammar: Grammar | None = grammar

    @classmethod
    def from_info(cls, info: ModelInfo) -> PromptReader:
        """The reader of a model with a closed vocabulary (``info.vocabulary``, without padding and BOS)."""
        if not info.vocabulary or info.image is None:
            raise ValueError(f"{info.name} has no closed vocabulary to read prompts with")
        tokenizer = Tokenizer((PAD_TOKEN, BOS_TOKEN, *info.vocabulary), max_tokens=info.image.max_prompt_tokens)
        return cls(tokenizer)

    def prompt_ids(self, prompt: str) -> list[int]:
        ids = self.tokenizer.encode(prompt if self.grammar is None else self.grammar(prompt), param="prompt")
        if len(ids) == 1:  # BOS alone is the unconditional prompt: it would draw a random scene
            raise InvalidRequestError(
                f"prompt has no words (only punctuation or spaces): {prompt[:40]!r}", param="prompt"
            )
        return ids

    def rows(self, request: ResolvedRequest) -> list[tuple[str, list[int]]]:
        """The token ids of each row of one image: ``cond``, then ``uncond`` when ``guidance_scale != 1``."""
        rows = [("cond", self.prompt_ids(request.prompt))]
        if request.guidance_scale != 1.0:
            negative = request.negative_prompt
            uncond = (
                self.tokenizer.null_ids
                if negative is None
                else self.tokenizer.encode(negative, param="negative_prompt")
            )
            rows.append(("uncond", uncond))
        return rows


__all__ = ["PromptReader"]
