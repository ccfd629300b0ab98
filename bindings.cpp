// bindings.cpp: the PyTorch face of kernels.cu. Every op is a dispatcher op, kernels::<name>
// (torch.ops.kernels.<name>, also kernels.<name>), registered at the end of its section: a CUDA
// implementation that checks its inputs (messages name the op and the argument), allocates outputs and
// launches on the current CUDA stream under a device guard; a meta implementation (shapes and dtypes, for
// fake tensors and torch.compile); and for a differentiable op an autograd Function whose backward is an
// op of its own made of our backward kernels. From Python the ops read like torch.nn.functional.
// Index ranges are the one check left to the kernels (see raise_pending_index_error): no op waits
// for the GPU.
//
// Non-contiguous inputs: matmul, linear and tiled attention read strided 2-D views (transposes,
// slices) directly, fused attention any (B, H, S, D) view with D contiguous (attention_operand),
// kv_write its k and v likewise (its caches must be contiguous: it writes them in place); every other
// op makes a contiguous copy first (cost: one extra copy).

#include <torch/extension.h>
#include <ATen/autocast_mode.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>

#include <cuda_bf16.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>
#include <string>

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using at::Tensor;

// ---- kernels.cu's launchers, limits and shared structs ----------------------------------------
// Part 0 of kernels.cu alone (no CUDA code): launch::<name> for each launcher, limits::<name> for what
// they accept, AttnLayout(s). A launcher defined there other than declared fails that file's build.
#define KERNELS_LAUNCHERS_ONLY
#include "kernels.cu"
#undef KERNELS_LAUNCHERS_ONLY

// ---- checks -----------------------------------------------------------------------------------

// Error messages are assembled here, numbers through std::to_string, and handed to TORCH_CHECK as
// one string (streaming integers into TORCH_CHECK's message crashed this extension on some setups).
static void put(std::string& s, const char* v) { s += v; }
static void put(std::string& s, const std::string& v) { s += v; }
static void put(std::string& s, int64_t v) { s += std::to_string(v); }
static void put(std::string& s, int v) { s += std::to_string(v); }
static void put(std::string& s, double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", v);
  s += b;
}
static void put(std::string& s, const c10::Device& d) { s += d.str(); }
static void put(std::string& s, at::ScalarType t) { s += c10::toString(t); }
static void put(std::string& s, at::IntArrayRef v) {
  s += "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  s += "]";
}
template <class... A>
static std::string msg(const A&... a) {
  std::string s;
  (put(s, a), ...);
  return s;
}
#define REQUIRE(cond, ...) TORCH_CHECK(cond, msg(__VA_ARGS__))
#define REQUIRE_VALUE(cond, ...) TORCH_CHECK_VALUE(cond, msg(__VA_ARGS__))

// A meta tensor (shapes and dtypes only: fake tensors, torch.compile's tracing) passes as a CUDA one, so
// the ops' meta versions run the same checks.
static bool cuda_or_meta(const Tensor& t) { return t.is_cuda() || t.is_meta(); }

static void check_float_cuda(const char* op, const Tensor& t, const char* name) {
  REQUIRE(t.defined(), op, ": ", name, " must be a tensor, got None");
  REQUIRE(cuda_or_meta(t), op, ": ", name, " must be a CUDA tensor, got ", t.device());
  REQUIRE(t.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ", t.scalar_type());
}

// Ops that take float32 or bfloat16 (bf16 values, fp32 arithmetic): the first tensor of a call sets the
// dtype, and every other one named this way must match it.
static void check_fp_cuda(const char* op, const Tensor& t, const char* name, const Tensor& first,
                          const char* first_name) {
  REQUIRE(t.defined(), op, ": ", name, " must be a tensor, got None");
  REQUIRE(cuda_or_meta(t), op, ": ", name, " must be a CUDA tensor, got ", t.device());
  if (&t == &first) {
    REQUIRE(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, op, ": ", name,
            " must be float32 or bfloat16, got ", t.scalar_type());
  } else {
    REQUIRE(t.scalar_type() == first.scalar_type(), op, ": ", name, " must be ", first.scalar_type(), " like ",
            first_name, ", got ", t.scalar_type());
  }
}

// An output dtype argument: None means `like`'s dtype; otherwise float32 or bfloat16.
static at::ScalarType out_dtype_or(const char* op, const std::optional<at::ScalarType>& dtype, const Tensor& like) {
  if (!dtype.has_value()) return like.scalar_type();
  REQUIRE_VALUE(*dtype == at::kFloat || *dtype == at::kBFloat16, op, ": out_dtype must be torch.float32 or ",
                "torch.bfloat16, got ", *dtype);
  return *dtype;
}

using bf16 = __nv_bfloat16;

// A tensor's data as the kernels' element type (nullptr for an undefined tensor).
template <class T>
static T* ptr(const Tensor& t) {
  return t.defined() ? reinterpret_cast<T*>(t.data_ptr()) : nullptr;
}

// Calls f with a value of the element type of dtype: float{} or bf16{} (launchers are templates on it).
template <class F>
static void with_type(at::ScalarType dtype, F&& f) {
  if (dtype == at::kBFloat16) f(bf16());
  else if (dtype == at::kFloat) f(float());
  else TORCH_CHECK(false, "internal: a kernel reached with dtype ", dtype, " (float32 or bfloat16 expected)");
}

static void check_index_cuda(const char* op, const Tensor& t, const char* name) {
  REQUIRE(t.defined(), op, ": ", name, " must be a tensor, got None");
  REQUIRE(cuda_or_meta(t), op, ": ", name, " must be a CUDA tensor, got ", t.device());
  REQUIRE(t.scalar_type() == at::kLong, op, ": ", name, " must be int64, got ", t.scalar_type());
}

static void check_same_device(const char* op, const Tensor& a, const char* an, const Tensor& b, const char* bn) {
  REQUIRE(a.device() == b.device(), op, ": ", an, " and ", bn, " must be on the same device, got ",
              a.device(), " and ", b.device());
}

static void check_dim(const char* op, const Tensor& t, const char* name, int64_t dim, const char* shape) {
  REQUIRE(t.dim() == dim, op, ": ", name, " must be ", dim, "-D ", shape, ", got shape ", t.sizes());
}

// Out-of-range indices (embedding's idx, cross_entropy's targets, expert_gemv's experts, kv_write's
// positions) are found by the kernels, on the device: checking them here would copy them to the host
// and stall the stream on every call, and could not run inside a CUDA graph. A bad index gives NaN in
// its rows (a bad kv_write position writes nothing), and the first one is left in a mailbox in pinned
// host memory (kernels.cu, 1.4). Every op raises it at entry, a host memory read with no
// sync, as a ValueError that names the op, the argument, the value and the valid range, and clears it;
// check_errors() waits for the current stream first.
static void raise_pending_index_error() {
  const char *op = nullptr, *arg = nullptr;
  int64_t value = 0, limit = 0;
  if (launch::take_index_error(&op, &arg, &value, &limit))
    REQUIRE_VALUE(false, op, ": ", arg, " out of range in an earlier call: got ", value, ", values must be in [0, ",
                  limit, ")");
}

void check_errors() {
  if (c10::cuda::device_count() == 0) return;
  // A sync is not allowed while the stream is captured; the mailbox is then read as it stands.
  if (c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None)
    at::cuda::getCurrentCUDAStream().synchronize();
  raise_pending_index_error();
}

static int to_int(const char* op, int64_t v, const char* what) {
  REQUIRE(v <= INT32_MAX, op, ": ", what, " = ", v, " exceeds the 2^31 - 1 limit of the kernels");
  return static_cast<int>(v);
}

static cudaStream_t stream() { return at::cuda::getCurrentCUDAStream(); }
static const float* fptr(const Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }
static float* ws_ptr(const Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }  // optional workspace

// ---- the dispatcher ---------------------------------------------------------------------------
// Each op is a PyTorch dispatcher op, kernels::<name> (its schema and registration end its section),
// so that torch.compile, fake tensors and torch.library.opcheck see it like one of PyTorch's own. A
// differentiable op has three parts: its CUDA implementation (<name>_cuda), a meta implementation (shapes
// and dtypes only, what fake tensors run), and an autograd Function whose forward calls the op below
// autograd and whose backward calls kernels::<name>_backward, an op too. Both go through the dispatcher,
// so a traced graph holds them as nodes and its backward is made of our kernels.

// kernels::NAME, typed like FN (its CUDA implementation), looked up once.
#define KERNELS_OP(NAME, FN)                                                                           \
  ([]() -> const c10::TypedOperatorHandle<decltype(FN)>& {                                            \
    static const auto handle =                                                                         \
        c10::Dispatcher::singleton().findSchemaOrThrow("kernels::" NAME, "").typed<decltype(FN)>(); \
    return handle;                                                                                     \
  }())

static bool requires_grad(const Tensor& t) { return t.defined() && t.requires_grad(); }
static bool requires_grad(const std::optional<Tensor>& t) { return t.has_value() && requires_grad(*t); }
template <class T>
static bool requires_grad(const T&) { return false; }  // not a tensor

// An Autograd kernel: Fn, the op's autograd Function, when a gradient will be wanted; else the op itself
// below autograd, without a Function's bookkeeping (a decode step calls a few hundred ops).
template <class... Args>
static bool wants_grad(const Args&... args) {
  return at::GradMode::is_enabled() && (requires_grad(args) || ...);
}

// The Autograd kernel of an op with no backward (decoding's): the op below autograd, its outputs
// requiring no gradient whatever its inputs do.
template <class Op, class... Args>
static auto call_below_autograd(const Op& op, const Args&... args) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(args...);
}

template <class Fn, class Op, class... Args>
static auto autograd_or_below(const Op& op, const Args&... args) {
  if (wants_grad(args...)) return Fn::apply(args...);
  return call_below_autograd(op, args...);
}

// Registration: each op's section ends with a TORCH_LIBRARY_FRAGMENT holding its schema (every argument's
// type and default, mutation as Tensor(a!)) and its implementations by dispatch key: cuda_meta (its
// CUDA implementation and its meta one, and with CPU_ERRORS the meta one for CPU tensors too, whose first
// check names the argument that must be a CUDA tensor), autograd (its Autograd kernel) or composite (an op
// made of other ops, for every backend at once). The autocast section registers the bf16 policy.
// def_op also exports the op as kernels.<name> (torch.ops.kernels.<name> itself, which torch.compile
// traces into its graph); def_half defines the forward and backward halves an autograd Function calls.
static std::vector<std::string>& exported_ops() {
  static std::vector<std::string> names;
  return names;
}

static void def_op(torch::Library& m, const char* schema) {
  m.def(schema);
  const std::string s = schema;
  exported_ops().push_back(s.substr(0, s.find('(')));
}

static void def_half(torch::Library& m, const char* schema) { m.def(schema); }

constexpr bool CPU_ERRORS = true;

template <class Cuda, class Meta>
static void cuda_meta(torch::Library& m, const char* name, Cuda* cuda, Meta* meta, bool cpu_errors = false) {
  m.impl(name, torch::dispatch(c10::DispatchKey::CUDA, cuda));
  m.impl(name, torch::dispatch(c10::DispatchKey::Meta, meta));
  if (cpu_errors) m.impl(name, torch::dispatch(c10::DispatchKey::CPU, meta));
}

template <class F>
static void autograd(torch::Library& m, const char* name, F* f) {
  m.impl(name, torch::dispatch(c10::DispatchKey::Autograd, f));
}

template <class F>
static void composite(torch::Library& m, const char* name, F* f) {
  m.impl(name, torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, f));
}

// A new tensor of x's shape and options, contiguous (what the CUDA implementations return for it).
static Tensor empty_like_contiguous(const Tensor& x, std::optional<at::ScalarType> dtype = std::nullopt) {
  return at::empty(x.sizes(), dtype ? x.options().dtype(*dtype) : x.options());
}

// Autocast: torch.autocast("cuda", dtype=torch.bfloat16) around our ops makes the choices autocast makes for
// PyTorch's: products (linear, matmul, attention) in bf16, linear's fp32 master weight and bias rounded by
// linear itself, which writes their gradients in fp32; the norms computing in fp32 and writing bf16 (the
// next product's input); softmax writing fp32; the rest as they come (activations and RoPE keep bf16, the
// cross-entropy's loss is fp32, the embedding and the residual stream stay fp32). Attention at a head size
// the fused kernels lack runs tiled in fp32 and rounds its output. Under float16 autocast the ops run as
// called: the kernels have no float16 path.

static bool bf16_autocast() { return at::autocast::get_autocast_dtype(at::kCUDA) == at::kBFloat16; }

static Tensor to_bf16(const Tensor& t) {
  return bf16_autocast() ? at::autocast::cached_cast(at::kBFloat16, t, c10::DeviceType::CUDA) : t;
}

// A norm's output dtype under autocast: bf16 unless the call names one.
static std::optional<at::ScalarType> norm_out(std::optional<at::ScalarType> out_dtype) {
  return out_dtype || !bf16_autocast() ? out_dtype : std::optional<at::ScalarType>(at::kBFloat16);
}

#define BELOW_AUTOCAST c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCUDA)

// ---- matmul on strided views ------------------------------------------------------------------

// A batch of matrices (dims 1, 2 of a 3-D tensor) as the kernel sees it: row-major with leading
// dim ld (trans = false) or column-major (trans = true), batch stride 0 when there is one matrix.
struct Mat {
  Tensor t;  // keeps a copy alive when one was needed
  bool trans;
  int64_t ld, batch_stride;
};

static Mat as_mat(const Tensor& m) {
  const int64_t R = m.size(1), C = m.size(2), s0 = m.stride(1), s1 = m.stride(2);
  const int64_t bs = m.size(0) == 1 ? 0 : m.stride(0);
  if ((C == 1 || s1 == 1) && (R == 1 || s0 >= C)) return {m, false, R == 1 ? C : s0, bs};
  if ((R == 1 || s0 == 1) && (C == 1 || s1 >= R)) return {m, true, C == 1 ? R : s1, bs};
  Tensor c = m.contiguous();
  return {c, false, C, c.size(0) == 1 ? 0 : R * C};
}

// The bf16 kernel reads operands through tensor maps, whose rows must start on 16 bytes. An operand
// that misses (an odd leading dim, an offset view) is copied once into rows padded to 8 elements.
static Mat tma_ready(const Mat& m) {
  if (launch::matmul_bf16_operand_ok(m.t.data_ptr(), m.ld, m.batch_stride)) return m;
  const int64_t batch = m.batch_stride == 0 ? 1 : m.t.size(0);
  const int64_t inner = m.trans ? m.t.size(1) : m.t.size(2), outer = m.trans ? m.t.size(2) : m.t.size(1);
  const int64_t ld = (inner + 7) / 8 * 8;
  Tensor buf = at::empty({batch, outer, ld}, m.t.options()).narrow(2, 0, inner);
  buf.copy_(m.trans ? m.t.narrow(0, 0, batch).transpose(1, 2) : m.t.narrow(0, 0, batch));
  return {m.trans ? buf.transpose(1, 2) : buf, m.trans, ld, batch == 1 ? 0 : outer * ld};
}

// c (batch, M, N), contiguous, = alpha * a (batch, M, K) @ b (batch, K, N) + bias. Small outputs
// with a long K (weight gradients) are split along K into a workspace from PyTorch's allocator.
// bf16 operands go to the Hopper bf16 kernel; c may then be bf16 or fp32.
// a_rowsum (bf16 only; fp32, M): also a's row sums over K, for one M-major a (M, K), strides (1, ld):
// the transpose of a contiguous dy, as a linear's weight gradient reads it.
static void mm(const Tensor& a, const Tensor& b, Tensor& c, const Tensor& bias = Tensor(), float alpha = 1.f,
               const Tensor& a_rowsum = Tensor()) {
  const char* op = "matmul";
  if (a.scalar_type() == at::kBFloat16) {
    const bool rowsum = a_rowsum.defined();
    // (the stride of a size-1 dim is arbitrary, even in a contiguous tensor: it does not count)
    REQUIRE(!rowsum || (a.size(0) == 1 && (a.size(1) == 1 || a.stride(1) == 1)), op,
            ": row sums need one M-major a");
    REQUIRE(!rowsum || (a_rowsum.scalar_type() == at::kFloat && a_rowsum.is_contiguous() &&
                        a_rowsum.numel() == a.size(1)), op, ": row sums go to a contiguous fp32 (M,)");
    // as_mat would call a one-column or one-row a row-major; the kernel sums rows of an M-major A
    const int64_t ld = a.size(2) == 1 ? a.size(1) : std::max<int64_t>(a.stride(2), 1);
    const Mat A = tma_ready(rowsum ? Mat{a, true, ld, 0} : as_mat(a));
    const Mat B = tma_ready(as_mat(b));
    const int batch = to_int(op, c.size(0), "batch"), M = to_int(op, c.size(1), "M"),
              N = to_int(op, c.size(2), "N"), K = to_int(op, a.size(2), "K");
    const size_t ws_floats = launch::matmul_bf16_workspace_floats(batch, M, N, K, rowsum);
    Tensor ws = ws_floats ? at::empty({(int64_t)ws_floats}, c.options().dtype(at::kFloat)) : Tensor();
    launch::matmul_bf16(ptr<bf16>(A.t), ptr<bf16>(B.t), ptr<bf16>(bias), c.data_ptr(), c.scalar_type() == at::kFloat, batch, M,
                N, K, A.trans, B.trans, A.ld, B.ld, N, A.batch_stride, B.batch_stride,
                batch == 1 ? 0 : (int64_t)M * N, alpha, rowsum ? a_rowsum.data_ptr<float>() : nullptr, ws_ptr(ws),
                stream());
    return;
  }
  REQUIRE(!a_rowsum.defined(), op, ": row sums are for bf16 operands");
  const Mat A = as_mat(a), B = as_mat(b);
  const int batch = to_int(op, c.size(0), "batch"), M = to_int(op, c.size(1), "M"), N = to_int(op, c.size(2), "N"),
            K = to_int(op, a.size(2), "K");
  const size_t ws_floats = launch::matmul_workspace_floats(batch, M, N, K);
  Tensor ws = ws_floats ? at::empty({(int64_t)ws_floats}, c.options()) : Tensor();
  launch::matmul(A.t.data_ptr<float>(), B.t.data_ptr<float>(), fptr(bias), c.data_ptr<float>(), batch, M, N, K, A.trans,
         B.trans, A.ld, B.ld, N, A.batch_stride, B.batch_stride, batch == 1 ? 0 : (int64_t)M * N, alpha,
         ws_floats ? ws.data_ptr<float>() : nullptr, stream());
}

static Tensor mm_new(const Tensor& a, const Tensor& b, float alpha = 1.f) {
  Tensor c = at::empty({std::max(a.size(0), b.size(0)), a.size(1), b.size(2)}, a.options());
  mm(a, b, c, Tensor(), alpha);
  return c;
}

// ---- linear -----------------------------------------------------------------------------------

// Mixed precision as autocast runs F.linear: a bf16 x with an fp32 (master) weight and bias. The product is
// bf16 from the weight rounded to bf16; the weight's and bias's gradients come back in fp32.
static bool master_weight(const Tensor& x, const Tensor& w) {
  return x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kFloat;
}

// The weight and bias the product reads: a master weight and its bias rounded to bf16, others as they are.
static std::pair<Tensor, Tensor> product_weights(const Tensor& x, const Tensor& w, const Tensor& b) {
  if (!master_weight(x, w)) return {w, b};
  return {w.to(at::kBFloat16), b.defined() ? b.to(at::kBFloat16) : b};
}

// Checks x (..., K), weight (N, K) and bias (N,) of linear; returns the bias, contiguous, or undefined.
static Tensor check_linear(const Tensor& x, const Tensor& w, const std::optional<Tensor>& b) {
  const char* op = "linear";
  check_fp_cuda(op, x, "x", x, "x");
  REQUIRE(w.defined(), op, ": weight must be a tensor, got None");
  if (master_weight(x, w)) check_fp_cuda(op, w, "weight", w, "weight");
  else check_fp_cuda(op, w, "weight", x, "x");
  check_dim(op, w, "weight", 2, "(out_features, in_features)");
  check_same_device(op, x, "x", w, "weight");
  REQUIRE(x.dim() >= 1 && x.size(-1) == w.size(1), op, ": x's last dim must equal weight.shape[1] = ",
              w.size(1), ", got x of shape ", x.sizes());
  if (!b.has_value() || !b->defined()) return Tensor();
  check_fp_cuda(op, *b, "bias", w, "weight");
  check_same_device(op, x, "x", *b, "bias");
  REQUIRE(b->dim() == 1 && b->size(0) == w.size(0), op, ": bias must have shape (", w.size(0), ",), got ",
              b->sizes());
  return b->contiguous();
}

static Tensor gemv_launch(const char* op, const Tensor& w, const Tensor& x, const Tensor& b, const Tensor& experts);

// y (..., N). One row (batch-1 decoding) goes to the GEMV kernel, which streams the weight once at memory
// speed, where the tensor-core matmul would fill one row of a 64-row tile.
Tensor linear_cuda(const Tensor& x, const Tensor& w, const std::optional<Tensor>& b) {
  raise_pending_index_error();
  const Tensor bias = check_linear(x, w, b);
  const c10::cuda::CUDAGuard guard(x.device());
  auto out_shape = x.sizes().vec();
  out_shape.back() = w.size(0);
  const auto [wc, bc] = product_weights(x, w, bias);  // a master weight and its bias rounded to bf16
  if (x.numel() == x.size(-1) && x.numel() > 0)
    return gemv_launch("linear", wc.contiguous(), x.reshape({1, -1}).contiguous(), bc, Tensor()).view(out_shape);
  // rows counted, not inferred: reshape cannot infer them from 0 elements (in_features = 0)
  const int64_t rows = c10::multiply_integers(x.sizes().begin(), x.sizes().end() - 1);
  Tensor y = at::empty({1, rows, w.size(0)}, x.options());
  mm(x.reshape({1, rows, w.size(1)}), wc.t().unsqueeze(0), y, bc);
  return y.view(out_shape);
}

Tensor linear_meta(const Tensor& x, const Tensor& w, const std::optional<Tensor>& b) {
  check_linear(x, w, b);
  auto out_shape = x.sizes().vec();
  out_shape.back() = w.size(0);
  return at::empty(out_shape, x.options());
}

// [dx, dw] + [db] with a bias. A master weight's gradients are written in fp32 by the kernels (the
// matmul's fp32 output, the column sums' fp32 finish), not rounded to bf16 and cast back as autocast's
// would be.
std::vector<Tensor> linear_backward_cuda(const Tensor& dy_in, const Tensor& x, const Tensor& w, bool has_bias) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = c10::multiply_integers(x.sizes().begin(), x.sizes().end() - 1);
  const Tensor x2 = x.reshape({1, rows, w.size(1)}), wc = product_weights(x, w, Tensor()).first;
  const Tensor dy = dy_in.reshape({1, rows, w.size(0)}).contiguous();
  const bool master = master_weight(x, w);
  const auto grad_options = master ? dy.options().dtype(at::kFloat) : dy.options();
  Tensor dx = mm_new(dy, wc.unsqueeze(0));                               // (M, N) @ (N, K)
  Tensor dw = at::empty({1, w.size(0), w.size(1)}, grad_options);
  // bf16: the bias gradient, dy's column sums, comes out of the weight gradient's product, which reads
  // dy anyway (as A's row sums); fp32, and in_features = 0 (no product), sum the columns on their own.
  const bool bias_in_product = has_bias && dy.scalar_type() == at::kBFloat16 && w.size(1) > 0;
  Tensor db = bias_in_product ? at::empty({w.size(0)}, dy.options().dtype(at::kFloat)) : Tensor();
  mm(dy.transpose(1, 2), x2, dw, Tensor(), 1.f, db);                    // (N, M) @ (M, K)
  if (bias_in_product && !master) db = db.to(at::kBFloat16);
  if (has_bias && !bias_in_product) {
    const int R = to_int("linear", dy.size(1), "rows"), C = to_int("linear", dy.size(2), "out_features");
    db = at::empty({C}, grad_options);
    Tensor part = at::empty({(int64_t)launch::colsum_chunks(R, C) * C}, dy.options().dtype(at::kFloat));
    with_type(dy.scalar_type(), [&](auto t) {
      using T = decltype(t);
      if (master) launch::bias_grad(ptr<T>(dy), part.data_ptr<float>(), db.data_ptr<float>(), R, C, stream());
      else launch::bias_grad(ptr<T>(dy), part.data_ptr<float>(), ptr<T>(db), R, C, stream());
    });
  }
  std::vector<Tensor> out{dx.view(x.sizes()), dw.squeeze(0)};
  if (has_bias) out.push_back(db);
  return out;
}

std::vector<Tensor> linear_backward_meta(const Tensor& dy, const Tensor& x, const Tensor& w, bool has_bias) {
  const auto grad_options = master_weight(x, w) ? dy.options().dtype(at::kFloat) : dy.options();
  std::vector<Tensor> out{at::empty(x.sizes(), dy.options()), at::empty(w.sizes(), grad_options)};
  if (has_bias) out.push_back(at::empty({w.size(0)}, grad_options));
  return out;
}

struct LinearFn : torch::autograd::Function<LinearFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& w, const std::optional<Tensor>& b) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->save_for_backward({x, w});
    ctx->saved_data["has_bias"] = b.has_value() && b->defined();
    return KERNELS_OP("linear", linear_cuda).call(x, w, b);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const auto r = KERNELS_OP("linear_backward", linear_backward_cuda).call(grads[0], s[0], s[1], has_bias);
    return {r[0], r[1], has_bias ? r[2] : Tensor()};
  }
};

Tensor linear_autograd(const Tensor& x, const Tensor& w, const std::optional<Tensor>& b) {
  return autograd_or_below<LinearFn>(KERNELS_OP("linear", linear_cuda), x, w, b);
}

TORCH_LIBRARY_FRAGMENT(kernels, m) {
  // y = x @ weight.T + bias, like F.linear; a bf16 x may take an fp32 (master) weight and bias.
  def_op(m, "linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  cuda_meta(m, "linear", linear_cuda, linear_meta, CPU_ERRORS);
  autograd(m, "linear", linear_autograd);
  def_half(m, "linear_backward(Tensor dy, Tensor x, Tensor weight, bool has_bias) -> Tensor[]");
  cuda_meta(m, "linear_backward", linear_backward_cuda, linear_backward_meta);
}

// Under bf16 autocast: x rounded to bf16, the fp32 master weight and bias rounded by linear itself.
Tensor linear_autocast(const Tensor& x, const Tensor& w, const std::optional<Tensor>& b) {
  BELOW_AUTOCAST;
  return KERNELS_OP("linear", linear_cuda).call(to_bf16(x), w, b);
}

TORCH_LIBRARY_IMPL(kernels, AutocastCUDA, m) {
  m.impl("linear", &linear_autocast);
}

// ---- matmul -----------------------------------------------------------------------------------

static void check_matmul(const Tensor& a, const Tensor& b) {
  const char* op = "matmul";
  check_fp_cuda(op, a, "a", a, "a");
  check_fp_cuda(op, b, "b", a, "a");
  check_same_device(op, a, "a", b, "b");
  REQUIRE((a.dim() == 2 && b.dim() == 2) || (a.dim() == 3 && b.dim() == 3), op,
          ": a and b must both be 2-D (M, K) @ (K, N) or both 3-D (B, M, K) @ (B, K, N), got shapes ", a.sizes(),
          " and ", b.sizes());
  REQUIRE(a.size(-1) == b.size(-2), op, ": inner dims must match, got a ", a.sizes(), " and b ", b.sizes());
  if (a.dim() == 3)
    REQUIRE(a.size(0) == b.size(0), op, ": a and b must have the same batch size (dim 0), got a ", a.sizes(),
            " and b ", b.sizes());
}

// 2-D a and b as a batch of one.
static Tensor as3(const Tensor& t) { return t.dim() == 2 ? t.unsqueeze(0) : t; }
static Tensor like_input(const Tensor& c, const Tensor& input) { return input.dim() == 2 ? c.squeeze(0) : c; }

Tensor matmul_cuda(const Tensor& a, const Tensor& b) {
  raise_pending_index_error();
  check_matmul(a, b);
  const c10::cuda::CUDAGuard guard(a.device());
  return like_input(mm_new(as3(a), as3(b)), a);
}

Tensor matmul_meta(const Tensor& a, const Tensor& b) {
  check_matmul(a, b);
  auto shape = a.sizes().vec();
  shape.back() = b.size(-1);
  return at::empty(shape, a.options());
}

std::tuple<Tensor, Tensor> matmul_backward_cuda(const Tensor& dc, const Tensor& a, const Tensor& b) {
  const c10::cuda::CUDAGuard guard(a.device());
  const Tensor g = as3(dc), a3 = as3(a), b3 = as3(b);
  return {like_input(mm_new(g, b3.transpose(1, 2)), a),   // dC @ B^T
          like_input(mm_new(a3.transpose(1, 2), g), b)};  // A^T @ dC
}

std::tuple<Tensor, Tensor> matmul_backward_meta(const Tensor&, const Tensor& a, const Tensor& b) {
  return {at::empty(a.sizes(), a.options()), at::empty(b.sizes(), b.options())};
}

struct MatmulFn : torch::autograd::Function<MatmulFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& a, const Tensor& b) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->save_for_backward({a, b});
    return KERNELS_OP("matmul", matmul_cuda).call(a, b);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const auto [da, db] = KERNELS_OP("matmul_backward", matmul_backward_cuda).call(grads[0], s[0], s[1]);
    return {da, db};
  }
};

Tensor matmul_autograd(const Tensor& a, const Tensor& b) {
  return autograd_or_below<MatmulFn>(KERNELS_OP("matmul", matmul_cuda), a, b);
}

TORCH_LIBRARY_FRAGMENT(kernels, m) {
  // a @ b, 2-D (M, K) @ (K, N) or batched 3-D (B, M, K) @ (B, K, N).
  def_op(m, "matmul(Tensor a, Tensor b) -> Tensor");
  cuda_meta(m, "matmul", matmul_cuda, matmul_meta, CPU_ERRORS);
  autograd(m, "matmul", matmul_autograd);
  def_half(m, "matmul_backward(Tensor dc, Tensor a, Tensor b) -> (Tensor, Tensor)");
  cuda_meta(m, "matmul_backward", matmul_backward_cuda, matmul_backward_meta);
}

// Under bf16 autocast: both operands in bf16.
Tensor matmul_autocast(const Tensor& a, const Tensor& b) {
  BELOW_AUTOCAST;
  return KERNELS_OP("matmul", matmul_cuda).call(to_bf16(a), to_bf16(b));
}

TORCH_LIBRARY_IMPL(kernels, AutocastCUDA, m) {
  m.impl("matmul", &matmul_autocast);
}

// ---- layernorm and RMSNorm --------------------------------------------------------------------

// x and the weights float32 or bfloat16 (all one dtype); y in out_dtype (default x's), so mixed
// precision can normalize the fp32 residual stream straight into the bf16 input of the next matmul.
// Statistics and arithmetic are fp32; dx comes back in x's dtype, dy in y's.
// add_layernorm / add_rmsnorm first add an addend (a sublayer's output, in out_dtype) to x: they return
// s = x + addend (x's dtype: the residual stream goes on from it) and the norm of s, in one pass, and
// their backward adds s's own gradient to the norm's (kernels.cu, "Residual add").
struct NormShape {
  int R, C;
};

static NormShape check_norm(const char* op, const Tensor& x, const Tensor& addend, const Tensor& w, const Tensor& b,
                            at::ScalarType out_dtype) {
  check_fp_cuda(op, x, "x", x, "x");
  check_fp_cuda(op, w, "weight", x, "x");
  check_same_device(op, x, "x", w, "weight");
  if (b.defined()) {
    check_fp_cuda(op, b, "bias", x, "x");
    check_same_device(op, x, "x", b, "bias");
  }
  REQUIRE(x.dim() >= 1, op, ": x must have at least one dim");
  const int64_t C = x.size(-1);
  REQUIRE(w.dim() == 1 && w.size(0) == C, op, ": weight must have shape (", C, ",), got ", w.sizes());
  if (b.defined()) REQUIRE(b.dim() == 1 && b.size(0) == C, op, ": bias must have shape (", C, ",), got ", b.sizes());
  if (addend.defined()) {
    REQUIRE(cuda_or_meta(addend), op, ": y must be a CUDA tensor, got ", addend.device());
    check_same_device(op, x, "x", addend, "y");
    REQUIRE(addend.sizes() == x.sizes(), op, ": y must have x's shape ", x.sizes(), ", got ", addend.sizes());
    REQUIRE(addend.scalar_type() == out_dtype, op, ": y must be ", out_dtype,
            " (out_dtype: the norm's output dtype, which a sublayer's output has), got ", addend.scalar_type());
    // the residual stream is the precise one: a bf16 stream with fp32 sublayer outputs would round y's
    // gradient differently from x's
    REQUIRE(!(x.scalar_type() == at::kBFloat16 && out_dtype == at::kFloat), op,
            ": a bfloat16 x takes a bfloat16 y (out_dtype), got float32");
  }
  return {to_int(op, x.numel() / std::max<int64_t>(C, 1), "rows"), to_int(op, C, "C")};
}

// Calls f(TI{}, TO{}) for the element types of x and y.
template <class F>
static void with_types(const Tensor& x, at::ScalarType y_dtype, F&& f) {
  with_type(x.scalar_type(), [&](auto ti) { with_type(y_dtype, [&](auto to) { f(ti, to); }); });
}

// The four ops are one: layernorm has a bias, RMSNorm none; add_* has an addend. kernels::norm_forward
// returns [y, rstd] + [mean] with a bias + [s] with an addend; kernels::norm_backward returns
// [dx, dw] + [db] with a bias + [the addend's gradient] when its dtype is not x's (else it is dx).
static const char* norm_name(bool add, bool rms) {
  return add ? (rms ? "add_rmsnorm" : "add_layernorm") : (rms ? "rmsnorm" : "layernorm");
}

std::vector<Tensor> norm_forward_cuda(const Tensor& x_in, const std::optional<Tensor>& addend_opt, const Tensor& w_in,
                                      const std::optional<Tensor>& b_opt, double eps,
                                      std::optional<at::ScalarType> out_dtype) {
  raise_pending_index_error();
  const Tensor addend_in = addend_opt.value_or(Tensor()), b_in = b_opt.value_or(Tensor());
  const bool add = addend_in.defined(), rms = !b_in.defined();
  const char* op = norm_name(add, rms);
  check_fp_cuda(op, x_in, "x", x_in, "x");
  const at::ScalarType y_dtype = out_dtype_or(op, out_dtype, x_in);
  const auto [R, C] = check_norm(op, x_in, addend_in, w_in, b_in, y_dtype);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const Tensor x = x_in.contiguous(), w = w_in.contiguous(), b = rms ? Tensor() : b_in.contiguous();
  const Tensor addend = add ? addend_in.contiguous() : Tensor();
  const auto stats = x.options().dtype(at::kFloat);
  Tensor y = empty_like_contiguous(x, y_dtype), sum = add ? empty_like_contiguous(x) : Tensor();
  Tensor mean = rms ? Tensor() : at::empty({R}, stats), rstd = at::empty({R}, stats);
  if (C > 0)
    with_types(x, y_dtype, [&](auto ti, auto to) {
      using TI = decltype(ti);
      using TO = decltype(to);
      if (rms)
        launch::rmsnorm_fwd(ptr<TI>(x), ptr<TO>(addend), ptr<TI>(w), ptr<TO>(y), ptr<TI>(sum), ptr<float>(rstd), R, C,
                    (float)eps, stream());
      else
        launch::layernorm_fwd(ptr<TI>(x), ptr<TO>(addend), ptr<TI>(w), ptr<TI>(b), ptr<TO>(y), ptr<TI>(sum),
                      ptr<float>(mean), ptr<float>(rstd), R, C, (float)eps, stream());
    });
  std::vector<Tensor> out{y, rstd};
  if (!rms) out.push_back(mean);
  if (add) out.push_back(sum);
  return out;
}

std::vector<Tensor> norm_forward_meta(const Tensor& x, const std::optional<Tensor>& addend_opt, const Tensor& w,
                                      const std::optional<Tensor>& b_opt, double,
                                      std::optional<at::ScalarType> out_dtype) {
  const Tensor addend = addend_opt.value_or(Tensor()), b = b_opt.value_or(Tensor());
  const char* op = norm_name(addend.defined(), !b.defined());
  check_fp_cuda(op, x, "x", x, "x");
  const at::ScalarType y_dtype = out_dtype_or(op, out_dtype, x);
  const auto [R, C] = check_norm(op, x, addend, w, b, y_dtype);
  std::vector<Tensor> out{empty_like_contiguous(x, y_dtype), at::empty({R}, x.options().dtype(at::kFloat))};
  if (b.defined()) out.push_back(at::empty({R}, x.options().dtype(at::kFloat)));
  if (addend.defined()) out.push_back(empty_like_contiguous(x));
  return out;
}

// x is s = x + addend for the add_* ops; dy (the norm's gradient) and dsum (s's) may be missing: an
// output nobody used.
std::vector<Tensor> norm_backward_cuda(const Tensor& x_in, const Tensor& w_in, const std::optional<Tensor>& mean_opt,
                                       const Tensor& rstd, const std::optional<Tensor>& dy_opt,
                                       const std::optional<Tensor>& dsum_opt, at::ScalarType y_dtype, bool add) {
  const Tensor mean = mean_opt.value_or(Tensor());
  const bool rms = !mean.defined();
  const c10::cuda::CUDAGuard guard(x_in.device());
  const Tensor x = x_in.contiguous(), w = w_in.contiguous();  // the kernels read rows; the Function saved views
  const Tensor dsum = dsum_opt.has_value() && dsum_opt->defined() ? dsum_opt->contiguous() : Tensor();
  const Tensor dy = dy_opt.has_value() && dy_opt->defined() ? dy_opt->contiguous()
                                                             : at::zeros_like(x, x.options().dtype(y_dtype));
  const int C = (int)w.size(0), R = (int)rstd.size(0);
  Tensor dx = at::empty_like(x), dw = at::empty_like(w), db = rms ? Tensor() : at::empty_like(w);
  // The addend's gradient is dx itself when the dtypes agree, else dx again in the addend's dtype.
  Tensor daddend = add && y_dtype != x.scalar_type() ? at::empty_like(x, x.options().dtype(y_dtype)) : Tensor();
  if (C > 0) {
    with_types(x, dy.scalar_type(), [&](auto ti, auto to) {
      using TI = decltype(ti);
      using TO = decltype(to);
      // the column sums' partial rows
      const Tensor ws = at::empty({launch::norm_bwd_workspace_floats<TI, TO>(rms, R, C)}, rstd.options());
      if (rms)
        launch::rmsnorm_bwd(ptr<TI>(x), ptr<TI>(w), ptr<TO>(dy), ptr<float>(rstd), ptr<TI>(dsum), ptr<TI>(dx),
                    ptr<TO>(daddend), ptr<TI>(dw), ptr<float>(ws), R, C, stream());
      else
        launch::layernorm_bwd(ptr<TI>(x), ptr<TI>(w), ptr<TO>(dy), ptr<float>(mean), ptr<float>(rstd), ptr<TI>(dsum),
                      ptr<TI>(dx), ptr<TO>(daddend), ptr<TI>(dw), ptr<TI>(db), ptr<float>(ws), R, C, stream());
    });
  }
  std::vector<Tensor> out{dx, dw};
  if (!rms) out.push_back(db);
  if (daddend.defined()) out.push_back(daddend);
  return out;
}

std::vector<Tensor> norm_backward_meta(const Tensor& x, const Tensor& w, const std::optional<Tensor>& mean,
                                       const Tensor&, const std::optional<Tensor>&, const std::optional<Tensor>&,
                                       at::ScalarType y_dtype, bool add) {
  std::vector<Tensor> out{empty_like_contiguous(x), empty_like_contiguous(w)};
  if (mean.has_value() && mean->defined()) out.push_back(empty_like_contiguous(w));
  if (add && y_dtype != x.scalar_type()) out.push_back(empty_like_contiguous(x, y_dtype));
  return out;
}

// Returns {y}, or {s, y} with the add. The optional tensors are std::optional, not undefined Tensors:
// autograd's apply() reads the device of every Tensor argument, which an undefined one does not have.
struct NormFn : torch::autograd::Function<NormFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const std::optional<Tensor>& addend,
                               const Tensor& w, const std::optional<Tensor>& b, double eps,
                               std::optional<at::ScalarType> out_dtype) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    // An output nobody used (s after the last layer) then reaches backward undefined, not as zeros.
    ctx->set_materialize_grads(false);
    const auto r = KERNELS_OP("norm_forward", norm_forward_cuda).call(x, addend, w, b, eps, out_dtype);
    const bool add = addend.has_value() && addend->defined(), rms = !(b.has_value() && b->defined());
    const Tensor &y = r[0], &rstd = r[1], mean = rms ? Tensor() : r[2], sum = add ? r.back() : Tensor();
    ctx->save_for_backward({add ? sum : x, w, mean, rstd});
    ctx->saved_data["add"] = add;
    ctx->saved_data["y_dtype"] = y.scalar_type();
    if (add) return {sum, y};
    return {y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const bool add = ctx->saved_data["add"].toBool(), rms = !s[2].defined();
    const auto y_dtype = ctx->saved_data["y_dtype"].toScalarType();
    const std::optional<Tensor> dsum = add ? std::optional<Tensor>(grads[0]) : std::nullopt;
    const std::optional<Tensor> dy = grads[add ? 1 : 0];
    const std::optional<Tensor> mean = rms ? std::nullopt : std::optional<Tensor>(s[2]);
    const auto r = KERNELS_OP("norm_backward", norm_backward_cuda).call(s[0], s[1], mean, s[3], dy, dsum, y_dtype, add);
    const Tensor db = rms ? Tensor() : r[2], daddend = add ? (r.size() > (rms ? 2u : 3u) ? r.back() : r[0]) : Tensor();
    return {r[0], daddend, r[1], db, Tensor(), Tensor()};
  }
};

// The four public ops. Below autograd (inference mode, and the backends' own calls) they are
// norm_forward's outputs; with autograd, NormFn's.

// A schema's Tensor takes Python's None as an undefined tensor, which norm_forward would read as no addend
// (an undefined y) or as RMSNorm (an undefined bias): the ops refuse it where they are entered, above and
// below autograd.
static void check_given(const char* op, const Tensor& t, const char* name) {
  REQUIRE(t.defined(), op, ": ", name, " must be a tensor, got None");
}

Tensor layernorm_impl(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                      std::optional<at::ScalarType> out_dtype) {
  check_given("layernorm", bias, "bias");
  return KERNELS_OP("norm_forward", norm_forward_cuda).call(x, std::nullopt, weight, bias, eps, out_dtype)[0];
}

Tensor rmsnorm_impl(const Tensor& x, const Tensor& weight, double eps, std::optional<at::ScalarType> out_dtype) {
  return KERNELS_OP("norm_forward", norm_forward_cuda).call(x, std::nullopt, weight, std::nullopt, eps, out_dtype)[0];
}

std::tuple<Tensor, Tensor> add_layernorm_impl(const Tensor& x, const Tensor& y, const Tensor& weight,
                                              const Tensor& bias, double eps, std::optional<at::ScalarType> out_dtype) {
  check_given("add_layernorm", y, "y");
  check_given("add_layernorm", bias, "bias");
  const auto r = KERNELS_OP("norm_forward", norm_forward_cuda).call(x, y, weight, bias, eps, out_dtype);
  return {r.back(), r[0]};
}

std::tuple<Tensor, Tensor> add_rmsnorm_impl(const Tensor& x, const Tensor& y, const Tensor& weight, double eps,
                                            std::optional<at::ScalarType> out_dtype) {
  check_given("add_rmsnorm", y, "y");
  const auto r = KERNELS_OP("norm_forward", norm_forward_cuda).call(x, y, weight, std::nullopt, eps, out_dtype);
  return {r.back(), r[0]};
}

Tensor layernorm_autograd(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                          std::optional<at::ScalarType> out_dtype) {
  check_given("layernorm", bias, "bias");
  if (wants_grad(x, weight, bias)) return NormFn::apply(x, std::nullopt, weight, bias, eps, out_dtype)[0];
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return layernorm_impl(x, weight, bias, eps, out_dtype);
}

Tensor rmsnorm_autograd(const Tensor& x, const Tensor& weight, double eps, std::optional<at::ScalarType> out_dtype) {
  if (wants_grad(x, weight)) return NormFn::apply(x, std::nullopt, weight, std::nullopt, eps, out_dtype)[0];
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return rmsnorm_impl(x, weight, eps, out_dtype);
}

std::tuple<Tensor, Tensor> add_layernorm_autograd(const Tensor& x, const Tensor& y, const Tensor& weight,
                                                  const Tensor& bias, double eps,
                                                  std::optional<at::ScalarType> out_dtype) {
  check_given("add_layernorm", y, "y");
  check_given("add_layernorm", bias, "bias");
  if (!wants_grad(x, y, weight, bias)) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return add_layernorm_impl(x, y, weight, bias, eps, out_dtype);
  }
  const auto r = NormFn::apply(x, y, weight, bias, eps, out_dtype);
  return {r[0], r[1]};
}

std::tuple<Tensor, Tensor> add_rmsnorm_autograd(const Tensor& x, const Tensor& y, const Tensor& weight, double eps,
                                                std::optional<at::ScalarType> out_dtype) {
  check_given("add_rmsnorm", y, "y");
  if (!wants_grad(x, y, weight)) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return add_rmsnorm_impl(x, y, weight, eps, out_dtype);
  }
  const auto r = NormFn::apply(x, y, weight, std::nullopt, eps, out_dtype);
  return {r[0], r[1]};
}

TORCH_LIBRARY_FRAGMENT(kernels, m) {
  // Norms over the last dim, like F.layer_norm and F.rms_norm; the result in out_dtype (None: x's). The add_*
  // forms return (s, norm(s)) with s = x + y in one pass (a sublayer's residual add and the next norm).
  def_op(m, "layernorm(Tensor x, Tensor weight, Tensor bias, float eps=1e-05, ScalarType? out_dtype=None) -> Tensor");
  composite(m, "layernorm", layernorm_impl);
  autograd(m, "layernorm", layernorm_autograd);
  def_op(m, "rmsnorm(Tensor x, Tensor weight, float eps=1e-05, ScalarType? out_dtype=None) -> Tensor");
  composite(m, "rmsnorm", rmsnorm_impl);
  autograd(m, "rmsnorm", rmsnorm_autograd);
  def_op(m, "add_layernorm(Tensor x, Tensor y, Tensor weight, Tensor bias, float eps=1e-05, "
         "ScalarType? out_dtype=None) -> (Tensor, Tensor)");
  composite(m, "add_layernorm", add_layernorm_impl);
  autograd(m, "add_layernorm", add_layernorm_autograd);
  def_op(m, "add_rmsnorm(Tensor x, Tensor y, Tensor weight, float eps=1e-05, ScalarType? out_dtype=None) "
         "-> (Tensor, Tensor)");
  composite(m, "add_rmsnorm", add_rmsnorm_impl);
  autograd(m, "add_rmsnorm", add_rmsnorm_autograd);
  def_half(m, "norm_forward(Tensor x, Tensor? addend, Tensor weight, Tensor? bias, float eps, "
           "ScalarType? out_dtype) -> Tensor[]");
  cuda_meta(m, "norm_forward", norm_forward_cuda, norm_forward_meta, CPU_ERRORS);
  def_half(m, "norm_backward(Tensor x, Tensor weight, Tensor? mean, Tensor rstd, Tensor? dy, Tensor? dsum, "
           "ScalarType y_dtype, bool add) -> Tensor[]");
  cuda_meta(m, "norm_backward", norm_backward_cuda, norm_backward_meta);
}

// Under bf16 autocast: computed in fp32, written in bf16 (the next product's input) unless out_dtype says.
Tensor layernorm_autocast(const Tensor& x, const Tensor& w, const Tensor& b, double eps,
                          std::optional<at::ScalarType> out_dtype) {
  BELOW_AUTOCAST;
  return KERNELS_OP("layernorm", layernorm_impl).call(x, w, b, eps, norm_out(out_dtype));
}

Tensor rmsnorm_autocast(const Tensor& x, const Tensor& w, double eps, std::optional<at::ScalarType> out_dtype) {
  BELOW_AUTOCAST;
  return KERNELS_OP("rmsnorm", rmsnorm_impl).call(x, w, eps, norm_out(out_dtype));
}

std::tuple<Tensor, Tensor> add_layernorm_autocast(const Tensor& x, const Tensor& y, const Tensor& w, const Tensor& b,
                                                  double eps, std::optional<at::ScalarType> out_dtype) {
  BELOW_AUTOCAST;
  return KERNELS_OP("add_layernorm", add_layernorm_impl).call(x, y, w, b, eps, norm_out(out_dtype));
}

std::tuple<Tensor, Tensor> add_rmsnorm_autocast(const Tensor& x, const Tensor& y, const Tensor& w, double eps,
                                                std::optional<at::ScalarType> out_dtype) {
  BELOW_AUTOCAST;
  return KERNELS_OP("add_rmsnorm", add_rmsnorm_impl).call(x, y, w, eps, norm_out(out_dtype));
}

TORCH_LIBRARY_IMPL(kernels, AutocastCUDA, m) {
  m.impl("layernorm", &layernorm_autocast);
  m.impl("rmsnorm", &rmsnorm_autocast);
  m.impl("add_layernorm", &add_layernorm_autocast);
  m.impl("add_rmsnorm", &add_rmsnorm_autocast);
}

// ---- Sinkhorn ---------------------------------------------------------------------------------

// The most streams (n) of Sinkhorn and the stream ops: kernels.cu keeps n x n state in registers.
constexpr int64_t MAX_STREAMS = limits::max_streams;

static void check_sinkhorn(const Tensor& logits, int64_t iters) {
  const char* op = "sinkhorn";
  check_float_cuda(op, logits, "logits");
  REQUIRE(logits.dim() >= 2 && logits.size(-1) == logits.size(-2), op,
          ": logits must have shape (..., n, n), square in its last two dims, got ", logits.sizes());
  const int64_t n = logits.size(-1);
  REQUIRE_VALUE(n >= 1 && n <= MAX_STREAMS, op, ": n = logits.shape[-1] must be in [1, ", MAX_STREAMS, "], got n = ",
                n);
  REQUIRE_VALUE(iters >= 1, op, ": iters must be >= 1, got iters = ", iters);
}

Tensor sinkhorn_cuda(const Tensor& logits, int64_t iters) {
  raise_pending_index_error();
  check_sinkhorn(logits, iters);
  const c10::cuda::CUDAGuard guard(logits.device());
  const Tensor x = logits.contiguous();
  Tensor p = at::empty_like(x);
  const int n = (int)x.size(-1);
  const int M = to_int("sinkhorn", x.numel() / (n * n), "number of matrices"), it = to_int("sinkhorn", iters, "iters");
  launch::sinkhorn_fwd(x.data_ptr<float>(), p.data_ptr<float>(), M, n, it, stream());
  return p;
}

Tensor sinkhorn_meta(const Tensor& logits, int64_t iters) {
  check_sinkhorn(logits, iters);
  return empty_like_contiguous(logits);
}

// The backward recomputes the iterations from the logits (kernels.cu, "Sinkhorn").
Tensor sinkhorn_backward_cuda(const Tensor& logits, const Tensor& dp_in, int64_t iters) {
  const c10::cuda::CUDAGuard guard(logits.device());
  const Tensor x = logits.contiguous(), dp = dp_in.contiguous();
  const int n = (int)x.size(-1), M = (int)(x.numel() / (n * n));
  Tensor dx = at::empty_like(x), ws = at::empty({launch::sinkhorn_workspace_floats(M, n, (int)iters)}, x.options());
  launch::sinkhorn_bwd(x.data_ptr<float>(), dp.data_ptr<float>(), dx.data_ptr<float>(), ws.data_ptr<float>(), M, n,
               (int)iters, stream());
  return dx;
}

Tensor sinkhorn_backward_meta(const Tensor& logits, const Tensor&, int64_t) { return empty_like_contiguous(logits); }

struct SinkhornFn : torch::autograd::Function<SinkhornFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& logits, int64_t iters) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->save_for_backward({logits});
    ctx->saved_data["iters"] = iters;
    return KERNELS_OP("sinkhorn", sinkhorn_cuda).call(logits, iters);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor logits = ctx->get_saved_variables()[0];
    const int64_t iters = ctx->saved_data["iters"].toInt();
    return {KERNELS_OP("sinkhorn_backward", sinkhorn_backward_cuda).call(logits, grads[0], iters), Tensor()};
  }
};

Tensor sinkhorn_autograd(const Tensor& logits, int64_t iters) {
  return autograd_or_below<SinkhornFn>(KERNELS_OP("sinkhorn", sinkhorn_cuda), logits, iters);
}

TORCH_LIBRARY_FRAGMENT(kernels, m) {
  // Hyper-connections (float32, n <= limits::max_streams streams): Sinkhorn-Knopp to a doubly stochastic matrix.
  def_op(m, "sinkhorn(Tensor logits, int iters=20) -> Tensor");
  cuda_meta(m, "sinkhorn", sinkhorn_cuda, sinkhorn_meta, CPU_ERRORS);
  autograd(m, "sinkhorn", sinkhorn_autograd);
  def_half(m, "sinkhorn_backward(Tensor logits, Tensor dp, int iters) -> Tensor");
  cuda_meta(m, "sinkhorn_backward", sinkhorn_backward_cuda, sinkhorn_backward_meta);
}

// ---- mhc-dynamic's coefficients ----------------------------------------------------------------
// From each token's K = 2n + n^2 projections of its streams: pre = sigmoid, post = 2 sigmoid and res =
// Sinkhorn of alpha (per group) * h + bias, one kernel each way (kernels.cu, "mhc-dynamic's coefficients").

// n for K = 2n + n^2 coefficients a token (K + 1 = (n + 1)^2), or 0 if K is no such count for n <= MAX_STREAMS.
static int64_t streams_of_coeffs(int64_t K) {
  for (int64_t n = 1; n <= MAX_STREAMS; ++n)
    if (2 * n + n * n == K) return n;
  return 0;
}

// Checks the arguments; returns n.
static int64_t check_hc_coeffs(const Tensor& h, const Tensor& alpha, const Tensor& bias, int64_t iters) {
  const char* op = "hc_coeffs";
  check_float_cuda(op, h, "h");
  check_float_cuda(op, alpha, "alpha");
  check_float_cuda(op, bias, "bias");
  REQUIRE(h.dim() >= 1, op, ": h must have shape (..., 2n + n^2), got a 0-dim tensor");
  const int64_t K = h.size(-1), n = streams_of_coeffs(K);
  REQUIRE_VALUE(n > 0, op, ": h's last dim must be 2n + n^2 for n in [1, ", MAX_STREAMS,
                "] (3, 8, 15, 24, 35, 48, 63 or 80), got ", K);
  REQUIRE(alpha.dim() == 1 && alpha.size(0) == 3, op, ": alpha must have shape (3,), got ", alpha.sizes());
  REQUIRE(bias.dim() == 1 && bias.size(0) == K, op, ": bias must have shape (", K, ",), got ", bias.sizes());
  REQUIRE(alpha.device() == h.device() && bias.device() == h.device(), op,
          ": h, alpha and bias must be on one device, got ", h.device(), ", ", alpha.device(), ", ", bias.device());
  REQUIRE_VALUE(iters >= 1, op, ": iters must be >= 1, got iters = ", iters);
  return n;
}

static std::vector<int64_t> with_dims(const Tensor& h, std::initializer_list<int64_t> last) {
  std::vector<int64_t> shape(h.sizes().begin(), h.sizes().end() - 1);
  shape.insert(shape.end(), last);
  return shape;
}

std::tuple<Tensor, Tensor, Tensor> hc_coeffs_cuda(const Tensor& h_in, const Tensor& alpha_in, const Tensor& bias_in,
                                                  int64_t iters) {
  raise_pending_index_error();
  const int64_t n = check_hc_coeffs(h_in, alpha_in, bias_in, iters);
  const c10::cuda::CUDAGuard guard(h_in.device());
  const Tensor h = h_in.contiguous(), alpha = alpha_in.contiguous(), bias = bias_in.contiguous();
  Tensor pre = at::empty(with_dims(h, {n}), h.options()), post = at::empty_like(pre);
  Tensor res = at::empty(with_dims(h, {n, n}), h.options());
  const int M = to_int("hc_coeffs", h.numel() / h.size(-1), "number of tokens");
  launch::hc_coeffs_fwd(h.data_ptr<float>(), alpha.data_ptr<float>(), bias.data_ptr<float>(), pre.data_ptr<float>(),
                post.data_ptr<float>(), res.data_ptr<float>(), M, (int)n, to_int("hc_coeffs", iters, "iters"),
                stream());
  return {pre, post, res};
}

std::tuple<Tensor, Tensor, Tensor> hc_coeffs_meta(const Tensor& h, const Tensor& alpha, const Tensor& bias,
                                                  int64_t iters) {
  const int64_t n = check_hc_coeffs(h, alpha, bias, iters);
  const Tensor pre = at::empty(with_dims(h, {n}), h.options());
  return {pre, at::empty_like(pre), at::empty(with_dims(h, {n, n}), h.options())};
}

// The backward recomputes Sinkhorn from h; an undefined gradient (an output nobody used) counts as zeros. Given the
// streams x (M, n, C) and dmerged (hc_pre's backward), dpre is the gradient of the merge stream_merge(x, pre), which
// the kernel computes from them (dpre_in unused).
static std::tuple<Tensor, Tensor, Tensor> coeffs_backward(const Tensor& h_in, const Tensor& alpha_in,
                                                          const Tensor& bias_in, const std::optional<Tensor>& dpre_in,
                                                          const std::optional<Tensor>& dpost_in,
                                                          const std::optional<Tensor>& dres_in, int64_t iters,
                                                          const Tensor& x = Tensor(),
                                                          const Tensor& dmerged = Tensor()) {
  const int64_t n = check_hc_coeffs(h_in, alpha_in, bias_in, iters);
  const c10::cuda::CUDAGuard guard(h_in.device());
  const Tensor h = h_in.contiguous(), alpha = alpha_in.contiguous(), bias = bias_in.contiguous();
  auto grad = [&](const std::optional<Tensor>& g, std::initializer_list<int64_t> last) {
    return g.has_value() && g->defined() ? g->contiguous() : at::zeros(with_dims(h, last), h.options());
  };
  const Tensor dpost = grad(dpost_in, {n}), dres = grad(dres_in, {n, n});
  const int M = (int)(h.numel() / h.size(-1));
  Tensor dh = at::empty_like(h), dalpha = at::empty_like(alpha), dbias = at::empty_like(bias);
  Tensor ws = at::empty({launch::hc_coeffs_workspace_floats(M, (int)n, (int)iters)}, h.options());
  if (dmerged.defined()) {
    launch::hc_pre_coeffs_bwd(x.data_ptr<float>(), dmerged.data_ptr<float>(), (int)x.size(-1), h.data_ptr<float>(),
                      alpha.data_ptr<float>(), bias.data_ptr<float>(), dpost.data_ptr<float>(), dres.data_ptr<float>(),
                      dh.data_ptr<float>(), dalpha.data_ptr<float>(), dbias.data_ptr<float>(), ws_ptr(ws), M, (int)n,
                      (int)iters, stream());
  } else {
    const Tensor dpre = grad(dpre_in, {n});
    launch::hc_coeffs_bwd(h.data_ptr<float>(), alpha.data_ptr<float>(), bias.data_ptr<float>(), dpre.data_ptr<float>(),
                  dpost.data_ptr<float>(), dres.data_ptr<float>(), dh.data_ptr<float>(), dalpha.data_ptr<float>(),
                  dbias.data_ptr<float>(), ws_ptr(ws), M, (int)n, (int)iters, stream());
  }
  return {dh, dalpha, dbias};
}

std::tuple<Tensor, Tensor, Tensor> hc_coeffs_backward_cuda(const Tensor& h, const Tensor& alpha, const Tensor& bias,
                                                           const std::optional<Tensor>& dpre,
                                                           const std::optional<Tensor>& dpost,
                                                           const std::optional<Tensor>& dres, int64_t iters) {
  return coeffs_backward(h, alpha, bias, dpre, dpost, dres, iters);
}

std::tuple<Tensor, Tensor, Tensor> hc_coeffs_backward_meta(const Tensor& h, const Tensor& alpha, const Tensor& bias,
                                                           const std::optional<Tensor>&, const std::optional<Tensor>&,
                                                           const std::optional<Tensor>&, int64_t) {
  return {empty_like_contiguous(h), empty_like_contiguous(alpha), empty_like_contiguous(bias)};
}

struct HcCoeffsFn : torch::autograd::Function<HcCoeffsFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& h, const Tensor& alpha, const Tensor& bias,
                               int64_t iters) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->set_materialize_grads(false);  // an unused output's gradient stays undefined: the kernel reads zeros
    ctx->save_for_backward({h, alpha, bias});
    ctx->saved_data["iters"] = iters;
    const auto [pre, post, res] = KERNELS_OP("hc_coeffs", hc_coeffs_cuda).call(h, alpha, bias, iters);
    return {pre, post, res};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    auto given = [](const Tensor& g) { return g.defined() ? std::optional<Tensor>(g) : std::nullopt; };
    const auto [dh, dalpha, dbias] = KERNELS_OP("hc_coeffs_backward", hc_coeffs_backward_cuda)
        .call(s[0], s[1], s[2], given(grads[0]), given(grads[1]), given(grads[2]),
              ctx->saved_data["iters"].toInt());
    return {dh, dalpha, dbias, Tensor()};
  }
};

std::tuple<Tensor, Tensor, Tensor> hc_coeffs_autograd(const Tensor& h, const Tensor& alpha, const Tensor& bias,
                                                      int64_t iters) {
  if (!wants_grad(h, alpha, bias)) return call_below_autograd(KERNELS_OP("hc_coeffs", hc_coeffs_cuda), h, alpha,
                                                              bias, iters);
  const auto r = HcCoeffsFn::apply(h, alpha, bias, iters);
  return {r[0], r[1], r[2]};
}

TORCH_LIBRARY_FRAGMENT(kernels, m) {
  // mhc-dynamic's coefficients (float32, n <= limits::max_streams streams) from each token's 2n + n^2 projections.
  def_op(m, "hc_coeffs(Tensor h, Tensor alpha, Tensor bias, int iters=20) -> (Tensor, Tensor, Tensor)");
  cuda_meta(m, "hc_coeffs", hc_coeffs_cuda, hc_coeffs_meta, CPU_ERRORS);
  autograd(m, "hc_coeffs", hc_coeffs_autograd);
  def_half(m, "hc_coeffs_backward(Tensor h, Tensor alpha, Tensor bias, Tensor? dpre, Tensor? dpost, Tensor? dres, "
           "int iters) -> (Tensor, Tensor, Tensor)");
  cuda_meta(m, "hc_coeffs_backward", hc_coeffs_backward_cuda, hc_coeffs_backward_meta);
}

// ---- mhc-dynamic's projection -----------------------------------------------------------------
// h = RMSNorm(x, weight) phi^T for x (..., D), a token's n streams flattened, and phi (2n + n^2, D): the norm
// and the narrow matmul in one kernel each way (kernels.cu, "mhc-dynamic's projection").

// Checks the arguments; returns n.
static int64_t check_hc_project(const Tensor& x, const Tensor& weight, const Tensor& phi) {
  const char* op = "hc_project";
  check_float_cuda(op, x, "x");
  check_float_cuda(op, weight, "weight");
  check_float_cuda(op, phi, "phi");
  REQUIRE(x.dim() >= 1 && x.size(-1) >= 1, op, ": x must have shape (..., D) with D >= 1, got ", x.sizes());
  const int64_t D = x.size(-1);
  REQUIRE(weight.dim() == 1 && weight.size(0) == D, op, ": weight must have shape (", D, ",), x's last dim, got ",
          weight.sizes());
  REQUIRE(phi.dim() == 2 && phi.size(1) == D, op, ": phi must have shape (2n + n^2, ", D, "), got ", phi.sizes());
  const int64_t n = streams_of_coeffs(phi.size(0));
  REQUIRE_VALUE(n > 0, op, ": phi's rows must be 2n + n^2 for n in [1, ", MAX_STREAMS,
                "] (3, 8, 15, 24, 35, 48, 63 or 80), got ", phi.size(0));
  REQUIRE(weight.device() == x.device() && phi.device() == x.device(), op,
          ": x, weight and phi must be on one device, got ", x.device(), ", ", weight.device(), ", ", phi.device());
  return n;
}

std::tuple<Tensor, Tensor> hc_project_forward_cuda(const Tensor& x_in, const Tensor& weight_in, const Tensor& phi_in,
                                                   double eps) {
  raise_pending_index_error();
  const int64_t n = check_hc_project(x_in, weight_in, phi_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const Tensor x = x_in.contiguous(), weight = weight_in.contiguous(), phi = phi_in.contiguous();
  const int64_t D = x.size(-1);
  Tensor h = at::empty(with_dims(x, {phi.size(0)}), x.options()), rstd = at::empty(with_dims(x, {}), x.options());
  const int M = to_int("hc_project", x.numel() / D, "number of tokens"), Di = to_int("hc_project", D, "x's last dim");
  const int64_t ws_floats = launch::hc_project_fwd_workspace_floats(M, (int)n, Di);
  const Tensor ws = ws_floats ? at::empty({ws_floats}, x.options()) : Tensor();
  launch::hc_project_fwd(x.data_ptr<float>(), weight.data_ptr<float>(), phi.data_ptr<float>(), h.data_ptr<float>(),
                 rstd.data_ptr<float>(), ws_ptr(ws), M, (int)n, Di, (float)eps, stream());
  return {h, rstd};
}

std::tuple<Tensor, Tensor> hc_project_forward_meta(const Tensor& x, const Tensor& weight, const Tensor& phi, double) {
  check_hc_project(x, weight, phi);
  return {at::empty(with_dims(x, {phi.size(0)}), x.options()), at::empty(with_dims(x, {}), x.options())};
}

std::tuple<Tensor, Tensor, Tensor> hc_project_backward_cuda(const Tensor& x_in, const Tensor& weight_in,
                                                            const Tensor& phi_in, const Tensor& h_in,
                                                            const Tensor& rstd_in, const Tensor& dh_in) {
  const int64_t n = check_hc_project(x_in, weight_in, phi_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const Tensor x = x_in.contiguous(), weight = weight_in.contiguous(), phi = phi_in.contiguous();
  const Tensor h = h_in.contiguous(), rstd = rstd_in.contiguous(), dh = dh_in.contiguous();
  const int64_t D = x.size(-1);
  const int M = (int)(x.numel() / D);
  Tensor dx = at::empty_like(x), dweight = at::empty_like(weight), dphi = at::empty_like(phi);
  Tensor ws = at::empty({launch::hc_project_bwd_workspace_floats(M, (int)n, (int)D)}, x.options());
  launch::hc_project_bwd(x.data_ptr<float>(), weight.data_ptr<float>(), phi.data_ptr<float>(), h.data_ptr<float>(),
                 rstd.data_ptr<float>(), dh.data_ptr<float>(), nullptr, nullptr, nullptr, dx.data_ptr<float>(),
                 dweight.data_ptr<float>(), dphi.data_ptr<float>(), ws_ptr(ws), M, (int)n, (int)D, stream());
  return {dx, dweight, dphi};
}

std::tuple<Tensor, Tensor, Tensor> hc_project_backward_meta(const Tensor& x, const Tensor& weight, const Tensor& phi,
                                                            const Tensor&, const Tensor&, const Tensor&) {
  return {empty_like_contiguous(x), empty_like_contiguous(weight), empty_like_contiguous(phi)};
}

struct HcProjectFn : torch::autograd::Function<HcProjectFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, const Tensor& phi, double eps) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const auto [h, rstd] = KERNELS_OP("hc_project_forward", hc_project_forward_cuda).call(x, weight, phi, eps);
    ctx->save_for_backward({x, weight, phi, h, rstd});
    return h;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const auto [dx, dweight, dphi] = KERNELS_OP("hc_project_backward", hc_project_backward_cuda)
        .call(s[0], s[1], s[2], s[3], s[4], grads[0]);
    return {dx, dweight, dphi, Tensor()};
  }
};

Tensor hc_project_impl(const Tensor& x, const Tensor& weight, const Tensor& phi, double eps) {
  return std::get<0>(KERNELS_OP("hc_project_forward", hc_project_forward_cuda).call(x, weight, phi, eps));
}

Tensor hc_project_autograd(const Tensor& x, const Tensor& weight, const Tensor& phi, double eps) {
  if (wants_grad(x, weight, phi)) return HcProjectFn::apply(x, weight, phi, eps);
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return hc_project_impl(x, weight, phi, eps);
}

TORCH_LIBRARY_FRAGMENT(kernels, m) {
  // mhc-dynamic's projection (float32, n <= limits::max_streams streams): RMSNorm(x, weight) phi^T, phi of 2n + n^2 rows.
  def_op(m, "hc_project(Tensor x, Tensor weight, Tensor phi, float eps=1e-05) -> Tensor");
  composite(m, "hc_project", hc_project_impl);
  autograd(m, "hc_project", hc_project_autograd);
  def_half(m, "hc_project_forward(Tensor x, Tensor weight, Tensor phi, float eps) -> (Tensor, Tensor)");
  cuda_meta(m, "hc_project_forward", hc_project_forward_cuda, hc_project_forward_meta, CPU_ERRORS);
  def_half(m, "hc_project_backward(Tensor x, Tensor weight, Tensor phi, Tensor h, Tensor rstd, Tensor dh) "
           "-> (Tensor, Tensor, Tensor)");
  cuda_meta(m, "hc_project_backward", hc_project_backward_cuda, hc_project_backward_meta);
}

// ---- stream mixing (hyper-connections) --------------------------------------------------------
// x (..., n, C): n residual streams per token; the coefficients are static (the same for every
// token) or per token (x's leading dims first). Static ones get the sum over all tokens as gradient.

// Checks x of a stream op; returns its leading dims (the tokens).
static std::vector<int64_t> check_streams(const char* op, const Tensor& x) {
  check_float_cuda(op, x, "x");
  REQUIRE(x.dim() >= 2, op, ": x must have shape (..., n, C), got ", x.sizes());
  const int64_t n = x.size(-2);
  REQUIRE_VALUE(n >= 1 && n <= MAX_STREAMS, op, ": n = x.shape[-2], the number of streams, must be in [1, ",
                MAX_STREAMS, "], got n = ", n);
  return x.sizes().slice(0, x.dim() - 2).vec();
}

// Coefficients h (name) of shape `base` (static) or x.shape[:-2] + base (per token); returns per token.
static bool check_coefs(const char* op, const Tensor& x, const Tensor& h, const char* name,
                        const std::vector<int64_t>& base, const char* base_text) {
  check_float_cuda(op, h, name);
  check_same_device(op, x, "x", h, name);
  std::vector<int64_t> per_token = x.sizes().slice(0, x.dim() - 2).vec();
  per_token.insert(per_token.end(), base.begin(), base.end());
  const bool is_static = h.sizes().equals(base);
  REQUIRE(is_static || h.sizes().equals(per_token), op, ": ", name, " must have shape ", base_text, " = ",
          at::IntArrayRef(base), " (static) or x.shape[:-2] + ", base_text, " = ", at::IntArrayRef(per_token),
          " (per token), got ", h.sizes());
  return !is_static;
}

static int64_t count_tokens(const std::vector<int64_t>& lead) {
  int64_t M = 1;
  for (int64_t d : lead) M *= d;
  return M;
}

// x (..., n, C), h (n,) or per token (..., n) -> (..., C); returns whether h is per token.
static bool check_stream_merge(const Tensor& x, const Tensor& h) {
  check_streams("stream_merge", x);
  return check_coefs("stream_merge", x, h, "h", {x.size(-2)}, "(n,)");
}

Tensor stream_merge_cuda(const Tensor& x_in, const Tensor& h_in) {
  raise_pending_index_error();
  const bool per_token = check_stream_merge(x_in, h_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const Tensor x = x_in.contiguous(), h = h_in.contiguous();
  std::vector<int64_t> shape = x.sizes().slice(0, x.dim() - 2).vec();
  const int M = to_int("stream_merge", count_tokens(shape), "number of tokens");
  const int n = (int)x.size(-2), C = to_int("stream_merge", x.size(-1), "C");
  shape.push_back(C);
  Tensor out = at::empty(shape, x.options());
  launch::stream_merge_fwd(x.data_ptr<float>(), h.data_ptr<float>(), out.data_ptr<float>(), M, n, C, per_token, stream());
  return out;
}

Tensor stream_merge_meta(const Tensor& x, const Tensor& h) {
  check_stream_merge(x, h);
  std::vector<int64_t> shape = x.sizes().slice(0, x.dim() - 2).vec();
  shape.push_back(x.size(-1));
  return at::empty(shape, x.options());
}

std::tuple<Tensor, Tensor> stream_merge_backward_cuda(const Tensor& x_in, const Tensor& h_in, const Tensor& dout_in) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  const Tensor x = x_in.contiguous(), h = h_in.contiguous(), dout = dout_in.contiguous();
  const int n = (int)x.size(-2), C = (int)x.size(-1), M = (int)count_tokens(x.sizes().slice(0, x.dim() - 2).vec());
  const bool per_token = h.dim() > 1;
  Tensor dx = at::empty_like(x), dh = at::empty_like(h);
  Tensor part = per_token ? Tensor() : at::empty({(int64_t)launch::stream_coef_rows(M) * n}, x.options());  // blocks' sums
  launch::stream_merge_bwd(x.data_ptr<float>(), h.data_ptr<float>(), dout.data_ptr<float>(), dx.data_ptr<float>(),
                   dh.data_ptr<float>(), ws_ptr(part), M, n, C, per_token, stream());
  return {dx, dh};
}

std::tuple<Tensor, Tensor> stream_merge_backward_meta(const Tensor& x, const Tensor& h, const Tensor&) {
  return {empty_like_contiguous(x), empty_like_contiguous(h)};
}

struct StreamMergeFn : torch::autograd::Function<StreamMergeFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& h) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->save_for_backward({x, h});
    return KERNELS_OP("stream_merge", stream_merge_cuda).call(x, h);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const auto [dx, dh] = KERNELS_OP("stream_merge_backward", stream_merge_backward_cuda).call(s[0], s[1], grads[0]);
    return {dx, dh};
  }
};

Tensor stream_merge_autograd(const Tensor& x, const Tensor& h) {
  return autograd_or_below<StreamMergeFn>(KERNELS_OP("stream_merge", stream_merge_cuda), x, h);
}

// x (..., n, C), h_res (n, n) and h_post (n,) or both per token, y (..., C) float32 or bfloat16 (the sublayer's
// output), and for stream_mix_merge h_pre like h_post; returns whether the coefficients are per token.
static bool check_stream_mix(const char* op, const Tensor& x, const Tensor& h_res, const Tensor& h_post,
                             const Tensor& y, const Tensor* h_pre = nullptr) {
  std::vector<int64_t> y_shape = check_streams(op, x);
  const int64_t n = x.size(-2);
  const bool res_per_token = check_coefs(op, x, h_res, "h_res", {n, n}, "(n, n)");
  const bool post_per_token = check_coefs(op, x, h_post, "h_post", {n}, "(n,)");
  REQUIRE(res_per_token == post_per_token, op, ": h_res and h_post must be both static ((n, n) and (n,)) or ",
          "both per token, got h_res ", h_res.sizes(), " and h_post ", h_post.sizes(), " for x ", x.sizes());
  if (h_pre)
    REQUIRE(check_coefs(op, x, *h_pre, "h_pre", {n}, "(n,)") == post_per_token, op, ": h_pre must be ",
            post_per_token ? "per token" : "static", " like h_post ", h_post.sizes(), ", got ", h_pre->sizes());
  check_fp_cuda(op, y, "y", y, "y");
  check_same_device(op, x, "x", y, "y");
  to_int(op, count_tokens(y_shape), "number of tokens");
  to_int(op, x.size(-1), "C");
  y_shape.push_back(x.size(-1));
  REQUIRE(y.sizes().equals(y_shape), op, ": y must have shape x.shape[:-2] + (C,) = ", at::IntArrayRef(y_shape),
          ", got ", y.sizes());
  return res_per_token;
}

// The mix, and with h_pre defined the merge of its output (stream_mix_merge's second output; else undefined).
static std::tuple<Tensor, Tensor> mix_forward(const char* op, const Tensor& x_in, const Tensor& h_res_in,
                                              const Tensor& h_post_in, const Tensor& y_in, const Tensor& h_pre_in) {
  raise_pending_index_error();
  const Tensor* h_pre_arg = h_pre_in.defined() ? &h_pre_in : nullptr;
  const bool per_token = check_stream_mix(op, x_in, h_res_in, h_post_in, y_in, h_pre_arg);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const Tensor x = x_in.contiguous(), h_res = h_res_in.contiguous(), h_post = h_post_in.contiguous(),
               y = y_in.contiguous(), h_pre = h_pre_in.defined() ? h_pre_in.contiguous() : Tensor();
  const int n = (int)x.size(-2), C = (int)x.size(-1), M = (int)count_tokens(x.sizes().slice(0, x.dim() - 2).vec());
  Tensor out = at::empty(x.sizes(), x.options());
  Tensor merged = h_pre.defined() ? at::empty(y.sizes(), x.options()) : Tensor();
  with_type(y.scalar_type(), [&](auto t) {
    using T = decltype(t);
    launch::stream_mix_fwd<T>(x.data_ptr<float>(), h_res.data_ptr<float>(), h_post.data_ptr<float>(), ptr<T>(y),
                      fptr(h_pre), out.data_ptr<float>(), ws_ptr(merged), M, n, C, per_token, stream());
  });
  return {out, merged};
}

// dx, dh_res, dh_post, dy, and with h_pre defined dh_pre (the merge's dout is dmerged).
static std::vector<Tensor> mix_backward(const Tensor& x_in, const Tensor& h_res_in, const Tensor& h_post_in,
                                        const Tensor& y_in, const Tensor& h_pre_in, const Tensor& dout_in,
                                        const Tensor& dmerged_in) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  const Tensor x = x_in.contiguous(), h_res = h_res_in.contiguous(), h_post = h_post_in.contiguous(),
               y = y_in.contiguous(), dout = dout_in.contiguous();
  const bool merge = h_pre_in.defined();
  const Tensor h_pre = merge ? h_pre_in.contiguous() : Tensor(), dmerged = merge ? dmerged_in.contiguous() : Tensor();
  const bool per_token = h_post.dim() > 1;
  const int64_t n = x.size(-2);
  const int C = (int)x.size(-1), M = (int)count_tokens(x.sizes().slice(0, x.dim() - 2).vec());
  Tensor dx = at::empty_like(x), dy = at::empty_like(y), dh_res = at::empty_like(h_res),
         dh_post = at::empty_like(h_post), dh_pre = merge ? at::empty_like(h_pre) : Tensor();
  const int64_t K = n * n + (merge ? 2 : 1) * n;  // static: the blocks' sums of every coefficient's gradient
  Tensor part = per_token ? Tensor() : at::empty({launch::stream_coef_rows(M) * K}, x.options());
  with_type(y.scalar_type(), [&](auto t) {
    using T = decltype(t);
    launch::stream_mix_bwd<T>(x.data_ptr<float>(), h_res.data_ptr<float>(), h_post.data_ptr<float>(), ptr<T>(y),
                      fptr(h_pre), dout.data_ptr<float>(), fptr(dmerged), dx.data_ptr<float>(), ptr<T>(dy),
                      dh_res.data_ptr<float>(), dh_post.data_ptr<float>(), ws_ptr(dh_pre), ws_ptr(part), M, (int)n, C,
                      per_token, stream());
  });
  std::vector<Tensor> grads{dx, dh_res, dh_post, dy};
  if (merge) grads.push_back(dh_pre);
  return grads;
}

Tensor stream_mix_cuda(const Tensor& x, const Tensor& h_res, const Tensor& h_post, const Tensor& y) {
  return std::get<0>(mix_forward("stream_mix", x, h_res, h_post, y, Tensor()));
}

Tensor stream_mix_meta(const Tensor& x, const Tensor& h_res, const Tensor& h_post, const Tensor& y) {
  check_stream_mix("stream_mix", x, h_res, h_post, y);
  return empty_like_contiguous(x);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> stream_mix_backward_cuda(const Tensor& x, const Tensor& h_res,
                                                                    const Tensor& h_post, const Tensor& y,
                                                                    const Tensor& dout) {
  const auto g = mix_backward(x, h_res, h_post, y, Tensor(), dout, Tensor());
  return {g[0], g[1], g[2], g[3]};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> stream_mix_backward_meta(const Tensor& x, const Tensor& h_res,
                                                                    const Tensor& h_post, const Tensor& y,
                                                                    const Tensor&) {
  return {empty_like_contiguous(x), empty_like_contiguous(h_res), empty_like_contiguous(h_post),
          empty_like_contiguous(y)};
}

struct StreamMixFn : torch::autograd::Function<StreamMixFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& h_res, const Tensor& h_post,
                        const Tensor& y) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->save_for_backward({x, h_res, h_post, y});
    return KERNELS_OP("stream_mix", stream_mix_cuda).call(x, h_res, h_post, y);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const auto [dx, dh_res, dh_post, dy] =
        KERNELS_OP("stream_mix_backward", stream_mix_backward_cuda).call(s[0], s[1], s[2], s[3], grads[0]);
    return {dx, dh_res, dh_post, dy};
  }
};

Tensor stream_mix_autograd(const Tensor& x, const Tensor& h_res, const Tensor& h_post, const Tensor& y) {
  return autograd_or_below<StreamMixFn>(KERNELS_OP("stream_mix", stream_mix_cuda), x, h_res, h_post, y);
}

// stream_mix_merge: the mix, and the next sublayer's merged input from the same pass (the static variants'
// residual step: each stream tensor then has one consumer, and no gradients of it are added by autograd).
std::tuple<Tensor, Tensor> stream_mix_merge_cuda(const Tensor& x, const Tensor& h_res, const Tensor& h_post,
                                                 const Tensor& y, const Tensor& h_pre) {
  REQUIRE(h_pre.defined(), "stream_mix_merge: h_pre must be a tensor, got None");
  return mix_forward("stream_mix_merge", x, h_res, h_post, y, h_pre);
}

std::tuple<Tensor, Tensor> stream_mix_merge_meta(const Tensor& x, const Tensor& h_res, const Tensor& h_post,
                                                 const Tensor& y, const Tensor& h_pre) {
  check_stream_mix("stream_mix_merge", x, h_res, h_post, y, &h_pre);
  return {empty_like_contiguous(x), at::empty(y.sizes(), x.options())};
}

std::vector<Tensor> stream_mix_merge_backward_cuda(const Tensor& x, const Tensor& h_res, const Tensor& h_post,
                                                   const Tensor& y, const Tensor& h_pre, const Tensor& dout,
                                                   const Tensor& dmerged) {
  return mix_backward(x, h_res, h_post, y, h_pre, dout, dmerged);
}

std::vector<Tensor> stream_mix_merge_backward_meta(const Tensor& x, const Tensor& h_res, const Tensor& h_post,
                                                   const Tensor& y, const Tensor& h_pre, const Tensor&,
                                                   const Tensor&) {
  return {empty_like_contiguous(x), empty_like_contiguous(h_res), empty_like_contiguous(h_post),
          empty_like_contiguous(y), empty_like_contiguous(h_pre)};
}

struct StreamMixMergeFn : torch::autograd::Function<StreamMixMergeFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& h_res, const Tensor& h_post,
                               const Tensor& y, const Tensor& h_pre) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->save_for_backward({x, h_res, h_post, y, h_pre});
    const auto [out, merged] = KERNELS_OP("stream_mix_merge", stream_mix_merge_cuda).call(x, h_res, h_post, y, h_pre);
    return {out, merged};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {  // an unused output's: zeros
    const auto s = ctx->get_saved_variables();
    return KERNELS_OP("stream_mix_merge_backward", stream_mix_merge_backward_cuda)
        .call(s[0], s[1], s[2], s[3], s[4], grads[0], grads[1]);
  }
};

std::tuple<Tensor, Tensor> stream_mix_merge_autograd(const Tensor& x, const Tensor& h_res, const Tensor& h_post,
                                                     const Tensor& y, const Tensor& h_pre) {
  if (!wants_grad(x, h_res, h_post, y, h_pre))
    return call_below_autograd(KERNELS_OP("stream_mix_merge", stream_mix_merge_cuda), x, h_res, h_post, y, h_pre);
  const auto r = StreamMixMergeFn::apply(x, h_res, h_post, y, h_pre);
  return {r[0], r[1]};
}

TORCH_LIBRARY_FRAGMENT(kernels, m) {
  // Streams x (..., n, C) merged by h (n,) or per token (..., n); mixed by h_res and added to h_post * y,
  // y float32 or bfloat16; and mixed, then merged by the next sublayer's h_pre.
  def_op(m, "stream_merge(Tensor x, Tensor h) -> Tensor");
  cuda_meta(m, "stream_merge", stream_merge_cuda, stream_merge_meta, CPU_ERRORS);
  autograd(m, "stream_merge", stream_merge_autograd);
  def_half(m, "stream_merge_backward(Tensor x, Tensor h, Tensor dout) -> (Tensor, Tensor)");
  cuda_meta(m, "stream_merge_backward", stream_merge_backward_cuda, stream_merge_backward_meta);
  def_op(m, "stream_mix(Tensor x, Tensor h_res, Tensor h_post, Tensor y) -> Tensor");
  cuda_meta(m, "stream_mix", stream_mix_cuda, stream_mix_meta, CPU_ERRORS);
  autograd(m, "stream_mix", stream_mix_autograd);
  def_half(m, "stream_mix_backward(Tensor x, Tensor h_res, Tensor h_post, Tensor y, Tensor dout) "
           "-> (Tensor, Tensor, Tensor, Tensor)");
  cuda_meta(m, "stream_mix_backward", stream_mix_backward_cuda, stream_mix_backward_meta);
  def_op(m, "stream_mix_merge(Tensor x, Tensor h_res, Tensor h_post, Tensor y, Tensor h_pre) -> (Tensor, Tensor)");
  cuda_meta(m, "stream_mix_merge", stream_mix_merge_cuda, stream_mix_merge_meta, CPU_ERRORS);
  autograd(m, "stream_mix_merge", stream_mix_merge_autograd);
  def_half(m, "stream_mix_merge_backward(Tensor x, Tensor h_res, Tensor h_post, Tensor y, Tensor h_pre, "
           "Tensor dout, Tensor dmerged) -> Tensor[]");
  cuda_meta(m, "stream_mix_merge_backward", stream_mix_merge_backward_cuda, stream_mix_merge_backward_meta);
}

// ---- mhc-dynamic's pre-sublayer step -------------------------------------------------------------
// hc_pre(x, weight, phi, alpha, bias) = (stream_merge(x, pre), post, res) with (pre, post, res) =
// hc_coeffs(hc_project(x flattened, weight, phi), alpha, bias): the three ops in a row, one op so that its
// backward reads x once for both uses of it (the projection's and the merge's: hc_project_bwd adds the merge's
// share of dx in its pass), where the three ops would leave autograd two dx to add.

// Checks the arguments; returns n.
static int64_t check_hc_pre(const Tensor& x, const Tensor& weight, const Tensor& phi, const char* op = "hc_pre") {
  check_streams(op, x);
  const int64_t n = x.size(-2);
  REQUIRE(phi.dim() == 2 && phi.size(0) == 2 * n + n * n, op, ": phi must have 2n + n^2 = ", 2 * n + n * n,
          " rows for x's n = ", n, " streams, got shape ", phi.sizes());
  return n;
}

// The rest of hc_pre's forward once x (contiguous) is projected: the coefficients and the merge, one launch.
// (merged, post, res, and for the backward h, rstd, pre)
static std::vector<Tensor> hc_pre_from_projection(const char* op, const Tensor& x, const Tensor& h, const Tensor& rstd,
                                                  const Tensor& alpha_in, const Tensor& bias_in, int64_t iters) {
  const int64_t n = check_hc_coeffs(h, alpha_in, bias_in, iters), C = x.size(-1);
  const Tensor alpha = alpha_in.contiguous(), bias = bias_in.contiguous();
  Tensor pre = at::empty(with_dims(h, {n}), h.options()), post = at::empty_like(pre);
  Tensor res = at::empty(with_dims(h, {n, n}), h.options());
  Tensor merged = at::empty(with_dims(x.select(-2, 0), {C}), x.options());
  launch::hc_pre_coeffs_fwd(x.data_ptr<float>(), to_int(op, C, "C"), h.data_ptr<float>(), alpha.data_ptr<float>(),
                    bias.data_ptr<float>(), pre.data_ptr<float>(), post.data_ptr<float>(), res.data_ptr<float>(),
                    merged.data_ptr<float>(), to_int(op, h.numel() / h.size(-1), "number of tokens"), (int)n,
                    to_int(op, iters, "iters"), stream());
  return {merged, post, res, h, rstd, pre};
}

std::vector<Tensor> hc_pre_forward_cuda(const Tensor& x_in, const Tensor& weight, const Tensor& phi,
                                        const Tensor& alpha, const Tensor& bias, int64_t iters, double eps) {
  check_hc_pre(x_in, weight, phi);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const Tensor x = x_in.contiguous();
  const auto [h, rstd] = hc_project_forward_cuda(x.flatten(-2), weight, phi, eps);
  return hc_pre_from_projection("hc_pre", x, h, rstd, alpha, bias, iters);
}

std::vector<Tensor> hc_pre_forward_meta(const Tensor& x, const Tensor& weight, const Tensor& phi, const Tensor& alpha,
                                        const Tensor& bias, int64_t iters, double eps) {
  check_hc_pre(x, weight, phi);
  const auto [h, rstd] = hc_project_forward_meta(x.flatten(-2), weight, phi, eps);
  const auto [pre, post, res] = hc_coeffs_meta(h, alpha, bias, iters);
  return {at::empty(with_dims(x.select(-2, 0), {x.size(-1)}), x.options()), post, res, h, rstd, pre};
}

// (dx, dweight, dphi, dalpha, dbias); an undefined gradient (an output nobody used) counts as zeros. dadd, where
// defined, is a gradient of x from elsewhere that dx takes in the same pass (hc_mix_pre's: the streams' own).
static std::vector<Tensor> hc_pre_grads(const Tensor& x_in, const Tensor& weight_in, const Tensor& phi_in,
                                        const Tensor& alpha, const Tensor& bias, const Tensor& h, const Tensor& rstd,
                                        const Tensor& pre, const std::optional<Tensor>& dmerged_in,
                                        const std::optional<Tensor>& dpost, const std::optional<Tensor>& dres,
                                        int64_t iters, const Tensor& dadd_in) {
  const int64_t n = check_hc_pre(x_in, weight_in, phi_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const Tensor x = x_in.contiguous(), weight = weight_in.contiguous(), phi = phi_in.contiguous();
  const int64_t C = x.size(-1), D = n * C;
  const int M = (int)(x.numel() / std::max<int64_t>(D, 1));
  const bool merged_used = dmerged_in.has_value() && dmerged_in->defined();
  const Tensor dmerged = merged_used ? dmerged_in->contiguous() : Tensor();
  // the coefficients' backward takes the merge's coefficient gradient from x and dmerged in its own kernel (the
  // merge's dx comes with the projection's below); an unused merged gives none
  const auto [dh, dalpha, dbias] = coeffs_backward(h, alpha, bias, std::nullopt, dpost, dres, iters, x, dmerged);
  const Tensor dadd = dadd_in.defined() ? dadd_in.contiguous() : Tensor();
  Tensor dx = at::empty_like(x), dweight = at::empty_like(weight), dphi = at::empty_like(phi);
  Tensor ws = at::empty({launch::hc_project_bwd_workspace_floats(M, (int)n, (int)D)}, x.options());
  launch::hc_project_bwd(x.data_ptr<float>(), weight.data_ptr<float>(), phi.data_ptr<float>(), h.data_ptr<float>(),
                 rstd.data_ptr<float>(), dh.data_ptr<float>(), merged_used ? pre.data_ptr<float>() : nullptr,
                 fptr(dmerged), fptr(dadd), dx.data_ptr<float>(), dweight.data_ptr<float>(), dphi.data_ptr<float>(),
                 ws_ptr(ws), M, (int)n, (int)D, stream());
  return {dx, dweight, dphi, dalpha, dbias};
}

std::vector<Tensor> hc_pre_backward_cuda(const Tensor& x, const Tensor& weight, const Tensor& phi, const Tensor& alpha,
                                         const Tensor& bias, const Tensor& h, const Tensor& rstd, const Tensor& pre,
                                         const std::optional<Tensor>& dmerged, const std::optional<Tensor>& dpost,
                                         const std::optional<Tensor>& dres, int64_t iters) {
  return hc_pre_grads(x, weight, phi, alpha, bias, h, rstd, pre, dmerged, dpost, dres, iters, Tensor());
}

std::vector<Tensor> hc_pre_backward_meta(const Tensor& x, const Tensor& weight, const Tensor& phi, const Tensor& alpha,
                                         const Tensor& bias, const Tensor&, const Tensor&, const Tensor&,
                                         const std::optional<Tensor>&, const std::optional<Tensor>&,
                                         const std::optional<Tensor>&, int64_t) {
  return {empty_like_contiguous(x), empty_like_contiguous(weight), empty_like_contiguous(phi),
          empty_like_contiguous(alpha), empty_like_contiguous(bias)};
}

struct HcPreFn : torch::autograd::Function<HcPreFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, const Tensor& phi,
                               const Tensor& alpha, const Tensor& bias, int64_t iters, double eps) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->set_materialize_grads(false);  // an unused output's gradient stays undefined: read as zeros
    const auto r = KERNELS_OP("hc_pre_forward", hc_pre_forward_cuda).call(x, weight, phi, alpha, bias, iters, eps);
    ctx->save_for_backward({x, weight, phi, alpha, bias, r[3], r[4], r[5]});
    ctx->saved_data["iters"] = iters;
    return {r[0], r[1], r[2]};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    auto given = [](const Tensor& g) { return g.defined() ? std::optional<Tensor>(g) : std::nullopt; };
    const auto r = KERNELS_OP("hc_pre_backward", hc_pre_backward_cuda)
        .call(s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], given(grads[0]), given(grads[1]), given(grads[2]),
              ctx->saved_data["iters"].toInt());
    return {r[0], r[1], r[2], r[3], r[4], Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor, Tensor> hc_pre_impl(const Tensor& x, const Tensor& weight, const Tensor& phi,
                                               const Tensor& alpha, const Tensor& bias, int64_t iters, double eps) {
  const auto r = KERNELS_OP("hc_pre_forward", hc_pre_forward_cuda).call(x, weight, phi, alpha, bias, iters, eps);
  return {r[0], r[1], r[2]};
}

std::tuple<Tensor, Tensor, Tensor> hc_pre_autograd(const Tensor& x, const Tensor& weight, const Tensor& phi,
                                                   const Tensor& alpha, const Tensor& bias, int64_t iters,
                                                   double eps) {
  if (!wants_grad(x, weight, phi, alpha, bias)) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return hc_pre_impl(x, weight, phi, alpha, bias, iters, eps);
  }
  const auto r = HcPreFn::apply(x, weight, phi, alpha, bias, iters, eps);
  return {r[0], r[1], r[2]};
}

TORCH_LIBRARY_FRAGMENT(kernels, m) {
  // mhc-dynamic's step before a sublayer (float32, n <= limits::max_streams streams): the merged stream and H_post, H_res.
  def_op(m, "hc_pre(Tensor x, Tensor weight, Tensor phi, Tensor alpha, Tensor bias, int iters=20, float eps=1e-05) "
         "-> (Tensor, Tensor, Tensor)");
  composite(m, "hc_pre", hc_pre_impl);
  autograd(m, "hc_pre", hc_pre_autograd);
  def_half(m, "hc_pre_forward(Tensor x, Tensor weight, Tensor phi, Tensor alpha, Tensor bias, int iters, float eps) "
           "-> Tensor[]");
  cuda_meta(m, "hc_pre_forward", hc_pre_forward_cuda, hc_pre_forward_meta, CPU_ERRORS);
  def_half(m, "hc_pre_backward(Tensor x, Tensor weight, Tensor phi, Tensor alpha, Tensor bias, Tensor h, "
           "Tensor rstd, Tensor pre, Tensor? dmerged, Tensor? dpost, Tensor? dres, int iters) -> Tensor[]");
  cuda_meta(m, "hc_pre_backward", hc_pre_backward_cuda, hc_pre_backward_meta);
}

// ---- mhc-dynamic's step between two sublayers --------------------------------------------------
// hc_mix_pre(x, h_res, h_post, y, weight, phi, alpha, bias) = (s, hc_pre(s, weight, phi, alpha, bias)) with
// s = stream_mix(x, h_res, h_post, y): the previous sublayer's mix, then this one's hc_pre. One op, so the mixed
// streams s have one consumer: their gradient from the next sublayer is added by hc_project_bwd in its pass over
// s, where two ops would leave autograd two gradients of s to add. Forward, one kernel mixes and projects
// (hc_mix_project_fwd): s is written once and not read back for the projection.

// (s, merged, post, res, and for the backward h, rstd, pre)
std::vector<Tensor> hc_mix_pre_forward_cuda(const Tensor& x_in, const Tensor& h_res_in, const Tensor& h_post_in,
                                            const Tensor& y_in, const Tensor& weight_in, const Tensor& phi_in,
                                            const Tensor& alpha, const Tensor& bias, int64_t iters, double eps) {
  raise_pending_index_error();
  const int64_t n = check_hc_pre(x_in, weight_in, phi_in, "hc_mix_pre");
  const bool per_token = check_stream_mix("hc_mix_pre", x_in, h_res_in, h_post_in, y_in);
  check_hc_project(x_in.flatten(-2), weight_in, phi_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const Tensor x = x_in.contiguous(), h_res = h_res_in.contiguous(), h_post = h_post_in.contiguous(),
               y = y_in.contiguous(), weight = weight_in.contiguous(), phi = phi_in.contiguous();
  const int64_t C = x.size(-1);
  const int M = to_int("hc_mix_pre", x.numel() / std::max<int64_t>(n * C, 1), "number of tokens");
  Tensor s = at::empty(x.sizes(), x.options());
  Tensor h = at::empty(with_dims(x.select(-2, 0), {phi.size(0)}), x.options());
  Tensor rstd = at::empty(with_dims(x.select(-2, 0), {}), x.options());
  const int64_t ws_floats = launch::hc_mix_project_fwd_workspace_floats(M, (int)n, (int)C);
  const Tensor ws = ws_floats ? at::empty({ws_floats}, x.options()) : Tensor();
  with_type(y.scalar_type(), [&](auto t) {  // the mix and the projection of its result in one pass
    using T = decltype(t);
    launch::hc_mix_project_fwd<T>(x.data_ptr<float>(), h_res.data_ptr<float>(), h_post.data_ptr<float>(), ptr<T>(y),
                          s.data_ptr<float>(), weight.data_ptr<float>(), phi.data_ptr<float>(), h.data_ptr<float>(),
                          rstd.data_ptr<float>(), ws_ptr(ws), M, (int)n, to_int("hc_mix_pre", C, "C"), per_token,
                          (float)eps, stream());
  });
  std::vector<Tensor> r = hc_pre_from_projection("hc_mix_pre", s, h, rstd, alpha, bias, iters);
  r.insert(r.begin(), s);
  return r;
}

std::vector<Tensor> hc_mix_pre_forward_meta(const Tensor& x, const Tensor& h_res, const Tensor& h_post,
                                            const Tensor& y, const Tensor& weight, const Tensor& phi,
                                            const Tensor& alpha, const Tensor& bias, int64_t iters, double eps) {
  check_hc_pre(x, weight, phi, "hc_mix_pre");
  check_stream_mix("hc_mix_pre", x, h_res, h_post, y);
  const Tensor s = empty_like_contiguous(x);
  std::vector<Tensor> r = hc_pre_forward_meta(s, weight, phi, alpha, bias, iters, eps);
  r.insert(r.begin(), s);
  return r;
}

// (dx, dh_res, dh_post, dy, dweight, dphi, dalpha, dbias); an undefined gradient counts as zeros. The projection's
// backward and the mix's stay two kernels, ds between them in memory: in one kernel, lanes laid out by column for the
// projection's sums over tokens must add up each token's mix sums (dh_res, dh_post) across lanes, token by token,
// and that kernel ran slower than the two.
std::vector<Tensor> hc_mix_pre_backward_cuda(const Tensor& x, const Tensor& h_res, const Tensor& h_post,
                                             const Tensor& y, const Tensor& s, const Tensor& weight,
                                             const Tensor& phi, const Tensor& alpha, const Tensor& bias,
                                             const Tensor& h, const Tensor& rstd, const Tensor& pre,
                                             const std::optional<Tensor>& ds, const std::optional<Tensor>& dmerged,
                                             const std::optional<Tensor>& dpost, const std::optional<Tensor>& dres,
                                             int64_t iters) {
  const auto pre_grads = hc_pre_grads(s, weight, phi, alpha, bias, h, rstd, pre, dmerged, dpost, dres, iters,
                                      ds.has_value() ? *ds : Tensor());
  std::vector<Tensor> g = mix_backward(x, h_res, h_post, y, Tensor(), pre_grads[0], Tensor());
  g.insert(g.end(), pre_grads.begin() + 1, pre_grads.end());
  return g;
}

std::vector<Tensor> hc_mix_pre_backward_meta(const Tensor& x, const Tensor& h_res, const Tensor& h_post,
                                             const Tensor& y, const Tensor&, const Tensor& weight, const Tensor& phi,
                                             const Tensor& alpha, const Tensor& bias, const Tensor&, const Tensor&,
                                             const Tensor&, const std::optional<Tensor>&,
                                             const std::optional<Tensor>&, const std::optional<Tensor>&,
                                             const std::optional<Tensor>&, int64_t) {
  return {empty_like_contiguous(x), empty_like_contiguous(h_res), empty_like_contiguous(h_post),
          empty_like_contiguous(y), empty_like_contiguous(weight), empty_like_contiguous(phi),
          empty_like_contiguous(alpha), empty_like_contiguous(bias)};
}

struct HcMixPreFn : torch::autograd::Function<HcMixPreFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& h_res, const Tensor& h_post,
                               const Tensor& y, const Tensor& weight, const Tensor& phi, const Tensor& alpha,
                               const Tensor& bias, int64_t iters, double eps) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->set_materialize_grads(false);  // an unused output's gradient stays undefined: read as zeros
    const auto r = KERNELS_OP("hc_mix_pre_forward", hc_mix_pre_forward_cuda)
        .call(x, h_res, h_post, y, weight, phi, alpha, bias, iters, eps);
    ctx->save_for_backward({x, h_res, h_post, y, r[0], weight, phi, alpha, bias, r[4], r[5], r[6]});
    ctx->saved_data["iters"] = iters;
    return {r[0], r[1], r[2], r[3]};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    auto given = [](const Tensor& g) { return g.defined() ? std::optional<Tensor>(g) : std::nullopt; };
    auto r = KERNELS_OP("hc_mix_pre_backward", hc_mix_pre_backward_cuda)
        .call(s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8], s[9], s[10], s[11], given(grads[0]),
              given(grads[1]), given(grads[2]), given(grads[3]), ctx->saved_data["iters"].toInt());
    r.insert(r.end(), {Tensor(), Tensor()});  // iters, eps
    return r;
  }
};

std::tuple<Tensor, Tensor, Tensor, Tensor> hc_mix_pre_impl(const Tensor& x, const Tensor& h_res, const Tensor& h_post,
                                                           const Tensor& y, const Tensor& weight, const Tensor& phi,
                                                           const Tensor& alpha, const Tensor& bias, int64_t iters,
                                                           double eps) {
  const auto r = KERNELS_OP("hc_mix_pre_forward", hc_mix_pre_forward_cuda)
      .call(x, h_res, h_post, y, weight, phi, alpha, bias, iters, eps);
  return {r[0], r[1], r[2], r[3]};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> hc_mix_pre_autograd(const Tensor& x, const Tensor& h_res,
                                                               const Tensor& h_post, const Tensor& y,
                                                               const Tensor& weight, const Tensor& phi,
                                                               const Tensor& alpha, const Tensor& bias, int64_t iters,
                                                               double eps) {
  if (!wants_grad(x, h_res, h_post, y, weight, phi, alpha, bias)) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return hc_mix_pre_impl(x, h_res, h_post, y, weight, phi, alpha, bias, iters, eps);
  }
  const auto r = HcMixPreFn::apply(x, h_res, h_post, y, weight, phi, alpha, bias, iters, eps);
  return {r[0], r[1], r[2], r[3]};
}

TORCH_LIBRARY_FRAGMENT(kernels, m) {
  // mhc-dynamic between two sublayers (float32 streams, y float32 or bfloat16, n <= limits::max_streams): the
  // mixed streams, then hc_pre's outputs for them.
  def_op(m, "hc_mix_pre(Tensor x, Tensor h_res, Tensor h_post, Tensor y, Tensor weight, Tensor phi, Tensor alpha, "
         "Tensor bias, int iters=20, float eps=1e-05) -> (Tensor, Tensor, Tensor, Tensor)");
  composite(m, "hc_mix_pre", hc_mix_pre_impl);
  autograd(m, "hc_mix_pre", hc_mix_pre_autograd);
  def_half(m, "hc_mix_pre_forward(Tensor x, Tensor h_res, Tensor h_post, Tensor y, Tensor weight, Tensor phi, "
           "Tensor alpha, Tensor bias, int iters, float eps) -> Tensor[]");
  cuda_meta(m, "hc_mix_pre_forward", hc_mix_pre_forward_cuda, hc_mix_pre_forward_meta, CPU_ERRORS);
  def_half(m, "hc_mix_pre_backward(Tensor x, Tensor h_res, Tensor h_post, Tensor y, Tensor s, Tensor weight, "
           "Tensor phi, Tensor alpha, Tensor bias, Tensor h, Tensor rstd, Tensor pre, Tensor? ds, Tensor? dmerged, "
           "Tensor? dpost, Tensor? dres, int iters) -> Tensor[]");
  cuda_meta(m, "hc_mix_pre_backward", hc_mix_pre_backward_cuda, hc_mix_pre_backward_meta);
}

// ---- softmax ----------------------------------------------------------------------------------

// x float32 or bfloat16; y in out_dtype (default x's): autocast gives bf16 logits an fp32 softmax.
static at::ScalarType check_softmax(const Tensor& x, std::optional<at::ScalarType> out_dtype) {
  check_fp_cuda("softmax", x, "x", x, "x");
  REQUIRE(x.dim() >= 1, "softmax: x must have at least one dim");
  return out_dtype_or("softmax", out_dtype, x);
}

Tensor softmax_cuda(const Tensor& x_in, std::optional<at::ScalarType> out_dtype) {
  raise_pending_index_error();
  const at::ScalarType y_dtype = check_softmax(x_in, out_dtype);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const Tensor x = x_in.contiguous();
  Tensor y = empty_like_contiguous(x, y_dtype);
  const int64_t C = x.size(-1);
  if (x.numel() > 0)
    with_types(x, y_dtype, [&](auto ti, auto to) {
      using TI = decltype(ti);
      using TO = decltype(to);
      launch::softmax_fwd(ptr<TI>(x), ptr<TO>(y), to_int("softmax", x.numel() / C, "rows"), to_int("softmax", C, "C"), 1.f,
                  0, 0, stream());
    });
  return y;
}

Tensor softmax_meta(const Tensor& x, std::optional<at::ScalarType> out_dtype) {
  return empty_like_contiguous(x, check_softmax(x, out_dtype));
}

// dx (in x_dtype) from the softmax's output y and its gradient dy.
Tensor softmax_backward_cuda(const Tensor& y, const Tensor& dy_in, at::ScalarType x_dtype) {
  const c10::cuda::CUDAGuard guard(y.device());
  const Tensor dy = dy_in.contiguous();
  Tensor dx = empty_like_contiguous(y, x_dtype);
  if (y.numel() > 0)
    with_types(dx, y.scalar_type(), [&](auto ti, auto to) {
      using TI = decltype(ti);
      using TO = decltype(to);
      launch::softmax_bwd(ptr<TO>(y), ptr<TO>(dy), ptr<TI>(dx), (int)(y.numel() / y.size(-1)), (int)y.size(-1), 1.f,
                  stream());
    });
  return dx;
}

Tensor softmax_backward_meta(const Tensor& y, const Tensor&, at::ScalarType x_dtype) {
  return empty_like_contiguous(y, x_dtype);
}

struct SoftmaxFn : torch::autograd::Function<SoftmaxFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, std::optional<at::ScalarType> out_dtype) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    Tensor y = KERNELS_OP("softmax", softmax_cuda).call(x, out_dtype);
    ctx->save_for_backward({y});
    ctx->saved_data["x_dtype"] = x.scalar_type();
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor y = ctx->get_saved_variables()[0];
    const auto x_dtype = ctx->saved_data["x_dtype"].toScalarType();
    return {KERNELS_OP("softmax_backward", softmax_backward_cuda).call(y, grads[0], x_dtype), Tensor()};
  }
};

Tensor softmax_autograd(const Tensor& x, std::optional<at::ScalarType> out_dtype) {
  return autograd_or_below<SoftmaxFn>(KERNELS_OP("softmax", softmax_cuda), x, out_dtype);
}

TORCH_LIBRARY_FRAGMENT(kernels, m) {
  // Softmax over the last dim, the result in out_dtype (None: x's).
  def_op(m, "softmax(Tensor x, ScalarType? out_dtype=None) -> Tensor");
  cuda_meta(m, "softmax", softmax_cuda, softmax_meta, CPU_ERRORS);
  autograd(m, "softmax", softmax_autograd);
  def_half(m, "softmax_backward(Tensor y, Tensor dy, ScalarType x_dtype) -> Tensor");
  cuda_meta(m, "softmax_backward", softmax_backward_cuda, softmax_backward_meta);
}

// Under bf16 autocast: written in fp32, as autocast runs torch.softmax.
Tensor softmax_autocast(const Tensor& x, std::optional<at::ScalarType> out_dtype) {
  BELOW_AUTOCAST;
  const bool fp32_out = !out_dtype && bf16_autocast();
  return KERNELS_OP("softmax", softmax_cuda).call(x, fp32_out ? std::optional<at::ScalarType>(at::kFloat) : out_dtype);
}

TORCH_LIBRARY_IMPL(kernels, AutocastCUDA, m) {
  m.impl("softmax", &softmax_autocast);
}

// ---- GELU and SiLU -----------------------------------------------------------------------------

// Elementwise ops in their input's dtype (float32 or bfloat16; fp32 arithmetic), on contiguous copies:
// f(x, y, n) or f(a, b, y, n) gets element pointers of that type.
template <class F>
static Tensor elementwise(const Tensor& x_in, F&& f) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  const Tensor x = x_in.contiguous();
  Tensor y = at::empty_like(x);
  with_type(x.scalar_type(), [&](auto t) {
    using T = decltype(t);
    f(ptr<T>(x), ptr<T>(y), x.numel());
  });
  return y;
}

template <class F>
static Tensor elementwise2(const Tensor& a_in, const Tensor& b_in, F&& f) {
  const c10::cuda::CUDAGuard guard(a_in.device());
  const Tensor a = a_in.contiguous(), b = b_in.contiguous();
  Tensor y = at::empty_like(a);
  with_type(a.scalar_type(), [&](auto t) {
    using T = decltype(t);
    f(ptr<T>(a), ptr<T>(b), ptr<T>(y), a.numel());
  });
  return y;
}

static bool gelu_tanh(const Tensor& x, c10::string_view approximate) {
  check_fp_cuda("gelu", x, "x", x, "x");
  REQUIRE_VALUE(approximate == "none" || approximate == "tanh", "gelu: approximate must be 'none' or 'tanh', got '",
                std::string(approximate), "'");
  return approximate == "tanh";
}

Tensor gelu_cuda(const Tensor& x, c10::string_view approximate) {
  raise_pending_index_error();
  const bool tanh = gelu_tanh(x, approximate);
  return elementwise(x, [&](auto x, auto y, int64_t n) { launch::gelu_fwd(x, y, n, tanh, stream()); });
}

Tensor gelu_meta(const Tensor& x, c10::string_view approximate) {
  gelu_tanh(x, approximate);
  return empty_like_contiguous(x);
}

Tensor gelu_backward_cuda(const Tensor& x, const Tensor& dy, c10::string_view approximate) {
  const bool tanh = approximate == "tanh";
  return elementwise2(x, dy, [&](auto x, auto dy, auto dx, int64_t n) { launch::gelu_bwd(x, dy, dx, n, tanh, stream()); });
}

Tensor gelu_backward_meta(const Tensor& x, const Tensor&, c10::string_view) { return empty_like_contiguous(x); }

Tensor silu_cuda(const Tensor& x) {
  raise_pending_index_error();
  check_fp_cuda("silu", x, "x", x, "x");
  return elementwise(x, [&](auto x, auto y, int64_t n) { launch::silu_fwd(x, y, n, stream()); });
}

Tensor silu_meta(const Tensor& x) {
  check_fp_cuda("silu", x, "x", x, "x");
  return empty_like_contiguous(x);
}

Tensor silu_backward_cuda(const Tensor& x, const Tensor& dy) {
  return elementwise2(x, dy, [&](auto x, auto dy, auto dx, int64_t n) { launch::silu_bwd(x, dy, dx, n, stream()); });
}

Tensor silu_backward_meta(const Tensor& x, const Tensor&) { return empty_like_contiguous(x); }

// GELU and SiLU: the forward saves x, the backward reads x and dy. approximate is GELU's alone.
struct GeluFn : torch::autograd::Function<GeluFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, c10::string_view approximate) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->save_for_backward({x});
    ctx->saved_data["approximate"] = std::string(approximate);
    return KERNELS_OP("gelu", gelu_cuda).call(x, approximate);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor x = ctx->get_saved_variables()[0];
    const std::string approximate = ctx->saved_data["approximate"].toStringRef();
    return {KERNELS_OP("gelu_backward", gelu_backward_cuda).call(x, grads[0], approximate), Tensor()};
  }
};

struct SiluFn : torch::autograd::Function<SiluFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->save_for_backward({x});
    return KERNELS_OP("silu", silu_cuda).call(x);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {KERNELS_OP("silu_backward", silu_backward_cuda).call(ctx->get_saved_variables()[0], grads[0])};
  }
};

Tensor gelu_autograd(const Tensor& x, c10::string_view approximate) {
  return autograd_or_below<GeluFn>(KERNELS_OP("gelu", gelu_cuda), x, approximate);
}

Tensor silu_autograd(const Tensor& x) { return autograd_or_below<SiluFn>(KERNELS_OP("silu", silu_cuda), x); }

TORCH_LIBRARY_FRAGMENT(kernels, m) {
  // GELU (approximate 'none' or 'tanh', like F.gelu) and SiLU.
  def_op(m, "gelu(Tensor x, str approximate='none') -> Tensor");
  cuda_meta(m, "gelu", gelu_cuda, gelu_meta, CPU_ERRORS);
  autograd(m, "gelu", gelu_autograd);
  def_half(m, "gelu_backward(Tensor x, Tensor dy, str approximate) -> Tensor");
  cuda_meta(m, "gelu_backward", gelu_backward_cuda, gelu_backward_meta);
  def_op(m, "silu(Tensor x) -> Tensor");
  cuda_meta(m, "silu", silu_cuda, silu_meta, CPU_ERRORS);
  autograd(m, "silu", silu_autograd);
  def_half(m, "silu_backward(Tensor x, Tensor dy) -> Tensor");
  cuda_meta(m, "silu_backward", silu_backward_cuda, silu_backward_meta);
}

// ---- SwiGLU ------------------------------------------------------------------------------------

// silu(a) * b in one pass (forward: read a, b, write y; backward: read a, b, dy, write da, db), where
// F.silu(a) * b takes two kernels and keeps silu(a) alive for the backward. a and b: one dtype.
static void check_swiglu(const Tensor& a, const Tensor& b) {
  const char* op = "swiglu";
  check_fp_cuda(op, a, "a", a, "a");
  check_fp_cuda(op, b, "b", a, "a");
  check_same_device(op, a, "a", b, "b");
  REQUIRE(a.sizes() == b.sizes(), op, ": a and b must have the same shape, got ", a.sizes(), " and ", b.sizes());
}

Tensor swiglu_cuda(const Tensor& a, const Tensor& b) {
  raise_pending_index_error();
  check_swiglu(a, b);
  return elementwise2(a, b, [&](auto a, auto b, auto y, int64_t n) { launch::swiglu_fwd(a, b, y, n, stream()); });
}

Tensor swiglu_meta(const Tensor& a, const Tensor& b) {
  check_swiglu(a, b);
  return empty_like_contiguous(a);
}

std::tuple<Tensor, Tensor> swiglu_backward_cuda(const Tensor& a_in, const Tensor& b_in, const Tensor& dy_in) {
  const c10::cuda::CUDAGuard guard(a_in.device());
  const Tensor a = a_in.contiguous(), b = b_in.contiguous(), dy = dy_in.contiguous();
  Tensor da = at::empty_like(a), db = at::empty_like(b);
  with_type(a.scalar_type(), [&](auto e) {
    using T = decltype(e);
    launch::swiglu_bwd(ptr<T>(a), ptr<T>(b), ptr<T>(dy), ptr<T>(da), ptr<T>(db), a.numel(), stream());
  });
  return {da, db};
}

std::tuple<Tensor, Tensor> swiglu_backward_meta(const Tensor& a, const Tensor& b, const Tensor&) {
  return {empty_like_contiguous(a), empty_like_contiguous(b)};
}

struct SwigluFn : torch::autograd::Function<SwigluFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& a, const Tensor& b) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->save_for_backward({a, b});
    return KERNELS_OP("swiglu", swiglu_cuda).call(a, b);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto t = ctx->get_saved_variables();
    const auto [da, db] = KERNELS_OP("swiglu_backward", swiglu_backward_cuda).call(t[0], t[1], grads[0]);
    return {da, db};
  }
};

Tensor swiglu_autograd(const Tensor& a, const Tensor& b) {
  return autograd_or_below<SwigluFn>(KERNELS_OP("swiglu", swiglu_cuda), a, b);
}

TORCH_LIBRARY_FRAGMENT(kernels, m) {
  // silu(a) * b in one kernel each way.
  def_op(m, "swiglu(Tensor a, Tensor b) -> Tensor");
  cuda_meta(m, "swiglu", swiglu_cuda, swiglu_meta, CPU_ERRORS);
  autograd(m, "swiglu", swiglu_autograd);
  def_half(m, "swiglu_backward(Tensor a, Tensor b, Tensor dy) -> (Tensor, Tensor)");
  cuda_meta(m, "swiglu_backward", swiglu_backward_cuda, swiglu_backward_meta);
}

// ---- RoPE -------------------------------------------------------------------------------------

// x (B, H, T, D) rotated into a new contiguous tensor; x is read in place when its last dim is contiguous.
static Tensor rope_launch(const Tensor& x_in, const Tensor& cos, const Tensor& sin, bool backward) {
  const Tensor x = x_in.stride(3) == 1 ? x_in : x_in.contiguous();
  Tensor out = at::empty(x.sizes(), x.options());
  with_type(x.scalar_type(), [&](auto t) {
    using T = decltype(t);
    launch::rope(ptr<T>(x), ptr<float>(cos), ptr<float>(sin), ptr<T>(out), to_int("rope", x.size(0), "B"),
         to_int("rope", x.size(1), "H"), to_int("rope", x.size(2), "T"), (int)x.size(3), x.stride(0), x.stride(1),
         x.stride(2), backward, stream());
  });
  return out;
}

static void check_rope(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  const char* op = "rope";
  check_fp_cuda(op, x, "x", x, "x");  // float32 or bfloat16 (rotated in fp32); the tables are float32
  check_float_cuda(op, cos, "cos");
  check_float_cuda(op, sin, "sin");
  check_same_device(op, x, "x", cos, "cos");
  check_same_device(op, x, "x", sin, "sin");
  check_dim(op, x, "x", 4, "(B, H, T, D)");
  REQUIRE_VALUE(x.size(3) % 2 == 0, op, ": the head dim D must be even (element i pairs with i + D/2), got D = ",
                x.size(3));
  const std::vector<int64_t> table{x.size(2), x.size(3) / 2};
  REQUIRE(cos.sizes() == at::IntArrayRef(table) && sin.sizes() == at::IntArrayRef(table), op,
          ": cos and sin must be (T, D/2) = ", at::IntArrayRef(table), " for x of shape ", x.sizes(), ", got ",
          cos.sizes(), " and ", sin.sizes());
}

Tensor rope_cuda(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  raise_pending_index_error();
  check_rope(x, cos, sin);
  const c10::cuda::CUDAGuard guard(x.device());
  return rope_launch(x, cos.contiguous(), sin.contiguous(), false);
}

Tensor rope_meta(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  check_rope(x, cos, sin);
  return empty_like_contiguous(x);
}

// The rotation's transpose: the same kernel turning the other way.
Tensor rope_backward_cuda(const Tensor& dy, const Tensor& cos, const Tensor& sin) {
  const c10::cuda::CUDAGuard guard(dy.device());
  return rope_launch(dy, cos.contiguous(), sin.contiguous(), true);
}

Tensor rope_backward_meta(const Tensor& dy, const Tensor&, const Tensor&) { return empty_like_contiguous(dy); }

struct RopeFn : torch::autograd::Function<RopeFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& cos, const Tensor& sin) {
    REQUIRE(!cos.requires_grad() && !sin.requires_grad(), "rope: cos and sin are constant tables and get no ",
            "gradient; pass them without requires_grad");
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->save_for_backward({cos, sin});
    return KERNELS_OP("rope", rope_cuda).call(x, cos, sin);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto t = ctx->get_saved_variables();
    return {KERNELS_OP("rope_backward", rope_backward_cuda).call(grads[0], t[0], t[1]), Tensor(), Tensor()};
  }
};

Tensor rope_autograd(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  return autograd_or_below<RopeFn>(KERNELS_OP("rope", rope_cuda), x, cos, sin);
}

TORCH_LIBRARY_FRAGMENT(kernels, m) {
  // Rotary embedding of x (B, H, T, D), element i paired with i + D/2; cos, sin (T, D/2) float32 tables.
  def_op(m, "rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  cuda_meta(m, "rope", rope_cuda, rope_meta, CPU_ERRORS);
  autograd(m, "rope", rope_autograd);
  def_half(m, "rope_backward(Tensor dy, Tensor cos, Tensor sin) -> Tensor");
  cuda_meta(m, "rope_backward", rope_backward_cuda, rope_backward_meta);
}

// ---- dropout ----------------------------------------------------------------------------------

// rng: a 2-element int64 tensor {seed, offset} on x's GPU, read by the kernel (a CUDA graph replays
// whatever it holds then); salt: the call site, in [0, 2^32). The mask is drawn, never stored.
// x (named x_name) is the tensor whose rows the masks cover: at most 2^32 of them (a draw's row is 32 bits).
static void check_dropout_rng(const char* op, const Tensor& x, const char* x_name, int64_t rows, double p,
                              const Tensor& rng, int64_t salt) {
  REQUIRE_VALUE(p >= 0.0 && p <= 1.0, op, ": dropout p must be in [0, 1], got ", p);
  REQUIRE(rng.defined() && cuda_or_meta(rng) && rng.scalar_type() == at::kLong && rng.numel() == 2, op,
          ": rng must be a 2-element int64 CUDA tensor {seed, offset}, got ",
          rng.defined() ? msg(rng.scalar_type(), " of shape ", rng.sizes(), " on ", rng.device()) : std::string("None"));
  check_same_device(op, x, x_name, rng, "rng");
  REQUIRE_VALUE(salt >= 0 && salt <= (int64_t)UINT32_MAX, op, ": salt must be in [0, 2^32), got ", salt);
  REQUIRE_VALUE(rows <= (int64_t)UINT32_MAX, op, ": dropout draws at most 2^32 rows, got ", rows);
}

// p kept to 1/65536: the threshold rounds p * 65536 as train.dropout_keep does (floor of x + 0.5, in double).
static DropoutArgs dropout_of(double p, const Tensor& rng, int64_t salt) {
  return {rng.data_ptr<int64_t>(), (uint32_t)salt, (uint32_t)std::floor(p * 65536.0 + 0.5),
          p < 1.0 ? (float)(1.0 / (1.0 - p)) : 0.f};
}

static void check_dropout(const Tensor& x, double p, const Tensor& rng, int64_t salt) {
  check_fp_cuda("dropout", x, "x", x, "x");
  const int64_t cols = x.dim() ? x.size(-1) : 1;
  check_dropout_rng("dropout", x, "x", cols ? x.numel() / cols : 0, p, rng, salt);
}

Tensor dropout_cuda(const Tensor& x_in, double p, const Tensor& rng, int64_t salt) {
  raise_pending_index_error();
  check_dropout(x_in, p, rng, salt);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const Tensor x = x_in.contiguous();
  Tensor y = at::empty_like(x);
  const int64_t cols = x.dim() ? x.size(-1) : 1;
  with_type(x.scalar_type(), [&](auto t) {
    using T = decltype(t);
    launch::dropout(ptr<T>(x), ptr<T>(y), cols ? x.numel() / cols : 0, cols, dropout_of(p, rng, salt), stream());
  });
  return y;
}

Tensor dropout_meta(const Tensor& x, double p, const Tensor& rng, int64_t salt) {
  check_dropout(x, p, rng, salt);
  return empty_like_contiguous(x);
}

// The backward is the forward's kernel on dy: the same draws, so the same mask. rng is saved as it is; the
// caller advances its offset only after the backward (autograd's version check says so otherwise).
struct DropoutFn : torch::autograd::Function<DropoutFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, double p, const Tensor& rng, int64_t salt) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->save_for_backward({rng});
    ctx->saved_data["p"] = p;
    ctx->saved_data["salt"] = salt;
    return KERNELS_OP("dropout", dropout_cuda).call(x, p, rng, salt);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor rng = ctx->get_saved_variables()[0];
    const Tensor dx = KERNELS_OP("dropout", dropout_cuda)
                          .call(grads[0], ctx->saved_data["p"].toDouble(), rng, ctx->saved_data["salt"].toInt());
    return {dx, Tensor(), Tensor(), Tensor()};
  }
};

Tensor dropout_autograd(const Tensor& x, double p, const Tensor& rng, int64_t salt) {
  return autograd_or_below<DropoutFn>(KERNELS_OP("dropout", dropout_cuda), x, p, rng, salt);
}

TORCH_LIBRARY_FRAGMENT(kernels, m) {
  // x times its dropout factors: 1 / (1 - p) where kept, 0 where dropped (x's dtype; train.torch_dropout's masks).
  def_op(m, "dropout(Tensor x, float p, Tensor rng, int salt=0) -> Tensor");
  cuda_meta(m, "dropout", dropout_cuda, dropout_meta, CPU_ERRORS);
  autograd(m, "dropout", dropout_autograd);
}

// ---- embedding --------------------------------------------------------------------------------

// weight float32 or bfloat16, rows copied as they are. The backward sums in fp32 (its deterministic
// kernel is fp32), then rounds a bf16 weight's gradient once; padding_idx's row gets none.

// padding_idx as F.embedding takes it (negative: counted from the end) as the kernel takes it: a row in
// [0, V), or -1 for none.
static int64_t padding_row(const std::optional<int64_t>& padding_idx, int64_t V) {
  if (!padding_idx.has_value()) return -1;
  const int64_t p = *padding_idx;
  REQUIRE_VALUE(p >= -V && p < V, "embedding: padding_idx must be in [-num_embeddings, num_embeddings) = [", -V,
                ", ", V, "), got ", p);
  return p < 0 ? p + V : p;
}

static void check_embedding(const Tensor& idx, const Tensor& w, const std::optional<int64_t>& padding_idx) {
  const char* op = "embedding";
  check_index_cuda(op, idx, "idx");
  check_fp_cuda(op, w, "weight", w, "weight");
  check_dim(op, w, "weight", 2, "(num_embeddings, embedding_dim)");
  check_same_device(op, idx, "idx", w, "weight");
  to_int(op, w.size(0), "num_embeddings");  // the backward sorts indices as 32-bit keys
  to_int(op, idx.numel(), "number of indices");
  to_int(op, w.size(1), "embedding_dim");
  padding_row(padding_idx, w.size(0));
}

static std::vector<int64_t> embedding_shape(const Tensor& idx, const Tensor& w) {
  auto shape = idx.sizes().vec();
  shape.push_back(w.size(1));
  return shape;
}

Tensor embedding_cuda(const Tensor& idx_in, const Tensor& w_in, std::optional<int64_t> padding_idx) {
  raise_pending_index_error();
  check_embedding(idx_in, w_in, padding_idx);  // the forward copies padding_idx's row like any other
  const c10::cuda::CUDAGuard guard(w_in.device());
  const Tensor idx = idx_in.contiguous(), w = w_in.contiguous();
  Tensor out = at::empty(embedding_shape(idx, w), w.options());
  with_type(w.scalar_type(), [&](auto t) {
    using T = decltype(t);
    launch::embedding_fwd(ptr<int64_t>(idx), ptr<T>(w), ptr<T>(out), idx.numel(), w.size(0), (int)w.size(1), stream());
  });
  return out;
}

Tensor embedding_meta(const Tensor& idx, const Tensor& w, std::optional<int64_t> padding_idx) {
  check_embedding(idx, w, padding_idx);
  return at::empty(embedding_shape(idx, w), w.options());
}

// Only this op's gradient, (num_embeddings, C) in dout's dtype: where the weight is also used elsewhere
// (a tied output head), autograd adds the two.
Tensor embedding_backward_cuda(const Tensor& idx, const Tensor& dout_in, int64_t num_embeddings,
                               std::optional<int64_t> padding_idx) {
  const int64_t pad = padding_row(padding_idx, num_embeddings);
  const c10::cuda::CUDAGuard guard(idx.device());
  const Tensor dout = dout_in.contiguous().to(at::kFloat);
  const int C = (int)dout.size(-1), T = (int)idx.numel();
  Tensor dw = at::zeros({num_embeddings, (int64_t)C}, dout.options());
  Tensor ws = at::empty({(int64_t)launch::embedding_bwd_workspace_bytes(T, num_embeddings, C)},
                        dout.options().dtype(at::kByte));
  launch::embedding_bwd(idx.contiguous().data_ptr<int64_t>(), dout.data_ptr<float>(), dw.data_ptr<float>(), T, num_embeddings,
                C, pad, ws.numel() ? ws.data_ptr() : nullptr, stream());
  return dw.to(dout_in.scalar_type());
}

Tensor embedding_backward_meta(const Tensor&, const Tensor& dout, int64_t num_embeddings,
                               std::optional<int64_t> padding_idx) {
  padding_row(padding_idx, num_embeddings);
  return at::empty({num_embeddings, dout.size(-1)}, dout.options());
}

struct EmbeddingFn : torch::autograd::Function<EmbeddingFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& idx, const Tensor& w, std::optional<int64_t> padding_idx) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->save_for_backward({idx});
    ctx->saved_data["V"] = w.size(0);
    ctx->saved_data["padding_idx"] = padding_idx;
    return KERNELS_OP("embedding", embedding_cuda).call(idx, w, padding_idx);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor idx = ctx->get_saved_variables()[0];
    const int64_t V = ctx->saved_data["V"].toInt();
    const auto padding_idx = ctx->saved_data["padding_idx"].toOptional<int64_t>();
    return {Tensor(), KERNELS_OP("embedding_backward", embedding_backward_cuda).call(idx, grads[0], V, padding_idx),
            Tensor()};
  }
};

Tensor embedding_autograd(const Tensor& idx, const Tensor& w, std::optional<int64_t> padding_idx) {
  return autograd_or_below<EmbeddingFn>(KERNELS_OP("embedding", embedding_cuda), idx, w, padding_idx);
}

TORCH_LIBRARY_FRAGMENT(kernels, m) {
  // Rows of weight gathered by int64 idx (deterministic backward; padding_idx's row gets no gradient); an idx
  // out of range gives a NaN row and a ValueError from the next call or check_errors().
  def_op(m, "embedding(Tensor idx, Tensor weight, int? padding_idx=None) -> Tensor");
  cuda_meta(m, "embedding", embedding_cuda, embedding_meta, CPU_ERRORS);
  autograd(m, "embedding", embedding_autograd);
  def_half(m, "embedding_backward(Tensor idx, Tensor dout, int num_embeddings, int? padding_idx) -> Tensor");
  cuda_meta(m, "embedding_backward", embedding_backward_cuda, embedding_backward_meta);
}

// ---- cross-entropy ----------------------------------------------------------------------------

// logits float32 or bfloat16; the loss is float32 either way (as under autocast), the logits' gradient
// in their dtype. Rows whose target is ignore_index count for nothing (F.cross_entropy's). Any int64
// ignore_index is allowed, as in PyTorch. kernels::cross_entropy_forward returns the loss, each row's
// logsumexp and the mean's denominator, the rows kept (a float32 on the device: no host sync).
static void check_cross_entropy(const Tensor& logits, const Tensor& tgt) {
  const char* op = "cross_entropy";
  check_fp_cuda(op, logits, "logits", logits, "logits");
  check_index_cuda(op, tgt, "targets");
  check_same_device(op, logits, "logits", tgt, "targets");
  check_dim(op, logits, "logits", 2, "(N, C)");
  REQUIRE(tgt.dim() == 1 && tgt.size(0) == logits.size(0), op, ": targets must have shape (", logits.size(0),
          ",), got ", tgt.sizes());
  REQUIRE(logits.size(0) > 0 && logits.size(1) > 0, op, ": logits must be non-empty, got ", logits.sizes());
  to_int(op, logits.size(0), "N");
  to_int(op, logits.size(1), "C");
}

std::tuple<Tensor, Tensor, Tensor> cross_entropy_forward_cuda(const Tensor& logits, const Tensor& tgt_in,
                                                              int64_t ignore_index) {
  raise_pending_index_error();
  check_cross_entropy(logits, tgt_in);
  const c10::cuda::CUDAGuard guard(logits.device());
  const Tensor x = logits.contiguous(), tgt = tgt_in.contiguous();
  const int R = (int)x.size(0), C = (int)x.size(1);
  const auto f32 = x.options().dtype(at::kFloat);
  Tensor lse = at::empty({R}, f32), rows = at::empty({R}, f32), loss = at::empty({}, f32), kept = at::empty({}, f32);
  with_type(x.scalar_type(), [&](auto t) {
    using T = decltype(t);
    launch::cross_entropy_fwd(ptr<T>(x), ptr<int64_t>(tgt), ignore_index, ptr<float>(lse), ptr<float>(rows),
                              ptr<float>(loss), ptr<float>(kept), R, C, stream());
  });
  return {loss, lse, kept};
}

std::tuple<Tensor, Tensor, Tensor> cross_entropy_forward_meta(const Tensor& logits, const Tensor& tgt, int64_t) {
  check_cross_entropy(logits, tgt);
  const auto f32 = logits.options().dtype(at::kFloat);
  return {at::empty({}, f32), at::empty({logits.size(0)}, f32), at::empty({}, f32)};
}

Tensor cross_entropy_backward_cuda(const Tensor& logits, const Tensor& tgt, const Tensor& lse, const Tensor& kept,
                                   const Tensor& dloss_in, int64_t ignore_index) {
  const c10::cuda::CUDAGuard guard(logits.device());
  const Tensor x = logits.contiguous(), dloss = dloss_in.contiguous();
  Tensor dx = at::empty_like(x);
  with_type(x.scalar_type(), [&](auto t) {
    using T = decltype(t);
    launch::cross_entropy_bwd(ptr<T>(x), ptr<int64_t>(tgt.contiguous()), ignore_index, ptr<float>(lse),
                              ptr<float>(kept), ptr<float>(dloss), ptr<T>(dx), (int)x.size(0), (int)x.size(1),
                              stream());
  });
  return dx;
}

Tensor cross_entropy_backward_meta(const Tensor& logits, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                   int64_t) {
  return empty_like_contiguous(logits);
}

struct CrossEntropyFn : torch::autograd::Function<CrossEntropyFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& logits, const Tensor& tgt, int64_t ignore_index) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const auto [loss, lse, kept] =
        KERNELS_OP("cross_entropy_forward", cross_entropy_forward_cuda).call(logits, tgt, ignore_index);
    ctx->save_for_backward({logits, tgt, lse, kept});
    ctx->saved_data["ignore_index"] = ignore_index;
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const int64_t ignore_index = ctx->saved_data["ignore_index"].toInt();
    return {KERNELS_OP("cross_entropy_backward", cross_entropy_backward_cuda)
                .call(s[0], s[1], s[2], s[3], grads[0], ignore_index),
            Tensor(), Tensor()};
  }
};

Tensor cross_entropy_impl(const Tensor& logits, const Tensor& tgt, int64_t ignore_index) {
  return std::get<0>(KERNELS_OP("cross_entropy_forward", cross_entropy_forward_cuda).call(logits, tgt, ignore_index));
}

Tensor cross_entropy_autograd(const Tensor& logits, const Tensor& tgt, int64_t ignore_index) {
  return autograd_or_below<CrossEntropyFn>(KERNELS_OP("cross_entropy", cross_entropy_impl), logits, tgt, ignore_index);
}

TORCH_LIBRARY_FRAGMENT(kernels, m) {
  // Mean cross-entropy of logits (N, C) against int64 targets (N,), float32, over the rows whose target is not
  // ignore_index (none kept: NaN); a target out of range: NaN, and a ValueError from the next call or
  // check_errors().
  def_op(m, "cross_entropy(Tensor logits, Tensor targets, int ignore_index=-100) -> Tensor");
  composite(m, "cross_entropy", cross_entropy_impl);
  autograd(m, "cross_entropy", cross_entropy_autograd);
  def_half(m, "cross_entropy_forward(Tensor logits, Tensor targets, int ignore_index) -> (Tensor, Tensor, Tensor)");
  cuda_meta(m, "cross_entropy_forward", cross_entropy_forward_cuda, cross_entropy_forward_meta, CPU_ERRORS);
  def_half(m, "cross_entropy_backward(Tensor logits, Tensor targets, Tensor lse, Tensor kept, Tensor dloss, "
              "int ignore_index) -> Tensor");
  cuda_meta(m, "cross_entropy_backward", cross_entropy_backward_cuda, cross_entropy_backward_meta);
}

// ---- GEMV (inference only, no autograd) --------------------------------------------------------

// y (S, N) = w[e_s] @ x[s] + b[e_s] with w (E, N, K), or w (N, K) and no experts. Inputs checked; all of one
// dtype, float32 or bfloat16 (bf16 weights: half the bytes a decode step streams; fp32 sums).
static Tensor gemv_launch(const char* op, const Tensor& w, const Tensor& x, const Tensor& b, const Tensor& experts) {
  const int64_t N = w.size(-2), K = w.size(-1), S = x.size(0);
  Tensor y = at::empty({S, N}, w.options());
  with_type(w.scalar_type(), [&](auto t) {
    using T = decltype(t);
    launch::gemv(ptr<T>(w), ptr<T>(x), ptr<T>(b), ptr<T>(y), to_int(op, N, "N"), to_int(op, K, "K"),
         to_int(op, S, "rows of x"), ptr<int64_t>(experts), w.dim() == 3 ? w.size(0) : 1, stream());
  });
  return y;
}

static Tensor checked_bias(const char* op, const Tensor& w, const std::optional<Tensor>& b_in, at::IntArrayRef shape) {
  if (!b_in.has_value() || !b_in->defined()) return Tensor();
  check_fp_cuda(op, *b_in, "bias", w, "weight");
  check_same_device(op, w, "weight", *b_in, "bias");
  REQUIRE(b_in->sizes() == shape, op, ": bias must have shape ", shape, ", got ", b_in->sizes());
  return b_in->contiguous();
}

// Both return the bias, checked and contiguous (undefined where none is given).
static Tensor check_gemv(const Tensor& w, const Tensor& x, const std::optional<Tensor>& b) {
  const char* op = "gemv";
  check_fp_cuda(op, w, "weight", w, "weight");
  check_fp_cuda(op, x, "x", w, "weight");
  check_same_device(op, w, "weight", x, "x");
  check_dim(op, w, "weight", 2, "(N, K)");
  REQUIRE(x.dim() == 1 && x.size(0) == w.size(1), op, ": x must have shape (", w.size(1), ",), got ", x.sizes());
  return checked_bias(op, w, b, {w.size(0)});
}

Tensor gemv_cuda(const Tensor& w, const Tensor& x, const std::optional<Tensor>& b) {
  raise_pending_index_error();
  const Tensor bias = check_gemv(w, x, b);
  const c10::cuda::CUDAGuard guard(w.device());
  return gemv_launch("gemv", w.contiguous(), x.reshape({1, -1}).contiguous(), bias, Tensor()).view({w.size(0)});
}

Tensor gemv_meta(const Tensor& w, const Tensor& x, const std::optional<Tensor>& b) {
  check_gemv(w, x, b);
  return at::empty({w.size(0)}, w.options());
}

static Tensor check_expert_gemv(const Tensor& w, const Tensor& x, const std::optional<Tensor>& b,
                                const Tensor& experts) {
  const char* op = "expert_gemv";
  check_fp_cuda(op, w, "weight", w, "weight");
  check_fp_cuda(op, x, "x", w, "weight");
  check_index_cuda(op, experts, "experts");
  check_same_device(op, w, "weight", x, "x");
  check_same_device(op, w, "weight", experts, "experts");
  check_dim(op, w, "weight", 3, "(E, N, K)");
  check_dim(op, x, "x", 2, "(S, K)");
  REQUIRE(x.size(1) == w.size(2), op, ": x must have shape (S, ", w.size(2), "), got ", x.sizes());
  REQUIRE(experts.dim() == 1 && experts.size(0) == x.size(0), op, ": experts must have shape (", x.size(0),
          ",), one per row of x, got ", experts.sizes());
  return checked_bias(op, w, b, {w.size(0), w.size(1)});
}

Tensor expert_gemv_cuda(const Tensor& w, const Tensor& x, const std::optional<Tensor>& b, const Tensor& experts) {
  raise_pending_index_error();
  const Tensor bias = check_expert_gemv(w, x, b, experts);
  const c10::cuda::CUDAGuard guard(w.device());
  return gemv_launch("expert_gemv", w.contiguous(), x.contiguous(), bias, experts.contiguous());
}

Tensor expert_gemv_meta(const Tensor& w, const Tensor& x, const std::optional<Tensor>& b, const Tensor& experts) {
  check_expert_gemv(w, x, b, experts);
  return at::empty({x.size(0), w.size(1)}, w.options());
}

// ---- KV cache write (inference only, no autograd) ---------------------------------------------

// k_cache[:, :, positions[t]] = k[:, :, t] and the same for v, in place (the schema says so: Tensor(a!)):
// the caches (B, H, S, D) contiguous, k and v (B, H, T, D) any strides with the last dim contiguous
// (views of a QKV output).
static void check_kv_write(const Tensor& k_cache, const Tensor& v_cache, const Tensor& positions, const Tensor& k,
                           const Tensor& v) {
  const char* op = "kv_write";
  check_fp_cuda(op, k_cache, "k_cache", k_cache, "k_cache");
  const std::pair<const Tensor*, const char*> others[] = {{&v_cache, "v_cache"}, {&k, "k"}, {&v, "v"}};
  for (const auto& [t, name] : others) {
    check_fp_cuda(op, *t, name, k_cache, "k_cache");
    check_same_device(op, k_cache, "k_cache", *t, name);
  }
  check_index_cuda(op, positions, "positions");
  check_same_device(op, k_cache, "k_cache", positions, "positions");
  check_dim(op, k_cache, "k_cache", 4, "(B, H, S, D)");
  check_dim(op, k, "k", 4, "(B, H, T, D)");
  REQUIRE(v_cache.sizes() == k_cache.sizes(), op, ": v_cache must have k_cache's shape ", k_cache.sizes(), ", got ",
          v_cache.sizes());
  REQUIRE(v.sizes() == k.sizes(), op, ": v must have k's shape ", k.sizes(), ", got ", v.sizes());
  const int64_t B = k_cache.size(0), H = k_cache.size(1), D = k_cache.size(3), T = k.size(2);
  REQUIRE(k.size(0) == B && k.size(1) == H && k.size(3) == D, op, ": k must have shape (", B, ", ", H, ", T, ", D,
          ") to fit k_cache ", k_cache.sizes(), ", got ", k.sizes());
  REQUIRE(positions.dim() == 1 && positions.size(0) == T, op, ": positions must have shape (", T,
          ",), one per row of k along dim 2, got ", positions.sizes());
  REQUIRE(k_cache.is_contiguous() && v_cache.is_contiguous(), op, ": k_cache and v_cache must be contiguous");
  REQUIRE(k.stride(3) == 1 && v.stride(3) == 1, op, ": k and v must have a contiguous last dim, got strides ",
          k.strides(), " and ", v.strides());
  REQUIRE(!wants_grad(k, v, k_cache, v_cache), op,
          ": writes to a cache and has no gradient; call it under torch.no_grad()");
}

void kv_write_cuda(const Tensor& k_cache, const Tensor& v_cache, const Tensor& positions, const Tensor& k,
                   const Tensor& v) {
  raise_pending_index_error();
  check_kv_write(k_cache, v_cache, positions, k, v);
  const char* op = "kv_write";
  const int64_t B = k_cache.size(0), H = k_cache.size(1), S = k_cache.size(2), D = k_cache.size(3), T = k.size(2);
  const c10::cuda::CUDAGuard guard(k_cache.device());
  const Tensor pos = positions.contiguous();
  const int64_t ks[3] = {k.stride(0), k.stride(1), k.stride(2)}, vs[3] = {v.stride(0), v.stride(1), v.stride(2)};
  with_type(k_cache.scalar_type(), [&](auto t) {
    using E = decltype(t);
    launch::kv_write(ptr<E>(k_cache), ptr<E>(v_cache), ptr<E>(k), ptr<E>(v), ks, vs, ptr<int64_t>(pos), to_int(op, B, "B"),
             to_int(op, H, "H"), to_int(op, T, "T"), to_int(op, S, "S"), to_int(op, D, "D"), stream());
  });
  torch::autograd::impl::bump_version(k_cache);  // written in place, as index_copy_ records it
  torch::autograd::impl::bump_version(v_cache);
}

void kv_write_meta(const Tensor& k_cache, const Tensor& v_cache, const Tensor& positions, const Tensor& k,
                   const Tensor& v) {
  check_kv_write(k_cache, v_cache, positions, k, v);
}

void kv_write_autograd(const Tensor& k_cache, const Tensor& v_cache, const Tensor& positions, const Tensor& k,
                       const Tensor& v) {
  call_below_autograd(KERNELS_OP("kv_write", kv_write_cuda), k_cache, v_cache, positions, k, v);
}

Tensor gemv_autograd(const Tensor& w, const Tensor& x, const std::optional<Tensor>& b) {
  return call_below_autograd(KERNELS_OP("gemv", gemv_cuda), w, x, b);
}

Tensor expert_gemv_autograd(const Tensor& w, const Tensor& x, const std::optional<Tensor>& b, const Tensor& experts) {
  return call_below_autograd(KERNELS_OP("expert_gemv", expert_gemv_cuda), w, x, b, experts);
}

TORCH_LIBRARY_FRAGMENT(kernels, m) {
  // Decoding, no autograd: y = weight @ x + bias for one vector; row s of x through expert experts[s] of
  // weight (E, N, K); a KV cache write in place.
  def_op(m, "gemv(Tensor weight, Tensor x, Tensor? bias=None) -> Tensor");
  cuda_meta(m, "gemv", gemv_cuda, gemv_meta, CPU_ERRORS);
  autograd(m, "gemv", gemv_autograd);
  def_op(m, "expert_gemv(Tensor weight, Tensor x, Tensor? bias, Tensor experts) -> Tensor");
  cuda_meta(m, "expert_gemv", expert_gemv_cuda, expert_gemv_meta, CPU_ERRORS);
  autograd(m, "expert_gemv", expert_gemv_autograd);
  def_op(m, "kv_write(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor positions, Tensor k, Tensor v) -> ()");
  cuda_meta(m, "kv_write", kv_write_cuda, kv_write_meta, CPU_ERRORS);
  autograd(m, "kv_write", kv_write_autograd);
}

// ---- top-k (no autograd) ----------------------------------------------------------------------

static std::vector<int64_t> check_topk(const Tensor& x, int64_t k) {
  const char* op = "topk";
  check_fp_cuda(op, x, "x", x, "x");
  REQUIRE(x.dim() >= 1, op, ": x must have at least one dim");
  const int64_t L = x.size(-1);
  REQUIRE_VALUE(k >= 1 && k <= L && k <= limits::topk_max_k, op, ": k must be in [1, min(", limits::topk_max_k,
                ", x.shape[-1] = ", L, ")], got k = ", k);
  auto shape = x.sizes().vec();
  shape.back() = k;
  return shape;
}

std::tuple<Tensor, Tensor> topk_cuda(const Tensor& x_in, int64_t k) {
  raise_pending_index_error();
  const auto shape = check_topk(x_in, k);
  const c10::cuda::CUDAGuard guard(x_in.device());
  // bf16 rows are ranked as fp32 (every bf16 value is exactly an fp32 one, so the order is the same)
  const Tensor x = x_in.contiguous().to(at::kFloat);
  Tensor values = at::empty(shape, x.options()), indices = at::empty(shape, x.options().dtype(at::kLong));
  const int64_t L = x.size(-1), rows = x.numel() / L;
  const int len = to_int("topk", L, "row length");
  const size_t ws_bytes = launch::topk_workspace_bytes(rows, len, (int)k);  // 0 unless wide rows are split
  const Tensor ws = ws_bytes ? at::empty({(int64_t)ws_bytes}, x.options().dtype(at::kByte)) : Tensor();
  launch::topk(x.data_ptr<float>(), values.data_ptr<float>(), indices.data_ptr<int64_t>(), rows, len, (int)k,
       ws_bytes ? ws.data_ptr() : nullptr, stream());
  return {values.to(x_in.scalar_type()), indices};
}

std::tuple<Tensor, Tensor> topk_meta(const Tensor& x, int64_t k) {
  const auto shape = check_topk(x, k);
  return {at::empty(shape, x.options()), at::empty(shape, x.options().dtype(at::kLong))};
}

std::tuple<Tensor, Tensor> topk_autograd(const Tensor& x, int64_t k) {
  return call_below_autograd(KERNELS_OP("topk", topk_cuda), x, k);
}

TORCH_LIBRARY_FRAGMENT(kernels, m) {
  // The k largest of each row, sorted (ties: lower index first); no autograd.
  def_op(m, "topk(Tensor x, int k) -> (Tensor, Tensor)");
  cuda_meta(m, "topk", topk_cuda, topk_meta, CPU_ERRORS);
  autograd(m, "topk", topk_autograd);
}

// ---- attention --------------------------------------------------------------------------------

struct AttnShape {
  int64_t B, H, Hkv, Sq, Sk, D;  // H query heads share Hkv key/value heads, H / Hkv each
  int group() const { return (int)(H / Hkv); }
};

// q, k, v: float32, or bfloat16 (fused mode), all three alike.
static AttnShape check_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal) {
  const char* op = "attention";
  check_fp_cuda(op, q, "q", q, "q");
  check_fp_cuda(op, k, "k", q, "q");
  check_fp_cuda(op, v, "v", q, "q");
  check_same_device(op, q, "q", k, "k");
  check_same_device(op, q, "q", v, "v");
  check_dim(op, q, "q", 4, "(B, H, Sq, D)");
  check_dim(op, k, "k", 4, "(B, H_kv, Sk, D)");
  check_dim(op, v, "v", 4, "(B, H_kv, Sk, D)");
  REQUIRE(k.sizes() == v.sizes(), op, ": k and v must have the same shape, got ", k.sizes(), " and ", v.sizes());
  REQUIRE(q.size(0) == k.size(0) && q.size(3) == k.size(3), op, ": q and k must agree in B and D, got q ",
          q.sizes(), " and k ", k.sizes());
  REQUIRE(q.size(1) >= 1, op, ": q needs at least one head, got q of shape ", q.sizes());
  REQUIRE(k.size(1) >= 1 && q.size(1) % k.size(1) == 0, op, ": q's heads (", q.size(1),
          ") must be a multiple of k's and v's (", k.size(1), "): each K/V head serves H / H_kv query heads");
  REQUIRE(k.size(2) >= 1, op, ": k and v need at least one key, got Sk = 0");
  REQUIRE_VALUE(!causal || q.size(2) <= k.size(2), op, ": causal attention needs Sq <= Sk (queries align to the ",
                    "last keys), got Sq = ", q.size(2), ", Sk = ", k.size(2));
  return {q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3)};
}

// The fused kernels read and write (B, H, S, D) tensors through their strides, D contiguous, in
// 16-byte chunks (cp.async): q, k, v as views of one projection's output, out and the gradients in
// (B, S, H, D) memory. A tensor whose rows do not start on 16 bytes (or lie 2^31 elements apart) is
// copied first.
static Tensor attention_operand(const Tensor& t) {
  const int64_t chunk = 16 / t.element_size();
  const bool ok = t.stride(3) == 1 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 &&
                  t.stride(0) % chunk == 0 && t.stride(1) % chunk == 0 && t.stride(2) % chunk == 0 &&
                  t.stride(2) <= INT32_MAX;  // the kernels keep the row stride in 32 bits
  if (ok) return t;
  Tensor c = t.contiguous();
  return reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 ? c.clone() : c;
}

// A new (B, H, S, D) tensor in (B, S, H, D) memory: the layout the heads side by side (the next
// projection's input) read without a copy.
static Tensor empty_bshd(const Tensor& like) {
  return at::empty({like.size(0), like.size(2), like.size(1), like.size(3)}, like.options()).transpose(1, 2);
}

// Whether q, k and v are the model's views of one projection: (B, S, (H + 2 H_kv) * D) memory holding q's,
// k's and v's heads side by side in that order. Then their gradients can be the same views of one new
// buffer (kernels::attention_fused_backward_packed), which train.JoinedSplit hands back whole (a
// concatenation of the three copied 37 MB a layer of the large preset). Read from strides, storage
// offsets and shared storage only, so fake tensors (torch.compile's tracing) take the same branch.
static bool packed_qkv(const Tensor& q, const Tensor& k, const Tensor& v) {
  const int64_t H = q.size(1), Hkv = k.size(1), S = q.size(2), D = q.size(3), W = (H + 2 * Hkv) * D;
  bool packed = S == k.size(2) && k.is_alias_of(q) && v.is_alias_of(q) &&
                k.storage_offset() == q.storage_offset() + H * D &&
                v.storage_offset() == k.storage_offset() + Hkv * D;
  for (const Tensor* t : {&q, &k, &v})
    packed = packed && t->stride(0) == S * W && t->stride(1) == D && t->stride(2) == W && t->stride(3) == 1;
  return packed;
}

// dq, dk, dv as (B, H, S, D) views of one (B, S, (H + 2 H_kv) * D) buffer, the layout of packed_qkv's inputs.
static std::array<Tensor, 3> packed_heads(const Tensor& buf, int64_t H, int64_t Hkv, int64_t D) {
  const int64_t B = buf.size(0), S = buf.size(1);
  const auto heads = [&](int64_t first, int64_t n) {  // heads first .. first + n - 1 as (B, n, S, D)
    return buf.narrow(2, first * D, n * D).view({B, S, n, D}).transpose(1, 2);
  };
  return {heads(0, H), heads(H, Hkv), heads(H + Hkv, Hkv)};
}

static AttnLayout layout_of(const Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2), (int)t.size(1)}; }

template <int... SIZES>
static std::vector<int64_t> as_vector(std::integer_sequence<int, SIZES...>) { return {SIZES...}; }

// The head sizes the fused kernels support (limits::fused_head_sizes).
static std::vector<int64_t> fused_head_sizes() { return as_vector(limits::fused_head_sizes{}); }

// The fused forward: (out, lse_log2), lse_log2 the rows' log2-sum-exp2 that the backward reads. kv_len (a
// 1-element int64 tensor on q's device) counts the valid keys.
// Dropout on q's probabilities where dropout_p != 0: rows (b * H + h) * Sq + query.
static void check_attention_dropout(const Tensor& q, double dropout_p, const std::optional<Tensor>& rng,
                                    int64_t salt) {
  if (dropout_p != 0.0)
    check_dropout_rng("attention", q, "q", q.size(0) * q.size(1) * q.size(2), dropout_p,
                      rng.has_value() ? *rng : Tensor(), salt);
}

static DropoutArgs attention_dropout(const Tensor& q, double dropout_p, const std::optional<Tensor>& rng,
                                     int64_t salt) {
  check_attention_dropout(q, dropout_p, rng, salt);  // the halves are ops too: checked here as well
  return dropout_p > 0.0 ? dropout_of(dropout_p, *rng, salt) : DropoutArgs{};
}

std::tuple<Tensor, Tensor> attention_fused_cuda(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                                                bool causal, double scale, bool precise,
                                                const std::optional<Tensor>& kv_len_opt, double dropout_p,
                                                const std::optional<Tensor>& rng, int64_t salt) {
  raise_pending_index_error();
  const AttnShape s = check_attention(q_in, k_in, v_in, causal);
  REQUIRE_VALUE(launch::attention_fused_supports((int)s.D), "attention: fused mode supports head dim D in ",
                at::IntArrayRef(fused_head_sizes()), ", got D = ", s.D, " (mode='tiled' takes any D)");
  const c10::cuda::CUDAGuard guard(q_in.device());
  if (std::isnan(scale)) {  // as SDPA: every score, so every output, NaN
    const auto nan = std::numeric_limits<float>::quiet_NaN();
    return {empty_bshd(q_in).fill_(nan), at::full({s.B, s.H, s.Sq}, nan, q_in.options().dtype(at::kFloat))};
  }
  const Tensor q = attention_operand(q_in), k = attention_operand(k_in), v = attention_operand(v_in);
  // The forward kernel keeps its row max over raw scores, which takes scale >= 0: a negative scale
  // runs as (-q, -scale), the same products exactly (the backward takes q and scale as given).
  const Tensor q_fwd = scale < 0 ? attention_operand(q.neg()) : q;
  const float scale_fwd = (float)std::abs(scale);
  const auto f32 = q.options().dtype(at::kFloat);  // lse_log2 and the splits' partial results stay fp32
  Tensor out = empty_bshd(q), lse_log2 = at::empty({s.B, s.H, s.Sq}, f32);
  AttnLayouts l{};
  l.q = layout_of(q_fwd); l.k = layout_of(k); l.v = layout_of(v); l.out = layout_of(out);
  const int BH = to_int("attention", s.B * s.H, "B * H");
  const int64_t ws_floats = launch::attention_fwd_workspace_floats(BH, s.group(), (int)s.Sq, (int)s.Sk, (int)s.D);
  Tensor ws = ws_floats ? at::empty({ws_floats}, f32) : Tensor();  // split keys' partial results
  const Tensor kv_len = kv_len_opt.has_value() && kv_len_opt->defined() ? kv_len_opt->contiguous() : Tensor();
  const int64_t* n = kv_len.defined() ? kv_len.data_ptr<int64_t>() : nullptr;
  const DropoutArgs drop = attention_dropout(q, dropout_p, rng, salt);
  if (q.scalar_type() == at::kBFloat16)
    launch::attention_fwd_fused(ptr<bf16>(q_fwd), ptr<bf16>(k), ptr<bf16>(v), ptr<bf16>(out), lse_log2.data_ptr<float>(), l, BH,
                        s.group(), (int)s.Sq, (int)s.Sk, (int)s.D, causal, scale_fwd, n, drop, ws_ptr(ws), stream());
  else
    launch::attention_fwd_fused(q_fwd.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), out.data_ptr<float>(),
                        lse_log2.data_ptr<float>(), l, BH, s.group(), (int)s.Sq, (int)s.Sk, (int)s.D, causal, scale_fwd,
                        precise, n, drop, ws_ptr(ws), stream());
  return {out, lse_log2};
}

std::tuple<Tensor, Tensor> attention_fused_meta(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                                                double, bool, const std::optional<Tensor>&, double,
                                                const std::optional<Tensor>&, int64_t) {
  const AttnShape s = check_attention(q, k, v, causal);
  return {empty_bshd(q), at::empty({s.B, s.H, s.Sq}, q.options().dtype(at::kFloat))};
}

// The fused backward into the buffers dq, dk, dv (any (B, H, S, D) views with D contiguous).
// deterministic = false: bf16 on Hopper adds dQ across key blocks in fp32 sums, in no fixed order.
static void fused_backward_into(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in, const Tensor& out,
                                const Tensor& lse_log2, const Tensor& dout_in, bool causal, double scale, bool precise,
                                bool deterministic, const DropoutArgs& drop, const Tensor& dq, const Tensor& dk,
                                const Tensor& dv) {
  const c10::cuda::CUDAGuard guard(q_in.device());
  if (std::isnan(scale)) {  // a NaN scale's outputs are NaN, and so are their gradients
    for (const Tensor* t : {&dq, &dk, &dv}) t->fill_(std::numeric_limits<float>::quiet_NaN());
    return;
  }
  const Tensor q = attention_operand(q_in), k = attention_operand(k_in), v = attention_operand(v_in);
  const Tensor dout = attention_operand(dout_in.to(q.scalar_type()));
  Tensor delta = at::empty_like(lse_log2);
  // with no queries nothing reaches k and v: their gradients are zeros, which the kernels never write
  if (!q.size(2)) {
    dk.zero_();
    dv.zero_();
  }
  AttnLayouts l{layout_of(q), layout_of(k), layout_of(v), layout_of(out), layout_of(dout),
                layout_of(dq), layout_of(dk), layout_of(dv)};
  const int BH = (int)(q.size(0) * q.size(1)), group = (int)(q.size(1) / k.size(1));
  const int Sq = (int)q.size(2), Sk = (int)k.size(2), D = (int)q.size(3);
  if (q.scalar_type() == at::kBFloat16) {
    // with dropout the backward is the deterministic one (kernels.cu 7.1)
    const int64_t sum_floats = deterministic || drop.rng ? 0 : launch::attention_bwd_dq_sum_floats(BH, Sq, D);
    const Tensor dq_sum = at::empty({sum_floats}, lse_log2.options());
    launch::attention_bwd_fused(ptr<bf16>(q), ptr<bf16>(k), ptr<bf16>(v), ptr<bf16>(out), ptr<bf16>(dout),
                        lse_log2.data_ptr<float>(), delta.data_ptr<float>(), ptr<bf16>(dq), ptr<bf16>(dk),
                        ptr<bf16>(dv), l, BH, group, Sq, Sk, D, causal, (float)scale, drop,
                        sum_floats ? dq_sum.data_ptr<float>() : nullptr, stream());
  } else
    launch::attention_bwd_fused(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), out.data_ptr<float>(),
                        dout.data_ptr<float>(), lse_log2.data_ptr<float>(), delta.data_ptr<float>(),
                        dq.data_ptr<float>(), dk.data_ptr<float>(), dv.data_ptr<float>(), l, BH, group, Sq, Sk, D,
                        causal, (float)scale, precise, drop, stream());
}

// dq, dk, dv, each in (B, S, H, D) memory, from the forward's inputs, output and lse_log2.
std::tuple<Tensor, Tensor, Tensor> attention_fused_backward_cuda(const Tensor& q, const Tensor& k, const Tensor& v,
                                                                 const Tensor& out, const Tensor& lse_log2,
                                                                 const Tensor& dout, bool causal, double scale,
                                                                 bool precise, bool deterministic, double dropout_p,
                                                                 const std::optional<Tensor>& rng, int64_t salt) {
  Tensor dq = empty_bshd(q), dk = empty_bshd(k), dv = empty_bshd(v);
  fused_backward_into(q, k, v, out, lse_log2, dout, causal, scale, precise, deterministic,
                      attention_dropout(q, dropout_p, rng, salt), dq, dk, dv);
  return {dq, dk, dv};
}

std::tuple<Tensor, Tensor, Tensor> attention_fused_backward_meta(const Tensor& q, const Tensor& k, const Tensor& v,
                                                                 const Tensor&, const Tensor&, const Tensor&, bool,
                                                                 double, bool, bool, double,
                                                                 const std::optional<Tensor>&, int64_t) {
  return {empty_bshd(q), empty_bshd(k), empty_bshd(v)};
}

// The same for packed_qkv's inputs: one (B, S, (H + 2 H_kv) * D) buffer, dq, dk and dv side by side.
Tensor attention_fused_backward_packed_cuda(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                            const Tensor& lse_log2, const Tensor& dout, bool causal, double scale,
                                            bool precise, bool deterministic, double dropout_p,
                                            const std::optional<Tensor>& rng, int64_t salt) {
  const int64_t H = q.size(1), Hkv = k.size(1), D = q.size(3);
  Tensor buf = at::empty({q.size(0), q.size(2), (H + 2 * Hkv) * D}, q.options());
  const auto [dq, dk, dv] = packed_heads(buf, H, Hkv, D);
  fused_backward_into(q, k, v, out, lse_log2, dout, causal, scale, precise, deterministic,
                      attention_dropout(q, dropout_p, rng, salt), dq, dk, dv);
  return buf;
}

Tensor attention_fused_backward_packed_meta(const Tensor& q, const Tensor& k, const Tensor&, const Tensor&,
                                            const Tensor&, const Tensor&, bool, double, bool, bool, double,
                                            const std::optional<Tensor>&, int64_t) {
  return at::empty({q.size(0), q.size(2), (q.size(1) + 2 * k.size(1)) * q.size(3)}, q.options());
}

// Tiled: S = scale * Q K^T and P = softmax(S) are materialized (B*H*Sq*Sk floats), built from the
// library's matmul and masked softmax; any head dim. Grouped K/V heads cost nothing extra: the query
// heads sharing one K/V head are stacked as the rows of one matrix (a reshape of contiguous q), and
// the masked softmax takes row r as query r % Sq; dK and dV then sum over the group inside the matmul.
// Returns out and P (B * H_kv, group * Sq, Sk).
std::tuple<Tensor, Tensor> attention_tiled_cuda(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                                                double scale) {
  raise_pending_index_error();
  const AttnShape s = check_attention(q, k, v, causal);
  const c10::cuda::CUDAGuard guard(q.device());
  const Tensor q3 = q.reshape({s.B * s.Hkv, s.group() * s.Sq, s.D});  // (B * H_kv, group * Sq, D)
  const Tensor k3 = k.reshape({-1, s.Sk, s.D}), v3 = v.reshape({-1, s.Sk, s.D});
  Tensor p = mm_new(q3, k3.transpose(1, 2), (float)scale);  // (BH, Sq, Sk)
  if (p.numel() > 0)
    launch::softmax_fwd(p.data_ptr<float>(), p.data_ptr<float>(), to_int("attention", p.numel() / s.Sk, "B * H * Sq"),
                to_int("attention", s.Sk, "Sk"), 1.f, causal ? (int)s.Sq : 0, (int)(s.Sk - s.Sq), stream());
  return {mm_new(p, v3).view({s.B, s.H, s.Sq, s.D}), p};
}

std::tuple<Tensor, Tensor> attention_tiled_meta(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                                                double) {
  const AttnShape s = check_attention(q, k, v, causal);
  return {at::empty({s.B, s.H, s.Sq, s.D}, q.options()),
          at::empty({s.B * s.Hkv, s.group() * s.Sq, s.Sk}, q.options())};
}

std::tuple<Tensor, Tensor, Tensor> attention_tiled_backward_cuda(const Tensor& q, const Tensor& k, const Tensor& v,
                                                                 const Tensor& p, const Tensor& dout_in,
                                                                 double scale) {
  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t Sk = k.size(2), D = q.size(3);
  const Tensor q3 = q.reshape({p.size(0), p.size(1), D}), k3 = k.reshape({-1, Sk, D}), v3 = v.reshape({-1, Sk, D});
  const Tensor dout = dout_in.reshape(q3.sizes());
  Tensor ds = mm_new(dout, v3.transpose(1, 2));  // dP, then dS in place
  Tensor dv = mm_new(p.transpose(1, 2), dout);
  if (p.numel() > 0)
    launch::softmax_bwd(p.data_ptr<float>(), ds.data_ptr<float>(), ds.data_ptr<float>(), (int)(p.numel() / p.size(2)),
                (int)p.size(2), (float)scale, stream());
  Tensor dq = mm_new(ds, k3);
  Tensor dk = mm_new(ds.transpose(1, 2), q3);
  return {dq.view(q.sizes()), dk.view(k.sizes()), dv.view(k.sizes())};
}

std::tuple<Tensor, Tensor, Tensor> attention_tiled_backward_meta(const Tensor& q, const Tensor& k, const Tensor&,
                                                                 const Tensor&, const Tensor&, double) {
  return {at::empty(q.sizes(), q.options()), at::empty(k.sizes(), k.options()), at::empty(k.sizes(), k.options())};
}

// The public op's arguments, checked; returns the scale (default 1/sqrt(D)).
static double attention_args(const Tensor& q, const Tensor& k, const Tensor& v, c10::string_view mode,
                             c10::string_view precision, std::optional<double> scale,
                             const std::optional<Tensor>& kv_len, double dropout_p, const std::optional<Tensor>& rng,
                             int64_t salt) {
  REQUIRE_VALUE(mode == "fused" || mode == "tiled", "attention: mode must be 'fused' or 'tiled', got '",
                std::string(mode), "'");
  REQUIRE_VALUE(precision == "fp32" || precision == "tf32",
                "attention: precision must be 'fp32' (3xTF32) or 'tf32', got '", std::string(precision), "'");
  REQUIRE(q.dim() == 4, "attention: q must be 4-D (B, H, Sq, D), got shape ", q.sizes());
  REQUIRE_VALUE(mode == "fused" || q.scalar_type() != at::kBFloat16,
                "attention: bfloat16 inputs run mode='fused' only; mode='tiled' takes float32");
  if (kv_len.has_value() && kv_len->defined()) {
    // Decoding against a preallocated cache: forward only, and kv_len stays on the device (no host read:
    // it is clamped to [0, Sk] in the kernel), so the call can be captured in a CUDA graph.
    REQUIRE(cuda_or_meta(*kv_len) && kv_len->scalar_type() == at::kLong && kv_len->numel() == 1,
            "attention: kv_len must be a 1-element int64 CUDA tensor, got ", kv_len->scalar_type(), " of shape ",
            kv_len->sizes(), " on ", kv_len->device());
    check_same_device("attention", q, "q", *kv_len, "kv_len");
    REQUIRE_VALUE(mode == "fused", "attention: kv_len needs mode='fused', got mode='", std::string(mode), "'");
    REQUIRE(!wants_grad(q, k, v),
            "attention: kv_len is for inference and has no backward; call it under torch.no_grad()");
  }
  if (dropout_p != 0.0) {  // on the probabilities, inside the fused kernels
    REQUIRE_VALUE(mode == "fused", "attention: dropout_p needs mode='fused', got mode='", std::string(mode), "'");
    check_attention_dropout(q, dropout_p, rng, salt);
  }
  return scale.has_value() ? *scale : 1.0 / std::sqrt((double)q.size(3));
}

// Below autograd: the forward op of the mode, its output.
Tensor attention_impl(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, std::optional<double> scale,
                      c10::string_view mode, c10::string_view precision, const std::optional<Tensor>& kv_len,
                      bool /*deterministic: the backward's*/, double dropout_p, const std::optional<Tensor>& rng,
                      int64_t salt) {
  const double sc = attention_args(q, k, v, mode, precision, scale, kv_len, dropout_p, rng, salt);
  if (mode == "tiled")
    return std::get<0>(KERNELS_OP("attention_tiled", attention_tiled_cuda).call(q, k, v, causal, sc));
  return std::get<0>(KERNELS_OP("attention_fused", attention_fused_cuda)
                         .call(q, k, v, causal, sc, precision == "fp32", kv_len, dropout_p, rng, salt));
}

struct AttentionFn : torch::autograd::Function<AttentionFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                        double scale, bool tiled, bool precise, bool deterministic, double dropout_p,
                        const std::optional<Tensor>& rng, int64_t salt) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const auto [out, stats] =
        tiled ? KERNELS_OP("attention_tiled", attention_tiled_cuda).call(q, k, v, causal, scale)
              : KERNELS_OP("attention_fused", attention_fused_cuda)
                    .call(q, k, v, causal, scale, precise, std::nullopt, dropout_p, rng, salt);
    // stats: lse_log2 (fused) or P (tiled); rng as it is (dropout's offset advances after the backward)
    ctx->save_for_backward({q, k, v, out, stats, rng.has_value() ? *rng : Tensor()});
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["salt"] = salt;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["tiled"] = tiled;
    ctx->saved_data["precise"] = precise;
    ctx->saved_data["deterministic"] = deterministic;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto t = ctx->get_saved_variables();
    const double scale = ctx->saved_data["scale"].toDouble();
    const bool tiled = ctx->saved_data["tiled"].toBool(), det = ctx->saved_data["deterministic"].toBool();
    const double dropout_p = ctx->saved_data["dropout_p"].toDouble();
    const int64_t salt = ctx->saved_data["salt"].toInt();
    const std::optional<Tensor> rng = t[5].defined() ? std::optional<Tensor>(t[5]) : std::nullopt;
    const variable_list none(AttentionFn::forward_args - 3);  // no gradient but for q, k, v
    if (!tiled && packed_qkv(t[0], t[1], t[2])) {
      const Tensor buf = KERNELS_OP("attention_fused_backward_packed", attention_fused_backward_packed_cuda)
                             .call(t[0], t[1], t[2], t[3], t[4], grads[0], ctx->saved_data["causal"].toBool(),
                                   scale, ctx->saved_data["precise"].toBool(), det, dropout_p, rng, salt);
      const auto [dq, dk, dv] = packed_heads(buf, t[0].size(1), t[1].size(1), t[0].size(3));
      return with_grads({dq, dk, dv}, none);
    }
    const auto [dq, dk, dv] =
        tiled
            ? KERNELS_OP("attention_tiled_backward", attention_tiled_backward_cuda).call(t[0], t[1], t[2], t[4],
                                                                                        grads[0], scale)
            : KERNELS_OP("attention_fused_backward", attention_fused_backward_cuda)
                  .call(t[0], t[1], t[2], t[3], t[4], grads[0], ctx->saved_data["causal"].toBool(), scale,
                        ctx->saved_data["precise"].toBool(), det, dropout_p, rng, salt);
    return with_grads({dq, dk, dv}, none);
  }

  static constexpr int forward_args = 11;  // q, k, v and the 8 after them

  static variable_list with_grads(variable_list grads, const variable_list& none) {
    grads.insert(grads.end(), none.begin(), none.end());
    return grads;
  }
};

Tensor attention_autograd(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, std::optional<double> scale,
                          c10::string_view mode, c10::string_view precision, const std::optional<Tensor>& kv_len,
                          bool deterministic, double dropout_p, const std::optional<Tensor>& rng, int64_t salt) {
  if ((kv_len.has_value() && kv_len->defined()) || !wants_grad(q, k, v)) {  // kv_len: inference only
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return attention_impl(q, k, v, causal, scale, mode, precision, kv_len, deterministic, dropout_p, rng, salt);
  }
  const double sc = attention_args(q, k, v, mode, precision, scale, kv_len, dropout_p, rng, salt);
  return AttentionFn::apply(q, k, v, causal, sc, mode == "tiled", precision == "fp32", deterministic, dropout_p, rng,
                            salt);
}

TORCH_LIBRARY_FRAGMENT(kernels, m) {
  // Attention over q (B, H, Sq, D), k, v (B, H_kv, Sk, D), like F.scaled_dot_product_attention; causal aligns
  // the queries to the last keys; H_kv dividing H is grouped-query attention; kv_len (a 1-element int64
  // tensor) counts a preallocated cache's valid keys (inference). float32 multiplies in 3xTF32
  // (precision 'fp32') or TF32; bfloat16 (mode 'fused') in bf16 with fp32 softmax statistics.
  // deterministic=False: the bf16 backward on Hopper adds dQ across key blocks in one kernel, in no
  // fixed order (faster at long sequences; dq's last bits vary from run to run, dk and dv do not).
  // dropout_p > 0 (fused): dropout on the probabilities, drawn as kernels.dropout draws from rng and salt,
  // the probabilities being rows (b * H + h) * Sq + query of Sk columns; its backward is deterministic.
  def_op(m, "attention(Tensor q, Tensor k, Tensor v, bool causal=False, float? scale=None, str mode='fused', "
         "str precision='fp32', Tensor? kv_len=None, bool deterministic=True, float dropout_p=0., "
         "Tensor? rng=None, int salt=0) -> Tensor");
  composite(m, "attention", attention_impl);
  autograd(m, "attention", attention_autograd);
  def_half(m, "attention_fused(Tensor q, Tensor k, Tensor v, bool causal, float scale, bool precise, "
           "Tensor? kv_len, float dropout_p, Tensor? rng, int salt) -> (Tensor, Tensor)");
  cuda_meta(m, "attention_fused", attention_fused_cuda, attention_fused_meta, CPU_ERRORS);
  def_half(m, "attention_fused_backward(Tensor q, Tensor k, Tensor v, Tensor output, Tensor lse_log2, Tensor dout, "
           "bool causal, float scale, bool precise, bool deterministic, float dropout_p, Tensor? rng, int salt) "
           "-> (Tensor, Tensor, Tensor)");
  cuda_meta(m, "attention_fused_backward", attention_fused_backward_cuda, attention_fused_backward_meta);
  def_half(m, "attention_fused_backward_packed(Tensor q, Tensor k, Tensor v, Tensor output, Tensor lse_log2, "
           "Tensor dout, bool causal, float scale, bool precise, bool deterministic, float dropout_p, Tensor? rng, "
           "int salt) -> Tensor");
  cuda_meta(m, "attention_fused_backward_packed", attention_fused_backward_packed_cuda,
            attention_fused_backward_packed_meta);
  def_half(m, "attention_tiled(Tensor q, Tensor k, Tensor v, bool causal, float scale) -> (Tensor, Tensor)");
  cuda_meta(m, "attention_tiled", attention_tiled_cuda, attention_tiled_meta, CPU_ERRORS);
  def_half(m, "attention_tiled_backward(Tensor q, Tensor k, Tensor v, Tensor p, Tensor dout, "
           "float scale) -> (Tensor, Tensor, Tensor)");
  cuda_meta(m, "attention_tiled_backward", attention_tiled_backward_cuda, attention_tiled_backward_meta);
}

// Under bf16 autocast: in bf16 where the fused kernels take the head size, else tiled in fp32, rounded.
Tensor attention_autocast(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, std::optional<double> scale,
                          c10::string_view mode, c10::string_view precision, const std::optional<Tensor>& kv_len,
                          bool deterministic, double dropout_p, const std::optional<Tensor>& rng, int64_t salt) {
  BELOW_AUTOCAST;
  const auto& op = KERNELS_OP("attention", attention_impl);
  if (!bf16_autocast() || q.dim() != 4)
    return op.call(q, k, v, causal, scale, mode, precision, kv_len, deterministic, dropout_p, rng, salt);
  // fused only with a cache or dropout: its own error if D is not supported
  const bool fused_only = (kv_len.has_value() && kv_len->defined()) || dropout_p != 0.0;
  if (mode == "fused" && (fused_only || launch::attention_fused_supports((int)q.size(3))))
    return op.call(to_bf16(q), to_bf16(k), to_bf16(v), causal, scale, "fused", precision, kv_len, deterministic,
                   dropout_p, rng, salt);
  return op.call(q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat), causal, scale, "tiled", precision, kv_len,
                 deterministic, dropout_p, rng, salt)
      .to(at::kBFloat16);
}

TORCH_LIBRARY_IMPL(kernels, AutocastCUDA, m) {
  m.impl("attention", &attention_autocast);
}

// ---- decode megakernel (inference only, no autograd) ------------------------------------------

// weights of a gpt model: wte (V, C), wpe (>= capacity, C), ln_f_w, ln_f_b (C), then per layer, as a gpt Block
// names them, ln_1_w, ln_1_b, attn_w (C + 2 kv, C), attn_b, attn_proj_w (C, C), attn_proj_b, ln_2_w, ln_2_b,
// mlp.fc_w (4C, C), mlp.fc_b, mlp.proj_w (C, 4C), mlp.proj_b. With rope_cos and rope_sin (fp32, (>= capacity,
// head_size / 2), a llama model's angles): wte, ln_f_w, then per layer ln_1_w, attn_w, attn_proj_w, ln_2_w,
// mlp.fc_w (H, C), mlp.up_w (H, C), mlp.proj_w (C, H), H the SwiGLU width. With top_k > 0 (a mixture of
// experts, of which a token takes top_k): every mlp weight and bias with a leading dim of the E experts, and
// mlp.router_w (E, C) last in each layer. Every one contiguous, in one dtype. A layer's weights fill the
// kernel's slots (limits::megakernel_layer_weights) that the model has.
static const char* const* const kMkSlotNames = limits::megakernel_layer_weights;
constexpr int MK_WEIGHTS = limits::megakernel_layer_slots;

// A layer's weight slots by name (limits::megakernel_slot, evaluated at compile time).
namespace mk {
constexpr int attn_w = limits::megakernel_slot("attn_w"),
              attn_b = limits::megakernel_slot("attn_b"), attn_proj_w = limits::megakernel_slot("attn_proj_w"),
              fc_w = limits::megakernel_slot("mlp.fc_w"), fc_b = limits::megakernel_slot("mlp.fc_b"),
              up_w = limits::megakernel_slot("mlp.up_w"), proj_w = limits::megakernel_slot("mlp.proj_w"),
              router_w = limits::megakernel_slot("mlp.router_w");
}  // namespace mk

static bool mk_is_bias(int slot) {
  const char* name = kMkSlotNames[slot];
  const size_t n = std::strlen(name);
  return n > 2 && std::strcmp(name + n - 2, "_b") == 0;
}

// The slots a model fills, in order: gpt's lack up_w, llama's the biases, a dense model's the router.
static const std::vector<int>& mk_slots(bool llama, bool moe) {
  static const std::array<std::vector<int>, 4> table = [] {
    std::array<std::vector<int>, 4> t;
    for (int k = 0; k < 4; ++k) {
      const bool is_llama = k / 2, is_moe = k % 2;
      for (int i = 0; i < MK_WEIGHTS; ++i)
        if (i == mk::router_w ? is_moe : i == mk::up_w ? is_llama : !(is_llama && mk_is_bias(i))) t[k].push_back(i);
    }
    return t;
  }();
  return table[2 * llama + moe];
}

static int64_t mk_globals(bool llama) { return llama ? 2 : 4; }  // wte, (wpe), ln_f_w, (ln_f_b)

// Slot's shape at width C, key width kv, mlp width H, E experts (0: dense).
static std::vector<int64_t> mk_slot_shape(int slot, int64_t C, int64_t kv, int64_t H, int64_t E) {
  std::vector<int64_t> shape = {C};
  if (slot == mk::attn_w) shape = {C + 2 * kv, C};
  else if (slot == mk::attn_b) shape = {C + 2 * kv};
  else if (slot == mk::attn_proj_w) shape = {C, C};
  else if (slot == mk::fc_w || slot == mk::up_w) shape = {H, C};
  else if (slot == mk::fc_b) shape = {H};
  else if (slot == mk::proj_w) shape = {C, H};
  else if (slot == mk::router_w) return {E, C};
  if (E && std::strncmp(kMkSlotNames[slot], "mlp.", 4) == 0) shape.insert(shape.begin(), E);  // each expert's
  return shape;
}

// Where layer 0's weight for `slot` sits among the arguments (a slot the model has).
static size_t mk_first(bool llama, bool moe, int slot) {
  const std::vector<int>& slots = mk_slots(llama, moe);
  return mk_globals(llama) + (std::find(slots.begin(), slots.end(), slot) - slots.begin());
}

// The mlp's width: gpt's 4C, llama's fc_w rows (of an expert, in a mixture).
static int64_t mk_hidden(const std::vector<Tensor>& weights, bool llama, int64_t C) {
  const size_t at = mk_first(llama, false, mk::fc_w);
  return llama && weights.size() > at && weights[at].dim() >= 2 ? weights[at].size(-2) : 4 * C;
}

// A mixture's experts: layer 0's router_w rows (0 for a dense model).
static int64_t mk_experts(const std::vector<Tensor>& weights, bool llama, int64_t top_k) {
  const size_t at = mk_first(llama, true, mk::router_w);
  return top_k > 0 && weights.size() > at && weights[at].dim() == 2 ? weights[at].size(0) : 0;
}

// What check_decode_megakernel read off the arguments: the architecture, where a layer's weights go among the
// kernel's slots, and the sizes the shapes were checked against.
struct MkLayout {
  bool llama;
  std::vector<int> slots;  // a layer's weights' slots, in their order
  int64_t globals, L, H, E;  // weights before the layers', layers, mlp width, experts (0: dense)
};

static MkLayout check_decode_megakernel(const std::vector<Tensor>& weights, const Tensor& tok, const Tensor& pos,
                                    const Tensor& k_cache, const Tensor& v_cache, const Tensor& logits,
                                    const Tensor& workspace, int64_t n_head, const std::optional<Tensor>& trace,
                                    const std::optional<Tensor>& rope_cos, const std::optional<Tensor>& rope_sin,
                                    int64_t top_k) {
  const char* op = "decode_megakernel";
  const bool llama = rope_cos.has_value() && rope_cos->defined();
  REQUIRE(llama == (rope_sin.has_value() && rope_sin->defined()), op,
          ": rope_cos and rope_sin come together (a llama model) or not at all (gpt)");
  REQUIRE(top_k >= 0 && top_k <= limits::megakernel_max_top_k, op, ": top_k must be 0 (a dense model) or the 1 to ",
          limits::megakernel_max_top_k, " experts a token takes, got ", top_k);
  const std::vector<int>& slots = mk_slots(llama, top_k > 0);
  const int64_t G = mk_globals(llama), per = (int64_t)slots.size();
  std::string names;
  for (int i : slots) names += std::string(names.empty() ? "" : ", ") + kMkSlotNames[i];
  REQUIRE((int64_t)weights.size() >= G + per && ((int64_t)weights.size() - G) % per == 0, op, ": weights must be ",
          llama ? "wte, ln_f_w" : "wte, wpe, ln_f_w, ln_f_b", ", then ", per, " a layer (", names, ") for a ",
          top_k ? "mixture of experts" : "dense model", llama ? " with rope tables (llama)" : " (gpt)", ", got ",
          (int64_t)weights.size(), " tensors");
  const Tensor& wte = weights[0];
  check_fp_cuda(op, wte, "wte", wte, "wte");
  check_dim(op, wte, "wte", 2, "(V, C)");
  const int64_t L = ((int64_t)weights.size() - G) / per, V = wte.size(0), C = wte.size(1);
  REQUIRE(n_head >= 1 && C % n_head == 0, op, ": n_head must divide n_embd (", C, "), got ", n_head);
  REQUIRE(C >= 1, op, ": wte must have at least one column (n_embd), got shape ", wte.sizes());
  check_fp_cuda(op, k_cache, "k_cache", wte, "wte");
  check_dim(op, k_cache, "k_cache", 5, "(n_layer, 1, n_kv_head, capacity, head_size)");
  const int64_t hs = C / n_head, n_kv = k_cache.size(2), capacity = k_cache.size(3);
  REQUIRE(k_cache.size(0) == L && k_cache.size(1) == 1 && k_cache.size(4) == hs && n_kv >= 1 && n_head % n_kv == 0,
          op, ": k_cache must have shape (", L, ", 1, n_kv_head, capacity, ", hs,
          ") with n_kv_head dividing n_head (one sequence, the weights' layers and head size), got ", k_cache.sizes());
  check_fp_cuda(op, v_cache, "v_cache", wte, "wte");
  REQUIRE(v_cache.sizes() == k_cache.sizes(), op, ": v_cache must have k_cache's shape ", k_cache.sizes(), ", got ",
          v_cache.sizes());
  REQUIRE(L <= limits::megakernel_max_layers, op, ": at most ", limits::megakernel_max_layers, " layers, got ", L);
  auto check_weight = [&](const Tensor& w, const std::string& name, std::vector<int64_t> shape) {
    check_fp_cuda(op, w, name.c_str(), wte, "wte");
    check_same_device(op, wte, "wte", w, name.c_str());
    REQUIRE(w.sizes() == at::IntArrayRef(shape), op, ": ", name, " must have shape ", at::IntArrayRef(shape),
            ", got ", w.sizes());
    REQUIRE(w.is_contiguous(), op, ": ", name, " must be contiguous");
  };
  check_weight(wte, "wte", {V, C});
  if (!llama) {
    REQUIRE(weights[1].dim() == 2 && weights[1].size(0) >= capacity, op, ": wpe must hold at least the cache's ",
            capacity, " positions, got shape ", weights[1].sizes());
    check_weight(weights[1], "wpe", {weights[1].size(0), C});
  }
  check_weight(weights[G / 2], "ln_f_w", {C});
  if (!llama) check_weight(weights[3], "ln_f_b", {C});
  const int64_t H = mk_hidden(weights, llama, C), elem = wte.element_size();
  REQUIRE(H >= C && H <= 4 * C && (H * elem) % 16 == 0, op, ": mlp.fc_w's rows (the SwiGLU width) must be in [", C,
          ", ", 4 * C, "] and a multiple of 16 bytes, got ", H);
  const int64_t E = mk_experts(weights, llama, top_k);
  REQUIRE(!top_k || (E >= top_k && E <= limits::megakernel_max_experts), op, ": mlp.router_w must have between top_k (",
          top_k, ") and ", limits::megakernel_max_experts, " rows (experts), got shape ", weights[G + per - 1].sizes());
  for (int64_t l = 0; l < L; ++l)
    for (int64_t i = 0; i < per; ++i)
      check_weight(weights[G + l * per + i], "layer " + std::to_string(l) + "'s " + kMkSlotNames[slots[i]],
                   mk_slot_shape(slots[i], C, n_kv * hs, H, E));
  const std::pair<const Tensor*, const char*> tables[] = {{&*rope_cos, "rope_cos"}, {&*rope_sin, "rope_sin"}};
  if (llama)
    for (const auto& [t, name] : tables) {
      check_float_cuda(op, *t, name);
      check_same_device(op, wte, "wte", *t, name);
      REQUIRE(t->dim() == 2 && t->size(0) >= capacity && t->size(1) == hs / 2 && t->is_contiguous(), op, ": ", name,
              " must be a contiguous (>= ", capacity, ", ", hs / 2,
              ") table of the cache's positions' angles, got shape ", t->sizes());
    }
  for (const auto& [t, name] : {std::pair<const Tensor*, const char*>{&tok, "tok"}, {&pos, "pos"}}) {
    check_index_cuda(op, *t, name);
    check_same_device(op, wte, "wte", *t, name);
    REQUIRE(t->numel() == 1, op, ": ", name, " must hold one value, got shape ", t->sizes());
  }
  check_fp_cuda(op, logits, "logits", wte, "wte");
  REQUIRE(logits.dim() == 1 && logits.size(0) == V && logits.is_contiguous(), op,
          ": logits must be a contiguous (", V, ",) tensor, got shape ", logits.sizes());
  check_float_cuda(op, workspace, "workspace");
  REQUIRE(k_cache.is_contiguous() && v_cache.is_contiguous() && workspace.is_contiguous(), op,
          ": k_cache, v_cache and workspace must be contiguous");
  for (const auto& [t, name] : {std::pair<const Tensor*, const char*>{&k_cache, "k_cache"}, {&v_cache, "v_cache"},
                                {&logits, "logits"}, {&workspace, "workspace"}})
    check_same_device(op, wte, "wte", *t, name);
  REQUIRE(!at::GradMode::is_enabled() || !std::any_of(weights.begin(), weights.end(), [](const Tensor& w) {
            return w.requires_grad();
          }), op, ": decodes and has no gradient; call it under torch.no_grad()");
  if (trace.has_value() && trace->defined()) {
    check_index_cuda(op, *trace, "trace");
    check_same_device(op, wte, "wte", *trace, "trace");
    REQUIRE(trace->dim() == 2 && trace->is_contiguous(), op,
            ": trace must be a contiguous (blocks, stamps) int64 tensor, got shape ", trace->sizes());
  }
  return {llama, slots, G, L, H, E};
}

// The workspace decode_megakernel needs at width n_embd with n_head heads, top_k experts a token (0: dense)
// (floats, on the current GPU).
static int64_t decode_megakernel_workspace(int64_t n_embd, int64_t n_head, int64_t top_k) {
  REQUIRE_VALUE(n_head >= 1 && n_embd % n_head == 0, "decode_megakernel_workspace_floats: n_head must divide n_embd");
  REQUIRE_VALUE(top_k >= 0 && top_k <= limits::megakernel_max_top_k,
                "decode_megakernel_workspace_floats: top_k must be 0 (dense) or 1 to ", limits::megakernel_max_top_k,
                ", got ", top_k);
  return launch::decode_megakernel_workspace_floats((int)n_embd, (int)n_head, (int)(n_embd / n_head),
                                            (int)std::max<int64_t>(1, top_k));
}

void decode_megakernel_cuda(const std::vector<Tensor>& weights, const Tensor& tok, const Tensor& pos,
                            const Tensor& k_cache, const Tensor& v_cache, const Tensor& logits,
                            const Tensor& workspace, int64_t n_head, double eps, const std::optional<Tensor>& trace,
                            const std::optional<Tensor>& rope_cos, const std::optional<Tensor>& rope_sin,
                            int64_t top_k) {
  raise_pending_index_error();
  const MkLayout layout = check_decode_megakernel(weights, tok, pos, k_cache, v_cache, logits, workspace, n_head,
                                                  trace, rope_cos, rope_sin, top_k);
  const char* op = "decode_megakernel";
  const c10::cuda::CUDAGuard guard(k_cache.device());
  const int64_t C = weights[0].size(1), L = layout.L, hs = C / n_head, n_kv = k_cache.size(2);
  const std::string why = launch::decode_megakernel_unsupported((int)C, (int)L, (int)n_head, (int)n_kv, (int)layout.H,
                                                                (int)layout.E, (int)top_k, (int)weights[0].element_size());
  REQUIRE_VALUE(why.empty(), op, ": this model cannot run here: ", why);
  const int64_t need = decode_megakernel_workspace(C, n_head, top_k);
  REQUIRE(workspace.numel() >= need, op, ": workspace must hold ", need,
          " floats (launch::decode_megakernel_workspace_floats), got ", workspace.numel());
  for (size_t i = 0; i < weights.size(); ++i)  // the kernel copies weight rows with 16-byte bulk copies
    REQUIRE(reinterpret_cast<uintptr_t>(weights[i].data_ptr()) % 16 == 0, op, ": weights[", (int64_t)i,
            "] must start at a 16-byte aligned address (a view at an offset is not)");
  REQUIRE(reinterpret_cast<uintptr_t>(workspace.data_ptr()) % 16 == 0, op,
          ": workspace must start at a 16-byte aligned address (a view at an offset is not)");
  const bool tracing = trace.has_value() && trace->defined();
  const int64_t blocks = launch::decode_megakernel_grid(), stamps = launch::decode_megakernel_trace_stamps((int)L);
  REQUIRE(!tracing || (trace->size(0) == blocks && trace->size(1) == stamps), op, ": trace must have shape (",
          blocks, ", ", stamps, "): the GPU's SMs, 2 + 10 n_layer stamps; got ", trace->sizes());
  const bool llama = layout.llama;
  const int64_t G = layout.globals, per = (int64_t)layout.slots.size();
  with_type(weights[0].scalar_type(), [&](auto t) {
    using E = decltype(t);
    std::vector<const E*> layers(L * MK_WEIGHTS, nullptr);  // the slots the architecture lacks stay empty
    for (int64_t l = 0; l < L; ++l)
      for (int64_t i = 0; i < per; ++i) layers[l * MK_WEIGHTS + layout.slots[i]] = ptr<E>(weights[G + l * per + i]);
    launch::decode_megakernel(layers.data(), MK_WEIGHTS, ptr<E>(weights[0]), llama ? nullptr : ptr<E>(weights[1]),
                      ptr<E>(weights[G / 2]), llama ? nullptr : ptr<E>(weights[3]),
                      llama ? ptr<float>(*rope_cos) : nullptr, llama ? ptr<float>(*rope_sin) : nullptr,
                      ptr<E>(k_cache), ptr<E>(v_cache), ptr<int64_t>(tok), ptr<int64_t>(pos), ptr<E>(logits),
                      ptr<float>(workspace), tracing ? reinterpret_cast<uint64_t*>(trace->data_ptr()) : nullptr,
                      (int)L, to_int(op, C, "n_embd"), (int)n_head, (int)n_kv, (int)layout.H, (int)layout.E, (int)top_k,
                      to_int(op, weights[0].size(0), "V"), to_int(op, k_cache.size(3), "capacity"), (float)eps,
                      stream());
  });
  for (const Tensor* t : {&pos, &k_cache, &v_cache, &logits, &workspace}) torch::autograd::impl::bump_version(*t);
  if (tracing) torch::autograd::impl::bump_version(*trace);
}

void decode_megakernel_meta(const std::vector<Tensor>& weights, const Tensor& tok, const Tensor& pos,
                            const Tensor& k_cache, const Tensor& v_cache, const Tensor& logits,
                            const Tensor& workspace, int64_t n_head, double eps, const std::optional<Tensor>& trace,
                            const std::optional<Tensor>& rope_cos, const std::optional<Tensor>& rope_sin,
                            int64_t top_k) {
  check_decode_megakernel(weights, tok, pos, k_cache, v_cache, logits, workspace, n_head, trace, rope_cos, rope_sin,
                          top_k);
}

void decode_megakernel_autograd(const std::vector<Tensor>& weights, const Tensor& tok, const Tensor& pos,
                                const Tensor& k_cache, const Tensor& v_cache, const Tensor& logits,
                                const Tensor& workspace, int64_t n_head, double eps, const std::optional<Tensor>& trace,
                                const std::optional<Tensor>& rope_cos, const std::optional<Tensor>& rope_sin,
                                int64_t top_k) {
  call_below_autograd(KERNELS_OP("decode_megakernel", decode_megakernel_cuda), weights, tok, pos, k_cache, v_cache,
                      logits, workspace, n_head, eps, trace, rope_cos, rope_sin, top_k);
}

// None if the current GPU's megakernel decodes a model of this shape and dtype, else why not.
static std::optional<std::string> decode_megakernel_why_not(int64_t n_embd, int64_t n_head, int64_t n_kv_head,
                                                            int64_t n_layer, int64_t element_size, int64_t hidden,
                                                            int64_t n_expert, int64_t top_k) {
  if (hidden == 0) hidden = 4 * n_embd;
  const std::string why = launch::decode_megakernel_unsupported((int)n_embd, (int)n_layer, (int)n_head, (int)n_kv_head,
                                                                (int)hidden, (int)n_expert, (int)top_k,
                                                                (int)element_size);
  return why.empty() ? std::nullopt : std::optional<std::string>(why);
}

TORCH_LIBRARY_FRAGMENT(kernels, m) {
  // A whole decode step of a gpt model (or, with rope_cos and rope_sin, a llama model; with top_k, a mixture of
  // experts): the logits of tok at position pos, its key and value written into the caches, pos advanced by one;
  // with trace, each block's clock (ns) at its start, after each step (its work done, the next step's inputs
  // arrived) and at its end. The workspace holds a launch count and the values passed between blocks: zero it
  // before the first step, then keep it for one model's steps on one stream and one GPU.
  def_op(m, "decode_megakernel(Tensor[] weights, Tensor tok, Tensor(a!) pos, Tensor(b!) k_cache, "
            "Tensor(c!) v_cache, Tensor(d!) logits, Tensor(e!) workspace, int n_head, float eps=1e-05, "
            "Tensor(f!)? trace=None, Tensor? rope_cos=None, Tensor? rope_sin=None, int top_k=0) -> ()");
  cuda_meta(m, "decode_megakernel", decode_megakernel_cuda, decode_megakernel_meta, CPU_ERRORS);
  autograd(m, "decode_megakernel", decode_megakernel_autograd);
}

// ---- module -----------------------------------------------------------------------------------

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Hand-written CUDA kernels for transformer training and inference (fp32 and bf16).";
  const py::object ops = py::module_::import("torch").attr("ops").attr("kernels");
  for (const std::string& name : exported_ops()) m.attr(name.c_str()) = ops.attr(name.c_str());
  m.def("check_errors", &check_errors,
        "wait for the current CUDA stream, then raise ValueError if an earlier embedding, cross_entropy, "
        "expert_gemv, kv_write or decode_megakernel call met an index out of range (naming the op, the argument, the first bad "
        "value and the valid range) and clear it. Every op does the same check at entry without waiting, so a bad "
        "index "
        "surfaces at the next call anyway; this is for when that must be now (a log point, the end of a run, "
        "after replaying a CUDA graph). While the stream is captured it does not wait",
        py::call_guard<py::gil_scoped_release>());
  m.def("set_pdl", &launch::set_pdl,
        "on (the default): the GEMV, norm forward, softmax, cross-entropy, elementwise (GELU, SiLU, SwiGLU), "
        "embedding forward, kv_write and attention-forward kernels are launched with programmatic dependent launch "
        "(a compute capability 9.0 GPU running the sm_90a build): each may start while the kernel before it runs "
        "and waits inside for it. off: ordinary launches, to measure the difference. Process-wide, for launches "
        "from then on (a captured CUDA graph keeps how it was captured)",
        py::arg("on"));
  m.def("set_attention_wgmma", &launch::set_attention_wgmma,
        "on (the default): bf16 fused attention at head size 64 multiplies with wgmma (a compute capability 9.0 "
        "GPU running the sm_90a build); off: with mma.sync, as on other GPUs and head sizes, to compare the two. "
        "Process-wide, for launches from then on",
        py::arg("on"));
  m.def("decode_megakernel_workspace_floats", &decode_megakernel_workspace,
        "floats of float32 workspace decode_megakernel needs for a model n_embd wide with n_head heads whose "
        "tokens each take top_k experts (0: dense, as the op's top_k), on the current GPU; zero it once and pass "
        "the same tensor to every step",
        py::arg("n_embd"), py::arg("n_head"), py::arg("top_k") = 0);
  m.def("decode_megakernel_trace_shape", [](int64_t n_layer) {
          return py::make_tuple(launch::decode_megakernel_grid(), launch::decode_megakernel_trace_stamps((int)n_layer));
        },
        "the shape of decode_megakernel's trace on the current GPU, (blocks, stamps): one block an SM; a block's "
        "clock at its start, after each of the 5 steps of a layer (its work done, the next step's inputs arrived), "
        "and at its end",
        py::arg("n_layer"));
  m.def("decode_megakernel_why_not", &decode_megakernel_why_not,
        "None if decode_megakernel runs a gpt or llama model of this shape on the current GPU, with weights of "
        "element_size bytes (4: float32, 2: bfloat16), an mlp `hidden` wide (0: gpt's 4 n_embd), n_expert experts "
        "(0: dense) of which a token takes top_k, else the reason",
        py::arg("n_embd"), py::arg("n_head"), py::arg("n_kv_head"), py::arg("n_layer"), py::arg("element_size"),
        py::arg("hidden") = 0, py::arg("n_expert") = 0, py::arg("top_k") = 0);
  // kernels.cu's limits (part 0, namespace limits), for the scripts' checks and messages
  py::dict limits_dict;
  limits_dict["max_streams"] = limits::max_streams;
  limits_dict["topk_max_k"] = limits::topk_max_k;
  limits_dict["fused_head_sizes"] = py::tuple(py::cast(fused_head_sizes()));
  limits_dict["hopper_head_sizes"] = py::tuple(py::cast(as_vector(limits::hopper_head_sizes{})));
  limits_dict["megakernel_max_layers"] = limits::megakernel_max_layers;
  limits_dict["megakernel_max_head_size"] = limits::megakernel_max_head_size;
  limits_dict["megakernel_max_experts"] = limits::megakernel_max_experts;
  limits_dict["megakernel_max_top_k"] = limits::megakernel_max_top_k;
  limits_dict["megakernel_layer_weights"] =
      py::tuple(py::cast(std::vector<std::string>(kMkSlotNames, kMkSlotNames + MK_WEIGHTS)));
  m.attr("LIMITS") = limits_dict;
}
