// Depthwise 2-D convolution (NHWC, float32, SAME padding, stride 1 or 2) and its two gradients as XLA FFI
// handlers for the CPU backend. Compiled on first use by jmsnas/native/__init__.py (g++ -O3 -march=native).
//
// Why: XLA:CPU runs grouped convolutions at about 1 GFLOP/s and fuses the shifted-sum formulation into loops
// without register blocking. Here every output pixel keeps a block of channels in registers while it runs over
// the k x k taps (the channel loop is the vectorised one: channels are contiguous in NHWC), and work is split
// by rows over XLA's intra-op thread pool.
//
// Shapes: x [B, H, W, C], w [k, k, C] (k odd), y / g [B, oh, ow, C] with oh = ceil(H / s), ow = ceil(W / s).
// SAME padding as TF/XLA: total = max((oh - 1) * s + k - H, 0), low = total / 2 (same on the W axis).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"

namespace ffi = xla::ffi;

namespace {

struct Geometry {
  int64_t b, h, w, c, k, s, oh, ow, ph, pw;
};

int64_t LowPad(int64_t size, int64_t k, int64_t s, int64_t out) {
  return std::max<int64_t>((out - 1) * s + k - size, 0) / 2;
}

Geometry MakeGeometry(int64_t b, int64_t h, int64_t w, int64_t c, int64_t k, int64_t s) {
  Geometry g{b, h, w, c, k, s, (h + s - 1) / s, (w + s - 1) / s, 0, 0};
  g.ph = LowPad(h, k, s, g.oh);
  g.pw = LowPad(w, k, s, g.ow);
  return g;
}

// The kernel rows i that land inside the image for output row oy: input row iy0 + i, i in [lo, hi).
struct TapRows {
  int64_t iy0, lo, hi;
};

TapRows RowTaps(const Geometry& g, int64_t oy) {
  const int64_t iy0 = oy * g.s - g.ph;
  return {iy0, std::max<int64_t>(0, -iy0), std::min<int64_t>(g.k, g.h - iy0)};
}

// ---- channel blocks held in registers -------------------------------------------------------------------------
// v8: 8 floats (GCC/clang vector extension), unaligned and may-alias loads/stores through a pointer cast.
typedef float v8 __attribute__((vector_size(32), aligned(4), may_alias));

inline v8 Load(const float* p) { return *reinterpret_cast<const v8*>(p); }
inline void Store(float* p, v8 v) { *reinterpret_cast<v8*>(p) = v; }

// CB consecutive channels of one accumulator (CB a multiple of 8, or 1).
template <int CB>
struct Block {
  static_assert(CB % 8 == 0, "CB must be a multiple of 8 or 1");
  v8 v[CB / 8] = {};
  void Fma(const float* a, const float* b) {
    for (int t = 0; t < CB / 8; ++t) v[t] += Load(a + 8 * t) * Load(b + 8 * t);
  }
  void StoreTo(float* p) const {
    for (int t = 0; t < CB / 8; ++t) Store(p + 8 * t, v[t]);
  }
  void AddTo(float* p) const {
    for (int t = 0; t < CB / 8; ++t) Store(p + 8 * t, Load(p + 8 * t) + v[t]);
  }
};

template <>
struct Block<1> {
  float v = 0.0f;
  void Fma(const float* a, const float* b) { v += *a * *b; }
  void StoreTo(float* p) const { *p = v; }
  void AddTo(float* p) const { *p += v; }
};

// ---- kernels: one row of pixels, channels in blocks of CB kept in registers ---------------------------------

// y[b, oy, ox, c0:c0+CB] for ox in [ox_begin, ox_end), one output pixel at a time (any column, borders too)
template <int CB>
void ForwardPixels(const Geometry& g, const float* x, const float* w, float* y, int64_t b, int64_t oy,
                   int64_t ox_begin, int64_t ox_end, int64_t c0) {
  const TapRows t = RowTaps(g, oy);
  for (int64_t ox = ox_begin; ox < ox_end; ++ox) {
    const int64_t ix0 = ox * g.s - g.pw;
    const int64_t j_lo = std::max<int64_t>(0, -ix0), j_hi = std::min<int64_t>(g.k, g.w - ix0);
    Block<CB> acc;
    for (int64_t i = t.lo; i < t.hi; ++i) {
      const float* xr = x + ((b * g.h + t.iy0 + i) * g.w + ix0) * g.c + c0;
      const float* wr = w + i * g.k * g.c + c0;
      for (int64_t j = j_lo; j < j_hi; ++j) acc.Fma(xr + j * g.c, wr + j * g.c);
    }
    acc.StoreTo(y + ((b * g.oh + oy) * g.ow + ox) * g.c + c0);
  }
}

// dx[b, iy, :, :] = sum over the (tap, output) pairs that read input pixel (iy, ix)
template <int CB>
void InputGradRowBlock(const Geometry& g, const float* gy, const float* w, float* dx, int64_t b, int64_t iy,
                       int64_t c0) {
  for (int64_t ix = 0; ix < g.w; ++ix) {
    Block<CB> acc;
    for (int64_t i = 0; i < g.k; ++i) {
      const int64_t ny = iy + g.ph - i;  // = oy * s
      if (ny < 0 || ny % g.s != 0 || ny / g.s >= g.oh) continue;
      const int64_t oy = ny / g.s;
      for (int64_t j = 0; j < g.k; ++j) {
        const int64_t nx = ix + g.pw - j;
        if (nx < 0 || nx % g.s != 0 || nx / g.s >= g.ow) continue;
        acc.Fma(gy + ((b * g.oh + oy) * g.ow + nx / g.s) * g.c + c0, w + (i * g.k + j) * g.c + c0);
      }
    }
    acc.StoreTo(dx + ((b * g.h + iy) * g.w + ix) * g.c + c0);
  }
}

// dw[i, j, c] += sum_ox x[b, oy*s - ph + i, ox*s - pw + j, c] * gy[b, oy, ox, c]
template <int CB>
void WeightGradRowBlock(const Geometry& g, const float* x, const float* gy, float* dw, int64_t b, int64_t oy,
                        int64_t c0) {
  const TapRows t = RowTaps(g, oy);
  const float* grow = gy + (b * g.oh + oy) * g.ow * g.c + c0;
  for (int64_t i = t.lo; i < t.hi; ++i) {
    const float* xrow = x + (b * g.h + t.iy0 + i) * g.w * g.c + c0;
    for (int64_t j = 0; j < g.k; ++j) {
      // ox with 0 <= ox * s - pw + j < w
      const int64_t lo = std::max<int64_t>(0, (g.pw - j + g.s - 1) / g.s);
      const int64_t hi = std::min<int64_t>(g.ow, (g.w - 1 + g.pw - j) / g.s + 1);
      Block<CB> acc;
      for (int64_t ox = lo; ox < hi; ++ox) acc.Fma(xrow + (ox * g.s - g.pw + j) * g.c, grow + ox * g.c);
      acc.AddTo(dw + (i * g.k + j) * g.c + c0);
    }
  }
}

// ---- register-blocked interior kernels (every tap in range) ------------------------------------------------------

// Forward of OX neighbouring outputs x 8 * NV channels of one row, ox in [ox0, ox0 + OX) all interior: OX * NV
// accumulators; each tap's weight vectors are loaded once for the OX outputs.
template <int OX, int NV>
void ForwardTile(const Geometry& g, const float* x, const float* w, float* y, int64_t b, int64_t oy, int64_t ox0,
                 int64_t c0, const TapRows& t) {
  const int64_t step = g.s * g.c;
  v8 acc[OX][NV] = {};
  // The input row that the next output row reads first and this one does not: this tile's part of it is requested
  // into the cache now. Measured on the 2-core EPYC (medians of 15, two runs each), forward 64 x H x W x C, k = 3:
  // 32x32x96 2.7-3.0 ms instead of 5.0-5.4, 16x16x288 1.8-2.2 instead of 4.4-4.9 (without it the tiles stalled on
  // each first touch of a row). Slower, so not done: clipping the columns to the image and prefetching in the border
  // path too; prefetching the next rows in the weight gradient (32x32x192 k = 7: 27-30 ms instead of 20-21).
  if (t.iy0 + g.k < g.h) {
    const float* nx = x + ((b * g.h + t.iy0 + g.k) * g.w + ox0 * g.s - g.pw) * g.c + c0;
    for (int o = 0; o < OX * g.s; ++o) __builtin_prefetch(nx + o * g.c);
  }
  for (int64_t i = t.lo; i < t.hi; ++i) {
    const float* xr = x + ((b * g.h + t.iy0 + i) * g.w + ox0 * g.s - g.pw) * g.c + c0;
    const float* wr = w + i * g.k * g.c + c0;
    for (int64_t j = 0; j < g.k; ++j) {
      v8 wv[NV];
      for (int v = 0; v < NV; ++v) wv[v] = Load(wr + j * g.c + 8 * v);
      const float* xp = xr + j * g.c;
      for (int o = 0; o < OX; ++o)
        for (int v = 0; v < NV; ++v) acc[o][v] += Load(xp + o * step + 8 * v) * wv[v];
    }
  }
  float* out = y + ((b * g.oh + oy) * g.ow + ox0) * g.c + c0;
  for (int o = 0; o < OX; ++o)
    for (int v = 0; v < NV; ++v) Store(out + o * g.c + 8 * v, acc[o][v]);
}

constexpr int kTileOX = 4;  // measured on the 2-core EPYC: 4 x 16 beat 2 x 32, 3 x 16, 8 x 8 and 4 x 8
constexpr int kTileNV = 2;

// Interior output columns: ox with 0 <= ox * s - pw and ox * s - pw + k <= w.
inline void InteriorColumns(const Geometry& g, int64_t* lo, int64_t* hi) {
  *lo = (g.pw + g.s - 1) / g.s;
  *hi = g.w - g.k + g.pw >= 0 ? std::max<int64_t>((g.w - g.k + g.pw) / g.s + 1, *lo) : *lo;
  *hi = std::min<int64_t>(*hi, g.ow);
  *lo = std::min<int64_t>(*lo, *hi);
}


// Weight gradient of 8 * NV channels over one output row and one kernel row i (K taps j at once, K * NV
// accumulators in registers): acc[j] += x[b, iy, ox * s - pw + j, c] * gy[b, oy, ox, c] for interior ox, then
// the border ox tap by tap.
// 32 channels per weight-gradient tile where AVX-512VL gives 32 vector registers (7 x 4 accumulators fit),
// else 16: measured on the 2-core EPYC (AVX-512): 32 channels 6.3 / 14.2 ms, 16 channels 8.6 / 16.4 ms for
// k = 3 / 7 on 64x32x32x96, one thread.
#if defined(__AVX512VL__)
constexpr int kWeightGradNV = 4;
#else
constexpr int kWeightGradNV = 2;
#endif

template <int K, int NV>
void WeightGradRowTile(const Geometry& g, const float* xrow, const float* grow, float* dwrow, int64_t c0,
                       int64_t lo, int64_t hi) {
  v8 acc[K][NV] = {};
  for (int64_t ox = lo; ox < hi; ++ox) {
    v8 gv[NV];
    for (int v = 0; v < NV; ++v) gv[v] = Load(grow + ox * g.c + c0 + 8 * v);
    const float* xp = xrow + (ox * g.s - g.pw) * g.c + c0;
    for (int j = 0; j < K; ++j)
      for (int v = 0; v < NV; ++v) acc[j][v] += Load(xp + j * g.c + 8 * v) * gv[v];
  }
  for (int64_t ox = 0; ox < g.ow; ++ox) {
    if (ox >= lo && ox < hi) continue;
    for (int j = 0; j < K; ++j) {
      const int64_t ix = ox * g.s - g.pw + j;
      if (ix < 0 || ix >= g.w) continue;
      for (int v = 0; v < NV; ++v)
        acc[j][v] += Load(xrow + ix * g.c + c0 + 8 * v) * Load(grow + ox * g.c + c0 + 8 * v);
    }
  }
  for (int j = 0; j < K; ++j)
    for (int v = 0; v < NV; ++v) {
      float* p = dwrow + j * g.c + c0 + 8 * v;
      Store(p, Load(p) + acc[j][v]);
    }
}

template <int K>
void WeightGradRowK(const Geometry& g, const float* x, const float* gy, float* dw, int64_t b, int64_t oy) {
  int64_t lo, hi;
  InteriorColumns(g, &lo, &hi);
  const TapRows t = RowTaps(g, oy);
  const float* grow = gy + (b * g.oh + oy) * g.ow * g.c;
  const int64_t cw = g.c / (8 * kWeightGradNV) * (8 * kWeightGradNV), c8 = g.c / 8 * 8;
  for (int64_t i = t.lo; i < t.hi; ++i) {
    const float* xrow = x + (b * g.h + t.iy0 + i) * g.w * g.c;
    for (int64_t c0 = 0; c0 < cw; c0 += 8 * kWeightGradNV)
      WeightGradRowTile<K, kWeightGradNV>(g, xrow, grow, dw + i * K * g.c, c0, lo, hi);
    for (int64_t c0 = cw; c0 < c8; c0 += 8) WeightGradRowTile<K, 1>(g, xrow, grow, dw + i * K * g.c, c0, lo, hi);
  }
  for (int64_t c0 = c8; c0 < g.c; ++c0) WeightGradRowBlock<1>(g, x, gy, dw, b, oy, c0);
}

// Run kernel<CB> over the channels [c_begin, c_end) of one row: blocks of 32, then 8, then single channels.
template <template <int> class K, typename... Args>
void ChannelBlocks(int64_t c_begin, int64_t c_end, Args... args) {
  int64_t c0 = c_begin;
  for (; c0 + 32 <= c_end; c0 += 32) K<32>::Run(args..., c0);
  for (; c0 + 8 <= c_end; c0 += 8) K<8>::Run(args..., c0);
  for (; c0 < c_end; ++c0) K<1>::Run(args..., c0);
}

template <int CB>
struct ForwardPixelsK {
  static void Run(const Geometry& g, const float* x, const float* w, float* y, int64_t b, int64_t oy,
                  int64_t ox_begin, int64_t ox_end, int64_t c0) {
    ForwardPixels<CB>(g, x, w, y, b, oy, ox_begin, ox_end, c0);
  }
};

// Output columns [ox_begin, ox_end) and channels [c_begin, c_end) of one row, pixel by pixel.
void ForwardColumns(const Geometry& g, const float* x, const float* w, float* y, int64_t b, int64_t oy,
                    int64_t ox_begin, int64_t ox_end, int64_t c_begin, int64_t c_end) {
  if (ox_begin < ox_end) ChannelBlocks<ForwardPixelsK>(c_begin, c_end, g, x, w, y, b, oy, ox_begin, ox_end);
}

template <int CB>
struct InputGradK {
  static void Run(const Geometry& g, const float* gy, const float* w, float* dx, int64_t b, int64_t r,
                  int64_t c0) {
    InputGradRowBlock<CB>(g, gy, w, dx, b, r, c0);
  }
};
template <int CB>
struct WeightGradK {
  static void Run(const Geometry& g, const float* x, const float* gy, float* dw, int64_t b, int64_t r,
                  int64_t c0) {
    WeightGradRowBlock<CB>(g, x, gy, dw, b, r, c0);
  }
};

// One output row, every channel: 4 x 16 register tiles in the interior, pixel by pixel at the borders.
void ForwardRow(const Geometry& g, const float* x, const float* w, float* y, int64_t b, int64_t oy) {
  int64_t lo, hi;
  InteriorColumns(g, &lo, &hi);
  const TapRows t = RowTaps(g, oy);
  const int64_t c16 = g.c / (8 * kTileNV) * (8 * kTileNV);
  const int64_t tiles_end = lo + (hi - lo) / kTileOX * kTileOX;
  if (c16 > 0 && tiles_end > lo) {
    for (int64_t ox = lo; ox < tiles_end; ox += kTileOX)
      for (int64_t c0 = 0; c0 < c16; c0 += 8 * kTileNV)
        ForwardTile<kTileOX, kTileNV>(g, x, w, y, b, oy, ox, c0, t);
    // the columns outside the tiles, all channels; the tiles' columns for the channels past c16
    ForwardColumns(g, x, w, y, b, oy, 0, lo, 0, g.c);
    ForwardColumns(g, x, w, y, b, oy, tiles_end, g.ow, 0, g.c);
    ForwardColumns(g, x, w, y, b, oy, lo, tiles_end, c16, g.c);
  } else {
    ForwardColumns(g, x, w, y, b, oy, 0, g.ow, 0, g.c);
  }
}

void WeightGradRow(const Geometry& g, const float* x, const float* gy, float* dw, int64_t b, int64_t oy) {
  switch (g.k) {
    case 3: return WeightGradRowK<3>(g, x, gy, dw, b, oy);
    case 5: return WeightGradRowK<5>(g, x, gy, dw, b, oy);
    case 7: return WeightGradRowK<7>(g, x, gy, dw, b, oy);
    default: ChannelBlocks<WeightGradK>(0, g.c, g, x, gy, dw, b, oy);
  }
}

// Every output row of the forward convolution of x with w into y, spread over the thread pool.
void ForwardRows(ffi::ThreadPool& pool, const Geometry& g, const float* x, const float* w, float* y) {
  const int64_t rows = g.b * g.oh;
  jmsnas::ParallelFor(pool, jmsnas::NumWorkers(pool, rows), rows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) ForwardRow(g, x, w, y, r / g.oh, r % g.oh);
  });
}

ffi::Error CheckStride(int64_t s) {
  if (s != 1 && s != 2) return ffi::Error::InvalidArgument("jmsnas depthwise: stride must be 1 or 2");
  return ffi::Error::Success();
}

ffi::Error ForwardImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                       ffi::ResultBuffer<ffi::F32> y, int64_t stride) {
  if (auto e = CheckStride(stride); e.failure()) return e;
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 4 || wd.size() != 3 || wd[2] != xd[3])
    return ffi::Error::InvalidArgument("jmsnas depthwise forward: expected x [B,H,W,C] and w [k,k,C]");
  const Geometry g = MakeGeometry(xd[0], xd[1], xd[2], xd[3], wd[0], stride);
  ForwardRows(pool, g, x.typed_data(), w.typed_data(), y->typed_data());
  return ffi::Error::Success();
}

ffi::Error InputGradImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> gy, ffi::Buffer<ffi::F32> w,
                         ffi::ResultBuffer<ffi::F32> dx, int64_t stride) {
  if (auto e = CheckStride(stride); e.failure()) return e;
  auto xd = dx->dimensions();
  auto wd = w.dimensions();
  const Geometry g = MakeGeometry(xd[0], xd[1], xd[2], xd[3], wd[0], stride);
  auto gd = gy.dimensions();
  if (gd.size() != 4 || gd[1] != g.oh || gd[2] != g.ow || gd[3] != g.c)
    return ffi::Error::InvalidArgument("jmsnas depthwise input gradient: cotangent shape does not match");
  const float* gp = gy.typed_data();
  const float* wp = w.typed_data();
  float* dxp = dx->typed_data();
  if (stride == 1) {
    // For stride 1 with odd k, SAME pads (k - 1) / 2 on both sides, so the input gradient is the forward
    // convolution of the cotangent with the kernel flipped in both spatial axes.
    std::vector<float> flipped(static_cast<size_t>(g.k * g.k * g.c));
    for (int64_t i = 0; i < g.k; ++i)
      for (int64_t j = 0; j < g.k; ++j)
        std::memcpy(flipped.data() + (i * g.k + j) * g.c, wp + ((g.k - 1 - i) * g.k + (g.k - 1 - j)) * g.c,
                    sizeof(float) * g.c);
    ForwardRows(pool, g, gp, flipped.data(), dxp);
    return ffi::Error::Success();
  }
  const int64_t rows = g.b * g.h;
  jmsnas::ParallelFor(pool, jmsnas::NumWorkers(pool, rows), rows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) ChannelBlocks<InputGradK>(0, g.c, g, gp, wp, dxp, r / g.h, r % g.h);
  });
  return ffi::Error::Success();
}

// Rows of the weight gradient are cut into this many fixed blocks, each summed into its own accumulator and the
// blocks added in order, so the result does not depend on the thread count or on scheduling.
constexpr int64_t kWeightGradBlocks = 16;

ffi::Error WeightGradImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> gy,
                          ffi::ResultBuffer<ffi::F32> dw, int64_t stride) {
  if (auto e = CheckStride(stride); e.failure()) return e;
  auto xd = x.dimensions();
  auto wd = dw->dimensions();
  const Geometry g = MakeGeometry(xd[0], xd[1], xd[2], xd[3], wd[0], stride);
  auto gd = gy.dimensions();
  if (gd.size() != 4 || gd[1] != g.oh || gd[2] != g.ow || gd[3] != g.c)
    return ffi::Error::InvalidArgument("jmsnas depthwise weight gradient: cotangent shape does not match");
  const float* xp = x.typed_data();
  const float* gp = gy.typed_data();
  const int64_t rows = g.b * g.oh;
  const int64_t blocks = std::min<int64_t>(rows, kWeightGradBlocks);
  const int64_t taps = g.k * g.k * g.c;
  std::vector<float> partial(static_cast<size_t>(blocks) * taps, 0.0f);  // one accumulator per block of rows
  jmsnas::ParallelBlocks(pool, rows, blocks, [&](int64_t block, int64_t begin, int64_t end) {
    float* acc = partial.data() + block * taps;
    for (int64_t r = begin; r < end; ++r) WeightGradRow(g, xp, gp, acc, r / g.oh, r % g.oh);
  });
  jmsnas::AddBlocksInOrder(partial.data(), blocks, taps, dw->typed_data());
  return ffi::Error::Success();
}

}  // namespace

// All three handlers: (thread pool, two float32 inputs) -> one float32 output, attribute "stride".
static auto DepthwiseBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Ret<ffi::Buffer<ffi::F32>>()
      .Attr<int64_t>("stride");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JmsnasDepthwiseForward, ForwardImpl, DepthwiseBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JmsnasDepthwiseInputGrad, InputGradImpl, DepthwiseBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JmsnasDepthwiseWeightGrad, WeightGradImpl, DepthwiseBinding());
