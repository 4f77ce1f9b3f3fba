from __future__ import annotations

import pytest
import torch
from dlo_test_models import tensor_bytes
from hypothesis import given, settings
from hypothesis import strategies as st

from dlo_offload.layout import ALIGNMENT_BYTES, layout_of, pack_range, storage_span

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
]


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    raw = torch.randint(
        0,
        256,
        (torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size(),),
        dtype=torch.uint8,
        generator=torch.Generator().manual_seed(seed),
    )
    if dtype == torch.bool:
        return (raw % 2).bool().view(shape)
    return raw.view(dtype).view(shape)  # arbitrary bit patterns, NaN payloads included


def test_storage_span_counts_the_physical_extent() -> None:
    assert storage_span((4, 6), (6, 1)) == 24
    assert storage_span((6, 4), (1, 6)) == 24  # transposed view of the same storage
    assert storage_span((3, 2), (4, 1)) == 10  # a row-sliced view keeps its gaps
    assert storage_span((0, 5), (5, 1)) == 0


def _pack_full(tensors: list[tuple[str, str, torch.Tensor]]) -> tuple[torch.Tensor, object]:
    layout = layout_of(tensors)  # type: ignore[arg-type]
    packed = torch.empty(layout.nbytes, dtype=torch.uint8)
    pack_range(packed, 0, layout, {n: t for n, _, t in tensors})
    return packed, layout


def test_every_dtype_and_stride_round_trips_bit_exactly() -> None:
    tensors = []
    for i, dtype in enumerate(DTYPES):
        base = _random(dtype, (5, 7), seed=i)
        tensors.append((f"c{i}", "parameter", base))
        tensors.append((f"t{i}", "buffer", base.t()))  # stride (1, 7)
        tensors.append((f"s{i}", "buffer", base[::2]))  # gaps in storage
    packed, layout = _pack_full(tensors)
    for entry, (name, _, tensor) in zip(
        sorted(layout.entries, key=lambda e: e.name), sorted(tensors, key=lambda t: t[0]), strict=True
    ):
        assert entry.name == name and entry.byte_offset % ALIGNMENT_BYTES == 0
        view = entry.view_in(packed)
        assert (view.dtype, view.shape, view.stride()) == (tensor.dtype, tensor.shape, tensor.stride())
        assert tensor_bytes(view) == tensor_bytes(tensor), name


def test_tensors_are_grouped_by_dtype() -> None:
    tensors = [
        ("a", "parameter", torch.zeros(3)),
        ("b", "parameter", torch.zeros(3, dtype=torch.float16)),
        ("c", "parameter", torch.zeros(3)),
        ("d", "buffer", torch.zeros(3, dtype=torch.float16)),
    ]
    assert [e.name for e in layout_of(tensors).entries] == ["a", "c", "b", "d"]  # type: ignore[arg-type]


def test_overlapping_tensor_is_rejected_with_advice() -> None:
    with pytest.raises(ValueError, match="make it contiguous"):
        layout_of([("x", "buffer", torch.zeros(1, 4).expand(3, 4))])


@settings(max_examples=30, deadline=None)
@given(
    world=st.integers(1, 5),
    sizes=st.lists(
        st.tuples(st.sampled_from(range(len(DTYPES))), st.integers(0, 40), st.booleans()), min_size=1, max_size=6
    ),
)
def test_equal_shards_concatenate_to_the_full_block(world: int, sizes: list[tuple[int, int, bool]]) -> None:
    tensors = []
    for i, (d, n, transpose) in enumerate(sizes):
        t = _random(DTYPES[d], (n, 3), seed=i)
        tensors.append((f"x{i}", "parameter", t.t() if transpose else t))
    full, layout = _pack_full(tensors)
    shard = layout.shard_nbytes(world)  # type: ignore[attr-defined]
    assert shard % ALIGNMENT_BYTES == 0 and shard * world >= layout.nbytes  # type: ignore[attr-defined]
    pieces = []
    for rank in range(world):
        piece = torch.full((shard,), 0xAB, dtype=torch.uint8)
        pack_range(piece, rank * shard, layout, {n: t for n, _, t in tensors})  # type: ignore[arg-type]
        pieces.append(piece)
    gathered = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8)
    assert torch.equal(gathered[: full.numel()], full)
    assert not gathered[full.numel() :].any()  # zero padding, never stale bytes
