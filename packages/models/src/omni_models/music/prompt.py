"""Prompt building for the music family: lyrics normalization, caption cleaning, the flat prompt string, its
token ids, and the length-matched ``<|audio_cfg|>`` twin that the uncond row decodes.

Invariant: the cond prompt and its null twin have the same length, so both rows reach ``<|audio_start|>`` at
the same position and decode in lockstep.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from omni_models.errors import InvalidRequestError
from omni_models.music.config import (
    AUDIO_CFG,
    AUDIO_START,
    CAPTION_END,
    CAPTION_START,
    IM_END,
    IM_START,
    LYRICS_END,
    LYRICS_START,
    SPECIAL_TOKENS,
    UNK_ID,
    MusicConfig,
)

_LEADING_TAGS = re.compile(r"^[ \t]*((?:\[[^\]\n]*\][ \t]*)+)")
_TAG = re.compile(r"\[[^\]\n]*\]")
_SPECIAL_WITH_VALUE = re.compile(r"<\|\s*([^|<>\s]+)\s+([^|<>]*?)\s*\|>")
_LONE_SPECIAL = re.compile(r"<\|\s*([^|<>]*?)\s*\|>")


def normalize_lyrics(text: str) -> str:
    """Lyrics in the form the model was trained on (byte-exact; positions decide the audio).

    A line that starts with ``[tags]`` keeps only its tags; ``"] "``, ``" ["`` and ``" ^ "`` become line breaks;
    tag text is lower-cased; ``"[start]\\n"`` goes first.
    """
    lines = []
    for line in text.split("\n"):
        match = _LEADING_TAGS.match(line)
        lines.append("".join(_TAG.findall(match.group(1))) if match else line)
    out = "\n".join(lines).replace("] ", "]\n").replace(" [", "\n[").replace(" ^ ", "\n")
    out = _TAG.sub(lambda m: m.group(0).lower(), out)
    return "[start]\n" + out


def clean_caption(text: str) -> str:
    """Caption without special-token syntax, Markdown, or blank-line runs (in that order).

    ``<|tag value|>`` reads ``tag is value``, a lone ``<|tag|>`` reads ``tag``: a caption can never carry a real
    special token.
    """
    out = _SPECIAL_WITH_VALUE.sub(lambda m: f"{m.group(1)} is {m.group(2)}", text)
    out = _LONE_SPECIAL.sub(lambda m: m.group(1), out).replace("<|", "").replace("|>", "")
    out = re.sub(r"(?m)^\s*#{1,6}\s*", "", out)  # headings
    out = re.sub(r"\*\*(.+?)\*\*", r"\1", out)  # bold
    out = re.sub(r"(?m)^\s*([-*_])\1{2,}\s*$", "", out)  # horizontal rules
    out = re.sub(r"(?m)^\s*[-*+]\s+", "", out)  # list bullets
    out = re.sub(r"(?<![*\w])\*(?!\s)(.+?)(?<!\s)\*(?!\*)", r"\1", out)  # italics
    out = out.replace("• ", "").replace("    ", " ")
    return re.sub(r"\n{2,}", "\n", out)


def build_prompt(caption: str, lyrics: str) -> str:
    """The flat prompt string (not a chat template)."""
    return (
        "<|im_start|><|caption_start|>"
        + clean_caption(caption)
        + "<|caption_end|><|lyrics_start|>"
        + normalize_lyrics(lyrics)
        + "<|lyrics_end|><|im_end|><|audio_start|>"
    )


def build_cfg_null_token_ids(ids: Sequence[int]) -> list[int]:
    """The uncond twin: same length, framing kept, every inner position ``<|audio_cfg|>``. Input not mutated."""
    ids = list(ids)
    if len(ids) < 4:
        raise ValueError(f"prompt of {len(ids)} tokens is too short for a CFG twin (at least 4)")
    if ids[0] != IM_START or ids[-2] != IM_END or ids[-1] != AUDIO_START:
        raise ValueError("prompt framing must be <|im_start|> ... <|im_end|><|audio_start|>")
    return [ids[0], *([AUDIO_CFG] * (len(ids) - 3)), ids[-2], ids[-1]]


_WORD = re.compile(r"\[[a-z0-9 _-]*\]|[a-z]+|[0-9]+")


class MusicTokenizer:
    """Word-level tokenizer of the music family: special tokens, tags and words; unknown words -> ``<unk>``.

    Captions and lyrics are free text, so unknown words are not an error; the prompt length is bounded.
    """

    def __init__(self, config: MusicConfig) -> None:
        self.config = config
        self._ids = {word: config.word_offset + i for i, word in enumerate(config.words)}

    def words(self, text: str) -> list[int]:
        return [self._ids.get(word, UNK_ID) for word in _WORD.findall(text.lower())]

    def encode(self, caption: str, lyrics: str) -> list[int]:
        """Token ids of ``build_prompt(caption, lyrics)``; InvalidRequestError when blank or too long."""
        if not isinstance(caption, str) or not caption.strip():
            raise InvalidRequestError("the music model needs a caption describing the music", param="prompt")
        if not isinstance(lyrics, str) or not lyrics.strip():
            raise InvalidRequestError("the music model needs non-empty lyrics", param="lyrics")
        ids = [
            IM_START,
            CAPTION_START,
            *self.words(clean_caption(caption)),
            CAPTION_END,
            LYRICS_START,
            *self.words(normalize_lyrics(lyrics)),
            LYRICS_END,
            IM_END,
            AUDIO_START,
        ]
        if len(ids) > self.config.max_prompt_tokens:
            raise InvalidRequestError(
                f"the prompt is {len(ids)} tokens; the maximum is {self.config.max_prompt_tokens}. "
                "Shorten the caption or the lyrics.",
                param="lyrics",
            )
        return ids

    def token(self, token_id: int) -> str:
        if token_id < len(SPECIAL_TOKENS):
            return SPECIAL_TOKENS[token_id]
        if token_id < self.config.audio_code_offset:
            return self.config.words[token_id - self.config.word_offset]
        return f"<c0_{token_id - self.config.audio_code_offset}>"
