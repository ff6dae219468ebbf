// tfpsx dynamic embedding table: int64 keys -> float32 rows of `dim`, TF-free.
//
// The table composes a StripedStore (striped_store.h: lock stripes, open-addressing
// index, chunked records), a RowInitializer (initializer.h) and a ChangeLog
// (change_log.h), and keeps the policies over rows:
// - a row is [value | num_slots optimizer slot vectors], dim floats each, with a
//   frequency counter and the step of its last update;
// - a missing key's initial row is a pure function of (seed, key), so every PS and every
//   restart draws the same row;
// - admission: with min_frequency > 1 a key is only counted until it has been seen that
//   often; until then it has no row and lookups return its initial row;
// - eviction: rows not updated since a step, or all but the N most frequent;
// - checkpoint tracking (incremental checkpoints): once a full checkpoint export arms
//   it, every row written since (inserted, updated, counted by a lookup, imported) is
//   marked in a per-stripe bitmap by row id, and every removed key is kept, so that a
//   delta export returns exactly what changed without a hash set on the write path.
// Optimizers are row functors (optimizers.h) that reach the rows through ApplyGradients;
// optimizer_registry.h finds them by name.
//
// Thread safety: every public method may be called concurrently; readers of a stripe
// share its lock, writers take it alone.

#ifndef TFPSX_CORE_HASH_TABLE_H_
#define TFPSX_CORE_HASH_TABLE_H_

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "custom_ops/cc/core/change_log.h"
#include "custom_ops/cc/core/initializer.h"
#include "custom_ops/cc/core/record_batch.h"
#include "custom_ops/cc/core/striped_store.h"

namespace tfpsx {

struct TableOptions {
  int64_t dim = 0;
  int num_slots = 0;           // optimizer slot vectors per row
  std::vector<float> slot_init;  // initial value of each slot (size num_slots)
  InitKind init = InitKind::kZeros;
  float init_a = 0.f;          // constant value / uniform low / normal mean
  float init_b = 0.f;          // uniform high / normal stddev
  uint64_t seed = 0;
  int64_t min_frequency = 1;   // admission: sightings before a key gets a row
  int num_stripes = 64;        // lock stripes (power of two)
  // Keys one stripe may hold (row ids take 24 bits of an index slot); lower it to cap a
  // table's memory. A write that would pass it fails (std::length_error), storing nothing
  // for that key.
  int64_t max_stripe_rows = kMaxRowsPerStripe;
  // Rows to reserve up front (0: none, the table grows as keys arrive). The index is
  // sized for them and their row memory is mapped and faulted in when the table is
  // built, so inserts up to that size neither rehash nor page-fault (on Linux VMs a
  // first-touch fault of 4 KiB costs 1.3-2 us: ~30 ns per 84-byte row of dim 16).
  int64_t capacity = 0;
};

// Returns "" when the options are usable, else what is wrong.
std::string ValidateOptions(const TableOptions& options);

struct ExportedRows {
  std::vector<int64_t> keys;
  std::vector<float> values;     // n * dim
  std::vector<float> slots;      // n * num_slots * dim
  std::vector<int64_t> freq;     // n
  std::vector<int64_t> step;     // n: step of the last update
};

// A checkpoint export (HashTable::CheckpointExport).
// A paged export's page bounds from where the rows lie: marks of (key, rows from that
// key on), in any order. Returns b_1 < ... < b_m (above INT64_MIN), which split the keys
// into the pages (-inf, b_1), [b_1, b_2), ..., [b_m, +inf) of about max_rows rows each
// (a mark's rows are counted whole in the page its key falls in).
std::vector<int64_t> PageBounds(std::vector<std::pair<int64_t, int64_t>> marks,
                                int64_t max_rows);

struct CheckpointRows {
  ExportedRows rows;             // sorted by key
  // Sorted: keys removed since the previous export and absent now (a key removed that
  // the previous export did not hold may be among them; removing it again is harmless).
  std::vector<int64_t> removed;
  // False when a delta was asked of a table not tracking since its last full export (a
  // new process, or a clear in between): the rows are then not a delta; save a full one.
  bool complete = true;
};

class HashTable {
 public:
  // Throws std::runtime_error when options.capacity cannot be reserved.
  explicit HashTable(const TableOptions& options);
  ~HashTable();
  HashTable(const HashTable&) = delete;
  HashTable& operator=(const HashTable&) = delete;

  const TableOptions& options() const { return options_; }
  int64_t dim() const { return options_.dim; }
  // Floats per row: the value and its slots.
  int64_t row_width() const { return row_width_; }

  // The initial row of `key` (deterministic in seed and key) into out[dim].
  void InitialRow(int64_t key, float* out) const { initializer_(key, out, options_.dim); }

  // Rows of keys[n] into out[n*dim]; a missing key gets its initial row (or zeros when
  // use_initializer is false). found[n] (may be null) says which keys were present.
  void Find(const int64_t* keys, int64_t n, float* out, bool* found,
            bool use_initializer = true) const;

  // Like Find, with each row's optimizer slots: out[n*row_width()] holds [value | slots]
  // per key; a missing key gets its initial row and slot_init. GEO reads the PS's rows
  // so, when the workers share their optimizer state (see AccumulateWithSlots).
  void FindWithSlots(const int64_t* keys, int64_t n, float* out, bool* found) const;
  // Worker cache lookup: like Find (found[n] required), and a present key is touched: its
  // frequency counted and its step set to `step` (LFU / LRU bookkeeping for CacheVictims).
  // Nothing is inserted, and touching is not a change (TakeChanged does not see it).
  void CacheFind(const int64_t* keys, int64_t n, int64_t step, float* out, bool* found);

  // The keys of the `count` rows a cache evicts first, without removing them: the lowest
  // frequency, then the oldest step (by_step false: LFU), or the oldest step, then the
  // lowest frequency (by_step true: LRU); last, the larger key goes first, so the choice
  // is deterministic. All keys when count >= size.
  std::vector<int64_t> CacheVictims(int64_t count, bool by_step) const;

  // Like Find, but a missing key is inserted with its initial row (subject to
  // admission) and every key's frequency is counted.
  void FindOrInsert(const int64_t* keys, int64_t n, int64_t step, float* out);

  // Sets the rows of keys[n] to values[n*dim], inserting missing keys.
  void Insert(const int64_t* keys, int64_t n, const float* values, int64_t step);
  // Like Insert, with each row's optimizer slots: rows[n*row_width()] hold [value | slots]
  // per key, written whole (a GEO copy takes the PS's rows with their shared optimizer
  // state exactly, in one pass).
  void InsertWithSlots(const int64_t* keys, int64_t n, const float* rows, int64_t step);

  // How Accumulate adds the deltas several writers push to one row (GEO's workers push
  // the deltas of their local copies; `skip_reader` is then the pusher's reader). The
  // other pushes: the c combined (not kSum) pushes that marked the row for the pusher
  // since its last TakeChanged, i.e. since it last pulled the row. A delta no other push
  // met stays whole in every mode. Keys of one combined push must be unique.
  enum class Combine {
    kSum,  // every delta whole
    // the mean: the others moved the row by m in all; it moves by (delta - m) / (1 + c),
    // to the pulled value + (their deltas + delta) / (1 + c) when they combined so too.
    // Exact when every push started from the same value (GEO's rounds with barriers), in
    // any order.
    kMean,
    // delta / (1 + c): for pushes from different values (GEO's background communicator),
    // where the mean would pull the row back towards each pusher's stale copy.
    kScaled,
  };

  // row += delta for keys[n] (combined by `combine`); a missing key starts from its
  // initial row. The keys are marked changed for every reader of the change log but
  // `skip_reader` (-1: none).
  void Accumulate(const int64_t* keys, int64_t n, const float* deltas, int64_t step,
                  int64_t skip_reader = -1, Combine combine = Combine::kSum);

  // [value | slots] += deltas[n*row_width()] for keys[n], every delta whole (Combine::kSum);
  // a missing key starts from its initial row and slot_init. GEO's push when its workers
  // share their optimizer state: a slot that sums over the gradients (Adagrad's
  // accumulator) then holds every worker's, as in async, and each worker's steps stay
  // async's size (with local accumulators a worker's steps are ~sqrt(N) of async's).
  void AccumulateWithSlots(const int64_t* keys, int64_t n, const float* deltas, int64_t step,
                           int64_t skip_reader = -1);
  // Training: update(row, grad) on the row of every key of keys[n] (expected unique),
  // `row` being [value | slots] (row_width() floats) and `grad` grads + i * dim. A missing
  // key starts from its initial row and slot_init; with admission on (min_frequency > 1)
  // it gets no row and its gradient is dropped. Throws std::length_error like Insert.
  template <typename RowFn>
  void ApplyGradients(const int64_t* keys, int64_t n, const float* grads, int64_t step,
                      RowFn&& update);

  // Removes keys[n]; returns how many were present.
  int64_t Remove(const int64_t* keys, int64_t n);

  int64_t Size() const;

  // Every row, with slots and metadata. Keys come out sorted, so exports are stable.
  ExportedRows Export() const;
  // Only rows whose last update step is >= since_step.
  ExportedRows ExportSince(int64_t since_step) const;
  // Only rows with lo <= key <= hi (a page of a paged export), sorted by key.
  ExportedRows ExportRange(int64_t lo, int64_t hi) const;
  // The rows of keys[n] that are present, sorted by key.
  ExportedRows ExportKeys(const int64_t* keys, int64_t n) const;
  // Every `stride`-th row's key in storage order (a sample of the keys), unsorted.
  std::vector<int64_t> Keys(int64_t stride = 1) const;

  // Replaces (clear_first) or merges rows. Sizes must match n, n*dim, n*num_slots*dim
  // (slots may be empty: slots then start from slot_init). Returns "" or an error.
  std::string Import(const int64_t* keys, int64_t n, const float* values, const float* slots,
                     int64_t slots_len, const int64_t* freq, const int64_t* step,
                     bool clear_first);

  // Incremental checkpoints. full: every row (like Export) and arms tracking; else the
  // rows written and the keys removed since the previous CheckpointExport (complete ==
  // false when no full export armed tracking since the last clear: see CheckpointRows).
  // Either way the marks are cleared, stripe by stripe under its lock, so each write
  // lands in exactly one export.
  CheckpointRows CheckpointExport(bool full);
  // A paged delta (tiered_table.h): CheckpointExport(false), with only the keys of the
  // rows written (rows.keys, sorted), not their rows.
  CheckpointRows CheckpointDeltaKeys();
  // What a full CheckpointExport does to the marks, without its rows: a paged full
  // export (its rows then read by key range, ExportRange) is the next delta's base. A
  // row written after this is in the next delta (and perhaps in a page too: applying
  // it twice is harmless).
  void ArmTracking();

  // Keys changed since `reader`'s previous call (change_log.h).
  std::vector<int64_t> TakeChanged(int64_t reader) { return changes_.Take(reader); }
  // Of those, the keys among keys[n]; the others stay marked (change_log.h).
  std::vector<int64_t> TakeChangedAmong(int64_t reader, const int64_t* keys, int64_t n) {
    return changes_.TakeAmong(reader, keys, n);
  }

  // Eviction: removes rows not updated since step < min_step; returns how many.
  int64_t EvictOlderThan(int64_t min_step);
  // Eviction: keeps the `keep` most frequent rows (ties: smaller key kept); returns removed.
  int64_t EvictToTopN(int64_t keep);

  // Removes keys[n] counted as evicted (a policy's choice, as EvictToTopN's).
  int64_t EvictKeys(const int64_t* keys, int64_t n) {
    return RemoveKeys(keys, n, /*count_as_evicted=*/true);
  }

  // Moving rows between RAM and a disk tier (tiered_table.h), as no change of the table:
  // neither the change log nor checkpoint tracking sees a row leave or come back as a
  // removal or a write. present[n]: whether each key has a row here.
  void Present(const int64_t* keys, int64_t n, bool* present) const;
  // Appends the rows of keys[n] (present ones, in no particular order) to `out`, whole,
  // with dirty[i] = 1 when the row was written since the last checkpoint export, and
  // removes them.
  void TakeRows(const int64_t* keys, int64_t n, RecordBatch* out, std::vector<uint8_t>* dirty);
  // Adds the rows of `in` back (a key already here keeps its row), marked for the next
  // incremental checkpoint where dirty[i] is 1.
  void PutRows(const RecordBatch& in, const std::vector<uint8_t>& dirty);
  // The keys of the `count` least recently updated rows of lock stripe `stripe` (the
  // oldest step, then the lowest frequency, then the larger key), not removed: a disk
  // tier spills stripe by stripe, so that choosing costs one stripe's scores, not the
  // table's.
  std::vector<int64_t> StripeVictims(int stripe, int64_t count) const;
  int num_stripes() const { return store_.num_stripes(); }
  int64_t StripeSize(int stripe) const;
  // (frequency, key) of every row, appended to `out` (EvictToTopN over RAM and disk).
  void Frequencies(std::vector<std::pair<uint32_t, int64_t>>* out) const;
  // Gives the memory of removed rows back to the system (ChunkPool::Trim).
  void TrimMemory() { store_.TrimMemory(); }
  // What the table may hold resident: indexes and row memory, less what was trimmed.
  int64_t ResidentBytes() const { return store_.ResidentBytes(); }

  // Counters since construction.
  int64_t admitted() const;
  int64_t evicted() const;
  // Keys seen but not yet admitted.
  int64_t pending_admission() const;

  // Memory accounting: what the rows held take (records: key, metadata, value, slots;
  // plus the index), and all the table holds (index plus every block of row memory
  // mapped: reserved capacity, chunks not filled yet). Used <= reserved.
  int64_t UsedBytes() const { return store_.UsedBytes(); }
  int64_t ReservedBytes() const { return store_.ReservedBytes(); }

 private:
  // Per-stripe policy state, kept at the stripe's id and guarded by its lock. Aligned to
  // a cache line: threads writing different stripes must not share one.
  struct alignas(64) StripeState {
    std::unordered_map<int64_t, uint32_t> pending;  // admission: sightings so far
    int64_t admitted = 0;
    int64_t evicted = 0;
    // Checkpoint tracking (CheckpointExport): armed by a full export, disarmed by a clear.
    bool tracked = false;
    std::vector<uint64_t> dirty;          // bit r: row r written since the last export
    std::unordered_set<int64_t> removed;  // keys removed since the last export
  };

  // Checkpoint tracking of stripe s (its lock held): row r was written.
  void MarkRow(const Stripe& s, int64_t r) {
    StripeState& st = stripe_state_[s.id];
    if (!st.tracked) return;
    const size_t word = static_cast<size_t>(r >> 6);
    if (word >= st.dirty.size()) st.dirty.resize(word + 1 + (word >> 1), 0);
    st.dirty[word] |= uint64_t{1} << (r & 63);
  }
  bool RowMarked(const StripeState& st, int64_t r) const {
    const size_t word = static_cast<size_t>(r >> 6);
    return word < st.dirty.size() && (st.dirty[word] >> (r & 63) & 1);
  }
  // Removes row r of s (its lock held), keeping the checkpoint marks with their rows (the
  // last row takes r's id) and the key as removed.
  // `as_removal` false: the row leaves for a disk tier, not recorded as removed.
  void RemoveTrackedRow(Stripe& s, int64_t r, bool as_removal = true);
  // Appends row r of s to `out`.
  void AppendRow(const Stripe& s, int64_t r, ExportedRows& out) const;
  // CheckpointExport's pass over the stripes (its marks taken): emit(stripe, row) for
  // each row it exports; returns removed and complete.
  template <typename Emit>
  CheckpointRows CheckpointPass(bool full, Emit&& emit);
  // `raw` ordered by key.
  ExportedRows SortedByKey(ExportedRows raw) const;

  // Adds a missing key's row at the probe's free slot `empty`: its initial value (when
  // init_value), slots at slot_init, frequency `freq`, admission bookkeeping. May throw
  // std::length_error (a full stripe).
  int64_t NewRow(Stripe& s, int64_t key, uint64_t h, uint64_t empty, bool init_value,
                 uint32_t freq);
  int64_t RemoveKeys(const int64_t* keys, int64_t n, bool count_as_evicted);
  // Runs fn(row, i) on the row of every key; a missing key is first asked fn(nullptr, i)
  // whether it gets a row (admission), which starts from its initial row when init_value.
  // Sets each written row's step and marks its key changed (as a push with `push`, giving
  // the rows' increments `moved`, n * dim floats, when not null: change_log.h).
  template <typename Fn>
  void UpdateRows(const int64_t* keys, int64_t n, const float* stream, int64_t step,
                  bool init_value, Fn&& fn, int64_t skip_reader = -1, bool push = false,
                  const float* moved = nullptr);

  TableOptions options_;
  int64_t row_width_;  // dim * (1 + num_slots)
  RowInitializer initializer_;
  StripedStore store_;
  std::vector<StripeState> stripe_state_;  // one per stripe of store_
  ChangeLog changes_;
  // Held by a combined Accumulate from reading the other pushes to marking its own, so
  // that two parallel pushes see each other.
  std::mutex combine_mu_;
};

template <typename Fn>
void HashTable::UpdateRows(const int64_t* keys, int64_t n, const float* stream, int64_t step,
                           bool init_value, Fn&& fn, int64_t skip_reader, bool push,
                           const float* moved) {
  const bool track = changes_.active();
  std::vector<int64_t> changed, at;
  if (track) changed.reserve(n);
  if (track && moved != nullptr) at.reserve(n);
  store_.ForEachByStripe<true>(keys, n, stream, options_.dim,
                               [&](Stripe& s, int64_t i, uint64_t h) {
    const int64_t key = keys[i];
    uint64_t empty = Stripe::kNoSlot;
    int64_t r = s.FindRow(key, h, &empty);
    if (r < 0) {
      if (!fn(nullptr, i)) return;
      r = NewRow(s, key, h, empty, init_value, 1);  // without init_value fn overwrites it
    }
    fn(s.rows.row(r), i);
    s.rows.set_step(r, step);
    MarkRow(s, r);
    if (track) changed.push_back(key);
    if (track && moved != nullptr) at.push_back(i);
  });
  if (!track) return;
  std::vector<float> increments;
  if (moved != nullptr) {  // in the order of `changed`
    const int64_t dim = options_.dim;
    increments.resize(at.size() * dim);
    for (size_t c = 0; c < at.size(); ++c) {
      std::copy_n(moved + at[c] * dim, dim, increments.data() + c * dim);
    }
  }
  changes_.Mark(changed.data(), static_cast<int64_t>(changed.size()), skip_reader, push,
                moved != nullptr ? increments.data() : nullptr, options_.dim);
}

template <typename RowFn>
void HashTable::ApplyGradients(const int64_t* keys, int64_t n, const float* grads, int64_t step,
                               RowFn&& update) {
  const int64_t dim = options_.dim;
  const bool create = options_.min_frequency <= 1;
  UpdateRows(keys, n, grads, step, /*init_value=*/true, [&](float* row, int64_t i) {
    if (row == nullptr) return create;
    update(row, grads + i * dim);
    return true;
  });
}

}  // namespace tfpsx

#endif  // TFPSX_CORE_HASH_TABLE_H_
