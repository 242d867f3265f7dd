// Row-invariant linear layers for the target on a CPU (sglang_omni_flash.kernels.linear).
//
// y[m, n] = x[m, :] . w[n, :] (+ b[n]) where every output element is the same fixed sequence of
// instructions over its own row of x and column of w, in k order, whatever else is in the call:
// the number of rows M never chooses a kernel, a blocking or a reduction split. A verify pass of
// 264 rows therefore gives each row the bits a one-row greedy step gives it. BLAS and oneDNN choose
// their kernels by M (on an AMX Xeon oneDNN switches kernels past ~32 bf16 rows and changes the last
// bits of the rows already there), which is what broke speculative == greedy in bfloat16.
//
// One path per process, chosen from the CPU (this file is compiled with -march=native) and never
// from the call:
//   float32                      FMA over k = 0..K-1, one fp32 accumulator per element
//                                (AVX-512 or AVX2 lanes over the columns, so no horizontal sums;
//                                without AVX2 FMA, 4-lane vectors with a multiply and an add);
//   bfloat16 with AMX-BF16       TDPBF16PS tiles: 16 rows x 16 columns, k in blocks of 32, blocks
//                                in order; rows past M are zeros of a padded copy of x;
//   bfloat16 with AVX512-BF16    VDPBF16PS: k pairs in order, lanes over the columns;
//   bfloat16 otherwise           the weight widened to fp32 (exact), FMA as for float32.
// Every path accumulates in fp32, adds the bias in fp32 (then, for fc1, GELU: fused here so that it
// too is one fixed sequence per element, where torch's elementwise kernels send the elements at a
// thread's chunk edge through a scalar tail) and rounds to the output dtype once (to nearest even). Work is split over column groups only, so a thread count never changes a bit.
// A column's lane within a vector never changes its arithmetic either (every lane runs the same
// instruction), so padding the columns to whole panels is free of consequences.
//
// Weights are packed once (`pack_linear`) into panels of 16 columns:
//   [P, K, 16]          float32, or bfloat16 widened at use (FMA paths)
//   [P, Kp / 2, 16, 2]  bfloat16 pairs of k (VNNI; AMX and AVX512-BF16), Kp = K rounded up to 32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

namespace {

constexpr int64_t PANEL = 16;  // columns per packed panel
constexpr int64_t GROUP_PANELS = 4;  // panels one micro-kernel call covers (64 columns)
constexpr int64_t GROUP = PANEL * GROUP_PANELS;
constexpr int64_t K_BLOCK = 32;  // k per AMX tile (and the VNNI padding of K)

using bf16 = c10::BFloat16;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// ------------------------------------------------------------------------------ fp32 vectors

#if defined(__AVX2__) && defined(__FMA__)
constexpr bool HAVE_AVX2_FMA = true;
#else
constexpr bool HAVE_AVX2_FMA = false;
#endif

#if defined(__AVX512F__)
constexpr int64_t LANES = 16;
constexpr int64_t MR = 6;  // rows per micro-kernel: 6 x 4 accumulators + 4 weights + 1 broadcast < 32
struct Vec {
  __m512 r;
};
inline Vec vzero() { return {_mm512_setzero_ps()}; }
inline Vec vbroadcast(float x) { return {_mm512_set1_ps(x)}; }
inline Vec vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline Vec vload(const bf16* p) {  // 16 bf16 -> fp32, exact
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
}
inline Vec vfma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.r, b.r, c.r)}; }
inline void vstore(float* p, Vec a) { _mm512_storeu_ps(p, a.r); }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t LANES = 8;
constexpr int64_t MR = 3;  // 3 x 4 accumulators + 3 broadcasts + 1 weight = 16 registers
struct Vec {
  __m256 r;
};
inline Vec vzero() { return {_mm256_setzero_ps()}; }
inline Vec vbroadcast(float x) { return {_mm256_set1_ps(x)}; }
inline Vec vload(const float* p) { return {_mm256_loadu_ps(p)}; }
inline Vec vload(const bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))};
}
inline Vec vfma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.r, b.r, c.r)}; }
inline void vstore(float* p, Vec a) { _mm256_storeu_ps(p, a.r); }
#else
// No AVX2 FMA (an x86-64 CPU model without it, or another architecture): 4 lanes of GCC vector
// extensions (SSE2 / NEON registers), a multiply then an add (this file is built as ISO C++, where
// GCC never contracts a * b + c into an FMA). Not std::fma: without hardware FMA that is a libm
// call per element, which made a 72-row head take seconds.
constexpr int64_t LANES = 4;  // one SSE2 / NEON register: wider vectors spilled (measured 6x slower)
constexpr int64_t MR = 3;  // 3 x 4 accumulators + 4 weights + 1 broadcast < 16 registers
typedef float f4v __attribute__((vector_size(16)));
typedef uint32_t u4v __attribute__((vector_size(16)));
typedef uint16_t h4v __attribute__((vector_size(8)));
struct Vec {
  f4v r;
};
inline Vec vzero() { return {f4v{}}; }
inline Vec vbroadcast(float x) { return {f4v{} + x}; }
inline Vec vload(const float* p) {
  Vec v;
  std::memcpy(&v.r, p, sizeof v.r);
  return v;
}
inline Vec vload(const bf16* p) {  // 4 bf16 -> fp32, exact
  h4v h;
  std::memcpy(&h, p, sizeof h);
  return {(f4v)(__builtin_convertvector(h, u4v) << 16)};
}
inline Vec vfma(Vec a, Vec b, Vec c) { return {a.r * b.r + c.r}; }
inline void vstore(float* p, Vec a) { std::memcpy(p, &a.r, sizeof a.r); }
#endif
constexpr const char* FMA_NAME = LANES == 16 ? "avx512 fma" : HAVE_AVX2_FMA ? "avx2 fma" : "4-lane multiply-add";
constexpr int64_t GROUP_VECS = 4;  // vectors across a micro-kernel
constexpr int64_t FMA_GROUP = GROUP_VECS * LANES;  // columns per FMA micro-kernel call

#if defined(__AVX512BF16__)
constexpr bool VNNI = true;  // bf16 weights packed as k pairs for VDPBF16PS / TDPBF16PS
#else
constexpr bool VNNI = false;
#endif

// ------------------------------------------------------------------------ the output rows

// The epilogue works on whole vectors of 16 floats (GCC vector extensions: the same instructions for
// every lane on any ISA; buffers are padded to whole panels), so no column ever takes a scalar tail.
typedef float f16v __attribute__((vector_size(64)));
typedef int32_t i16v __attribute__((vector_size(64)));
typedef uint32_t u16v __attribute__((vector_size(64)));
typedef uint16_t h16v __attribute__((vector_size(32)));

inline f16v load16(const float* p) {
  f16v v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// exp(x) for x <= 0, exactly 0 below -87: Cody-Waite reduction and Cephes' degree-6 polynomial
inline f16v exp_nonpositive(f16v x) {
  const f16v v = x > -87.f ? x : f16v{} - 87.f;
  const f16v k = (v * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round to nearest (1.5 * 2^23)
  f16v r = v - k * 0.693359375f;
  r = r - k * -2.12194440e-4f;
  f16v p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.f;
  const f16v scale = (f16v)((__builtin_convertvector(k, i16v) + 127) << 23);
  return x > -87.f ? p * scale : f16v{};
}

// GELU(v) = v/2 (1 + erf(v / sqrt 2)), erf by Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7, the
// approximation torch's own vectorised CPU erf uses)
inline f16v gelu(f16v v) {
  const f16v x = v * 0.70710678118654752f;
  const i16v sign = (i16v)x & (int32_t)0x80000000;
  const f16v a = (f16v)((i16v)x & 0x7FFFFFFF);
  const f16v t = 1.f / (a * 0.3275911f + 1.f);
  f16v y = t * 1.061405429f - 1.453152027f;
  y = y * t + 1.421413741f;
  y = y * t - 0.284496736f;
  y = y * t + 0.254829592f;
  y = y * t;
  const f16v erf_abs = 1.f - y * exp_nonpositive(f16v{} - a * a);
  const f16v erf = (f16v)((i16v)erf_abs | sign);
  return v * 0.5f * (erf + 1.f);
}

// out[r, c] = act(acc[r, c] + bias[c]) for r < rows, c < cols, rounded once to T: the one epilogue
// of every path. Columns up to cols rounded up to 16 of acc and bias are readable (whole panels).
template <typename T>
void write_rows(const float* acc, int64_t acc_ld, int64_t rows, int64_t cols, const float* bias,
                bool act_gelu, T* out, int64_t out_ld) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; c += 16) {
      f16v v = load16(acc + r * acc_ld + c);
      if (bias != nullptr) v = v + load16(bias + c);
      if (act_gelu) v = gelu(v);
      T* o = out + r * out_ld + c;
      if constexpr (std::is_same_v<T, float>) {
        if (c + 16 <= cols)
          std::memcpy(o, &v, 64);
        else
          std::memcpy(o, &v, (cols - c) * 4);
      } else {  // round to nearest even, as c10::BFloat16(float) does; NaN stays a quiet NaN
        const u16v u = (u16v)v;
        const u16v rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
        const u16v bits = v != v ? u16v{} + 0x7FC0u : rounded;
        const h16v h = __builtin_convertvector(bits, h16v);
        if (c + 16 <= cols)
          std::memcpy(o, &h, 32);
        else
          std::memcpy(o, &h, (cols - c) * 2);
      }
    }
  }
}

// ------------------------------------------------------------------------- FMA micro-kernel

// acc[m][v] over k = 0..K-1 in order: acc = fma(x[m, k], w[k, v], acc). The same sequence for every
// element, whatever ROWS and VECS this instantiation was made for.
template <int ROWS, int VECS, typename W>
void fma_block(const float* x, int64_t x_ld, const W* panels, int64_t k_len, int64_t first_col, float* acc) {
  Vec a[ROWS][VECS];
  for (int m = 0; m < ROWS; ++m)
    for (int v = 0; v < VECS; ++v) a[m][v] = vzero();
  const W* w[VECS];
  for (int v = 0; v < VECS; ++v) {
    const int64_t col = first_col + v * LANES;
    w[v] = panels + (col / PANEL) * k_len * PANEL + (col % PANEL);
  }
  for (int64_t k = 0; k < k_len; ++k) {
    Vec wk[VECS];
    for (int v = 0; v < VECS; ++v) wk[v] = vload(w[v] + k * PANEL);
    for (int m = 0; m < ROWS; ++m) {
      const Vec xb = vbroadcast(x[m * x_ld + k]);
      for (int v = 0; v < VECS; ++v) a[m][v] = vfma(xb, wk[v], a[m][v]);
    }
  }
  for (int m = 0; m < ROWS; ++m)
    for (int v = 0; v < VECS; ++v) vstore(acc + m * FMA_GROUP + v * LANES, a[m][v]);
}

template <int ROWS, typename W>
void fma_rows(const float* x, int64_t x_ld, const W* panels, int64_t k_len, int64_t first_col, int64_t vecs,
              float* acc) {
  switch (vecs) {
    case 1: return fma_block<ROWS, 1>(x, x_ld, panels, k_len, first_col, acc);
    case 2: return fma_block<ROWS, 2 <= GROUP_VECS ? 2 : 1>(x, x_ld, panels, k_len, first_col, acc);
    case 3: return fma_block<ROWS, 3 <= GROUP_VECS ? 3 : 1>(x, x_ld, panels, k_len, first_col, acc);
    default: return fma_block<ROWS, GROUP_VECS>(x, x_ld, panels, k_len, first_col, acc);
  }
}

template <typename W>
void fma_dispatch(int64_t rows, const float* x, int64_t x_ld, const W* panels, int64_t k_len, int64_t first_col,
                  int64_t vecs, float* acc) {
  switch (rows) {
    case 1: return fma_rows<1>(x, x_ld, panels, k_len, first_col, vecs, acc);
    case 2: return fma_rows<2>(x, x_ld, panels, k_len, first_col, vecs, acc);
    case 3: return fma_rows<3>(x, x_ld, panels, k_len, first_col, vecs, acc);
#if !(defined(__AVX2__) && defined(__FMA__)) || defined(__AVX512F__)
    case 4: return fma_rows<4>(x, x_ld, panels, k_len, first_col, vecs, acc);
#endif
#if defined(__AVX512F__)
    case 5: return fma_rows<5>(x, x_ld, panels, k_len, first_col, vecs, acc);
    case 6: return fma_rows<6>(x, x_ld, panels, k_len, first_col, vecs, acc);
#endif
    default: TORCH_CHECK(false, "row_linear: bad row block");
  }
}

// x [M, K] fp32 (rows x_ld apart), weights [P, K, 16] of W -> out [M, N] of T
template <typename W, typename T>
void fma_linear(const float* x, int64_t x_ld, int64_t m_len, const W* panels, int64_t k_len, int64_t n_len,
                const float* bias, bool act_gelu, T* out) {
  const int64_t padded = round_up(n_len, PANEL);
  const int64_t groups = (padded + FMA_GROUP - 1) / FMA_GROUP;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float acc[MR * FMA_GROUP];
    for (int64_t g = begin; g < end; ++g) {
      const int64_t col = g * FMA_GROUP;
      const int64_t cols = std::min(FMA_GROUP, padded - col);
      for (int64_t m = 0; m < m_len; m += MR) {
        const int64_t rows = std::min(MR, m_len - m);
        fma_dispatch(rows, x + m * x_ld, x_ld, panels, k_len, col, cols / LANES, acc);
        write_rows(acc, FMA_GROUP, rows, std::min(cols, n_len - col), bias == nullptr ? nullptr : bias + col,
                   act_gelu, out + m * n_len + col, n_len);
      }
    }
  });
}

// ----------------------------------------------------------------- bf16 pairs: AVX512-BF16, AMX

#if defined(__AVX512BF16__)
// acc[m][v] over k pairs in order: acc = dpbf16(acc, x[m, 2i:2i+2], w[2i:2i+2, v]) (VDPBF16PS).
template <int ROWS, int VECS>
void dot_block(const bf16* x, int64_t x_ld, const bf16* panels, int64_t pairs, int64_t first_panel, float* acc) {
  __m512 a[ROWS][VECS];
  for (int m = 0; m < ROWS; ++m)
    for (int v = 0; v < VECS; ++v) a[m][v] = _mm512_setzero_ps();
  const bf16* w[VECS];
  for (int v = 0; v < VECS; ++v) w[v] = panels + (first_panel + v) * pairs * 2 * PANEL;
  for (int64_t i = 0; i < pairs; ++i) {
    __m512bh wk[VECS];
    for (int v = 0; v < VECS; ++v) wk[v] = (__m512bh)_mm512_loadu_si512(w[v] + i * 2 * PANEL);
    for (int m = 0; m < ROWS; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * x_ld + 2 * i, 4);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < VECS; ++v) a[m][v] = _mm512_dpbf16_ps(a[m][v], xb, wk[v]);
    }
  }
  for (int m = 0; m < ROWS; ++m)
    for (int v = 0; v < VECS; ++v) _mm512_storeu_ps(acc + m * GROUP + v * PANEL, a[m][v]);
}

template <int ROWS>
void dot_rows(const bf16* x, int64_t x_ld, const bf16* panels, int64_t pairs, int64_t first_panel, int64_t vecs,
              float* acc) {
  switch (vecs) {
    case 1: return dot_block<ROWS, 1>(x, x_ld, panels, pairs, first_panel, acc);
    case 2: return dot_block<ROWS, 2>(x, x_ld, panels, pairs, first_panel, acc);
    case 3: return dot_block<ROWS, 3>(x, x_ld, panels, pairs, first_panel, acc);
    default: return dot_block<ROWS, 4>(x, x_ld, panels, pairs, first_panel, acc);
  }
}

constexpr int64_t DOT_MR = 6;

template <typename T>
void dot_linear(const bf16* x, int64_t x_ld, int64_t m_len, const bf16* panels, int64_t pairs, int64_t n_len,
                const float* bias, bool act_gelu, T* out) {
  const int64_t n_panels = round_up(n_len, PANEL) / PANEL;
  const int64_t groups = (n_panels + GROUP_PANELS - 1) / GROUP_PANELS;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float acc[DOT_MR * GROUP];
    for (int64_t g = begin; g < end; ++g) {
      const int64_t p0 = g * GROUP_PANELS, np = std::min(GROUP_PANELS, n_panels - p0), col = p0 * PANEL;
      for (int64_t m = 0; m < m_len; m += DOT_MR) {
        const int64_t rows = std::min(DOT_MR, m_len - m);
        const bf16* xm = x + m * x_ld;
        switch (rows) {
          case 1: dot_rows<1>(xm, x_ld, panels, pairs, p0, np, acc); break;
          case 2: dot_rows<2>(xm, x_ld, panels, pairs, p0, np, acc); break;
          case 3: dot_rows<3>(xm, x_ld, panels, pairs, p0, np, acc); break;
          case 4: dot_rows<4>(xm, x_ld, panels, pairs, p0, np, acc); break;
          case 5: dot_rows<5>(xm, x_ld, panels, pairs, p0, np, acc); break;
          default: dot_rows<6>(xm, x_ld, panels, pairs, p0, np, acc); break;
        }
        write_rows(acc, GROUP, rows, std::min(np * PANEL, n_len - col),
                   bias == nullptr ? nullptr : bias + col, act_gelu, out + m * n_len + col, n_len);
      }
    }
  });
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
constexpr bool AMX_BUILT = true;

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool amx_permitted() {
  // Linux hands out the AMX tile state only on request (once per process)
  static const bool ok = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

// tiles 0..3: C (16 rows x 16 fp32 columns, one per panel), 4: A (16 rows x 32 bf16 of x),
// 5, 6: B (16 k pairs x 16 columns); every tile 16 rows of 64 bytes
template <int PANELS>
void amx_block(const bf16* x, int64_t x_ld, const bf16* panels, int64_t pairs, int64_t first_panel, float* acc) {
  _tile_zero(0);
  if constexpr (PANELS > 1) _tile_zero(1);
  if constexpr (PANELS > 2) _tile_zero(2);
  if constexpr (PANELS > 3) _tile_zero(3);
  const int64_t panel_stride = pairs * 2 * PANEL;
  const bf16* w = panels + first_panel * panel_stride;
  for (int64_t kb = 0; kb < pairs / 16; ++kb) {
    _tile_loadd(4, x + kb * K_BLOCK, x_ld * 2);
    const bf16* wk = w + kb * K_BLOCK * PANEL;
    _tile_loadd(5, wk, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (PANELS > 1) {
      _tile_loadd(6, wk + panel_stride, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (PANELS > 2) {
      _tile_loadd(5, wk + 2 * panel_stride, 64);
      _tile_dpbf16ps(2, 4, 5);
    }
    if constexpr (PANELS > 3) {
      _tile_loadd(6, wk + 3 * panel_stride, 64);
      _tile_dpbf16ps(3, 4, 6);
    }
  }
  _tile_stored(0, acc, GROUP * 4);
  if constexpr (PANELS > 1) _tile_stored(1, acc + PANEL, GROUP * 4);
  if constexpr (PANELS > 2) _tile_stored(2, acc + 2 * PANEL, GROUP * 4);
  if constexpr (PANELS > 3) _tile_stored(3, acc + 3 * PANEL, GROUP * 4);
}

// x: [Mp, Kp] bf16 with Mp a multiple of 16 (rows past m_len are zeros)
template <typename T>
void amx_linear(const bf16* x, int64_t x_ld, int64_t m_len, const bf16* panels, int64_t pairs, int64_t n_len,
                const float* bias, bool act_gelu, T* out) {
  const int64_t n_panels = round_up(n_len, PANEL) / PANEL;
  const int64_t groups = (n_panels + GROUP_PANELS - 1) / GROUP_PANELS;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    TileConfig cfg;
    for (int t = 0; t < 7; ++t) {
      cfg.colsb[t] = 64;
      cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
    alignas(64) float acc[16 * GROUP];
    for (int64_t g = begin; g < end; ++g) {
      const int64_t p0 = g * GROUP_PANELS, np = std::min(GROUP_PANELS, n_panels - p0), col = p0 * PANEL;
      for (int64_t m = 0; m < m_len; m += 16) {
        const bf16* xm = x + m * x_ld;
        switch (np) {
          case 1: amx_block<1>(xm, x_ld, panels, pairs, p0, acc); break;
          case 2: amx_block<2>(xm, x_ld, panels, pairs, p0, acc); break;
          case 3: amx_block<3>(xm, x_ld, panels, pairs, p0, acc); break;
          default: amx_block<4>(xm, x_ld, panels, pairs, p0, acc); break;
        }
        write_rows(acc, GROUP, std::min<int64_t>(16, m_len - m), std::min(np * PANEL, n_len - col),
                   bias == nullptr ? nullptr : bias + col, act_gelu, out + m * n_len + col, n_len);
      }
    }
    _tile_release();
  });
}
#else
constexpr bool AMX_BUILT = false;
bool amx_permitted() { return false; }
#endif

bool use_amx() { return AMX_BUILT && amx_permitted(); }

// ------------------------------------------------------------------------------- the ops

at::Tensor pack_linear(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu(), "pack_linear: weight [N, K] on CPU");
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "pack_linear: float32 or bfloat16, got ", dtype);
  const int64_t n = weight.size(0), k = weight.size(1), np = round_up(n, PANEL) / PANEL;
  auto w = at::zeros({np * PANEL, k}, weight.options());
  w.narrow(0, 0, n).copy_(weight);
  if (dtype == at::kBFloat16 && VNNI) {  // [P, Kp/2, 16, 2]
    const int64_t kp = round_up(k, K_BLOCK);
    auto wk = at::zeros({np * PANEL, kp}, weight.options());
    wk.narrow(1, 0, k).copy_(w);
    return wk.view({np, PANEL, kp / 2, 2}).permute({0, 2, 1, 3}).contiguous();
  }
  return w.view({np, PANEL, k}).permute({0, 2, 1}).contiguous();  // [P, K, 16]
}

at::Tensor row_linear(const at::Tensor& input, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                      int64_t n_len, bool act_gelu) {
  TORCH_CHECK(input.device().is_cpu() && packed.device().is_cpu(), "row_linear runs on CPU");
  TORCH_CHECK(input.scalar_type() == packed.scalar_type(), "row_linear: input ", input.scalar_type(),
              " but weight ", packed.scalar_type());
  const bool pairs_layout = packed.dim() == 4;
  const int64_t k_len = input.size(-1);
  TORCH_CHECK(pairs_layout ? packed.size(1) * 2 >= k_len && packed.size(1) * 2 - k_len < K_BLOCK
                           : packed.size(1) == k_len,
              "row_linear: weight packed for another input width than ", k_len);
  TORCH_CHECK(packed.size(0) * PANEL >= n_len && packed.size(0) * PANEL - n_len < PANEL, "row_linear: bad N");
  auto sizes = input.sizes().vec();
  sizes.back() = n_len;
  auto x = input.reshape({-1, k_len});
  const int64_t m_len = x.size(0);
  auto out = at::empty({m_len, n_len}, input.options());
  if (m_len == 0) return out.view(sizes);
  at::Tensor b;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    b = at::zeros({round_up(n_len, PANEL)}, at::kFloat);
    b.narrow(0, 0, n_len).copy_(*bias);
    bp = b.data_ptr<float>();
  }
  if (input.scalar_type() == at::kFloat) {
    x = x.contiguous();
    fma_linear(x.data_ptr<float>(), k_len, m_len, packed.data_ptr<float>(), k_len, n_len, bp, act_gelu, out.data_ptr<float>());
  } else if (!pairs_layout) {  // bf16 without bf16 instructions: widen x (exact), FMA over widened weights
    auto xf = x.to(at::kFloat).contiguous();
    fma_linear(xf.data_ptr<float>(), k_len, m_len, reinterpret_cast<const bf16*>(packed.data_ptr()), k_len, n_len,
               bp, act_gelu, reinterpret_cast<bf16*>(out.data_ptr()));
  } else {
#if defined(__AVX512BF16__)
    const int64_t kp = packed.size(1) * 2;
    const bool amx = use_amx();
    auto xp = at::zeros({amx ? round_up(m_len, 16) : m_len, kp}, input.options());  // zero-padded copy
    xp.narrow(0, 0, m_len).narrow(1, 0, k_len).copy_(x);
    const auto* xb = reinterpret_cast<const bf16*>(xp.data_ptr());
    const auto* wb = reinterpret_cast<const bf16*>(packed.data_ptr());
    auto* ob = reinterpret_cast<bf16*>(out.data_ptr());
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (amx) {
      amx_linear(xb, kp, m_len, wb, kp / 2, n_len, bp, act_gelu, ob);
      return out.view(sizes);
    }
#endif
    dot_linear(xb, kp, m_len, wb, kp / 2, n_len, bp, act_gelu, ob);
#else
    TORCH_CHECK(false, "row_linear: weight packed as bf16 pairs, but this build has no AVX512-BF16");
#endif
  }
  return out.view(sizes);
}

std::string row_linear_path(c10::ScalarType dtype) {
  if (dtype == at::kBFloat16) {
    if (use_amx()) return "amx-bf16 tiles";
    if (VNNI) return "avx512-bf16 dot products";
    return std::string(FMA_NAME) + " over widened bf16";
  }
  return FMA_NAME;
}

std::string path_of(bool bfloat16) { return row_linear_path(bfloat16 ? at::kBFloat16 : at::kFloat); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(whisper_flash, m) {
  m.def("pack_linear(Tensor weight) -> Tensor");
  m.def("row_linear(Tensor input, Tensor packed, Tensor? bias, int n, bool gelu=False) -> Tensor");
  m.def("row_linear_path(bool bfloat16) -> str", &path_of);
}

TORCH_LIBRARY_IMPL(whisper_flash, CPU, m) {
  m.impl("pack_linear", &pack_linear);
  m.impl("row_linear", &row_linear);
}
