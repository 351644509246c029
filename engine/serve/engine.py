"""``aotlm.serve.engine``: the serving engine's former import path (it is ``aotlm.batching.engine``)."""

from aotlm.batching.engine import DECODE_CHUNK, SOLO_AFTER, SOLO_CHUNK, STEP_ROWS, Engine

__all__ = ["DECODE_CHUNK", "SOLO_AFTER", "SOLO_CHUNK", "STEP_ROWS", "Engine"]
