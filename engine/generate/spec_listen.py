"""What speculative rounds (a draft's or prompt lookup's) follow on the host, token by token.

A round commits several tokens at once on the device, so the rules plain decoding applies per
token there (``stop_sequences`` in the graph; a streamer and ``stopping_criteria`` after each
token) are applied here to each token a call committed, in order: a row that meets one ends at
that token (later tokens of its round are dropped, as plain decoding would never have made
them), with plain decoding's finish reason. While one listens, each graph call is given a few
rounds' slots (``LISTEN_ROUNDS``), so the host sees the tokens soon after they are made.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from aotlm.core.graphs import FinishReason
from aotlm.generate import generation, stopping

LISTEN_ROUNDS = 2  # rounds' slots a graph call may fill while a streamer or a stop rule listens
KEYS = ("streamer", "stop_sequences", "stopping_criteria", "stopping_criteria_list", "return_dict")


@dataclass
class Listen:
    """The host's per-token rules of one request's ``rows`` prompts: ``stops[r]`` row ``r``'s stop
    sequences (token tuples), ``criteria`` transformers ``StoppingCriteria``, ``streamer`` a
    ``BaseStreamer``."""

    rows: int = 0
    streamer: object | None = None
    stops: list[list[tuple[int, ...]]] = field(default_factory=list)  # one list per row
    criteria: list = field(default_factory=list)

    @property
    def active(self) -> bool:
        return self.streamer is not None or any(self.stops) or bool(self.criteria)


def split(call: dict, n: int, rows: int, vocab: int, name: str) -> tuple[Listen, bool]:
    """Take the listening keys out of a speculative request's ``call`` (``n`` prompts padded to
    ``rows``): its ``Listen`` and whether a ``GenerateOutput`` is wanted. ``name``: the request's
    kind in errors (``prompt_lookup_num_tokens``, ``draft_model``)."""
    streamer = call.pop("streamer", None)
    generation.check_streamer(streamer)
    if streamer is not None and n != 1:
        raise ValueError(f"a streamer follows one prompt with {name}, got {n}")
    given = call.pop("stopping_criteria", None), call.pop("stopping_criteria_list", None)
    if given[0] is not None and given[1] is not None:
        raise ValueError("give stopping_criteria or stopping_criteria_list, not both")
    criteria = stopping.criteria_list(given[0] if given[0] is not None else given[1])
    table = generation.stop_array(call.pop("stop_sequences", None), n, rows, vocab)
    stops = [[tuple(int(x) for x in seq[seq != -2]) for seq in row if (seq != -2).any()] for row in table[:n]]
    return Listen(n, streamer, stops, criteria), bool(call.pop("return_dict", False))


def _why(listen: Listen, r: int, prompt: np.ndarray, gen: np.ndarray, last: bool) -> int:
    """Why row ``r`` ends at its newest token ``gen[-1]`` by a host rule, or ``RUNNING``. As in
    plain decoding, a stop sequence counts inside the generated tokens and wins over the length
    limit; the criteria are not asked about a row the length limit ends (``last``)."""
    for seq in listen.stops[r]:
        if len(gen) >= len(seq) and tuple(gen[-len(seq) :].tolist()) == seq:
            return FinishReason.STOP_SEQUENCE
    if listen.criteria and not last:
        seq = np.concatenate([prompt, gen])[None, :]
        if stopping.criteria_hit(listen.criteria, seq)[0]:
            return FinishReason.STOPPED
    return FinishReason.RUNNING


def check(listen: Listen, host: dict, seen: np.ndarray, reason: np.ndarray, ids, skip: int, eos) -> bool:
    """Apply the rules to row ``r``'s tokens in columns ``seen[r]..n_out[r]`` of ``host["out"]``
    (numpy copies of the loop state; generated tokens start at column ``skip``), cutting ``n_out``
    and setting ``done`` where a rule ends a row and its ``reason``; streams row 0's kept tokens.
    Returns whether a row was cut (the state must go back to the device)."""
    cut = False
    for r in range(listen.rows):
        c = int(seen[r])
        while c < host["n_out"][r]:
            gen = host["out"][r, skip : c + 1]
            if not np.isin(gen[-1], eos):  # eos wins over every rule
                last = c + 1 >= host["budget"][r]
                why = _why(listen, r, ids[r], gen, last)
                if why != FinishReason.RUNNING:
                    reason[r] = why
                    cut |= c + 1 < host["n_out"][r] or not host["done"][r]
                    host["n_out"][r], host["done"][r] = c + 1, True
            c += 1
        if listen.streamer is not None and r == 0 and c > seen[r]:
            listen.streamer.put(host["out"][:1, seen[r] : c])
        seen[r] = c
    return cut


def finish_reasons(reason: np.ndarray, gen: np.ndarray, n_out: np.ndarray, eos) -> list[str]:
    """Each row's ``GenerateOutput.finish_reason``: a host rule's, else eos when its last token is
    one, else the length limit."""
    last = gen[np.arange(len(n_out)), np.maximum(n_out - 1, 0)]
    plain = np.where(np.isin(last, eos), FinishReason.EOS, FinishReason.LENGTH)
    code = np.where(reason != FinishReason.RUNNING, reason, plain)
    return [FinishReason(int(c)).label for c in code]
