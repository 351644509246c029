// Prefill handlers (included by wmatmul.cc inside its anonymous namespace, after scale_of and
// packed_type): the GEMMs (gemm.h) and the attention over a call's own tokens (attn.h), all run on
// XLA's intra-op threads (XlaThreads) instead of the kernels' pool.
#pragma once

// parallel_for on XLA's intra-op threads (the prefill GEMMs): parts are taken from a shared counter
// by the caller and by num_threads - 1 scheduled tasks; the caller returns once every part is done
// (a task that starts later finds none left and only drops its reference to the counters). Why not
// the kernels' own pool: between two GEMMs XLA runs the layer's elementwise fusions on its threads,
// and with a third thread (the pool's worker) on 2 cores those ran 2-4x slower (GPT-2-small's
// 128-token int8 prefill: 24 vs 11 ms outside the GEMMs, even with the worker asleep).
struct XlaThreads {
  ffi::ThreadPool* tp;
  void operator()(int n, const std::function<void(int)>& fn) const {
    struct State {
      std::atomic<int> next{0}, done{0};
    };
    auto st = std::make_shared<State>();
    const std::function<void(int)>* f = &fn;
    const auto work = [](State& s, int n, const std::function<void(int)>* f) {
      int i;
      while ((i = s.next.fetch_add(1)) < n) {
        (*f)(i);
        s.done.fetch_add(1, std::memory_order_release);
      }
    };
    const int64_t helpers = std::min<int64_t>(n, tp->num_threads()) - 1;
    for (int64_t h = 0; h < helpers; ++h) tp->Schedule([st, n, f, work] { work(*st, n, f); });
    work(*st, n, f);
    for (int spins = 0; st->done.load(std::memory_order_acquire) < n; ++spins) {
      if (spins < 256)
        _mm_pause();
      else
        std::this_thread::yield();
    }
  }
};

// Prefill GEMM, f32: y [M, N] = act(x [M, K] @ w [K, N] (+ bias)), all f32 (gemm.h).
ffi::Error gemm_f32(ffi::ThreadPool tp, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer bias,
                    ffi::Result<ffi::AnyBuffer> y, int32_t act) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2 || wd[0] != xd[1] || yd[0] != xd[0] || yd[1] != wd[1])
    return ffi::Error::InvalidArgument("aotlm_gemm: x [M, K], w [K, N] and y [M, N] must be 2-D");
  if (x.element_type() != DataType::F32 || w.element_type() != DataType::F32 || y->element_type() != DataType::F32)
    return ffi::Error::InvalidArgument("aotlm_gemm: x, w and y must be f32");
  const int64_t M = xd[0], K = xd[1], N = wd[1];
  const float* b = nullptr;
  if (!scale_of(bias, N, &b) || act < aotlm_gm::ACT_NONE || act > aotlm_gm::ACT_RELU)
    return ffi::Error::InvalidArgument("aotlm_gemm: bias must be f32 [N] or empty, act 0 / 1 / 2");
  const aotlm::Executor ex = XlaThreads{&tp};
  const aotlm::ScopedExecutor on(&ex);
  aotlm_gm::gemm(aotlm_gm::RowMajorW{static_cast<const float*>(w.untyped_data()), N},
                 static_cast<const float*>(x.untyped_data()), nullptr, b, act, M, K, N,
                 Out{y->untyped_data(), DataType::F32});
  return ffi::Error::Success();
}

// W8A8: int8 x [M, K] with row scales sx, int8 W panels -> out = act((x @ W) * sx[m] * scale[n] + b[n]).
ffi::Error w8a8(const int8_t* xi, const float* sx, const int8_t* w, const float* s, const float* b, int32_t act,
                int64_t M, int64_t K, int64_t N, const Out& out) {
#if defined(AOTLM_AMX)  // tdpbssd where the kernel may use tiles (amx8.h)
  if (M > aotlm_amx::MIN_ROWS && aotlm_amx::ready()) {
    aotlm_gm::i8_gemm_amx(xi, sx, w, s, b, act, M, K, N, out);
    return ffi::Error::Success();
  }
#endif
#if defined(__AVX512VNNI__)  // vpdpbusd on the int8 bytes as they are (gemm512.h)
  aotlm_gm::i8_gemm_vnni(xi, sx, w, s, b, act, M, K, N, out);
  return ffi::Error::Success();
#endif
  const int64_t Kp = (K + 16) / 16 * 16;
  std::vector<int16_t> xq(M * Kp, 0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xq[m * Kp + k] = xi[m * K + k];
  aotlm_gm::i8_gemm(xq.data(), Kp, sx, w, s, b, act, M, K, N, out);
  return ffi::Error::Success();
}

// Prefill GEMM, packed W: x f32 [M, K] with int8 / bf16 / f16 / f32 W (widened to f32 in L1, sx empty); bf16 x
// with bf16 W (quant="bf16a": vdpbf16ps where the level has AVX512-BF16, else x widened to f32); or int8 x
// with its per-row scale sx f32 [M] and int8 W (W8A8) -> y [M, N] f32 = act((x @ W) (* sx) * scale + bias).
// quant_x = 1: W8A8 on f32 x, rounded to int8 per row by the kernel (the graph's math, bit for bit; one
// device only). live: int8 [M], the rows to multiply (live.h; the others get act(bias)), or empty (all).
ffi::Error gemm_pk(ffi::ThreadPool tp, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scale, ffi::AnyBuffer sx,
                   ffi::AnyBuffer bias, ffi::AnyBuffer live, ffi::Result<ffi::AnyBuffer> y, int32_t act, int32_t quant_x) {
  int64_t M, K, N;
  if (const std::string e = packed_shapes(x, w, *y, &M, &K, &N); !e.empty())
    return ffi::Error::InvalidArgument("aotlm_gemm_pk: " + e);
  if (y->element_type() != DataType::F32) return ffi::Error::InvalidArgument("aotlm_gemm_pk: y must be f32");
  const float* s = nullptr;
  if (!scale_of(scale, N, &s)) return ffi::Error::InvalidArgument("aotlm_gemm_pk: scale must be f32 [N]");
  const float* b = nullptr;
  if (!scale_of(bias, N, &b)) return ffi::Error::InvalidArgument("aotlm_gemm_pk: bias must be f32 [N] or empty");
  if (act < aotlm_gm::ACT_NONE || act > aotlm_gm::ACT_RELU)
    return ffi::Error::InvalidArgument("aotlm_gemm_pk: act must be 0 (none), 1 (gelu tanh) or 2 (relu)");
  const int8_t* lv = nullptr;
  if (!aotlm_lr::live_of(live, M, &lv))
    return ffi::Error::InvalidArgument("aotlm_gemm_pk: live rows must be int8 [M] or empty");
  const Out out{y->untyped_data(), DataType::F32};
  const aotlm::Executor ex = XlaThreads{&tp};
  const aotlm::ScopedExecutor on(&ex);
  if (quant_x) {  // W8A8 on f32 x: rounded to int8 per row here, as the graph would (quantize_rows_s8)
    if (x.element_type() != DataType::F32 || w.element_type() != DataType::S8 || sx.element_count())
      return ffi::Error::InvalidArgument("aotlm_gemm_pk: quant_x takes f32 x, int8 w and no sx");
    const auto run = [&](const float* xr, int64_t Mr, const Out& o) {
      thread_local std::vector<int8_t> xq;  // kept between calls (not gemm.h's scratch: the GEMM packs into that)
      thread_local std::vector<float> rs;
      if (xq.size() < size_t(Mr * K)) xq.resize(size_t(Mr * K));
      if (rs.size() < size_t(Mr)) rs.resize(size_t(Mr));
      aotlm_gm::quantize_rows_s8(xr, Mr, K, xq.data(), rs.data());
      w8a8(xq.data(), rs.data(), static_cast<const int8_t*>(w.untyped_data()), s, b, act, Mr, K, N, o);
    };
    aotlm_lr::live_rows(static_cast<const float*>(x.untyped_data()), lv, M, K, N, b, act, out, run);
    return ffi::Error::Success();
  }
  if (x.element_type() == DataType::F32 || x.element_type() == DataType::BF16) {
    const float* xf = static_cast<const float*>(x.untyped_data());
    std::vector<float> wide;
    if (x.element_type() == DataType::BF16) {  // activations rounded to bf16 (quant="bf16a"): bf16 panels only
      if (w.element_type() != DataType::BF16)
        return ffi::Error::InvalidArgument("aotlm_gemm_pk: bf16 x needs bf16 w panels");
      const uint16_t* xb = static_cast<const uint16_t*>(x.untyped_data());
#if defined(__AVX512BF16__)  // vdpbf16ps on the bf16 pairs as they are (gemm512.h), tiles past 16 rows (amx16.h)
      aotlm_lr::live_rows(xb, lv, M, K, N, b, act, out, [&](const uint16_t* xr, int64_t Mr, const Out& o) {
        const uint16_t* wb = static_cast<const uint16_t*>(w.untyped_data());
#if defined(AOTLM_AMX)
        if (Mr > aotlm_amx::MIN_ROWS && aotlm_amx::ready()) return aotlm_gm::bf16_gemm_amx(xr, wb, s, b, act, Mr, K, N, o);
#endif
        aotlm_gm::bf16_gemm_dp(xr, wb, s, b, act, Mr, K, N, o);
      });
      return ffi::Error::Success();
#endif
      wide.resize(size_t(M * K));  // lower levels: x widened (exactly) to f32, the f32-x GEMM
      for (int64_t i = 0; i < M * K; ++i) wide[i] = bf16_to_f32(xb[i]);
      xf = wide.data();
    }
    aotlm_lr::live_rows(xf, lv, M, K, N, b, act, out, [&](const float* xr, int64_t Mr, const Out& o) {
#if defined(AOTLM_AMX)  // bf16 panels: x in three bf16 parts on tiles (amx16.h)
      if (w.element_type() == DataType::BF16 && Mr > aotlm_amx::MIN_ROWS && aotlm_amx::ready())
        return aotlm_gm::f32x_bf16_gemm_amx(xr, static_cast<const uint16_t*>(w.untyped_data()), s, b, act, Mr, K, N, o);
#endif
      aotlm_gm::gemm(aotlm_gm::PanelW{w.element_type(), w.untyped_data(), K / 2}, xr, s, b, act, Mr, K, N, o);
    });
    return ffi::Error::Success();
  }
  if (x.element_type() != DataType::S8 || w.element_type() != DataType::S8)
    return ffi::Error::InvalidArgument("aotlm_gemm_pk: x must be f32, bf16 (with bf16 w) or int8 (with int8 w and sx)");
  if (sx.element_type() != DataType::F32 || int64_t(sx.element_count()) != M)
    return ffi::Error::InvalidArgument("aotlm_gemm_pk: int8 x needs sx f32 [M]");
  return w8a8(static_cast<const int8_t*>(x.untyped_data()), static_cast<const float*>(sx.untyped_data()),
              static_cast<const int8_t*>(w.untyped_data()), s, b, act, M, K, N, out);
}


// Prefill attention (attn.h): q [B,T,H,Dh], k and v [B,T,Kh,Dh] f32 -- or the fused projection
// qkv [B,T,Kh,g+2,Dh] as q with k and v empty -- and mask [B,T,T] bool -> o [B,T,H,Dh], kc
// [B,Kh,T,Dh] and vt [B,Kh,Dh,T] (k and v in the cache's layouts).
ffi::Error attn(ffi::ThreadPool tp, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer mask,
                ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> kc, ffi::Result<ffi::AnyBuffer> vt,
                float scale) {
  auto qd = q.dimensions(), kd = k.dimensions(), md = mask.dimensions(), od = o->dimensions();
  const bool fused = k.element_count() == 0 && v.element_count() == 0;
  if (od.size() != 4 || md.size() != 3 || (fused ? qd.size() != 5 : qd.size() != 4 || kd.size() != 4))
    return ffi::Error::InvalidArgument("aotlm_attn: q [B,T,H,Dh] with k, v [B,T,Kh,Dh], or qkv [B,T,Kh,g+2,Dh]");
  const aotlm_at::Dims d{od[0], od[1], od[2], fused ? qd[2] : kd[2], od[3]};
  if (d.Kh < 1 || d.H % d.Kh || md[0] != d.B || md[1] != d.T || md[2] != d.T)
    return ffi::Error::InvalidArgument("aotlm_attn: H must be a multiple of Kh and mask [B, T, T]");
  const int64_t g = d.H / d.Kh;
  const bool fits = fused ? qd[0] == d.B && qd[1] == d.T && qd[3] == g + 2 && qd[4] == d.Dh
                          : qd[0] == d.B && qd[1] == d.T && qd[2] == d.H && qd[3] == d.Dh && kd[0] == d.B &&
                                kd[1] == d.T && kd[3] == d.Dh && v.dimensions() == kd;
  if (!fits) return ffi::Error::InvalidArgument("aotlm_attn: q, k, v and o shapes do not match");
  for (const auto* a : {&q, &k, &v})
    if (a->element_type() != DataType::F32) return ffi::Error::InvalidArgument("aotlm_attn: q, k, v must be f32");
  const int64_t kv_count = d.B * d.T * d.Kh * d.Dh;
  if (mask.element_type() != DataType::PRED || o->element_type() != DataType::F32)
    return ffi::Error::InvalidArgument("aotlm_attn: mask must be bool and o f32");
  for (auto* r : {&kc, &vt})
    if ((*r)->element_type() != DataType::F32 || int64_t((*r)->element_count()) != kv_count)
      return ffi::Error::InvalidArgument("aotlm_attn: kc and vt must be f32 [B, Kh, T, Dh] / [B, Kh, Dh, T]");
  const float* qp = static_cast<const float*>(q.untyped_data());
  aotlm_at::Src src{qp, static_cast<const float*>(k.untyped_data()), static_cast<const float*>(v.untyped_data()),
                    d.H * d.Dh, g * d.Dh, d.Kh * d.Dh, d.Dh};
  if (fused) {  // views into qkv: row stride Kh * (g + 2) * Dh, kv head stride (g + 2) * Dh
    const int64_t row = d.Kh * (g + 2) * d.Dh, head = (g + 2) * d.Dh;
    src = {qp, qp + g * d.Dh, qp + (g + 1) * d.Dh, row, head, row, head};
  }
  const aotlm::Executor ex = XlaThreads{&tp};
  const aotlm::ScopedExecutor on(&ex);
  aotlm_at::attend(src, static_cast<const uint8_t*>(mask.untyped_data()), d, scale,
                   static_cast<float*>(o->untyped_data()), static_cast<float*>(kc->untyped_data()),
                   static_cast<float*>(vt->untyped_data()));
  return ffi::Error::Success();
}
