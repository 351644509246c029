"""What happens per request on top of the compiled graphs.

``causal_lm.CausalLMForSampling`` (``sample()``; ``AutoModelForSampling`` and the family classes),
generation parameters (``params``), the host side of the decode loop and its row state
(``generation``, ``rows``), and the strategies that add graph kinds: beam search, speculative
decoding (host and graph sides), context broadcasting (``extensions`` routes to them).

May import: ``aotlm.core`` and everything below it.
"""
