"""Perplexity per bit: FP32, RTN, squeeze (SqueezeLLM; -ec: error-compensated) and HQQ side by side, in one run.

    .venv/bin/python scripts/bench/bench_quality.py                 # SmolLM2-135M (GGUF), sotu -> wikitext2
    .venv/bin/python scripts/bench/bench_quality.py --methods fp32,rtn-w3,w3,w3-s045 --eval-windows 10

Calibration on ../shared/corpora/sotu.txt, evaluation on ../shared/corpora/wikitext2_raw_test.txt
(512-token windows, first 40). The Fisher pass runs once and feeds every squeeze variant; each variant
replaces the target weights by their exact dequantization (the artifact's reference path) and is scored
on the same token windows. Bits per weight are counted exactly (codes, LUTs/scales, sparse entries).
Variants ending in -ec use error compensation (squeeze.quant.ec) against the layer inputs' Hessians, which
the same calibration pass accumulates (-ec-refit: the LUT refitted once after compensation; -ec-act: columns
in descending diag(H) order; -seq takes block i's Hessians from the outputs of the blocks above as already
quantized (squeeze.calibrate.hessian.sequential_hessians; the calibration windows plus the sampled ones); a
trailing -rrR alternates R rounds of LUT refit and compensation, weights.refit_rounds; a trailing -dampX sets
the dampening, default 0.01). --eval-text2 scores every method on a second held-out text too. --generated-samples N adds
the inputs of N sequences the model samples itself to those Hessians (weights.generated_samples).
A -lnqR suffix (before -dampX) refits each row's LUT and codes R rounds against the Fisher-weighted loss
(squeeze.quant.lnq; --lnq-ridge, --lnq-shrink), keeping per row the iterate best on the Hessians of
--held-out-windows calibration windows the fit did not see; the JSON row gets each layer's objective before / after.
Variants ending in -activation weight the k-means by each input column's mean square over the same calibration
windows instead of the Fisher (weights.sensitivity: activation; forward passes only, timed on its own).
Writes JSON (--out) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"
sys.path.insert(0, str(REPO))

from squeeze.calibrate.activation import activation_sensitivity  # noqa: E402
from squeeze.calibrate.fisher import fisher_information  # noqa: E402
from squeeze.calibrate.generated import sample_windows_from_model, start_token  # noqa: E402
from squeeze.calibrate.hessian import (  # noqa: E402
    dedupe_hessians,
    input_hessians,
    output_weighted_hessians,
    sequential_hessians,
)
from squeeze.calibrate.windows import sample_windows, tokenize_text  # noqa: E402
from squeeze.eval.perplexity import perplexity_from_ids  # noqa: E402
from squeeze.models.source import load_model, resolve_model  # noqa: E402
from squeeze.models.targets import find_target_linears  # noqa: E402
from squeeze.quant.schemes.lut import compensate_lut, quantize_lut  # noqa: E402
from squeeze.quant.schemes.lut_lnq import DEFAULT_RIDGE, DEFAULT_SHRINK, refit_against_loss  # noqa: E402
from squeeze.quant.schemes.rtn import rtn_quantize  # noqa: E402
from squeeze.quant.sparse import select_sparse  # noqa: E402

SQUEEZE = {
    "w4": (4, 0.0, 0.0),
    "w4-s045": (4, 0.0005, 0.004),
    "w3": (3, 0.0, 0.0),
    "w3-s045": (3, 0.0005, 0.004),
    "w3-uniform": (3, 0.0, 0.0),
}
SQUEEZE.update({f"{name}-lut8": spec for name, spec in list(SQUEEZE.items()) if not name.endswith("uniform")})
SQUEEZE.update({f"{name}-activation": SQUEEZE[name] for name in ("w4", "w3", "w4-s045", "w3-s045")})
SQUEEZE["w2"] = (2, 0.0, 0.0)
SQUEEZE["w2-s045"] = (2, 0.0005, 0.004)
# error compensation: -ec, plus -act (columns by descending diag H) and / or -refit (LUT refitted once)
for _suffix in ("-ec", "-ec-act", "-ec-refit", "-ec-act-refit"):
    SQUEEZE.update(
        {f"{n}{_suffix}": spec for n, spec in list(SQUEEZE.items()) if "-ec" not in n and "uniform" not in n}
    )
RTN = {
    "rtn-w4": (4, None),
    "rtn-w3": (3, None),
    "rtn-w4-g128": (4, 128),
    "rtn-w3-g128": (3, 128),
    "rtn-w2-g128": (2, 128),
    "rtn-w2-g64": (2, 64),  # 2.5 bpw with its fp16 scale and zero: the peer of --target-bpw 2.5
}
#: HQQ variants: (bits, group size); g64 at 2 bits is 2.5 bpw, the peer of --target-bpw 2.5
HQQ = {"hqq-w4-g128": (4, 128), "hqq-w3-g128": (3, 128), "hqq-w2-g128": (2, 128), "hqq-w2-g64": (2, 64)}
DEFAULT_METHODS = "fp32,rtn-w4,rtn-w4-g128,hqq-w4-g128,w4,w4-s045,rtn-w3,rtn-w3-g128,hqq-w3-g128,w3,w3-s045"


def hqq_dequantize(weight: torch.Tensor, bits: int, group_size: int = 128) -> tuple[torch.Tensor, int]:
    from hqq.core.quantize import BaseQuantizeConfig, HQQLinear

    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data.copy_(weight)
    quantized = HQQLinear(
        linear,
        BaseQuantizeConfig(nbits=bits, group_size=group_size),
        compute_dtype=torch.float32,
        device="cpu",
        del_orig=False,
    )
    w = quantized.dequantize().detach().float().reshape(weight.shape)
    groups = math.ceil(weight.numel() / group_size)
    return w, weight.numel() * bits + groups * 2 * 16  # codes + fp16 scale and zero per group


#: The option suffixes an -ec variant may end with, in this order: -seq (sequential Hessians: block i's from the
#: outputs of the blocks above as already quantized, squeeze.calibrate.hessian.sequential_hessians), -rrR (R rounds
#: of LUT refit and compensation, weights.refit_rounds), -gqG (output-weighted Hessians, G row groups), -lnqR (R
#: rounds of the refit against the Fisher-weighted loss, weights.lnq_rounds; also after a plain variant), -dampX
#: (the dampening).
_OPTIONS_RE = re.compile(r"(-seq)?(-rr[0-9]+)?(-gq[0-9]+)?(-lnq[0-9]+)?(-damp[0-9.]+)?$")


def _base_method(method: str) -> str:
    """The method without its option suffixes (e.g. w3-ec-act-rr3-gq4-damp0.1 -> w3-ec-act)."""
    return _OPTIONS_RE.sub("", method)


def _guided_groups(method: str) -> int | None:
    """G of an -ec variant's -gqG suffix: compensate against GuidedQuant's output-weighted Hessians."""
    match = _OPTIONS_RE.search(method)
    return int(match.group(3)[3:]) if match and match.group(3) else None


def _refit_rounds(method: str) -> int:
    """R of an -ec variant's -rrR suffix (0 without one)."""
    match = _OPTIONS_RE.search(method)
    return int(match.group(2)[3:]) if match and match.group(2) else 0


def _lnq_rounds(method: str) -> int:
    """R of a -lnqR suffix: R rounds of the LUT refit against the Fisher-weighted loss (squeeze.quant.lnq),
    the best per row kept by the objective on held-out calibration windows (0 without one)."""
    match = _OPTIONS_RE.search(method)
    return int(match.group(4)[4:]) if match and match.group(4) else 0


def _sequential(method: str) -> bool:
    match = _OPTIONS_RE.search(method)
    return bool(match and match.group(1))


def _damp(method: str) -> float:
    match = re.search(r"-damp([0-9.]+)$", method)
    return float(match.group(1)) if match else 0.01


def _with_generated(
    model: torch.nn.Module,
    tokenizer: object,
    targets: dict[str, torch.nn.Linear],
    hessians: dict[str, torch.Tensor],
    samples: int,
    seq_len: int,
    cache: Path | None,
    weight: float = 1.0,
) -> dict[str, torch.Tensor]:
    """``hessians`` plus ``weight`` times those of ``samples`` sequences the model samples (seed 0), as compress
    adds them (weights.generated_samples, weight 1); cached beside the Fisher (``-gen{samples}``) when ``cache``
    is given."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    path = cache.with_name(f"{cache.stem}-gen{samples}x{seq_len}.safetensors") if cache is not None else None
    if path is not None and path.is_file():
        with safe_open(str(path), framework="pt") as handle:
            alias = json.loads((handle.metadata() or {})["alias"])
        stored = load_file(str(path))
        generated = {name: stored[owner] for name, owner in alias.items()}
        print(f"generated-text Hessians: loaded from {path}", flush=True)
    else:
        t0 = time.perf_counter()
        with input_hessians(targets) as acc:
            sample_windows_from_model(model, samples, seq_len, start=start_token(tokenizer), seed=0)
        generated = acc.result()
        print(f"generated-text Hessians: {samples} x {seq_len} tokens in {time.perf_counter() - t0:.1f} s", flush=True)
        if path is not None:
            stored, alias = dedupe_hessians(generated)
            save_file(stored, str(path), metadata={"alias": json.dumps(alias)})
    total: dict[int, torch.Tensor] = {}  # one sum per shared tensor, so q/k/v (gate/up) still share theirs
    return {name: total.setdefault(id(h), h + weight * generated[name]) for name, h in hessians.items()}


def _held_out_hessians(
    model: torch.nn.Module,
    tokenizer: Any,
    targets: dict[str, torch.nn.Linear],
    args: argparse.Namespace,
    cache: Path | None,
) -> dict[str, torch.Tensor]:
    """Input Hessians of ``--held-out-windows`` calibration windows drawn with seed 1, none overlapping the
    Fisher pass's seed-0 windows (forward passes only); cached beside the Fisher (``-heldout{n}x{seq_len}``)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    n = args.held_out_windows
    path = cache.with_name(f"{cache.stem}-heldout{n}x{args.seq_len}.safetensors") if cache is not None else None
    if path is not None and path.is_file():
        with safe_open(str(path), framework="pt") as handle:
            alias = json.loads((handle.metadata() or {})["alias"])
        stored = load_file(str(path))
        print(f"held-out Hessians: loaded from {path}", flush=True)
        return {name: stored[owner] for name, owner in alias.items()}
    ids = tokenize_text(Path(args.calibration).read_text(encoding="utf-8"), tokenizer)
    span = len(ids) - args.seq_len
    fitted = torch.randint(0, span, (args.num_samples,), generator=torch.Generator().manual_seed(0))
    candidates = torch.randint(0, span, (64 * n,), generator=torch.Generator().manual_seed(1))
    free = [int(s) for s in candidates if bool(((s - fitted).abs() >= args.seq_len).all())][:n]
    windows = torch.stack([ids[s : s + args.seq_len] for s in free])
    t0 = time.perf_counter()
    with input_hessians(targets) as acc, torch.no_grad():
        for window in windows:
            model(window[None, :])
    result = acc.result()
    print(f"held-out Hessians: {len(free)} x {args.seq_len} tokens in {time.perf_counter() - t0:.1f} s", flush=True)
    if path is not None:
        stored, alias = dedupe_hessians(result)
        save_file(stored, str(path), metadata={"alias": json.dumps(alias)})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--calibration", default=str(SHARED / "corpora" / "sotu.txt"))
    parser.add_argument("--eval-text", default=str(SHARED / "corpora" / "wikitext2_raw_test.txt"))
    parser.add_argument("--num-samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--eval-windows", type=int, default=40)
    parser.add_argument(
        "--eval-text2",
        default=None,
        help="a second held-out text (never used for calibration) every method is also scored on",
    )
    parser.add_argument("--eval2-windows", type=int, default=20)
    parser.add_argument("--methods", default=DEFAULT_METHODS)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", default="bench-out/quality.json")
    parser.add_argument(
        "--fisher-cache",
        default=None,
        help="safetensors file: load the Fisher from it if present, else compute and save it there",
    )
    parser.add_argument(
        "--generated-samples",
        type=int,
        default=0,
        help="-ec variants: add N model-sampled sequences of --seq-len tokens to the Hessians (seed 0)",
    )
    parser.add_argument("--lnq-ridge", type=float, default=DEFAULT_RIDGE, help="-lnqR: ridge toward k-means levels")
    parser.add_argument("--lnq-shrink", type=float, default=DEFAULT_SHRINK, help="-lnqR: correlation shrinkage")
    parser.add_argument(
        "--held-out-windows",
        type=int,
        default=8,
        help="-lnqR: calibration windows (seed 1, none overlapping the fitted ones) whose Hessians pick the iterate",
    )
    parser.add_argument(
        "--generated-weight",
        type=float,
        default=1.0,
        help="the sampled sequences' Hessians are added times this (1: as compress adds them)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    methods = args.methods.split(",")
    known = set(SQUEEZE) | set(RTN) | set(HQQ) | {"fp32"}
    unknown = [m for m in methods if _base_method(m) not in known]
    if unknown:
        raise SystemExit(f"unknown methods {unknown}")

    t0 = time.perf_counter()
    model, tokenizer = load_model(resolve_model(args.model))
    load_seconds = time.perf_counter() - t0
    targets = find_target_linears(
        model, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), ("lm_head",)
    )
    originals = {name: module.weight.detach().clone() for name, module in targets.items()}
    n_weights = sum(w.numel() for w in originals.values())
    # the model's other tensors as the artifact keeps them: in the source's 16-bit dtype, tied weights once
    other_bytes = 2 * (sum(p.numel() for p in model.parameters()) - n_weights)
    eval_ids = tokenize_text(Path(args.eval_text).read_text(encoding="utf-8"), tokenizer)[None, :]
    eval2_ids = None
    if args.eval_text2:
        eval2_ids = tokenize_text(Path(args.eval_text2).read_text(encoding="utf-8"), tokenizer)[None, :]

    fisher: dict[str, torch.Tensor] = {}
    hessians: dict[str, torch.Tensor] = {}
    fisher_seconds = 0.0
    guided: dict[str, torch.Tensor] = {}
    want_ec = any("-ec" in m or _lnq_rounds(m) for m in methods)
    groups = sorted({g for m in methods if (g := _guided_groups(m)) is not None})
    if len(groups) > 1:
        raise SystemExit(f"one -gqG group count per run, found {groups}")
    want_guided = groups[0] if groups else None
    if any(_base_method(m) in SQUEEZE for m in methods):
        cache = Path(args.fisher_cache) if args.fisher_cache else None
        hcache = cache.with_name(cache.stem + "-hessian.safetensors") if cache is not None else None
        gcache = cache.with_name(f"{cache.stem}-guided{want_guided}.safetensors") if cache is not None else None
        have_guided = want_guided is None or (gcache is not None and gcache.is_file())
        if (
            cache is not None
            and cache.is_file()
            and have_guided
            and (not want_ec or (hcache is not None and hcache.is_file()))
        ):
            from safetensors import safe_open
            from safetensors.torch import load_file

            fisher = load_file(str(cache))  # safetensors: no pickle, safe to reuse across runs
            if want_ec and hcache is not None:
                with safe_open(str(hcache), framework="pt") as handle:
                    alias = json.loads((handle.metadata() or {})["alias"])
                stored = load_file(str(hcache))
                hessians = {name: stored[owner] for name, owner in alias.items()}
            if want_guided is not None and gcache is not None:
                guided = load_file(str(gcache))
            print(f"Fisher: loaded from {cache}", flush=True)
        else:
            calib_ids = tokenize_text(Path(args.calibration).read_text(encoding="utf-8"), tokenizer)
            windows = sample_windows(calib_ids, args.num_samples, args.seq_len, seed=0)
            t0 = time.perf_counter()
            # the Hessians only when a variant uses them, so the Fisher's seconds are its own otherwise
            ec_targets = targets if want_ec else {}
            guided_targets = targets if want_guided is not None else {}
            with (
                input_hessians(ec_targets) as acc,
                output_weighted_hessians(guided_targets, want_guided or 1) as gacc,
            ):
                fisher = fisher_information(model, windows, targets)
            hessians = acc.result()
            if want_guided is not None:
                guided = gacc.result()
            fisher_seconds = time.perf_counter() - t0
            print(
                f"Fisher + Hessians: {args.num_samples} x {args.seq_len} tokens in {fisher_seconds:.1f} s", flush=True
            )
            if cache is not None and hcache is not None:
                from safetensors.torch import save_file

                cache.parent.mkdir(parents=True, exist_ok=True)
                save_file({k: v.contiguous() for k, v in fisher.items()}, str(cache))
                if want_ec:
                    stored, alias = dedupe_hessians(hessians)
                    save_file(stored, str(hcache), metadata={"alias": json.dumps(alias)})
                if want_guided is not None and gcache is not None:
                    save_file(guided, str(gcache))

    activation: dict[str, torch.Tensor] = {}
    activation_seconds = 0.0
    if any(m.endswith("-activation") for m in methods):
        calib_ids = tokenize_text(Path(args.calibration).read_text(encoding="utf-8"), tokenizer)
        windows = sample_windows(calib_ids, args.num_samples, args.seq_len, seed=0)
        t0 = time.perf_counter()
        activation = activation_sensitivity(model, windows, targets)
        activation_seconds = time.perf_counter() - t0
        print(f"activation: {args.num_samples} x {args.seq_len} tokens in {activation_seconds:.1f} s", flush=True)

    if want_ec and args.generated_samples:
        hessians = _with_generated(
            model, tokenizer, targets, hessians, args.generated_samples, args.seq_len, cache, args.generated_weight
        )

    held_out: dict[str, torch.Tensor] = {}
    if any(_lnq_rounds(m) for m in methods):
        held_out = _held_out_hessians(model, tokenizer, targets, args, cache)
    lnq_layers: dict[str, list[dict[str, Any]]] = {}

    def quantize(method: str, name: str, hessian: torch.Tensor | None) -> tuple[torch.Tensor, int]:
        """(dequantized weight, its exact bits) of target ``name`` by ``method``."""
        weight = originals[name]
        if _base_method(method) in SQUEEZE:
            bits, s, o = SQUEEZE[_base_method(method)]
            f = (
                None
                if method.endswith("uniform")
                else activation.get(name)
                if "-activation" in method
                else fisher[name]
            )
            mask = select_sparse(weight, f, s, o) if (s or o) else None
            lut_dtype = "int8" if "lut8" in method else "float16"
            q = quantize_lut(weight, f, bits, mask=mask, lut_dtype=lut_dtype)
            if "-ec" in method:
                assert hessian is not None
                q = compensate_lut(
                    q,
                    weight,
                    guided[name] if _guided_groups(method) is not None else hessian,
                    mask=mask,
                    refit=_base_method(method).endswith("refit"),
                    act_order="-act" in method,
                    damp=_damp(method),
                    refit_rounds=_refit_rounds(method),
                )
            if _lnq_rounds(method):
                assert hessian is not None
                q, report = refit_against_loss(
                    q,
                    weight,
                    None if f is None else f.masked_fill(mask, 0.0) if mask is not None else f,
                    hessian,
                    held_out[name],
                    rounds=_lnq_rounds(method),
                    ridge=args.lnq_ridge,
                    shrink=args.lnq_shrink,
                    mask=mask,
                )
                lnq_layers.setdefault(method, []).append(
                    {
                        "layer": name,
                        "held_out_before": report.before,
                        "held_out_after": report.after,
                        "fit_before": report.fit_before,
                        "fit_after": report.fit_after,
                        "rows_changed": int((report.round > 0).sum()),
                        "rows": int(report.round.numel()),
                    }
                )
            return q.dequantize(), q.storage_bits()
        if method in RTN:
            r = rtn_quantize(weight, *RTN[method])
            return r.dequantize(), r.storage_bits()
        return hqq_dequantize(weight, *HQQ[method])

    seq_windows = None
    if any(_sequential(m) for m in methods):
        # the Fisher pass's windows, then the sampled sequences (sampled by the original model, seed 0)
        calib_ids = tokenize_text(Path(args.calibration).read_text(encoding="utf-8"), tokenizer)
        seq_windows = sample_windows(calib_ids, args.num_samples, args.seq_len, seed=0)
        if args.generated_samples:
            sampled = sample_windows_from_model(
                model, args.generated_samples, args.seq_len, start=start_token(tokenizer), seed=0
            )
            seq_windows = torch.cat([seq_windows, sampled])

    rows = []
    for method in methods:
        t0 = time.perf_counter()
        bits_total = n_weights * 32
        if method != "fp32" and _sequential(method):
            assert seq_windows is not None
            spent: list[int] = []

            def on_block(
                _index: int, block_hessians: dict[str, torch.Tensor], method: str = method, spent: list[int] = spent
            ) -> None:
                for name, h in block_hessians.items():
                    w, b = quantize(method, name, h)
                    targets[name].weight.data.copy_(w)
                    spent.append(b)

            sequential_hessians(model, seq_windows, targets, on_block)
            bits_total = sum(spent)
        elif method != "fp32":
            bits_total = 0
            for name, module in targets.items():
                w, b = quantize(method, name, hessians.get(name))
                module.weight.data.copy_(w)
                bits_total += b
        quant_seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        result = perplexity_from_ids(
            model, eval_ids, seq_len=args.seq_len, max_windows=args.eval_windows, tokenizer=tokenizer
        )
        second = None
        if eval2_ids is not None:
            second = perplexity_from_ids(
                model, eval2_ids, seq_len=args.seq_len, max_windows=args.eval2_windows, tokenizer=tokenizer
            ).perplexity
        eval_seconds = time.perf_counter() - t0
        for name, module in targets.items():
            module.weight.data.copy_(originals[name])
        row = {
            "method": method,
            "perplexity": result.perplexity,
            "perplexity2": second,
            "word_perplexity": result.word_perplexity,
            "bits_per_weight": bits_total / n_weights,
            # what the artifact would weigh: the quantized linears' exact bits + every other tensor in 16 bits
            # (fp32 counts the whole model in 16 bits too: the bf16 original users compare with)
            "model_bytes": (n_weights * 16 if method == "fp32" else bits_total) // 8 + other_bytes,
            "quantize_seconds": quant_seconds,
            "eval_seconds": eval_seconds,
        }
        if method in lnq_layers:
            layers = lnq_layers[method]
            row["lnq_layers"] = layers
            row["lnq_held_out_ratio"] = sum(x["held_out_after"] for x in layers) / sum(
                x["held_out_before"] for x in layers
            )
            print(f"{method}: held-out objective after / before, summed over layers: {row['lnq_held_out_ratio']:.4f}")
        rows.append(row)
        print(
            f"{method:14s} ppl {result.perplexity:9.3f}  "
            + (f"text2 {second:9.3f}  " if second is not None else "")
            + f"bpw {row['bits_per_weight']:.3f}  "
            f"quantize {quant_seconds:6.1f} s  eval {eval_seconds:5.1f} s",
            flush=True,
        )

    print(
        f"\n{args.model}: calibration {Path(args.calibration).name} ({args.num_samples} x {args.seq_len}), "
        f"eval {Path(args.eval_text).name} ({args.eval_windows} x {args.seq_len}); load {load_seconds:.1f} s, "
        f"Fisher {fisher_seconds:.1f} s; activation {activation_seconds:.1f} s; {torch.get_num_threads()} threads"
    )
    text2 = f" | {Path(args.eval_text2).name} ({args.eval2_windows} x {args.seq_len})" if args.eval_text2 else ""
    print(f"| method | perplexity{text2} | bits/weight | quantize s |\n|---|---|{'---|' if text2 else ''}---|---|")
    for row in rows:
        cell = f" | {row['perplexity2']:.2f}" if row["perplexity2"] is not None else ""
        print(
            f"| {row['method']} | {row['perplexity']:.2f}{cell} | {row['bits_per_weight']:.3f} "
            f"| {row['quantize_seconds']:.1f} |"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "model": args.model,
                "num_samples": args.num_samples,
                "seq_len": args.seq_len,
                "eval_windows": args.eval_windows,
                "fisher_seconds": fisher_seconds,
                "load_seconds": load_seconds,
                "rows": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
