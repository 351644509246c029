"""Beam search on the compiled graphs, with transformers' ``_beam_search`` semantics.

Beams are batch rows: the compiled batch ``B`` holds ``P = B // num_beams`` prompts, rows
``p*num_beams .. p*num_beams+num_beams-1`` being prompt ``p``'s beams (HF's flattening).
The prompt is encoded once per prompt (context broadcasting, ``aotlm.generate.broadcast``), then

* ``("beam_init", num_beams)`` turns the prefill logits into the first beam step, and
* ``("beam", num_beams, W)`` (one per token bucket ``W``) runs the whole search inside a
  ``lax.while_loop``: reorder the KV-cache rows by source beam (on device, slots ``< W``
  only), feed every beam's newest token, score, pick the top candidates, update the
  finished hypotheses and the early-stop heuristic, exactly as transformers 5 does
  (same float32 operations in the same order, same ``-1e9`` masking).

Static (baked into the graphs): ``num_beams`` and the candidate width
``K = num_beams * (1 + MAX_EOS)``. HF keeps ``max(2, 1 + n_eos) * num_beams`` candidates;
keeping more changes nothing, because at most ``n_eos * num_beams`` of them can end in eos,
so the best ``num_beams`` unfinished ones are among HF's. Traced: ``length_penalty`` (as a
table of ``float32(n ** length_penalty)``, computed in double on the host as Python does),
``early_stopping`` (True / False / "never"), eos ids, ``max_length``, the prompt length.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from aotlm.core import buckets as bk
from aotlm.core import inputs, sampler_params, sharding
from aotlm.generate.strategies import StrategyHost
from aotlm.models import decoder

MAX_EOS = 3  # eos ids honoured by beam search (static: sets the candidate width)
NEG = -1.0e9
ES_FALSE, ES_TRUE, ES_NEVER = 0, 1, 2


@dataclass
class BeamOutput:
    """``sample(..., num_beams=N, return_dict=True)``: as transformers' GenerateBeamDecoderOnlyOutput."""

    sequences: np.ndarray  # [prompts * num_return_sequences, len]
    sequences_scores: np.ndarray  # [prompts * num_return_sequences] float32


def graph_keys(model: StrategyHost) -> list[tuple]:
    nb = model.strategies.num_beams
    if nb <= 1:
        return []
    return [("beam_init", nb)] + [("beam", nb, w) for w in model.tg_buckets]


# ------------------------------------------------------------------------------ the step
def _take(x, idx):
    """``x [P, N, ...]`` gathered along axis 1 by ``idx [P, M]``."""
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


def step(st: dict, logits, nb: int) -> dict:
    """One beam-search iteration on the logits of slot ``cur`` (HF step b-g)."""
    p, _, s = st["seq"].shape
    v = logits.shape[-1]
    k = min(nb * (1 + MAX_EOS), nb * v)
    cur, plen = st["cur"], st["plen"]
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1).reshape(p, nb, v)
    flat = (lp + st["score"][:, :, None]).reshape(p, nb * v)
    topv, topi = lax.top_k(flat, k)
    src_beam, tok = topi // v, (topi % v).astype(jnp.int32)
    cseq = lax.dynamic_update_slice(_take(st["seq"], src_beam), tok[:, :, None], (0, 0, cur))
    is_eos = jnp.any(tok[..., None] == st["eos"][None, None, :], -1)
    hits = is_eos | (cur + 1 >= st["max_len"])
    # running beams for the next iteration
    run_lp = topv + hits.astype(jnp.float32) * NEG
    nxt = lax.top_k(run_lp, nb)[1]
    seq, score, srcb = _take(cseq, nxt), _take(run_lp, nxt), _take(src_beam, nxt)
    # finished hypotheses
    just = hits & (jnp.arange(k) < nb)[None, :]
    fl = topv / st["den"][cur + 1 - plen]
    full = jnp.all(st["fdone"], -1, keepdims=True) & (st["es"] == ES_TRUE)
    fl = fl + full.astype(jnp.float32) * NEG
    fl = fl + (~st["heur"]).astype(jnp.float32)[:, None] * NEG
    fl = fl + (~just).astype(jnp.float32) * NEG
    mscore = jnp.concatenate([st["fscore"], fl], 1)
    mi = lax.top_k(mscore, nb)[1]
    gen = jnp.full((p, k), cur + 1 - plen, jnp.int32)
    fseq = _take(jnp.concatenate([st["fseq"], cseq], 1), mi)
    fscore = _take(mscore, mi)
    fdone = _take(jnp.concatenate([st["fdone"], just], 1), mi)
    flen = _take(jnp.concatenate([st["flen"], gen], 1), mi)
    # early-stop heuristic with the new length (HF step g)
    cur = cur + 1
    den = jnp.where(st["never_pos"], st["den"][st["max_len"] - plen], st["den"][cur - plen])
    best = score[:, :1] / den
    worst = jnp.where(fdone, jnp.min(fscore, 1, keepdims=True), NEG)
    heur = st["heur"] & jnp.any(best > worst, -1)
    go = jnp.any(heur) & ~(jnp.all(fdone) & (st["es"] == ES_TRUE)) & ~jnp.all(hits)
    rows = (jnp.arange(p, dtype=jnp.int32)[:, None] * nb + srcb).reshape(p * nb)
    feed = lax.dynamic_index_in_dim(seq, cur - 1, axis=2, keepdims=False).reshape(p * nb)
    return dict(
        st,
        seq=seq,
        score=score,
        fseq=fseq,
        fscore=fscore,
        fdone=fdone,
        flen=flen,
        heur=heur,
        go=go & st["go"],
        cur=cur,
        tok=feed,
        src=rows.astype(jnp.int32),
    )


def reorder(cache, src, width: int):
    """Cache rows ``r <- src[r]`` for the first ``width`` slots (later slots are unused yet)."""
    take = lambda a: jnp.take(a, src, axis=0)
    k = [lax.dynamic_update_slice(a, take(a[:, :, :width]), (0, 0, 0, 0)) for a in cache["k"]]
    v = [lax.dynamic_update_slice(a, take(a[..., :width]), (0, 0, 0, 0)) for a in cache["v"]]
    return {"k": k, "v": v, "pos": take(cache["pos"])}


def init_graph(nb: int, logits, st):
    return step(st, logits, nb)


def loop_graph(cfg, nb: int, width: int, params, cache, st):
    """Beam steps on device while the search goes on and the fed slot is inside the bucket."""

    def cond(carry):
        return carry[1]["go"] & (carry[1]["cur"] - 1 < width)

    def body(carry):
        cache, st = carry
        cache = reorder(cache, st["src"], width)
        slot = st["cur"] - 1
        h, cache = decoder.forward(cfg, params, cache, st["tok"][:, None], st["pos"][:, None], slot, width)
        st = step(dict(st, pos=st["pos"] + 1), decoder.logits(cfg, params, h[:, 0]), nb)
        return cache, st

    return lax.while_loop(cond, body, (cache, st))


def state_spec(model: StrategyHost, nb: int) -> dict:
    b, s, rep = model.batch_size, model.n_positions, model.replicated
    p = b // nb
    a = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=rep)
    i32, f32, b1 = jnp.int32, jnp.float32, jnp.bool_
    return {
        "seq": a((p, nb, s), i32),
        "score": a((p, nb), f32),
        "fseq": a((p, nb, s), i32),
        "fscore": a((p, nb), f32),
        "fdone": a((p, nb), b1),
        "flen": a((p, nb), i32),
        "heur": a((p,), b1),
        "go": a((), b1),
        "cur": a((), i32),
        "plen": a((), i32),
        "max_len": a((), i32),
        "tok": a((b,), i32),
        "src": a((b,), i32),
        "pos": a((b,), i32),
        "eos": a((MAX_EOS,), i32),
        "den": a((s + 1,), f32),
        "es": a((), i32),
        "never_pos": a((), b1),
    }


def lower(model: StrategyHost, key: tuple):
    nb = key[1]
    st = state_spec(model, nb)
    st_sh = model.shardings(st)
    if key[0] == "beam_init":
        logits = jax.ShapeDtypeStruct(
            (model.batch_size, model.cfg.vocab_size), jnp.float32, sharding=model.replicated
        )
        fn = jax.jit(functools.partial(init_graph, nb), donate_argnums=(1,), out_shardings=st_sh)
        return fn.lower(logits, st)
    p, cache = model.abstract(model.params), model.cache_specs()
    fn = jax.jit(
        functools.partial(loop_graph, model.cfg, nb, key[2]),
        donate_argnums=(1, 2),
        out_shardings=(model.shardings(cache), st_sh),
    )
    return fn.lower(p, cache, st)


# ------------------------------------------------------------------------------ host side
def check(model: StrategyHost, n_prompts: int, num_beams: int, num_return_sequences: int) -> None:
    if not isinstance(num_beams, int) or num_beams < 1:
        raise ValueError(f"num_beams must be an int >= 1, got {num_beams!r}")
    if not 1 <= num_return_sequences <= num_beams:
        raise ValueError(
            f"num_return_sequences={num_return_sequences} must be between 1 and num_beams={num_beams}"
        )
    need = n_prompts * num_beams
    if need > model.batch_size or model.batch_size % num_beams:
        raise ValueError(
            f"{n_prompts} prompt(s) x num_beams={num_beams} need a compiled batch of {need} rows (a multiple "
            f"of num_beams); the model has batch_size={model.batch_size}. Compiled batch = runtime batch x "
            "num_return_sequences x num_beams: load the model with a larger batch_size"
        )


def _early_stopping(value) -> int:
    if value is True or value is False:
        return ES_TRUE if value else ES_FALSE
    if value == "never":
        return ES_NEVER
    raise ValueError(f'early_stopping must be True, False or "never", got {value!r}')


def search(
    model,
    ids: np.ndarray,
    mask: np.ndarray,
    max_new_tokens: int,
    eos_token_id,
    pad_token_id,
    num_beams: int,
    num_return_sequences: int = 1,
    length_penalty: float = 1.0,
    early_stopping=False,
) -> BeamOutput:
    """Beam search for ``ids [n, len]`` (left-padded, ``mask``); see the module docstring."""
    n, plen = ids.shape
    check(model, n, num_beams, num_return_sequences)
    es = _early_stopping(early_stopping)
    eos = inputs.eos_ids(eos_token_id, MAX_EOS)
    real_eos = [int(e) for e in eos if e >= 0]
    # HF: pad_token_id or eos_token_id[0] fills the unused tail of finished sequences
    fill = (pad_token_id or real_eos[0]) if real_eos else (-1 if pad_token_id is None else pad_token_id)
    b, s = model.batch_size, model.n_positions
    p = b // num_beams
    max_len = plen + int(max_new_tokens)
    rows = lambda x: np.concatenate([x, np.repeat(x[:1], p - n, 0)]) if p > n else x
    grp_ids, grp_mask = rows(ids), rows(mask)
    flat_ids, flat_mask = np.repeat(grp_ids, num_beams, 0), np.repeat(grp_mask, num_beams, 0)
    with model.strategies.broadcasting(num_beams, b):
        out = model.encode(flat_ids, flat_mask)
    logits, positions = out[0], out[-1]
    seq = np.full((p, num_beams, s), fill, np.int32)
    seq[:, :, :plen] = grp_ids[:, None, :]
    score = np.zeros((p, num_beams), np.float32)
    score[:, 1:] = NEG
    with np.errstate(divide="ignore"):
        den = np.array([float(i) ** float(length_penalty) if i else 1.0 for i in range(s + 1)], np.float32)
    st = {
        "seq": seq,
        "score": score,
        "fseq": seq.copy(),
        "fscore": np.full((p, num_beams), NEG, np.float32),
        "fdone": np.zeros((p, num_beams), bool),
        "flen": np.zeros((p, num_beams), np.int32),
        "heur": np.ones(p, bool),
        "go": np.bool_(True),
        "cur": np.int32(plen),
        "plen": np.int32(plen),
        "max_len": np.int32(max_len),
        "tok": np.zeros(b, np.int32),
        "src": np.arange(b, dtype=np.int32),
        "pos": (positions.max(1) + 1).astype(np.int32),
        "eos": eos,
        "den": den,
        "es": np.int32(es),
        "never_pos": np.bool_(es == ES_NEVER and length_penalty > 0),
    }
    st = jax.tree.map(lambda x: model.put(np.asarray(x)), st)
    st = model.executable(("beam_init", num_beams))(logits, st)
    cur, go = plen + 1, bool(sharding.fetch(st["go"]))
    while go:
        exe = model.executable(("beam", num_beams, bk.decode_bucket(model.tg_buckets, cur - 1)))
        model.cache, st = exe(model.params, model.cache, st)
        cur, go = int(sharding.fetch(st["cur"])), bool(sharding.fetch(st["go"]))
    r = num_return_sequences
    fseq = sharding.fetch(st["fseq"])[:n, :r].reshape(n * r, s)
    fscore = sharding.fetch(st["fscore"])[:n, :r].reshape(n * r)
    flen = sharding.fetch(st["flen"])[:, :r]
    length = plen + int(flen.max())
    return BeamOutput(sequences=fseq[:, :length].astype(np.int64), sequences_scores=fscore)


_KNOWN = {"input_ids", "attention_mask", "start_ids", "max_new_tokens", "sequence_length", "eos_token_id"}
_DEFAULTS = sampler_params.GREEDY  # sampling settings: accepted at their neutral values only


def new_tokens(model: StrategyHost, p_len: int, max_new_tokens, sequence_length) -> int:
    if max_new_tokens is not None and sequence_length is not None:
        raise ValueError("give max_new_tokens or sequence_length, not both")
    new = int(sequence_length) - p_len if sequence_length is not None else max_new_tokens
    new = model.n_positions - p_len if new is None else int(np.max(new))
    if new < 1 or p_len + new > model.n_positions:
        raise ValueError(
            f"prompt ({p_len} tokens) + max_new_tokens ({new}) must be in [{p_len + 1}, n_positions="
            f"{model.n_positions}]; shorten the request or load the model with a larger n_positions"
        )
    return new


def sample(
    model: StrategyHost, call: dict, num_beams: int, num_return_sequences: int, length_penalty, early_stopping
):
    """``model.sample(..., num_beams=N)``: sequences ``[prompts * num_return_sequences, len]``."""
    return_dict = bool(call.pop("return_dict", False))
    pad = call.pop("pad_token_id", None)
    for name, default in _DEFAULTS.items():
        if name in call and call.pop(name) != default:
            raise ValueError(
                f"{name} is not supported with num_beams > 1 (beam search here is HF's plain beam search)"
            )
    unknown = set(call) - _KNOWN
    if unknown:
        raise ValueError(f"{sorted(unknown)} not supported with num_beams > 1")
    ids = inputs.token_ids(call["input_ids"], model.cfg.vocab_size)
    mask = inputs.prompt_mask(ids, call.get("attention_mask"), call.get("start_ids"))
    check(model, ids.shape[0], num_beams, num_return_sequences)
    new = new_tokens(model, ids.shape[1], call.get("max_new_tokens"), call.get("sequence_length"))
    out = search(
        model,
        ids,
        mask,
        new,
        call.get("eos_token_id"),
        pad,
        num_beams,
        num_return_sequences,
        length_penalty,
        early_stopping,
    )
    return out if return_dict else out.sequences
