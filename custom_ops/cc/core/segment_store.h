// A tiered table's disk rows: immutable segment files, each a sorted run of whole rows.
//
// A segment is written once, by one call, from rows sorted by key: a 64-byte header,
// then records [key int64 | step int64 | freq uint32 | value and slot floats] (the RAM
// table's record, row_store.h), in groups of kGroupRecords records or fewer. RAM keeps
// per segment the first key of each group (its fences: 8 bytes per group) and one bit
// per record saying that the row went back to RAM or away (dead). A row's place in its
// group is the key index's (key_index.h): a lookup finds the group from the fences and
// reads that one record. A read of many keys is one batch: the records are sorted,
// those close together merged into one read, and the reads submitted together (the
// page cache is the OS's, outside the process's RSS; no mmap, whose pages would count
// in it). Segments are never rewritten in place: a compaction writes the live records
// of some into a new one and drops them.
//
// Errors (a directory that cannot be written, a full disk) throw std::runtime_error
// naming the file and the system's reason; a failed write leaves no segment behind.
// Not thread-safe: the tiered table's lock guards it (RunRead excepted: it touches
// nothing of the store).

#ifndef TFPSX_CORE_SEGMENT_STORE_H_
#define TFPSX_CORE_SEGMENT_STORE_H_

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "custom_ops/cc/core/key_index.h"
#include "custom_ops/cc/core/record_batch.h"

namespace tfpsx {

class SegmentStore {
 public:
  static constexpr int64_t kHeaderBytes = 64;
  // A group: about kGroupBytes of records, at least kMinGroupRecords (fences then cost
  // at most 8 / kMinGroupRecords bytes a key) and at most kGroupRecords (a record's
  // place in its group is 5 bits of its index entry).
  static constexpr int64_t kGroupBytes = 4096;
  static constexpr int64_t kMinGroupRecords = 6;
  static constexpr int64_t kGroupRecords = 32;
  static_assert(kGroupRecords == KeyIndex::kMaxSlot + 1, "a slot names a record of a group");
  static constexpr int64_t kMaxRunBytes = int64_t{1} << 20;  // one pread at most
  // Records of one segment at most this many bytes apart are read by one read (the
  // bytes between cost less than another request).
  static constexpr int64_t kMergeGapBytes = 1024;

  SegmentStore(std::string directory, int64_t width);
  ~SegmentStore();
  SegmentStore(const SegmentStore&) = delete;
  SegmentStore& operator=(const SegmentStore&) = delete;

  // Creates the directory (and its parents, 0700), takes the folder for this store (an
  // exclusive flock on <directory>/LOCK, which names the owner's pid and host, held
  // until the store is destroyed) and removes the segment files a previous process left
  // there: a tiered table's disk rows belong to its process, a restart restores its
  // checkpoint. Throws std::runtime_error when it cannot, naming the owner when another
  // open store (this process's or another's) holds the folder; then nothing in the
  // folder was changed.
  void Open();
  const std::string& directory() const { return directory_; }

  // Writes batch (unique keys) as a new segment, its records in the order `order` gives
  // (indexes into batch, sorted by key), or as they are (already sorted) when null;
  // returns its id.
  int32_t Write(const RecordBatch& batch, const std::vector<int64_t>* order = nullptr);

  // One lookup: `key` at place `slot` of its group in segment `segment` (the key
  // index's candidate); ReadMany fills record (-1: not there or dead).
  struct Request {
    int64_t key;
    int32_t segment;
    int32_t slot;
    int64_t record = -1;   // out
  };
  // Finds every request's record; found rows are appended to `into` in disk order
  // (and `found_at` gets each one's request index).
  void ReadMany(std::vector<Request>* requests, RecordBatch* into,
                std::vector<int64_t>* found_at);

  // An open segment file. A read holds it: a segment dropped during a read keeps its
  // file open (unlinked) until the read lets go.
  struct File {
    int fd = -1;
    std::string path;
    ~File();
  };
  // A batch read in three parts, so that its I/O can run without the table's lock
  // (a prefetch): PlanRead (under the lock) finds the groups to read and holds their
  // files; RunRead (any thread, nothing shared) reads them and finds the requests'
  // records, live or not; the caller then keeps, under the lock again, the hits that
  // are still Live (a record killed, or its segment dropped, meanwhile is not).
  struct Read {
    struct Run {
      std::shared_ptr<const File> file;
      int32_t segment;
      uint64_t number;               // the segment's file number (ids are reused)
      int64_t begin, end;            // records [begin, end)
      size_t first_want, end_want;   // wants[first_want, end_want)
    };
    struct Want {
      int64_t request;
      int64_t record;
    };
    struct Hit {
      int64_t request;
      int32_t segment;
      uint64_t number;
      int64_t record;
    };
    std::vector<Run> runs;
    std::vector<Want> wants;
    int64_t record_bytes = 0;
    std::vector<Hit> hits;  // RunRead's, in disk order; their rows are rows'
    RecordBatch rows;
    int64_t bytes_read = 0, read_calls = 0;
  };
  Read PlanRead(const std::vector<Request>& requests) const;
  // Throws std::runtime_error naming the file when a read fails.
  static void RunRead(const std::vector<Request>& requests, Read* read);
  // Whether `record` of the segment `segment` with file number `number` is still live.
  bool Live(int32_t segment, uint64_t number, int64_t record) const;
  // Adds a read's I/O to the store's counters.
  void Count(const Read& read) {
    bytes_read_ += read.bytes_read;
    read_calls_ += read.read_calls;
  }

  // Every live record of `segment`, read sequentially: fn(record, key, step, freq, row).
  template <typename Fn>
  void Scan(int32_t segment, Fn&& fn) {
    ScanRecords(segment, 0, segs_[segment]->count,
                [&](int64_t record, int64_t key, int64_t step, uint32_t freq,
                    const float* row) {
                  fn(record, key, step, freq, row);
                  return true;
                });
  }
  // The live records of `segment` with lo <= key <= hi, in key order: only the groups
  // their fences say may hold such keys are read (a page of a paged export).
  template <typename Fn>
  void ScanRange(int32_t segment, int64_t lo, int64_t hi, Fn&& fn);
  // fn(first key, records) of every group of every segment: where the disk's keys lie,
  // from RAM alone (a paged export's page bounds).
  template <typename Fn>
  void ForEachGroup(Fn&& fn) const;

  void MarkDead(int32_t segment, int64_t record);
  // Removes the segment's file and state.
  void Drop(int32_t segment);
  void DropAll();

  std::vector<int32_t> segments() const;
  int64_t live(int32_t segment) const { return segs_[segment]->live; }
  int64_t records(int32_t segment) const { return segs_[segment]->count; }

  int64_t record_bytes() const { return record_bytes_; }
  int64_t group_records() const { return group_records_; }
  int64_t live_rows() const { return live_rows_; }
  // RAM held: fences, dead bits, per-segment state.
  int64_t ram_bytes() const;
  int64_t disk_bytes() const { return disk_bytes_; }
  int64_t bytes_written() const { return bytes_written_; }
  int64_t bytes_read() const { return bytes_read_; }
  int64_t read_calls() const { return read_calls_; }

 private:
  struct Segment {
    std::string path;
    std::shared_ptr<const File> file;
    uint64_t number = 0;  // the file's number, seg_<number>.dat
    int64_t count = 0, live = 0;
    std::vector<int64_t> fences;  // first key of each group
    std::vector<uint64_t> dead;   // bit per record
  };
  // Reads bytes at offset, whole; throws std::runtime_error naming the file.
  static void Pread(const File& f, char* buf, int64_t bytes, int64_t offset);
  // The live records of [begin, end) of `segment`, read sequentially:
  // fn(record, key, step, freq, row) returns false to stop.
  template <typename Fn>
  void ScanRecords(int32_t segment, int64_t begin, int64_t end, Fn&& fn);
  bool IsDead(const Segment& s, int64_t r) const { return s.dead[r >> 6] >> (r & 63) & 1; }
  static void ParseRecord(const char* p, int64_t* key, int64_t* step, uint32_t* freq,
                          const float** row);

  void Lock();

  const std::string directory_;
  const int64_t width_, record_bytes_, group_records_;
  int lock_fd_ = -1;
  std::vector<std::unique_ptr<Segment>> segs_;  // by id; null: free id
  uint64_t next_file_ = 0;
  int64_t live_rows_ = 0, disk_bytes_ = 0;
  int64_t bytes_written_ = 0, bytes_read_ = 0, read_calls_ = 0;
};

template <typename Fn>
void SegmentStore::ScanRecords(int32_t segment, int64_t begin, int64_t end, Fn&& fn) {
  const Segment& s = *segs_[segment];
  const int64_t per_read = std::max<int64_t>(1, kMaxRunBytes / record_bytes_);
  std::vector<char> buf;
  for (int64_t first = begin; first < end; first += per_read) {
    const int64_t n = std::min(per_read, end - first);
    buf.resize(static_cast<size_t>(n * record_bytes_));
    Pread(*s.file, buf.data(), n * record_bytes_, kHeaderBytes + first * record_bytes_);
    bytes_read_ += n * record_bytes_;
    ++read_calls_;
    for (int64_t i = 0; i < n; ++i) {
      if (IsDead(s, first + i)) continue;
      int64_t key, step;
      uint32_t freq;
      const float* row;
      ParseRecord(buf.data() + i * record_bytes_, &key, &step, &freq, &row);
      if (!fn(first + i, key, step, freq, row)) return;
    }
  }
}

template <typename Fn>
void SegmentStore::ScanRange(int32_t segment, int64_t lo, int64_t hi, Fn&& fn) {
  const Segment& s = *segs_[segment];
  if (lo > hi || s.fences.empty() || hi < s.fences.front()) return;
  // Groups from the one lo falls in to the one hi falls in.
  const auto first = std::upper_bound(s.fences.begin(), s.fences.end(), lo);
  const int64_t g0 = std::max<int64_t>(0, first - s.fences.begin() - 1);
  const int64_t g1 = std::upper_bound(s.fences.begin(), s.fences.end(), hi) -
                     s.fences.begin();  // one past the last
  ScanRecords(segment, g0 * group_records_, std::min(s.count, g1 * group_records_),
              [&](int64_t record, int64_t key, int64_t step, uint32_t freq,
                  const float* row) {
                if (key > hi) return false;  // sorted: nothing further is in range
                if (key >= lo) fn(record, key, step, freq, row);
                return true;
              });
}

template <typename Fn>
void SegmentStore::ForEachGroup(Fn&& fn) const {
  for (const auto& s : segs_) {
    if (s == nullptr) continue;
    for (size_t g = 0; g < s->fences.size(); ++g) {
      const int64_t first = static_cast<int64_t>(g) * group_records_;
      fn(s->fences[g], std::min(group_records_, s->count - first));
    }
  }
}

}  // namespace tfpsx

#endif  // TFPSX_CORE_SEGMENT_STORE_H_
