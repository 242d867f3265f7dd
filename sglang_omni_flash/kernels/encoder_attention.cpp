// Whisper's encoder self-attention in bfloat16 on VDPBF16PS (sglang_omni_flash.kernels.encoder_attention).
//
// out[b, t, h] = sum_j softmax_j(scale * q[b, h, t] . k[b, h, j]) v[b, h, j] over every key j: no mask,
// no causality (a 30 s window attends to all of its 1,500 frames).
//
// Why a kernel of our own: on a CPU with AVX512-BF16 but no AMX, torch's flash attention runs bf16
// at its fp32 speed (2-core EPYC, 8 heads x 1,500 x 1,500 x 64: 31 ms in bf16, 30 ms in fp32, while a
// bf16 linear there runs at 2.1x fp32's rate), and it was half of a bf16 encoder window. Here both
// products run on VDPBF16PS, which multiplies pairs of bf16 exactly and adds them into fp32.
//
// Numerics, one fixed sequence per output row (whatever the thread count, computed by one thread):
//   scores   fp32 sums over pairs of the head dimension in order, d = 0, 2, .., hd - 2, times scale;
//   softmax  the row's max over all keys; exp(s - max) in fp32 (one polynomial, every element through
//            the same vector code); the denominator as 16 lane sums over keys in order, the lanes then
//            added in a fixed order;
//   values   the exponentials rounded to bf16 (nearest even) and multiplied with the values on
//            VDPBF16PS over pairs of keys in order (fp32 sums); divided once by the fp32 denominator,
//            rounded to bf16 once.
// The probabilities meet the values in bf16 (they are in [0, 1]: a relative error of at most 2^-9
// each); scores and sums stay fp32 throughout.
//
// Built only where the compiler targets AVX512-BF16; elsewhere `encoder_attention_built()` is false
// and callers keep torch's attention.

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
#include <limits>
#include <vector>

namespace {

#if defined(__AVX512BF16__)
constexpr int64_t VEC = 16;          // fp32 lanes of a zmm; keys per score block
constexpr int64_t ROWS = 16;         // query rows computed together (16 accumulators)
constexpr int64_t MAX_HEAD_DIM = 128;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }
inline __m512i broadcast32(const uint32_t* p) { return _mm512_set1_epi32(static_cast<int32_t>(*p)); }

// One (b, h)'s keys and values in VDPBF16PS's layouts, keys padded with zeros to whole blocks of 16:
//   kpairs[blk][i][l] = (k[16 blk + l][2i], k[16 blk + l][2i + 1])      (pairs of the head dimension)
//   vpairs[i][d]      = (v[2i][d], v[2i + 1][d])                        (pairs of keys)
void pack_head(const c10::BFloat16* k, int64_t k_ld, const c10::BFloat16* v, int64_t v_ld, int64_t keys,
               int64_t padded, int64_t hd, uint32_t* kpairs, uint32_t* vpairs) {
  const int64_t half = hd / 2;
  for (int64_t blk = 0; blk < padded / VEC; ++blk)
    for (int64_t l = 0; l < VEC; ++l) {
      const int64_t j = blk * VEC + l;
      for (int64_t i = 0; i < half; ++i) {
        uint32_t pair = 0;
        if (j < keys) std::memcpy(&pair, k + j * k_ld + 2 * i, sizeof pair);  // k[j][2i] low, k[j][2i+1] high
        kpairs[(blk * half + i) * VEC + l] = pair;
      }
    }
  for (int64_t i = 0; i < padded / 2; ++i) {
    const int64_t j = 2 * i;
    for (int64_t d = 0; d < hd; ++d) {
      const uint16_t even = j < keys ? c10::bit_cast<uint16_t>(v[j * v_ld + d]) : 0;
      const uint16_t odd = j + 1 < keys ? c10::bit_cast<uint16_t>(v[(j + 1) * v_ld + d]) : 0;
      vpairs[i * hd + d] = uint32_t(even) | (uint32_t(odd) << 16);
    }
  }
}

// s[r][16 blk + l] = scale * q[r] . k[16 blk + l] for R rows and every key block, pairs in order.
// q: R rows of `half` pairs (rows past the real ones are zeros).
template <int R>
void score_block_rows(const uint32_t* q, int64_t half, const uint32_t* kpairs, int64_t blocks, float scale,
                      float* s, int64_t s_ld) {
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t blk = 0; blk < blocks; ++blk) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    const uint32_t* kb = kpairs + blk * half * VEC;
    for (int64_t i = 0; i < half; ++i) {
      const __m512bh kv = as_bh(_mm512_loadu_si512(kb + i * VEC));
      for (int r = 0; r < R; ++r) acc[r] = _mm512_dpbf16_ps(acc[r], as_bh(broadcast32(q + r * half + i)), kv);
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(s + r * s_ld + blk * VEC, _mm512_mul_ps(acc[r], sc));
  }
}

// exp(x) for x <= 0, exactly 0 below -87: Cody-Waite reduction and Cephes' degree-6 polynomial
// (~2 ulp), 16 lanes, the same steps as kernels/row_attention.cpp's scalar-looped version.
inline __m512 exp_nonpositive16(__m512 x) {
  const __m512 floor87 = _mm512_set1_ps(-87.f);
  const __mmask16 keep = _mm512_cmp_ps_mask(x, floor87, _CMP_GT_OQ);
  const __m512 v = _mm512_max_ps(x, floor87);
  const __m512 shifter = _mm512_set1_ps(12582912.f);
  const __m512 k = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f)), shifter),
                                 shifter);
  __m512 r = _mm512_sub_ps(v, _mm512_mul_ps(k, _mm512_set1_ps(0.693359375f)));
  r = _mm512_sub_ps(r, _mm512_mul_ps(k, _mm512_set1_ps(-2.12194440e-4f)));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mov_ps(keep, _mm512_mul_ps(p, _mm512_castsi512_ps(e)));
}

// One row: s (padded keys, those past `keys` ignored) -> probabilities in bf16 (p, padded keys 0),
// returns the fp32 denominator.
float softmax_row(float* s, int64_t keys, int64_t padded, c10::BFloat16* p) {
  const int64_t whole = keys / VEC * VEC;
  const __mmask16 tail = static_cast<__mmask16>((1u << (keys - whole)) - 1u);
  __m512 m = _mm512_set1_ps(NEG_INF);
  for (int64_t j = 0; j < whole; j += VEC) m = _mm512_max_ps(m, _mm512_loadu_ps(s + j));
  if (tail) m = _mm512_mask_max_ps(m, tail, m, _mm512_loadu_ps(s + whole));
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(m));  // a max: exact in any order
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < padded; j += VEC) {
    const __mmask16 here = j < whole ? __mmask16(0xFFFF) : (j == whole ? tail : __mmask16(0));
    const __m512 e = _mm512_maskz_mov_ps(here, exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(s + j), top)));
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), (__m256i)_mm512_cvtneps_pbh(e));
  }
  alignas(64) float lanes[VEC];
  _mm512_store_ps(lanes, sum);
  float total = 0.f;
  for (int l = 0; l < VEC; ++l) total += lanes[l];  // lanes in order
  return total;
}

// out[r][16 c + l] for R rows, one 16-wide column block c of the head: sum over key pairs in order
// of p[r][pair] . vpairs[pair][16 c + l], then / denom[r], rounded to bf16.
template <int R>
void value_block_rows(const c10::BFloat16* p, int64_t p_ld, const uint32_t* vpairs, int64_t pairs, int64_t hd,
                      int64_t c, const float* denom, int64_t rows, c10::BFloat16* out, int64_t out_ld) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const uint32_t* vb = vpairs + c * VEC;
  for (int64_t i = 0; i < pairs; ++i) {
    const __m512bh vv = as_bh(_mm512_loadu_si512(vb + i * hd));
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_dpbf16_ps(acc[r], as_bh(broadcast32(reinterpret_cast<const uint32_t*>(p + r * p_ld) + i)), vv);
  }
  for (int r = 0; r < R && r < rows; ++r) {
    const __m512 y = _mm512_div_ps(acc[r], _mm512_set1_ps(denom[r]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * out_ld + c * VEC), (__m256i)_mm512_cvtneps_pbh(y));
  }
}
#endif

bool encoder_attention_built() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// q, k, v: [B, H, T, hd] bf16 (any strides, hd contiguous) -> [B, T, H, hd] bf16 contiguous (the layout
// both transformers' and sglang-omni's encoders reshape into [B, T, d] next).
at::Tensor encoder_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
#if !defined(__AVX512BF16__)
  TORCH_CHECK(false, "encoder_attention: this build has no AVX512-BF16");
  return q;
#else
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "encoder_attention: q, k, v must be [B, H, T, hd]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16, "encoder_attention: bfloat16 only");
  const int64_t batch = q.size(0), heads = q.size(1), rows = q.size(2), hd = q.size(3), keys = k.size(2);
  TORCH_CHECK(k.size(0) == batch && v.size(0) == batch && k.size(1) == heads && v.size(1) == heads &&
                  v.size(2) == keys && k.size(3) == hd && v.size(3) == hd, "encoder_attention: shapes differ");
  TORCH_CHECK(hd % VEC == 0 && hd <= MAX_HEAD_DIM && keys > 0, "encoder_attention: head dim must be a multiple of 16");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "encoder_attention: head dim not contiguous");
  const int64_t half = hd / 2, padded = (keys + VEC - 1) / VEC * VEC, blocks = padded / VEC;
  const auto* qp = q.data_ptr<c10::BFloat16>();
  const auto* kp = k.data_ptr<c10::BFloat16>();
  const auto* vp = v.data_ptr<c10::BFloat16>();
  at::Tensor out = at::empty({batch, rows, heads, hd}, q.options());
  auto* op = out.data_ptr<c10::BFloat16>();

  // every (b, h)'s keys and values packed once, then (b, h, row block) items over the threads
  std::vector<uint32_t> kpairs(static_cast<size_t>(batch * heads * padded * half));
  std::vector<uint32_t> vpairs(static_cast<size_t>(batch * heads * padded / 2 * hd));
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / heads, h = bh % heads;
      pack_head(kp + b * k.stride(0) + h * k.stride(1), k.stride(2), vp + b * v.stride(0) + h * v.stride(1),
                v.stride(2), keys, padded, hd, kpairs.data() + bh * padded * half,
                vpairs.data() + bh * padded / 2 * hd);
    }
  });
  const int64_t row_blocks = (rows + ROWS - 1) / ROWS;
  at::parallel_for(0, batch * heads * row_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(static_cast<size_t>(ROWS * padded));
    std::vector<c10::BFloat16> p(static_cast<size_t>(ROWS * padded));
    alignas(64) uint32_t qpairs[ROWS * MAX_HEAD_DIM / 2];
    float denom[ROWS];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t bh = item / row_blocks, r0 = item % row_blocks * ROWS;
      const int64_t b = bh / heads, h = bh % heads, here = std::min<int64_t>(ROWS, rows - r0);
      for (int64_t r = 0; r < ROWS; ++r) {
        if (r < here)
          std::memcpy(qpairs + r * half, qp + b * q.stride(0) + h * q.stride(1) + (r0 + r) * q.stride(2),
                      hd * sizeof(c10::BFloat16));
        else
          std::memset(qpairs + r * half, 0, hd * sizeof(c10::BFloat16));
      }
      score_block_rows<ROWS>(qpairs, half, kpairs.data() + bh * padded * half, blocks, static_cast<float>(scale),
                             s.data(), padded);
      for (int64_t r = 0; r < here; ++r) denom[r] = softmax_row(s.data() + r * padded, keys, padded, p.data() + r * padded);
      for (int64_t r = here; r < ROWS; ++r) std::memset(p.data() + r * padded, 0, padded * sizeof(c10::BFloat16));
      c10::BFloat16* o = op + (b * rows + r0) * heads * hd + h * hd;
      for (int64_t c = 0; c < hd / VEC; ++c)
        value_block_rows<ROWS>(p.data(), padded, vpairs.data() + bh * padded / 2 * hd, padded / 2, hd, c, denom,
                               here, o, heads * hd);
    }
  });
  return out;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(whisper_flash, m) {
  m.def("encoder_attention_built() -> bool", &encoder_attention_built);
  m.def("encoder_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(whisper_flash, CPU, m) { m.impl("encoder_attention", &encoder_attention); }
