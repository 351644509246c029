"""Generation requests on the host: HF-named parameters -> one traced state, then the decode loop.

``GenerationConfig`` uses transformers' names and semantics. Every sampling parameter and
``max_new_tokens`` is a scalar or a sequence with one value per row; all are validated here
(``ValueError``/``TypeError`` before any device work) and become per-row arrays of the
decode state (``graphs.state_spec``), so changing them never compiles anything.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from aotlm.core import buckets as bk
from aotlm.core import graphs, inputs, sampler_params, sampling, sharding
from aotlm.core.contract import GraphHost
from aotlm.core.state import DecodeState
from aotlm.generate import bans, constraints, sequence_bias
from aotlm.generate.params import GenerationConfig
from aotlm.generate.stopping import criteria_hit

# tokens per decode call while a streamer or stopping criteria listen: one, so a streamer gets
# each token as it is produced and criteria see every token (measured: scripts/bench.py, the
# streamed row); the loop stays on device otherwise
STREAM_CHUNK = 1


@dataclass
class GenerateOutput:
    """``sample(..., return_dict=True)``: tokens plus per-token scores and finish reasons.

    ``logprobs[b, i]``: log-probability of generated token ``i`` under the distribution row
    ``b`` drew it from (after penalties and warpers; 0 after the row finished).
    ``num_generated[b]``: tokens row ``b`` generated, its stop token included.
    ``top_logprobs`` (when requested): ``(ids [B, new, n], logprobs [B, new, n])``.
    ``scores`` / ``logits`` (``output_scores`` / ``output_logits``): one ``[B, V]`` array per
    step, as transformers' ``generate`` returns them: the processed scores each token was chosen
    from (warped in sampled rows), the model's logits.
    """

    sequences: np.ndarray
    logprobs: np.ndarray
    finish_reason: list[str]
    num_generated: np.ndarray
    top_logprobs: tuple[np.ndarray, np.ndarray] | None = None
    time_to_first_token: float = 0.0  # seconds from the call to the first token on the host
    scores: tuple[np.ndarray, ...] | None = None
    logits: tuple[np.ndarray, ...] | None = None


def per_row(value, name: str, n: int, dtype) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim == 0:
        arr = np.full(n, arr)
    if arr.ndim != 1 or arr.shape[0] != n:
        raise ValueError(f"{name} has {arr.size} values for {n} prompts; give one value or one per row")
    if dtype is bool:
        if arr.dtype != np.bool_:
            raise TypeError(f"{name} must be True/False (or one per row), got {value!r}")
        return arr
    try:
        out = arr.astype(dtype)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name} must be a number (or one per row), got {value!r}") from e
    if np.issubdtype(dtype, np.integer) and not np.all(out == arr):
        raise TypeError(f"{name} must be an integer (or one per row), got {value!r}")
    return out


def sampling_params(cfg: GenerationConfig, n: int, rows: int) -> dict[str, np.ndarray]:
    """Validated per-row arrays of every ``sampler_params.TABLE`` setting ``cfg`` names (keyed by
    ``name``; ``n`` real rows, padded to the compiled ``rows`` with row 0). A seed not given is
    drawn per row."""
    p = {}
    for q in sampler_params.TABLE:
        if q.hf is None:
            continue
        value = getattr(cfg, q.hf)
        if value is None:
            if q.name == "seed":
                value = [secrets.randbits(32) for _ in range(n)]
            else:
                value = q.fill
        dtype = bool if q.dtype == "bool" else np.int64 if q.integer else np.dtype(q.dtype)
        p[q.name] = per_row(value, q.hf, n, dtype)
    bad = sampler_params.violations({sampler_params.BY_NAME[k].hf: v for k, v in p.items()})
    if bad:
        raise ValueError(bad[0][1])
    p = {k: v.astype(sampler_params.BY_NAME[k].dtype) for k, v in p.items()}
    return {k: np.concatenate([v, np.repeat(v[:1], rows - n)]) for k, v in p.items()}


def _is_seq(x) -> bool:
    return isinstance(x, Sequence | np.ndarray) and not isinstance(x, str | bytes)


def _is_ids(x) -> bool:
    return _is_seq(x) and len(x) > 0 and all(isinstance(t, int | np.integer) for t in x)


def stop_array(stop_sequences, n: int, rows: int, vocab: int) -> np.ndarray:
    """``[rows, MAX_STOPS, MAX_STOP_LEN]`` right-aligned stop sequences (-2 = unused).

    ``stop_sequences``: a list of token-id lists for every row, or one such list per row.
    """
    out = np.full((rows, graphs.MAX_STOPS, graphs.MAX_STOP_LEN), -2, np.int32)
    if stop_sequences is None:
        return out
    err = (
        "stop_sequences must be a list of token-id lists, e.g. [[13], [198, 198]] (or one such list per row)"
    )
    if not _is_seq(stop_sequences):
        raise TypeError(err)
    if all(_is_ids(q) for q in stop_sequences):
        lists = [stop_sequences] * n
    elif len(stop_sequences) == n and all(_is_seq(r) and all(_is_ids(q) for q in r) for r in stop_sequences):
        lists = list(stop_sequences)
    else:
        raise TypeError(err)
    for r, seqs in enumerate(lists):
        if len(seqs) > graphs.MAX_STOPS:
            raise ValueError(
                f"at most {graphs.MAX_STOPS} stop sequences per row are supported, got {len(seqs)}"
            )
        for i, seq in enumerate(seqs):
            if not all(0 <= t < vocab for t in seq):
                raise ValueError(f"stop sequence {list(seq)} holds ids outside the vocabulary [0, {vocab})")
            if len(seq) > graphs.MAX_STOP_LEN:
                raise ValueError(
                    f"stop sequence of {len(seq)} tokens is longer than the supported {graphs.MAX_STOP_LEN}"
                )
            out[r, i, graphs.MAX_STOP_LEN - len(seq) :] = seq
    out[n:] = out[0]
    return out


def check_streamer(streamer) -> None:
    if streamer is not None and not (
        callable(getattr(streamer, "put", None)) and callable(getattr(streamer, "end", None))
    ):
        raise TypeError(
            "streamer must have put(tokens) and end() methods (transformers BaseStreamer), "
            f"got {type(streamer).__name__}"
        )


def initial_state(
    model: GraphHost,
    ids: np.ndarray,
    mask: np.ndarray,
    positions: np.ndarray,
    n: int,
    last,
    cfg,
    lora=None,
    scores: bool = False,
) -> DecodeState:
    """The host-side generation state for a prompt batch (see ``graphs.state_spec``; ``scores``:
    for the graphs that keep each token's ``[B, V]`` scores).

    ``min_end``: eos is masked for tokens before this slot: ``min_new_tokens`` after the
    (padded) prompt, or ``min_length`` counted from slot 0 with the padding, as transformers.
    """
    b, p_len = ids.shape
    sp = sampling_params(cfg, n, b)
    min_end = np.maximum(p_len + sp["min_new"], sp["min_len"]).clip(0, 2**31 - 1)
    s, v, k = model.n_positions, model.cfg.vocab_size, sampling.TOP_LOGPROBS_MAX

    eos = inputs.eos_ids(cfg.eos_token_id, graphs.MAX_EOS)
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else (int(eos[0]) if eos[0] >= 0 else 0)
    out = np.full((b, s), -1, np.int32)
    out[:, :p_len] = np.where(mask > 0, ids, -1)
    seen = np.zeros((b, v), np.bool_)
    rows, cols = np.nonzero(mask)
    seen[rows, ids[rows, cols]] = True
    return DecodeState(
        tok=np.zeros(b, np.int32),
        pos=positions.max(1) + 1,
        done=np.zeros(b, np.bool_),
        reason=np.zeros(b, np.int32),
        end=np.zeros(b, np.int32),
        last=np.asarray(last, np.int32),
        min_end=min_end.astype(np.int32),
        out=out,
        logp=np.zeros((b, s), np.float32),
        top_ids=np.zeros((b, s, k), np.int32),
        top_lp=np.zeros((b, s, k), np.float32),
        seen=seen,
        allow=np.full((b, sampling.mask_words(v)), 0xFFFFFFFF, np.uint32),
        bias_ids=np.full((b, sampling.MAX_LOGIT_BIAS), -1, np.int32),
        bias_val=np.zeros((b, sampling.MAX_LOGIT_BIAS), np.float32),
        stop=stop_array(cfg.stop_sequences, n, b, v),
        idx=np.int32(p_len),
        first=np.int32(p_len),
        limit=np.int32(0),
        eos=eos,
        pad=np.int32(pad),
        want_logprobs=np.bool_(False),
        scores=np.zeros((b, v if scores else 1), np.float32),
        raw=np.zeros((b, v if scores else 1), np.float32),
        params=sampler_params.row_params(sp),
        adapter=np.full(b, -1, np.int32) if lora is None else np.asarray(lora, np.int32),
    )


def _stop_rows(model: GraphHost, state: DecodeState, criteria: list, ids, n: int, p_len: int, idx: int, done):
    """Evaluate the stopping criteria on the sequences so far (token at slot ``idx`` included);
    rows they end get reason ``stopping_criteria`` in the device state. Returns the new ``done``."""
    fetch = sharding.fetch
    if done[:n].all():
        return done
    seqs = np.concatenate([ids[:n], fetch(state.out)[:n, p_len : idx + 1]], axis=1)
    hit = np.zeros(done.shape[0], bool)
    hit[:n] = criteria_hit(criteria, seqs) & ~done[:n]
    if hit.any():
        reason = np.where(hit, graphs.FinishReason.STOPPED, fetch(state.reason)).astype(np.int32)
        end = np.where(hit, idx, fetch(state.end)).astype(np.int32)
        done = done | hit
        state.done, state.reason, state.end = model.put(done), model.put(reason), model.put(end)
    return done


def _advance(matchers: dict, tokens: np.ndarray, done: np.ndarray) -> None:
    """Feed each constrained row that was live its newest token."""
    for row, m in matchers.items():
        if not done[row]:
            m.advance((int(tokens[row]),))


def run(
    model,
    ids,
    mask,
    n: int,
    new: np.ndarray,
    cfg: GenerationConfig,
    streamer,
    criteria,
    want_dict: bool,
    matchers: dict | None = None,
    lora: np.ndarray | None = None,
    scores: bool = False,
):
    """Prefill, first token, then decode calls (whole buckets, or chunks while someone listens).

    ``matchers`` (``{row: constraints.Matcher}``) constrain those rows to their grammars: the
    loop then runs one token per call and fills their masks before each. ``lora [B]``: each
    row's adapter slot (``aotlm.core.lora_slots``), None: the base model. ``scores``: each token's
    ``[B, V]`` scores and logits are read after it (the ``*_scores`` graphs, one token a call).
    """
    t_start = time.perf_counter()
    b, p_len = ids.shape
    last = p_len + np.concatenate([new, np.repeat(new[:1], b - n)]) - 1
    logits, positions = model.encode(ids, mask, lora)
    state = initial_state(model, ids, mask, positions, n, last, cfg, lora, scores)
    state.want_logprobs = np.bool_(want_dict)
    steps = _Steps(n, scores)
    matchers = matchers or {}
    ban = bans.build(cfg, ids, mask, model.cfg.vocab_size, state.eos)
    bias = sequence_bias.build(cfg, ids, mask, model.cfg.vocab_size, sampling.MAX_LOGIT_BIAS)
    allow = state.allow
    constraints.fill_rows(allow, matchers)
    if ban is not None:
        ban.apply(allow, first=True)
    if bias is not None:
        state.bias_ids, state.bias_val = bias.arrays(b)
    state = model.executable(("select_scores",) if scores else ("select",))(logits, model.put_tree(state))
    fetch = sharding.fetch
    first_tok = fetch(state.tok)  # waits for prefill + first token (the decode waits anyway)
    ttft = time.perf_counter() - t_start
    steps.take(state)
    if streamer is not None:
        streamer.put(ids[:n])
        streamer.put(first_tok[:n])
    refill = bool(matchers) or any(x is not None and x.dynamic for x in (ban, bias))  # follow every token
    listening = streamer is not None or bool(criteria) or refill or scores
    stop, idx, done = int(last.max()), p_len, fetch(state.done)
    _after_first(model, state, allow, first_tok, matchers, ban, bias, refill)
    if criteria:
        done = _stop_rows(model, state, criteria, ids, n, p_len, idx, done)
    while idx < stop and not done[:n].all():  # padding rows never hold the loop
        limit = min(stop, idx + STREAM_CHUNK) if listening else stop
        state.limit = model.put(np.int32(limit))
        if refill:
            _refill(model, state, allow, matchers, ban, bias, done)
        exe = model.executable(
            ("decode_scores" if scores else "decode", bk.decode_bucket(model.tg_buckets, idx))
        )
        model.cache, state = exe(model.params, model.cache, state)
        prev, was_done, idx, done = idx, done, int(fetch(state.idx)), fetch(state.done)
        if idx > prev:
            steps.take(state)
        if refill and idx > prev:
            _advance(matchers, fetch(state.tok), was_done)
            for x in (ban, bias):
                if x is not None:
                    x.advance(fetch(state.tok), was_done)
        if streamer is not None and idx > prev:  # STREAM_CHUNK = 1: the rows' newest token (pad if done)
            streamer.put(fetch(state.tok)[:n])
        if criteria:
            done = _stop_rows(model, state, criteria, ids, n, p_len, idx, done)
    if streamer is not None:
        streamer.end()
    out = _result(state, ids, n, p_len, idx - p_len + 1, cfg, want_dict, ttft)
    if scores:
        out.scores, out.logits = tuple(steps.scores), tuple(steps.logits)
    return out


def _after_first(
    model, state: DecodeState, allow, first_tok, matchers: dict, ban, bias, refill: bool
) -> None:
    """Grammars, sequence biases and bans see the first token; the first token's own bans end
    (``allow``: the host's mask, filled in place and sent)."""
    none_done = np.zeros(first_tok.shape, bool)
    _advance(matchers, first_tok, none_done)
    if bias is not None:
        bias.advance(first_tok, none_done)
    if ban is not None:
        ban.advance(first_tok, none_done)
        if ban.begin is not None and not refill:
            allow[:] = constraints.ALL_ONES
            ban.apply(allow, first=False)
            state.allow = model.put(allow)


def _refill(model, state: DecodeState, allow, matchers: dict, ban, bias, done) -> None:
    """Before a step that follows every token: the live rows' grammar masks and bans (``allow``:
    the host's mask, filled in place and sent), the biases."""
    constraints.fill_rows(allow, {r: m for r, m in matchers.items() if not done[r]})
    if ban is not None:
        ban.apply(allow, first=False, live=~done)
    state.allow = model.put(allow)
    if bias is not None and bias.dynamic:
        state.bias_ids, state.bias_val = map(model.put, bias.arrays(done.shape[0]))


class _Steps:
    """Each step's ``[n, V]`` scores and logits, read from the state after the step (``on``)."""

    def __init__(self, n: int, on: bool):
        self.n, self.on, self.scores, self.logits = n, on, [], []

    def take(self, state: DecodeState) -> None:
        if self.on:
            self.scores.append(np.array(sharding.fetch(state.scores)[: self.n]))
            self.logits.append(np.array(sharding.fetch(state.raw)[: self.n]))


def _result(state: DecodeState, ids, n: int, p_len: int, n_gen: int, cfg, want_dict: bool, ttft: float):
    """The call's sequences (prompt + ``n_gen`` slots), or its ``GenerateOutput``."""
    fetch = sharding.fetch
    out = fetch(state.out)[:n, p_len : p_len + n_gen]
    sequences = np.concatenate([ids[:n], out], axis=1)
    if not want_dict:
        return sequences
    reason = fetch(state.reason)[:n]
    top = None
    if cfg.top_logprobs:
        w = int(cfg.top_logprobs)
        sl = slice(p_len, p_len + n_gen)
        top = (fetch(state.top_ids)[:n, sl, :w], fetch(state.top_lp)[:n, sl, :w])
    return GenerateOutput(
        sequences=sequences,
        logprobs=fetch(state.logp)[:n, p_len : p_len + n_gen],
        finish_reason=[graphs.FinishReason.of(r).label for r in reason],
        num_generated=fetch(state.end)[:n] - p_len + 1,
        top_logprobs=top,
        time_to_first_token=ttft,
    )
