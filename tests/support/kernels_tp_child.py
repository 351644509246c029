"""Child of tests/kernels/test_kernels.py: kernel matmuls on 2 forced CPU devices, sharded like the params.

Prints JSON ``{"devices": n, "cases": {name: [relative error, kernel call in compiled HLO]}}``.
"""

import json

import jax
import numpy as np
from jax.sharding import NamedSharding

from aotlm import kernels
from aotlm.core import sharding
from aotlm.models import packing

mesh = sharding.make_mesh(2)
rules = sharding.rules("shard-over-heads", 2)
rng = np.random.default_rng(0)
cases = {  # name: (leaf name, x shape, w shape, axes, nt, with scale)
    "column w_up": ("w_up", (3, 1, 40), (40, 58), 1, False, True),  # N = 58: 29 columns per device
    "row w_down": ("w_down", (5, 1, 58), (58, 40), 1, False, True),  # contracted dim sharded: psum
    "row wo (dense_in)": ("wo", (2, 1, 4, 9), (4, 9, 21), 2, False, False),
    "vocab embed_q (nt)": ("embed_q", (8, 33), (102, 33), 1, True, True),
}
out = {}
put = lambda a, leaf: sharding.put(a, sharding.param_sharding(mesh, (leaf,), a.ndim, rules))


def check(name, x, w, stored, s, axes, nt, target):
    """[relative error, ``target`` in the compiled HLO] of ``matmul`` with the ``stored`` weight
    (``w`` or its packed form) sharded like the params, against float64 NumPy on ``w``."""
    wd = put(stored, name)
    sd = put(s, name + "_scale") if s is not None else None
    xd = sharding.put(x, sharding.replicated(mesh))
    pk = packing.packed_k(name, stored.ndim)
    fn = jax.jit(lambda x, w, s: kernels.matmul(x, w, s, axes, name, nt, packed_k=pk))
    with kernels.mesh_context(mesh, sharding.spec_of(rules)):
        compiled = fn.lower(xd, wd, sd).compile()
    y = np.asarray(sharding.fetch(compiled(xd, wd, sd)), np.float64)
    k = int(np.prod(w.shape[1:] if nt else w.shape[:axes]))
    w64 = np.asarray(w, np.float64)
    w64 = w64.reshape(w.shape[0], k).T if nt else w64.reshape(k, -1)
    ref = np.asarray(x, np.float64).reshape(-1, k) @ w64
    if s is not None:
        ref = ref * s.reshape(-1)
    assert isinstance(wd.sharding, NamedSharding)
    return [float(np.abs(y.reshape(ref.shape) - ref).max() / np.abs(ref).max()), target in compiled.as_text()]


for case, (name, xs, ws, axes, nt, with_scale) in cases.items():
    x = rng.standard_normal(xs).astype(np.float32)
    w = (
        rng.integers(-127, 128, ws).astype(np.int8)
        if with_scale
        else rng.standard_normal(ws).astype("bfloat16")
    )
    n_out = ws[:1] if nt else ws[axes:]
    s = (rng.random(n_out).astype(np.float32) / 100) if with_scale else None
    out[case] = check(name, x, w, w, s, axes, nt, "aotlm_wmm")


# prefill's whole-matrix conversion of a column- and a row-sharded weight: each device its shard
def convert_check(name, w, stored, target):
    """[max |error|, ``target`` in the HLO] of ``convert`` (to f32, the logical layout) of ``stored``."""
    wd = put(stored, name)
    fn = jax.jit(lambda w: kernels.convert(w, np.float32, name, packed_k=packing.packed_k(name, stored.ndim)))
    with kernels.mesh_context(mesh, sharding.spec_of(rules)):
        compiled = fn.lower(wd).compile()
    got = np.asarray(sharding.fetch(compiled(wd)))
    return [float(np.abs(got - np.asarray(w, np.float32)).max()), target in compiled.as_text()]


for name, ws in (("w_up", (40, 58)), ("w_down", (58, 40))):
    w = rng.integers(-127, 128, ws).astype(np.int8)
    out[f"convert {name}"] = convert_check(name, w, w, "aotlm_convert")
# int8 weights in the panel layout (aotlm.models.packing): every device multiplies its packed shard
packed_cases = {  # name: (leaf, x shape, logical w shape, axes, nt)
    "packed column w_up": ("w_up", (1, 1, 40), (40, 64), 1, False),  # 2 panels per device
    "packed row w_down": ("w_down", (3, 1, 64), (64, 48), 1, False),  # 16 pairs of rows per device: psum
    "packed row wo": ("wo", (2, 1, 4, 10), (4, 10, 32), 2, False),
    "packed vocab embed_q": ("embed_q", (2, 34), (96, 34), 1, True),
    "packed bf16 column w_up": ("w_up", (1, 1, 40), (40, 64), 1, False),  # quant="bf16": no scale
}
for case, (name, xs, ws, axes, nt) in packed_cases.items():
    x = rng.standard_normal(xs).astype(np.float32)
    bf16 = "bf16" in case
    w = rng.standard_normal(ws).astype("bfloat16") if bf16 else rng.integers(-127, 128, ws).astype(np.int8)
    wp = packing.prepare(name, w, sharding.param_spec((name,), w.ndim, rules), 2)
    assert packing.is_packed(name, wp.ndim), case
    s = None if bf16 else rng.random(ws[:1] if nt else ws[axes:]).astype(np.float32) / 100
    out[case] = check(name, x, w, wp, s, axes, nt, "aotlm_wmm_pk")
    if not nt:  # prefill: each device unpacks its shard to the logical layout
        out[f"unpack {case}"] = convert_check(name, w, wp, "aotlm_unpack")
print(json.dumps({"devices": jax.device_count(), "cases": out}))
