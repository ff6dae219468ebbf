// A table's storage: lock stripes chosen by the key's hash, each an open-addressing
// index (linear probing, 32-bit slots) over the stripe's records (row_store.h), whose
// chunks come from one ChunkPool per table. A key costs its payload plus ~26 bytes (12 of
// metadata, 6-12 of index slot, chunk slack) and a lookup touches one slot and one record.
// Wide rows are no exception: the memory mapped grows with the rows held (chunk_pool.h).
//
// The store knows keys, records and locks. What a row holds (value, optimizer slots) and
// the policies over rows (initializer, admission, eviction, change tracking) belong to the
// table (hash_table.h).

#ifndef TFPSX_CORE_STRIPED_STORE_H_
#define TFPSX_CORE_STRIPED_STORE_H_

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "custom_ops/cc/core/chunk_pool.h"
#include "custom_ops/cc/core/initializer.h"
#include "custom_ops/cc/core/row_store.h"

namespace tfpsx {

constexpr float kMaxLoad = 0.7f;
// Row ids take 24 bits of an index slot (the other 8 are a hash tag).
constexpr int64_t kMaxRowsPerStripe = (int64_t{1} << 24) - 2;

struct Stripe {
  Stripe(int id, int64_t row_width) : id(id), rows(row_width) {}

  // The stripe's place in its store: the table keeps its per-stripe state (admission
  // counts) at this index, guarded by this stripe's lock.
  const int id;
  mutable std::shared_mutex mu;
  // Index slots: 0 is empty, else (row + 1) << 8 | an 8-bit tag from the key's hash, so
  // a probe passes over other keys' slots without touching their records (255 in 256
  // mismatches are rejected by the tag).
  std::vector<uint32_t> index;
  uint64_t mask = 0;
  RowStore rows;

  static constexpr uint64_t kNoSlot = ~uint64_t{0};

  static uint32_t TagOf(uint64_t h) { return static_cast<uint32_t>(h >> 32) & 0xff; }
  static uint32_t MakeSlot(int64_t r, uint64_t h) {
    return static_cast<uint32_t>(r + 1) << 8 | TagOf(h);
  }
  static int64_t RowOf(uint32_t slot) { return static_cast<int64_t>(slot >> 8) - 1; }

  int64_t size() const { return rows.size(); }

  // The key's row, or -1; on a miss *empty (if given) is the free slot where the probe
  // ended, where AddRow puts the key unless the index grows first.
  int64_t FindRow(int64_t key, uint64_t h, uint64_t* empty = nullptr) const {
    if (index.empty()) {
      if (empty != nullptr) *empty = kNoSlot;
      return -1;
    }
    const uint32_t tag = TagOf(h);
    for (uint64_t pos = h & mask;; pos = (pos + 1) & mask) {
      const uint32_t slot = index[pos];
      if (slot == 0) {
        if (empty != nullptr) *empty = pos;
        return -1;
      }
      if ((slot & 0xff) == tag && rows.key(RowOf(slot)) == key) return RowOf(slot);
    }
  }

  // Second prefetch stage: the index slot was fetched earlier, now fetch the record.
  void PrefetchRecord(uint64_t h) const {
    if (index.empty()) return;
    const uint32_t slot = index[h & mask];
    if (slot != 0 && (slot & 0xff) == TagOf(h)) __builtin_prefetch(rows.record(RowOf(slot)));
  }

  // An empty index of `slots` slots (a power of two, or 0: none yet).
  void ResetIndex(uint64_t slots) {
    index.assign(slots, 0);
    mask = slots == 0 ? 0 : slots - 1;
  }

  // Appends a zeroed row for a key known to be absent; returns its row id. `empty` is the
  // free slot FindRow reported, if any. Throws std::length_error past max_rows.
  int64_t AddRow(int64_t key, uint64_t h, int64_t max_rows, uint64_t empty = kNoSlot) {
    if (rows.size() >= max_rows) {
      throw std::length_error("table full: a stripe holds at most " + std::to_string(max_rows) +
                              " keys (max_stripe_rows); use more shards, evict, or raise it");
    }
    const double need = static_cast<double>(rows.size() + 1);
    if (need > kMaxLoad * static_cast<double>(index.size())) {
      uint64_t capacity = std::max<uint64_t>(16, index.size() * 2);
      while (need > kMaxLoad * static_cast<double>(capacity)) capacity *= 2;
      Rehash(capacity);
      empty = kNoSlot;
    }
    const int64_t r = rows.Append(key);
    uint64_t pos = empty != kNoSlot ? empty : h & mask;
    while (index[pos] != 0) pos = (pos + 1) & mask;
    index[pos] = MakeSlot(r, h);
    return r;
  }

  // Rebuilds the index with `capacity` slots.
  void Rehash(uint64_t capacity);
  // Removes row r; the last row takes its id.
  void RemoveRow(int64_t r);

 private:
  uint64_t SlotOf(int64_t key, int64_t r) const;
};

class StripedStore {
 public:
  // num_stripes: a power of two (ValidateOptions checks).
  StripedStore(int64_t row_width, int num_stripes);
  StripedStore(const StripedStore&) = delete;
  StripedStore& operator=(const StripedStore&) = delete;

  int num_stripes() const { return static_cast<int>(stripes_.size()); }
  Stripe& stripe(int s) const { return *stripes_[s]; }
  int StripeIndex(uint64_t h) const {
    return stripe_shift_ == 64 ? 0 : static_cast<int>(h >> stripe_shift_);
  }
  Stripe& StripeOf(uint64_t h) const { return *stripes_[StripeIndex(h)]; }

  // Sizes every stripe's index for `rows` keys and has the pool map and fault in their
  // row memory, so that inserts up to that size neither rehash nor page-fault; ClearLocked
  // keeps the index size. Throws std::runtime_error naming the rows and MiB asked for.
  void Reserve(int64_t rows);
  // Empties stripe s, whose lock the caller holds.
  void ClearLocked(Stripe& s) const {
    s.ResetIndex(reserved_slots_);
    s.rows.Clear();
  }

  // Calls fn(stripe, i, hash) for every key, grouped by stripe so that each stripe is
  // locked once per call (exclusively when kExclusive, then fn gets a Stripe&), with the
  // next keys' index slots, records and input rows (stream + i * stream_width, stream may
  // be null) prefetched. Outputs are not prefetched: measured slower, the stores do not
  // wait on them.
  template <bool kExclusive, typename Fn>
  void ForEachByStripe(const int64_t* keys, int64_t n, const float* stream, int64_t stream_width,
                       Fn&& fn) const;

  // The sum of fn(stripe) over all stripes, each read under its shared lock.
  template <typename Fn>
  int64_t SumOverStripes(Fn&& fn) const {
    int64_t total = 0;
    for (const auto& s : stripes_) {
      std::shared_lock<std::shared_mutex> lock(s->mu);
      total += fn(static_cast<const Stripe&>(*s));
    }
    return total;
  }

  // What the rows held take: their records plus the indexes.
  int64_t UsedBytes() const;
  // All the memory the store holds: the indexes plus every block the pool mapped (rows
  // held, chunks reserved, given back or partly filled, the newest block's rest).
  int64_t ReservedBytes() const;
  // The indexes plus the row memory that may be resident (ChunkPool::ResidentBytes).
  int64_t ResidentBytes() const { return IndexBytes() + pool_->ResidentBytes(); }
  void TrimMemory() { pool_->Trim(); }

 private:
  int64_t IndexBytes() const;

  std::unique_ptr<ChunkPool> pool_;  // before stripes_: outlives the chunks they hold
  std::vector<std::unique_ptr<Stripe>> stripes_;
  int stripe_shift_;
  uint64_t reserved_slots_ = 0;  // index slots per stripe kept through clears (Reserve)
};

template <bool kExclusive, typename Fn>
void StripedStore::ForEachByStripe(const int64_t* keys, int64_t n, const float* stream,
                                   int64_t stream_width, Fn&& fn) const {
  using StripeRef = std::conditional_t<kExclusive, Stripe&, const Stripe&>;
  const int stripes = num_stripes();
  std::vector<uint64_t> hashes(n);
  std::vector<int64_t> start(stripes + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    hashes[i] = HashKey(keys[i]);
    ++start[StripeIndex(hashes[i]) + 1];
  }
  for (int s = 0; s < stripes; ++s) start[s + 1] += start[s];
  // order: key positions grouped by stripe; sorted: their hashes in that order, so the
  // loops below read hashes sequentially (a gather through order was their top stall).
  std::vector<int64_t> order(n);
  std::vector<uint64_t> sorted(n);
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t at = fill[StripeIndex(hashes[i])]++;
      order[at] = i;
      sorted[at] = hashes[i];
    }
  }
  constexpr int64_t kAhead = 8;
  auto run = [&](StripeRef stripe, int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      if (j + kAhead < end && !stripe.index.empty()) {
        __builtin_prefetch(&stripe.index[sorted[j + kAhead] & stripe.mask]);
      }
      if (j + kAhead / 2 < end) {
        stripe.PrefetchRecord(sorted[j + kAhead / 2]);
        if (stream != nullptr) __builtin_prefetch(stream + order[j + kAhead / 2] * stream_width);
      }
      fn(stripe, order[j], sorted[j]);
    }
  };
  // A stripe another thread holds is skipped and done after the others, so threads
  // working on parts of one batch do not convoy behind each other from stripe to stripe.
  using Lock = std::conditional_t<kExclusive, std::unique_lock<std::shared_mutex>,
                                  std::shared_lock<std::shared_mutex>>;
  std::vector<int> busy;
  const int first = n > 0 ? static_cast<int>(hashes[0] & (stripes - 1)) : 0;
  for (int t = 0; t < stripes; ++t) {
    const int s = (first + t) & (stripes - 1);
    if (start[s] == start[s + 1]) continue;
    Lock lock(stripes_[s]->mu, std::try_to_lock);
    if (!lock.owns_lock()) {
      busy.push_back(s);
      continue;
    }
    run(*stripes_[s], start[s], start[s + 1]);
  }
  for (int s : busy) {
    Lock lock(stripes_[s]->mu);
    run(*stripes_[s], start[s], start[s + 1]);
  }
}

}  // namespace tfpsx

#endif  // TFPSX_CORE_STRIPED_STORE_H_
