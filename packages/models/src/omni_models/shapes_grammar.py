"""The prompt grammar of the shapes world (the shipped ``omni-shapes-tiny``): its words, and the canonical order.

The model was trained on captions in one order only (``omni_models.training.captions``)::

    a COLOR SHAPE [at the POSITION] [on a COLOR background]

Fed another order, it draws garbage (0/24 scenes right for "on a green background, a black square at the
top right"). Retraining for free order needs a GPU, so instead ``canonicalize`` reads the clauses in any
order and rewrites them in the trained order before tokenizing: "on a green background, a black square at
the top right" becomes "a black square at the top right on a green background", which the model draws as
well as any canonical prompt (same token ids, same image). A prompt already in canonical order is returned
unchanged, so canonical figures cannot move.

``canonicalize`` refuses, with ``InvalidRequestError(param="prompt")`` naming the problem and showing the
accepted form:
- two objects ("a red circle and a blue square"): the model draws exactly one shape;
- contradictions: two colours or two shapes for the object, two positions, two backgrounds, a shape in its
  background's colour (it would be invisible; the world never draws one);
- a shape prompt with words outside the clauses (e.g. a stray "the").
Prompts without a shape word (``"a"``, ``"red"``) and prompts with words outside the vocabulary are left to
the tokenizer, which accepts the former and names the unknown words of the latter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from omni_models.errors import InvalidRequestError
from omni_models.tokenizer import WORD_ALIASES, split_words

COLOR_NAMES: tuple[str, ...] = ("red", "orange", "yellow", "green", "blue", "purple", "white", "black")
SHAPE_NAMES: tuple[str, ...] = ("circle", "square", "triangle", "diamond")
# Row-major 3x3 grid: index = 3 * row + column.
POSITION_NAMES: tuple[str, ...] = (
    "top left",
    "top",
    "top right",
    "left",
    "center",
    "right",
    "bottom left",
    "bottom",
    "bottom right",
)
GRAMMAR_WORDS: tuple[str, ...] = ("a", "at", "the", "on", "background")
ACCEPTED_FORM = (
    "exactly one shape, clauses in any order: 'a COLOR SHAPE [at the POSITION] [on a COLOR background]', "
    "e.g. 'a red circle at the top left on a blue background'"
)
_CONJUNCTIONS = ("and", "with", "plus")


@dataclass
class _Clauses:
    objects: list[tuple[list[str], list[str]]] = field(default_factory=list)  # (colours, shapes) per object
    positions: list[str] = field(default_factory=list)
    backgrounds: list[str] = field(default_factory=list)


def _refuse(message: str) -> InvalidRequestError:
    return InvalidRequestError(f"prompt {message}; accepted: {ACCEPTED_FORM}", param="prompt")


def _parse(words: Sequence[str]) -> _Clauses:
    clauses = _Clauses()
    i, n = 0, len(words)
    while i < n:
        word = words[i]
        if word in _CONJUNCTIONS:
            raise _refuse(f"asks for more than one object ({word!r}): this model draws exactly one shape")
        if word == "at":  # at [the] POSITION
            i += 1 + (i + 1 < n and words[i + 1] == "the")
            two = " ".join(words[i : i + 2])
            if two in POSITION_NAMES:
                clauses.positions.append(two)
                i += 2
            elif i < n and words[i] in POSITION_NAMES:
                clauses.positions.append(words[i])
                i += 1
            else:
                raise _refuse(f"has 'at' without a position ({', '.join(POSITION_NAMES)}) after it")
        elif word == "on" or (word in COLOR_NAMES and i + 1 < n and words[i + 1] == "background"):
            # [on] [a] COLOR background
            j = i + (word == "on")
            j += j < n and words[j] == "a"
            if j + 1 < n and words[j] in COLOR_NAMES and words[j + 1] == "background":
                clauses.backgrounds.append(words[j])
                i = j + 2
            else:
                raise _refuse("has 'on' without 'a COLOR background' after it")
        elif word == "a" or word in COLOR_NAMES or word in SHAPE_NAMES:  # [a] COLOR* SHAPE*
            j = i + (word == "a")
            colours, shapes = [], []
            while j < n and words[j] in COLOR_NAMES and not (j + 1 < n and words[j + 1] == "background"):
                colours.append(words[j])
                j += 1
            while j < n and words[j] in SHAPE_NAMES:
                shapes.append(words[j])
                j += 1
            if not shapes:
                raise _refuse(f"has {' '.join(words[i:j]) or word!r} without a shape ({', '.join(SHAPE_NAMES)})")
            clauses.objects.append((colours, shapes))
            i = j
        else:
            raise _refuse(f"has {word!r} outside the clauses")
    return clauses


def _check(clauses: _Clauses) -> None:
    if len(clauses.objects) > 1:
        named = " and ".join(" ".join(["a", *c, *s]) for c, s in clauses.objects)
        raise _refuse(f"asks for more than one object ({named}): this model draws exactly one shape")
    ((colours, shapes),) = clauses.objects
    if len(set(shapes)) > 1:
        raise _refuse(f"names two shapes for one object ({' and '.join(shapes)})")
    if len(set(colours)) > 1:
        raise _refuse(f"names two colours for one shape ({' and '.join(colours)})")
    if len(set(clauses.positions)) > 1:
        raise _refuse(f"names two positions ({' and '.join(clauses.positions)})")
    if len(set(clauses.backgrounds)) > 1:
        raise _refuse(f"names two backgrounds ({' and '.join(clauses.backgrounds)})")
    if colours and clauses.backgrounds and colours[0] == clauses.backgrounds[0]:
        raise InvalidRequestError(
            f"prompt asks for a {colours[0]} {shapes[0]} on a {colours[0]} background: a shape in its background's "
            "colour would be invisible; choose two different colours",
            param="prompt",
        )


def canonicalize(prompt: str) -> str:
    """The prompt with its clauses in the trained order (see the module docstring); raises on the refused cases."""
    words = [WORD_ALIASES.get(word, word) for word in split_words(prompt)]
    vocabulary = (
        set(COLOR_NAMES)
        | set(SHAPE_NAMES)
        | {w for p in POSITION_NAMES for w in p.split()}
        | set(GRAMMAR_WORDS)
        | set(_CONJUNCTIONS)
    )
    if not any(word in SHAPE_NAMES for word in words) or any(word not in vocabulary for word in words):
        return prompt  # not a shape prompt, or unknown words: the tokenizer decides
    clauses = _parse(words)
    _check(clauses)
    ((colours, shapes),) = clauses.objects
    out = ["a", *colours[:1], shapes[0]]
    if clauses.positions:
        out += ["at", "the", clauses.positions[0]]
    if clauses.backgrounds:
        out += ["on", "a", clauses.backgrounds[0], "background"]
    canonical = " ".join(out)
    # Canonical input comes back unchanged (spelling, articles, punctuation and all), so its tokens cannot move.
    return prompt if canonical == " ".join(words) else canonical


def is_shapes_vocabulary(vocabulary: Sequence[str]) -> bool:
    """True when a model's words (after padding and BOS) are exactly this grammar's: the grammar applies."""
    words = set(COLOR_NAMES) | set(SHAPE_NAMES) | {w for p in POSITION_NAMES for w in p.split()} | set(GRAMMAR_WORDS)
    return set(vocabulary) == words
