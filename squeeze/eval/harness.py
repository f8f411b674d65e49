"""lm-evaluation-harness on a squeeze model, as squeeze loads it (verified, compressed kernels, its KV cache).

:class:`HarnessModel` is the scoring core and does not need lm-eval: log-likelihoods of (context,
continuation) pairs, rolling log-likelihoods of texts, and greedy generation, computed as ``squeeze eval``
computes perplexity (one forward pass, fp32 log-softmax: :func:`squeeze.eval.perplexity.next_token_scores`).
Texts are tokenized as lm-eval's own models tokenize them (no special tokens; a context's trailing spaces
moved to the continuation; an empty context replaced by the BOS token, else EOS), so its numbers are those
``squeeze serve`` gives lm-eval's ``local-completions`` model on the same artifact.

:func:`lm_class` wraps the core in lm-eval's ``LM`` interface (importing lm-eval then), :func:`register`
names it ``squeeze`` in lm-eval's model registry, and :func:`run_tasks` runs lm-eval's evaluator on named
tasks (``squeeze eval --tasks``). lm-eval is the optional extra ``squeeze[eval]``.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from squeeze.errors import ConfigError
from squeeze.eval.perplexity import CacheFactory, next_token_scores
from squeeze.eval.task_files import check_include_path
from squeeze.limits import check_at_least, is_int
from squeeze.runtime.options import KVOptions, LoadOptions, load_and_kv

#: The name lm-eval knows squeeze's model by (``--model squeeze``).
MODEL_NAME = "squeeze"
INSTALL_HINT = "pip install 'squeeze[eval]'"


class HarnessModel:
    """A loaded causal LM scored the way lm-evaluation-harness asks (see the module docstring).

    ``batch_size``: sequences per forward pass (right-padded: a causal model's real positions do not see the
    padding). ``kv_cache``: score through a fresh cache from this factory (the artifact's quantized KV cache).
    ``max_length``: the context (default: the model's ``max_position_embeddings``, else 2048); longer inputs
    keep their last tokens.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        *,
        batch_size: int = 1,
        kv_cache: CacheFactory | None = None,
        max_length: int | None = None,
    ) -> None:
        if batch_size < 1:
            raise ConfigError(f"--batch-size must be a positive integer, found {batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.kv_cache = kv_cache
        context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        self.max_length = max_length or (context if isinstance(context, int) else 2048)
        prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        self.prefix_token_id = int(prefix if prefix is not None else 0)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """lm-eval's split: the context's trailing spaces go with the continuation, whose tokens are those of
        the whole text after the context's."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if not context:
            return [self.prefix_token_id], self.encode(continuation)
        whole = self.encode(context + continuation)
        context_ids = self.encode(context)
        return context_ids, whole[len(context_ids) :]

    def loglikelihood(self, pairs: Sequence[tuple[str, str]]) -> list[tuple[float, bool]]:
        """(log-likelihood of the continuation given the context, whether it is the greedy continuation)."""
        encoded = [self.encode_pair(context, continuation) for context, continuation in pairs]
        return self.loglikelihood_ids(encoded)

    def loglikelihood_ids(self, encoded: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """:meth:`loglikelihood` of already tokenized (context, continuation) pairs."""
        rows = []
        for context, continuation in encoded:
            ids = (context + continuation)[-self.max_length :]
            rows.append((ids, min(len(continuation), len(ids) - 1)))
        return [(float(-nll.sum()), bool(greedy)) for nll, greedy in self._score(rows)]

    def loglikelihood_rolling(self, texts: Sequence[str]) -> list[float]:
        """Each text's whole log-likelihood (after the prefix token), in disjoint windows of the context."""
        rows: list[tuple[list[int], int]] = []
        owners: list[int] = []
        step = self.max_length - 1
        for t, text in enumerate(texts):
            tokens = [self.prefix_token_id, *self.encode(text)]
            for start in range(1, len(tokens), step):
                end = min(start + step, len(tokens))
                rows.append((tokens[max(0, end - self.max_length) : end], end - start))
                owners.append(t)
        totals = [0.0] * len(texts)
        for owner, (nll, _) in zip(owners, self._score(rows), strict=True):
            totals[owner] -= float(nll.sum())
        return totals

    def generate_until(self, context: str, until: Sequence[str], max_new_tokens: int) -> str:
        """Greedy continuation of ``context``, cut before the first of ``until``."""
        ids = torch.tensor([self.encode(context)[-(self.max_length - max_new_tokens) :]])
        with torch.inference_mode():
            generate: Callable[..., torch.Tensor] = self.model.generate  # type: ignore[assignment]
            out = generate(input_ids=ids, max_new_tokens=max_new_tokens, do_sample=False)
        text = str(self.tokenizer.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=True))
        cut = min((at for at in (text.find(s) for s in until if s) if at >= 0), default=len(text))
        return text[:cut]

    def _score(self, rows: Sequence[tuple[list[int], int]]) -> list[tuple[torch.Tensor, bool]]:
        """For each (ids, k): the NLLs of the last k tokens of ids and whether each was the greedy choice."""
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))  # similar lengths share a batch
        results: dict[int, tuple[torch.Tensor, bool]] = {}
        for b in range(0, len(order), self.batch_size):
            batch = order[b : b + self.batch_size]
            width = max(len(rows[i][0]) for i in batch)
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            for r, i in enumerate(batch):
                ids[r, : len(rows[i][0])] = torch.tensor(rows[i][0])
            nll, greedy = next_token_scores(self.model, ids, self.kv_cache)
            for r, i in enumerate(batch):
                tokens, k = rows[i]
                n = len(tokens)
                span = slice(n - 1 - k, n - 1)  # position p predicts token p + 1
                targets = ids[r, n - k : n]
                results[i] = (nll[r, span], bool((greedy[r, span] == targets).all()))
        return [results[i] for i in range(len(rows))]


def load_harness_model(
    path: str | os.PathLike[str],
    *,
    batch_size: int = 1,
    load: LoadOptions | None = None,
    kv: KVOptions | None = None,
    **options: Any,
) -> HarnessModel:
    """A model or artifact opened as ``squeeze eval`` opens it (an artifact verified, its LUT kernels'
    ``activations``, its calibrated KV cache unless ``kv_bits`` says otherwise) and wrapped for lm-eval.
    ``load`` / ``kv``: the options objects, or their keywords (``activations=``, ``kv_bits=``...)."""
    from squeeze.eval.compare import kv_cache_factory, open_target, resolve_target

    load, kv = load_and_kv(options, load, kv)
    model, tokenizer, calibrated = open_target(resolve_target(path), load)
    factory, _ = kv_cache_factory(model, calibrated, kv)
    return HarnessModel(model, tokenizer, batch_size=batch_size, kv_cache=factory)


def import_lm_eval() -> Any:
    """lm-eval's package, or ConfigError with the install line."""
    try:
        return importlib.import_module("lm_eval")
    except ImportError:
        raise ConfigError("lm-evaluation-harness (lm_eval) is not installed", hint=INSTALL_HINT) from None


def lm_class() -> type:
    """lm-eval's ``LM`` for squeeze models (``--model squeeze --model_args pretrained=PATH[,kv_bits=4]``)."""
    import_lm_eval()
    from lm_eval.api.model import LM

    class SqueezeLM(LM):  # type: ignore[misc]
        """lm-eval's view of a :class:`HarnessModel`."""

        def __init__(
            self,
            pretrained: str | None = None,
            batch_size: int | str = 1,
            kv_bits: int | None = None,
            kv_dynamic: bool = False,
            core: HarnessModel | None = None,
            **_: Any,
        ) -> None:
            super().__init__()
            if core is None:
                if pretrained is None:
                    raise ConfigError("--model squeeze needs --model_args pretrained=ARTIFACT")
                size = int(batch_size) if str(batch_size).isdigit() else 1
                bits = int(kv_bits) if kv_bits is not None else None
                kv = KVOptions(bits, bool(kv_dynamic))
                core = load_harness_model(pretrained, batch_size=size, kv=kv)
            self.core = core

        def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
            return self.core.loglikelihood([tuple(r.args) for r in requests])

        def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
            return self.core.loglikelihood_rolling([r.args[0] for r in requests])

        def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
            out = []
            for request in requests:
                context, options = request.args
                until = options.get("until") or []
                until = [until] if isinstance(until, str) else list(until)
                out.append(self.core.generate_until(context, until, int(options.get("max_gen_toks", 256))))
            return out

    return SqueezeLM


def register() -> None:
    """Name squeeze's model ``squeeze`` in lm-eval's registry (idempotent)."""
    import_lm_eval()
    import lm_eval.models  # noqa: F401 - lm-eval's own models first: it fills an empty registry only
    from lm_eval.api.registry import model_registry

    if MODEL_NAME not in model_registry:
        model_registry.register(MODEL_NAME, target=lm_class())


def _is_download_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a dataset that could not be fetched (offline, no such dataset, network)."""
    root = type(exc).__module__.split(".")[0]
    return isinstance(exc, (ConnectionError, TimeoutError)) or root in {
        "datasets",
        "huggingface_hub",
        "requests",
        "urllib3",
        "fsspec",
        "aiohttp",
    }


@dataclass(frozen=True)
class HarnessResult:
    """lm-eval's results: ``rows`` (task, metric, value, stderr) and its whole ``results`` dictionary."""

    rows: tuple[tuple[str, str, float, float | None], ...]
    results: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {
            "results": self.results.get("results", {}),
            "n_samples": self.results.get("n-samples", {}),
            "configs": {k: {"num_fewshot": v.get("num_fewshot")} for k, v in self.results.get("configs", {}).items()},
        }


def run_tasks(
    core: HarnessModel,
    tasks: Sequence[str],
    *,
    include_path: str | os.PathLike[str] | None = None,
    limit: int | None = None,
    num_fewshot: int | None = None,
) -> HarnessResult:
    """lm-eval's evaluator on ``tasks`` (ConfigError for a task lm-eval does not know, or one whose data it
    cannot reach offline, with the hint to use ``include_path``)."""
    check_task_options(include_path=include_path, limit=limit, num_fewshot=num_fewshot)
    lm_eval = import_lm_eval()
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=os.fspath(include_path) if include_path is not None else None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ConfigError(
            f"lm-eval does not know the task{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}",
            hint="`lm_eval ls tasks` lists the known ones; --include-path DIR adds the task YAMLs in DIR",
        )
    try:
        results = lm_eval.simple_evaluate(
            model=lm_class()(core=core),
            tasks=list(tasks),
            num_fewshot=num_fewshot,
            limit=limit,
            task_manager=manager,
            batch_size=core.batch_size,
            log_samples=False,
        )
    except ValueError as exc:
        if "larger than population" not in str(exc):  # random.sample's words: fewer documents than asked for
            raise
        raise ConfigError(
            f"--num-fewshot {num_fewshot} asks for more examples than a task has documents to draw them from",
            hint="pass a smaller --num-fewshot (most tasks use 0 to 25)",
        ) from None
    except Exception as exc:
        if not _is_download_failure(exc):
            raise
        raise ConfigError(
            f"lm-eval could not load a task's data: {type(exc).__name__}: {exc}",
            hint="offline, use a local task: --include-path DIR with a task YAML whose data are local files",
        ) from None
    rows = []
    for task, metrics in (results or {}).get("results", {}).items():
        for key, value in metrics.items():
            name, comma, _filter = key.partition(",")
            if not comma or name.endswith("_stderr") or not isinstance(value, (int, float)):
                continue  # "alias", "sample_len": not metrics
            stderr = metrics.get(f"{name}_stderr,{_filter}")
            rows.append((task, name, float(value), float(stderr) if isinstance(stderr, (int, float)) else None))
    return HarnessResult(tuple(rows), results or {})


#: Examples per prompt at most: past any task's convention (0 to 25) and past what fits any context; lm-eval
#: itself fails deep inside (random.sample) when a task has fewer documents than asked for.
MAX_NUM_FEWSHOT = 1024


def check_task_options(
    *, include_path: str | os.PathLike[str] | None, limit: int | None, num_fewshot: int | None
) -> None:
    """ConfigError, before lm-eval starts, for a ``num_fewshot`` outside [0, MAX_NUM_FEWSHOT], a ``limit``
    below 1, or an ``include_path`` lm-eval cannot read safely (squeeze.eval.task_files)."""
    if num_fewshot is not None and not (is_int(num_fewshot) and 0 <= num_fewshot <= MAX_NUM_FEWSHOT):
        raise ConfigError(
            f"--num-fewshot must be an integer from 0 to {MAX_NUM_FEWSHOT}, found {num_fewshot!r}",
            hint="most tasks use 0 to 25 examples per prompt",
        )
    if limit is not None:
        check_at_least(limit, 1, "--limit", hint="pass --limit N with N >= 1 documents per task, or leave it out")
    if include_path is not None:
        check_include_path(include_path)


def main() -> None:
    """``python -m squeeze.eval.harness ARGS``: lm-eval's own command line (``lm_eval ARGS``) with squeeze
    registered: ``--model squeeze --model_args pretrained=ARTIFACT`` (squeeze's kernels and KV cache), and
    ``--model hf --model_args pretrained=ARTIFACT`` (transformers' loader, which needs squeeze's quantization
    method registered: lm-eval has no plugin entry points, so this module is the one-line plugin)."""
    from squeeze.runtime.hf import register as register_transformers

    register_transformers()
    register()
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


__all__ = [
    "main",
    "MODEL_NAME",
    "INSTALL_HINT",
    "HarnessModel",
    "HarnessResult",
    "load_harness_model",
    "import_lm_eval",
    "lm_class",
    "register",
    "run_tasks",
    "check_task_options",
    "MAX_NUM_FEWSHOT",
]


if __name__ == "__main__":
    main()
