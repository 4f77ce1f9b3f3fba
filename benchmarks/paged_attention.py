"""Paged non-causal attention (diffusion_kv Triton kernel) vs dense SDPA (flash backend).

Identical shapes for both: bf16, 24 heads x 128, batch B rows of S tokens each, every
query attending all S keys of its row (non-causal). The paged side reads K/V from a
pool of `page`-token blocks through shuffled (non-contiguous) block tables; the dense
side gets contiguous `[B, S, H, D]` K/V. Timed with `triton.testing.do_bench`
(CUDA events, warm-up included); the first paged call of each shape also autotunes.

    PYTHONPATH=packages/diffusion-kv/src python benchmarks/paged_attention.py --out OUT
    python benchmarks/paged_attention.py --smoke      # tiny CPU run (Triton interpreter)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from diffusion_kv import PagedAttentionMetadata, paged_attention, write_kv_cache  # noqa: E402

TOKENS_PER_SHAPE = 16384  # B = max(1, TOKENS_PER_SHAPE // S): enough programs to fill the GPU at S=1k


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="directory for paged_attention.json")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU under the Triton interpreter")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096, 32768])
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[16, 64, 256])
    return parser.parse_args()


def timer_ms(fn, device: str) -> float:
    if device == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=50, rep=200))
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def dense_sdpa(q, k, v):
    """Flash SDPA on `[B, S, H, D]` tensors (transposed views, as a model would pass them)."""
    if q.device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))


def run_shape(batch, seq_len, page, heads, head_size, dtype, device, gen):
    q, k, v = (torch.randn(batch, seq_len, heads, head_size, generator=gen).to(device, dtype) for _ in range(3))
    blocks_per_row = seq_len // page
    num_blocks = batch * blocks_per_row
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = perm.view(batch, blocks_per_row).to(device=device, dtype=torch.int32)
    kv_cache = torch.empty(num_blocks, 2, page, heads, head_size, device=device, dtype=dtype)
    # Every query of a row attends to all of its keys: one metadata both writes the rows and attends.
    metadata = PagedAttentionMetadata.build(
        block_tables, block_size=page, query_lens=[seq_len] * batch, seq_lens=[seq_len] * batch,
        query_pos_start=[0] * batch,
    )
    write_kv_cache(k.reshape(-1, heads, head_size), v.reshape(-1, heads, head_size), kv_cache, metadata)
    query = q.reshape(-1, heads, head_size)
    out = torch.empty_like(query)
    backend = "triton" if device == "cuda" or SMOKE else "torch"

    def paged():
        paged_attention(query, kv_cache, metadata, out=out, backend=backend)

    def dense():
        dense_sdpa(q, k, v)

    paged()  # autotunes on CUDA
    max_err = (out.float() - dense_sdpa(q, k, v).transpose(1, 2).reshape(-1, heads, head_size).float()).abs().max()
    dense_ms = timer_ms(dense, device)
    paged_ms = timer_ms(paged, device)
    flops = 4.0 * batch * heads * seq_len * seq_len * head_size
    return {
        "seq_len": seq_len, "page_size": page, "batch": batch, "heads": heads, "head_size": head_size,
        "dtype": str(dtype).removeprefix("torch."),
        "dense_ms": dense_ms, "paged_ms": paged_ms,
        "dense_tflops": flops / dense_ms / 1e9, "paged_tflops": flops / paged_ms / 1e9,
        "ratio": dense_ms / paged_ms, "max_abs_err": float(max_err),
    }


def main() -> None:
    args = parse_args()
    if SMOKE:
        device, heads, head_size, dtype = "cpu", 2, 32, torch.float32
        seq_lens, pages = [64], [16, 32]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("paged_attention benchmark needs CUDA; use --smoke for a CPU check")
        device, heads, head_size, dtype = "cuda", 24, 128, torch.bfloat16
        seq_lens, pages = args.seq_lens, args.page_sizes
    gen = torch.Generator().manual_seed(0)
    results = []
    header = f"{'S':>6} {'page':>5} {'B':>3} {'dense TFLOP/s':>14} {'paged TFLOP/s':>14} {'paged/dense':>12} {'max|err|':>9}"
    print(header)
    for seq_len in seq_lens:
        batch = max(1, TOKENS_PER_SHAPE // seq_len) if not SMOKE else 2
        for page in pages:
            r = run_shape(batch, seq_len, page, heads, head_size, dtype, device, gen)
            results.append(r)
            print(f"{seq_len:>6} {page:>5} {batch:>3} {r['dense_tflops']:>14.1f} {r['paged_tflops']:>14.1f} "
                  f"{r['ratio']:>11.3f}x {r['max_abs_err']:>9.2e}", flush=True)
    meta = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)",
        "torch": torch.__version__,
        "baseline": "torch SDPA, flash backend, contiguous [B,S,H,D] K/V" if device == "cuda" else "torch SDPA (cpu)",
        "timer": "triton.testing.do_bench(warmup=50, rep=200)" if device == "cuda" else "perf_counter, 1 run",
    }
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "paged_attention.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))


if __name__ == "__main__":
    main()
