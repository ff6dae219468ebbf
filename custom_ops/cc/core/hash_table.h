// tfpsx dynamic embedding table: int64 keys -> float32 rows of `dim`, TF-free.
//
// The table is split into lock stripes (shards) chosen by the key's hash; each stripe
// is an open-addressing index (linear probing, 32-bit row ids) over chunked records
// [key | step | freq | value | slots], so a key costs its payload plus ~26 bytes
// (12 of metadata, 6-12 of index slot, chunk slack) and a lookup touches one slot and
// one record. Records are kept dense: removing a key moves the last record into its place.
//
// Every row carries `num_slots` optimizer slot vectors of `dim` floats next to its
// value, a frequency counter and the step of its last update. A missing key's initial
// row is a pure function of (seed, key), so every PS and every restart draws the same
// row. Admission: with min_frequency > 1 a key is only counted until it has been seen
// that often; until then it has no row and lookups return its initial row.
//
// Thread safety: every public method may be called concurrently; readers of a stripe
// share its lock, writers take it alone.

#ifndef TFPSX_CORE_HASH_TABLE_H_
#define TFPSX_CORE_HASH_TABLE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace tfpsx {

enum class InitKind { kZeros = 0, kConstant = 1, kUniform = 2, kNormal = 3 };

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
  int64_t max_stripe_rows = (int64_t{1} << 24) - 2;
  // Rows to reserve up front (0: none, the table grows as keys arrive). The index is
  // sized for them and their row memory is mapped and faulted in when the table is
  // built, so inserts up to that size neither rehash nor page-fault (on Linux VMs a
  // first-touch fault of 4 KiB costs 1.3-2 us: ~30 ns per 84-byte row of dim 16).
  int64_t capacity = 0;
};

// Returns "" when the options are usable, else what is wrong.
std::string ValidateOptions(const TableOptions& options);

class ChunkPool;  // where a table's row chunks come from (hash_table.cc)

struct ExportedRows {
  std::vector<int64_t> keys;
  std::vector<float> values;     // n * dim
  std::vector<float> slots;      // n * num_slots * dim
  std::vector<int64_t> freq;     // n
  std::vector<int64_t> step;     // n: step of the last update
};

class HashTable {
 public:
  explicit HashTable(const TableOptions& options);
  ~HashTable();
  HashTable(const HashTable&) = delete;
  HashTable& operator=(const HashTable&) = delete;

  const TableOptions& options() const { return options_; }
  int64_t dim() const { return options_.dim; }

  // The initial row of `key` (deterministic in seed and key) into out[dim].
  void InitialRow(int64_t key, float* out) const;

  // Rows of keys[n] into out[n*dim]; a missing key gets its initial row (or zeros when
  // use_initializer is false). found[n] (may be null) says which keys were present.
  void Find(const int64_t* keys, int64_t n, float* out, bool* found,
            bool use_initializer = true) const;

  // Like Find, but a missing key is inserted with its initial row (subject to
  // admission) and every key's frequency is counted.
  void FindOrInsert(const int64_t* keys, int64_t n, int64_t step, float* out);

  // Sets the rows of keys[n] to values[n*dim], inserting missing keys.
  void Insert(const int64_t* keys, int64_t n, const float* values, int64_t step);

  // row += delta for keys[n]; a missing key starts from its initial row.
  void Accumulate(const int64_t* keys, int64_t n, const float* deltas, int64_t step);

  // Removes keys[n]; returns how many were present.
  int64_t Remove(const int64_t* keys, int64_t n);

  int64_t Size() const;

  // Every row, with slots and metadata. Keys come out sorted, so exports are stable.
  ExportedRows Export() const;
  // Only rows whose last update step is >= since_step.
  ExportedRows ExportSince(int64_t since_step) const;

  // Replaces (clear_first) or merges rows. Sizes must match n, n*dim, n*num_slots*dim
  // (slots may be empty: slots then start from slot_init). Returns "" or an error.
  std::string Import(const int64_t* keys, int64_t n, const float* values, const float* slots,
                     int64_t slots_len, const int64_t* freq, const int64_t* step,
                     bool clear_first);

  // Per-reader change tracking (sparse GEO): every update marks its keys changed for all
  // registered readers; TakeChanged returns a reader's keys changed since its last call
  // and resets them. Readers are registered by their first TakeChanged call.
  std::vector<int64_t> TakeChanged(int64_t reader);

  // Server-side optimizers: apply grads[n*dim] to keys[n] (expected unique). Missing keys
  // are created from their initial row. Slots: Adagrad 1 (accumulator), Adam 2 (m, v),
  // FTRL 2 (z, n accumulators).
  void ApplySgd(const int64_t* keys, int64_t n, const float* grads, float lr, int64_t step);
  void ApplyAdagrad(const int64_t* keys, int64_t n, const float* grads, float lr, float eps,
                    int64_t step);
  void ApplyAdam(const int64_t* keys, int64_t n, const float* grads, float lr, float beta1,
                 float beta2, float eps, int64_t step);
  void ApplyFtrl(const int64_t* keys, int64_t n, const float* grads, float lr, float lr_power,
                 float l1, float l2, int64_t step);

  // Eviction: removes rows not updated since step < min_step; returns how many.
  int64_t EvictOlderThan(int64_t min_step);
  // Eviction: keeps the `keep` most frequent rows (ties: smaller key kept); returns removed.
  int64_t EvictToTopN(int64_t keep);

  // Counters since construction.
  int64_t admitted() const;
  int64_t evicted() const;
  // Keys seen but not yet admitted.
  int64_t pending_admission() const;

  // Bytes held by the table's arrays (capacity), for memory accounting.
  int64_t MemoryBytes() const;

 private:
  struct Stripe;
  Stripe& StripeOf(uint64_t hash) const;
  // Calls fn(stripe, i, hash) for every key, grouped by stripe so that each stripe is
  // locked once per call (shared or exclusive), with the next keys' index slots, records
  // and input rows (stream + i * dim, may be null) prefetched. Outputs are not prefetched:
  // measured slower, the stores do not wait on them.
  template <bool kExclusive, typename Fn>
  void ForEachByStripe(const int64_t* keys, int64_t n, const float* stream, Fn&& fn) const;
  void MarkChanged(const int64_t* keys, int64_t n);
  // Sizes every stripe's index for options_.capacity rows (reserved_slots_) and has the
  // pool map and fault in their row memory.
  void Reserve();
  // Adds a missing key's row at the probe's free slot `empty`: its initial value (when
  // init_value), slots at slot_init, frequency `freq`, admission bookkeeping. May throw
  // std::length_error (a full stripe).
  int64_t NewRow(Stripe& s, int64_t key, uint64_t h, uint64_t empty, bool init_value,
                 uint32_t freq);
  int64_t RemoveKeys(const int64_t* keys, int64_t n, bool count_as_evicted);
  template <typename Fn>
  int64_t SumOverStripes(Fn&& fn) const;
  // The optimizers' shared loop: update(row, grad) for every key's row (admission aside).
  template <typename Fn>
  void ApplyGrads(const int64_t* keys, int64_t n, const float* grads, int64_t step, Fn&& update);
  template <typename Fn>
  // Runs fn(row, i) on the row of every key; a missing key is first asked fn(nullptr, i)
  // whether it gets a row (admission), which starts from its initial row when init_value.
  void UpdateRows(const int64_t* keys, int64_t n, const float* stream, int64_t step,
                  bool init_value, Fn&& fn);

  TableOptions options_;
  int64_t row_width_;  // dim * (1 + num_slots)
  std::unique_ptr<ChunkPool> pool_;  // before stripes_: outlives the chunks they hold
  std::vector<std::unique_ptr<Stripe>> stripes_;
  int stripe_shift_;
  uint64_t reserved_slots_ = 0;  // index slots per stripe kept through clears (Reserve)

  std::atomic<bool> has_readers_{false};
  mutable std::mutex readers_mu_;
  std::unordered_map<int64_t, std::unordered_set<int64_t>> changed_;
};

}  // namespace tfpsx

#endif  // TFPSX_CORE_HASH_TABLE_H_
