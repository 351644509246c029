"""Checkpoints: from what a user names to tensors in memory.

A name (``smollm2``, ``aotlm/tiny-py``), a checkpoint directory, a training run's directory or a
``.gguf`` file is resolved (``resolve``, ``named``, ``bundled``) to a directory holding
``config.json``; its weights are then read one tensor at a time: safetensors / ``pytorch_model.bin``
(``formats``) or, for a GGUF file, the file itself (``gguf``: metadata and tokenizer cached once,
``gguf_file`` / ``gguf_names``: its tensors and llama.cpp's layout changes, ``gguf_weights``: the
reader, ``gguf_q4k``: Q4_K group scales). The format names below are the room's public contract.
"""

from __future__ import annotations

from aotlm.models.checkpoint.formats import (
    SAFE_INDEX,
    SAFE_SINGLE,
    TORCH_INDEX,
    TORCH_SINGLE,
    CheckpointError,
    SafetensorsFile,
    WeightReader,
    drop_pages,
    gc_paused,
    load_hf_config,
    transposed,
)

__all__ = [
    "SAFE_INDEX",
    "SAFE_SINGLE",
    "TORCH_INDEX",
    "TORCH_SINGLE",
    "CheckpointError",
    "SafetensorsFile",
    "WeightReader",
    "drop_pages",
    "gc_paused",
    "load_hf_config",
    "transposed",
]
