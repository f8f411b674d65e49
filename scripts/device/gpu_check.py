#!/usr/bin/env python3
"""Device check of the Triton LUT kernels: correctness, speed against the bandwidth floor, decode tokens/s.

One self-contained run for a machine with one CUDA GPU and no network (installs nothing; needs torch,
triton and transformers; run from the repo root with PYTHONPATH=. or through scripts/device/gpu_check.sh):

1. env: versions, GPU, multiprocessors, L2.
2. copy: device-to-device copy bandwidth (read + write bytes / time), the floor every ratio refers to.
3. correctness: every path of ``lut_linear`` against the torch reference (``x @ qweight.dequantize().T``)
   on fresh random weights: bits 3/4, 4096x4096 and 8192x8192, M in {1, 4, 8, 128, 2048} (GEMV, fused
   GEMM, dequantize + matmul), with and without a 0.45 % sparse part; float16/float32 spot checks.
4. timing: CUDA-graph replays of many calls over rotating weight copies (more bytes than the L2 holds),
   median per call; the GEMV's achieved GB/s as a fraction of the copy bandwidth (goal >= 50 % at 4 bits),
   and the speed-up over the bfloat16 dense F.linear of the same shape (timed the same way).
5. decode: greedy decode tokens/s of a random-weight ~1B Llama (built from a config) in bfloat16, then with
   every linear of its blocks replaced by a random 4-bit SqueezeLinear on the Triton path.
6. compress (scripts/device/gpu_check_compress.py): ``squeeze compress --device cuda`` vs the CPU run of the same w4
   and rtn-w4 jobs on a SmolLM2-shaped model: wall and stage seconds, which stages are the same bytes (RTN and
   every unquantized tensor: promised) and how far the Fisher and the LUT codes are (float tolerance), and the
   per-unit rates for squeeze/compression/plan_rates.json.
7. sweeps (while time is left): GEMV and GEMM tilings, to tune squeeze/runtime/kernels/configs.py.

Prints a table last and writes gpu_check.json + gpu_check.md to $OUT (if set) or --out.

Modes that need no GPU:
  --dry-run       everything above on tiny shapes, on CPU tensors under TRITON_INTERPRET=1 (code paths)
  --compile-only  compile every kernel variant the full run launches for sm_90 (Triton's own ptxas, no
                  GPU needed) and report registers, stack (spills) and tensor-core instructions
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on CPU tensors
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from squeeze.quant.packing import pack_codes  # noqa: E402
from squeeze.quant.schemes import LutWeight  # noqa: E402
from squeeze.quant.sparse import SparseCSR  # noqa: E402
from squeeze.runtime.kernels import GemmConfig, GemvConfig, lut_linear, prepare, triton_available  # noqa: E402
from squeeze.runtime.kernels.layout import PreparedLut  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check_compress import section_compress  # noqa: E402

SPARSE = 0.0045


@dataclass
class Plan:
    """What a run covers; ``full`` is the device run, ``dry`` the tiny CPU run of the same code paths."""

    shapes: list[tuple[int, int]]
    ms: list[int]
    bits: list[int]
    l2_multiple: float = 4.0  # rotating weight copies must exceed this many L2s
    reps: int = 10
    llama: dict[str, int] = field(default_factory=dict)
    decode_tokens: int = 64
    prompt_tokens: int = 32
    gemv_sweep: list[GemvConfig] = field(default_factory=list)
    gemv_sweep_tiles: list[int] = field(default_factory=list)
    gemv_sweep_m8: list[GemvConfig] = field(default_factory=list)
    gemm_sweep: list[GemmConfig] = field(default_factory=list)


FULL = Plan(
    shapes=[(4096, 4096), (8192, 8192)],
    ms=[1, 4, 8, 128, 2048],
    bits=[4, 3],
    llama={
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
    },
    gemv_sweep=[
        GemvConfig(block_r=8),
        GemvConfig(block_r=4),
        GemvConfig(block_r=16),
        GemvConfig(block_r=32, num_warps=8),
        GemvConfig(block_r=8, num_warps=2),
        GemvConfig(block_r=16, num_warps=8),
        GemvConfig(block_r=8, prefetch=1),
        GemvConfig(block_r=8, prefetch=0, num_stages=1),
        GemvConfig(block_r=8, prefetch=0, num_stages=3),
        GemvConfig(block_r=8, split_k=2),
        GemvConfig(block_r=16, split_k=4),
    ],
    gemv_sweep_tiles=[64],
    gemv_sweep_m8=[
        GemvConfig(block_r=16, prefetch=1),
        GemvConfig(block_r=16, prefetch=2, num_warps=8),
        GemvConfig(block_r=32, prefetch=1, num_warps=8),
        GemvConfig(block_r=16, prefetch=1, split_k=2),
        GemvConfig(block_r=8, mma=False),
    ],
    gemm_sweep=[
        GemmConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
        for bm, bn, bk, nw, ns in [
            (128, 128, 32, 8, 2),
            (128, 128, 64, 8, 3),
            (64, 128, 32, 4, 2),
            (128, 64, 32, 4, 2),
            (64, 64, 64, 4, 3),
        ]
    ],
)
DRY = Plan(
    shapes=[(40, 172), (64, 96)],
    ms=[1, 4, 8, 16, 40],
    bits=[4, 3],
    l2_multiple=0.0,
    reps=2,
    llama={
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 128,
    },
    decode_tokens=3,
    prompt_tokens=5,
    gemv_sweep=[
        GemvConfig(block_r=8, split_k=2),
        GemvConfig(block_r=16, prefetch=1),
        GemvConfig(block_r=8, prefetch=0, num_stages=2),
    ],
    gemv_sweep_tiles=[16],
    gemv_sweep_m8=[GemvConfig(block_r=16, prefetch=1, split_k=2), GemvConfig(block_r=8, mma=False)],
    gemm_sweep=[GemmConfig(block_m=16, block_n=16, block_k=16, num_warps=4)],
)


class Report:
    """Rows of results by section, errors, and the budget clock."""

    def __init__(self, budget_s: float) -> None:
        self.start = time.perf_counter()
        self.budget_s = budget_s
        self.sections: dict[str, list[dict[str, Any]]] = {}
        self.errors: list[str] = []
        self.failed_checks = 0

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def add(self, section: str, **row: Any) -> None:
        self.sections.setdefault(section, []).append(row)
        print(f"[{self.elapsed():6.1f}s] {section}: " + ", ".join(f"{k}={_fmt(v)}" for k, v in row.items()), flush=True)

    def run(self, name: str, fn: Callable[[], None], min_left_s: float = 0.0) -> None:
        """Run one section; a failure is recorded and the run goes on."""
        if self.left() < min_left_s:
            self.errors.append(f"{name}: skipped, {self.left():.0f} s of the budget left (< {min_left_s:.0f})")
            print(self.errors[-1], flush=True)
            return
        print(f"== {name} ({self.elapsed():.1f} s in)", flush=True)
        try:
            fn()
        except Exception as exc:  # keep going: one broken section must not hide the others
            self.errors.append(f"{name}: {type(exc).__name__}: {exc}")
            traceback.print_exc()

    def markdown(self) -> str:
        out = [f"# gpu_check ({self.elapsed():.0f} s)", ""]
        for section, rows in self.sections.items():
            keys = list(dict.fromkeys(k for row in rows for k in row))
            out += [f"## {section}", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            out += ["| " + " | ".join(_fmt(row.get(k, "")) for k in keys) + " |" for row in rows]
            out.append("")
        if self.errors:
            out += ["## errors", ""] + [f"- {e}" for e in self.errors] + [""]
        return "\n".join(out)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.0f}"
    return str(v)


# ------------------------------------------------------------------------------------------------------
# data, references, timers


def random_lut_weight(
    rows: int, cols: int, bits: int, sparse: float, device: torch.device, seed: int, scale: float = 1.0
) -> LutWeight:
    """Random codes, ascending fp16 LUTs (N(0, scale) entries) and a random sparse part of bf16 values."""
    g = torch.Generator(device=device).manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (rows, cols), dtype=torch.uint8, device=device, generator=g)
    lut = (torch.randn(rows, 1 << bits, device=device, generator=g) * scale).sort(dim=1).values.half()
    csr = None
    if sparse:
        mask = torch.rand(rows, cols, device=device, generator=g) < sparse
        vals = (torch.randn(rows, cols, device=device, generator=g) * 3 * scale).to(torch.bfloat16)
        csr = SparseCSR.from_mask(mask, vals)
    return LutWeight(bits=bits, in_features=cols, packed=pack_codes(codes, bits), lut=lut, sparse=csr)


def clone_prepared(p: PreparedLut) -> PreparedLut:
    """The same weight at new addresses: rotating copies keep the timed calls from hitting the L2."""
    c = lambda t: None if t is None else t.clone()  # noqa: E731
    return PreparedLut(
        p.bits, p.in_features, p.out_features, p.tile, c(p.codes), c(p.lut), c(p.rowptr), c(p.cols), c(p.resid)
    )


def n_copies(plan: Plan, nbytes: int, l2_bytes: int) -> int:
    return max(1, min(64, math.ceil(plan.l2_multiple * l2_bytes / max(1, nbytes))))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fns: list[Callable[[], Any]], device: torch.device, reps: int) -> tuple[float, str]:
    """(median seconds per call, method): CUDA-graph replays of all ``fns`` in a row, or eager loops."""
    for f in fns:  # compile / autotune / allocate outside any capture
        f()
    sync(device)
    if device.type != "cuda":
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for f in fns:
                f()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) / len(fns), "cpu"
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for f in fns:
                f()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for f in fns:
                f()
        graph.replay()
        sync(device)
        run, method = graph.replay, "graph"
    except Exception as exc:  # some path not capturable: time eager launches (includes launch overhead)
        print(f"   (graph capture failed: {type(exc).__name__}: {exc}; timing eager launches)", flush=True)
        run, method = (lambda: [f() for f in fns]), "eager"
    times = []
    for _ in range(reps):
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times) / len(fns), method


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """max |y - ref| / max |ref| in float32."""
    y, ref = y.float(), ref.float()
    return float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}


# ------------------------------------------------------------------------------------------------------
# sections


def section_env(rep: Report, device: torch.device) -> dict[str, Any]:
    import triton

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "device": str(device),
        "interpret": os.environ.get("TRITON_INTERPRET", ""),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = "absent"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu=props.name,
            sms=props.multi_processor_count,
            mem_gib=round(props.total_memory / 2**30, 1),
            l2_mib=round(getattr(props, "L2_cache_size", 0) / 2**20, 1),
        )
    rep.add("env", **info)
    return info


def section_copy(rep: Report, device: torch.device, plan: Plan) -> float:
    """Device-to-device copy bandwidth, GB/s counting bytes read + written."""
    nbytes = (1 << 30) if device.type == "cuda" else (1 << 24)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    t, method = time_calls([lambda: dst.copy_(src)], device, max(plan.reps, 5))
    gbps = 2 * nbytes / t / 1e9
    rep.add("copy", bytes=nbytes, us=t * 1e6, gbps=gbps, method=method)
    return gbps  # src and dst are freed on return


def _check(rep: Report, name: str, y: torch.Tensor, ref: torch.Tensor, **row: Any) -> None:
    err = rel_err(y, ref)
    ok = bool(torch.isfinite(y).all()) and err <= TOL[y.dtype]
    rep.failed_checks += not ok
    rep.add(
        "correctness",
        case=name,
        **row,
        dtype=str(y.dtype).replace("torch.", ""),
        max_rel_err=err,
        ok="yes" if ok else "NO",
    )


def section_correctness(rep: Report, device: torch.device, plan: Plan) -> None:
    seed = 0
    for bits in plan.bits:
        for r, n in plan.shapes:
            for sparse in (0.0, SPARSE):
                seed += 1
                q = random_lut_weight(r, n, bits, sparse, device, seed)
                p = prepare(q, device)
                w = q.dequantize(torch.float32)  # (R, N) exact reference weight
                for m in plan.ms:
                    x = torch.randn(m, n, device=device, dtype=torch.bfloat16)
                    ref = x.float() @ w.T
                    row = dict(bits=bits, shape=f"{r}x{n}", sparse=sparse, m=m)
                    if m <= 8:
                        _check(rep, "gemv", lut_linear(x, p), ref, **row)
                    else:
                        _check(rep, "gemm", lut_linear(x, p, prefill="fused"), ref, **row)
                        _check(rep, "dequant+mm", lut_linear(x, p, prefill="dequant"), ref, **row)
                del q, p, w
    # other activation dtypes and a bias, on the smaller shape
    r, n = plan.shapes[0]
    q = random_lut_weight(r, n, 4, SPARSE, device, 99)
    p = prepare(q, device)
    w = q.dequantize(torch.float32)
    bias = torch.randn(r, device=device)
    for dtype in (torch.float16, torch.float32):
        for m in (1, plan.ms[3]):
            x = torch.randn(m, n, device=device, dtype=dtype)
            ref = x.float() @ w.T + bias.to(dtype).float()
            _check(
                rep,
                "gemv" if m <= 8 else "gemm",
                lut_linear(x, p, bias.to(dtype), prefill="fused"),
                ref,
                bits=4,
                shape=f"{r}x{n}",
                sparse=SPARSE,
                m=m,
            )


def _bytes_lut(p: PreparedLut, m: int, elem: int) -> int:
    return p.nbytes() + m * p.in_features * elem + m * p.out_features * elem


def section_timing(rep: Report, device: torch.device, plan: Plan, copy_gbps: float, l2_bytes: int) -> None:
    import torch.nn.functional as F

    for r, n in plan.shapes:
        dense = torch.randn(r, n, device=device, dtype=torch.bfloat16)
        dense_copies = [dense] + [dense.clone() for _ in range(n_copies(plan, dense.numel() * 2, l2_bytes) - 1)]
        base: dict[int, float] = {}
        for bits in plan.bits:
            for sparse in (0.0, SPARSE):
                q = random_lut_weight(r, n, bits, sparse, device, 7)
                p0 = prepare(q, device)
                copies = [p0] + [clone_prepared(p0) for _ in range(n_copies(plan, p0.nbytes(), l2_bytes) - 1)]
                for m in plan.ms:
                    x = torch.randn(m, n, device=device, dtype=torch.bfloat16)
                    if m not in base:
                        base[m], _ = time_calls([lambda d=d: F.linear(x, d) for d in dense_copies], device, plan.reps)
                    paths = ["gemv"] if m <= 8 else ["fused", "dequant"]
                    for path in paths:
                        kw = {} if path == "gemv" else {"prefill": path}
                        t, method = time_calls([lambda c=c: lut_linear(x, c, **kw) for c in copies], device, plan.reps)
                        gbps = _bytes_lut(p0, m, 2) / t / 1e9
                        rep.add(
                            "timing",
                            bits=bits,
                            shape=f"{r}x{n}",
                            sparse=sparse,
                            m=m,
                            path=path,
                            us=t * 1e6,
                            bf16_us=base[m] * 1e6,
                            speedup=base[m] / t,
                            gbps=gbps,
                            frac_copy=gbps / copy_gbps,
                            method=method,
                        )
                del copies, p0, q
        del dense_copies, dense


def section_sweeps(rep: Report, device: torch.device, plan: Plan, copy_gbps: float, l2_bytes: int) -> None:
    r, n = plan.shapes[-1]
    for bits in plan.bits:
        q = random_lut_weight(r, n, bits, SPARSE, device, 11)
        for tile in [None] + plan.gemv_sweep_tiles:  # None: the default tile for these bits
            p0 = prepare(q, device, tile=tile)
            copies = [p0] + [clone_prepared(p0) for _ in range(n_copies(plan, p0.nbytes(), l2_bytes) - 1)]
            x = torch.randn(1, n, device=device, dtype=torch.bfloat16)
            configs = plan.gemv_sweep if tile is None else plan.gemv_sweep[:4]
            for cfg in configs:
                if rep.left() < 60:
                    rep.errors.append("sweeps: stopped early, budget nearly spent")
                    return
                try:
                    t, _ = time_calls([lambda c=c: lut_linear(x, c, gemv=cfg) for c in copies], device, plan.reps)
                except Exception as exc:
                    rep.add(
                        "sweep_gemv",
                        bits=bits,
                        tile=p0.tile,
                        config=_cfg(cfg),
                        error=f"{type(exc).__name__}: {str(exc)[:120]}",
                    )
                    continue
                gbps = _bytes_lut(p0, 1, 2) / t / 1e9
                rep.add(
                    "sweep_gemv",
                    bits=bits,
                    shape=f"{r}x{n}",
                    m=1,
                    tile=p0.tile,
                    config=_cfg(cfg),
                    us=t * 1e6,
                    frac_copy=gbps / copy_gbps,
                )
            del copies, p0
    q = random_lut_weight(r, n, 4, SPARSE, device, 12)
    p0 = prepare(q, device)
    copies = [p0] + [clone_prepared(p0) for _ in range(n_copies(plan, p0.nbytes(), l2_bytes) - 1)]
    x8 = torch.randn(plan.ms[2], n, device=device, dtype=torch.bfloat16)
    for cfg in plan.gemv_sweep_m8:
        if rep.left() < 60:
            rep.errors.append("sweeps: stopped early, budget nearly spent")
            return
        try:
            t, _ = time_calls([lambda c=c: lut_linear(x8, c, gemv=cfg) for c in copies], device, plan.reps)
        except Exception as exc:
            rep.add(
                "sweep_gemv", bits=4, m=x8.shape[0], config=_cfg(cfg), error=f"{type(exc).__name__}: {str(exc)[:120]}"
            )
            continue
        rep.add(
            "sweep_gemv",
            bits=4,
            shape=f"{r}x{n}",
            m=x8.shape[0],
            tile=p0.tile,
            config=_cfg(cfg),
            us=t * 1e6,
            frac_copy=_bytes_lut(p0, x8.shape[0], 2) / t / 1e9 / copy_gbps,
        )
    del copies
    for m in plan.ms[3:]:
        x = torch.randn(m, n, device=device, dtype=torch.bfloat16)
        for cfg in plan.gemm_sweep:
            if rep.left() < 45:
                rep.errors.append("sweeps: stopped early, budget nearly spent")
                return
            try:
                t, _ = time_calls([lambda: lut_linear(x, p0, gemm=cfg, prefill="fused")], device, plan.reps)
            except Exception as exc:  # e.g. a tiling that needs more shared memory than a block may have
                rep.add("sweep_gemm", bits=4, m=m, config=_cfg(cfg), error=f"{type(exc).__name__}: {str(exc)[:120]}")
                continue
            rep.add(
                "sweep_gemm",
                bits=4,
                shape=f"{r}x{n}",
                m=m,
                config=_cfg(cfg),
                us=t * 1e6,
                tflops=2 * m * r * n / t / 1e12,
            )


def _cfg(cfg: GemvConfig | GemmConfig) -> str:
    return " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in asdict(cfg).items())


def section_decode(rep: Report, device: torch.device, plan: Plan, dry: bool) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from squeeze.runtime.kernels.dispatch import lut_forward
    from squeeze.runtime.linear import SqueezeLinear

    class TritonSqueezeLinear(SqueezeLinear):
        """SqueezeLinear whose forward runs the Triton kernels (also on CPU tensors in a dry run), or, with
        ``use_triton`` off, the exact torch reference: x @ dequantize()^T (SqueezeLinear.forward itself would
        take the Triton kernels again on CUDA, so the comparison would test them against themselves)."""

        use_triton = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = lut_forward(x, self, allow_cpu=dry) if self.use_triton else None
            if y is not None:
                return y
            return torch.nn.functional.linear(x, self.dequantize(x.dtype).to(x.device), self.bias)

    torch.manual_seed(0)
    config = LlamaConfig(max_position_embeddings=4096, **plan.llama)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model = model.to(torch.bfloat16).eval()
    params = sum(t.numel() for t in model.parameters())
    prompt = torch.randint(0, config.vocab_size, (1, plan.prompt_tokens), device=device)

    @torch.inference_mode()
    def decode() -> tuple[float, torch.Tensor]:
        out = model(input_ids=prompt, use_cache=True)
        past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(plan.decode_tokens):
            out = model(input_ids=tok, past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        sync(device)
        return plan.decode_tokens / (time.perf_counter() - t0), out.logits

    decode()  # warm-up (cuBLAS handles, kernels)
    bf16_tps, _ = decode()
    rep.add(
        "decode",
        model=f"llama {params / 1e9:.2f}B random",
        weights="bf16",
        tokens_per_s=bf16_tps,
        new_tokens=plan.decode_tokens,
    )

    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    seed = 1000
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in targets:
                lin = getattr(parent, name, None)
                if lin is None:
                    continue
                seed += 1
                scale = float(lin.weight.float().std())
                q = random_lut_weight(lin.out_features, lin.in_features, 4, SPARSE, device, seed, scale)
                setattr(parent, name, TritonSqueezeLinear(q, None, dense_cache=False))
    sync(device)
    with torch.inference_mode():  # the Triton path against the module's own torch reference path
        TritonSqueezeLinear.use_triton = False
        ref_logits = model(input_ids=prompt).logits.float()
        TritonSqueezeLinear.use_triton = True
        tri_logits = model(input_ids=prompt).logits.float()
    decode()
    sq_tps, _ = decode()
    rep.add(
        "decode",
        model=f"llama {params / 1e9:.2f}B random",
        weights="squeeze w4 s0.45% (triton)",
        tokens_per_s=sq_tps,
        new_tokens=plan.decode_tokens,
        vs_bf16=sq_tps / bf16_tps,
        prefill_logits_rel_err=rel_err(tri_logits, ref_logits),
    )


# ------------------------------------------------------------------------------------------------------
# Kernel variants of a run: recorded without launching, then compiled ahead (--compile-only, no GPU) or
# compiled in parallel worker processes into Triton's on-disk cache before the device run (--precompile)


def record_launches(plan: Plan, sms: int) -> list[dict[str, Any]]:
    """The distinct kernel launches (kernel name, args with tensors as dtype names, kwargs) that the run's
    sections make, found by calling lut_linear with recording stand-ins for the kernels on shape-only
    weights. Mirrors the sections' calls: a variant missed here is simply compiled on first use."""
    from squeeze.runtime.kernels import _triton_kernels as K
    from squeeze.runtime.kernels import configs, triton_lut

    names = ["_lut_gemv_kernel", "_lut_gemm_kernel", "_csr_spmm_kernel", "_lut_dequant_kernel"]
    seen: dict[str, dict[str, Any]] = {}

    class Recorder:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid: Any) -> Callable[..., None]:
            def launch(*args: Any, **kwargs: Any) -> None:
                args_ = [str(a.dtype).replace("torch.", "") if isinstance(a, torch.Tensor) else a for a in args]
                kwargs_ = dict(kwargs)
                if "DOT_UPCAST" in kwargs_:
                    kwargs_["DOT_UPCAST"] = False  # recorded on CPU tensors; the device run uses CUDA ones
                # one record per compiled variant: ints matter only as Triton specialises them
                spec = [
                    a if isinstance(a, str) else "one" if a == 1 else "d16" if a % 16 == 0 else "int" for a in args_
                ]
                key = json.dumps([self.name, spec, kwargs_], sort_keys=True, default=str)
                seen.setdefault(key, {"kernel": self.name, "args": args_, "kwargs": kwargs_})

            return launch

    saved = {n: getattr(K, n) for n in names}
    saved_sm, saved_f = configs.sm_count, triton_lut.F
    try:
        for n in names:
            setattr(K, n, Recorder(n))
        configs.sm_count = lambda device: sms  # the device's, so default configs match the device run
        # the dequantize + matmul path: no CPU matmul of the full shapes, only its launches matter
        triton_lut.F = type(
            "NoMatmul", (), {"linear": staticmethod(lambda x, w, b=None: x.new_empty(x.shape[0], w.shape[0]))}
        )
        bf16 = torch.bfloat16
        for bits in plan.bits:  # correctness and timing
            for r, n in plan.shapes:
                for sparse in (False, True):
                    p = _fake_prepared(bits, r, n, None, sparse)
                    for m in plan.ms:
                        x = torch.empty(m, n, dtype=bf16)
                        for prefill in ("fused", "dequant") if m > 8 else ("auto",):
                            lut_linear(x, p, prefill=prefill)  # type: ignore[arg-type]
        r, n = plan.shapes[0]  # correctness: other dtypes with a bias
        p = _fake_prepared(4, r, n, None, True)
        for dtype in (torch.float16, torch.float32):
            for m in (1, plan.ms[3]):
                lut_linear(torch.empty(m, n, dtype=dtype), p, torch.empty(r, dtype=dtype), prefill="fused")
        h, inter = plan.llama["hidden_size"], plan.llama["intermediate_size"]  # decode
        kv = h // plan.llama["num_attention_heads"] * plan.llama["num_key_value_heads"]
        for r, n in {(h, h), (kv, h), (inter, h), (h, inter)}:
            p = _fake_prepared(4, r, n, None, True)
            for m in (1, plan.prompt_tokens):
                lut_linear(torch.empty(m, n, dtype=bf16), p)
        r, n = plan.shapes[-1]  # sweeps
        x1 = torch.empty(1, n, dtype=bf16)
        for bits in plan.bits:
            for cfg in plan.gemv_sweep:
                lut_linear(x1, _fake_prepared(bits, r, n, None, True), gemv=cfg)
            for tile in plan.gemv_sweep_tiles:
                for cfg in plan.gemv_sweep[:4]:
                    lut_linear(x1, _fake_prepared(bits, r, n, tile, True), gemv=cfg)
        x8 = torch.empty(plan.ms[2], n, dtype=bf16)
        for cfg in plan.gemv_sweep_m8:
            lut_linear(x8, _fake_prepared(4, r, n, None, True), gemv=cfg)
        for cfg in plan.gemm_sweep:
            for m in plan.ms[3:]:
                lut_linear(
                    torch.empty(m, n, dtype=bf16), _fake_prepared(4, r, n, None, True), gemm=cfg, prefill="fused"
                )
    finally:
        for n, fn in saved.items():
            setattr(K, n, fn)
        configs.sm_count, triton_lut.F = saved_sm, saved_f
    return list(seen.values())


def compile_only(rep: Report, plan: Plan) -> None:
    """Compile every recorded variant for sm_90 (no GPU needed), each in a child process (a compiler
    assertion aborts the process), and report registers, stack bytes (spills) and tensor-core ops."""
    import multiprocessing as mp

    variants = record_launches(plan, sms=132)  # an H200's multiprocessors
    print(f"{len(variants)} kernel variants to compile", flush=True)
    ctx = mp.get_context("fork")
    for launch in variants:
        if rep.left() < 10:
            rep.errors.append("compile-only: stopped, budget spent")
            break
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_compile_child, args=(launch, child))
        t0 = time.perf_counter()
        proc.start()
        proc.join(600)
        result = parent.recv() if parent.poll() else {"error": f"compiler process died (exit {proc.exitcode})"}
        if "error" in result:
            rep.failed_checks += 1
        consts = {k: v for k, v in launch["kwargs"].items() if k not in ("L", "CPG", "BPG")}
        rep.add(
            "compile",
            kernel=launch["kernel"].strip("_").replace("_kernel", ""),
            config=" ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in consts.items()),
            s=time.perf_counter() - t0,
            **result,
        )


def precompile(rep: Report, plan: Plan, device: torch.device, workers: int) -> None:
    """Compile the run's kernel variants in parallel worker processes (Triton's warmup, same cache keys
    as the launches), so the timed sections find them in the on-disk cache."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    variants = record_launches(plan, sms=torch.cuda.get_device_properties(device).multi_processor_count)
    t0 = time.perf_counter()
    failed: list[str] = []
    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
        futures = [pool.submit(_warmup_child, launch) for launch in variants]
        for fut in as_completed(futures):
            error = fut.result()
            if error:
                failed.append(error)
    rep.add("precompile", variants=len(variants), workers=workers, s=time.perf_counter() - t0, failed=len(failed))
    for error in failed[:5]:
        rep.errors.append(f"precompile: {error}")


def _warmup_child(launch: dict[str, Any]) -> str:
    """Compile one variant through the JIT's own path (kernel.warmup), filling the on-disk cache."""
    try:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        from squeeze.runtime.kernels import _triton_kernels as K

        args = [getattr(torch, a) if isinstance(a, str) else a for a in launch["args"]]
        getattr(K, launch["kernel"]).warmup(*args, grid=(1,), **launch["kwargs"])
        return ""
    except Exception as exc:
        return f"{launch['kernel']}: {type(exc).__name__}: {str(exc)[:200]}"


def _fake_prepared(bits: int, r: int, n: int, tile: int | None, sparse: bool) -> PreparedLut:
    from squeeze.runtime.kernels.layout import DEFAULT_TILE, GROUPS

    cpg, bpg = GROUPS[bits]
    tile = DEFAULT_TILE[bits] if tile is None else tile
    nt = -(-n // (cpg * tile))
    per_row = max(1, round(n * SPARSE))
    # contents never reach a kernel: only shapes, dtypes and valid sparse indices (column 0) matter
    e = lambda *s, dt: torch.empty(*s, dtype=dt)  # noqa: E731
    sp = (
        (
            torch.arange(r + 1, dtype=torch.int32) * per_row,
            torch.zeros(r * per_row, dtype=torch.int32),
            torch.zeros(r * per_row),
        )
        if sparse
        else (None, None, None)
    )
    return PreparedLut(bits, n, r, tile, e(r, nt, bpg, tile, dt=torch.uint8), torch.zeros(r, 1 << bits), *sp)


_TY = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.uint8: "u8",
    torch.int32: "i32",
    torch.int64: "i64",
}


def _signature(fn: Any, args: list[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """What a launch specialises on, as Triton's JIT does: pointer dtypes (tensors recorded as dtype names,
    16-byte aligned), ints == 1 (constants), ints divisible by 16, every constexpr, warps and stages."""
    sig, consts, div16 = {}, {}, []
    for name, value in zip(fn.arg_names, args, strict=False):
        if isinstance(value, str):
            sig[name] = "*" + _TY[getattr(torch, value)]
            div16.append(name)
        elif isinstance(value, int) and value == 1:
            sig[name], consts[name] = "constexpr", 1
        else:
            sig[name] = "i32"
            if value % 16 == 0:
                div16.append(name)
    for name, value in kwargs.items():
        if name not in ("num_warps", "num_stages"):
            sig[name], consts[name] = "constexpr", value
    return {
        "signature": sig,
        "constexprs": consts,
        "div16": div16,
        "num_warps": kwargs.get("num_warps", 4),
        "num_stages": kwargs.get("num_stages", 3),
    }


def _compile_child(launch: dict[str, Any], conn: Any) -> None:
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from squeeze.runtime.kernels import _triton_kernels as K

    try:
        fn = getattr(K, launch["kernel"])
        variant = _signature(fn, launch["args"], launch["kwargs"])
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in variant["div16"]}
        src = ASTSource(fn=fn, signature=variant["signature"], constexprs=variant["constexprs"], attrs=attrs)
        kernel = triton.compile(
            src,
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": variant["num_warps"], "num_stages": variant["num_stages"]},
        )
        tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        with tempfile.TemporaryDirectory() as d:
            cubin = Path(d) / "k.cubin"
            cubin.write_bytes(kernel.asm["cubin"])
            usage = subprocess.run([str(tool), "--dump-resource-usage", str(cubin)], capture_output=True, text=True)
            sass = subprocess.run([str(tool), "--dump-sass", str(cubin)], capture_output=True, text=True).stdout
        found = re.search(r"REG:(\d+) STACK:(\d+)", usage.stdout)
        conn.send(
            {
                "regs": int(found.group(1)) if found else -1,
                "stack": int(found.group(2)) if found else -1,
                "hgmma": sass.count("HGMMA"),
                "hmma": sass.count("HMMA"),
                "smem": int(kernel.metadata.shared) if hasattr(kernel.metadata, "shared") else -1,
            }
        )
    except Exception as exc:
        conn.send({"error": f"{type(exc).__name__}: {str(exc)[:300]}"})


# ------------------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU tensors under TRITON_INTERPRET=1")
    ap.add_argument("--compile-only", action="store_true", help="compile every kernel variant for sm_90; no GPU")
    ap.add_argument("--budget-s", type=float, default=460.0, help="skip what no longer fits after this many seconds")
    ap.add_argument(
        "--workers",
        type=int,
        default=min(8, os.cpu_count() or 1),
        help="processes that compile the run's kernels ahead (0: compile on first use)",
    )
    ap.add_argument("--skip", default="", help="comma-separated sections to skip: timing,decode,compress,sweeps")
    ap.add_argument("--compress-model", default=None, help="compress section: a real checkpoint dir to use")
    ap.add_argument("--out", default=os.environ.get("OUT", ""), help="folder for gpu_check.json/.md (default $OUT)")
    args = ap.parse_args()
    rep = Report(args.budget_s)
    skip = set(filter(None, args.skip.split(",")))
    if not triton_available():
        print("triton is not importable: nothing to check", file=sys.stderr)
        return 2
    plan = DRY if args.dry_run else FULL
    if args.compile_only:
        rep.run("compile-only", lambda: compile_only(rep, plan))
    else:
        if not args.dry_run and not torch.cuda.is_available():
            print("no CUDA device (use --dry-run or --compile-only on a machine without one)", file=sys.stderr)
            return 2
        device = torch.device("cpu" if args.dry_run else "cuda")
        torch.backends.cuda.matmul.allow_tf32 = False  # the float32 references must be float32
        info = section_env(rep, device)
        l2 = int(info.get("l2_mib", 0) * 2**20) or 64 * 2**20
        state: dict[str, float] = {"copy": float("nan")}
        if args.workers > 0 and not args.dry_run:
            rep.run("precompile", lambda: precompile(rep, plan, device, args.workers))
        rep.run("copy", lambda: state.__setitem__("copy", section_copy(rep, device, plan)))
        rep.run("correctness", lambda: section_correctness(rep, device, plan))
        if "timing" not in skip:
            rep.run("timing", lambda: section_timing(rep, device, plan, state["copy"], l2), min_left_s=120)
        if "decode" not in skip:
            rep.run("decode", lambda: section_decode(rep, device, plan, args.dry_run), min_left_s=90)
        if "compress" not in skip:
            run_compress = lambda: section_compress(rep, device, args.dry_run, args.compress_model)  # noqa: E731
            rep.run("compress", run_compress, min_left_s=150)
        if "sweeps" not in skip:
            rep.run("sweeps", lambda: section_sweeps(rep, device, plan, state["copy"], l2), min_left_s=60)
    md = rep.markdown()
    print("\n" + md, flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check.md").write_text(md + "\n")
        (out / "gpu_check.json").write_text(
            json.dumps(
                {
                    "sections": rep.sections,
                    "errors": rep.errors,
                    "failed_checks": rep.failed_checks,
                    "elapsed_s": rep.elapsed(),
                    "dry_run": args.dry_run,
                    "compile_only": args.compile_only,
                },
                indent=1,
                default=str,
            )
            + "\n"
        )
    return 1 if rep.failed_checks or rep.errors else 0


if __name__ == "__main__":
    sys.exit(main())
