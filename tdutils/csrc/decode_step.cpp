// The elementwise work of the lean decode step (tdutils/engines/lean_step.py) in one call each, with the arithmetic
// of transformers' modules: every product and sum rounded to the model's dtype T where the module rounds it (this
// file is compiled with fp-contract off, so no multiply-add is fused into one rounding).
//
// rms_norm_out(x, w, eps, mode, out): the RMSNorm of each row of x [N, D] (contiguous, T = float32 or bfloat16;
//   w [D] in T), r = rsqrt(mean(x^2) + eps) with x, the mean and the rsqrt in fp32 (mean(x^2) by torch's own
//   pow and mean, the modules' ops, so the statistics are theirs bit for bit):
//   mode 0 (Llama, Mistral, Qwen):  out = w * T(x * r);   mode 1 (Gemma):  out = T(x * r * (1 + float(w))).
// rope_write_out(q, k, v, cos, sin, key_store, value_store, lengths, q_out): rotary embedding (rotate_half layout)
//   of one decode token per row, its key and value written into a slot store layer:
//   q [B, Hq, d], k and v [B, H, d] (contiguous, T), cos and sin [B, d] (contiguous, T);
//   key_store, value_store [S, H, W, d] (contiguous, T), lengths [>= B] int64 (the column row b writes);
//   key_store[b, h, lengths[b]] = rot(k[b, h]), value_store[b, h, lengths[b]] = v[b, h];
//   q_out [B, Hq, d] float32 = rot(q) (rounded to T first, as transformers' q_embed), what the attention reads.
//   rot(x)[i] = T(T(x[i] * cos[i]) + T(r[i] * sin[i])), r = (-x[d/2:], x[:d/2]).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>

// products and sums round one at a time, as torch's separate ops do (the attention kernel keeps its fused ones)
#pragma GCC optimize("fp-contract=off")

namespace {

template <typename T>
inline float rnd(float x) { return static_cast<float>(static_cast<T>(x)); }  // float: x; BFloat16: nearest-even

template <typename T>
void rms_norm_rows(const T* x, const T* w, const float* var, T* out, int64_t N, int64_t D, float eps, int64_t mode) {
  for (int64_t n = 0; n < N; ++n) {
    const T* xr = x + n * D;
    T* o = out + n * D;
    const float r = 1.0f / std::sqrt(var[n] + eps);  // torch.rsqrt: 1 / sqrt, each correctly rounded
    if (mode == 0) {
      for (int64_t i = 0; i < D; ++i)
        o[i] = static_cast<T>(static_cast<float>(w[i]) * rnd<T>(static_cast<float>(xr[i]) * r));
    } else {
      for (int64_t i = 0; i < D; ++i)
        o[i] = static_cast<T>((static_cast<float>(xr[i]) * r) * (1.0f + static_cast<float>(w[i])));
    }
  }
}

template <typename T>
inline void rotate(const T* x, const T* c, const T* s, int64_t d, float* out_f, T* out_t) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; ++i) {
    const float r = i < half ? -static_cast<float>(x[i + half]) : static_cast<float>(x[i - half]);
    const float a = rnd<T>(static_cast<float>(x[i]) * static_cast<float>(c[i]));
    const float b = rnd<T>(r * static_cast<float>(s[i]));
    const T y = static_cast<T>(a + b);
    if (out_f) out_f[i] = static_cast<float>(y);
    if (out_t) out_t[i] = y;
  }
}

template <typename T>
void rope_write_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                     const at::Tensor& sin, at::Tensor& ks, at::Tensor& vs, const int64_t* len, at::Tensor& q_out) {
  const int64_t B = q.size(0), Hq = q.size(1), d = q.size(2), H = k.size(1), W = ks.size(2);
  const T* qp = static_cast<const T*>(q.data_ptr());
  const T* kp = static_cast<const T*>(k.data_ptr());
  const T* vp = static_cast<const T*>(v.data_ptr());
  const T* cp = static_cast<const T*>(cos.data_ptr());
  const T* sp = static_cast<const T*>(sin.data_ptr());
  T* kst = static_cast<T*>(ks.data_ptr());
  T* vst = static_cast<T*>(vs.data_ptr());
  float* qo = q_out.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    const T* c = cp + b * d;
    const T* s = sp + b * d;
    for (int64_t h = 0; h < Hq; ++h) rotate<T>(qp + (b * Hq + h) * d, c, s, d, qo + (b * Hq + h) * d, nullptr);
    for (int64_t h = 0; h < H; ++h) {
      const int64_t at = ((b * H + h) * W + len[b]) * d;
      rotate<T>(kp + (b * H + h) * d, c, s, d, nullptr, kst + at);
      for (int64_t i = 0; i < d; ++i) vst[at + i] = vp[(b * H + h) * d + i];
    }
  }
}

bool supported(const at::Tensor& t) { return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16; }

void rms_norm_out(const at::Tensor& x, const at::Tensor& w, double eps, int64_t mode, at::Tensor& out) {
  TORCH_CHECK(mode == 0 || mode == 1, "mode must be 0 (Llama: w * T(x r)) or 1 (Gemma: T(x r (1 + w)))");
  TORCH_CHECK(supported(x) && x.is_contiguous() && x.dim() >= 1, "x must be contiguous float32 or bfloat16");
  const int64_t D = x.size(-1);
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.is_contiguous() && w.dim() == 1 && w.size(0) == D,
              "w must be [D] in x's dtype");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && out.is_contiguous() && out.sizes() == x.sizes(),
              "out must be contiguous, shaped and typed like x");
  const int64_t N = D ? x.numel() / D : 0;
  const at::Tensor var = x.to(at::kFloat).pow(2).mean(-1).contiguous();  // [N]: the modules' own reduction
  const float* vp = var.data_ptr<float>();
  if (x.scalar_type() == at::kFloat)
    rms_norm_rows<float>(x.data_ptr<float>(), w.data_ptr<float>(), vp, out.data_ptr<float>(), N, D, (float)eps,
                         mode);
  else
    rms_norm_rows<c10::BFloat16>(static_cast<const c10::BFloat16*>(x.data_ptr()),
                                 static_cast<const c10::BFloat16*>(w.data_ptr()), vp,
                                 static_cast<c10::BFloat16*>(out.data_ptr()), N, D, (float)eps, mode);
}

void rope_write_out(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                    const at::Tensor& sin, at::Tensor& key_store, at::Tensor& value_store, const at::Tensor& lengths,
                    at::Tensor& q_out) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && key_store.dim() == 4, "q [B, Hq, d], k, v [B, H, d], "
              "key_store [S, H, W, d]");
  const auto T = q.scalar_type();
  const at::Tensor* all[] = {&q, &k, &v, &cos, &sin, &key_store, &value_store};
  for (const at::Tensor* t : all)
    TORCH_CHECK(t->scalar_type() == T && t->is_contiguous() && supported(*t), "q, k, v, cos, sin and the stores "
                "must be contiguous and all float32 or all bfloat16");
  const int64_t B = q.size(0), d = q.size(2), H = k.size(1);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == B && k.size(2) == d && d % 2 == 0, "k, v [B, H, d], d even");
  TORCH_CHECK(cos.numel() == B * d && sin.numel() == B * d, "cos, sin [B, d]");
  TORCH_CHECK(key_store.sizes() == value_store.sizes() && key_store.size(0) >= B && key_store.size(1) == H &&
                  key_store.size(3) == d, "key_store, value_store [S >= B, H, W, d]");
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.is_contiguous() && lengths.numel() >= B,
              "lengths: contiguous int64, one per row");
  TORCH_CHECK(q_out.scalar_type() == at::kFloat && q_out.is_contiguous() && q_out.sizes() == q.sizes(),
              "q_out: contiguous float32 shaped like q");
  const int64_t* len = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(len[b] >= 0 && len[b] < key_store.size(2), "a row's column is outside the store's width");
  if (T == at::kFloat)
    rope_write_rows<float>(q, k, v, cos, sin, key_store, value_store, len, q_out);
  else
    rope_write_rows<c10::BFloat16>(q, k, v, cos, sin, key_store, value_store, len, q_out);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tdutils_kernels, m) {
  m.def("rms_norm_out(Tensor x, Tensor w, float eps, int mode, Tensor(a!) out) -> ()");
  m.def("rope_write_out(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) key_store, "
        "Tensor(b!) value_store, Tensor lengths, Tensor(c!) q_out) -> ()");
}

TORCH_LIBRARY_IMPL(tdutils_kernels, CPU, m) {
  m.impl("rms_norm_out", &rms_norm_out);
  m.impl("rope_write_out", &rope_write_out);
}
