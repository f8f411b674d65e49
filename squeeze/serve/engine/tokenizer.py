"""The serving engine's tokenizer side (squeeze.serve.engine.engine): prompts and chat messages to token ids, ids
back to text (whole, each token alone, or each token's name in context for log-probabilities,
squeeze.serve.engine.token_names), and what /tokenizer_info reports. These run on the event loop's side
(tokenization on the HTTP layer's worker thread), never on the engine's."""

from __future__ import annotations

import re
from collections.abc import Sequence as Seq
from typing import Any

from squeeze.serve.engine.token_names import token_names
from squeeze.serve.types import RequestError, TokenLogprob, TokenNames


class EngineTokenizer:
    """The tokenizer side of :class:`~squeeze.serve.engine.engine.Engine`, which holds one and answers the HTTP
    layer's tokenizer calls (squeeze.serve.types.EngineClient) with it. ``tokenizer``: the model's (transformers);
    ``vocab_size``: the model's, which ids are checked against; ``max_model_len``: the engine's context."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def tokenize(self, prompt: str | Seq[int], *, add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])
        return self._check_ids(prompt, "prompt")

    def _check_ids(self, ids: Seq[int], param: str) -> list[int]:
        checked = [int(t) for t in ids]
        bad = [t for t in checked if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"{param} token ids must lie in [0, {self.vocab_size}), found {bad[0]}", param=param)
        return checked

    def detokenize(self, ids: Seq[int]) -> str:
        return str(self.tokenizer.decode(self._check_ids(ids, "tokens"), skip_special_tokens=False))

    def token_strings(self, ids: Seq[int]) -> list[str]:
        return [str(self.tokenizer.decode([int(i)], skip_special_tokens=False)) for i in ids]

    def token_names(self, context: Seq[int], entries: Seq[TokenLogprob], *, specials: bool = False) -> list[TokenNames]:
        return token_names(self.tokenizer, context, entries, specials=specials)

    def tokenizer_info(self) -> dict[str, Any]:
        tok = self.tokenizer
        info: dict[str, Any] = {"tokenizer_class": type(tok).__name__}
        for name in ("eos_token", "bos_token", "pad_token", "unk_token"):
            value = getattr(tok, name, None)
            info[name] = value if isinstance(value, str) else None
        template = getattr(tok, "chat_template", None)
        info["chat_template"] = template if isinstance(template, str) else None
        info["model_max_length"] = self.max_model_len
        info["vocab_size"] = self.vocab_size
        return info

    def tokenize_chat(self, messages: Seq[dict[str, Any]], tools: Seq[dict[str, Any]] | None = None) -> list[int]:
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise RequestError(
                "this model's tokenizer has no chat template, so /v1/chat/completions cannot format messages",
                hint="use /v1/completions with a plain prompt",
                param="messages",
            )
        if tools and not _renders_tools(template):
            raise RequestError(
                "this model's chat template does not render tools, so the model cannot be told about them",
                hint="send the request without tools (or describe them in a message), or serve a model whose "
                "chat template takes tools",
                param="tools",
            )
        text = self.tokenizer.apply_chat_template(
            [{**m, "content": _text_content(m.get("content"))} for m in messages],
            tools=list(tools) if tools else None,
            tokenize=False,
            add_generation_prompt=True,
        )
        # the template already wrote any BOS: adding special tokens again would double it (as squeeze run --chat)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def _renders_tools(template: Any) -> bool:
    """Whether a chat template reads the ``tools`` variable (transformers passes tools under that name; a
    template that never mentions it drops them silently). A dict of named templates counts if any does."""
    texts = template.values() if isinstance(template, dict) else [template]
    return any(isinstance(t, str) and re.search(r"\btools\b", t) is not None for t in texts)


def _text_content(content: Any) -> str:
    """A chat message's content as text: a string, or OpenAI's list of parts (their text parts joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(part.get("text", "") for part in content if isinstance(part, dict))  # as the HTTP layer
    return "" if content is None else str(content)


__all__ = ["EngineTokenizer"]
