// specjax CPU kernel: grouped-query attention of a few new tokens over a KV cache (decoding and
// k-token verification), reading each cached key and value once for all queries of its head.
//
// Operands (float32): q [B, T, N, H] (positions already rotated), k_new and v_new [B, T, K, H]
// (this call's entries), k_cache [B, K, S, H], v_cache [B, K, H, S] (specjax.models.kv_cache's
// layouts), lengths [B] (int32: committed slots of each row). Result [B, T, N * H].
//
// Visibility (the model's causal rule, `specjax.models.llama.attention` without a tree): query t of
// row b sees cache slots s < lengths[b] and the call's own tokens t' <= t; query head n reads
// key/value head n / (N / K). Slots past a row's length are never read, so whatever they hold
// (stale or rejected entries) cannot reach a result.
//
// Numerics. Per query: scores q.k / sqrt(H) in float32 (each a fixed-order sum), m = their
// maximum, weights exp(score - m), out = (sum of weight x value) / (sum of weights), the sums
// in a fixed order over the visible positions (the cache's slots, then the new tokens). A
// query's result depends only on its row and on the positions it sees: not on the other rows
// or on the later tokens of its block. A NaN score makes the query's result NaN (as the
// reference's softmax does).
//
// Threads: (row, key/value head) pairs are shared out between the calling thread and XLA's own
// intra-op pool (shared_work.h).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define SPECJAX_X86 1
#endif

#include "xla/ffi/api/ffi.h"
#include "shared_work.h"

namespace ffi = xla::ffi;

namespace {

struct Attn {
  const float *q, *k_new, *v_new, *k_cache, *v_cache;
  const int32_t* lengths;
  float* out;
  int64_t B, T, N, K, H, S;
};

// Horizontal sum of 16 lanes in a fixed order (pairs, then pairs of pairs ...).
inline float Sum16(const float* a) {
  float b[8], c[4];
  for (int i = 0; i < 8; ++i) b[i] = a[i] + a[i + 8];
  for (int i = 0; i < 4; ++i) c[i] = b[i] + b[i + 4];
  return (c[0] + c[2]) + (c[1] + c[3]);
}

// dot(x, y) over n floats: 16 lane-wise fma chains, then a fixed-order sum of the lanes.
inline float DotScalar(const float* x, const float* y, int64_t n) {
  float acc[16] = {0.0f};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] = std::fma(x[i + j], y[i + j], acc[j]);
  for (int j = 0; i + j < n; ++j) acc[j] = std::fma(x[i + j], y[i + j], acc[j]);
  return Sum16(acc);
}

#ifdef SPECJAX_X86
__attribute__((target("avx512f"))) inline float Dot512(const float* x, const float* y, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i), acc);
  if (i < n) {
    const __mmask16 m = __mmask16((1u << (n - i)) - 1u);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// exp(x) for x <= 0 (scores minus their maximum): 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2,
// p the Taylor polynomial of degree 7 (relative error < 3e-9 before rounding); below -87.3
// (where expf underflows) the result is 0.
__attribute__((target("avx512f"))) inline __m512 Exp512(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3f);
  const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(~under, _mm512_scalef_ps(p, n));
}

// w[i] = exp(w[i] - m) for i < n; returns the sum of the new w[i] (16 lane sums, then Sum16).
__attribute__((target("avx512f"))) inline float ExpShift512(float* w, int64_t n, float m) {
  const __m512 mv = _mm512_set1_ps(m);
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 e = Exp512(_mm512_sub_ps(_mm512_loadu_ps(w + i), mv));
    _mm512_storeu_ps(w + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  if (i < n) {
    const __mmask16 k = __mmask16((1u << (n - i)) - 1u);
    const __m512 e = _mm512_maskz_mov_ps(k, Exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, w + i), mv)));
    _mm512_mask_storeu_ps(w + i, k, e);
    acc = _mm512_add_ps(acc, e);
  }
  return _mm512_reduce_add_ps(acc);
}
#endif

float ExpShiftScalar(float* w, int64_t n, float m) {
  float acc[16] = {0.0f};
  for (int64_t i = 0; i < n; ++i) {
    w[i] = std::exp(w[i] - m);
    acc[i % 16] += w[i];
  }
  return Sum16(acc);
}

enum Isa : int { kScalar = 0, kAvx512 = 2 };

int DetectIsa() {
#ifdef SPECJAX_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return kAvx512;
#endif
  return kScalar;
}

int ActiveIsa() {
  static const int isa = DetectIsa();
  return isa;
}

// All queries (t, g) of row b and key/value head kv.
void Pair(const Attn& a, int64_t b, int64_t kv, int isa, std::vector<float>& w) {
  const int64_t G = a.N / a.K, H = a.H, S = a.S, T = a.T;
  const int64_t len = std::min<int64_t>(std::max<int32_t>(a.lengths[b], 0), S);
  const float scale = 1.0f / std::sqrt(static_cast<float>(H));
  const float* kc = a.k_cache + (b * a.K + kv) * S * H;        // [S, H]
  const float* vc = a.v_cache + (b * a.K + kv) * H * S;        // [H, S]
  const int64_t Q = T * G, W = len + T;                        // queries; positions a query can see
  w.assign(Q * W, 0.0f);
  auto dot = [&](const float* x, const float* y, int64_t n) {
#ifdef SPECJAX_X86
    if (isa == kAvx512) return Dot512(x, y, n);
#endif
    return DotScalar(x, y, n);
  };
  auto qrow = [&](int64_t t, int64_t g) { return a.q + ((b * T + t) * a.N + kv * G + g) * H; };
  // scores: each cached key row is read once for every query
  for (int64_t s = 0; s < len; ++s) {
    const float* kr = kc + s * H;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t g = 0; g < G; ++g) w[(t * G + g) * W + s] = dot(qrow(t, g), kr, H) * scale;
  }
  for (int64_t u = 0; u < T; ++u) {
    const float* kr = a.k_new + ((b * T + u) * a.K + kv) * H;
    for (int64_t t = u; t < T; ++t)
      for (int64_t g = 0; g < G; ++g) w[(t * G + g) * W + len + u] = dot(qrow(t, g), kr, H) * scale;
  }
  // weights, per query over its visible positions [0, len + t]
  std::vector<float> inv(Q);
  std::vector<char> bad(Q, 0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t g = 0; g < G; ++g) {
      float* wq = w.data() + (t * G + g) * W;
      const int64_t n = len + t + 1;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t i = 0; i < n; ++i) {
        if (std::isnan(wq[i])) bad[t * G + g] = 1;
        m = std::max(m, wq[i]);
      }
      float sum;
#ifdef SPECJAX_X86
      if (isa == kAvx512) sum = ExpShift512(wq, n, m);
      else
#endif
        sum = ExpShiftScalar(wq, n, m);
      for (int64_t i = n; i < W; ++i) wq[i] = 0.0f;
      inv[t * G + g] = 1.0f / sum;
    }
  }
  // values: each cached value row [S] (one dimension h over the slots) is read once for every query
  for (int64_t h = 0; h < H; ++h) {
    const float* vr = vc + h * S;
    for (int64_t q = 0; q < Q; ++q) {
      const int64_t t = q / G, g = q % G;
      const float* wq = w.data() + q * W;
      float acc = dot(wq, vr, len);
      for (int64_t u = 0; u <= t; ++u) acc = std::fma(wq[len + u], a.v_new[((b * T + u) * a.K + kv) * H + h], acc);
      a.out[((b * T + t) * a.N + kv * G + g) * H + h] =
          bad[q] ? std::numeric_limits<float>::quiet_NaN() : acc * inv[q];
    }
  }
}

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_new,
                           ffi::Buffer<ffi::F32> v_new, ffi::Buffer<ffi::F32> k_cache,
                           ffi::Buffer<ffi::F32> v_cache, ffi::Buffer<ffi::S32> lengths,
                           ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = k_new.dimensions(), cd = k_cache.dimensions(), vd = v_cache.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || cd.size() != 4 || vd.size() != 4) {
    return ffi::Error::InvalidArgument("specjax_decode_attention: expected 4-d q, k_new, k_cache and v_cache");
  }
  Attn a;
  a.B = qd[0]; a.T = qd[1]; a.N = qd[2]; a.H = qd[3]; a.K = kd[2]; a.S = cd[2];
  if (kd[0] != a.B || kd[1] != a.T || kd[3] != a.H || a.K < 1 || a.N % a.K != 0 || cd[0] != a.B ||
      cd[1] != a.K || cd[3] != a.H || vd[0] != a.B || vd[1] != a.K || vd[2] != a.H || vd[3] != a.S ||
      v_new.dimensions().size() != 4 || lengths.dimensions().size() != 1 || lengths.dimensions()[0] != a.B) {
    return ffi::Error::InvalidArgument(
        "specjax_decode_attention: shapes do not fit q [B, T, N, H], k_new/v_new [B, T, K, H], "
        "k_cache [B, K, S, H], v_cache [B, K, H, S], lengths [B]");
  }
  a.q = q.typed_data(); a.k_new = k_new.typed_data(); a.v_new = v_new.typed_data();
  a.k_cache = k_cache.typed_data(); a.v_cache = v_cache.typed_data(); a.lengths = lengths.typed_data();
  a.out = out->typed_data();
  if (a.B == 0 || a.T == 0) return ffi::Error::Success();
  const int isa = ActiveIsa();
  specjax_kernels::ShareOut(pool, a.B * a.K, [a, isa](int64_t i) {
    thread_local std::vector<float> scratch;
    Pair(a, i / a.K, i % a.K, isa, scratch);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// 2: AVX-512 body, 0: portable body (correct, not fast).
extern "C" int SpecjaxAttentionIsa() { return ActiveIsa(); }
