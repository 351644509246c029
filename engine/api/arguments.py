"""``from_pretrained``'s keyword arguments checked by name before anything loads.

A typo (``batchsize``) gets the close names; an argument of transformers' ``from_pretrained`` or
``pipeline`` (``torch_dtype``, ``device_map``, ...) gets aotlm's way of saying the same thing,
instead of Python's "unexpected keyword argument" from a constructor the user never called.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterable

_DTYPE = "aotlm's precision arguments are amp='f32' | 'bf16' | 'f16' (compute) and quant= (weight storage)"
_DEVICE = (
    "aotlm runs on JAX's default backend (JAX_PLATFORMS=cpu|cuda|tpu picks it) and splits a model over "
    "devices with tp_degree=N / pp_degree=N"
)
_HUB = "aotlm loads local checkpoints, GGUF files and bundled names only (no model hub)"
TRANSFORMERS_ARGUMENTS = {
    "torch_dtype": _DTYPE,
    "dtype": _DTYPE,
    "device_map": _DEVICE,
    "device": _DEVICE,
    "load_in_8bit": "aotlm's is quant='int8'",
    "load_in_4bit": "aotlm's is quant='int4'",
    "quantization_config": "aotlm's is quant= (a name or an aotlm QuantizationConfig)",
    "trust_remote_code": "aotlm runs its own implementation of each supported family; no code is loaded",
    "low_cpu_mem_usage": "aotlm always loads weights tensor by tensor",
    "attn_implementation": "aotlm compiles its own attention for the backend",
    "revision": _HUB,
    "cache_dir": _HUB + "; the compile cache is compile_cache=DIR",
    "token": _HUB,
    "local_files_only": _HUB,
}


def accepted(functions: Iterable) -> set[str]:
    """The keyword parameter names of ``functions`` (their ``**kwargs`` left out)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {
        name
        for f in functions
        for name, p in inspect.signature(f).parameters.items()
        if p.kind in kinds and name not in ("self", "cls", "path")
    }


def check_names(given: Iterable[str], known: set[str], where: str) -> None:
    """A ``TypeError`` for the first unknown name: transformers' meaning, or the close known names."""
    for name in given:
        if name in known:
            continue
        if name in TRANSFORMERS_ARGUMENTS:
            raise TypeError(
                f"{where} does not take {name!r} (a transformers argument): {TRANSFORMERS_ARGUMENTS[name]}"
            )
        close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
        hint = f"did you mean {' or '.join(map(repr, close))}?" if close else f"it takes {sorted(known)}"
        raise TypeError(f"{where} got an unexpected keyword argument {name!r}; {hint}")
