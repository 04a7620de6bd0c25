// groupcoord custom all-reduce kernels for ranks on one node with peer access.
//
// Compiled at run time by NVRTC (device_communicators/nvrtc_compile.py) and,
// where a toolkit exists, by nvcc in the tests. Entry points are extern "C"
// so their symbol names are fixed: gc_allreduce_<algo>_<dtype>_w<world>,
// algo in {oneshot, twoshot}, dtype in {f32, f16, bf16}, world in {2, 4, 6, 8}.
//
// Memory layout of one rank's signal buffer (shared with peers via CUDA IPC):
//   [ Signal | two-shot scratch area (max_size bytes) ]
// The staging/input buffers of every rank are reached through a RankData
// entry (8 device pointers, in absolute rank order) that lives in device memory,
// so a CUDA graph records the entry's address and the pointers can be filled
// in after capture.
//
// No standard headers: NVRTC provides no libc++, and the fp16/bf16 headers come
// from the nvidia-cuda-runtime wheel.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#define GC_DINLINE __device__ __forceinline__

namespace gc {

constexpr int kMaxBlocks = 36;
constexpr int kMaxRanks = 8;
typedef unsigned int FlagType;

// Per-block barrier counters. self_counter[b][peer] counts barriers this rank
// has passed in block b (one counter per peer thread, so no shared memory is
// needed to broadcast it). peer_counter[parity][b][peer] is written by `peer`
// when it reaches a barrier. Two parity sets: a fast rank already at barrier
// N+1 writes into the other set, so it cannot overwrite the value a slow rank
// still waits for at barrier N. It cannot get to N+2 before every rank has
// left N+1, so two sets are enough.
struct Signal {
  alignas(128) FlagType self_counter[kMaxBlocks][kMaxRanks];
  alignas(128) FlagType peer_counter[2][kMaxBlocks][kMaxRanks];
};

// custom_all_reduce.py reserves this many bytes for the Signal at the start of
// each signal buffer; the two-shot scratch area starts right after the struct.
static_assert(sizeof(Signal) <= 4096, "Signal outgrew the space reserved for it");

struct __align__(16) RankData {
  const void* ptrs[kMaxRanks];
};

struct __align__(16) RankSignals {
  Signal* signals[kMaxRanks];
};

// 16-byte packed vectors: every thread moves 16 bytes per load/store.
template <typename T, int sz>
struct __align__(alignof(T) * sz) array_t {
  T data[sz];
  static constexpr int size = sz;
};

template <typename T>
struct packed_t {
  typedef array_t<T, 16 / sizeof(T)> P;      // what is loaded/stored
  typedef array_t<float, 16 / sizeof(T)> A;  // fp32 accumulator
};

GC_DINLINE float upcast_s(float v) { return v; }
GC_DINLINE float upcast_s(__half v) { return __half2float(v); }
GC_DINLINE float upcast_s(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
GC_DINLINE T downcast_s(float v);
template <>
GC_DINLINE float downcast_s<float>(float v) { return v; }
template <>
GC_DINLINE __half downcast_s<__half>(float v) { return __float2half(v); }
template <>
GC_DINLINE __nv_bfloat16 downcast_s<__nv_bfloat16>(float v) { return __float2bfloat16(v); }

template <typename P, typename A>
GC_DINLINE A upcast(const P& val) {
  A out;
#pragma unroll
  for (int i = 0; i < P::size; i++) out.data[i] = upcast_s(val.data[i]);
  return out;
}

template <typename T, typename P, typename A>
GC_DINLINE P downcast(const A& val) {
  P out;
#pragma unroll
  for (int i = 0; i < P::size; i++) out.data[i] = downcast_s<T>(val.data[i]);
  return out;
}

// Sums element idx of every rank's input in absolute rank order 0..ngpus-1,
// accumulating in fp32: every rank computes bit-identical results.
template <typename T, int ngpus>
GC_DINLINE typename packed_t<T>::P packed_reduce(const typename packed_t<T>::P* const* ptrs,
                                                 int idx) {
  typedef typename packed_t<T>::P P;
  typedef typename packed_t<T>::A A;
  A acc = upcast<P, A>(ptrs[0][idx]);
#pragma unroll
  for (int r = 1; r < ngpus; r++) {
    A val = upcast<P, A>(ptrs[r][idx]);
#pragma unroll
    for (int i = 0; i < A::size; i++) acc.data[i] += val.data[i];
  }
  return downcast<T, P, A>(acc);
}

// Flag accesses. release/acquire at system scope order this rank's earlier
// global writes (the two-shot scratch area) before the flag, as seen from a
// peer GPU over NVLink/PCIe; volatile only guarantees the access is not cached
// in registers or L1, which is enough where no data hand-off rides on the flag.
GC_DINLINE void st_flag_release(FlagType* addr, FlagType v) {
  asm volatile("st.release.sys.global.u32 [%1], %0;" ::"r"(v), "l"(addr));
}
GC_DINLINE FlagType ld_flag_acquire(FlagType* addr) {
  FlagType v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(addr));
  return v;
}
GC_DINLINE void st_flag_volatile(FlagType* addr, FlagType v) {
  asm volatile("st.volatile.global.u32 [%1], %0;" ::"r"(v), "l"(addr));
}
GC_DINLINE FlagType ld_flag_volatile(FlagType* addr) {
  FlagType v;
  asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(addr));
  return v;
}

// Cross-GPU barrier of block blockIdx.x of every rank. Thread t < ngpus talks
// to rank t (itself included). is_start: entry barrier (every rank's input is
// complete because each rank reaches it only after its own stream finished
// writing the input). need_fence: data written before the barrier is read by
// peers after it, so the flag store must release and the load acquire.
template <int ngpus, bool is_start, bool need_fence = false>
GC_DINLINE void multi_gpu_barrier(const RankSignals& sg, Signal* self_sg, int rank) {
  if (!is_start) __syncthreads();  // the whole block finished its part first
  if (threadIdx.x < ngpus) {
    FlagType val = self_sg->self_counter[blockIdx.x][threadIdx.x] += 1;
    FlagType* peer_slot = &sg.signals[threadIdx.x]->peer_counter[val % 2][blockIdx.x][rank];
    FlagType* self_slot = &self_sg->peer_counter[val % 2][blockIdx.x][threadIdx.x];
    if (need_fence) {
      st_flag_release(peer_slot, val);
      while (ld_flag_acquire(self_slot) != val) {
      }
    } else {
      st_flag_volatile(peer_slot, val);
      while (ld_flag_volatile(self_slot) != val) {
      }
    }
  }
  if (is_start || need_fence) __syncthreads();
}

template <typename P>
GC_DINLINE P* scratch(Signal* sg) {
  return reinterpret_cast<P*>(sg + 1);
}

// One-shot: every rank reads every peer's whole input and writes the sum.
// size counts 16-byte packs. The end barrier keeps a fast rank from
// overwriting its staging buffer (next call) while a peer still reads it.
template <typename T, int ngpus>
GC_DINLINE void one_shot(const RankData* dp_in, RankSignals sg, Signal* self_sg,
                         T* __restrict__ result, int rank, int size) {
  typedef typename packed_t<T>::P P;
  const P* ptrs[ngpus];
#pragma unroll
  for (int r = 0; r < ngpus; r++) ptrs[r] = reinterpret_cast<const P*>(dp_in->ptrs[r]);
  multi_gpu_barrier<ngpus, true>(sg, self_sg, rank);
  for (int idx = blockIdx.x * blockDim.x + threadIdx.x; idx < size; idx += gridDim.x * blockDim.x) {
    reinterpret_cast<P*>(result)[idx] = packed_reduce<T, ngpus>(ptrs, idx);
  }
  multi_gpu_barrier<ngpus, false>(sg, self_sg, rank);
}

// Two-shot: reduce-scatter (rank r sums part r into its own scratch area),
// barrier with release/acquire, then all-gather every part from the owners'
// scratch areas. The last rank's part also takes the remainder. No end
// barrier: inputs are not read after the middle barrier, and a peer's scratch
// is only rewritten after the next call's entry barrier, which it cannot pass
// before this rank finished this kernel (same stream).
template <typename T, int ngpus>
GC_DINLINE void two_shot(const RankData* dp_in, RankSignals sg, Signal* self_sg,
                         T* __restrict__ result, int rank, int size) {
  typedef typename packed_t<T>::P P;
  int tid = blockIdx.x * blockDim.x + threadIdx.x;
  int stride = gridDim.x * blockDim.x;
  int part = size / ngpus;
  int start = rank * part;
  int end = rank == ngpus - 1 ? size : start + part;
  int largest_part = part + size % ngpus;
  const P* ptrs[ngpus];
  P* tmps[ngpus];
#pragma unroll
  for (int r = 0; r < ngpus; r++) {
    ptrs[r] = reinterpret_cast<const P*>(dp_in->ptrs[r]);
    tmps[r] = scratch<P>(sg.signals[r]);
  }
  P* tmp_out = tmps[rank];
  multi_gpu_barrier<ngpus, true>(sg, self_sg, rank);
  for (int idx = start + tid; idx < end; idx += stride) {
    tmp_out[idx - start] = packed_reduce<T, ngpus>(ptrs, idx);
  }
  multi_gpu_barrier<ngpus, false, true>(sg, self_sg, rank);
  for (int idx = tid; idx < largest_part; idx += stride) {
#pragma unroll
    for (int i = 0; i < ngpus; i++) {
      // Start with the own part then rotate, so ranks do not all read the same peer.
      int src = (rank + i) % ngpus;
      if (src == ngpus - 1 || idx < part) {
        reinterpret_cast<P*>(result)[src * part + idx] = tmps[src][idx];
      }
    }
  }
}

}  // namespace gc

#define GC_INSTANTIATE(TNAME, T, N)                                                           \
  extern "C" __global__ void __launch_bounds__(512, 1) gc_allreduce_oneshot_##TNAME##_w##N( \
      const gc::RankData* dp, gc::RankSignals sg, gc::Signal* self_sg, T* result, int rank,  \
      int size) {                                                                            \
    gc::one_shot<T, N>(dp, sg, self_sg, result, rank, size);                                 \
  }                                                                                          \
  extern "C" __global__ void __launch_bounds__(512, 1) gc_allreduce_twoshot_##TNAME##_w##N( \
      const gc::RankData* dp, gc::RankSignals sg, gc::Signal* self_sg, T* result, int rank,  \
      int size) {                                                                            \
    gc::two_shot<T, N>(dp, sg, self_sg, result, rank, size);                                 \
  }

#define GC_INSTANTIATE_WORLDS(TNAME, T) \
  GC_INSTANTIATE(TNAME, T, 2)           \
  GC_INSTANTIATE(TNAME, T, 4)           \
  GC_INSTANTIATE(TNAME, T, 6)           \
  GC_INSTANTIATE(TNAME, T, 8)

GC_INSTANTIATE_WORLDS(f32, float)
GC_INSTANTIATE_WORLDS(f16, __half)
GC_INSTANTIATE_WORLDS(bf16, __nv_bfloat16)
