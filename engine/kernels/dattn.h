// Decode attention handlers (included by wmatmul.cc inside its namespace, after bdot.h and attn.h).
//
//   aotlm_bdot:  the dots alone (bdot.h); XLA masks, takes the softmax and adds the segments.
//   aotlm_dattn: one query token per row, the whole step in one call:
//     o[i, g, :] = (sum_{j < n_i, mask[b, j]} e[g, j] v[i, :, j] + e[g, own] v_new[i, :]) / sum_j e[g, j]
//     e[g, j] = exp(scale q[i, g] . k[i, j] - max), over the visible cache slots and the row's own token
//   q [I, G, Dh] f32 (I = B * Kh: row b = i / Kh, kv head i % Kh; G query heads per kv head), keys
//   [IB >= I, S, Dh] and values [IB, Dh, S] (the cache: f32, bf16 bits or f16; only the first I blocks
//   and slots j < n_i = min(lim[i], W) are read), k_new, v_new [I, Dh] f32 (the call's own key, value),
//   mask [B, W + 1] (bool: cache slots 0..W-1 visible, then the own token visible), lim [I] int32.
//   A row that sees nothing (a finished serving row) gets zeros.
//
// Why: a decode step's attention was four kernel calls per layer (the cache's and the own token's
// scores, then their values) around XLA's mask, concatenation, softmax and slicing on [B, H, W]
// scores: ~10 small ops per layer, each a pass over the scores in memory. Here the scores of one
// (row, kv head) stay in a thread's buffer, L1 / L2 sized, between the two products.
#pragma once

ffi::Error bdot(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer lim, ffi::Result<ffi::AnyBuffer> c) {
  auto ad = a.dimensions(), bd = b.dimensions(), cd = c->dimensions();
  if (ad.size() != 3 || bd.size() != 3 || cd.size() != 3)
    return ffi::Error::InvalidArgument("aotlm_bdot: a, b and c must be 3-D");
  const int64_t I = ad[0], M = ad[1], L = ad[2], NB = bd[1], LB = bd[2], N = cd[2];
  if (bd[0] < I || cd[0] != I || cd[1] != M || N > NB || L > LB)
    return ffi::Error::InvalidArgument("aotlm_bdot: shapes do not match");
  if (c->element_type() != DataType::F32) return ffi::Error::InvalidArgument("aotlm_bdot: c must be f32");
  if (lim.element_type() != DataType::S32 || (lim.element_count() != 2 && lim.element_count() != 2 * I))
    return ffi::Error::InvalidArgument("aotlm_bdot: lim must be int32 [2] or [I, 2]");
  const int32_t* lp = static_cast<const int32_t*>(lim.untyped_data());
  const int64_t ls = lim.element_count() == 2 ? 0 : 2;  // one pair for all rows, or one per row
  const DataType at = a.element_type();
  if (at != DataType::F32 && at != DataType::BF16 && at != DataType::F16)
    return ffi::Error::InvalidArgument("aotlm_bdot: a must be f32, bf16 or f16");
  std::vector<float> tmp;
  const float* af = x_f32(a, I * M * L, tmp);
  float* cf = static_cast<float*>(c->untyped_data());
  switch (b.element_type()) {
    case DataType::F32: aotlm_bd::run<F32>(af, b.untyped_data(), cf, I, M, L, NB, LB, N, lp, ls); break;
    case DataType::BF16:
    case DataType::U16:  // a bf16 KV cache stored as its bits (XLA:CPU upcasts bf16 cache writes, layers.py)
      aotlm_bd::run<BF16>(af, b.untyped_data(), cf, I, M, L, NB, LB, N, lp, ls);
      break;
    case DataType::F16: aotlm_bd::run<F16>(af, b.untyped_data(), cf, I, M, L, NB, LB, N, lp, ls); break;
    default: return ffi::Error::InvalidArgument("aotlm_bdot: b must be f32, bf16 (or its bits as u16) or f16");
  }
  return ffi::Error::Success();
}

namespace aotlm_da {
#include "dattn512.h"  // the avx512 builds' loops: each cache element widened once for the G queries

template <class W>
void run(const float* q, const void* kraw, const void* vraw, const float* k_new, const float* v_new, const bool* mask,
         const int32_t* lim, float* o, int64_t I, int64_t G, int64_t Dh, int64_t S, int64_t Wd, int64_t Kh,
         float scale) {
  using T = typename W::T;
  const T* kc = static_cast<const T*>(kraw);
  const T* vc = static_cast<const T*>(vraw);
  aotlm::parallel_for(int(I), [&](int job) {
    const int64_t i = job, b = i / Kh, n = std::max<int64_t>(0, std::min<int64_t>(lim[i], Wd)), ld = n + 1;
    thread_local std::vector<float> s, inv;
    thread_local std::vector<uint8_t> vis;
    s.resize(size_t(G * ld));
    inv.resize(size_t(G));
    vis.resize(size_t(ld));
    const float* qi = q + i * G * Dh;
    const T* vi = vc + i * Dh * S;  // its slots into L2 now, read from there after the keys: a 16-row
    for (int64_t d = 0; d < Dh; ++d)  // SmolLM2 step's attention 263 -> 220 us per layer (harness)
      for (int64_t j = 0; j < n; j += 64 / int64_t(sizeof(T)))
        _mm_prefetch(reinterpret_cast<const char*>(vi + d * S + j), _MM_HINT_T1);
    if (!qk_g<W>(qi, G, kc + i * S * Dh, Dh, n, s.data(), ld))  // cache slots: dattn512.h's loops or the dots
      aotlm_bd::dots<W>(qi, G, Dh, Dh, kc + i * S * Dh, Dh, 0, n, s.data(), ld);
    aotlm_bd::dots<F32>(qi, G, Dh, Dh, k_new + i * Dh, Dh, 0, 1, s.data() + n, ld);  // the own token
    std::memcpy(vis.data(), mask + b * (Wd + 1), size_t(n));
    vis[n] = mask[b * (Wd + 1) + Wd];
    for (int64_t g = 0; g < G; ++g) inv[g] = aotlm_at::softmax_row(s.data() + g * ld, vis.data(), ld, ld, scale);
    float* oi = o + i * G * Dh;
    if (!pv_g<W>(s.data(), G, ld, vi, S, Dh, n, oi)) aotlm_bd::dots<W>(s.data(), G, ld, n, vi, S, 0, Dh, oi, Dh);
    const float* vn = v_new + i * Dh;
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < Dh; ++d) oi[g * Dh + d] = (oi[g * Dh + d] + s[g * ld + n] * vn[d]) * inv[g];
  });
}

}  // namespace aotlm_da

ffi::Error dattn(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer k_new, ffi::AnyBuffer v_new,
                 ffi::AnyBuffer mask, ffi::AnyBuffer lim, ffi::Result<ffi::AnyBuffer> o, float scale) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), nd = k_new.dimensions();
  auto md = mask.dimensions();
  if (qd.size() != 3 || kd.size() != 3 || vd.size() != 3 || nd.size() != 2 || md.size() != 2)
    return ffi::Error::InvalidArgument("aotlm_dattn: q, k, v must be 3-D, k_new, v_new and mask 2-D");
  const int64_t I = qd[0], G = qd[1], Dh = qd[2], S = kd[1], B = md[0], Wd = md[1] - 1;
  const bool ok = kd[0] >= I && kd[2] == Dh && vd[0] == kd[0] && vd[1] == Dh && vd[2] == S && nd[0] == I &&
                  nd[1] == Dh && v_new.element_count() == size_t(I * Dh) && B > 0 && I % B == 0 && Wd >= 0 && Wd <= S &&
                  lim.element_count() == size_t(I) && o->element_count() == size_t(I * G * Dh);
  if (!ok) return ffi::Error::InvalidArgument("aotlm_dattn: shapes do not match");
  if (q.element_type() != DataType::F32 || k_new.element_type() != DataType::F32 ||
      v_new.element_type() != DataType::F32 ||
      o->element_type() != DataType::F32 || mask.element_type() != DataType::PRED ||
      lim.element_type() != DataType::S32 || k.element_type() != v.element_type())
    return ffi::Error::InvalidArgument("aotlm_dattn: q, k_new, v_new, o f32; mask bool; lim int32; k, v one dtype");
  const auto* qp = static_cast<const float*>(q.untyped_data());
  const auto* kn = static_cast<const float*>(k_new.untyped_data());
  const auto* vn = static_cast<const float*>(v_new.untyped_data());
  const auto* mp = static_cast<const bool*>(mask.untyped_data());
  const auto* lp = static_cast<const int32_t*>(lim.untyped_data());
  auto* op = static_cast<float*>(o->untyped_data());
  const int64_t Kh = I / B;
  switch (k.element_type()) {
    case DataType::F32:
      aotlm_da::run<F32>(qp, k.untyped_data(), v.untyped_data(), kn, vn, mp, lp, op, I, G, Dh, S, Wd, Kh, scale);
      break;
    case DataType::BF16:
    case DataType::U16:
      aotlm_da::run<BF16>(qp, k.untyped_data(), v.untyped_data(), kn, vn, mp, lp, op, I, G, Dh, S, Wd, Kh, scale);
      break;
    case DataType::F16:
      aotlm_da::run<F16>(qp, k.untyped_data(), v.untyped_data(), kn, vn, mp, lp, op, I, G, Dh, S, Wd, Kh, scale);
      break;
    default: return ffi::Error::InvalidArgument("aotlm_dattn: k, v must be f32, bf16 (or its bits as u16) or f16");
  }
  return ffi::Error::Success();
}
