"""A SentencePiece-like tokenizer for tests, built in milliseconds: the pipeline of Llama 2's, Mistral's and
stories260K's ``tokenizer.json`` (Metaspace ``▁`` words, BPE with byte fallback ``<0x00>`` ... ``<0xFF>``, a
decoder that writes ``▁`` as a space and strips the first one), so a word's leading space is written only in
context and a character outside the vocabulary is spelled in bytes."""

from __future__ import annotations

import json
from typing import Any

SPECIAL = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2 as in Llama's vocabulary; the 256 byte tokens follow

#: What the tokenizer is trained on by default: its characters and a few whole words (any other character,
#: "é" say, is spelled in bytes).
TEXT = (
    "Once upon a time there was a little cat. The cat sat on the mat and the dog ran to the park.\n"
    "Lily and Tom were playing in the sun. She loved the dog and the dog loved her. Then it was time to go.\n"
    "A long prompt with more words than the context the output is read after, said the bird.\n"
) * 4


def build_sentencepiece_tokenizer(text: str = TEXT, vocab_size: int = 120) -> Any:
    """A PreTrainedTokenizerFast trained on ``text`` (BPE merges beyond the specials, bytes and characters)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    metaspace = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = metaspace
    trained.train_from_iterator(text.splitlines(), trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False))
    learned = json.loads(trained.to_str())["model"]
    pieces = [*SPECIAL, *(f"<0x{b:02X}>" for b in range(256))]
    pieces += sorted(learned["vocab"], key=learned["vocab"].__getitem__)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    backend = Tokenizer(
        models.BPE(
            vocab={piece: i for i, piece in enumerate(pieces)},
            merges=merges,
            unk_token="<unk>",
            byte_fallback=True,
            fuse_unk=True,
        )
    )
    backend.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL])
    backend.pre_tokenizer = metaspace
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    return tokenizer
