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
// the same vector code: buffers are padded to whole vectors); the denominator summed key by key;
// the values accumulated key by key (lanes over d); one division at the end. fp32 accumulation for
// float32 and bfloat16 inputs alike. Work is split over (b, h) only.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <limits>
#include <vector>

namespace {

constexpr int64_t LANES = 8;
constexpr int64_t BLOCK = 8 * LANES;  // keys scored together (8 independent vector accumulators)
constexpr int64_t MAX_HEAD_DIM = 256;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

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
    std::vector<float> qf(rows * hd), scores(rows * padded), block(hd * BLOCK), denom(rows);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / heads, h = item % heads;
      const Memory<T>& mem = memories[b];
      const int64_t width = mem.width, ks2 = mem.ks2, vs2 = mem.vs2;
      const int64_t* row_limit = lim + b * rows;
      int64_t longest = 0;
      for (int64_t r = 0; r < rows; ++r) {
        const T* src = qp + b * qs0 + h * qs1 + r * qs2;
        for (int64_t d = 0; d < hd; ++d) qf[r * hd + d] = to_float(src[d * qs3]);
        longest = std::max(longest, std::min(row_limit[r], width));
      }
      const int64_t longest_padded = (longest + BLOCK - 1) / BLOCK * BLOCK;
      const T* kbase = mem.k + h * mem.ks1;
      // scores, BLOCK keys at a time (CHAINS independent accumulators of LANES keys, for throughput),
      // each key's score a sum over d in order. Whole float blocks read kt in place; bf16 blocks
      // and the last partial block go through a float copy, zero-padded (the same arithmetic).
      for (int64_t j0 = 0; j0 < longest_padded; j0 += BLOCK) {
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
            for (int64_t l = 0; l < here; ++l) dst[l] = to_float(src[l]);
            for (int64_t l = here; l < BLOCK; ++l) dst[l] = 0.f;
          }
          keys = block.data();
        }
        for (int64_t r = 0; r < rows; ++r) {
          float acc[BLOCK];
          for (int64_t l = 0; l < BLOCK; ++l) acc[l] = 0.f;
          const float* qr = qf.data() + r * hd;
          for (int64_t d = 0; d < hd; ++d) {
            const float qd = qr[d];
            const float* kd = keys + d * stride;
            for (int64_t l = 0; l < BLOCK; ++l) acc[l] += qd * kd[l];
          }
          float* s = scores.data() + r * padded + j0;
          for (int64_t l = 0; l < BLOCK; ++l) s[l] = acc[l] * scale;
        }
      }
      // visibility, max, exp, denominator
      for (int64_t r = 0; r < rows; ++r) {
        float* s = scores.data() + r * padded;
        const int64_t lr = std::min(row_limit[r], width);
        const bool* mrow = mk == nullptr ? nullptr : mk + (b * rows + r) * width;
        for (int64_t j = 0; j < longest_padded; ++j)
          if (j >= lr || (mrow != nullptr && !mrow[j])) s[j] = NEG_INF;
        float top = NEG_INF;
        for (int64_t j = 0; j < longest_padded; ++j) top = s[j] > top ? s[j] : top;
        if (top == NEG_INF) top = 0.f;  // a row that sees nothing gets zeros
        for (int64_t j = 0; j < longest_padded; ++j) s[j] -= top;
        exp_nonpositive(s, longest_padded);
        float sum = 0.f;
        for (int64_t j = 0; j < longest_padded; ++j) sum += s[j];
        denom[r] = sum;
      }
      // values: key by key in key order (lanes over d), two rows per pass over v
      const T* vbase = mem.v + h * mem.vs1;
      for (int64_t r0 = 0; r0 < rows; r0 += 2) {
        const bool pair = r0 + 1 < rows;
        float acc0[MAX_HEAD_DIM], acc1[MAX_HEAD_DIM];
        for (int64_t d = 0; d < hd; ++d) acc0[d] = acc1[d] = 0.f;
        const float* p0 = scores.data() + r0 * padded;
        const float* p1 = pair ? p0 + padded : p0;
        for (int64_t j = 0; j < longest; ++j) {
          const float w0 = p0[j], w1 = p1[j];
          const T* vj = vbase + j * vs2;
          for (int64_t d = 0; d < hd; ++d) {
            const float x = to_float(vj[d]);
            acc0[d] += w0 * x;
            acc1[d] += w1 * x;
          }
        }
        for (int64_t r = r0; r < r0 + (pair ? 2 : 1); ++r) {
          const float* a = r == r0 ? acc0 : acc1;
          T* o = op + ((b * heads + h) * rows + r) * hd;
          const float inv = denom[r] > 0.f ? 1.f / denom[r] : 0.f;
          for (int64_t d = 0; d < hd; ++d) o[d] = static_cast<T>(a[d] * inv);
        }
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
  TORCH_CHECK(hd <= MAX_HEAD_DIM, "head_dim above ", MAX_HEAD_DIM);
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
  TORCH_CHECK(hd <= MAX_HEAD_DIM, "head_dim above ", MAX_HEAD_DIM);
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(whisper_flash, m) {
  m.def("row_attention(Tensor q, Tensor kt, Tensor v, Tensor limit, Tensor? mask, float scale) -> Tensor");
  m.def("row_attention_each(Tensor q, Tensor[] kts, Tensor[] vs, Tensor limit, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(whisper_flash, CPU, m) {
  m.impl("row_attention", &row_attention);
  m.impl("row_attention_each", &row_attention_each);
}
