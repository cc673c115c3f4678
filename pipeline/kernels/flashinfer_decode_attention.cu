// FlashInfer's batch decode kernel behind the ABI of recipe `qwen.decode_attention_region@2`
//
//   run(q, k_cache, v_cache, kv_len, out)
//     q        [1, Hq, 1, D]   BF16 or FP16, already scaled (softmax scale 1.0)
//     k_cache  [1, Hkv, C, D]  same dtype, a fixed capacity C; query head h reads KV head h / (Hq/Hkv)
//     v_cache  [1, Hkv, C, D]
//     kv_len   [1]             INT32 on the device: keys 0 .. kv_len[0]-1 are attended
//     out      [1, Hq, 1, D]   softmax(q k^T) v
//
// Built by `trtmc kernel export flashinfer-decode-attention` against the headers of a pinned,
// unmodified FlashInfer release (FLASHINFER_INCLUDE on the include path); D = 128 (HEAD_DIM).
//
// How the cache becomes FlashInfer's paged cache without a copy: the cache is read as C / P pages
// of P keys in FlashInfer's HND layout, with the page stride P*D and the head stride C*D, so page
// p holds keys p*P .. p*P+P-1 of every head where they already are; the page table is the
// identity. How the length stays on the device: FlashInfer's kernel takes the page count
// (indptr), the last page's fill and its split plan (chunk size, valid chunks, partial offsets)
// from device memory, so a one-block kernel writes them from kv_len before each call. The split
// rule is FlashInfer's own CUDA-graph plan evaluated on the device: chunk slots = its grid limit
// over the KV heads (asked once per device, from its work estimation), pages per chunk = the
// fewest (at least 128 keys) that cover the active pages in that many chunks. Nothing is
// allocated, nothing read back to the host, no synchronization: the call can be captured in a
// CUDA graph. The plan, page table and partials live in static device buffers, as FlashInfer's
// workspace would: two calls must not run at once on different streams of one device.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <flashinfer/attention/decode.cuh>
#include <flashinfer/attention/default_decode_params.cuh>
#include <flashinfer/attention/scheduler.cuh>
#include <flashinfer/attention/variants.cuh>
#include <flashinfer/page.cuh>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include <exception>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#ifndef TRTMC_BUILD_INFO
#define TRTMC_BUILD_INFO "{}"
#endif
// How this library was built (FlashInfer's version, where its headers came from, the flags), as
// JSON in a section of its own: `trtmc kernel inspect` and the gates read it from the file
// without loading the library.
extern "C" __attribute__((used, section(".trtmc_build"))) const char trtmc_build_info[] =
    TRTMC_BUILD_INFO;

namespace {

using tvm::ffi::TensorView;

constexpr uint32_t kHeadDim = 128;
constexpr uint32_t kMaxPages = 1u << 16;      // page table entries: C / P
constexpr uint32_t kMaxSlots = 1024;           // chunk slots (FlashInfer's padded batch)
constexpr uint32_t kPartialRows = 1u << 14;    // slots * Hq partial rows of D outputs
constexpr uint32_t kPageSizes[] = {64, 32, 16, 8, 4, 2, 1};

struct Plan {
  int32_t indptr[2];
  int32_t last_page_len[1];
  int32_t o_indptr[2];
  int32_t kv_chunk_size[1];
  int32_t request_indices[kMaxSlots];
  int32_t kv_tile_indices[kMaxSlots];
  bool block_valid_mask[kMaxSlots];
};

__device__ Plan g_plan;
__device__ int32_t g_pages[kMaxPages];
__device__ __nv_bfloat16 g_partial_o[kPartialRows * kHeadDim];  // the output dtype's 16 bits
__device__ float g_partial_lse[kPartialRows];

// Writes the plan for this call's length: FlashInfer's page count and last-page fill, its split
// (chunk size in keys, which chunk slots hold work) and the identity page table of the pages used.
__global__ void WritePlan(const int32_t* __restrict__ kv_len, int32_t capacity, int32_t page_size,
                          int32_t slots) {
  Plan& p = g_plan;
  const int32_t len = max(0, min(kv_len[0], capacity));
  const int32_t pages = (len + page_size - 1) / page_size;
  const int32_t min_pages = max(128 / page_size, 1);
  const int32_t per_chunk = max((pages + slots - 1) / slots, min_pages);
  const int32_t chunks = (max(pages, 1) + per_chunk - 1) / per_chunk;
  for (int32_t i = threadIdx.x; i < pages; i += blockDim.x) g_pages[i] = i;
  for (int32_t i = threadIdx.x; i < slots; i += blockDim.x) {
    p.request_indices[i] = 0;
    p.kv_tile_indices[i] = i;
    p.block_valid_mask[i] = i < chunks && len > 0;
  }
  if (threadIdx.x == 0) {
    p.indptr[0] = 0;
    p.indptr[1] = pages;
    p.last_page_len[0] = len - max(pages - 1, 0) * page_size;  // 0 keys: pages 0, fill P - P
    if (pages == 0) p.last_page_len[0] = page_size;
    p.o_indptr[0] = 0;
    p.o_indptr[1] = len > 0 ? chunks : 0;
    p.kv_chunk_size[0] = per_chunk * page_size;
  }
}

std::string Shape(const TensorView& t) {
  std::ostringstream os;
  os << "[";
  for (int32_t i = 0; i < t.ndim(); ++i) os << (i ? ", " : "") << t.size(i);
  os << "]";
  return os.str();
}

// The device address of a static buffer (the host never touches its contents).
template <typename T>
T* DevicePointer(T& symbol) {
  void* at = nullptr;
  cudaError_t err = cudaGetSymbolAddress(&at, symbol);
  if (err != cudaSuccess) {
    TVM_FFI_THROW(RuntimeError) << "flashinfer decode attention: cannot address its device buffers: "
                                << cudaGetErrorString(err);
  }
  return static_cast<T*>(at);
}

template <typename T, size_t N>
T* DevicePointer(T (&symbol)[N]) {
  return *DevicePointer<T[N]>(symbol);
}

// FlashInfer's grid limit over the KV heads for this kernel on `device` (its CUDA-graph plan's
// padded batch), from its own work estimation, asked once per device and group size.
template <uint32_t kGroup, typename Params, typename Variant>
uint32_t ChunkSlots(int device, uint32_t heads) {
  static std::mutex mutex;
  static std::vector<uint32_t> known;  // by device index; 0: not asked yet
  std::lock_guard<std::mutex> hold(mutex);
  if (known.size() <= size_t(device)) known.resize(size_t(device) + 1, 0);
  if (known[device] == 0) {
    bool split = false;
    uint32_t grid = 0, pages_per_batch = 0, batch = 0, gdy = 0;
    int32_t indptr[2] = {0, 1};
    cudaError_t err = flashinfer::BatchDecodeWithPagedKVCacheWorkEstimationDispatched<
        kGroup, kHeadDim, flashinfer::PosEncodingMode::kNone, Variant, Params>(
        split, grid, pages_per_batch, batch, gdy, 1, indptr, heads, 1, true, nullptr);
    if (err != cudaSuccess || gdy == 0) {
      TVM_FFI_THROW(RuntimeError) << "flashinfer decode attention: FlashInfer's work estimation "
                                     "failed: " << cudaGetErrorString(err);
    }
    known[device] = std::max<uint32_t>(1, std::min<uint32_t>(grid / gdy, kMaxSlots));
  }
  return known[device];
}

template <typename T, uint32_t kGroup>
void Attend(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& kv_len,
            const TensorView& out, uint32_t page_size) {
  using Params = flashinfer::BatchDecodeParams<T, T, T, int32_t>;
  using Variant = flashinfer::DefaultAttention<false, false, false, false>;
  const uint32_t heads = q.size(1), kv_heads = k.size(1), capacity = k.size(2);
  const int device = q.device().device_id;
  const uint32_t slots = std::min<uint32_t>(ChunkSlots<kGroup, Params, Variant>(device, heads),
                                            kPartialRows / heads);
  cudaStream_t stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, device));

  WritePlan<<<1, 256, 0, stream>>>(static_cast<const int32_t*>(kv_len.data_ptr()), capacity,
                                   page_size, slots);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    TVM_FFI_THROW(RuntimeError) << "flashinfer decode attention: plan launch failed: "
                                << cudaGetErrorString(err);
  }
  Plan* plan = DevicePointer(g_plan);
  // page p of head h starts at h*C*D + p*P*D: strides (page, head, key) in elements
  const int64_t strides[3] = {int64_t(page_size) * kHeadDim, int64_t(capacity) * kHeadDim, kHeadDim};
  flashinfer::paged_kv_t<T, int32_t> paged_kv(
      kv_heads, page_size, kHeadDim, /*batch_size=*/1, flashinfer::QKVLayout::kHND,
      static_cast<T*>(k.data_ptr()), static_cast<T*>(v.data_ptr()), strides,
      DevicePointer(g_pages), plan->indptr, plan->last_page_len);
  Params params;
  params.q = static_cast<T*>(q.data_ptr());
  params.paged_kv = paged_kv;
  params.o = static_cast<T*>(out.data_ptr());
  params.lse = nullptr;
  params.num_qo_heads = heads;
  params.q_stride_n = heads * kHeadDim;
  params.q_stride_h = kHeadDim;
  params.window_left = -1;
  params.logits_soft_cap = 0.f;
  params.sm_scale = 1.f;  // the query comes scaled
  params.rope_rcp_scale = 1.f;
  params.rope_rcp_theta = 1.f;
  params.request_indices = plan->request_indices;
  params.kv_tile_indices = plan->kv_tile_indices;
  params.o_indptr = plan->o_indptr;
  params.kv_chunk_size_ptr = plan->kv_chunk_size;
  params.block_valid_mask = plan->block_valid_mask;
  params.padded_batch_size = slots;
  err = flashinfer::BatchDecodeWithPagedKVCacheDispatched<kHeadDim, flashinfer::PosEncodingMode::kNone,
                                                          Variant>(
      params, reinterpret_cast<T*>(DevicePointer(g_partial_o)), DevicePointer(g_partial_lse),
      /*enable_pdl=*/false, stream);
  if (err != cudaSuccess) {
    TVM_FFI_THROW(RuntimeError) << "flashinfer decode attention: FlashInfer's decode failed: "
                                << cudaGetErrorString(err);
  }
}

template <typename T>
void AttendGroup(uint32_t group, const TensorView& q, const TensorView& k, const TensorView& v,
                 const TensorView& kv_len, const TensorView& out, uint32_t page_size) {
  switch (group) {  // the group sizes FlashInfer's decode dispatches
    case 1: return Attend<T, 1>(q, k, v, kv_len, out, page_size);
    case 2: return Attend<T, 2>(q, k, v, kv_len, out, page_size);
    case 4: return Attend<T, 4>(q, k, v, kv_len, out, page_size);
    case 8: return Attend<T, 8>(q, k, v, kv_len, out, page_size);
    default:
      TVM_FFI_THROW(ValueError) << "flashinfer decode attention: " << group
                                << " query heads per KV head; this build handles 1, 2, 4 or 8";
  }
}

bool Contiguous(const TensorView& t) {
  int64_t expected = 1;
  for (int32_t i = t.ndim() - 1; i >= 0; --i) {
    if (t.size(i) != 1 && t.stride(i) != expected) return false;
    expected *= t.size(i);
  }
  return true;
}

void Run(TensorView q, TensorView k_cache, TensorView v_cache, TensorView kv_len, TensorView out) {
  const char* who = "flashinfer decode attention";
  const TensorView* all[] = {&q, &k_cache, &v_cache, &kv_len, &out};
  const char* names[] = {"q", "k_cache", "v_cache", "kv_len", "out"};
  for (int i = 0; i < 5; ++i) {
    if (all[i]->device().device_type != kDLCUDA || all[i]->device().device_id != q.device().device_id) {
      TVM_FFI_THROW(ValueError) << who << ": argument '" << names[i] << "' is not on the GPU of q "
                                << "(FlashInfer's kernel runs on CUDA tensors only)";
    }
    if (!Contiguous(*all[i])) {
      TVM_FFI_THROW(ValueError) << who << ": argument '" << names[i] << "' is not contiguous";
    }
  }
  const DLDataType dt = q.dtype();
  const bool bf16 = dt.code == kDLBfloat && dt.bits == 16 && dt.lanes == 1;
  const bool fp16 = dt.code == kDLFloat && dt.bits == 16 && dt.lanes == 1;
  if (!bf16 && !fp16) {
    TVM_FFI_THROW(TypeError) << who << ": q has dtype " << dt << ", expected bfloat16 or float16";
  }
  for (const TensorView* t : {&k_cache, &v_cache, &out}) {
    if (t->dtype() != dt) TVM_FFI_THROW(TypeError) << who << ": q, k_cache, v_cache and out must share one dtype";
  }
  const DLDataType lt = kv_len.dtype();
  if (!(lt.code == kDLInt && lt.bits == 32 && lt.lanes == 1) || kv_len.ndim() != 1 || kv_len.size(0) != 1) {
    TVM_FFI_THROW(TypeError) << who << ": kv_len is " << lt << " " << Shape(kv_len) << ", expected int32 [1]";
  }
  if (q.ndim() != 4 || q.size(0) != 1 || q.size(2) != 1 || q.size(3) != kHeadDim) {
    TVM_FFI_THROW(ValueError) << who << ": q is " << Shape(q) << ", expected [1, Hq, 1, " << kHeadDim << "]";
  }
  if (k_cache.ndim() != 4 || k_cache.size(0) != 1 || k_cache.size(3) != kHeadDim ||
      k_cache.size(1) <= 0 || q.size(1) % k_cache.size(1) != 0) {
    TVM_FFI_THROW(ValueError) << who << ": k_cache is " << Shape(k_cache) << ", expected [1, Hkv, C, "
                              << kHeadDim << "] with Hq = " << q.size(1) << " a multiple of Hkv";
  }
  if (Shape(v_cache) != Shape(k_cache) || Shape(out) != Shape(q)) {
    TVM_FFI_THROW(ValueError) << who << ": v_cache " << Shape(v_cache) << " must be like k_cache "
                              << Shape(k_cache) << " and out " << Shape(out) << " like q " << Shape(q);
  }
  const int64_t capacity = k_cache.size(2);
  uint32_t page_size = 0;
  for (uint32_t p : kPageSizes) {
    if (capacity % p == 0 && capacity / p <= kMaxPages) { page_size = p; break; }
  }
  if (page_size == 0 || capacity <= 0 || q.size(1) > int64_t(kPartialRows)) {
    TVM_FFI_THROW(ValueError) << who << ": a capacity of " << capacity << " keys and " << q.size(1)
                              << " heads do not fit its page table (at most " << kMaxPages
                              << " pages of up to 64 keys) and partials";
  }
  const uint32_t group = q.size(1) / k_cache.size(1);
  try {
    if (bf16) {
      AttendGroup<__nv_bfloat16>(group, q, k_cache, v_cache, kv_len, out, page_size);
    } else {
      AttendGroup<__half>(group, q, k_cache, v_cache, kv_len, out, page_size);
    }
  } catch (const tvm::ffi::Error&) {
    throw;
  } catch (const std::exception& e) {  // FlashInfer's own errors (FLASHINFER_ERROR)
    TVM_FFI_THROW(RuntimeError) << who << ": " << e.what();
  }
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(run, Run);
