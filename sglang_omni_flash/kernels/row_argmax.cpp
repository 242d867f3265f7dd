// torch.argmax over the last dimension of logits rows, fast on a CPU (sglang_omni_flash.kernels.argmax).
//
// Why a kernel of our own: every greedy token, plain or speculative, is an argmax over Whisper's
// 51,865 columns, and a round takes it on all its verify rows (72 at batch 8). torch's CPU argmax
// scans element by element with an index per compare: 3 ms for 72 float32 rows and 7 ms in bfloat16
// on a 2-core EPYC, against 0.4 ms for their max alone. Here a row is read twice at vector speed:
// its maximum (and whether it holds a NaN), then the first column equal to it.
//
// The result is torch.argmax's, index for index (tests/test_row_argmax.py checks it), because the
// plain server picks with torch's own argmax and a speculative round must pick the same token:
// - the first maximal column wins a tie (-0.0 and +0.0 are equal, as for torch's `>`);
// - a NaN beats every number, and the first NaN wins;
// - a row of -inf gives column 0.
// bfloat16 values are widened to float32 exactly, so they compare as torch compares them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

// 16 floats as GCC vector extensions (one zmm with AVX-512, two ymm with AVX2, four xmm otherwise)
typedef float f16v __attribute__((vector_size(64)));
typedef int32_t i16v __attribute__((vector_size(64)));
typedef uint32_t u16v __attribute__((vector_size(64)));
typedef uint16_t h16v __attribute__((vector_size(32)));
constexpr int64_t VEC = 16;

inline f16v load16(const float* p) {
  f16v out;
  std::memcpy(&out, p, sizeof(out));
  return out;
}

inline f16v load16(const c10::BFloat16* p) {  // bf16 -> fp32 is exact: the bits move up 16 places
  h16v half;
  std::memcpy(&half, p, sizeof(half));
  u16v wide = __builtin_convertvector(half, u16v) << 16;
  f16v out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

inline float value(float x) { return x; }
inline float value(c10::BFloat16 x) { return static_cast<float>(x); }

inline bool any(i16v mask) {
  int32_t acc = 0;
  for (int i = 0; i < VEC; ++i) acc |= mask[i];
  return acc != 0;
}

template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // pass 1: the maximum, and whether any NaN is present (a NaN compares false with everything)
  f16v best = f16v{} + neg_inf;
  i16v nan = i16v{};
  int64_t j = 0;
  for (; j + VEC <= n; j += VEC) {
    f16v v = load16(x + j);
    nan |= (v != v);
    best = v > best ? v : best;
  }
  float top = neg_inf;
  bool has_nan = any(nan);
  for (int i = 0; i < VEC; ++i) top = best[i] > top ? best[i] : top;
  for (; j < n; ++j) {
    float v = value(x[j]);
    has_nan |= (v != v);
    top = v > top ? v : top;
  }
  // pass 2: the first column equal to the maximum (or the first NaN)
  for (j = 0; j + VEC <= n; j += VEC) {
    f16v v = load16(x + j);
    i16v hit = has_nan ? (v != v) : (v == top);
    if (any(hit)) {
      for (int i = 0; i < VEC; ++i)
        if (hit[i]) return j + i;
    }
  }
  for (; j < n; ++j) {
    float v = value(x[j]);
    if (has_nan ? (v != v) : (v == top)) return j;
  }
  return 0;  // n == 0 is refused by the caller; unreachable otherwise
}

at::Tensor row_argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu(), "row_argmax runs on CPU tensors");
  TORCH_CHECK(logits.dim() >= 1 && logits.size(-1) > 0, "row_argmax needs a non-empty last dimension");
  auto x = logits.contiguous();
  const int64_t n = x.size(-1);
  const int64_t rows = x.numel() / n;
  auto sizes = x.sizes().vec();
  sizes.pop_back();
  auto out = at::empty(sizes, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* base = x.data_ptr<T>();
    // a row is ~100 us of work at most: split rows over threads only where there are several
    at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) o[r] = argmax_row<T>(base + r * n, n);
    });
  };
  if (x.scalar_type() == at::kFloat) {
    run(float{});
  } else if (x.scalar_type() == at::kBFloat16) {
    run(c10::BFloat16{});
  } else {
    TORCH_CHECK(false, "row_argmax supports float32 and bfloat16, got ", x.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(whisper_flash, m) {
  m.def("row_argmax(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(whisper_flash, CPU, m) {
  m.impl("row_argmax", &row_argmax);
}
