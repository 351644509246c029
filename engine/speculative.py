"""Speculative decoding (work in progress)."""


def graph_keys(model) -> list[tuple]:
    return []
