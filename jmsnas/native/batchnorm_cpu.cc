// Training-mode batch norm fused with its activation (none or ReLU6), forward and backward, as XLA FFI handlers
// for the CPU backend. Compiled with dwconv_cpu.cc into one library by jmsnas/native/__init__.py.
//
// Why: XLA:CPU compiles batch norm + ReLU6 and their gradients into ~10 separate passes over the activation
// (statistics as reductions, then normalise, clamp, masks and the gradient terms as separate loops). Here the
// forward is two passes (channel sums; normalise + activation) and the backward two (channel sums of the masked
// cotangent and of its product with x-hat; the input gradient).
//
// Layout: x, y, g, dx float[R, C] (rows = every axis but the channel one), per-channel vectors float[C].
// Forward:  mean = sum_r x / R, var = sum_r (x - mean)^2 / R (biased), inv = 1 / sqrt(var + eps),
//           z = (x - mean) * inv * scale + bias, y = act(z).
// Backward: gz = g * act'(z), d_bias = sum_r gz, d_scale = sum_r gz * xhat,
//           dx = scale * inv * (gz - d_bias / R - xhat * d_scale / R) + g_mean / R + xhat * 2 g_var / (R inv).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "parallel.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kRowsPerChunk = 256;

// ACT: 0 = none, 1 = ReLU6. A template parameter, so the row loops have no branch and vectorise.
template <int ACT>
inline float Act(float z) {
  return ACT == 1 ? std::min(std::max(z, 0.0f), 6.0f) : z;
}
// g * act'(z)
template <int ACT>
inline float MaskGrad(float g, float z) {
  return ACT == 1 ? ((z > 0.0f && z < 6.0f) ? g : 0.0f) : g;
}

// Row kernels, with restrict-qualified pointers so that the channel loops vectorise.
#define R __restrict__

inline void SumsRow(int64_t c, const float* R xr, const float* R x0, float* R a, float* R b) {
  for (int64_t j = 0; j < c; ++j) {
    const float d = xr[j] - x0[j];
    a[j] += d;
    b[j] += d * d;
  }
}

template <int ACT>
inline void NormActRow(int64_t c, const float* R xr, const float* R mul, const float* R add, float* R yr) {
  for (int64_t j = 0; j < c; ++j) yr[j] = Act<ACT>(xr[j] * mul[j] + add[j]);
}

template <int ACT>
inline void GradSumsRow(int64_t c, const float* R xr, const float* R gr, const float* R mean, const float* R inv,
                        const float* R mul, const float* R add, float* R a, float* R b) {
  for (int64_t j = 0; j < c; ++j) {
    const float gz = MaskGrad<ACT>(gr[j], xr[j] * mul[j] + add[j]);
    a[j] += gz;
    b[j] += gz * ((xr[j] - mean[j]) * inv[j]);
  }
}

template <int ACT>
inline void InputGradRow(int64_t c, const float* R xr, const float* R gr, const float* R mean, const float* R inv,
                         const float* R mul, const float* R add, const float* R kx, const float* R k0,
                         float* R out) {
  for (int64_t j = 0; j < c; ++j) {
    const float gz = MaskGrad<ACT>(gr[j], xr[j] * mul[j] + add[j]);
    out[j] = mul[j] * gz + kx[j] * ((xr[j] - mean[j]) * inv[j]) + k0[j];
  }
}

#undef R

// Per channel: inv = 1 / sqrt(var + eps), and z = x * mul + add with mul = scale * inv, add = bias - mean * mul.
void NormCoefficients(int64_t c, const float* scale, const float* bias, const float* mean, const float* var,
                      float eps, std::vector<float>* inv, std::vector<float>* mul, std::vector<float>* add) {
  inv->resize(c);
  mul->resize(c);
  add->resize(c);
  for (int64_t j = 0; j < c; ++j) {
    (*inv)[j] = 1.0f / std::sqrt(var[j] + eps);
    (*mul)[j] = scale[j] * (*inv)[j];
    (*add)[j] = bias[j] - mean[j] * (*mul)[j];
  }
}

// Two channel sums over all rows: float sums per chunk of kRowsPerChunk rows, added in double into one accumulator
// per fixed block of chunks, and the blocks added in order, so the result does not depend on the thread count or
// on scheduling.
constexpr int64_t kSumBlocks = 64;

template <typename RowFn>
void ChannelSums(ffi::ThreadPool& pool, int64_t rows, int64_t c, std::vector<double>* s1, std::vector<double>* s2,
                 RowFn row_fn) {
  const int64_t chunks = (rows + kRowsPerChunk - 1) / kRowsPerChunk;
  const int64_t blocks = std::max<int64_t>(std::min(chunks, kSumBlocks), 1);
  std::vector<double> part(static_cast<size_t>(blocks) * 2 * c, 0.0);
  jmsnas::ParallelBlocks(pool, chunks, blocks, [&](int64_t block, int64_t begin, int64_t end) {
    double* a = part.data() + block * 2 * c;
    double* b = a + c;
    std::vector<float> fa(c), fb(c);
    for (int64_t k = begin; k < end; ++k) {
      std::fill(fa.begin(), fa.end(), 0.0f);
      std::fill(fb.begin(), fb.end(), 0.0f);
      const int64_t r1 = std::min(rows, (k + 1) * kRowsPerChunk);
      for (int64_t r = k * kRowsPerChunk; r < r1; ++r) row_fn(r, fa.data(), fb.data());
      for (int64_t j = 0; j < c; ++j) {
        a[j] += fa[j];
        b[j] += fb[j];
      }
    }
  });
  s1->assign(c, 0.0);
  s2->assign(c, 0.0);
  for (int64_t k = 0; k < blocks; ++k)
    for (int64_t j = 0; j < c; ++j) {
      (*s1)[j] += part[k * 2 * c + j];
      (*s2)[j] += part[k * 2 * c + c + j];
    }
}

template <typename RowFn>
void Rows(ffi::ThreadPool& pool, int64_t rows, RowFn row_fn) {
  const int64_t chunks = (rows + kRowsPerChunk - 1) / kRowsPerChunk;
  jmsnas::ParallelFor(pool, jmsnas::NumWorkers(pool, chunks), chunks, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin * kRowsPerChunk; r < std::min(rows, end * kRowsPerChunk); ++r) row_fn(r);
  });
}

template <int ACT>
ffi::Error BnActForward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> scale,
                        ffi::Buffer<ffi::F32> bias, ffi::ResultBuffer<ffi::F32> y, ffi::ResultBuffer<ffi::F32> mean_out,
                        ffi::ResultBuffer<ffi::F32> var_out, float eps) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || scale.element_count() != xd[1] || bias.element_count() != xd[1])
    return ffi::Error::InvalidArgument("jmsnas batch norm: expected x [rows, C], scale [C], bias [C]");
  const int64_t rows = xd[0], c = xd[1];
  const float* xp = x.typed_data();
  // pass 1: sums of x - x[0] and its square (shifted by the first row, in float per chunk, double across chunks)
  std::vector<double> s1, s2;
  ChannelSums(pool, rows, c, &s1, &s2,
              [&](int64_t r, float* a, float* b) { SumsRow(c, xp + r * c, xp, a, b); });
  float* mean = mean_out->typed_data();
  float* var = var_out->typed_data();
  for (int64_t j = 0; j < c; ++j) {
    const double m = s1[j] / rows;
    mean[j] = static_cast<float>(m + xp[j]);
    var[j] = static_cast<float>(std::max(s2[j] / rows - m * m, 0.0));
  }
  std::vector<float> inv, mul, add;
  NormCoefficients(c, scale.typed_data(), bias.typed_data(), mean, var, eps, &inv, &mul, &add);
  // pass 2: y = act(x * mul + add)
  float* yp = y->typed_data();
  const float* mp = mul.data();
  const float* ap = add.data();
  Rows(pool, rows, [&](int64_t r) { NormActRow<ACT>(c, xp + r * c, mp, ap, yp + r * c); });
  return ffi::Error::Success();
}

template <int ACT>
ffi::Error BnActBackward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> scale,
                         ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::F32> mean_in, ffi::Buffer<ffi::F32> var_in,
                         ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> g_mean, ffi::Buffer<ffi::F32> g_var,
                         ffi::ResultBuffer<ffi::F32> dx, ffi::ResultBuffer<ffi::F32> d_scale,
                         ffi::ResultBuffer<ffi::F32> d_bias, float eps) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || g.dimensions().size() != 2 || g.dimensions()[0] != xd[0] || g.dimensions()[1] != xd[1])
    return ffi::Error::InvalidArgument("jmsnas batch norm backward: x and g must both be [rows, C]");
  const int64_t rows = xd[0], c = xd[1];
  const float* xp = x.typed_data();
  const float* gp = g.typed_data();
  const float* mean = mean_in.typed_data();
  std::vector<float> inv, mul, add;
  NormCoefficients(c, scale.typed_data(), bias.typed_data(), mean, var_in.typed_data(), eps, &inv, &mul, &add);
  const float* ip = inv.data();
  const float* mp = mul.data();
  const float* ap = add.data();
  // pass 1: d_bias = sum gz, d_scale = sum gz * xhat
  std::vector<double> sb, ss;
  ChannelSums(pool, rows, c, &sb, &ss, [&](int64_t r, float* a, float* b) {
    GradSumsRow<ACT>(c, xp + r * c, gp + r * c, mean, ip, mp, ap, a, b);
  });
  float* dbp = d_bias->typed_data();
  float* dsp = d_scale->typed_data();
  std::vector<float> k_x(c), k_0(c);  // dx = mul * gz + k_x * xhat + k_0
  const float* gm = g_mean.typed_data();
  const float* gv = g_var.typed_data();
  for (int64_t j = 0; j < c; ++j) {
    dbp[j] = static_cast<float>(sb[j]);
    dsp[j] = static_cast<float>(ss[j]);
    const float n = static_cast<float>(rows);
    k_x[j] = -mp[j] * dsp[j] / n + 2.0f * gv[j] / (n * ip[j]);
    k_0[j] = -mp[j] * dbp[j] / n + gm[j] / n;
  }
  // pass 2: the input gradient
  float* dxp = dx->typed_data();
  const float* kx = k_x.data();
  const float* k0 = k_0.data();
  Rows(pool, rows, [&](int64_t r) {
    InputGradRow<ACT>(c, xp + r * c, gp + r * c, mean, ip, mp, ap, kx, k0, dxp + r * c);
  });
  return ffi::Error::Success();
}

ffi::Error BnActForwardImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> scale,
                            ffi::Buffer<ffi::F32> bias, ffi::ResultBuffer<ffi::F32> y,
                            ffi::ResultBuffer<ffi::F32> mean_out, ffi::ResultBuffer<ffi::F32> var_out, int64_t act,
                            float eps) {
  if (act == 0) return BnActForward<0>(pool, x, scale, bias, y, mean_out, var_out, eps);
  if (act == 1) return BnActForward<1>(pool, x, scale, bias, y, mean_out, var_out, eps);
  return ffi::Error::InvalidArgument("jmsnas batch norm: act must be 0 (none) or 1 (ReLU6)");
}

ffi::Error BnActBackwardImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> scale,
                             ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::F32> mean_in, ffi::Buffer<ffi::F32> var_in,
                             ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> g_mean, ffi::Buffer<ffi::F32> g_var,
                             ffi::ResultBuffer<ffi::F32> dx, ffi::ResultBuffer<ffi::F32> d_scale,
                             ffi::ResultBuffer<ffi::F32> d_bias, int64_t act, float eps) {
  if (act == 0)
    return BnActBackward<0>(pool, x, scale, bias, mean_in, var_in, g, g_mean, g_var, dx, d_scale, d_bias, eps);
  if (act == 1)
    return BnActBackward<1>(pool, x, scale, bias, mean_in, var_in, g, g_mean, g_var, dx, d_scale, d_bias, eps);
  return ffi::Error::InvalidArgument("jmsnas batch norm: act must be 0 (none) or 1 (ReLU6)");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JmsnasBatchNormActForward, BnActForwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale
                                  .Arg<ffi::Buffer<ffi::F32>>()  // bias
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y
                                  .Ret<ffi::Buffer<ffi::F32>>()  // mean
                                  .Ret<ffi::Buffer<ffi::F32>>()  // var
                                  .Attr<int64_t>("act")
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JmsnasBatchNormActBackward, BnActBackwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale
                                  .Arg<ffi::Buffer<ffi::F32>>()  // bias
                                  .Arg<ffi::Buffer<ffi::F32>>()  // mean
                                  .Arg<ffi::Buffer<ffi::F32>>()  // var
                                  .Arg<ffi::Buffer<ffi::F32>>()  // g
                                  .Arg<ffi::Buffer<ffi::F32>>()  // g_mean
                                  .Arg<ffi::Buffer<ffi::F32>>()  // g_var
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dx
                                  .Ret<ffi::Buffer<ffi::F32>>()  // d_scale
                                  .Ret<ffi::Buffer<ffi::F32>>()  // d_bias
                                  .Attr<int64_t>("act")
                                  .Attr<float>("eps"));
