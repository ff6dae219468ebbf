#include "custom_ops/cc/core/hash_table.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <numeric>

namespace tfpsx {
namespace {

inline uint64_t Mix(uint64_t x) {  // splitmix64's finalizer: a fast, well-spread hash
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

inline uint64_t HashKey(int64_t key) { return Mix(static_cast<uint64_t>(key)); }

inline float Uniform01(uint64_t bits) {  // (0, 1]: safe for log()
  return (static_cast<float>(bits >> 40) + 1.0f) * (1.0f / 16777216.0f);
}

constexpr float kMaxLoad = 0.7f;

}  // namespace

std::string ValidateOptions(const TableOptions& o) {
  if (o.dim <= 0) return "dim must be > 0, got " + std::to_string(o.dim);
  if (o.num_slots < 0 || o.num_slots > 4)
    return "num_slots must be in 0..4, got " + std::to_string(o.num_slots);
  if (static_cast<int>(o.slot_init.size()) != o.num_slots)
    return "slot_init must have num_slots=" + std::to_string(o.num_slots) + " values, got " +
           std::to_string(o.slot_init.size());
  if (o.min_frequency < 1)
    return "min_frequency must be >= 1, got " + std::to_string(o.min_frequency);
  if (o.num_stripes < 1 || (o.num_stripes & (o.num_stripes - 1)) != 0)
    return "num_stripes must be a power of two, got " + std::to_string(o.num_stripes);
  if (o.init == InitKind::kUniform && !(o.init_a < o.init_b))
    return "uniform initializer needs low < high";
  if (o.init == InitKind::kNormal && !(o.init_b >= 0))
    return "normal initializer needs stddev >= 0";
  return "";
}

struct HashTable::Stripe {
  mutable std::shared_mutex mu;
  std::vector<uint32_t> index;  // 0: empty; else row + 1
  uint64_t mask = 0;
  std::vector<int64_t> keys;
  std::vector<float> rows;  // row_width floats per row: value, then slots
  std::vector<uint32_t> freq;
  std::vector<int64_t> step;
  std::unordered_map<int64_t, uint32_t> pending;  // admission: sightings so far
  int64_t admitted = 0;
  int64_t evicted = 0;

  int64_t FindRow(int64_t key, uint64_t h) const {
    if (index.empty()) return -1;
    for (uint64_t pos = h & mask;; pos = (pos + 1) & mask) {
      const uint32_t r = index[pos];
      if (r == 0) return -1;
      if (keys[r - 1] == key) return r - 1;
    }
  }

  void Rehash(uint64_t capacity) {
    index.assign(capacity, 0);
    mask = capacity - 1;
    for (size_t r = 0; r < keys.size(); ++r) {
      uint64_t pos = HashKey(keys[r]) & mask;
      while (index[pos] != 0) pos = (pos + 1) & mask;
      index[pos] = static_cast<uint32_t>(r + 1);
    }
  }

  // Appends a row for a key known to be absent; returns its row id.
  int64_t AddRow(int64_t key, uint64_t h, int64_t width) {
    if (static_cast<double>(keys.size() + 1) > kMaxLoad * static_cast<double>(index.size())) {
      uint64_t capacity = std::max<uint64_t>(16, index.size() * 2);
      while (static_cast<double>(keys.size() + 1) > kMaxLoad * static_cast<double>(capacity))
        capacity *= 2;
      Rehash(capacity);
    }
    const int64_t r = static_cast<int64_t>(keys.size());
    uint64_t pos = h & mask;
    while (index[pos] != 0) pos = (pos + 1) & mask;
    index[pos] = static_cast<uint32_t>(r + 1);
    keys.push_back(key);
    rows.resize(rows.size() + width);
    freq.push_back(0);
    step.push_back(0);
    return r;
  }

  uint64_t SlotOf(int64_t key, uint32_t row_plus_one) const {
    for (uint64_t pos = HashKey(key) & mask;; pos = (pos + 1) & mask) {
      if (index[pos] == row_plus_one) return pos;
    }
  }

  void RemoveRow(int64_t r, int64_t width) {
    // Backward-shift deletion keeps linear probing chains intact without tombstones.
    uint64_t hole = SlotOf(keys[r], static_cast<uint32_t>(r + 1));
    index[hole] = 0;
    for (uint64_t j = (hole + 1) & mask; index[j] != 0; j = (j + 1) & mask) {
      const uint64_t ideal = HashKey(keys[index[j] - 1]) & mask;
      const bool stays = hole <= j ? (hole < ideal && ideal <= j) : (hole < ideal || ideal <= j);
      if (!stays) {
        index[hole] = index[j];
        index[j] = 0;
        hole = j;
      }
    }
    // Keep rows dense: the last row takes the removed row's place.
    const int64_t last = static_cast<int64_t>(keys.size()) - 1;
    if (r != last) {
      index[SlotOf(keys[last], static_cast<uint32_t>(last + 1))] = static_cast<uint32_t>(r + 1);
      keys[r] = keys[last];
      std::memcpy(&rows[r * width], &rows[last * width], width * sizeof(float));
      freq[r] = freq[last];
      step[r] = step[last];
    }
    keys.pop_back();
    rows.resize(rows.size() - width);
    freq.pop_back();
    step.pop_back();
  }
};

HashTable::HashTable(const TableOptions& options)
    : options_(options), row_width_(options.dim * (1 + options.num_slots)) {
  stripes_.reserve(options.num_stripes);
  for (int i = 0; i < options.num_stripes; ++i) stripes_.emplace_back(new Stripe());
  stripe_shift_ = 64;
  for (int s = options.num_stripes; s > 1; s >>= 1) --stripe_shift_;
}

HashTable::~HashTable() = default;

HashTable::Stripe& HashTable::StripeOf(uint64_t hash) const {
  return *stripes_[stripe_shift_ == 64 ? 0 : (hash >> stripe_shift_)];
}

template <bool kExclusive, typename Fn>
void HashTable::ForEachByStripe(const int64_t* keys, int64_t n, Fn&& fn) const {
  const int stripes = options_.num_stripes;
  std::vector<uint64_t> hashes(n);
  std::vector<int64_t> start(stripes + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    hashes[i] = HashKey(keys[i]);
    ++start[(stripe_shift_ == 64 ? 0 : hashes[i] >> stripe_shift_) + 1];
  }
  for (int s = 0; s < stripes; ++s) start[s + 1] += start[s];
  std::vector<int64_t> order(n);
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < n; ++i)
      order[fill[stripe_shift_ == 64 ? 0 : hashes[i] >> stripe_shift_]++] = i;
  }
  constexpr int64_t kAhead = 8;
  // Threads working on parts of one batch start at different stripes, so they do not
  // queue behind each other on stripe 0, 1, 2, ... in lockstep.
  const int first = n > 0 ? static_cast<int>(hashes[0] & (stripes - 1)) : 0;
  for (int t = 0; t < stripes; ++t) {
    const int s = (first + t) & (stripes - 1);
    const int64_t begin = start[s], end = start[s + 1];
    if (begin == end) continue;
    Stripe& stripe = *stripes_[s];
    auto run = [&] {
      for (int64_t j = begin; j < end; ++j) {
        if (j + kAhead < end && !stripe.index.empty()) {
          __builtin_prefetch(&stripe.index[hashes[order[j + kAhead]] & stripe.mask]);
        }
        const int64_t i = order[j];
        fn(stripe, i, hashes[i]);
      }
    };
    if (kExclusive) {
      std::unique_lock<std::shared_mutex> lock(stripe.mu);
      run();
    } else {
      std::shared_lock<std::shared_mutex> lock(stripe.mu);
      run();
    }
  }
}

void HashTable::InitialRow(int64_t key, float* out) const {
  const int64_t dim = options_.dim;
  switch (options_.init) {
    case InitKind::kZeros:
      std::fill(out, out + dim, 0.f);
      return;
    case InitKind::kConstant:
      std::fill(out, out + dim, options_.init_a);
      return;
    default:
      break;
  }
  const uint64_t base = Mix(options_.seed ^ Mix(static_cast<uint64_t>(key)));
  if (options_.init == InitKind::kUniform) {
    const float lo = options_.init_a, span = options_.init_b - options_.init_a;
    for (int64_t j = 0; j < dim; ++j) out[j] = lo + span * (Uniform01(Mix(base + j)) - 0.5f / 16777216.0f);
    return;
  }
  // Normal: Box-Muller, two values per pair of uniforms.
  for (int64_t j = 0; j < dim; j += 2) {
    const float u1 = Uniform01(Mix(base + 2 * j)), u2 = Uniform01(Mix(base + 2 * j + 1));
    const float radius = std::sqrt(-2.f * std::log(u1)) * options_.init_b;
    out[j] = options_.init_a + radius * std::cos(6.2831853071795864f * u2);
    if (j + 1 < dim) out[j + 1] = options_.init_a + radius * std::sin(6.2831853071795864f * u2);
  }
}

void HashTable::Find(const int64_t* keys, int64_t n, float* out, bool* found,
                     bool use_initializer) const {
  const int64_t dim = options_.dim;
  ForEachByStripe<false>(keys, n, [&](const Stripe& s, int64_t i, uint64_t h) {
    const int64_t r = s.FindRow(keys[i], h);
    if (r >= 0) {
      std::memcpy(out + i * dim, &s.rows[r * row_width_], dim * sizeof(float));
    } else if (use_initializer) {
      InitialRow(keys[i], out + i * dim);
    } else {
      std::fill(out + i * dim, out + (i + 1) * dim, 0.f);
    }
    if (found) found[i] = r >= 0;
  });
}

void HashTable::FindOrInsert(const int64_t* keys, int64_t n, int64_t step, float* out) {
  const int64_t dim = options_.dim;
  std::vector<int64_t> inserted;
  ForEachByStripe<true>(keys, n, [&](const Stripe& cs, int64_t i, uint64_t h) {
    Stripe& s = const_cast<Stripe&>(cs);
    const int64_t key = keys[i];
    int64_t r = s.FindRow(key, h);
    if (r < 0) {
      uint32_t seen = 1;
      if (options_.min_frequency > 1) {
        seen = ++s.pending[key];
        if (seen < options_.min_frequency) {
          InitialRow(key, out + i * dim);
          return;
        }
        s.pending.erase(key);
      }
      r = s.AddRow(key, h, row_width_);
      float* row = &s.rows[r * row_width_];
      InitialRow(key, row);
      for (int k = 0; k < options_.num_slots; ++k)
        std::fill(row + (k + 1) * dim, row + (k + 2) * dim, options_.slot_init[k]);
      s.freq[r] = seen;
      s.step[r] = step;
      ++s.admitted;
      inserted.push_back(key);
    } else if (s.freq[r] != UINT32_MAX) {
      ++s.freq[r];
    }
    std::memcpy(out + i * dim, &s.rows[r * row_width_], dim * sizeof(float));
  });
  if (!inserted.empty()) MarkChanged(inserted.data(), static_cast<int64_t>(inserted.size()));
}

template <typename Fn>
void HashTable::UpdateRows(const int64_t* keys, int64_t n, int64_t step, Fn&& fn) {
  const int64_t dim = options_.dim;
  const bool track = has_readers_.load(std::memory_order_acquire);
  std::vector<int64_t> changed;
  if (track) changed.reserve(n);
  ForEachByStripe<true>(keys, n, [&](const Stripe& cs, int64_t i, uint64_t h) {
    Stripe& s = const_cast<Stripe&>(cs);
    const int64_t key = keys[i];
    int64_t r = s.FindRow(key, h);
    if (r < 0) {
      // fn(nullptr, i) decides whether a missing key gets a row (admission).
      if (!fn(nullptr, i)) return;
      r = s.AddRow(key, h, row_width_);
      float* row = &s.rows[r * row_width_];
      InitialRow(key, row);
      for (int k = 0; k < options_.num_slots; ++k)
        std::fill(row + (k + 1) * dim, row + (k + 2) * dim, options_.slot_init[k]);
      s.freq[r] = 1;
      ++s.admitted;
      s.pending.erase(key);
    }
    fn(&s.rows[r * row_width_], i);
    s.step[r] = step;
    if (track) changed.push_back(key);
  });
  if (track) MarkChanged(changed.data(), static_cast<int64_t>(changed.size()));
}

void HashTable::Insert(const int64_t* keys, int64_t n, const float* values, int64_t step) {
  const int64_t dim = options_.dim;
  UpdateRows(keys, n, step, [&](float* row, int64_t i) {
    if (row != nullptr) std::memcpy(row, values + i * dim, dim * sizeof(float));
    return true;
  });
}

void HashTable::Accumulate(const int64_t* keys, int64_t n, const float* deltas, int64_t step) {
  const int64_t dim = options_.dim;
  UpdateRows(keys, n, step, [&](float* row, int64_t i) {
    if (row != nullptr) {
      const float* d = deltas + i * dim;
      for (int64_t j = 0; j < dim; ++j) row[j] += d[j];
    }
    return true;
  });
}

int64_t HashTable::Remove(const int64_t* keys, int64_t n) {
  return RemoveKeys(keys, n, /*count_as_evicted=*/false);
}

int64_t HashTable::RemoveKeys(const int64_t* keys, int64_t n, bool count_as_evicted) {
  int64_t removed = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t h = HashKey(keys[i]);
    Stripe& s = StripeOf(h);
    std::unique_lock<std::shared_mutex> lock(s.mu);
    s.pending.erase(keys[i]);
    const int64_t r = s.FindRow(keys[i], h);
    if (r >= 0) {
      s.RemoveRow(r, row_width_);
      ++removed;
      if (count_as_evicted) ++s.evicted;
    }
  }
  return removed;
}

ExportedRows HashTable::ExportSince(int64_t since_step) const {
  const int64_t dim = options_.dim, slots = options_.num_slots;
  ExportedRows raw;
  for (const auto& sp : stripes_) {
    const Stripe& s = *sp;
    std::shared_lock<std::shared_mutex> lock(s.mu);
    for (size_t r = 0; r < s.keys.size(); ++r) {
      if (s.step[r] < since_step) continue;
      raw.keys.push_back(s.keys[r]);
      const float* row = &s.rows[r * row_width_];
      raw.values.insert(raw.values.end(), row, row + dim);
      raw.slots.insert(raw.slots.end(), row + dim, row + row_width_);
      raw.freq.push_back(s.freq[r]);
      raw.step.push_back(s.step[r]);
    }
  }
  // Sort by key so that exports (and so checkpoints) are deterministic.
  std::vector<int64_t> order(raw.keys.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](int64_t a, int64_t b) { return raw.keys[a] < raw.keys[b]; });
  ExportedRows out;
  const int64_t n = static_cast<int64_t>(order.size());
  out.keys.resize(n);
  out.values.resize(n * dim);
  out.slots.resize(n * slots * dim);
  out.freq.resize(n);
  out.step.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t o = order[i];
    out.keys[i] = raw.keys[o];
    std::memcpy(&out.values[i * dim], &raw.values[o * dim], dim * sizeof(float));
    if (slots)
      std::memcpy(&out.slots[i * slots * dim], &raw.slots[o * slots * dim],
                  slots * dim * sizeof(float));
    out.freq[i] = raw.freq[o];
    out.step[i] = raw.step[o];
  }
  return out;
}

ExportedRows HashTable::Export() const { return ExportSince(INT64_MIN); }

std::string HashTable::Import(const int64_t* keys, int64_t n, const float* values,
                              const float* slots, int64_t slots_len, const int64_t* freq,
                              const int64_t* step, bool clear_first) {
  const int64_t dim = options_.dim, num_slots = options_.num_slots;
  if (slots_len != 0 && slots_len != n * num_slots * dim) {
    return "slots must hold n*num_slots*dim=" + std::to_string(n * num_slots * dim) +
           " floats (or none), got " + std::to_string(slots_len);
  }
  if (clear_first) {
    for (auto& sp : stripes_) {
      Stripe& s = *sp;
      std::unique_lock<std::shared_mutex> lock(s.mu);
      s.index.clear();
      s.mask = 0;
      s.keys.clear();
      s.rows.clear();
      s.freq.clear();
      s.step.clear();
      s.pending.clear();
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t h = HashKey(keys[i]);
    Stripe& s = StripeOf(h);
    std::unique_lock<std::shared_mutex> lock(s.mu);
    int64_t r = s.FindRow(keys[i], h);
    if (r < 0) r = s.AddRow(keys[i], h, row_width_);
    float* row = &s.rows[r * row_width_];
    std::memcpy(row, values + i * dim, dim * sizeof(float));
    for (int k = 0; k < num_slots; ++k) {
      if (slots_len) {
        std::memcpy(row + (k + 1) * dim, slots + (i * num_slots + k) * dim, dim * sizeof(float));
      } else {
        std::fill(row + (k + 1) * dim, row + (k + 2) * dim, options_.slot_init[k]);
      }
    }
    s.freq[r] = freq ? static_cast<uint32_t>(std::min<int64_t>(std::max<int64_t>(freq[i], 0),
                                                               UINT32_MAX))
                     : 1;
    s.step[r] = step ? step[i] : 0;
  }
  MarkChanged(keys, n);
  return "";
}

void HashTable::MarkChanged(const int64_t* keys, int64_t n) {
  if (!has_readers_.load(std::memory_order_acquire)) return;
  std::lock_guard<std::mutex> lock(readers_mu_);
  for (auto& reader : changed_) reader.second.insert(keys, keys + n);
}

std::vector<int64_t> HashTable::TakeChanged(int64_t reader) {
  std::lock_guard<std::mutex> lock(readers_mu_);
  std::vector<int64_t> out;
  auto it = changed_.find(reader);
  if (it == changed_.end()) {
    changed_[reader];  // registered from now on
    has_readers_.store(true, std::memory_order_release);
    return out;
  }
  out.assign(it->second.begin(), it->second.end());
  std::sort(out.begin(), out.end());
  it->second.clear();
  return out;
}

void HashTable::ApplySgd(const int64_t* keys, int64_t n, const float* grads, float lr,
                         int64_t step) {
  const int64_t dim = options_.dim;
  const bool create = options_.min_frequency <= 1;
  UpdateRows(keys, n, step, [&](float* row, int64_t i) {
    if (row == nullptr) return create;
    const float* g = grads + i * dim;
    for (int64_t j = 0; j < dim; ++j) row[j] -= lr * g[j];
    return true;
  });
}

void HashTable::ApplyAdagrad(const int64_t* keys, int64_t n, const float* grads, float lr,
                             float eps, int64_t step) {
  const int64_t dim = options_.dim;
  const bool create = options_.min_frequency <= 1;
  UpdateRows(keys, n, step, [&](float* row, int64_t i) {
    if (row == nullptr) return create;
    const float* g = grads + i * dim;
    float* acc = row + dim;
    for (int64_t j = 0; j < dim; ++j) {
      acc[j] += g[j] * g[j];
      row[j] -= lr * g[j] / (std::sqrt(acc[j]) + eps);
    }
    return true;
  });
}

void HashTable::ApplyAdam(const int64_t* keys, int64_t n, const float* grads, float lr,
                          float beta1, float beta2, float eps, int64_t step) {
  // Lazy Adam as TF applies it to sparse rows: bias correction from the global step.
  const int64_t dim = options_.dim;
  const bool create = options_.min_frequency <= 1;
  const double t = static_cast<double>(std::max<int64_t>(step, 1));
  const float lr_t = static_cast<float>(lr * std::sqrt(1.0 - std::pow(beta2, t)) /
                                        (1.0 - std::pow(beta1, t)));
  UpdateRows(keys, n, step, [&](float* row, int64_t i) {
    if (row == nullptr) return create;
    const float* g = grads + i * dim;
    float* m = row + dim;
    float* v = row + 2 * dim;
    for (int64_t j = 0; j < dim; ++j) {
      m[j] = beta1 * m[j] + (1 - beta1) * g[j];
      v[j] = beta2 * v[j] + (1 - beta2) * g[j] * g[j];
      row[j] -= lr_t * m[j] / (std::sqrt(v[j]) + eps);
    }
    return true;
  });
}

void HashTable::ApplyFtrl(const int64_t* keys, int64_t n, const float* grads, float lr,
                          float lr_power, float l1, float l2, int64_t step) {
  // FTRL-Proximal (McMahan et al. 2013), as tf.compat.v1.train.FtrlOptimizer applies it.
  const int64_t dim = options_.dim;
  const bool create = options_.min_frequency <= 1;
  UpdateRows(keys, n, step, [&](float* row, int64_t i) {
    if (row == nullptr) return create;
    const float* g = grads + i * dim;
    float* z = row + dim;
    float* acc = row + 2 * dim;
    for (int64_t j = 0; j < dim; ++j) {
      const float new_acc = acc[j] + g[j] * g[j];
      const float sigma = (std::pow(new_acc, -lr_power) - std::pow(acc[j], -lr_power)) / lr;
      z[j] += g[j] - sigma * row[j];
      acc[j] = new_acc;
      if (std::fabs(z[j]) <= l1) {
        row[j] = 0.f;
      } else {
        const float sign = z[j] > 0 ? 1.f : -1.f;
        row[j] = -(z[j] - sign * l1) / (std::pow(new_acc, -lr_power) / lr + 2 * l2);
      }
    }
    return true;
  });
}

int64_t HashTable::EvictOlderThan(int64_t min_step) {
  int64_t removed = 0;
  for (auto& sp : stripes_) {
    Stripe& s = *sp;
    std::unique_lock<std::shared_mutex> lock(s.mu);
    for (int64_t r = static_cast<int64_t>(s.keys.size()) - 1; r >= 0; --r) {
      if (s.step[r] < min_step) {
        s.RemoveRow(r, row_width_);
        ++s.evicted;
        ++removed;
      }
    }
  }
  return removed;
}

int64_t HashTable::EvictToTopN(int64_t keep) {
  std::vector<std::pair<uint32_t, int64_t>> all;  // (freq, key)
  for (const auto& sp : stripes_) {
    std::shared_lock<std::shared_mutex> lock(sp->mu);
    for (size_t r = 0; r < sp->keys.size(); ++r) all.emplace_back(sp->freq[r], sp->keys[r]);
  }
  if (keep < 0) keep = 0;
  if (static_cast<int64_t>(all.size()) <= keep) return 0;
  // Highest frequency first; on ties the smaller key stays, so the result is deterministic.
  auto better = [](const std::pair<uint32_t, int64_t>& a, const std::pair<uint32_t, int64_t>& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  };
  std::nth_element(all.begin(), all.begin() + keep, all.end(), better);
  std::vector<int64_t> victims;
  for (size_t i = keep; i < all.size(); ++i) victims.push_back(all[i].second);
  return RemoveKeys(victims.data(), static_cast<int64_t>(victims.size()),
                    /*count_as_evicted=*/true);
}

template <typename Fn>
int64_t HashTable::SumOverStripes(Fn&& fn) const {
  int64_t total = 0;
  for (const auto& s : stripes_) {
    std::shared_lock<std::shared_mutex> lock(s->mu);
    total += fn(*s);
  }
  return total;
}

int64_t HashTable::Size() const {
  return SumOverStripes([](const Stripe& s) { return static_cast<int64_t>(s.keys.size()); });
}

int64_t HashTable::admitted() const {
  return SumOverStripes([](const Stripe& s) { return s.admitted; });
}

int64_t HashTable::evicted() const {
  return SumOverStripes([](const Stripe& s) { return s.evicted; });
}

int64_t HashTable::pending_admission() const {
  return SumOverStripes([](const Stripe& s) { return static_cast<int64_t>(s.pending.size()); });
}

int64_t HashTable::MemoryBytes() const {
  return SumOverStripes([](const Stripe& s) -> int64_t {
    return s.index.capacity() * sizeof(uint32_t) + s.keys.capacity() * sizeof(int64_t) +
           s.rows.capacity() * sizeof(float) + s.freq.capacity() * sizeof(uint32_t) +
           s.step.capacity() * sizeof(int64_t);
  });
}

}  // namespace tfpsx
