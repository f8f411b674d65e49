"""Greedy generation through vLLM, printed as one JSON object (run in the vLLM environment, scripts/check_vllm.sh).

    python scripts/bench/vllm_generate.py MODEL --prompts-json '["Once upon a time"]' --max-tokens 32 [--tp 3] \
        [--enable-expert-parallel]

Prints {"tokens": [[ids...]...], "texts": [...], "prompt_tokens": [[ids...]...], "logprobs": [[{id: logprob}...]...],
"load_seconds": s, "generate_seconds": s}. Used by tests/integrations/vllm and scripts/bench/bench_vllm.py: vLLM
spawns worker processes, so each engine lives in a process of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--prompts-json", required=True, help="a JSON list of prompts")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    parser.add_argument(
        "--enable-expert-parallel", action="store_true", help="MoE experts dealt to the --tp ranks, not cut"
    )
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--logprobs", type=int, default=0, help="top logprobs to return per step")
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--kv-cache-dtype", default="auto")
    args = parser.parse_args()
    prompts = json.loads(args.prompts_json)

    if args.tp > 1:  # vLLM's CPU workers each bind a core list; this machine kind has 2 cores and 1 NUMA node
        cores = os.cpu_count() or 1
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % cores) for i in range(args.tp)))
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        enforce_eager=True,
        # on CPU: the fraction of the machine's memory EACH rank reserves for its KV cache
        gpu_memory_utilization=0.24 / args.tp,
        tensor_parallel_size=args.tp,
        enable_expert_parallel=args.enable_expert_parallel,
        distributed_executor_backend="mp" if args.tp > 1 else None,
        load_format=args.load_format,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    load_seconds = time.perf_counter() - start
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=0.0, logprobs=args.logprobs or None, ignore_eos=args.ignore_eos
    )
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    generate_seconds = time.perf_counter() - start
    result = {
        "tokens": [list(out.outputs[0].token_ids) for out in outputs],
        "texts": [out.outputs[0].text for out in outputs],
        "prompt_tokens": [list(out.prompt_token_ids or []) for out in outputs],
        "logprobs": [
            [{str(k): v.logprob for k, v in step.items()} for step in (out.outputs[0].logprobs or [])]
            for out in outputs
        ],
        "load_seconds": load_seconds,
        "generate_seconds": generate_seconds,
    }
    print("VLLM_RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":  # vLLM's workers spawn: nothing may run on import
    sys.exit(main())
