// The weight gradient of a 1x1 convolution, out[K, N] = x[M, K]^T g[M, N] over a tall M (every pixel of the
// batch), as an XLA FFI handler for the CPU backend. Compiled with the other kernels by jmsnas/native/__init__.py.
//
// Why: XLA:CPU hands a dot that contracts the leading axis of both operands to Eigen's contraction (YNNPACK takes
// only the row-major form), which packs both operands and allocates per call: 13.0-13.6 ms for
// 65536x192^T @ 65536x32 on a 2-core AMD EPYC with AVX-512, against 7.4-9.1 ms here (benchmarks/bench_matmul_tn.py,
// two runs). The output is small (K x N <= 576 x 96 in the supernets), so register tiles of kRowTile output rows x
// 2 vectors of columns accumulate over chunks of 256 input rows that stay in L2.
//
// Register tiles follow the vector registers the instruction set has: with AVX-512 (32 registers of 16 floats)
// 8 x 2 accumulators; otherwise (AVX2: 16 registers of 8 floats) 6 x 2. A 16-float tile without AVX-512 needs twice
// the registers there are: GCC spills every accumulator, and the kernel ran 25x slower than XLA on a 2-core AMD
// EPYC with AVX2 only (1835 vs 70 ms for 65536x96^T @ 65536x576).
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

#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kRowTile = 8;
#else
constexpr int kLanes = 8;
constexpr int kRowTile = 6;
#endif
typedef float vec __attribute__((vector_size(4 * kLanes), aligned(4), may_alias));

constexpr int64_t kRowsPerChunk = 256;
constexpr int64_t kBlocks = 16;

// acc[KT x kLanes*NV] (leading dimension ldo) += x[rows, KT]^T g[rows, kLanes*NV], x and g with leading dimensions ldx, ldg.
template <int KT, int NV>
void Tile(int64_t rows, const float* x, int64_t ldx, const float* g, int64_t ldg, float* acc, int64_t ldo) {
  vec a[KT][NV];
  for (int i = 0; i < KT; ++i)
    for (int v = 0; v < NV; ++v) a[i][v] = *reinterpret_cast<const vec*>(acc + i * ldo + kLanes * v);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * ldx;
    const float* gr = g + r * ldg;
    vec gv[NV];
    for (int v = 0; v < NV; ++v) gv[v] = *reinterpret_cast<const vec*>(gr + kLanes * v);
    for (int i = 0; i < KT; ++i) {
      const float xi = xr[i];
      for (int v = 0; v < NV; ++v) a[i][v] += xi * gv[v];
    }
  }
  for (int i = 0; i < KT; ++i)
    for (int v = 0; v < NV; ++v) *reinterpret_cast<vec*>(acc + i * ldo + kLanes * v) = a[i][v];
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

// Output rows [k0, k0 + kt) (kt <= kRowTile) for every column, over `rows` input rows.
template <int KT>
void Strip(int64_t rows, int64_t n, const float* x, int64_t ldx, const float* g, int64_t ldg, float* acc,
           int64_t ldo) {
  int64_t j = 0;
  for (; j + 2 * kLanes <= n; j += 2 * kLanes) Tile<KT, 2>(rows, x, ldx, g + j, ldg, acc + j, ldo);
  for (; j + kLanes <= n; j += kLanes) Tile<KT, 1>(rows, x, ldx, g + j, ldg, acc + j, ldo);
  if (j < n) Corner(rows, KT, n - j, x, ldx, g + j, ldg, acc + j, ldo);
}

void Chunk(int64_t rows, int64_t k, int64_t n, const float* x, const float* g, float* acc) {
  int64_t i = 0;
  for (; i + kRowTile <= k; i += kRowTile) Strip<kRowTile>(rows, n, x + i, k, g, n, acc + i * n, n);
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
