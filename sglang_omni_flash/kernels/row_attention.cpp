// Row-invariant attention for CPU decoding (sglang_omni_flash.kernels.attention).
//
// out[b, h, r] = sum_j softmax_j(scale * q[b, h, r] . k[b, h, j]) v[b, h, j] over the keys row r may
// see: j < limit[b, r], and mask[b, r, j] where a mask is given (draft trees). Keys come transposed,
// kt[b, h, :, j] (the engine's caches keep them so on a CPU), values as v[b, h, j, :].
//
// Why a kernel of our own: Whisper-Flash promises the target's greedy tokens, and a verify pass
// computes several rows at once where plain greedy computes one. torch's CPU attention (SDPA, and
// matmul + softmax through MKL) picks its blocking from the sizes of the call, so a row's result
// changes in its last bits with the number of query rows, the number of requests and masked keys
// -- and in bfloat16 those bits flip argmaxes (measured: 4 of 38 test clips). Here each row's result
// is a fixed sequence of operations over its own query and the keys it sees, in key order, so it is
// bit-identical whatever else is in the call: one row or 33, one request or 8, a chain or a tree
// whose hidden keys sit between the visible ones (a hidden key adds an exact zero).
//
// Fixed order, per (b, h, r): each score is a sum over the head dimension in order d = 0..hd-1
// (vector lanes run over keys, never over d); the max; exp by one polynomial (every element through
// the same vector code: buffers are padded to whole vectors); the denominator as 16 lane sums over
// the visible keys listed in order (a tree node's hidden keys left out), the lanes then added in a
// fixed order;
// the values accumulated key by key (lanes over d); one division at the end. fp32 accumulation for
// float32 and bfloat16 inputs alike; products and sums fused (one rounding) where the CPU has FMA,
// separate elsewhere: one choice per build, never per call. Work is split over (b, h) only.
//
// Rows of one (b, h) are scored and weighted ROWS_TOGETHER at a time, so that each key vector and
// value vector loaded (and, in bf16, widened) serves several rows. A row's arithmetic does not see
// its neighbours: the same instructions run for it in a group of 1 or of 4.
//
// bfloat16 scores on a CPU with AVX512-BF16 (one choice per build, like FMA): VDPBF16PS over pairs
// of the head dimension in order, score += q[d] k[d] + q[d+1] k[d+1] for d = 0, 2, .. hd-2 (each
// product exact in fp32, then the CPU's fixed rounding of the pair), half the instructions of the
// widened FMAs. Still a fixed sequence per (row, key), whatever else is in the call.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <limits>
#include <string>
#include <vector>

namespace {

constexpr int64_t LANES = 8;
constexpr int64_t BLOCK = 8 * LANES;  // keys scored together (4 vectors of 16)
constexpr int64_t MAX_HEAD_DIM = 256;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// 16 floats as GCC vector extensions (one zmm with AVX-512, two ymm with AVX2, four xmm otherwise):
// every lane runs the same instruction, on any ISA.
typedef float f16v __attribute__((vector_size(64)));
typedef uint32_t u16v __attribute__((vector_size(64)));
typedef uint16_t h16v __attribute__((vector_size(32)));
constexpr int64_t VEC = 16;
constexpr int64_t BLOCK_VECS = BLOCK / VEC;

// a * b + c: fused where the build has FMA (one rounding), else a multiply then an add (this file
// is compiled with -ffp-contract=off, so the compiler never fuses on its own)
inline f16v madd(f16v a, f16v b, f16v c) {
#if defined(__AVX512F__)
  return (f16v)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 a2[2], b2[2], c2[2];
  std::memcpy(a2, &a, 64);
  std::memcpy(b2, &b, 64);
  std::memcpy(c2, &c, 64);
  for (int i = 0; i < 2; ++i) c2[i] = _mm256_fmadd_ps(a2[i], b2[i], c2[i]);
  f16v out;
  std::memcpy(&out, c2, 64);
  return out;
#else
  return a * b + c;
#endif
}

#if defined(__AVX512F__)
constexpr int64_t ROWS_TOGETHER = 4;  // 4 rows x 4 accumulators + 4 loaded vectors < 32 registers
#else
constexpr int64_t ROWS_TOGETHER = 1;  // 16 registers: one row's 4 accumulators (8 ymm) + loads
#endif

inline f16v load16(const float* p) {
  f16v v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline f16v load16(const c10::BFloat16* p) {  // 16 bf16 -> fp32, exact
  h16v h;
  std::memcpy(&h, p, sizeof h);
  return (f16v)(__builtin_convertvector(h, u16v) << 16);
}

// scores of G rows against BLOCK keys: s[i][l] = scale * sum_d q[i][d] k[d][l], d in order
template <int G>
void score_rows(const float* q, int64_t hd, const float* keys, int64_t stride, float scale, float* s,
                int64_t s_ld) {
  f16v acc[G][BLOCK_VECS];
  for (int i = 0; i < G; ++i)
    for (int v = 0; v < BLOCK_VECS; ++v) acc[i][v] = f16v{};
  for (int64_t d = 0; d < hd; ++d) {
    f16v k[BLOCK_VECS];
    for (int v = 0; v < BLOCK_VECS; ++v) k[v] = load16(keys + d * stride + v * VEC);
    for (int i = 0; i < G; ++i) {
      const f16v qd = f16v{} + q[i * hd + d];
      for (int v = 0; v < BLOCK_VECS; ++v) acc[i][v] = madd(qd, k[v], acc[i][v]);
    }
  }
  for (int i = 0; i < G; ++i)
    for (int v = 0; v < BLOCK_VECS; ++v) {
      const f16v x = acc[i][v] * scale;
      std::memcpy(s + i * s_ld + v * VEC, &x, sizeof x);
    }
}

#if defined(__AVX512F__)
inline __m512 load_zmm(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_zmm(const c10::BFloat16* p) {  // 16 bf16 -> fp32, exact
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// value_rows' arithmetic (the same fused multiply-adds in the same order: the same bits) in
// AVX-512 registers. Through the vector extensions, inlined into attend, GCC 12 kept these
// accumulators in memory and stored all of them after every key (a 2-core EPYC, bf16: a verify's
// attention 40% slower); out of line and in intrinsics they stay in registers.
template <int G, int NV, typename T>
__attribute__((noinline)) void value_rows_zmm(const float* p, int64_t p_ld, const T* v, int64_t v_ld, int64_t keys,
                                              const float* denom, T* out, int64_t out_ld) {
  __m512 acc[G][NV];
  for (int i = 0; i < G; ++i)
    for (int c = 0; c < NV; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < keys; ++j) {
    __m512 x[NV];
    for (int c = 0; c < NV; ++c) x[c] = load_zmm(v + j * v_ld + c * VEC);
    for (int i = 0; i < G; ++i) {
      const __m512 w = _mm512_set1_ps(p[i * p_ld + j]);
      for (int c = 0; c < NV; ++c) acc[i][c] = _mm512_fmadd_ps(w, x[c], acc[i][c]);
    }
  }
  for (int i = 0; i < G; ++i) {
    const __m512 inv = _mm512_set1_ps(denom[i] > 0.f ? 1.f / denom[i] : 0.f);
    alignas(64) float row[NV * VEC];
    for (int c = 0; c < NV; ++c) _mm512_store_ps(row + c * VEC, _mm512_mul_ps(acc[i][c], inv));
    for (int64_t d = 0; d < NV * VEC; ++d) out[i * out_ld + d] = static_cast<T>(row[d]);
  }
}
#endif

// G rows' weighted values, keys 0..keys-1 in order, then the division: out[i][d] =
// (sum_j p[i][j] v[j][d]) / denom[i]. NV: head_dim / 16 when known at compile time (Whisper: 4), else 0.
template <int G, int NV, typename T>
void value_rows(const float* p, int64_t p_ld, const T* v, int64_t v_ld, int64_t keys, int64_t hd,
                const float* denom, T* out, int64_t out_ld) {
#if defined(__AVX512F__)
  if constexpr (NV > 0) return value_rows_zmm<G, NV>(p, p_ld, v, v_ld, keys, denom, out, out_ld);
#endif
  constexpr int CAP = NV > 0 ? NV : MAX_HEAD_DIM / VEC;
  const int nv = NV > 0 ? NV : static_cast<int>(hd / VEC);
  f16v acc[G][CAP];
  for (int i = 0; i < G; ++i)
    for (int c = 0; c < nv; ++c) acc[i][c] = f16v{};
  for (int64_t j = 0; j < keys; ++j) {
    f16v x[CAP];
    for (int c = 0; c < nv; ++c) x[c] = load16(v + j * v_ld + c * VEC);
    for (int i = 0; i < G; ++i) {
      const f16v w = f16v{} + p[i * p_ld + j];
      for (int c = 0; c < nv; ++c) acc[i][c] = madd(w, x[c], acc[i][c]);
    }
  }
  for (int i = 0; i < G; ++i) {
    const float inv = denom[i] > 0.f ? 1.f / denom[i] : 0.f;
    alignas(64) float row[MAX_HEAD_DIM];
    for (int c = 0; c < nv; ++c) {
      const f16v y = acc[i][c] * inv;
      std::memcpy(row + c * VEC, &y, sizeof y);
    }
    for (int64_t d = 0; d < hd; ++d) out[i * out_ld + d] = static_cast<T>(row[d]);
  }
}

template <int NV, typename T>
void value_group(int64_t g, const float* p, int64_t p_ld, const T* v, int64_t v_ld, int64_t keys, int64_t hd,
                 const float* denom, T* out, int64_t out_ld) {
  switch (g) {
    case 1: return value_rows<1, NV>(p, p_ld, v, v_ld, keys, hd, denom, out, out_ld);
    case 2: return value_rows<2 <= ROWS_TOGETHER ? 2 : 1, NV>(p, p_ld, v, v_ld, keys, hd, denom, out, out_ld);
    case 3: return value_rows<3 <= ROWS_TOGETHER ? 3 : 1, NV>(p, p_ld, v, v_ld, keys, hd, denom, out, out_ld);
    default: return value_rows<ROWS_TOGETHER, NV>(p, p_ld, v, v_ld, keys, hd, denom, out, out_ld);
  }
}

void score_group(int64_t g, const float* q, int64_t hd, const float* keys, int64_t stride, float scale, float* s,
                 int64_t s_ld) {
  switch (g) {
    case 1: return score_rows<1>(q, hd, keys, stride, scale, s, s_ld);
    case 2: return score_rows<2 <= ROWS_TOGETHER ? 2 : 1>(q, hd, keys, stride, scale, s, s_ld);
    case 3: return score_rows<3 <= ROWS_TOGETHER ? 3 : 1>(q, hd, keys, stride, scale, s, s_ld);
    default: return score_rows<ROWS_TOGETHER>(q, hd, keys, stride, scale, s, s_ld);
  }
}

#if defined(__AVX512BF16__)
constexpr bool BF16_PAIRS = true;

// kt's BLOCK keys from key j0 (here of them, the rest zero) as pairs of the head dimension:
// pairs[i * BLOCK + l] = (k[2i][l], k[2i + 1][l]) as two bf16 halves of 32 bits (VDPBF16PS's layout)
void pair_keys(const c10::BFloat16* kbase, int64_t ks2, int64_t j0, int64_t here, int64_t hd, uint32_t* pairs) {
  for (int64_t i = 0; i < hd / 2; ++i) {
    const uint16_t* even = reinterpret_cast<const uint16_t*>(kbase + 2 * i * ks2 + j0);
    const uint16_t* odd = reinterpret_cast<const uint16_t*>(kbase + (2 * i + 1) * ks2 + j0);
    uint32_t* dst = pairs + i * BLOCK;
    if (here == BLOCK) {
      for (int64_t v = 0; v < BLOCK_VECS; ++v) {
        const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(even + v * VEC)));
        const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(odd + v * VEC)));
        _mm512_storeu_si512(dst + v * VEC, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
      continue;
    }
    for (int64_t l = 0; l < here; ++l) dst[l] = uint32_t(even[l]) | (uint32_t(odd[l]) << 16);
    for (int64_t l = here; l < BLOCK; ++l) dst[l] = 0;
  }
}

// scores of G rows against BLOCK paired keys: s[i][l] = scale * sum over pairs in order
template <int G>
void score_rows_paired(const uint32_t* q, int64_t half, const uint32_t* pairs, float scale, float* s, int64_t s_ld) {
  __m512 acc[G][BLOCK_VECS];
  for (int i = 0; i < G; ++i)
    for (int v = 0; v < BLOCK_VECS; ++v) acc[i][v] = _mm512_setzero_ps();
  for (int64_t d = 0; d < half; ++d) {
    __m512bh k[BLOCK_VECS];
    for (int v = 0; v < BLOCK_VECS; ++v) k[v] = (__m512bh)_mm512_loadu_si512(pairs + d * BLOCK + v * VEC);
    for (int i = 0; i < G; ++i) {
      const __m512bh qd = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(q[i * half + d]));
      for (int v = 0; v < BLOCK_VECS; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], qd, k[v]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int i = 0; i < G; ++i)
    for (int v = 0; v < BLOCK_VECS; ++v) _mm512_storeu_ps(s + i * s_ld + v * VEC, _mm512_mul_ps(acc[i][v], sc));
}

void score_group_paired(int64_t g, const uint32_t* q, int64_t half, const uint32_t* pairs, float scale, float* s,
                        int64_t s_ld) {
  switch (g) {
    case 1: return score_rows_paired<1>(q, half, pairs, scale, s, s_ld);
    case 2: return score_rows_paired<2>(q, half, pairs, scale, s, s_ld);
    case 3: return score_rows_paired<3>(q, half, pairs, scale, s, s_ld);
    default: return score_rows_paired<ROWS_TOGETHER>(q, half, pairs, scale, s, s_ld);
  }
}
#else
constexpr bool BF16_PAIRS = false;
#endif

// exp(x) for x <= 0 (scores minus their max), exactly 0 below -87. Cody-Waite reduction and
// Cephes' degree-6 polynomial (~2 ulp); n is a multiple of LANES, so no element takes a scalar tail.
void exp_nonpositive(float* __restrict x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i] > -87.f ? x[i] : -87.f;
    const float k = (v * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round to nearest (1.5 * 2^23)
    float r = v - k * 0.693359375f;
    r = r - k * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float z = r * r;
    p = p * z + r + 1.f;
    const float scale = __builtin_bit_cast(float, (static_cast<int32_t>(k) + 127) << 23);
    const float keep = x[i] > -87.f ? 1.f : 0.f;
    x[i] = p * scale * keep;
  }
}

// s[j] <- exp(s[j] - max_j s[j]) in place, n a multiple of 16: the max over 16 lanes, then across
// them (exact in any order). A row that sees nothing (all -inf) gets zeros.
void exp_shifted(float* s, int64_t n) {
  f16v m = f16v{} + NEG_INF;
  for (int64_t j = 0; j < n; j += VEC) {
    const f16v x = load16(s + j);
    m = x > m ? x : m;
  }
  float top = NEG_INF;
  for (int l = 0; l < VEC; ++l) top = m[l] > top ? m[l] : top;
  if (top == NEG_INF) top = 0.f;
  for (int64_t j = 0; j < n; ++j) s[j] -= top;
  exp_nonpositive(s, n);
}

// x[0] + ... + x[n-1], n a multiple of 16, in one fixed order: 16 lane sums (lane l: x[l], x[l + 16],
// ... in order), then the lanes added pairwise. Zeros after the last visible key change nothing, so
// the sum is over a row's visible keys listed in order: the caller lists them without gaps.
float lane_sum(const float* x, int64_t n) {
  f16v acc = f16v{};
  for (int64_t j = 0; j < n; j += VEC) acc = acc + load16(x + j);
  float lanes[VEC];
  std::memcpy(lanes, &acc, sizeof acc);
  for (int w = VEC / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
  return lanes[0];
}

// One request's keys and values: kt [heads, hd, width] and v [heads, width, hd] by their strides.
template <typename T>
struct Memory {
  const T* k;
  int64_t ks1, ks2;
  const T* v;
  int64_t vs1, vs2;
  int64_t width;
};

template <typename T>
Memory<T> memory_of(const at::Tensor& kt, const at::Tensor& v, int64_t b) {  // kt, v [n, ...]: request b
  return {kt.data_ptr<T>() + b * kt.stride(0), kt.stride(1), kt.stride(2),
          v.data_ptr<T>() + b * v.stride(0), v.stride(1), v.stride(2), v.size(2)};
}

template <typename T>
void attend(const at::Tensor& q, const std::vector<Memory<T>>& memories, const at::Tensor& limit,
            const c10::optional<at::Tensor>& mask, double scale_d, at::Tensor& out) {
  const int64_t n = q.size(0), heads = q.size(1), rows = q.size(2), hd = q.size(3);
  int64_t widest = 0;
  for (const auto& m : memories) widest = std::max(widest, m.width);
  const float scale = static_cast<float>(scale_d);
  const int64_t* lim = limit.data_ptr<int64_t>();  // [n, rows]
  const bool* mk = mask.has_value() ? mask->data_ptr<bool>() : nullptr;  // [n, rows, width] (one width)
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2), qs3 = q.stride(3);

  at::parallel_for(0, n * heads, 1, [&](int64_t begin, int64_t end) {
    const int64_t padded = (widest + BLOCK - 1) / BLOCK * BLOCK;
    // bf16 on AVX512-BF16 scores from q and key pairs; every other path from fp32 q and key blocks
    constexpr bool paired = BF16_PAIRS && std::is_same_v<T, c10::BFloat16>;
    std::vector<float> qf(paired ? 0 : rows * hd), block(paired ? 0 : hd * BLOCK);
    std::vector<uint32_t> qpairs(paired ? rows * hd / 2 : 0), kpairs(paired ? hd / 2 * BLOCK : 0);
    std::vector<float> scores(rows * padded), denom(rows), visible(padded);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / heads, h = item % heads;
      const Memory<T>& mem = memories[b];
      const int64_t width = mem.width, ks2 = mem.ks2, vs2 = mem.vs2;
      const int64_t* row_limit = lim + b * rows;
      int64_t longest = 0;
      for (int64_t r = 0; r < rows; ++r) {
        const T* src = qp + b * qs0 + h * qs1 + r * qs2;
        if constexpr (paired)
          for (int64_t i = 0; i < hd / 2; ++i)
            qpairs[r * hd / 2 + i] = uint32_t(src[2 * i * qs3].x) | (uint32_t(src[(2 * i + 1) * qs3].x) << 16);
        else
          for (int64_t d = 0; d < hd; ++d) qf[r * hd + d] = to_float(src[d * qs3]);
        longest = std::max(longest, std::min(row_limit[r], width));
      }
      const int64_t longest_padded = (longest + BLOCK - 1) / BLOCK * BLOCK;
      const T* kbase = mem.k + h * mem.ks1;
      // scores, BLOCK keys at a time (CHAINS independent accumulators of LANES keys, for throughput),
      // each key's score a sum over d in order. Whole float blocks read kt in place; bf16 blocks
      // and the last partial block go through a float copy, zero-padded (the same arithmetic), or
      // with AVX512-BF16 through a copy as pairs of d, zero-padded likewise.
      for (int64_t j0 = 0; j0 < longest_padded; j0 += BLOCK) {
#if defined(__AVX512BF16__)
        if constexpr (paired) {
          pair_keys(kbase, ks2, j0, std::min(BLOCK, longest - j0), hd, kpairs.data());
          for (int64_t r = 0; r < rows; r += ROWS_TOGETHER)
            score_group_paired(std::min(ROWS_TOGETHER, rows - r), qpairs.data() + r * hd / 2, hd / 2, kpairs.data(),
                               scale, scores.data() + r * padded + j0, padded);
          continue;
        }
#endif
        const float* keys = nullptr;
        int64_t stride = BLOCK;
        if constexpr (std::is_same_v<T, float>) {
          if (j0 + BLOCK <= longest) {
            keys = kbase + j0;
            stride = ks2;
          }
        }
        if (keys == nullptr) {
          const int64_t here = std::min(BLOCK, longest - j0);
          for (int64_t d = 0; d < hd; ++d) {
            const T* src = kbase + d * ks2 + j0;
            float* dst = block.data() + d * BLOCK;
            if (here == BLOCK) {
              for (int64_t v = 0; v < BLOCK_VECS; ++v) {
                const f16v x = load16(src + v * VEC);
                std::memcpy(dst + v * VEC, &x, sizeof x);
              }
              continue;
            }
            for (int64_t l = 0; l < here; ++l) dst[l] = to_float(src[l]);
            for (int64_t l = here; l < BLOCK; ++l) dst[l] = 0.f;
          }
          keys = block.data();
        }
        for (int64_t r = 0; r < rows; r += ROWS_TOGETHER)
          score_group(std::min(ROWS_TOGETHER, rows - r), qf.data() + r * hd, hd, keys, stride, scale,
                      scores.data() + r * padded + j0, padded);
      }
      // visibility, max, exp, denominator (longest_padded is a whole number of vectors)
      for (int64_t r = 0; r < rows; ++r) {
        float* s = scores.data() + r * padded;
        const int64_t lr = std::min(row_limit[r], width);
        if (mk != nullptr) {
          const bool* mrow = mk + (b * rows + r) * width;
          for (int64_t j = 0; j < lr; ++j)
            if (!mrow[j]) s[j] = NEG_INF;
        }
        for (int64_t j = lr; j < longest_padded; ++j) s[j] = NEG_INF;
        exp_shifted(s, longest_padded);
        if (mk == nullptr) {
          denom[r] = lane_sum(s, longest_padded);
        } else {  // a tree node: its visible keys without the hidden ones between them, as its chain has them
          const bool* mrow = mk + (b * rows + r) * width;
          int64_t count = 0;
          for (int64_t j = 0; j < lr; ++j)
            if (mrow[j]) visible[count++] = s[j];
          for (; count % VEC != 0; ++count) visible[count] = 0.f;
          denom[r] = lane_sum(visible.data(), count);
        }
      }
      // values: key by key in key order (lanes over d), ROWS_TOGETHER rows per pass over v
      const T* vbase = mem.v + h * mem.vs1;
      for (int64_t r = 0; r < rows; r += ROWS_TOGETHER) {
        const int64_t g = std::min(ROWS_TOGETHER, rows - r);
        T* o = op + ((b * heads + h) * rows + r) * hd;
        const float* p = scores.data() + r * padded;
        if (hd == 64)
          value_group<4>(g, p, padded, vbase, vs2, longest, hd, denom.data() + r, o, hd);
        else
          value_group<0>(g, p, padded, vbase, vs2, longest, hd, denom.data() + r, o, hd);
      }
    }
  });
}

at::Tensor row_attention(const at::Tensor& q, const at::Tensor& kt, const at::Tensor& v, const at::Tensor& limit,
                         const c10::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && kt.dim() == 4 && v.dim() == 4,
              "q [n, heads, rows, hd], kt [n, heads, hd, keys], v [n, heads, keys, hd]");
  TORCH_CHECK(q.device().is_cpu() && kt.device().is_cpu() && v.device().is_cpu(), "row_attention runs on CPU");
  TORCH_CHECK(q.scalar_type() == kt.scalar_type() && q.scalar_type() == v.scalar_type(), "q, kt, v dtypes differ");
  TORCH_CHECK(kt.stride(3) == 1 && v.stride(3) == 1, "kt must be contiguous over keys, v over head_dim");
  const int64_t n = q.size(0), heads = q.size(1), rows = q.size(2), hd = q.size(3);
  TORCH_CHECK(hd <= MAX_HEAD_DIM && hd % VEC == 0, "head_dim must be a multiple of 16 up to ", MAX_HEAD_DIM);
  TORCH_CHECK(kt.size(0) == n && kt.size(1) == heads && kt.size(2) == hd, "kt does not fit q");
  TORCH_CHECK(v.size(0) == n && v.size(1) == heads && v.size(3) == hd && v.size(2) == kt.size(3), "v does not fit kt");
  auto lim = limit.to(at::kLong).contiguous();
  TORCH_CHECK(lim.dim() == 2 && lim.size(0) == n && lim.size(1) == rows, "limit must be [n, rows]");
  c10::optional<at::Tensor> m;
  if (mask.has_value()) {
    m = mask->to(at::kBool).contiguous();
    TORCH_CHECK(m->dim() == 3 && m->size(0) == n && m->size(1) == rows && m->size(2) == v.size(2),
                "mask must be [n, rows, keys]");
  }
  auto out = at::empty({n, heads, rows, hd}, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (q.scalar_type() == at::kFloat) {
    std::vector<Memory<float>> memories;
    for (int64_t b = 0; b < n; ++b) memories.push_back(memory_of<float>(kt, v, b));
    attend<float>(q, memories, lim, m, scale, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    std::vector<Memory<c10::BFloat16>> memories;
    for (int64_t b = 0; b < n; ++b) memories.push_back(memory_of<c10::BFloat16>(kt, v, b));
    attend<c10::BFloat16>(q, memories, lim, m, scale, out);
  } else {
    TORCH_CHECK(false, "row_attention supports float32 and bfloat16, got ", q.scalar_type());
  }
  return out;
}

// The same attention with each request's keys and values in tensors of its own (kts[b] [heads, hd,
// width_b], vs[b] [heads, width_b, hd]): a server's decode step attends every request's encoder
// states, kept per request, in one call. Request b's rows are computed exactly as row_attention
// computes them: the same sequence of operations, only the addresses differ.
at::Tensor row_attention_each(const at::Tensor& q, at::TensorList kts, at::TensorList vs, const at::Tensor& limit,
                              double scale) {
  TORCH_CHECK(q.dim() == 4 && q.device().is_cpu(), "q [n, heads, rows, hd] on CPU");
  const int64_t n = q.size(0), heads = q.size(1), rows = q.size(2), hd = q.size(3);
  TORCH_CHECK(static_cast<int64_t>(kts.size()) == n && static_cast<int64_t>(vs.size()) == n,
              "one kt and one v per request");
  TORCH_CHECK(hd <= MAX_HEAD_DIM && hd % VEC == 0, "head_dim must be a multiple of 16 up to ", MAX_HEAD_DIM);
  for (int64_t b = 0; b < n; ++b) {
    const auto& kt = kts[b];
    const auto& v = vs[b];
    TORCH_CHECK(kt.dim() == 3 && v.dim() == 3 && kt.device().is_cpu() && v.device().is_cpu(),
                "kts[b] [heads, hd, keys], vs[b] [heads, keys, hd] on CPU");
    TORCH_CHECK(kt.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "q, kt, v dtypes differ");
    TORCH_CHECK(kt.stride(2) == 1 && v.stride(2) == 1, "kt must be contiguous over keys, v over head_dim");
    TORCH_CHECK(kt.size(0) == heads && kt.size(1) == hd && v.size(0) == heads && v.size(2) == hd &&
                    v.size(1) == kt.size(2), "kts[b] / vs[b] do not fit q");
  }
  auto lim = limit.to(at::kLong).contiguous();
  TORCH_CHECK(lim.dim() == 2 && lim.size(0) == n && lim.size(1) == rows, "limit must be [n, rows]");
  auto out = at::empty({n, heads, rows, hd}, q.options().memory_format(at::MemoryFormat::Contiguous));
  auto each = [&](auto tag) {
    using T = decltype(tag);
    std::vector<Memory<T>> memories;
    for (int64_t b = 0; b < n; ++b)
      memories.push_back({kts[b].data_ptr<T>(), kts[b].stride(0), kts[b].stride(1),
                          vs[b].data_ptr<T>(), vs[b].stride(0), vs[b].stride(1), vs[b].size(1)});
    attend<T>(q, memories, lim, c10::nullopt, scale, out);
  };
  if (q.scalar_type() == at::kFloat) {
    each(float{});
  } else if (q.scalar_type() == at::kBFloat16) {
    each(c10::BFloat16{});
  } else {
    TORCH_CHECK(false, "row_attention_each supports float32 and bfloat16, got ", q.scalar_type());
  }
  return out;
}

// Which arithmetic this build scores keys with (tests check each CPU class gets its own).
std::string row_attention_path(bool bfloat16) {
#if defined(__AVX512F__)
  const std::string fma = "avx512 fma";
#elif defined(__AVX2__) && defined(__FMA__)
  const std::string fma = "avx2 fma";
#else
  const std::string fma = "vector multiply-add";
#endif
  if (!bfloat16) return fma;
  return BF16_PAIRS ? "avx512-bf16 dot products" : fma + " over widened bf16";
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(whisper_flash, m) {
  m.def("row_attention_path(bool bfloat16) -> str", &row_attention_path);
  m.def("row_attention(Tensor q, Tensor kt, Tensor v, Tensor limit, Tensor? mask, float scale) -> Tensor");
  m.def("row_attention_each(Tensor q, Tensor[] kts, Tensor[] vs, Tensor limit, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(whisper_flash, CPU, m) {
  m.impl("row_attention", &row_attention);
  m.impl("row_attention_each", &row_attention_each);
}
