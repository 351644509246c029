"""The projections of a layer: q / k / v, the attention output and the MLP, each with the rows'
LoRA updates (``adapters.lora``) where the layer holds adapter tables."""

from __future__ import annotations

from aotlm.models import adapters
from aotlm.models.layers import activation, add_bias, dense, dense_in


def project_qkv(x, p: dict):
    """q ``[B,T,H,Dh]``, k, v ``[B,T,K,Dh]`` from ``x [B,T,D]``: three matmuls, or one with ``wqkv``.

    The fused ``wqkv [D, K, G+2, Dh]`` holds per kv head its ``G`` query heads then its k and v
    (``aotlm.models.quant.fuse_qkv_heads``); the local ``K`` / ``G`` come from the (possibly sharded or
    regrouped) weight's shape.
    """
    if "wqkv" not in p:
        qkv = tuple(proj(x, p, w, b) for w, b in (("wq", "bq"), ("wk", "bk"), ("wv", "bv")))
        return adapters.lora_many(qkv, x, p, ("wq", "wk", "wv"))
    qkv = proj(x, p, "wqkv", "bqkv")  # [B,T,K,G+2,Dh]
    g = qkv.shape[-2] - 2
    q, k, v = qkv[..., :g, :].reshape(*qkv.shape[:-3], -1, qkv.shape[-1]), qkv[..., g, :], qkv[..., g + 1, :]
    out = add_bias(q, p.get("bq")), add_bias(k, p.get("bk")), add_bias(v, p.get("bv"))
    return adapters.lora_many(out, x, p, ("wq", "wk", "wv"))


def fused_qkv(x, p: dict):
    """The fused projection ``[B,T,K,G+2,Dh]`` itself (``project_qkv`` slices it), or None when the
    layer has no ``wqkv``, separate q / k / v biases or adapter tables."""
    if "wqkv" not in p or any(b in p for b in ("bq", "bk", "bv")) or adapters.has_tables(p):
        return None
    return proj(x, p, "wqkv", "bqkv")


def proj(x, p: dict, w: str, b: str, act: str | None = None):
    """``dense`` with layer ``p``'s weight ``w``, its bias ``b`` and scale, if any."""
    return dense(x, p[w], p.get(b), p.get(w + "_scale"), name=w, act=act)


def mlp(x, p: dict, act: str, gated: bool):
    """``down(act(gate(x)) * up(x))`` when gated (SwiGLU), else ``down(act(up(x)))``.

    With ``w_gu [D, 2, F]`` (``fuse_qkv``) gate and up are one matmul.
    """
    lora = adapters.lora
    down = lambda h: lora(proj(h, p, "w_down", "b_down"), h, p, "w_down")  # noqa: E731
    if "w_gu" in p:
        gu = proj(x, p, "w_gu", "b_gu")  # [B,T,2,F]
        gate, up = add_bias(gu[..., 0, :], p.get("b_gate")), add_bias(gu[..., 1, :], p.get("b_up"))
    elif not gated:  # the activation may run in the GEMM's output pass, unless an adapter adds to it
        if not adapters.has_tables(p):
            return down(proj(x, p, "w_up", "b_up", act))
        return down(activation(act, lora(proj(x, p, "w_up", "b_up"), x, p, "w_up")))
    else:
        up, gate = proj(x, p, "w_up", "b_up"), proj(x, p, "w_gate", "b_gate")
    gate, up = adapters.lora_many((gate, up), x, p, ("w_gate", "w_up"))
    return down(activation(act, gate) * up)


def out_proj(p: dict, o):
    """The attention output projection of ``o [B,T,H,Dh]``."""
    return adapters.lora(dense_in(o, p["wo"], p.get("bo"), p.get("wo_scale"), name="wo"), o, p, "wo")
