"""Host side of continuous batching: a model's KV-cache rows as slots, one request each.

``SlotBatch`` owns the device-resident serving state (``slot_graphs.state_spec``) and calls the
slot graphs: ``prefill_step`` (one context-bucket chunk of a prompt into its row), ``insert``
(the request's settings + its first token), ``decode`` (a few steps of every live row) and
``read`` (what the host needs to stream tokens). It knows nothing of queues or threads: the
scheduler (``aotlm.batching.engine``) decides who runs when. One SlotBatch per model, used from
one thread; it holds the model's lock only inside each call, so the model's cache is its
own between calls (``sample()`` on the same model object would overwrite the slots).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import jax
import numpy as np

from aotlm.batching import policy, slot_graphs
from aotlm.batching.prompt_scores import PromptScores
from aotlm.core import buckets as bk
from aotlm.core import graphs, inputs, sampler_params, sampling, sharding
from aotlm.core.contract import GraphHost
from aotlm.core.state import SlotState
from aotlm.generate import constraints
from aotlm.generate.generation import stop_array
from aotlm.generate.params import SamplingParams


def check(model: GraphHost, prompt_len: int, s: SamplingParams) -> list[tuple[str, str]]:
    """Problems with a request as ``(field, message)`` pairs (empty: it can run)."""
    bad: list[tuple[str, str]] = []
    n = model.n_positions
    if prompt_len < 1:
        bad.append(("prompt", "the prompt is empty; give at least one token"))
    if s.max_tokens < 1:
        bad.append(("max_tokens", f"max_tokens must be >= 1, got {s.max_tokens}"))
    elif prompt_len + s.max_tokens > n:
        bad.append(("max_tokens" if prompt_len < n else "prompt",
                    f"prompt ({prompt_len} tokens) + max_tokens ({s.max_tokens}) = "
                    f"{prompt_len + s.max_tokens} exceeds the context of {n} tokens; shorten the prompt "
                    "or lower max_tokens"))  # fmt: skip
    bad += sampler_params.violations({k: getattr(s, k) for k in sampler_params.BY_OPENAI})
    k = sampling.TOP_LOGPROBS_MAX
    if s.logprobs is not None and not 0 <= s.logprobs <= k:
        bad.append(("logprobs", f"logprobs must be in [0, {k}], got {s.logprobs}"))
    bad += prompt_logprobs_problems(model, s.prompt_logprobs)
    if s.embed and not getattr(model, "embeddings", False):
        bad.append(("input", "this server computes no embeddings: start it with --embeddings"))
    if len(s.stop_token_ids) > graphs.MAX_STOPS:
        bad.append(("stop", f"at most {graphs.MAX_STOPS} token stop sequences are supported"))
    v = model.cfg.vocab_size
    bad += _bias_problems(s.logit_bias, v)
    slots = getattr(model, "adapter_slots", None)
    if s.adapter is not None and (slots is None or s.adapter not in slots.names):
        loaded = [] if slots is None else [a for a in slots.names if a is not None]
        bad.append(("model", f"no LoRA adapter named {s.adapter!r} is loaded (loaded: {loaded})"))
    for seq in s.stop_token_ids:
        if not 0 < len(seq) <= graphs.MAX_STOP_LEN or not all(0 <= t < v for t in seq):
            bad.append(("stop", f"token stop sequence {list(seq)} must hold 1..{graphs.MAX_STOP_LEN} ids "
                                f"in [0, {v})"))  # fmt: skip
    return bad


def prompt_logprobs_problems(model: GraphHost, k: int | None) -> list[tuple[str, str]]:
    """What keeps ``prompt_logprobs=k`` from running on ``model`` (its score graphs, the range)."""
    if k is None:
        return []
    if not getattr(model, "prompt_logprobs", False):
        why = ("this server computes no prompt log-probabilities (echo with logprobs, prompt_logprobs): "
               "start it with --prompt-logprobs (one more graph per prefill shape)")  # fmt: skip
        return [("prompt_logprobs", why)]
    top = sampling.TOP_LOGPROBS_MAX
    if not 0 <= k <= top:
        return [("prompt_logprobs", f"prompt_logprobs must be in [0, {top}], got {k}")]
    return []


def _bias_problems(bias: Sequence[tuple[int, float]], vocab: int) -> list[tuple[str, str]]:
    n = sampling.MAX_LOGIT_BIAS
    if len(bias) > n:
        return [("logit_bias", f"logit_bias takes at most {n} tokens, got {len(bias)}")]
    for t, val in bias:
        if not 0 <= t < vocab:
            return [("logit_bias", f"logit_bias token id {t} is outside the vocabulary (0..{vocab - 1})")]
        if not -100 <= val <= 100:
            return [("logit_bias", f"logit_bias values must be in [-100, 100], got {val} for token {t}")]
    return []


def host_state(slots: int, n_slots: int, vocab: int) -> SlotState:
    """A serving state of numpy arrays: nothing generated, neutral sampler settings."""
    zeros = lambda a: np.zeros(a.shape, a.dtype)
    st = jax.tree.map(zeros, slot_graphs.state_spec(slots, n_slots, vocab, None))
    st.out[:], st.stop[:], st.bias_ids[:] = -1, -2, -1  # unwritten slots; unused stop tokens, biases
    st.allow[:] = 0xFFFFFFFF  # unconstrained
    st.adapter[:] = -1  # the base model
    return st.replace(params=sampler_params.neutral_rows(slots))


def _chunk(prompt: np.ndarray, step: bk.PrefillStep) -> tuple[np.ndarray, np.ndarray]:
    """The step's tokens and positions ``[1, bucket]`` (padding: token 0 at position -1)."""
    end = step.start + step.n_real
    tok = np.zeros((1, step.bucket), np.int32)
    pos = np.full((1, step.bucket), -1, np.int32)
    tok[0, : step.n_real] = prompt[step.start : end]
    pos[0, : step.n_real] = np.arange(step.start, end, dtype=np.int32)
    return tok, pos


class SlotModel(GraphHost, Protocol):
    """A ``GraphHost`` that may carry slot graphs (``CausalLMForSampling``)."""

    continuous_batching: bool


@runtime_checkable
class SlotRunner(Protocol):
    """The contract a continuous-batching scheduler (``aotlm.batching.engine``) drives.

    ``slots`` rows of ``n_positions`` KV slots each. A request enters row ``row`` in three moves:
    ``prefill_plan`` splits its prompt into chunks (from ``start``: the K/V of the first
    ``start`` tokens is already in the row; the plan's first step says how many it reuses),
    ``prefill_step`` encodes one chunk (returning opaque logits, only passed on; ``prefill_scored``
    also scores the chunk's next prompt tokens, a ``PromptScores``, for a plan from slot 0;
    ``prefill_embedded`` encodes a plan's last chunk and returns its last token's hidden state;
    ``prefill_rows`` encodes up to ``max_prompts`` whole one-chunk prompts of one of
    ``prompt_buckets`` from slot 0 at once), ``insert`` makes the row live with its settings and
    first token (chosen among ``allow``'s tokens: structured outputs). ``constrain`` sets the live
    constrained rows' next-token masks before a decode call. ``decode`` then advances the live rows among the
    first ``rows`` by up to ``steps`` tokens (``cancel`` marks rows to stop; rows at or past
    ``rows`` must not be live), and ``read`` returns host arrays ``idx [slots]`` (slot of each
    row's last token), ``done [slots]``, ``reason [slots]`` (``aotlm.core.graphs.FinishReason``
    values), ``out [slots, n_positions]`` (prompt then tokens) and, with ``logprobs``,
    ``logp``, ``top_ids``, ``top_lp``. ``swap`` exchanges two rows (K/V of their first
    ``filled`` slots and their states; the row moving up stops); ``save`` copies a row's first
    ``filled`` slots out (an opaque copy and its bytes) and ``restore`` writes such a copy back
    into a row (the scheduler's prefix store). ``check`` lists what keeps a request from
    running. ``SlotBatch`` implements it on compiled slot graphs; a fake with arithmetic tokens
    drives the scheduler's tests.
    """

    slots: int
    n_positions: int
    vocab_size: int
    max_chunk: int  # the largest prefill chunk (the default prefill budget per round)
    max_prompts: int  # whole prompts ``prefill_rows`` takes at once (1: it is never called)
    prompt_buckets: tuple[int, ...]  # the context buckets ``prefill_rows`` takes

    def check(self, prompt_len: int, settings: SamplingParams) -> list[tuple[str, str]]: ...

    def prefill_plan(self, prompt_len: int, start: int = 0) -> Sequence[bk.PrefillStep]: ...

    def prefill_step(
        self, row: int, prompt: np.ndarray, step: bk.PrefillStep, adapter: str | None = None
    ) -> Any: ...

    def prefill_scored(
        self, row: int, prompt: np.ndarray, step: bk.PrefillStep, adapter: str | None = None
    ) -> tuple[Any, PromptScores]: ...

    def prefill_embedded(
        self, row: int, prompt: np.ndarray, step: bk.PrefillStep, adapter: str | None = None
    ) -> np.ndarray: ...

    def prefill_rows(
        self,
        rows: Sequence[int],
        prompts: Sequence[np.ndarray],
        bucket: int,
        adapters: Sequence[str | None] = (),
    ) -> list: ...

    def insert(
        self,
        row: int,
        prompt: np.ndarray,
        settings: SamplingParams,
        logits: Any,
        allow: np.ndarray | None = None,
    ) -> None: ...

    def constrain(self, matchers: dict[int, constraints.Matcher]) -> None: ...

    def decode(self, steps: int, max_live_slot: int, rows: int, cancel: np.ndarray | None = None) -> None: ...

    def swap(self, a: int, b: int, filled: int) -> None: ...

    def save(self, row: int, filled: int) -> tuple[Any, int]: ...

    def restore(self, row: int, kv: Any) -> None: ...

    def read(self, logprobs: bool = False) -> dict[str, np.ndarray]: ...


class SlotBatch:
    """The serving state of ``model`` (built with ``continuous_batching=True``): a ``SlotRunner``."""

    def __init__(self, model: SlotModel, eos_token_id: Sequence[int] = (), pad_token_id: int | None = None):
        if not model.continuous_batching:
            raise ValueError("the model must be built with continuous_batching=True to serve")
        self.model = model
        self.vocab_size = model.cfg.vocab_size
        self.max_chunk = max(model.ctx_buckets)
        self.max_prompts = max(slot_graphs.prompt_ladder(model.batch_size), default=1)
        self.prompt_buckets = slot_graphs.rows_buckets(model.ctx_buckets)
        self.slots = model.batch_size
        self.n_positions = model.n_positions
        self.prompt_logprobs = bool(getattr(model, "prompt_logprobs", False))  # has the score graphs
        self.embeddings = bool(getattr(model, "embeddings", False))  # has the embedding graphs
        eos = inputs.eos_ids(list(eos_token_id) or None, graphs.MAX_EOS)
        pad = pad_token_id if pad_token_id is not None else (int(eos[0]) if eos[0] >= 0 else 0)
        host = host_state(self.slots, self.n_positions, self.vocab_size)
        host = host.replace(done=np.ones(self.slots, np.bool_), eos=eos, pad=np.int32(pad))
        with model.lock:
            self.state = model.put_tree(host)
        self._cancel_none = model.put(np.zeros(self.slots, np.bool_))
        self._allow = host.allow.copy()  # host buffer of the masks (``constrain``)
        self._constrained = False  # some row's device mask is not all ones

    def check(self, prompt_len: int, settings: SamplingParams) -> list[tuple[str, str]]:
        return check(self.model, prompt_len, settings)

    # ------------------------------------------------------------------ prefill + insert
    def prefill_plan(self, prompt_len: int, start: int = 0) -> tuple[bk.PrefillStep, ...]:
        m = self.model
        return bk.resume_plan(prompt_len, start, m.ctx_buckets, m.tg_buckets)

    def _slot(self, adapter: str | None) -> int:
        """An adapter name's slot (``aotlm.core.lora_slots``), -1 for None (the base model)."""
        return -1 if adapter is None else self.model.adapter_slots.slot_of(adapter)

    def _prefill(self, kind: str, row: int, prompt: np.ndarray, step: bk.PrefillStep, adapter, *more):
        """Run the ``kind`` prefill graph of ``step`` on row ``row``; its outputs but the cache."""
        m = self.model
        tok, pos = _chunk(prompt, step)
        with m.lock:
            exe = m.executable((kind, step.bucket, step.width))
            put = m.put
            *out, m.cache = exe(
                m.params, m.cache, put(tok), put(pos), put(np.int32(step.start)),
                put(np.int32(step.n_real - 1)), put(np.int32(row)), put(np.int32(self._slot(adapter))),
                *(put(x) for x in more),
            )  # fmt: skip
        return out

    def prefill_step(self, row: int, prompt: np.ndarray, step: bk.PrefillStep, adapter: str | None = None):
        """Encode one chunk of ``prompt`` into cache row ``row`` (with LoRA ``adapter``); returns the
        (device) logits."""
        return self._prefill("slot_prefill", row, prompt, step, adapter)[0]

    def prefill_embedded(
        self, row: int, prompt: np.ndarray, step: bk.PrefillStep, adapter: str | None = None
    ) -> np.ndarray:
        """``prefill_step`` through the ``slot_prefill_embed`` graph: the hidden state ``[D]`` (host,
        float32) of the chunk's last token (an embedding request's last chunk)."""
        return sharding.fetch(self._prefill("slot_prefill_embed", row, prompt, step, adapter)[0])[0]

    def prefill_scored(
        self, row: int, prompt: np.ndarray, step: bk.PrefillStep, adapter: str | None = None
    ) -> tuple[Any, PromptScores]:
        """``prefill_step`` through the ``slot_prefill_score`` graph: also the scores of the prompt
        tokens after the chunk's positions (the chunk's last one scores the next chunk's first)."""
        targets = np.full((1, step.bucket), -1, np.int32)
        nxt = prompt[step.start + 1 : step.start + step.n_real + 1]
        targets[0, : len(nxt)] = nxt
        logits, scores = self._prefill("slot_prefill_score", row, prompt, step, adapter, targets)
        lp, rank, ids, top = (sharding.fetch(x)[0, : len(nxt)] for x in scores)
        return logits, PromptScores(step.start + 1, nxt.astype(np.int64), lp, rank, ids, top)

    def prefill_rows(
        self,
        rows: Sequence[int],
        prompts: Sequence[np.ndarray],
        bucket: int,
        adapters: Sequence[str | None] = (),
    ) -> list:
        """Encode whole prompts (each fitting context bucket ``bucket``, each with its LoRA adapter
        of ``adapters``, default none) into ``rows`` in one call; returns each one's (device)
        logits. The call's prompt count is the smallest of
        ``slot_graphs.prompt_ladder`` holding them; the rest of its entries repeat the first."""
        m, k = self.model, len(rows)
        n = next(n for n in slot_graphs.prompt_ladder(self.slots) if n >= k)
        tok = np.zeros((n, bucket), np.int32)
        pos = np.full((n, bucket), -1, np.int32)
        last, where, lora = np.zeros(n, np.int32), np.zeros(n, np.int32), np.zeros(n, np.int32)
        names = list(adapters) or [None] * k
        for i in range(n):
            j = i if i < k else 0
            p = prompts[j]
            tok[i, : len(p)], pos[i, : len(p)] = p, np.arange(len(p))
            last[i], where[i], lora[i] = len(p) - 1, rows[j], self._slot(names[j])
        with m.lock:
            exe = m.executable(("slot_prefill_rows", bucket, n))
            put = m.put
            logits, m.cache = exe(m.params, m.cache, put(tok), put(pos), put(last), put(where), put(lora))
        return list(logits[:k])

    def insert(
        self, row: int, prompt: np.ndarray, settings: SamplingParams, logits, allow: np.ndarray | None = None
    ) -> None:
        """Make ``row`` live with ``settings``; its first token is chosen from ``logits`` among
        the tokens ``allow`` (a ``[ceil(V/32)]`` uint32 bitmask; None: every token)."""
        m = self.model
        v, p_len = self.vocab_size, len(prompt)
        r = host_state(1, self.n_positions, v)
        r.out[0, :p_len] = prompt
        r.seen[0, prompt] = True
        r.idx[0] = r.first[0] = p_len
        r.last[0] = p_len + settings.max_tokens - 1
        r.stop[:] = stop_array([list(q) for q in settings.stop_token_ids] or None, 1, 1, v)
        r.ignore_eos[0], r.want[0] = settings.ignore_eos, settings.logprobs is not None
        r.adapter[0] = self._slot(settings.adapter)
        r.presence[0], r.frequency[0] = settings.presence_penalty, settings.frequency_penalty
        seed = secrets.randbits(32) if settings.seed is None else settings.seed
        values = {q.name: getattr(settings, q.openai) for q in sampler_params.ROW if q.openai}
        values.update(do_sample=settings.temperature > 0, seed=seed)  # OpenAI: temperature 0 is greedy
        for name, value in values.items():
            getattr(r.params, name)[0] = value
        if settings.logit_bias:
            ids, vals = zip(*settings.logit_bias, strict=True)
            r.bias_ids[0, : len(ids)], r.bias_val[0, : len(ids)] = ids, vals
        if allow is not None:
            r.allow[0] = allow
            self._constrained = True
        with m.lock:
            exe = m.executable(("slot_insert",))
            self.state = exe(self.state, logits, m.put_tree(r), m.put(np.int32(row)))

    def warm_up(self, max_flops: float | None | Literal["backend"] = "backend") -> tuple[int, int]:
        """Run the slot graphs once on free rows (their K/V and states are overwritten by the next
        request that uses them; none holds tokens for reuse): an executable's first run costs more
        than later ones, which the first requests after a start would otherwise pay. Prefill graphs
        estimated above ``max_flops`` (``policy.warmed``; None: none; default: the backend's
        ``policy.warm_bound``) are left to their first request. Returns (graphs run, graphs in all)."""
        m, one = self.model, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        logits = None
        if max_flops == "backend":
            max_flops = policy.warm_bound(jax.default_backend())
        keys = slot_graphs.graph_keys(
            m.ctx_buckets, m.tg_buckets, self.slots, self.prompt_logprobs, self.embeddings
        )
        run = policy.warmed(m.cfg, keys, max_flops)
        for key in run:
            if key[0] == "slot_prefill":  # the chunk ends at the width's last slot
                _, c, w = key
                step = bk.PrefillStep(start=w - c, bucket=c, width=w, n_real=c)
                logits = self.prefill_step(0, np.zeros(w, np.int32), step)
            elif key[0] == "slot_prefill_embed":
                _, c, w = key
                self.prefill_embedded(0, np.zeros(w, np.int32), bk.PrefillStep(w - c, c, w, c))
            elif key[0] == "slot_prefill_score":  # a whole prompt of the shape's chunk, from slot 0
                _, c, w = key
                self.prefill_scored(0, np.zeros(w, np.int32), bk.PrefillStep(w - c, c, w, c))
            elif key[0] == "slot_prefill_rows":
                _, c, n = key
                self.prefill_rows(range(n), [np.zeros(c, np.int32)] * n, c)
            elif key[0] == "slot_decode":  # row 0 live at slot w - 2: width w, one step
                _, w, rows = key
                self.insert(0, np.zeros(w - 2, np.int32), one, logits)
                self.decode(1, w - 2, rows)
            elif key[0] == "slot_kv_out":
                self.restore(0, self.save(0, key[1])[0])
        self.swap(0, 1, 0)  # (the swap graph) row 0 is done already
        jax.block_until_ready((self.state, m.cache))
        return len(run), len(keys)

    # ------------------------------------------------------------------ decode
    def constrain(self, matchers: dict[int, constraints.Matcher]) -> None:
        """Write the next-token masks of the constrained live rows (``{row: matcher}``) into
        the state before a decode call (one step per call while any row is constrained);
        the other rows get all ones. Nothing is sent while no row is, or was, constrained."""
        if not matchers and not self._constrained:
            return
        self._constrained = constraints.fill_rows(self._allow, matchers)
        with self.model.lock:
            self.state.allow = self.model.put(self._allow)

    def decode(self, steps: int, max_live_slot: int, rows: int, cancel: np.ndarray | None = None) -> None:
        """Run up to ``steps`` decode steps of the live rows, all below ``rows``; ``max_live_slot``
        is the largest live row's slot. The graph is the smallest ladder row count holding them. A
        call never crosses a token bucket (fewer steps then): each step attends the window it would
        in a call of its own, so a request's numbers do not depend on the steps per call."""
        m = self.model
        first = max(max_live_slot, 0)
        width = bk.decode_bucket(m.tg_buckets, first)
        steps = max(1, min(steps, width - first))
        with m.lock:
            self.state.steps = m.put(np.int32(steps))
            c = self._cancel_none if cancel is None or not cancel.any() else m.put(cancel.astype(np.bool_))
            exe = m.executable(("slot_decode", width, slot_graphs.rows_for(rows, self.slots)))
            m.cache, self.state = exe(m.params, m.cache, self.state, c)

    def swap(self, a: int, b: int, filled: int) -> None:
        """Exchange rows ``a`` and ``b``: states and the K/V of their first ``filled`` slots (each
        row's block copied out, then written into the other: in place, where one graph swapping
        two rows of the cache made XLA copy all of it)."""
        m = self.model
        if a != b and filled > 0:
            ka, kb = self.save(a, filled)[0], self.save(b, filled)[0]
            self.restore(b, ka)
            self.restore(a, kb)
        with m.lock:
            self.state = m.executable(("slot_swap",))(self.state, m.put(np.int32(a)), m.put(np.int32(b)))

    def save(self, row: int, filled: int) -> tuple[Any, int]:
        """A copy of row ``row``'s first ``filled`` slots of K/V (for a prefix store) and its bytes."""
        m = self.model
        width = bk.decode_bucket(m.tg_buckets, max(min(filled, self.n_positions) - 1, 0))
        with m.lock:
            kv = m.executable(("slot_kv_out", width))(m.cache, m.put(np.int32(row)))
        return kv, sum(x.nbytes for x in jax.tree.leaves(kv))

    def restore(self, row: int, kv: Any) -> None:
        """Write ``save``'s copy back into row ``row`` (its first slots)."""
        m = self.model
        with m.lock:
            exe = m.executable(("slot_kv_in", kv["pos"].shape[1]))
            m.cache = exe(m.cache, kv, m.put(np.int32(row)))

    def read(self, logprobs: bool = False) -> dict:
        """The host copy of what streaming needs: idx, done, reason, out (+ logp, top_*)."""
        keys = ("idx", "done", "reason", "out") + (("logp", "top_ids", "top_lp") if logprobs else ())
        return {key: sharding.fetch(getattr(self.state, key)) for key in keys}
