"""Generation on a pipelined model (``pp_degree > 1``): the host chains the stages' graphs.

Every call below returns at once (JAX dispatches asynchronously) and each device runs its calls
in order, so issuing micro-batch after micro-batch lets stage ``s`` work on micro-batch ``m``
while stage ``s - 1`` works on ``m + 1``; with ``M = S`` micro-batches, micro-batch ``m``'s next
step enters the first stage right after its token leaves the last (a ring, no bubble in the
steady state). Hidden states move to the next stage with ``jax.device_put`` (``b x D`` values per
token: the lecture's 2D bytes per token per boundary).

Semantics are the one-program loop's (``generation.run``): rows are independent (per-row
sampling seeds and attention), every micro-batch steps until all rows are done or the longest
row's budget is spent, finished rows get ``pad``, the output is trimmed to the longest row.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from aotlm.core import buckets as bk
from aotlm.core import graphs, sharding
from aotlm.generate import generation
from aotlm.generate.stopping import criteria_hit

SCALARS = ("idx", "first", "limit", "eos", "pad", "want_logprobs")  # state leaves shared by all rows


def _to(stage, x):
    """``x`` (on the previous stage's devices) onto ``stage``'s, replicated over its tp devices."""
    return jax.device_put(x, stage._repl)


def _rows(state: dict, lo: int, hi: int) -> dict:
    """Rows ``lo:hi`` of a host-side generation state."""
    out = {}
    for k, v in state.items():
        if k == "params":
            out[k] = {p: a[lo:hi] for p, a in v.items()}
        else:
            out[k] = v if k in SCALARS else v[lo:hi]
    return out


def encode(model, ids: np.ndarray, mask: np.ndarray):
    """Prefill every micro-batch through the stages; returns (per micro-batch logits on the last
    stage's devices, positions ``[B, P]``)."""
    stages, b = model.stages, model.stages[0].batch_size
    positions = np.where(mask > 0, np.cumsum(mask, 1) - 1, -1).astype(np.int32)
    logits = [None] * model.micro_batches
    for step in bk.prefill_plan(ids.shape[1], model.ctx_buckets, model.tg_buckets):
        end = step.start + step.n_real
        key = ("pp_prefill", step.bucket, step.width)
        for m in range(model.micro_batches):
            tok = np.zeros((b, step.bucket), np.int32)
            pos = np.full((b, step.bucket), -1, np.int32)
            tok[:, : step.n_real] = ids[m * b : (m + 1) * b, step.start : end]
            pos[:, : step.n_real] = positions[m * b : (m + 1) * b, step.start : end]
            x = stages[0]._put(tok)
            for s, st in enumerate(stages):
                scalars = st._put(np.int32(step.start)), st._put(np.int32(step.n_real - 1))
                out, st.caches[m] = st._executable(key)(st.params, st.caches[m], x, st._put(pos), *scalars)
                x = out if st.stage.is_last else _to(stages[s + 1], out)
            logits[m] = x
    return logits, positions


def _step(model, m: int, idx: int, state: dict) -> dict:
    """Dispatch one decode step of micro-batch ``m`` through every stage; returns its new state."""
    stages = model.stages
    w = bk.decode_bucket(model.tg_buckets, idx)
    x = _to(stages[0], state["tok"])
    for s, st in enumerate(stages[:-1]):
        exe = st._executable(("pp_step", w))
        h, st.caches[m] = exe(st.params, st.caches[m], x, _to(st, state["pos"]), st._put(np.int32(idx)))
        x = _to(stages[s + 1], h)
    head = stages[-1]
    head.caches[m], state = head._executable(("pp_step", w))(head.params, head.caches[m], x, state)
    return state


def _step_all(model, states: list, idx: int, known: list, listening: bool) -> bool:
    """Step every micro-batch at slot ``idx``; False once all rows are known to be done.

    Without listeners the host reads a micro-batch's ``done`` only when it is about to step it
    again (its previous step is the next step's dependency anyway), so the device queues never
    drain between steps; a micro-batch may take one extra (padding) step before the end is seen.
    """
    for m in range(len(states)):
        if not listening:
            known[m] = sharding.fetch(states[m]["done"])
            if all(k.all() for k in known):
                return False
        states[m] = _step(model, m, idx, states[m])
    return True


def _stop_rows(model, states, criteria, ids, n: int, p_len: int, idx: int, done: np.ndarray) -> np.ndarray:
    """``generation._stop_rows`` over the micro-batches' states."""
    fetch, b = sharding.fetch, model.stages[0].batch_size
    if done[:n].all():
        return done
    out = np.concatenate([fetch(st["out"]) for st in states])
    seqs = np.concatenate([ids[:n], out[:n, p_len : idx + 1]], axis=1)
    hit = np.zeros(done.shape[0], bool)
    hit[:n] = criteria_hit(criteria, seqs) & ~done[:n]
    head = model.stages[-1]
    for m, st in enumerate(states):
        rows = slice(m * b, (m + 1) * b)
        if hit[rows].any():
            reason = np.where(hit[rows], graphs.STOPPED, fetch(st["reason"])).astype(np.int32)
            end = np.where(hit[rows], idx, fetch(st["end"])).astype(np.int32)
            st.update(done=head._put(done[rows] | hit[rows]), reason=head._put(reason), end=head._put(end))
    return done | hit


def run(model, ids, mask, n: int, new: np.ndarray, cfg, streamer, criteria, want_dict: bool):
    """``generation.run`` for a pipelined model."""
    t_start, fetch = time.perf_counter(), sharding.fetch
    big_b, p_len = ids.shape
    b, n_micro, head = model.stages[0].batch_size, model.micro_batches, model.stages[-1]
    last = p_len + np.concatenate([new, np.repeat(new[:1], big_b - n)]) - 1
    logits, positions = encode(model, ids, mask)
    full = generation.initial_state(model, ids, mask, positions, n, last, cfg)
    full["want_logprobs"] = np.bool_(want_dict)
    select = head._executable(("select",))
    states = [select(logits[m], head._put_tree(_rows(full, m * b, (m + 1) * b))) for m in range(n_micro)]
    cat = lambda key: np.concatenate([fetch(st[key]) for st in states])
    first_tok = cat("tok")
    ttft = time.perf_counter() - t_start
    if streamer is not None:
        streamer.put(ids[:n])
        streamer.put(first_tok[:n])
    listening = streamer is not None or bool(criteria)
    stop, idx, done = int(last.max()), p_len, cat("done")
    if criteria:
        done = _stop_rows(model, states, criteria, ids, n, p_len, idx, done)
    known = [done[m * b : (m + 1) * b] for m in range(n_micro)]  # done as of each one's last step
    while idx < stop and not done.all():
        if not _step_all(model, states, idx, known, listening):
            break  # every row was done: nothing more to generate
        idx += 1
        if listening:  # one synchronous step at a time: the streamer and criteria see every token
            done = cat("done")
            if streamer is not None:
                streamer.put(cat("tok")[:n])
            if criteria:
                done = _stop_rows(model, states, criteria, ids, n, p_len, idx, done)
    if streamer is not None:
        streamer.end()
    return _output(states, cat, ids, n, p_len, cfg, want_dict, ttft, int(fetch(states[0]["pad"])))


def _output(states, cat, ids, n, p_len, cfg, want_dict, ttft, pad):
    end = cat("end")
    n_gen = int(end.max()) - p_len + 1  # the longest row, as the one-program loop stops there
    out = cat("out")[:n, p_len : p_len + n_gen]
    sequences = np.concatenate([ids[:n], np.where(out < 0, pad, out)], axis=1)
    if not want_dict:
        return sequences
    top = None
    if cfg.top_logprobs:
        w, sl = int(cfg.top_logprobs), slice(p_len, p_len + n_gen)
        top = (cat("top_ids")[:n, sl, :w], cat("top_lp")[:n, sl, :w])
    return generation.GenerateOutput(
        sequences=sequences,
        logprobs=cat("logp")[:n, p_len : p_len + n_gen],
        finish_reason=[graphs.REASONS.get(int(r), "length") for r in cat("reason")[:n]],
        num_generated=end[:n] - p_len + 1,
        top_logprobs=top,
        time_to_first_token=ttft,
    )
