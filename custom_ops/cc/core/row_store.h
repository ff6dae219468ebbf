// A stripe's rows: fixed-size chunks of records [key int64 | step int64 | freq uint32 |
// value and slot floats], so that (a) a lookup touches one index slot and one record,
// with the key beside the value, and (b) growth never copies rows nor leaves a doubled
// vector's spare half behind: the slack is at most one chunk per stripe. A chunk holds a
// power of two of records, up to 512 and at most kMaxChunkBytes unless one record is
// larger (then one record): a narrow table takes 512 rows at once, a table of 12 MB
// rows one row at a time. Records are kept dense (ids 0..size-1). Not thread-safe: the
// stripe's lock guards it.

#ifndef TFPSX_CORE_ROW_STORE_H_
#define TFPSX_CORE_ROW_STORE_H_

#include <cstdint>
#include <cstring>
#include <vector>

#include "custom_ops/cc/core/chunk_pool.h"

namespace tfpsx {

class RowStore {
 public:
  static constexpr int64_t kMaxChunkShift = 9;  // at most 512 records per chunk
  static constexpr int64_t kMaxChunkBytes = int64_t{64} << 10;
  static constexpr int64_t kHeaderBytes = 20;

  // Bytes of one record of `row_width` floats.
  static int64_t RecordBytes(int64_t row_width) {
    return kHeaderBytes + row_width * static_cast<int64_t>(sizeof(float));
  }
  // log2 of the records per chunk (see the file comment).
  static int64_t ChunkShift(int64_t record_bytes) {
    int64_t shift = kMaxChunkShift;
    while (shift > 0 && (record_bytes << shift) > kMaxChunkBytes) --shift;
    return shift;
  }

  explicit RowStore(int64_t row_width)
      : stride_(RecordBytes(row_width)),
        chunk_shift_(ChunkShift(stride_)),
        chunk_mask_((int64_t{1} << chunk_shift_) - 1) {}
  ~RowStore() { Clear(); }
  RowStore(const RowStore&) = delete;
  RowStore& operator=(const RowStore&) = delete;

  int64_t record_bytes() const { return stride_; }
  int64_t chunk_rows() const { return chunk_mask_ + 1; }
  int64_t chunk_bytes() const { return chunk_rows() * stride_; }
  // Where chunks come from (set once, before the first Append).
  void set_pool(ChunkPool* pool) { pool_ = pool; }

  int64_t size() const { return size_; }
  char* record(int64_t r) const {
    return chunks_[r >> chunk_shift_] + (r & chunk_mask_) * stride_;
  }
  int64_t key(int64_t r) const { return Load<int64_t>(record(r)); }
  int64_t step(int64_t r) const { return Load<int64_t>(record(r) + 8); }
  uint32_t freq(int64_t r) const { return Load<uint32_t>(record(r) + 16); }
  void set_key(int64_t r, int64_t v) { Store(record(r), v); }
  void set_step(int64_t r, int64_t v) { Store(record(r) + 8, v); }
  void set_freq(int64_t r, uint32_t v) { Store(record(r) + 16, v); }
  float* row(int64_t r) const { return reinterpret_cast<float*>(record(r) + kHeaderBytes); }

  // Appends a zeroed record; returns its id.
  int64_t Append(int64_t key) {
    if ((size_ >> chunk_shift_) == static_cast<int64_t>(chunks_.size()))
      chunks_.push_back(pool_->Get());
    const int64_t r = size_++;
    std::memset(record(r), 0, stride_);
    set_key(r, key);
    return r;
  }
  // Copies record src over dst (whole record: key, metadata, row).
  void CopyRecord(int64_t dst, int64_t src) { std::memcpy(record(dst), record(src), stride_); }
  void PopBack() {
    --size_;
    if (static_cast<int64_t>(chunks_.size()) > (size_ >> chunk_shift_) + 1) {
      pool_->Put(chunks_.back());
      chunks_.pop_back();
    }
  }
  void Clear() {
    for (char* c : chunks_) pool_->Put(c);
    chunks_.clear();
    size_ = 0;
  }

 private:
  template <typename T>
  static T Load(const char* p) {
    T v;
    std::memcpy(&v, p, sizeof(T));
    return v;
  }
  template <typename T>
  static void Store(char* p, T v) {
    std::memcpy(p, &v, sizeof(T));
  }

  const int64_t stride_;
  const int64_t chunk_shift_;
  const int64_t chunk_mask_;
  int64_t size_ = 0;
  ChunkPool* pool_ = nullptr;
  std::vector<char*> chunks_;
};

}  // namespace tfpsx

#endif  // TFPSX_CORE_ROW_STORE_H_
