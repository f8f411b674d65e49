"""``squeeze serve``: an OpenAI-compatible server over a continuously batched engine and a paged quantized KV cache.

Two rooms and what they share. ``serve/engine/`` runs the model: engine (the thread that ties the rest
together), scheduler (the per-step plan: continuous batching, chunked prefill, preemption, and each step's
bookkeeping), blocks (block tables and reference counts), prefix_cache (KV blocks of shared prompt prefixes,
found by name), kv_pool (the paged int8 / int4 / full-precision KV storage), runner (one step through the
model), sequence, sampling, grammar, and the tokenizer the engine composes. ``serve/http/`` speaks OpenAI's
wire format over any engine: app (the FastAPI app and its routes), request and tool schemas, responses,
choices, errors, metrics and the connection limits. Shared: types (what the engine and the HTTP layer
exchange) and logprobs (computed on the engine's side, written in OpenAI's shapes on the HTTP side).
Nothing here is imported by ``import squeeze``.
"""
