"""Probe of cuDNN's paged SDPA (diffusion_kv.ops.cudnn_paged) and of extra Triton tile shapes, on the H200.

Sections (all by default, or the ones named): `checks` (ragged rows, GQA, head sizes 64-256, empty rows, CUDA-graph
replay, against the torch reference), `dit` (one DiT layer's attention: 4 rows x 1024 queries over 1536 keys, 24
heads, through every path), `shapes` (S 4k/16k/32k x pages 64/256: torch's cuDNN SDPA on both layouts vs cuDNN
paged with the heuristic's plan and with every plan timed, vs gather + SDPA), `host` (host microseconds to
enqueue one call while the GPU is busy: a synchronizing path would wait), `sweep` (Triton bf16 and FP8 tiles
beyond the autotuned lists, S 16k/32k), `engines` (every cuDNN engine and knob setting, dense and paged),
`build` (seconds of a call that builds its graph vs a cached one), `gather_output` (gather + SDPA writing into a
caller's `out` vs returning SDPA's own output). Five do_bench medians per timing in `shapes`/`dit`.

    PYTHONPATH=packages/diffusion-kv/src python benchmarks/cudnn_probe.py OUT [SECTION ...]
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).parent))
from paged_attention import Shape, sdpa_layout  # noqa: E402

from diffusion_kv import PagedAttentionMetadata, paged_attention  # noqa: E402
from diffusion_kv.ops import cudnn_paged, sdpa_gather  # noqa: E402

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("probe_out")
VARIANT_SECONDS = 25
SECTIONS = sys.argv[2:] or ["checks", "dit", "shapes", "host", "sweep", "engines", "build", "gather_output"]
OUT.mkdir(parents=True, exist_ok=True)
REPS = 5
results: dict = {"env": {}, "shapes": [], "checks": {}}


def bench(fn) -> dict:
    times = [float(do_bench(fn, warmup=25, rep=150, return_mode="median")) for _ in range(REPS)]
    times.sort()
    return {"ms_median": times[len(times) // 2], "ms_min": times[0], "ms_max": times[-1], "reps": times}


def save():
    (OUT / "cudnn_probe.json").write_text(json.dumps(results, indent=2, default=str))


def env():
    import cudnn

    results["env"] = {
        "frontend": cudnn.__version__,
        "backend": cudnn.backend_version(),
        "torch_cudnn": torch.backends.cudnn.version(),
        "torch": torch.__version__,
        "reason": cudnn_paged.frontend_missing_reason(),
    }
    print(results["env"], flush=True)


def shape_case(seq_len: int, page: int, gen):
    batch = max(1, 16384 // seq_len)
    shape = Shape(batch, seq_len, page, 24, 128, torch.bfloat16, "cuda", gen)
    entry = {"S": seq_len, "page": page, "B": batch}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = sdpa_layout(shape.q, shape.k, shape.v, "token-major")
    qh, kh, vh = sdpa_layout(shape.q, shape.k, shape.v, "head-major")
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        entry["torch_cudnn_token_major"] = bench(lambda: F.scaled_dot_product_attention(q, k, v))
        entry["torch_cudnn_head_major"] = bench(lambda: F.scaled_dot_product_attention(qh, kh, vh))
    base = min(entry["torch_cudnn_token_major"]["ms_median"], entry["torch_cudnn_head_major"]["ms_median"])
    out = torch.full_like(shape.query, float("nan"))
    args = (shape.query, shape.kv_cache, shape.metadata, shape.scale, out)
    for label, autotune in (("cudnn_paged_heuristic", False), ("cudnn_paged_autotuned", True)):
        try:
            cudnn_paged.AUTOTUNE = autotune
            cudnn_paged._graphs.clear()
            out.fill_(float("nan"))
            t0 = time.perf_counter()
            cudnn_paged.paged_attention(*args)
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            (graph_entry,) = cudnn_paged._graphs.values()
            err = (out.float() - shape.reference).abs().max().item()
            run = bench(lambda: cudnn_paged.paged_attention(*args))
            run.update(
                first_call_s=first,
                max_abs_err=err,
                written=bool(not out.isnan().any()),
                plan=graph_entry.plan_index,
                plans=graph_entry.graph.get_execution_plan_count(),
                ratio_vs_torch_cudnn=base / run["ms_median"],
            )
            entry[label] = run
        except Exception:  # noqa: BLE001
            entry[label] = {"error": traceback.format_exc()[-3000:]}
            print(entry[label]["error"], flush=True)
    entry["sdpa_gather"] = bench(lambda: sdpa_gather.paged_attention(*args))
    entry["sdpa_gather"]["ratio_vs_torch_cudnn"] = base / entry["sdpa_gather"]["ms_median"]
    entry["flops"] = shape.flops
    results["shapes"].append(entry)
    summary = {
        k: (v.get("ms_median"), v.get("ratio_vs_torch_cudnn")) if isinstance(v, dict) else v for k, v in entry.items()
    }
    print(summary, flush=True)
    save()


def dit_case(gen):
    """Two requests x CFG rows: 1024 image queries over 1024 + 512 prompt keys, 24 heads x 128 (a DiT layer)."""
    rows, q_len, kv_len, heads, d, page = 4, 1024, 1536, 24, 128, 64
    blocks = kv_len // page
    perm = torch.randperm(rows * blocks + 8, generator=gen)[: rows * blocks]
    tables = perm.view(rows, blocks).to("cuda", torch.int32)
    cache = torch.randn(rows * blocks + 8, 2, page, heads, d, generator=gen).to("cuda", torch.bfloat16)
    meta = PagedAttentionMetadata.build(
        tables,
        block_size=page,
        query_lens=[q_len] * rows,
        seq_lens=[kv_len] * rows,
        query_pos_start=[kv_len - q_len] * rows,
    )
    qkv = torch.randn(rows * q_len, 3, heads, d, generator=gen).to("cuda", torch.bfloat16)
    query = qkv[:, 0]  # a view of packed QKV: token stride 3 * heads * d
    entry = {"case": "dit_layer"}
    ref = paged_attention(query, cache, meta, backend="torch")
    for label, fn in (
        ("triton", lambda: paged_attention(query, cache, meta, backend="triton")),
        ("auto", lambda: paged_attention(query, cache, meta)),
        ("sdpa_gather", lambda: paged_attention(query, cache, meta, backend="sdpa")),
        (
            "cudnn_paged",
            lambda: cudnn_paged.paged_attention(
                query, cache, meta, d**-0.5, torch.empty(query.shape, dtype=query.dtype, device="cuda")
            ),
        ),
    ):
        try:
            result = fn()
            entry[label] = bench(fn)
            entry[label]["max_abs_err"] = (result.float() - ref.float()).abs().max().item()
        except Exception:  # noqa: BLE001
            entry[label] = {"error": traceback.format_exc()[-3000:]}
    results["shapes"].append(entry)
    print({k: v.get("ms_median", v.get("error")) if isinstance(v, dict) else v for k, v in entry.items()}, flush=True)
    save()


def checks(gen):
    """Ragged rows, GQA, head sizes, empty rows, and CUDA-graph capture, against the torch reference."""
    from kv_builders import build_paged_rows

    out = {}
    cases = {
        "ragged_mha_d128": ([(0, 300), (0, 300), (40, 77), (5, 513)], 8, 8, 128, 64),
        "gqa_d64": ([(0, 200), (10, 64)], 8, 2, 64, 64),
        "d256": ([(0, 128), (0, 256)], 4, 4, 256, 64),
        "d80_page16": ([(0, 100)], 4, 4, 80, 16),
        "empty_row": ([(0, 128), (0, 0), (3, 60)], 4, 4, 128, 64),
    }
    for name, (rows, heads, kv_heads, d, page) in cases.items():
        try:
            args, *_ = build_paged_rows(
                rows, heads, kv_heads, d, page, torch.bfloat16, seed=11, device="cuda", backend="triton", spare_blocks=5
            )
            reason = cudnn_paged.unsupported_reason(*args)
            ref = paged_attention(*args, backend="torch")
            if reason is not None:
                out[name] = {"declined": reason}
                continue
            res = torch.full_like(args[0], float("nan"))
            cudnn_paged.paged_attention(args[0], args[1], args[2], args[0].shape[2] ** -0.5, res)
            out[name] = {"max_abs_err": (res.float() - ref.float()).abs().max().item(), "nan": bool(res.isnan().any())}
        except Exception:  # noqa: BLE001
            out[name] = {"error": traceback.format_exc()[-2500:]}
    try:  # capture in a CUDA graph, replay with new data
        args, *_ = build_paged_rows(
            [(0, 256), (0, 256)], 8, 8, 128, 64, torch.bfloat16, seed=3, device="cuda", backend="triton"
        )
        query, cache, meta = args
        res = torch.empty_like(query)
        cudnn_paged.paged_attention(query, cache, meta, 128**-0.5, res)  # warm: graph built, plan picked
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            cudnn_paged.paged_attention(query, cache, meta, 128**-0.5, res)
        query.copy_(torch.randn_like(query))
        graph.replay()
        torch.cuda.synchronize()
        ref = paged_attention(query, cache, meta, backend="torch")
        out["cuda_graph_replay"] = {"max_abs_err": (res.float() - ref.float()).abs().max().item()}
    except Exception:  # noqa: BLE001
        out["cuda_graph_replay"] = {"error": traceback.format_exc()[-2500:]}
    results["checks"] = out
    print(json.dumps(out, indent=1), flush=True)
    save()


def sweep(gen):
    """Extra Triton tile configs, bf16 and FP8, at S 16k/32k."""
    from diffusion_kv.ops import triton_flash

    bf16_cfgs = [
        (128, 64, 4, 3),
        (128, 64, 4, 4),
        (128, 64, 4, 5),
        (128, 128, 4, 3),
        (256, 64, 8, 3),
        (256, 128, 8, 2),
        (256, 128, 8, 3),
        (128, 128, 8, 3),
    ]
    fp8_cfgs = [
        (128, 64, 4, 3),
        (128, 64, 4, 4),
        (128, 64, 4, 5),
        (128, 128, 4, 3),
        (128, 128, 4, 4),
        (256, 64, 8, 3),
        (256, 128, 8, 2),
        (256, 128, 8, 3),
        (128, 128, 8, 3),
        (64, 64, 4, 4),
        (128, 256, 8, 2),
        (256, 256, 8, 2),
    ]
    rows = []
    for seq_len in (16384, 32768):
        for page in (64, 256):
            shape = Shape(max(1, 16384 // seq_len), seq_len, page, 24, 128, torch.bfloat16, "cuda", gen)
            entry = {"S": seq_len, "page": page, "bf16": {}, "fp8": {}}
            out = torch.empty_like(shape.query)
            for bm, bn, w, st in bf16_cfgs:
                if page % bn:
                    continue
                cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": st}
                try:
                    fn = lambda cfg=cfg, shape=shape: triton_flash.paged_attention(
                        shape.query, shape.kv_cache, shape.metadata, shape.scale, out, config=cfg
                    )
                    fn()
                    err = (out.float() - shape.reference).abs().max().item()
                    ms = float(do_bench(fn, warmup=25, rep=150, return_mode="median"))
                    entry["bf16"][str((bm, bn, w, st))] = {"tflops": shape.flops / ms / 1e9, "err": err}
                except Exception as exc:  # noqa: BLE001
                    entry["bf16"][str((bm, bn, w, st))] = {"error": str(exc).splitlines()[0][:200]}
            query, q_scale, cache, k_scale, v_scale = shape.fp8_inputs()
            for bm, bn, w, st in fp8_cfgs:
                if page % bn:
                    continue
                cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": st}
                try:
                    fn = lambda cfg=cfg, shape=shape, cache=cache: triton_flash.paged_attention_fp8(
                        query, q_scale, cache, k_scale, v_scale, shape.metadata, shape.scale, out, config=cfg
                    )
                    fn()
                    err = ((out.float() - shape.reference).norm() / shape.reference.norm()).item()
                    ms = float(do_bench(fn, warmup=25, rep=150, return_mode="median"))
                    entry["fp8"][str((bm, bn, w, st))] = {"tflops": shape.flops / ms / 1e9, "rel_l2": err}
                except Exception as exc:  # noqa: BLE001
                    entry["fp8"][str((bm, bn, w, st))] = {"error": str(exc).splitlines()[0][:200]}
            rows.append(entry)
            print(json.dumps(entry), flush=True)
            results["sweep"] = rows
            save()
            del shape, cache
            torch.cuda.empty_cache()


def host_overhead(gen):
    """Host time to enqueue one call while the GPU is busy (a sync inside would make it wait for the sleep)."""
    rows, q_len, kv_len, heads, d, page = 2, 1024, 1536, 16, 128, 64
    blocks = kv_len // page
    tables = torch.randperm(rows * blocks, generator=gen).view(rows, blocks).to("cuda", torch.int32)
    cache = torch.randn(rows * blocks, 2, page, heads, d, generator=gen).to("cuda", torch.bfloat16)
    meta = PagedAttentionMetadata.build(
        tables,
        block_size=page,
        query_lens=[q_len] * rows,
        seq_lens=[kv_len] * rows,
        query_pos_start=[kv_len - q_len] * rows,
    )
    query = torch.randn(rows * q_len, heads, d, generator=gen).to("cuda", torch.bfloat16)
    out = torch.empty_like(query)
    entry = {}

    for label, fn in (
        ("triton", lambda: paged_attention(query, cache, meta, out=out, backend="triton")),
        ("sdpa_gather", lambda: paged_attention(query, cache, meta, out=out, backend="sdpa")),
        ("cudnn_paged", lambda: paged_attention(query, cache, meta, out=out, backend="cudnn")),
        ("cudnn_execute_only", None),
        ("reason_only", lambda: cudnn_paged.unsupported_reason(query, cache, meta)),
    ):
        if fn is None:
            (g,) = cudnn_paged._graphs.values() if len(cudnn_paged._graphs) == 1 else (None,)
            if g is None:
                continue
            rows_in = cudnn_paged._row_inputs(meta, query.stride(0), heads * d)
            pack = cudnn_paged._variant_pack(g, query, cache, out, rows_in)
            ws = torch.empty(max(g.workspace_bytes, 1), dtype=torch.uint8, device="cuda")
            h = cudnn_paged._handle(query.device)
            fn = lambda: g.graph.execute_plan_at_index(pack, ws, g.plan_index or 0, handle=h)
        fn()
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU spin ahead of the calls
        t0 = time.perf_counter()
        for _ in range(50):
            fn()
        host = (time.perf_counter() - t0) / 50 * 1e6
        torch.cuda.synchronize()
        entry[label] = {"host_us_per_call": host}
    cudnn_paged._graphs.clear()
    results["host_overhead"] = entry
    print(entry, flush=True)
    save()


def _graph(shape, paged: bool, implementation: str):
    """A cuDNN SDPA graph over `shape`: dense token-major K/V (torch's layout), or the paged cache in place."""
    import cudnn

    io = cudnn.data_type.BFLOAT16
    handle = cudnn_paged._handle(torch.device("cuda"))
    graph = cudnn.pygraph(
        io_data_type=io,
        intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT,
        handle=handle,
    )
    b, s_len, h, d = shape.q.shape
    tok = h * d
    q = graph.tensor(name="q", dim=[b, h, s_len, d], stride=[s_len * tok, d, tok, 1], data_type=io)
    buffers = {"q": shape.q}
    kw = dict(implementation=getattr(cudnn.attention_implementation, implementation))
    if paged:
        nb, _, page, hk, _ = shape.kv_cache.shape
        strides = [2 * page * hk * d, d, hk * d, 1]
        k = graph.tensor(name="k", dim=[nb, hk, page, d], stride=strides, data_type=io)
        v = graph.tensor(name="v", dim=[nb, hk, page, d], stride=strides, data_type=io)
        width = shape.block_tables.shape[1]
        kt = graph.tensor(name="kt", dim=[b, 1, width, 1], stride=[width, width, 1, 1], data_type=cudnn.data_type.INT32)
        vt = graph.tensor(name="vt", dim=[b, 1, width, 1], stride=[width, width, 1, 1], data_type=cudnn.data_type.INT32)
        sq = graph.tensor(name="sq", dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)
        skv = graph.tensor(name="skv", dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)
        lens = torch.full((b, 1, 1, 1), s_len, dtype=torch.int32, device="cuda")
        half = page * hk * d * 2
        buffers.update(
            k=shape.kv_cache.data_ptr(),
            v=shape.kv_cache.data_ptr() + half,
            kt=shape.block_tables,
            vt=shape.block_tables,
            sq=lens,
            skv=lens,
        )
        kw.update(
            use_padding_mask=True,
            seq_len_q=sq,
            seq_len_kv=skv,
            paged_attention_k_table=kt,
            paged_attention_v_table=vt,
            paged_attention_max_seq_len_kv=s_len,
        )
        named = {"q": q, "k": k, "v": v, "kt": kt, "vt": vt, "sq": sq, "skv": skv}
    else:
        k = graph.tensor(name="k", dim=[b, h, s_len, d], stride=[s_len * tok, d, tok, 1], data_type=io)
        v = graph.tensor(name="v", dim=[b, h, s_len, d], stride=[s_len * tok, d, tok, 1], data_type=io)
        buffers.update(k=shape.k, v=shape.v)
        named = {"q": q, "k": k, "v": v}
    o, _ = graph.sdpa(name="sdpa", q=q, k=k, v=v, generate_stats=False, attn_scale=shape.scale, **kw)
    out = torch.empty_like(shape.q)
    o.set_output(True).set_dim([b, h, s_len, d]).set_stride([s_len * tok, d, tok, 1])
    named["o"] = o
    buffers["o"] = out
    graph.validate()
    graph.build_operation_graph()
    pack = {named[n]: buffers[n] for n in named}
    return graph, pack, out, handle


def engines(gen):
    """Every cuDNN engine and knob setting for dense and paged SDPA, each timed: does any beat torch's pick?"""
    import itertools

    rows = []
    for seq_len, page in ((4096, 64), (16384, 64), (16384, 256)):
        shape = Shape(max(1, 16384 // seq_len), seq_len, page, 24, 128, torch.bfloat16, "cuda", gen)
        q, k, v = sdpa_layout(shape.q, shape.k, shape.v, "token-major")
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            torch_ms = float(
                do_bench(lambda: F.scaled_dot_product_attention(q, k, v), warmup=25, rep=100, return_mode="median")
            )
        entry = {"S": seq_len, "page": page, "torch_cudnn_ms": torch_ms, "configs": []}
        for paged, impl in ((False, "AUTO"), (True, "AUTO"), (False, "UNIFIED"), (True, "UNIFIED")):
            label = f"{'paged' if paged else 'dense'}/{impl}"
            try:
                graph, pack, out, handle = _graph(shape, paged, impl)
            except Exception as exc:  # noqa: BLE001
                entry["configs"].append({"variant": label, "error": str(exc).splitlines()[0][:300]})
                continue
            candidates = []
            for engine in range(graph.get_engine_count()):
                try:
                    knobs = graph.get_knobs_for_engine(engine)
                except Exception:  # noqa: BLE001
                    continue
                ranges = [
                    [(kn.type, value) for value in range(kn.min_value, kn.max_value + 1, max(kn.stride, 1))]
                    for kn in knobs
                ]
                combos = list(itertools.product(*ranges)) if ranges else [()]
                for combo in combos[:48]:
                    candidates.append((engine, dict(combo)))
            for engine, knobs in candidates:
                try:
                    graph.create_execution_plan(engine, knobs)
                except Exception:  # noqa: BLE001
                    continue
            count = graph.get_execution_plan_count()
            timed = []
            started = time.perf_counter()
            for index in range(count):
                if time.perf_counter() - started > VARIANT_SECONDS:
                    timed.append({"index": index, "error": f"not tried: {VARIANT_SECONDS} s budget spent"})
                    continue
                try:
                    graph.build_plan_at_index(index)
                    ws = torch.empty(
                        max(graph.get_workspace_size_plan_at_index(index), 1), dtype=torch.uint8, device="cuda"
                    )
                    fn = lambda index=index, ws=ws: graph.execute_plan_at_index(pack, ws, index, handle=handle)
                    fn()
                    torch.cuda.synchronize()
                    err = (out.reshape(-1, 24, 128).float() - shape.reference).abs().max().item()
                    ms = float(do_bench(fn, warmup=10, rep=60, return_mode="median"))
                    timed.append(
                        {"name": graph.get_plan_name_at_index(index), "ms": ms, "x_torch": torch_ms / ms, "err": err}
                    )
                except Exception as exc:  # noqa: BLE001
                    timed.append({"index": index, "error": str(exc).splitlines()[0][:160]})
            ok = sorted((t for t in timed if "ms" in t), key=lambda t: t["ms"])
            entry["configs"].append(
                {
                    "variant": label,
                    "candidates": len(candidates),
                    "plans": count,
                    "best": ok[:5],
                    "failed": len(timed) - len(ok),
                }
            )
            print(label, seq_len, page, "plans", count, "best", ok[:3], flush=True)
        rows.append(entry)
        results["engines"] = rows
        save()
        del shape
        torch.cuda.empty_cache()


def build_time(gen):
    """Seconds for a call that must first build its cuDNN graph (heuristic plan), against a cached call."""
    from kv_builders import build_paged_rows

    rows_out = []
    for rows in ([(512, 1024)] * 2, [(512, 1024)] * 4, [(0, 4096)], [(77, 1000), (512, 1024)]):
        args, *_ = build_paged_rows(rows, 16, 16, 128, 64, torch.bfloat16, seed=5, device="cuda", backend="triton")
        out = torch.empty_like(args[0])
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        cudnn_paged.paged_attention(args[0], args[1], args[2], 128**-0.5, out)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        cudnn_paged.paged_attention(args[0], args[1], args[2], 128**-0.5, out)
        torch.cuda.synchronize()
        rows_out.append({"rows": rows, "first_call_s": first, "cached_call_s": time.perf_counter() - t0})
    results["build_time"] = rows_out
    print(rows_out, flush=True)
    save()


def gather_output(gen):
    """gather + SDPA with a caller's `out` (SDPA's result copied in) vs without (SDPA's own output returned)."""
    rows = []
    for seq_len in (4096, 16384):
        shape = Shape(max(1, 16384 // seq_len), seq_len, 64, 24, 128, torch.bfloat16, "cuda", gen)
        out = torch.empty_like(shape.query)
        with_out = bench(
            lambda shape=shape, out=out: paged_attention(
                shape.query, shape.kv_cache, shape.metadata, out=out, backend="sdpa"
            )
        )
        without = bench(
            lambda shape=shape: paged_attention(shape.query, shape.kv_cache, shape.metadata, backend="sdpa")
        )
        same = torch.equal(paged_attention(shape.query, shape.kv_cache, shape.metadata, backend="sdpa"), out)
        rows.append(
            {
                "S": seq_len,
                "with_out_ms": with_out["ms_median"],
                "without_out_ms": without["ms_median"],
                "speedup": with_out["ms_median"] / without["ms_median"],
                "bitwise_equal": same,
                "with_out": with_out,
                "without_out": without,
            }
        )
        print({k: v for k, v in rows[-1].items() if not isinstance(v, dict)}, flush=True)
        del shape
    results["gather_output"] = rows
    save()


def main():
    gen = torch.Generator().manual_seed(0)
    env()
    sys.path.insert(0, str(Path(__file__).parent.parent / "tests" / "diffusion_kv"))
    if "checks" in SECTIONS:
        checks(gen)
    if "dit" in SECTIONS:
        dit_case(gen)
    if "shapes" in SECTIONS:
        for seq_len in (4096, 16384, 32768):
            for page in (64, 256):
                shape_case(seq_len, page, gen)
                torch.cuda.empty_cache()
    if "host" in SECTIONS:
        host_overhead(gen)
    if "sweep" in SECTIONS:
        sweep(gen)
    if "engines" in SECTIONS:
        engines(gen)
    if "build" in SECTIONS:
        build_time(gen)
    if "gather_output" in SECTIONS:
        gather_output(gen)


if __name__ == "__main__":
    main()
