"""Speculative decoding (host side): ``SpeculativeGenerator(draft, target, k)`` and
``target.sample(..., draft_model=draft, speculation_length=k)``.

The rounds run on device (``aotlm.generate.spec_graphs``): one graph call per token bucket (or per
``SPEC_CHUNK`` slots) holds the draft's proposals, the target's check, acceptance, rollback
and the per-row stop rules, so no token crosses to the host between rounds. The host only
encodes the prompt in both models, picks the first token with the target's own ``select``
graph (the same token ``target.sample`` gives) and hands out buckets.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from aotlm.core import buckets as bk
from aotlm.core import compile_cache, inputs, sampler_params, sharding
from aotlm.core.contract import GraphHost
from aotlm.generate import generation, params, spec_listen
from aotlm.generate import spec_graphs as sg
from aotlm.generate.strategies import StrategyHost, positive

SP_KEYS = sg.SP_KEYS
# the sample() arguments a speculative request takes besides the sampling settings (SP_KEYS)
CALL_KEYS = ("input_ids", "max_new_tokens", "sequence_length", "attention_mask", "start_ids", "eos_token_id",
             "pad_token_id", *spec_listen.KEYS)  # fmt: skip


def lower(model: StrategyHost, key: tuple):
    draft = model.strategies.drafts.get(key[4])
    if draft is None:
        raise ValueError(f"{key}: no draft model attached; use SpeculativeGenerator(draft, target, k)")
    return sg.lower(model, draft, key)


def draft_tag(draft) -> str:
    """Short hash of the draft's configuration and environment (part of the graph key)."""
    digest, _ = compile_cache.entry_key(draft.fingerprint(), ("draft",), draft.mesh)
    return hashlib.sha256(digest.encode()).hexdigest()[:12]


def width_pairs(target: GraphHost, draft: GraphHost, k: int) -> list[tuple[int, int]]:
    """Every (target width, draft width) a round at slot ``idx`` may need (slots ``idx..idx+k``)."""
    s = min(target.n_positions, draft.n_positions)
    pairs = {
        (bk.decode_bucket(target.tg_buckets, x), bk.decode_bucket(draft.tg_buckets, x)) for x in range(k, s)
    }
    return sorted(pairs)


# ------------------------------------------------------------------------------ host side
def _tokenizer_vocab(path: str):
    f = Path(path) / "tokenizer.json"
    if not f.is_file():
        return None
    try:
        return json.loads(f.read_text()).get("model", {}).get("vocab")
    except (OSError, ValueError):
        return None


class SpeculativeGenerator:
    """``SpeculativeGenerator(draft, target, k)``: greedy speculative decoding (transformers-neuronx name).

    ``draft`` and ``target`` are ``AutoModelForSampling`` models with the same vocabulary and
    tokenizer and the same ``batch_size``. ``generate(input_ids, ...)`` returns what
    ``target.sample(input_ids, ...)`` returns (greedy), usually in fewer target calls.
    """

    def __init__(self, draft, target, k: int):
        k = positive(k, "speculation_length")
        if draft is None:
            raise ValueError("speculative decoding needs a draft_model")
        if draft.cfg.vocab_size != target.cfg.vocab_size:
            raise ValueError(
                f"the draft's vocabulary ({draft.cfg.vocab_size} tokens) differs from the target's "
                f"({target.cfg.vocab_size}); use a draft trained with the target's tokenizer"
            )
        dv, tv = _tokenizer_vocab(draft.path), _tokenizer_vocab(target.path)
        if dv is not None and tv is not None and dv != tv:
            raise ValueError(
                "the draft's tokenizer.json differs from the target's; use a draft with the same tokenizer"
            )
        for name in ("bos_token_id", "eos_token_id"):
            d, t = getattr(draft.hf_config, name, None), getattr(target.hf_config, name, None)
            if d is not None and t is not None and d != t:
                raise ValueError(f"draft {name}={d} differs from the target's {t}: not the same tokenizer")
        if draft.batch_size != target.batch_size:
            raise ValueError(
                f"draft batch_size={draft.batch_size} differs from the target's {target.batch_size}; "
                "load both with the same batch_size"
            )
        same_mesh = (
            draft.mesh.axis_names == target.mesh.axis_names
            and draft.mesh.devices.shape == target.mesh.devices.shape
            and [d.id for d in draft.mesh.devices.flat] == [d.id for d in target.mesh.devices.flat]
        )
        if not same_mesh:
            raise ValueError(
                f"the draft runs on other devices (tp_degree={draft.tp_degree}) than the target "
                f"(tp_degree={target.tp_degree}); load both with the same tp_degree"
            )
        enabled = target.strategies.speculation_length
        if enabled and k not in enabled:
            raise ValueError(
                f"the target was built for speculation_length {list(enabled)} "
                f"(enable_speculative_decoder), not k={k}; use one of those"
            )
        self.draft, self.target, self.k = draft, target, k
        self.tag = draft_tag(draft)
        target.strategies.drafts[self.tag] = draft
        self.stats: dict = {}

    def graph_keys(self) -> list[tuple]:
        """The target's ``("spec", k, Wt, Wd, draft)`` graphs, one per pair of bucket widths."""
        return [("spec", self.k, wt, wd, self.tag) for wt, wd in width_pairs(self.target, self.draft, self.k)]

    def compile(self) -> SpeculativeGenerator:
        """Compile (or load) both models' prefill graphs, the target's first-token graph and the
        speculative loop graphs."""
        t, d = self.target, self.draft
        with t.lock, d.lock:
            for model, kinds in ((t, ("prefill", "select")), (d, ("prefill",))):
                for key in [key for key in model.graph_keys() if key[0] in kinds]:
                    model.executable(key)
            for key in self.graph_keys():
                t.executable(key)
        return self

    def sample(self, input_ids, sequence_length: int | None = None, **kwargs) -> np.ndarray:
        """transformers-neuronx's name: ``generate(input_ids, sequence_length=...)``."""
        return self.generate(input_ids, sequence_length=sequence_length, **kwargs)

    def generate(
        self,
        input_ids,
        max_new_tokens=None,
        sequence_length=None,
        attention_mask=None,
        start_ids=None,
        eos_token_id=None,
        pad_token_id=None,
        **sampling_kwargs,
    ) -> np.ndarray | generation.GenerateOutput:
        """Greedy by default; ``do_sample=True`` with transformers' warpers (``temperature``,
        ``top_k``, ``top_p``, ...: ``SP_KEYS``) and ``seed`` (one value or one per row) samples
        from the target's distribution. ``return_dict``, ``streamer`` (one prompt),
        ``stop_sequences`` and ``stopping_criteria`` as in ``sample()`` (``spec_listen``)."""
        unknown = set(sampling_kwargs) - {*SP_KEYS, *spec_listen.KEYS}
        if unknown:
            raise ValueError(f"{sorted(unknown)} not supported with speculative decoding")
        t, d = self.target, self.draft
        with t.lock, d.lock:
            return self._generate(
                input_ids,
                max_new_tokens,
                sequence_length,
                attention_mask,
                start_ids,
                eos_token_id,
                pad_token_id,
                sampling_kwargs,
            )

    def _generate(
        self, input_ids, max_new_tokens, sequence_length, attention_mask, start_ids, eos_token_id, pad, skw
    ):
        t, d, k = self.target, self.draft, self.k
        t0 = time.perf_counter()
        ids, mask, n = t.prepare(input_ids, attention_mask, start_ids)
        listen, want = spec_listen.split(skw, n, t.batch_size, t.cfg.vocab_size, "draft_model")
        req = begin(
            t,
            k,
            min(t.n_positions, d.n_positions),
            ids,
            mask,
            n,
            (max_new_tokens, sequence_length),
            eos_token_id,
            pad,
            skw,
            listen=listen,
            want=want,
            t0=t0,
        )
        d.encode(ids, mask)

        def call(idx: int, st):
            wt, wd = bk.decode_bucket(t.tg_buckets, idx + k), bk.decode_bucket(d.tg_buckets, idx + k)
            t.cache, d.cache, st = t.executable(("spec", k, wt, wd, self.tag))(
                t.params, t.cache, d.params, d.cache, st
            )
            return st

        out, self.stats = rounds(t, req, call)
        return out


@dataclass
class Request:
    """One speculative request after its prompt is encoded: the prompt rows ``ids`` (``n`` real),
    the loop state on the device (``st``, first token chosen), the pad id, and ``skip``: the
    columns of ``st["out"]`` before the generated tokens (the prompt, where proposals read it);
    ``k``, the slots ``s`` a request may fill, the eos ids, the host's rules (``listen``), whether
    a ``GenerateOutput`` is wanted and the seconds to the first token."""

    ids: np.ndarray
    n: int
    pad: int
    st: dict
    skip: int
    k: int
    s: int
    eos: np.ndarray
    listen: spec_listen.Listen
    want: bool
    ttft: float


def begin(
    t,
    k: int,
    s: int,
    ids,
    mask,
    n: int,
    lengths: tuple,
    eos_token_id,
    pad,
    skw,
    history=False,
    listen: spec_listen.Listen | None = None,
    want: bool = False,
    t0: float | None = None,
) -> Request:
    """Check the request against ``s`` slots, encode the prompt in the target, pick the first token
    with its ``select`` graph (the token ``t.sample`` gives) and build the round loop's state.
    ``history``: ``st["out"]`` starts with the prompt (left padding as -1), its budgets counted
    from there, so that proposals can read the whole sequence. ``want``: every token's log-prob
    is kept (``GenerateOutput``); ``t0``: when the call began (time to first token)."""
    t0 = time.perf_counter() if t0 is None else t0
    b, plen = ids.shape
    budget = np.zeros(b, np.int32)  # per row; padding rows are done at once
    budget[:n] = t.token_budget(plen, n, *lengths)
    new = int(budget.max())
    if plen + new + k - 1 > s:
        name = "prompt_lookup_num_tokens" if history else "speculation_length"
        raise ValueError(
            f"prompt ({plen}) + max_new_tokens ({new}) + {name} ({k}) - 1 = "
            f"{plen + new + k - 1} exceeds n_positions={s} (a verify call writes k+1 slots); "
            "shorten the request or raise n_positions"
        )
    eos = inputs.eos_ids(eos_token_id, sg.MAX_EOS)
    pad = pad if pad is not None else (int(eos[0]) if eos[0] >= 0 else 0)
    cfg = params.GenerationConfig(**skw)
    sp = sampler_params.row_params(generation.sampling_params(cfg, n, b))
    logits, positions = t.encode(ids, mask)
    state = generation.initial_state(t, ids, mask, positions, n, np.full(b, plen + new - 1), cfg)
    state.want_logprobs = np.bool_(want)
    chosen = t.executable(("select",))(logits, t.put_tree(state))
    first = sharding.fetch(chosen.tok).astype(np.int32)
    ttft = time.perf_counter() - t0
    skip = plen if history else 0
    out = np.zeros((b, s), np.int32)
    if history:
        out[:, :plen] = np.where(mask > 0, ids, -1)
    out[:, skip] = first
    lp = np.zeros((b, s), np.float32)
    if want:
        lp[:, skip] = sharding.fetch(chosen.logp)[:, plen]
    done = np.isin(first, eos[eos >= 0]) | (budget <= 1)
    done[n:] = True
    st = {
        "last": first,
        "pos": (positions.max(1) + 1).astype(np.int32),
        "n_out": np.full(b, skip + 1, np.int32),
        "budget": budget + skip,
        "idx": np.int32(plen),
        "rnd": np.int32(0),
        "limit": np.int32(s),
        "proposed": np.int32(0),
        "accepted": np.int32(0),
        "uneven": np.int32(0),
        "done": done,
        "out": out,
        "lp": lp,
        "want": np.bool_(want),
        "eos": eos.astype(np.int32),
        "sp": sp,
    }
    listen = listen or spec_listen.Listen()
    return Request(ids, n, pad, t.put_tree(st), skip, k, s, eos[eos >= 0], listen, want, ttft)


def rounds(t, req: Request, call) -> tuple[np.ndarray | generation.GenerateOutput, dict]:
    """Run ``call(idx, st) -> st`` (one graph call: rounds until a bucket edge, the state's
    ``limit`` or every row is done) until every row is done; returns ``sample()``'s output (prompt
    + tokens, finished rows padded; a ``GenerateOutput`` when wanted) and the acceptance stats.
    While the request's rules listen, a call gets ``LISTEN_ROUNDS`` rounds' slots and the rules
    see its tokens (``spec_listen.check``)."""
    st, idx, calls = req.st, int(req.ids.shape[1]), 0
    listen, b = req.listen, req.ids.shape[0]
    seen, reason = np.full(b, req.skip, np.int64), np.zeros(b, np.int32)
    if listen.streamer is not None:
        listen.streamer.put(req.ids[: req.n])
    st, done = _listened(t, req, st, seen, reason)
    while not done.all():
        if listen.active:
            st["limit"] = t.put(np.int32(min(req.s, idx + spec_listen.LISTEN_ROUNDS * (req.k + 1))))
        st = call(idx, st)
        calls += 1
        new_idx = int(sharding.fetch(st["idx"]))
        st, done = _listened(t, req, st, seen, reason)
        if new_idx == idx and not done.all():  # pragma: no cover - guarded by the length check
            raise RuntimeError(f"speculative decoding made no progress at slot {idx}")
        idx = new_idx
    if listen.streamer is not None:
        listen.streamer.end()
    keys = ("out", "lp", "n_out", "rnd", "proposed", "accepted", "uneven")
    host = {key: sharding.fetch(st[key]) for key in keys}
    proposed, accepted = int(host["proposed"]), int(host["accepted"])
    stats = {
        "rounds": int(host["rnd"]),
        "proposed": proposed,
        "accepted": accepted,
        "acceptance": accepted / proposed if proposed else 0.0,
        "uneven_rounds": int(host["uneven"]),  # rounds where rows kept different numbers of tokens
        "slots": idx - int(req.ids.shape[1]),
        "graph_calls": calls,
    }
    return _result(req, host, reason), stats


def _listened(t, req: Request, st: dict, seen, reason) -> tuple[dict, np.ndarray]:
    """The host's rules over the tokens since the last look (rows they end go back to the
    device cut); returns the state and which rows are done."""
    if not req.listen.active:
        return st, sharding.fetch(st["done"])
    host = {key: np.array(sharding.fetch(st[key])) for key in ("out", "n_out", "budget", "done")}
    if spec_listen.check(req.listen, host, seen, reason, req.ids, req.skip, req.eos):
        st = dict(st, n_out=t.put(host["n_out"].astype(np.int32)), done=t.put(host["done"]))
    return st, host["done"]


def _result(req: Request, host: dict, reason: np.ndarray):
    """``sample()``'s output from the loop's final state (numpy copies)."""
    n, skip = req.n, req.skip
    n_out = host["n_out"][:n] - skip
    width = int(n_out.max())
    kept = np.arange(width)[None, :] < n_out[:, None]
    gen = np.where(kept, host["out"][:n, skip : skip + width], req.pad).astype(np.int64)
    sequences = np.concatenate([req.ids[:n].astype(np.int64), gen], axis=1)
    if not req.want:
        return sequences
    return generation.GenerateOutput(
        sequences=sequences,
        logprobs=np.where(kept, host["lp"][:n, skip : skip + width], 0.0).astype(np.float32),
        finish_reason=spec_listen.finish_reasons(reason[:n], gen, n_out, req.eos),
        num_generated=n_out.astype(np.int64),
        time_to_first_token=req.ttft,
    )


def applicable(call: dict, name: str) -> dict:
    """``call`` without the settings left at their neutral values (a checkpoint's
    ``generation_config.json`` often names ``repetition_penalty=1.0``...); any other setting the
    rounds cannot apply is refused, named."""
    own = {*CALL_KEYS, *SP_KEYS}
    rest = {key: v for key, v in call.items() if key not in own}
    bad = sorted(key for key, v in rest.items() if not _neutral(key, v))
    if bad:
        raise ValueError(f"{bad} not supported with {name}")
    return {key: v for key, v in call.items() if key in own}


def _neutral(key: str, value) -> bool:
    if value is False:  # a switch left off (output_scores=False...)
        return True
    if key not in sampler_params.GREEDY:
        return False
    try:
        return bool(np.all(np.asarray(value) == sampler_params.GREEDY[key]))
    except (TypeError, ValueError):
        return False


def sample_with_draft(target: StrategyHost, draft: StrategyHost | None, k, call: dict):
    """``target.sample(..., draft_model=draft, speculation_length=k)``."""
    if k is None:
        k = (target.strategies.speculation_length or (None,))[0]
    if k is None:
        raise ValueError("give speculation_length=k (>= 1) with draft_model")
    gen = SpeculativeGenerator(draft, target, k)
    out = gen.generate(**applicable(call, "draft_model"))
    target.last_speculative_stats = gen.stats
    return out
