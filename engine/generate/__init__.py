"""Offline decoding on top of the compiled graphs: what a ``sample()`` call does per request.

Generation parameters (``params``), the host side of the decode loop and its row state
(``generation``, ``sampler``, ``rows``, ``stopping``), grammar constraints (``constraints``), the
pipeline-parallel loop (``pp_run``) and the strategies that add graph kinds: beam search,
speculative decoding (host and graph sides), context broadcasting. The model classes users get
from ``from_pretrained`` are ``aotlm.api``'s; continuous batching is ``aotlm.batching``'s.

May import: ``aotlm.core`` and everything below it.
"""
