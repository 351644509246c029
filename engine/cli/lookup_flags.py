"""``--prompt-lookup-num-tokens K`` / ``--max-matching-ngram-size N`` of the text front ends
(``generate``, ``chat``): transformers' prompt lookup decoding (``aotlm.generate.lookup``), the same
text in fewer target forwards where the answer quotes its prompt."""

from __future__ import annotations

import argparse

from aotlm.generate import lookup, speculative


def add_lookup_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prompt-lookup-num-tokens",
        type=int,
        default=None,
        metavar="K",
        help="prompt lookup decoding: check K tokens copied from the prompt each forward (same text; "
        "pays where the answer quotes the prompt: edits, extraction, summaries)",
    )
    p.add_argument(
        "--max-matching-ngram-size",
        type=int,
        default=None,
        metavar="N",
        help=f"longest n-gram prompt lookup matches (default {lookup.DEFAULT_NGRAM})",
    )


def lookup_settings(args: argparse.Namespace, gen: dict) -> dict:
    """The flags as ``sample()`` keywords, checked before the weights load against the sampling
    settings ``gen`` (the rounds apply the distribution's settings only)."""
    k, n = args.prompt_lookup_num_tokens, args.max_matching_ngram_size
    if k is None:
        if n is not None:
            raise ValueError(
                "--max-matching-ngram-size is prompt lookup's: give --prompt-lookup-num-tokens too"
            )
        return {}
    for flag, value in (("--prompt-lookup-num-tokens", k), ("--max-matching-ngram-size", n)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    speculative.applicable(dict(gen), "--prompt-lookup-num-tokens")
    return {name: v for name, v in zip(lookup.NAMES, (k, n), strict=True) if v is not None}
