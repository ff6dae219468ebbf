// tfpsx's CUDA core for the embedding hot path, TF-free (the GPU machines have no
// TensorFlow): id dedup, a GPU open-addressing hash table for a worker cache, and
// gather / scatter-add of rows. Every pointer argument is device memory and every call
// only enqueues work on `stream`, unless it says it synchronizes.
//
// The table draws a missing key's row with the CPU table's initializer
// (custom_ops/cc/core/initializer.h: a pure function of seed and key), so a row
// inserted on the GPU equals the CPU table's, bit for bit up to the device's
// sinf/cosf/logf ulps. Keys are int64; two values are reserved (kEmptyKey, kRemovedKey).
//
// Concurrency: Find, FindOrInsert and Accumulate may run on several streams at once
// (an insert claims a slot with one compare-and-swap; a row becomes readable when its
// initial value is written). Evict must not overlap an insert on another stream (a slot
// it frees may be taken again).

#ifndef TFPSX_CUDA_GPU_TABLE_H_
#define TFPSX_CUDA_GPU_TABLE_H_

#include <stdint.h>

#include "custom_ops/cc/core/initializer.h"

struct CUstream_st;

namespace tfpsx {
namespace cuda {

using Stream = CUstream_st*;  // a cudaStream_t; null: the legacy default stream

constexpr int64_t kEmptyKey = INT64_MIN;        // a free slot
constexpr int64_t kRemovedKey = INT64_MIN + 1;  // an evicted key's slot (reusable)

// Throws std::runtime_error naming the call when CUDA reports an error.
void Check(int error, const char* what);

class GpuHashTable {
 public:
  // `capacity` slots (rounded up to a power of two, >= 2 * expected keys keeps probes
  // short) of `dim` floats each; throws std::runtime_error when memory is short.
  GpuHashTable(int64_t capacity, int64_t dim, RowInitializer init);
  ~GpuHashTable();
  GpuHashTable(const GpuHashTable&) = delete;
  GpuHashTable& operator=(const GpuHashTable&) = delete;

  int64_t capacity() const { return capacity_; }
  int64_t dim() const { return dim_; }

  // values[n * dim] = the rows of keys[n]; a missing key gets its initial row and
  // found[i] = false (found may be null).
  void Find(const int64_t* keys, int64_t n, float* values, bool* found, Stream stream) const;

  // Like Find, inserting missing keys with their initial rows. A key that finds no free
  // slot (a full table) gets its initial row, is not stored, and counts in *failed
  // (a device counter; may be null).
  void FindOrInsert(const int64_t* keys, int64_t n, float* values, Stream stream,
                    unsigned long long* failed = nullptr);

  // row += deltas[i] for keys[n] (repeats add up); a missing key starts from its
  // initial row. A key with no free slot counts in *failed.
  void Accumulate(const int64_t* keys, int64_t n, const float* deltas, Stream stream,
                  unsigned long long* failed = nullptr);

  // Evicts keys[n]: their slots are freed; *removed counts those present (may be null).
  void Evict(const int64_t* keys, int64_t n, Stream stream,
             unsigned long long* removed = nullptr);

  // Keys stored. Synchronizes the stream.
  int64_t Size(Stream stream) const;

  // Every stored key and its row, to host memory (keys[capacity], values[capacity * dim]
  // sized by the caller); returns how many. Synchronizes. For tests and checkpoints.
  int64_t Export(int64_t* keys, float* values, Stream stream) const;

 private:
  int64_t capacity_, dim_;
  RowInitializer init_;
  int64_t* keys_ = nullptr;        // [capacity]
  float* values_ = nullptr;        // [capacity * dim]
  int* ready_ = nullptr;           // [capacity]: the row holds its value
  unsigned long long* size_ = nullptr;  // [1]: keys stored
};

// Dedup: unique[u] (sorted ascending) and inverse[n] (keys[i] == unique[inverse[i]]) of
// keys[n]; returns u. Synchronizes the stream.
int64_t UniqueKeys(const int64_t* keys, int64_t n, int64_t* unique, int64_t* inverse,
                   Stream stream);

// out[i * dim ..] = rows[index[i] * dim ..] for i < n.
void GatherRows(const float* rows, int64_t dim, const int64_t* index, int64_t n, float* out,
                Stream stream);

// out[index[i] * dim ..] += rows[i * dim ..] for i < n (atomic: repeated indexes add up).
void ScatterAddRows(const float* rows, int64_t dim, const int64_t* index, int64_t n, float* out,
                    Stream stream);

}  // namespace cuda
}  // namespace tfpsx

#endif  // TFPSX_CUDA_GPU_TABLE_H_
