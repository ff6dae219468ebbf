// A table larger than its RAM: hot rows in a HashTable, the rest on local disk.
//
// The HashTable keeps serving every row operation; this class moves rows between it and
// the disk around them (the TF kernels call FaultIn before an operation on keys and
// Settle after):
// - FaultIn(keys): the keys' rows that are on disk come back to RAM whole (value, slots,
//   frequency, step), read in one batch (segment_store.h); their disk copies die. A key
//   the disk does not hold costs no read (key_index.h).
// - Settle(): when the resident bytes pass the high-water mark, the least recently
//   updated rows leave whole, in segments of at most kSpillBytes, down to the low-water
//   mark; then a bounded compaction rewrites the live rows of the emptiest segments.
// RAM counted against ram_bytes: the HashTable's resident bytes (rows, slots, index),
// the key index (4.2-8 bytes a disk key), the segments' fences and dead bits (1 bit a
// record, 8 bytes a group of at most 32), the set of disk rows changed since the last
// checkpoint.
// Buffers of one spill or compaction (at most kSpillBytes each) are the fixed overhead.
//
// A row is either in RAM or live on disk, never both: FaultIn kills the disk copy it
// reads, so the disk never serves a row older than RAM's. The disk files belong to the
// process: Open removes what an earlier one left; a restart restores its checkpoint.
//
// Thread safety: none of its own; the caller holds one lock over FaultIn, the operation
// and Settle (TableResource does), so rows cannot leave between FaultIn and their use.

#ifndef TFPSX_CORE_TIERED_TABLE_H_
#define TFPSX_CORE_TIERED_TABLE_H_

#include <algorithm>
#include <cstdint>
#include <string>
#include <unordered_set>
#include <vector>

#include "custom_ops/cc/core/hash_table.h"
#include "custom_ops/cc/core/key_index.h"
#include "custom_ops/cc/core/segment_store.h"

namespace tfpsx {

struct TierOptions {
  std::string directory;   // this shard's own folder
  int64_t ram_bytes = 0;   // the shard's RAM budget
  double high_water = 0.9;  // fractions of ram_bytes
  double low_water = 0.75;
};

struct TierStats {
  int64_t ram_bytes = 0;        // what counts against the budget now
  int64_t disk_rows = 0;        // live rows on disk
  int64_t disk_bytes = 0;       // segment files' bytes
  int64_t bytes_written = 0;    // by spills and compactions
  int64_t bytes_spilled = 0;    // of rows moved to disk (spills only)
  int64_t bytes_read = 0;
  int64_t read_calls = 0;
  int64_t rows_spilled = 0;
  int64_t rows_faulted = 0;
  int64_t segments = 0;
  int64_t index_bytes = 0;
  int64_t index_rebuilds = 0;  // the key index rebuilt larger from the disk's keys
};

class TieredTable {
 public:
  static constexpr int64_t kSpillBytes = int64_t{1} << 20;
  // A page of a paged export holds about this fraction of ram_bytes of rows (its copies
  // on the way out take a few times that).
  static constexpr int64_t kPageFraction = 32;

  // `hot` outlives this. Throws std::invalid_argument for unusable options.
  TieredTable(HashTable* hot, TierOptions options);

  // The least ram_bytes a tier over `hot` works with: each lock stripe keeps a partly
  // filled chunk of rows (row_store.h), and the key index starts at its least size.
  static int64_t MinRamBytes(const HashTable& hot);

  // Prepares the directory (segment_store.h's Open). Throws std::runtime_error.
  void Open();

  // Brings the rows of keys[n] that are on disk into RAM. Throws std::length_error when
  // the rows of the keys not in RAM (read back or new) could not fit between the
  // high-water mark and ram_bytes (the message says the ram_bytes such a batch needs),
  // std::runtime_error on an I/O error.
  void FaultIn(const int64_t* keys, int64_t n);
  // A read-only lookup's rows that are not in RAM: for every i with found[i] false whose
  // key is on disk, its row (`width` floats: the value, or with slots the whole row)
  // into out[i * width] and found[i] = true; the rows stay on disk. A lookup that trains
  // nothing (an evaluation, a serving read, GEO's pull) then neither needs RAM for its
  // batch nor pushes the training's hot rows out.
  void FindOnDisk(const int64_t* keys, int64_t n, int64_t width, float* out, bool* found);
  // Keys an operation may bring into RAM at once (their rows and index slots fit in the
  // room above the high-water mark): kernels split larger batches into such pieces.
  int64_t KeysPerPiece() const {
    const int64_t room = options_.ram_bytes - static_cast<int64_t>(options_.high_water *
                                                                   options_.ram_bytes);
    return std::max<int64_t>(1, room / (RecordBytes() + 8));
  }
  // Moves rows to disk when over the high-water mark; compacts. The rows of keys[n] (the
  // operation's own, just used) stay: a lookup's rows are the next apply's. So do the
  // last prefetch's.
  void Settle(const int64_t* keys = nullptr, int64_t n = 0);

  // Prefetch: the disk rows of a coming batch brought into RAM ahead of its step, the
  // reads done without the table's lock, so that they overlap the operations of the
  // step before (another thread, another core). In three calls:
  //   PlanPrefetch  (under the lock) which keys are not in RAM, where their rows are;
  //   ReadPrefetch  (no lock) the reads;
  //   PlacePrefetch (under the lock) the rows still live on disk go to RAM (a row an
  //                 operation brought back meanwhile, or one that moved, is skipped);
  //                 returns how many; then Settle(prefetch.keys).
  // At most KeysPerPiece() keys of a batch are prefetched (a prefetch is a hint: the
  // rest come in with their operation). The rows placed stay in RAM through Settle
  // until the next prefetch. Throws std::runtime_error on an I/O error (nothing moved).
  struct Prefetch {
    std::vector<int64_t> keys;  // the keys not in RAM, sorted
    std::vector<SegmentStore::Request> requests;
    SegmentStore::Read read;
  };
  Prefetch PlanPrefetch(const int64_t* keys, int64_t n);
  static void ReadPrefetch(Prefetch* prefetch) {
    SegmentStore::RunRead(prefetch->requests, &prefetch->read);
  }
  int64_t PlacePrefetch(Prefetch* prefetch);

  // The table's operations over every row, RAM and disk together.
  int64_t Size() const { return hot_->Size() + store_.live_rows(); }
  ExportedRows ExportSince(int64_t since_step);
  CheckpointRows CheckpointExport(bool full);
  // A paged export, so that a full checkpoint or a serving export of a shard larger than
  // its RAM needs a page of RAM, not the shard's size: PageBounds splits the keys into
  // pages of about max_rows rows (PageBounds in hash_table.h; 0: PageRows()), from the
  // segments' fences and a sample of RAM's keys; ExportRange is one page's rows (lo <=
  // key <= hi), RAM's and disk's, sorted by key, moving none. ArmTracking does what a
  // full CheckpointExport does to the marks, without its rows (a paged full checkpoint).
  int64_t PageRows() const {
    return std::max<int64_t>(1, options_.ram_bytes / kPageFraction / RecordBytes());
  }
  std::vector<int64_t> PageBounds(int64_t max_rows) const;
  ExportedRows ExportRange(int64_t lo, int64_t hi);
  void ArmTracking();
  // A paged delta checkpoint: BeginDelta takes CheckpointExport(false)'s marks and
  // returns its removed keys and complete flag, keeping the keys of the rows written
  // since the last export (no rows); DeltaBounds splits those keys into pages of
  // max_rows (0: PageRows()); DeltaRange is one page's rows (lo <= key <= hi), read where
  // they are now, in RAM or on disk. A row written again meanwhile is in the next delta
  // too. CheckpointExport(false) is the three in one step.
  CheckpointRows BeginDelta();
  std::vector<int64_t> DeltaBounds(int64_t max_rows) const;
  ExportedRows DeltaRange(int64_t lo, int64_t hi);
  std::string Import(const int64_t* keys, int64_t n, const float* values, const float* slots,
                     int64_t slots_len, const int64_t* freq, const int64_t* step,
                     bool clear_first);
  // Removes keys[n] from RAM and disk (without bringing disk rows back); returns how
  // many were present.
  int64_t Remove(const int64_t* keys, int64_t n);
  int64_t EvictOlderThan(int64_t min_step);
  int64_t EvictToTopN(int64_t keep);
  int64_t evicted() const { return evicted_; }

  // Once, when a Settle left RAM above ram_bytes with no row left to move (what stays
  // in RAM regardless: the disk keys' index, the stripes' chunks, the operation's own
  // rows): a message naming the figures; "" otherwise.
  std::string TakeWarning();

  TierStats Stats() const;
  const TierOptions& options() const { return options_; }
  int64_t RamBytes() const;

 private:
  // A batch read's requests for keys[n]: one per index entry matching a key (its file).
  std::vector<SegmentStore::Request> Lookups(const int64_t* keys, int64_t n) const;
  // The key index, full, rebuilt larger from every live disk row (a scan of the
  // segments). An I/O error leaves it lost: every later lookup throws (CheckIndex),
  // never a disk row taken for a new one; an Import that clears the table starts a new
  // one (a restore).
  void RebuildIndex();
  void CheckIndex() const;
  // The keys of keys[n] not in RAM, sorted, unique.
  std::vector<int64_t> Missing(const int64_t* keys, int64_t n) const;
  // Rows of `missing` (sorted, unique, not in RAM) that are on disk, read and killed
  // there; dirty flags beside them.
  void ReadOut(const std::vector<int64_t>& missing, RecordBatch* rows,
               std::vector<uint8_t>* dirty);
  // The hits of a finished read (ReadOut's, a prefetch's) still live on disk: appended
  // to rows (dirty flags beside) and killed there.
  void TakeLive(SegmentStore::Read* read, RecordBatch* rows, std::vector<uint8_t>* dirty);
  void Spill(int64_t target_bytes, const int64_t* keep, int64_t n_keep);
  void Compact();
  // Every live disk row: fn(segment, record, key, step, freq, row), segment by segment,
  // in each one's key order.
  template <typename Fn>
  void ForEachDiskRow(Fn&& fn);
  // Appends the disk rows of keys (sorted) to out, without moving them.
  void PeekRows(const std::vector<int64_t>& keys, ExportedRows* out);
  // Disk rows updated at since_step or later, sorted by key.
  ExportedRows DiskRowsSince(int64_t since_step);
  void AppendRows(const RecordBatch& rows, ExportedRows* out) const;
  static ExportedRows MergeByKey(ExportedRows a, ExportedRows b, int64_t dim, int slots);
  int64_t RecordBytes() const { return 20 + 4 * hot_->row_width(); }

  HashTable* const hot_;
  const TierOptions options_;
  SegmentStore store_;
  KeyIndex index_;
  const int64_t first_buckets_;
  std::string index_error_;  // why the index was lost ("" while it holds)
  int64_t index_rebuilds_ = 0;
  // Disk rows written since the last checkpoint export (they left RAM dirty).
  std::unordered_set<int64_t> dirty_on_disk_;
  // Disk rows evicted since the last checkpoint export (its "removed").
  std::unordered_set<int64_t> removed_on_disk_;
  std::vector<int64_t> prefetched_;  // the last prefetch's keys, sorted: Settle keeps them
  std::vector<int64_t> delta_keys_;  // BeginDelta's written keys, sorted, for DeltaRange
  bool tracking_ = false;  // a full checkpoint export armed incremental ones
  int64_t evicted_ = 0;
  std::string warning_;
  bool warned_ = false;
  int64_t bytes_spilled_ = 0, rows_spilled_ = 0, rows_faulted_ = 0;
};

}  // namespace tfpsx

#endif  // TFPSX_CORE_TIERED_TABLE_H_
