// Decode attention over a KV cache read in place: one query token per row, GQA without copies.
//
// out[b, h*g + j, :] = sum_t softmax_t(scaling * q[b, h*g + j] . k[b, h, t] (+ mask)) * v[b, h, t, :]
//
// q    [B, Hq, d]  float32, contiguous (already in fp32; the caller casts)
// k, v [B, H, T, d] float32 or bfloat16, any strides with the last one 1 (slot store views)
// mask [B, Hm, T]  optional: bool (True = attend) or float32 additive; Hm is 1 or Hq, any strides. An additive
//                  value at or below HIDDEN (-1e38: the float32 and bfloat16 minimums that transformers' additive
//                  masks hide with) hides its column as -inf does: the same output wherever a row sees a column
//                  (exp of such a logit is 0 in fp32), and the column is not read
// out  [B, Hq, d]  float32, contiguous, written here
//
// Each (b, h) is one work item (at::parallel_for, torch's own thread pool): the g query heads of KV head h read
// each key and value row once, converted to fp32 in registers; logits and the softmax are fp32. Columns whose
// mask hides them for every head of the item are skipped (the slot store's padding past a row's length).
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// exp(x) for x <= 0 (softmax after subtracting the max), vectorizable: 2^n * p(r), x = n ln2 + r, |r| <= ln2/2,
// p a degree-7 Taylor polynomial (relative error < 2e-7 on that range). x = -inf gives 0 exactly.
inline float exp_nonpos(float x) {
  const float lo = -87.0f;
  float xc = x < lo ? lo : x;
  float n = std::nearbyint(xc * 1.44269504088896341f);
  float r = xc - n * 0.693145751953125f;
  r = r - n * 1.42860682030941723212e-6f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < lo ? 0.0f : p * scale;
}

inline void load_row(const float* src, float* dst, int64_t d) {
  std::memcpy(dst, src, d * sizeof(float));
}

inline void load_row(const uint16_t* src, float* dst, int64_t d) {
  uint32_t* bits = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) bits[i] = static_cast<uint32_t>(src[i]) << 16;
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// [sum(v[0]), ..., sum(v[15])]: 16 horizontal sums at once (a transpose by shuffles, 15 adds)
inline __m512 sum16(const __m512* v) {
  __m512 x[8], y[4];
  for (int k = 0; k < 8; ++k)
    x[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int m = 0; m < 4; ++m)
    y[m] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * m], x[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(x[2 * m], x[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(y[2], y[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// logits[j*T + t0 + r] = q_j . k[t0 + r] for r < 16 and every head j < g (d a multiple of 16): each key row is
// read once into fp32 (buf, 16 x d), then every head's 16 dot products share one sum16
template <int D, typename KV>
inline void logits16(const float* qs, const KV* kb, int64_t kst, int64_t t0, int64_t g, int64_t T, float* logits,
                     float* buf) {
  for (int r = 0; r < 16; ++r) {
    const KV* row = kb + (t0 + r) * kst;
    // the row 32 ahead, into L1: one core's sequential stream alone kept fp32 keys at ~7 GB/s on an AMX Xeon
    // (1.74 -> 1.54-1.64 ms per SmolLM2 layer at 4 x 2048 with this; bf16 unchanged)
    for (int c = 0; c < D * (int)sizeof(KV); c += 64) _mm_prefetch((const char*)(row + 32 * kst) + c, _MM_HINT_T0);
    for (int c = 0; c < D; c += 16) _mm512_storeu_ps(buf + r * D + c, load16(row + c));
  }
  for (int64_t j = 0; j < g; ++j) {
    const float* qj = qs + j * D;
    __m512 v[16];
    for (int r = 0; r < 16; ++r) {
      __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qj), _mm512_loadu_ps(buf + r * D));
      for (int c = 16; c < D; c += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(qj + c), _mm512_loadu_ps(buf + r * D + c), a);
      v[r] = a;
    }
    _mm512_storeu_ps(logits + j * T + t0, sum16(v));
  }
}

#if defined(__AVX512BF16__)
// the bf16 form of logits16: q_j (bf16, unscaled: the model's own bf16 query) . k[t0 + r] by AVX512-BF16 dot
// products of bf16 pairs into fp32 (each product exact, sums in fp32), times `scaling`; no key row is converted
template <int D>
inline void logits16_bf16(const uint16_t* qbf, const uint16_t* kb, int64_t kst, int64_t t0, int64_t g, int64_t T,
                          float scaling, float* logits) {
  static_assert(D % 32 == 0, "bf16 pairs: D a multiple of 32");
  const __m512 s = _mm512_set1_ps(scaling);
  for (int64_t j = 0; j < g; ++j) {
    __m512bh qc[D / 32];
    for (int c = 0; c < D / 32; ++c) qc[c] = (__m512bh)_mm512_loadu_si512(qbf + j * D + c * 32);
    __m512 v[16];
    for (int r = 0; r < 16; ++r) {
      const uint16_t* row = kb + (t0 + r) * kst;
      __m512 a = _mm512_setzero_ps();
      for (int c = 0; c < D / 32; ++c) a = _mm512_dpbf16_ps(a, qc[c], (__m512bh)_mm512_loadu_si512(row + c * 32));
      v[r] = a;
    }
    _mm512_storeu_ps(logits + j * T + t0, _mm512_mul_ps(sum16(v), s));
  }
}
#endif

// acc[j] (the output of head j, fp32, D values) = sum over live columns t of p[j*T + t] * v[t] for every head
// j < g: blocks of 4 heads x 64 values stay in registers while the value rows stream past once per block
template <int D, typename KV>
inline void weighted_values(const float* p, const KV* vb, int64_t vst, const uint8_t* live, int64_t g, int64_t T,
                            float* acc) {
  constexpr int CB = D < 64 ? D / 16 : 4;  // chunks of 16 per block
  for (int c0 = 0; c0 < D / 16; c0 += CB) {
    for (int64_t j0 = 0; j0 < g; j0 += 4) {
      const int64_t jn = g - j0 < 4 ? g - j0 : 4;
      __m512 a[4][CB];
      for (int jj = 0; jj < 4; ++jj)
        for (int c = 0; c < CB; ++c) a[jj][c] = _mm512_setzero_ps();
      for (int64_t t = 0; t < T; ++t) {
        if (!live[t]) continue;
        const KV* row = vb + t * vst + c0 * 16;
        for (int c = 0; c < CB * 16 * (int)sizeof(KV); c += 64)
          _mm_prefetch((const char*)(row + 32 * vst) + c, _MM_HINT_T0);
        __m512 x[CB];
        for (int c = 0; c < CB; ++c) x[c] = load16(row + c * 16);
        for (int jj = 0; jj < 4; ++jj) {
          if (jj >= jn) break;
          const __m512 w = _mm512_set1_ps(p[(j0 + jj) * T + t]);
          for (int c = 0; c < CB; ++c) a[jj][c] = _mm512_fmadd_ps(w, x[c], a[jj][c]);
        }
      }
      for (int jj = 0; jj < jn; ++jj)
        for (int c = 0; c < CB; ++c) _mm512_storeu_ps(acc + (j0 + jj) * D + (c0 + c) * 16, a[jj][c]);
    }
  }
}
#endif

// an additive mask value at or below this hides its column (sliding-window layers' masks hid with finfo.min: before,
// Gemma 3's sliding layers read all 2048 columns of a 4 x 2048 batch where 512 are in their window)
constexpr float HIDDEN = -1e38f;

// Per-row hidden mask of item (b, h) as additive fp32 (0 or -inf, or the float mask's values), head j at madd[j*T + t];
// returns whether every column is hidden for every head (`live[t]` says per column).
inline void item_mask(const void* mask, bool mask_bool, const int64_t* ms, int64_t b, int64_t h, int64_t g, int64_t T,
                      float* madd, uint8_t* live, int64_t heads) {
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < heads; ++j) {
    const int64_t base = b * ms[0] + (h * g + j) * ms[1];
    float* mj = madd + j * T;
    if (mask == nullptr) {
      std::fill(mj, mj + T, 0.0f);
    } else if (mask_bool) {
      const bool* m = static_cast<const bool*>(mask) + base;
      for (int64_t t = 0; t < T; ++t) mj[t] = m[t * ms[2]] ? 0.0f : ninf;
    } else {
      const float* m = static_cast<const float*>(mask) + base;
      for (int64_t t = 0; t < T; ++t) mj[t] = m[t * ms[2]] <= HIDDEN ? ninf : m[t * ms[2]];
    }
  }
  for (int64_t t = 0; t < T; ++t) {
    bool any = false;
    for (int64_t j = 0; j < heads; ++j) any = any || madd[j * T + t] != ninf;
    live[t] = any;
  }
}

// D: the head dim when known at compile time (the loops over it unroll), else 0 (runtime d)
template <int D, typename KV>
void run(const float* q, const KV* k, const KV* v, const void* mask, bool mask_bool, const int64_t* ms,
         float* out, int64_t B, int64_t Hq, int64_t H, int64_t T, int64_t d_rt, const int64_t* ks,
         const int64_t* vs, float scaling) {
  const int64_t d = D > 0 ? D : d_rt;
  const int64_t g = Hq / H;
  const int64_t heads = (mask != nullptr && ms[1] != 0) ? g : 1;  // mask rows per item
  const float ninf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(g * d), logits(g * T), acc(g * d), row(d), madd(heads * T), inv(g), blockbuf(16 * d);
    std::vector<uint16_t> qbf(std::is_same_v<KV, uint16_t> ? g * d : 0);
    std::vector<uint8_t> live(T);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / H, h = item % H;
      const KV* kb = k + b * ks[0] + h * ks[1];
      const KV* vb = v + b * vs[0] + h * vs[1];
      for (int64_t j = 0; j < g; ++j)
        for (int64_t i = 0; i < d; ++i) qs[j * d + i] = q[(b * Hq + h * g + j) * d + i] * scaling;
      if constexpr (std::is_same_v<KV, uint16_t>) {  // the query in bf16, unscaled (exact for a bf16 model's)
        for (int64_t j = 0; j < g; ++j)
          for (int64_t i = 0; i < d; ++i) {
            uint32_t bits;
            std::memcpy(&bits, q + (b * Hq + h * g + j) * d + i, sizeof bits);
            bits += 0x7FFF + ((bits >> 16) & 1);  // round to nearest even (q is finite)
            qbf[j * d + i] = static_cast<uint16_t>(bits >> 16);
          }
      }
      item_mask(mask, mask_bool, ms, b, h, g, T, madd.data(), live.data(), heads);
      // pass 1: logits, every live key row read once for the g heads
      float* rw = row.data();
      int64_t t = 0;
#if defined(__AVX512F__)
      if constexpr (D > 0 && D % 16 == 0) {
        // blocks of 16 columns (a block with hidden columns too: their logits are set to -inf below)
        for (; t + 16 <= T; t += 16) {
          bool any = false;
          for (int r = 0; r < 16; ++r) any = any || live[t + r];
          if (any) {
#if defined(__AVX512BF16__)
            if constexpr (std::is_same_v<KV, uint16_t> && D % 32 == 0)
              logits16_bf16<D>(qbf.data(), kb, ks[2], t, g, T, scaling, logits.data());
            else
#endif
              logits16<D>(qs.data(), kb, ks[2], t, g, T, logits.data(), blockbuf.data());
          }
          // the mask added, hidden columns -inf (the logits of a block with no live column were never written)
          __mmask16 lm = 0;
          for (int r = 0; r < 16; ++r) lm |= (__mmask16)((live[t + r] != 0) << r);
          for (int64_t j = 0; j < g; ++j) {
            const float* mj = madd.data() + (heads == 1 ? 0 : j) * T + t;
            float* lj = logits.data() + j * T + t;
            _mm512_storeu_ps(lj, _mm512_mask_add_ps(_mm512_set1_ps(ninf), lm, _mm512_loadu_ps(lj), _mm512_loadu_ps(mj)));
          }
        }
      }
#endif
      for (; t < T; ++t) {
        if (!live[t]) {
          for (int64_t j = 0; j < g; ++j) logits[j * T + t] = ninf;
          continue;
        }
        load_row(kb + t * ks[2], rw, d);
        for (int64_t j = 0; j < g; ++j) {
          const float* qj = qs.data() + j * d;
          float s = 0.0f;
#pragma omp simd reduction(+ : s)
          for (int64_t i = 0; i < d; ++i) s += qj[i] * rw[i];
          logits[j * T + t] = s + madd[(heads == 1 ? 0 : j) * T + t];
        }
      }
      // softmax per head, in place (a head that attends nowhere gets zeros)
      for (int64_t j = 0; j < g; ++j) {
        float* lj = logits.data() + j * T;
        float mx = ninf;
        for (int64_t t = 0; t < T; ++t) mx = lj[t] > mx ? lj[t] : mx;
        float sum = 0.0f;
        if (mx == ninf) {
          std::fill(lj, lj + T, 0.0f);
        } else {
#pragma omp simd reduction(+ : sum)
          for (int64_t t = 0; t < T; ++t) {
            const float e = exp_nonpos(lj[t] - mx);
            lj[t] = e;
            sum += e;
          }
        }
        inv[j] = sum > 0.0f ? 1.0f / sum : 0.0f;
      }
      // pass 2: every live value row read once, accumulated into the g heads' outputs
      std::fill(acc.begin(), acc.end(), 0.0f);
#if defined(__AVX512F__)
      if constexpr (D > 0 && D % 16 == 0) {
        weighted_values<D>(logits.data(), vb, vs[2], live.data(), g, T, acc.data());
      } else
#endif
      for (int64_t t = 0; t < T; ++t) {
        if (!live[t]) continue;
        load_row(vb + t * vs[2], rw, d);
        for (int64_t j = 0; j < g; ++j) {
          const float w = logits[j * T + t];
          float* aj = acc.data() + j * d;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) aj[i] += w * rw[i];
        }
      }
      for (int64_t j = 0; j < g; ++j)
        for (int64_t i = 0; i < d; ++i) out[(b * Hq + h * g + j) * d + i] = acc[j * d + i] * inv[j];
    }
  });
}

template <typename KV>
void dispatch(int64_t d, const float* q, const KV* k, const KV* v, const void* mask, bool mask_bool,
              const int64_t* ms, float* out, int64_t B, int64_t Hq, int64_t H, int64_t T, const int64_t* ks,
              const int64_t* vs, float scaling) {
  switch (d) {
    case 64: return run<64>(q, k, v, mask, mask_bool, ms, out, B, Hq, H, T, d, ks, vs, scaling);
    case 128: return run<128>(q, k, v, mask, mask_bool, ms, out, B, Hq, H, T, d, ks, vs, scaling);
    case 256: return run<256>(q, k, v, mask, mask_bool, ms, out, B, Hq, H, T, d, ks, vs, scaling);
    default: return run<0>(q, k, v, mask, mask_bool, ms, out, B, Hq, H, T, d, ks, vs, scaling);
  }
}

void decode_attention_out(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const std::optional<at::Tensor>& mask, double scaling, at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.dim() == 4, "q [B, Hq, d], k and v [B, H, T, d]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be contiguous float32");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.sizes() == q.sizes(),
              "out must be contiguous float32 shaped like q");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() &&
                  (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16),
              "k and v must both be float32 or both bfloat16");
  TORCH_CHECK(k.sizes() == v.sizes() && k.stride(3) == 1 && v.stride(3) == 1, "k, v same shape, last stride 1");
  const int64_t B = q.size(0), Hq = q.size(1), d = q.size(2), H = k.size(1), T = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == d && H > 0 && Hq % H == 0, "q, k shapes do not match");
  const void* mp = nullptr;
  bool mask_bool = false;
  int64_t ms[3] = {0, 0, 0};
  if (mask.has_value()) {
    const at::Tensor& m = *mask;
    TORCH_CHECK(m.dim() == 3 && m.size(0) == B && (m.size(1) == 1 || m.size(1) == Hq) && m.size(2) == T,
                "mask must be [B, 1 or Hq, T]");
    TORCH_CHECK(m.scalar_type() == at::kBool || m.scalar_type() == at::kFloat, "mask must be bool or float32");
    mask_bool = m.scalar_type() == at::kBool;
    mp = m.data_ptr();
    ms[0] = m.stride(0);
    ms[1] = m.size(1) == 1 ? 0 : m.stride(1);
    ms[2] = m.stride(2);
  }
  const int64_t ks[3] = {k.stride(0), k.stride(1), k.stride(2)};
  const int64_t vs[3] = {v.stride(0), v.stride(1), v.stride(2)};
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (k.scalar_type() == at::kFloat) {
    dispatch<float>(d, qp, k.data_ptr<float>(), v.data_ptr<float>(), mp, mask_bool, ms, op, B, Hq, H, T, ks, vs,
                    static_cast<float>(scaling));
  } else {
    dispatch<uint16_t>(d, qp, static_cast<const uint16_t*>(k.data_ptr()), static_cast<const uint16_t*>(v.data_ptr()),
                       mp, mask_bool, ms, op, B, Hq, H, T, ks, vs, static_cast<float>(scaling));
  }
}

}  // namespace

TORCH_LIBRARY(tdutils_kernels, m) {
  m.def("decode_attention_out(Tensor q, Tensor k, Tensor v, Tensor? mask, float scaling, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(tdutils_kernels, CPU, m) { m.impl("decode_attention_out", &decode_attention_out); }
