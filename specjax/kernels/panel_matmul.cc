// specjax CPU kernel: y[..., N] = x[..., D] @ W[D, N], with W stored as 32-column panels.
//
// Layout. W is packed once at load time (specjax/kernels/__init__.py, `pack`) into panels
// P[j, d, c] = W[d, 32 j + c] of shape [ceil(N / 32), D, 32] (the last panel zero-padded), so
// each panel is one contiguous stream of D * 32 floats. A decode step (1 row) or a verification
// block (a few rows) then reads every weight exactly once, from one sequential stream per panel,
// and uses each loaded weight vector for every row: the cost of k <= 8 rows stays close to the
// cost of one row while the product is memory-bound (the case llama.cpp's CPU matmuls are
// written for). XLA:CPU instead switches from a one-thread matrix-vector kernel at one row to a
// matrix-multiply library from two rows on (experiments/bench_speed/PROFILE.md).
//
// Numerics. Output element (m, n) is the chain acc = fma(x[m, d], W[d, n], acc) for d = 0..D-1
// from acc = 0, whatever the instruction set, the number of rows in the call or the thread
// split: a row's result is bitwise independent of the other rows of the call, so a k-token
// verification block scores each position exactly as a one-token step would (up to the
// attention part, which XLA computes).
//
// Threads. Panels are split into chunks shared out between the calling thread and XLA's own
// intra-op thread pool (shared_work.h).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define SPECJAX_X86 1
#endif

#include "xla/ffi/api/ffi.h"
#include "shared_work.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 32;

struct Problem {
  const float* x;   // [m, d]
  const float* w;   // [panels, d, 32]
  float* y;         // [m, n]
  int64_t m, d, n, panels;
};

inline int64_t PanelCols(const Problem& p, int64_t j) {
  return std::min<int64_t>(kPanel, p.n - j * kPanel);
}

// Portable body: `rows` rows of panel j (any instruction set; the same fma chain).
void RowsScalar(const Problem& p, int64_t j, int64_t m0, int64_t rows) {
  const float* wp = p.w + j * p.d * kPanel;
  const int64_t cols = PanelCols(p, j);
  for (int64_t r = 0; r < rows; ++r) {
    float acc[kPanel] = {0.0f};
    const float* xr = p.x + (m0 + r) * p.d;
    for (int64_t k = 0; k < p.d; ++k) {
      const float xv = xr[k];
      const float* wk = wp + k * kPanel;
      for (int64_t c = 0; c < kPanel; ++c) acc[c] = std::fma(xv, wk[c], acc[c]);
    }
    float* yr = p.y + (m0 + r) * p.n + j * kPanel;
    for (int64_t c = 0; c < cols; ++c) yr[c] = acc[c];
  }
}

#ifdef SPECJAX_X86
// AVX-512: R rows x 32 columns = 2R accumulators; each panel row (two vectors) is loaded once
// and used by all R rows.
template <int R>
__attribute__((target("avx512f"))) void RowsAvx512(const Problem& p, int64_t j, int64_t m0) {
  const float* wp = p.w + j * p.d * kPanel;
  const float* xr[R];
  __m512 a0[R], a1[R];
  for (int r = 0; r < R; ++r) {
    xr[r] = p.x + (m0 + r) * p.d;
    a0[r] = _mm512_setzero_ps();
    a1[r] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < p.d; ++k) {
    const __m512 w0 = _mm512_loadu_ps(wp + k * kPanel);
    const __m512 w1 = _mm512_loadu_ps(wp + k * kPanel + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(xr[r][k]);
      a0[r] = _mm512_fmadd_ps(xb, w0, a0[r]);
      a1[r] = _mm512_fmadd_ps(xb, w1, a1[r]);
    }
  }
  const int64_t cols = PanelCols(p, j);
  const __mmask16 m0mask = cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1u);
  const __mmask16 m1mask = cols >= 32 ? __mmask16(0xFFFF)
                           : cols > 16 ? __mmask16((1u << (cols - 16)) - 1u) : __mmask16(0);
  for (int r = 0; r < R; ++r) {
    float* yr = p.y + (m0 + r) * p.n + j * kPanel;
    _mm512_mask_storeu_ps(yr, m0mask, a0[r]);
    _mm512_mask_storeu_ps(yr + 16, m1mask, a1[r]);
  }
}

// AVX2 + FMA: R <= 3 rows x 32 columns = 4R accumulators (16 vector registers in all).
template <int R>
__attribute__((target("avx2,fma"))) void RowsAvx2(const Problem& p, int64_t j, int64_t m0) {
  const float* wp = p.w + j * p.d * kPanel;
  const float* xr[R];
  __m256 a[R][4];
  for (int r = 0; r < R; ++r) {
    xr[r] = p.x + (m0 + r) * p.d;
    for (int c = 0; c < 4; ++c) a[r][c] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < p.d; ++k) {
    __m256 xb[R];
    for (int r = 0; r < R; ++r) xb[r] = _mm256_broadcast_ss(xr[r] + k);
    for (int c = 0; c < 4; ++c) {
      const __m256 w = _mm256_loadu_ps(wp + k * kPanel + 8 * c);
      for (int r = 0; r < R; ++r) a[r][c] = _mm256_fmadd_ps(xb[r], w, a[r][c]);
    }
  }
  const int64_t cols = PanelCols(p, j);
  for (int r = 0; r < R; ++r) {
    float* yr = p.y + (m0 + r) * p.n + j * kPanel;
    if (cols == kPanel) {
      for (int c = 0; c < 4; ++c) _mm256_storeu_ps(yr + 8 * c, a[r][c]);
    } else {
      alignas(32) float tmp[kPanel];
      for (int c = 0; c < 4; ++c) _mm256_store_ps(tmp + 8 * c, a[r][c]);
      for (int64_t c = 0; c < cols; ++c) yr[c] = tmp[c];
    }
  }
}
#endif  // SPECJAX_X86

enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

int DetectIsa() {
#ifdef SPECJAX_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
#endif
  return kScalar;
}

int ActiveIsa() {
  static const int isa = DetectIsa();
  return isa;
}

// Rows [m0, m0 + rows) of panel j, in groups the instruction set's body takes.
void Rows(const Problem& p, int64_t j, int64_t m0, int64_t rows, int isa) {
#ifdef SPECJAX_X86
  if (isa == kAvx512) {
    for (int64_t s = 0; s < rows; s += 8) {
      switch (std::min<int64_t>(8, rows - s)) {
        case 8: RowsAvx512<8>(p, j, m0 + s); break;
        case 7: RowsAvx512<7>(p, j, m0 + s); break;
        case 6: RowsAvx512<6>(p, j, m0 + s); break;
        case 5: RowsAvx512<5>(p, j, m0 + s); break;
        case 4: RowsAvx512<4>(p, j, m0 + s); break;
        case 3: RowsAvx512<3>(p, j, m0 + s); break;
        case 2: RowsAvx512<2>(p, j, m0 + s); break;
        default: RowsAvx512<1>(p, j, m0 + s); break;
      }
    }
    return;
  }
  if (isa == kAvx2) {
    for (int64_t s = 0; s < rows; s += 3) {
      switch (std::min<int64_t>(3, rows - s)) {
        case 3: RowsAvx2<3>(p, j, m0 + s); break;
        case 2: RowsAvx2<2>(p, j, m0 + s); break;
        default: RowsAvx2<1>(p, j, m0 + s); break;
      }
    }
    return;
  }
#endif
  RowsScalar(p, j, m0, rows);
}

ffi::Error PanelMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                       ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() < 1 || wd.size() != 3 || yd.size() != xd.size() || wd[2] != kPanel) {
    return ffi::Error::InvalidArgument(
        "specjax_panel_matmul: expected x [..., D], panels [P, D, 32] and y [..., N]");
  }
  Problem p;
  p.d = xd[xd.size() - 1];
  p.n = yd[yd.size() - 1];
  p.panels = wd[0];
  p.m = 1;
  for (size_t i = 0; i + 1 < xd.size(); ++i) {
    if (xd[i] != yd[i]) return ffi::Error::InvalidArgument("specjax_panel_matmul: x and y differ in a leading dim");
    p.m *= xd[i];
  }
  if (wd[1] != p.d || (p.n + kPanel - 1) / kPanel != p.panels) {
    return ffi::Error::InvalidArgument(
        "specjax_panel_matmul: panels [" + std::to_string(wd[0]) + ", " + std::to_string(wd[1]) +
        ", 32] do not fit x [..., " + std::to_string(p.d) + "] -> y [..., " + std::to_string(p.n) + "]");
  }
  p.x = x.typed_data();
  p.w = w.typed_data();
  p.y = y->typed_data();
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();

  const int isa = ActiveIsa();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // About four chunks of panels per thread: the caller and the pool share them out as they come free.
  const int64_t chunk = std::max<int64_t>(1, (p.panels + 4 * threads - 1) / (4 * threads));
  const int64_t chunks = (p.panels + chunk - 1) / chunk;
  specjax_kernels::ShareOut(pool, chunks, [p, isa, chunk](int64_t c) {
    const int64_t j1 = std::min(p.panels, (c + 1) * chunk);
    for (int64_t j = c * chunk; j < j1; ++j) Rows(p, j, 0, p.m, isa);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxPanelMatmul, PanelMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// 2: AVX-512 body, 1: AVX2 + FMA body, 0: portable body (correct, not fast).
extern "C" int SpecjaxKernelIsa() { return ActiveIsa(); }
