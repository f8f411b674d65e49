"""The cost of echo scoring (issue 37): lm-eval's local-completions log-likelihood requests (token ids, echo,
logprobs 1, max_tokens 1, 8 prompts per HTTP request) through ``squeeze serve`` vs the in-process adapter
``squeeze eval --tasks`` uses, on a task's JSON lines; prints requests per second and the largest difference.

    python scripts/bench/bench_echo.py ARTIFACT [tests/data/lm_eval/tinystories_mc.jsonl] [PORT]
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx

from squeeze.eval.harness import load_harness_model

BATCH = 8


def main(artifact: str, task: str = "tests/data/lm_eval/tinystories_mc.jsonl", port: int = 8438) -> None:
    docs = [json.loads(line) for line in Path(task).read_text(encoding="utf-8").splitlines() if line.strip()]
    core = load_harness_model(artifact, batch_size=BATCH)
    encoded = [core.encode_pair(d["context"], c) for d in docs for c in d["choices"]]
    start = time.perf_counter()
    local = core.loglikelihood_ids(encoded)
    t_local = time.perf_counter() - start
    server = subprocess.Popen(
        [sys.executable, "-m", "squeeze", "serve", artifact, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as http:
            for _ in range(240):
                try:
                    if http.get("/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            served: list[float] = []
            start = time.perf_counter()
            for b in range(0, len(encoded), BATCH):
                batch = encoded[b : b + BATCH]
                body = {
                    "prompt": [c + x for c, x in batch],
                    "echo": True,
                    "logprobs": 1,
                    "max_tokens": 1,
                    "temperature": 0,
                    "seed": 1234,
                }
                choices = sorted(http.post("/v1/completions", json=body).json()["choices"], key=lambda c: c["index"])
                for (context, _), choice in zip(batch, choices, strict=True):
                    served.append(sum(choice["logprobs"]["token_logprobs"][len(context) : -1]))
            t_served = time.perf_counter() - start
    finally:
        server.terminate()
        server.wait()
    diff = max(abs(a[0] - b) for a, b in zip(local, served, strict=True))
    n = len(encoded)
    print(
        f"{n} requests: in-process {n / t_local:.1f}/s ({t_local:.1f} s), served {n / t_served:.1f}/s "
        f"({t_served:.1f} s), largest difference {diff:.2e}"
    )


if __name__ == "__main__":
    main(sys.argv[1], *sys.argv[2:3], *(int(p) for p in sys.argv[3:4]))
