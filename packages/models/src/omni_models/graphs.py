"""CUDA graphs for the fixed-shape part of a denoising step: capture once per batch layout, replay every step.

While a batch keeps its layout (the same rows, lengths and block tables, as through one image's steps), the
device work of a denoising step, from the token embeddings to the velocity, is the same sequence of kernels on
the same buffers; only the latents and the timesteps change. ``StepGraphs.run`` captures that work once per
layout and replays it afterwards, which removes the launch cost of some thousand small kernels per step and the
host time between them.

Invariants:
- The first call of a layout runs the forward eagerly (compiling and autotuning every kernel, and producing this
  step's result), then captures it; later calls copy the step's inputs into the captured buffers and replay.
- ``run`` returns a captured buffer: it holds the result until the next ``run`` of the same layout.
- A captured forward must not synchronise with the host or allocate outside the capture (the paged forward
  passes every length it needs on the host side), and must not use module hooks that move weights (layerwise
  offload): a pipeline with offload must run without graphs.
- At most ``max_graphs`` layouts are kept; the least recently used one is dropped first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass
class _Captured:
    plan: Any
    inputs: tuple[Tensor, ...]
    output: Tensor
    graph: torch.cuda.CUDAGraph


class StepGraphs:
    """Captured denoise forwards keyed by batch layout (CUDA only)."""

    def __init__(self, max_graphs: int = 4) -> None:
        if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 1:
            raise ValueError(f"max_graphs must be a positive int, got {max_graphs!r}")
        self.max_graphs = max_graphs
        self._graphs: OrderedDict[Hashable, _Captured] = OrderedDict()
        self.captures = 0
        self.replays = 0

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        self._graphs.clear()

    def run(
        self,
        key: Hashable,
        make_plan: Callable[[], Any],
        forward: Callable[..., Tensor],
        *inputs: Tensor,
    ) -> Tensor:
        """``forward(plan, *inputs)`` for the layout ``key``: eager + capture on first use, a replay afterwards.

        ``make_plan()`` builds the layout's static device tensors (called once per capture); ``inputs`` are the
        per-step tensors, copied into the captured buffers on replay (same shapes and dtypes every step).
        """
        captured = self._graphs.get(key)
        if captured is not None:
            self._graphs.move_to_end(key)
            for buffer, value in zip(captured.inputs, inputs, strict=True):
                if buffer.shape != value.shape or buffer.dtype != value.dtype:
                    raise ValueError(
                        f"step input {tuple(value.shape)} {value.dtype} does not match the captured "
                        f"{tuple(buffer.shape)} {buffer.dtype} of this layout"
                    )
                buffer.copy_(value)
            captured.graph.replay()
            self.replays += 1
            return captured.output
        if not all(t.is_cuda for t in inputs):
            raise ValueError("StepGraphs runs CUDA tensors only; call the forward directly elsewhere")
        plan = make_plan()
        static_inputs = tuple(t.clone() for t in inputs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            result = forward(plan, *static_inputs).clone()  # compiles/autotunes outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            output = forward(plan, *static_inputs)
        self._graphs[key] = _Captured(plan, static_inputs, output, graph)
        self.captures += 1
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return result
