// A table's row operations: find, insert, accumulate, remove, the worker cache's reads
// and victims (hash_table.h); its whole-table operations (exports, checkpoints, import,
// eviction) are in hash_table_whole.cc.

#include "custom_ops/cc/core/hash_table.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <mutex>
#include <shared_mutex>
#include <utility>

namespace tfpsx {

std::string ValidateOptions(const TableOptions& o) {
  if (o.dim <= 0) return "dim must be > 0, got " + std::to_string(o.dim);
  if (o.num_slots < 0 || o.num_slots > 4)
    return "num_slots must be in 0..4, got " + std::to_string(o.num_slots);
  if (static_cast<int>(o.slot_init.size()) != o.num_slots)
    return "slot_init must have num_slots=" + std::to_string(o.num_slots) + " values, got " +
           std::to_string(o.slot_init.size());
  if (o.min_frequency < 1)
    return "min_frequency must be >= 1, got " + std::to_string(o.min_frequency);
  if (o.max_stripe_rows < 1 || o.max_stripe_rows > kMaxRowsPerStripe)
    return "max_stripe_rows must be in 1.." + std::to_string(kMaxRowsPerStripe) + ", got " +
           std::to_string(o.max_stripe_rows);
  if (o.num_stripes < 1 || (o.num_stripes & (o.num_stripes - 1)) != 0)
    return "num_stripes must be a power of two, got " + std::to_string(o.num_stripes);
  if (o.capacity < 0 || o.capacity / o.num_stripes > o.max_stripe_rows)
    return "capacity must be in 0.." + std::to_string(o.num_stripes * o.max_stripe_rows) +
           " (num_stripes * max_stripe_rows), got " + std::to_string(o.capacity);
  if (o.init == InitKind::kUniform && !(o.init_a < o.init_b))
    return "uniform initializer needs low < high";
  if (o.init == InitKind::kNormal && !(o.init_b >= 0))
    return "normal initializer needs stddev >= 0";
  return "";
}

HashTable::HashTable(const TableOptions& options)
    : options_(options),
      row_width_(options.dim * (1 + options.num_slots)),
      initializer_{options.init, options.init_a, options.init_b, options.seed},
      store_(row_width_, options.num_stripes),
      stripe_state_(options.num_stripes) {
  if (options.capacity > 0) store_.Reserve(options.capacity);
}

HashTable::~HashTable() = default;

void HashTable::Find(const int64_t* keys, int64_t n, float* out, bool* found,
                     bool use_initializer) const {
  const int64_t dim = options_.dim;
  store_.ForEachByStripe<false>(keys, n, nullptr, 0, [&](const Stripe& s, int64_t i, uint64_t h) {
    const int64_t r = s.FindRow(keys[i], h);
    if (r >= 0) {
      std::memcpy(out + i * dim, s.rows.row(r), dim * sizeof(float));
    } else if (use_initializer) {
      InitialRow(keys[i], out + i * dim);
    } else {
      std::fill(out + i * dim, out + (i + 1) * dim, 0.f);
    }
    if (found) found[i] = r >= 0;
  });
}

void HashTable::FindWithSlots(const int64_t* keys, int64_t n, float* out, bool* found) const {
  const int64_t dim = options_.dim, width = row_width_;
  store_.ForEachByStripe<false>(keys, n, nullptr, 0, [&](const Stripe& s, int64_t i, uint64_t h) {
    const int64_t r = s.FindRow(keys[i], h);
    float* row = out + i * width;
    if (r >= 0) {
      std::memcpy(row, s.rows.row(r), width * sizeof(float));
    } else {
      InitialRow(keys[i], row);
      for (int k = 0; k < options_.num_slots; ++k)
        std::fill(row + (k + 1) * dim, row + (k + 2) * dim, options_.slot_init[k]);
    }
    if (found) found[i] = r >= 0;
  });
}

int64_t HashTable::NewRow(Stripe& s, int64_t key, uint64_t h, uint64_t empty, bool init_value,
                          uint32_t freq) {
  const int64_t dim = options_.dim;
  const int64_t r = s.AddRow(key, h, options_.max_stripe_rows, empty);
  float* row = s.rows.row(r);
  if (init_value) InitialRow(key, row);
  for (int k = 0; k < options_.num_slots; ++k)
    std::fill(row + (k + 1) * dim, row + (k + 2) * dim, options_.slot_init[k]);
  s.rows.set_freq(r, freq);
  MarkRow(s, r);
  StripeState& state = stripe_state_[s.id];
  ++state.admitted;
  if (!state.pending.empty()) state.pending.erase(key);  // admitted: no longer counted
  return r;
}

void HashTable::CacheFind(const int64_t* keys, int64_t n, int64_t step, float* out,
                          bool* found) {
  const int64_t dim = options_.dim;
  store_.ForEachByStripe<true>(keys, n, nullptr, 0, [&](Stripe& s, int64_t i, uint64_t h) {
    const int64_t r = s.FindRow(keys[i], h);
    found[i] = r >= 0;
    if (r < 0) {
      InitialRow(keys[i], out + i * dim);
      return;
    }
    if (s.rows.freq(r) != UINT32_MAX) s.rows.set_freq(r, s.rows.freq(r) + 1);
    s.rows.set_step(r, step);
    MarkRow(s, r);
    std::memcpy(out + i * dim, s.rows.row(r), dim * sizeof(float));
  });
}

namespace {

// A row's place in a victim order: the lower `first`, then `second`, the sooner it goes;
// last, the larger key (EvictToTopN keeps the smaller), so the choice is deterministic.
struct Scored {
  int64_t first, second, key;
};

// The keys of the `count` first rows of `all` in that order (sorted when `sorted`).
std::vector<int64_t> FirstKeys(std::vector<Scored> all, int64_t count, bool sorted) {
  auto before = [](const Scored& a, const Scored& b) {
    if (a.first != b.first) return a.first < b.first;
    if (a.second != b.second) return a.second < b.second;
    return a.key > b.key;
  };
  if (count < static_cast<int64_t>(all.size())) {
    std::nth_element(all.begin(), all.begin() + count, all.end(), before);
    all.resize(static_cast<size_t>(count));
  }
  if (sorted) std::sort(all.begin(), all.end(), before);
  std::vector<int64_t> keys;
  keys.reserve(all.size());
  for (const Scored& scored : all) keys.push_back(scored.key);
  return keys;
}

// Appends stripe s's rows (its lock held) scored by LRU (step, then frequency) or LFU.
void ScoreRows(const Stripe& s, bool by_step, std::vector<Scored>* out) {
  for (int64_t r = 0; r < s.size(); ++r) {
    const int64_t freq = s.rows.freq(r), step = s.rows.step(r);
    out->push_back(by_step ? Scored{step, freq, s.rows.key(r)} : Scored{freq, step, s.rows.key(r)});
  }
}

}  // namespace

std::vector<int64_t> HashTable::CacheVictims(int64_t count, bool by_step) const {
  if (count <= 0) return {};  // (a cache under its size asks every step)
  std::vector<Scored> all;
  all.reserve(static_cast<size_t>(Size()));
  for (int i = 0; i < store_.num_stripes(); ++i) {
    const Stripe& s = store_.stripe(i);
    std::shared_lock<std::shared_mutex> lock(s.mu);
    ScoreRows(s, by_step, &all);
  }
  return FirstKeys(std::move(all), count, /*sorted=*/true);
}

std::vector<int64_t> HashTable::StripeVictims(int stripe, int64_t count) const {
  if (count <= 0) return {};
  std::vector<Scored> all;
  {
    const Stripe& s = store_.stripe(stripe);
    std::shared_lock<std::shared_mutex> lock(s.mu);
    all.reserve(static_cast<size_t>(s.size()));
    ScoreRows(s, /*by_step=*/true, &all);
  }
  return FirstKeys(std::move(all), count, /*sorted=*/false);
}

int64_t HashTable::StripeSize(int stripe) const {
  const Stripe& s = store_.stripe(stripe);
  std::shared_lock<std::shared_mutex> lock(s.mu);
  return s.size();
}

void HashTable::FindOrInsert(const int64_t* keys, int64_t n, int64_t step, float* out) {
  const int64_t dim = options_.dim;
  std::vector<int64_t> inserted;
  store_.ForEachByStripe<true>(keys, n, nullptr, 0, [&](Stripe& s, int64_t i, uint64_t h) {
    const int64_t key = keys[i];
    uint64_t empty = Stripe::kNoSlot;
    int64_t r = s.FindRow(key, h, &empty);
    if (r < 0) {
      uint32_t seen = 1;
      if (options_.min_frequency > 1) {
        seen = ++stripe_state_[s.id].pending[key];
        if (seen < options_.min_frequency) {
          InitialRow(key, out + i * dim);
          return;
        }
      }
      r = NewRow(s, key, h, empty, /*init_value=*/true, seen);  // may throw: the count stays
      s.rows.set_step(r, step);
      inserted.push_back(key);
    } else if (s.rows.freq(r) != UINT32_MAX) {
      s.rows.set_freq(r, s.rows.freq(r) + 1);
      MarkRow(s, r);
    }
    std::memcpy(out + i * dim, s.rows.row(r), dim * sizeof(float));
  });
  if (!inserted.empty()) changes_.Mark(inserted.data(), static_cast<int64_t>(inserted.size()));
}

void HashTable::Insert(const int64_t* keys, int64_t n, const float* values, int64_t step) {
  const int64_t dim = options_.dim;
  UpdateRows(keys, n, values, step, /*init_value=*/false, [&](float* row, int64_t i) {
    if (row != nullptr) std::memcpy(row, values + i * dim, dim * sizeof(float));
    return true;
  });
}

void HashTable::InsertWithSlots(const int64_t* keys, int64_t n, const float* rows,
                                int64_t step) {
  const int64_t width = row_width_;
  UpdateRows(keys, n, nullptr, step, /*init_value=*/false, [&](float* row, int64_t i) {
    if (row != nullptr) std::memcpy(row, rows + i * width, width * sizeof(float));
    return true;
  });
}

void HashTable::Accumulate(const int64_t* keys, int64_t n, const float* deltas, int64_t step,
                           int64_t skip_reader, Combine combine) {
  const int64_t dim = options_.dim;
  // A summed push is not counted: the combined pushes neither see it nor are seen by it.
  const bool counted = combine != Combine::kSum;
  auto add = [&](const float* rows, const float* moved) {
    UpdateRows(keys, n, rows, step, /*init_value=*/true, [&](float* row, int64_t i) {
      if (row != nullptr) {
        const float* d = rows + i * dim;
        for (int64_t j = 0; j < dim; ++j) row[j] += d[j];
      }
      return true;
    }, skip_reader, counted, moved);
  };
  if (!counted) {
    add(deltas, nullptr);
    return;
  }
  std::lock_guard<std::mutex> lock(combine_mu_);
  std::vector<int32_t> pushes(n);
  std::vector<float> increments(n * dim);
  const bool mean = combine == Combine::kMean;
  changes_.Pushes(skip_reader, keys, n, pushes.data(), mean ? increments.data() : nullptr, dim);
  for (int64_t i = 0; i < n; ++i) {
    float* inc = increments.data() + i * dim;
    const float* d = deltas + i * dim;
    const float share = 1.f / static_cast<float>(1 + pushes[i]);
    if (pushes[i] == 0) {
      std::copy_n(d, dim, inc);
    } else if (mean) {  // inc holds the others' move
      for (int64_t j = 0; j < dim; ++j) inc[j] = (d[j] - inc[j]) * share;
    } else {
      for (int64_t j = 0; j < dim; ++j) inc[j] = d[j] * share;
    }
  }
  // A mean push records its increments: the next pusher's "others' move".
  add(increments.data(), mean ? increments.data() : nullptr);
}

void HashTable::AccumulateWithSlots(const int64_t* keys, int64_t n, const float* deltas,
                                    int64_t step, int64_t skip_reader) {
  const int64_t width = row_width_;
  UpdateRows(keys, n, nullptr, step, /*init_value=*/true, [&](float* row, int64_t i) {
    if (row != nullptr) {
      const float* d = deltas + i * width;
      for (int64_t j = 0; j < width; ++j) row[j] += d[j];
    }
    return true;
  }, skip_reader);
}

int64_t HashTable::Remove(const int64_t* keys, int64_t n) {
  return RemoveKeys(keys, n, /*count_as_evicted=*/false);
}

int64_t HashTable::RemoveKeys(const int64_t* keys, int64_t n, bool count_as_evicted) {
  // Grouped by stripe: one lock per stripe, not per key (a cache evicts thousands of
  // rows at once).
  int64_t removed = 0;
  store_.ForEachByStripe<true>(keys, n, nullptr, 0, [&](Stripe& s, int64_t i, uint64_t h) {
    StripeState& state = stripe_state_[s.id];
    if (!state.pending.empty()) state.pending.erase(keys[i]);
    const int64_t r = s.FindRow(keys[i], h);
    if (r >= 0) {
      RemoveTrackedRow(s, r);
      ++removed;
      if (count_as_evicted) ++state.evicted;
    }
  });
  return removed;
}

void HashTable::Present(const int64_t* keys, int64_t n, bool* present) const {
  store_.ForEachByStripe<false>(keys, n, nullptr, 0, [&](const Stripe& s, int64_t i, uint64_t h) {
    present[i] = s.FindRow(keys[i], h) >= 0;
  });
}

void HashTable::TakeRows(const int64_t* keys, int64_t n, RecordBatch* out,
                         std::vector<uint8_t>* dirty) {
  // Grouped by stripe (one lock each); rows come out in that order.
  store_.ForEachByStripe<true>(keys, n, nullptr, 0, [&](Stripe& s, int64_t i, uint64_t h) {
    const int64_t r = s.FindRow(keys[i], h);
    if (r < 0) return;
    out->Add(keys[i], s.rows.step(r), s.rows.freq(r), s.rows.row(r));
    const StripeState& st = stripe_state_[s.id];
    dirty->push_back(st.tracked && RowMarked(st, r) ? 1 : 0);
    RemoveTrackedRow(s, r, /*as_removal=*/false);
  });
}

void HashTable::PutRows(const RecordBatch& in, const std::vector<uint8_t>& dirty) {
  for (int64_t i = 0; i < in.size(); ++i) {
    const int64_t key = in.keys[i];
    const uint64_t h = HashKey(key);
    Stripe& s = store_.StripeOf(h);
    std::unique_lock<std::shared_mutex> lock(s.mu);
    uint64_t empty = Stripe::kNoSlot;
    if (s.FindRow(key, h, &empty) >= 0) continue;
    const int64_t r = s.AddRow(key, h, options_.max_stripe_rows, empty);
    std::memcpy(s.rows.row(r), in.rows.data() + i * row_width_, row_width_ * sizeof(float));
    s.rows.set_freq(r, in.freqs[i]);
    s.rows.set_step(r, in.steps[i]);
    if (dirty[i]) MarkRow(s, r);
  }
}

int64_t HashTable::Size() const {
  return store_.SumOverStripes([](const Stripe& s) { return s.size(); });
}

void HashTable::RemoveTrackedRow(Stripe& s, int64_t r, bool as_removal) {
  StripeState& st = stripe_state_[s.id];
  if (st.tracked) {
    const int64_t last = s.size() - 1;  // RemoveRow moves it to r
    const bool last_marked = RowMarked(st, last);
    if (as_removal) st.removed.insert(s.rows.key(r));
    if (static_cast<size_t>(last >> 6) < st.dirty.size())
      st.dirty[last >> 6] &= ~(uint64_t{1} << (last & 63));
    if (static_cast<size_t>(r >> 6) < st.dirty.size())
      st.dirty[r >> 6] &= ~(uint64_t{1} << (r & 63));
    if (last_marked && last != r) MarkRow(s, r);
  }
  s.RemoveRow(r);
}

int64_t HashTable::admitted() const {
  return store_.SumOverStripes([&](const Stripe& s) { return stripe_state_[s.id].admitted; });
}

int64_t HashTable::evicted() const {
  return store_.SumOverStripes([&](const Stripe& s) { return stripe_state_[s.id].evicted; });
}

int64_t HashTable::pending_admission() const {
  return store_.SumOverStripes([&](const Stripe& s) {
    return static_cast<int64_t>(stripe_state_[s.id].pending.size());
  });
}

}  // namespace tfpsx
