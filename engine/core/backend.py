"""What aotlm does differently per backend: XLA compile options and the decode loop's shape.

**Compile options** are baked into every executable aotlm compiles for a backend: passed to
``Lowered.compile(compiler_options)`` for each graph (never set process-wide in ``XLA_FLAGS``, so a
user's other JAX code is left as it was), and part of the compile-cache key
(``compile_cache.environment_fields``). ``AOTLM_XLA_OPTIONS`` (a JSON object of XLA debug-option names
to values) is merged over the defaults, for experiments: ``{"name": null}`` drops a default.

**The decode loop's group** (``graphs.decode``): how often the on-device loop checks for its end.
``AOTLM_DECODE_GROUP`` overrides the backend's default.
"""

from __future__ import annotations

import json
import os

ENV = "AOTLM_XLA_OPTIONS"
GROUP_ENV = "AOTLM_DECODE_GROUP"

# platform (jax's ``Device.platform``) -> XLA debug options
DEFAULTS: dict[str, dict[str, str | bool | int]] = {
    "cpu": {},
    "gpu": {},
}


# platform -> ``graphs.decode``'s ``group``: how the decode loop checks for its end (see there). XLA:CPU
# runs loops and branches on the host anyway (0: check every step); XLA:GPU copies each loop condition
# and branch predicate to the host and waits for the device, so steps run in groups there.
DECODE_GROUP = {"cpu": 0, "gpu": 8}


def platform_name(platform: str) -> str:
    """jax's platform names for one kind of backend: ``cuda`` / ``rocm`` are ``gpu``."""
    return "gpu" if platform in ("cuda", "rocm", "gpu") else platform


def compiler_options(platform: str) -> dict[str, str | bool | int]:
    """The options every graph for ``platform`` is compiled with (defaults, then ``AOTLM_XLA_OPTIONS``)."""
    opts = dict(DEFAULTS.get(platform_name(platform), {}))
    raw = os.environ.get(ENV, "").strip()
    if raw:
        try:
            extra = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(
                f'{ENV} is not JSON ({e}); give an object such as \'{{"xla_...": "..."}}\''
            ) from e
        if not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra):
            raise ValueError(f"{ENV} must be a JSON object of XLA option names to values, got {raw!r}")
        for k, v in extra.items():
            if v is None:
                opts.pop(k, None)
            else:
                opts[k] = v
    return opts


def decode_group(platform: str) -> int:
    """``graphs.decode``'s ``group`` for ``platform`` (``AOTLM_DECODE_GROUP`` overrides it)."""
    raw = os.environ.get(GROUP_ENV, "").strip()
    if raw:
        if not raw.isdigit():
            raise ValueError(f"{GROUP_ENV}={raw!r} must be an integer >= 0 (0: check every step)")
        return int(raw)
    return DECODE_GROUP.get(platform_name(platform), 0)
