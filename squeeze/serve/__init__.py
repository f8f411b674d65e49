"""``squeeze serve``: an OpenAI-compatible server over a continuously batched engine and a paged quantized KV cache.

Modules, each with one job: types (what the engine and the HTTP layer share), blocks (block tables and
reference counts), prefix_cache (KV blocks of shared prompt prefixes, found by name), kv_pool (the paged
int8 / int4 / full-precision KV storage), sequence (one request's tokens and text), scheduler (the per-step
plan: continuous batching, chunked prefill, preemption), runner (one step through the model), sampling
(each request's next token), engine (the thread that ties them together), and the HTTP side (protocol,
metrics, http). Nothing here is imported by ``import squeeze``.
"""
