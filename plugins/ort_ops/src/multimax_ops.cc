// onnxruntime custom-op library: the `multimax` domain's ops of the reweighting family (plugins/family.py) as
// fused CPU kernels, with the semantics of their ONNX function bodies (plugins/onnx_bodies.py). Every member
// (MULTIMAX_FAMILY, generated from the contract by build.py) has <Op>(x, mask) and <Op>NoMask(x), registered by
// one loop (FamilyOps); MultiMax adds MultiMaxSigma(x). MultiMax: sigma, then the mask (numpy broadcasting), then
// Softmax over the last axis (softmax_row / sigma in rows.inc). The others (SparseMax, EntMax15, EvSoftMax,
// TopKSoftMax, GaussianAttention, LaplacianAttention, LengthScaledSoftMax) follow the contract's masking rule
// (docs/REWEIGHTING.md): row kernels in reweight.inc.
//
// Written against the C API only (onnxruntime_c_api.h): no exception crosses the C boundary, every
// failure is an OrtStatus. The library does not link against onnxruntime; RegisterCustomOps asks the
// loading runtime for the API version these headers define, which newer runtimes still serve.
//
// MULTIMAX_ORT_ISA=portable|avx2|avx512 forces a kernel path (read when a session creates its kernels);
// a forced path the CPU lacks fails kernel creation with a clear status.

#include <onnxruntime_c_api.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "rows.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#define MM_EXPORT __attribute__((visibility("default")))

namespace multimax {
namespace {

const OrtApi* g_api = nullptr;
// Kernel runs, and those whose output took x's buffer (MultiMaxRunCounts: diagnostics and tests).
std::atomic<uint64_t> g_runs{0}, g_in_place_runs{0};

OrtStatus* fail(const std::string& msg, OrtErrorCode code = ORT_INVALID_ARGUMENT) {
  return g_api->CreateStatus(code, ("multimax: " + msg).c_str());
}

#define MM_RETURN_IF_ERROR(expr)        \
  do {                                  \
    if (OrtStatus* _s = (expr)) return _s; \
  } while (0)

// ---- kernel path selection -------------------------------------------------------------------

#if defined(__x86_64__)
// What the CPU has AND the OS saves across context switches: CPUID's feature bits alone are not enough
// (a kernel or hypervisor may leave the AVX/AVX-512 register state off), so XGETBV's XCR0 is checked too.
struct X86Features {
  bool avx2 = false, avx512 = false;
};

X86Features x86_features() {
  X86Features f;
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool fma = c & bit_FMA, osxsave = c & bit_OSXSAVE, avx = c & bit_AVX;
  if (!osxsave || !avx) return f;
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  const bool ymm_state = (lo & 0x6) == 0x6;      // SSE + AVX state
  const bool zmm_state = (lo & 0xe6) == 0xe6;    // ... + opmask, ZMM0-15 upper halves, ZMM16-31
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return f;
  f.avx2 = ymm_state && fma && (b & bit_AVX2);
  f.avx512 = zmm_state && fma && (b & bit_AVX512F);
  return f;
}
#endif

bool cpu_has(const std::string& isa) {
#if defined(__x86_64__)
  static const X86Features f = x86_features();
  if (isa == "avx512") return f.avx512;
  if (isa == "avx2") return f.avx2;
#endif
  return isa == "portable";
}

const RowKernels* kernels_for(const std::string& isa) {
  if (isa == "portable") return &portable::kernels;
#if defined(__x86_64__)
  if (isa == "avx2") return &avx2::kernels;
  if (isa == "avx512") return &avx512::kernels;
#endif
  return nullptr;
}

// The best path this CPU runs (what sessions use unless MULTIMAX_ORT_ISA forces one).
const RowKernels* best_kernels() {
  for (const char* isa : {"avx512", "avx2"})
    if (kernels_for(isa) && cpu_has(isa)) return kernels_for(isa);
  return &portable::kernels;
}

OrtStatus* choose_kernels(const RowKernels** out) {
  const char* forced = std::getenv("MULTIMAX_ORT_ISA");
  if (forced && *forced) {
    std::string isa(forced);
    if (!kernels_for(isa)) return fail("MULTIMAX_ORT_ISA=" + isa + ": unknown path (portable, avx2 or avx512)");
    if (!cpu_has(isa)) return fail("MULTIMAX_ORT_ISA=" + isa + ": this CPU does not support it", ORT_FAIL);
    *out = kernels_for(isa);
    return nullptr;
  }
  *out = best_kernels();
  return nullptr;
}

// ---- shapes ----------------------------------------------------------------------------------

struct Tensor {
  const float* data = nullptr;
  std::vector<int64_t> shape;
};

OrtStatus* read_input(OrtKernelContext* ctx, size_t index, const char* name, Tensor* t) {
  const OrtValue* value = nullptr;
  MM_RETURN_IF_ERROR(g_api->KernelContext_GetInput(ctx, index, &value));
  if (!value) return fail(std::string("input ") + name + " is missing");
  OrtTensorTypeAndShapeInfo* info = nullptr;
  MM_RETURN_IF_ERROR(g_api->GetTensorTypeAndShape(value, &info));
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  size_t rank = 0;
  OrtStatus* s = g_api->GetTensorElementType(info, &type);
  if (!s) s = g_api->GetDimensionsCount(info, &rank);
  if (!s) {
    t->shape.assign(rank, 0);
    s = g_api->GetDimensions(info, t->shape.data(), rank);
  }
  g_api->ReleaseTensorTypeAndShapeInfo(info);
  MM_RETURN_IF_ERROR(s);
  if (type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) return fail(std::string("input ") + name + " must be float32");
  void* data = nullptr;
  MM_RETURN_IF_ERROR(g_api->GetTensorMutableData(const_cast<OrtValue*>(value), &data));
  t->data = static_cast<const float*>(data);
  return nullptr;
}

OrtStatus* make_output(OrtKernelContext* ctx, const std::vector<int64_t>& shape, float** out) {
  OrtValue* value = nullptr;
  MM_RETURN_IF_ERROR(g_api->KernelContext_GetOutput(ctx, 0, shape.data(), shape.size(), &value));
  void* data = nullptr;
  MM_RETURN_IF_ERROR(g_api->GetTensorMutableData(value, &data));
  *out = static_cast<float*>(data);
  return nullptr;
}

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Row-major strides of `shape` left-padded to `rank`, 0 along broadcast (size-1) dimensions.
std::vector<int64_t> broadcast_strides(const std::vector<int64_t>& shape, const std::vector<int64_t>& out) {
  std::vector<int64_t> strides(out.size(), 0);
  int64_t stride = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    size_t d = shape.size() - 1 - i, o = out.size() - 1 - i;
    strides[o] = (shape[d] == 1 && out[o] != 1) ? 0 : stride;
    stride *= shape[d];
  }
  return strides;
}

// ---- the kernels' settings --------------------------------------------------------------------

enum class Op { kMasked, kNoMask, kSigma };

struct Kernel {
  Op op;
  Sigma params;  // MultiMax
  const RowKernels* rows;
  bool reweight = false;  // a member other than MultiMax (rw.fn)
  Reweight rw{};
  std::vector<float> offset, scale;  // Gaussian/Laplacian: 1 value, or one per head (axis 1 of rank-4 x)

  size_t heads() const { return std::max(offset.size(), scale.size()); }
  // This row's parameters: the per-head ones picked by the row's index along axis 1.
  Reweight row(int64_t head) const {
    Reweight p = rw;
    if (!offset.empty()) p.offset = offset[offset.size() > 1 ? head : 0];
    if (!scale.empty()) p.scale = scale[scale.size() > 1 ? head : 0];
    return p;
  }
};

// ---- parallel rows ---------------------------------------------------------------------------

// Work per task: enough elements (~16k, tens of microseconds) that the pool's dispatch cost vanishes.
constexpr int64_t kElementsPerTask = 1 << 14;

struct Job {
  const RowKernels* k;
  const Sigma* p;
  const Kernel* rw;  // a reweighting op's kernel (its function and per-head parameters), else null
  int64_t rows, n, rows_per_task;
  // Softmax ops: x/mask rows found through broadcast strides over the output's leading dimensions.
  const float* x;
  const float* mask;
  float* y;
  std::vector<int64_t> lead;                       // the output's dimensions before the last
  std::vector<int64_t> x_strides, m_strides;       // per leading dimension, 0 where broadcast
  int64_t x_last, m_last;                          // stride along the last axis: 1 or 0 (broadcast)
};

// Rows [begin, end): the x/mask offsets of the first from its index, then advanced like an odometer
// (no division per row; a row is only ~200 elements).
void run_rows(const Job& j, int64_t begin, int64_t end) {
  const size_t dims = j.lead.size();
  std::vector<int64_t> idx(dims);
  int64_t xo = 0, mo = 0, rem = begin;
  for (size_t d = dims; d-- > 0;) {
    idx[d] = rem % j.lead[d];
    rem /= j.lead[d];
    xo += idx[d] * j.x_strides[d];
    mo += idx[d] * j.m_strides[d];
  }
  std::vector<float> xbuf, mbuf;  // only for rows broadcast along the softmax axis
  std::vector<float> scratch(j.rw ? j.n : 0);  // the reweighting rows' sort/selection candidates
  for (int64_t r = begin; r < end; ++r) {
    const float* x = j.x + xo;
    const float* m = j.mask ? j.mask + mo : nullptr;
    if (j.x_last == 0) xbuf.assign(j.n, *x), x = xbuf.data();
    if (m && j.m_last == 0) mbuf.assign(j.n, *m), m = mbuf.data();
    if (j.rw)  // per-head parameters: rank-4 output (checked), the head is the index along axis 1
      j.k->reweight_row(j.rw->row(dims == 3 ? idx[1] : 0), x, m, j.y + r * j.n, j.n, scratch.data());
    else
      j.k->softmax_row(*j.p, x, m, j.y + r * j.n, j.n);
    for (size_t d = dims; d-- > 0;) {
      xo += j.x_strides[d];
      mo += j.m_strides[d];
      if (++idx[d] < j.lead[d]) break;
      xo -= j.x_strides[d] * j.lead[d];
      mo -= j.m_strides[d] * j.lead[d];
      idx[d] = 0;
    }
  }
}

void softmax_task(void* data, size_t task) {
  const Job& j = *static_cast<const Job*>(data);
  int64_t begin = static_cast<int64_t>(task) * j.rows_per_task;
  run_rows(j, begin, std::min(j.rows, begin + j.rows_per_task));
}

void sigma_task(void* data, size_t task) {
  const Job& j = *static_cast<const Job*>(data);
  int64_t begin = static_cast<int64_t>(task) * kElementsPerTask;
  int64_t end = std::min(j.rows * j.n, begin + kElementsPerTask);
  j.k->sigma(*j.p, j.x + begin, j.y + begin, end - begin);
}

OrtStatus* parallel(OrtKernelContext* ctx, void (*fn)(void*, size_t), int64_t tasks, Job* job) {
  if (tasks <= 1) {
    if (tasks == 1) fn(job, 0);
    return nullptr;
  }
  return g_api->KernelContext_ParallelFor(ctx, fn, static_cast<size_t>(tasks), 0, job);
}

// ---- the kernels -----------------------------------------------------------------------------

OrtStatus* read_floats(const OrtKernelInfo* info, const char* name, float out[4]) {
  size_t size = 0;
  OrtStatus* s = g_api->KernelInfoGetAttributeArray_float(info, name, nullptr, &size);
  if (s) {
    g_api->ReleaseStatus(s);
    return fail(std::string("attribute '") + name + "' (4 floats) is missing");
  }
  if (size != 4) return fail(std::string("attribute '") + name + "' must hold 4 floats, got " + std::to_string(size));
  return g_api->KernelInfoGetAttributeArray_float(info, name, out, &size);
}

// The reweighting ops' attributes (models.onnx_contract.REWEIGHTING_ATTRIBUTES), checked here so that a bad
// value fails session creation with a clear status rather than giving NaN rows.
OrtStatus* read_attr(const OrtKernelInfo* info, const char* name, int64_t* v) {
  if (OrtStatus* s = g_api->KernelInfoGetAttribute_int64(info, name, v))
    return g_api->ReleaseStatus(s), fail(std::string("attribute '") + name + "' (int) is missing");
  return nullptr;
}

OrtStatus* read_attr(const OrtKernelInfo* info, const char* name, float* v) {
  if (OrtStatus* s = g_api->KernelInfoGetAttribute_float(info, name, v))
    return g_api->ReleaseStatus(s), fail(std::string("attribute '") + name + "' (float) is missing");
  return nullptr;
}

OrtStatus* read_attr(const OrtKernelInfo* info, const char* name, std::vector<float>* v) {
  size_t size = 0;
  if (OrtStatus* s = g_api->KernelInfoGetAttributeArray_float(info, name, nullptr, &size))
    return g_api->ReleaseStatus(s), fail(std::string("attribute '") + name + "' (floats) is missing");
  if (size == 0) return fail(std::string("attribute '") + name + "' is empty (1 value, or one per head)");
  v->resize(size);
  return g_api->KernelInfoGetAttributeArray_float(info, name, v->data(), &size);
}

std::string str(float v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

OrtStatus* create_reweight(Fn fn, const OrtKernelInfo* info, Kernel* k) {
  k->reweight = true;
  k->rw.fn = fn;
  switch (fn) {
    case Fn::TopKSoftMax:
      MM_RETURN_IF_ERROR(read_attr(info, "k", &k->rw.k));
      if (k->rw.k < 1) return fail("attribute 'k' must be >= 1, got " + std::to_string(k->rw.k));
      break;
    case Fn::GaussianAttention:
    case Fn::LaplacianAttention:
      MM_RETURN_IF_ERROR(read_attr(info, "offset", &k->offset));
      MM_RETURN_IF_ERROR(read_attr(info, "scale", &k->scale));
      if (k->offset.size() > 1 && k->scale.size() > 1 && k->offset.size() != k->scale.size())
        return fail("attributes 'offset' and 'scale' must hold 1 value or one per head, the same number; got " +
                    std::to_string(k->offset.size()) + " and " + std::to_string(k->scale.size()));
      for (float v : k->offset)
        if (!std::isfinite(v)) return fail("attribute 'offset' must be finite, got " + str(v));
      for (float v : k->scale)
        if (!(v > 0.0f) || !std::isfinite(v)) return fail("attribute 'scale' must be > 0 and finite, got " + str(v));
      break;
    case Fn::LengthScaledSoftMax:
      MM_RETURN_IF_ERROR(read_attr(info, "eps", &k->rw.eps));
      MM_RETURN_IF_ERROR(read_attr(info, "m", &k->rw.m));
      if (!(k->rw.eps > 0.0f && k->rw.eps < 1.0f)) return fail("attribute 'eps' must be in (0, 1), got " + str(k->rw.eps));
      if (!(k->rw.m >= 0.0f) || !std::isfinite(k->rw.m))
        return fail("attribute 'm' must be >= 0 (0: the square root of the unmasked length), got " + str(k->rw.m));
      break;
    default:
      break;
  }
  return nullptr;
}

std::string heads_error(size_t heads, const std::vector<int64_t>& shape) {
  std::string dims;
  for (int64_t d : shape) dims += (dims.empty() ? "" : ", ") + (d < 0 ? std::string("?") : std::to_string(d));
  return "attributes 'offset'/'scale' hold " + std::to_string(heads) + " per-head values: the input must be rank 4 " +
         "(batch, heads, q, k) with " + std::to_string(heads) + " heads on axis 1, got shape (" + dims + ")";
}

// Per-head parameters against x's shape where the graph knows it (at session creation); where it does not,
// compute_softmax checks the output's shape on every run. (The masked op's output rank is x's unless the
// mask has more axes: then only the heads axis of a rank-4 x is checked here.)
OrtStatus* check_heads(const Kernel& k, const OrtKernelInfo* info) {
  if (k.heads() <= 1) return nullptr;
  OrtTypeInfo* type = nullptr;
  if (OrtStatus* s = g_api->KernelInfo_GetInputTypeInfo(info, 0, &type)) return g_api->ReleaseStatus(s), nullptr;
  const OrtTensorTypeAndShapeInfo* tensor = nullptr;
  std::vector<int64_t> shape;
  size_t rank = 0;
  OrtStatus* s = g_api->CastTypeInfoToTensorInfo(type, &tensor);
  if (!s && tensor) s = g_api->GetDimensionsCount(tensor, &rank);
  if (!s && tensor) shape.resize(rank), s = g_api->GetDimensions(tensor, shape.data(), rank);
  g_api->ReleaseTypeInfo(type);
  if (s || !tensor || rank == 0) return s ? (g_api->ReleaseStatus(s), nullptr) : nullptr;  // unknown: run time
  const bool bad_rank = k.op == Op::kNoMask && rank != 4;
  const bool bad_heads = rank == 4 && shape[1] > 0 && shape[1] != static_cast<int64_t>(k.heads());
  return bad_rank || bad_heads ? fail(heads_error(k.heads(), shape)) : nullptr;
}

OrtStatus* create_kernel(Op op, Fn fn, const OrtKernelInfo* info, void** out) {
  Kernel k{op, {}, nullptr};
  if (fn != Fn::MultiMax) {
    MM_RETURN_IF_ERROR(create_reweight(fn, info, &k));
    MM_RETURN_IF_ERROR(check_heads(k, info));
    MM_RETURN_IF_ERROR(choose_kernels(&k.rows));
    *out = new (std::nothrow) Kernel(k);
    return *out ? nullptr : fail("out of memory", ORT_FAIL);
  }
  MM_RETURN_IF_ERROR(read_floats(info, "ranges", k.params.r));
  MM_RETURN_IF_ERROR(read_floats(info, "ts", k.params.t));
  // `order` is metadata for the body (order-1 nodes carry ts[2:] = 0); an exported value outside 1/2 is corrupt.
  int64_t order = 2;
  if (OrtStatus* s = g_api->KernelInfoGetAttribute_int64(info, "order", &order)) g_api->ReleaseStatus(s);
  if (order != 1 && order != 2) return fail("attribute 'order' must be 1 or 2, got " + std::to_string(order));
  MM_RETURN_IF_ERROR(choose_kernels(&k.rows));
  *out = new (std::nothrow) Kernel(k);
  return *out ? nullptr : fail("out of memory", ORT_FAIL);
}

void count_run(const void* x, const float* y) {
  g_runs.fetch_add(1, std::memory_order_relaxed);
  if (x == y) g_in_place_runs.fetch_add(1, std::memory_order_relaxed);
}

OrtStatus* compute_softmax(const Kernel& k, OrtKernelContext* ctx) {
  Tensor x, mask;
  MM_RETURN_IF_ERROR(read_input(ctx, 0, "x", &x));
  if (k.op == Op::kMasked) MM_RETURN_IF_ERROR(read_input(ctx, 1, "mask", &mask));
  if (x.shape.empty()) return fail("x must have at least one dimension (softmax runs over the last)");
  std::vector<int64_t> out = x.shape;
  if (k.op == Op::kMasked) {
    size_t rank = std::max(x.shape.size(), mask.shape.size());
    std::vector<int64_t> xs(rank - x.shape.size(), 1), ms(rank - mask.shape.size(), 1);
    xs.insert(xs.end(), x.shape.begin(), x.shape.end());
    ms.insert(ms.end(), mask.shape.begin(), mask.shape.end());
    out.assign(rank, 0);
    for (size_t d = 0; d < rank; ++d) {
      if (xs[d] != ms[d] && xs[d] != 1 && ms[d] != 1)
        return fail("mask does not broadcast against x at dimension " + std::to_string(d) + " (" +
                    std::to_string(ms[d]) + " vs " + std::to_string(xs[d]) + ")");
      out[d] = xs[d] == 1 ? ms[d] : xs[d];
    }
  }
  if (k.reweight && k.heads() > 1 && (out.size() != 4 || out[1] != static_cast<int64_t>(k.heads())))
    return fail(heads_error(k.heads(), out));
  float* y = nullptr;
  MM_RETURN_IF_ERROR(make_output(ctx, out, &y));
  count_run(x.data, y);
  Job j{k.rows, &k.params, k.reweight ? &k : nullptr, 0, out.back(), 1, x.data, nullptr, y, {}, {}, {}, 1, 1};
  if (j.n == 0 || numel(out) == 0) return nullptr;
  j.rows = numel(out) / j.n;
  j.lead.assign(out.begin(), out.end() - 1);
  std::vector<int64_t> xst = broadcast_strides(x.shape, out);
  j.x_last = xst.back();
  j.x_strides.assign(xst.begin(), xst.end() - 1);
  j.m_strides.assign(j.lead.size(), 0);
  if (k.op == Op::kMasked) {
    std::vector<int64_t> mst = broadcast_strides(mask.shape, out);
    j.mask = mask.data;
    j.m_last = mst.back();
    j.m_strides.assign(mst.begin(), mst.end() - 1);
  }
  j.rows_per_task = std::max<int64_t>(1, kElementsPerTask / j.n);
  return parallel(ctx, softmax_task, (j.rows + j.rows_per_task - 1) / j.rows_per_task, &j);
}

OrtStatus* compute_sigma(const Kernel& k, OrtKernelContext* ctx) {
  Tensor x;
  MM_RETURN_IF_ERROR(read_input(ctx, 0, "x", &x));
  float* y = nullptr;
  MM_RETURN_IF_ERROR(make_output(ctx, x.shape, &y));
  count_run(x.data, y);
  Job j{k.rows, &k.params, nullptr, 1, numel(x.shape), 1, x.data, nullptr, y, {}, {}, {}, 1, 1};
  return parallel(ctx, sigma_task, (j.n + kElementsPerTask - 1) / kElementsPerTask, &j);
}

OrtStatus* compute(void* kernel, OrtKernelContext* ctx) noexcept {
  try {
    const Kernel& k = *static_cast<const Kernel*>(kernel);
    return k.op == Op::kSigma ? compute_sigma(k, ctx) : compute_softmax(k, ctx);
  } catch (const std::bad_alloc&) {
    return fail("out of memory", ORT_FAIL);
  } catch (...) {
    return fail("unexpected internal error", ORT_FAIL);
  }
}

// ---- shape inference and in-place output -----------------------------------------------------

// Output shape = x's (the masked op: x and mask broadcast, dimension by dimension where it is known).
// Knowing it lets onnxruntime's planner give the output x's buffer when x has no other reader (GetMayInplace
// below): one buffer less per node, and the output's lines are already in cache. Nothing is inferred
// where the inputs' shapes are unknown; that is not an error.
struct Dim {
  int64_t value;      // -1: unknown
  std::string name;   // symbolic name, if any
};

OrtStatus* dims_of(const OrtTensorTypeAndShapeInfo* info, std::vector<Dim>* out) {
  size_t rank = 0;
  MM_RETURN_IF_ERROR(g_api->GetDimensionsCount(info, &rank));
  std::vector<int64_t> values(rank);
  std::vector<const char*> names(rank, nullptr);
  MM_RETURN_IF_ERROR(g_api->GetDimensions(info, values.data(), rank));
  MM_RETURN_IF_ERROR(g_api->GetSymbolicDimensions(info, names.data(), rank));
  out->clear();
  for (size_t i = 0; i < rank; ++i) out->push_back({values[i], names[i] ? names[i] : ""});
  return nullptr;
}

Dim broadcast_dim(const Dim& a, const Dim& b) {
  if (a.value == 1) return b;
  if (b.value == 1) return a;
  if (a.value > 1) return a;  // b must be a.value (or the run fails the broadcast check)
  if (b.value > 1) return b;
  if (!a.name.empty() && a.name == b.name) return a;
  return {-1, ""};
}

OrtStatus* infer_masked_shape(OrtShapeInferContext* ctx, OrtTensorTypeAndShapeInfo* x) {
  OrtTensorTypeAndShapeInfo* mask = nullptr;
  if (OrtStatus* s = g_api->ShapeInferContext_GetInputTypeShape(ctx, 1, &mask)) return g_api->ReleaseStatus(s), nullptr;
  std::vector<Dim> xd, md;
  MM_RETURN_IF_ERROR(dims_of(x, &xd));
  MM_RETURN_IF_ERROR(dims_of(mask, &md));
  if (xd.empty() || md.empty()) return nullptr;  // rank unknown (a scalar would fail the run anyway)
  const size_t rank = std::max(xd.size(), md.size());
  xd.insert(xd.begin(), rank - xd.size(), Dim{1, ""});
  md.insert(md.begin(), rank - md.size(), Dim{1, ""});
  std::vector<int64_t> values;
  std::vector<const char*> names;
  std::vector<Dim> out;
  for (size_t i = 0; i < rank; ++i) out.push_back(broadcast_dim(xd[i], md[i]));
  for (const Dim& d : out) values.push_back(d.value), names.push_back(d.name.c_str());
  OrtTensorTypeAndShapeInfo* info = nullptr;
  MM_RETURN_IF_ERROR(g_api->CreateTensorTypeAndShapeInfo(&info));
  OrtStatus* s = g_api->SetTensorElementType(info, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
  if (!s) s = g_api->SetDimensions(info, values.data(), rank);
  if (!s) s = g_api->SetSymbolicDimensions(info, names.data(), rank);
  if (!s) s = g_api->ShapeInferContext_SetOutputTypeShape(ctx, 0, info);
  g_api->ReleaseTensorTypeAndShapeInfo(info);
  return s;
}

OrtStatus* infer_shape(Op op, OrtShapeInferContext* ctx) {
  OrtTensorTypeAndShapeInfo* x = nullptr;  // owned by the context
  if (OrtStatus* s = g_api->ShapeInferContext_GetInputTypeShape(ctx, 0, &x)) return g_api->ReleaseStatus(s), nullptr;
  if (op == Op::kMasked) return infer_masked_shape(ctx, x);
  size_t rank = 0;
  MM_RETURN_IF_ERROR(g_api->GetDimensionsCount(x, &rank));
  if (rank == 0) return nullptr;  // rank unknown: infer nothing (MultiMaxSigma of a scalar is a scalar anyway)
  return g_api->ShapeInferContext_SetOutputTypeShape(ctx, 0, x);
}

// ---- the OrtCustomOp tables ------------------------------------------------------------------

// Op types per member, indexed by Fn: {masked, NoMask} (models.onnx_contract.FAMILY_OPS, through family_ops.h).
#define MULTIMAX_NAMES(op) {#op, #op MULTIMAX_NO_MASK},
constexpr const char* kOpNames[][2] = {MULTIMAX_FAMILY(MULTIMAX_NAMES)};
#undef MULTIMAX_NAMES

// Member kFn's op: masked (kMasked), NoMask, or MultiMax's modulation alone (kSigma).
template <Op kOp, Fn kFn>
struct CustomOp : OrtCustomOp {
  static_assert(kOp != Op::kSigma || kFn == Fn::MultiMax, "only MultiMax has a Sigma op");
  static constexpr const char* name() {
    if (kOp == Op::kSigma) return MULTIMAX_SIGMA_OP;
    return kOpNames[static_cast<int>(kFn)][kOp == Op::kMasked ? 0 : 1];
  }
  CustomOp() {
    std::memset(static_cast<OrtCustomOp*>(this), 0, sizeof(OrtCustomOp));
    version = ORT_API_VERSION;
    GetName = [](const OrtCustomOp*) { return name(); };
    GetExecutionProviderType = [](const OrtCustomOp*) { return "CPUExecutionProvider"; };
    GetInputType = [](const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; };
    GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return kOp == Op::kMasked ? 2 : 1; };
    GetOutputType = [](const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; };
    GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return 1; };
    GetInputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; };
    GetOutputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; };
    GetInputMemoryType = [](const OrtCustomOp*, size_t) { return OrtMemTypeDefault; };
    GetVariadicInputMinArity = [](const OrtCustomOp*) { return 1; };
    GetVariadicInputHomogeneity = [](const OrtCustomOp*) { return 1; };
    GetVariadicOutputMinArity = [](const OrtCustomOp*) { return 1; };
    GetVariadicOutputHomogeneity = [](const OrtCustomOp*) { return 1; };
    KernelDestroy = [](void* k) { delete static_cast<Kernel*>(k); };
    CreateKernelV2 = [](const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** out) noexcept
        -> OrtStatusPtr {
      try {
        return create_kernel(kOp, kFn, info, out);
      } catch (...) {
        return fail("cannot create the kernel", ORT_FAIL);
      }
    };
    KernelComputeV2 = [](void* k, OrtKernelContext* ctx) -> OrtStatusPtr { return compute(k, ctx); };
    GetStartVersion = [](const OrtCustomOp*) { return 1; };
    GetEndVersion = [](const OrtCustomOp*) { return 1 << 30; };
    InferOutputShapeFn = [](const OrtCustomOp*, OrtShapeInferContext* ctx) noexcept -> OrtStatusPtr {
      try {
        return infer_shape(kOp, ctx);
      } catch (...) {
        return nullptr;  // no shape inferred: the output gets its own buffer
      }
    };
    // The output may take x's buffer: every kernel reads an element before writing that same element,
    // and rows (tasks) never overlap. Same-size buffers only (the planner checks the inferred shapes).
    GetMayInplace = [](int** in, int** out) -> size_t {
      *in = static_cast<int*>(std::malloc(sizeof(int)));
      *out = static_cast<int*>(std::malloc(sizeof(int)));
      if (!*in || !*out) return std::free(*in), std::free(*out), *in = *out = nullptr, 0;
      **in = **out = 0;
      return 1;
    };
    ReleaseMayInplace = [](int* in, int* out) { std::free(in), std::free(out); };
    GetAliasMap = [](int**, int**) -> size_t { return 0; };
    ReleaseAliasMap = [](int*, int*) {};
  }
};

// Every member's masked and NoMask op (Fn 0 .. kFamilySize-1), and MultiMaxSigma.
template <typename Fns>
struct FamilyOps;
template <int... kFns>
struct FamilyOps<std::integer_sequence<int, kFns...>> {
  std::tuple<CustomOp<Op::kMasked, static_cast<Fn>(kFns)>...> masked;
  std::tuple<CustomOp<Op::kNoMask, static_cast<Fn>(kFns)>...> nomask;
  CustomOp<Op::kSigma, Fn::MultiMax> sigma;
  std::vector<const OrtCustomOp*> all() const {
    std::vector<const OrtCustomOp*> out;
    std::apply([&](const auto&... op) { (out.push_back(&op), ...); }, masked);
    std::apply([&](const auto&... op) { (out.push_back(&op), ...); }, nomask);
    out.push_back(&sigma);
    return out;
  }
};
const FamilyOps<std::make_integer_sequence<int, kFamilySize>> g_family;

#include "attention.inc"

}  // namespace
}  // namespace multimax

extern "C" {

// Entry point onnxruntime calls from SessionOptions.register_custom_ops_library. The domain object is
// kept for the process's lifetime (sessions hold on to it).
MM_EXPORT OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  using namespace multimax;
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (!api) {
    const OrtApi* oldest = api_base->GetApi(1);  // every runtime serves version 1: enough to report why
    std::string msg = "multimax: this onnxruntime (" + std::string(api_base->GetVersionString()) +
                      ") does not serve API version " + std::to_string(ORT_API_VERSION);
    return oldest ? oldest->CreateStatus(ORT_FAIL, msg.c_str()) : nullptr;
  }
  g_api = api;
  OrtCustomOpDomain* domain = nullptr;
  MM_RETURN_IF_ERROR(api->CreateCustomOpDomain(MULTIMAX_DOMAIN, &domain));
  std::vector<const OrtCustomOp*> ops = g_family.all();
  ops.push_back(&g_attention);
  for (const OrtCustomOp* op : ops) MM_RETURN_IF_ERROR(api->CustomOpDomain_Add(domain, op));
  return api->AddCustomOpDomain(options, domain);
}

// For `python -m plugins.ort_ops` and the tests: the kernel paths this CPU can run, best (the default) first.
MM_EXPORT const char* MultiMaxKernelPaths() {
  using namespace multimax;
  static const std::string paths = [] {
    std::string out;
    for (const char* isa : {"avx512", "avx2"})
      if (kernels_for(isa) && cpu_has(isa)) out += std::string(isa) + ",";
    return out + "portable";
  }();
  return paths.c_str();
}

// Kernel runs in this process so far, and how many of them wrote their output into x's buffer.
MM_EXPORT void MultiMaxRunCounts(uint64_t* runs, uint64_t* in_place) {
  *runs = multimax::g_runs.load();
  *in_place = multimax::g_in_place_runs.load();
}

// y = sigma(x) over n floats on the calling thread (y may be x), for PyTorch on CPUs (plugins/cpu_sigma.py calls it
// by ctypes): the LM head's SegLU on a decode step's logits, one vectorised pass instead of a dozen tensor ops.
// isa: a kernel path, or null / empty for the CPU's best. 0 on success; -1: that path is unknown or this CPU
// lacks it.
MM_EXPORT int MultiMaxSigmaRow(const float* x, float* y, int64_t n, const float* ranges, const float* ts,
                               const char* isa) {
  using namespace multimax;
  const RowKernels* k = nullptr;
  if (isa && *isa) {
    if (!kernels_for(isa) || !cpu_has(isa)) return -1;
    k = kernels_for(isa);
  } else {
    static const RowKernels* best = best_kernels();
    k = best;
  }
  Sigma p;
  for (int i = 0; i < 4; ++i) p.r[i] = ranges[i], p.t[i] = ts[i];
  k->sigma(p, x, y, n);
  return 0;
}

// Every kernel path compiled into this library (whether or not this CPU runs it).
MM_EXPORT const char* MultiMaxCompiledPaths() {
#if defined(__x86_64__)
  return "avx512,avx2,portable";
#else
  return "portable";
#endif
}

}  // extern "C"
