"""Evaluation: paper-protocol token perplexity and lm-eval-style word perplexity."""

from __future__ import annotations

from squeeze.eval.perplexity import PerplexityResult, perplexity, perplexity_from_ids

__all__ = ["PerplexityResult", "perplexity", "perplexity_from_ids"]
