#!/usr/bin/env python3
"""Would a compact dtype for the Fisher checkpoint (and the spills) change any byte of the artifact? (issue 40.4)

    .venv/bin/python scripts/bench/bench_fisher_dtype.py --model ../shared/models/stories260K \\
        --calibration ../shared/corpora/tinystories_sample.txt --num-samples 8 --seq-len 64

Computes the Fisher once (float64 sums rounded to fp32, as compress does), then quantizes every target with each
recipe from the fp32 Fisher and from the same Fisher rounded to bfloat16 and to float16 (what a compact
checkpoint would hand the quantize stage), and prints, per recipe and dtype, how many targets come out with
different bytes (packed codes, LUT, sparse part). Any difference means that dtype is not free for that recipe.
"""

from __future__ import annotations

import argparse
import json

import torch

from squeeze.calibrate.fisher import fisher_information
from squeeze.calibrate.windows import calibration_windows
from squeeze.compression.quantize import quantize_module
from squeeze.config import load_calibration_spec, load_recipe
from squeeze.models.source import load_model, resolve_model
from squeeze.models.targets import find_target_linears


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--calibration", required=True)
    ap.add_argument("--num-samples", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--recipes", default="w4,w3,w3-s045")
    args = ap.parse_args()
    model, tokenizer = load_model(resolve_model(args.model), dtype=torch.float32)
    spec = load_calibration_spec(args.calibration, num_samples=args.num_samples, seq_len=args.seq_len)
    windows = calibration_windows(spec, tokenizer)
    names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    targets = find_target_linears(model, names)
    fisher = fisher_information(model, windows, targets)
    rows = []
    for name in args.recipes.split(","):
        recipe = load_recipe(name)
        for dtype in (torch.bfloat16, torch.float16):
            differing = 0
            for target, module in targets.items():
                weight = module.weight.detach().float()
                want = quantize_module(weight, fisher[target], recipe).to_tensors(target)
                got = quantize_module(weight, fisher[target].to(dtype).float(), recipe).to_tensors(target)
                differing += any(not torch.equal(got[k], want[k]) for k in want) or got.keys() != want.keys()
            rows.append(
                {
                    "recipe": name,
                    "stored_as": str(dtype).removeprefix("torch."),
                    "targets": len(targets),
                    "targets_with_different_bytes": differing,
                }
            )
            print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
