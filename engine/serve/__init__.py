"""Serving over HTTP: an OpenAI-compatible front end to the continuous-batching engine
(``aotlm.batching``).

The HTTP layer (``app``, ``handlers``, ``protocol``, ``chat``, ``responses``, ``detok``,
``structured``, ``metrics``) needs the ``[serve]`` extra; ``engine`` and ``types`` only keep the
old import paths of ``aotlm.batching``'s engine and request types. A front end: it may import
``api``, ``batching``, ``generate``, ``core``, ``text`` and lower layers; only ``cli`` imports it.
"""
