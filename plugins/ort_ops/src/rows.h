// Row kernels of the fused MultiMax ops, compiled once per instruction set (rows_*.cc).
#pragma once
#include <cstddef>
#include <cstdint>

namespace multimax {

// The node's learned parameters: sigma(x) = x + t0*relu(r0-x) + t1*relu(x-r1) + t2*relu(r2-x)^2 + t3*relu(x-r3)^2.
struct Sigma {
  float r[4];
  float t[4];
};

// One instruction set's kernels. `mask` may be null (no mask); x, mask and y are contiguous rows of n.
struct RowKernels {
  const char* name;
  // y = softmax(sigma(x) [+ mask]) over one row: three passes over y, which stays in cache.
  void (*softmax_row)(const Sigma& p, const float* x, const float* mask, float* y, int64_t n);
  // y = sigma(x), elementwise.
  void (*sigma)(const Sigma& p, const float* x, float* y, int64_t n);
};

#define MULTIMAX_DECLARE_ISA(ns) \
  namespace ns { extern const RowKernels kernels; }
MULTIMAX_DECLARE_ISA(portable)
#if defined(__x86_64__)
MULTIMAX_DECLARE_ISA(avx2)
MULTIMAX_DECLARE_ISA(avx512)
#endif
#undef MULTIMAX_DECLARE_ISA

}  // namespace multimax
