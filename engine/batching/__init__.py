"""Continuous batching: a model's KV-cache rows as slots that requests enter and leave.

``slot_graphs`` (the compiled slot graphs: prefill a chunk into a row, insert a request, decode
every live row), ``slots`` (``SlotBatch``: the host side of those graphs, behind the
``SlotRunner`` contract), ``policy`` (``plan_round``: the scheduler's decisions as a pure function
of its state), ``engine`` (``Engine``: the scheduler thread that applies them), ``rows`` (what
free rows still hold: prefix reuse) and ``types`` (what a request sends and receives). No HTTP:
``aotlm.serve`` puts it behind an OpenAI-compatible server.

May import: ``aotlm.generate``, ``aotlm.core`` and everything below them.
"""
