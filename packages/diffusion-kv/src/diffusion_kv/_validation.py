"""Integer helpers shared across the package: argument checks and ceiling division."""

from __future__ import annotations

from typing import Any


def is_int(value: Any) -> bool:
    """An ``int`` that is not a ``bool``: a True/False size, length or id is always a caller bug."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_positive_int(value: Any) -> bool:
    return is_int(value) and value > 0


def check_positive_int(name: str, value: Any) -> None:
    """Raise ``ValueError("{name} must be a positive int, got {value!r}")`` unless ``is_positive_int(value)``."""
    if not is_positive_int(value):
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def cdiv(numerator: int, denominator: int) -> int:
    """``ceil(numerator / denominator)`` in integers: the blocks a row of ``numerator`` tokens needs at block
    size ``denominator``."""
    return -(-numerator // denominator)
