"""Serving: a slot engine with continuous batching and an OpenAI-compatible HTTP front end.

``engine`` (the scheduler thread over ``aotlm.generate.slots``), ``types`` (what a request
sends and receives), and the HTTP layer (``app``, ``protocol``, ``chat``, ``detok``,
``metrics``), which needs the ``[serve]`` extra. A front end: it may import ``generate``,
``core``, ``text`` and lower layers; only ``cli`` imports it.
"""
