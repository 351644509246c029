"""Generation on a pipelined model (``pp_degree > 1``): the host chains the stages' graphs.

Every call below returns at once (JAX dispatches asynchronously) and each device runs its calls
in order, so issuing micro-batch after micro-batch lets stage ``s`` work on micro-batch ``m``
while stage ``s - 1`` works on ``m + 1``; with ``M = S`` micro-batches, micro-batch ``m``'s next
step enters the first stage right after its token leaves the last (a ring, no bubble in the
steady state). Hidden states move to the next stage with ``core.handoff`` (``jax.device_put`` in one process,
a collective-permute between the two stages' devices across processes): ``b x D`` values per
token and boundary, the lecture's 2D bytes.

Across processes (a stage per host) every process runs the same loop, dispatching its own
stages' graphs and taking part in the hand-offs next to them; the rows step to the longest
row's budget (no host can read the last stage's done flags without a collective per step), and
the results are broadcast from the last stage's process at the end.

Semantics are the one-program loop's (``generation.run``): rows are independent (per-row
sampling seeds and attention), every micro-batch steps until all rows are done or the longest
row's budget is spent, finished rows get ``pad``, the output is trimmed to the longest row.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from aotlm.core import buckets as bk
from aotlm.core import graphs, sampling, sharding
from aotlm.core.handoff import hand_off, settle
from aotlm.core.state import DecodeState
from aotlm.generate import generation
from aotlm.generate.stopping import criteria_hit

SCALARS = ("idx", "first", "limit", "eos", "pad", "want_logprobs")  # state leaves shared by all rows


def _rows(state: DecodeState, lo: int, hi: int) -> DecodeState:
    """Rows ``lo:hi`` of a host-side generation state."""
    rows = {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.name not in SCALARS}
    cut = jax.tree.map(lambda a: a[lo:hi], rows)
    return state.replace(**cut)


def encode(model, ids: np.ndarray, mask: np.ndarray):
    """Prefill every micro-batch through the stages; returns (per micro-batch logits on the last
    stage's devices, None where another process runs it; positions ``[B, P]``)."""
    stages, b, d = model.stages, model.stages[0].batch_size, model.cfg.hidden_size
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
            x = stages[0].put(tok) if stages[0].local else None
            for s, st in enumerate(stages):
                out = None
                if st.local:
                    scalars = st.put(np.int32(step.start)), st.put(np.int32(step.n_real - 1))
                    out, st.caches[m] = settle(
                        st.executable(key)(st.params, st.caches[m], x, st.put(pos), *scalars)
                    )
                if st.stage.is_last:
                    logits[m] = out
                else:
                    x = hand_off(st, stages[s + 1], out, (b, step.bucket, d), model.dtype)
    return logits, positions


def _step(model, m: int, idx: int, state: dict | None, pos: np.ndarray) -> dict | None:
    """Dispatch one decode step of micro-batch ``m`` through every stage; returns its new state
    (None where another process runs the last stage).

    ``pos [b]``: the model positions of the tokens at slot ``idx``, known on the host (one more
    per step after the prompt's), so only the sampled token travels back to the first stage."""
    stages, head = model.stages, model.stages[-1]
    b, d = stages[0].batch_size, model.cfg.hidden_size
    w = bk.decode_bucket(model.tg_buckets, idx)
    x = hand_off(head, stages[0], state.tok if head.local else None, (b,), np.int32)
    for s, st in enumerate(stages[:-1]):
        h = None
        if st.local:
            exe = st.executable(("pp_step", w))
            h, st.caches[m] = settle(exe(st.params, st.caches[m], x, st.put(pos), st.put(np.int32(idx))))
        x = hand_off(st, stages[s + 1], h, (b, 1, d), model.dtype)
    if head.local:
        head.caches[m], state = settle(head.executable(("pp_step", w))(head.params, head.caches[m], x, state))
    return state


def _step_all(model, states: list, idx: int, known: list, listening: bool, pos: np.ndarray) -> bool:
    """Step every micro-batch at slot ``idx``; False once all rows are known to be done.

    Without listeners the host reads a micro-batch's ``done`` only when it is about to step it
    again (its previous step is the next step's dependency anyway), so the device queues never
    drain between steps; a micro-batch may take one extra (padding) step before the end is seen.
    """
    for m in range(len(states)):
        if not listening:
            known[m] = sharding.fetch(states[m].done)
            if all(k.all() for k in known):
                return False
        b = len(known[m])
        states[m] = _step(model, m, idx, states[m], pos[m * b : (m + 1) * b])
    return True


def _stop_rows(model, states, criteria, ids, n: int, p_len: int, idx: int, done: np.ndarray) -> np.ndarray:
    """``generation._stop_rows`` over the micro-batches' states."""
    fetch, b = sharding.fetch, model.stages[0].batch_size
    if done[:n].all():
        return done
    out = np.concatenate([fetch(st.out) for st in states])
    seqs = np.concatenate([ids[:n], out[:n, p_len : idx + 1]], axis=1)
    hit = np.zeros(done.shape[0], bool)
    hit[:n] = criteria_hit(criteria, seqs) & ~done[:n]
    head = model.stages[-1]
    for m, st in enumerate(states):
        rows = slice(m * b, (m + 1) * b)
        if hit[rows].any():
            reason = np.where(hit[rows], graphs.FinishReason.STOPPED, fetch(st.reason)).astype(np.int32)
            end = np.where(hit[rows], idx, fetch(st.end)).astype(np.int32)
            st.done, st.reason, st.end = head.put(done[rows] | hit[rows]), head.put(reason), head.put(end)
    return done | hit


def run(model, ids, mask, n: int, new: np.ndarray, cfg, streamer, criteria, want_dict: bool):
    """``generation.run`` for a pipelined model."""
    t_start, fetch = time.perf_counter(), sharding.fetch
    big_b, p_len = ids.shape
    b, n_micro, head = model.stages[0].batch_size, model.micro_batches, model.stages[-1]
    multi = jax.process_count() > 1
    if multi and (streamer is not None or criteria):
        raise ValueError(
            "a streamer or stopping criteria need the tokens on every host: not supported with pp_degree > 1 "
            "across processes; run them without, or in one process"
        )
    last = p_len + np.concatenate([new, np.repeat(new[:1], big_b - n)]) - 1
    logits, positions = encode(model, ids, mask)
    full = generation.initial_state(model, ids, mask, positions, n, last, cfg)
    full.want_logprobs = np.bool_(want_dict)
    states: list = [None] * n_micro
    if head.local:
        select = head.executable(("select",))
        states = [
            settle(select(logits[m], head.put_tree(_rows(full, m * b, (m + 1) * b)))) for m in range(n_micro)
        ]
    cat = lambda key: np.concatenate([fetch(getattr(st, key)) for st in states])
    stop, idx = int(last.max()), p_len
    first_pos = (positions.max(1) + 1).astype(np.int32)  # of the first generated token (state.pos)
    if multi:  # every process runs the same steps (no host reads another's done flags)
        ttft = time.perf_counter() - t_start
        for idx in range(p_len, stop):
            for m in range(n_micro):
                states[m] = _step(model, m, idx, states[m], (first_pos + (idx - p_len))[m * b : (m + 1) * b])
        res = _broadcast(model, states, cat)
        return _output(res, ids, n, p_len, cfg, want_dict, ttft)
    first_tok = cat("tok")
    ttft = time.perf_counter() - t_start
    if streamer is not None:
        streamer.put(ids[:n])
        streamer.put(first_tok[:n])
    listening = streamer is not None or bool(criteria)
    done = cat("done")
    if criteria:
        done = _stop_rows(model, states, criteria, ids, n, p_len, idx, done)
    known = [done[m * b : (m + 1) * b] for m in range(n_micro)]  # done as of each one's last step
    while idx < stop and not done[:n].all():  # padding rows never hold the loop
        if not _step_all(model, states, idx, known, listening, first_pos + (idx - p_len)):
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
    res = {k: cat(k) for k in RESULT_KEYS}
    res["pad"] = int(fetch(states[0].pad))
    return _output(res, ids, n, p_len, cfg, want_dict, ttft)


RESULT_KEYS = ("out", "end", "reason", "logp", "top_ids", "top_lp")


def _broadcast(model, states: list, cat) -> dict:
    """The results, from the process that runs the last stage to every process."""
    head, big_b = model.stages[-1], model.batch_size
    s, k = model.n_positions, sampling.TOP_LOGPROBS_MAX
    shapes = {"out": ((big_b, s), np.int32), "end": ((big_b,), np.int32), "reason": ((big_b,), np.int32),
              "logp": ((big_b, s), np.float32), "top_ids": ((big_b, s, k), np.int32),
              "top_lp": ((big_b, s, k), np.float32), "pad": ((), np.int32)}  # fmt: skip
    res = {}
    for key, (shape, dtype) in shapes.items():
        mine = (cat(key) if key != "pad" else sharding.fetch(states[0].pad)) if head.local else None
        value = np.asarray(mine if mine is not None else np.zeros(shape, dtype), dtype)
        res[key] = multihost_utils.broadcast_one_to_all(value, is_source=head.local)
    res["pad"] = int(res["pad"])
    return res


def _output(res: dict, ids, n, p_len, cfg, want_dict, ttft):
    end = res["end"]
    n_gen = int(end[:n].max()) - p_len + 1  # the longest row, as the one-program loop stops there
    out = res["out"][:n, p_len : p_len + n_gen]
    sequences = np.concatenate([ids[:n], np.where(out < 0, res["pad"], out)], axis=1)
    if not want_dict:
        return sequences
    top = None
    if cfg.top_logprobs:
        w, sl = int(cfg.top_logprobs), slice(p_len, p_len + n_gen)
        top = (res["top_ids"][:n, sl, :w], res["top_lp"][:n, sl, :w])
    return generation.GenerateOutput(
        sequences=sequences,
        logprobs=res["logp"][:n, p_len : p_len + n_gen],
        finish_reason=[graphs.FinishReason.of(r).label for r in res["reason"][:n]],
        num_generated=end[:n] - p_len + 1,
        top_logprobs=top,
        time_to_first_token=ttft,
    )
