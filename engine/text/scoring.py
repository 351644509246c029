"""Scoring requests on top of ``model.score()``: continuations, rolling windows, perplexity.

The definitions are lm-evaluation-harness's, so numbers agree with its ``hf`` backend:

* ``loglikelihood(context, continuation)``: the sum of log p(continuation tokens | all tokens before
  them) and whether every continuation token is the argmax. A pair longer than ``n_positions + 1``
  tokens keeps its last ``n_positions + 1`` (left truncation; the last token is only predicted).
* ``loglikelihood_rolling(tokens)``: the text's total log-likelihood, the first token conditioned
  on a prefix token (eos/bos), in windows of at most ``max_len`` input tokens: the first window
  predicts the first ``max_len`` tokens, every later one the next ``stride`` tokens with the
  ``max_len - stride`` tokens before them as extra context (``stride = max_len``: disjoint windows,
  lm-eval's ``get_rolling_token_windows`` with ``context_len=1``).

Requests are sorted by length so that each batch pads little; results come back in input order.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np


def rolling_windows(
    tokens: Sequence[int], prefix_token: int, max_len: int, stride: int | None = None
) -> list[tuple[list[int], list[int]]]:
    """``(context, continuation)`` pairs covering ``tokens`` once each, every pair at most
    ``max_len + 1`` tokens long (``max_len`` inputs). ``stride`` defaults to ``max_len``."""
    stride = max_len if stride is None else stride
    if not 1 <= stride <= max_len:
        raise ValueError(f"stride must be in [1, max_len={max_len}], got {stride}")
    toks = [int(t) for t in tokens]
    if not toks:
        return []
    first = min(max_len, len(toks))
    out = [([int(prefix_token)], toks[:first])]
    done = first
    while done < len(toks):
        end = min(len(toks), done + stride)
        start = max(0, end - max_len - 1)  # inputs tokens[start : end - 1], max_len of them at most
        out.append((toks[start:done], toks[done:end]))
        done = end
    return out


def _pairs_to_rows(model, pairs) -> list[tuple[list[int], int]]:
    """Each pair as (token ids to score, how many trailing ones are the continuation)."""
    limit = model.n_positions + 1
    rows = []
    for i, (ctx, cont) in enumerate(pairs):
        ctx, cont = [int(t) for t in ctx], [int(t) for t in cont]
        if not ctx:
            raise ValueError(f"request {i}: empty context; pass a prefix token (eos or bos) as the context")
        if not cont:
            raise ValueError(f"request {i}: empty continuation; give at least one token to score")
        if len(cont) >= limit:
            raise ValueError(
                f"request {i}: a continuation of {len(cont)} tokens does not fit n_positions="
                f"{model.n_positions}; use loglikelihood_rolling or a larger n_positions"
            )
        rows.append(((ctx + cont)[-limit:], len(cont)))
    return rows


def loglikelihood(model, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[tuple[float, bool]]:
    """``(sum log p(continuation | context), is_greedy)`` per ``(context ids, continuation ids)``."""
    rows = _pairs_to_rows(model, pairs)
    out: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
    for lo in range(0, len(order), model.batch_size):
        idx = order[lo : lo + model.batch_size]
        width = max(len(rows[i][0]) for i in idx)
        ids = np.zeros((len(idx), width), np.int64)
        mask = np.zeros((len(idx), width), np.int64)
        for r, i in enumerate(idx):
            seq = rows[i][0]
            ids[r, width - len(seq) :], mask[r, width - len(seq) :] = seq, 1
        res = model.score(ids, attention_mask=mask)
        for r, i in enumerate(idx):
            n_cont = rows[i][1]
            lp = res.logprobs[r, width - n_cont :].astype(np.float64).sum()
            out[i] = (float(lp), bool(res.is_greedy[r, width - n_cont :].all()))
    return out


def loglikelihood_rolling(
    model,
    token_lists: Sequence[Sequence[int]],
    prefix_token: int,
    max_len: int | None = None,
    stride: int | None = None,
) -> list[float]:
    """Total log-likelihood of each token list (``rolling_windows``; ``max_len`` defaults to the
    model's ``n_positions``). Windows of every text share batches."""
    max_len = model.n_positions if max_len is None else int(max_len)
    if not 1 <= max_len <= model.n_positions:
        raise ValueError(f"max_len must be in [1, n_positions={model.n_positions}], got {max_len}")
    owner, pairs = [], []
    for i, toks in enumerate(token_lists):
        for pair in rolling_windows(toks, prefix_token, max_len, stride):
            owner.append(i)
            pairs.append(pair)
    totals = [0.0] * len(token_lists)
    for i, (lp, _) in zip(owner, loglikelihood(model, pairs), strict=True):
        totals[i] += lp
    return totals


@dataclasses.dataclass(frozen=True)
class TextScore:
    """A text's score: ``tokens`` scored, their summed log-probability (nats), nats per token and
    perplexity (``exp`` of nats per token)."""

    tokens: int
    logprob: float
    nats_per_token: float
    perplexity: float

    @classmethod
    def of(cls, tokens: int, logprob: float) -> TextScore:
        nats = -logprob / tokens if tokens else float("nan")
        return cls(tokens, logprob, nats, math.exp(nats) if tokens else float("nan"))


def prefix_token(tokenizer) -> int:
    """The token a text's first token is conditioned on: bos when the tokenizer has one, else eos
    (lm-eval's ``prefix_token_id``)."""
    for tid in (tokenizer.bos_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    raise ValueError("the tokenizer has neither a bos nor an eos token; pass prefix_token explicitly")


def tok_encode(tokenizer, text: str, prefix: int, add_special_tokens: bool | None = None) -> list[int]:
    """Token ids as lm-eval's hf backend encodes a request: with the tokenizer's own special
    tokens (a Llama bos, say) unless asked otherwise or the text already starts with the prefix
    token's text (they would be doubled)."""
    if add_special_tokens is None:
        first = tokenizer.decode([prefix])
        add_special_tokens = not (first and text.startswith(first))
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def encode_pair(tokenizer, context: str, continuation: str, prefix: int | None = None):
    """``(context ids, continuation ids)`` as lm-eval tokenizes a loglikelihood request: whitespace
    ending the context moves to the continuation, the whole string is encoded once and split where
    the context's own encoding ends; an empty context becomes ``[prefix]`` (bos, else eos) unless
    the continuation already starts with that token."""
    prefix = prefix_token(tokenizer) if prefix is None else prefix
    if not context:
        cont = tok_encode(tokenizer, continuation, prefix, add_special_tokens=False)
        return (cont[:1], cont[1:]) if cont and cont[0] == prefix else ([prefix], cont)
    cut = len(context.rstrip())
    context, continuation = context[:cut], context[cut:] + continuation
    whole = tok_encode(tokenizer, context + continuation, prefix)
    n_ctx = len(tok_encode(tokenizer, context, prefix))
    return whole[:n_ctx], whole[n_ctx:]


def perplexity(
    model, tokenizer, texts: Sequence[str], stride: int | None = None, max_len: int | None = None
) -> list[TextScore]:
    """Score whole texts: tokenized without special tokens, the first token conditioned on
    ``prefix_token(tokenizer)``, in rolling windows (``loglikelihood_rolling``)."""
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    totals = loglikelihood_rolling(model, ids, prefix_token(tokenizer), max_len, stride)
    return [TextScore.of(len(t), lp) for t, lp in zip(ids, totals, strict=True)]
