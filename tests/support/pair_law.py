"""The exact law of a prompt's first two sampled tokens under temperature + top-k, from the torch
reference model: the oracle the speculative and prompt-lookup samplers' draws are tested against."""

import numpy as np
import torch


def pair_law(ref, prompt: np.ndarray, temperature: float, top_k: int) -> dict:
    """``{(1st, 2nd): probability}`` over the top-k x top-k pairs after ``prompt [1, P]``."""

    def law(ids):
        with torch.no_grad():
            lg = ref(torch.tensor(ids)).logits[0, -1].double() / temperature
        top = torch.topk(lg, top_k)
        return top.indices.numpy(), torch.softmax(top.values, -1).numpy()

    cells, (t1s, p1) = {}, law(prompt)
    for a, pa in zip(t1s, p1, strict=True):
        t2s, p2 = law(np.concatenate([prompt, [[a]]], 1))
        for b, pb in zip(t2s, p2, strict=True):
            cells[(int(a), int(b))] = pa * pb
    return cells


def chi2(counts: dict, cells: dict) -> float:
    """Pearson's statistic of the observed pair ``counts`` against ``cells``' probabilities."""
    n = sum(counts.values())
    return sum((counts[c] - n * p) ** 2 / (n * p) for c, p in cells.items())


def draw_pairs(generate, prompt: np.ndarray, cells: dict, rows: int = 3, draws: int = 150):
    """``(counts, accepted, proposed)`` over ``draws`` calls of ``generate(ids, seeds) -> (out, stats)``
    on ``rows`` copies of ``prompt`` (seeds differ per row and call); a pair outside ``cells`` (a
    token outside the top-k) is a KeyError."""
    counts, acc, prop = dict.fromkeys(cells, 0), 0, 0
    ids, plen = np.repeat(prompt, rows, 0), prompt.shape[1]
    for seed in range(draws):
        out, stats = generate(ids, [seed * rows + i for i in range(rows)])
        acc, prop = acc + stats["accepted"], prop + stats["proposed"]
        for r in out[:, plen : plen + 2]:
            counts[(int(r[0]), int(r[1]))] += 1
    return counts, acc, prop
