// kernels.cu: every CUDA kernel of the repo and its host launcher, in layers read top to bottom: the
// launchers' declarations (part 0), the primitives every kernel is built from (1), then the ops from
// the simplest to the hardest (2-9). Tensors are fp32 or bf16 (bf16 values, fp32 arithmetic: widened
// on load, rounded once on store). fp32 products run on the tensor cores in 3xTF32, which keeps
// fp32-level accuracy; bf16 ones in bf16 with fp32 accumulation.
//
// Launchers take raw device pointers, sizes and a cudaStream_t, own the grid arithmetic and throw
// std::runtime_error if a launch fails. No PyTorch header is included: `nvcc -c kernels.cu` compiles
// this file on its own. bindings.cpp is the PyTorch face (checks, allocation, autograd).
//
// Contents: section, the line it starts on (`python test_ops.py --toc` renumbers; a test checks it).
//   0    The launchers: limits, shared structs, declarations ................................... 60
//   1    Primitives ........................................................................... 287
//   1.1  launch helpers: grids, per-device queries, programmatic dependent launch, tensor maps ... 295
//   1.2  values: fp32 and bf16, warp and row reductions, 16-byte loads and stores, fast exp2 ... 467
//   1.3  row launches: a row per warp or per block, shaped by the row's length ................ 573
//   1.4  index errors: the mailbox ............................................................ 659
//   1.5  async copies (sm_80): cp.async from global to shared memory .......................... 767
//   1.6  tensor cores (sm_80): mma.sync, ldmatrix ............................................. 797
//   1.7  Hopper (sm_90a): mbarriers, bulk and tensor-map copies, wgmma, named barriers ........ 895
//   1.8  random numbers: Philox4x32-10, dropout's draws ...................................... 1203
//   2    Elementwise ......................................................................... 1288
//   2.1  activations: GELU, SiLU ............................................................. 1293
//   2.2  SwiGLU .............................................................................. 1448
//   2.3  RoPE ................................................................................ 1484
//   2.4  dropout ............................................................................. 1554
//   3    Rows ................................................................................ 1675
//   3.1  softmax ............................................................................. 1680
//   3.2  layernorm and RMSNorm ............................................................... 1816
//   3.3  column sums: the norms' weight and bias gradients ................................... 2124
//   4    Embedding and cross-entropy ......................................................... 2359
//   4.1  embedding ........................................................................... 2364
//   4.2  cross-entropy ....................................................................... 2587
//   5    Decoding: GEMV, KV cache, top-k ..................................................... 2723
//   5.1  GEMV ................................................................................ 2728
//   5.2  KV cache write ...................................................................... 2846
//   5.3  top-k ............................................................................... 2915
//   6    Matmul .............................................................................. 3208
//   6.1  matmul on mma.sync (any GPU from sm_80) ............................................. 3213
//   6.2  fp32 matmul on Hopper: pack, then wgmma ............................................. 3435
//   6.3  bf16 matmul on Hopper: tensor-map copies, then wgmma ................................ 3603
//   7    Attention ........................................................................... 4271
//   7.1  attention: shapes, operand policies, tiles .......................................... 4277
//   7.2  fused forward (mma.sync): online softmax over key tiles, the splits' merge .......... 4788
//   7.3  fused backward (mma.sync): delta, dK and dV per key block, dQ per query block ....... 5007
//   7.4  fused launch: the operand policy and head size of a call, splits .................... 5215
//   7.5  Hopper forward (bf16, sm_90a): TMA, warp specialization, wgmma ...................... 5312
//   7.6  Hopper backward (bf16, sm_90a) ...................................................... 5587
//   7.7  attention launchers ................................................................. 6078
//   8    Hyper-connections (mhc.py) .......................................................... 6328
//   8.1  stream loads and per-lane sums ...................................................... 6334
//   8.2  Sinkhorn-Knopp ...................................................................... 6433
//   8.3  mhc-dynamic's coefficients .......................................................... 6693
//   8.4  mhc-dynamic's projection ............................................................ 7027
//   8.5  stream mixing ....................................................................... 7518
//   9    The decode megakernel ............................................................... 7922
//   9.1  decode megakernel ................................................................... 7927

// ================================================================================================
// 0. The launchers: limits, shared structs, declarations
// What bindings.cpp calls, and all it sees of this file: it includes kernels.cu with
// KERNELS_LAUNCHERS_ONLY defined, which stops at the end of this part.
// ================================================================================================

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

// What the launchers accept, stated once: the kernels size their arrays and templates by these,
// bindings.cpp checks inputs against them and exports them to Python as kernels.LIMITS.
namespace limits {
constexpr int max_streams = 8;                // hyper-connection streams n (Sinkhorn, mHC coefficients, mixing)
constexpr int topk_max_k = 128;               // k of top-k
using fused_head_sizes = std::integer_sequence<int, 32, 64, 96, 128>;  // head sizes of fused attention
using hopper_head_sizes = std::integer_sequence<int, 64, 128>;         // of those, the wgmma (Hopper) kernels'
constexpr int megakernel_max_layers = 64;     // layers decode_megakernel's argument holds
constexpr int megakernel_max_head_size = 128;  // at most 4 values a lane
constexpr int megakernel_max_experts = 64;    // experts of a mixture
constexpr int megakernel_max_top_k = 2;       // experts a token takes
// A layer's weight slots in decode_megakernel, in order (named as a Block's parameters); a model fills
// those it has (gpt: no up_w, llama: no biases, a dense model: no router_w).
constexpr const char* megakernel_layer_weights[] = {
    "ln_1_w", "ln_1_b", "attn_w", "attn_b", "attn_proj_w", "attn_proj_b", "ln_2_w",
    "ln_2_b", "mlp.fc_w", "mlp.fc_b", "mlp.up_w", "mlp.proj_w", "mlp.proj_b", "mlp.router_w"};
constexpr int megakernel_layer_slots = sizeof(megakernel_layer_weights) / sizeof(megakernel_layer_weights[0]);
// The slot of a weight named as in megakernel_layer_weights, at compile time where the name is (-1: none).
constexpr int megakernel_slot(const char* name) {
  for (int i = 0; i < megakernel_layer_slots; ++i) {
    const char *a = megakernel_layer_weights[i], *b = name;
    while (*a && *a == *b) ++a, ++b;
    if (*a == *b) return i;
  }
  return -1;
}
}  // namespace limits

// Where an attention tensor (B, H, S, D) keeps its values: (b, h, s, d) at b * sb + h * sh + s * ss + d
// (D contiguous). q, k and v are often views of one (B, S, 3C) projection, and out is written as
// (B, S, H, D) memory, so that the heads side by side again (the next projection's input) need no copy.
struct AttnLayout {
  int64_t sb, sh, ss;
  int heads;
};
struct AttnLayouts {
  AttnLayout q, k, v, out, dout, dq, dk, dv;
};

// Dropout of one call (2.4, and attention's probabilities in 7): a kept value is multiplied by scale,
// a dropped one by 0. rng points at the device's int64 {seed, offset} (read when the kernel runs, so a
// CUDA graph replays fresh masks once the caller advances offset); salt tells a step's call sites apart.
// An element is kept where its 16-bit draw (1.8) is >= threshold = round(p * 65536).
struct DropoutArgs {
  const int64_t* rng;  // nullptr: no dropout
  uint32_t salt, threshold;
  float scale;  // 1 / (1 - p); 0 at p = 1
};

// The launchers, section by section. Templates on the element type are built for float and
// __nv_bfloat16 (the row ops for the pairs TI -> TO of FOR_ROW_TYPES). Each is defined below as
// launch::name: a definition unlike its declaration here fails to compile (for a template, through the
// ONE_TEMPLATE check after its instantiation).
namespace launch {
// 1. primitives
void set_pdl(bool on);  // programmatic dependent launch on (default) or off, for launches from now on
bool take_index_error(const char** op, const char** arg, int64_t* value, int64_t* limit);  // and clear it
// 2. elementwise
template <class T> void gelu_fwd(const T* x, T* y, int64_t n, bool tanh_approx, cudaStream_t s);
template <class T> void gelu_bwd(const T* x, const T* dy, T* dx, int64_t n, bool tanh_approx, cudaStream_t s);
template <class T> void silu_fwd(const T* x, T* y, int64_t n, cudaStream_t s);
template <class T> void silu_bwd(const T* x, const T* dy, T* dx, int64_t n, cudaStream_t s);
template <class T> void swiglu_fwd(const T* a, const T* b, T* y, int64_t n, cudaStream_t s);
template <class T> void swiglu_bwd(const T* a, const T* b, const T* dy, T* da, T* db, int64_t n, cudaStream_t s);
template <class T>
void rope(const T* x, const float* cos, const float* sin, T* out, int B, int H, int T_, int D, int64_t sb,
          int64_t sh, int64_t st, bool backward, cudaStream_t s);
// x viewed as (rows, cols), contiguous; also the backward (the same mask applied to dy)
template <class T> void dropout(const T* x, T* y, int64_t rows, int64_t cols, const DropoutArgs& d, cudaStream_t s);
// 3. rows
template <class TI, class TO>
void softmax_fwd(const TI* x, TO* y, int R, int C, float scale, int sq, int offset, cudaStream_t s);
template <class TI, class TO>
void softmax_bwd(const TO* y, const TO* dy, TI* dx, int R, int C, float scale, cudaStream_t s);
template <class TI, class TO>
void layernorm_fwd(const TI* x, const TO* addend, const TI* w, const TI* b, TO* y, TI* sum, float* mean, float* rstd,
                   int R, int C, float eps, cudaStream_t s);
template <class TI, class TO>
void rmsnorm_fwd(const TI* x, const TO* addend, const TI* w, TO* y, TI* sum, float* rstd, int R, int C, float eps,
                 cudaStream_t s);
template <class TI, class TO>
void layernorm_bwd(const TI* x, const TI* w, const TO* dy, const float* mean, const float* rstd, const TI* dsum, TI* dx,
                   TO* daddend, TI* dw, TI* db, float* ws, int R, int C, cudaStream_t s);
template <class TI, class TO>
void rmsnorm_bwd(const TI* x, const TI* w, const TO* dy, const float* rstd, const TI* dsum, TI* dx, TO* daddend,
                 TI* dw, float* ws, int R, int C, cudaStream_t s);
template <class TI, class TO> int64_t norm_bwd_workspace_floats(bool rms, int R, int C);
int colsum_chunks(int R, int C);
template <class TG, class TD> void bias_grad(const TG* dy, float* part, TD* db, int R, int C, cudaStream_t s);
// 4. embedding and cross-entropy
template <class T>
void embedding_fwd(const int64_t* idx, const T* weight, T* out, int64_t T_, int64_t V, int C, cudaStream_t s);
size_t embedding_bwd_workspace_bytes(int T, int64_t V, int C);
void embedding_bwd(const int64_t* idx, const float* dout, float* dweight, int T, int64_t V, int C, int64_t padding_idx,
                   void* workspace, cudaStream_t s);
template <class T>
void cross_entropy_fwd(const T* x, const int64_t* tgt, int64_t ignore_index, float* lse, float* loss_rows, float* loss,
                       float* kept, int R, int C, cudaStream_t s);
template <class T>
void cross_entropy_bwd(const T* x, const int64_t* tgt, int64_t ignore_index, const float* lse, const float* kept,
                       const float* dloss, T* dx, int R, int C, cudaStream_t s);
// 5. decoding: GEMV, KV cache, top-k
template <class T>
void gemv(const T* W, const T* x, const T* bias, T* y, int N, int K, int S, const int64_t* experts, int64_t E,
          cudaStream_t s);
template <class T>
void kv_write(T* k_cache, T* v_cache, const T* k, const T* v, const int64_t* k_strides, const int64_t* v_strides,
              const int64_t* positions, int B, int H, int T_, int S, int D, cudaStream_t s);
size_t topk_workspace_bytes(int64_t rows, int L, int k);
void topk(const float* x, float* values, int64_t* indices, int64_t rows, int L, int k, void* workspace,
          cudaStream_t s);
// 6. matmul
size_t matmul_workspace_floats(int batch, int M, int N, int K);
void matmul(const float* a, const float* b, const float* bias, float* c, int batch, int M, int N, int K, bool ta,
            bool tb, int64_t lda, int64_t ldb, int64_t ldc, int64_t sa, int64_t sb, int64_t sc, float alpha,
            float* workspace, cudaStream_t s);
bool matmul_bf16_operand_ok(const void* x, int64_t ld, int64_t bs);
size_t matmul_bf16_workspace_floats(int batch, int M, int N, int K, bool a_rowsum);
void matmul_bf16(const __nv_bfloat16* a, const __nv_bfloat16* b, const __nv_bfloat16* bias, void* c, bool c_f32,
                 int batch, int M, int N, int K, bool ta, bool tb, int64_t lda, int64_t ldb, int64_t ldc, int64_t sa,
                 int64_t sb, int64_t sc, float alpha, float* a_rowsum, float* workspace, cudaStream_t s);
// 7. attention
bool attention_fused_supports(int D);
void set_attention_wgmma(bool on);  // bf16 at D 64 on wgmma (default) or on mma.sync, for launches from now on
int64_t attention_fwd_workspace_floats(int BH, int group, int Sq, int Sk, int D);
int64_t attention_bwd_dq_sum_floats(int BH, int Sq, int D);
void attention_fwd_fused(const float* q, const float* k, const float* v, float* out, float* lse_log2,
                         const AttnLayouts& l, int BH, int group, int Sq, int Sk, int D, bool causal, float scale,
                         bool precise, const int64_t* kv_len, const DropoutArgs& drop, float* workspace,
                         cudaStream_t s);
void attention_fwd_fused(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                         __nv_bfloat16* out, float* lse_log2, const AttnLayouts& l, int BH, int group, int Sq, int Sk,
                         int D, bool causal, float scale, const int64_t* kv_len, const DropoutArgs& drop,
                         float* workspace, cudaStream_t s);
void attention_bwd_fused(const float* q, const float* k, const float* v, const float* out, const float* dout,
                         const float* lse_log2, float* delta, float* dq, float* dk, float* dv, const AttnLayouts& l,
                         int BH, int group, int Sq, int Sk, int D, bool causal, float scale, bool precise,
                         const DropoutArgs& drop, cudaStream_t s);
void attention_bwd_fused(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                         const __nv_bfloat16* out, const __nv_bfloat16* dout, const float* lse_log2, float* delta,
                         __nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv, const AttnLayouts& l, int BH,
                         int group, int Sq, int Sk, int D, bool causal, float scale, const DropoutArgs& drop,
                         float* dq_sum, cudaStream_t s);
// 8. hyper-connections (mhc.py)
int64_t sinkhorn_workspace_floats(int M, int n, int iters);
void sinkhorn_fwd(const float* logits, float* out, int M, int n, int iters, cudaStream_t s);
void sinkhorn_bwd(const float* logits, const float* dout, float* dlogits, float* ws, int M, int n, int iters,
                  cudaStream_t s);
int64_t hc_coeffs_workspace_floats(int M, int n, int iters);
void hc_coeffs_fwd(const float* h, const float* alpha, const float* bias, float* pre, float* post, float* res, int M,
                   int n, int iters, cudaStream_t s);
void hc_coeffs_bwd(const float* h, const float* alpha, const float* bias, const float* dpre, const float* dpost,
                   const float* dres, float* dh, float* dalpha, float* dbias, float* ws, int M, int n, int iters,
                   cudaStream_t s);
void hc_pre_coeffs_fwd(const float* x, int C, const float* h, const float* alpha, const float* bias, float* pre,
                       float* post, float* res, float* merged, int M, int n, int iters, cudaStream_t s);
void hc_pre_coeffs_bwd(const float* x, const float* dmerged, int C, const float* h, const float* alpha,
                       const float* bias, const float* dpost, const float* dres, float* dh, float* dalpha,
                       float* dbias, float* ws, int M, int n, int iters, cudaStream_t s);
int64_t hc_project_fwd_workspace_floats(int M, int n, int D);
int64_t hc_mix_project_fwd_workspace_floats(int M, int n, int C);
int64_t hc_project_bwd_workspace_floats(int M, int n, int D);
void hc_project_fwd(const float* x, const float* w, const float* phi, float* h, float* rstd, float* ws, int M, int n,
                    int D, float eps, cudaStream_t s);
template <class TY>
void hc_mix_project_fwd(const float* x, const float* h_res, const float* h_post, const TY* y, float* out,
                        const float* w, const float* phi, float* h, float* rstd, float* ws, int M, int n, int C,
                        bool per_token, float eps, cudaStream_t s);
void hc_project_bwd(const float* x, const float* w, const float* phi, const float* h, const float* rstd,
                    const float* dh, const float* pre, const float* dmerged, const float* dadd, float* dx, float* dw,
                    float* dphi, float* ws, int M, int n, int D, cudaStream_t s);
int stream_coef_rows(int M);
void stream_merge_fwd(const float* x, const float* h, float* out, int M, int n, int C, bool per_token,
                      cudaStream_t s);
void stream_merge_bwd(const float* x, const float* h, const float* dout, float* dx, float* dh, float* part, int M,
                      int n, int C, bool per_token, cudaStream_t s);
template <class TY>
void stream_mix_fwd(const float* x, const float* h_res, const float* h_post, const TY* y, const float* h_pre,
                    float* out, float* merged, int M, int n, int C, bool per_token, cudaStream_t s);
template <class TY>
void stream_mix_bwd(const float* x, const float* h_res, const float* h_post, const TY* y, const float* h_pre,
                    const float* dout, const float* dmerged, float* dx, TY* dy, float* dh_res, float* dh_post,
                    float* dh_pre, float* part, int M, int n, int C, bool per_token, cudaStream_t s);
// 9. decode megakernel
template <class T>
void decode_megakernel(const T* const* layers, int per_layer, const T* wte, const T* wpe, const T* lnf_w, const T* lnf_b,
                       const float* rope_cos, const float* rope_sin, T* k_cache, T* v_cache, const int64_t* tok,
                       int64_t* pos, T* logits, float* ws, uint64_t* trace, int n_layer, int C, int n_head,
                       int n_kv_head, int hidden, int n_expert, int top_k, int V, int capacity, float eps,
                       cudaStream_t s);
int64_t decode_megakernel_workspace_floats(int C, int n_head, int hs, int top_k);
// Why decode_megakernel cannot run a model of this shape on the current GPU, or "" where it can: width C,
// n_layer layers, n_head heads over n_kv_head, an mlp `hidden` wide, n_expert experts (0: dense) of
// which a token takes top_k, weights of elem_bytes.
std::string decode_megakernel_unsupported(int C, int n_layer, int n_head, int n_kv_head, int hidden, int n_expert,
                                          int top_k, int elem_bytes);
int decode_megakernel_grid();
int decode_megakernel_trace_stamps(int n_layer);
}  // namespace launch

#ifndef KERNELS_LAUNCHERS_ONLY

#include <cuda.h>          // CUtensorMap and its encoder's types (the function itself comes from the driver)
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#include <cub/device/device_radix_sort.cuh>  // CUB ships with the CUDA toolkit (header-only)
#include <atomic>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <type_traits>

// ================================================================================================
// 1. Primitives
// What every kernel below is built from, each with its contract: launches, value conversions and
// reductions, row launches, the index-error mailbox, async copies, the tensor-core instructions of
// sm_80 (mma.sync, ldmatrix) and of sm_90a (mbarriers, TMA, wgmma, named barriers). Read 1.1-1.3
// to know how any kernel here is launched; the rest where a section's 'Uses' names it.
// ================================================================================================

// ------------------------------------------------------------------------------------------------
// 1.1 launch helpers: grids, per-device queries, programmatic dependent launch, tensor maps

static void check_launch(const char* what) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": CUDA launch failed: " + cudaGetErrorString(err));
}

static int ceil_div(int64_t a, int64_t b) { return (int)((a + b - 1) / b); }

// A grid.x of `blocks`, or an error naming `what`: grid.x takes up to 2^31 - 1 blocks (grid.y and z only
// 65535, which is why long dimensions go on x).
static unsigned grid_x(int64_t blocks, const char* what) {
  if (blocks > INT_MAX)
    throw std::invalid_argument(std::string(what) + ": " + std::to_string(blocks) +
                                " blocks exceed the grid's limit of 2^31 - 1");
  return (unsigned)blocks;
}

static bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

constexpr int kMaxDevices = 64;

// ask(device) once per device, its answer (a positive int) kept: attribute and occupancy queries and
// attribute settings are driver calls that cost host time on every launch, and their answers never
// change. Each call site's lambda is a type of its own, so each has its own cache (per kernel, where
// the call site is in a kernel's template); what a lambda captures must therefore be the same on
// every call (a kernel's shared memory or block size). Devices past kMaxDevices are asked every time.
template <class Ask>
static int once_per_device(Ask ask) {
  static std::atomic<int> cached[kMaxDevices];  // 0: not asked yet
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 0 || dev >= kMaxDevices) return ask(dev);
  int v = cached[dev].load();
  if (v == 0) {
    v = ask(dev);  // two threads may both ask: the same answer, stored twice
    cached[dev].store(v);
  }
  return v;
}

static int num_sms() {
  return once_per_device([](int dev) {
    int n = 0;
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    return n > 0 ? n : 1;
  });
}

// Raises kernel's dynamic shared-memory limit to smem (the same for every launch of it), once per
// device: the attribute stays set.
template <auto kernel>
static void raise_smem_limit(size_t smem) {
  once_per_device([smem](int) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    return 1;
  });
}

// Programmatic dependent launch (compute capability 9.0). A decode step is a chain of small kernels, each
// reading what the one before wrote; even inside a CUDA graph, every link costs the next kernel's launch and
// ramp-up, which at decode sizes is as long as the kernel's own work. A kernel launched through launch_pdl
// may be launched while the kernel before it in the stream still runs: its blocks get resident and wait in
// pdl_wait_upstream() until the kernel before has finished and its writes are visible.
// pdl_launch_downstream() at a kernel's start lets the next such kernel launch as soon as every block of this
// one is running. The rule that keeps stream order for every kernel after: every thread of a launch_pdl
// kernel passes pdl_wait_upstream() before it loads or stores global memory or returns. Both calls compile to
// nothing before sm_90, and the wait returns at once in a kernel launched the ordinary way.
__device__ __forceinline__ void pdl_wait_upstream() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaGridDependencySynchronize();
#endif
}
__device__ __forceinline__ void pdl_launch_downstream() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaTriggerProgrammaticLaunchCompletion();
#endif
}

// The start of a launch_pdl kernel with nothing to read before the wait.
__device__ __forceinline__ void pdl_begin() {
  pdl_launch_downstream();
  pdl_wait_upstream();
}

static std::atomic<bool> pdl_enabled{true};  // set_pdl: off to measure what the early launches save
void launch::set_pdl(bool on) { pdl_enabled.store(on); }

#if defined(KERNELS_SM90A)
static bool hopper_wgmma() {  // compute capability 9.0, and this build has sm_90a code for it
  return once_per_device([](int dev) {
           int major = 0, minor = 0;
           cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
           cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
           return major == 9 && minor == 0 ? 1 : 2;
         }) == 1;
}
#else
static bool hopper_wgmma() { return false; }
#endif

// After each explicit instantiation of a launcher template: it is the one template of that name, the one
// part 0 declares. (A definition whose parameters differ would be a second template, which the compiler
// accepts; taking the instance's address then has two candidates and fails to compile.)
#define ONE_TEMPLATE(...) static_assert(sizeof(decltype(&launch::__VA_ARGS__)) > 0, #__VA_ARGS__)

// f(std::integral_constant<int, D>{}) for the head size D among SIZES (limits::fused_head_sizes{},
// limits::hopper_head_sizes{}): the one place a run-time head size becomes a kernel instance. false: D
// is none of them, and f was not called.
template <int... SIZES, class F>
static bool with_head_size(std::integer_sequence<int, SIZES...>, int D, F&& f) {
  return ((D == SIZES && (f(std::integral_constant<int, SIZES>{}), true)) || ...);
}
template <class Sizes>
static bool is_head_size(Sizes sizes, int D) { return with_head_size(sizes, D, [](auto) {}); }

// f(std::true_type{}) or f(std::false_type{}): a run-time flag as a template argument.
template <class F>
static void with_flag(bool on, F&& f) {
  if (on) f(std::true_type{});
  else f(std::false_type{});
}

// kernel<<<grid, block, smem, s>>>(args...), allowed to launch before the kernel ahead of it ends.
template <class... Params, class... Args>
static void launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t s,
                       Args&&... args) {
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cfg.attrs = &attr;
  // Only where this build's sm_90a code runs (a conservative choice: the waits are in any sm_90 code,
  // none in code built for older targets).
  cfg.numAttrs = pdl_enabled.load() && hopper_wgmma() ? 1 : 0;
  cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);  // a failure is left for check_launch
}

static int compute_major() {  // the current GPU's compute capability, major part
  return once_per_device([](int dev) {
    int major = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    return major;
  });
}

static void require_tensor_cores(const char* what) {
  if (compute_major() < 8)
    throw std::runtime_error(std::string(what) + ": needs a GPU of compute capability 8.0 or newer (tensor-core TF32)");
}

// The driver's tensor-map encoder, looked up once (the runtime API has no wrapper for it).
static PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = []() -> PFN_cuTensorMapEncodeTiled_v12000 {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      return nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  if (!fn) throw std::runtime_error("matmul: the CUDA driver has no cuTensorMapEncodeTiled (bfloat16 needs CUDA 12+)");
  return fn;
}

// ------------------------------------------------------------------------------------------------
// 1.2 values: fp32 and bf16, warp and row reductions, 16-byte loads and stores, fast exp2

// bf16 tensors are read and written through these; the arithmetic is fp32.
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <class T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Reduce one value per thread over a row handled by TX threads (threadIdx.x). TX == 32 is one
// warp per row (rows stacked in threadIdx.y, no barrier); TX > 32 is one row per block and goes
// through shared memory. Every thread gets the result; the fixed order keeps it deterministic.
template <int TX, bool IS_MAX>
__device__ __forceinline__ float row_reduce(float v, float* red) {
  v = IS_MAX ? warp_max(v) : warp_sum(v);
  if (TX == 32) return v;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // the previous reduction's reads of red[] are done
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float r = red[0];
#pragma unroll
  for (int i = 1; i < TX / 32; ++i) r = IS_MAX ? fmaxf(r, red[i]) : r + red[i];
  return r;
}

// 16 bytes of T as floats, and back: 4 fp32 or 8 bf16 values (bf16 rounds to nearest even).
template <class T>
__host__ __device__ constexpr int per16() { return 16 / (int)sizeof(T); }
__device__ __forceinline__ void unpack16(const float4& raw, float (&v)[4]) { v[0] = raw.x; v[1] = raw.y; v[2] = raw.z; v[3] = raw.w; }
__device__ __forceinline__ void unpack16(const float4& raw, float (&v)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ float4 pack16(const float (&v)[4]) { return make_float4(v[0], v[1], v[2], v[3]); }
__device__ __forceinline__ float4 pack16(const float (&v)[8]) {
  float4 raw;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
  return raw;
}

// Four values of T at p (16 bytes of fp32, 8 of bf16) as floats, and back.
__device__ __forceinline__ void load4(const float* p, float (&v)[4]) { unpack16(*reinterpret_cast<const float4*>(p), v); }
__device__ __forceinline__ void load4(const __nv_bfloat16* p, float (&v)[4]) {
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
  v[0] = a.x; v[1] = a.y; v[2] = b.x; v[3] = b.y;
}
__device__ __forceinline__ void store4(float* p, const float (&v)[4]) { *reinterpret_cast<float4*>(p) = pack16(v); }
__device__ __forceinline__ void store4(__nv_bfloat16* p, const float (&v)[4]) {
  uint2 raw;
  *reinterpret_cast<__nv_bfloat162*>(&raw.x) = __floats2bfloat162_rn(v[0], v[1]);
  *reinterpret_cast<__nv_bfloat162*>(&raw.y) = __floats2bfloat162_rn(v[2], v[3]);
  *reinterpret_cast<uint2*>(p) = raw;
}

// A 16-byte read-only load that asks L2 to fetch the whole 256-byte block around it: a streaming
// kernel then reads DRAM in longer bursts.
__device__ __forceinline__ float4 load_stream4(const void* p) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  float4 v;
  asm volatile("ld.global.nc.L2::256B.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
  return v;
#else
  return *reinterpret_cast<const float4*>(p);
#endif
}

// Two adjacent outputs of a row (a C fragment's pair) to global memory.
__device__ __forceinline__ void store2(float* p, float a, float b) { *reinterpret_cast<float2*>(p) = make_float2(a, b); }
__device__ __forceinline__ void store2(__nv_bfloat16* p, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}

// 2^x on the special-function unit: ex2.approx.ftz (relative error ~2^-22, the instruction exp2f
// wraps in a fix-up for results below 2^-126, which flush to 0 here). Attention's online softmax and
// Sinkhorn sum terms of at most 1 (the max subtracted) into a sum of at least 1, so one that small is 0 at fp32's resolution.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ------------------------------------------------------------------------------------------------
// 1.3 row launches: a row per warp or per block, shaped by the row's length

// A row is read in "units" of VEC values (VEC = 4 when the row length is a multiple of 4 and the
// pointers are 16-byte aligned, else 1). Unit u of a row belongs to thread u % TX. Rows of T = fp32
// or bf16 are read and written as fp32: the arithmetic is fp32 either way.
template <int VEC, class T>
__device__ __forceinline__ void load_unit(const T* row, int u, int C, float (&v)[VEC], float fill) {
  if (VEC == 4) {
    if (u * 4 < C) {
      load4(row + 4 * u, reinterpret_cast<float(&)[4]>(v));
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[i] = fill;
    }
  } else {
    v[0] = u < C ? to_float(row[u]) : fill;
  }
}

template <int VEC, class T>
__device__ __forceinline__ void store_unit(T* row, int u, int C, const float (&v)[VEC]) {
  if (VEC == 4) {
    if (u * 4 < C) store4(row + 4 * u, reinterpret_cast<const float(&)[4]>(v));
  } else if (u < C) {
    row[u] = from_float<T>(v[0]);
  }
}

// Row kernels cache N units per thread in registers (N * TX * VEC columns, at most 16 floats per thread at
// 1024 threads); wider rows re-read the rest from global memory in a tail loop. The launch shape follows the
// row length: up to 256 units one warp per row (4 rows per block), up to 2048 units 256 threads per row,
// beyond that 1024 threads per row.
struct RowLaunch {
  int tx, ty, n, vec;
};

static RowLaunch row_launch(int C, bool vec_ok) {
  RowLaunch L;
  L.vec = (vec_ok && C % 4 == 0) ? 4 : 1;
  int units = ceil_div(C, L.vec);
  if (units <= 256) { L.tx = 32; L.ty = 4; }
  else if (units <= 2048) { L.tx = 256; L.ty = 1; }
  else { L.tx = 1024; L.ty = 1; }
  int per = ceil_div(units, L.tx);
  L.n = per <= 1 ? 1 : per <= 2 ? 2 : per <= 4 ? 4 : 8;
  if (L.tx * L.vec > 2048) L.n = std::min(L.n, 4);  // 1024 threads get 64 registers each
  return L;
}

// Calls f(tx, n, vec) with a RowLaunch's shape as std::integral_constant values, so that f can name
// the kernel instance: LAUNCH_ROW launches it; the norm backward asks its occupancy first.
template <class F>
static void with_row_shape(const RowLaunch& L, F&& f) {
  auto with_n = [&](auto tx, auto vec) {
    constexpr int TX = decltype(tx)::value, VEC = decltype(vec)::value;
    switch (L.n) {
      case 1: f(tx, std::integral_constant<int, 1>(), vec); break;
      case 2: f(tx, std::integral_constant<int, 2>(), vec); break;
      case 4: f(tx, std::integral_constant<int, 4>(), vec); break;
      default: f(tx, std::integral_constant<int, (TX * VEC > 2048 ? 4 : 8)>(), vec);
    }
  };
  auto with_vec = [&](auto tx) {
    if (L.vec == 4) with_n(tx, std::integral_constant<int, 4>());
    else with_n(tx, std::integral_constant<int, 1>());
  };
  if (L.tx == 32) with_vec(std::integral_constant<int, 32>());
  else if (L.tx == 256) with_vec(std::integral_constant<int, 256>());
  else with_vec(std::integral_constant<int, 1024>());
}

// Instantiates KERNEL<TX, N, VEC, TYPES...> for the chosen RowLaunch and launches it with ARGS, a block
// of L.tx x L.ty threads for every L.ty rows, through launch_pdl: every kernel launched here starts
// with pdl_begin(). TYPES is a parenthesized list of the element types, e.g. (float, __nv_bfloat16).
#define ROW_TYPES(...) __VA_ARGS__
#define LAUNCH_ROW(KERNEL, TYPES, L, rows, stream, ...)                                                   \
  with_row_shape(L, [&](auto tx_, auto n_, auto vec_) {                                                   \
    launch_pdl(KERNEL<decltype(tx_)::value, decltype(n_)::value, decltype(vec_)::value, ROW_TYPES TYPES>, \
               dim3(ceil_div(rows, L.ty)), dim3(L.tx, L.ty), 0, stream, __VA_ARGS__);                     \
  })

// The element-type pairs (TI, TO) the row ops are built for: fp32, bf16, and the mixed pairs of
// mixed-precision training (fp32 residual stream in, bf16 out) and back.
#define FOR_ROW_TYPES(M) M(float, float) M(float, __nv_bfloat16) M(__nv_bfloat16, __nv_bfloat16) M(__nv_bfloat16, float)

// ------------------------------------------------------------------------------------------------
// 1.4 index errors: the mailbox
// embedding (idx), cross_entropy (targets), expert_gemv (experts), kv_write (positions) and decode_megakernel
// (tok, pos) take indices that live on the device. Checking them on the host would copy them back and stall
// the stream on every call, and cannot run at all inside a CUDA graph. So the kernels check them where they
// read them: a bad index gives NaN where its row would go (kv_write, whose index says where a row goes,
// writes nothing), never a silent value or an out-of-bounds access, and the first bad index is recorded in a
// mailbox in pinned, host-mapped memory. bindings.cpp reads the mailbox at the entry of every op, a plain
// host read with no sync, and raises the error there; check_errors() syncs first. A write to mapped memory is
// an ordinary store, so it works inside a captured graph.
//
// First error wins: the mailbox is claimed with an atomicCAS on a counter in device memory (atomics
// on host memory over PCIe are not guaranteed), from the value the host last armed it with. The host
// re-arms it (armed = claims) when it takes the error, so no device memory needs resetting from the
// host (a stream-ordered reset would end up inside a graph being captured). An error that comes while
// the host is taking the previous one may be dropped; its NaN stays.

enum IndexErrorWhat {
  kBadEmbeddingIdx = 1, kBadCrossEntropyTarget, kBadExpert, kBadCachePosition, kBadDecodeToken, kBadDecodePosition
};
constexpr const char* kIndexErrorOp[] = {"",         "embedding",         "cross_entropy",
                                         "expert_gemv", "kv_write",       "decode_megakernel", "decode_megakernel"};
constexpr const char* kIndexErrorArg[] = {"", "idx", "targets", "experts", "positions", "tok", "pos"};

struct IndexErrorBox {  // one per device, in pinned host memory mapped into the device's address space
  int full;             // set by the device after the fields below, cleared by the host
  int what;             // an IndexErrorWhat
  long long value, limit;
  unsigned armed;       // the claim count at which the next error may write here
};

__device__ unsigned index_error_claims;  // one per device: each device holds its own copy of this module
static std::atomic<IndexErrorBox*> g_error_boxes{nullptr};  // host view, kMaxDevices boxes
static std::atomic<IndexErrorBox*> g_error_box_dev[kMaxDevices];  // device views
static std::atomic<int> g_error_devices{0};  // 1 + the highest device that has its box
static std::mutex g_error_mutex;

// Records index `value`, outside [0, limit), unless an earlier error is still pending.
__device__ __noinline__ void report_bad_index(IndexErrorBox* box, int what, int64_t value, int64_t limit) {
  if (box == nullptr) return;
  const unsigned armed = *(volatile unsigned*)&box->armed;  // host-written: read past the caches
  if (atomicCAS(&index_error_claims, armed, armed + 1) != armed) return;
  box->what = what;
  box->value = value;
  box->limit = limit;
  __threadfence_system();  // the fields reach the host before the flag does
  *(volatile int*)&box->full = 1;
}

// The current device's mailbox (device pointer), made on first use; the pinned allocation lives as
// long as the process, since graphs captured with its address may be replayed at any time.
static IndexErrorBox* index_error_box() {
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 0 || dev >= kMaxDevices) return nullptr;  // no mailbox: bad indices still give NaN
  IndexErrorBox* box = g_error_box_dev[dev].load(std::memory_order_acquire);
  if (box) return box;
  std::lock_guard<std::mutex> lock(g_error_mutex);
  if (!g_error_boxes.load()) {
    // The first call may come while a graph is being captured: allow the allocation there.
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    cudaThreadExchangeStreamCaptureMode(&mode);
    void* host = nullptr;
    const cudaError_t err =
        cudaHostAlloc(&host, kMaxDevices * sizeof(IndexErrorBox), cudaHostAllocMapped | cudaHostAllocPortable);
    cudaThreadExchangeStreamCaptureMode(&mode);
    if (err != cudaSuccess)
      throw std::runtime_error(std::string("index error mailbox: cudaHostAlloc failed: ") + cudaGetErrorString(err));
    std::memset(host, 0, kMaxDevices * sizeof(IndexErrorBox));
    g_error_boxes.store(static_cast<IndexErrorBox*>(host));
  }
  void* dptr = nullptr;
  const cudaError_t err = cudaHostGetDevicePointer(&dptr, g_error_boxes.load() + dev, 0);
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("index error mailbox: cudaHostGetDevicePointer failed: ") +
                             cudaGetErrorString(err));
  box = static_cast<IndexErrorBox*>(dptr);
  g_error_box_dev[dev].store(box, std::memory_order_release);
  if (g_error_devices.load() < dev + 1) g_error_devices.store(dev + 1);
  return box;
}

// Takes the first bad index recorded on any device since the last take: its op, argument, value and
// the end of the valid range [0, limit). Returns false (and touches nothing) when there is none. Host
// memory reads only: no CUDA call, no sync; a kernel still running may report later.
bool launch::take_index_error(const char** op, const char** arg, int64_t* value, int64_t* limit) {
  const volatile IndexErrorBox* boxes = g_error_boxes.load(std::memory_order_acquire);
  if (boxes == nullptr) return false;  // no kernel that checks indices has run yet
  const int n = g_error_devices.load(std::memory_order_acquire);
  for (int dev = 0; dev < n; ++dev) {
    volatile IndexErrorBox* b = const_cast<volatile IndexErrorBox*>(boxes + dev);
    if (!b->full) continue;
    std::lock_guard<std::mutex> lock(g_error_mutex);
    if (!b->full) continue;  // another thread took it
    std::atomic_thread_fence(std::memory_order_acquire);  // the fields were written before the flag
    const int what = b->what;
    *op = kIndexErrorOp[what];
    *arg = kIndexErrorArg[what];
    *value = b->value;
    *limit = b->limit;
    b->full = 0;
    std::atomic_thread_fence(std::memory_order_seq_cst);  // cleared before re-armed
    b->armed = b->armed + 1;  // == the device's claim count again: armed
    return true;
  }
  return false;
}

// ------------------------------------------------------------------------------------------------
// 1.5 async copies (sm_80): cp.async from global to shared memory

// One asynchronous copy of BYTES from global to shared memory: 16 (.cg, past L1) or 4 (.ca: copies
// under 16 bytes must go through L1); valid = false writes zeros.
template <int BYTES>
__device__ __forceinline__ void cp_async(void* smem, const void* gmem, bool valid) {
  static_assert(BYTES == 16 || BYTES == 4, "the two sizes the kernels copy");
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  const uint32_t dst = (uint32_t)__cvta_generic_to_shared(smem), n = valid ? BYTES : 0;
  if constexpr (BYTES == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(n));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(gmem), "r"(n));
#else
  __trap();
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// ------------------------------------------------------------------------------------------------
// 1.6 tensor cores (sm_80): mma.sync, ldmatrix
// Mma.sync m16n8k8 with TF32 operands, used by matmul and fused attention.
//
// TF32 keeps 10 of fp32's 23 mantissa bits. PRECISE mode splits each operand x = hi + lo (both
// TF32) and sums lo*hi + hi*lo + hi*hi ("3xTF32"): about fp32 accuracy at tensor-core speed, the
// trick PyTorch's fp32 attention kernels use too. PRECISE = false does one TF32 product.
//
// Fragment layout of m16n8k8 (g = lane / 4, t = lane % 4): A (16 x 8) a0 = (g, t), a1 = (g+8, t),
// a2 = (g, t+4), a3 = (g+8, t+4); B (8 x 8) b0 = (k=t, n=g), b1 = (k=t+4, n=g); C (16 x 8)
// c0,c1 = (g, 2t), (g, 2t+1), c2,c3 = (g+8, 2t), (g+8, 2t+1).

__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  __trap();  // tensor-core TF32 needs sm_80+; the launchers refuse older GPUs
#endif
}

// An operand fragment as hi (and lo, when PRECISE) TF32 parts. PRECISE splits by truncation:
// hi = x with the 13 mantissa bits TF32 lacks cleared, lo = x - hi (exact in fp32), and the tensor
// core drops lo's own low bits. Two integer/float ops per value instead of two conversions; the
// dropped lo*lo term and lo's truncation leave a relative error near 2^-20 per product.
template <int NR, bool PRECISE>
struct Frag {
  uint32_t hi[NR], lo[NR];
  __device__ __forceinline__ void set(const float (&x)[NR]) {
#pragma unroll
    for (int i = 0; i < NR; ++i) {
      if (PRECISE) {
        hi[i] = __float_as_uint(x[i]) & 0xffffe000u;
        lo[i] = __float_as_uint(x[i] - __uint_as_float(hi[i]));
      } else {
        hi[i] = to_tf32(x[i]);
      }
    }
  }
};

template <bool PRECISE>
__device__ __forceinline__ void mma(float (&c)[4], const Frag<4, PRECISE>& a, const Frag<2, PRECISE>& b) {
  if (PRECISE) {  // small terms first
    mma_tf32(c, a.lo, b.hi);
    mma_tf32(c, a.hi, b.lo);
  }
  mma_tf32(c, a.hi, b.hi);
}

// bf16 products: mma.sync m16n8k16 (bf16 operands, fp32 accumulation). Fragment layout (g = lane / 4,
// t = lane % 4; each register holds two bf16, the lower column in the low half): A (16 x 16)
// a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..); B (16 x 8)
// b0 = (k=2t..2t+1, n=g), b1 = (k=2t+8.., n=g); C as for m16n8k8.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  __trap();
#endif
}

// Four 8 x 8 bf16 matrices from shared memory; lane l gives the row address of row l % 8 of matrix
// l / 8 and receives row l / 4, columns 2 (l % 4) .. + 1 of each (TRANS: of each one's transpose).
template <bool TRANS>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const __nv_bfloat16* row) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  const uint32_t a = (uint32_t)__cvta_generic_to_shared(row);
  if (TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
#else
  __trap();
#endif
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// ------------------------------------------------------------------------------------------------
// 1.7 Hopper (sm_90a): mbarriers, bulk and tensor-map copies, wgmma, named barriers

// PTX wrappers: mbarriers, the bulk copy, wgmma. Only sm_90a has wgmma; elsewhere the kernel traps
// and the launcher never picks it.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WG_ENABLED 1
#endif

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}

// Makes one thread's mbarrier inits visible to the block and the copy engine: after the inits, before
// the __syncthreads that publishes them.
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_expect_bytes(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

// The same expectation without an arrival, for a barrier whose arrivals come from several threads.
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

// Wait until the barrier's phase of this parity has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// The stage ring's barriers, set up by one thread before the block's first __syncthreads: full[s]
// completes on the producer's arrive (with the copies' byte count), empty[s] on one arrive per
// reading warp: `readers`, 8 for two consumer warpgroups (10 in the bf16 matmul with its row-sum warps).
template <int STAGES>
__device__ __forceinline__ void init_stage_barriers(uint32_t full, uint32_t empty, int readers = 8) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full + 8 * s, 1);
      mbar_init(empty + 8 * s, readers);
    }
    mbar_init_fence();
  }
  __syncthreads();
}

__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// Shared-memory matrix descriptor for a 128-byte-swizzled operand: its start address and two byte
// strides, lbo (between 64-element slabs along M or N; unused by K-major operands) and sbo (between
// groups of 8 rows).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32) | (1ull << 62);
}

// K-major TF32 tile: groups of 8 rows 1024 bytes apart.
__device__ __forceinline__ uint64_t wg_desc(uint32_t addr) { return smem_desc(addr, 16, 1024); }

// d (64 x 128, spread over the warpgroup) = a (64 x 8) * b (8 x 128) + (accumulate ? d : 0), TF32.
__device__ __forceinline__ void wgmma_tf32(float (&d)[64], uint64_t a, uint64_t b, int accumulate) {
#ifdef WG_ENABLED
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "
      "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, "
      "%43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(a), "l"(b), "r"(accumulate));
#endif
}

__device__ __forceinline__ void wgmma_fence() {
#ifdef WG_ENABLED
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_commit() {
#ifdef WG_ENABLED
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}

// Wait until at most n committed groups of this warpgroup's wgmma are still running.
template <int n>
__device__ __forceinline__ void wgmma_wait() {
#ifdef WG_ENABLED
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(n) : "memory");
#endif
}

__device__ __forceinline__ void wgmma_commit_and_wait() {
#ifdef WG_ENABLED
  asm volatile("wgmma.commit_group.sync.aligned;\nwgmma.wait_group.sync.aligned 0;" ::: "memory");
#endif
}

// Copies one box of a 3-D tensor map (x fastest) into shared memory; completion counted on bar.
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap* map, int x, int y, int z, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];" ::"r"(dst),
      "l"(map), "r"(x), "r"(y), "r"(z), "r"(bar)
      : "memory");
}

// The same for one box of a 4-D tensor map (attention's (d, s, head, batch)).
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, int x, int y, int z, int w,
                                            uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];" ::"r"(dst),
      "l"(map), "r"(x), "r"(y), "r"(z), "r"(w), "r"(bar)
      : "memory");
}

// d (64 x BN over the warpgroup) += a (64 x 16) * b (16 x BN), bf16 in, fp32 accumulate; BN 256, 192, 128 or 64.
// TA / TB: the operand is M- / N-major in shared memory (the transpose bits).
#define WG_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
                 "+f"(d[i + 6]), "+f"(d[i + 7])
#define WG_D32(i) WG_D8(i), WG_D8(i + 8), WG_D8(i + 16), WG_D8(i + 24)
#define WG_R16(a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p)                                                       \
  "%" #a ", %" #b ", %" #c ", %" #d ", %" #e ", %" #f ", %" #g ", %" #h ", %" #i ", %" #j ", %" #k ", %" #l ", %" #m \
  ", %" #n ", %" #o ", %" #p
// The first 32, 64 and 96 accumulator operands, which the shapes list.
#define WG_R32                                                      \
  WG_R16(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15) ", " \
  WG_R16(16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31)
#define WG_R64                                                                \
  WG_R32 ", "                                                                 \
  WG_R16(32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47) ", " \
  WG_R16(48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63)
#define WG_R96                                                                \
  WG_R64 ", "                                                                 \
  WG_R16(64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79) ", " \
  WG_R16(80, 81, 82, 83, 84, 85, 86, 87, 88, 89, 90, 91, 92, 93, 94, 95)
template <int TA, int TB, int BN>
__device__ __forceinline__ void wgmma_bf16(float (&d)[BN / 2], uint64_t a, uint64_t b, int accumulate) {
#ifdef WG_ENABLED
  static_assert(BN == 256 || BN == 192 || BN == 128 || BN == 64, "wgmma_bf16: BN is 256, 192, 128 or 64");
  if constexpr (BN == 64) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %36, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" WG_R32 "}, %32, %33, p, 1, 1, %34, %35;\n}\n"
        : WG_D32(0)
        : "l"(a), "l"(b), "n"(TA), "n"(TB), "r"(accumulate));
  } else if constexpr (BN == 128) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %68, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" WG_R64 "}, %64, %65, p, 1, 1, %66, %67;\n}\n"
        : WG_D32(0), WG_D32(32)
        : "l"(a), "l"(b), "n"(TA), "n"(TB), "r"(accumulate));
  } else if constexpr (BN == 256) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %132, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" WG_R96 ", "
        WG_R16(96, 97, 98, 99, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111) ", "
        WG_R16(112, 113, 114, 115, 116, 117, 118, 119, 120, 121, 122, 123, 124, 125, 126, 127) "}, "
        "%128, %129, p, 1, 1, %130, %131;\n}\n"
        : WG_D32(0), WG_D32(32), WG_D32(64), WG_D32(96)
        : "l"(a), "l"(b), "n"(TA), "n"(TB), "r"(accumulate));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %100, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 {" WG_R96 "}, "
        "%96, %97, p, 1, 1, %98, %99;\n}\n"
        : WG_D32(0), WG_D32(32), WG_D32(64)
        : "l"(a), "l"(b), "n"(TA), "n"(TB), "r"(accumulate));
  }
#endif
}
// The same with a (64 x 16) from registers, this thread's share in mma.sync's m16n8k16 A layout for its
// warp's 16 rows (a score tile's C fragments, packed to bf16); N 128 or 64.
template <int TB, int N>
__device__ __forceinline__ void wgmma_bf16_ra(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b, int accumulate) {
#ifdef WG_ENABLED
  static_assert(N == 128 || N == 64, "wgmma_bf16_ra: N is 128 or 64");
  if constexpr (N == 64) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" WG_R32 "}, {%32, %33, %34, %35}, %36, p, 1, 1, "
        "%38;\n}\n"
        : WG_D32(0)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate), "n"(TB));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" WG_R64 "}, {%64, %65, %66, %67}, %68, p, 1, 1, "
        "%70;\n}\n"
        : WG_D32(0), WG_D32(32)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate), "n"(TB));
  }
#endif
}
#undef WG_R96
#undef WG_R64
#undef WG_R32
#undef WG_R16
#undef WG_D32
#undef WG_D8

// The epilogue's copy-engine store: one box of shared memory to a 3-D tensor map (clipped at the
// tensor's edges), committed as its own bulk group.
__device__ __forceinline__ void tma_store(const CUtensorMap* map, uint32_t src, int x, int y, int z) {
  asm volatile(
      "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n"
      "cp.async.bulk.commit_group;" ::"l"(map),
      "r"(src), "r"(x), "r"(y), "r"(z)
      : "memory");
}

// Wait until at most n of this thread's bulk groups still read shared memory.
template <int n>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(n) : "memory");
}

__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// Makes this thread's ordinary shared-memory stores visible to the copy engine (the async proxy).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Barrier over `threads` threads (a multiple of 32) under id (1..15; 0 is __syncthreads).
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Arrives on barrier id for `threads` threads without waiting (the other side waits in named_sync).
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Warp specialization's register hand-off (sm_90a): a warpgroup gives its registers back down to N a thread
// (a producer), or waits until the block's pool lets each of its threads hold N (the consumers).
template <int N>
__device__ __forceinline__ void regs_release() {
#ifdef WG_ENABLED
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
#endif
}
template <int N>
__device__ __forceinline__ void regs_acquire() {
#ifdef WG_ENABLED
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
#endif
}

// Four 8 x 8 bf16 matrices from registers to shared memory, ldmatrix's inverse: lane l gives the address
// of row l % 8 of matrix l / 8 and holds in r[i] row l / 4, columns 2 (l % 4) .. + 1 of matrix i.
__device__ __forceinline__ void stmatrix_x4(uint32_t dst, const uint32_t* r) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(dst), "r"(r[0]), "r"(r[1]),
               "r"(r[2]), "r"(r[3])
               : "memory");
}

// 4 or 16 bytes to shared memory at a shared-space address (as the copy engine's buffers are addressed).
__device__ __forceinline__ void st_shared4(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void st_shared16(uint32_t addr, float a, float b, float c, float d) {
  asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}
__device__ __forceinline__ void st_shared16_zero(uint32_t addr) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(addr), "r"(0) : "memory");
}

__device__ __forceinline__ uint4 ld_shared16(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr)
               : "memory");
  return v;
}

// Adds `bytes` of floats from shared memory into global memory through the copy engine; one bulk group.
__device__ __forceinline__ void bulk_add_f32(float* dst, uint32_t src, uint32_t bytes) {
  asm volatile(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
      "cp.async.bulk.commit_group;" ::"l"(dst),
      "r"(src), "r"(bytes)
      : "memory");
}

constexpr int SMEM_BLOCK_MAX = 227 * 1024;  // the most shared memory a block may have (sm_90)

// ------------------------------------------------------------------------------------------------
// 1.8 random numbers: Philox4x32-10, dropout's draws
// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", 2011; cuRAND's and
// PyTorch's CUDA generator) turns a 128-bit counter and a 64-bit key into 128 random bits in ten rounds of
// two 32-bit multiplies. A draw is a pure function of where it is used, so a backward regenerates the
// forward's mask instead of storing it, and any kernel can draw the same number for the same element.
//
// Dropout's draws: element (r, c) of a matrix of rows r and columns c, at a call site `salt` and the
// rng's {seed, offset}, is 16-bit number lane(c) of
//   philox(counter = {unit(c), r, salt, offset}, key = seed),
//   unit(c) = (c / 32) * 4 + (c % 8) / 2,  lane(c) = (c / 8 % 4) * 2 + c % 2  (number i: bits 16i.. of the 128).
// So one counter's 8 numbers fall on the 8 columns one thread of an mma.sync C fragment holds among 32
// (columns 2t and 2t + 1 of four n8 tiles): attention draws a probability tile with one call per 8 of its
// values. 16-bit numbers keep p to 1/65536 (FlashAttention-2 draws 8-bit ones): the kept share is
// 1 - round(p * 65536) / 65536 while the factor is 1 / (1 - p), as PyTorch's, so the mean is off by up to
// 2^-17 / (1 - p) of itself (0.7% at p = 0.999).
//
// Twin: train.philox, train.dropout_keep (the same integers in PyTorch, bit for bit).

__device__ __forceinline__ uint4 philox(uint4 c, uint2 k) {
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    if (round) k = make_uint2(k.x + 0x9E3779B9u, k.y + 0xBB67AE85u);  // the key's Weyl sequence
    const uint32_t hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
    const uint32_t hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
    c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
  }
  return c;
}

// A kernel's dropout, its {seed, offset} read once from the device.
struct Dropout {
  uint2 key;
  uint32_t salt, offset, threshold;
  float scale;
  Dropout() = default;  // no dropout: never read
  __device__ explicit Dropout(const DropoutArgs& d)
      : key(make_uint2((uint32_t)d.rng[0], (uint32_t)((uint64_t)d.rng[0] >> 32))), salt(d.salt),
        offset((uint32_t)d.rng[1]), threshold(d.threshold), scale(d.scale) {}
  __device__ __forceinline__ static uint32_t unit(int64_t c) { return (uint32_t)((c >> 5) * 4 + ((c & 7) >> 1)); }
  __device__ __forceinline__ static int lane(int64_t c) { return (int)(((c >> 3) & 3) * 2 + (c & 1)); }
  // The 8 numbers of row r's counter u.
  __device__ __forceinline__ uint4 draws(uint32_t r, uint32_t u) const { return philox(make_uint4(u, r, salt, offset), key); }
  // The factor of the element whose number is lane i of draws d: scale where kept, 0 where dropped.
  __device__ __forceinline__ float factor(const uint4& d, int i) const {
    const uint32_t w = (i >> 1) == 0 ? d.x : (i >> 1) == 1 ? d.y : (i >> 1) == 2 ? d.z : d.w;
    return ((w >> (16 * (i & 1))) & 0xFFFFu) >= threshold ? scale : 0.f;
  }
  // The factors of a backward's 2 x 2 block in the transposed frame (keys as rows, queries as columns):
  // z[e] of query q + (e & 1), key key0 + 8 (e >> 1), where key0 = 16m + g, g = lane / 4. Lanes g and
  // g ^ 1 (lane ^ 4) need the same two counters, rows q and q + 1, and from each the same two words (keys
  // key0 and key0 + 8; the two keys of one lane pair are a word's halves): each lane draws one counter and
  // the pair swap words, one Philox call per 4 values. Every lane of the warp calls it.
  __device__ __forceinline__ void factors_t(uint32_t q, int64_t key0, float (&z)[4]) const {
    const uint32_t odd = (uint32_t)(key0 & 1);  // the odd key's lane draws row q + 1, the even one's row q
    const uint4 d = draws(q + odd, unit(key0));
    const bool low = lane(key0) < 2;  // key0's number in word 0 (key0 + 8's in word 1), else words 2 and 3
    const uint32_t a = low ? d.x : d.z, b = low ? d.y : d.w;
    const uint32_t pa = __shfl_xor_sync(0xffffffffu, a, 4), pb = __shfl_xor_sync(0xffffffffu, b, 4);
    const int half = 16 * (int)odd;
    auto f = [&](uint32_t w) { return ((w >> half) & 0xFFFFu) >= threshold ? scale : 0.f; };
    z[0] = f(odd ? pa : a);  // query q, key0
    z[1] = f(odd ? a : pa);  // query q + 1
    z[2] = f(odd ? pb : b);  // query q, key0 + 8
    z[3] = f(odd ? b : pb);
  }
  // A 16 x 8NT tile of C fragments (rows row0: e < 2, row1: e >= 2; column c0 + 8j + 2t + (e & 1), c0 a
  // multiple of 32) times its factors: two calls per 32 columns.
  template <int NT>
  __device__ __forceinline__ void apply(float (&s)[NT][4], uint32_t row0, uint32_t row1, int c0) const {
    static_assert(NT % 4 == 0, "whole 32-column units");
    const uint32_t t = threadIdx.x & 3;
#pragma unroll
    for (int j = 0; j < NT; j += 4) {
      const uint32_t u = (uint32_t)((c0 + 8 * j) >> 5) * 4 + t;
      const uint4 d0 = draws(row0, u), d1 = draws(row1, u);
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        s[j + jj][0] *= factor(d0, 2 * jj); s[j + jj][1] *= factor(d0, 2 * jj + 1);
        s[j + jj][2] *= factor(d1, 2 * jj); s[j + jj][3] *= factor(d1, 2 * jj + 1);
      }
    }
  }
};

// ================================================================================================
// 2. Elementwise
// Each thread maps values to values; bound by memory, so the work is in the loads.
// ================================================================================================

// ------------------------------------------------------------------------------------------------
// 2.1 activations: GELU, SiLU
// GELU (erf and tanh) and SiLU, forward and backward. Formulas follow PyTorch's own (same operation
// order) so results agree to the last bit or two. One kernel serves every elementwise op: a functor maps
// NIN input values to NOUT outputs (GELU forward 1 -> 1; SwiGLU's backward, in 2.2, a, b, dy -> da, db).
// 16-byte loads when every pointer allows.
//
// Twin: F.gelu, F.silu. Uses: 1.1 launch_pdl, 1.2 load_stream4.

struct GeluErf {
  __device__ float fwd(float x) const { return x * 0.5f * (1.f + erff(x * (float)M_SQRT1_2)); }
  __device__ float bwd(float x, float dy) const {
    const float kAlpha = (float)(M_2_SQRTPI * M_SQRT1_2 * 0.5);
    const float cdf = 0.5f * (1.f + erff(x * (float)M_SQRT1_2));
    const float pdf = expf(-0.5f * x * x) * kAlpha;
    return dy * (cdf + x * pdf);
  }
};

struct GeluTanh {
  static constexpr float kBeta = 0.7978845608028654f;  // sqrt(2 / pi)
  static constexpr float kKappa = 0.044715f;
  __device__ float fwd(float x) const {
    const float inner = kBeta * (x + kKappa * x * x * x);
    return 0.5f * x * (1.f + tanhf(inner));
  }
  __device__ float bwd(float x, float dy) const {
    const float x_sq = x * x;
    const float inner = kBeta * (x + kKappa * x_sq * x);
    const float t = tanhf(inner);
    const float left = 0.5f * x, right = 1.f + t;
    const float left_derivative = 0.5f * right;
    const float right_derivative = left * (1.f - t * t) * kBeta * (1.f + 3.f * kKappa * x_sq);
    return dy * (left_derivative + right_derivative);
  }
};

__device__ __forceinline__ float sigmoidf(float u) { return 1.f / (1.f + expf(-u)); }

// SiLU(x) = x * sigmoid(x), written as PyTorch writes it: x / (1 + exp(-x)).
struct Silu {
  __device__ float fwd(float x) const { return x / (1.f + expf(-x)); }
  __device__ float bwd(float x, float dy) const {
    const float s = sigmoidf(x);
    return dy * s * (1.f + x * (1.f - s));
  }
};

// The functors the kernel runs for an activation: its forward and its backward.
template <class A>
struct ActFwd {
  __device__ void operator()(const float (&in)[1], float (&out)[1]) const { out[0] = A().fwd(in[0]); }
};
template <class A>
struct ActBwd {  // in: x, dy
  __device__ void operator()(const float (&in)[2], float (&out)[1]) const { out[0] = A().bwd(in[0], in[1]); }
};

template <int N, class T>
struct Ptrs { const T* p[N]; };
template <int N, class T>
struct OutPtrs { T* p[N]; };

// PER items of VEC values per thread (VEC = 16 bytes of T: 4 fp32 or 8 bf16, or VEC = 1), all loads
// issued before any math so that several are in flight per thread. The arithmetic is fp32.
template <class F, int NIN, int NOUT, int VEC, int PER, class T>
__global__ void elementwise_kernel(Ptrs<NIN, T> in, OutPtrs<NOUT, T> out, int64_t n) {
  pdl_begin();
  const F f;
  const int64_t items = n / VEC;
  const int64_t first = (int64_t)blockIdx.x * blockDim.x * PER + threadIdx.x;
  float a[PER][NIN][VEC];
#pragma unroll
  for (int u = 0; u < PER; ++u) {
    const int64_t i = first + u * blockDim.x;
    if (i >= items) continue;
#pragma unroll
    for (int k = 0; k < NIN; ++k) {
      if constexpr (VEC == 1) a[u][k][0] = to_float(in.p[k][i]);
      else unpack16(load_stream4(in.p[k] + VEC * i), a[u][k]);
    }
  }
#pragma unroll
  for (int u = 0; u < PER; ++u) {
    const int64_t i = first + u * blockDim.x;
    if (i >= items) continue;
    float o[NOUT][VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      float x[NIN], y[NOUT];
#pragma unroll
      for (int k = 0; k < NIN; ++k) x[k] = a[u][k][e];
      f(x, y);
#pragma unroll
      for (int j = 0; j < NOUT; ++j) o[j][e] = y[j];
    }
#pragma unroll
    for (int j = 0; j < NOUT; ++j) {
      if constexpr (VEC == 1) out.p[j][i] = from_float<T>(o[j][0]);
      else reinterpret_cast<float4*>(out.p[j])[i] = pack16(o[j]);
    }
  }
}

template <class F, int NIN, int NOUT, class T>
static void elementwise(Ptrs<NIN, T> in, OutPtrs<NOUT, T> out, int64_t n, const char* what, cudaStream_t s) {
  if (n == 0) return;
  constexpr int VEC = per16<T>();
  bool vec = n % VEC == 0;
  for (const T* p : in.p) vec = vec && aligned16(p);
  for (T* p : out.p) vec = vec && aligned16(p);
  const int64_t items = vec ? n / VEC : n;
  // 2 vectors per thread in blocks of 128 (the bench's gelu rows choose between such shapes).
  const unsigned blocks = (unsigned)((items + 255) / 256);
  if (vec) launch_pdl(elementwise_kernel<F, NIN, NOUT, VEC, 2, T>, dim3(blocks), dim3(128), 0, s, in, out, n);
  else launch_pdl(elementwise_kernel<F, NIN, NOUT, 1, 2, T>, dim3(blocks), dim3(128), 0, s, in, out, n);
  check_launch(what);
}

// T: fp32 or bf16, every tensor of a call the same.
template <class T>
void launch::gelu_fwd(const T* x, T* y, int64_t n, bool tanh_approx, cudaStream_t s) {
  if (tanh_approx) elementwise<ActFwd<GeluTanh>, 1, 1, T>({{x}}, {{y}}, n, "gelu_fwd", s);
  else elementwise<ActFwd<GeluErf>, 1, 1, T>({{x}}, {{y}}, n, "gelu_fwd", s);
}

template <class T>
void launch::gelu_bwd(const T* x, const T* dy, T* dx, int64_t n, bool tanh_approx, cudaStream_t s) {
  if (tanh_approx) elementwise<ActBwd<GeluTanh>, 2, 1, T>({{x, dy}}, {{dx}}, n, "gelu_bwd", s);
  else elementwise<ActBwd<GeluErf>, 2, 1, T>({{x, dy}}, {{dx}}, n, "gelu_bwd", s);
}

template <class T>
void launch::silu_fwd(const T* x, T* y, int64_t n, cudaStream_t s) {
  elementwise<ActFwd<Silu>, 1, 1, T>({{x}}, {{y}}, n, "silu_fwd", s);
}

template <class T>
void launch::silu_bwd(const T* x, const T* dy, T* dx, int64_t n, cudaStream_t s) {
  elementwise<ActBwd<Silu>, 2, 1, T>({{x, dy}}, {{dx}}, n, "silu_bwd", s);
}

#define INSTANTIATE_ACTIVATIONS(T)                                                                  \
  template void launch::gelu_fwd<T>(const T*, T*, int64_t, bool, cudaStream_t);                     \
  ONE_TEMPLATE(gelu_fwd<T>);                                                                        \
  template void launch::gelu_bwd<T>(const T*, const T*, T*, int64_t, bool, cudaStream_t);           \
  ONE_TEMPLATE(gelu_bwd<T>);                                                                        \
  template void launch::silu_fwd<T>(const T*, T*, int64_t, cudaStream_t);                           \
  ONE_TEMPLATE(silu_fwd<T>);                                                                        \
  template void launch::silu_bwd<T>(const T*, const T*, T*, int64_t, cudaStream_t);                 \
  ONE_TEMPLATE(silu_bwd<T>);
INSTANTIATE_ACTIVATIONS(float)
INSTANTIATE_ACTIVATIONS(__nv_bfloat16)
#undef INSTANTIATE_ACTIVATIONS

// ------------------------------------------------------------------------------------------------
// 2.2 SwiGLU
// silu(a) * b, Llama's gate, in one pass each way: 2.1's elementwise kernel with a functor of two
// inputs (one read of a, b and dy and one write of da and db backward, where the composition takes several).
//
// Twin: F.silu(a) * b. Uses: 2.1 elementwise, Silu.

struct SwigluFwd {  // in: a, b -> silu(a) * b
  __device__ void operator()(const float (&in)[2], float (&out)[1]) const { out[0] = Silu().fwd(in[0]) * in[1]; }
};
struct SwigluBwd {  // in: a, b, dy -> da = silu'(a) * b * dy, db = silu(a) * dy
  __device__ void operator()(const float (&in)[3], float (&out)[2]) const {
    out[0] = Silu().bwd(in[0], in[2] * in[1]);
    out[1] = Silu().fwd(in[0]) * in[2];
  }
};

template <class T>
void launch::swiglu_fwd(const T* a, const T* b, T* y, int64_t n, cudaStream_t s) {
  elementwise<SwigluFwd, 2, 1, T>({{a, b}}, {{y}}, n, "swiglu_fwd", s);
}

template <class T>
void launch::swiglu_bwd(const T* a, const T* b, const T* dy, T* da, T* db, int64_t n, cudaStream_t s) {
  elementwise<SwigluBwd, 3, 2, T>({{a, b, dy}}, {{da, db}}, n, "swiglu_bwd", s);
}

#define INSTANTIATE_SWIGLU(T)                                                                       \
  template void launch::swiglu_fwd<T>(const T*, const T*, T*, int64_t, cudaStream_t);               \
  ONE_TEMPLATE(swiglu_fwd<T>);                                                                      \
  template void launch::swiglu_bwd<T>(const T*, const T*, const T*, T*, T*, int64_t, cudaStream_t); \
  ONE_TEMPLATE(swiglu_bwd<T>);
INSTANTIATE_SWIGLU(float)
INSTANTIATE_SWIGLU(__nv_bfloat16)
#undef INSTANTIATE_SWIGLU

// ------------------------------------------------------------------------------------------------
// 2.3 RoPE
// Rotary position embedding (RoPE), with the "rotate half" pairing of GPT-NeoX and of Llama as
// Hugging Face runs it: element i of a head pairs with element i + D/2, and the pair turns by the
// angle of its token's position times frequency i:
//   out_i = x_i cos - x_{i+D/2} sin,   out_{i+D/2} = x_{i+D/2} cos + x_i sin.
// cos and sin arrive as (T, D/2) tables of the T tokens' angles, so decoding at any cache position
// runs the same kernel. x may be a strided (B, H, T, D) view (the heads of a fused QKV projection);
// the output is contiguous, so the rotation also does the transpose that attention needs. Each
// product is rounded on its own (__fmul_rn: no fused multiply-add) so the forward equals PyTorch's
// formula bit for bit. The backward is the rotation by -angle: the same kernel with sin negated.
//
// Twin: train.torch_rope. Uses: 1.1.

template <class T>
struct RopeArgs {
  const T* x;
  const float *cos, *sin;
  T* out;
  int64_t sb, sh, st;  // x's strides of B, H, T (D is contiguous)
  int H, T_, half;     // T_: tokens; half = D / 2
};

// The pair (x1, x2) turned by the angle of cosine c and sine s, each product rounded on its own.
__device__ __forceinline__ void rope_turn(float x1, float x2, float c, float s, float& o1, float& o2) {
  o1 = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));
  o2 = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
}

// T: x and out, fp32 or bf16 (a bf16 pair is rotated in fp32 and rounded once).
template <bool BWD, class T>
__global__ void rope_kernel(RopeArgs<T> a, int64_t n) {
  const int64_t step = (int64_t)gridDim.x * blockDim.x;
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += step) {
    const int i = (int)(e % a.half);
    const int64_t row = e / a.half;  // (b * H + h) * T + t: the output row
    const int t = (int)(row % a.T_);
    const int h = (int)(row / a.T_ % a.H);
    const int64_t b = row / a.T_ / a.H;
    const T* x = a.x + b * a.sb + h * a.sh + t * a.st;
    const float c = a.cos[(int64_t)t * a.half + i];
    const float s = BWD ? -a.sin[(int64_t)t * a.half + i] : a.sin[(int64_t)t * a.half + i];
    const float x1 = to_float(x[i]), x2 = to_float(x[i + a.half]);
    T* o = a.out + row * 2 * a.half;
    float o1, o2;
    rope_turn(x1, x2, c, s, o1, o2);
    o[i] = from_float<T>(o1);
    o[i + a.half] = from_float<T>(o2);
  }
}

// out (B, H, T, D) contiguous; x with strides sb, sh, st and a contiguous last dim.
template <class T>
void launch::rope(const T* x, const float* cos, const float* sin, T* out, int B, int H, int T_, int D, int64_t sb,
                  int64_t sh, int64_t st, bool backward, cudaStream_t s) {
  const int64_t n = (int64_t)B * H * T_ * (D / 2);
  if (n == 0) return;
  const RopeArgs<T> a{x, cos, sin, out, sb, sh, st, H, T_, D / 2};
  const unsigned blocks = (unsigned)std::min<int64_t>((n + 255) / 256, 32 * num_sms());
  if (backward) rope_kernel<true, T><<<blocks, 256, 0, s>>>(a, n);
  else rope_kernel<false, T><<<blocks, 256, 0, s>>>(a, n);
  check_launch("rope");
}
template void launch::rope<float>(const float*, const float*, const float*, float*, int, int, int, int, int64_t, int64_t,
                                  int64_t, bool, cudaStream_t);
ONE_TEMPLATE(rope<float>);
template void launch::rope<__nv_bfloat16>(const __nv_bfloat16*, const float*, const float*, __nv_bfloat16*, int, int, int,
                                          int, int64_t, int64_t, int64_t, bool, cudaStream_t);
ONE_TEMPLATE(rope<__nv_bfloat16>);

// ------------------------------------------------------------------------------------------------
// 2.4 dropout
// y = x * factor, the factor scale = 1 / (1 - p) where element (r, c) of x, seen as rows of its last dim,
// is kept (1.8's draw >= threshold), 0 where dropped. The backward is the same kernel on dy: the mask is
// drawn again, never stored. Four Philox calls give the numbers of 32 columns of a row, a segment. Rows of
// whole segments (the models' widths) take dropout_segments_kernel, whose loads are coalesced; other
// shapes dropout_kernel, a thread a segment.
//
// Twin: train.torch_dropout. Uses: 1.2 unpack16 / pack16, 1.8 Dropout.

template <class T, bool VEC>
__global__ void __launch_bounds__(256) dropout_kernel(const T* x, T* y, int64_t rows, int64_t cols, DropoutArgs a) {
  const Dropout d(a);
  const int64_t segs = (cols + 31) / 32, n = rows * segs;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / segs, c0 = i % segs * 32;
    uint4 dr[4];  // counter unit(c0) + t holds the numbers of columns c0 + 8j + 2t + {0, 1}
#pragma unroll
    for (int t = 0; t < 4; ++t) dr[t] = d.draws((uint32_t)r, Dropout::unit(c0) + t);
    const T* xr = x + r * cols + c0;
    T* yr = y + r * cols + c0;
    if (VEC && c0 + 32 <= cols) {
      constexpr int W = per16<T>();
#pragma unroll
      for (int c = 0; c < 32; c += W) {
        float v[W];
        unpack16(*reinterpret_cast<const float4*>(xr + c), v);
#pragma unroll
        for (int w = 0; w < W; ++w) v[w] *= d.factor(dr[((c + w) & 7) >> 1], Dropout::lane(c + w));
        *reinterpret_cast<float4*>(yr + c) = pack16(v);
      }
    } else {
#pragma unroll
      for (int c = 0; c < 32; ++c)
        if (c0 + c < cols) yr[c] = from_float<T>(to_float(xr[c]) * d.factor(dr[(c & 7) >> 1], Dropout::lane(c)));
    }
  }
}

// Rows of whole segments (cols % 32 == 0, 16-byte aligned), which then lie side by side in memory: a warp
// takes 32 consecutive segments, each lane drawing one segment's numbers into shared memory; lane i moves
// the warp's 16-byte chunks i, i + 32, ... (a warp's accesses one contiguous span, where a thread a
// segment would read 32 spans 128 bytes apart), each chunk's numbers read back from its segment's lane.
// A whole group of 32 segments issues all of a lane's loads before the draws, which then run while the
// loads are in flight; the last, partial group loads a chunk at a time.
constexpr int DROPOUT_WARPS = 8;

template <class T>
__global__ void __launch_bounds__(32 * DROPOUT_WARPS) dropout_segments_kernel(const T* x, T* y, int64_t segs,
                                                                               int64_t segs_per_row, DropoutArgs a) {
  __shared__ uint4 nums[DROPOUT_WARPS][4][32];  // a warp's counters t of its 32 segments, segment fastest
  constexpr int W = per16<T>(), CHUNKS = 32 / W;  // a chunk's values, a segment's chunks (and a lane's chunks)
  const Dropout d(a);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t stride = (int64_t)gridDim.x * DROPOUT_WARPS * 32;
  auto draw = [&](int64_t s0) {  // segment s0 + lane's numbers into nums
    if (s0 + lane < segs) {
      const int64_t s = s0 + lane;
      const uint32_t r = (uint32_t)(s / segs_per_row), u = Dropout::unit(s % segs_per_row * 32);
#pragma unroll
      for (int t = 0; t < 4; ++t) nums[warp][t][lane] = d.draws(r, u + t);
    }
    __syncwarp();
  };
  auto scale = [&](float (&v)[W], int ch) {  // chunk ch of the group: its values times their factors
    const int seg = ch / CHUNKS, c = ch % CHUNKS * W;  // the chunk's segment, its first column there
#pragma unroll
    for (int w = 0; w < W; ++w) v[w] *= d.factor(nums[warp][((c + w) & 7) >> 1][seg], Dropout::lane(c + w));
  };
  for (int64_t s0 = ((int64_t)blockIdx.x * DROPOUT_WARPS + warp) * 32; s0 < segs; s0 += stride) {
    const T* xs = x + s0 * 32;
    T* ys = y + s0 * 32;
    if (s0 + 32 <= segs) {
      float4 in[CHUNKS];
#pragma unroll
      for (int k = 0; k < CHUNKS; ++k) in[k] = *reinterpret_cast<const float4*>(xs + (lane + 32 * k) * W);
      draw(s0);
#pragma unroll
      for (int k = 0; k < CHUNKS; ++k) {
        float v[W];
        unpack16(in[k], v);
        scale(v, lane + 32 * k);
        *reinterpret_cast<float4*>(ys + (lane + 32 * k) * W) = pack16(v);
      }
    } else {
      draw(s0);
      for (int ch = lane; ch < (int)(segs - s0) * CHUNKS; ch += 32) {
        float v[W];
        unpack16(*reinterpret_cast<const float4*>(xs + ch * W), v);
        scale(v, ch);
        *reinterpret_cast<float4*>(ys + ch * W) = pack16(v);
      }
    }
    __syncwarp();  // every lane has read the numbers before the next segments' overwrite them
  }
}

// x and y contiguous (rows, cols); 16-byte loads where rows start on 16 bytes.
template <class T>
void launch::dropout(const T* x, T* y, int64_t rows, int64_t cols, const DropoutArgs& d, cudaStream_t s) {
  const int64_t n = rows * ((cols + 31) / 32);
  if (n == 0) return;
  if (cols % 32 == 0 && aligned16(x) && aligned16(y)) {
    const unsigned blocks = (unsigned)std::min<int64_t>((n + 32 * DROPOUT_WARPS - 1) / (32 * DROPOUT_WARPS), 32 * num_sms());
    dropout_segments_kernel<T><<<blocks, 32 * DROPOUT_WARPS, 0, s>>>(x, y, n, cols / 32, d);
    check_launch("dropout");
    return;
  }
  const unsigned blocks = (unsigned)std::min<int64_t>((n + 255) / 256, 32 * num_sms());
  if (aligned16(x) && aligned16(y) && cols % per16<T>() == 0)
    dropout_kernel<T, true><<<blocks, 256, 0, s>>>(x, y, rows, cols, d);
  else
    dropout_kernel<T, false><<<blocks, 256, 0, s>>>(x, y, rows, cols, d);
  check_launch("dropout");
}
template void launch::dropout<float>(const float*, float*, int64_t, int64_t, const DropoutArgs&, cudaStream_t);
ONE_TEMPLATE(dropout<float>);
template void launch::dropout<__nv_bfloat16>(const __nv_bfloat16*, __nv_bfloat16*, int64_t, int64_t,
                                             const DropoutArgs&, cudaStream_t);
ONE_TEMPLATE(dropout<__nv_bfloat16>);

// ================================================================================================
// 3. Rows
// A row per warp or per block (1.3), reduced in registers and shared memory (1.2).
// ================================================================================================

// ------------------------------------------------------------------------------------------------
// 3.1 softmax
// Softmax over the last dim, max-subtracted: y = exp(scale * x - max) / sum. For tiled attention
// the kernel also applies the causal mask: row r is query (r % sq), which sees keys
// j <= (r % sq) + offset (offset = Sk - Sq); masked entries get probability 0. sq = 0: no mask.
// In-place (y == x) is safe: each thread rereads only what it has not yet written.
//
// Twin: torch.softmax. Uses: 1.2 row_reduce; 1.3 LAUNCH_ROW.

template <int TX, int N, int VEC, class TI, class TO>
__global__ void __launch_bounds__(TX == 32 ? 128 : TX, 1) softmax_fwd_kernel(const TI* x, TO* y, int R, int C,
                                                           float scale, int sq, int offset) {
  __shared__ float red[32];
  pdl_begin();
  const int r = blockIdx.x * blockDim.y + threadIdx.y;
  if (r >= R) return;
  const TI* xr = x + (int64_t)r * C;
  TO* yr = y + (int64_t)r * C;
  const int units = (C + VEC - 1) / VEC;
  const int limit = sq > 0 ? min(C, r % sq + offset + 1) : C;  // columns >= limit are masked
  float v[N][VEC];
  float mx = -INFINITY;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const int u = threadIdx.x + j * TX;
    load_unit<VEC>(xr, u, C, v[j], 0.f);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      v[j][i] = (u * VEC + i < limit) ? v[j][i] * scale : -INFINITY;
      mx = fmaxf(mx, v[j][i]);
    }
  }
  for (int u = threadIdx.x + N * TX; u < units; u += TX) {
    float t[VEC];
    load_unit<VEC>(xr, u, C, t, 0.f);
    for (int i = 0; i < VEC; ++i)
      if (u * VEC + i < limit) mx = fmaxf(mx, t[i] * scale);
  }
  mx = row_reduce<TX, true>(mx, red);
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < N; ++j)
#pragma unroll
    for (int i = 0; i < VEC; ++i) { v[j][i] = expf(v[j][i] - mx); sum += v[j][i]; }
  for (int u = threadIdx.x + N * TX; u < units; u += TX) {
    float t[VEC];
    load_unit<VEC>(xr, u, C, t, 0.f);
    for (int i = 0; i < VEC; ++i)
      if (u * VEC + i < limit) sum += expf(t[i] * scale - mx);
  }
  const float inv = 1.f / row_reduce<TX, false>(sum, red);
#pragma unroll
  for (int j = 0; j < N; ++j) {
    float o[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) o[i] = v[j][i] * inv;
    store_unit<VEC>(yr, threadIdx.x + j * TX, C, o);
  }
  for (int u = threadIdx.x + N * TX; u < units; u += TX) {
    float t[VEC], o[VEC];
    load_unit<VEC>(xr, u, C, t, 0.f);
    for (int i = 0; i < VEC; ++i) o[i] = (u * VEC + i < limit) ? expf(t[i] * scale - mx) * inv : 0.f;
    store_unit<VEC>(yr, u, C, o);
  }
}

// dx = scale * y * (dy - sum(dy * y)); dx may alias dy.
template <int TX, int N, int VEC, class TI, class TO>
__global__ void __launch_bounds__(TX == 32 ? 128 : TX, 1) softmax_bwd_kernel(const TO* y, const TO* dy, TI* dx,
                                                           int R, int C, float scale) {
  __shared__ float red[32];
  pdl_begin();
  const int r = blockIdx.x * blockDim.y + threadIdx.y;
  if (r >= R) return;
  const TO* yr = y + (int64_t)r * C;
  const TO* dyr = dy + (int64_t)r * C;
  TI* dxr = dx + (int64_t)r * C;
  const int units = (C + VEC - 1) / VEC;
  float yv[N][VEC], gv[N][VEC];
  float dot = 0.f;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const int u = threadIdx.x + j * TX;
    load_unit<VEC>(yr, u, C, yv[j], 0.f);
    load_unit<VEC>(dyr, u, C, gv[j], 0.f);
#pragma unroll
    for (int i = 0; i < VEC; ++i) dot += yv[j][i] * gv[j][i];
  }
  for (int u = threadIdx.x + N * TX; u < units; u += TX) {
    float a[VEC], g[VEC];
    load_unit<VEC>(yr, u, C, a, 0.f);
    load_unit<VEC>(dyr, u, C, g, 0.f);
    for (int i = 0; i < VEC; ++i) dot += a[i] * g[i];
  }
  dot = row_reduce<TX, false>(dot, red);
#pragma unroll
  for (int j = 0; j < N; ++j) {
    float o[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) o[i] = scale * yv[j][i] * (gv[j][i] - dot);
    store_unit<VEC>(dxr, threadIdx.x + j * TX, C, o);
  }
  for (int u = threadIdx.x + N * TX; u < units; u += TX) {
    float a[VEC], g[VEC], o[VEC];
    load_unit<VEC>(yr, u, C, a, 0.f);
    load_unit<VEC>(dyr, u, C, g, 0.f);
    for (int i = 0; i < VEC; ++i) o[i] = scale * a[i] * (g[i] - dot);
    store_unit<VEC>(dxr, u, C, o);
  }
}

// TI: x and dx; TO: y and dy (fp32 or bf16; the arithmetic is fp32).
template <class TI, class TO>
void launch::softmax_fwd(const TI* x, TO* y, int R, int C, float scale, int sq, int offset, cudaStream_t s) {
  if (R == 0) return;
  RowLaunch L = row_launch(C, aligned16(x) && aligned16(y));
  LAUNCH_ROW(softmax_fwd_kernel, (TI, TO), L, R, s, x, y, R, C, scale, sq, offset);
  check_launch("softmax_fwd");
}

template <class TI, class TO>
void launch::softmax_bwd(const TO* y, const TO* dy, TI* dx, int R, int C, float scale, cudaStream_t s) {
  if (R == 0) return;
  RowLaunch L = row_launch(C, aligned16(y) && aligned16(dy) && aligned16(dx));
  LAUNCH_ROW(softmax_bwd_kernel, (TI, TO), L, R, s, y, dy, dx, R, C, scale);
  check_launch("softmax_bwd");
}

#define INSTANTIATE_SOFTMAX(TI, TO)                                                                    \
  template void launch::softmax_fwd<TI, TO>(const TI*, TO*, int, int, float, int, int, cudaStream_t);  \
  ONE_TEMPLATE(softmax_fwd<TI, TO>);                                                                   \
  template void launch::softmax_bwd<TI, TO>(const TO*, const TO*, TI*, int, int, float, cudaStream_t); \
  ONE_TEMPLATE(softmax_bwd<TI, TO>);
FOR_ROW_TYPES(INSTANTIATE_SOFTMAX)
#undef INSTANTIATE_SOFTMAX

// ------------------------------------------------------------------------------------------------
// 3.2 layernorm and RMSNorm
// Layernorm and RMSNorm over the last dim. Both run the same row code (norm_fwd_row, norm_bwd_row)
// in one of two modes, the compile-time flag RMS (thin kernels pick it forward; the backward kernel
// takes it as a template argument):
//   layernorm (RMS = false): y = (x - mean) * rstd * w + b,  rstd = 1 / sqrt(mean((x - mean)^2) + eps)
//   RMSNorm   (RMS = true):  y = x * rstd * w,               rstd = 1 / sqrt(mean(x^2) + eps)
// RMSNorm is layernorm with the mean fixed at 0 and no bias: every formula reads the same with
// mean = 0, and the mean's loads and reductions drop out at compile time (a run-time flag made
// layernorm's 1024-thread backward spill). rstd (and the mean) are saved per row. The variance is
// computed two-pass from the registers (no E[x^2] - mean^2 cancellation).
//
// Residual add (add_layernorm, add_rmsnorm): given an addend (a sublayer's output, in y's dtype), the
// row normalized is s = x + addend, rounded to x's dtype (the residual stream's) as a separate add
// would round it; s is written out (the stream goes on from it) and saved for the backward. The add
// rides on the norm's pass over the row: one read of each input and one write of s, where an add
// kernel would write s and the norm read it back. The backward adds the gradient that reaches s from
// downstream (dsum) to the norm's dx, and writes it once more in the addend's dtype when that
// differs (the sublayer's output gradient), so the residual stream's backward is one pass as well.
//
// Twin: F.layer_norm, F.rms_norm (train.torch_add_layernorm, torch_add_rmsnorm). Uses: 1.2, 1.3.

// Unit u of the row sum = x + addend, rounded to TI: v holds x's unit on entry and the sum on exit.
template <int VEC, class TI, class TO>
__device__ __forceinline__ void add_unit(const TO* addend, TI* sum, int u, int C, float (&v)[VEC]) {
  float a[VEC];
  load_unit<VEC>(addend, u, C, a, 0.f);
#pragma unroll
  for (int i = 0; i < VEC; ++i) v[i] = to_float(from_float<TI>(v[i] + a[i]));
  store_unit<VEC>(sum, u, C, v);
}

template <int TX, int N, int VEC, bool RMS, class TI, class TO>
__device__ __forceinline__ void norm_fwd_row(const TI* __restrict__ x, const TO* __restrict__ addend,
                                             const TI* __restrict__ w, const TI* __restrict__ b, TO* __restrict__ y,
                                             TI* __restrict__ sum_out, float* mean_out, float* rstd_out, int R, int C,
                                             float eps) {
  __shared__ float red[32];
  pdl_begin();
  const int r = blockIdx.x * blockDim.y + threadIdx.y;
  if (r >= R) return;
  const TI* xr = x + (int64_t)r * C;
  const TO* ar = addend ? addend + (int64_t)r * C : nullptr;
  TI* sr = addend ? sum_out + (int64_t)r * C : nullptr;
  const TI* src = addend ? sr : xr;  // where passes after the first read the row (this thread wrote its units)
  TO* yr = y + (int64_t)r * C;
  const int units = (C + VEC - 1) / VEC;
  float v[N][VEC];
  float sum = 0.f;
  // Loads first, in loops of their own: a store to s between two loads (or a branch around one) would
  // keep the later load from being issued before the earlier one returned.
#pragma unroll
  for (int j = 0; j < N; ++j) load_unit<VEC>(xr, threadIdx.x + j * TX, C, v[j], 0.f);
  if (ar)
#pragma unroll
    for (int j = 0; j < N; ++j) add_unit<VEC>(ar, sr, threadIdx.x + j * TX, C, v[j]);
#pragma unroll
  for (int j = 0; j < N; ++j)
#pragma unroll
    for (int i = 0; i < VEC; ++i) sum += v[j][i];
  float mean = 0.f;
  if (!RMS || ar)  // the tail's first pass: layernorm's sum, and the residual add
    for (int u = threadIdx.x + N * TX; u < units; u += TX) {
      float t[VEC];
      load_unit<VEC>(xr, u, C, t, 0.f);
      if (ar) add_unit<VEC>(ar, sr, u, C, t);
      for (int i = 0; i < VEC; ++i) sum += t[i];
    }
  if (!RMS) mean = row_reduce<TX, false>(sum, red) / C;
  float sq = 0.f;
#pragma unroll
  for (int j = 0; j < N; ++j)
    if ((threadIdx.x + j * TX) < units)
#pragma unroll
      for (int i = 0; i < VEC; ++i) { float d = v[j][i] - mean; sq += d * d; }
  for (int u = threadIdx.x + N * TX; u < units; u += TX) {
    float t[VEC];
    load_unit<VEC>(src, u, C, t, mean);
    for (int i = 0; i < VEC; ++i) { float d = t[i] - mean; sq += d * d; }
  }
  const float rstd = rsqrtf(row_reduce<TX, false>(sq, red) / C + eps);
  if (threadIdx.x == 0) {
    if (!RMS) mean_out[r] = mean;
    rstd_out[r] = rstd;
  }
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const int u = threadIdx.x + j * TX;
    float wv[VEC], bv[VEC] = {}, o[VEC];
    load_unit<VEC>(w, u, C, wv, 0.f);
    if (!RMS) load_unit<VEC>(b, u, C, bv, 0.f);
#pragma unroll
    for (int i = 0; i < VEC; ++i) o[i] = (v[j][i] - mean) * rstd * wv[i] + bv[i];
    store_unit<VEC>(yr, u, C, o);
  }
  for (int u = threadIdx.x + N * TX; u < units; u += TX) {
    float t[VEC], wv[VEC], bv[VEC] = {}, o[VEC];
    load_unit<VEC>(src, u, C, t, 0.f);
    load_unit<VEC>(w, u, C, wv, 0.f);
    if (!RMS) load_unit<VEC>(b, u, C, bv, 0.f);
    for (int i = 0; i < VEC; ++i) o[i] = (t[i] - mean) * rstd * wv[i] + bv[i];
    store_unit<VEC>(yr, u, C, o);
  }
}

template <int TX, int N, int VEC, class TI, class TO>
__global__ void __launch_bounds__(TX == 32 ? 128 : TX, 1) layernorm_fwd_kernel(const TI* __restrict__ x,
    const TO* __restrict__ addend, const TI* __restrict__ w, const TI* __restrict__ b, TO* __restrict__ y,
    TI* __restrict__ sum_out, float* mean_out, float* rstd_out, int R, int C, float eps) {
  norm_fwd_row<TX, N, VEC, false>(x, addend, w, b, y, sum_out, mean_out, rstd_out, R, C, eps);
}

template <int TX, int N, int VEC, class TI, class TO>
__global__ void __launch_bounds__(TX == 32 ? 128 : TX, 1) rmsnorm_fwd_kernel(const TI* __restrict__ x,
    const TO* __restrict__ addend, const TI* __restrict__ w, TO* __restrict__ y, TI* __restrict__ sum_out,
    float* rstd_out, int R, int C, float eps) {
  norm_fwd_row<TX, N, VEC, true>(x, addend, w, (const TI*)nullptr, y, sum_out, nullptr, rstd_out, R, C, eps);
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * w, xhat = (x - mean) * rstd.
// RMSNorm: dx = rstd * (g - xhat * mean(g * xhat)), xhat = x * rstd (the mean(g) term comes from
// the subtracted mean, which RMSNorm does not have). With the residual add, x is the saved sum, dsum
// (if any) is added to dx, and daddend (if any) gets dx again in the addend's dtype.
//
// The weight and bias gradients, dw = sum over rows of dy * xhat and db = sum of dy, are made of
// values this pass already holds in registers, so it adds them up as well: each block walks its rows
// (blockIdx.x * rows_per_block + y, then a grid's worth further on), keeps its column sums (NormSums:
// in registers or shared memory) and writes them as one partial row; colsum_finish adds the partial
// rows in a fixed order (same bits every run). A second pass over x and dy for them read 37 MB more
// per norm of the large preset. Rows of over 2048 units (C > 8192 with 4-wide loads, C > 2048
// without), which take 1024 threads, keep two passes: this kernel for dx, then colsum_launch.
template <class TI, class TO>
struct NormBwdArgs {
  const TI* x;         // the normalized input: the saved sum, with the add
  const TI* w;
  const TO* dy;
  const float* mean;   // null for RMSNorm
  const float* rstd;
  const TI* dsum;      // gradient reaching the sum from downstream, or null
  TI* dx;
  TO* daddend;         // dx again in the addend's dtype, or null
  float* part_w;       // gridDim.x partial rows of C, or null: dx alone
  float* part_b;       // the same for the bias; null for RMSNorm
  int R, C;
};

// Where the backward keeps its column sums while it walks rows. A block a row (256 threads): each
// thread its own columns' sums, in registers. A warp a row: each warp in its own slice of shared
// memory, each column read and written by the one thread that owns it (no barrier until the end); in
// registers they would cost the warp-a-row kernel registers, and so resident warps. 1024 threads a row: none (64 registers a thread leave no room; a
// second pass adds them).
enum NormSums { kSumsNone, kSumsRegs, kSumsShared };
__host__ __device__ constexpr NormSums norm_sums(int tx) {
  return tx == 1024 ? kSumsNone : tx == 256 ? kSumsRegs : kSumsShared;
}

// Row r: dx, and its dy * xhat and dy added to this thread's column sums (units u = x + j * TX): in
// aw, ab, or at [u * VEC + i] and [SLICE + u * VEC + i] of its warp's slice of shared memory, sw.
template <int TX, int N, int VEC, bool RMS, NormSums SUMS, class TI, class TO>
__device__ __forceinline__ void norm_bwd_row(const NormBwdArgs<TI, TO>& a, int r, float* red, float (&aw)[N][VEC],
                                             float (&ab)[N][VEC], float* sw) {
  constexpr int SLICE = 32 * N * VEC;
  const int C = a.C, units = (C + VEC - 1) / VEC;
  const TI* xr = a.x + (int64_t)r * C;
  const TO* dyr = a.dy + (int64_t)r * C;
  const float mean = RMS ? 0.f : a.mean[r], rstd = a.rstd[r];
  float xh[N][VEC], g[N][VEC];
  float sg = 0.f, sgx = 0.f;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const int u = threadIdx.x + j * TX;
    float wv[VEC];
    load_unit<VEC>(xr, u, C, xh[j], mean);  // units past C: xhat 0, dy 0
    load_unit<VEC>(dyr, u, C, g[j], 0.f);
    load_unit<VEC>(a.w, u, C, wv, 0.f);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      xh[j][i] = (xh[j][i] - mean) * rstd;
      if constexpr (SUMS == kSumsRegs) {
        aw[j][i] += g[j][i] * xh[j][i];
        if (!RMS) ab[j][i] += g[j][i];
      } else if constexpr (SUMS == kSumsShared) {
        sw[u * VEC + i] += g[j][i] * xh[j][i];
        if (!RMS) sw[SLICE + u * VEC + i] += g[j][i];
      }
      g[j][i] *= wv[i];
      sg += g[j][i];
      sgx += g[j][i] * xh[j][i];
    }
  }
  for (int u = threadIdx.x + N * TX; u < units; u += TX) {  // the tail (1024 threads: no column sums)
    float xv[VEC], dv[VEC], wv[VEC];
    load_unit<VEC>(xr, u, C, xv, mean);
    load_unit<VEC>(dyr, u, C, dv, 0.f);
    load_unit<VEC>(a.w, u, C, wv, 0.f);
    for (int i = 0; i < VEC; ++i) {
      float gi = dv[i] * wv[i];
      sg += gi;
      sgx += gi * (xv[i] - mean) * rstd;
    }
  }
  const float mg = RMS ? 0.f : row_reduce<TX, false>(sg, red) / C;
  const float mgx = row_reduce<TX, false>(sgx, red) / C;
  TI* dxr = a.dx + (int64_t)r * C;
  const TI* dsr = a.dsum ? a.dsum + (int64_t)r * C : nullptr;
  TO* dar = a.daddend ? a.daddend + (int64_t)r * C : nullptr;
  auto store_dx = [&](int u, float (&o)[VEC]) {
    if (dsr) {
      float d[VEC];
      load_unit<VEC>(dsr, u, C, d, 0.f);
#pragma unroll
      for (int i = 0; i < VEC; ++i) o[i] += d[i];
    }
    store_unit<VEC>(dxr, u, C, o);
    if (dar) store_unit<VEC>(dar, u, C, o);
  };
#pragma unroll
  for (int j = 0; j < N; ++j) {
    float o[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) o[i] = rstd * (g[j][i] - mg - xh[j][i] * mgx);
    store_dx(threadIdx.x + j * TX, o);
  }
  for (int u = threadIdx.x + N * TX; u < units; u += TX) {
    float xv[VEC], dv[VEC], wv[VEC], o[VEC];
    load_unit<VEC>(xr, u, C, xv, mean);
    load_unit<VEC>(dyr, u, C, dv, 0.f);
    load_unit<VEC>(a.w, u, C, wv, 0.f);
    for (int i = 0; i < VEC; ++i) o[i] = rstd * (dv[i] * wv[i] - mg - (xv[i] - mean) * rstd * mgx);
    store_dx(u, o);
  }
}

// Rows a block of the norm backward: a warp a row, 8 of them (4 where each thread caches 8 units),
// so that their slices of shared memory (2 x 32 x N x VEC floats each, half that for RMSNorm) take at
// most 32 KB; else a block a row.
__host__ __device__ constexpr int norm_bwd_rows(int tx, int n) { return tx == 32 ? (n == 8 ? 4 : 8) : 1; }

// A warp a row: at least 3 blocks (24 or 12 warps) an SM, which holds the 8-row kernel to 85 registers
// a thread; at 92 it kept 16 warps an SM, and each warp waits on a row's loads, reductions and stores.
template <int TX, int N, int VEC, bool RMS, class TI, class TO>
__global__ void __launch_bounds__(TX * norm_bwd_rows(TX, N), TX == 32 ? 3 : 1) norm_bwd_kernel(NormBwdArgs<TI, TO> a) {
  constexpr NormSums SUMS = norm_sums(TX);
  constexpr int ROWS = norm_bwd_rows(TX, N), SLICE = 32 * N * VEC, WARP_SLICES = RMS ? 1 : 2;  // dw (and db)
  __shared__ float red[32];
  __shared__ float slices[SUMS == kSumsShared ? ROWS * WARP_SLICES * SLICE : 1];
  float aw[N][VEC] = {}, ab[N][VEC] = {};
  float* sw = slices + (SUMS == kSumsShared ? threadIdx.y * WARP_SLICES * SLICE : 0);
  const int r0 = blockIdx.x * blockDim.y + threadIdx.y;
  if constexpr (SUMS == kSumsNone) {  // dx alone, a block for every row (a row loop here spilled registers)
    if (r0 < a.R) norm_bwd_row<TX, N, VEC, RMS, SUMS>(a, r0, red, aw, ab, sw);
  } else {  // rows a grid's worth apart, then the block's column sums as its partial row
    if constexpr (SUMS == kSumsShared)  // each thread zeroes the sums it adds to
#pragma unroll
      for (int k = 0; k < N * VEC; ++k) {
        const int c = (threadIdx.x + k / VEC * TX) * VEC + k % VEC;
        sw[c] = 0.f;
        if (!RMS) sw[SLICE + c] = 0.f;
      }
    for (int r = r0; r < a.R; r += gridDim.x * blockDim.y) norm_bwd_row<TX, N, VEC, RMS, SUMS>(a, r, red, aw, ab, sw);
    const int64_t row = (int64_t)blockIdx.x * a.C;
    if constexpr (SUMS == kSumsRegs) {
#pragma unroll
      for (int j = 0; j < N; ++j)
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const int c = (threadIdx.x + j * TX) * VEC + i;
          if (c >= a.C) continue;
          a.part_w[row + c] = aw[j][i];
          if (!RMS) a.part_b[row + c] = ab[j][i];
        }
    } else {  // the warps' slices added in warp order
      __syncthreads();
      for (int c = threadIdx.y * TX + threadIdx.x; c < a.C; c += ROWS * TX) {
        float w = 0.f, b = 0.f;
        for (int y = 0; y < ROWS; ++y) {
          w += slices[y * WARP_SLICES * SLICE + c];
          if (!RMS) b += slices[y * WARP_SLICES * SLICE + SLICE + c];
        }
        a.part_w[row + c] = w;
        if (!RMS) a.part_b[row + c] = b;
      }
    }
  }
}

// TI: x, the weights, dx and the residual sum (fp32 or bf16); TO: y, dy and the addend. Statistics and
// arithmetic are fp32. A null addend is the plain norm (sum_out unused). The backwards are further
// down, after the column sums they finish with.
template <class TI, class TO>
void launch::layernorm_fwd(const TI* x, const TO* addend, const TI* w, const TI* b, TO* y, TI* sum_out, float* mean,
                           float* rstd, int R, int C, float eps, cudaStream_t s) {
  if (R == 0) return;
  RowLaunch L = row_launch(C, aligned16(x) && aligned16(y) && aligned16(w) && aligned16(b) && aligned16(addend) &&
                                  aligned16(sum_out));
  LAUNCH_ROW(layernorm_fwd_kernel, (TI, TO), L, R, s, x, addend, w, b, y, sum_out, mean, rstd, R, C, eps);
  check_launch("layernorm_fwd");
}

template <class TI, class TO>
void launch::rmsnorm_fwd(const TI* x, const TO* addend, const TI* w, TO* y, TI* sum_out, float* rstd, int R, int C, float eps,
                         cudaStream_t s) {
  if (R == 0) return;
  RowLaunch L = row_launch(C, aligned16(x) && aligned16(y) && aligned16(w) && aligned16(addend) && aligned16(sum_out));
  LAUNCH_ROW(rmsnorm_fwd_kernel, (TI, TO), L, R, s, x, addend, w, y, sum_out, rstd, R, C, eps);
  check_launch("rmsnorm_fwd");
}

// ------------------------------------------------------------------------------------------------
// 3.3 column sums: the norms' weight and bias gradients
// Column sums (deterministic): dw = sum_rows dy * xhat, db = sum_rows dy for layernorm; dw alone
// for RMSNorm (mean == nullptr: xhat = x * rstd; db == nullptr: no bias); db alone for the bias
// gradient of linear (LN = false). Pass 1: each block sums a chunk of rows for 32 units of columns
// (VEC = 4 columns a unit when rows allow 4-wide loads, as in the row kernels) into a partial row;
// pass 2 adds the partial rows in a fixed order. No atomics, same bits every run. The row loop
// loads four rows before it adds any: one narrow load at a time leaves the kernel waiting on memory.
//
// Twin: the weight and bias gradients of 3.2's twins. Uses: 1.2, 1.3.

template <bool LN, int VEC, class TG, class TX>
__global__ void __launch_bounds__(256) colsum_partial_kernel(const TG* dy, const TX* x, const float* mean,
                                                              const float* rstd, float* part_w, float* part_b, int R,
                                                              int C, int chunk) {
  __shared__ float sw[8][VEC][33], sb[8][VEC][33];
  const int u = blockIdx.x * 32 + threadIdx.x;  // this thread's unit of columns
  const int r0 = blockIdx.y * chunk, r1 = min(R, r0 + chunk);
  float aw[VEC] = {}, ab[VEC] = {};
  // Adds rows r, r + 8, ... (NR of them, all < r1) in that order.
  auto add_rows = [&](int r, auto nr) {
    constexpr int NR = decltype(nr)::value;
    float g[NR][VEC], xv[NR][VEC];
#pragma unroll
    for (int i = 0; i < NR; ++i) {
      load_unit<VEC>(dy + (int64_t)(r + 8 * i) * C, u, C, g[i], 0.f);
      if (LN) load_unit<VEC>(x + (int64_t)(r + 8 * i) * C, u, C, xv[i], 0.f);
    }
#pragma unroll
    for (int i = 0; i < NR; ++i) {
      const float mu = LN && mean ? mean[r + 8 * i] : 0.f, rs = LN ? rstd[r + 8 * i] : 0.f;
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        ab[v] += g[i][v];
        if (LN) aw[v] += g[i][v] * (xv[i][v] - mu) * rs;
      }
    }
  };
  if (u * VEC < C) {
    int r = r0 + threadIdx.y;
    for (; r + 24 < r1; r += 32) add_rows(r, std::integral_constant<int, 4>());
    for (; r < r1; r += 8) add_rows(r, std::integral_constant<int, 1>());
  }
#pragma unroll
  for (int v = 0; v < VEC; ++v) {
    sw[threadIdx.y][v][threadIdx.x] = aw[v];
    sb[threadIdx.y][v][threadIdx.x] = ab[v];
  }
  __syncthreads();
  if (threadIdx.y == 0) {
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      const int c = u * VEC + v;
      if (c >= C) break;
      float w = aw[v], b = ab[v];
      for (int i = 1; i < 8; ++i) { w += sw[i][v][threadIdx.x]; b += sb[i][v][threadIdx.x]; }
      if (LN) part_w[(int64_t)blockIdx.y * C + c] = w;
      if (part_b) part_b[(int64_t)blockIdx.y * C + c] = b;
    }
  }
}

// Pass 2 over 32 columns a block: thread row y adds partial rows y, y + 16, ..., then the 16 sums are
// added in order (one thread adding all ~180 partial rows of a column waited on each load in turn).
// blockIdx.y picks the sum: 0 part0 into out0, 1 part1 into out1 (a norm's weight and bias at once).
template <class T>
__global__ void __launch_bounds__(512) colsum_finish_kernel(const float* part0, T* out0, const float* part1, T* out1,
                                                             int nchunk, int C) {
  __shared__ float sum[16][33];
  const float* part = blockIdx.y ? part1 : part0;
  T* out = blockIdx.y ? out1 : out0;
  const int c = blockIdx.x * 32 + threadIdx.x;
  float acc = 0.f;
  if (c < C)
#pragma unroll 4
    for (int i = threadIdx.y; i < nchunk; i += 16) acc += part[(int64_t)i * C + c];
  sum[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    for (int i = 1; i < 16; ++i) acc += sum[i][threadIdx.x];
    out[c] = from_float<T>(acc);
  }
}

// out0 = the column sums of nchunk partial rows at part0, and out1 of those at part1 (if out1).
template <class T>
static void colsum_finish(const float* part0, T* out0, const float* part1, T* out1, int nchunk, int C,
                          cudaStream_t s) {
  colsum_finish_kernel<<<dim3(ceil_div(C, 32), out1 ? 2 : 1), dim3(32, 16), 0, s>>>(part0, out0, part1, out1, nchunk,
                                                                                    C);
  check_launch("colsum_finish");
}

// Number of row chunks; the caller allocates nchunk * C floats per partial buffer. About 4 blocks
// per SM when the columns go 4 to a thread (128 to a block).
int launch::colsum_chunks(int R, int C) {
  if (R <= 0 || C <= 0) return 1;
  int colblocks = ceil_div(C, 128);
  int want = std::max(1, 4 * num_sms() / colblocks);
  int nchunk = std::min(std::max(1, ceil_div(R, 32)), want);
  int chunk = ceil_div(R, nchunk);
  return std::max(1, ceil_div(R, chunk));
}

// dy of type TG, x and the sums of type TX. ln: dw (part_w, from x) and db (part_b, if db) as the norm
// backward wants them; else db alone.
template <class TG, class TX>
static void colsum_launch(bool ln, const TG* dy, const TX* x, const float* mean, const float* rstd, float* part_w,
                          float* part_b, TX* dw, TX* db, int R, int C, cudaStream_t s) {
  if (C == 0) return;
  int nchunk = launch::colsum_chunks(R, C);
  int chunk = R == 0 ? 1 : ceil_div(R, nchunk);
  const bool vec = C % 4 == 0 && aligned16(dy) && aligned16(x);
  const dim3 grid(ceil_div(C, vec ? 128 : 32), nchunk), block(32, 8);
  if (ln && vec) colsum_partial_kernel<true, 4><<<grid, block, 0, s>>>(dy, x, mean, rstd, part_w, part_b, R, C, chunk);
  else if (ln) colsum_partial_kernel<true, 1><<<grid, block, 0, s>>>(dy, x, mean, rstd, part_w, part_b, R, C, chunk);
  else if (vec) colsum_partial_kernel<false, 4><<<grid, block, 0, s>>>(dy, x, mean, rstd, part_w, part_b, R, C, chunk);
  else colsum_partial_kernel<false, 1><<<grid, block, 0, s>>>(dy, x, mean, rstd, part_w, part_b, R, C, chunk);
  check_launch("colsum_partial");
  if (ln) colsum_finish(part_w, dw, part_b, db, nchunk, C, s);
  else colsum_finish(part_b, db, (const float*)nullptr, (TX*)nullptr, nchunk, C, s);
}

// The norm backward's shape: the forward's, with norm_bwd_rows rows a block.
static RowLaunch norm_bwd_shape(int C, bool vec_ok) {
  RowLaunch L = row_launch(C, vec_ok);
  L.ty = norm_bwd_rows(L.tx, L.n);
  return L;
}

// Blocks of kernel resident on one SM at `threads` a block (the same for every launch of it).
template <auto kernel>
static int resident_blocks(int threads) {
  return once_per_device([threads](int) {
    int n = 0;
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, 0) == cudaSuccess && n > 0 ? n : 1;
  });
}

// Blocks (so partial rows) the fused backward launches for this shape: one per block slot of the GPU,
// at most one per row group.
template <bool RMS, class TI, class TO>
static int norm_bwd_blocks(int R, const RowLaunch& L) {
  int per_sm = 1;
  with_row_shape(L, [&](auto tx, auto n, auto vec) {
    per_sm = resident_blocks<norm_bwd_kernel<decltype(tx)::value, decltype(n)::value, decltype(vec)::value, RMS,
                                             TI, TO>>(L.tx * L.ty);
  });
  return std::max(1, std::min(ceil_div(R, L.ty), num_sms() * per_sm));
}

// Floats of workspace the norm backward takes: two partial sums (weight, bias), either path.
template <class TI, class TO>
int64_t launch::norm_bwd_workspace_floats(bool rms, int R, int C) {
  int rows = launch::colsum_chunks(R, C);
  for (bool vec : {false, true}) {
    const RowLaunch L = norm_bwd_shape(C, vec);
    if (L.tx < 1024) rows = std::max(rows, rms ? norm_bwd_blocks<true, TI, TO>(R, L) : norm_bwd_blocks<false, TI, TO>(R, L));
  }
  return 2 * (int64_t)rows * C;
}

// The norm backward: dx, and dw (and db unless RMS) through the partial rows in ws.
template <bool RMS, class TI, class TO>
static void norm_bwd(NormBwdArgs<TI, TO> a, TI* dw, TI* db, float* ws, cudaStream_t s) {
  if (a.C == 0) return;
  const RowLaunch L = norm_bwd_shape(a.C, aligned16(a.x) && aligned16(a.dy) && aligned16(a.w) && aligned16(a.dx) &&
                                              aligned16(a.dsum) && aligned16(a.daddend));
  const bool fused = L.tx < 1024;  // as norm_bwd_kernel decides; its column sums skip a row's tail
  if (fused && (int64_t)L.n * L.tx * L.vec < a.C) throw std::logic_error("norm_bwd: a fused row shape leaves a tail");
  const int blocks = fused ? norm_bwd_blocks<RMS, TI, TO>(a.R, L) : ceil_div(a.R, L.ty);
  if (fused) {
    a.part_w = ws;
    a.part_b = RMS ? nullptr : ws + (int64_t)blocks * a.C;
  }
  with_row_shape(L, [&](auto tx, auto n, auto vec) {
    const auto kernel = norm_bwd_kernel<decltype(tx)::value, decltype(n)::value, decltype(vec)::value, RMS, TI, TO>;
    if (blocks > 0) kernel<<<blocks, dim3(L.tx, L.ty), 0, s>>>(a);
  });
  check_launch(RMS ? "rmsnorm_bwd" : "layernorm_bwd");
  if (fused) {
    colsum_finish(a.part_w, dw, a.part_b, db, blocks, a.C, s);
  } else {
    const int nchunk = launch::colsum_chunks(a.R, a.C);
    colsum_launch<TO, TI>(true, a.dy, a.x, a.mean, a.rstd, ws, RMS ? nullptr : ws + (int64_t)nchunk * a.C, dw, db,
                          a.R, a.C, s);
  }
}

// x, w, dx, the sum's gradients and dw, db of type TI; dy and daddend of type TO (as in
// layernorm_fwd<TI, TO>). ws: norm_bwd_workspace_floats(R, C) floats.
template <class TI, class TO>
void launch::layernorm_bwd(const TI* x, const TI* w, const TO* dy, const float* mean, const float* rstd, const TI* dsum,
                           TI* dx, TO* daddend, TI* dw, TI* db, float* ws, int R, int C, cudaStream_t s) {
  norm_bwd<false>(NormBwdArgs<TI, TO>{x, w, dy, mean, rstd, dsum, dx, daddend, nullptr, nullptr, R, C}, dw, db, ws, s);
}

template <class TI, class TO>
void launch::rmsnorm_bwd(const TI* x, const TI* w, const TO* dy, const float* rstd, const TI* dsum, TI* dx, TO* daddend,
                         TI* dw, float* ws, int R, int C, cudaStream_t s) {
  norm_bwd<true>(NormBwdArgs<TI, TO>{x, w, dy, nullptr, rstd, dsum, dx, daddend, nullptr, nullptr, R, C}, dw,
                 (TI*)nullptr, ws, s);
}

// dy of type TG, db of type TD: the same, or a bf16 dy summed into an fp32 db (a master bias's gradient).
template <class TG, class TD>
void launch::bias_grad(const TG* dy, float* part, TD* db, int R, int C, cudaStream_t s) {
  colsum_launch<TG, TD>(false, dy, nullptr, nullptr, nullptr, nullptr, part, nullptr, db, R, C, s);
}
template void launch::bias_grad<float, float>(const float*, float*, float*, int, int, cudaStream_t);
ONE_TEMPLATE(bias_grad<float, float>);
template void launch::bias_grad<__nv_bfloat16, __nv_bfloat16>(const __nv_bfloat16*, float*, __nv_bfloat16*, int, int,
                                                              cudaStream_t);
ONE_TEMPLATE(bias_grad<__nv_bfloat16, __nv_bfloat16>);
template void launch::bias_grad<__nv_bfloat16, float>(const __nv_bfloat16*, float*, float*, int, int, cudaStream_t);
ONE_TEMPLATE(bias_grad<__nv_bfloat16, float>);

#define INSTANTIATE_NORMS(TI, TO)                                                                                        \
  template void launch::layernorm_fwd<TI, TO>(const TI*, const TO*, const TI*, const TI*, TO*, TI*, float*, float*, int, \
                                              int, float, cudaStream_t);                                                         \
  ONE_TEMPLATE(layernorm_fwd<TI, TO>);                                                                                   \
  template void launch::layernorm_bwd<TI, TO>(const TI*, const TI*, const TO*, const float*, const float*, const TI*,    \
                                              TI*, TO*, TI*, TI*, float*, int, int, cudaStream_t);                               \
  ONE_TEMPLATE(layernorm_bwd<TI, TO>);                                                                                   \
  template void launch::rmsnorm_fwd<TI, TO>(const TI*, const TO*, const TI*, TO*, TI*, float*, int, int, float,          \
                                            cudaStream_t);                                                                       \
  ONE_TEMPLATE(rmsnorm_fwd<TI, TO>);                                                                                     \
  template void launch::rmsnorm_bwd<TI, TO>(const TI*, const TI*, const TO*, const float*, const TI*, TI*, TO*, TI*,     \
                                            float*, int, int, cudaStream_t);                                                     \
  ONE_TEMPLATE(rmsnorm_bwd<TI, TO>);                                                                                     \
  template int64_t launch::norm_bwd_workspace_floats<TI, TO>(bool, int, int);                                            \
  ONE_TEMPLATE(norm_bwd_workspace_floats<TI, TO>);
FOR_ROW_TYPES(INSTANTIATE_NORMS)
#undef INSTANTIATE_NORMS

// ================================================================================================
// 4. Embedding and cross-entropy
// The ops that take indices on the device: bad ones go to the mailbox (1.4).
// ================================================================================================

// ------------------------------------------------------------------------------------------------
// 4.1 embedding
// Embedding: out[t, :] = weight[idx[t], :]. An index outside [0, V) gives a NaN row and goes to the
// error mailbox (1.4).
//
// The backward is deterministic: the same inputs give bitwise the same dweight, run after run (atomic
// adds would sum a repeated row in whatever order the adds land, so two runs of one training step
// would differ in the last bits and a diverging run could not be replayed). The (index, position)
// pairs are sorted by index with CUB's radix sort, which is stable, so each run of equal indices
// lists its positions in token order; each run's dout rows are then summed in that order. For
// parallelism the sorted list is cut into chunks of EMB_CHUNK positions, one block per chunk (and
// column tile): a run inside a chunk is summed and written at once; a run that crosses chunks has
// each chunk's piece written to a workspace, and a second kernel adds the pieces, in chunk order,
// into the row. Every row is written by exactly one thread per column: no atomics, no races.
// padding_idx (F.embedding's, >= 0; -1: none) names a row that gets no gradient: its positions take
// the key of a bad index and are dropped with them.
//
// Twin: F.embedding. Uses: 1.2, 1.4, CUB's radix sort.

constexpr int EMB_CHUNK = 32;

// Threads per row (x) and rows per block (y) for copying rows of `units` VEC-float units.
static dim3 embedding_block(int units) {
  const int tx = units >= 256 ? 256 : ((units + 31) / 32) * 32;
  return dim3(tx, std::max(1, 256 / tx));
}

template <int VEC, class T>
__global__ void embedding_fwd_kernel(const int64_t* idx, const T* weight, T* out, int64_t T_, int64_t V, int C,
                                     IndexErrorBox* box) {
  pdl_begin();
  const int64_t t = (int64_t)blockIdx.x * blockDim.y + threadIdx.y;
  if (t >= T_) return;
  const int64_t row = idx[t];
  const bool ok = row >= 0 && row < V;
  if (!ok && threadIdx.x == 0) report_bad_index(box, kBadEmbeddingIdx, row, V);
  const T* src = weight + row * C;
  T* dst = out + t * C;
  const int units = C / VEC;
  for (int u = threadIdx.x; u < units; u += blockDim.x) {
    float v[VEC];
    if (ok) load_unit<VEC>(src, u, C, v, 0.f);
    else
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[i] = NAN;
    store_unit<VEC>(dst, u, C, v);
  }
}

// weight and out of type T, fp32 or bf16 (a copy: bf16 rows stay exact).
template <class T>
void launch::embedding_fwd(const int64_t* idx, const T* weight, T* out, int64_t T_, int64_t V, int C, cudaStream_t s) {
  if (T_ == 0 || C == 0) return;
  const bool vec = C % 4 == 0 && aligned16(weight) && aligned16(out);
  const dim3 block = embedding_block(vec ? C / 4 : C);
  const unsigned grid = (unsigned)ceil_div(T_, block.y);
  IndexErrorBox* box = index_error_box();
  if (vec) launch_pdl(embedding_fwd_kernel<4, T>, dim3(grid), block, 0, s, idx, weight, out, T_, V, C, box);
  else launch_pdl(embedding_fwd_kernel<1, T>, dim3(grid), block, 0, s, idx, weight, out, T_, V, C, box);
  check_launch("embedding_fwd");
}
template void launch::embedding_fwd<float>(const int64_t*, const float*, float*, int64_t, int64_t, int, cudaStream_t);
ONE_TEMPLATE(embedding_fwd<float>);
template void launch::embedding_fwd<__nv_bfloat16>(const int64_t*, const __nv_bfloat16*, __nv_bfloat16*, int64_t, int64_t,
                                                   int, cudaStream_t);
ONE_TEMPLATE(embedding_fwd<__nv_bfloat16>);

// Sort keys: the index, or V for a bad one or padding_idx (it sorts last and is dropped); values: the position.
__global__ void embedding_sort_keys_kernel(const int64_t* idx, unsigned* keys, int* pos, int T, int64_t V,
                                           int64_t padding_idx) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= T) return;
  const int64_t row = idx[t];
  keys[t] = row >= 0 && row < V && row != padding_idx ? (unsigned)row : (unsigned)V;
  pos[t] = t;
}

// One chunk of sorted positions (blockIdx.x), one unit of columns a thread in the column tiles blockIdx.y,
// blockIdx.y + gridDim.y, ... (grid.y stops at 65535 tiles, 16.8M units).
// For each run of equal keys in the chunk, the sum of its dout rows in order goes to dweight (the run
// lies inside the chunk), to part[chunk][0] (the run began in an earlier chunk) or to part[chunk][1]
// (the run begins here and goes on into the next chunk).
template <int VEC>
__global__ void __launch_bounds__(256) embedding_bwd_chunk_kernel(const unsigned* keys, const int* pos,
                                                                   const float* dout, float* dweight, float* part,
                                                                   int T, unsigned V, int C) {
  __shared__ unsigned key[EMB_CHUNK + 2];  // key[0]: the one before the chunk, key[n + 1]: the one after
  __shared__ int row[EMB_CHUNK];
  const int c0 = blockIdx.x * EMB_CHUNK, n = min(EMB_CHUNK, T - c0);
  const unsigned none = 0xffffffffu;  // no key: V <= 2^31 - 1, so every real key and V are smaller
  for (int i = threadIdx.x; i < n + 2; i += blockDim.x) {
    const int p = c0 + i - 1;
    key[i] = p >= 0 && p < T ? keys[p] : none;
    if (i >= 1 && i <= n) row[i - 1] = pos[p];
  }
  __syncthreads();
  const int64_t step = (int64_t)gridDim.y * blockDim.x;
  for (int64_t uu = (int64_t)blockIdx.y * blockDim.x + threadIdx.x; uu < C / VEC; uu += step) {
    const int u = (int)uu;  // VEC = 4 only where C % 4 == 0
    for (int a = 0; a < n;) {
      const unsigned k = key[a + 1];
      int b = a + 1;
      while (b < n && key[b + 1] == k) ++b;
      if (k < V) {
        float acc[VEC] = {};
#pragma unroll 8
        for (int r = a; r < b; ++r) {  // token order; the loads of several rows in flight at once
          float v[VEC];
          load_unit<VEC>(dout + (int64_t)row[r] * C, u, C, v, 0.f);
#pragma unroll
          for (int i = 0; i < VEC; ++i) acc[i] += v[i];
        }
        float* dst = a == 0 && key[0] == k        ? part + (int64_t)blockIdx.x * 2 * C
                     : b == n && key[n + 1] == k ? part + ((int64_t)blockIdx.x * 2 + 1) * C
                                                 : dweight + (int64_t)k * C;
        store_unit<VEC>(dst, u, C, acc);
      }
      a = b;
    }
  }
}

// The runs that cross chunks: the chunk where a run begins adds, in chunk order, the pieces the later
// chunks left in part, and writes the row.
template <int VEC>
__global__ void __launch_bounds__(256) embedding_bwd_runs_kernel(const unsigned* keys, const float* part,
                                                                  float* dweight, int T, unsigned V, int C) {
  const int c = blockIdx.x, c0 = c * EMB_CHUNK, c1 = c0 + EMB_CHUNK;
  if (c1 >= T) return;  // the last chunk: no run goes on past it
  const unsigned k = keys[c1 - 1];
  if (k >= V || keys[c1] != k) return;      // the chunk's last run ends inside it
  if (c0 > 0 && keys[c0 - 1] == k) return;  // the run began in an earlier chunk, which owns it
  int lo = c1, hi = T;                      // the run's end: the first position with a larger key
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (keys[mid] <= k) lo = mid + 1;
    else hi = mid;
  }
  const int last = (lo - 1) / EMB_CHUNK;  // the last chunk the run reaches
  const int64_t step = (int64_t)gridDim.y * blockDim.x;
  for (int64_t uu = (int64_t)blockIdx.y * blockDim.x + threadIdx.x; uu < C / VEC; uu += step) {
    const int u = (int)uu;  // column tiles as in embedding_bwd_chunk_kernel
    float acc[VEC];
    load_unit<VEC>(part + ((int64_t)c * 2 + 1) * C, u, C, acc, 0.f);
#pragma unroll 4
    for (int j = c + 1; j <= last; ++j) {
      float v[VEC];
      load_unit<VEC>(part + (int64_t)j * 2 * C, u, C, v, 0.f);
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[i] += v[i];
    }
    store_unit<VEC>(dweight + (int64_t)k * C, u, C, acc);
  }
}

// The backward's workspace, carved into: sort keys and positions (in and out), the chunk pieces, and
// CUB's temporary storage.
struct EmbeddingBwdWorkspace {
  unsigned *keys_in, *keys_out;
  int *pos_in, *pos_out;
  float* part;
  void* sort_tmp;
  size_t sort_bytes, total;
};

static int embedding_key_bits(int64_t V) {  // bits that hold every key 0..V (V marks a bad index)
  int bits = 1;
  while (bits < 32 && (1ll << bits) <= V) ++bits;
  return bits;
}

static EmbeddingBwdWorkspace embedding_bwd_carve(void* base, int T, int64_t V, int C) {
  EmbeddingBwdWorkspace w{};
  cub::DeviceRadixSort::SortPairs(nullptr, w.sort_bytes, (const unsigned*)nullptr, (unsigned*)nullptr,
                                  (const int*)nullptr, (int*)nullptr, T, 0, embedding_key_bits(V));
  char* p = static_cast<char*>(base);
  size_t off = 0;
  auto take = [&](size_t bytes) {
    void* at = p ? p + off : nullptr;
    off += (bytes + 255) / 256 * 256;
    return at;
  };
  w.keys_in = static_cast<unsigned*>(take(T * sizeof(unsigned)));
  w.keys_out = static_cast<unsigned*>(take(T * sizeof(unsigned)));
  w.pos_in = static_cast<int*>(take(T * sizeof(int)));
  w.pos_out = static_cast<int*>(take(T * sizeof(int)));
  w.part = static_cast<float*>(take((size_t)ceil_div(T, EMB_CHUNK) * 2 * C * sizeof(float)));
  w.sort_tmp = take(w.sort_bytes);
  w.total = off;
  return w;
}

size_t launch::embedding_bwd_workspace_bytes(int T, int64_t V, int C) {
  return T == 0 || C == 0 ? 0 : embedding_bwd_carve(nullptr, T, V, C).total;
}

// dweight (V, C) must be zeroed by the caller (rows no index names stay zero, and padding_idx's); V <= 2^31 - 1.
void launch::embedding_bwd(const int64_t* idx, const float* dout, float* dweight, int T, int64_t V, int C,
                           int64_t padding_idx, void* workspace, cudaStream_t s) {
  if (T == 0 || C == 0) return;
  const EmbeddingBwdWorkspace w = embedding_bwd_carve(workspace, T, V, C);
  embedding_sort_keys_kernel<<<ceil_div(T, 256), 256, 0, s>>>(idx, w.keys_in, w.pos_in, T, V, padding_idx);
  check_launch("embedding_bwd_keys");
  size_t sort_bytes = w.sort_bytes;
  const cudaError_t err = cub::DeviceRadixSort::SortPairs(w.sort_tmp, sort_bytes, w.keys_in, w.keys_out, w.pos_in,
                                                          w.pos_out, T, 0, embedding_key_bits(V), s);
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("embedding_bwd: sort failed: ") + cudaGetErrorString(err));
  const bool vec = C % 4 == 0 && aligned16(dout) && aligned16(dweight);
  const int units = vec ? C / 4 : C;
  const dim3 block(embedding_block(units).x);
  const dim3 grid(ceil_div(T, EMB_CHUNK), std::min(ceil_div(units, block.x), 65535));  // grid.y limit
  if (vec) {
    embedding_bwd_chunk_kernel<4><<<grid, block, 0, s>>>(w.keys_out, w.pos_out, dout, dweight, w.part, T,
                                                          (unsigned)V, C);
    embedding_bwd_runs_kernel<4><<<grid, block, 0, s>>>(w.keys_out, w.part, dweight, T, (unsigned)V, C);
  } else {
    embedding_bwd_chunk_kernel<1><<<grid, block, 0, s>>>(w.keys_out, w.pos_out, dout, dweight, w.part, T,
                                                          (unsigned)V, C);
    embedding_bwd_runs_kernel<1><<<grid, block, 0, s>>>(w.keys_out, w.part, dweight, T, (unsigned)V, C);
  }
  check_launch("embedding_bwd");
}
// ------------------------------------------------------------------------------------------------
// 4.2 cross-entropy
// Cross-entropy over rows of logits (R, V) with int64 targets: per-row loss = lse - x[target],
// then a single-block mean in a fixed order. A row whose target is ignore_index (F.cross_entropy's;
// Hugging Face pads labels with -100) is skipped: loss 0 (lse 0, unread), not counted. The mean is
// over the kept rows, counted in the same block (as a float, exact below 2^24 rows) and written to
// `kept` for the backward; with none kept it is 0/0 = NaN, as PyTorch's. Backward:
// (softmax - onehot) * dloss / kept, dloss and kept read from device memory so that no host sync is
// needed; an ignored row's gradient is exactly zero, its logits unread (PyTorch's is NaN where they hold
// a NaN or inf). A target outside [0, V), not ignore_index, gives that row a NaN loss (so the mean
// is NaN) and NaN gradients, and goes to the error mailbox.
//
// Twin: F.cross_entropy. Uses: 1.2 row_reduce, 1.3, 1.4.

template <int TX, int N, int VEC, class T>
__global__ void __launch_bounds__(TX == 32 ? 128 : TX, 1) cross_entropy_fwd_kernel(const T* x, const int64_t* tgt,
    int64_t ignore_index, float* lse_out, float* loss_rows, int R, int C, IndexErrorBox* box) {
  __shared__ float red[32];
  pdl_begin();
  const int r = blockIdx.x * blockDim.y + threadIdx.y;
  if (r >= R) return;
  const int64_t target = tgt[r];
  if (target == ignore_index) {  // the whole row (a warp, or the block) leaves together
    if (threadIdx.x == 0) lse_out[r] = loss_rows[r] = 0.f;
    return;
  }
  const T* xr = x + (int64_t)r * C;
  const int units = (C + VEC - 1) / VEC;
  float v[N][VEC];
  float mx = -INFINITY;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    load_unit<VEC>(xr, threadIdx.x + j * TX, C, v[j], -INFINITY);
#pragma unroll
    for (int i = 0; i < VEC; ++i) mx = fmaxf(mx, v[j][i]);
  }
  for (int u = threadIdx.x + N * TX; u < units; u += TX) {
    float t[VEC];
    load_unit<VEC>(xr, u, C, t, -INFINITY);
    for (int i = 0; i < VEC; ++i) mx = fmaxf(mx, t[i]);
  }
  mx = row_reduce<TX, true>(mx, red);
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < N; ++j)
#pragma unroll
    for (int i = 0; i < VEC; ++i) sum += expf(v[j][i] - mx);
  for (int u = threadIdx.x + N * TX; u < units; u += TX) {
    float t[VEC];
    load_unit<VEC>(xr, u, C, t, -INFINITY);
    for (int i = 0; i < VEC; ++i) sum += expf(t[i] - mx);
  }
  sum = row_reduce<TX, false>(sum, red);
  if (threadIdx.x == 0) {
    const float lse = mx + logf(sum);
    const bool ok = target >= 0 && target < C;
    if (!ok) report_bad_index(box, kBadCrossEntropyTarget, target, C);
    lse_out[r] = lse;
    loss_rows[r] = ok ? lse - to_float(xr[target]) : NAN;
  }
}

// The mean over the kept rows, and their count, in one block: the same order every run.
__global__ void cross_entropy_mean_kernel(const float* loss_rows, const int64_t* tgt, int64_t ignore_index,
                                          float* loss, float* kept, int n) {
  __shared__ float red[32];
  float acc = 0.f;
  int count = 0;
  for (int i = threadIdx.x; i < n; i += 1024) {
    if (tgt[i] == ignore_index) continue;
    acc += loss_rows[i];
    ++count;
  }
  acc = row_reduce<1024, false>(acc, red);
  const float total = row_reduce<1024, false>((float)count, red);
  if (threadIdx.x == 0) {
    *loss = acc / total;
    *kept = total;
  }
}

template <int TX, int N, int VEC, class T>
__global__ void __launch_bounds__(TX == 32 ? 128 : TX, 1) cross_entropy_bwd_kernel(const T* x, const int64_t* tgt,
    int64_t ignore_index, const float* lse_in, const float* kept, const float* dloss, T* dx, int R, int C) {
  pdl_begin();
  const int r = blockIdx.x * blockDim.y + threadIdx.y;
  if (r >= R) return;
  const T* xr = x + (int64_t)r * C;
  T* dxr = dx + (int64_t)r * C;
  const int units = (C + VEC - 1) / VEC;
  const int64_t t = tgt[r];
  if (t == ignore_index) {  // no loss, no gradient
    const float zero[VEC] = {};
    for (int u = threadIdx.x; u < units; u += TX) store_unit<VEC>(dxr, u, C, zero);
    return;
  }
  const float lse = lse_in[r], g = t >= 0 && t < C ? *dloss / *kept : NAN;  // a bad target: NaN, like its loss
  for (int u = threadIdx.x; u < units; u += TX) {
    float v[VEC], o[VEC];
    load_unit<VEC>(xr, u, C, v, 0.f);
#pragma unroll
    for (int i = 0; i < VEC; ++i) o[i] = g * (expf(v[i] - lse) - (u * VEC + i == t ? 1.f : 0.f));
    store_unit<VEC>(dxr, u, C, o);
  }
}

// logits and dx of type T (fp32 or bf16); loss_rows and lse are R-float workspaces; loss and kept one float each.
template <class T>
void launch::cross_entropy_fwd(const T* x, const int64_t* tgt, int64_t ignore_index, float* lse, float* loss_rows,
                               float* loss, float* kept, int R, int C, cudaStream_t s) {
  RowLaunch L = row_launch(C, aligned16(x));
  LAUNCH_ROW(cross_entropy_fwd_kernel, (T), L, R, s, x, tgt, ignore_index, lse, loss_rows, R, C, index_error_box());
  check_launch("cross_entropy_fwd");
  cross_entropy_mean_kernel<<<1, 1024, 0, s>>>(loss_rows, tgt, ignore_index, loss, kept, R);
  check_launch("cross_entropy_mean");
}

template <class T>
void launch::cross_entropy_bwd(const T* x, const int64_t* tgt, int64_t ignore_index, const float* lse,
                               const float* kept, const float* dloss, T* dx, int R, int C, cudaStream_t s) {
  RowLaunch L = row_launch(C, aligned16(x) && aligned16(dx));
  LAUNCH_ROW(cross_entropy_bwd_kernel, (T), L, R, s, x, tgt, ignore_index, lse, kept, dloss, dx, R, C);
  check_launch("cross_entropy_bwd");
}

#define INSTANTIATE_CROSS_ENTROPY(T)                                                                          \
  template void launch::cross_entropy_fwd<T>(const T*, const int64_t*, int64_t, float*, float*, float*, float*, \
                                             int, int, cudaStream_t);                                        \
  ONE_TEMPLATE(cross_entropy_fwd<T>);                                                                         \
  template void launch::cross_entropy_bwd<T>(const T*, const int64_t*, int64_t, const float*, const float*,     \
                                             const float*, T*, int, int, cudaStream_t);                      \
  ONE_TEMPLATE(cross_entropy_bwd<T>);
INSTANTIATE_CROSS_ENTROPY(float)
INSTANTIATE_CROSS_ENTROPY(__nv_bfloat16)
#undef INSTANTIATE_CROSS_ENTROPY

// ================================================================================================
// 5. Decoding: GEMV, KV cache, top-k
// Batch-1 work, bound by reading the weights or the row once.
// ================================================================================================

// ------------------------------------------------------------------------------------------------
// 5.1 GEMV
// GEMV for decoding: y = W x (+ b), W row-major N x K. Bound by reading W once, so the kernel is
// about keeping enough loads in flight: a warp reads a K-slice of one row with 16-byte loads (when
// K % 4 == 0), eight per lane issued before they are used; a row is cut into KSPLIT slices when the
// matrix has too few rows to give every SM ~32 warps (a 768 x 768 projection has 768 rows for 132
// SMs), and the slices' partial sums are added in shared memory in a fixed order.
// Batched for mixture-of-experts decoding: grid.y = S vectors, vector s multiplied by expert
// experts[s] of a stack W (E, N, K), b (E, N). The index is read on the device, so a decode step
// needs no host sync to pick its experts; an index outside [0, E) gives a NaN row and goes to the
// error mailbox.
//
// Twin: torch.mv / addmv, train.torch_expert_gemv. Uses: 1.1 launch_pdl, 1.2, 1.4.

constexpr int GEMV_WARPS = 8;

// Sum of the products of 16 bytes of w and of x (4 fp32 or 8 bf16 values each), added in order.
template <class T>
__device__ __forceinline__ float dot16(const float4& w_raw, const float4& x_raw) {
  float w[per16<T>()], x[per16<T>()], acc = 0.f;
  unpack16(w_raw, w);
  unpack16(x_raw, x);
#pragma unroll
  for (int i = 0; i < per16<T>(); ++i) acc += w[i] * x[i];
  return acc;
}

// T: W, x, bias and y, fp32 or bf16 (bf16 halves the bytes per row); the sums are fp32.
// Launched with launch_pdl, it waits for the kernel upstream before anything else. It does not ask L2
// for its weights before that wait (prefetch.global.L2): in graphed decoding that slowed the step.
template <bool VEC, int KSPLIT, class T>
__global__ void __launch_bounds__(32 * GEMV_WARPS) gemv_kernel(const T* W, const T* x, const T* bias, T* y, int N,
                                                                int K, const int64_t* experts, int64_t E,
                                                                IndexErrorBox* box) {
  __shared__ float part[GEMV_WARPS];
  pdl_begin();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row = blockIdx.x * (GEMV_WARPS / KSPLIT) + warp / KSPLIT, slice = warp % KSPLIT;
  const int s = blockIdx.y;
  const int64_t e = experts ? experts[s] : 0;
  const bool expert_ok = e >= 0 && e < E, ok = row < N && expert_ok;
  if (!expert_ok && blockIdx.x == 0 && threadIdx.x == 0) report_bad_index(box, kBadExpert, e, E);
  float acc = 0.f;
  if (ok) {
    const T* w = W + (e * N + row) * (int64_t)K;
    const T* xs = x + (int64_t)s * K;
    const int units = VEC ? K / per16<T>() : K;  // 16-byte units (VEC) or single values
    const int per = (units + KSPLIT - 1) / KSPLIT, u0 = slice * per, u1 = min(units, u0 + per);
    int u = u0 + lane;
    if (VEC) {
      const float4* w4 = reinterpret_cast<const float4*>(w);
      const float4* x4 = reinterpret_cast<const float4*>(xs);
      for (; u + 32 * 7 < u1; u += 32 * 8) {
        float4 a[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) a[j] = __ldcs(w4 + u + 32 * j);  // all loads first: eight in flight per lane
#pragma unroll
        for (int j = 0; j < 8; ++j) acc += dot16<T>(a[j], x4[u + 32 * j]);
      }
#pragma unroll 4
      for (; u < u1; u += 32) acc += dot16<T>(__ldcs(w4 + u), x4[u]);
    } else {
#pragma unroll 8
      for (; u < u1; u += 32) acc += to_float(w[u]) * to_float(xs[u]);
    }
  }
  acc = warp_sum(acc);
  if (KSPLIT > 1) {
    if (lane == 0) part[warp] = acc;
    __syncthreads();
    if (slice != 0) return;
    acc = 0.f;
#pragma unroll
    for (int j = 0; j < KSPLIT; ++j) acc += part[warp + j];
  }
  if (lane == 0 && row < N)
    y[(int64_t)s * N + row] = from_float<T>(expert_ok ? acc + (bias ? to_float(bias[e * N + row]) : 0.f) : NAN);
}

// grid.y runs over the vectors and stops at 65535: more take further launches, each on its slice of x,
// y and experts (one launch at decoding's sizes).
template <bool VEC, int KSPLIT, class T>
static void gemv_launch(const T* W, const T* x, const T* bias, T* y, int N, int K, int S, const int64_t* experts,
                        int64_t E, IndexErrorBox* box, cudaStream_t s) {
  for (int s0 = 0; s0 < S; s0 += 65535) {
    const dim3 grid(ceil_div(N, GEMV_WARPS / KSPLIT), std::min(S - s0, 65535));
    launch_pdl(gemv_kernel<VEC, KSPLIT, T>, grid, dim3(32 * GEMV_WARPS), 0, s, W, x + (int64_t)s0 * K, bias,
               y + (int64_t)s0 * N, N, K, experts ? experts + s0 : nullptr, E, box);
  }
}

// y (S, N) = W[experts[s]] x[s] (+ b[experts[s]]); experts == nullptr: one matrix (E = 1), S vectors.
template <class T>
void launch::gemv(const T* W, const T* x, const T* bias, T* y, int N, int K, int S, const int64_t* experts, int64_t E,
                  cudaStream_t s) {
  if (N == 0 || S == 0) return;
  const bool vec = K % per16<T>() == 0 && aligned16(W) && aligned16(x);
  IndexErrorBox* box = experts ? index_error_box() : nullptr;
  // Slices per row: enough warps for ~32 per SM, each slice still at least a full warp of 16-byte loads.
  const int min_slice = 32 * per16<T>();
  int ksplit = 1;
  while (ksplit < GEMV_WARPS && (int64_t)N * S * ksplit < 32 * num_sms() && K / (ksplit * 2) >= min_slice) ksplit *= 2;
#define GEMV_CASE(KS)                                                              \
  case KS:                                                                         \
    if (vec) gemv_launch<true, KS, T>(W, x, bias, y, N, K, S, experts, E, box, s); \
    else gemv_launch<false, KS, T>(W, x, bias, y, N, K, S, experts, E, box, s);    \
    break;
  switch (ksplit) { GEMV_CASE(1) GEMV_CASE(2) GEMV_CASE(4) GEMV_CASE(8) }
#undef GEMV_CASE
  check_launch("gemv");
}
template void launch::gemv<float>(const float*, const float*, const float*, float*, int, int, int, const int64_t*, int64_t,
                                  cudaStream_t);
ONE_TEMPLATE(gemv<float>);
template void launch::gemv<__nv_bfloat16>(const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*, __nv_bfloat16*,
                                          int, int, int, const int64_t*, int64_t, cudaStream_t);
ONE_TEMPLATE(gemv<__nv_bfloat16>);

// ------------------------------------------------------------------------------------------------
// 5.2 KV cache write
// KV cache write for decoding: k and v (B, H, T, D), rows of this step's keys and values, go to rows
// positions[t] of the caches (B, H, S, D), in place; one kernel for both (index_copy_ twice in the
// torch op set), launched with launch_pdl like the attention that reads the caches next. A warp copies
// a row, in 16-byte units where the rows allow. A position outside [0, S) writes nothing and goes to
// the error mailbox.
//
// Twin: train.torch_kv_write. Uses: 1.1, 1.4.

template <class T>
struct KvWriteArgs {
  T *k_cache, *v_cache;       // (B, H, S, D) contiguous
  const T *k, *v;             // (B, H, T, D), last dim contiguous
  int64_t ksb, ksh, kst;      // k's strides (b, h, t); v's below
  int64_t vsb, vsh, vst;
  const int64_t* positions;   // (T,)
  int B, H, NT, S, D;         // NT: the T of k and v (tokens this call writes)
  IndexErrorBox* box;
};

template <int VEC, class T>
__global__ void __launch_bounds__(128) kv_write_kernel(KvWriteArgs<T> a) {
  pdl_begin();
  const int64_t row = (int64_t)blockIdx.x * blockDim.y + threadIdx.y;  // (b, h, t), t fastest
  if (row >= (int64_t)a.B * a.H * a.NT) return;
  const int t = row % a.NT, h = (row / a.NT) % a.H, b = row / ((int64_t)a.NT * a.H);
  const int64_t pos = a.positions[t];
  if (pos < 0 || pos >= a.S) {
    if (threadIdx.x == 0 && h == 0 && b == 0) report_bad_index(a.box, kBadCachePosition, pos, a.S);
    return;
  }
  const int64_t dst = (((int64_t)b * a.H + h) * a.S + pos) * a.D;
  const T* k = a.k + b * a.ksb + h * a.ksh + t * a.kst;
  const T* v = a.v + b * a.vsb + h * a.vsh + t * a.vst;
  for (int u = threadIdx.x; u < a.D / VEC; u += 32) {
    if constexpr (VEC == 1) {
      a.k_cache[dst + u] = k[u];
      a.v_cache[dst + u] = v[u];
    } else {
      reinterpret_cast<float4*>(a.k_cache + dst)[u] = reinterpret_cast<const float4*>(k)[u];
      reinterpret_cast<float4*>(a.v_cache + dst)[u] = reinterpret_cast<const float4*>(v)[u];
    }
  }
}

template <class T>
void launch::kv_write(T* k_cache, T* v_cache, const T* k, const T* v, const int64_t* k_strides, const int64_t* v_strides,
                      const int64_t* positions, int B, int H, int T_, int S, int D, cudaStream_t s) {
  const int64_t rows = (int64_t)B * H * T_;
  if (rows == 0 || D == 0) return;
  KvWriteArgs<T> a{k_cache, v_cache, k, v, k_strides[0], k_strides[1], k_strides[2], v_strides[0], v_strides[1],
                   v_strides[2], positions, B, H, T_, S, D, index_error_box()};
  constexpr int VEC = per16<T>();
  bool vec = D % VEC == 0 && aligned16(k_cache) && aligned16(v_cache) && aligned16(k) && aligned16(v);
  for (int i = 0; i < 3; ++i) vec = vec && k_strides[i] % VEC == 0 && v_strides[i] % VEC == 0;
  const dim3 block(32, 4), grid((unsigned)ceil_div(rows, 4));
  if (vec) launch_pdl(kv_write_kernel<VEC, T>, grid, block, 0, s, a);
  else launch_pdl(kv_write_kernel<1, T>, grid, block, 0, s, a);
  check_launch("kv_write");
}
template void launch::kv_write<float>(float*, float*, const float*, const float*, const int64_t*, const int64_t*,
                                      const int64_t*, int, int, int, int, int, cudaStream_t);
ONE_TEMPLATE(kv_write<float>);
template void launch::kv_write<__nv_bfloat16>(__nv_bfloat16*, __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*,
                                              const int64_t*, const int64_t*, const int64_t*, int, int, int, int, int,
                                              cudaStream_t);
ONE_TEMPLATE(kv_write<__nv_bfloat16>);

// ------------------------------------------------------------------------------------------------
// 5.3 top-k
// Top-k over the last dim, sorted descending like torch.topk. Order: larger value first, NaN above
// everything, equal values (-0 and +0 included) by lower index first. That order is the order of a
// 64-bit key per element: the value's bits made order-preserving in the high word, the complement
// of the column in the low word. Keys within a row are distinct, so "the top k" is "the k largest
// keys" and needs no tie rule of its own; key 0 is below every element and marks padding. The
// outputs read the value back from x, so -0 and NaN payloads come out as they went in.
//
// Rows of up to 512 with k <= 16 (MoE routing, small vocabularies) take one warp per row: the row
// in registers, k rounds of "warp max, retire the winner"; no shared memory, no barrier, one launch.
//
// Everything else is a block radix select. Each thread holds its keys in registers; for 8-bit
// digits from the top, the keys still in the running build a shared histogram, one warp scans it
// for the digit that holds the k-th largest key, and the running set narrows to that digit's
// bucket, until the bucket holds exactly as many keys as are still wanted (after 4 digits when the
// values are distinct, at most 8). The chosen keys are gathered unsorted in shared memory; the
// final pass ranks them (each of the k counts the larger ones) and writes values and indices.
// Where the rows alone would leave SMs idle (a single 50k-wide row gives one block's work to a
// 132-SM GPU), a row wider than one block holds is split: pass 1 gives each slice of about 2048
// columns (wider where there are rows enough to fill the GPU) a block that writes its top-k keys to
// the workspace, and pass 2, one block per row, selects again over those candidates. At most 64
// slices per row, so pass 2 reads at most 64 * 128 keys. A block whose share exceeds its registers
// reads it in chunks, the top k so far riding along as one extra key per thread. Two launches at
// most, no host sync, and each element is read from memory once (torch.topk's radix select counts
// digits in several passes over the row).
//
// Twin: train.torch_topk (a stable sort). Uses: 1.2.

constexpr int TOPK_WARP_MAX_L = 512, TOPK_WARP_MAX_K = 16;  // the one-warp-per-row kernel's limits
constexpr int TOPK_BLOCK_MAX_THREADS = 512;
constexpr int TOPK_SLICE = 2048, TOPK_MAX_SLICES = 64;      // the split of a wide row

__device__ __forceinline__ uint64_t topk_key(float v, uint32_t col) {
  const uint32_t b = __float_as_uint(v);
  uint32_t u;
  if ((b & 0x7fffffffu) > 0x7f800000u) u = 0xffffffffu;  // any NaN: above +inf
  else if ((b & 0x7fffffffu) == 0) u = 0x80000000u;      // -0 ties with +0
  else u = (b & 0x80000000u) ? ~b : (b | 0x80000000u);    // larger float, larger u (>= 0x007fffff)
  return (uint64_t)u << 32 | (uint32_t)~col;             // equal values: lower column, larger key
}

__device__ __forceinline__ uint32_t topk_col(uint64_t key) { return ~(uint32_t)key; }

__device__ __forceinline__ uint64_t max_u64(uint64_t a, uint64_t b) { return a > b ? a : b; }

// One warp per row (rows stacked in threadIdx.y), L <= 32 * M, k <= 32.
template <int M>
__global__ void topk_warp_kernel(const float* __restrict__ x, float* __restrict__ values,
                                 int64_t* __restrict__ indices, int64_t rows, int L, int k) {
  const int64_t row = (int64_t)blockIdx.x * blockDim.y + threadIdx.y;
  if (row >= rows) return;  // the whole warp; nothing below waits for it
  const int lane = threadIdx.x;
  const float* xr = x + row * L;
  uint64_t key[M];
#pragma unroll
  for (int j = 0; j < M; ++j) {
    const int col = j * 32 + lane;
    key[j] = col < L ? topk_key(xr[col], col) : 0;
  }
  uint64_t mine = 0;  // lane r keeps the r-th largest
  for (int r = 0; r < k; ++r) {
    uint64_t best = key[0];
#pragma unroll
    for (int j = 1; j < M; ++j) best = max_u64(best, key[j]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) best = max_u64(best, __shfl_xor_sync(0xffffffffu, best, o));
#pragma unroll
    for (int j = 0; j < M; ++j)
      if (key[j] == best) key[j] = 0;  // keys are distinct: only the owner's matches
    if (lane == r) mine = best;
  }
  if (lane < k) {  // k <= L, so every round found a real key
    const uint32_t col = topk_col(mine);
    values[row * k + lane] = xr[col];
    indices[row * k + lane] = col;
  }
}

struct TopkShared {
  alignas(16) unsigned hist[256];
  uint64_t chosen[limits::topk_max_k];  // the top k so far, unsorted
  unsigned pick[4];             // the scan's answer: digit, keys above it in the bucket, keys in it, total
  unsigned slots;               // slot counter for gathering chosen keys; never reset, see `base`
};

// Among the block's keys (N per thread; 0 is padding, the others distinct), find the k largest, or
// all of them if fewer. Returns how many (the same in every thread) and sets mask and want so that a
// key is chosen iff key != 0 && (key & mask) >= want. sh.hist is zero on entry and again on return.
// Every thread of the block calls it; blockDim.x is a multiple of 32.
template <int N>
__device__ __forceinline__ int topk_block_select(const uint64_t (&key)[N], int k, TopkShared& sh,
                                                 uint64_t& mask, uint64_t& want) {
  const int lane = threadIdx.x & 31;
  mask = 0;
  want = 0;
  unsigned need = 0, chosen = 0;
  for (int shift = 56; shift >= 0; shift -= 8) {
    // the histogram of this digit over the keys whose higher digits are `want`; when a warp's
    // such keys share one digit (the merge's candidates often do), one lane adds for all of them
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const bool in = key[j] != 0 && (key[j] & mask) == want;
      const unsigned d = (unsigned)(key[j] >> shift) & 255u;
      const unsigned act = __ballot_sync(0xffffffffu, in);
      if (act == 0) continue;
      const int first = __ffs(act) - 1;
      const unsigned d0 = __shfl_sync(0xffffffffu, d, first);
      if (__all_sync(0xffffffffu, !in || d == d0)) {
        if (lane == first) atomicAdd(&sh.hist[d0], (unsigned)__popc(act));
      } else if (in) {
        atomicAdd(&sh.hist[d], 1u);
      }
    }
    __syncthreads();
    if (threadIdx.x < 32) {  // lane l owns bins 8l..8l+7: read, clear, find the bin of the need-th from the top
      uint4* h4 = reinterpret_cast<uint4*>(sh.hist) + 2 * lane;
      const uint4 a = h4[0], b = h4[1];
      h4[0] = make_uint4(0, 0, 0, 0);
      h4[1] = make_uint4(0, 0, 0, 0);
      const unsigned h[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
      unsigned own = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) own += h[i];
      unsigned from = own;  // keys in the bins of lanes >= this one
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const unsigned t = __shfl_down_sync(0xffffffffu, from, o);
        if (lane + o < 32) from += t;
      }
      const unsigned total = __shfl_sync(0xffffffffu, from, 0);
      const unsigned n = shift == 56 ? min((unsigned)k, total) : need;
      unsigned above = from - own;
#pragma unroll
      for (int i = 7; i >= 0; --i) {  // exactly one bin has above < n <= above + h (when n >= 1)
        if (above < n && above + h[i] >= n) {
          sh.pick[0] = 8 * lane + i;
          sh.pick[1] = above;
          sh.pick[2] = h[i];
        }
        above += h[i];
      }
      if (lane == 0) sh.pick[3] = total;
    }
    __syncthreads();  // pick is read below and rewritten only after the next histogram's barrier
    if (shift == 56) {
      chosen = need = min((unsigned)k, sh.pick[3]);
      if (need == 0) break;
    }
    need -= sh.pick[1];
    mask |= 0xffull << shift;
    want |= (uint64_t)sh.pick[0] << shift;
    if (sh.pick[2] == need) break;  // the whole bucket is wanted; at shift 0 the bucket is one key
  }
  return (int)chosen;
}

struct TopkPass {
  const float* x;           // (rows, L): read by a pass over the columns, and for the final values
  const uint64_t* keys_in;  // pass 2 of a split: (rows, len) candidate keys; else nullptr
  uint64_t* keys_out;       // pass 1 of a split: (rows, nseg, k) keys, 0-padded; else nullptr
  float* values;            // the final pass: (rows, k); else nullptr
  int64_t* indices;
  int64_t len, seglen;      // keys per row read by this pass; each block's share of them
  int L, k, nseg;
};

// Block (row, seg) of rows * nseg: the top k of its share of the row. blockDim.x in [128, 512],
// a multiple of 32 and >= k (one carried key per thread); N keys per thread per chunk.
template <int N, bool FROM_KEYS>
__global__ void __launch_bounds__(TOPK_BLOCK_MAX_THREADS) topk_block_kernel(TopkPass p) {
  __shared__ TopkShared sh;
  const int64_t row = blockIdx.x / p.nseg;
  const int seg = blockIdx.x % p.nseg, tid = threadIdx.x, k = p.k;
  for (int i = tid; i < 256; i += blockDim.x) sh.hist[i] = 0;
  if (tid == 0) sh.slots = 0;
  __syncthreads();
  const int64_t lo = seg * p.seglen, hi = lo + p.seglen < p.len ? lo + p.seglen : p.len;
  int carried = 0;
  unsigned base = 0;  // sh.slots before this chunk's gather
  for (int64_t c = lo; c < hi; c += (int64_t)N * blockDim.x) {
    uint64_t key[N + 1];
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const int64_t i = c + (int64_t)j * blockDim.x + tid;
      if (FROM_KEYS) key[j] = i < hi ? p.keys_in[row * p.len + i] : 0;
      else key[j] = i < hi ? topk_key(p.x[row * p.L + i], (uint32_t)i) : 0;
    }
    key[N] = tid < carried ? sh.chosen[tid] : 0;  // read before the select's first barrier
    uint64_t mask, want;
    const int n = topk_block_select<N + 1>(key, k, sh, mask, want);
#pragma unroll
    for (int j = 0; j <= N; ++j)
      if (key[j] != 0 && (key[j] & mask) >= want) {
        const unsigned slot = atomicAdd(&sh.slots, 1u) - base;
        if (slot < limits::topk_max_k) sh.chosen[slot] = key[j];
      }
    base += n;
    carried = n;
    __syncthreads();  // chosen[] complete
  }
  if (p.keys_out) {
    if (tid < k) p.keys_out[(row * p.nseg + seg) * k + tid] = tid < carried ? sh.chosen[tid] : 0;
    return;
  }
  for (int t = tid; t < carried; t += blockDim.x) {  // carried == k here: the row has >= k columns
    const uint64_t mine = sh.chosen[t];
    int rank = 0;
#pragma unroll 8
    for (int j = 0; j < carried; ++j) rank += sh.chosen[j] > mine;
    const uint32_t col = topk_col(mine);
    p.values[row * k + rank] = p.x[row * p.L + col];
    p.indices[row * k + rank] = col;
  }
}

// Threads and keys per thread for a block that reads `share` keys: up to 2048, 4 keys a thread
// (128 to 512 threads); beyond, 16 a thread, and chunks past 512 * 16.
static void topk_block_launch(const TopkPass& p, int64_t blocks, int64_t share, cudaStream_t s) {
  const int n = share <= 4 * TOPK_BLOCK_MAX_THREADS ? 4 : 16;
  int threads = 128;
  while (threads < TOPK_BLOCK_MAX_THREADS && (int64_t)threads * n < share) threads *= 2;
  const bool from_keys = p.keys_in != nullptr;
  if (n == 4 && from_keys) topk_block_kernel<4, true><<<(unsigned)blocks, threads, 0, s>>>(p);
  else if (n == 4) topk_block_kernel<4, false><<<(unsigned)blocks, threads, 0, s>>>(p);
  else if (from_keys) topk_block_kernel<16, true><<<(unsigned)blocks, threads, 0, s>>>(p);
  else topk_block_kernel<16, false><<<(unsigned)blocks, threads, 0, s>>>(p);
  check_launch("topk");
}

struct TopkPlan {
  bool warp;       // one warp per row
  int nseg;        // > 1: split into slices of seglen columns, then merge
  int64_t seglen;
};

// The one place that decides how a call runs; topk_workspace_bytes() sizes the workspace from it.
static TopkPlan topk_plan(int64_t rows, int L, int k) {
  TopkPlan p{L <= TOPK_WARP_MAX_L && k <= TOPK_WARP_MAX_K, 1, L};
  if (p.warp || L <= TOPK_BLOCK_MAX_THREADS * 16) return p;  // one block holds the row
  // slices of about TOPK_SLICE columns, no more than ~8 blocks per SM need, at most 64 a row
  const int64_t fill = std::max<int64_t>(1, ceil_div(8 * (int64_t)num_sms(), rows));
  const int64_t nseg = std::min<int64_t>(std::min<int64_t>(ceil_div(L, TOPK_SLICE), TOPK_MAX_SLICES), fill);
  p.seglen = ceil_div(L, nseg);
  p.nseg = ceil_div(L, p.seglen);  // no empty slice
  return p;
}

// Bytes of workspace topk() needs: the candidate keys of a split row.
size_t launch::topk_workspace_bytes(int64_t rows, int L, int k) {
  const TopkPlan p = topk_plan(rows, L, k);
  return p.nseg > 1 ? (size_t)rows * p.nseg * k * sizeof(uint64_t) : 0;
}

void launch::topk(const float* x, float* values, int64_t* indices, int64_t rows, int L, int k, void* workspace,
                  cudaStream_t s) {
  if (rows == 0) return;
  const TopkPlan plan = topk_plan(rows, L, k);
  if (plan.warp) {
    const dim3 block(32, 4), grid(ceil_div(rows, 4));
    if (L <= 32) topk_warp_kernel<1><<<grid, block, 0, s>>>(x, values, indices, rows, L, k);
    else if (L <= 64) topk_warp_kernel<2><<<grid, block, 0, s>>>(x, values, indices, rows, L, k);
    else if (L <= 128) topk_warp_kernel<4><<<grid, block, 0, s>>>(x, values, indices, rows, L, k);
    else if (L <= 256) topk_warp_kernel<8><<<grid, block, 0, s>>>(x, values, indices, rows, L, k);
    else topk_warp_kernel<16><<<grid, block, 0, s>>>(x, values, indices, rows, L, k);
    check_launch("topk");
    return;
  }
  TopkPass last{};
  last.x = x;
  last.values = values;
  last.indices = indices;
  last.L = L;
  last.k = k;
  last.nseg = 1;
  if (plan.nseg > 1) {
    TopkPass first = last;
    first.values = nullptr;
    first.indices = nullptr;
    first.keys_out = static_cast<uint64_t*>(workspace);
    first.len = L;
    first.seglen = plan.seglen;
    first.nseg = plan.nseg;
    topk_block_launch(first, rows * plan.nseg, plan.seglen, s);
    last.keys_in = first.keys_out;
    last.len = (int64_t)plan.nseg * k;
  } else {
    last.len = L;
  }
  last.seglen = last.len;
  topk_block_launch(last, rows, last.len, s);
}

// ================================================================================================
// 6. Matmul
// mma.sync on any GPU from sm_80, then Hopper's wgmma for fp32 (3xTF32) and bf16.
// ================================================================================================

// ------------------------------------------------------------------------------------------------
// 6.1 matmul on mma.sync (any GPU from sm_80)
// Matmul: C = alpha * op(A) * op(B) (+ bias[n]) on the tensor cores in 3xTF32 (fp32 accuracy), batched over
// grid.z. This mma.sync kernel runs on any GPU from sm_80 and takes the small products on Hopper too (the
// wgmma kernel below takes the big ones). op(A) is M x K: stored row-major with leading dim lda (TA = false,
// A[m][k] = a[m*lda + k]) or as its transpose (TA = true, A[m][k] = a[k*lda + m]); likewise op(B) is K x N
// (TB = true reads b[n*ldb + k], the layout of a linear layer's weight). A batch stride of
// 0 broadcasts an operand.
//
// A block computes a BM x BN tile of C with 2 x (warps / 2) warps, each a (BM/2) x (BN/(warps/2))
// piece made of m16n8 tensor-core tiles. K advances BK = 16 at a time through shared memory, both
// operands stored k-minor ([m][k] and [n][k], rows padded to 20 floats so fragment reads hit 32
// different banks); the next K tile is fetched into registers while the current one is multiplied
// (double-buffered shared memory, one barrier per tile). Global loads are bounds-checked and laid
// out so consecutive threads read consecutive addresses in either storage order, 16 bytes at a
// time when sizes and pointers allow: any M, N, K and any alignment work.
//
// Twin: torch.matmul, F.linear. Uses: 1.1, 1.6 Frag, mma.

struct MatmulArgs {
  const float* a; const float* b; const float* bias; float* c;
  int M, N, K;
  int64_t lda, ldb, ldc;
  int64_t sa, sb, sc;  // batch strides in elements
  float alpha;
  bool vec_c;  // C rows may be written as float2 (set by the launcher)
  // split-K: grid.z = batch * splits; split s covers K range [s * kchunk, (s + 1) * kchunk) and
  // writes its partial C at c + s * split_stride (then matmul_reduce_kernel adds the splits)
  int batch, splits, kchunk;
  int64_t split_stride;
};

// Tile pid of a tiles_m x tiles_n grid in grouped order: GROUP consecutive blocks share B's columns
// while walking rows of A, so the tiles they read are still in L2. All three matmul kernels use it.
__device__ __forceinline__ void grouped_tile(int pid, int tiles_m, int tiles_n, int& tile_m, int& tile_n) {
  constexpr int GROUP = 8;
  const int per_group = GROUP * tiles_n;
  const int first_m = (pid / per_group) * GROUP, group_m = min(tiles_m - first_m, GROUP);
  tile_m = first_m + (pid % per_group) % group_m;
  tile_n = (pid % per_group) / group_m;
}

// 3xTF32 splits an infinite operand into inf and a NaN lo part, so every output an inf reaches comes
// out NaN, where an fp32 product gives ±inf (and NaN only for inf * 0, inf - inf or a NaN operand). The
// epilogues sum a NaN output again here, in plain fp32 along row a (stride a_ks) and column b (stride
// b_ks) over [k0, k1), stopping at the first NaN, which no later term can undo. Only NaN outputs pay, but
// each one its whole row of K terms, one thread alone: operands with infinite rows or columns (a diverged
// run) make every output they reach a serial dot product.
__device__ __noinline__ float plain_dot(const float* a, int64_t a_ks, const float* b, int64_t b_ks, int k0, int k1) {
  float sum = 0.f;
  for (int k = k0; k < k1 && !isnan(sum); ++k) sum = fmaf(a[k * a_ks], b[k * b_ks], sum);
  return sum;
}

// Outputs n and n + 1 of a row of C: one float2 store where the row's alignment allows (vec), else the
// ones below N.
__device__ __forceinline__ void store_pair(float* dst, const float (&o)[2], int n, int N, bool vec) {
  if (vec && n + 1 < N) {
    *reinterpret_cast<float2*>(dst) = make_float2(o[0], o[1]);
  } else {
    if (n < N) dst[0] = o[0];
    if (n + 1 < N) dst[1] = o[1];
  }
}

template <int BM, int BN, int NT, bool TA, bool TB, int VEC>
__global__ void __launch_bounds__(NT, NT == 256 ? 2 : 3) matmul_kernel(MatmulArgs p) {
  constexpr int BK = 16, PAD = BK + 4;
  constexpr int WARPS_N = NT / 64, WTM = BM / 2, WTN = BN / WARPS_N;  // 2 x WARPS_N warps
  constexpr int MI = WTM / 16, NJ = WTN / 8;                          // m16 x n8 tiles per warp
  __shared__ __align__(16) float As[2][BM][PAD];
  __shared__ __align__(16) float Bs[2][BN][PAD];

  const int tiles_m = (p.M + BM - 1) / BM, tiles_n = (p.N + BN - 1) / BN;
  int tile_m, tile_n;
  grouped_tile(blockIdx.x, tiles_m, tiles_n, tile_m, tile_n);
  const int m0 = tile_m * BM, n0 = tile_n * BN;

  const int bz = blockIdx.z / p.splits, split = blockIdx.z % p.splits;
  const float* a = p.a + bz * p.sa;
  const float* b = p.b + bz * p.sb;
  float* c = p.c + bz * p.sc + split * p.split_stride;
  const int k_lo = split * p.kchunk, k_hi = min(p.K, k_lo + p.kchunk);
  const int tid = threadIdx.x;

  // Each thread loads VEC consecutive elements along the contiguous ("fast") storage dim of an
  // operand (VEC = 4: one 16-byte load) at LA (LB) positions that share the fast index and step a
  // fixed number of rows apart.
  constexpr int A_UNITS = (TA ? BM : BK) / VEC, B_UNITS = (TB ? BK : BN) / VEC;  // vectors per tile row
  constexpr int LA = BM * BK / NT / VEC, LB = BN * BK / NT / VEC;
  constexpr int A_STEP = NT / A_UNITS, B_STEP = NT / B_UNITS;
  const int a_fast = (tid % A_UNITS) * VEC, a_slow = tid / A_UNITS;  // TA: (m, k) = (fast, slow), else (slow, fast)
  const int b_fast = (tid % B_UNITS) * VEC, b_slow = tid / B_UNITS;  // TB: (n, k) = (slow, fast), else (fast, slow)
  float ra[LA][VEC], rb[LB][VEC];
  auto load_vec = [](const float* src, bool in, float (&dst)[VEC]) {
    if (!in) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) dst[j] = 0.f;
    } else if (VEC == 4) {
      const float4 v = *reinterpret_cast<const float4*>(src);
      dst[0] = v.x; dst[1] = v.y; dst[2] = v.z; dst[VEC - 1] = v.w;
    } else {
      dst[0] = *src;
    }
  };
  auto load_tiles = [&](int k0) {
#pragma unroll
    for (int i = 0; i < LA; ++i) {
      const int slow = a_slow + i * A_STEP;
      const int gm = m0 + (TA ? a_fast : slow), gk = k0 + (TA ? slow : a_fast);
      load_vec(a + (TA ? (int64_t)gk * p.lda + gm : (int64_t)gm * p.lda + gk), gm < p.M && gk < k_hi, ra[i]);
    }
#pragma unroll
    for (int i = 0; i < LB; ++i) {
      const int slow = b_slow + i * B_STEP;
      const int gn = n0 + (TB ? slow : b_fast), gk = k0 + (TB ? b_fast : slow);
      load_vec(b + (TB ? (int64_t)gn * p.ldb + gk : (int64_t)gk * p.ldb + gn), gn < p.N && gk < k_hi, rb[i]);
    }
  };
  auto store_tiles = [&](int buf) {
#pragma unroll
    for (int i = 0; i < LA; ++i)
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const int slow = a_slow + i * A_STEP, fast = a_fast + j;
        As[buf][TA ? fast : slow][TA ? slow : fast] = ra[i][j];
      }
#pragma unroll
    for (int i = 0; i < LB; ++i)
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const int slow = b_slow + i * B_STEP, fast = b_fast + j;
        Bs[buf][TB ? slow : fast][TB ? fast : slow] = rb[i][j];
      }
  };

  const int warp = tid >> 5, g = (tid & 31) >> 2, t = tid & 3;
  const int wm = (warp / WARPS_N) * WTM, wn = (warp % WARPS_N) * WTN;
  float acc[MI][NJ][4] = {};
  const int ktiles = (k_hi - k_lo + BK - 1) / BK;
  load_tiles(k_lo);
  store_tiles(0);
  __syncthreads();
  for (int kt = 0; kt < ktiles; ++kt) {
    const int buf = kt & 1;
    if (kt + 1 < ktiles) load_tiles(k_lo + (kt + 1) * BK);
#pragma unroll
    for (int kk = 0; kk < BK; kk += 8) {
      Frag<4, true> fa[MI];
#pragma unroll
      for (int i = 0; i < MI; ++i) {
        const float* r = &As[buf][wm + i * 16 + g][kk + t];
        const float x[4] = {r[0], r[8 * PAD], r[4], r[8 * PAD + 4]};
        fa[i].set(x);
      }
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const float* r = &Bs[buf][wn + j * 8 + g][kk + t];
        const float x[2] = {r[0], r[4]};
        Frag<2, true> fb;
        fb.set(x);
#pragma unroll
        for (int i = 0; i < MI; ++i) {
          // The tensor core adds into its accumulator without rounding to nearest, an error that
          // grows with K; summing 8 products there and the rest with fp32 adds keeps it fp32-like.
          float part[4] = {0.f, 0.f, 0.f, 0.f};
          mma<true>(part, fa[i], fb);
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[i][j][e] += part[e];
        }
      }
    }
    if (kt + 1 < ktiles) store_tiles(buf ^ 1);
    __syncthreads();
  }

#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = m0 + wm + i * 16 + g + 8 * h;
      if (m >= p.M) continue;
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const int n = n0 + wn + j * 8 + 2 * t;
        float o[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float v = acc[i][j][2 * h + e];
          if (isnan(v) && n + e < p.N)
            v = plain_dot(a + (TA ? m : m * p.lda), TA ? p.lda : 1, b + (TB ? (n + e) * p.ldb : n + e),
                          TB ? 1 : p.ldb, k_lo, k_hi);
          o[e] = p.alpha * v;
          if (p.bias && n + e < p.N) o[e] += p.bias[n + e];
        }
        store_pair(c + (int64_t)m * p.ldc + n, o, n, p.N, p.vec_c);
      }
    }
}

template <int BM, int BN, int NT, int VEC>
static void matmul_tiles(const MatmulArgs& p, bool ta, bool tb, cudaStream_t s) {
  dim3 grid(ceil_div(p.M, BM) * ceil_div(p.N, BN), 1, p.batch * p.splits);
  if (!ta && !tb) matmul_kernel<BM, BN, NT, false, false, VEC><<<grid, NT, 0, s>>>(p);
  else if (!ta && tb) matmul_kernel<BM, BN, NT, false, true, VEC><<<grid, NT, 0, s>>>(p);
  else if (ta && !tb) matmul_kernel<BM, BN, NT, true, false, VEC><<<grid, NT, 0, s>>>(p);
  else matmul_kernel<BM, BN, NT, true, true, VEC><<<grid, NT, 0, s>>>(p);
}

// c[b][m][n] = alpha * sum over splits of part[s][b][m][n] + bias[n], in a fixed order.
__global__ void matmul_reduce_kernel(const float* part, const float* bias, float* c, int splits, int64_t split_stride,
                                     int M, int N, int64_t ldc, int64_t sc, float alpha) {
  const int64_t total = split_stride, stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
    float acc = 0.f;
    for (int sp = 0; sp < splits; ++sp) acc += part[sp * split_stride + i];
    const int64_t bz = i / ((int64_t)M * N), mn = i % ((int64_t)M * N);
    const int m = (int)(mn / N), n = (int)(mn % N);
    c[bz * sc + m * ldc + n] = alpha * acc + (bias ? bias[n] : 0.f);
  }
}

// ------------------------------------------------------------------------------------------------
// 6.2 fp32 matmul on Hopper: pack, then wgmma
//
// Hopper's tensor cores are fed by `wgmma`, which reads its operands straight from shared
// memory in a fixed layout: for TF32 both operands K-major, rows of 32 floats (128 bytes) whose
// 16-byte chunks are permuted ("128-byte swizzle": chunk c of row r sits at c ^ (r % 8)) so the
// tensor cores read them without bank conflicts. A pack kernel first rewrites op(A) (M x K) and
// op(B) (as N x K) into that layout, tile after tile (128 rows x 32 of K), each tile as two planes:
// hi = x with the 13 mantissa bits TF32 lacks cleared, lo = x - hi. Zero padding fills the ragged
// edges, so the main kernel never checks bounds on a load, and any transpose, stride, or alignment
// costs only the pack. The main kernel then copies whole packed tiles with the bulk-copy engine
// (`cp.async.bulk`, completion counted on an mbarrier) and multiplies: lo*hi + hi*lo + hi*hi, the
// same 3xTF32 as the mma.sync path, at four times its rate per instruction.
//
// Block: 3 warpgroups. Warpgroup 0 is the producer (one thread issues the copies, WG_STAGES deep);
// warpgroups 1 and 2 each compute 64 x 128 of the block's 128 x 128 tile of C. The tensor core
// accumulates without rounding to nearest, so each 32-wide K step is summed into a fresh register
// tile and then added to the fp32 accumulator with ordinary (rounded) adds.
//
// Twin: as 6.1. Uses: 1.7 mbarriers, bulk_copy, wgmma_tf32.

constexpr int WG_BM = 128, WG_BN = 128, WG_BK = 32, WG_STAGES = 3;
constexpr int WG_PLANE = 128 * WG_BK;           // floats in one plane of a packed tile (16 KB)
constexpr int WG_TILE = 2 * WG_PLANE;           // hi and lo planes (32 KB)
constexpr int WG_STAGE_BYTES = 2 * WG_TILE * 4;  // one A and one B tile (64 KB)
constexpr int WG_SMEM = WG_STAGES * WG_STAGE_BYTES + 1024 + 2 * WG_STAGES * 8;  // + alignment, mbarriers

// op(X) as an R x K matrix, element (r, k) at x[r * rs + k * ks] with rs or ks equal to 1.
struct PackArgs {
  const float* x;
  float* out;
  int R, K, ktiles;
  int64_t rs, ks, bs, out_bs;  // bs: batch stride of x; out_bs: of the packed copy
};

__global__ void __launch_bounds__(256) matmul_pack_kernel(PackArgs p) {
  __shared__ float s[128][WG_BK + 1];  // +1: the transposing reads hit 32 banks
  const int kt = blockIdx.x, rt = blockIdx.y, tid = threadIdx.x;
  const float* x = p.x + blockIdx.z * p.bs;
  const bool k_fast = p.ks == 1;  // read along whichever dim is contiguous
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int idx = tid + 256 * i;
    const int r = k_fast ? idx / WG_BK : idx % 128, k = k_fast ? idx % WG_BK : idx / 128;
    const int gr = rt * 128 + r, gk = kt * WG_BK + k;
    s[r][k] = gr < p.R && gk < p.K ? x[gr * p.rs + gk * p.ks] : 0.f;
  }
  __syncthreads();
  float* out = p.out + blockIdx.z * p.out_bs + ((int64_t)rt * p.ktiles + kt) * WG_TILE;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int chunk = tid + 256 * i, r = chunk / 8, c = chunk % 8;
    float hi[4], lo[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float v = s[r][4 * c + j];
      hi[j] = __uint_as_float(__float_as_uint(v) & 0xffffe000u);
      lo[j] = v - hi[j];
    }
    const int off = r * WG_BK + 4 * (c ^ (r % 8));
    *reinterpret_cast<float4*>(out + off) = make_float4(hi[0], hi[1], hi[2], hi[3]);
    *reinterpret_cast<float4*>(out + WG_PLANE + off) = make_float4(lo[0], lo[1], lo[2], lo[3]);
  }
}

struct WgmmaArgs {
  const float* a;  // packed op(A): [batch][M tiles][K tiles] packed tiles
  const float* b;  // packed op(B) as N x K
  const float* bias;
  float* c;
  int M, N, ktiles;
  int64_t a_bs, b_bs;  // packed batch strides, 0 to broadcast
  int64_t ldc, sc;
  float alpha;
  bool vec_c;
  int splits, kt_per_split;  // split-K as in MatmulArgs, in units of K tiles
  int64_t split_stride;
  // The operands as given, for plain_dot: op(A)(m, k) = a_src[m * a_rs + k * a_ks], op(B)(k, n) =
  // b_src[k * b_ks + n * b_cs], batch strides sa and sb.
  const float* a_src; const float* b_src;
  int64_t a_rs, a_ks, b_ks, b_cs, sa, sb;
  int K;
};

__global__ void __launch_bounds__(384, 1) matmul_wgmma_kernel(WgmmaArgs p) {
#ifdef WG_ENABLED
  extern __shared__ uint8_t smem_raw[];
  // Swizzled tiles must start 1024-byte aligned (the swizzle is a function of the address bits).
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const uint32_t base = smem_addr(smem);
  const uint32_t full = base + WG_STAGES * WG_STAGE_BYTES, empty = full + 8 * WG_STAGES;  // mbarrier arrays

  const int tiles_m = (p.M + WG_BM - 1) / WG_BM, tiles_n = (p.N + WG_BN - 1) / WG_BN;
  int tile_m, tile_n;
  grouped_tile(blockIdx.x, tiles_m, tiles_n, tile_m, tile_n);
  const int bz = blockIdx.z / p.splits, split = blockIdx.z % p.splits;
  const int kt0 = split * p.kt_per_split, kt1 = min(p.ktiles, kt0 + p.kt_per_split);

  init_stage_barriers<WG_STAGES>(full, empty);

  const int wg = threadIdx.x / 128;
  if (wg == 0) {  // producer
    if (threadIdx.x == 0) {
      const float* a = p.a + bz * p.a_bs + (int64_t)tile_m * p.ktiles * WG_TILE;
      const float* b = p.b + bz * p.b_bs + (int64_t)tile_n * p.ktiles * WG_TILE;
      for (int kt = kt0, i = 0; kt < kt1; ++kt, ++i) {
        const int s = i % WG_STAGES;
        mbar_wait(empty + 8 * s, ((i / WG_STAGES) & 1) ^ 1);  // a fresh barrier passes parity 1
        mbar_expect_bytes(full + 8 * s, WG_STAGE_BYTES);
        const uint32_t dst = base + s * WG_STAGE_BYTES;
        bulk_copy(dst, a + (int64_t)kt * WG_TILE, WG_TILE * 4, full + 8 * s);
        bulk_copy(dst + WG_TILE * 4, b + (int64_t)kt * WG_TILE, WG_TILE * 4, full + 8 * s);
      }
    }
    return;
  }

  const int half = wg - 1;  // rows 64 * half .. of the block's tile
  float acc[64], part[64];
#pragma unroll
  for (int e = 0; e < 64; ++e) acc[e] = 0.f;
  for (int kt = kt0, i = 0; kt < kt1; ++kt, ++i) {
    const int s = i % WG_STAGES;
    mbar_wait(full + 8 * s, (i / WG_STAGES) & 1);
    const uint32_t a_hi = base + s * WG_STAGE_BYTES + half * (64 * WG_BK * 4), a_lo = a_hi + WG_PLANE * 4;
    const uint32_t b_hi = base + s * WG_STAGE_BYTES + WG_TILE * 4, b_lo = b_hi + WG_PLANE * 4;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < WG_BK / 8; ++kk) {  // 8 of K (32 bytes of each row) per instruction
      const uint32_t off = kk * 32;
      wgmma_tf32(part, wg_desc(a_lo + off), wg_desc(b_hi + off), kk > 0);  // small terms first
      wgmma_tf32(part, wg_desc(a_hi + off), wg_desc(b_lo + off), 1);
      wgmma_tf32(part, wg_desc(a_hi + off), wg_desc(b_hi + off), 1);
    }
    wgmma_commit_and_wait();
    if (threadIdx.x % 32 == 0) mbar_arrive(empty + 8 * s);
#pragma unroll
    for (int e = 0; e < 64; ++e) acc[e] += part[e];
  }

  // Accumulator layout: warp w of the warpgroup holds rows 16w..16w+15; lane (g, t) = (lane / 4,
  // lane % 4) holds rows g and g + 8, columns 8j + 2t and 8j + 2t + 1, at acc[4j ..4j + 3].
  float* c = p.c + bz * p.sc + split * p.split_stride;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int row0 = tile_m * WG_BM + half * 64 + (threadIdx.x % 128) / 32 * 16 + g;
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = row0 + 8 * h, n = tile_n * WG_BN + 8 * j + 2 * t;
      if (m >= p.M) continue;
      float o[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float v = acc[4 * j + 2 * h + e];
        if (isnan(v) && n + e < p.N)
          v = plain_dot(p.a_src + bz * p.sa + m * p.a_rs, p.a_ks, p.b_src + bz * p.sb + (n + e) * p.b_cs, p.b_ks,
                        kt0 * WG_BK, min(p.K, kt1 * WG_BK));
        o[e] = p.alpha * v;
        if (p.bias && n + e < p.N) o[e] += p.bias[n + e];
      }
      store_pair(c + (int64_t)m * p.ldc + n, o, n, p.N, p.vec_c);
    }
#else
  __trap();  // built without sm_90a: the launcher only picks this kernel when it was compiled
#endif
}

// ------------------------------------------------------------------------------------------------
// 6.3 bf16 matmul on Hopper: tensor-map copies, then wgmma
//
// bf16 needs no pack. wgmma reads 16-bit operands in either orientation: K-major, or M/N-major
// when the instruction's transpose bit is set. The tensor-map copy engine (TMA) lifts a tile of the
// caller's tensor into shared memory in the 128-byte-swizzled layout wgmma reads, filling zeros
// past the matrix edges. So the producer issues per stage one copy per 64-wide slab of each
// operand, from tensor maps built on the host; the rest is the TF32 kernel's pipeline: an mbarrier
// ring, one producer warpgroup, two consumer warpgroups. Block tile 128 x BN x 64, as many stages as
// fit (bf_stages); each consumer warpgroup owns 64 x BN of C, BN / 2 fp32 accumulators per thread, and
// issues m64nBNk16 wgmma, accumulating in fp32 like cuBLAS. BN is 256 or 192, whichever takes fewer
// rounds of tiles over the SMs (192 where 256 would pad N, at the large preset's 384 and 1152, or
// leave SMs idle); 128 or 64 for products too small to fill half the SMs with wider tiles (bf16_plan).
//
// Epilogue: a consumer warpgroup writes its 64 x BN of C in 64 x 64 pieces into shared memory
// (swizzled like the operands, so the stores are free of bank conflicts) and one thread hands each
// piece to the copy engine (a TMA store, clipped at the matrix edges), then the warpgroup goes on to
// its next tile while the store drains. Two buffers per warpgroup: a piece waits only for the store
// two pieces back. The tile is packed to bf16 pairs in registers first; at BN 256 with 12 or more K
// tiles (and A K-major) it is written out only after the next tile's first products are issued, so
// those run under the stores. Stores straight from registers write 16 bytes per row per instruction
// and keep the tensor cores idle for as long; they remain for
// fp32 outputs (split-K partials) and outputs a tensor map cannot address.
//
// Split-K: an output of few tiles with a long K (a weight gradient: 1152 x 384 over 16384 tokens is
// 18 tiles for 132 SMs) is cut along K; each split writes its fp32 partial tile to a workspace, and
// matmul_bf16_reduce_kernel adds the splits in a fixed order (deterministic), then alpha and bias.
//
// Row sums of A: a linear's bias gradient is dy's column sums, and its weight gradient dy^T x reads dy
// as A (M-major: M = out_features, K = tokens), so every element of it passes through shared memory
// in this kernel. Two warps of the producer warpgroup, idle otherwise, read each stage's A tile once
// more and add it along K: the bias gradient without a pass of its own over dy. They arrive on the
// stage's empty barrier like the consumers.
//
// Shared-memory layouts (all 1024-byte aligned, 128-byte swizzle):
//   K-major slab: rows of 64 K values (128 bytes), 8-row groups 1024 bytes apart; a k16 step moves
//                 the descriptor 32 bytes along the row.
//   M/N-major slab: 64 K-rows of 64 M (or N) values, 8 K-rows per 1024 bytes; a k16 step moves it
//                 two groups (2048 bytes); slabs for the next 64 of N sit 8192 bytes apart.
//
// Twin: torch.matmul, F.linear in bf16. Uses: 1.1 tensor maps, 1.7 tma_load, wgmma_bf16, named barriers.

constexpr int BF_BM = 128, BF_BK = 64;
constexpr int BF_SLAB = 64 * BF_BK * 2;     // one 64 x 64 bf16 slab (8 KB); also one epilogue piece
constexpr int BF_A_BYTES = BF_BM * BF_BK * 2;  // 16 KB
constexpr int BF_OUT_BYTES = 2 * 2 * BF_SLAB;  // epilogue: two pieces per consumer warpgroup
constexpr int BF_BIAS_BYTES = 2 * 256 * 2;     // the tile's bias (bf16), per consumer warpgroup
__host__ __device__ constexpr int bf_stage_bytes(int bn) { return BF_A_BYTES + bn * BF_BK * 2; }  // 48 KB at 256
// As many stages as fit, up to 8, in a block's shared memory (SMEM_BLOCK_MAX) beside the epilogue's
// pieces, the bias, the 1024-byte alignment and the barriers: 4 at BN 256 and 192, 6 at 128, 8 at 64.
__host__ __device__ constexpr int bf_stages(int bn) {
  constexpr int room = SMEM_BLOCK_MAX - BF_OUT_BYTES - BF_BIAS_BYTES - 1024 - 2 * 8 * 8;
  return room / bf_stage_bytes(bn) < 8 ? room / bf_stage_bytes(bn) : 8;
}
__host__ __device__ constexpr int bf_smem(int bn) {
  return bf_stages(bn) * bf_stage_bytes(bn) + BF_OUT_BYTES + BF_BIAS_BYTES + 1024 + 2 * bf_stages(bn) * 8;
}

struct Bf16MatmulArgs {
  const __nv_bfloat16* bias;
  void* c;  // bf16, or fp32 when c_f32
  int M, N, ktiles;
  int64_t ldc, sc;
  float alpha;
  bool c_f32, vec_c, c_tma, a_bcast, b_bcast;  // c_tma: bf16 C written through map_c
  int batch;
  int splits, kt_per_split;  // split-K: split s covers K tiles [s * kt_per_split, ...)
  int64_t split_stride;      // elements between the splits' outputs
  float* a_rowsum = nullptr;  // TA, batch 1: A's row sums over this split's K, at a_rowsum + split * M
};

// Tile `work` of a persistent block's share: grouped order within each batch entry.
__device__ __forceinline__ void bf16_tile(int work, int tiles_m, int tiles_n, int& tile_m, int& tile_n, int& bz) {
  const int per_batch = tiles_m * tiles_n;
  grouped_tile(work % per_batch, tiles_m, tiles_n, tile_m, tile_n);
  bz = work / per_batch;
}

// What a block computes for work unit u: tile (tile_m, tile_n) of batch entry bz over K tiles
// [kt0, kt1), split `split`. The splits of one tile are consecutive units.
struct Bf16Unit {
  int tile_m, tile_n, bz, split, kt0, kt1;
};

__device__ __forceinline__ Bf16Unit bf16_unit(const Bf16MatmulArgs& p, int u, int tiles_m, int tiles_n) {
  Bf16Unit w;
  w.split = u % p.splits;
  bf16_tile(u / p.splits, tiles_m, tiles_n, w.tile_m, w.tile_n, w.bz);
  w.kt0 = w.split * p.kt_per_split;
  w.kt1 = min(p.ktiles, w.kt0 + p.kt_per_split);
  return w;
}

// The row sums of A (stored K x M, M-major), by warps 1 and 2 of the producer warpgroup: warp 1+h sums
// the tile's rows 64h .. 64h + 63 (A slab h of each stage). Lane (c, q) adds the 8 values of 16-byte
// chunk c over K-rows q, q + 4, ..., q + 60; chunk c of K-row r sits at chunk c ^ (r % 8) of the row
// (the 128-byte swizzle), so a load of the warp reads 4 whole rows: 4 wavefronts, no conflicts. The
// four lanes of a chunk then add their sums by shuffles (in a fixed order: the same bits every run).
// A stage's 16 values are added apart, then to the running sum: 64 terms a chain, not K / 4, at 16K
// tokens. Every block reads and releases every stage, but only units on the first column of tiles
// add (the other columns would write the same sums again: that filter is for speed).
template <int STAGE_BYTES, int STAGES>
__device__ __forceinline__ void bf16_a_rowsums(const Bf16MatmulArgs& p, uint32_t base, uint32_t full, uint32_t empty,
                                               int tiles_m, int tiles_n, int units) {
  const int h = threadIdx.x / 32 - 1, lane = threadIdx.x % 32, c = lane % 8, q = lane / 8;
  int it = 0;  // stages consumed so far, as the producer counts them
  for (int u = blockIdx.x; u < units; u += gridDim.x) {
    const Bf16Unit w = bf16_unit(p, u, tiles_m, tiles_n);
    const bool add = w.tile_n == 0;
    float sum[8] = {};
    for (int kt = w.kt0; kt < w.kt1; ++kt, ++it) {
      const int s = it % STAGES;
      mbar_wait(full + 8 * s, (it / STAGES) & 1);
      if (add) {
        const uint32_t slab = base + s * STAGE_BYTES + h * BF_SLAB;
        float stage[8] = {};
#pragma unroll
        for (int j = 0; j < BF_BK / 4; ++j) {
          const int r = q + 4 * j;
          const uint4 v = ld_shared16(slab + r * 128 + ((c ^ (r % 8)) << 4));
          const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[i]));
            stage[2 * i] += f.x;
            stage[2 * i + 1] += f.y;
          }
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) sum[i] += stage[i];
      }
      __syncwarp();  // the warp's reads are done before the stage goes back to the producer
      if (lane == 0) mbar_arrive(empty + 8 * s);
    }
    if (!add) continue;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      sum[i] += __shfl_xor_sync(0xffffffffu, sum[i], 8);
      sum[i] += __shfl_xor_sync(0xffffffffu, sum[i], 16);
    }
    const int m0 = w.tile_m * BF_BM + 64 * h + 8 * c;
    if (q == 0)
#pragma unroll
      for (int i = 0; i < 8; ++i)
        if (m0 + i < p.M) p.a_rowsum[(int64_t)w.split * p.M + m0 + i] = sum[i];
  }
}

// TA: A stored K x M (M contiguous); TB: B stored N x K (K contiguous), as in matmul().
// Persistent: a block per SM walks units blockIdx.x, + gridDim.x, ... The stage ring runs on
// across units, so the producer loads the next tile while the consumers store this one.
template <bool TA, bool TB, int BN>
__global__ void __launch_bounds__(384, 1)
    matmul_bf16_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                       const __grid_constant__ CUtensorMap map_c, Bf16MatmulArgs p) {
#ifdef WG_ENABLED
  constexpr int STAGE_BYTES = bf_stage_bytes(BN), STAGES = bf_stages(BN);
  // Whether a tile's stores may wait for the next tile's first stage (see `held` below): at BN 256 only,
  // where the tiles are costliest to store and the two tiles' registers fit (the producer warpgroup's
  // handed over), and not with TA, whose producer warpgroup keeps its registers for A's row sums.
  constexpr bool OVERLAP = BN == 256 && !TA;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const uint32_t base = smem_addr(smem), out_base = base + STAGES * STAGE_BYTES;
  const uint32_t full = out_base + BF_OUT_BYTES + BF_BIAS_BYTES, empty = full + 8 * STAGES;
  const int tiles_m = (p.M + BF_BM - 1) / BF_BM, tiles_n = (p.N + BN - 1) / BN;
  const int units = tiles_m * tiles_n * p.batch * p.splits;

  const bool rowsum = TA && p.a_rowsum;
  init_stage_barriers<STAGES>(full, empty, rowsum ? 10 : 8);

  const int wg = threadIdx.x / 128;
  if (wg == 0) {  // producer
    if (OVERLAP) regs_release<40>();
    if (rowsum && (threadIdx.x / 32 == 1 || threadIdx.x / 32 == 2)) {
      bf16_a_rowsums<STAGE_BYTES, STAGES>(p, base, full, empty, tiles_m, tiles_n, units);
    } else if (threadIdx.x == 0) {
      int it = 0;  // stages filled so far, over all of this block's units
      for (int u = blockIdx.x; u < units; u += gridDim.x) {
        const Bf16Unit w = bf16_unit(p, u, tiles_m, tiles_n);
        const int za = p.a_bcast ? 0 : w.bz, zb = p.b_bcast ? 0 : w.bz;
        const int m0 = w.tile_m * BF_BM, n0 = w.tile_n * BN;
        for (int kt = w.kt0; kt < w.kt1; ++kt, ++it) {
          const int s = it % STAGES, k0 = kt * BF_BK;
          mbar_wait(empty + 8 * s, ((it / STAGES) & 1) ^ 1);  // a fresh barrier passes parity 1
          const uint32_t bar = full + 8 * s, a = base + s * STAGE_BYTES, b = a + BF_A_BYTES;
          mbar_expect_bytes(bar, STAGE_BYTES);  // out-of-range parts of a box still count
          if (TA) {
            for (int h = 0; h < BF_BM / 64; ++h) tma_load(a + h * BF_SLAB, &map_a, m0 + 64 * h, k0, za, bar);
          } else {
            tma_load(a, &map_a, k0, m0, za, bar);
          }
          if (TB) {
            tma_load(b, &map_b, k0, n0, zb, bar);
          } else {
            for (int j = 0; j < BN / 64; ++j) tma_load(b + j * BF_SLAB, &map_b, n0 + 64 * j, k0, zb, bar);
          }
        }
      }
    }
  } else {  // consumers
    if (OVERLAP) regs_acquire<232>();
    const int half = wg - 1;  // rows 64 * half .. of the block's tile
    // One stage: 4 wgmma (k16 each) into the accumulators, committed as one group. A unit's first
    // stage is issued before its loop, so the loop can keep one group in flight while it issues the
    // next and only then waits for the older one (wait_group 1) and hands its buffers back. Zeroing
    // acc instead of the first product's scale-d = 0 would make ptxas serialize every wgmma (C7515).
    float acc[BN / 2];
    int it = 0;  // stages consumed so far, as the producer counts them
    auto issue_stage = [&](int i) {
      const int s = (it + i) % STAGES;
      mbar_wait(full + 8 * s, ((it + i) / STAGES) & 1);
      const uint32_t a = base + s * STAGE_BYTES + half * BF_SLAB, b = base + s * STAGE_BYTES + BF_A_BYTES;
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BF_BK / 16; ++kk) {
        const uint64_t da = TA ? smem_desc(a + kk * 2048, BF_SLAB, 1024) : smem_desc(a + kk * 32, 16, 1024);
        const uint64_t db = TB ? smem_desc(b + kk * 32, 16, 1024) : smem_desc(b + kk * 2048, BF_SLAB, 1024);
        wgmma_bf16<TA, !TB, BN>(acc, da, db, i > 0 || kk > 0);
      }
      wgmma_commit();
    };
    auto release_stage = [&](int i) {
      if (threadIdx.x % 32 == 0) mbar_arrive(empty + 8 * ((it + i) % STAGES));
    };
    // Accumulator layout as in matmul_wgmma_kernel, BN / 8 column groups of 8: thread (warp, g, t)
    // holds rows 16 * warp + g + 8h of the warpgroup's 64 and columns 8j + 2t, +1, in acc[4j + 2h + e].
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, warp = threadIdx.x % 128 / 32;
    const bool leader = threadIdx.x % 128 == 0;  // issues this warpgroup's epilogue stores
    int pieces = 0;                              // epilogue pieces this warpgroup has stored
    // The copy-engine path packs a finished tile into bf16 pairs (out[2j + h]: column group j, row half h).
    // With `overlap` it stores them only once the next tile's first stage is issued, so the tensor cores
    // work through the stores. That pays where the products bound the tile (12 K tiles, K = 768, and
    // more), not where loads and stores do (6, K = 384).
    const bool overlap = OVERLAP && p.ktiles >= 12;
    uint32_t out[BN / 4];
    bool held = false;  // out holds unit `prev`, not yet stored
    Bf16Unit prev{};
    // Piece q: columns 64q .. 64q + 63 of the warpgroup's 64 x BN, 128-byte rows whose 16-byte chunks
    // sit at (chunk ^ row % 8), the layout map_c's swizzle reads. stmatrix stores four 8 x 8 matrices a
    // warp from the C fragments as they are (lane (g, t) holds row g, columns 2t, 2t + 1 of each), lane l
    // naming row l % 8 of matrix l / 8: a quarter of the store instructions of one st.shared a pair.
    auto store_held = [&]() {
#pragma unroll
      for (int q = 0; q < BN / 64; ++q, ++pieces) {
        const uint32_t buf = out_base + (2 * half + pieces % 2) * BF_SLAB;
        if (leader) bulk_wait_read<1>();  // the store two pieces back has read this buffer
        named_sync(1 + half, 128);
#pragma unroll
        for (int jj = 0; jj < 8; jj += 2) {
          const uint32_t* r = out + 2 * (8 * q + jj);
          const int m = lane / 8, row = 16 * warp + lane % 8 + 8 * (m % 2), chunk = jj + m / 2;
          const uint32_t dst = buf + row * 128 + ((chunk ^ (row % 8)) << 4);
          stmatrix_x4(dst, r);
        }
        fence_proxy_async();
        named_sync(1 + half, 128);
        if (leader) tma_store(&map_c, buf, prev.tile_n * BN + 64 * q, prev.tile_m * BF_BM + half * 64, prev.bz);
      }
      held = false;
    };
    // This warpgroup's copy of the tile's bias: read from global memory before the main loop (thread i:
    // columns i and 128 + i), so the load's latency hides behind the products; read in the epilogue,
    // it stalled every piece on a global load.
    __nv_bfloat16* bias_s = reinterpret_cast<__nv_bfloat16*>(smem + STAGES * STAGE_BYTES + BF_OUT_BYTES) + 256 * half;
    const int tid = threadIdx.x % 128;
    for (int u = blockIdx.x; u < units; u += gridDim.x) {
      const Bf16Unit w = bf16_unit(p, u, tiles_m, tiles_n);
      const int nk = w.kt1 - w.kt0;
      const int m_tile = w.tile_m * BF_BM + half * 64, n_tile = w.tile_n * BN;
      __nv_bfloat16 bias_v[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int col = tid + 128 * i;
        bias_v[i] = p.bias && col < BN && n_tile + col < p.N ? p.bias[n_tile + col] : __float2bfloat16_rn(0.f);
      }
      if (nk > 0) {
        issue_stage(0);
        if (held) store_held();  // the previous tile goes out while this one's first products run
        for (int i = 1; i < nk; ++i) {
          issue_stage(i);
          wgmma_wait<1>();
          release_stage(i - 1);
        }
        wgmma_wait<0>();
        release_stage(nk - 1);
        it += nk;
      } else {  // K == 0: C = bias (no tile is held: that takes 12 or more K tiles)
#pragma unroll
        for (int e = 0; e < BN / 2; ++e) acc[e] = 0.f;
      }

      // Every thread of the warpgroup has read the previous tile's bias_s: the copy-engine path passed
      // store_held's barriers after its packing, the register path ends each tile on one.
      bias_s[tid] = bias_v[0];
      if (tid + 128 < BN) bias_s[tid + 128] = bias_v[1];
      named_sync(1 + half, 128);
      // alpha * acc + bias for the pair at column group j, row half h (column n_tile + 8j + 2t).
      auto result = [&](int j, int h) {
        float o[2];
#pragma unroll
        for (int e = 0; e < 2; ++e)
          o[e] = p.alpha * acc[4 * j + 2 * h + e] + __bfloat162float(bias_s[8 * j + 2 * t + e]);
        return make_float2(o[0], o[1]);
      };
      if (p.c_tma) {
#pragma unroll
        for (int j = 0; j < BN / 8; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float2 o = result(j, h);
            const __nv_bfloat162 v = __floats2bfloat162_rn(o.x, o.y);
            out[2 * j + h] = *reinterpret_cast<const uint32_t*>(&v);
          }
        held = true;
        prev = w;
        if (!overlap) store_held();
        continue;
      }
      const int64_t c0 = w.split * p.split_stride + w.bz * p.sc;
#pragma unroll
      for (int j = 0; j < BN / 8; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int m = m_tile + 16 * warp + g + 8 * h, n = n_tile + 8 * j + 2 * t;
          if (m >= p.M) continue;
          const float2 o = result(j, h);
          const int64_t off = c0 + (int64_t)m * p.ldc + n;
          if (p.c_f32) {
            float* dst = static_cast<float*>(p.c) + off;
            if (p.vec_c && n + 1 < p.N) {
              *reinterpret_cast<float2*>(dst) = o;
            } else {
              if (n < p.N) dst[0] = o.x;
              if (n + 1 < p.N) dst[1] = o.y;
            }
          } else {
            __nv_bfloat16* dst = static_cast<__nv_bfloat16*>(p.c) + off;
            if (p.vec_c && n + 1 < p.N) {
              *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(o.x, o.y);
            } else {
              if (n < p.N) dst[0] = __float2bfloat16_rn(o.x);
              if (n + 1 < p.N) dst[1] = __float2bfloat16_rn(o.y);
            }
          }
        }
      named_sync(1 + half, 128);  // every thread has read bias_s before the next tile writes it
    }
    if (held) store_held();
    if (leader) bulk_wait_all();  // shared memory stays until the last store has read it
  }
#else
  __trap();  // built without sm_90a: the launcher refuses before launching
#endif
}

// Split-K's second pass: c = alpha * (split 0 + split 1 + ...) + bias, the fp32 partials (batch x M x
// N each, contiguous) added in split order so every run gives the same bits; likewise A's row sums
// (M floats a split at rowsum_part) into rowsum, when asked for.
__global__ void matmul_bf16_reduce_kernel(const float* part, const __nv_bfloat16* bias, void* c, bool c_f32, int splits,
                                          int64_t split_stride, int M, int N, int64_t ldc, int64_t sc, float alpha,
                                          const float* rowsum_part, float* rowsum) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x, mn = (int64_t)M * N;
  if (rowsum)
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < M; i += stride) {
      float acc = 0.f;
      for (int sp = 0; sp < splits; ++sp) acc += rowsum_part[sp * M + i];
      rowsum[i] = acc;
    }
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < split_stride; i += stride) {
    float acc = 0.f;
    for (int sp = 0; sp < splits; ++sp) acc += part[sp * split_stride + i];
    const int64_t z = i / mn, m = i % mn / N, n = i % N;
    const float o = alpha * acc + (bias ? __bfloat162float(bias[n]) : 0.f);
    const int64_t off = z * sc + m * ldc + n;
    if (c_f32) static_cast<float*>(c)[off] = o;
    else static_cast<__nv_bfloat16*>(c)[off] = __float2bfloat16_rn(o);
  }
}

// How matmul() runs a problem: on which kernel, split along K how many ways, and the workspace
// each part needs (floats).
struct MatmulPlan {
  bool wgmma;
  int splits, kchunk;                  // kchunk: K per split (a multiple of the kernel's K tile)
  size_t packed_a, packed_b, partial;  // workspace floats
};

static MatmulPlan matmul_plan(int batch, int M, int N, int K, bool has_workspace) {
  MatmulPlan plan{};
  // The Hopper kernel pays a pack pass over each operand and fills 128 x 128 tiles: worth it for
  // products of 512^3 and up with every dim at least 128 (below that, or with K = 64 as in attention's
  // batched products, the mma.sync kernel is faster).
  plan.wgmma = has_workspace && hopper_wgmma() && M >= 128 && N >= 128 && K >= 128 &&
               (double)M * N * K * batch >= 512.0 * 512 * 512;
  const int tile = plan.wgmma ? WG_BM : 64, ktile = plan.wgmma ? WG_BK : 16;
  const int64_t tiles = (int64_t)ceil_div(M, tile) * ceil_div(N, tile) * batch;
  const int sms = num_sms();
  // Split K when the output has too few tiles to fill the GPU (a weight gradient: small M x N,
  // K = all the tokens of a batch), each split at least 128 of K. A Hopper block holds a whole SM:
  // aim at one full wave; the mma.sync kernel runs several blocks per SM: aim at 4 per SM.
  int64_t want = 1;
  if (has_workspace && tiles > 0 && K >= 256) {
    if (plan.wgmma && tiles < sms) want = std::min<int64_t>(sms / tiles, K / 128);
    if (!plan.wgmma && tiles < 2 * sms) want = std::min<int64_t>((4 * sms + tiles - 1) / tiles, K / 128);
  }
  plan.kchunk = std::max(ktile, ceil_div(ceil_div(K, std::max<int64_t>(want, 1)), ktile) * ktile);
  plan.splits = ceil_div(std::max(K, 1), plan.kchunk);  // no empty split
  if (plan.wgmma) {
    const size_t ktiles = ceil_div(K, WG_BK);
    plan.packed_a = (size_t)batch * ceil_div(M, WG_BM) * ktiles * WG_TILE;
    plan.packed_b = (size_t)batch * ceil_div(N, WG_BN) * ktiles * WG_TILE;
  }
  plan.partial = plan.splits > 1 ? (size_t)plan.splits * batch * M * N : 0;
  return plan;
}

// Floats of workspace matmul() wants for these sizes.
size_t launch::matmul_workspace_floats(int batch, int M, int N, int K) {
  const MatmulPlan plan = matmul_plan(batch, M, N, K, true);
  return plan.packed_a + plan.packed_b + plan.partial;
}

// Packs op(X) (R x K per batch entry; rs, ks its strides) for the Hopper kernel; returns the packed
// batch stride (0 when x is one matrix broadcast over the batch).
static int64_t matmul_pack(const float* x, float* out, int batch, int R, int K, int64_t rs, int64_t ks, int64_t bs,
                           cudaStream_t s) {
  const int ktiles = ceil_div(K, WG_BK), rtiles = ceil_div(R, 128);
  const int64_t out_bs = bs == 0 ? 0 : (int64_t)rtiles * ktiles * WG_TILE;
  const int copies = bs == 0 ? 1 : batch;
  for (int z0 = 0; z0 < copies; z0 += 65535)      // grid.z limit
    for (int t0 = 0; t0 < rtiles; t0 += 65535) {  // grid.y limit: 8.4M rows
      PackArgs p{x + z0 * bs + (int64_t)t0 * 128 * rs, out + z0 * out_bs + (int64_t)t0 * ktiles * WG_TILE,
                 R - t0 * 128, K, ktiles, rs, ks, bs, out_bs};
      const dim3 grid(ktiles, std::min(rtiles - t0, 65535), std::min(copies - z0, 65535));
      matmul_pack_kernel<<<grid, 256, 0, s>>>(p);
      check_launch("matmul_pack");
    }
  return out_bs;
}

// c[b][m][n] = alpha * sum_k op(A)[b][m][k] * op(B)[b][k][n] + bias[n]. Strides in elements; a
// batch stride of 0 broadcasts an operand. workspace: matmul_workspace_floats(...) floats, or
// nullptr (then the mma.sync kernel, K never split).
void launch::matmul(const float* a, const float* b, const float* bias, float* c, int batch, int M, int N,
                    int K, bool ta, bool tb, int64_t lda, int64_t ldb, int64_t ldc, int64_t sa, int64_t sb,
                    int64_t sc, float alpha, float* workspace, cudaStream_t s) {
  if (batch == 0 || M == 0 || N == 0) return;
  require_tensor_cores("matmul");
  const MatmulPlan plan = matmul_plan(batch, M, N, K, workspace != nullptr);
  float* out = c;
  int64_t ldo = ldc, so = sc, split_stride = 0;
  float out_alpha = alpha;
  const float* out_bias = bias;
  if (plan.splits > 1) {  // partial products into the workspace, no alpha or bias yet
    out = workspace + plan.packed_a + plan.packed_b;
    ldo = N; so = (int64_t)M * N; split_stride = (int64_t)batch * M * N;
    out_alpha = 1.f; out_bias = nullptr;
  }
  const bool vec_c = ldo % 2 == 0 && so % 2 == 0 && N % 2 == 0 && (reinterpret_cast<uintptr_t>(out) & 7) == 0;
  const int zmax = 65535 / plan.splits;  // grid.z limit
  if (plan.wgmma) {
    raise_smem_limit<matmul_wgmma_kernel>(WG_SMEM);
    float* pa = workspace;
    float* pb = workspace + plan.packed_a;
    const int64_t a_bs = matmul_pack(a, pa, batch, M, K, ta ? 1 : lda, ta ? lda : 1, sa, s);
    const int64_t b_bs = matmul_pack(b, pb, batch, N, K, tb ? ldb : 1, tb ? 1 : ldb, sb, s);
    WgmmaArgs p{pa, pb, out_bias, out, M, N, ceil_div(K, WG_BK), a_bs, b_bs, ldo, so, out_alpha, vec_c,
                plan.splits, plan.kchunk / WG_BK, split_stride,
                a, b, ta ? 1 : lda, ta ? lda : 1, tb ? 1 : ldb, tb ? ldb : 1, sa, sb, K};
    for (int z0 = 0; z0 < batch; z0 += zmax) {
      WgmmaArgs q = p;
      q.a += z0 * a_bs; q.b += z0 * b_bs; q.c += z0 * so;
      q.a_src += z0 * sa; q.b_src += z0 * sb;
      const dim3 grid(ceil_div(M, WG_BM) * ceil_div(N, WG_BN), 1, std::min(batch - z0, zmax) * plan.splits);
      matmul_wgmma_kernel<<<grid, 384, WG_SMEM, s>>>(q);
      check_launch("matmul");
    }
  } else {
    MatmulArgs p{a, b, out_bias, out, M, N, K, lda, ldb, ldo, sa, sb, so, out_alpha, vec_c, batch, plan.splits,
                 plan.kchunk, split_stride};
    // 16-byte operand loads need the contiguous extent, leading dims and batch strides in multiples
    // of 4 floats and aligned base pointers; otherwise every element is loaded on its own.
    const bool vec = (ta ? M : K) % 4 == 0 && lda % 4 == 0 && sa % 4 == 0 && aligned16(a) &&
                     (tb ? K : N) % 4 == 0 && ldb % 4 == 0 && sb % 4 == 0 && aligned16(b);
    // Big tiles only when they fill the GPU; otherwise 64 x 64 tiles give 4x more blocks.
    const bool big = (int64_t)ceil_div(M, 128) * ceil_div(N, 128) * batch >= num_sms();
    for (int z0 = 0; z0 < batch; z0 += zmax) {
      MatmulArgs q = p;
      q.batch = std::min(batch - z0, zmax);
      q.a += z0 * sa; q.b += z0 * sb; q.c += z0 * so;
      if (big && vec) matmul_tiles<128, 128, 256, 4>(q, ta, tb, s);
      else if (big) matmul_tiles<128, 128, 256, 1>(q, ta, tb, s);
      else if (vec) matmul_tiles<64, 64, 128, 4>(q, ta, tb, s);
      else matmul_tiles<64, 64, 128, 1>(q, ta, tb, s);
      check_launch("matmul");
    }
  }
  if (plan.splits > 1) {
    const int64_t total = split_stride;
    const int blocks = (int)std::min<int64_t>(ceil_div(total, 256), (int64_t)num_sms() * 8);
    matmul_reduce_kernel<<<blocks, 256, 0, s>>>(out, bias, c, plan.splits, split_stride, M, N, ldc, sc, alpha);
    check_launch("matmul_reduce");
  }
}

// A tensor map over `batch` matrices of rows x inner bf16 values (inner contiguous, leading dim ld,
// batch stride bs; bs == 0: one matrix for every batch entry), read in boxes of 64 x box_rows.
static CUtensorMap bf16_tile_map(const void* x, int64_t inner, int64_t rows, int64_t ld, int batch, int64_t bs,
                                 int box_rows) {
  CUtensorMap map;
  const cuuint64_t dims[3] = {(cuuint64_t)inner, (cuuint64_t)rows, (cuuint64_t)(bs == 0 ? 1 : batch)};
  const cuuint64_t strides[2] = {(cuuint64_t)ld * 2, (cuuint64_t)(bs == 0 ? ld * rows : bs) * 2};  // bytes
  const cuuint32_t box[3] = {64, (cuuint32_t)box_rows, 1}, elem_strides[3] = {1, 1, 1};
  const CUresult r = tensor_map_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(x), dims,
                                          strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                          CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw std::runtime_error("matmul: cuTensorMapEncodeTiled failed (CUresult " + std::to_string((int)r) + ")");
  return map;
}

// A tensor map reads rows that start on 16 bytes: an aligned base, leading dim and batch stride
// multiples of 8 elements.
bool launch::matmul_bf16_operand_ok(const void* x, int64_t ld, int64_t bs) { return aligned16(x) && ld % 8 == 0 && bs % 8 == 0; }

// How matmul_bf16 runs a problem: N tile bn, and K split into `splits` parts of kt_per_split K tiles
// each (1 part: no split).
struct Bf16Plan {
  int bn, splits, kt_per_split;
};

static Bf16Plan bf16_plan(int batch, int M, int N, int K, bool has_workspace) {
  const int ktiles = ceil_div(K, BF_BK), sms = num_sms();
  const bool can_split = has_workspace && ktiles >= 32;
  const auto tiles_for = [&](int bn) { return (int64_t)ceil_div(M, BF_BM) * ceil_div(N, bn) * batch; };
  // The N tile that takes the fewest rounds of tiles over the SMs, a round costing the tile's width plus
  // 32 (its pipeline fill and epilogue), the wider tile on a tie: 192 where 256 pads N (384, 1152) or
  // leaves SMs idle (a 3072 x 768 weight gradient: 96 tiles against 72). Where even that fills under
  // half the SMs and K is too short to split, narrower tiles spread the work (1024^3: 128 tiles of
  // 128 x 64 against 32 of 128 x 256).
  const auto cost = [&](int bn) { return (tiles_for(bn) + sms - 1) / sms * (bn + 32); };
  Bf16Plan plan{cost(192) < cost(256) ? 192 : 256, 1, std::max(ktiles, 1)};
  if (tiles_for(plan.bn) * 2 <= sms && !can_split)
    for (int bn : {128, 64})
      if (cost(bn) < cost(plan.bn)) plan.bn = bn;
  const int64_t tiles = tiles_for(plan.bn);
  // Split K when the tiles fill under half the SMs and K is long (32 K tiles, 2048, or more), each
  // split keeping at least 8 K tiles (512): shorter ones pay more in partial sums written and read
  // and a second launch than they gain in busy SMs (32 tiles of 16 K tiles run slower in two splits than
  // whole; a weight gradient of 384 x 384 over K = 16384 is the case that needs it).
  if (can_split && tiles * 2 <= sms) {
    const int want = (int)std::min<int64_t>(sms / tiles, ktiles / 8);
    plan.kt_per_split = ceil_div(ktiles, want);
    plan.splits = ceil_div(ktiles, plan.kt_per_split);  // no empty split
  }
  // A partly idle last round stays as it is. Stream-K (that round's K tiles shared out evenly over all the
  // blocks, each tile's parts added by its last block in block order) does not pay here: each block writes,
  // and an owner reads back, an fp32 partial tile.
  return plan;
}

// Floats of workspace matmul_bf16 wants for these sizes (0: it never splits K for them); a_rowsum: with
// A's row sums.
size_t launch::matmul_bf16_workspace_floats(int batch, int M, int N, int K, bool a_rowsum) {
  const Bf16Plan plan = bf16_plan(batch, M, N, K, true);
  return plan.splits > 1 ? (size_t)plan.splits * batch * M * N + (a_rowsum ? (size_t)plan.splits * M : 0) : 0;
}

// Launches matmul_bf16_kernel for the operands' orientations, its shared-memory limit raised once per device.
template <bool TA, bool TB, int BN>
static void bf16_launch_one(int grid, const CUtensorMap& ma, const CUtensorMap& mb, const CUtensorMap& mc,
                            const Bf16MatmulArgs& p, cudaStream_t s) {
  raise_smem_limit<matmul_bf16_kernel<TA, TB, BN>>(bf_smem(BN));
  matmul_bf16_kernel<TA, TB, BN><<<grid, 384, bf_smem(BN), s>>>(ma, mb, mc, p);
}

template <int BN>
static void bf16_launch_kernel(bool ta, bool tb, int grid, const CUtensorMap& ma, const CUtensorMap& mb,
                               const CUtensorMap& mc, const Bf16MatmulArgs& p, cudaStream_t s) {
  if (ta && tb) bf16_launch_one<true, true, BN>(grid, ma, mb, mc, p, s);
  else if (ta) bf16_launch_one<true, false, BN>(grid, ma, mb, mc, p, s);
  else if (tb) bf16_launch_one<false, true, BN>(grid, ma, mb, mc, p, s);
  else bf16_launch_one<false, false, BN>(grid, ma, mb, mc, p, s);
}

static void bf16_launch(const Bf16Plan& plan, const __nv_bfloat16* a, const __nv_bfloat16* b,
                        const __nv_bfloat16* bias, void* c, bool c_f32, int batch, int M, int N, int K, bool ta,
                        bool tb, int64_t lda, int64_t ldb, int64_t ldc, int64_t sa, int64_t sb, int64_t sc,
                        float alpha, float* a_rowsum, float* workspace, cudaStream_t s) {
  int dev = 0;
  cudaGetDevice(&dev);
  // The tensor-map encoder is a driver call and needs the device's context current on this thread;
  // autograd's backward thread may not have made it so yet (CUDA_ERROR_INVALID_CONTEXT).
  thread_local uint64_t bound = 0;  // devices whose context this thread has made current
  static_assert(kMaxDevices <= 64, "one bit a device");
  if (dev >= kMaxDevices || !(bound >> dev & 1)) {
    cudaSetDevice(dev);
    if (dev < kMaxDevices) bound |= 1ull << dev;
  }
  // With K == 0 nothing is read, and a tensor map of an empty matrix cannot be built: C = bias.
  CUtensorMap ma{}, mb{}, mc{};
  if (K > 0) {
    ma = ta ? bf16_tile_map(a, M, K, lda, batch, sa, 64) : bf16_tile_map(a, K, M, lda, batch, sa, BF_BM);
    mb = tb ? bf16_tile_map(b, K, N, ldb, batch, sb, plan.bn) : bf16_tile_map(b, N, K, ldb, batch, sb, 64);
  }
  Bf16MatmulArgs p{bias, c, M, N, ceil_div(K, BF_BK), ldc, sc, alpha, c_f32, false, false, sa == 0, sb == 0, batch,
                   plan.splits, plan.kt_per_split, 0, a_rowsum};
  float* rowsum_part = plan.splits > 1 ? workspace + (size_t)plan.splits * batch * M * N : nullptr;
  if (plan.splits > 1) {  // fp32 partial products into the workspace, alpha and bias in the reduction
    p.bias = nullptr;
    p.c = workspace;
    p.c_f32 = true;
    p.alpha = 1.f;
    p.ldc = N;
    p.sc = (int64_t)M * N;
    p.split_stride = (int64_t)batch * M * N;
    if (a_rowsum) p.a_rowsum = rowsum_part;  // a partial row of sums a split, after the products'
  }
  const int64_t c_align = p.c_f32 ? 8 : 4;
  p.vec_c = p.ldc % 2 == 0 && p.sc % 2 == 0 && N % 2 == 0 && reinterpret_cast<uintptr_t>(p.c) % c_align == 0;
  // A bf16 C whose rows a tensor map can address goes out through the copy engine.
  // (sc == 0 with a batch, every entry writing one C, stays on the register path: a tensor map's
  // batch stride of 0 means one matrix, which would clip the other entries' stores.)
  const int64_t c_bs = batch == 1 ? 0 : p.sc;
  p.c_tma = !p.c_f32 && (batch == 1 || p.sc != 0) && launch::matmul_bf16_operand_ok(p.c, p.ldc, c_bs);
  if (p.c_tma) mc = bf16_tile_map(p.c, N, M, p.ldc, batch, c_bs, 64);
  const int64_t units = (int64_t)ceil_div(M, BF_BM) * ceil_div(N, plan.bn) * batch * plan.splits;
  if (units > INT32_MAX) throw std::runtime_error("matmul: bfloat16 product has more than 2^31 - 1 output tiles");
  const int grid = (int)std::min<int64_t>(units, num_sms());  // persistent: one block per SM
  switch (plan.bn) {
    case 64: bf16_launch_kernel<64>(ta, tb, grid, ma, mb, mc, p, s); break;
    case 128: bf16_launch_kernel<128>(ta, tb, grid, ma, mb, mc, p, s); break;
    case 192: bf16_launch_kernel<192>(ta, tb, grid, ma, mb, mc, p, s); break;
    default: bf16_launch_kernel<256>(ta, tb, grid, ma, mb, mc, p, s);
  }
  check_launch("matmul (bf16)");
  if (plan.splits > 1) {
    const int blocks = (int)std::min<int64_t>(ceil_div(p.split_stride, 256), (int64_t)num_sms() * 8);
    matmul_bf16_reduce_kernel<<<blocks, 256, 0, s>>>(workspace, bias, c, c_f32, plan.splits, p.split_stride, M, N,
                                                     ldc, sc, alpha, rowsum_part, a_rowsum);
    check_launch("matmul_reduce (bf16)");
  }
}

// matmul() for bf16 operands: c = alpha * op(A) op(B) + bias, fp32 accumulation, c in bf16 (or fp32
// when c_f32). Same operand conventions as matmul(); each operand must pass matmul_bf16_operand_ok.
// a_rowsum (or nullptr): also A's row sums over K, M floats (fp32 sums of the bf16 values), for one
// A stored K x M (ta, batch 1) and N > 0: a linear's bias gradient next to its weight gradient.
// workspace: matmul_bf16_workspace_floats(..., a_rowsum != nullptr) floats, or nullptr (then K is
// never split).
void launch::matmul_bf16(const __nv_bfloat16* a, const __nv_bfloat16* b, const __nv_bfloat16* bias, void* c, bool c_f32,
                         int batch, int M, int N, int K, bool ta, bool tb, int64_t lda, int64_t ldb, int64_t ldc, int64_t sa,
                         int64_t sb, int64_t sc, float alpha, float* a_rowsum, float* workspace, cudaStream_t s) {
  if (a_rowsum && (!ta || batch != 1 || N == 0))
    throw std::invalid_argument("matmul: A's row sums need one A stored K x M (ta, batch 1) and N > 0");
  if (batch == 0 || M == 0 || N == 0) return;
  if (!hopper_wgmma())
    throw std::runtime_error("matmul: bfloat16 runs on Hopper's wgmma: it needs a compute capability 9.0 GPU and a "
                             "build with sm_90a code (TORCH_CUDA_ARCH_LIST=9.0a)");
  if (!matmul_bf16_operand_ok(a, lda, sa) || !matmul_bf16_operand_ok(b, ldb, sb))
    throw std::runtime_error("matmul: bfloat16 operands need 16-byte aligned rows (leading dims and batch strides "
                             "multiples of 8 elements)");
  bf16_launch(bf16_plan(batch, M, N, K, workspace != nullptr), a, b, bias, c, c_f32, batch, M, N, K, ta, tb, lda, ldb,
              ldc, sa, sb, sc, alpha, a_rowsum, workspace, s);
}

// ================================================================================================
// 7. Attention
// Tiled (composed in bindings.cpp), fused FlashAttention-2 style on mma.sync, and the
// FlashAttention-3 design on Hopper.
// ================================================================================================

// ------------------------------------------------------------------------------------------------
// 7.1 attention: shapes, operand policies, tiles
// Q (BH, Sq, D), k and v (BH / group, Sk, D), contiguous. Causal aligns queries to the end
// of the keys: query i sees keys j <= i + (Sk - Sq), so Sq = 1 decodes one token against a cache.
// Grouped-query attention: query heads h * group .. h * group + group - 1 share K/V head h (group = 1
// is ordinary multi-head attention, group = H multi-query); a smaller KV cache for the same queries.
// For a preallocated KV cache, the forward can take kv_len, a device pointer to the number of valid
// leading keys (Sk is then the cache's capacity, which sets the stride between heads): the kernel
// reads it at run time, so one CUDA graph serves every position of a decode loop. A query that sees
// no key (only possible with kv_len < Sq) gets zeros.
//
// Tiled attention is composed in bindings.cpp from the pieces above (batched matmul for Q K^T,
// the masked softmax, matmul for P V, and the same pieces backwards); it stores the S x S scores.
//
// Fused attention (FlashAttention-2 style) never stores them. A forward block owns 64 * MT queries
// (4 warps x MT tiles of 16 rows; MT = 2 for bf16 at D <= 64, else 1); K and V stream through shared
// memory 64 keys at a time (cp.async). Where two blocks per SM still fit (attn_stages), K and V have two
// stages: the next tile loads during the whole of the current one, one barrier per tile; else one
// stage, the next K tile loading while the current V tile is used and the other way round. The
// backward streams its Q/dO (dK/dV blocks) and K/V (dQ blocks) tiles the same way. The softmax is
// online (running max m and sum l per row, the output accumulator rescaled when m grows), in log2
// units: m is the max of s * scale * log2(e), a probability exp2(s * scale * log2(e) - m), one FFMA
// and one ex2. The block saves lse_log2 = m + log2(l) per row so the backward can rebuild
// P = exp2(s * scale * log2(e) - lse_log2) tile by tile.
//
// The products run on the tensor cores (1.6), 3xTF32 by default ('fp32'), one TF32
// product with precision='tf32'. A score tile from a C fragment feeds the next product as its A
// operand if the 8 keys of a k-step are taken in the order (0,2,4,6,1,3,5,7): then
// a = {c0, c2, c1, c3}, and the B operand reads key rows 2t and 2t+1.
// Shared-memory rows are padded to D + 4 floats, which makes every fragment read conflict-free.
//
// bf16 q, k, v (bf16 out and gradients) multiply on the tensor cores in bf16 with fp32 accumulation
// (mma.sync m16n8k16, FlashAttention-2's shape); the softmax statistics, lse_log2 and delta stay fp32.
// Fragments come from shared memory through ldmatrix (.trans for the right operand of P V, dS K and
// their transposed-frame twins); rows are padded by one 16-byte chunk (D + 8 elements), which puts
// the 8 row addresses of each ldmatrix phase in 8 different bank groups. Two adjacent n8 score tiles
// in C fragments are the A fragment of one k16 step of P V, packed to bf16x2: no reordering.
//
// On Hopper, bf16 at head sizes 64 and 128 runs the FlashAttention-3 design instead (copy-engine loads,
// warp specialization, wgmma for every product): attention_fwd_tma_kernel forward,
// attention_bwd_dkv_tma_kernel and attention_bwd_dq_tma_kernel backward, or with deterministic=False
// attention_bwd_dkv_tma_kernel adding dQ across key blocks and attention_bwd_dq_finish_kernel (see there).
//
// The kernels are written once over an operand policy (AttnTf32, AttnBf16 below): its element type,
// its shared-memory row, and the two products every kernel is built from. Tile walking, masking,
// the online softmax, the splits and their merge do not depend on it.
//
// Dropout on the probabilities (every fused kernel's DROP, mma.sync and Hopper): probability (i, j) of
// query head h is element ((b * H + h) * Sq + i, j) of 1.8's draws. The forward multiplies P by its
// factors after the row sums took it whole; the backward draws them again, multiplying dP (dO V^T is the
// gradient of the kept, scaled P) before dS = P (dP - delta), and P before dV = P^T dO. delta =
// rowsum(dO * O) holds as it is: O is the output with dropout. The dK/dV kernels work in the transposed
// frame, where a lane's values sit on 4 counters instead of 1: Dropout::factors_t shares them between
// lane pairs. With dropout the bf16 backward is the deterministic one (no dQ added across key blocks).
//
// Twin: train.torch_attention (SDPA; with dropout spelled out). Uses: 1.5 cp_async, 1.6 mma/mma_bf16/ldmatrix,
// 1.7 (Hopper), 1.8 Dropout.

// Elements of a shared-memory row holding D of them: one 16-byte chunk of padding.
template <class T, int D>
__host__ __device__ constexpr int smem_row() { return D + per16<T>(); }

// Bytes of shared memory a fused-attention block asks for: `rows` tile rows of the policy's layout,
// `extra` bytes after them, and room to align the start to 1024 bytes for wgmma's swizzled tiles.
template <class Ops>
__host__ __device__ constexpr int attn_smem_bytes(int rows, int extra = 0) {
  return rows * Ops::LD * (int)sizeof(typename Ops::T) + extra + (Ops::WGMMA ? 1024 : 0);
}

// Stages of the tiles a fused-attention block streams (see the section comment): two where a block
// holding `fixed` rows plus two stages of `streamed` rows and `extra` bytes each leaves room for a second
// block on the SM (228 KB of shared memory, 1 KB of it reserved per block), else one.
template <class Ops>
__host__ __device__ constexpr int attn_stages(int fixed, int streamed, int extra = 0) {
  return attn_smem_bytes<Ops>(fixed + 2 * streamed, 2 * extra) <= 113 * 1024 ? 2 : 1;
}

// The start of a block's dynamic shared memory, aligned as Ops's tiles need (the 128-byte swizzle is
// a function of address bits 4-9: a swizzled tile starts on 1024 bytes).
template <class Ops>
__device__ __forceinline__ unsigned char* attn_smem_base(unsigned char* raw) {
  if constexpr (!Ops::WGMMA) return raw;
  return reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
}

// Where an attention tensor keeps its values: AttnLayout (part 0).

// The rows of one head: row r at p + r * row (row: the layout's ss, which the launcher keeps under
// 2^31). The tile loops address rows through this: a multiply, as with contiguous heads.
template <class T>
struct AttnRows {
  T* p;
  int row;
  __device__ __forceinline__ T* at(int r) const { return p + (int64_t)r * row; }
};

// The query heads that share a K/V head, stacked (the forward's rows): row r is position r % per of
// head r / per. Read once per block (the Q tile, the output), so its divisions cost little.
template <class T>
struct AttnGroupRows {
  T* p;
  int64_t head;
  int row, per;
  __device__ __forceinline__ T* at(int r) const { return p + (int64_t)(r / per) * head + (int64_t)(r % per) * row; }
};

template <class T>
__device__ __forceinline__ T* head_start(T* base, const AttnLayout& l, int bh) {  // bh = b * heads + h
  return base + (int64_t)(bh / l.heads) * l.sb + (int64_t)(bh % l.heads) * l.sh;
}
template <class T>
__device__ __forceinline__ AttnRows<T> attn_rows(T* base, const AttnLayout& l, int bh) {
  return {head_start(base, l, bh), (int)l.ss};
}
// Heads bh, bh + 1, ... of one batch entry, per rows each.
template <class T>
__device__ __forceinline__ AttnGroupRows<T> attn_group_rows(T* base, const AttnLayout& l, int bh, int per) {
  return {head_start(base, l, bh), l.sh, (int)l.ss, per};
}

// Threads of every fused-attention block (4 warps).
constexpr int ATTN_THREADS = 128;

// Rows [r0, r0 + ROWS) of one head's (S, D) rows (AttnRows or AttnGroupRows) into a smem tile laid
// out as Ops says (Ops::at(r, c): where element c of row r goes); rows >= S become zeros. Every tile
// here makes the 16-byte chunks a multiple of the block's threads: the loop unrolls into straight
// cp.asyncs.
template <int ROWS, class Ops, class T, class Rows>
__device__ __forceinline__ void load_rows_async(T* sm, const Rows& g, int r0, int S) {
  constexpr int W = per16<T>(), CHUNKS = Ops::D / W;
  static_assert(ROWS * CHUNKS % ATTN_THREADS == 0, "whole chunks per thread");
#pragma unroll
  for (int i = 0; i < ROWS * CHUNKS / ATTN_THREADS; ++i) {
    const int e = threadIdx.x + i * ATTN_THREADS, r = e / CHUNKS, c = (e % CHUNKS) * W;
    const bool valid = r0 + r < S;
    cp_async<16>(sm + Ops::at(r, c), g.at(valid ? r0 + r : 0) + c, valid);
  }
}

// The same for one head's rows, the tiles the main loops stream: a thread's chunks of a whole tile lie
// a fixed number of rows apart (a multiple of 8, so a swizzled layout puts them in the same column),
// so after the first address each is an add (no per-chunk row math).
template <int ROWS, class Ops, class T>
__device__ __forceinline__ void load_rows_async(T* sm, const AttnRows<const T>& g, int r0, int S) {
  constexpr int W = per16<T>(), CHUNKS = Ops::D / W;
  if constexpr (ATTN_THREADS % CHUNKS == 0) {
    if (r0 + ROWS <= S) {
      constexpr int STEP = ATTN_THREADS / CHUNKS;  // rows between a thread's chunks
      static_assert(ROWS % STEP == 0 && (STEP % 8 == 0 || !Ops::WGMMA), "whole rows, the same swizzle phase");
      const int r = threadIdx.x / CHUNKS, c = threadIdx.x % CHUNKS * W;
      const T* src = g.at(r0 + r) + c;
      T* dst = sm + Ops::at(r, c);
      const int64_t step = (int64_t)STEP * g.row;
#pragma unroll
      for (int i = 0; i < ROWS / STEP; ++i) cp_async<16>(dst + i * STEP * Ops::LD, src + i * step, true);
      return;
    }
  }
  load_rows_async<ROWS, Ops, T, AttnRows<const T>>(sm, g, r0, S);
}

// The tiles this thread copied (all but the newest N groups) have landed, and every thread's have:
// the block may read them. wgmma reads shared memory through the async proxy, and cp.async writes it
// through the generic one: each thread's landed copies are made visible to the async proxy before
// the barrier.
template <class Ops, int N>
__device__ __forceinline__ void tiles_landed() {
  cp_async_wait<N>();
#ifdef WG_ENABLED
  if constexpr (Ops::WGMMA) fence_proxy_async();
#endif
  __syncthreads();
}

// A fragment (rows row0 + g, row0 + g + 8; columns k0 + t, k0 + t + 4) of a smem matrix.
template <int D, bool PRECISE>
__device__ __forceinline__ Frag<4, PRECISE> frag_a(const float* sm, int row0, int k0) {
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  const float* p = sm + (row0 + g) * (D + 4) + k0 + t;
  const float x[4] = {p[0], p[8 * (D + 4)], p[4], p[8 * (D + 4) + 4]};
  Frag<4, PRECISE> f;
  f.set(x);
  return f;
}

// B fragment of M^T for a smem matrix M (row-major, rows = n): b = M[n0 + g][k0 + t], [.. + 4].
template <int D, bool PRECISE>
__device__ __forceinline__ Frag<2, PRECISE> frag_bt(const float* sm, int n0, int k0) {
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  const float* p = sm + (n0 + g) * (D + 4) + k0 + t;
  const float x[2] = {p[0], p[4]};
  Frag<2, PRECISE> f;
  f.set(x);
  return f;
}

// B fragment of M itself with the permuted k order: b = M[k0 + 2t][n0 + g], M[k0 + 2t + 1][n0 + g].
template <int D, bool PRECISE>
__device__ __forceinline__ Frag<2, PRECISE> frag_b_perm(const float* sm, int k0, int n0) {
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  const float* p = sm + (k0 + 2 * t) * (D + 4) + n0 + g;
  const float x[2] = {p[0], p[D + 4]};
  Frag<2, PRECISE> f;
  f.set(x);
  return f;
}

// A fragment from the C fragment of a score tile (the permuted k order, see above).
template <bool PRECISE>
__device__ __forceinline__ Frag<4, PRECISE> frag_a_from_c(const float (&c)[4]) {
  const float x[4] = {c[0], c[2], c[1], c[3]};
  Frag<4, PRECISE> f;
  f.set(x);
  return f;
}

// acc (16 x 8*NT per warp) += A (rows row0.., D wide) * B^T (rows of bsm, NT*8 of them).
template <int D, int NT, bool PRECISE>
__device__ __forceinline__ void mma_a_times_bt(float (&acc)[NT][4], const float* asm_, int row0, const float* bsm) {
#pragma unroll
  for (int kk = 0; kk < D; kk += 8) {
    const Frag<4, PRECISE> a = frag_a<D, PRECISE>(asm_, row0, kk);
#pragma unroll
    for (int j = 0; j < NT; ++j) mma<PRECISE>(acc[j], a, frag_bt<D, PRECISE>(bsm, j * 8, kk));
  }
}

// acc (16 x D per warp) += P (16 x 8*NT, C fragments) * M (rows of msm, D wide).
template <int D, int NT, bool PRECISE>
__device__ __forceinline__ void mma_p_times_m(float (&acc)[D / 8][4], const float (&p)[NT][4], const float* msm) {
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const Frag<4, PRECISE> a = frag_a_from_c<PRECISE>(p[j]);
#pragma unroll
    for (int n = 0; n < D / 8; ++n) mma<PRECISE>(acc[n], a, frag_b_perm<D, PRECISE>(msm, j * 8, n * 8));
  }
}

// The operand policies of the fused kernels. a_times_bt<NT>: acc (16 x 8*NT per warp) += A (smem rows
// row0.., D wide) * B^T (smem rows 0 .. 8*NT), the shape of Q K^T. p_times_m<NT>: acc (16 x D per warp) +=
// P (16 x 8*NT, C fragments) * M (smem rows 0 .. 8*NT, D wide), the shape of P V. Each also comes for MT
// such row tiles per warp at once (tile mt: A rows row0 + 64 mt): the forward's warps own MT tiles of 16
// rows, and each B fragment read from shared memory then feeds MT products.
template <int D_, bool PRECISE>
struct AttnTf32 {
  using T = float;
  static constexpr int D = D_, LD = smem_row<T, D>(), MT = 1;
  static constexpr bool WGMMA = false;
  __device__ __forceinline__ static int at(int r, int c) { return r * LD + c; }  // padded rows
  template <int NT, int M>
  __device__ __forceinline__ static void a_times_bt(float (&acc)[M][NT][4], const T* a, int row0, const T* b) {
#pragma unroll
    for (int mt = 0; mt < M; ++mt) mma_a_times_bt<D, NT, PRECISE>(acc[mt], a, row0 + 64 * mt, b);
  }
  template <int NT, int M>
  __device__ __forceinline__ static void p_times_m(float (&acc)[M][D / 8][4], const float (&p)[M][NT][4], const T* m) {
#pragma unroll
    for (int mt = 0; mt < M; ++mt) mma_p_times_m<D, NT, PRECISE>(acc[mt], p[mt], m);
  }
  template <int NT>
  __device__ __forceinline__ static void a_times_bt(float (&acc)[NT][4], const T* a, int row0, const T* b) {
    mma_a_times_bt<D, NT, PRECISE>(acc, a, row0, b);
  }
  template <int NT>
  __device__ __forceinline__ static void p_times_m(float (&acc)[D / 8][4], const float (&p)[NT][4], const T* m) {
    mma_p_times_m<D, NT, PRECISE>(acc, p, m);
  }
};

// A policy P's products for one row tile per warp (the backward's), through its M-tile ones.
template <class P, int D, class T>
struct OneRowTile {
  template <int NT>
  __device__ __forceinline__ static void a_times_bt(float (&acc)[NT][4], const T* a, int row0, const T* b) {
    P::template a_times_bt<NT, 1>(reinterpret_cast<float(&)[1][NT][4]>(acc), a, row0, b);
  }
  template <int NT>
  __device__ __forceinline__ static void p_times_m(float (&acc)[D / 8][4], const float (&p)[NT][4], const T* m) {
    P::template p_times_m<NT, 1>(reinterpret_cast<float(&)[1][D / 8][4]>(acc),
                                 reinterpret_cast<const float(&)[1][NT][4]>(p), m);
  }
};

template <int D_>
struct AttnBf16 : OneRowTile<AttnBf16<D_>, D_, __nv_bfloat16> {
  using T = __nv_bfloat16;
  // Two row tiles per forward warp where the registers allow (its o and s double).
  static constexpr int D = D_, LD = smem_row<T, D>(), MT = D <= 64 ? 2 : 1;
  static constexpr bool WGMMA = false;
  __device__ __forceinline__ static int at(int r, int c) { return r * LD + c; }  // padded rows
  // A: matrices (rows 0-7, cols 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15) are a0..a3. B: two n8
  // tiles per ldmatrix, matrices (rows 0-7, cols 0-7), (0-7, 8-15), (8-15, 0-7), (8-15, 8-15) are
  // b0, b1 of the first tile and b0, b1 of the second.
  template <int NT, int M>
  __device__ __forceinline__ static void a_times_bt(float (&acc)[M][NT][4], const T* a, int row0, const T* b) {
    static_assert(NT % 2 == 0, "two n8 tiles per ldmatrix");
    const int l = threadIdx.x & 31;
    const T* pa = a + (row0 + (l & 15)) * LD + (l >> 4) * 8;
    const T* pb = b + ((l & 7) + (l >> 4) * 8) * LD + ((l >> 3) & 1) * 8;
#pragma unroll
    for (int kk = 0; kk < D; kk += 16) {
      uint32_t af[M][4];
#pragma unroll
      for (int mt = 0; mt < M; ++mt) ldmatrix_x4<false>(af[mt], pa + 64 * mt * LD + kk);
#pragma unroll
      for (int j = 0; j < NT; j += 2) {
        uint32_t bf[4];
        ldmatrix_x4<false>(bf, pb + j * 8 * LD + kk);
#pragma unroll
        for (int mt = 0; mt < M; ++mt) {
          mma_bf16(acc[mt][j], af[mt], bf[0], bf[1]);
          mma_bf16(acc[mt][j + 1], af[mt], bf[2], bf[3]);
        }
      }
    }
  }
  // The C fragments of score tiles j, j + 1 are the A fragment of k step j / 2. M's matrices, read
  // transposed: (keys 0-7, cols 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15) are b0, b1 of the first
  // n8 tile and b0, b1 of the second.
  template <int NT, int M>
  __device__ __forceinline__ static void p_times_m(float (&acc)[M][D / 8][4], const float (&p)[M][NT][4], const T* m) {
    static_assert(NT % 2 == 0, "k steps of 16 keys");
    const int l = threadIdx.x & 31;
    const T* pm_ = m + (l & 15) * LD + (l >> 4) * 8;
#pragma unroll
    for (int j = 0; j < NT; j += 2) {
      uint32_t af[M][4];
#pragma unroll
      for (int mt = 0; mt < M; ++mt) {
        af[mt][0] = pack_bf16x2(p[mt][j][0], p[mt][j][1]);
        af[mt][1] = pack_bf16x2(p[mt][j][2], p[mt][j][3]);
        af[mt][2] = pack_bf16x2(p[mt][j + 1][0], p[mt][j + 1][1]);
        af[mt][3] = pack_bf16x2(p[mt][j + 1][2], p[mt][j + 1][3]);
      }
#pragma unroll
      for (int n = 0; n < D / 8; n += 2) {
        uint32_t bf[4];
        ldmatrix_x4<true>(bf, pm_ + j * 8 * LD + n * 8);
#pragma unroll
        for (int mt = 0; mt < M; ++mt) {
          mma_bf16(acc[mt][n], af[mt], bf[0], bf[1]);
          mma_bf16(acc[mt][n + 1], af[mt], bf[2], bf[3]);
        }
      }
    }
  }
  using OneRowTile<AttnBf16<D_>, D_, T>::a_times_bt;
  using OneRowTile<AttnBf16<D_>, D_, T>::p_times_m;
};

// bf16 on Hopper's warpgroup MMA (sm_90a), D = 64. The block's 4 warps are one warpgroup, and a
// product is wgmma m64n64k16 over a whole 64-row tile: warp w gets rows 16w .. 16w + 15, n8 tile j in
// registers 4j .. 4j + 3, exactly the C fragments of the mma.sync policies above, so the kernels run
// unchanged (their row0 is always 16 * warp). A score tile's C fragments are also wgmma's register
// layout for the left operand, as they are mma.sync's. The smem operands are read through
// descriptors, in the 128-byte swizzle: a row is 64 elements (128 bytes, no padding), its 16-byte
// chunk c stored at chunk c ^ (row % 8), a tile starting on 1024 bytes. The right operand is K-major
// in a_times_bt (rows of B are its n, D along k) and N-major in p_times_m (rows of M are its k). Each product waits
// for its wgmmas before returning: the softmax between them needs the results anyway, and two blocks
// per SM overlap one's softmax with the other's products.
template <int D_>
struct AttnBf16Wg : OneRowTile<AttnBf16Wg<D_>, D_, __nv_bfloat16> {
  using T = __nv_bfloat16;
  static_assert(D_ == 64, "one 128-byte swizzle row per tile row");
  static constexpr int D = D_, LD = D, MT = 2;
  static constexpr bool WGMMA = true;
  __device__ __forceinline__ static int at(int r, int c) { return r * LD + ((((c >> 3) ^ r) & 7) << 3) + (c & 7); }
  // 8-row groups 1024 bytes apart; a k16 step is 32 bytes along a K-major row, 16 rows (2048 bytes)
  // down an N-major tile (whose 64 columns are one swizzle row: the slab stride is not used).
  __device__ __forceinline__ static uint64_t k_major(const T* p, int kk) {
    return smem_desc(smem_addr(p) + 32 * kk, 16, 1024);
  }
  __device__ __forceinline__ static uint64_t n_major(const T* p, int kk) {
    return smem_desc(smem_addr(p) + 2048 * kk, 8192, 1024);
  }
  template <int NT, int M>
  __device__ __forceinline__ static void a_times_bt(float (&acc)[M][NT][4], const T* a, int, const T* b) {
    static_assert(NT == 8, "64 columns: m64n64");
    wgmma_fence();
#pragma unroll
    for (int mt = 0; mt < M; ++mt)
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
        wgmma_bf16<0, 0, 64>(reinterpret_cast<float(&)[32]>(acc[mt]), k_major(a + 64 * mt * LD, kk), k_major(b, kk), 1);
    wgmma_commit_and_wait();
  }
  template <int NT, int M>
  __device__ __forceinline__ static void p_times_m(float (&acc)[M][D / 8][4], const float (&p)[M][NT][4], const T* m) {
    static_assert(NT % 2 == 0, "k steps of 16");
    uint32_t af[M][NT / 2][4];  // packed first: the fence below covers every register the wgmmas read
#pragma unroll
    for (int mt = 0; mt < M; ++mt)
#pragma unroll
      for (int j = 0; j < NT; j += 2) {
        af[mt][j / 2][0] = pack_bf16x2(p[mt][j][0], p[mt][j][1]);
        af[mt][j / 2][1] = pack_bf16x2(p[mt][j][2], p[mt][j][3]);
        af[mt][j / 2][2] = pack_bf16x2(p[mt][j + 1][0], p[mt][j + 1][1]);
        af[mt][j / 2][3] = pack_bf16x2(p[mt][j + 1][2], p[mt][j + 1][3]);
      }
    wgmma_fence();
#pragma unroll
    for (int mt = 0; mt < M; ++mt)
#pragma unroll
      for (int j = 0; j < NT / 2; ++j)
        wgmma_bf16_ra<1, 64>(reinterpret_cast<float(&)[32]>(acc[mt]), af[mt][j], n_major(m, j), 1);
    wgmma_commit_and_wait();
  }
  using OneRowTile<AttnBf16Wg<D_>, D_, T>::a_times_bt;
  using OneRowTile<AttnBf16Wg<D_>, D_, T>::p_times_m;
};

template <class T>
struct AttnArgs {
  const T *q, *k, *v, *dout;
  T *out, *dq, *dk, *dv;
  AttnLayout lq, lk, lv, lout, ldout, ldq, ldk, ldv;  // each tensor's strides
  float *lse_log2, *delta;
  const int64_t* kv_len;  // forward only: valid keys, read on the device; nullptr: all Sk
  int Sq, Sk;
  int group;  // query heads per K/V head
  int split_tiles;              // forward: key tiles per split
  float *part_o, *part_lse_log2;    // forward with splits: each split's output and lse_log2 (workspace)
  bool causal;
  float scale, scale_log2;  // scale, and scale * log2(e)
  DropoutArgs drop;         // on the probabilities, where the kernel's DROP is set
};

// Number of 'tile'-key tiles the queries [q0, q1) attend to, of Sk valid keys.
template <class T>
__device__ __forceinline__ int key_tiles(const AttnArgs<T>& p, int Sk, int q1, int tile) {
  const int last = p.causal ? min(Sk, q1 + Sk - p.Sq) : Sk;
  return last > 0 ? (last + tile - 1) / tile : 0;
}

// Scores a query may not see to -inf, in a 16 x 8*NT tile of C fragments: element (j, e) is key
// key0 + j * 8 + (e & 1) (key0: the tile's first key + 2t), hidden when past Sk or past last0 (rows g,
// e < 2) / last1 (rows g + 8), the last key each row sees (INT_MAX: no causal limit).
template <int NT>
__device__ __forceinline__ void mask_scores(float (&s)[NT][4], int key0, int Sk, int last0, int last1) {
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int key = key0 + j * 8 + (e & 1);
      if (key >= Sk || key > (e < 2 ? last0 : last1)) s[j][e] = -INFINITY;
    }
}

// One step of the online softmax over a 16 x 8*NT score tile in C fragments (rows g and g + 8 of the
// warp). The row max is taken over the raw scores and kept in log2 units (m = max * k2, k2 = scale *
// log2(e) > 0), so a probability is one FFMA and one ex2: s -> exp2(s * k2 - m). m0, m1 take the new
// maxima, l0, l1 (this thread's partial row sums) are rescaled and added to; returns the factors the
// output so far must be scaled by. A row with no visible key yet keeps max -inf and subtracts 0, so
// exp2 gives 0, not NaN.
template <int NT>
__device__ __forceinline__ float2 online_softmax_step(float (&s)[NT][4], float k2, float& m0, float& m1, float& l0,
                                                      float& l1) {
  float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    mx0 = fmaxf(mx0, fmaxf(s[j][0], s[j][1]));
    mx1 = fmaxf(mx1, fmaxf(s[j][2], s[j][3]));
  }
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
  const float n0 = fmaxf(m0, mx0 == -INFINITY ? -INFINITY : mx0 * k2);
  const float n1 = fmaxf(m1, mx1 == -INFINITY ? -INFINITY : mx1 * k2);
  const float c0 = n0 == -INFINITY ? 0.f : n0, c1 = n1 == -INFINITY ? 0.f : n1;
  const float2 a = make_float2(fast_exp2(m0 - c0), fast_exp2(m1 - c1));
  m0 = n0;
  m1 = n1;
  l0 *= a.x;
  l1 *= a.y;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    s[j][0] = fast_exp2(fmaf(s[j][0], k2, -c0)); s[j][1] = fast_exp2(fmaf(s[j][1], k2, -c0));
    s[j][2] = fast_exp2(fmaf(s[j][2], k2, -c1)); s[j][3] = fast_exp2(fmaf(s[j][3], k2, -c1));
  }
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    l0 += s[j][0] + s[j][1];
    l1 += s[j][2] + s[j][3];
  }
  return a;
}

// A wgmma accumulator of N columns, flat as wgmma writes it, seen as N / 8 C fragments (the same
// registers in the same order) for store_rows and the softmax helpers.
template <int N>
__device__ __forceinline__ float (&as_fragments(float (&acc)[N / 2]))[N / 8][4] {
  return reinterpret_cast<float(&)[N / 8][4]>(acc);
}

// A warp's 16 x D accumulator rows (C fragments: rows row0 and row0 + 8) to rows of out (D wide),
// scaled by s0 and s1, rows >= rows skipped.
template <int N, class Rows>
__device__ __forceinline__ void store_rows(const Rows& out, const float (&acc)[N][4], int row0, int rows, float s0,
                                           float s1) {
  const int t = threadIdx.x & 3;
  auto* r0 = row0 < rows ? out.at(row0) : nullptr;
  auto* r1 = row0 + 8 < rows ? out.at(row0 + 8) : nullptr;
#pragma unroll
  for (int n = 0; n < N; ++n) {
    const int c = n * 8 + 2 * t;
    if (r0) store2(r0 + c, acc[n][0] * s0, acc[n][1] * s0);
    if (r1) store2(r1 + c, acc[n][2] * s1, acc[n][3] * s1);
  }
}

// ------------------------------------------------------------------------------------------------
// 7.2 fused forward (mma.sync): online softmax over key tiles, the splits' merge

// The forward runs per K/V head: the query heads that share it are stacked as the rows of one
// (group * Sq, D) matrix (a view of contiguous q), row r being query r % Sq of head r / Sq. A block
// owns 64 * MT of those rows, so one query per head (decoding) still fills 4 * group of them, and each
// K/V tile a block loads serves the whole group. When the blocks are too few to fill the GPU (short
// queries against a long cache), the key tiles are also split among `splits` blocks per row tile:
// each writes its rows' output and lse_log2 over its keys to a workspace, and attention_combine_kernel
// merges them in split order (deterministic).
template <class Ops, int MT, bool DROP>
__global__ void __launch_bounds__(ATTN_THREADS) attention_fwd_kernel(AttnArgs<typename Ops::T> p,
                                                                     int kv_heads) {
  using T = typename Ops::T;
  constexpr int D = Ops::D, LD = Ops::LD, BM = 64 * MT;  // BM rows a block
  constexpr int STAGES = attn_stages<Ops>(BM, 128);
  extern __shared__ __align__(16) unsigned char attn_smem[];
  pdl_begin();
  T* Qs = reinterpret_cast<T*>(attn_smem_base<Ops>(attn_smem));
  T* KVs = Qs + BM * LD;  // stage st: K rows at KVs + st * 128 * LD, V rows 64 * LD further
  // x: (K/V head, row block y) with the heads fastest (attention_fwd_launch)
  const int kvh = blockIdx.x % kv_heads, y = blockIdx.x / kv_heads, row_blocks = gridDim.x / kv_heads;
  const int split = blockIdx.z;
  const int R = p.group * p.Sq;  // rows per K/V head
  // Heaviest causal tiles (the last queries) first, so the light ones fill the last wave: when the
  // heads' rows split into whole tiles, y runs over the group's heads fastest, then tiles backwards.
  const int head_tiles = p.Sq / BM;
  const int r0 = p.Sq % BM == 0 ? (y % p.group) * p.Sq + (head_tiles - 1 - y / p.group) * BM
                                : (row_blocks - 1 - y) * BM;
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  const AttnGroupRows<const T> q = attn_group_rows(p.q, p.lq, kvh * p.group, p.Sq);
  const AttnRows<const T> k = attn_rows(p.k, p.lk, kvh), v = attn_rows(p.v, p.lv, kvh);
  // row tile mt of this warp: rows row0[mt] (c0, c1) and row0[mt] + 8 (c2, c3), queries qi0, qi1
  int row0[MT], qi0[MT], qi1[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    row0[mt] = r0 + 64 * mt + warp * 16 + g;
    qi0[mt] = row0[mt] % p.Sq;
    qi1[mt] = (row0[mt] + 8) % p.Sq;
  }
  const int Sk = p.kv_len ? (int)max((int64_t)0, min(*p.kv_len, (int64_t)p.Sk)) : p.Sk;  // valid keys
  const int offset = Sk - p.Sq;
  // query indices the block spans: a block across two heads' rows spans them all
  const int r_last = min(r0 + BM - 1, R - 1);
  const bool one_head = r0 / p.Sq == r_last / p.Sq;
  const int qmin = one_head ? r0 % p.Sq : 0, qmax = one_head ? r_last % p.Sq : p.Sq - 1;
  // Dropout's row of a probability: (b * H + h) * Sq + query, which is kvh * R + row (kvh counts the batch).
  const Dropout drop = DROP ? Dropout(p.drop) : Dropout();
  const uint32_t drop_row = (uint32_t)((int64_t)kvh * R);

  float o[MT][D / 8][4] = {};
  float m0[MT], m1[MT], l0[MT], l1[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) m0[mt] = m1[mt] = -INFINITY, l0[mt] = l1[mt] = 0.f;
  const int ntiles = key_tiles(p, Sk, qmax + 1, 64);
  const int t_begin = split * p.split_tiles, t_end = min(ntiles, t_begin + p.split_tiles);

  load_rows_async<BM, Ops>(Qs, q, r0, R);
  load_rows_async<64, Ops>(KVs, k, t_begin * 64, Sk);
  cp_async_commit();
  load_rows_async<64, Ops>(KVs + 64 * LD, v, t_begin * 64, Sk);
  cp_async_commit();
  for (int kt = t_begin; kt < t_end; ++kt) {
    const int k0 = kt * 64, st = STAGES == 1 ? 0 : (kt - t_begin) & 1;
    T* Ks = KVs + st * 128 * LD;
    T* Vs = Ks + 64 * LD;
    // Two stages: tile kt has landed, and every warp is done with tile kt - 1, whose stage takes tile
    // kt + 1 now. One stage: Q and this K tile have landed (V follows).
    tiles_landed<Ops, STAGES == 1 ? 1 : 0>();
    if (STAGES == 2) {
      if (kt + 1 < t_end) {
        load_rows_async<64, Ops>(KVs + (st ^ 1) * 128 * LD, k, k0 + 64, Sk);
        load_rows_async<64, Ops>(KVs + (st ^ 1) * 128 * LD + 64 * LD, v, k0 + 64, Sk);
      }
      cp_async_commit();
    }
    float s[MT][8][4] = {};
    Ops::template a_times_bt<8>(s, Qs, warp * 16, Ks);
    if (STAGES == 1) {
      __syncthreads();  // all warps are done with Ks
      if (kt + 1 < t_end) load_rows_async<64, Ops>(Ks, k, k0 + 64, Sk);
      cp_async_commit();
    }

    // online softmax on this tile (online_softmax_step; scale_log2 > 0: see attention_fwd). Tiles with
    // hidden keys (past Sk, or past the causal diagonal) set them to -inf behind one uniform branch; the
    // other tiles carry no index math.
    const float k2 = p.scale_log2;
    const bool masked = k0 + 64 > Sk || (p.causal && k0 + 63 > qmin + offset);
    if (masked) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) mask_scores(s[mt], k0 + 2 * t, Sk, p.causal ? qi0[mt] + offset : INT_MAX,
                                                  p.causal ? qi1[mt] + offset : INT_MAX);
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const float2 a = online_softmax_step(s[mt], k2, m0[mt], m1[mt], l0[mt], l1[mt]);
      const float a0 = a.x, a1 = a.y;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        o[mt][n][0] *= a0; o[mt][n][1] *= a0; o[mt][n][2] *= a1; o[mt][n][3] *= a1;
      }
      // The row sums l above hold every probability; the output sums the kept ones, scaled.
      if constexpr (DROP) drop.apply(s[mt], drop_row + row0[mt], drop_row + row0[mt] + 8, k0);
    }

    if (STAGES == 1) tiles_landed<Ops, 1>();  // this V tile has landed
    Ops::template p_times_m<8>(o, s, Vs);
    if (STAGES == 1) {
      __syncthreads();  // all warps are done with Vs
      if (kt + 1 < t_end) load_rows_async<64, Ops>(Vs, v, k0 + 64, Sk);
      cp_async_commit();
    }
  }
  cp_async_wait<0>();

  // Without splits straight into out and lse_log2; with them into this split's slice of the workspace.
  // A split past the valid keys writes lse_log2 = -inf: weight 0 in the merge.
  const int64_t rows_total = (int64_t)kv_heads * R;
  float* lse_log2 = (gridDim.z == 1 ? p.lse_log2 : p.part_lse_log2 + split * rows_total) + (int64_t)kvh * R;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    float L0 = l0[mt], L1 = l1[mt];
    L0 += __shfl_xor_sync(0xffffffffu, L0, 1);
    L0 += __shfl_xor_sync(0xffffffffu, L0, 2);
    L1 += __shfl_xor_sync(0xffffffffu, L1, 1);
    L1 += __shfl_xor_sync(0xffffffffu, L1, 2);
    const float inv0 = L0 > 0.f ? 1.f / L0 : 0.f, inv1 = L1 > 0.f ? 1.f / L1 : 0.f;  // no key seen: zeros
    if (gridDim.z == 1) {
      store_rows(attn_group_rows(p.out, p.lout, kvh * p.group, p.Sq), o[mt], row0[mt], R, inv0, inv1);
    } else {  // the workspace: contiguous rows
      float* part = p.part_o + (split * rows_total + (int64_t)kvh * R) * D;
      store_rows(AttnRows<float>{part, D}, o[mt], row0[mt], R, inv0, inv1);
    }
    if (t == 0) {
      if (row0[mt] < R) lse_log2[row0[mt]] = m0[mt] + log2f(L0);
      if (row0[mt] + 8 < R) lse_log2[row0[mt] + 8] = m1[mt] + log2f(L1);
    }
  }
}

// Merges the splits of each row: out = sum_s w_s out_s / sum_s w_s with w_s = 2^(lse_log2_s - max lse_log2),
// lse_log2 = max + log2(sum_s w_s). A split that saw no key has lse_log2_s = -inf (weight 0, its output not
// read); a row that no split saw gets zeros, as without splits. A block of 4 warps per
// row: the lanes share out the splits for the max and the weight sum; for the output, warp w adds
// splits w, w + 4, ... over the row's D (lanes over d), and the 4 partial rows are added in order:
// many splits are merged in parallel, in a fixed order (deterministic).
constexpr int COMBINE_WARPS = 4;

template <class T>
__global__ void __launch_bounds__(32 * COMBINE_WARPS) attention_combine_kernel(const float* part_o,
    const float* part_lse_log2, T* out, AttnLayout lout, int Sq, float* lse_log2, int64_t rows, int D, int splits) {
  __shared__ float partial[COMBINE_WARPS][128];  // D <= 128
  pdl_begin();
  const int64_t r = blockIdx.x;
  const int lane = threadIdx.x, warp = threadIdx.y;
  float mx = -INFINITY;
  for (int s = lane; s < splits; s += 32) mx = fmaxf(mx, part_lse_log2[s * rows + r]);
  mx = warp_max(mx);
  const float base = mx == -INFINITY ? 0.f : mx;
  float wsum = 0.f;
  for (int s = lane; s < splits; s += 32) wsum += exp2f(part_lse_log2[s * rows + r] - base);
  wsum = warp_sum(wsum);
  float acc[4] = {0.f, 0.f, 0.f, 0.f};  // d = lane + 32 i
#pragma unroll 4
  for (int s = warp; s < splits; s += COMBINE_WARPS) {
    const float w = exp2f(part_lse_log2[s * rows + r] - base);
    if (w == 0.f) continue;
    const float* o = part_o + (s * rows + r) * D;
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (lane + 32 * i < D) acc[i] += w * o[lane + 32 * i];
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
    if (lane + 32 * i < D) partial[warp][lane + 32 * i] = acc[i];
  __syncthreads();
  if (warp != 0) return;
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
  T* orow = attn_rows(out, lout, (int)(r / Sq)).at((int)(r % Sq));
  for (int d = lane; d < D; d += 32) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < COMBINE_WARPS; ++w) sum += partial[w][d];
    orow[d] = from_float<T>(sum * inv);
  }
  if (lane == 0) lse_log2[r] = mx + log2f(wsum);
}

// delta[r] = sum_d dout[r][d] * out[r][d]: the row term of the softmax backward. 16 lanes per row,
// each reading 16 bytes at a time (chunks lane, lane + 16, ...), added across the lanes in a fixed
// order.
constexpr int DELTA_LANES = 16;

template <class T>
__global__ void __launch_bounds__(256) attention_delta_kernel(const T* out, AttnLayout lout, const T* dout,
                                                              AttnLayout ldout, float* delta, int Sq, int64_t rows,
                                                              int D) {
  constexpr int W = per16<T>();
  const int lane = threadIdx.x % DELTA_LANES;
  const int64_t r = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / DELTA_LANES;
  float acc = 0.f;
  if (r < rows) {
    const int bh = (int)(r / Sq), s = (int)(r % Sq);
    const T* o = attn_rows(out, lout, bh).at(s);
    const T* g = attn_rows(dout, ldout, bh).at(s);
    for (int c = lane * W; c < D; c += DELTA_LANES * W) {
      float a[W], b[W];
      unpack16(*reinterpret_cast<const float4*>(o + c), a);
      unpack16(*reinterpret_cast<const float4*>(g + c), b);
#pragma unroll
      for (int i = 0; i < W; ++i) acc += a[i] * b[i];
    }
  }
#pragma unroll
  for (int m = DELTA_LANES / 2; m > 0; m /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, m);
  if (r < rows && lane == 0) delta[r] = acc;
}

// ------------------------------------------------------------------------------------------------
// 7.3 fused backward (mma.sync): delta, dK and dV per key block, dQ per query block

// P and dS for a 16 x (8*NT) tile in C fragments, in place: s -> P = exp2(s * c - lse_log2[q]),
// dp -> dS = P * (dp - delta[q]). With MASK (the tiles that hold hidden pairs: callers branch on it
// once per tile), the query index of element (j, e) comes from qidx(j, e), the key from kidx(j, e), and
// pairs out of range or past the causal diagonal get P = 0.
template <bool MASK, int NT, class T, class QI, class KI>
__device__ __forceinline__ void softmax_grad_tile(const AttnArgs<T>& p, float (&s)[NT][4], float (&dp)[NT][4],
                                                  QI qidx, KI kidx, const float* lse_log2, const float* delta) {
  const int offset = p.Sk - p.Sq;
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float pr = fast_exp2(s[j][e] * p.scale_log2 - lse_log2[e]);
      if (MASK) {
        const int qi = qidx(j, e), ki = kidx(j, e);
        if (qi >= p.Sq || ki >= p.Sk || (p.causal && ki > qi + offset)) pr = 0.f;
      }
      s[j][e] = pr;
      dp[j][e] = pr * (dp[j][e] - delta[e]);
    }
}

// dK, dV for 64 keys per block (4 warps x 16 keys) of K/V head kvh, looping over the query tiles
// (BQ rows) of every query head that shares it. Works in the transposed frame: S^T = K Q^T, P^T,
// dV += P^T dO, dP^T = V dO^T, dS^T, dK += dS^T Q. Each block writes its own rows of dK and dV, summed
// over the group in a fixed order: no atomics, deterministic. Tile i's Q, dO, lse_log2 and delta load
// into stage i % STAGES.
template <class Ops, int BQ, int STAGES, bool DROP>
__device__ __forceinline__ void attention_bwd_dkv(const AttnArgs<typename Ops::T>& p, unsigned char* smem, int kvh,
                                                  int kblock) {
  using T = typename Ops::T;
  constexpr int D = Ops::D, LD = Ops::LD;
  T* Ks = reinterpret_cast<T*>(smem);
  T* Vs = Ks + 64 * LD;
  T* QdO = Vs + 64 * LD;  // stage st: Q rows at QdO + st * 2 * BQ * LD, dO rows BQ * LD further
  float* stats = reinterpret_cast<float*>(QdO + STAGES * 2 * BQ * LD);  // stage st: lse_log2 at stats + st * 2 * BQ,
                                                                        // delta BQ further
  const int k0 = kblock * 64;
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  const int key0 = k0 + warp * 16 + g;
  const int offset = p.Sk - p.Sq;
  // Causal: query i reaches key k0 only if i >= k0 - offset. The tiles: q0 = qstart, qstart + BQ, ...
  // (< Sq) of each query head sharing this K/V head, in head order. The loads walk them with a cursor
  // (hq_load, q0_load): an add per tile, a head's row addresses looked up when it starts.
  const int qstart = p.causal ? max(0, k0 - offset) / BQ * BQ : 0;
  const int head_tiles = (p.Sq - qstart + BQ - 1) / BQ, tiles = p.group * head_tiles;
  const Dropout drop = DROP ? Dropout(p.drop) : Dropout();
  int hq_load = kvh * p.group, q0_load = qstart;
  AttnRows<const T> q_rows = attn_rows(p.q, p.lq, hq_load), do_rows = attn_rows(p.dout, p.ldout, hq_load);
  auto load_next = [&](int st) {
    T* Qs = QdO + st * 2 * BQ * LD;
    load_rows_async<BQ, Ops>(Qs, q_rows, q0_load, p.Sq);
    load_rows_async<BQ, Ops>(Qs + BQ * LD, do_rows, q0_load, p.Sq);
    // lse_log2 and delta: (B * H, Sq), contiguous; threads [0, BQ) copy lse_log2, [BQ, 2 BQ) delta. Rows past Sq
    // read as 0 (the mask zeroes their P).
    static_assert(2 * BQ <= ATTN_THREADS, "a thread per value");
    if (threadIdx.x < 2 * BQ) {
      const int r = threadIdx.x % BQ;
      const bool in = q0_load + r < p.Sq;
      const float* src = threadIdx.x < BQ ? p.lse_log2 : p.delta;
      cp_async<4>(stats + st * 2 * BQ + threadIdx.x, src + (int64_t)hq_load * p.Sq + (in ? q0_load + r : 0), in);
    }
    cp_async_commit();
    if ((q0_load += BQ) >= p.Sq) {
      q0_load = qstart;
      ++hq_load;
      q_rows = attn_rows(p.q, p.lq, hq_load);
      do_rows = attn_rows(p.dout, p.ldout, hq_load);
    }
  };

  load_rows_async<64, Ops>(Ks, attn_rows(p.k, p.lk, kvh), k0, p.Sk);
  load_rows_async<64, Ops>(Vs, attn_rows(p.v, p.lv, kvh), k0, p.Sk);
  load_next(0);  // one group with K and V
  float dk[D / 8][4] = {}, dv[D / 8][4] = {};
  for (int i = 0, q0 = qstart; i < tiles; ++i, q0 = q0 + BQ < p.Sq ? q0 + BQ : qstart) {
    const int st = STAGES == 1 ? 0 : i & 1;
    const T* Qs = QdO + st * 2 * BQ * LD;
    const T* dOs = Qs + BQ * LD;
    const float* Ls = stats + st * 2 * BQ;
    const float* Ds = Ls + BQ;
    tiles_landed<Ops, 0>();  // tile i; two stages: and every warp is done with tile i - 1, whose stage takes i + 1
    if (STAGES == 2 && i + 1 < tiles) load_next(st ^ 1);
    float s[BQ / 8][4] = {}, dp[BQ / 8][4] = {};
    Ops::template a_times_bt<BQ / 8>(s, Ks, warp * 16, Qs);   // S^T (16 keys x BQ queries)
    Ops::template a_times_bt<BQ / 8>(dp, Vs, warp * 16, dOs); // dP^T
    auto grads = [&](auto masked) {
#pragma unroll
      for (int j = 0; j < BQ / 8; ++j) {
        // lse_log2 and delta are per query: the column of the element
        const float2 l2 = *reinterpret_cast<const float2*>(Ls + j * 8 + 2 * t);
        const float2 d2 = *reinterpret_cast<const float2*>(Ds + j * 8 + 2 * t);
        const float lq[4] = {l2.x, l2.y, l2.x, l2.y}, dq[4] = {d2.x, d2.y, d2.x, d2.y};
        float sj[1][4] = {{s[j][0], s[j][1], s[j][2], s[j][3]}};
        float dj[1][4] = {{dp[j][0], dp[j][1], dp[j][2], dp[j][3]}};
        // With dropout, dP (of the kept probabilities) is dP' * factor, and dV's P is P * factor.
        float z[4] = {1.f, 1.f, 1.f, 1.f};
        if constexpr (DROP) {
          const int64_t row = (int64_t)(kvh * p.group + i / head_tiles) * p.Sq + q0 + j * 8 + 2 * t;
          drop.factors_t((uint32_t)row, key0, z);
#pragma unroll
          for (int e = 0; e < 4; ++e) dj[0][e] *= z[e];
        }
        softmax_grad_tile<decltype(masked)::value>(p, sj, dj,
            [&](int, int e) { return q0 + j * 8 + 2 * t + (e & 1); },
            [&](int, int e) { return key0 + (e < 2 ? 0 : 8); }, lq, dq);
#pragma unroll
        for (int e = 0; e < 4; ++e) { s[j][e] = sj[0][e] * z[e]; dp[j][e] = dj[0][e]; }
      }
    };
    if (q0 + BQ > p.Sq || k0 + 64 > p.Sk || (p.causal && k0 + 63 > q0 + offset)) grads(std::true_type{});
    else grads(std::false_type{});
    Ops::template p_times_m<BQ / 8>(dv, s, dOs);  // dV += P^T dO
    Ops::template p_times_m<BQ / 8>(dk, dp, Qs);  // dK += dS^T Q
    if (STAGES == 1) {
      __syncthreads();  // every warp is done with the stage tile i + 1 takes
      if (i + 1 < tiles) load_next(0);
    }
  }
  store_rows(attn_rows(p.dk, p.ldk, kvh), dk, key0, p.Sk, p.scale, p.scale);
  store_rows(attn_rows(p.dv, p.ldv, kvh), dv, key0, p.Sk, 1.f, 1.f);
}

// dQ for 64 queries per block over key tiles of BK: S = Q K^T, P, dP = dO V^T, dS, dQ += dS K.
// Recomputing S and dP here (instead of atomically adding dQ in the dK/dV kernel) keeps dQ
// deterministic. Key tile kt's K and V load into stage kt % STAGES.
template <class Ops, int BK, int STAGES, bool DROP>
__device__ __forceinline__ void attention_bwd_dq(const AttnArgs<typename Ops::T>& p, unsigned char* smem, int bh,
                                                 int qblock) {
  using T = typename Ops::T;
  constexpr int D = Ops::D, LD = Ops::LD;
  T* Qs = reinterpret_cast<T*>(smem);
  T* dOs = Qs + 64 * LD;
  T* KV = dOs + 64 * LD;  // stage st: K rows at KV + st * 2 * BK * LD, V rows BK * LD further
  const int q0 = qblock * 64;
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  const int64_t qbase = (int64_t)bh * p.Sq;  // lse_log2 and delta: (B * H, Sq), contiguous
  const AttnRows<const T> k = attn_rows(p.k, p.lk, bh / p.group), v = attn_rows(p.v, p.lv, bh / p.group);
  const int row0 = q0 + warp * 16 + g;
  const int offset = p.Sk - p.Sq;
  const float lq[4] = {row0 < p.Sq ? p.lse_log2[qbase + row0] : INFINITY, 0.f,
                       row0 + 8 < p.Sq ? p.lse_log2[qbase + row0 + 8] : INFINITY, 0.f};
  const float lse[4] = {lq[0], lq[0], lq[2], lq[2]};
  const float dl[4] = {row0 < p.Sq ? p.delta[qbase + row0] : 0.f, 0.f,
                       row0 + 8 < p.Sq ? p.delta[qbase + row0 + 8] : 0.f, 0.f};
  const float delta[4] = {dl[0], dl[0], dl[2], dl[2]};
  const Dropout drop = DROP ? Dropout(p.drop) : Dropout();
  const uint32_t drop_row = (uint32_t)((int64_t)bh * p.Sq + row0);
  auto load_tile = [&](int kt, int st) {
    T* Ks = KV + st * 2 * BK * LD;
    load_rows_async<BK, Ops>(Ks, k, kt * BK, p.Sk);
    load_rows_async<BK, Ops>(Ks + BK * LD, v, kt * BK, p.Sk);
    cp_async_commit();
  };

  load_rows_async<64, Ops>(Qs, attn_rows(p.q, p.lq, bh), q0, p.Sq);
  load_rows_async<64, Ops>(dOs, attn_rows(p.dout, p.ldout, bh), q0, p.Sq);
  cp_async_commit();
  float dq[D / 8][4] = {};
  const int ntiles = key_tiles(p, p.Sk, min(q0 + 64, p.Sq), BK);
  if (ntiles > 0) load_tile(0, 0);
  for (int kt = 0; kt < ntiles; ++kt) {
    const int k0 = kt * BK, st = STAGES == 1 ? 0 : kt & 1;
    T* Ks = KV + st * 2 * BK * LD;
    T* Vs = Ks + BK * LD;
    tiles_landed<Ops, 0>();  // tile kt; two stages: and every warp is done with tile kt - 1, whose stage takes kt + 1
    if (STAGES == 2 && kt + 1 < ntiles) load_tile(kt + 1, st ^ 1);
    float s[BK / 8][4] = {}, dp[BK / 8][4] = {};
    Ops::template a_times_bt<BK / 8>(s, Qs, warp * 16, Ks);
    Ops::template a_times_bt<BK / 8>(dp, dOs, warp * 16, Vs);
    if constexpr (DROP) drop.apply(dp, drop_row, drop_row + 8, k0);  // dP of the kept probabilities
    auto qidx = [&](int, int e) { return row0 + (e < 2 ? 0 : 8); };
    auto kidx = [&](int j, int e) { return k0 + j * 8 + 2 * t + (e & 1); };
    if (q0 + 64 > p.Sq || k0 + BK > p.Sk || (p.causal && k0 + BK - 1 > q0 + offset))
      softmax_grad_tile<true>(p, s, dp, qidx, kidx, lse, delta);
    else
      softmax_grad_tile<false>(p, s, dp, qidx, kidx, lse, delta);
    Ops::template p_times_m<BK / 8>(dq, dp, Ks);
    if (STAGES == 1) {
      __syncthreads();  // every warp is done with the stage tile kt + 1 takes
      if (kt + 1 < ntiles) load_tile(kt + 1, 0);
    }
  }
  cp_async_wait<0>();  // no tile: Q and dO may still be in flight
  store_rows(attn_rows(p.dq, p.ldq, bh), dq, row0, p.Sq, p.scale, p.scale);
}

// One launch for both backward halves: blocks y < kv_blocks compute dK/dV for a key block, the
// rest dQ for a query block (heaviest causal ones first). Sharing the grid lets the two halves
// fill each other's last wave, and both need the same shared memory at the chosen tile sizes.
// bh runs over the query heads; with grouped K/V heads only the first BH / group have a dK/dV block.
template <class Ops, int BQ, int BK, int STAGES, bool DROP>
__global__ void __launch_bounds__(ATTN_THREADS) attention_bwd_kernel(AttnArgs<typename Ops::T> p, int BH,
                                                                     int kv_blocks) {
  extern __shared__ __align__(16) unsigned char attn_smem[];
  unsigned char* smem = attn_smem_base<Ops>(attn_smem);
  // x: (query head bh, block y) with the heads fastest (attention_bwd_dispatch)
  const int bh = blockIdx.x % BH, y = blockIdx.x / BH, blocks_y = gridDim.x / BH;
  if (y < kv_blocks) {
    if (bh < BH / p.group) attention_bwd_dkv<Ops, BQ, STAGES, DROP>(p, smem, bh, y);
  } else {
    attention_bwd_dq<Ops, BK, STAGES, DROP>(p, smem, bh, blocks_y - 1 - y);
  }
}

// ------------------------------------------------------------------------------------------------
// 7.4 fused launch: the operand policy and head size of a call, splits

template <class T>
static AttnArgs<T> attn_args(int Sq, int Sk, int group, bool causal, float scale) {
  AttnArgs<T> p{};
  p.Sq = Sq;
  p.Sk = Sk;
  p.group = group;
  p.causal = causal;
  p.scale = scale;
  p.scale_log2 = scale * 1.4426950408889634f;
  return p;
}

// Grid: (K/V heads x row blocks of 64 * MT, splits), the heads and row blocks folded into x, heads
// fastest (the order of a 2-D grid's blocks): grid.y would stop at 65535 row blocks, 4.2M rows. Rows
// that fit one block of 64 (decoding) take MT = 1: the kernel is then bound by reading K and V, and
// more blocks fit on an SM.
template <class Ops, int MT, bool DROP>
static void attention_fwd_launch(const AttnArgs<typename Ops::T>& p, int kv_heads, int splits, cudaStream_t s) {
  const size_t smem = attn_smem_bytes<Ops>(64 * MT + attn_stages<Ops>(64 * MT, 128) * 128);
  const int64_t blocks = (int64_t)kv_heads * ceil_div((int64_t)p.group * p.Sq, 64 * MT);
  const dim3 grid(grid_x(blocks, "attention_fwd_fused"), 1, splits);
  raise_smem_limit<attention_fwd_kernel<Ops, MT, DROP>>(smem);
  launch_pdl(attention_fwd_kernel<Ops, MT, DROP>, grid, dim3(ATTN_THREADS), smem, s, p, kv_heads);
}
template <class Ops>
static void attention_fwd_dispatch(const AttnArgs<typename Ops::T>& p, int kv_heads, int splits, cudaStream_t s) {
  with_flag(p.drop.rng != nullptr, [&](auto drop) {
    constexpr bool DROP = decltype(drop)::value;
    if (Ops::MT > 1 && (int64_t)p.group * p.Sq > 64) attention_fwd_launch<Ops, Ops::MT, DROP>(p, kv_heads, splits, s);
    else attention_fwd_launch<Ops, 1, DROP>(p, kv_heads, splits, s);
  });
}

// Splits of the key tiles per forward block (see attention_fwd_kernel): 1 when the row tiles alone
// give two blocks per SM, else enough for that, down to one key tile per split. A block's cost is
// the key tiles it walks, whatever its number of real rows: decoding (one query per head) is the
// case this serves.
int attention_fwd_splits(int BH, int group, int Sq, int Sk) {
  const int64_t blocks = (int64_t)(BH / group) * ceil_div((int64_t)group * Sq, 64);
  const int tiles = ceil_div(Sk, 64);
  if (blocks == 0 || blocks >= 2 * num_sms()) return 1;
  return std::max(1, std::min(ceil_div(2 * num_sms(), blocks), tiles));
}

template <class Ops>
static void attention_bwd_dispatch(const AttnArgs<typename Ops::T>& p, int BH, cudaStream_t s) {
  constexpr int D = Ops::D;
  constexpr int BQ = D > 64 ? 32 : 64, BK = D > 64 ? 32 : 64;  // register budget at D = 128
  // dK/dV blocks hold K, V (64 rows) + per stage Q, dO (BQ rows each), lse_log2, delta; dQ blocks Q, dO
  // (64 rows each) + per stage K, V (BK rows each). The larger of the two sets the stages.
  constexpr int STAGES = attn_stages<Ops>(128, 2 * std::max(BQ, BK), 2 * BQ * (int)sizeof(float));
  constexpr size_t smem_kv = attn_smem_bytes<Ops>(128 + STAGES * 2 * BQ, STAGES * 2 * BQ * sizeof(float));
  constexpr size_t smem_q = attn_smem_bytes<Ops>(128 + STAGES * 2 * BK);
  const int kv_blocks = ceil_div(p.Sk, 64), q_blocks = ceil_div(p.Sq, 64);
  constexpr size_t smem = std::max(smem_kv, smem_q);
  // (query heads x blocks) folded into x as in attention_fwd_launch: a grid.y of kv_blocks + q_blocks
  // stopped at 65535, 4.2M keys (or 2.1M keys and queries each)
  const unsigned grid = grid_x((int64_t)BH * (kv_blocks + q_blocks), "attention_bwd_fused");
  with_flag(p.drop.rng != nullptr, [&](auto drop) {
    constexpr bool DROP = decltype(drop)::value;
    raise_smem_limit<attention_bwd_kernel<Ops, BQ, BK, STAGES, DROP>>(smem);
    attention_bwd_kernel<Ops, BQ, BK, STAGES, DROP><<<grid, ATTN_THREADS, smem, s>>>(p, BH, kv_blocks);
  });
  check_launch("attention_bwd");
}

// The head sizes the fused kernels are built for (96: a 768-wide model with 8 heads). The one place
// this list lives: bindings.cpp exposes it to Python as kernels.FUSED_HEAD_SIZES.
bool launch::attention_fused_supports(int D) { return is_head_size(limits::fused_head_sizes{}, D); }

static std::atomic<bool> attention_wgmma_enabled{true};  // set_attention_wgmma: off to compare with mma.sync
void launch::set_attention_wgmma(bool on) { attention_wgmma_enabled.store(on); }

// f(Ops{}) with the operand policy of element type T and head dim D: fp32 multiplies in 3xTF32
// (precise) or TF32, bf16 in bf16 (precise does not apply), on wgmma at D = 64 where this build's
// sm_90a code runs.
template <class T, int D, class F>
static void with_attn_ops(bool precise, F& f) {
  if constexpr (std::is_same_v<T, float>) {
    if (precise) f(AttnTf32<D, true>{});
    else f(AttnTf32<D, false>{});
  } else if constexpr (D == 64) {
    if (attention_wgmma_enabled.load() && hopper_wgmma()) f(AttnBf16Wg<D>{});
    else f(AttnBf16<D>{});
  } else {
    f(AttnBf16<D>{});
  }
}
template <class T, class F>
static void with_attn_ops(int D, bool precise, F&& f) {
  if (!with_head_size(limits::fused_head_sizes{}, D, [&](auto d) { with_attn_ops<T, decltype(d)::value>(precise, f); }))
    throw std::invalid_argument("attention: fused mode does not support this head dim");
}

// ------------------------------------------------------------------------------------------------
// 7.5 Hopper forward (bf16, sm_90a): TMA, warp specialization, wgmma

// bf16 attention forward on Hopper, the FlashAttention-3 design (head sizes 64 and 128). A unit of
// work is 128 queries of one head: two consumer warpgroups of 64 rows each, and a producer warpgroup
// (its registers handed to the consumers, setmaxnreg) whose first thread lifts Q, then K and V 128
// keys at a time, through the copy engine (TMA, 4-D tensor maps over (d, position, head, batch), so
// strided heads and ragged lengths cost nothing: rows past the end come in as zeros) into a ring of
// stages, each with a barrier for K and one for V, so a product starts as soon as its own operand
// has landed. Every product is wgmma: S = Q K^T from shared memory (m64n128k16), O += P V with P
// from registers (the score tile's accumulators, packed to bf16, are the A operand as they stand)
// and V read N-major. Within a warpgroup the softmax of tile j overlaps the tensor cores:
// S_j+1 = Q K_j+1^T and O += P_j V_j are issued together, the softmax waits for S_j+1 only, and O is
// rescaled once P_j V_j has landed. Causal units walk only the key tiles up to their last query, and
// mask only the tiles that cross the diagonal or the end of the keys. The softmax math and lse_log2
// are attention_fwd_kernel's.
template <int D>
struct AttnTmaShape {
  static constexpr int BM = 128, BN = 128, THREADS = 384;  // the producer warpgroup, two consumer ones
  static constexpr bool PINGPONG = D == 64;
  static constexpr int Q_BYTES = BM * D * 2, KV_BYTES = BN * D * 2;
  static constexpr int Q_SLAB = BM * 128, KV_SLAB = BN * 128;  // one 64-column slab of a tile
  // As many stages as fit beside Q, the barriers, the mailbox and the 1024-byte alignment, up to 4: 3
  // at D 128.
  static constexpr int STAGES = std::min(4, (SMEM_BLOCK_MAX - 1024 - Q_BYTES - 256) / (2 * KV_BYTES));
  static constexpr int SMEM = 1024 + Q_BYTES + STAGES * 2 * KV_BYTES + 8 * (2 + 3 * STAGES + 4) + 8;  // + mailbox
};

struct AttnTmaArgs {
  __nv_bfloat16* out;
  AttnLayout lout;
  float* lse_log2;
  int Sq, Sk, BH, heads, group;  // BH: query heads of all batch entries; heads: per entry
  float scale_log2;
  int* next_unit;  // the units handed out beyond the first gridDim.x (zero at launch)
  DropoutArgs drop;  // on the probabilities, where the kernel's DROP is set
};

// A work unit: queries q0 .. q0 + 127 of query head bh, which see `ntiles` key tiles.
struct AttnTmaUnit {
  int bh, q0, ntiles;
};

template <int BM, int BN, bool CAUSAL>
__device__ __forceinline__ AttnTmaUnit attn_tma_unit(const AttnTmaArgs& p, int u, int qtiles) {
  // A head's query tiles are consecutive units, so the blocks that read the same K and V run together
  // and share them in L2 (with heads first, each tile re-read them from memory). Causal: each head's
  // heaviest tile first.
  AttnTmaUnit w;
  w.bh = u / qtiles;
  const int tile = u % qtiles;
  w.q0 = (CAUSAL ? qtiles - 1 - tile : tile) * BM;
  const int key_end = CAUSAL ? min(p.Sk, min(w.q0 + BM, p.Sq) + p.Sk - p.Sq) : p.Sk;  // keys any row sees
  w.ntiles = key_end > 0 ? (key_end + BN - 1) / BN : 0;
  return w;
}

// Persistent: a block per SM takes unit blockIdx.x, then the next one not yet taken (a global
// counter, so the units running at any time stay neighbours, as a grid's blocks would, however their
// costs differ; a fixed stride scattered causal blocks over many heads, out of L2). The producer takes
// them and passes each on through a two-slot mailbox in shared memory. The K/V ring runs on across
// units, and Q is reloaded as soon as a unit's last Q K^T has landed, so the next unit's loads hide
// behind this one's last P V and its output stores.
template <int D, bool CAUSAL, bool DROP>
__global__ void __launch_bounds__(AttnTmaShape<D>::THREADS, 1)
    attention_fwd_tma_kernel(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_k,
                             const __grid_constant__ CUtensorMap map_v, AttnTmaArgs p) {
#ifdef WG_ENABLED
  using S = AttnTmaShape<D>;
  constexpr int BM = S::BM, BN = S::BN, STAGES = S::STAGES;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t q_s = (smem_addr(smem_raw) + 1023) & ~1023u, kv_s = q_s + S::Q_BYTES;  // stage st: K, then V
  const uint32_t q_full = kv_s + STAGES * 2 * S::KV_BYTES, q_empty = q_full + 8, k_full = q_empty + 8,
                 v_full = k_full + 8 * STAGES, empty = v_full + 8 * STAGES, unit_full = empty + 8 * STAGES,
                 unit_empty = unit_full + 16;
  volatile int* mailbox = reinterpret_cast<int*>(smem_raw + (unit_empty + 16 - smem_addr(smem_raw)));
  const int qtiles = (p.Sq + BM - 1) / BM, units = qtiles * p.BH;
  if (threadIdx.x == 0) {
    mbar_init(q_full, 1);
    mbar_init(q_empty, 8);  // one arrival per consumer warp
    for (int i = 0; i < 2; ++i) {
      mbar_init(unit_full + 8 * i, 1);
      mbar_init(unit_empty + 8 * i, 8);
    }
    for (int st = 0; st < STAGES; ++st) {
      mbar_init(k_full + 8 * st, 1);
      mbar_init(v_full + 8 * st, 1);
      mbar_init(empty + 8 * st, 8);
    }
    mbar_init_fence();
  }
  __syncthreads();
  pdl_begin();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // Registers: the block starts with 168 a thread (384 threads, one block per SM). The producer
  // warpgroup keeps 32 and the consumers take 232: setmaxnreg.inc waits until the block's pool holds
  // what it asks, so the two must balance (128 x 32 + 256 x 232 <= 384 x 168).
  if (warp < 4) {  // producer: lane 0 of warp 0 issues every copy
    regs_release<32>();
    if (warp > 0 || lane > 0) return;
    int it = 0, nq = 0;  // K/V tiles and Q tiles loaded so far
    for (int i = 0, u = blockIdx.x;; ++i, u = gridDim.x + atomicAdd(p.next_unit, 1)) {
      mbar_wait(unit_empty + 8 * (i % 2), ((i / 2) & 1) ^ 1);  // a fresh barrier passes parity 1
      mailbox[i % 2] = u;
      mbar_arrive(unit_full + 8 * (i % 2));
      if (u >= units) break;
      const AttnTmaUnit w = attn_tma_unit<BM, BN, CAUSAL>(p, u, qtiles);
      if (w.ntiles == 0) continue;  // (its consumers write zeros without waiting for Q)
      const int b = w.bh / p.heads, h = w.bh % p.heads, hk = h / p.group;
      mbar_wait(q_empty, (nq++ & 1) ^ 1);  // a fresh barrier passes parity 1
      mbar_expect_bytes(q_full, S::Q_BYTES);
      for (int c = 0; c < D / 64; ++c) tma_load_4d(q_s + c * S::Q_SLAB, &map_q, 64 * c, w.q0, h, b, q_full);
      for (int j = 0; j < w.ntiles; ++j, ++it) {
        const int st = it % STAGES;
        mbar_wait(empty + 8 * st, ((it / STAGES) & 1) ^ 1);
        const uint32_t ks = kv_s + 2 * st * S::KV_BYTES, vs = ks + S::KV_BYTES;
        mbar_expect_bytes(k_full + 8 * st, S::KV_BYTES);  // rows past the end still count
        for (int c = 0; c < D / 64; ++c)
          tma_load_4d(ks + c * S::KV_SLAB, &map_k, 64 * c, j * BN, hk, b, k_full + 8 * st);
        mbar_expect_bytes(v_full + 8 * st, S::KV_BYTES);
        for (int c = 0; c < D / 64; ++c)
          tma_load_4d(vs + c * S::KV_SLAB, &map_v, 64 * c, j * BN, hk, b, v_full + 8 * st);
      }
    }
    return;
  }

  // Consumer warpgroup wg: rows 64 wg .. of a unit's queries; thread (warp, g, t) holds rows
  // r0 = q0 + 64 wg + 16 (warp % 4) + g and r0 + 8, columns 8j + 2t, +1 of each n8 tile j, in
  // s[4j + 2h + e] (and o likewise).
  regs_acquire<232>();
  const int wg = warp / 4 - 1, g = lane / 4, t = lane % 4, row = 64 * wg + 16 * (warp % 4) + g;
  const float k2 = p.scale_log2;
  const int offset = p.Sk - p.Sq;
  float s[BN / 2], o[D / 2];
  uint32_t pf[BN / 16][4];  // P as the A operand of P V, one k16 step of keys each
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;  // (set again for each unit)
  int it = 0, nq = 0;  // as the producer counts them
  int q0 = 0, r0 = 0;  // the current unit's first query, and this thread's first row
  const Dropout drop = DROP ? Dropout(p.drop) : Dropout();
  uint32_t drop_row = 0;  // row r0's in the draws: (b * H + h) * Sq + r0

  auto issue_qk = [&](int j) {
    const int st = (it + j) % STAGES;
    mbar_wait(k_full + 8 * st, ((it + j) / STAGES) & 1);
    const uint32_t ks = kv_s + 2 * st * S::KV_BYTES, qs = q_s + wg * 64 * 128;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      wgmma_bf16<0, 0, BN>(s, smem_desc(qs + kk / 4 * S::Q_SLAB + kk % 4 * 32, 16, 1024),
                           smem_desc(ks + kk / 4 * S::KV_SLAB + kk % 4 * 32, 16, 1024), kk > 0);
    wgmma_commit();
  };
  auto issue_pv = [&](int j) {
    const int st = (it + j) % STAGES;
    mbar_wait(v_full + 8 * st, ((it + j) / STAGES) & 1);
    const uint32_t vs = kv_s + (2 * st + 1) * S::KV_BYTES;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
      wgmma_bf16_ra<1, D>(o, pf[kk], smem_desc(vs + kk * 2048, S::KV_SLAB, 1024), j > 0 || kk > 0);
    wgmma_commit();
  };
  auto release = [&](uint32_t bar) {
    if (lane == 0) mbar_arrive(bar);
  };
  // The online softmax over tile j's scores (in s), its hidden keys masked first; returns the factors
  // the output so far must be scaled by. With dropout, P is multiplied by its factors once the row sums
  // have taken it whole.
  auto softmax = [&](int j) {
    float(&sf)[BN / 8][4] = as_fragments<BN>(s);
    const int k0 = j * BN;
    if (k0 + BN > p.Sk || (CAUSAL && k0 + BN - 1 > q0 + 64 * wg + offset))
      mask_scores(sf, k0 + 2 * t, p.Sk, CAUSAL ? r0 + offset : INT_MAX, CAUSAL ? r0 + 8 + offset : INT_MAX);
    const float2 a = online_softmax_step(sf, k2, m0, m1, l0, l1);
    if constexpr (DROP) drop.apply(sf, drop_row, drop_row + 8, k0);
    return a;
  };
  auto pack_p = [&]() {
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
      for (int e = 0; e < 4; ++e) pf[kk][e] = pack_bf16x2(s[8 * kk + 2 * e], s[8 * kk + 2 * e + 1]);
  };
  // Ping-pong at D 64 (S::PINGPONG): the two warpgroups take turns issuing their products (named
  // barrier 1 + wg: my turn), so one's softmax runs while the other's products keep the tensor cores
  // busy; warpgroup 0 goes first in each unit, and warpgroup 1 keeps its last turn. At D 128 the
  // products are long enough to hide the softmax within a warpgroup, and the turns cost more than
  // they give.
  int turns_left = 0;
  auto my_turn = [&]() {
    if (S::PINGPONG) named_sync(1 + wg, 256);
  };
  auto your_turn = [&]() {
    if (S::PINGPONG && (--turns_left > 0 || wg == 0)) named_arrive(2 - wg, 256);
  };

  for (int i = 0;; ++i) {
    mbar_wait(unit_full + 8 * (i % 2), (i / 2) & 1);
    const int u = mailbox[i % 2];
    __syncwarp();
    release(unit_empty + 8 * (i % 2));
    if (u >= units) break;
    const AttnTmaUnit w = attn_tma_unit<BM, BN, CAUSAL>(p, u, qtiles);
    q0 = w.q0;
    r0 = q0 + row;
    drop_row = (uint32_t)((int64_t)w.bh * p.Sq + r0);
    m0 = m1 = -INFINITY;
    l0 = l1 = 0.f;
    const int n = w.ntiles;
    if (n > 0) {
      turns_left = n + 1;
      if (S::PINGPONG && wg == 1) named_arrive(1, 256);
      mbar_wait(q_full, nq++ & 1);
      my_turn();
      issue_qk(0);
      your_turn();
      wgmma_wait<0>();
      if (n == 1) release(q_empty);  // the unit's last Q K^T has landed: the producer may reload Q
      softmax(0);
      pack_p();
      for (int j = 1; j < n; ++j) {
        my_turn();
        issue_qk(j);
        issue_pv(j - 1);
        your_turn();
        wgmma_wait<1>();  // S_j has landed; P_j-1 V_j-1 may still run
        if (j == n - 1) release(q_empty);
        const float2 a = softmax(j);
        wgmma_wait<0>();
        release(empty + 8 * ((it + j - 1) % STAGES));
#pragma unroll
        for (int i = 0; i < D / 2; i += 4) {
          o[i] *= a.x;
          o[i + 1] *= a.x;
          o[i + 2] *= a.y;
          o[i + 3] *= a.y;
        }
        pack_p();
      }
      my_turn();
      issue_pv(n - 1);
      your_turn();
      wgmma_wait<0>();
      release(empty + 8 * ((it + n - 1) % STAGES));
      it += n;
    } else {
#pragma unroll
      for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
    }

    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;  // no key seen: zeros
    // Row by row, each with its lse_log2 (store_rows' interleaved rows ran slower here at short S).
    __nv_bfloat16* out = head_start(p.out, p.lout, w.bh);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = r0 + 8 * hh;
      if (r >= p.Sq) continue;
      const float inv = hh ? inv1 : inv0;
      __nv_bfloat16* dst = out + (int64_t)r * p.lout.ss;
#pragma unroll
      for (int j = 0; j < D / 8; ++j)
        store2(dst + 8 * j + 2 * t, o[4 * j + 2 * hh] * inv, o[4 * j + 2 * hh + 1] * inv);
      if (t == 0) p.lse_log2[(int64_t)w.bh * p.Sq + r] = (hh ? m1 : m0) + log2f(hh ? l1 : l0);
    }
  }
#else
  __trap();  // built without sm_90a: the launcher never picks this kernel
#endif
}

// ------------------------------------------------------------------------------------------------
// 7.6 Hopper backward (bf16, sm_90a)

// dK and dV of the bf16 backward on Hopper, in the forward's design: a block owns 128 keys of one K/V
// head (two consumer warpgroups of 64 keys) and walks the query tiles (64 queries) of every query
// head that shares it, in head order; the producer thread lifts K and V once, then each tile's Q and
// dO through the copy engine. The consumers load the tile's lse_log2 and delta (one float a query,
// rows not on 16 bytes) a tile ahead, each warp into its own shared memory. Products, all
// wgmma, in the transposed frame: S^T = K Q^T and dP^T = V dO^T from shared memory, then P^T and
// dS^T = P^T (dP^T - delta) in registers feed dV += P^T dO and dK += dS^T Q as A operands, Q and dO
// read N-major. Each block writes its own rows of dK and dV, summed over the group in a fixed order: no
// atomics, deterministic. dQ comes from attention_bwd_dq_tma_kernel below.
//
// ADD_DQ (the op's deterministic=False): dQ here too, added across key blocks, five products a tile
// where this kernel and the dQ kernel take seven. Each warpgroup writes its dS^T into shared memory
// (bf16, the M-major layout wgmma reads) and computes a 64 x 64 part of the tile's dQ = dS K: at D 128
// 64 columns over all 128 keys, issued a tile later with the next dV and dK products so that neither
// warpgroup waits for the other's dS^T; at D 64 all 64 columns over its own 64 keys. The part goes to
// a shared-memory buffer, and a producer thread per consumer warpgroup has the copy engine add it into
// fp32 sums in global memory (cp.reduce.async.bulk) while the consumers go on;
// attention_bwd_dq_finish_kernel then writes dq in bf16. The sums are added in whatever order the
// blocks get there, so dq's last bits may differ from run to run (dK and dV stay bit for bit the
// deterministic ones), as in cuDNN's and FlashAttention-3's default backward.
template <int D, bool ADD_DQ = false>
struct AttnBwdTmaShape {
  static constexpr int BN = 128, BQ = 64, THREADS = 384;
  // At D 64 a tile's S^T and dP^T are issued before the previous tile's dV and dK have landed; at
  // D 128 the registers hold only one of the two sets of products, so the two warpgroups ping-pong
  // instead (at D 64 that gained nothing on top of the overlap).
  static constexpr bool OVERLAP = D == 64, PINGPONG = D == 128;
  static constexpr int KV_BYTES = BN * D * 2, Q_BYTES = BQ * D * 2;  // K or V; Q or dO
  static constexpr int KV_SLAB = BN * 128, Q_SLAB = BQ * 128;
  static constexpr int STAGE_BYTES = 2 * Q_BYTES;  // Q, dO
  static constexpr int STATS_BYTES = 8 * 2 * 2 * BQ * 4;  // each consumer warp's lse_log2 and delta, two tiles
  // ADD_DQ: two buffers of a tile's dS^T (bf16) and one 64 x 64 dQ part (fp32) per warpgroup
  static constexpr int DS_BYTES = BN * BQ * 2, DQ_BYTES = BQ * 64 * 4;
  static constexpr int FIXED = 1024 + 2 * KV_BYTES + (ADD_DQ ? 2 * DS_BYTES + 2 * DQ_BYTES : 0) + STATS_BYTES;
  static constexpr int STAGES = std::min(4, (SMEM_BLOCK_MAX - FIXED - 256) / STAGE_BYTES);  // ADD_DQ: 2 at D 128
  static constexpr int SMEM = FIXED + STAGES * STAGE_BYTES + 8 * (1 + 2 * STAGES + 4);
};

struct AttnBwdTmaArgs {
  const float *lse_log2, *delta;  // (B * H, Sq)
  __nv_bfloat16 *dk, *dv;
  AttnLayout ldk, ldv;
  int Sq, Sk, heads, group;  // heads: query heads per batch entry
  float scale, scale_log2;
  int nq = 0;              // ADD_DQ: query tiles (64) a head
  float* dq_sum = nullptr;  // ADD_DQ: (B * H, nq, D / 64, a 64 x 64 part in fragment order), zero at launch
  DropoutArgs drop{};       // on the probabilities, where the kernel's DROP is set (never with ADD_DQ)
};

template <int D, bool CAUSAL, bool ADD_DQ, bool DROP>
__global__ void __launch_bounds__(AttnBwdTmaShape<D>::THREADS, 1)
    attention_bwd_dkv_tma_kernel(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_k,
                                 const __grid_constant__ CUtensorMap map_v, const __grid_constant__ CUtensorMap map_do,
                                 AttnBwdTmaArgs p) {
#ifdef WG_ENABLED
  using S = AttnBwdTmaShape<D, ADD_DQ>;
  static_assert(!(ADD_DQ && DROP), "dropout's backward adds no dQ here");
  constexpr int BN = S::BN, BQ = S::BQ, STAGES = S::STAGES;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t k_s = (smem_addr(smem_raw) + 1023) & ~1023u, v_s = k_s + S::KV_BYTES, ds_s = v_s + S::KV_BYTES;
  const uint32_t dq_s = ds_s + (ADD_DQ ? 2 * S::DS_BYTES : 0), st_s = dq_s + (ADD_DQ ? 2 * S::DQ_BYTES : 0);
  // stage st: Q at st_s + st * STAGE_BYTES, dO after it; the barriers; the consumers' statistics
  const uint32_t kv_full = st_s + STAGES * S::STAGE_BYTES, full = kv_full + 8, empty = full + 8 * STAGES;
  const uint32_t dq_full = empty + 8 * STAGES, dq_empty = dq_full + 16;  // ADD_DQ: one each per dQ buffer
  float* stats = reinterpret_cast<float*>(smem_raw + (dq_empty + 16 - smem_addr(smem_raw)));
  const int kvhead = blockIdx.y, b = kvhead / (p.heads / p.group), hk = kvhead % (p.heads / p.group);
  const int k0 = blockIdx.x * BN, offset = p.Sk - p.Sq;
  // Causal: query q reaches key k0 only if q >= k0 - offset.
  const int qstart = CAUSAL ? max(0, k0 - offset) / BQ * BQ : 0;
  const int per_head = qstart < p.Sq ? (p.Sq - qstart + BQ - 1) / BQ : 0, tiles = p.group * per_head;
  if (threadIdx.x == 0) {
    mbar_init(kv_full, 1);
    for (int st = 0; st < STAGES; ++st) {
      mbar_init(full + 8 * st, 1);
      mbar_init(empty + 8 * st, 8);  // one arrival per consumer warp
    }
    for (int w = 0; ADD_DQ && w < 2; ++w) {
      mbar_init(dq_full + 8 * w, 4);   // the warpgroup's warps
      mbar_init(dq_empty + 8 * w, 1);  // its writer
    }
    mbar_init_fence();
  }
  __syncthreads();
  pdl_begin();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // Registers as in attention_fwd_tma_kernel, but 24 / 240: dK and dV take 128 a thread at D 128.
  if (warp < 4) {  // producer warpgroup
    regs_release<24>();
    if (tiles == 0 || lane > 0 || warp > (ADD_DQ ? 2 : 0)) return;
    if (ADD_DQ && warp > 0) {  // warp 1 + w, one thread: warpgroup w's dQ parts added into the sums
      const int w = warp - 1;
      for (int i = 0; i < tiles; ++i) {
        const int h = hk * p.group + i / per_head, qt = qstart / BQ + i % per_head;
        const int64_t part = ((int64_t)(b * p.heads + h) * p.nq + qt) * (D / 64) + (D == 128 ? w : 0);
        mbar_wait(dq_full + 8 * w, i & 1);
        bulk_add_f32(p.dq_sum + part * (BQ * 64), dq_s + w * S::DQ_BYTES, S::DQ_BYTES);
        bulk_wait_read<0>();
        mbar_arrive(dq_empty + 8 * w);
      }
      bulk_wait_all();
      return;
    }
    mbar_expect_bytes(kv_full, 2 * S::KV_BYTES);
    for (int c = 0; c < D / 64; ++c) {
      tma_load_4d(k_s + c * S::KV_SLAB, &map_k, 64 * c, k0, hk, b, kv_full);
      tma_load_4d(v_s + c * S::KV_SLAB, &map_v, 64 * c, k0, hk, b, kv_full);
    }
    for (int i = 0; i < tiles; ++i) {
      const int st = i % STAGES, h = hk * p.group + i / per_head, q0 = qstart + i % per_head * BQ;
      const uint32_t qs = st_s + st * S::STAGE_BYTES;
      mbar_wait(empty + 8 * st, ((i / STAGES) & 1) ^ 1);
      mbar_expect_bytes(full + 8 * st, 2 * S::Q_BYTES);
      for (int c = 0; c < D / 64; ++c) {
        tma_load_4d(qs + c * S::Q_SLAB, &map_q, 64 * c, q0, h, b, full + 8 * st);
        tma_load_4d(qs + S::Q_BYTES + c * S::Q_SLAB, &map_do, 64 * c, q0, h, b, full + 8 * st);
      }
    }
    return;
  }

  regs_acquire<240>();
  // Consumer warpgroup wg: keys 64 wg .. of the block's; thread (warp, g, t) holds keys
  // key0 = k0 + 64 wg + 16 (warp % 4) + g and key0 + 8 (rows), queries 8j + 2t, +1 of the tile (columns).
  const int wg = warp / 4 - 1, g = lane / 4, t = lane % 4, key0 = k0 + 64 * wg + 16 * (warp % 4) + g;
  const uint32_t ks = k_s + wg * 64 * 128, vs = v_s + wg * 64 * 128;
  const Dropout drop = DROP ? Dropout(p.drop) : Dropout();
  float s[BQ / 2], dp[BQ / 2], dk[D / 2], dv[D / 2], dq[32];
  uint32_t pf[BQ / 16][4], dsf[BQ / 16][4];  // P^T and dS^T as A operands, one k16 step of queries each
  // Tile i's lse_log2 and delta (BQ each): a warp's columns span all of them, too many registers for
  // each thread to load its own. So each warp loads the next tile's a tile ahead, four a lane, and
  // shares them through its buffer i % 2 in shared memory: lse_log2 at [0, BQ), delta at [BQ, 2 BQ).
  static_assert(2 * BQ == 4 * 32, "four statistics a lane");
  float* warp_stats = stats + (warp - 4) * 4 * BQ;
  float next_stats[4];
  auto load_stats = [&](int i) {  // zero past Sq: P is masked there
    const int64_t row = (int64_t)(b * p.heads + hk * p.group + i / per_head) * p.Sq;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int q = qstart + i % per_head * BQ + (c & 1) * 32 + lane;
      next_stats[c] = q < p.Sq ? (c < 2 ? p.lse_log2 : p.delta)[row + q] : 0.f;
    }
  };
  if (tiles > 0) load_stats(0);
  // The next tile's are loaded at the top of a tile. With ADD_DQ at D 128 the registers run short:
  // the loaded values are spilled as they land, and the spill store kept the warp from its first turn
  // for the load's whole latency. There they are loaded during the wait on the second turn's products
  // instead (which slows the other kernels).
  constexpr bool LOAD_STATS_LATE = ADD_DQ && !S::OVERLAP;
  // ADD_DQ: this warpgroup's dQ part (landed) into its buffer for its writer, 16 bytes a thread in turn
  // (the sums keep this order; the finish kernel puts each value in its place).
  int dq_staged = 0;
  auto stage_dq = [&]() {
    mbar_wait(dq_empty + 8 * wg, (dq_staged++ & 1) ^ 1);
    const uint32_t buf = dq_s + wg * S::DQ_BYTES + (threadIdx.x - 128 - 128 * wg) * 16;
#pragma unroll
    for (int c = 0; c < 8; ++c)
      st_shared16(buf + c * 128 * 16, dq[4 * c], dq[4 * c + 1], dq[4 * c + 2], dq[4 * c + 3]);
    fence_proxy_async();
    __syncwarp();
    if (lane == 0) mbar_arrive(dq_full + 8 * wg);
  };
  // ADD_DQ at D 128: warpgroup w's dQ of tile i - 1 (dS^T buffer (i - 1) % 2, K's columns 64 w ..)
  auto issue_dq_of = [&](uint32_t dss) {
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
      wgmma_bf16<1, 1, 64>(dq, smem_desc(dss + kk * 2048, S::DS_BYTES, 1024),
                           smem_desc(k_s + wg * S::KV_SLAB + kk * 2048, S::KV_SLAB, 1024), kk > 0);
  };
  if (ADD_DQ && D == 128) {  // buffer 1 zeroed: tile 0 issues a dQ product too, thrown away (a wgmma
    // under a branch would serialize every wgmma of the kernel)
    for (int o = (threadIdx.x - 128) * 16; o < S::DS_BYTES; o += 256 * 16)
      st_shared16_zero(ds_s + S::DS_BYTES + o);
    fence_proxy_async();
    named_sync(3, 256);
  }
  // Ping-pong: the warpgroups take turns issuing products (named barrier 1 + wg: my turn), so one's
  // elementwise work runs while the other's products keep the tensor cores busy; warpgroup 0 goes
  // first and warpgroup 1 keeps its last turn (no one is left to take it).
  int turns_left = 2 * tiles;
  auto my_turn = [&]() {
    if (S::PINGPONG) named_sync(1 + wg, 256);
  };
  auto your_turn = [&]() {
    if (S::PINGPONG && (--turns_left > 0 || wg == 0)) named_arrive(2 - wg, 256);
  };
  if (S::PINGPONG && wg == 1 && tiles > 0) named_arrive(1, 256);
  if (tiles > 0) {
    mbar_wait(kv_full, 0);
  } else {
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.f;
  }
  for (int i = 0; i < tiles; ++i) {
    const int st = i % STAGES, q0 = qstart + i % per_head * BQ;
    const uint32_t qs = st_s + st * S::STAGE_BYTES, dos = qs + S::Q_BYTES, dss = ds_s + (i & 1) * S::DS_BYTES;
    // Buffer i % 2 was last read in tile i - 2, before the warp's __syncwarp in tile i - 1.
    float* ts = warp_stats + (i & 1) * 2 * BQ;
#pragma unroll
    for (int c = 0; c < 4; ++c) ts[32 * c + lane] = next_stats[c];
    if (!LOAD_STATS_LATE && i + 1 < tiles) load_stats(i + 1);
    __syncwarp();
    mbar_wait(full + 8 * st, (i / STAGES) & 1);
    my_turn();
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const int off = kk / 4 * S::KV_SLAB + kk % 4 * 32, qoff = kk / 4 * S::Q_SLAB + kk % 4 * 32;
      wgmma_bf16<0, 0, BQ>(s, smem_desc(ks + off, 16, 1024), smem_desc(qs + qoff, 16, 1024), kk > 0);
      wgmma_bf16<0, 0, BQ>(dp, smem_desc(vs + off, 16, 1024), smem_desc(dos + qoff, 16, 1024), kk > 0);
    }
    wgmma_commit();
    your_turn();
    if (S::OVERLAP && i > 0) {
      wgmma_wait<1>();  // the previous tile's dV and dK (and dQ) have landed: its stage goes back
      if (lane == 0) mbar_arrive(empty + 8 * ((i - 1) % STAGES));
    }
    wgmma_wait<0>();
    // (accumulators read while a wgmma is in flight would serialize them all)
    if (ADD_DQ && S::OVERLAP && i > 0) stage_dq();
    const bool masked = q0 + BQ > p.Sq || k0 + BN > p.Sk || (CAUSAL && k0 + BN - 1 > q0 + offset);
    // Dropout: the rows of this tile's queries in the draws, (b * H + h) * Sq + q
    const uint32_t drop_row = (uint32_t)((int64_t)(b * p.heads + hk * p.group + i / per_head) * p.Sq + q0);
#pragma unroll
    for (int j = 0; j < BQ / 8; ++j) {  // this thread's queries, columns 8j + 2t and + 1
      const float2 l2 = *reinterpret_cast<const float2*>(ts + 8 * j + 2 * t);
      const float2 d2 = *reinterpret_cast<const float2*>(ts + BQ + 8 * j + 2 * t);
      const float lq[2] = {l2.x, l2.y}, dl[2] = {d2.x, d2.y};
      // With dropout, dP (of the kept probabilities) is dP' * factor, and dV's P is P * factor.
      float z[4] = {1.f, 1.f, 1.f, 1.f};
      if constexpr (DROP) drop.factors_t(drop_row + 8 * j + 2 * t, key0, z);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float pr = fast_exp2(s[4 * j + e] * p.scale_log2 - lq[e & 1]);
        if (masked) {
          const int q = q0 + 8 * j + 2 * t + (e & 1), key = key0 + (e & 2 ? 8 : 0);
          if (q >= p.Sq || key >= p.Sk || (CAUSAL && key > q + offset)) pr = 0.f;
        }
        s[4 * j + e] = DROP ? pr * z[e] : pr;
        dp[4 * j + e] = pr * ((DROP ? dp[4 * j + e] * z[e] : dp[4 * j + e]) - dl[e & 1]);
      }
    }
#pragma unroll
    for (int kk = 0; kk < BQ / 16; ++kk)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        pf[kk][e] = pack_bf16x2(s[8 * kk + 2 * e], s[8 * kk + 2 * e + 1]);
        dsf[kk][e] = pack_bf16x2(dp[8 * kk + 2 * e], dp[8 * kk + 2 * e + 1]);
      }
    if constexpr (ADD_DQ) {
      // D 128: buffer i % 2 was last read by both warpgroups' dQ of tile i - 2 (at i = 1: the thrown-away
      // one), issued in tile i - 1. Warpgroup 0's has landed before its first turn of tile i, which
      // warpgroup 1's first turn waits for; warpgroup 1's landing is signalled on barrier 6. (The other
      // way round would not hold: warpgroup 0 could arrive twice before warpgroup 1 waits.)
      if (D == 128 && wg == 0 && i >= 1) named_sync(6, 256);
      // dS^T into buffer i % 2: rows of keys, 64 queries each (128 bytes), 16-byte pieces swizzled as
      // the copy engine lays out an M-major operand (piece c of row r at c ^ (r % 8)); dsf[kk][e] holds
      // key row g + 8 (e & 1), queries 16 kk + 8 (e >> 1) + 2t and + 1.
#pragma unroll
      for (int kk = 0; kk < BQ / 16; ++kk)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = 64 * wg + 16 * (warp % 4) + g + 8 * (e & 1), c = 2 * kk + (e >> 1);
          st_shared4(dss + r * 128 + ((c ^ g) << 4) + 4 * t, dsf[kk][e]);
        }
      fence_proxy_async();
      if (D == 64) named_sync(4 + wg, 128);  // the warpgroup's own dS^T, read below
    }
    my_turn();
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BQ / 16; ++kk) {
      wgmma_bf16_ra<1, D>(dv, pf[kk], smem_desc(dos + kk * 2048, S::Q_SLAB, 1024), i > 0 || kk > 0);
      wgmma_bf16_ra<1, D>(dk, dsf[kk], smem_desc(qs + kk * 2048, S::Q_SLAB, 1024), i > 0 || kk > 0);
    }
    if constexpr (ADD_DQ && D == 128) {
      issue_dq_of(ds_s + ((i + 1) & 1) * S::DS_BYTES);  // tile i - 1's (both dS^T were written before this turn)
    } else if constexpr (ADD_DQ) {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)  // D 64: over the warpgroup's own 64 keys
        wgmma_bf16<1, 1, 64>(dq, smem_desc(dss + wg * 8192 + kk * 2048, S::DS_BYTES, 1024),
                             smem_desc(ks + kk * 2048, S::KV_SLAB, 1024), kk > 0);
    }
    wgmma_commit();
    your_turn();
    if (LOAD_STATS_LATE && i + 1 < tiles) load_stats(i + 1);
    if (!S::OVERLAP) {
      wgmma_wait<0>();
      if (lane == 0) mbar_arrive(empty + 8 * st);
      if (ADD_DQ && i > 0) stage_dq();
      if (ADD_DQ && wg == 1 && i + 1 < tiles) named_arrive(6, 256);  // my dQ of tile i - 1 has landed
    }
  }
  if (ADD_DQ && D == 128 && tiles > 0) {  // the last tile's dQ, once both warpgroups wrote its dS^T
    named_sync(3, 256);
    wgmma_fence();
    issue_dq_of(ds_s + ((tiles - 1) & 1) * S::DS_BYTES);
    wgmma_commit();
    wgmma_wait<0>();
    stage_dq();
  }
  wgmma_wait<0>();
  if (S::OVERLAP && tiles > 0) {
    if (lane == 0) mbar_arrive(empty + 8 * ((tiles - 1) % STAGES));
    if (ADD_DQ) stage_dq();
  }
  store_rows(attn_rows(p.dk, p.ldk, kvhead), as_fragments<D>(dk), key0, p.Sk, p.scale, p.scale);
  store_rows(attn_rows(p.dv, p.ldv, kvhead), as_fragments<D>(dv), key0, p.Sk, 1.f, 1.f);
#else
  __trap();  // built without sm_90a: the launcher never picks this kernel
#endif
}

// dq (bf16, times the scale) from ADD_DQ's sums: a block per 64 x 64 part, through shared memory so
// that each row goes out in 16-byte pieces. Value e of thread tid's piece c is its dQ fragment's
// 4c + e: row 16 (tid / 32) + tid % 32 / 4 + 8 (e / 2), column 8c + 2 (tid % 4) + e % 2.
template <int D>
__global__ void __launch_bounds__(128) attention_bwd_dq_finish_kernel(const float* dq_sum, __nv_bfloat16* dq,
                                                                      AttnLayout ldq, int Sq, int nq, float scale) {
  __shared__ float tile[64][65];
  const int64_t part = blockIdx.x;  // (query head, tile, 64 columns)
  const int slab = (int)(part % (D / 64)), qt = (int)(part / (D / 64) % nq), bh = (int)(part / (D / 64) / nq);
  const int tid = threadIdx.x, t = tid % 4, r = 16 * (tid / 32) + tid % 32 / 4;
  const float4* sum = reinterpret_cast<const float4*>(dq_sum + part * 64 * 64) + tid;
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    const float4 v = sum[c * 128];
    tile[r][8 * c + 2 * t] = v.x;
    tile[r][8 * c + 2 * t + 1] = v.y;
    tile[r + 8][8 * c + 2 * t] = v.z;
    tile[r + 8][8 * c + 2 * t + 1] = v.w;
  }
  __syncthreads();
  const AttnRows<__nv_bfloat16> out = attn_rows(dq, ldq, bh);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int row = 16 * k + tid / 8, seg = tid % 8, q = 64 * qt + row;
    if (q >= Sq) continue;
    uint32_t w[4];
#pragma unroll
    for (int e = 0; e < 4; ++e)
      w[e] = pack_bf16x2(tile[row][8 * seg + 2 * e] * scale, tile[row][8 * seg + 2 * e + 1] * scale);
    *reinterpret_cast<uint4*>(out.at(q) + 64 * slab + 8 * seg) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// dQ of the bf16 backward on Hopper: the forward's structure again. A block owns 128 queries of one
// head (two consumer warpgroups of 64); the producer thread lifts Q and dO once, then K and V 64 keys
// at a time. Per tile: S = Q K^T and dP = dO V^T from shared memory, P = exp2(S * scale_log2 - lse_log2)
// and dS = P (dP - delta) in registers (one lse_log2 and delta a row, read once), dQ += dS K with dS as
// the A operand and K read N-major; the next tile's S and dP are issued before this tile's dQ product
// is waited for. Every dQ row is this block's alone: deterministic.
// Recomputing S and dP here takes two products a tile that the dK/dV kernel has done already; the
// dK/dV kernel's ADD_DQ (deterministic=False) adds each tile's dS K into fp32 sums instead. Kept
// deterministic, the key blocks must add in a fixed order, each waiting for its turn: at head size 64
// and at short lengths the turns cost more than the two products.
template <int D>
struct AttnDqTmaShape {
  static constexpr int BM = 128, BN = 64, THREADS = 384;
  static constexpr int Q_BYTES = BM * D * 2, KV_BYTES = BN * D * 2;  // Q or dO; K or V
  static constexpr int Q_SLAB = BM * 128, KV_SLAB = BN * 128;
  static constexpr int STAGES = std::min(4, (SMEM_BLOCK_MAX - 1024 - 2 * Q_BYTES - 256) / (2 * KV_BYTES));
  static constexpr int SMEM = 1024 + 2 * Q_BYTES + STAGES * 2 * KV_BYTES + 8 * (1 + 2 * STAGES);
};

struct AttnDqTmaArgs {
  const float *lse_log2, *delta;  // (B * H, Sq)
  __nv_bfloat16* dq;
  AttnLayout ldq;
  int Sq, Sk, heads, group;
  float scale, scale_log2;
  DropoutArgs drop;  // on the probabilities, where the kernel's DROP is set
};

template <int D, bool CAUSAL, bool DROP>
__global__ void __launch_bounds__(AttnDqTmaShape<D>::THREADS, 1)
    attention_bwd_dq_tma_kernel(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_k,
                                const __grid_constant__ CUtensorMap map_v, const __grid_constant__ CUtensorMap map_do,
                                AttnDqTmaArgs p) {
#ifdef WG_ENABLED
  using S = AttnDqTmaShape<D>;
  constexpr int BM = S::BM, BN = S::BN, STAGES = S::STAGES;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t q_s = (smem_addr(smem_raw) + 1023) & ~1023u, do_s = q_s + S::Q_BYTES, kv_s = do_s + S::Q_BYTES;
  const uint32_t q_full = kv_s + STAGES * 2 * S::KV_BYTES, full = q_full + 8, empty = full + 8 * STAGES;
  // As in attention_fwd_tma_kernel: a head's query tiles neighbours in the grid, the heaviest first.
  const int bh = blockIdx.y, b = bh / p.heads, h = bh % p.heads;
  const int q0 = (CAUSAL ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * BM, offset = p.Sk - p.Sq;
  const int key_end = CAUSAL ? min(p.Sk, min(q0 + BM, p.Sq) + offset) : p.Sk;
  const int ntiles = key_end > 0 ? (key_end + BN - 1) / BN : 0;
  if (threadIdx.x == 0) {
    mbar_init(q_full, 1);
    for (int st = 0; st < STAGES; ++st) {
      mbar_init(full + 8 * st, 1);
      mbar_init(empty + 8 * st, 8);
    }
    mbar_init_fence();
  }
  __syncthreads();
  pdl_begin();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp < 4) {  // producer warpgroup: registers as in attention_fwd_tma_kernel
    regs_release<32>();
    if (threadIdx.x > 0 || ntiles == 0) return;
    mbar_expect_bytes(q_full, 2 * S::Q_BYTES);
    for (int c = 0; c < D / 64; ++c) {
      tma_load_4d(q_s + c * S::Q_SLAB, &map_q, 64 * c, q0, h, b, q_full);
      tma_load_4d(do_s + c * S::Q_SLAB, &map_do, 64 * c, q0, h, b, q_full);
    }
    for (int j = 0; j < ntiles; ++j) {
      const int st = j % STAGES;
      mbar_wait(empty + 8 * st, ((j / STAGES) & 1) ^ 1);
      const uint32_t ks = kv_s + 2 * st * S::KV_BYTES, vs = ks + S::KV_BYTES;
      mbar_expect_bytes(full + 8 * st, 2 * S::KV_BYTES);
      for (int c = 0; c < D / 64; ++c) {
        tma_load_4d(ks + c * S::KV_SLAB, &map_k, 64 * c, j * BN, h / p.group, b, full + 8 * st);
        tma_load_4d(vs + c * S::KV_SLAB, &map_v, 64 * c, j * BN, h / p.group, b, full + 8 * st);
      }
    }
    return;
  }

  regs_acquire<232>();
  // Consumer warpgroup wg: rows r0 = q0 + 64 wg + 16 (warp % 4) + g and r0 + 8, keys 8j + 2t, +1.
  const int wg = warp / 4 - 1, g = lane / 4, t = lane % 4, r0 = q0 + 64 * wg + 16 * (warp % 4) + g;
  const uint32_t qs = q_s + wg * 64 * 128, dos = do_s + wg * 64 * 128;
  const Dropout drop = DROP ? Dropout(p.drop) : Dropout();
  const uint32_t drop_row = (uint32_t)((int64_t)bh * p.Sq + r0);
  float s[BN / 2], dp[BN / 2], dq[D / 2];
  uint32_t dsf[BN / 16][4];  // dS as the A operand of dS K, one k16 step of keys each
  float lse[2], dlt[2];
  for (int hh = 0; hh < 2; ++hh) {
    const bool in = r0 + 8 * hh < p.Sq;
    lse[hh] = in ? p.lse_log2[(int64_t)bh * p.Sq + r0 + 8 * hh] : 0.f;
    dlt[hh] = in ? p.delta[(int64_t)bh * p.Sq + r0 + 8 * hh] : 0.f;
  }
  if (ntiles > 0) {
    mbar_wait(q_full, 0);
  } else {
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dq[i] = 0.f;
  }
  for (int j = 0; j < ntiles; ++j) {
    const int st = j % STAGES, k0 = j * BN;
    const uint32_t ks = kv_s + 2 * st * S::KV_BYTES, vs = ks + S::KV_BYTES;
    mbar_wait(full + 8 * st, (j / STAGES) & 1);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const int qoff = kk / 4 * S::Q_SLAB + kk % 4 * 32, koff = kk / 4 * S::KV_SLAB + kk % 4 * 32;
      wgmma_bf16<0, 0, BN>(s, smem_desc(qs + qoff, 16, 1024), smem_desc(ks + koff, 16, 1024), kk > 0);
      wgmma_bf16<0, 0, BN>(dp, smem_desc(dos + qoff, 16, 1024), smem_desc(vs + koff, 16, 1024), kk > 0);
    }
    wgmma_commit();
    if (j > 0) {
      wgmma_wait<1>();  // the previous tile's dQ product has landed: its stage goes back
      if (lane == 0) mbar_arrive(empty + 8 * ((j - 1) % STAGES));
    }
    wgmma_wait<0>();
    const bool masked = k0 + BN > p.Sk || (CAUSAL && k0 + BN - 1 > q0 + 64 * wg + offset);
    if constexpr (DROP) drop.apply(as_fragments<BN>(dp), drop_row, drop_row + 8, k0);  // dP of the kept P
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) {
      const int hh = (i >> 1) & 1;
      float pr = fast_exp2(s[i] * p.scale_log2 - lse[hh]);
      if (masked) {
        const int key = k0 + 8 * (i / 4) + 2 * t + (i & 1);
        if (key >= p.Sk || (CAUSAL && key > r0 + 8 * hh + offset)) pr = 0.f;
      }
      dp[i] = pr * (dp[i] - dlt[hh]);
    }
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
      for (int e = 0; e < 4; ++e) dsf[kk][e] = pack_bf16x2(dp[8 * kk + 2 * e], dp[8 * kk + 2 * e + 1]);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
      wgmma_bf16_ra<1, D>(dq, dsf[kk], smem_desc(ks + kk * 2048, S::KV_SLAB, 1024), j > 0 || kk > 0);
    wgmma_commit();
  }
  wgmma_wait<0>();
  if (ntiles > 0 && lane == 0) mbar_arrive(empty + 8 * ((ntiles - 1) % STAGES));
  store_rows(attn_rows(p.dq, p.ldq, bh), as_fragments<D>(dq), r0, p.Sq, p.scale, p.scale);
#else
  __trap();  // built without sm_90a: the launcher never picks this kernel
#endif
}

// ------------------------------------------------------------------------------------------------
// 7.7 attention launchers

// A tensor map over one attention operand, (batch, heads, rows, D) bf16 laid out as l says, read in
// boxes of 64 values x box_rows rows of one head; false where the copy engine cannot address it
// (a base or stride off 16 bytes).
static bool attn_tile_map(CUtensorMap& map, const void* x, const AttnLayout& l, int batch, int rows, int D,
                          int box_rows) {
  if (!aligned16(x) || l.ss % 8 || l.sh % 8 || l.sb % 8) return false;
  const cuuint64_t dims[4] = {(cuuint64_t)D, (cuuint64_t)rows, (cuuint64_t)l.heads, (cuuint64_t)batch};
  // A dimension of size 1 is never stepped over; give it a stride the encoder accepts.
  const int64_t sh = l.heads == 1 ? (int64_t)rows * l.ss : l.sh, sb = batch == 1 ? sh * l.heads : l.sb;
  if (l.ss <= 0 || sh <= 0 || sb <= 0) return false;
  const cuuint64_t strides[3] = {(cuuint64_t)l.ss * 2, (cuuint64_t)sh * 2, (cuuint64_t)sb * 2};
  const cuuint32_t box[4] = {64, (cuuint32_t)box_rows, 1, 1}, elem_strides[4] = {1, 1, 1, 1};
  return tensor_map_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, const_cast<void*>(x), dims, strides, box,
                              elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <int D, bool CAUSAL, bool DROP>
static void attention_fwd_tma_launch(const CUtensorMap (&maps)[3], const AttnTmaArgs& p, cudaStream_t s) {
  using S = AttnTmaShape<D>;
  raise_smem_limit<attention_fwd_tma_kernel<D, CAUSAL, DROP>>(S::SMEM);
  cudaMemsetAsync(p.next_unit, 0, sizeof(int), s);
  const int64_t units = (int64_t)ceil_div(p.Sq, S::BM) * p.BH;
  launch_pdl(attention_fwd_tma_kernel<D, CAUSAL, DROP>, dim3((unsigned)std::min<int64_t>(units, num_sms())),
             dim3(S::THREADS), S::SMEM, s, maps[0], maps[1], maps[2], p);
}

// Runs the bf16 forward on attention_fwd_tma_kernel where it applies (sm_90a, head size 64 or 128,
// no kv_len, at least one whole query tile, operands the copy engine can address, a workspace for
// the unit counter); false: it did not, and the caller runs attention_fwd_kernel.
static bool attention_fwd_tma(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                              __nv_bfloat16* out, float* lse_log2, const AttnLayouts& l, int BH, int group, int Sq,
                              int Sk, int D, bool causal, float scale_log2, const int64_t* kv_len,
                              const DropoutArgs& drop, float* workspace, cudaStream_t s) {
  if (!attention_wgmma_enabled.load() || !hopper_wgmma() || !is_head_size(limits::hopper_head_sizes{}, D) || kv_len || Sq < 128 || !workspace ||
      (int64_t)ceil_div(Sq, AttnTmaShape<64>::BM) * BH > INT_MAX)  // the units, counted in int
    return false;
  const int batch = BH / l.q.heads;
  CUtensorMap maps[3];
  if (!attn_tile_map(maps[0], q, l.q, batch, Sq, D, 128) || !attn_tile_map(maps[1], k, l.k, batch, Sk, D, 128) ||
      !attn_tile_map(maps[2], v, l.v, batch, Sk, D, 128))
    return false;
  int* next_unit = reinterpret_cast<int*>(workspace);
  const AttnTmaArgs p{out, l.out, lse_log2, Sq, Sk, BH, l.q.heads, group, scale_log2, next_unit, drop};
  with_head_size(limits::hopper_head_sizes{}, D, [&](auto d) {
    with_flag(causal, [&](auto c) {
      with_flag(drop.rng != nullptr, [&](auto dr) {
        attention_fwd_tma_launch<decltype(d)::value, decltype(c)::value, decltype(dr)::value>(maps, p, s);
      });
    });
  });
  return true;
}

template <int D, bool CAUSAL, bool ADD_DQ, bool DROP = false>
static void attention_bwd_dkv_tma_launch(const CUtensorMap (&maps)[4], const AttnBwdTmaArgs& p, int kv_heads,
                                         cudaStream_t s) {
  using S = AttnBwdTmaShape<D, ADD_DQ>;
  raise_smem_limit<attention_bwd_dkv_tma_kernel<D, CAUSAL, ADD_DQ, DROP>>(S::SMEM);
  launch_pdl(attention_bwd_dkv_tma_kernel<D, CAUSAL, ADD_DQ, DROP>, dim3(ceil_div(p.Sk, S::BN), kv_heads),
             dim3(S::THREADS), S::SMEM, s, maps[0], maps[1], maps[2], maps[3], p);
}

// Whether the Hopper backward (attention_bwd_tma) may run: sm_90a, head size 64 or 128, at most 65535 query
// heads. It still needs operands the copy engine can address.
static bool attention_bwd_hopper(int BH, int D) {
  return attention_wgmma_enabled.load() && hopper_wgmma() && is_head_size(limits::hopper_head_sizes{}, D) && BH <= 65535;
}

// Floats of the fp32 dQ sums the Hopper backward adds into with deterministic = false (0 where it does not run).
int64_t launch::attention_bwd_dq_sum_floats(int BH, int Sq, int D) {
  return attention_bwd_hopper(BH, D) ? (int64_t)BH * ceil_div(Sq, 64) * 64 * D : 0;
}

template <int D, bool CAUSAL, bool DROP>
static void attention_bwd_dq_tma_launch(const CUtensorMap (&maps)[4], const AttnDqTmaArgs& p, int BH, cudaStream_t s) {
  using S = AttnDqTmaShape<D>;
  raise_smem_limit<attention_bwd_dq_tma_kernel<D, CAUSAL, DROP>>(S::SMEM);
  launch_pdl(attention_bwd_dq_tma_kernel<D, CAUSAL, DROP>, dim3(ceil_div(p.Sq, S::BM), BH), dim3(S::THREADS), S::SMEM, s,
             maps[0], maps[1], maps[2], maps[3], p);
}

// dq, its fp32 sums of attention_bwd_dkv_tma_kernel<..., ADD_DQ> in dq_sum (attention_bwd_dq_sum_floats).
template <int D>
static void attention_bwd_add_dq(const CUtensorMap (&maps)[4], AttnBwdTmaArgs p, bool causal, __nv_bfloat16* dq,
                                 const AttnLayout& ldq, int BH, int kv_heads, cudaStream_t s) {
  p.nq = ceil_div(p.Sq, 64);
  cudaMemsetAsync(p.dq_sum, 0, launch::attention_bwd_dq_sum_floats(BH, p.Sq, D) * sizeof(float), s);
  (causal ? attention_bwd_dkv_tma_launch<D, true, true> : attention_bwd_dkv_tma_launch<D, false, true>)(maps, p,
                                                                                                       kv_heads, s);
  check_launch("attention_bwd_dkv_tma (dQ added)");
  attention_bwd_dq_finish_kernel<D><<<(unsigned)((int64_t)BH * p.nq * (D / 64)), 128, 0, s>>>(p.dq_sum, dq, ldq, p.Sq,
                                                                                             p.nq, p.scale);
  check_launch("attention_bwd_dq_finish");
}

// The bf16 backward on attention_bwd_dkv_tma_kernel and attention_bwd_dq_tma_kernel where they apply
// (attention_bwd_hopper, and operands the copy engine can address); false: they did not, and
// attention_bwd_kernel runs. delta is computed already.
// dq_sum (or nullptr): attention_bwd_dq_sum_floats floats, dQ added across key blocks in one kernel
// (not deterministic; where dq's rows are 16-byte aligned for the finish kernel's stores; not with dropout).
static bool attention_bwd_tma(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                              const __nv_bfloat16* dout, const float* lse_log2, const float* delta, __nv_bfloat16* dq,
                              __nv_bfloat16* dk, __nv_bfloat16* dv, const AttnLayouts& l, int BH, int group, int Sq,
                              int Sk, int D, bool causal, float scale, const DropoutArgs& drop, float* dq_sum,
                              cudaStream_t s) {
  if (!attention_bwd_hopper(BH, D)) return false;
  const int batch = BH / l.q.heads;
  CUtensorMap kv[4];  // boxes of 64 queries and 128 keys (dK, dV)
  if (!attn_tile_map(kv[0], q, l.q, batch, Sq, D, 64) || !attn_tile_map(kv[1], k, l.k, batch, Sk, D, 128) ||
      !attn_tile_map(kv[2], v, l.v, batch, Sk, D, 128) || !attn_tile_map(kv[3], dout, l.dout, batch, Sq, D, 64))
    return false;
  const float scale_log2 = scale * 1.4426950408889634f;
  AttnBwdTmaArgs pkv{lse_log2, delta, dk, dv, l.dk, l.dv, Sq, Sk, l.q.heads, group, scale, scale_log2};
  pkv.drop = drop;
  if (dq_sum && !drop.rng && aligned16(dq) && l.dq.ss % 8 == 0 && l.dq.sh % 8 == 0 && l.dq.sb % 8 == 0) {
    pkv.dq_sum = dq_sum;
    with_head_size(limits::hopper_head_sizes{}, D, [&](auto d) {
      attention_bwd_add_dq<decltype(d)::value>(kv, pkv, causal, dq, l.dq, BH, BH / group, s);
    });
    return true;
  }
  CUtensorMap qo[4];  // 128 queries and 64 keys (dQ), encoded only where the dQ kernel runs
  if (!attn_tile_map(qo[0], q, l.q, batch, Sq, D, 128) || !attn_tile_map(qo[1], k, l.k, batch, Sk, D, 64) ||
      !attn_tile_map(qo[2], v, l.v, batch, Sk, D, 64) || !attn_tile_map(qo[3], dout, l.dout, batch, Sq, D, 128))
    return false;
  const AttnDqTmaArgs pq{lse_log2, delta, dq, l.dq, Sq, Sk, l.q.heads, group, scale, scale_log2, drop};
  with_head_size(limits::hopper_head_sizes{}, D, [&](auto d) {
    with_flag(causal, [&](auto c) {
      with_flag(drop.rng != nullptr, [&](auto dr) {
        constexpr int D_ = decltype(d)::value;
        constexpr bool CAUSAL = decltype(c)::value, DROP = decltype(dr)::value;
        attention_bwd_dkv_tma_launch<D_, CAUSAL, false, DROP>(kv, pkv, BH / group, s);
        check_launch("attention_bwd_dkv_tma");
        attention_bwd_dq_tma_launch<D_, CAUSAL, DROP>(qo, pq, BH, s);
        check_launch("attention_bwd_dq_tma");
      });
    });
  });
  return true;
}

// Floats of workspace attention_fwd_fused needs: the splits' partial results (fp32, for fp32 and bf16
// alike), and at least one word for the Hopper forward's unit counter where it may run.
int64_t launch::attention_fwd_workspace_floats(int BH, int group, int Sq, int Sk, int D) {
  const int splits = attention_fwd_splits(BH, group, Sq, Sk);
  return std::max<int64_t>(splits == 1 ? 0 : (int64_t)splits * BH * Sq * (D + 1), Sq >= 128 ? 1 : 0);
}

template <class T>
static void attention_fwd(const T* q, const T* k, const T* v, T* out, float* lse_log2, const AttnLayouts& l, int BH,
                          int group, int Sq, int Sk, int D, bool causal, float scale, bool precise,
                          const int64_t* kv_len, const DropoutArgs& drop, float* workspace, cudaStream_t s) {
  if (BH == 0 || Sq == 0) return;
  require_tensor_cores("attention_fwd_fused");
  // The forward's row max over raw scores needs scale > 0. A negative scale is the caller's to turn
  // into (-q, -scale); a zero one runs as FLT_MIN, whose products round every weight to exactly 1, as
  // zero's do, while hidden keys stay at -inf (0 * -inf would be NaN).
  if (!(scale >= 0.f)) throw std::invalid_argument("attention_fwd_fused: scale must be >= 0 (pass -q for a negative one)");
  scale = std::max(scale, FLT_MIN);
  AttnArgs<T> p = attn_args<T>(Sq, Sk, group, causal, scale);
  p.q = q; p.k = k; p.v = v; p.out = out; p.lse_log2 = lse_log2; p.kv_len = kv_len;
  p.lq = l.q; p.lk = l.k; p.lv = l.v; p.lout = l.out; p.drop = drop;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    if (attention_fwd_tma(q, k, v, out, lse_log2, l, BH, group, Sq, Sk, D, causal, p.scale_log2, kv_len, drop,
                          workspace, s)) {
      check_launch("attention_fwd_fused");
      return;
    }
  }
  const int splits = attention_fwd_splits(BH, group, Sq, Sk);
  p.split_tiles = ceil_div(ceil_div(Sk, 64), splits);
  const int64_t rows = (int64_t)BH * Sq;
  if (splits > 1) {
    p.part_o = workspace;
    p.part_lse_log2 = workspace + splits * rows * D;
  }
  with_attn_ops<T>(D, precise, [&](auto ops) { attention_fwd_dispatch<decltype(ops)>(p, BH / group, splits, s); });
  check_launch("attention_fwd_fused");
  if (splits > 1) {
    launch_pdl(attention_combine_kernel<T>, dim3((unsigned)rows), dim3(32, COMBINE_WARPS), 0, s, p.part_o,
               p.part_lse_log2, out, l.out, Sq, lse_log2, rows, D, splits);
    check_launch("attention_combine");
  }
}

// q, k, v, out laid out as l says (cp.async: 16-byte aligned base and strides). BH counts query
// heads (B * H_q); k and v hold BH / group heads. lse_log2 receives BH * Sq floats (log2 units, (B, H, Sq)
// contiguous) for the backward. workspace: the floats attention_fwd_workspace_floats asks for.
// kv_len: nullptr, or a device pointer to the number of valid keys (see the section comment).
void launch::attention_fwd_fused(const float* q, const float* k, const float* v, float* out, float* lse_log2,
                                 const AttnLayouts& l, int BH, int group, int Sq, int Sk, int D, bool causal, float scale,
                                 bool precise, const int64_t* kv_len, const DropoutArgs& drop, float* workspace,
                                 cudaStream_t s) {
  attention_fwd(q, k, v, out, lse_log2, l, BH, group, Sq, Sk, D, causal, scale, precise, kv_len, drop, workspace, s);
}
void launch::attention_fwd_fused(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                                 __nv_bfloat16* out, float* lse_log2, const AttnLayouts& l, int BH, int group, int Sq, int Sk,
                                 int D, bool causal, float scale, const int64_t* kv_len, const DropoutArgs& drop,
                                 float* workspace, cudaStream_t s) {
  attention_fwd(q, k, v, out, lse_log2, l, BH, group, Sq, Sk, D, causal, scale, false, kv_len, drop, workspace, s);
}

template <class T>
static void attention_bwd(const T* q, const T* k, const T* v, const T* out, const T* dout, const float* lse_log2,
                          float* delta, T* dq, T* dk, T* dv, const AttnLayouts& l, int BH, int group, int Sq, int Sk,
                          int D, bool causal, float scale, bool precise, const DropoutArgs& drop, float* dq_sum,
                          cudaStream_t s) {
  if (BH == 0 || Sq == 0) return;
  require_tensor_cores("attention_bwd_fused");
  const int64_t rows = (int64_t)BH * Sq;
  attention_delta_kernel<<<ceil_div(rows * DELTA_LANES, 256), 256, 0, s>>>(out, l.out, dout, l.dout, delta, Sq, rows,
                                                                           D);
  check_launch("attention_delta");
  AttnArgs<T> p = attn_args<T>(Sq, Sk, group, causal, scale);
  p.q = q; p.k = k; p.v = v; p.dout = dout; p.lse_log2 = const_cast<float*>(lse_log2);
  p.delta = delta; p.dq = dq; p.dk = dk; p.dv = dv;
  p.lq = l.q; p.lk = l.k; p.lv = l.v; p.lout = l.out; p.ldout = l.dout; p.ldq = l.dq; p.ldk = l.dk; p.ldv = l.dv;
  p.drop = drop;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    if (attention_bwd_tma(q, k, v, dout, lse_log2, delta, dq, dk, dv, l, BH, group, Sq, Sk, D, causal, scale, drop,
                          dq_sum, s))
      return;
  }
  with_attn_ops<T>(D, precise, [&](auto ops) { attention_bwd_dispatch<decltype(ops)>(p, BH, s); });
}

// delta is a BH * Sq float workspace; dk and dv have k's shape (BH / group heads). bf16 dq_sum: nullptr
// (deterministic), or attention_bwd_dq_sum_floats floats for dQ added across key blocks where the Hopper
// kernels run (faster at long sequences; dq's last bits then vary from run to run).
void launch::attention_bwd_fused(const float* q, const float* k, const float* v, const float* out,
                                 const float* dout, const float* lse_log2, float* delta, float* dq, float* dk,
                                 float* dv, const AttnLayouts& l, int BH, int group, int Sq, int Sk, int D, bool causal,
                                 float scale, bool precise, const DropoutArgs& drop, cudaStream_t s) {
  attention_bwd(q, k, v, out, dout, lse_log2, delta, dq, dk, dv, l, BH, group, Sq, Sk, D, causal, scale, precise, drop,
                nullptr, s);
}
void launch::attention_bwd_fused(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                                 const __nv_bfloat16* out, const __nv_bfloat16* dout, const float* lse_log2, float* delta,
                                 __nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv, const AttnLayouts& l, int BH,
                                 int group, int Sq, int Sk, int D, bool causal, float scale, const DropoutArgs& drop,
                                 float* dq_sum, cudaStream_t s) {
  attention_bwd(q, k, v, out, dout, lse_log2, delta, dq, dk, dv, l, BH, group, Sq, Sk, D, causal, scale, false, drop,
                dq_sum, s);
}

// ================================================================================================
// 8. Hyper-connections (mhc.py)
// n <= limits::max_streams residual streams: Sinkhorn-Knopp, mhc-dynamic's
// coefficients and projection, the streams' merge and mix.
// ================================================================================================

// ------------------------------------------------------------------------------------------------
// 8.1 stream loads and per-lane sums

// Loads and per-lane sums the stream kernels (mhc.py) and mhc-dynamic's coefficients share.

// VEC values of a row of fp32 or bf16 at unit u, as floats, and back (16-byte fp32 or 8-byte bf16 units).
template <int VEC, class T>
__device__ __forceinline__ void stream_load(const T* row, int u, float (&v)[VEC]) {
  if constexpr (VEC == 4 && std::is_same_v<T, float>) unpack16(load_stream4(row + 4 * u), v);
  else if constexpr (VEC == 4) load4(row + 4 * u, v);
  else v[0] = to_float(row[u]);
}

template <int VEC, class T>
__device__ __forceinline__ void stream_store(T* row, int u, const float (&v)[VEC]) {
  if constexpr (VEC == 4) store4(row + 4 * u, v);
  else row[u] = from_float<T>(v[0]);
}

// out = sum_i h[i] v[i], in the order stream_merge sums (so a fused merge gives the same bits).
template <int N, int VEC>
__device__ __forceinline__ void stream_combine(const float (&h)[N], const float (&v)[N][VEC], float (&out)[VEC]) {
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    out[k] = h[0] * v[0][k];
#pragma unroll
    for (int i = 1; i < N; ++i) out[k] = fmaf(h[i], v[i][k], out[k]);
  }
}

// The steps below P of warp_sum_each, offset O first (recursion, so every index into w is a constant).
template <int O, int P>
__device__ __forceinline__ void warp_sum_halves(float (&w)[P]) {
  if constexpr (O > 0) {
    const bool upper = threadIdx.x & O;
#pragma unroll
    for (int k = 0; k < O; ++k) {
      const float send = upper ? w[k] : w[k + O];
      w[k] = (upper ? w[k + O] : w[k]) + __shfl_xor_sync(0xffffffffu, send, O);
    }
    warp_sum_halves<O / 2>(w);
  }
}

// Each of V <= 32 values summed over the warp's lanes: afterwards lane l holds the total of value l % P, P being
// V rounded up to a power of 2. The butterfly's steps at offsets 16 .. P add all P values; each step below P
// halves them, a lane keeping the half its offset bit picks and adding its partner's copy of that half. That is
// P log2(32 / P) + P - 1 shuffles (31 for 32 values) where a warp_sum of each takes 5 per value, and each
// total is the same pairwise sum in the same order as warp_sum's: the same bits. threadIdx.x's low 5 bits must be
// the lane (blocks a multiple of 32 wide, as every stream kernel's).
template <int V>
__device__ __forceinline__ float warp_sum_each(const float* v) {
  constexpr int P = V <= 1 ? 1 : V <= 2 ? 2 : V <= 4 ? 4 : V <= 8 ? 8 : V <= 16 ? 16 : 32;
  float w[P];
#pragma unroll
  for (int k = 0; k < P; ++k) w[k] = k < V ? v[k] : 0.f;
  for (int o = 16; o >= P; o >>= 1)
#pragma unroll
    for (int k = 0; k < P; ++k) w[k] += __shfl_xor_sync(0xffffffffu, w[k], o);
  warp_sum_halves<P / 2>(w);
  return w[0];
}

// The K per-lane sums acc added over the warp, 32 values at a time: use(k, total) runs on lane k % 32.
template <int LO = 0, int K, class Use>
__device__ __forceinline__ void warp_sums(const float (&acc)[K], Use use) {
  constexpr int V = K - LO < 32 ? K - LO : 32;
  const float total = warp_sum_each<V>(acc + LO);
  const int lane = threadIdx.x & 31;
  if (lane < V) use(LO + lane, total);
  if constexpr (LO + 32 < K) warp_sums<LO + 32>(acc, use);
}

// Calls launch(N, VEC) with n (1..8) and VEC (4 when vec4, else 1) as compile-time constants
// (std::integral_constant), so each stream kernel is instantiated for every stream count and unit width.
template <class Launch>
static void stream_dispatch(int n, bool vec4, Launch launch) {
  auto widths = [&](auto N) {
    if (vec4) launch(N, std::integral_constant<int, 4>{});
    else launch(N, std::integral_constant<int, 1>{});
  };
  switch (n) {
    case 1: widths(std::integral_constant<int, 1>{}); break;
    case 2: widths(std::integral_constant<int, 2>{}); break;
    case 3: widths(std::integral_constant<int, 3>{}); break;
    case 4: widths(std::integral_constant<int, 4>{}); break;
    case 5: widths(std::integral_constant<int, 5>{}); break;
    case 6: widths(std::integral_constant<int, 6>{}); break;
    case 7: widths(std::integral_constant<int, 7>{}); break;
    default: widths(std::integral_constant<int, 8>{});
  }
}

// Whole units of 4: C % 4 == 0 and every pointer aligned to 4 of its elements (nullptr passes).
template <class... P>
static bool stream_vec4(int C, P... ptrs) {
  return C % 4 == 0 && ((reinterpret_cast<uintptr_t>(ptrs) % (4 * sizeof(*ptrs)) == 0) && ...);
}

// ------------------------------------------------------------------------------------------------
// 8.2 Sinkhorn-Knopp
// Sinkhorn-Knopp for mHC: logits (M, n, n), n <= limits::max_streams -> doubly stochastic P (M, n, n), the same
// iteration as mhc.sinkhorn_torch. Each of `iters` iterations normalises the columns, then the
// rows (the paper's order, P <- T_r(T_c(P))), so P's rows sum to 1 and its columns nearly so.
//
// Log domain: the state A starts as the logits and each half-step subtracts a log-sum-exp,
// A <- A - lse over each column (over i), then over each row (over j); P = exp(A). In exact
// arithmetic that is exp() followed by divisions by column and row sums, but the exp domain fails on
// ordinary inputs: with logits of a few hundred, a whole column of exp(logits) underflows to 0 and
// the division gives 0/0 = NaN. Here each lse subtracts its max first (max + log(sum exp(a - max)),
// the sum in [1, n]), so any finite logits give finite results. The new state is formed as
// (a - max) - log(sum): the entries that carry weight (near the max) keep full precision even when
// |logits| is ~1e3, and rows of P sum to 1 within a few fp32 ulps. The state is kept in base 2
// (A log2(e), P = 2^A; the scaling rounds each logit once more), so a half-step's exponentials and
// its logarithm are one special-function instruction each: ex2.approx.ftz for the terms 2^(a - max)
// of the sum (fast_exp2: a term below 2^-126 flushes to 0 against a sum of at least 1) and lg2.approx
// for the log of that sum, which lies in [1, n] (__log2f, relative error about 2^-22), where log2f is
// a polynomial of some twenty instructions. A matrix's chain of 2 * iters half-steps is what limits
// both kernels, and it issues every one of those instructions.
//
// One row per lane: a matrix is a group of G lanes of one warp (G = n rounded up to a power of 2), lane
// r holding row r of the state in registers (n is a template parameter, dispatched 1..8, and every loop
// over j is unrolled, so nothing goes to local memory). A row step is the lane's own; a column step
// reduces each column over the group with shuffles (lanes past n give -inf to the max and 0 to the
// sum), the same fixed tree every time, so results are deterministic. The work of one iteration is
// then spread over n lanes instead of being one thread's serial chain: a single matrix (static mHC)
// and thousands of them (one per token, mhc-dynamic) both get more lanes than one thread a matrix would.
//
// Backward, one launch: recompute the forward, storing every half-step's lse (n floats), then the exact
// reverse pass. The lse sit in shared memory, laid out (2 * iters, matrices of the block, n), when the block's
// fit in SINKHORN_LSE_SMEM bytes (20 iterations need 20 KB); more iterations use a workspace laid out
// (2 * iters, M, n), whose loads each wait on L2. With n fastest, a row step's stores (lane r: row r's lse) and
// loads are consecutive addresses, free of bank conflicts, and a column step's are one per matrix. Start with
// dA = dP * P. A half-step A' = A - lse(A) along an axis has the Jacobian of a log-softmax along that
// axis: dA = dA' - exp(A') * sum(dA') (sum along the same axis: over j for each row i after a row
// step, over i for each column j after a column step), since exp(A') is the softmax of A along it.
// The state before the step is A = A' + lse, from the stored lse (it differs from the forward's by
// the rounding of lse, which matters only where exp(A) is tiny). The gradient w.r.t. the logits is
// dA after undoing the first column step.
//
// Twin: mhc.sinkhorn_torch. Uses: 1.2 fast_exp2.

constexpr int SINKHORN_THREADS = 128;
constexpr int SINKHORN_LSE_SMEM = 32 * 1024;  // a block's lse in shared memory at most (with the static: <= 48 KB)

// Lanes per matrix: n rounded up to a power of 2.
__host__ __device__ constexpr int sinkhorn_lanes(int n) { return n == 1 ? 1 : n == 2 ? 2 : n <= 4 ? 4 : 8; }

template <int N>
struct SinkhornGroup {
  static constexpr int G = sinkhorn_lanes(N);                        // lanes per matrix
  static constexpr int PER_BLOCK = SINKHORN_THREADS / G;             // matrices per block
  int m, r;     // this lane's matrix and row
  bool active;  // a row of a matrix that exists
  __device__ SinkhornGroup(int M) {
    m = blockIdx.x * PER_BLOCK + threadIdx.x / G;
    r = threadIdx.x % G;
    active = m < M && r < N;
  }
  __device__ static float max(float v) {
#pragma unroll
    for (int o = G / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
  }
  __device__ static float sum(float v) {
#pragma unroll
    for (int o = G / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
  }
};

// Bytes of shared memory a block's lse take, or 0 where they do not fit and go to the workspace.
__host__ __device__ constexpr int sinkhorn_lse_smem(int n, int iters) {
  const long long bytes = 8LL * iters * n * (SINKHORN_THREADS / sinkhorn_lanes(n));
  return bytes <= SINKHORN_LSE_SMEM ? (int)bytes : 0;
}

// Where the backward keeps the lse of the lane's matrix: half-step h's entry k at p[h * step + k].
struct SinkhornLse {
  float* p;
  int64_t step;
};

// The lse of grp's matrix: in the block's shared memory smem (sinkhorn_lse_smem bytes), or in the workspace ws
// when smem is nullptr. Lanes outside a matrix never store; what they read back (their slot's unwritten shared
// memory, or matrix 0's entries in the workspace) reaches only their own state, which the sums leave out.
template <int N>
__device__ __forceinline__ SinkhornLse sinkhorn_lse(const SinkhornGroup<N>& grp, float* smem, float* ws, int M) {
  using Grp = SinkhornGroup<N>;
  if (smem) return {smem + threadIdx.x / Grp::G * N, Grp::PER_BLOCK * N};
  return {ws + (int64_t)(grp.m < M ? grp.m : 0) * N, (int64_t)M * N};
}

// The forward's iterations on row a of group grp: a comes in as logits and leaves as the last state in base 2
// (P = exp2f(a)); lse.p != nullptr stores each half-step's lse (base 2) there, lane r the entry of column r and of
// row r: every lane of the group has each column's lse (the shuffles' sums are the same bits in all of them), so a
// lane picks its own and stores once a half-step, through a pointer that moves by a constant: the stores sit in the
// chain of half-steps that limits the kernels, so each takes as few instructions as it can.
template <int N>
__device__ __forceinline__ void sinkhorn_iterate(const SinkhornGroup<N>& grp, float (&a)[N], int iters,
                                                 SinkhornLse lse) {
  using Grp = SinkhornGroup<N>;
  const bool store = lse.p && grp.active;
  float* mine = store ? lse.p + grp.r : nullptr;  // iteration it's: column r's at mine[0], row r's at mine[step]
#pragma unroll
  for (int j = 0; j < N; ++j) a[j] *= 1.4426950408889634f;  // log2(e)
  for (int it = 0; it < iters; ++it) {
    float col_lse = 0.f;  // column r's
#pragma unroll
    for (int j = 0; j < N; ++j) {  // column j over the group's rows
      const float mx = Grp::max(grp.active ? a[j] : -INFINITY);
      const float log_sum = __log2f(Grp::sum(grp.active ? fast_exp2(a[j] - mx) : 0.f));
      a[j] = (a[j] - mx) - log_sum;
      if (grp.r == j) col_lse = mx + log_sum;
    }
    float mx = a[0];  // row r, the lane's own
#pragma unroll
    for (int j = 1; j < N; ++j) mx = fmaxf(mx, a[j]);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < N; ++j) sum += fast_exp2(a[j] - mx);
    const float log_sum = __log2f(sum);
#pragma unroll
    for (int j = 0; j < N; ++j) a[j] = (a[j] - mx) - log_sum;
    if (store) {
      mine[0] = col_lse;
      mine[lse.step] = mx + log_sum;
      mine += 2 * lse.step;
    }
  }
}

template <int N>
__device__ __forceinline__ void sinkhorn_load_row(const SinkhornGroup<N>& grp, const float* src, float (&a)[N]) {
  const float* row = src + ((int64_t)grp.m * N + grp.r) * N;
#pragma unroll
  for (int j = 0; j < N; ++j) a[j] = grp.active ? row[j] : 0.f;
}

template <int N>
__global__ void __launch_bounds__(SINKHORN_THREADS) sinkhorn_fwd_kernel(const float* logits, float* out, int M,
                                                                         int iters) {
  const SinkhornGroup<N> grp(M);
  float a[N];
  sinkhorn_load_row<N>(grp, logits, a);
  sinkhorn_iterate<N>(grp, a, iters, {});
  if (!grp.active) return;
  float* dst = out + ((int64_t)grp.m * N + grp.r) * N;
#pragma unroll
  for (int j = 0; j < N; ++j) dst[j] = exp2f(a[j]);
}

// The reverse pass: a holds the forward's last state (base 2), g = dL/dP of the lane's row; leaves g = dL/dlogits.
// The state's base does not enter g: each half-step's Jacobian is that of a log-softmax, exp(A') = exp2f(a').
template <int N>
__device__ __forceinline__ void sinkhorn_reverse(const SinkhornGroup<N>& grp, float (&a)[N], float (&g)[N],
                                                 SinkhornLse lse, int iters) {
  using Grp = SinkhornGroup<N>;
#pragma unroll
  for (int j = 0; j < N; ++j) g[j] *= exp2f(a[j]);  // dA = dP * P
  // The lse of iteration it - 1 are loaded while iteration it is undone: from the workspace each load waits on
  // L2 (the forward's stores went there), which would otherwise add its latency to every half-step.
  const int r = grp.r < N ? grp.r : 0;  // lanes outside a matrix read a row's lse, unused
  const float* at = lse.p + 2 * (iters - 1) * lse.step;  // the last iteration's; then one back at a time
  auto load_lse = [&](float& row, float (&col)[N]) {
    row = at[lse.step + r];
#pragma unroll
    for (int j = 0; j < N; ++j) col[j] = at[j];
  };
  float row_next, col_next[N];
  load_lse(row_next, col_next);
  for (int it = iters - 1; it >= 0; --it) {
    float row_lse = row_next, col_lse[N];
#pragma unroll
    for (int j = 0; j < N; ++j) col_lse[j] = col_next[j];
    if (it > 0) {
      at -= 2 * lse.step;
      load_lse(row_next, col_next);
    }
    float sum = 0.f;  // undo the row step: over j, the lane's own
#pragma unroll
    for (int j = 0; j < N; ++j) sum += g[j];
#pragma unroll
    for (int j = 0; j < N; ++j) {
      g[j] -= exp2f(a[j]) * sum;
      a[j] += row_lse;
    }
#pragma unroll
    for (int j = 0; j < N; ++j) {  // undo the column step: column j over the group's rows
      const float col_sum = Grp::sum(grp.active ? g[j] : 0.f);
      g[j] -= exp2f(a[j]) * col_sum;
      a[j] += col_lse[j];
    }
  }
}

// ws: the lse when sinkhorn_lse_smem(N, iters) is 0 (no dynamic shared memory).
template <int N>
__global__ void __launch_bounds__(SINKHORN_THREADS) sinkhorn_bwd_kernel(const float* logits, const float* dout,
    float* dlogits, float* ws, int M, int iters) {
  extern __shared__ float lse_smem[];
  const SinkhornGroup<N> grp(M);
  const SinkhornLse lse = sinkhorn_lse(grp, sinkhorn_lse_smem(N, iters) ? lse_smem : nullptr, ws, M);
  float a[N], g[N];
  sinkhorn_load_row<N>(grp, logits, a);
  sinkhorn_iterate<N>(grp, a, iters, lse);
  __syncwarp();  // the lse each lane stored are read back by its group's other lanes
  sinkhorn_load_row<N>(grp, dout, g);
  sinkhorn_reverse<N>(grp, a, g, lse, iters);
  if (!grp.active) return;
  float* dst = dlogits + ((int64_t)grp.m * N + grp.r) * N;
#pragma unroll
  for (int j = 0; j < N; ++j) dst[j] = g[j];
}

// Floats of workspace sinkhorn_bwd needs: the lse, unless they fit in shared memory.
int64_t launch::sinkhorn_workspace_floats(int M, int n, int iters) {
  return sinkhorn_lse_smem(n, iters) ? 0 : (int64_t)M * 2 * iters * n;
}

// LSE: a backward kernel, given its lse's shared memory (sinkhorn_lse_smem(N, iters) bytes; iters in scope).
#define SINKHORN_LAUNCH(KERNEL, N, LSE, M, stream, ...)                   \
  KERNEL<N><<<ceil_div(M, SinkhornGroup<N>::PER_BLOCK), SINKHORN_THREADS, \
              LSE ? sinkhorn_lse_smem(N, iters) : 0, stream>>>(__VA_ARGS__)
#define SINKHORN_DISPATCH(KERNEL, n, LSE, M, stream, ...)                   \
  switch (n) {                                                              \
    case 1: SINKHORN_LAUNCH(KERNEL, 1, LSE, M, stream, __VA_ARGS__); break; \
    case 2: SINKHORN_LAUNCH(KERNEL, 2, LSE, M, stream, __VA_ARGS__); break; \
    case 3: SINKHORN_LAUNCH(KERNEL, 3, LSE, M, stream, __VA_ARGS__); break; \
    case 4: SINKHORN_LAUNCH(KERNEL, 4, LSE, M, stream, __VA_ARGS__); break; \
    case 5: SINKHORN_LAUNCH(KERNEL, 5, LSE, M, stream, __VA_ARGS__); break; \
    case 6: SINKHORN_LAUNCH(KERNEL, 6, LSE, M, stream, __VA_ARGS__); break; \
    case 7: SINKHORN_LAUNCH(KERNEL, 7, LSE, M, stream, __VA_ARGS__); break; \
    default: SINKHORN_LAUNCH(KERNEL, 8, LSE, M, stream, __VA_ARGS__);       \
  }

static void sinkhorn_check_args(const char* what, int n, int iters) {
  if (n < 1 || n > limits::max_streams || iters < 1)
    throw std::runtime_error(std::string(what) + ": needs 1 <= n <= " + std::to_string(limits::max_streams) +
                             " and iters >= 1, got n = " + std::to_string(n) + ", iters = " + std::to_string(iters));
}

// logits, out: M matrices of n x n, contiguous.
void launch::sinkhorn_fwd(const float* logits, float* out, int M, int n, int iters, cudaStream_t s) {
  sinkhorn_check_args("sinkhorn_fwd", n, iters);
  if (M == 0) return;
  SINKHORN_DISPATCH(sinkhorn_fwd_kernel, n, false, M, s, logits, out, M, iters);
  check_launch("sinkhorn_fwd");
}

// dout = dL/dP, dlogits = dL/dlogits; ws: sinkhorn_workspace_floats(M, n, iters) floats.
void launch::sinkhorn_bwd(const float* logits, const float* dout, float* dlogits, float* ws, int M, int n, int iters,
                          cudaStream_t s) {
  sinkhorn_check_args("sinkhorn_bwd", n, iters);
  if (M == 0) return;
  SINKHORN_DISPATCH(sinkhorn_bwd_kernel, n, true, M, s, logits, dout, dlogits, ws, M, iters);
  check_launch("sinkhorn_bwd");
}

// ------------------------------------------------------------------------------------------------
// 8.3 mhc-dynamic's coefficients
// Mhc-dynamic's coefficients from the projected streams, one kernel each way (the twin is
// mhc.hc_coeffs_torch). h (M, K) holds each token's K = 2n + n^2 projections; with the per-group
// scales alpha (3) and the bias (K),
//   pre  = sigmoid(alpha[0] h[:, :n] + bias[:n])                      (M, n)
//   post = 2 sigmoid(alpha[1] h[:, n:2n] + bias[n:2n])                (M, n)
//   res  = Sinkhorn(alpha[2] h[:, 2n:] + bias[2n:], as (n, n))        (M, n, n)
// in place of PyTorch's chain of scale, add, slice, sigmoid and Sinkhorn kernels (and in the backward
// their sums over tokens). A token is a Sinkhorn group (SinkhornGroup): lane r computes pre[r], post[r]
// and row r of res. The backward returns dh and, summed over the tokens, dalpha and dbias: each block
// sums its tokens' terms in a fixed order into a row of partials, and one more launch sums the rows
// (deterministic, no atomics).
//
// Twin: mhc.hc_coeffs_torch, hc_pre_torch. Uses: 8.1, 8.2.

__host__ __device__ constexpr int hc_coeff_count(int n) { return 2 * n + n * n; }

// Lane r's logits of row r of res: alpha[2] h + bias.
template <int N>
__device__ __forceinline__ void hc_res_logits(const SinkhornGroup<N>& grp, const float* hm, const float* alpha,
                                              const float* bias, float (&a)[N]) {
  const int base = 2 * N + (grp.r < N ? grp.r : 0) * N;
#pragma unroll
  for (int j = 0; j < N; ++j) a[j] = grp.active ? alpha[2] * hm[base + j] + bias[base + j] : 0.f;
}

// hc_pre (and hc_mix_pre) hand both kernels the streams x (M, n, C) as well: its merge by H_pre happens in the same
// launch. Sinkhorn's chain of half-steps is latency, a few warps an SM, and the merge is a pass over the streams;
// a block's first SINKHORN_THREADS run Sinkhorn for its tokens while HC_DOT_WARPS more warps stream those tokens'
// rows, so the two overlap. Forward, the dot warps write merged[m, c] = sum_i pre[m, i] x[m, i, c] (stream_merge's
// order; pre is a sigmoid of h, which they compute as the Sinkhorn threads do). Backward, they compute the merge's
// coefficient gradient dpre[m, i] = sum_c dmerged[m, c] x[m, i, c] into shared memory, which the Sinkhorn threads
// need only at the end: no stream_merge_bwd launch for it and no dpre through memory. Not more dot warps: they
// take issue slots from the Sinkhorn warps, whose chain is the longer part at 4 x 256 wide.
constexpr int HC_DOT_WARPS = 8;

// Threads a block of the coefficient kernels has: SINKHORN_THREADS, and the dot warps where they have streams.
__host__ __device__ constexpr int hc_coeffs_threads(int vec) {
  return SINKHORN_THREADS + (vec ? 32 * HC_DOT_WARPS : 0);
}

struct HcCoeffsFwdArgs {
  const float* h, *alpha, *bias;
  float* pre, *post, *res;
  const float* x;  // hc_pre: the streams, merged by pre into merged
  float* merged;
  int M, C, iters;
};

// merged of the block's tokens, by the dot warps (w: which one), each taking an equal share of the tokens: a token's
// units spread over the lanes, TU tokens' loads in flight together.
template <int N, int VEC>
__device__ __forceinline__ void hc_merge_streams(const HcCoeffsFwdArgs& a, int w) {
  static_assert(SinkhornGroup<N>::PER_BLOCK % HC_DOT_WARPS == 0, "an equal share of the tokens for each dot warp");
  constexpr int T = SinkhornGroup<N>::PER_BLOCK / HC_DOT_WARPS, K = hc_coeff_count(N);
  constexpr int TU = 8 / N < 1 ? 1 : 8 / N > T ? T : 8 / N;
  const int lane = threadIdx.x % 32, units = a.C / VEC;
  for (int t0 = 0; t0 < T; t0 += TU) {
    float pre[TU][N];
    bool live[TU];
    int64_t m[TU];
#pragma unroll
    for (int t = 0; t < TU; ++t) {
      m[t] = (int64_t)blockIdx.x * SinkhornGroup<N>::PER_BLOCK + w * T + t0 + t;
      live[t] = t0 + t < T && m[t] < a.M;
      const float* hm = a.h + (live[t] ? m[t] : 0) * K;
#pragma unroll
      for (int i = 0; i < N; ++i) pre[t][i] = sigmoidf(a.alpha[0] * hm[i] + a.bias[i]);
    }
    for (int u = lane; u < units; u += 32) {
      float xv[TU][N][VEC];
#pragma unroll
      for (int t = 0; t < TU; ++t)
#pragma unroll
        for (int i = 0; i < N; ++i)
          if (live[t]) stream_load<VEC>(a.x + (m[t] * N + i) * a.C, u, xv[t][i]);
#pragma unroll
      for (int t = 0; t < TU; ++t) {
        if (!live[t]) continue;
        float out[VEC];
        stream_combine<N, VEC>(pre[t], xv[t], out);
        stream_store<VEC>(a.merged + m[t] * a.C, u, out);
      }
    }
  }
}

// VEC 0: the coefficients alone; 1 or 4: with the merge (hc_merge_streams's units).
template <int N, int VEC = 0>
__global__ void __launch_bounds__(hc_coeffs_threads(VEC)) hc_coeffs_fwd_kernel(HcCoeffsFwdArgs a) {
  constexpr int K = hc_coeff_count(N);
  if (threadIdx.x >= SINKHORN_THREADS) {
    if constexpr (VEC > 0) hc_merge_streams<N, VEC>(a, threadIdx.x / 32 - SINKHORN_THREADS / 32);
    return;
  }
  const SinkhornGroup<N> grp(a.M);
  const float* hm = a.h + (int64_t)(grp.active ? grp.m : 0) * K;
  const float* alpha = a.alpha, *bias = a.bias;
  float u[N];
  hc_res_logits<N>(grp, hm, alpha, bias, u);
  sinkhorn_iterate<N>(grp, u, a.iters, {});
  if (!grp.active) return;
  const int64_t row = (int64_t)grp.m * N + grp.r;
  a.pre[row] = sigmoidf(alpha[0] * hm[grp.r] + bias[grp.r]);
  a.post[row] = 2.f * sigmoidf(alpha[1] * hm[N + grp.r] + bias[N + grp.r]);
#pragma unroll
  for (int j = 0; j < N; ++j) a.res[row * N + j] = exp2f(u[j]);
}

// What hc_coeffs_bwd_kernel reads and writes. part: one row of 2K floats a block, the block's sums of dL/du (the
// bias's gradient) and of dL/du * h (alpha's, before the sum over its group), u being alpha h + bias. hc_pre's
// backward passes the streams x and the merge's output gradient dmerged (M, C) in place of dpre.
struct HcCoeffsBwdArgs {
  const float* h, *alpha, *bias, *dpre, *dpost, *dres;
  const float* x, *dmerged;  // hc_pre's backward: dpre from these
  float* dh, *part, *ws;
  int M, C, iters;
};

// dpre of the block's tokens into dpre_s[slot][i], by the dot warps (w: which one), each taking an equal share of
// the tokens: a token's units spread over the lanes, TU tokens' loads in flight together, then warp_sums.
template <int N, int VEC>
__device__ __forceinline__ void hc_merge_dpre(const HcCoeffsBwdArgs& a, int w, float (*dpre_s)[N]) {
  static_assert(SinkhornGroup<N>::PER_BLOCK % HC_DOT_WARPS == 0, "an equal share of the tokens for each dot warp");
  constexpr int T = SinkhornGroup<N>::PER_BLOCK / HC_DOT_WARPS;  // tokens of a dot warp
  constexpr int TU = 10 / (N + 1) < 1 ? 1 : 10 / (N + 1) > T ? T : 10 / (N + 1);
  const int lane = threadIdx.x % 32, first = w * T, units = a.C / VEC;
  for (int t0 = 0; t0 < T; t0 += TU) {
    const float* x[TU], *g[TU];
    bool live[TU];
#pragma unroll
    for (int t = 0; t < TU; ++t) {
      const int64_t m = (int64_t)blockIdx.x * SinkhornGroup<N>::PER_BLOCK + first + t0 + t;
      live[t] = t0 + t < T && m < a.M;
      x[t] = a.x + (live[t] ? m : 0) * N * a.C;
      g[t] = a.dmerged + (live[t] ? m : 0) * a.C;
    }
    float acc[TU][N] = {};
    for (int u = lane; u < units; u += 32) {
      float gv[TU][VEC], xv[TU][N][VEC];
#pragma unroll
      for (int t = 0; t < TU; ++t) {
        if (!live[t]) continue;
        stream_load<VEC>(g[t], u, gv[t]);
#pragma unroll
        for (int i = 0; i < N; ++i) stream_load<VEC>(x[t] + (int64_t)i * a.C, u, xv[t][i]);
      }
#pragma unroll
      for (int t = 0; t < TU; ++t) {
        if (!live[t]) continue;
#pragma unroll
        for (int i = 0; i < N; ++i)
#pragma unroll
          for (int k = 0; k < VEC; ++k) acc[t][i] = fmaf(gv[t][k], xv[t][i][k], acc[t][i]);
      }
    }
#pragma unroll
    for (int t = 0; t < TU; ++t)
      if (t0 + t < T) warp_sums(acc[t], [&](int i, float total) { dpre_s[first + t0 + t][i] = total; });
  }
}

// VEC 0: dpre read from memory; 1 or 4: computed from x and dmerged by the dot warps (hc_merge_dpre's units). The
// lse take sinkhorn_lse_smem(N, iters) bytes of dynamic shared memory, or the workspace ws where that is 0.
template <int N, int VEC = 0>
__global__ void __launch_bounds__(hc_coeffs_threads(VEC)) hc_coeffs_bwd_kernel(HcCoeffsBwdArgs a) {
  using Grp = SinkhornGroup<N>;
  constexpr int K = hc_coeff_count(N);
  extern __shared__ float lse_smem[];
  __shared__ float du_s[Grp::PER_BLOCK][K], duh_s[Grp::PER_BLOCK][K];
  __shared__ float dpre_s[VEC ? Grp::PER_BLOCK : 1][N];
  const bool sinkhorn = threadIdx.x < SINKHORN_THREADS;  // else a dot warp
  const Grp grp(a.M);  // for the Sinkhorn threads
  const int tok = threadIdx.x / Grp::G;  // the token's slot in the block
  const float* hm = a.h + (int64_t)(grp.active ? grp.m : 0) * K;
  const float* alpha = a.alpha, *bias = a.bias;
  float g[N];
  if (sinkhorn) {
    const SinkhornLse lse = sinkhorn_lse(grp, sinkhorn_lse_smem(N, a.iters) ? lse_smem : nullptr, a.ws, a.M);
    float u[N];
    hc_res_logits<N>(grp, hm, alpha, bias, u);
    sinkhorn_iterate<N>(grp, u, a.iters, lse);
    __syncwarp();  // the lse each lane stored are read back by its group's other lanes
    sinkhorn_load_row<N>(grp, a.dres, g);
    sinkhorn_reverse<N>(grp, u, g, lse, a.iters);  // g: dL/du of row r of res
  } else if constexpr (VEC > 0) {
    hc_merge_dpre<N, VEC>(a, threadIdx.x / 32 - SINKHORN_THREADS / 32, dpre_s);
  }
  if constexpr (VEC > 0) __syncthreads();  // dpre_s written
  if (sinkhorn && grp.r < N) {  // the token's terms, zero for a slot past M
    const int r = grp.r, base = 2 * N + r * N;
    const int64_t row = (int64_t)(grp.active ? grp.m : 0) * N + r;
    float du_pre = 0.f, du_post = 0.f;
    if (grp.active) {
      const float sp = sigmoidf(alpha[0] * hm[r] + bias[r]), sq = sigmoidf(alpha[1] * hm[N + r] + bias[N + r]);
      du_pre = (VEC ? dpre_s[tok][r] : a.dpre[row]) * sp * (1.f - sp);
      du_post = a.dpost[row] * 2.f * sq * (1.f - sq);
      float* dhm = a.dh + (int64_t)grp.m * K;
      dhm[r] = alpha[0] * du_pre;
      dhm[N + r] = alpha[1] * du_post;
#pragma unroll
      for (int j = 0; j < N; ++j) dhm[base + j] = alpha[2] * g[j];
    }
    du_s[tok][r] = du_pre;
    du_s[tok][N + r] = du_post;
    duh_s[tok][r] = grp.active ? du_pre * hm[r] : 0.f;
    duh_s[tok][N + r] = grp.active ? du_post * hm[N + r] : 0.f;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      du_s[tok][base + j] = grp.active ? g[j] : 0.f;
      duh_s[tok][base + j] = grp.active ? g[j] * hm[base + j] : 0.f;
    }
  }
  __syncthreads();
  for (int t = threadIdx.x; t < 2 * K; t += blockDim.x) {
    const float (*src)[K] = t < K ? du_s : duh_s;
    const int c = t < K ? t : t - K;
    float sum = 0.f;
    for (int i = 0; i < Grp::PER_BLOCK; ++i) sum += src[i][c];
    a.part[(int64_t)blockIdx.x * 2 * K + t] = sum;
  }
}

// The blocks' partials summed: dbias[c] over all rows, dalpha[g] over its group's c too. A warp takes a column,
// its lanes strided over the blocks, then a shuffle tree: a fixed order, so the same bits every run.
__global__ void hc_coeffs_finish_kernel(const float* part, int blocks, int n, float* dalpha, float* dbias) {
  __shared__ float duh[hc_coeff_count(limits::max_streams)];
  const int K = hc_coeff_count(n), lane = threadIdx.x % 32;
  for (int t = threadIdx.x / 32; t < 2 * K; t += blockDim.x / 32) {
    float sum = 0.f;
#pragma unroll 4
    for (int b = lane; b < blocks; b += 32) sum += part[(int64_t)b * 2 * K + t];
    sum = warp_sum(sum);
    if (lane == 0) {
      if (t < K) dbias[t] = sum;
      else duh[t - K] = sum;
    }
  }
  __syncthreads();
  if (threadIdx.x < 3) {
    const int lo = threadIdx.x == 0 ? 0 : threadIdx.x == 1 ? n : 2 * n, hi = threadIdx.x == 2 ? K : lo + n;
    float sum = 0.f;
    for (int c = lo; c < hi; ++c) sum += duh[c];
    dalpha[threadIdx.x] = sum;
  }
}

static int hc_coeffs_blocks(int M, int n) { return ceil_div(M, SINKHORN_THREADS / sinkhorn_lanes(n)); }

// Floats of workspace hc_coeffs_bwd needs: Sinkhorn's lse, then the blocks' partial sums.
int64_t launch::hc_coeffs_workspace_floats(int M, int n, int iters) {
  return sinkhorn_workspace_floats(M, n, iters) + (int64_t)hc_coeffs_blocks(M, n) * 2 * hc_coeff_count(n);
}

// hc_coeffs_fwd and hc_pre_coeffs_fwd: the kernel, with the merge where a.x is given.
static void hc_coeffs_fwd_launch(const HcCoeffsFwdArgs& a, int n, cudaStream_t s) {
  const int M = a.M, iters = a.iters;
  if (M == 0) return;
  if (!a.x) {
    SINKHORN_DISPATCH(hc_coeffs_fwd_kernel, n, false, M, s, a);
    return;
  }
  stream_dispatch(n, stream_vec4(a.C, a.x, a.merged), [&](auto N, auto V) {
    constexpr int n_ = decltype(N)::value, vec = decltype(V)::value;
    hc_coeffs_fwd_kernel<n_, vec><<<ceil_div(M, SinkhornGroup<n_>::PER_BLOCK), hc_coeffs_threads(vec), 0, s>>>(a);
  });
}

// h (M, K) contiguous, K = 2n + n^2; pre, post (M, n); res (M, n, n).
void launch::hc_coeffs_fwd(const float* h, const float* alpha, const float* bias, float* pre, float* post, float* res, int M,
                           int n, int iters, cudaStream_t s) {
  sinkhorn_check_args("hc_coeffs_fwd", n, iters);
  HcCoeffsFwdArgs a{};
  a.h = h; a.alpha = alpha; a.bias = bias; a.pre = pre; a.post = post; a.res = res; a.M = M; a.iters = iters;
  hc_coeffs_fwd_launch(a, n, s);
  check_launch("hc_coeffs_fwd");
}

// hc_pre's: hc_coeffs_fwd and the merge merged = stream_merge(x, pre) (M, C) of the streams x (M, n, C), in one
// launch; all contiguous.
void launch::hc_pre_coeffs_fwd(const float* x, int C, const float* h, const float* alpha, const float* bias, float* pre,
                               float* post, float* res, float* merged, int M, int n, int iters, cudaStream_t s) {
  sinkhorn_check_args("hc_pre_coeffs_fwd", n, iters);
  HcCoeffsFwdArgs a{};
  a.h = h; a.alpha = alpha; a.bias = bias; a.pre = pre; a.post = post; a.res = res; a.x = x; a.merged = merged;
  a.M = M; a.C = C; a.iters = iters;
  hc_coeffs_fwd_launch(a, n, s);
  check_launch("hc_pre_coeffs_fwd");
}

// hc_coeffs_bwd and hc_pre_coeffs_bwd: the kernel (its dpre from a.dpre, or from a.x and a.dmerged), then the sums
// of the blocks' partials.
static void hc_coeffs_bwd_launch(HcCoeffsBwdArgs a, float* dalpha, float* dbias, int n, cudaStream_t s) {
  const int M = a.M, iters = a.iters, blocks = M == 0 ? 0 : hc_coeffs_blocks(M, n);
  a.part = a.ws + launch::sinkhorn_workspace_floats(M, n, iters);
  if (M > 0 && !a.x) {
    SINKHORN_DISPATCH(hc_coeffs_bwd_kernel, n, true, M, s, a);
  } else if (M > 0) {
    stream_dispatch(n, stream_vec4(a.C, a.x, a.dmerged), [&](auto N, auto V) {
      constexpr int n_ = decltype(N)::value;
      constexpr int vec = decltype(V)::value;
      hc_coeffs_bwd_kernel<n_, vec><<<blocks, hc_coeffs_threads(vec), sinkhorn_lse_smem(n_, iters), s>>>(a);
    });
  }
  hc_coeffs_finish_kernel<<<1, 1024, 0, s>>>(a.part, blocks, n, dalpha, dbias);
}

// dpre, dpost (M, n), dres (M, n, n) -> dh (M, K), dalpha (3), dbias (K); ws: hc_coeffs_workspace_floats.
// With M = 0, dalpha and dbias are zeros.
void launch::hc_coeffs_bwd(const float* h, const float* alpha, const float* bias, const float* dpre, const float* dpost,
                           const float* dres, float* dh, float* dalpha, float* dbias, float* ws, int M, int n, int iters,
                           cudaStream_t s) {
  sinkhorn_check_args("hc_coeffs_bwd", n, iters);
  HcCoeffsBwdArgs a{};
  a.h = h; a.alpha = alpha; a.bias = bias; a.dpre = dpre; a.dpost = dpost; a.dres = dres;
  a.dh = dh; a.ws = ws; a.M = M; a.iters = iters;
  hc_coeffs_bwd_launch(a, dalpha, dbias, n, s);
  check_launch("hc_coeffs_bwd");
}

// hc_pre's: hc_coeffs_bwd with dpre the gradient of the merge stream_merge(x, pre), from the streams x (M, n, C)
// and the merge's output gradient dmerged (M, C), both contiguous.
void launch::hc_pre_coeffs_bwd(const float* x, const float* dmerged, int C, const float* h, const float* alpha,
                               const float* bias, const float* dpost, const float* dres, float* dh, float* dalpha,
                               float* dbias, float* ws, int M, int n, int iters, cudaStream_t s) {
  sinkhorn_check_args("hc_pre_coeffs_bwd", n, iters);
  HcCoeffsBwdArgs a{};
  a.h = h; a.alpha = alpha; a.bias = bias; a.dpost = dpost; a.dres = dres; a.x = x; a.dmerged = dmerged;
  a.dh = dh; a.ws = ws; a.M = M; a.C = C; a.iters = iters;
  hc_coeffs_bwd_launch(a, dalpha, dbias, n, s);
  check_launch("hc_pre_coeffs_bwd");
}

// ------------------------------------------------------------------------------------------------
// 8.4 mhc-dynamic's projection
// Mhc-dynamic's projection of the streams, RMSNorm and the narrow matmul in one pass each way (the
// twin is mhc.hc_project_torch): x (M, D) holds a token's n streams flattened (D = nC), w (D) the norm's
// weight, phi (K, D) the projection, K = 2n + n^2 outputs (3 to 80). RMSNorm only scales a row, so
//   h[m, k] = rstd[m] sum_d x[m, d] (w[d] phi[k, d]),   rstd[m] = 1 / sqrt(mean_d x[m, d]^2 + eps),
// and one read of x gives the K dot products and the sum of squares together, where the unfused path
// reads x, writes the normalized copy and reads it again (three kernels forward, four backward).
//
// Forward: x times w * phi on the tensor cores (below, at hc_project_fwd_kernel); rstd is kept for the
// backward; hc_mix_pre's forward is the same kernel with the previous sublayer's stream mix in front. The
// backward's sums (over k for s, over tokens for dphi) would fit tensor-core tiles too (K padded to 8), but a
// tensor-core version ran no faster: taking the FMAs away leaves the wait on the loads of x and the per-element
// work, which are what limit it. So the backward runs fp32 FMAs on the CUDA cores.
// Backward, with g = dh[m] (K values) and c[m] = sum_k g_k h[m, k]:
//   dx[m, d] = rstd w[d] s[m, d] - x[m, d] rstd^2 c / D,   s[m, d] = sum_k g_k phi[k, d]
//   dphi[k, d] = w[d] sum_m rstd g_k x[m, d],   dw[d] = sum_m rstd x[m, d] s[m, d]
// A block owns a run of HPB_TOKENS tokens and HPB_COLS threads of a column each (its K values of phi in
// registers), the run's g staged in shared memory. It writes dx and its run's partial sums of dphi
// (before the w) and dw, K + 1 rows; a second kernel adds the runs in order (deterministic).
//
// Twin: mhc.hc_project_torch, hc_mix_pre_torch. Uses: 1.2; 1.6 Frag, mma.

constexpr int HP_TOKENS = 32, HP_SPLIT = 4;  // forward: a block's tokens (16 a warp); warps sharing a token's columns
constexpr int HP_THREADS = HP_TOKENS / 16 * HP_SPLIT * 32;
constexpr int HP_STAGE_FLOATS = 25000;       // forward: floats of w * phi a block stages at most (~98 KB)
constexpr int HP_LOADS = 20;                 // forward: loads a lane has in flight, about (whole steps of them)
constexpr int HPB_COLS = 128, HPB_TOKENS = 64;  // backward: a block's threads (a column each) and tokens
constexpr int HPB_UNROLL = 8;                    // backward: tokens whose loads are issued together

// On the tensor cores: a block takes HP_TOKENS tokens and a range of columns, whose w * phi it stages in shared
// memory once (K rows padded to 8: the n-tiles of mma m16n8k8, 3xTF32 as the fp32 matmul), then streams x with
// no further barrier. The block sees a token's row as S streams of C columns: S = 1 and C = D for hc_project;
// for hc_mix_pre (MIX) S = n, and the row it projects is the mix s = stream_mix(x, h_res, h_post, y), computed
// from x and y in registers and written out on the way, so the mixed streams are written once and not read back.
// A range is columns [c0, c0 + CR) of every stream. A warp owns 16 tokens and every HP_SPLIT-th step of 16
// columns of the range; lane (g, t) takes 4 adjacent columns of rows g and g + 8, in each stream, and its two
// products take them as the k indices (t, t + 4) of one step and of the next, phi's columns read in the same
// order (the sum over k does not care which columns go together). Where C needs more than one range (wide
// models, large n), each range's sums and sums of squares go to a workspace and hc_project_fwd_finish_kernel
// adds them up.
__host__ __device__ constexpr int hp_padded_rows(int n) { return (hc_coeff_count(n) + 7) / 8 * 8; }  // n-tiles of 8

__host__ __device__ constexpr int hp_range_cols(int S, int KP, int C) {  // columns of each stream a block takes
  const int most = (HP_STAGE_FLOATS / KP - 16) / S / 32 * 32, need = (C + 31) / 32 * 32;
  return most < need ? most : need;
}

// Shared memory: the staged rows (stride 16 mod 32: conflict-free fragment reads), later the warps' sums; then
// the tokens' mix coefficients (coefs floats).
__host__ __device__ constexpr int hp_smem_bytes(int S, int KP, int C, int coefs) {
  const int staged = KP * (S * hp_range_cols(S, KP, C) + 16), sums = HP_TOKENS * HP_SPLIT * (KP + 1);
  return 4 * ((staged > sums ? staged : sums) + coefs);
}

template <int N, bool MIX>
struct HpFwd {
  static constexpr int K = hc_coeff_count(N), KP = hp_padded_rows(N), NT = KP / 8;  // padded rows, n-tiles
  static constexpr int S = MIX ? N : 1;                    // streams in the block's view of a row
  static constexpr int R = MIX ? N * N + N : 0;            // a token's mix coefficients: h_res, then h_post
  static constexpr int STEP_LOADS = 2 * (S + (MIX ? 1 : 0));  // a lane's loads a step: x's streams and y, 2 rows
  static constexpr int U = HP_LOADS / STEP_LOADS < 1 ? 1 : HP_LOADS / STEP_LOADS > 8 ? 8 : HP_LOADS / STEP_LOADS;
  static constexpr int SMEM = hp_smem_bytes(S, KP, 1 << 30, HP_TOKENS * R);  // bytes at most
};

template <class TY>
struct HpFwdArgs {
  const float* x;                // (M, S, C)
  const float* w, *phi;          // (S C), (K, S C)
  const float* h_res, *h_post;   // MIX: token m's (n, n) at m * res_stride, (n) at m * post_stride (0: shared)
  const TY* y;                   // MIX: (M, C)
  float* s;                      // MIX: the mixed streams (M, n, C)
  float* h, *rstd;               // (M, K), (M) when one range takes all of C
  float* part;                   // else (ranges, M, K + 1): the ranges' sums and sums of squares
  int64_t res_stride, post_stride;
  int M, C;
  float eps;
};

// w * phi of the block's range, zeros past K and past the stream's end: row k at smem[k * stride + i * CR + c].
template <int N, bool MIX, bool VEC, class TY>
__device__ __forceinline__ void hp_stage(const HpFwdArgs<TY>& a, float* smem, int CR, int c0, int cols) {
  using P = HpFwd<N, MIX>;
  const int stride = P::S * CR + 16;
  const int64_t D = (int64_t)P::S * a.C;
  if (VEC) {  // a thread's quads of columns, every row; C % 4 == 0: a quad is all in or all out
    for (int q = 4 * threadIdx.x; q < P::S * CR; q += 4 * HP_THREADS) {
      const int c = q % CR;
      const bool in = c < cols;
      const int64_t col = (int64_t)(q / CR) * a.C + c0 + c;
      const float4 wq = in ? __ldg(reinterpret_cast<const float4*>(a.w + col)) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
      for (int kk = 0; kk < P::KP; ++kk) {
        float4 p = make_float4(0.f, 0.f, 0.f, 0.f);
        if (in && kk < P::K) p = __ldg(reinterpret_cast<const float4*>(a.phi + kk * D + col));
        *reinterpret_cast<float4*>(smem + kk * stride + q) =
            make_float4(wq.x * p.x, wq.y * p.y, wq.z * p.z, wq.w * p.w);
      }
    }
  } else {
    for (int e = threadIdx.x; e < P::KP * P::S * CR; e += HP_THREADS) {
      const int kk = e / (P::S * CR), q = e % (P::S * CR), c = q % CR;
      const int64_t col = (int64_t)(q / CR) * a.C + c0 + c;
      smem[kk * stride + q] = kk < P::K && c < cols ? __ldg(a.w + col) * __ldg(a.phi + kk * D + col) : 0.f;
    }
  }
}

// Stream i of the mix for 4 columns, out = h_post[i] y + sum_j h_res[i, j] x[j], in stream_mixed's order (keep
// the two in step); cf: the token's coefficients in shared memory, h_res row-major then h_post.
template <int N>
__device__ __forceinline__ void hp_mixed(const float* cf, int i, const float (&x)[N][4], const float (&y)[4],
                                         float (&out)[4]) {
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    out[e] = cf[N * N + i] * y[e];
#pragma unroll
    for (int j = 0; j < N; ++j) out[e] = fmaf(cf[i * N + j], x[j][e], out[e]);
  }
}

// Columns c..c+3 of a range of one row (fp32 or bf16), zeros past its end or for a token past M.
template <bool VEC, class T>
__device__ __forceinline__ void hp_load(const T* row, bool live, int c, int cols, float (&v)[4]) {
  if (VEC && live && c < cols) {
    if constexpr (std::is_same_v<T, float>) unpack16(__ldg(reinterpret_cast<const float4*>(row + c)), v);
    else load4(row + c, v);
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] = live && c + e < cols ? to_float(row[c + e]) : 0.f;
  }
}

template <bool VEC>
__device__ __forceinline__ void hp_store(float* row, bool live, int c, int cols, const float (&v)[4]) {
  if (VEC && live && c < cols) {
    store4(row + c, v);
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (live && c + e < cols) row[c + e] = v[e];
  }
}

// out: h (M, K) and rstd (M) when the block's range is all of C, else its partial sums (ranges, M, K + 1).
template <int N, bool MIX, bool VEC, class TY>
__global__ void __launch_bounds__(HP_THREADS) hc_project_fwd_kernel(HpFwdArgs<TY> a) {
  using P = HpFwd<N, MIX>;
  constexpr int K = P::K, KP = P::KP, NT = P::NT, S = P::S, R = P::R, U = P::U;
  extern __shared__ __align__(16) float hp_smem[];
  const int CR = hp_range_cols(S, KP, a.C), stride = S * CR + 16;
  const int c0 = blockIdx.y * CR, cols = min(CR, a.C - c0);
  const int64_t D = (int64_t)S * a.C, mb = (int64_t)blockIdx.x * HP_TOKENS;
  hp_stage<N, MIX, VEC>(a, hp_smem, CR, c0, cols);
  float* coef = hp_smem + max(KP * stride, HP_TOKENS * HP_SPLIT * (KP + 1));  // past the staged rows and the sums
  if constexpr (MIX)
    for (int e = threadIdx.x; e < HP_TOKENS * R; e += HP_THREADS) {
      const int k = e % R;
      const int64_t m = mb + e / R;
      coef[e] = m >= a.M ? 0.f : k < N * N ? __ldg(a.h_res + m * a.res_stride + k)
                                           : __ldg(a.h_post + m * a.post_stride + k - N * N);
    }
  __syncthreads();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int group = warp / HP_SPLIT, split = warp % HP_SPLIT;
  const int64_t m0 = mb + group * 16;
  const bool live_a = m0 + g < a.M, live_b = m0 + g + 8 < a.M;
  const int64_t ra = live_a ? m0 + g : 0, rb = live_b ? m0 + g + 8 : 0;
  const float* xa = a.x + ra * D + c0;  // stream i at + i * C
  const float* xb = a.x + rb * D + c0;
  const float* cfa = coef + (group * 16 + g) * R;
  const float* cfb = cfa + 8 * R;
  float acc[NT][4] = {}, ss_a = 0.f, ss_b = 0.f;
  const int steps = (cols + 15) / 16;
  for (int s0 = split; s0 < steps; s0 += U * HP_SPLIT) {
    float va[U][S][4], vb[U][S][4], ya[U][4], yb[U][4];  // U steps' loads in flight before any math
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = (s0 + u * HP_SPLIT) * 16 + 4 * t;
#pragma unroll
      for (int i = 0; i < S; ++i) {
        hp_load<VEC>(xa + (int64_t)i * a.C, live_a, c, cols, va[u][i]);
        hp_load<VEC>(xb + (int64_t)i * a.C, live_b, c, cols, vb[u][i]);
      }
      if constexpr (MIX) {
        hp_load<VEC>(a.y + ra * a.C + c0, live_a, c, cols, ya[u]);
        hp_load<VEC>(a.y + rb * a.C + c0, live_b, c, cols, yb[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (s0 + u * HP_SPLIT >= steps) break;
      const int c = (s0 + u * HP_SPLIT) * 16 + 4 * t;
#pragma unroll
      for (int i = 0; i < S; ++i) {
        float sa[4], sb[4];  // the row's values: x itself, or the mix, which is also written out
        if constexpr (MIX) {
          hp_mixed<N>(cfa, i, va[u], ya[u], sa);
          hp_mixed<N>(cfb, i, vb[u], yb[u], sb);
          hp_store<VEC>(a.s + ra * D + (int64_t)i * a.C + c0, live_a, c, cols, sa);
          hp_store<VEC>(a.s + rb * D + (int64_t)i * a.C + c0, live_b, c, cols, sb);
        } else {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            sa[e] = va[u][i][e];
            sb[e] = vb[u][i][e];
          }
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          ss_a = fmaf(sa[e], sa[e], ss_a);
          ss_b = fmaf(sb[e], sb[e], ss_b);
        }
        Frag<4, true> fa[2];  // columns 4t + 2 half and 4t + 2 half + 1 as k = t and t + 4 of product `half`
#pragma unroll
        for (int half = 0; half < 2; ++half)
          fa[half].set({sa[2 * half], sb[2 * half], sa[2 * half + 1], sb[2 * half + 1]});
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const float4 p = *reinterpret_cast<const float4*>(hp_smem + (j * 8 + g) * stride + i * CR + c);
          Frag<2, true> b0, b1;
          b0.set({p.x, p.y});
          b1.set({p.z, p.w});
          mma<true>(acc[j], fa[0], b0);
          mma<true>(acc[j], fa[1], b1);
        }
      }
    }
  }
  // the HP_SPLIT warps of a group meet in shared memory (over the staged phi, which nobody reads any more)
  __syncthreads();
  float* red = hp_smem + (group * HP_SPLIT + split) * 16 * (KP + 1);  // [16 rows][KP sums, sum of squares]
  ss_a += __shfl_xor_sync(0xffffffffu, ss_a, 1);
  ss_a += __shfl_xor_sync(0xffffffffu, ss_a, 2);
  ss_b += __shfl_xor_sync(0xffffffffu, ss_b, 1);
  ss_b += __shfl_xor_sync(0xffffffffu, ss_b, 2);
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    red[g * (KP + 1) + j * 8 + 2 * t] = acc[j][0];
    red[g * (KP + 1) + j * 8 + 2 * t + 1] = acc[j][1];
    red[(g + 8) * (KP + 1) + j * 8 + 2 * t] = acc[j][2];
    red[(g + 8) * (KP + 1) + j * 8 + 2 * t + 1] = acc[j][3];
  }
  if (t == 0) {
    red[g * (KP + 1) + KP] = ss_a;
    red[(g + 8) * (KP + 1) + KP] = ss_b;
  }
  __syncthreads();
  if (split != 0) return;
  const float* mine = hp_smem + group * HP_SPLIT * 16 * (KP + 1);
  for (int i = lane; i < 16 * (K + 1); i += 32) {  // (row, k), k = K: the sum of squares
    const int row = i / (K + 1), kk = i % (K + 1);
    const int64_t m = m0 + row;
    if (m >= a.M) continue;
    float sum = 0.f, ss = 0.f;  // the splits in order
#pragma unroll
    for (int sp = 0; sp < HP_SPLIT; ++sp) {
      sum += mine[(sp * 16 + row) * (KP + 1) + (kk < K ? kk : KP)];
      ss += mine[(sp * 16 + row) * (KP + 1) + KP];
    }
    if (gridDim.y > 1) {
      a.part[((int64_t)blockIdx.y * a.M + m) * (K + 1) + kk] = sum;
    } else {
      const float r = rsqrtf(ss / D + a.eps);
      if (kk < K) a.h[m * K + kk] = sum * r;
      else a.rstd[m] = r;
    }
  }
}

// The ranges' partial sums added in range order: h = sum * rstd, rstd from the sum of squares. A thread per entry
// (m, k) of a range's (M, K + 1) rows, so a warp's loads are consecutive floats.
__global__ void hc_project_fwd_finish_kernel(const float* part, int ranges, int M, int K, int64_t D, float eps,
                                             float* h, float* rstd) {
  const int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, stride = (int64_t)M * (K + 1);
  if (e >= stride) return;
  const int64_t m = e / (K + 1);
  const int kk = (int)(e % (K + 1));
  float sum = 0.f, ss = 0.f;
  for (int r = 0; r < ranges; ++r) {
    sum += part[r * stride + e];
    ss += part[r * stride + m * (K + 1) + K];
  }
  const float rs = rsqrtf(ss / D + eps);
  if (kk == K) rstd[m] = rs;
  else h[m * K + kk] = sum * rs;
}

// part: (runs, K + 1, D), the run's sums of rstd g_k x (rows k < K) and of rstd x s (row K). A thread takes one
// column (two a thread, with twice the K sums in registers, leaves fewer warps to hide latency).
// Given pre (M, n) and dmerged (M, C), C = D / n: dx also gets the merge's pre[m, i] dmerged[m, c] (d = iC + c);
// given dadd (M, D), a gradient of x from elsewhere, dx gets that too.
template <int N>
__global__ void __launch_bounds__(HPB_COLS) hc_project_bwd_kernel(const float* x, const float* w, const float* phi,
    const float* h, const float* rstd, const float* dh, const float* pre, const float* dmerged, const float* dadd,
    float* dx, float* part, int M, int D) {
  constexpr int K = hc_coeff_count(N), K4 = (K + 3) / 4 * 4;  // g's rows padded for 16-byte loads
  __shared__ __align__(16) float g_s[HPB_TOKENS][K4];
  __shared__ float r_s[HPB_TOKENS], q_s[HPB_TOKENS];  // rstd and rstd^2 c / D
  __shared__ float pre_s[HPB_TOKENS][N];
  const int d = blockIdx.y * HPB_COLS + threadIdx.x, m0 = blockIdx.x * HPB_TOKENS;  // runs on x: up to 2^31 - 1
  const int count = min(HPB_TOKENS, M - m0), C = pre ? D / N : 1;  // C: the merge's stream width
  if (pre)
    for (int i = threadIdx.x; i < count * N; i += HPB_COLS) pre_s[i / N][i % N] = pre[(int64_t)m0 * N + i];
  for (int i = threadIdx.x; i < HPB_TOKENS * K4; i += HPB_COLS) {
    const int t = i / K4, k = i % K4;
    g_s[t][k] = t < count && k < K ? dh[(int64_t)(m0 + t) * K + k] : 0.f;
  }
  for (int t = threadIdx.x; t < count; t += HPB_COLS) {
    const float* hm = h + (int64_t)(m0 + t) * K;
    const float* gm = dh + (int64_t)(m0 + t) * K;
    float c = 0.f;
    for (int k = 0; k < K; ++k) c = fmaf(gm[k], hm[k], c);
    const float r = rstd[m0 + t];
    r_s[t] = r;
    q_s[t] = r * r * c / D;
  }
  __syncthreads();
  if (d >= D) return;
  float p[K], e[K] = {}, ew = 0.f;
  const float wd = __ldg(w + d);
#pragma unroll
  for (int k = 0; k < K; ++k) p[k] = __ldg(phi + (int64_t)k * D + d);
  const int stream = d / C, col = d % C;  // the merge's (i, c) of the column
  for (int t0 = 0; t0 < count; t0 += HPB_UNROLL) {
    float xv[HPB_UNROLL], mv[HPB_UNROLL] = {}, av[HPB_UNROLL] = {};  // HPB_UNROLL tokens' loads in flight
#pragma unroll
    for (int i = 0; i < HPB_UNROLL; ++i)
      if (t0 + i < count) {
        const int64_t m = m0 + t0 + i;
        xv[i] = __ldg(x + m * D + d);
        if (dadd) av[i] = __ldg(dadd + m * D + d);
        if (pre) mv[i] = __ldg(dmerged + m * C + col);
      }
#pragma unroll
    for (int i = 0; i < HPB_UNROLL; ++i) {
      const int t = t0 + i;
      if (t >= count) break;
      const float r = r_s[t], xr = xv[i] * r;
      float s4[4] = {};  // s in four partial sums: chains of K / 4 dependent FMAs, not K
#pragma unroll
      for (int k4 = 0; k4 < K4; k4 += 4) {
        const float4 g4 = *reinterpret_cast<const float4*>(&g_s[t][k4]);
        const float g[4] = {g4.x, g4.y, g4.z, g4.w};
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if (k4 + j < K) {
            s4[j] = fmaf(g[j], p[k4 + j], s4[j]);
            e[k4 + j] = fmaf(g[j], xr, e[k4 + j]);
          }
      }
      const float s = (s4[0] + s4[1]) + (s4[2] + s4[3]);
      float out = r * wd * s - xv[i] * q_s[t];
      if (pre) out = fmaf(pre_s[t][stream], mv[i], out);
      if (dadd) out += av[i];
      ew = fmaf(xr, s, ew);
      dx[(int64_t)(m0 + t) * D + d] = out;
    }
  }
  float* out = part + (int64_t)blockIdx.x * (K + 1) * D + d;
#pragma unroll
  for (int k = 0; k < K; ++k) out[(int64_t)k * D] = e[k];
  out[(int64_t)K * D] = ew;
}

// The runs' partials summed in run order: row k < K of blockIdx.y gives dphi[k] (times w), row K dw.
__global__ void __launch_bounds__(HPB_COLS) hc_project_finish_kernel(const float* part, const float* w, int runs, int K,
                                                                     int D, float* dphi, float* dw) {
  const int d = blockIdx.x * HPB_COLS + threadIdx.x, k = blockIdx.y;
  if (d >= D) return;
  float sum = 0.f;
#pragma unroll 8
  for (int run = 0; run < runs; ++run) sum += part[((int64_t)run * (K + 1) + k) * D + d];
  if (k < K) dphi[(int64_t)k * D + d] = w[d] * sum;
  else dw[d] = sum;
}

static int hc_project_runs(int M) { return ceil_div(M, HPB_TOKENS); }

// Floats of workspace hc_project_bwd needs: the runs' partial sums.
int64_t launch::hc_project_bwd_workspace_floats(int M, int n, int D) {
  return (int64_t)hc_project_runs(M) * (hc_coeff_count(n) + 1) * D;
}

#define HP_BWD_LAUNCH(N)                                                                                       \
  hc_project_bwd_kernel<N><<<dim3(runs, ceil_div(D, HPB_COLS)), HPB_COLS, 0, s>>>(x, w, phi, h, rstd, dh, pre, \
                                                                                 dmerged, dadd, dx, ws, M, D);
#define HP_DISPATCH(LAUNCH)  \
  switch (n) {               \
    case 1: LAUNCH(1) break; \
    case 2: LAUNCH(2) break; \
    case 3: LAUNCH(3) break; \
    case 4: LAUNCH(4) break; \
    case 5: LAUNCH(5) break; \
    case 6: LAUNCH(6) break; \
    case 7: LAUNCH(7) break; \
    default: LAUNCH(8)       \
  }

template <int N, bool MIX, class TY>
static void hp_fwd_launch(HpFwdArgs<TY> a, float* ws, bool vec4, cudaStream_t s) {
  using P = HpFwd<N, MIX>;
  const dim3 grid(ceil_div(a.M, HP_TOKENS), ceil_div(a.C, hp_range_cols(P::S, P::KP, a.C)));
  const int smem = hp_smem_bytes(P::S, P::KP, a.C, HP_TOKENS * P::R);
  if (grid.y > 65535) throw std::runtime_error("hc_project_fwd: more than 65535 column ranges");
  a.part = grid.y > 1 ? ws : nullptr;
  if (vec4) {
    raise_smem_limit<hc_project_fwd_kernel<N, MIX, true, TY>>(P::SMEM);
    hc_project_fwd_kernel<N, MIX, true, TY><<<grid, HP_THREADS, smem, s>>>(a);
  } else {
    raise_smem_limit<hc_project_fwd_kernel<N, MIX, false, TY>>(P::SMEM);
    hc_project_fwd_kernel<N, MIX, false, TY><<<grid, HP_THREADS, smem, s>>>(a);
  }
  if (grid.y > 1)
    hc_project_fwd_finish_kernel<<<ceil_div((int64_t)a.M * (P::K + 1), 256), 256, 0, s>>>(
        ws, (int)grid.y, a.M, P::K, (int64_t)P::S * a.C, a.eps, a.h, a.rstd);
}

#define HP_FWD_LAUNCH(N) hp_fwd_launch<N, MIX>(a, ws, vec4, s);
template <bool MIX, class TY>
static void hp_fwd(const HpFwdArgs<TY>& a, int n, float* ws, bool vec4, cudaStream_t s) {
  HP_DISPATCH(HP_FWD_LAUNCH)
}

// Floats of workspace the forward needs: the column ranges' partial sums, where a stream takes more than one.
static int64_t hp_fwd_workspace_floats(int M, int n, int S, int C) {
  const int ranges = ceil_div(C, hp_range_cols(S, hp_padded_rows(n), C));
  return ranges > 1 ? (int64_t)ranges * M * (hc_coeff_count(n) + 1) : 0;
}
int64_t launch::hc_project_fwd_workspace_floats(int M, int n, int D) { return hp_fwd_workspace_floats(M, n, 1, D); }
int64_t launch::hc_mix_project_fwd_workspace_floats(int M, int n, int C) { return hp_fwd_workspace_floats(M, n, n, C); }

// x (M, D), w (D), phi (K, D) with K = 2n + n^2 -> h (M, K), rstd (M); all contiguous; ws:
// hc_project_fwd_workspace_floats.
void launch::hc_project_fwd(const float* x, const float* w, const float* phi, float* h, float* rstd, float* ws, int M, int n,
                            int D, float eps, cudaStream_t s) {
  sinkhorn_check_args("hc_project_fwd", n, 1);
  require_tensor_cores("hc_project_fwd");
  if (M == 0) return;
  HpFwdArgs<float> a{};
  a.x = x; a.w = w; a.phi = phi; a.h = h; a.rstd = rstd; a.M = M; a.C = D; a.eps = eps;
  hp_fwd<false>(a, n, ws, D % 4 == 0 && aligned16(x) && aligned16(w) && aligned16(phi), s);
  check_launch("hc_project_fwd");
}

// hc_mix_pre's forward: the mix out = stream_mix(x, h_res, h_post, y) (M, n, C), written out, and its
// projection h (M, K) and rstd (M) as hc_project_fwd gives them for out flattened, in one pass. h_res (n, n) and
// h_post (n) per token (per_token) or for all. All contiguous; ws: hc_mix_project_fwd_workspace_floats.
template <class TY>
void launch::hc_mix_project_fwd(const float* x, const float* h_res, const float* h_post, const TY* y, float* out,
                                const float* w, const float* phi, float* h, float* rstd, float* ws, int M, int n, int C,
                                bool per_token, float eps, cudaStream_t s) {
  sinkhorn_check_args("hc_mix_project_fwd", n, 1);
  require_tensor_cores("hc_mix_project_fwd");
  if (M == 0 || C == 0) return;
  HpFwdArgs<TY> a{};
  a.x = x; a.h_res = h_res; a.h_post = h_post; a.y = y; a.s = out; a.w = w; a.phi = phi; a.h = h; a.rstd = rstd;
  a.res_stride = per_token ? n * n : 0; a.post_stride = per_token ? n : 0;
  a.M = M; a.C = C; a.eps = eps;
  const bool vec4 = C % 4 == 0 && aligned16(x) && aligned16(out) && aligned16(w) && aligned16(phi) &&
                    reinterpret_cast<uintptr_t>(y) % (4 * sizeof(TY)) == 0;
  hp_fwd<true>(a, n, ws, vec4, s);
  check_launch("hc_mix_project_fwd");
}
template void launch::hc_mix_project_fwd<float>(const float*, const float*, const float*, const float*, float*, const float*,
                                                const float*, float*, float*, float*, int, int, int, bool, float, cudaStream_t);
ONE_TEMPLATE(hc_mix_project_fwd<float>);
template void launch::hc_mix_project_fwd<__nv_bfloat16>(const float*, const float*, const float*, const __nv_bfloat16*,
                                                        float*, const float*, const float*, float*, float*, float*, int, int,
                                                        int, bool, float, cudaStream_t);
ONE_TEMPLATE(hc_mix_project_fwd<__nv_bfloat16>);

// dh (M, K) -> dx (M, D), dw (D), dphi (K, D), from the forward's h and rstd; ws:
// hc_project_bwd_workspace_floats. With M = 0, dw and dphi are zeros. Given pre (M, n) and dmerged (M, D / n),
// dx also gets the gradient of stream_merge(x, pre) (hc_pre's backward: x read once, no add of two dx); given
// dadd (M, D), that too (hc_mix_pre's: the gradient of the streams from their next consumer).
void launch::hc_project_bwd(const float* x, const float* w, const float* phi, const float* h, const float* rstd,
                            const float* dh, const float* pre, const float* dmerged, const float* dadd, float* dx, float* dw,
                            float* dphi, float* ws, int M, int n, int D, cudaStream_t s) {
  sinkhorn_check_args("hc_project_bwd", n, 1);
  const int K = hc_coeff_count(n), runs = hc_project_runs(M);
  if (ceil_div(D, HPB_COLS) > 65535) throw std::runtime_error("hc_project_bwd: D > 65535 * 128");
  if (M > 0) HP_DISPATCH(HP_BWD_LAUNCH)
  hc_project_finish_kernel<<<dim3(ceil_div(D, HPB_COLS), K + 1), HPB_COLS, 0, s>>>(ws, w, runs, K, D, dphi, dw);
  check_launch("hc_project_bwd");
}
#undef HP_DISPATCH
#undef HP_BWD_LAUNCH
#undef HP_FWD_LAUNCH

// ------------------------------------------------------------------------------------------------
// 8.5 stream mixing
// Stream mixing for hyper-connections (mhc.py). x (M, n, C) holds the n residual streams of M
// tokens, n <= limits::max_streams; the PyTorch twins are mhc.stream_merge_torch and mhc.stream_mix_torch:
//   stream_merge: out[m, c]    = sum_i h[i] x[m, i, c]                               (M, C)
//   stream_mix:   out[m, i, c] = sum_j h_res[i, j] x[m, j, c] + h_post[i] y[m, c]    (M, n, C)
// and stream_mix_merge, the mix and then the merge of its out by the next sublayer's h_pre, from the
// registers that hold out. The coefficients are static (one set for all tokens) or per token; a kernel
// reads token m's at m * stride, so a stride of 0 makes them static and one kernel serves both. The
// streams are fp32; y (the sublayer's output) is fp32 or bf16 (mixed precision), widened on load.
//
// A few FMAs per byte: the floor is reading every input once and writing every output once, which
// unfused PyTorch misses by far (permute copies, tiny batched matmuls, separate elementwise kernels,
// each a pass over memory). A thread owns a "unit" of one token: VEC columns (4, as 16-byte loads of
// fp32 and 8-byte loads of bf16, when C % 4 == 0 and every pointer is so aligned, else 1) in all n
// streams, so the n x n mixing of the unit happens in registers and each element is loaded once.
// Blocks are 32 x STREAM_TOKENS, a warp per token, lanes on consecutive units (coalesced); the
// token's coefficients sit in registers, loaded once per thread from warp-uniform addresses (one L1
// broadcast each). -Xptxas -v: the n = 8 backward with the merge takes 255 registers at 128 threads,
// without spills.
//
// Forward: a token's units are also spread over grid.y, so each thread has one unit when C allows.
// Backward: dx (and dy) are per unit like the forward, but the coefficient gradients are sums over
// C (dh[i] = sum_c dout[c] x[i, c], ...), so a token stays in one warp and each lane sums its units.
// Per-token coefficients: the lanes' K sums (n for the merge, n * n + n for the mix, n * n + 2n with
// the merge) are added up by one butterfly that leaves value k's total in lane k (warp_sums: about 31
// shuffles instead of 5 per value), and lane k stores it. Static coefficients: a warp walks several
// tokens and keeps adding into the same K sums, the block adds its warps' totals into one row of
// partials, and stream_coef_finish adds the rows. Every order is fixed: no atomics, the same bits
// every run.
//
// Twin: mhc.stream_merge_torch, stream_mix_torch. Uses: 8.1.

constexpr int STREAM_TOKENS = 4;  // tokens (warps) per block

// What a stream kernel reads and writes (unused pointers stay nullptr). Strides: floats per token.
// y and dy are the sublayer output's dtype (TY: fp32, or bf16 under --dtype=bf16), the streams fp32.
struct StreamArgs {
  const float* x;       // (M, n, C)
  const float* h;       // merge: h; mix: h_res
  const float* h_post;  // mix
  const float* h_pre;   // mix_merge: the next sublayer's merge coefficients
  const void* y;        // mix: (M, C)
  const float* dout;    // backward: merge (M, C), mix (M, n, C)
  const float* dmerged; // mix_merge backward: (M, C)
  float* out;           // forward
  float* merged;        // mix_merge forward: (M, C)
  float* dx;            // backward, like x
  void* dy;             // mix backward, like y
  float* dh;            // backward: merge's dh or mix's dh_res, token m's at m * dh_stride
  float* dh_post;       // mix backward, token m's at m * dpost_stride
  float* dh_pre;        // mix_merge backward, token m's at m * dpost_stride
  float* part;          // backward with static coefficients: a row of the block's K sums per block
  int64_t h_stride, post_stride, dh_stride, dpost_stride;
  int M, C;
};

template <int K>
__device__ __forceinline__ void stream_coefs(const float* p, float (&c)[K]) {
#pragma unroll
  for (int k = 0; k < K; ++k) c[k] = __ldg(p + k);
}

// Stream i of the mix, out[i] = sum_j r[i, j] x[j] + p[i] y, for one unit.
template <int N, int VEC>
__device__ __forceinline__ void stream_mixed(int i, const float (&r)[N * N], const float (&p)[N],
                                             const float (&xv)[N][VEC], const float (&yv)[VEC], float (&o)[VEC]) {
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    o[k] = p[i] * yv[k];
#pragma unroll
    for (int j = 0; j < N; ++j) o[k] = fmaf(r[i * N + j], xv[j][k], o[k]);
  }
}

// Static coefficients: each warp's K sums (over all its tokens) added over its lanes, then the block's warps
// added in order into row blockIdx.x of part. Every thread of the block must call it.
template <int K>
__device__ __forceinline__ void stream_block_sums(const float (&acc)[K], float* part) {
  __shared__ float sums[STREAM_TOKENS][K];
  warp_sums(acc, [&](int k, float total) { sums[threadIdx.y][k] = total; });
  __syncthreads();
  for (int k = threadIdx.y * 32 + threadIdx.x; k < K; k += 32 * STREAM_TOKENS) {
    float t = sums[0][k];
#pragma unroll
    for (int w = 1; w < STREAM_TOKENS; ++w) t += sums[w][k];
    part[(int64_t)blockIdx.x * K + k] = t;
  }
}

template <int N, int VEC>
__global__ void __launch_bounds__(32 * STREAM_TOKENS) stream_merge_fwd_kernel(StreamArgs a) {
  const int m = blockIdx.x * STREAM_TOKENS + threadIdx.y;
  if (m >= a.M) return;
  const int units = a.C / VEC;
  const float* x = a.x + (int64_t)m * N * a.C;
  float* out = a.out + (int64_t)m * a.C;
  float h[N];
  stream_coefs<N>(a.h + m * a.h_stride, h);
  for (int u = blockIdx.y * 32 + threadIdx.x; u < units; u += gridDim.y * 32) {
    float xv[N][VEC], o[VEC];
#pragma unroll
    for (int i = 0; i < N; ++i) stream_load<VEC>(x + (int64_t)i * a.C, u, xv[i]);
    stream_combine<N, VEC>(h, xv, o);
    stream_store<VEC>(out, u, o);
  }
}

// The mix; with MERGE (stream_mix_merge) also the next sublayer's merged input, sum_i h_pre[i] out[i],
// from the registers that hold out: the merge's read of the streams is saved.
template <int N, int VEC, class TY, bool MERGE>
__global__ void __launch_bounds__(32 * STREAM_TOKENS) stream_mix_fwd_kernel(StreamArgs a) {
  const int m = blockIdx.x * STREAM_TOKENS + threadIdx.y;
  if (m >= a.M) return;
  const int units = a.C / VEC;
  const float* x = a.x + (int64_t)m * N * a.C;
  const TY* y = static_cast<const TY*>(a.y) + (int64_t)m * a.C;
  float* out = a.out + (int64_t)m * N * a.C;
  float r[N * N], p[N], q[N];  // h_res row-major, h_post, h_pre
  stream_coefs<N * N>(a.h + m * a.h_stride, r);
  stream_coefs<N>(a.h_post + m * a.post_stride, p);
  if constexpr (MERGE) stream_coefs<N>(a.h_pre + m * a.post_stride, q);
  for (int u = blockIdx.y * 32 + threadIdx.x; u < units; u += gridDim.y * 32) {
    float xv[N][VEC], yv[VEC], o[N][VEC];
#pragma unroll
    for (int j = 0; j < N; ++j) stream_load<VEC>(x + (int64_t)j * a.C, u, xv[j]);
    stream_load<VEC>(y, u, yv);
#pragma unroll
    for (int i = 0; i < N; ++i) {
      stream_mixed<N, VEC>(i, r, p, xv, yv, o[i]);
      stream_store<VEC>(out + (int64_t)i * a.C, u, o[i]);
    }
    if constexpr (MERGE) {
      float mv[VEC];
      stream_combine<N, VEC>(q, o, mv);
      stream_store<VEC>(a.merged + (int64_t)m * a.C, u, mv);
    }
  }
}

// dx[i] = h[i] dout; dh[i] = sum_c dout[c] x[i, c] for each of the warp's tokens (static: summed over them).
template <int N, int VEC>
__global__ void __launch_bounds__(32 * STREAM_TOKENS) stream_merge_bwd_kernel(StreamArgs a) {
  const bool per_token = a.h_stride != 0;
  const int units = a.C / VEC;
  float acc[N] = {};
  // m is the same for the whole warp, so the shuffles in warp_sums always have every lane
  for (int m = blockIdx.x * STREAM_TOKENS + threadIdx.y; m < a.M; m += gridDim.x * STREAM_TOKENS) {
    const float* x = a.x + (int64_t)m * N * a.C;
    const float* g = a.dout + (int64_t)m * a.C;
    float* dx = a.dx + (int64_t)m * N * a.C;
    float h[N];
    stream_coefs<N>(a.h + m * a.h_stride, h);
    for (int u = threadIdx.x; u < units; u += 32) {
      float gv[VEC], xv[N][VEC];
      stream_load<VEC>(g, u, gv);
#pragma unroll
      for (int i = 0; i < N; ++i) stream_load<VEC>(x + (int64_t)i * a.C, u, xv[i]);
#pragma unroll
      for (int i = 0; i < N; ++i) {
        float d[VEC];
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          d[k] = h[i] * gv[k];
          acc[i] = fmaf(gv[k], xv[i][k], acc[i]);
        }
        stream_store<VEC>(dx + (int64_t)i * a.C, u, d);
      }
    }
    if (per_token) {
      warp_sums(acc, [&](int k, float total) { a.dh[m * a.dh_stride + k] = total; });
#pragma unroll
      for (int i = 0; i < N; ++i) acc[i] = 0.f;
    }
  }
  if (!per_token) stream_block_sums<N>(acc, a.part);
}

// dx[j] = sum_i h_res[i, j] dout[i]; dy = sum_i h_post[i] dout[i]; for token m, added into acc (K = n * n + n
// values, n * n + 2n with MERGE): dh_res[i, j] = sum_c dout[i, c] x[j, c] and dh_post[i] = sum_c dout[i, c] y[c].
// With MERGE the gradient reaching out[i] is dout[i] + h_pre[i] dmerged (the add autograd would make,
// rounded as it would round it), and dh_pre[i] = sum_c dmerged[c] out[i, c] with out recomputed from x and y.
template <int N, int VEC, class TY, bool MERGE, int K>
__device__ __forceinline__ void stream_mix_bwd_token(const StreamArgs& a, int m, float (&acc)[K]) {
  constexpr int RES = 0, POST = N * N, PRE = N * N + N;  // where each coefficient's sums start in acc
  const int units = a.C / VEC;
  const float* x = a.x + (int64_t)m * N * a.C;
  const TY* y = static_cast<const TY*>(a.y) + (int64_t)m * a.C;
  const float* g = a.dout + (int64_t)m * N * a.C;
  float* dx = a.dx + (int64_t)m * N * a.C;
  TY* dy = static_cast<TY*>(a.dy) + (int64_t)m * a.C;
  float r[N * N], p[N], q[N];
  stream_coefs<N * N>(a.h + m * a.h_stride, r);
  stream_coefs<N>(a.h_post + m * a.post_stride, p);
  if constexpr (MERGE) stream_coefs<N>(a.h_pre + m * a.post_stride, q);
  for (int u = threadIdx.x; u < units; u += 32) {
    float gv[N][VEC], xv[N][VEC], yv[VEC];
#pragma unroll
    for (int i = 0; i < N; ++i) stream_load<VEC>(g + (int64_t)i * a.C, u, gv[i]);
#pragma unroll
    for (int j = 0; j < N; ++j) stream_load<VEC>(x + (int64_t)j * a.C, u, xv[j]);
    stream_load<VEC>(y, u, yv);
    if constexpr (MERGE) {
      float dm[VEC];
      stream_load<VEC>(a.dmerged + (int64_t)m * a.C, u, dm);
#pragma unroll
      for (int i = 0; i < N; ++i) {
        float o[VEC];
        stream_mixed<N, VEC>(i, r, p, xv, yv, o);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          acc[PRE + i] = fmaf(dm[k], o[k], acc[PRE + i]);
          gv[i][k] = __fadd_rn(gv[i][k], __fmul_rn(q[i], dm[k]));
        }
      }
    }
#pragma unroll
    for (int j = 0; j < N; ++j) {
      float d[VEC];
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        d[k] = r[j] * gv[0][k];
#pragma unroll
        for (int i = 1; i < N; ++i) d[k] = fmaf(r[i * N + j], gv[i][k], d[k]);
      }
      stream_store<VEC>(dx + (int64_t)j * a.C, u, d);
    }
    float d[VEC];
    stream_combine<N, VEC>(p, gv, d);
    stream_store<VEC>(dy, u, d);
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        acc[POST + i] = fmaf(gv[i][k], yv[k], acc[POST + i]);
#pragma unroll
        for (int j = 0; j < N; ++j) acc[RES + i * N + j] = fmaf(gv[i][k], xv[j][k], acc[RES + i * N + j]);
      }
  }
}

// The mix's backward for each of the warp's tokens (stream_mix_bwd_token); the coefficient gradients stored per
// token (h_res's, then h_post's, then h_pre's) or, static, summed over the tokens (stream_block_sums).
template <int N, int VEC, class TY, bool MERGE>
__global__ void __launch_bounds__(32 * STREAM_TOKENS) stream_mix_bwd_kernel(StreamArgs a) {
  constexpr int K = N * N + (MERGE ? 2 : 1) * N;
  const bool per_token = a.h_stride != 0;
  float acc[K] = {};
  // m is the same for the whole warp, so the shuffles in warp_sums always have every lane
  for (int m = blockIdx.x * STREAM_TOKENS + threadIdx.y; m < a.M; m += gridDim.x * STREAM_TOKENS) {
    stream_mix_bwd_token<N, VEC, TY, MERGE>(a, m, acc);
    if (per_token) {
      warp_sums(acc, [&](int k, float total) {
        if (k < N * N) a.dh[m * a.dh_stride + k] = total;
        else if (k < N * N + N) a.dh_post[m * a.dpost_stride + k - N * N] = total;
        else a.dh_pre[m * a.dpost_stride + k - N * N - N] = total;
      });
#pragma unroll
      for (int k = 0; k < K; ++k) acc[k] = 0.f;
    }
  }
  if (!per_token) stream_block_sums<K>(acc, a.part);
}

// The static coefficients' gradients: the column sums of the blocks' rows of part (rows x K), a warp a column, its
// lanes strided over the rows and then a shuffle tree (a fixed order: the same bits every run); columns
// [0, k0) go to out0, [k0, k0 + k1) to out1 and the rest to out2.
__global__ void stream_coef_finish_kernel(const float* part, int rows, int K, float* out0, int k0, float* out1,
                                          int k1, float* out2) {
  const int t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (t >= K) return;
  float sum = 0.f;
  for (int b = lane; b < rows; b += 32) sum += part[(int64_t)b * K + t];
  sum = warp_sum(sum);
  if (lane == 0) {
    if (t < k0) out0[t] = sum;
    else if (t < k0 + k1) out1[t - k0] = sum;
    else out2[t - k0 - k1] = sum;
  }
}

static const dim3 STREAM_BLOCK(32, STREAM_TOKENS);

static void stream_check_n(const char* what, int n) {
  if (n < 1 || n > limits::max_streams)
    throw std::runtime_error(std::string(what) + ": needs 1 <= n <= " + std::to_string(limits::max_streams) +
                             ", got n = " + std::to_string(n));
}

// Forward grid: STREAM_TOKENS tokens per block in x, a token's units over y (32 per block).
static dim3 stream_fwd_grid(int M, int C, bool vec4) {
  return dim3(ceil_div(M, STREAM_TOKENS), std::min(ceil_div(vec4 ? C / 4 : C, 32), 65535));
}

// x (M, n, C) -> out (M, C); h: n floats, or n per token when per_token. All contiguous.
void launch::stream_merge_fwd(const float* x, const float* h, float* out, int M, int n, int C, bool per_token,
                              cudaStream_t s) {
  stream_check_n("stream_merge_fwd", n);
  if (M == 0 || C == 0) return;
  StreamArgs a{};
  a.x = x; a.h = h; a.out = out; a.h_stride = per_token ? n : 0; a.M = M; a.C = C;
  const bool vec4 = stream_vec4(C, x, out);
  const dim3 grid = stream_fwd_grid(M, C, vec4);
  stream_dispatch(n, vec4, [&](auto N, auto V) {
    stream_merge_fwd_kernel<decltype(N)::value, decltype(V)::value><<<grid, STREAM_BLOCK, 0, s>>>(a);
  });
  check_launch("stream_merge_fwd");
}

// Rows of partial sums the static coefficients' backward writes (K floats each): one per block, 4 blocks an SM
// (STREAM_TOKENS warps each), so each warp walks about M / (4 * STREAM_TOKENS * SMs) tokens.
int launch::stream_coef_rows(int M) { return std::max(1, std::min(ceil_div(M, STREAM_TOKENS), 4 * num_sms())); }

// The backward's blocks: a warp per token for per-token coefficients, stream_coef_rows for static ones (then the
// K = k0 + k1 + k2 column sums of their rows into out0, out1 and out2 by stream_coef_finish_kernel).
template <class Launch>
static void stream_bwd_launch(const char* what, int M, bool per_token, Launch launch, const float* part, int k0,
                              float* out0, int k1, float* out1, int k2, float* out2, cudaStream_t s) {
  const int blocks = per_token ? ceil_div(M, STREAM_TOKENS) : launch::stream_coef_rows(M);
  if (blocks > 0) launch(blocks);
  check_launch(what);
  if (per_token) return;
  const int K = k0 + k1 + k2;
  stream_coef_finish_kernel<<<ceil_div(K, 8), 256, 0, s>>>(part, blocks, K, out0, k0, out1, k1, out2);
  check_launch("stream_coef_finish");
}

// dout (M, C) -> dx (M, n, C) and dh: per token (M, n); static (n,), the token sum, through the workspace part
// (stream_coef_rows(M) * n floats). Zeros where C or M is 0.
void launch::stream_merge_bwd(const float* x, const float* h, const float* dout, float* dx, float* dh, float* part, int M,
                              int n, int C, bool per_token, cudaStream_t s) {
  stream_check_n("stream_merge_bwd", n);
  StreamArgs a{};
  a.x = x; a.h = h; a.dout = dout; a.dx = dx; a.dh = dh; a.part = part;
  a.h_stride = per_token ? n : 0; a.dh_stride = n; a.M = M; a.C = C;
  const bool vec4 = stream_vec4(C, x, dout, dx);
  auto launch = [&](int blocks) {
    stream_dispatch(n, vec4, [&](auto N, auto V) {
      stream_merge_bwd_kernel<decltype(N)::value, decltype(V)::value><<<blocks, STREAM_BLOCK, 0, s>>>(a);
    });
  };
  stream_bwd_launch("stream_merge_bwd", M, per_token, launch, part, n, dh, 0, nullptr, 0, nullptr, s);
}

// x (M, n, C), y (M, C) -> out (M, n, C); h_res n * n floats (row-major) and h_post n, or that many per
// token when per_token. With h_pre (n floats, or n per token, like h_post) also merged (M, C), the merge of
// out by h_pre (stream_mix_merge); h_pre = nullptr: the mix alone. All contiguous.
template <class TY>
void launch::stream_mix_fwd(const float* x, const float* h_res, const float* h_post, const TY* y, const float* h_pre,
                            float* out, float* merged, int M, int n, int C, bool per_token, cudaStream_t s) {
  stream_check_n("stream_mix_fwd", n);
  if (M == 0 || C == 0) return;
  StreamArgs a{};
  a.x = x; a.h = h_res; a.h_post = h_post; a.h_pre = h_pre; a.y = y; a.out = out; a.merged = merged;
  a.h_stride = per_token ? n * n : 0; a.post_stride = per_token ? n : 0; a.M = M; a.C = C;
  const bool vec4 = stream_vec4(C, x, y, out, merged);
  const dim3 grid = stream_fwd_grid(M, C, vec4);
  stream_dispatch(n, vec4, [&](auto N, auto V) {
    constexpr int n_ = decltype(N)::value, vec = decltype(V)::value;
    if (h_pre) stream_mix_fwd_kernel<n_, vec, TY, true><<<grid, STREAM_BLOCK, 0, s>>>(a);
    else stream_mix_fwd_kernel<n_, vec, TY, false><<<grid, STREAM_BLOCK, 0, s>>>(a);
  });
  check_launch("stream_mix_fwd");
}

// dout (M, n, C) -> dx (M, n, C), dy (M, C), and the coefficient gradients: per token dh_res (M, n, n) and
// dh_post (M, n); static, their token sums (n, n) and (n,) through the workspace part (stream_coef_rows(M) * K
// floats, K = n * n + n). With h_pre (stream_mix_merge) dmerged (M, C) comes in too and dh_pre (M, n) or (n,)
// goes out (K = n * n + 2n). Zeros where C or M is 0.
template <class TY>
void launch::stream_mix_bwd(const float* x, const float* h_res, const float* h_post, const TY* y, const float* h_pre,
                            const float* dout, const float* dmerged, float* dx, TY* dy, float* dh_res, float* dh_post,
                            float* dh_pre, float* part, int M, int n, int C, bool per_token, cudaStream_t s) {
  stream_check_n("stream_mix_bwd", n);
  StreamArgs a{};
  a.x = x; a.h = h_res; a.h_post = h_post; a.h_pre = h_pre; a.y = y; a.dout = dout; a.dmerged = dmerged;
  a.dx = dx; a.dy = dy; a.dh = dh_res; a.dh_post = dh_post; a.dh_pre = dh_pre; a.part = part;
  a.h_stride = per_token ? n * n : 0; a.post_stride = per_token ? n : 0;
  a.dh_stride = n * n; a.dpost_stride = n;
  a.M = M; a.C = C;
  const bool vec4 = stream_vec4(C, x, y, dout, dmerged, dx, dy);
  auto launch = [&](int blocks) {
    stream_dispatch(n, vec4, [&](auto N, auto V) {
      constexpr int n_ = decltype(N)::value, vec = decltype(V)::value;
      if (h_pre) stream_mix_bwd_kernel<n_, vec, TY, true><<<blocks, STREAM_BLOCK, 0, s>>>(a);
      else stream_mix_bwd_kernel<n_, vec, TY, false><<<blocks, STREAM_BLOCK, 0, s>>>(a);
    });
  };
  stream_bwd_launch("stream_mix_bwd", M, per_token, launch, part, n * n, dh_res, n, dh_post, h_pre ? n : 0, dh_pre,
                    s);
}

#define STREAM_MIX_INSTANTIATE(TY)                                                                                    \
  template void launch::stream_mix_fwd<TY>(const float*, const float*, const float*, const TY*, const float*, float*, \
                                           float*, int, int, int, bool, cudaStream_t);                                        \
  ONE_TEMPLATE(stream_mix_fwd<TY>);                                                                                   \
  template void launch::stream_mix_bwd<TY>(const float*, const float*, const float*, const TY*, const float*,         \
                                           const float*, const float*, float*, TY*, float*, float*, float*, float*,           \
                                           int, int, int, bool, cudaStream_t);                                                \
  ONE_TEMPLATE(stream_mix_bwd<TY>);
STREAM_MIX_INSTANTIATE(float)
STREAM_MIX_INSTANTIATE(__nv_bfloat16)
#undef STREAM_MIX_INSTANTIATE

// ================================================================================================
// 9. The decode megakernel
// A whole decode step in one persistent kernel.
// ================================================================================================

// ------------------------------------------------------------------------------------------------
// 9.1 decode megakernel
// One decoded token of a gpt model (LayerNorm, learned positions, GELU MLP, biases) or a
// llama model (RMSNorm, RoPE, SwiGLU MLP, no biases), dense or a mixture of experts, multi-head or
// grouped-query attention, fp32 or bf16, in one launch, where the op set launches about ten kernels a
// layer. Decoding one token reads every weight once, so its limit is bandwidth; with a kernel per op each
// of the ~130 links costs a launch and a ramp-up, about what a layer's weights take to stream in, and the
// step reaches a fraction of the copy rate (inference.py prints how much).
//
// Instruction set. A layer is five steps: (A) norm + QKV projection, the new key and value written into the
// cache; (B) attention of the one query, a block per (head, split of the keys), split 0 of a head adding
// the splits up (llama: each block first rotates the query and the new key, and writes the key into the
// cache, as the rows of a pair may come from two blocks); (C) output projection + residual; (D) norm + fc +
// GELU, or norm + fc and up + SwiGLU (a block's rows of both, so the pairs meet in the block); (E) mlp
// projection + residual. A mixture of experts' step D starts with the router, which every block computes
// itself (a few rows) rather than wait for another's; the products of D and E then run once for each chosen
// expert, and E adds the experts' outputs weighted by their renormalised probabilities. After the last
// layer, (F) norm + the tied output head writes the logits (the caller picks the token). Every block
// computes a norm over the whole row (n_embd values) itself rather than wait for one to share it. Each op
// rounds to the weights' dtype where the op set's kernels write their outputs, so the math is the op set's;
// the sums' order is not (one warp a row here), so fp32 logits agree to rounding.
//
// Scheduler. The grid is one block per SM, all resident (a cooperative launch). The rows of each
// product are cut evenly over the blocks, so the schedule is arithmetic on the block index and the
// position: a block's weight rows of the whole step, and before each layer's output projection the keys
// and values its attention split reads from the cache, form one list of chunks of a page of shared
// memory each (MkPlan). A producer warp walks the list and fills page j % pages with chunk j (bulk
// copies, completion on the page's mbarrier) as soon as every consumer thread has released the chunk
// before it there, so the next steps' weights stream in while the consumers wait or compute: the
// weights never wait on the activations, and attention reads the cache from shared memory.
//
// Synchronisation. No grid barrier: each value one block hands to others (the query, the new key and
// value, the attention splits' parts and output, the residual stream, the GELU output) is a 64-bit word
// of the float and the tag of the step that wrote it, and a reader polls the words it needs until each
// carries the step's tag (mk_put, mk_poll). A block waits only for the values it reads, and no fence
// orders data before a flag. A release (a barrier's arrival) would also wait for the producer's bulk
// copies in flight. With a trace, thread 0 of each block records the clock when it has finished each
// step's work and when the next step's inputs have all arrived (test_ops.py --bench --only megakernel).
//
// Twin: a decode step of train.GPT on the torch op set (inference.py). Uses: 1.2, 1.4, 1.5 cp_async, 1.7
// mbarriers and bulk_copy; 2.1 GeluErf, Silu; 2.3 rope_turn. Its own: the consumer warps' barrier (mk_sync,
// a named barrier at a fixed id), the tagged hand-offs through global memory (mk_put, mk_load2, mk_poll).

constexpr int MK_THREADS = 256, MK_WARPS = MK_THREADS / 32;  // the consumer warps; one producer warp more
constexpr int MK_MAX_PAGES = 6, MK_MIN_PAGE_BYTES = 32 * 1024;  // pages a block streams through (mk_pages)
constexpr int MK_MAX_SPLITS = 32;   // splits of a head's keys (blocks per head in step B)
constexpr int MK_MAX_OWN = 64;      // rows of the residual stream a block keeps: n_embd <= 64 x its SMs

__device__ __forceinline__ void mk_sync() {  // the consumer warps' barrier (the producer warp runs apart)
  asm volatile("bar.sync 1, %0;" ::"n"(MK_THREADS) : "memory");
}

// Floats of attention's scratch: the warps' parts of an item, later the splits' parts of a head; then the
// query and the new key and value.
__host__ __device__ constexpr int mk_scratch_floats(int hs, int splits) {
  return (splits > MK_WARPS ? splits : MK_WARPS) * (hs + 2) + 3 * hs;
}

template <class T>
struct MkLayer {  // one layer's weights, in the slots of limits::megakernel_layer_weights; nullptr: none (biases
                  // in llama, up_w in gpt, router_w in a dense model). A mixture's fc, up and mlp projection
                  // weights and biases hold every expert's, one after another.
  const T *ln1_w, *ln1_b, *attn_w, *attn_b, *proj_w, *proj_b, *ln2_w, *ln2_b, *fc_w, *fc_b, *up_w, *fc2_w, *fc2_b;
  const T* router_w;
};

// MkLayer's fields sit in the named slots: the launcher fills them from the caller's array by position.
#define MK_SLOT_IS(field, name)                                                          \
  static_assert(offsetof(MkLayer<float>, field) == limits::megakernel_slot(name) * sizeof(const float*), \
                "MkLayer::" #field " is not slot " name " of limits::megakernel_layer_weights")
MK_SLOT_IS(ln1_w, "ln_1_w"); MK_SLOT_IS(ln1_b, "ln_1_b"); MK_SLOT_IS(attn_w, "attn_w"); MK_SLOT_IS(attn_b, "attn_b");
MK_SLOT_IS(proj_w, "attn_proj_w"); MK_SLOT_IS(proj_b, "attn_proj_b"); MK_SLOT_IS(ln2_w, "ln_2_w");
MK_SLOT_IS(ln2_b, "ln_2_b"); MK_SLOT_IS(fc_w, "mlp.fc_w"); MK_SLOT_IS(fc_b, "mlp.fc_b"); MK_SLOT_IS(up_w, "mlp.up_w");
MK_SLOT_IS(fc2_w, "mlp.proj_w"); MK_SLOT_IS(fc2_b, "mlp.proj_b"); MK_SLOT_IS(router_w, "mlp.router_w");
#undef MK_SLOT_IS
static_assert(sizeof(MkLayer<float>) == limits::megakernel_layer_slots * sizeof(const float*),
              "MkLayer has a field for every slot of limits::megakernel_layer_weights, and no other");

constexpr int MK_MAX_QKV_ROWS = 3 * MK_MAX_OWN + 1;  // a block's rows of the QKV product: (3 n_embd) / SMs

// Rows of the largest chunk (the products of n_embd columns; the mlp's width is at least n_embd): a page's
// biases.
__host__ __device__ constexpr int mk_max_chunk_rows(int C, int elem_bytes, int page_bytes) {
  return page_bytes / (C * elem_bytes);
}

template <class T>
struct MkArgs {
  MkLayer<T> layer[limits::megakernel_max_layers];
  const T *wte, *wpe, *lnf_w, *lnf_b;  // wpe and lnf_b nullptr in llama
  const float *rope_cos, *rope_sin;    // llama's angles, (>= capacity, hs / 2) each; nullptr in gpt
  T *k_cache, *v_cache;    // (n_layer, n_kv_head, capacity, hs)
  const int64_t* tok;      // the token to decode
  int64_t* pos;            // its position; advanced by one
  T* logits;               // (V)
  float* ws;               // mk_workspace
  uint64_t* trace;         // nullptr, or (G, mk_trace_stamps) ns: MkTrace's stamps of each block
  IndexErrorBox* box;
  int n_layer, C, n_head, n_kv_head, hs, hidden, V, capacity, splits;  // hidden: the mlp's width, 4C or SwiGLU's
  int n_expert, top_k;    // a mixture's experts and those a token takes; dense: 0 and 1
  int pages, page_bytes;  // mk_pages
  float eps, scale;
};

// The workspace: the launch count, then the values handed between blocks, each a 64-bit word of its float's
// bits and the tag of the step that wrote it (mk_put, mk_poll).
struct MkWorkspace {
  unsigned* launches;    // launches so far; block 0 adds one at the end of each
  uint64_t *xa, *xd;     // the residual stream after the mlp (step E, read by A) and after attention (C, read by D)
  uint64_t *q, *kv, *o;  // the query (C), the new key and value (2 n_kv_head hs), the attention output (C)
  uint64_t *h;           // the GELU or SwiGLU output of each chosen expert (top_k x hidden, hidden <= 4C)
  uint64_t* part;        // (n_head, splits, hs + 2): each split's max score, sum of exps and unnormalised output
  __host__ __device__ MkWorkspace(float* ws, int C, int kv_width, int top_k) {
    launches = reinterpret_cast<unsigned*>(ws);
    xa = reinterpret_cast<uint64_t*>(ws + 4);
    xd = xa + C;
    q = xd + C;
    kv = q + C;
    o = kv + 2 * kv_width;
    h = o + C;
    part = h + 4 * C * top_k;
  }
};

// Stamps of a block's trace: its start, two for each of a layer's 5 steps (MkTrace), its end.
__host__ __device__ constexpr int mk_trace_stamps(int n_layer) { return 2 + 10 * n_layer; }

// Floats of MkWorkspace.
__host__ __device__ inline int64_t mk_workspace_floats(int C, int n_head, int hs, int splits, int top_k) {
  return 4 + 2 * ((6LL + 4 * top_k) * C + (int64_t)n_head * splits * (hs + 2));
}

template <class T>
__device__ __forceinline__ float round_to(float v) { return to_float(from_float<T>(v)); }

// Step s's product in a layer (QKV, attention output, fc, up (llama; none in gpt), mlp projection) or the head.
enum MkProduct { MK_QKV, MK_OUT, MK_FC, MK_UP, MK_FC2, MK_HEAD, MK_PRODUCTS };

struct MkRows {  // a block's rows of one product and their chunks
  int r0, rows, per_chunk, chunks, first;  // first: its first chunk's index within a layer's chunks
};

template <class T>
struct MkPlan {
  MkRows p[MK_PRODUCTS];
  int K[MK_PRODUCTS], runs[MK_PRODUCTS];  // runs: times the product runs, once for each chosen expert
  int per_layer, total;  // chunks a layer, chunks of the whole step
  int pages, page_bytes;
  // Step B's split holds keys [att_j0, att_j1); its chunk: the cached keys and values [att_j0, att_j0 +
  // att_keys), keys first
  int att_j0, att_j1, att_keys, att_chunks, att_first;

  __device__ MkPlan(const MkArgs<T>& a, int pos) {
    const int G = gridDim.x, b = blockIdx.x, kv = a.n_kv_head * a.hs;
    const int F = a.hidden, up = a.rope_cos ? F : 0;
    const int N[MK_PRODUCTS] = {a.C + 2 * kv, a.C, F, up, a.C, a.V};
    const int Ks[MK_PRODUCTS] = {a.C, a.C, a.C, a.C, F, a.C};
    // Step B's item is the block's index (mk_attention). Its keys before pos are in the cache before the
    // launch (the key at pos comes from step A); as many as fit a page go through one, the rest (a long
    // context) are read from the cache, as are all where a cache row is no multiple of 16 bytes.
    const int splits = a.splits, hs = a.hs, row_bytes = hs * (int)sizeof(T);
    const int per_split = (pos + 1 + splits - 1) / splits, j0 = b % splits * per_split;
    const int j1 = min(pos + 1, j0 + per_split), fit = row_bytes % 16 == 0 ? a.page_bytes / (2 * row_bytes) : 0;
    att_j0 = j0;
    att_j1 = j1;
    att_keys = b < a.n_head * splits ? max(0, min(min(j1, pos), j0 + fit) - j0) : 0;
    att_chunks = att_keys > 0;
    int first = 0;
    for (int s = 0; s < MK_PRODUCTS; ++s) {
      const int r0 = (int)((int64_t)N[s] * b / G), r1 = (int)((int64_t)N[s] * (b + 1) / G);
      const int per = a.page_bytes / (Ks[s] * (int)sizeof(T));
      K[s] = Ks[s];
      runs[s] = s == MK_FC || s == MK_UP || s == MK_FC2 ? a.top_k : 1;
      p[s] = {r0, r1 - r0, per, (r1 - r0 + per - 1) / per, s == MK_HEAD ? 0 : first};
      if (s != MK_HEAD) first += p[s].chunks * runs[s];
      if (s == MK_QKV) {
        att_first = first;
        first += att_chunks;
      }
    }
    per_layer = first;
    total = a.n_layer * per_layer + p[MK_HEAD].chunks;
    pages = a.pages;
    page_bytes = a.page_bytes;
  }

  // The chunk's index in the step's list: chunk c of product s in layer l (run k's chunks after run k - 1's).
  __device__ int index(int l, int s, int c) const {
    return (s == MK_HEAD ? total - p[MK_HEAD].chunks : l * per_layer + p[s].first) + c;
  }
};

// Where row r of the QKV product goes: kind (0 query, 1 key, 2 value) << 30 | its offset in w.q, or in the
// cache's layer at position 0.
template <class T>
__device__ unsigned mk_qkv_at(const MkArgs<T>& a, int r) {
  const int kv = a.n_kv_head * a.hs;
  if (r < a.C) return r;
  const int c = (r - a.C) % kv, head = c / a.hs, d = c % a.hs;
  return (r < a.C + kv ? 1u : 2u) << 30 | (unsigned)(head * a.capacity * a.hs + d);
}

// Product s's weight matrix in layer l (expert e's in a mixture), and its bias (nullptr: none).
template <class T>
__device__ __forceinline__ const T* mk_matrix(const MkArgs<T>& a, int l, int s, int e) {
  const MkLayer<T>& w = a.layer[l];
  const int64_t expert = (int64_t)e * a.hidden * a.C;  // elements of each expert's fc, up or projection
  return s == MK_QKV ? w.attn_w : s == MK_OUT ? w.proj_w : s == MK_FC ? w.fc_w + expert
       : s == MK_UP ? w.up_w + expert : s == MK_FC2 ? w.fc2_w + expert : a.wte;
}

template <class T>
__device__ __forceinline__ const T* mk_bias(const MkArgs<T>& a, int l, int s, int e) {
  const MkLayer<T>& w = a.layer[l];
  const T* b = s == MK_QKV ? w.attn_b : s == MK_OUT ? w.proj_b : s == MK_FC ? w.fc_b : s == MK_FC2 ? w.fc2_b : nullptr;
  return b && (s == MK_FC || s == MK_FC2) ? b + (int64_t)e * (s == MK_FC ? a.hidden : a.C) : b;
}

// The producer warp: walks the step's list of chunks and fills each page as soon as the consumer threads have
// released it (empty): weight rows by one bulk copy and their biases (fp32, 0 for none) by the lanes, or a
// split's keys and values by two copies. full completes on the 32 lanes' arrivals and the copies' bytes.
// A mixture's expert weights wait for the block's router (route: its phase l completes once experts holds
// layer l's choice).
template <class T>
__device__ void mk_produce(const MkArgs<T>& a, const MkPlan<T>& plan, char* pages, float* pbias, int max_rows,
                           uint32_t full, uint32_t empty, uint32_t route, const int* experts) {
  const int lane = threadIdx.x % 32;
  int j = 0, chosen[limits::megakernel_max_top_k] = {};
  // Only a block with rows of the experts' products waits for their choice: its consumers cannot complete
  // route's next phase before this warp has filled the pages of the last one, so the parity never aliases.
  // (A block without such rows would let its consumers run phases ahead, and it needs no choice.)
  const bool fetches_experts = a.n_expert && plan.p[MK_FC].chunks + plan.p[MK_UP].chunks + plan.p[MK_FC2].chunks > 0;
  auto page = [&] {  // page j % pages, once the consumers have released its last chunk
    const int p = j % a.pages;
    if (j >= a.pages) mbar_wait(empty + 8 * p, (j / a.pages - 1) & 1);
    return p;
  };
  for (int l = 0; l <= a.n_layer; ++l)
    for (int s = l == a.n_layer ? MK_HEAD : 0; s < (l == a.n_layer ? MK_PRODUCTS : MK_HEAD); ++s) {
      if (s == MK_OUT && plan.att_chunks) {  // step B's keys and values
        const int p = page();
        if (lane == 0) {
          const int kvh = blockIdx.x / a.splits / (a.n_head / a.n_kv_head);
          const int64_t at = (((int64_t)l * a.n_kv_head + kvh) * a.capacity + plan.att_j0) * a.hs;
          const uint32_t bytes = (uint32_t)plan.att_keys * a.hs * sizeof(T);
          const uint32_t dst = smem_addr(pages + (int64_t)p * a.page_bytes);
          mbar_expect_tx(full + 8 * p, 2 * bytes);
          bulk_copy(dst, a.k_cache + at, bytes, full + 8 * p);
          bulk_copy(dst + bytes, a.v_cache + at, bytes, full + 8 * p);
        }
        mbar_arrive(full + 8 * p);
        ++j;
      }
      if (s == MK_FC && fetches_experts) {  // this layer's experts, once the block's router has chosen them
        mbar_wait(route, l & 1);
        for (int k = 0; k < a.top_k; ++k) chosen[k] = experts[k];
      }
      const MkRows& r = plan.p[s];
      for (int run = 0; run < plan.runs[s]; ++run) {
        const T* w = mk_matrix(a, l == a.n_layer ? 0 : l, s, chosen[run]);
        const T* bias = l == a.n_layer ? nullptr : mk_bias(a, l, s, chosen[run]);
        for (int c = 0; c < r.chunks; ++c, ++j) {
          const int p = page(), row = r.r0 + c * r.per_chunk, rows = min(r.per_chunk, r.rows - c * r.per_chunk);
          if (lane == 0) {
            const uint32_t bytes = (uint32_t)rows * plan.K[s] * sizeof(T);
            const uint32_t dst = smem_addr(pages + (int64_t)p * a.page_bytes);
            mbar_expect_tx(full + 8 * p, bytes);
            bulk_copy(dst, w + (int64_t)row * plan.K[s], bytes, full + 8 * p);
          }
          for (int i = lane; i < rows; i += 32) pbias[p * max_rows + i] = bias ? to_float(bias[row + i]) : 0.f;
          mbar_arrive(full + 8 * p);
        }
      }
    }
}

// A warp's dot products of n <= R rows of the page (row r at row + r * stride values) with vec (fp32, shared
// memory) into sum[0, n), lanes over 16-byte units. The rows go together: each unit of vec is read once for
// all of them and their loads are in flight at once, where a row at a time would wait on each load in turn.
// Each row's sum is in the same order whatever R.
constexpr int MK_ROWS = 2;

template <class T, int R>
__device__ __forceinline__ void mk_dots(const T* row, int64_t stride, int n, const float* vec, int K, float* sum) {
  constexpr int E = per16<T>();
  float acc[R] = {};
  for (int u = threadIdx.x % 32; u < K / E; u += 32) {
    float x[E];
#pragma unroll
    for (int k = 0; k < E; k += 4) *reinterpret_cast<float4*>(x + k) = *reinterpret_cast<const float4*>(vec + u * E + k);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (r >= n) break;
      float w[E];
      unpack16(*reinterpret_cast<const float4*>(row + r * stride + u * E), w);
#pragma unroll
      for (int e = 0; e < E; ++e) acc[r] = fmaf(w[e], x[e], acc[r]);
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) sum[r] = warp_sum(acc[r]);
}

// The block's rows of product s (layer l; in a mixture, its run for the run-th chosen expert) times vec,
// plus bias: out(row, value) for each, by lane 0 of a warp. Each thread releases a page once it has read it
// (empty counts the consumer threads); the warps do not wait for each other.
template <class T, class Out>
__device__ void mk_product(const MkPlan<T>& plan, int l, int s, int run, const float* vec, const char* pages,
                           const float* pbias, int max_rows, uint32_t full, uint32_t empty, Out out) {
  const MkRows& r = plan.p[s];
  const int warp = threadIdx.x / 32, K = plan.K[s];
  for (int c = 0; c < r.chunks; ++c) {
    const int j = plan.index(l, s, run * r.chunks + c), p = j % plan.pages;
    const int rows = min(r.per_chunk, r.rows - c * r.per_chunk);
    mbar_wait(full + 8 * p, (j / plan.pages) & 1);
    const T* page = reinterpret_cast<const T*>(pages + (int64_t)p * plan.page_bytes);
    const float* b = pbias + p * max_rows;
    for (int i = warp; i < rows; i += MK_ROWS * MK_WARPS) {  // rows i, i + MK_WARPS, ...
      const int n = min(MK_ROWS, (rows - i + MK_WARPS - 1) / MK_WARPS);
      float sum[MK_ROWS];
      if (sizeof(T) == 4 && n == 1)  // measured: the one-row loop is faster for fp32, slower for bf16
        mk_dots<T, 1>(page + (int64_t)i * K, 0, 1, vec, K, sum);
      else
        mk_dots<T, MK_ROWS>(page + (int64_t)i * K, (int64_t)MK_WARPS * K, n, vec, K, sum);
      if (threadIdx.x % 32 == 0)
        for (int k = 0; k < n; ++k) out(r.r0 + c * r.per_chunk + i + k * MK_WARPS, sum[k] + b[i + k * MK_WARPS]);
    }
    mbar_arrive(empty + 8 * p);  // by every thread after its own reads, so no read is left unordered
  }
}

// Sum over the block, the same order in every thread; red: MK_WARPS floats of shared memory.
__device__ __forceinline__ float mk_block_sum(float v, float* red) {
  v = warp_sum(v);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  mk_sync();
  float sum = 0.f;
#pragma unroll
  for (int w = 0; w < MK_WARPS; ++w) sum += red[w];
  mk_sync();  // red may be written again
  return sum;
}

// vec (C, shared memory) = layernorm(vec) * w + b, two-pass as norm_fwd_row, rounded to T; with no bias
// (rms), RMSNorm: the mean fixed at 0. w and b in shared memory, copied there while the block waited
// (mk_fetch_norm).
template <class T>
__device__ void mk_norm(float* vec, const T* w, const T* b, bool rms, int C, float eps, float* red) {
  cp_async_wait<0>();  // this thread's part of w and b has landed; the block sum's barrier makes it all
  float s = 0.f;
  if (!rms)
    for (int i = threadIdx.x; i < C; i += MK_THREADS) s += vec[i];
  const float mean = rms ? 0.f : mk_block_sum(s, red) / C;
  float ss = 0.f;
  for (int i = threadIdx.x; i < C; i += MK_THREADS) ss += (vec[i] - mean) * (vec[i] - mean);
  const float rstd = rsqrtf(mk_block_sum(ss, red) / C + eps);
  for (int i = threadIdx.x; i < C; i += MK_THREADS)
    vec[i] = round_to<T>((vec[i] - mean) * rstd * to_float(w[i]) + (rms ? 0.f : to_float(b[i])));
  mk_sync();
}

// Thread-parallel copy of a norm's weight and bias (C values each; no bias: nullptr) into shared memory, for
// a later mk_norm; the block's last reads of the previous ones are behind a barrier.
template <class T>
__device__ __forceinline__ void mk_fetch_norm(T* dst, const T* w, const T* b, int C) {
  constexpr int E = per16<T>();
  const int units = C / E;  // 16-byte units of each
  for (int u = threadIdx.x; u < (b ? 2 : 1) * units; u += MK_THREADS)
    cp_async<16>(dst + u * E, u < units ? w + u * E : b + (u - units) * E, true);
  cp_async_commit();
}

// Hand-offs between blocks. A value one block writes and others read is stored with the tag of the step
// that wrote it, in one 64-bit word (mk_put); a reader polls the words it needs until every tag is the
// step's (mk_poll). The word is written and read whole, so a value is seen with its own tag or not at all:
// no fence orders the data before a flag, and no grid barrier waits for every block. Tags count steps
// over launches (MkWorkspace.launches), so a word left by an earlier step or launch never passes.
// A buffer is written again only after every block has read it: each step's output feeds, through the
// next steps, every block's input before that buffer's next write.
__device__ __forceinline__ void mk_put(uint64_t* dst, float v, unsigned tag) {
  const uint64_t word = (uint64_t)tag << 32 | __float_as_uint(v);
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(dst), "l"(word) : "memory");
}

__device__ __forceinline__ ulonglong2 mk_load2(const uint64_t* src) {
  ulonglong2 v;
  asm volatile("ld.relaxed.gpu.global.v2.u64 {%0, %1}, [%2];" : "=l"(v.x), "=l"(v.y) : "l"(src) : "memory");
  return v;
}

// dst[0, n) = the values at src(i) once they carry `tag` (n even; src(i + 1) = src(i) + 1 for even i, and
// src(i) 16-byte aligned), four pairs a thread in flight; then the consumer warps' barrier.
template <class Src>
__device__ void mk_poll(float* dst, int n, unsigned tag, Src src) {
  constexpr int U = 4;
  mk_sync();  // every warp has read dst's previous values
  for (int i0 = 2 * threadIdx.x; i0 < n; i0 += 2 * U * MK_THREADS) {
    ulonglong2 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (i0 + 2 * u * MK_THREADS < n) v[u] = mk_load2(src(i0 + 2 * u * MK_THREADS));
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = i0 + 2 * u * MK_THREADS;
      if (i >= n) break;
      while ((unsigned)(v[u].x >> 32) != tag || (unsigned)(v[u].y >> 32) != tag) {
        __nanosleep(64);  // measured: polling back to back slows the writers down
        v[u] = mk_load2(src(i));
      }
      dst[i] = __uint_as_float((unsigned)v[u].x);
      dst[i + 1] = __uint_as_float((unsigned)v[u].y);
    }
  }
  mk_sync();
}

__device__ __forceinline__ uint64_t mk_clock() {  // ns, the same clock on every SM
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The trace: thread 0's clock when its block finished a step's work and when the next step's inputs had
// all arrived (nullptr: none).
struct MkTrace {
  uint64_t* at;
  int stamp = 0;
  __device__ void record() {
    if (at && threadIdx.x == 0) at[stamp] = mk_clock();
    ++stamp;
  }
};

// Adds up n parts of one head's attention (max score, sum of exps, hs unnormalised values each, at
// parts[i * (hs + 2)]): with keep = 1 into one such part (put(0, the max), put(1, the sum), ...), with keep = 0
// into the normalised output (hs values, rounded to T).
template <class T, class Put>
__device__ void mk_merge(const float* parts, int n, int hs, int keep, Put put) {
  const int stride = hs + 2;
  float mx = -INFINITY;
  for (int i = 0; i < n; ++i) mx = fmaxf(mx, parts[i * stride]);
  for (int d = threadIdx.x; d < hs + 2 * keep; d += MK_THREADS) {
    float acc = 0.f, den = 0.f;
    for (int i = 0; i < n; ++i) {
      const float* pi = parts + i * stride;
      if (pi[0] == -INFINITY) continue;  // no keys
      const float f = expf(pi[0] - mx);
      den += f * pi[1];
      acc += f * pi[keep ? d : 2 + d];
    }
    put(d, keep ? (d == 0 ? mx : acc) : round_to<T>(acc / den));
  }
}

// A mixture's router, in every block: the logits of vec (the normed row) against router_w (a warp a row,
// rounded to T as the op set's linear), their softmax, the top_k largest (the first of equals) and their
// probabilities renormalised over the chosen, each rounded to T as the op set's ops round them, into
// experts and weights; thread 0 then completes route's phase for the producer warp. logits: n_expert floats.
template <class T>
__device__ void mk_route(const MkArgs<T>& a, const T* router_w, const float* vec, float* logits, int* experts,
                         float* weights, uint32_t route) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, E = a.n_expert;
  for (int e = warp; e < E; e += MK_WARPS) {
    float sum = 0.f;
    for (int i = lane; i < a.C; i += 32) sum = fmaf(to_float(router_w[(int64_t)e * a.C + i]), vec[i], sum);
    sum = warp_sum(sum);
    if (lane == 0) logits[e] = round_to<T>(sum);
  }
  mk_sync();
  if (threadIdx.x == 0) {
    float m = -INFINITY, z = 0.f, total = 0.f;
    for (int e = 0; e < E; ++e) m = fmaxf(m, logits[e]);
    for (int e = 0; e < E; ++e) z += expf(logits[e] - m);
    for (int e = 0; e < E; ++e) logits[e] = round_to<T>(expf(logits[e] - m) / z);
    for (int k = 0; k < a.top_k; ++k) {
      int best = -1;
      for (int e = 0; e < E; ++e) {
        bool taken = false;
        for (int i = 0; i < k; ++i) taken |= experts[i] == e;
        if (!taken && (best < 0 || logits[e] > logits[best])) best = e;
      }
      experts[k] = best;  // E >= top_k, so one is left; with NaN probabilities, the first left
      weights[k] = logits[experts[k]];
      total += weights[k];
    }
    total = round_to<T>(total);
    for (int k = 0; k < a.top_k; ++k) weights[k] = round_to<T>(weights[k] / total);
    mbar_arrive(route);  // releases experts to the producer warp
  }
  mk_sync();
}

// llama's RoPE in step B: the query and, where the split holds it (has_new), the new key (qkv's first and
// second hs values) turned by pos's angles as the rope op turns them (rope_turn, then rounded to T);
// key_row: where the rotated key goes in the cache, or nullptr (another block writes it).
template <class T>
__device__ void mk_rope(const MkArgs<T>& a, float* qkv, bool has_new, int pos, T* key_row) {
  const int half = a.hs / 2;
  const float *cos = a.rope_cos + (int64_t)pos * half, *sin = a.rope_sin + (int64_t)pos * half;
  for (int i = threadIdx.x; i < (has_new ? 2 : 1) * half; i += MK_THREADS) {
    const bool key = i >= half;
    const int d = i - (key ? half : 0);
    float* x = qkv + (key ? a.hs : 0);
    float o1, o2;
    rope_turn(x[d], x[d + half], cos[d], sin[d], o1, o2);
    x[d] = round_to<T>(o1);
    x[d + half] = round_to<T>(o2);
    if (key && key_row) {
      key_row[d] = from_float<T>(x[d]);
      key_row[d + half] = from_float<T>(x[d + half]);
    }
  }
  mk_sync();
}

// Step B for one (head, split) item: its keys' softmax-weighted values, unnormalised, with their max score
// and sum of exps; split 0 of the head adds the splits up into o. The keys and values come from the
// producer's page (MkPlan's att_keys of them), the one at pos from step A's hand-off, any others from the
// cache. A warp takes every MK_WARPS-th key, MK_KEYS at a time with all their loads issued first (a key at
// a time would wait a round trip for each one read from memory). scratch: mk_scratch_floats.
constexpr int MK_KEYS = 2;

template <class T>
__device__ void mk_attention(const MkArgs<T>& a, const MkPlan<T>& plan, const MkWorkspace& w, int l, int item,
                             int pos, float* scratch, const char* pages, uint32_t full, uint32_t empty,
                             unsigned tag_a, unsigned tag_b) {
  const int hs = a.hs, head = item / a.splits, split = item % a.splits, stride = hs + 2;
  const int kvh = head / (a.n_head / a.n_kv_head), lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int j0 = plan.att_j0, j1 = plan.att_j1, kvw = a.n_kv_head * hs;  // item is the block's index
  const int64_t base = ((int64_t)l * a.n_kv_head + kvh) * a.capacity * hs;
  float* qkv = scratch + max(MK_WARPS, a.splits) * stride;  // the query, then the new key and value
  const bool has_new = j0 <= pos && pos < j1;
  mk_poll(qkv, has_new ? 3 * hs : hs, tag_a, [&](int i) {
    return i < hs ? w.q + head * hs + i : w.kv + (i < 2 * hs ? kvh * hs + i - hs : kvw + kvh * hs + i - 2 * hs);
  });
  if (a.rope_cos) {  // the first query head of the key's group writes it
    const bool writes = has_new && head % (a.n_head / a.n_kv_head) == 0;
    mk_rope(a, qkv, has_new, pos, writes ? a.k_cache + base + (int64_t)pos * hs : nullptr);
  }
  float q[4], o[4] = {0.f, 0.f, 0.f, 0.f}, m = -INFINITY, sum = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) q[i] = lane + 32 * i < hs ? qkv[lane + 32 * i] : 0.f;
  const int jp = l * plan.per_layer + plan.att_first, pg = jp % plan.pages;  // the chunk and its page
  const int je = j0 + plan.att_keys;                                             // keys before je: the page's
  const T* ks = reinterpret_cast<const T*>(pages + (int64_t)pg * plan.page_bytes);
  const T* vs = ks + plan.att_keys * hs;
  if (plan.att_chunks) mbar_wait(full + 8 * pg, (jp / plan.pages) & 1);
  for (int jb = j0 + warp; jb < j1; jb += MK_KEYS * MK_WARPS) {  // online softmax over the warp's keys
    float k[MK_KEYS][4], v[MK_KEYS][4];
#pragma unroll
    for (int t = 0; t < MK_KEYS; ++t) {
      const int key = jb + t * MK_WARPS;
      const int64_t at = base + (int64_t)key * hs;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int d = lane + 32 * i;
        const bool live = key < j1 && d < hs;
        const int e = (key - j0) * hs + d;
        k[t][i] = !live      ? 0.f
                  : key == pos ? qkv[hs + d]
                  : key < je   ? to_float(ks[e])
                               : to_float(__ldcg(a.k_cache + at + d));
        v[t][i] = !live      ? 0.f
                  : key == pos ? qkv[2 * hs + d]
                  : key < je   ? to_float(vs[e])
                               : to_float(__ldcg(a.v_cache + at + d));
      }
    }
#pragma unroll
    for (int t = 0; t < MK_KEYS; ++t) {
      if (jb + t * MK_WARPS >= j1) break;
      float s = 0.f;
#pragma unroll
      for (int i = 0; i < 4; ++i) s = fmaf(q[i], k[t][i], s);
      s = warp_sum(s) * a.scale;
      const float m_new = fmaxf(m, s), corr = expf(m - m_new), p = expf(s - m_new);
      sum = sum * corr + p;
#pragma unroll
      for (int i = 0; i < 4; ++i) o[i] = o[i] * corr + p * v[t][i];
      m = m_new;
    }
  }
  if (plan.att_chunks) mbar_arrive(empty + 8 * pg);  // this thread has read the page
  float* mine = scratch + warp * stride;  // the warps' parts, then added up in a fixed order
  if (lane == 0) { mine[0] = m; mine[1] = sum; }
#pragma unroll
  for (int i = 0; i < 4; ++i)
    if (lane + 32 * i < hs) mine[2 + lane + 32 * i] = o[i];
  mk_sync();
  uint64_t* parts = w.part + (int64_t)head * a.splits * stride;
  mk_merge<T>(scratch, MK_WARPS, hs, 1, [&](int d, float v) { mk_put(parts + split * stride + d, v, tag_b); });
  if (split != 0) return;
  mk_sync();  // scratch is read again below
  mk_poll(scratch, a.splits * stride, tag_b, [&](int i) { return parts + i; });
  mk_merge<T>(scratch, a.splits, hs, 0, [&](int d, float v) { mk_put(w.o + head * hs + d, v, tag_b); });
}

template <class T>
__global__ void __launch_bounds__(MK_THREADS + 32, 1) decode_megakernel_kernel(const __grid_constant__ MkArgs<T> a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();  // the bulk copies are Hopper's; the launcher refuses older GPUs
#else
  extern __shared__ __align__(128) char smem[];
  char* pages = smem;
  T* norm = reinterpret_cast<T*>(smem + (int64_t)a.pages * a.page_bytes);  // 2C: the next norm's weight and bias
  float* vec = reinterpret_cast<float*>(norm + 2 * a.C);            // 4C: a product's input
  float* scratch = vec + 4 * a.C;                                   // mk_scratch_floats: attention's parts
  float* red = scratch + mk_scratch_floats(a.hs, a.splits);         // MK_WARPS: block sums
  float* pbias = red + MK_WARPS;                                    // pages * max_rows: the pages' biases
  const int max_rows = mk_max_chunk_rows(a.C, sizeof(T), a.page_bytes);
  __shared__ uint64_t full_bars[MK_MAX_PAGES];   // page p has been filled
  __shared__ uint64_t empty_bars[MK_MAX_PAGES];  // page p has been read by every consumer thread
  __shared__ unsigned qkv_at[MK_MAX_QKV_ROWS];  // where each of the block's QKV rows goes (mk_qkv_at)
  __shared__ float own[MK_MAX_OWN];          // the block's rows of the residual stream
  __shared__ float gate[limits::megakernel_max_top_k * 4 * MK_MAX_OWN];  // llama: the block's rows of fc, SwiGLU's gate, by run
  __shared__ float mix[MK_MAX_OWN];          // a mixture: the block's rows of the experts' outputs so far
  __shared__ float router[limits::megakernel_max_experts];   // a mixture: the router's logits, then its probabilities
  __shared__ int experts[limits::megakernel_max_top_k];       // a mixture: the layer's chosen experts
  __shared__ float expert_p[limits::megakernel_max_top_k];    // and their renormalised probabilities
  __shared__ uint64_t route_bar;             // phase l: layer l's experts are chosen (mk_route)
  const uint32_t full = smem_addr(full_bars), empty = smem_addr(empty_bars), route = smem_addr(&route_bar);
  const MkWorkspace w(a.ws, a.C, a.n_kv_head * a.hs, a.top_k);
  const int C = a.C, G = gridDim.x;
  const bool llama = a.rope_cos != nullptr;  // RMSNorm, RoPE, SwiGLU, no biases
  const int64_t tok = *a.tok, pos = *a.pos;
  if (tok < 0 || tok >= a.V || pos < 0 || pos >= a.capacity) {  // every block sees the same values
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      if (tok < 0 || tok >= a.V) report_bad_index(a.box, kBadDecodeToken, tok, a.V);
      else report_bad_index(a.box, kBadDecodePosition, pos, a.capacity);
    }
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < a.V; i += G * blockDim.x)
      a.logits[i] = from_float<T>(NAN);
    return;
  }
  const MkPlan<T> plan(a, (int)pos);
  MkTrace trace{a.trace ? a.trace + (int64_t)blockIdx.x * mk_trace_stamps(a.n_layer) : nullptr};
  trace.record();
  // tag(l, s): step s (A..E) of layer l in this launch, counted over launches
  const unsigned tag0 = *w.launches * (5u * a.n_layer) + 1u;
  auto tag = [&](int l, int s) { return tag0 + 5u * l + s; };
  if (threadIdx.x == 0) {
    for (int p = 0; p < a.pages; ++p) {
      mbar_init(full + 8 * p, 32);
      mbar_init(empty + 8 * p, MK_THREADS);
    }
    mbar_init(route, 1);
    mbar_init_fence();
  }
  __syncthreads();
  if (threadIdx.x >= MK_THREADS) {
    mk_produce(a, plan, pages, pbias, max_rows, full, empty, route, experts);
    return;
  }
  for (int i = threadIdx.x; i < plan.p[MK_QKV].rows; i += MK_THREADS) qkv_at[i] = mk_qkv_at(a, plan.p[MK_QKV].r0 + i);
  mk_fetch_norm(norm, a.layer[0].ln1_w, a.layer[0].ln1_b, C);
  // The embedding: every block adds the two rows (as the op set's add, rounded to T; llama has no position
  // row). The residual stream's rows [r0, r0 + rows) of the output projections are this block's (the same
  // cut for both): it keeps them in shared memory and publishes them for the norms.
  for (int i = threadIdx.x; i < C; i += MK_THREADS) {
    const float e = to_float(a.wte[tok * C + i]);
    vec[i] = a.wpe ? round_to<T>(e + to_float(a.wpe[pos * C + i])) : e;
  }
  mk_sync();
  const int r0 = plan.p[MK_OUT].r0;
  for (int i = threadIdx.x; i < plan.p[MK_OUT].rows; i += MK_THREADS) own[i] = vec[r0 + i];
  // the stream's row r plus y, both rounded to T as the op set's add, handed to the next norm with tag t
  auto residual = [&](uint64_t* x, unsigned t) {
    return [&, x, t](int r, float y) {
      const float v = round_to<T>(own[r - r0] + round_to<T>(y));
      own[r - r0] = v;
      mk_put(x + r, v, t);
    };
  };
  auto from = [](const uint64_t* src) { return [src](int i) { return src + i; }; };
  for (int l = 0; l < a.n_layer; ++l) {
    const MkLayer<T>& L = a.layer[l];
    // (A) norm + QKV; the key (gpt's; llama's is rotated in step B) and value go into the cache at pos,
    // and to step B
    mk_norm<T>(vec, norm, norm + C, llama, C, a.eps, red);
    mk_fetch_norm(norm, L.ln2_w, L.ln2_b, C);
    const int64_t cache_row = ((int64_t)l * a.n_kv_head * a.capacity + pos) * a.hs;
    mk_product(plan, l, MK_QKV, 0, vec, pages, pbias, max_rows, full, empty, [&](int r, float sum) {
      const float y = round_to<T>(sum);
      const unsigned at = qkv_at[r - plan.p[MK_QKV].r0];
      const int kind = at >> 30, off = at & ((1u << 30) - 1);
      if (kind == 0) {
        mk_put(w.q + off, y, tag(l, 0));
      } else {
        if (kind == 2 || !llama) (kind == 1 ? a.k_cache : a.v_cache)[cache_row + off] = from_float<T>(y);
        mk_put(w.kv + r - C, y, tag(l, 0));
      }
    });
    trace.record();
    trace.record();  // step B's inputs are polled inside mk_attention
    // (B) attention
    if (blockIdx.x < a.n_head * a.splits)
      mk_attention<T>(a, plan, w, l, blockIdx.x, (int)pos, scratch, pages, full, empty, tag(l, 0), tag(l, 1));
    trace.record();
    mk_poll(vec, C, tag(l, 1), from(w.o));
    trace.record();
    // (C) output projection + residual
    mk_product(plan, l, MK_OUT, 0, vec, pages, pbias, max_rows, full, empty, residual(w.xd, tag(l, 2)));
    trace.record();
    mk_poll(vec, C, tag(l, 2), from(w.xd));
    trace.record();
    // (D) norm (+ a mixture's router) + fc + GELU, or + fc and up + SwiGLU, once for each chosen expert
    mk_norm<T>(vec, norm, norm + C, llama, C, a.eps, red);
    if (l + 1 < a.n_layer) mk_fetch_norm(norm, a.layer[l + 1].ln1_w, a.layer[l + 1].ln1_b, C);
    else mk_fetch_norm(norm, a.lnf_w, a.lnf_b, C);
    if (a.n_expert) mk_route(a, L.router_w, vec, router, experts, expert_p, route);
    const int h0 = plan.p[MK_FC].r0, F = a.hidden;
    for (int k = 0; k < a.top_k; ++k)
      mk_product(plan, l, MK_FC, k, vec, pages, pbias, max_rows, full, empty, [&](int r, float sum) {
        if (llama) gate[k * 4 * MK_MAX_OWN + r - h0] = round_to<T>(sum);
        else mk_put(w.h + k * F + r, round_to<T>(GeluErf().fwd(round_to<T>(sum))), tag(l, 3));
      });
    if (llama) {
      mk_sync();  // every warp's gates are in
      for (int k = 0; k < a.top_k; ++k)
        mk_product(plan, l, MK_UP, k, vec, pages, pbias, max_rows, full, empty, [&](int r, float sum) {
          const float g = gate[k * 4 * MK_MAX_OWN + r - h0];
          mk_put(w.h + k * F + r, round_to<T>(Silu().fwd(g) * round_to<T>(sum)), tag(l, 3));
        });
    }
    trace.record();
    // (E) mlp projection + residual; a mixture's experts' outputs weighted, rounded and added in order
    for (int k = 0; k < a.top_k; ++k) {
      mk_poll(vec, F, tag(l, 3), from(w.h + k * F));
      if (k == 0) trace.record();
      if (!a.n_expert) {
        mk_product(plan, l, MK_FC2, 0, vec, pages, pbias, max_rows, full, empty, residual(w.xa, tag(l, 4)));
        break;
      }
      const bool last = k + 1 == a.top_k;
      mk_product(plan, l, MK_FC2, k, vec, pages, pbias, max_rows, full, empty, [&](int r, float sum) {
        const float y = (k ? mix[r - r0] : 0.f) + round_to<T>(expert_p[k] * round_to<T>(sum));
        if (last) residual(w.xa, tag(l, 4))(r, y);
        else mix[r - r0] = y;
      });
    }
    trace.record();
    mk_poll(vec, C, tag(l, 4), from(w.xa));  // the next layer's input, or the head's
    trace.record();
  }
  // (F) norm + head
  mk_norm<T>(vec, norm, norm + C, llama, C, a.eps, red);
  mk_product(plan, 0, MK_HEAD, 0, vec, pages, pbias, max_rows, full, empty,
             [&](int r, float sum) { a.logits[r] = from_float<T>(sum); });
  trace.record();
  // Every block read pos and the launch count at its start, before its first hand-off, and block 0 has
  // seen every block's last one.
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    *a.pos = pos + 1;
    *w.launches += 1;
  }
#endif
}

// Bytes of dynamic shared memory the kernel takes besides its pages, at width C and head size hs.
static int mk_smem_rest(int C, int hs, int elem_bytes, int splits) {
  return 2 * C * elem_bytes + 4 * (4 * C + mk_scratch_floats(hs, splits) + MK_WARPS);
}

static int mk_splits(int n_head) { return std::max(1, std::min(MK_MAX_SPLITS, num_sms() / n_head)); }

static int mk_smem_optin() {  // the most shared memory a block may have (static + dynamic)
  return once_per_device([](int dev) {
    int bytes = 0;
    cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    return bytes;
  });
}

static int mk_static_smem(int elem_bytes);

// The pages: each holds a row of the mlp projection (up to 4 n_embd values) and is at least 32 KB (two such rows
// in bf16 at 2048 wide: with one, one warp would do that product); as many as shared memory holds, up to 6.
struct MkPages {
  int count, bytes;
};
static MkPages mk_pages(int C, int hs, int elem_bytes, int splits) {
  const int bytes = std::max(MK_MIN_PAGE_BYTES, (4 * C * elem_bytes + 1023) / 1024 * 1024);
  const int each = bytes + 4 * mk_max_chunk_rows(C, elem_bytes, bytes);  // a page and its biases
  const int room = mk_smem_optin() - mk_static_smem(elem_bytes) - mk_smem_rest(C, hs, elem_bytes, splits);
  return {std::min(MK_MAX_PAGES, std::max(0, room / each)), bytes};
}

static int mk_smem_bytes(int C, int hs, int elem_bytes, int splits) {
  const MkPages p = mk_pages(C, hs, elem_bytes, splits);
  return p.count * (p.bytes + 4 * mk_max_chunk_rows(C, elem_bytes, p.bytes)) + mk_smem_rest(C, hs, elem_bytes, splits);
}

static int mk_static_smem(int elem_bytes) {  // bytes of the kernel's __shared__ variables
  cudaFuncAttributes attr = {};
  if (elem_bytes == 4) cudaFuncGetAttributes(&attr, decode_megakernel_kernel<float>);
  else cudaFuncGetAttributes(&attr, decode_megakernel_kernel<__nv_bfloat16>);
  return (int)attr.sharedSizeBytes;
}


int launch::decode_megakernel_grid() { return num_sms(); }
int launch::decode_megakernel_trace_stamps(int n_layer) { return mk_trace_stamps(n_layer); }

// Floats of workspace decode_megakernel needs (top_k: the experts a token takes, 1 for a dense model); zero
// it once, then keep it for every step.
int64_t launch::decode_megakernel_workspace_floats(int C, int n_head, int hs, int top_k) {
  return mk_workspace_floats(C, n_head, hs, mk_splits(n_head), top_k);
}

std::string launch::decode_megakernel_unsupported(int C, int n_layer, int n_head, int n_kv_head, int hidden,
                                                  int n_expert, int top_k, int elem_bytes) {
  auto n = [](int v) { return std::to_string(v); };
  if (compute_major() < 9) return "a GPU of compute capability 9.0 or later (its bulk copies are Hopper's)";
  if (n_layer < 1 || n_layer > limits::megakernel_max_layers)
    return "n_layer outside [1, " + n(limits::megakernel_max_layers) + "]";
  if (n_head < 1 || n_kv_head < 1 || C % n_head != 0) return "n_head not dividing n_embd";
  const int hs = C / n_head;
  if (hs > limits::megakernel_max_head_size)
    return "a head size (n_embd / n_head) over " + n(limits::megakernel_max_head_size);
  if (n_head % n_kv_head != 0) return "n_head not a multiple of n_kv_head";
  if (n_head > num_sms()) return "more heads than the GPU has SMs";
  if (hs % 2 != 0) return "an odd head size";
  if ((C * elem_bytes) % 16 != 0) return "a row of n_embd values not a multiple of 16 bytes";
  if ((C + num_sms() - 1) / num_sms() > MK_MAX_OWN)
    return "n_embd over " + n(MK_MAX_OWN) + " rows for each SM of the GPU";
  if (hidden < C || hidden > 4 * C)  // a page's biases are sized for rows of n_embd columns
    return "its mlp width " + n(hidden) + " is outside [n_embd, 4 n_embd] = [" + n(C) + ", " + n(4 * C) + "]";
  if (hidden * elem_bytes % 16 != 0) return "an mlp row not a multiple of 16 bytes";
  if (n_expert && (n_expert > limits::megakernel_max_experts || top_k < 1 ||
                   top_k > std::min(n_expert, limits::megakernel_max_top_k)))
    return "it decodes mixtures of at most " + n(limits::megakernel_max_experts) + " experts, of which a token takes at most " +
           n(limits::megakernel_max_top_k);
  if (mk_pages(C, hs, elem_bytes, mk_splits(n_head)).count < 2)
    return "more shared memory a block than the GPU has (n_embd too wide: two weight pages must fit)";
  return "";
}

// layers: n_layer * per_layer (limits::megakernel_layer_slots) device pointers, host array, in MkLayer's
// order, nullptr for those the model has none of; with rope_cos and rope_sin (fp32, (>= capacity, hs / 2)) a
// llama model, else gpt (wpe and lnf_b given); hidden: the mlp's width; n_expert 0 (dense), or a mixture's
// experts of which a token takes top_k (router_w given). The caches (n_layer, n_kv_head, capacity, hs); ws:
// decode_megakernel_workspace_floats, zeroed before the first step; trace: nullptr or
// decode_megakernel_trace_stamps(n_layer) ns for each of decode_megakernel_grid() blocks.
template <class T>
void launch::decode_megakernel(const T* const* layers, int per_layer, const T* wte, const T* wpe, const T* lnf_w, const T* lnf_b,
                               const float* rope_cos, const float* rope_sin, T* k_cache, T* v_cache, const int64_t* tok,
                               int64_t* pos, T* logits, float* ws, uint64_t* trace, int n_layer, int C, int n_head,
                               int n_kv_head, int hidden, int n_expert, int top_k, int V, int capacity, float eps,
                               cudaStream_t s) {
  std::string why = decode_megakernel_unsupported(C, n_layer, n_head, n_kv_head, hidden, n_expert, top_k, sizeof(T));
  if (per_layer != limits::megakernel_layer_slots)
    why = std::to_string(limits::megakernel_layer_slots) + " weight slots a layer (limits::megakernel_layer_weights)";
  if (!why.empty()) throw std::runtime_error(std::string("decode_megakernel: ") + why);
  const int hs = C / n_head;
  MkArgs<T> a = {};
  for (int l = 0; l < n_layer; ++l) {
    const T* const* p = layers + limits::megakernel_layer_slots * l;
    std::memcpy(&a.layer[l], p, sizeof(MkLayer<T>));  // slot by slot (MK_SLOT_IS)
  }
  a.wte = wte; a.wpe = wpe; a.lnf_w = lnf_w; a.lnf_b = lnf_b; a.rope_cos = rope_cos; a.rope_sin = rope_sin;
  a.k_cache = k_cache; a.v_cache = v_cache; a.tok = tok; a.pos = pos; a.logits = logits; a.ws = ws;
  a.trace = trace;
  a.box = index_error_box();
  a.n_layer = n_layer; a.C = C; a.n_head = n_head; a.n_kv_head = n_kv_head; a.hs = hs; a.hidden = hidden; a.V = V;
  a.n_expert = n_expert; a.top_k = n_expert ? top_k : 1;
  a.capacity = capacity; a.splits = mk_splits(n_head); a.eps = eps; a.scale = 1.f / sqrtf((float)hs);
  const MkPages pages = mk_pages(C, hs, sizeof(T), a.splits);
  a.pages = pages.count;
  a.page_bytes = pages.bytes;
  const int smem = mk_smem_bytes(C, hs, sizeof(T), a.splits);
  cudaFuncSetAttribute(decode_megakernel_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeCooperative;  // every block resident at once, or the launch fails
  attr.val.cooperative = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(num_sms());
  cfg.blockDim = dim3(MK_THREADS + 32);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  cudaLaunchKernelEx(&cfg, decode_megakernel_kernel<T>, a);
  check_launch("decode_megakernel");
}

template void launch::decode_megakernel<float>(const float* const*, int, const float*, const float*, const float*, const float*,
                                               const float*, const float*, float*, float*, const int64_t*, int64_t*, float*,
                                               float*, uint64_t*, int, int, int, int, int, int, int, int, int, float,
                                               cudaStream_t);
ONE_TEMPLATE(decode_megakernel<float>);
template void launch::decode_megakernel<__nv_bfloat16>(const __nv_bfloat16* const*, int, const __nv_bfloat16*,
                                                       const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*,
                                                       const float*, const float*, __nv_bfloat16*, __nv_bfloat16*,
                                                       const int64_t*, int64_t*, __nv_bfloat16*, float*, uint64_t*, int, int,
                                                       int, int, int, int, int, int, int, float, cudaStream_t);
ONE_TEMPLATE(decode_megakernel<__nv_bfloat16>);


#endif  // KERNELS_LAUNCHERS_ONLY
