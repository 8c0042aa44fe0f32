// The linear layers of the decode step (tdutils/engines/packed.py): y = x W^T + b for a few rows x (the decode
// batch), bound by how fast W streams from memory. The weight is packed once into column panels, so one panel is
// one sequential stream and every weight is read once per call, at memory speed. T = float32 or bfloat16:
//
// pack_linear(w) -> packed: w [N, K] T (contiguous) -> panels of 64 output columns, the columns past N zero:
//   float32:  [ceil(N / 64), K, 64],       packed[c, k, j] = w[64 c + j, k];
//   bfloat16: [ceil(N / 64), K / 2, 128],  packed[c, p, 2 j + i] = w[64 c + j, 2 p + i] (pairs of k; K even).
// linear_out(x, packed, bias, out): x [M, K] T (contiguous), bias [N] T or None, out [M, N] T (contiguous),
//   written here; out[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]) in fp32 (float32: fused multiply-adds;
//   bfloat16: AVX512-BF16 dot products of pairs, each product exact), in blocks of 16 values of k, then the
//   blocks' sums (an error against fp64 of the size of F.linear's), + bias in fp32, rounded once to T.
// linear_native(w) -> bool: whether this build computes w's dtype (float32: AVX-512; bfloat16: AVX512-BF16);
//   without it the engine keeps oneDNN.
//
// Work: panels spread over torch's threads (at::parallel_for); within a panel, blocks of 4 rows keep 4 x 64
// accumulators in registers (each row of x broadcast per k, or per pair of k) while the panel streams past once.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t PANEL = 64;  // output columns per panel: 4 AVX-512 registers
constexpr int64_t KBLOCK = 16;  // values of k per partial sum (16: within 2e-5 of F.linear on the tiny model's logits)

inline float as_float(float v) { return v; }
inline float as_float(c10::BFloat16 v) { return static_cast<float>(v); }

at::Tensor pack_linear(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() &&
                  (w.scalar_type() == at::kFloat || (w.scalar_type() == at::kBFloat16 && w.size(1) % 2 == 0)),
              "w must be contiguous float32 [N, K], or bfloat16 [N, K] with K even");
  const int64_t N = w.size(0), K = w.size(1), C = (N + PANEL - 1) / PANEL;
  const int64_t pair = w.scalar_type() == at::kBFloat16 ? 2 : 1;  // values of k side by side per column
  at::Tensor packed = at::zeros({C, K / pair, PANEL * pair}, w.options());
  const int64_t es = w.element_size();
  const char* src = static_cast<const char*>(w.data_ptr());
  char* dst = static_cast<char*>(packed.data_ptr());
  at::parallel_for(0, C, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c)
      for (int64_t j = 0; j < PANEL && c * PANEL + j < N; ++j)
        for (int64_t k = 0; k < K; ++k)  // column j, value k: row k / pair, slot j * pair + k % pair of the panel
          std::memcpy(dst + ((c * (K / pair) + k / pair) * PANEL * pair + j * pair + k % pair) * es,
                      src + ((c * PANEL + j) * K + k) * es, es);
  });
  return packed;
}

#if defined(__AVX512F__)
// rows m0 .. m0 + MR of x against k0 .. k1 of one panel, added into total[m - m0] (64 floats per row)
template <int MR>
inline void panel_block(const float* x, int64_t K, const float* panel, int64_t k0, int64_t k1, float* total) {
  __m512 acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < 4; ++c) acc[m][c] = _mm512_setzero_ps();
  for (int64_t k = k0; k < k1; ++k) {
    const float* w = panel + k * PANEL;
    // 16 panel rows (4 KiB) ahead: the hardware prefetcher alone left the stream at ~11 GB/s on one core
    for (int c = 0; c < 4; ++c) _mm_prefetch((const char*)(w + 16 * PANEL) + 64 * c, _MM_HINT_T0);
    const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16), w2 = _mm512_loadu_ps(w + 32),
                 w3 = _mm512_loadu_ps(w + 48);
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m * K + k]);
      acc[m][0] = _mm512_fmadd_ps(xv, w0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(xv, w1, acc[m][1]);
      acc[m][2] = _mm512_fmadd_ps(xv, w2, acc[m][2]);
      acc[m][3] = _mm512_fmadd_ps(xv, w3, acc[m][3]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < 4; ++c)
      _mm512_storeu_ps(total + m * PANEL + 16 * c, _mm512_add_ps(_mm512_loadu_ps(total + m * PANEL + 16 * c), acc[m][c]));
}

#if defined(__AVX512BF16__)
// the bf16 form of panel_block: pairs p0 .. p1 of k, each row's pair of x broadcast as one 32-bit lane
template <int MR>
inline void panel_block(const c10::BFloat16* x, int64_t K, const c10::BFloat16* panel, int64_t p0, int64_t p1,
                        float* total) {
  __m512 acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < 4; ++c) acc[m][c] = _mm512_setzero_ps();
  for (int64_t p = p0; p < p1; ++p) {
    const c10::BFloat16* w = panel + p * 2 * PANEL;
    for (int c = 0; c < 4; ++c) _mm_prefetch((const char*)(w + 16 * 2 * PANEL) + 64 * c, _MM_HINT_T0);
    __m512bh wc[4];
    for (int c = 0; c < 4; ++c) wc[c] = (__m512bh)_mm512_loadu_si512(w + 32 * c);
    for (int m = 0; m < MR; ++m) {
      int32_t xy;
      std::memcpy(&xy, x + m * K + 2 * p, sizeof xy);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(xy);
      for (int c = 0; c < 4; ++c) acc[m][c] = _mm512_dpbf16_ps(acc[m][c], xv, wc[c]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < 4; ++c)
      _mm512_storeu_ps(total + m * PANEL + 16 * c, _mm512_add_ps(_mm512_loadu_ps(total + m * PANEL + 16 * c), acc[m][c]));
}
#endif

// every row of x against one panel: out[m, 0:ncols] = x[m] . panel (+ bias). The panel streams from memory once:
// blocks of KBLOCK values of k (4 KiB of panel, in L1) are taken by every block of 4 rows in turn, and summed
// apart, the blocks' sums then added up: a rounding error that grows like K / KBLOCK + KBLOCK rather than K (one
// running sum gave 3-5x F.linear's error against fp64 at K = 576..1536)
template <typename T>
inline void panel_rows(const T* x, int64_t M, int64_t K, const T* panel, const T* bias, T* out, int64_t N,
                       int64_t ncols, float* total) {
  constexpr int64_t pair = sizeof(T) == 2 ? 2 : 1;
  const int64_t rows = K / pair, step = KBLOCK / pair;  // panel rows (values of k, or pairs), per block
  std::fill(total, total + M * PANEL, 0.0f);
  for (int64_t k0 = 0; k0 < rows; k0 += step) {
    const int64_t k1 = rows - k0 < step ? rows : k0 + step;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) panel_block<4>(x + m * K, K, panel, k0, k1, total + m * PANEL);
    switch (M - m) {
      case 3: panel_block<3>(x + m * K, K, panel, k0, k1, total + m * PANEL); break;
      case 2: panel_block<2>(x + m * K, K, panel, k0, k1, total + m * PANEL); break;
      case 1: panel_block<1>(x + m * K, K, panel, k0, k1, total + m * PANEL); break;
      default: break;
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    const float* t = total + m * PANEL;
    T* o = out + m * N;
    for (int64_t j = 0; j < ncols; ++j) o[j] = static_cast<T>(bias != nullptr ? t[j] + as_float(bias[j]) : t[j]);
  }
}
#endif

bool linear_native(const at::Tensor& w) {
#if defined(__AVX512F__)
  if (w.scalar_type() == at::kFloat) return true;
#endif
#if defined(__AVX512BF16__)
  if (w.scalar_type() == at::kBFloat16) return true;
#endif
  return false;
}

template <typename T>
void linear_rows(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), C = packed.size(0), pair = sizeof(T) == 2 ? 2 : 1;
  const T* bp = bias.has_value() ? bias->data_ptr<T>() : nullptr;
  const T* xp = x.data_ptr<T>();
  const T* wp = packed.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, C, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> total(M * PANEL);
    for (int64_t c = begin; c < end; ++c) {
      const int64_t n0 = c * PANEL, ncols = N - n0 < PANEL ? N - n0 : PANEL;
      panel_rows<T>(xp, M, K, wp + c * K * PANEL, bp == nullptr ? nullptr : bp + n0, op + n0, N, ncols,
                    total.data());
    }
  });
  (void)pair;
}

void linear_out(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                at::Tensor& out) {
  const auto T = x.scalar_type();
  TORCH_CHECK(linear_native(x), "linear_out: this build has no kernel for ", x.scalar_type(),
              " (linear_native is False; float32 needs AVX-512, bfloat16 AVX512-BF16)");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be contiguous [M, K]");
  const int64_t pair = T == at::kBFloat16 ? 2 : 1;
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == T && packed.is_contiguous() &&
                  packed.size(1) * pair == x.size(1) && packed.size(2) == PANEL * pair,
              "packed must be pack_linear's panels, in x's dtype, for x's K");
  const int64_t M = x.size(0), N = out.size(1), C = packed.size(0);
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == T && out.is_contiguous() && out.size(0) == M &&
                  (N + PANEL - 1) / PANEL == C,
              "out must be contiguous [M, N] in x's dtype, with N the packed weight's rows");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == T && bias->is_contiguous() && bias->numel() == N, "bias: [N] in x's dtype");
#if defined(__AVX512F__)
  if (T == at::kFloat) return linear_rows<float>(x, packed, bias, out);
#endif
#if defined(__AVX512BF16__)
  if (T == at::kBFloat16) return linear_rows<c10::BFloat16>(x, packed, bias, out);
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tdutils_kernels, m) {
  m.def("pack_linear(Tensor w) -> Tensor");
  m.def("linear_out(Tensor x, Tensor packed, Tensor? bias, Tensor(a!) out) -> ()");
  m.def("linear_native(Tensor w) -> bool");
}

TORCH_LIBRARY_IMPL(tdutils_kernels, CPU, m) {
  m.impl("pack_linear", &pack_linear);
  m.impl("linear_out", &linear_out);
  m.impl("linear_native", &linear_native);
}
