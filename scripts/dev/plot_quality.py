"""Perplexity vs model bytes: every method and peer of a bench_quality.py run on one plot (SVG).

    .venv/bin/python scripts/dev/plot_quality.py bench-out/quality.json --out docs/quality.svg
    .venv/bin/python scripts/dev/plot_quality.py bench-out/quality.json --extra b3.5=41.18:118.0e6 \\
        --out docs/quality.svg

Reads the JSON that scripts/bench/bench_quality.py writes (rows with method, perplexity, model_bytes). ``--extra``
adds points measured elsewhere (an artifact's `compress --json` artifact_bytes and its `squeeze eval`
perplexity), as NAME=PERPLEXITY:BYTES. Squeeze variants, RTN and HQQ get one marker each, so the frontier
reads at a glance; the y axis is logarithmic (2-bit peers sit orders of magnitude above). Needs matplotlib
(`pip install -e .[bench]`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

FAMILIES = (("rtn-", "RTN", "s"), ("hqq-", "HQQ", "^"), ("fp32", "original (16-bit)", "*"))


def family(method: str) -> tuple[str, str]:
    """(legend label, marker) of a bench method name: RTN, HQQ, the original, else squeeze."""
    for prefix, label, marker in FAMILIES:
        if method.startswith(prefix):
            return label, marker
    return "squeeze", "o"


def parse_extra(text: str) -> dict[str, object]:
    """NAME=PERPLEXITY:BYTES -> a row like bench_quality's."""
    name, _, rest = text.partition("=")
    ppl, _, size = rest.partition(":")
    if not name or not ppl or not size:
        raise SystemExit(f"--extra wants NAME=PERPLEXITY:BYTES, found {text!r}")
    return {"method": name, "perplexity": float(ppl), "model_bytes": float(size)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="bench_quality.py JSON files")
    parser.add_argument("--extra", action="append", default=[], help="NAME=PERPLEXITY:BYTES")
    parser.add_argument("--out", default="bench-out/quality.svg")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    rows: list[dict[str, object]] = []
    model = "model"
    for path in args.results:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        model = data.get("model", model)
        rows.extend(row for row in data["rows"] if "model_bytes" in row)
    rows.extend(parse_extra(text) for text in args.extra)
    if not rows:
        raise SystemExit("no rows with model_bytes: run scripts/bench/bench_quality.py first")

    fig, ax = plt.subplots(figsize=(8, 5.5))
    seen: set[str] = set()
    for row in rows:
        label, marker = family(str(row["method"]))
        x, y = float(row["model_bytes"]) / 1e6, float(row["perplexity"])  # type: ignore[arg-type]
        ax.scatter(x, y, marker=marker, s=45, label=None if label in seen else label)
        seen.add(label)
        ax.annotate(str(row["method"]), (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7)
    ax.set_yscale("log")
    ax.set_xlabel("model bytes (MB): quantized linears at their exact bits, other tensors in 16 bits")
    ax.set_ylabel("WikiText-2 perplexity (log scale)")
    ax.set_title(f"{model}: perplexity vs size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, bbox_inches="tight", metadata={"Date": None})  # no timestamp: the same data, the same file
    print(f"wrote {out} ({len(rows)} points)")


if __name__ == "__main__":
    main()
