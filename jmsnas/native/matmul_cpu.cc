// The weight gradient of a 1x1 convolution, out[K, N] = x[M, K]^T g[M, N] over a tall M (every pixel of the
// batch), as an XLA FFI handler for the CPU backend. Compiled with the other kernels by jmsnas/native/__init__.py.
//
// Why: XLA:CPU hands a dot that contracts the leading axis of both operands to Eigen's contraction (YNNPACK takes
// only the row-major form), which packs both operands and allocates per call: 13.0-13.6 ms for
// 65536x192^T @ 65536x32 on the 2-core EPYC, against 7.4-9.1 ms here (benchmarks/bench_matmul_tn.py, two
// runs). The output is small (K x N <= 576 x 96 in the supernets), so register tiles of 8 output rows x 32 (or 16)
// columns accumulate over chunks of 256 input rows that stay in L2.
//
// Determinism: the rows are cut into fixed blocks (a count that depends only on M), each summed into its own
// accumulator in row order, and the blocks added in order, so the result does not depend on the thread count or on
// scheduling.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "parallel.h"

namespace ffi = xla::ffi;

namespace {

typedef float v16 __attribute__((vector_size(64), aligned(4), may_alias));

constexpr int64_t kRowsPerChunk = 256;
constexpr int64_t kBlocks = 16;

// acc[KT x 16*NV] (leading dimension ldo) += x[rows, KT]^T g[rows, 16*NV], x and g with leading dimensions ldx, ldg.
template <int KT, int NV>
void Tile(int64_t rows, const float* x, int64_t ldx, const float* g, int64_t ldg, float* acc, int64_t ldo) {
  v16 a[KT][NV];
  for (int i = 0; i < KT; ++i)
    for (int v = 0; v < NV; ++v) a[i][v] = *reinterpret_cast<const v16*>(acc + i * ldo + 16 * v);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * ldx;
    const float* gr = g + r * ldg;
    v16 gv[NV];
    for (int v = 0; v < NV; ++v) gv[v] = *reinterpret_cast<const v16*>(gr + 16 * v);
    for (int i = 0; i < KT; ++i) {
      const float xi = xr[i];
      for (int v = 0; v < NV; ++v) a[i][v] += xi * gv[v];
    }
  }
  for (int i = 0; i < KT; ++i)
    for (int v = 0; v < NV; ++v) *reinterpret_cast<v16*>(acc + i * ldo + 16 * v) = a[i][v];
}

// The same for any kt x nt corner (the few output rows and columns the vector tiles leave).
void Corner(int64_t rows, int64_t kt, int64_t nt, const float* x, int64_t ldx, const float* g, int64_t ldg,
            float* acc, int64_t ldo) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < kt; ++i) {
      const float xi = x[r * ldx + i];
      for (int64_t j = 0; j < nt; ++j) acc[i * ldo + j] += xi * g[r * ldg + j];
    }
}

// Output rows [k0, k0 + kt) (kt <= 8) for every column, over `rows` input rows.
template <int KT>
void Strip(int64_t rows, int64_t n, const float* x, int64_t ldx, const float* g, int64_t ldg, float* acc,
           int64_t ldo) {
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) Tile<KT, 2>(rows, x, ldx, g + j, ldg, acc + j, ldo);
  for (; j + 16 <= n; j += 16) Tile<KT, 1>(rows, x, ldx, g + j, ldg, acc + j, ldo);
  if (j < n) Corner(rows, KT, n - j, x, ldx, g + j, ldg, acc + j, ldo);
}

void Chunk(int64_t rows, int64_t k, int64_t n, const float* x, const float* g, float* acc) {
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) Strip<8>(rows, n, x + i, k, g, n, acc + i * n, n);
  for (; i + 4 <= k; i += 4) Strip<4>(rows, n, x + i, k, g, n, acc + i * n, n);
  for (; i < k; ++i) Strip<1>(rows, n, x + i, k, g, n, acc + i * n, n);
}

ffi::Error MatmulTNImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> g,
                        ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions();
  auto gd = g.dimensions();
  auto od = out->dimensions();
  if (xd.size() != 2 || gd.size() != 2 || gd[0] != xd[0] || od.size() != 2 || od[0] != xd[1] || od[1] != gd[1])
    return ffi::Error::InvalidArgument("jmsnas matmul_tn: expected x [M, K], g [M, N], out [K, N]");
  const int64_t m = xd[0], k = xd[1], n = gd[1];
  const float* xp = x.typed_data();
  const float* gp = g.typed_data();
  float* op = out->typed_data();
  const int64_t blocks = std::max<int64_t>(std::min<int64_t>(kBlocks, (m + kRowsPerChunk - 1) / kRowsPerChunk), 1);
  std::vector<float> partial(static_cast<size_t>(blocks) * k * n, 0.0f);
  jmsnas::ParallelBlocks(pool, m, blocks, [&](int64_t block, int64_t begin, int64_t end) {
    float* acc = partial.data() + block * k * n;
    for (int64_t r = begin; r < end; r += kRowsPerChunk) {
      const int64_t rows = std::min(kRowsPerChunk, end - r);
      Chunk(rows, k, n, xp + r * k, gp + r * n, acc);
    }
  });
  jmsnas::AddBlocksInOrder(partial.data(), blocks, k * n, op);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JmsnasMatmulTN, MatmulTNImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
