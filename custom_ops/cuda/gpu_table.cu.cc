// The CUDA core (gpu_table.h): an open-addressing table with linear probing over a
// power-of-two slot array, keys claimed by 64-bit compare-and-swap; CUB's radix sort
// for dedup.
//
// Lookups run several threads per key (one float4 of the row each), all probing the same
// slots (the reads coalesce) so that no thread waits on another; inserts claim a slot in
// one thread per key, write the initial row, then publish it (`ready`); a reader that
// finds a key whose row is not published yet returns the initial row, which is its value.

#include "custom_ops/cuda/gpu_table.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cub/cub.cuh>
#include <stdexcept>
#include <string>
#include <vector>

namespace tfpsx {
namespace cuda {
namespace {

constexpr int kBlock = 256;
constexpr int kMaxClaims = 64;  // CAS retries of one insert before it counts as failed

int64_t Blocks(int64_t threads) { return (threads + kBlock - 1) / kBlock; }

int64_t RoundUpPow2(int64_t n) {
  int64_t p = 1;
  while (p < n) p <<= 1;
  return p;
}

// Threads per key for a row of dim floats: one float4 (or float) each, a power of two.
int ThreadsPerKey(int64_t dim) {
  const int64_t units = dim % 4 == 0 ? dim / 4 : dim;
  int t = 1;
  while (t < units && t < 32) t <<= 1;
  return t;
}

__device__ inline int64_t LoadKey(const int64_t* keys, int64_t slot) {
  return *reinterpret_cast<const volatile int64_t*>(keys + slot);
}

// The slot holding key, or -1 (stops at an empty slot).
__device__ int64_t Probe(const int64_t* keys, uint64_t mask, int64_t key) {
  const uint64_t h = HashKey(key);
  for (uint64_t p = 0; p <= mask; ++p) {
    const int64_t slot = static_cast<int64_t>((h + p) & mask);
    const int64_t k = LoadKey(keys, slot);
    if (k == key) return slot;
    if (k == kEmptyKey) return -1;
  }
  return -1;
}

// Copies (or draws) the rows of keys at slots into out: tpk threads per key.
__global__ void CopyRowsKernel(const int64_t* keys, const int64_t* slots, int64_t n,
                               const float* values, const int* ready, int64_t dim, int tpk,
                               RowInitializer init, float* out, bool* found,
                               const int64_t* table_keys, uint64_t mask) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t i = t / tpk;
  const int lane = static_cast<int>(t % tpk);
  if (i >= n) return;
  const int64_t key = keys[i];
  // slots == null: probe here (a pure lookup needs no first pass).
  const int64_t slot = slots != nullptr ? slots[i] : Probe(table_keys, mask, key);
  const bool have = slot >= 0 && *reinterpret_cast<const volatile int*>(ready + slot) != 0;
  if (found != nullptr && lane == 0) found[i] = slot >= 0;
  float* row_out = out + i * dim;
  if (!have) {
    if (lane == 0) init(key, row_out, dim);
    return;
  }
  const float* row = values + slot * dim;
  if (dim % 4 == 0) {
    const float4* src = reinterpret_cast<const float4*>(row);
    float4* dst = reinterpret_cast<float4*>(row_out);
    for (int64_t j = lane; j < dim / 4; j += tpk) dst[j] = src[j];
  } else {
    for (int64_t j = lane; j < dim; j += tpk) row_out[j] = row[j];
  }
}

// One thread per key: finds or claims its slot (slots[i], -1 when the table is full).
__global__ void ClaimKernel(const int64_t* keys, int64_t n, int64_t* table_keys, uint64_t mask,
                            float* values, int* ready, int64_t dim, RowInitializer init,
                            unsigned long long* size, int64_t* slots, unsigned long long* failed) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t key = keys[i];
  const uint64_t h = HashKey(key);
  for (int attempt = 0; attempt < kMaxClaims; ++attempt) {
    int64_t free_slot = -1, free_was = kEmptyKey;
    for (uint64_t p = 0; p <= mask; ++p) {
      const int64_t slot = static_cast<int64_t>((h + p) & mask);
      const int64_t k = LoadKey(table_keys, slot);
      if (k == key) {
        slots[i] = slot;
        return;
      }
      if (k == kRemovedKey && free_slot < 0) {
        free_slot = slot;
        free_was = kRemovedKey;
      }
      if (k == kEmptyKey) {
        if (free_slot < 0) free_slot = slot;
        break;
      }
    }
    if (free_slot < 0) break;  // full
    auto* cell = reinterpret_cast<unsigned long long*>(table_keys + free_slot);
    const auto prev = static_cast<int64_t>(
        atomicCAS(cell, static_cast<unsigned long long>(free_was),
                  static_cast<unsigned long long>(key)));
    if (prev == free_was) {  // claimed: draw the row, then publish it
      init(key, values + free_slot * dim, dim);
      __threadfence();
      atomicExch(ready + free_slot, 1);
      atomicAdd(size, 1ULL);
      slots[i] = free_slot;
      return;
    }
    if (prev == key) {  // another thread inserted this key there first
      slots[i] = free_slot;
      return;
    }
    // Another key took the slot: probe again.
  }
  slots[i] = -1;
  if (failed != nullptr) atomicAdd(failed, 1ULL);
}

// row += delta, once the row is published (a claim in flight on another stream is
// running: it publishes without waiting on anything).
__global__ void AddRowsKernel(const int64_t* keys, const int64_t* slots, int64_t n,
                              const float* deltas, float* values, const int* ready,
                              int64_t dim) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= n * dim) return;
  const int64_t i = e / dim;
  const int64_t slot = slots[i];
  if (slot < 0) return;
  while (*reinterpret_cast<const volatile int*>(ready + slot) == 0) {
  }
  atomicAdd(values + slot * dim + e % dim, deltas[e]);
}

__global__ void EvictKernel(const int64_t* keys, int64_t n, int64_t* table_keys, uint64_t mask,
                            int* ready, unsigned long long* size,
                            unsigned long long* removed) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t key = keys[i];
  const int64_t slot = Probe(table_keys, mask, key);
  if (slot < 0) return;
  auto* cell = reinterpret_cast<unsigned long long*>(table_keys + slot);
  atomicExch(ready + slot, 0);
  __threadfence();
  if (static_cast<int64_t>(atomicCAS(cell, static_cast<unsigned long long>(key),
                                     static_cast<unsigned long long>(kRemovedKey))) == key) {
    atomicAdd(size, ~0ULL);  // - 1, modulo 2^64
    if (removed != nullptr) atomicAdd(removed, 1ULL);
  }
}

__global__ void FillKeysKernel(int64_t* keys, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) keys[i] = kEmptyKey;
}

__global__ void IotaKernel(int64_t* out, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = i;
}

__global__ void HeadsKernel(const int64_t* sorted, int64_t n, int64_t* heads) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) heads[i] = (i == 0 || sorted[i] != sorted[i - 1]) ? 1 : 0;
}

__global__ void UniqueScatterKernel(const int64_t* sorted, const int64_t* order,
                                    const int64_t* heads, const int64_t* position, int64_t n,
                                    int64_t* unique, int64_t* inverse) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t at = position[i] - 1;
  if (heads[i]) unique[at] = sorted[i];
  inverse[order[i]] = at;
}

__global__ void GatherKernel(const float* rows, int64_t dim, const int64_t* index, int64_t n,
                             float* out) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e < n * dim) out[e] = rows[index[e / dim] * dim + e % dim];
}

__global__ void ScatterAddKernel(const float* rows, int64_t dim, const int64_t* index, int64_t n,
                                 float* out) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e < n * dim) atomicAdd(out + index[e / dim] * dim + e % dim, rows[e]);
}

cudaStream_t S(Stream s) { return reinterpret_cast<cudaStream_t>(s); }

void Launched(const char* what) { Check(cudaGetLastError(), what); }

// Device scratch memory in stream order: allocated and freed on the stream, so a batch
// needs no synchronization (and batches on several streams get their own).
// held[s] = 1 where slot s holds a key (Export's compaction).
__global__ void HeldKernel(const int64_t* keys, int64_t slots, int64_t* held) {
  const int64_t s = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (s >= slots) return;
  const int64_t k = LoadKey(keys, s);
  held[s] = k != kEmptyKey && k != kRemovedKey;
}

// One thread per float of the slot array: a held slot's key and row go to their place
// in the compacted output (position: the inclusive sum of held).
__global__ void CompactKernel(const int64_t* keys, const float* values, int64_t dim,
                              int64_t slots, const int64_t* held, const int64_t* position,
                              int64_t* out_keys, float* out_rows) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= slots * dim) return;
  const int64_t s = e / dim, j = e % dim;
  if (!held[s]) return;
  const int64_t at = position[s] - 1;
  if (j == 0) out_keys[at] = keys[s];
  out_rows[at * dim + j] = values[e];
}

struct Buffer {
  void* ptr = nullptr;
  cudaStream_t stream;
  Buffer(size_t bytes, cudaStream_t s) : stream(s) {
    if (bytes) Check(cudaMallocAsync(&ptr, bytes, s), "cudaMallocAsync");
  }
  ~Buffer() {
    if (ptr) cudaFreeAsync(ptr, stream);
  }
  template <typename T>
  T* as() const { return static_cast<T*>(ptr); }
};

}  // namespace

void Check(int error, const char* what) {
  if (error != cudaSuccess) {
    throw std::runtime_error(std::string("tfpsx CUDA: ") + what + ": " +
                             cudaGetErrorString(static_cast<cudaError_t>(error)));
  }
}

GpuHashTable::GpuHashTable(int64_t capacity, int64_t dim, RowInitializer init)
    : capacity_(RoundUpPow2(capacity < 2 ? 2 : capacity)), dim_(dim), init_(init) {
  if (dim <= 0) throw std::invalid_argument("GpuHashTable: dim must be > 0");
  Check(cudaMalloc(&keys_, capacity_ * sizeof(int64_t)), "cudaMalloc(keys)");
  Check(cudaMalloc(&values_, capacity_ * dim_ * sizeof(float)), "cudaMalloc(values)");
  Check(cudaMalloc(&ready_, capacity_ * sizeof(int)), "cudaMalloc(ready)");
  Check(cudaMalloc(&size_, sizeof(unsigned long long)), "cudaMalloc(size)");
  FillKeysKernel<<<Blocks(capacity_), kBlock>>>(keys_, capacity_);
  Launched("FillKeysKernel");
  Check(cudaMemset(ready_, 0, capacity_ * sizeof(int)), "cudaMemset(ready)");
  Check(cudaMemset(size_, 0, sizeof(unsigned long long)), "cudaMemset(size)");
  Check(cudaDeviceSynchronize(), "GpuHashTable init");
}

GpuHashTable::~GpuHashTable() {
  cudaFree(keys_);
  cudaFree(values_);
  cudaFree(ready_);
  cudaFree(size_);
}

void GpuHashTable::Find(const int64_t* keys, int64_t n, float* values, bool* found,
                        Stream stream) const {
  if (n == 0) return;
  const int tpk = ThreadsPerKey(dim_);
  CopyRowsKernel<<<Blocks(n * tpk), kBlock, 0, S(stream)>>>(
      keys, nullptr, n, values_, ready_, dim_, tpk, init_, values, found, keys_,
      static_cast<uint64_t>(capacity_ - 1));
  Launched("Find");
}

void GpuHashTable::FindOrInsert(const int64_t* keys, int64_t n, float* values, Stream stream,
                                unsigned long long* failed) {
  if (n == 0) return;
  Buffer slots(n * sizeof(int64_t), S(stream));
  ClaimKernel<<<Blocks(n), kBlock, 0, S(stream)>>>(
      keys, n, keys_, static_cast<uint64_t>(capacity_ - 1), values_, ready_, dim_, init_, size_,
      slots.as<int64_t>(), failed);
  Launched("FindOrInsert claim");
  const int tpk = ThreadsPerKey(dim_);
  CopyRowsKernel<<<Blocks(n * tpk), kBlock, 0, S(stream)>>>(
      keys, slots.as<int64_t>(), n, values_, ready_, dim_, tpk, init_, values, nullptr, keys_,
      static_cast<uint64_t>(capacity_ - 1));
  Launched("FindOrInsert copy");
}

void GpuHashTable::Accumulate(const int64_t* keys, int64_t n, const float* deltas,
                              Stream stream, unsigned long long* failed) {
  if (n == 0) return;
  Buffer slots(n * sizeof(int64_t), S(stream));
  ClaimKernel<<<Blocks(n), kBlock, 0, S(stream)>>>(
      keys, n, keys_, static_cast<uint64_t>(capacity_ - 1), values_, ready_, dim_, init_, size_,
      slots.as<int64_t>(), failed);
  Launched("Accumulate claim");
  AddRowsKernel<<<Blocks(n * dim_), kBlock, 0, S(stream)>>>(keys, slots.as<int64_t>(), n,
                                                              deltas, values_, ready_, dim_);
  Launched("Accumulate add");
}

void GpuHashTable::Evict(const int64_t* keys, int64_t n, Stream stream,
                         unsigned long long* removed) {
  if (n == 0) return;
  EvictKernel<<<Blocks(n), kBlock, 0, S(stream)>>>(
      keys, n, keys_, static_cast<uint64_t>(capacity_ - 1), ready_, size_, removed);
  Launched("Evict");
}

int64_t GpuHashTable::Size(Stream stream) const {
  unsigned long long size = 0;
  Check(cudaMemcpyAsync(&size, size_, sizeof(size), cudaMemcpyDeviceToHost, S(stream)),
        "Size");
  Check(cudaStreamSynchronize(S(stream)), "Size");
  return static_cast<int64_t>(size);
}

int64_t GpuHashTable::Export(int64_t* keys, float* values, Stream stream) const {
  // Compacted on the device (held slots in slot order), so that only the stored rows
  // cross to the host: a copy of the whole slot array would move the unused slots'
  // never-written rows too (compute-sanitizer's initcheck flags them), about half the
  // bytes at the table's load factor.
  cudaStream_t s = S(stream);
  const int64_t slots = capacity_;
  Buffer held(slots * sizeof(int64_t), s), position(slots * sizeof(int64_t), s);
  HeldKernel<<<Blocks(slots), kBlock, 0, s>>>(keys_, slots, held.as<int64_t>());
  Launched("Export held");
  size_t scan_bytes = 0;
  Check(cub::DeviceScan::InclusiveSum(nullptr, scan_bytes, held.as<int64_t>(),
                                      position.as<int64_t>(), static_cast<int>(slots), s),
        "Export scan size");
  {
    Buffer temp(scan_bytes, s);
    Check(cub::DeviceScan::InclusiveSum(temp.ptr, scan_bytes, held.as<int64_t>(),
                                        position.as<int64_t>(), static_cast<int>(slots), s),
          "Export scan");
  }
  int64_t count = 0;
  Check(cudaMemcpyAsync(&count, position.as<int64_t>() + slots - 1, sizeof(count),
                        cudaMemcpyDeviceToHost, s), "Export count");
  Check(cudaStreamSynchronize(s), "Export count");
  if (count == 0) return 0;
  Buffer out_keys(count * sizeof(int64_t), s), out_rows(count * dim_ * sizeof(float), s);
  CompactKernel<<<Blocks(slots * dim_), kBlock, 0, s>>>(
      keys_, values_, dim_, slots, held.as<int64_t>(), position.as<int64_t>(),
      out_keys.as<int64_t>(), out_rows.as<float>());
  Launched("Export compact");
  Check(cudaMemcpyAsync(keys, out_keys.ptr, count * sizeof(int64_t), cudaMemcpyDeviceToHost, s),
        "Export keys");
  Check(cudaMemcpyAsync(values, out_rows.ptr, count * dim_ * sizeof(float),
                        cudaMemcpyDeviceToHost, s), "Export values");
  Check(cudaStreamSynchronize(s), "Export");
  return count;
}

int64_t UniqueKeys(const int64_t* keys, int64_t n, int64_t* unique, int64_t* inverse,
                   Stream stream) {
  if (n == 0) return 0;
  cudaStream_t s = S(stream);
  const size_t bytes = n * sizeof(int64_t);
  Buffer order_in(bytes, s), sorted(bytes, s), order(bytes, s), heads(bytes, s),
      position(bytes, s);
  IotaKernel<<<Blocks(n), kBlock, 0, s>>>(order_in.as<int64_t>(), n);
  Launched("UniqueKeys iota");
  size_t sort_bytes = 0, scan_bytes = 0;
  Check(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, keys, sorted.as<int64_t>(),
                                        order_in.as<int64_t>(), order.as<int64_t>(),
                                        static_cast<int>(n), 0, 64, s), "SortPairs size");
  Check(cub::DeviceScan::InclusiveSum(nullptr, scan_bytes, heads.as<int64_t>(),
                                      position.as<int64_t>(), static_cast<int>(n), s),
        "InclusiveSum size");
  Buffer temp(std::max(sort_bytes, scan_bytes), s);
  Check(cub::DeviceRadixSort::SortPairs(temp.ptr, sort_bytes, keys, sorted.as<int64_t>(),
                                        order_in.as<int64_t>(), order.as<int64_t>(),
                                        static_cast<int>(n), 0, 64, s), "SortPairs");
  HeadsKernel<<<Blocks(n), kBlock, 0, s>>>(sorted.as<int64_t>(), n, heads.as<int64_t>());
  Launched("UniqueKeys heads");
  Check(cub::DeviceScan::InclusiveSum(temp.ptr, scan_bytes, heads.as<int64_t>(),
                                      position.as<int64_t>(), static_cast<int>(n), s),
        "InclusiveSum");
  UniqueScatterKernel<<<Blocks(n), kBlock, 0, s>>>(sorted.as<int64_t>(), order.as<int64_t>(),
                                                   heads.as<int64_t>(), position.as<int64_t>(),
                                                   n, unique, inverse);
  Launched("UniqueKeys scatter");
  int64_t count = 0;
  Check(cudaMemcpyAsync(&count, position.as<int64_t>() + n - 1, sizeof(count),
                        cudaMemcpyDeviceToHost, s), "UniqueKeys count");
  Check(cudaStreamSynchronize(s), "UniqueKeys");
  return count;
}

void GatherRows(const float* rows, int64_t dim, const int64_t* index, int64_t n, float* out,
                Stream stream) {
  if (n == 0) return;
  GatherKernel<<<Blocks(n * dim), kBlock, 0, S(stream)>>>(rows, dim, index, n, out);
  Launched("GatherRows");
}

void ScatterAddRows(const float* rows, int64_t dim, const int64_t* index, int64_t n, float* out,
                    Stream stream) {
  if (n == 0) return;
  ScatterAddKernel<<<Blocks(n * dim), kBlock, 0, S(stream)>>>(rows, dim, index, n, out);
  Launched("ScatterAddRows");
}

}  // namespace cuda
}  // namespace tfpsx
