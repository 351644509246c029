// Weight-only low-precision matmuls for XLA:CPU, called through JAX's FFI.
//
//   aotlm_wmm_nn:  y[M,N] = x[M,K] @ W[K,N]      (dense weights, row-major [in, out])
//   aotlm_wmm_nt:  y[M,N] = x[M,K] @ W[N,K]^T    (embedding rows: tied lm_head)
//   aotlm_wmm_pk:  y[M,N] = x[M,K] @ W[K,N]      (int8 / bf16 / f16 / f32 W in the panel layout, packed.h)
//   aotlm_wmm_q4:  y[M,N] = x[M,K] @ W[K,N]      (4-bit W in groups along K, int4.h; int8 W in groups, group8.h)
//
// W is bf16, f16, f32 or int8 (then times a per-output-channel f32 scale); x and y are f32,
// bf16 or f16 (y has x's dtype); products accumulate in f32. Why: XLA:CPU converts a whole
// low-precision matrix before a GEMV (1-2 GB/s), so decode with bf16/int8 weights was slower
// than f32. Here every weight byte is read once per call, converted in registers (AVX2 +
// FMA + F16C) and used for all M rows, with the work split over a thread pool (all cores by
// default). Float weights: wfloat.h; int8 weights take integer dot products instead (int8.h: x
// rounded to int16 per row). Also here: the decode attention dots (bdot.h), prefill's whole-matrix
// conversion (convert.h) and a read-bandwidth probe. Built on first use by aotlm.kernels
// (g++ -O3 -mavx2 -mfma -mf16c, plus -mavx512f/bw/vl/dq [-mavx512vnni] for the avx512 levels:
// aotlm.kernels.isa).
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__linux__)
#include <sys/syscall.h>  // arch_prctl: the AMX tile state (amx.h)
#include <unistd.h>
#endif

#include "int8.h"
#include "pool.h"
#include "wfloat.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using ffi::DataType;

namespace {

#include "amx.h"      // AMX tiles: the per-process permission, the tile configuration
#include "bdot.h"     // batched attention dots: uses the element types and hsum of wfloat.h
#include "convert.h"  // whole-matrix conversion for prefill
#include "epilogue.h"  // scale, bias and activation applied to the sums as they are written
#include "live.h"      // prefill rows of zeros (padding): written without their products
#include "packed.h"   // int8 / bf16 / f16 / f32 weights in the panel layout (decode matmuls, prefill unpacking)
#include "gemm.h"     // prefill GEMMs: f32 W, int8 panels (weight-only and W8A8)
#if defined(AOTLM_AMX)
#include "amx16i.h"  // int8 panels' prefill rows (int16 x) on AMX tiles: after gemm.h, for its regrouping
#endif
#include "peak.h"     // measured f32 FMA and int8 multiply-add peaks
#include "attn.h"     // prefill attention over the call's own tokens
#include "argmax.h"   // greedy decoding's argmax over the vocabulary
#include "lora.h"     // per-row LoRA updates (each row's adapter slot read in place)
#include "host.h"     // host-side array moves for the weight loader (ctypes)

// ------------------------------------------------------------------ driver
// x as f32 (converted once, shared read-only by the workers).
const float* x_f32(const ffi::AnyBuffer& x, int64_t n, std::vector<float>& tmp) {
  if (x.element_type() == DataType::F32) return static_cast<const float*>(x.untyped_data());
  tmp.resize(n);
  const uint16_t* p = static_cast<const uint16_t*>(x.untyped_data());
  if (x.element_type() == DataType::BF16)
    aotlm_cv::to_f32<BF16>(p, 0, n, tmp.data());
  else
    aotlm_cv::to_f32<F16>(p, 0, n, tmp.data());
  return tmp.data();
}

// One row of x times W[K,N]: the threads split K, each streaming its rows of W front to back
// (stream(k0, k1, part) adds rows [k0, k1) into its own N partial sums; a column split walks
// N-strided rows and reached ~60% of the bandwidth); the parts are added at the end. The
// length of a part is a multiple of ``align``.
template <class Stream>
std::vector<float> split_k(int64_t K, int64_t N, int64_t align, const Stream& stream) {
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(2 * aotlm::pool_size(), K / 64));
  const int64_t step = ((K + parts - 1) / parts + align - 1) / align * align;
  std::vector<float> part(parts * N, 0.f);
  aotlm::parallel_for(int(parts), [&](int c) {
    const int64_t k0 = c * step, k1 = std::min(K, k0 + step);
    if (k0 < k1) stream(k0, k1, part.data() + c * N);
  });
  for (int64_t c = 1; c < parts; ++c)
    for (int64_t n = 0; n < N; ++n) part[n] += part[c * N + n];
  part.resize(N);
  return part;
}

template <class W>
void run(bool nt, const float* x, const void* wraw, const float* scale, int64_t M, int64_t K, int64_t N,
         const Out& out) {
  const typename W::T* w = static_cast<const typename W::T*>(wraw);
  if (!nt && M == 1) {
    std::vector<float> y = split_k(K, N, 1, [&](int64_t k0, int64_t k1, float* part) {
      kn_row_stream<W>(x, w, N, k0, k1, part);
    });
    if (scale)
      for (int64_t n = 0; n < N; ++n) y[n] *= scale[n];
    out.put(0, y.data(), int(N));
    return;
  }
  // Column chunks: multiples of 32 columns (whole cache lines of W for nn), ~4 per thread.
  const int64_t threads = aotlm::pool_size();
  const int64_t align = nt ? 4 : 32;
  int64_t chunk = (N + 4 * threads - 1) / (4 * threads);
  chunk = std::max<int64_t>(align, (chunk + align - 1) / align * align);
  if (!nt) chunk = std::min<int64_t>(chunk, 1024);  // partial sums of a chunk stay in L2
  const int64_t n_chunks = (N + chunk - 1) / chunk;
  aotlm::parallel_for(int(n_chunks), [&](int c) {
    const int64_t n0 = c * chunk, n1 = std::min(N, n0 + chunk);
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
      const int mr = int(std::min<int64_t>(8, M - m0));
      if (nt)
        nt_block<W>(mr, x + m0 * K, w, scale, K, N, n0, n1, out, m0);
      else
        nn_block<W>(mr, x + m0 * K, w, scale, K, N, n0, n1, out, m0);
    }
  });
}

// int8 weights (int8.h): x rounded to int16 per row, integer dot products, then * sx * scale.
void run_i8(bool nt, const float* x, const int8_t* w, const float* scale, int64_t M, int64_t K, int64_t N,
            const Out& out) {
  const int64_t Kp = (K + 16) / 16 * 16;  // >= K + 1: the pair (k, k+1) at an odd K reads a zero
  std::vector<int16_t> xq(M * Kp);
  std::vector<float> sx(M);
  aotlm_i8::quantize_rows(x, M, K, Kp, xq.data(), sx.data());
  const int64_t threads = aotlm::pool_size();
  // buf [rows, ld]: unscaled sums for columns [n0, n0 + ld) of rows m0.. -> y, one put per row
  auto finish = [&](float* buf, int64_t m0, int64_t rows, int64_t ld, int64_t n0) {
    for (int64_t m = 0; m < rows; ++m) {
      float* r = buf + m * ld;
      for (int64_t j = 0; j < ld; ++j) r[j] *= sx[m0 + m] * (scale ? scale[n0 + j] : 1.f);
      out.put((m0 + m) * N + n0, r, int(ld));
    }
  };
  if (nt) {  // rows of W split over threads, ~4 chunks each
    const int64_t chunk = std::max<int64_t>(8, (N + 4 * threads - 1) / (4 * threads) / 8 * 8);
    aotlm::parallel_for(int((N + chunk - 1) / chunk), [&](int c) {
      const int64_t n0 = c * chunk, n1 = std::min(N, n0 + chunk), ld = n1 - n0;
      thread_local std::vector<float> buf;
      buf.resize(M * ld);
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int16_t* xm = xq.data() + m0 * Kp;
        auto emit = [&](int m, int64_t n, float v) { buf[(m0 + m) * ld + (n - n0)] = v; };
        switch (std::min<int64_t>(4, M - m0)) {  // MR * NR accumulators + MR x + 1 w <= 16
          case 1: aotlm_i8::nk_rows<1, 8>(xm, Kp, w, K, n0, n1, emit); break;
          case 2: aotlm_i8::nk_rows<2, 4>(xm, Kp, w, K, n0, n1, emit); break;
          case 3: aotlm_i8::nk_rows<3, 3>(xm, Kp, w, K, n0, n1, emit); break;
          default: aotlm_i8::nk_rows<4, 2>(xm, Kp, w, K, n0, n1, emit); break;
        }
      }
      finish(buf.data(), 0, M, ld, n0);
    });
    return;
  }
  if (M == 1) {  // parts of an even length: a part never splits a pair of rows
    std::vector<float> y = split_k(K, N, 2, [&](int64_t k0, int64_t k1, float* part) {
      thread_local std::vector<int32_t> acc;
      if (int64_t(acc.size()) < N) acc.resize(N);
      aotlm_i8::kn_row_stream(xq.data(), w, N, k0, k1, part, acc.data());
    });
    finish(y.data(), 0, 1, N, 0);
    return;
  }
  // several rows: column chunks (multiples of 64 columns, <= 1024 so the partial sums stay in L1/L2)
  int64_t chunk = (N + 4 * threads - 1) / (4 * threads);
  chunk = std::min<int64_t>(1024, std::max<int64_t>(64, (chunk + 63) / 64 * 64));
  aotlm::parallel_for(int((N + chunk - 1) / chunk), [&](int c) {
    const int64_t n0 = c * chunk, n1 = std::min(N, n0 + chunk), ld = n1 - n0;
    thread_local std::vector<float> buf;
    buf.assign(M * ld, 0.f);
    aotlm_i8::kn_rows(xq.data(), Kp, M, w, K, N, n0, n1, buf.data());
    finish(buf.data(), 0, M, ld, n0);
  });
}

// The optional per-output-channel scale: empty -> nullptr; else it must be f32 [N].
bool scale_of(const ffi::AnyBuffer& scale, int64_t N, const float** s) {
  if (scale.element_count() == 0) return true;
  if (scale.element_type() != DataType::F32 || int64_t(scale.element_count()) != N) return false;
  *s = static_cast<const float*>(scale.untyped_data());
  return true;
}

ffi::Error wmm(bool nt, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scale,
               ffi::Result<ffi::AnyBuffer> y) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2) return ffi::Error::InvalidArgument("aotlm_wmm: x and w must be 2-D");
  const int64_t M = xd[0], K = xd[1], N = nt ? wd[0] : wd[1];
  if ((nt ? wd[1] : wd[0]) != K) return ffi::Error::InvalidArgument("aotlm_wmm: contracting dims differ");
  if (y->element_type() != x.element_type()) return ffi::Error::InvalidArgument("aotlm_wmm: y dtype != x dtype");
  const DataType xt = x.element_type();
  if (xt != DataType::F32 && xt != DataType::BF16 && xt != DataType::F16)
    return ffi::Error::InvalidArgument("aotlm_wmm: x must be f32, bf16 or f16");
  const float* s = nullptr;
  if (!scale_of(scale, N, &s)) return ffi::Error::InvalidArgument("aotlm_wmm: scale must be f32 [N]");
  std::vector<float> tmp;
  const float* xf = x_f32(x, M * K, tmp);
  Out out{y->untyped_data(), xt};
  switch (w.element_type()) {
    case DataType::S8: run_i8(nt, xf, static_cast<const int8_t*>(w.untyped_data()), s, M, K, N, out); break;
    case DataType::BF16: run<BF16>(nt, xf, w.untyped_data(), s, M, K, N, out); break;
    case DataType::F16: run<F16>(nt, xf, w.untyped_data(), s, M, K, N, out); break;
    case DataType::F32: run<F32>(nt, xf, w.untyped_data(), s, M, K, N, out); break;
    default: return ffi::Error::InvalidArgument("aotlm_wmm: w must be int8, bf16, f16 or f32");
  }
  return ffi::Error::Success();
}

ffi::Error wmm_nn(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer s, ffi::Result<ffi::AnyBuffer> y) {
  return wmm(false, x, w, s, y);
}
ffi::Error wmm_nt(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer s, ffi::Result<ffi::AnyBuffer> y) {
  return wmm(true, x, w, s, y);
}

// The element type of a packed W, if the panel kernels read it (int8, bf16, f16 or f32).
bool packed_type(const ffi::AnyBuffer& w) {
  const DataType t = w.element_type();
  return t == DataType::S8 || t == DataType::BF16 || t == DataType::F16 || t == DataType::F32;
}

// Shapes of a product with packed W: x [M, K] and y [M, N] 2-D, w int8 / bf16 / f16 / f32 with K * N
// elements, K even, N % 16 == 0. Returns "" (and M, K, N) or what is wrong.
std::string packed_shapes(const ffi::AnyBuffer& x, const ffi::AnyBuffer& w, const ffi::AnyBuffer& y, int64_t* M,
                          int64_t* K, int64_t* N) {
  auto xd = x.dimensions(), yd = y.dimensions();
  if (xd.size() != 2 || yd.size() != 2 || xd[0] != yd[0]) return "x [M, K] and y [M, N] must be 2-D with equal M";
  *M = xd[0], *K = xd[1], *N = yd[1];
  if (!packed_type(w) || int64_t(w.element_count()) != *K * *N || *K % 2 || *N % aotlm_pk::P)
    return "w must be packed int8, bf16, f16 or f32, K * N elements, K even, N % 16 == 0";
  return "";
}

// Packed int8 / bf16 / f16 / f32 W (any shape, K * N elements): x [M, K] -> y [M, N] = act(x @ W (* scale)
// (+ bias)); bias f32 [N] or empty, act as for aotlm_gemm_pk (epilogue.h); a8 != 0 (int8 W): x rounded to
// int8 per row first (W8A8 decode rows, packed.h's run_s8).
ffi::Error wmm_pk(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scale, ffi::AnyBuffer bias,
                  ffi::AnyBuffer live, ffi::Result<ffi::AnyBuffer> y, int32_t act, int32_t a8) {
  int64_t M, K, N;
  if (const std::string e = packed_shapes(x, w, *y, &M, &K, &N); !e.empty())
    return ffi::Error::InvalidArgument("aotlm_wmm_pk: " + e);
  if (a8 && w.element_type() != DataType::S8)
    return ffi::Error::InvalidArgument("aotlm_wmm_pk: a8 (x rounded to int8) needs int8 W");
  const DataType xt = x.element_type();
  if (y->element_type() != xt || (xt != DataType::F32 && xt != DataType::BF16 && xt != DataType::F16))
    return ffi::Error::InvalidArgument("aotlm_wmm_pk: x and y must both be f32, bf16 or f16");
  const float* s = nullptr;
  if (!scale_of(scale, N, &s)) return ffi::Error::InvalidArgument("aotlm_wmm_pk: scale must be f32 [N]");
  const float* b = nullptr;
  if (!scale_of(bias, N, &b)) return ffi::Error::InvalidArgument("aotlm_wmm_pk: bias must be f32 [N] or empty");
  if (act < aotlm_ep::ACT_NONE || act > aotlm_ep::ACT_RELU)
    return ffi::Error::InvalidArgument("aotlm_wmm_pk: act must be 0 (none), 1 (gelu tanh) or 2 (relu)");
  const int8_t* lv = nullptr;  // prefill rows of a padded prompt: only the live ones multiplied (live.h)
  if (!aotlm_lr::live_of(live, M, &lv))
    return ffi::Error::InvalidArgument("aotlm_wmm_pk: live rows must be int8 [M] or empty");
  std::vector<float> tmp;
  aotlm_lr::live_rows(x_f32(x, M * K, tmp), lv, M, K, N, b, act, Out{y->untyped_data(), xt},
                      [&](const float* xr, int64_t Mr, const Out& o) {
                        aotlm_pk::run(w.element_type(), xr, w.untyped_data(), s, b, act, Mr, K, N, o, a8 != 0);
                      });
  return ffi::Error::Success();
}

// Packed int8 / bf16 / f16 / f32 W -> y [K, N] (f32, bf16 or f16); ``after``: unused (orders the call, see convert).
ffi::Error unpack(ffi::AnyBuffer w, ffi::AnyBuffer after, ffi::Result<ffi::AnyBuffer> y) {
  auto yd = y->dimensions();
  const DataType yt = y->element_type();
  if (yd.size() != 2 || (yt != DataType::F32 && yt != DataType::BF16 && yt != DataType::F16))
    return ffi::Error::InvalidArgument("aotlm_unpack: y must be 2-D f32, bf16 or f16");
  const int64_t K = yd[0], N = yd[1];
  if (!packed_type(w) || int64_t(w.element_count()) != K * N || K % 2 || N % aotlm_pk::P)
    return ffi::Error::InvalidArgument(
        "aotlm_unpack: w must be int8, bf16, f16 or f32, K * N elements, K even, N % 16 == 0");
  aotlm_pk::run_unpack(w.element_type(), w.untyped_data(), K, N, Out{y->untyped_data(), yt});
  return ffi::Error::Success();
}

ffi::Error convert(ffi::AnyBuffer w, ffi::AnyBuffer after, ffi::Result<ffi::AnyBuffer> y) {  // after: unused (ordering)
  const DataType yt = y->element_type();
  if (yt != DataType::F32 && yt != DataType::BF16 && yt != DataType::F16)
    return ffi::Error::InvalidArgument("aotlm_convert: y must be f32, bf16 or f16");
  if (y->element_count() != w.element_count()) return ffi::Error::InvalidArgument("aotlm_convert: sizes differ");
  if (!aotlm_cv::run(w.element_type(), w.untyped_data(), int64_t(w.element_count()), Out{y->untyped_data(), yt}))
    return ffi::Error::InvalidArgument("aotlm_convert: w must be int8, bf16, f16 or f32");
  return ffi::Error::Success();
}
#include "prefill.h"  // prefill handlers: the GEMMs and attention on XLA's threads
#include "tiles.h"    // the group-scaled row kernels' tiles and driver
#include "group8.h"   // int8 weights with group scales (GGUF Q8_0 kept as stored)
#include "int4.h"     // 4-bit group-quantized weights (decode and prefill rows)
#include "dattn.h"    // decode attention handlers: the dots (bdot.h) and the fused step (q.k, softmax, p.v)
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AotlmConvert, convert,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(AotlmUnpack, unpack,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(AotlmWmmPK, wmm_pk,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("act")
                                  .Attr<int32_t>("a8"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(AotlmWmmQ4, wmm_q4,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("group")
                                  .Attr<int32_t>("act")
                                  .Attr<int32_t>("parts"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(AotlmUnpackQ4, unpack_q4,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("group"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(AotlmWmmNN, wmm_nn,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(AotlmWmmNT, wmm_nt,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(AotlmGemm, gemm_f32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("act"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(AotlmGemmPk, gemm_pk,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("act")
                                  .Attr<int32_t>("quant_x"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(AotlmAttn, attn,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("scale"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(AotlmArgmax, argmax, ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    AotlmLora, lora, ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().RemainingArgs().RemainingRets());
XLA_FFI_DEFINE_HANDLER_SYMBOL(AotlmBdot, bdot,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(AotlmDattn, dattn,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("scale"));

// Whether this CPU runs every instruction this build may use (its ISA level, aotlm.kernels.isa).
extern "C" int aotlm_kernels_cpu_ok() {
  bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#if defined(__AVX512F__)
  ok = ok && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
       __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#endif
#if defined(__AVX512VNNI__)
  ok = ok && __builtin_cpu_supports("avx512vnni");
#endif
#if defined(__AVX512BF16__)
  ok = ok && __builtin_cpu_supports("avx512bf16");
#endif
#if defined(AOTLM_AMX)
  ok = ok && __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-int8") &&
       __builtin_cpu_supports("amx-bf16");
#endif
  return ok;
}
// The ISA level this binary was built for (its -m flags), checked against the one asked for at load.
extern "C" const char* aotlm_kernels_isa() {
#if defined(AOTLM_AMX)
  return "amx";
#elif defined(__AVX512BF16__)
  return "avx512bf16";
#elif defined(__AVX512VNNI__)
  return "avx512vnni";
#elif defined(__AVX512F__)
  return "avx512";
#else
  return "avx2";
#endif
}
extern "C" int aotlm_kernels_threads() { return aotlm::pool_size(); }
// 1 where this build has AMX code (the amx level) and Linux granted the process the tile state (amx.h).
extern "C" int aotlm_amx_tiles() {
#if defined(AOTLM_AMX)
  return int(aotlm_amx::ready());
#else
  return 0;
#endif
}
// f32 FMA, int8 and bf16 multiply-add peaks (G(FL)OP/s) of the pool's threads, best of ``runs`` (peak.h).
extern "C" double aotlm_fma_peak(int runs) { return aotlm_peak::fma_peak(runs); }
extern "C" double aotlm_int8_peak(int runs) { return aotlm_peak::int8_peak(runs); }
extern "C" double aotlm_bf16_peak(int runs) { return aotlm_peak::bf16_peak(runs); }

// Streaming read bandwidth in GB/s (median of ``runs``) over ``mib`` MiB (peak.h): scripts/bench.py's roofline.
extern "C" double aotlm_read_gbps(int64_t mib, int runs) { return aotlm_peak::read_gbps(mib, runs); }
