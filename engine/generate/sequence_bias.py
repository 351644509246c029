"""transformers' ``sequence_bias`` for ``sample()`` (``SequenceBiasLogitsProcessor``), as the decode
state's sparse logit bias (``bias_ids`` / ``bias_val [B, MAX_LOGIT_BIAS]``, the arrays OpenAI's
``logit_bias`` uses in the serving graphs).

``sequence_bias`` is ``[[token ids], bias]`` pairs (or transformers' older ``{(token ids): bias}``): a
one-token sequence's bias is added to that token's score at every step; a longer one's to its last
token when the row's tokens (its real prompt tokens, then what it generated) end with the rest of it,
added to any other bias of that token. A sequence given twice keeps its last bias (transformers keeps
them in a dict). One setting for every row of the call. Applied with the bans and the grammar mask,
after the repetition penalty, where transformers applies it before: the two orders agree unless a
repetition penalty is also set, which is refused with it.

One-token biases are fixed arrays: the decode loop stays on the device. Sequences of several tokens
are matched on the host after every token (one token per decode call, as bad words of several tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from aotlm.generate import bans

FIELD = "sequence_bias"


def pairs(value, vocab: int) -> tuple[tuple[tuple[int, ...], float], ...]:
    """The ``(token ids, bias)`` pairs of ``value`` (None: none), the last bias of a repeated sequence."""
    if value is None:
        return ()
    err = "sequence_bias must be [[token ids], bias] pairs, e.g. [[[13], -2.0], [[198, 198], 1.5]]"
    items = list(value.items()) if isinstance(value, dict) else value
    if isinstance(items, str | bytes) or not isinstance(items, Sequence) or not items:
        raise TypeError(f"{err}, got {value!r}")
    out: dict[tuple[int, ...], float] = {}
    for item in items:
        if isinstance(item, str | bytes) or not isinstance(item, Sequence) or len(item) != 2:
            raise TypeError(f"{err}, got {item!r}")
        seq, bias = item
        ok_seq = isinstance(seq, Sequence | np.ndarray) and not isinstance(seq, str | bytes) and len(seq) > 0
        if not ok_seq or not all(isinstance(t, int | np.integer) and not isinstance(t, bool) for t in seq):
            raise TypeError(f"{err}, got {item!r}")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not np.isfinite(bias):
            raise TypeError(f"sequence_bias: the bias of {list(seq)} must be a finite number, got {bias!r}")
        bad = [int(t) for t in seq if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"sequence_bias holds {bad[0]}, outside the vocabulary [0, {vocab})")
        out[tuple(int(t) for t in seq)] = float(bias)
    return tuple(out.items())


class SequenceBias:
    """One call's biases over its rows; ``histories``: each row's real prompt tokens, extended by
    ``advance`` with what it generates (only when a sequence has several tokens)."""

    def __init__(self, biases, histories: list[list[int]], width: int):
        self.single = {s[0]: b for s, b in biases if len(s) == 1}
        self.longer = tuple((s, b) for s, b in biases if len(s) > 1)
        self.histories, self.width = histories, width
        if len(self.single) + len({s[-1] for s, _ in self.longer}) > width:
            raise ValueError(f"sequence_bias biases more than {width} distinct tokens; give at most {width}")

    @property
    def dynamic(self) -> bool:
        """Whether the biases change with each token (sequences of several tokens)."""
        return bool(self.longer)

    def arrays(self, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """``(bias_ids, bias_val)`` ``[rows, width]`` for the next token (-1 / 0 padded; rows past the
        histories, the compiled batch's padding, get row 0's)."""
        ids = np.full((rows, self.width), -1, np.int32)
        vals = np.zeros((rows, self.width), np.float32)
        for r in range(rows):
            hist = self.histories[min(r, len(self.histories) - 1)]
            total = dict(self.single)
            for seq, bias in self.longer:
                if bans.ends_with(hist, seq[:-1]):
                    total[seq[-1]] = total.get(seq[-1], 0.0) + bias
            ids[r, : len(total)], vals[r, : len(total)] = list(total), list(total.values())
        return ids, vals

    def advance(self, tokens: np.ndarray, done: np.ndarray) -> None:
        """Each row that was live gets its newest token."""
        if self.longer:
            bans.extend(self.histories, tokens, done)


def build(cfg, ids: np.ndarray, mask: np.ndarray, vocab: int, width: int) -> SequenceBias | None:
    """The biases ``cfg`` (a ``GenerationConfig``) asks for over the padded prompt batch, or None; a
    repetition penalty with them is refused (transformers applies the two in the other order)."""
    biases = pairs(getattr(cfg, FIELD, None), vocab)
    if not biases:
        return None
    penalty = np.asarray(getattr(cfg, "repetition_penalty", None) or 1.0, np.float64)
    if (penalty != 1.0).any():
        raise ValueError(
            "sequence_bias with a repetition_penalty is not supported (transformers biases the scores "
            "before penalizing them, aotlm after); give one of them"
        )
    histories = [row[keep > 0].tolist() for row, keep in zip(ids, mask, strict=True)]
    return SequenceBias(biases, histories, width)
