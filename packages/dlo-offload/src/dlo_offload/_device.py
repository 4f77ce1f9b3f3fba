"""Stream and event primitives for the compute device, with a CPU twin.

The executor orders its copies with streams and events. On CUDA those are real
`torch.cuda.Stream`/`torch.cuda.Event` objects; on CPU every operation is
synchronous already, so the same calls become no-ops and the executor's code path
(packing, slot rotation, re-pointing) still runs end to end. No method here
synchronises the host with the device except `synchronize`, which only setup and
teardown call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class _CpuEvent:
    """An event on a synchronous device: always complete."""

    def record(self, stream: object | None = None) -> None:
        return None

    def synchronize(self) -> None:
        return None


class _CpuStream:
    """A stream on a synchronous device: work is already ordered by the host."""

    def wait_event(self, event: object) -> None:
        return None

    def wait_stream(self, stream: object) -> None:
        return None


# What `DeviceOps` hands out: the real CUDA objects, or their no-op CPU twins.
Stream = torch.cuda.Stream | _CpuStream
Event = torch.cuda.Event | _CpuEvent


class DeviceOps:
    """Streams, events and allocator calls for one `torch.device`."""

    def __init__(self, device: torch.device | str | int) -> None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.type not in ("cuda", "cpu"):
            raise ValueError(
                f"layerwise offload supports 'cuda' and 'cpu' devices, got {str(device)!r}; "
                "pass device='cuda' (or 'cuda:N') on a GPU host or device='cpu' to run the CPU path"
            )
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(
                f"device={str(device)!r} was requested but torch.cuda.is_available() is False; "
                "install a CUDA build of torch or pass device='cpu'"
            )
        self.device = device
        self.is_cuda = device.type == "cuda"

    def new_stream(self) -> Stream:
        return torch.cuda.Stream(device=self.device) if self.is_cuda else _CpuStream()

    def new_event(self) -> Event:
        return torch.cuda.Event() if self.is_cuda else _CpuEvent()

    def current_stream(self) -> Stream:
        return torch.cuda.current_stream(self.device) if self.is_cuda else _CpuStream()

    @contextlib.contextmanager
    def on_stream(self, stream: Stream) -> Iterator[None]:
        if self.is_cuda:
            with torch.cuda.stream(stream):
                yield
        else:
            yield

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        if self.is_cuda:
            torch.cuda.empty_cache()
