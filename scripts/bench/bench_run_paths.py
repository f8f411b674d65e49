"""``squeeze run`` decode tokens/s with transformers' forward + the torch KV codec vs the flat forward + the native
KV write (issue 45 items 2 and 4), same process, interleaved, best of ``--repeats`` (a shared machine).

    .venv/bin/python scripts/bench/bench_run_paths.py --artifact DIR [--tokens 64] [--repeats 3] [--threads N]
        [--kv-dynamic 4]

Both paths give the same text (checked here too); ``before`` sets SQUEEZE_FAST_PATH=0 and
SQUEEZE_NATIVE_KV_WRITE=0, ``after`` leaves both on. The artifact's calibrated KV cache is used (or
``--kv-dynamic``'s uncalibrated one).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from bench_common import command_line, revision  # scripts/bench/ is on sys.path when a script runs

from squeeze import api
from squeeze.runtime.options import KVOptions
from squeeze.runtime.sampling_params import SamplingParams

MODES = {"before": {"SQUEEZE_FAST_PATH": "0", "SQUEEZE_NATIVE_KV_WRITE": "0"}, "after": {}}
PROMPT = "The President spoke to the Congress about the state of the union, and said that"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--kv-dynamic", type=int, choices=(4, 8), help="uncalibrated per-token int KV of this width")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = api.load(args.artifact)
    kv_options = KVOptions(kv_bits=args.kv_dynamic, kv_dynamic=True) if args.kv_dynamic else None
    print(json.dumps({"revision": revision(), "command": command_line(), "threads": torch.get_num_threads()}))
    best: dict[str, float] = {}
    texts: dict[str, str] = {}
    for _ in range(args.repeats):
        for mode, env in MODES.items():
            for name in ("SQUEEZE_FAST_PATH", "SQUEEZE_NATIVE_KV_WRITE"):
                os.environ.pop(name, None)
            os.environ.update(env)
            sampling = SamplingParams(max_tokens=args.tokens, temperature=0)
            result = api.generate(loaded, PROMPT, sampling, kv=kv_options)
            rate = result.tokens_per_second or 0.0
            best[mode] = max(best.get(mode, 0.0), rate)
            texts[mode] = result.text
            kv = result.kv_cache
    print(
        json.dumps(
            {"kv": kv, "tokens": args.tokens, "best tok/s": best, "after / before": best["after"] / best["before"]}
        )
    )
    print(json.dumps({"same text": texts["before"] == texts["after"]}))


if __name__ == "__main__":
    main()
