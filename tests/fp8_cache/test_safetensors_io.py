"""The safetensors reader: header checks, CPU mmap views, and the CUDA reader's chunk plan (run on CPU)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fp8_cache import SAFETENSORS_DTYPES
from fp8_cache.safetensors_io import (
    SafetensorsFormatError,
    _pread_exact,
    _release_cached_pinned_memory,
    _StagedCudaReader,
    host_bytes,
    load_tensors,
    read_header,
    read_tensor_specs,
)


def test_the_dtype_table_names_what_safetensors_writes_and_cannot_be_changed(tmp_path: Path) -> None:
    for name, dtype in SAFETENSORS_DTYPES.items():
        path = tmp_path / f"{name}.safetensors"
        save_file({"t": torch.zeros(2, dtype=dtype)}, str(path))
        with safe_open(str(path), framework="pt") as f:
            assert f.get_slice("t").get_dtype() == name
        assert read_tensor_specs(path)[0].dtype == dtype
    with pytest.raises(TypeError):
        SAFETENSORS_DTYPES["F32"] = torch.float16  # type: ignore[index]


def _mixed_file(path: Path) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.weight": torch.randn(33, 17, generator=g).to(torch.float8_e4m3fn),
        "a.weight_scale": torch.tensor(0.25),
        "b": torch.randn(5, 3, generator=g).bfloat16(),
        "c": torch.arange(7, dtype=torch.int64),
        "empty": torch.zeros(0, 4),
        "flag": torch.tensor([True, False, True]),
    }
    save_file(tensors, str(path))
    return tensors


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    same_bytes = torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    return a.dtype == b.dtype and a.shape == b.shape and same_bytes


def test_cpu_load_returns_exact_tensors_as_mmap_views(tmp_path):
    path = tmp_path / "m.safetensors"
    expected = _mixed_file(path)
    loaded = load_tensors([path], "cpu")
    assert loaded.keys() == expected.keys()
    assert all(_equal(loaded[k], expected[k]) for k in expected)


def test_safetensors_own_header_reader_gives_names_dtypes_and_shapes(tmp_path):
    path = tmp_path / "m.safetensors"
    expected = _mixed_file(path)
    specs = {spec.name: spec for spec in read_tensor_specs(path)}
    assert specs.keys() == expected.keys()
    for name, tensor in expected.items():
        assert (specs[name].dtype, specs[name].shape) == (tensor.dtype, tuple(tensor.shape))
        assert specs[name].nbytes == tensor.numel() * tensor.element_size()
    assert {e.name: e.nbytes for e in read_header(path)} == {n: s.nbytes for n, s in specs.items()}
    path.write_bytes(_raw(b"{not json"))
    with pytest.raises(SafetensorsFormatError, match="m.safetensors"):
        read_tensor_specs(path)


def test_chunk_plan_covers_every_byte_exactly_once(tmp_path):
    path = tmp_path / "m.safetensors"
    _mixed_file(path)
    entries = read_header(path)
    planner = _StagedCudaReader.__new__(_StagedCudaReader)
    data = path.read_bytes()
    for chunk_bytes in (1, 7, 64, 1 << 20):
        planner.chunk_bytes = chunk_bytes
        out = {e.name: bytearray(e.nbytes) for e in entries}
        written = {e.name: 0 for e in entries}
        for piece in planner._plan_chunks({str(path): entries}):
            assert piece.file_hi - piece.file_lo <= chunk_bytes
            chunk = data[piece.file_lo : piece.file_hi]
            for name, dst, src, length in piece.pieces:
                out[name][dst : dst + length] = chunk[src : src + length]
                written[name] += length
        for e in entries:
            assert written[e.name] == e.nbytes and bytes(out[e.name]) == data[e.begin : e.end]


def test_duplicate_names_across_files_are_rejected(tmp_path):
    save_file({"x": torch.ones(2)}, str(tmp_path / "a.safetensors"))
    save_file({"x": torch.ones(2)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(SafetensorsFormatError, match="appears in both"):
        load_tensors([tmp_path / "a.safetensors", tmp_path / "b.safetensors"], "cpu")


def _raw(header: dict | bytes, payload: bytes = b"") -> bytes:
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(blob)) + blob + payload


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\x01\x02", "shorter than"),
        (struct.pack("<Q", 10**9) + b"{}", "exceeds the file size"),
        (_raw(b"{not json"), "not valid JSON"),
        (_raw([1, 2]), "not a JSON object"),  # type: ignore[arg-type]
        (_raw({"t": {"dtype": "F7", "shape": [1], "data_offsets": [0, 1]}}, b"\x00"), "unsupported dtype"),
        (_raw({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\x00" * 4), "does not fit"),
        (_raw({"t": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\x00" * 4), "invalid shape"),
        (
            _raw(
                {
                    "t": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
                    "u": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]},
                },
                b"\x00" * 3,
            ),
            "overlap",
        ),
    ],
)
def test_malformed_files_raise_a_clear_format_error(tmp_path, content, message):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(SafetensorsFormatError, match=message):
        read_header(path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned staging path exists only for CUDA loads")
def test_a_cuda_load_leaves_no_staging_memory_pinned(tmp_path):
    path = tmp_path / "m.safetensors"
    expected = _mixed_file(path)
    _release_cached_pinned_memory()  # count only pinned memory in use from here
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    loaded = load_tensors([path], "cuda")
    assert all(_equal(loaded[k].cpu(), expected[k]) for k in expected)
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == before


def test_pread_into_a_tensor_buffer_reads_the_exact_range(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(bytes(range(256)) * 4)
    buffer = torch.zeros(64, dtype=torch.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        _pread_exact(fd, host_bytes(buffer, 48), 300, str(path))
        assert buffer[:48].tolist() == [(300 + i) % 256 for i in range(48)] and buffer[48:].sum() == 0
        with pytest.raises(SafetensorsFormatError, match="file ended"):
            _pread_exact(fd, host_bytes(buffer, 64), 1000, str(path))
    finally:
        os.close(fd)
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        host_bytes(buffer, 65)
