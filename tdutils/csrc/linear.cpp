// The fp32 linear layers of the decode step (tdutils/engines/packed.py): y = x W^T + b for a few rows x (the decode
// batch), bound by how fast W streams from memory. The weight is packed once into column panels, so one panel is
// one sequential stream and every weight is read once per call, at memory speed:
//
// pack_linear_fp32(w) -> packed: w [N, K] float32 (contiguous) -> [ceil(N / 64), K, 64] float32, the columns past N
//   zero; packed[c, k, j] = w[64 c + j, k].
// linear_fp32_out(x, packed, bias, out): x [M, K] float32 (contiguous), bias [N] float32 or None,
//   out [M, N] float32 (contiguous), written here; out[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]), with fused
//   multiply-adds in blocks of 16 values of k, then the blocks' sums (a float summation order of its own: its
//   error against fp64 is of the size of F.linear's).
// linear_fp32_native() -> bool: whether this build has the AVX-512 path (without it the engine keeps oneDNN).
//
// Work: panels of 64 columns spread over torch's threads (at::parallel_for); within a panel, blocks of 4 rows keep
// 4 x 64 accumulators in registers (each row of x broadcast per k) while the panel streams past once.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

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

at::Tensor pack_linear_fp32(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous(), "w must be contiguous float32 [N, K]");
  const int64_t N = w.size(0), K = w.size(1), C = (N + PANEL - 1) / PANEL;
  at::Tensor packed = at::zeros({C, K, PANEL}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, C, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c)
      for (int64_t j = 0; j < PANEL && c * PANEL + j < N; ++j) {
        const float* row = src + (c * PANEL + j) * K;
        for (int64_t k = 0; k < K; ++k) dst[(c * K + k) * PANEL + j] = row[k];
      }
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

// every row of x against one panel: out[m, 0:ncols] = x[m] . panel (+ bias). The panel streams from memory once:
// blocks of KBLOCK values of k (4 KiB of panel, in L1) are taken by every block of 4 rows in turn, and summed
// apart, the blocks' sums then added up: a rounding error that grows like K / KBLOCK + KBLOCK rather than K (one
// running sum gave 3-5x F.linear's error against fp64 at K = 576..1536)
inline void panel_rows(const float* x, int64_t M, int64_t K, const float* panel, const float* bias, float* out,
                       int64_t N, int64_t ncols, float* total) {
  std::fill(total, total + M * PANEL, 0.0f);
  for (int64_t k0 = 0; k0 < K; k0 += KBLOCK) {
    const int64_t k1 = K - k0 < KBLOCK ? K : k0 + KBLOCK;
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
    float* o = out + m * N;
    if (bias != nullptr)
      for (int64_t j = 0; j < ncols; ++j) o[j] = t[j] + bias[j];
    else
      std::memcpy(o, t, ncols * sizeof(float));
  }
}
#endif

void linear_fp32_out(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                     at::Tensor& out) {
#if defined(__AVX512F__)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [M, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kFloat && packed.is_contiguous() &&
                  packed.size(1) == x.size(1) && packed.size(2) == PANEL,
              "packed must be pack_linear_fp32's [ceil(N / 64), K, 64] for x's K");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), C = packed.size(0);
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.is_contiguous() && out.size(0) == M &&
                  (N + PANEL - 1) / PANEL == C,
              "out must be contiguous float32 [M, N] with N the packed weight's rows");
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, "bias: float32 [N]");
    bp = bias->data_ptr<float>();
  }
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, C, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> total(M * PANEL);
    for (int64_t c = begin; c < end; ++c) {
      const int64_t n0 = c * PANEL, ncols = N - n0 < PANEL ? N - n0 : PANEL;
      panel_rows(xp, M, K, wp + c * K * PANEL, bp == nullptr ? nullptr : bp + n0, op + n0, N, ncols, total.data());
    }
  });
#else
  TORCH_CHECK(false, "linear_fp32_out needs AVX-512 (linear_fp32_native() is False on this build)");
#endif
}

bool linear_fp32_native() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tdutils_kernels, m) {
  m.def("pack_linear_fp32(Tensor w) -> Tensor");
  m.def("linear_fp32_out(Tensor x, Tensor packed, Tensor? bias, Tensor(a!) out) -> ()");
  m.def("linear_fp32_native() -> bool", &linear_fp32_native);
}

TORCH_LIBRARY_IMPL(tdutils_kernels, CPU, m) {
  m.impl("pack_linear_fp32", &pack_linear_fp32);
  m.impl("linear_fp32_out", &linear_fp32_out);
}
