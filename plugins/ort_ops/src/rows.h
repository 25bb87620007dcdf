// Row kernels of the fused MultiMax ops, compiled once per instruction set (rows_*.cc).
#pragma once
#include <cstddef>
#include <cstdint>

#include "family_ops.h"  // generated from models/onnx_contract.py by build.py: MULTIMAX_FAMILY

namespace multimax {

// The node's learned parameters: sigma(x) = x + t0*relu(r0-x) + t1*relu(x-r1) + t2*relu(r2-x)^2 + t3*relu(x-r3)^2.
struct Sigma {
  float r[4];
  float t[4];
};

// The members of the reweighting family, named by their masked op type, in the contract's order (FAMILY_OPS).
#define MULTIMAX_FN(op) op,
enum class Fn : int32_t { MULTIMAX_FAMILY(MULTIMAX_FN) };
#undef MULTIMAX_FN
#define MULTIMAX_COUNT(op) +1
constexpr int kFamilySize = 0 MULTIMAX_FAMILY(MULTIMAX_COUNT);
#undef MULTIMAX_COUNT

// One row's settings of a member other than MultiMax (whose parameters are a Sigma).
struct Reweight {
  Fn fn;
  int64_t k;            // TopKSoftMax
  float eps, m;         // LengthScaledSoftMax (m = 0: sqrt of the unmasked length)
  float offset, scale;  // Gaussian/Laplacian: this row's head's
};

// One instruction set's kernels. `mask` may be null (no mask); x, mask and y are contiguous rows of n.
struct RowKernels {
  const char* name;
  // y = softmax(sigma(x) [+ mask]) over one row: three passes over y, which stays in cache.
  void (*softmax_row)(const Sigma& p, const float* x, const float* mask, float* y, int64_t n);
  // y = sigma(x), elementwise.
  void (*sigma)(const Sigma& p, const float* x, float* y, int64_t n);
  // y = the reweighting function `p.fn` of x (+ mask: entries with mask <= -1e4 are masked and get 0) over one
  // row; `scratch` holds n floats (candidates of the sort/selection). y may be x.
  void (*reweight_row)(const Reweight& p, const float* x, const float* mask, float* y, int64_t n, float* scratch);
  // Attention: out[j] = scale * (q . k_j) over n rows of length d, `stride` apart.
  void (*scaled_dots)(const float* q, const float* k, int64_t n, int64_t d, int64_t stride, float scale, float* out);
  // out[0:d] = sum_j p[j] * v_j over n rows of length d, `stride` apart.
  void (*weighted_sum)(const float* p, const float* v, int64_t n, int64_t d, int64_t stride, float* out);
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
