#include "custom_ops/cc/core/change_log.h"

#include <algorithm>

namespace tfpsx {

void ChangeLog::Mark(const int64_t* keys, int64_t n, int64_t skip_reader, bool push,
                     const float* moved, int64_t dim) {
  if (!active()) return;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& entry : readers_) {
    if (entry.first == skip_reader) continue;
    Reader& reader = entry.second;
    reader.keys.insert(reader.keys.end(), keys, keys + n);
    if (reader.keys.size() >= reader.compact_at) Compact(reader);
    if (!push) continue;
    for (int64_t i = 0; i < n; ++i) {
      Marked& marked = reader.pushed[keys[i]];
      ++marked.pushes;
      if (moved == nullptr) continue;
      if (marked.moved < 0) {
        marked.moved = static_cast<int64_t>(reader.moved.size());
        reader.moved.resize(reader.moved.size() + dim, 0.f);
      }
      float* sum = reader.moved.data() + marked.moved;
      for (int64_t j = 0; j < dim; ++j) sum[j] += moved[i * dim + j];
    }
  }
}

void ChangeLog::Pushes(int64_t reader, const int64_t* keys, int64_t n, int32_t* pushes,
                       float* moved, int64_t dim) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = readers_.find(reader);
  if (moved != nullptr) std::fill(moved, moved + n * dim, 0.f);
  for (int64_t i = 0; i < n; ++i) {
    pushes[i] = 0;
    if (it == readers_.end()) continue;
    auto found = it->second.pushed.find(keys[i]);
    if (found == it->second.pushed.end()) continue;
    pushes[i] = found->second.pushes;
    if (moved != nullptr && found->second.moved >= 0) {
      std::copy_n(it->second.moved.data() + found->second.moved, dim, moved + i * dim);
    }
  }
}

ChangeLog::Reader* ChangeLog::Registered(int64_t reader) {
  auto it = readers_.find(reader);
  if (it != readers_.end()) return &it->second;
  readers_[reader];  // registered from now on
  active_.store(true, std::memory_order_release);
  return nullptr;
}

std::vector<int64_t> ChangeLog::Take(int64_t reader) {
  std::vector<int64_t> out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Reader* found = Registered(reader);
    if (found == nullptr) return out;
    Reader& r = *found;
    out.swap(r.keys);
    r.sorted = 0;
    r.compact_at = kMinCompact;
    r.pushed.clear();
    r.moved.clear();
  }
  // Outside the lock: the writers marking meanwhile do not wait for the sort.
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::vector<int64_t> ChangeLog::TakeAmong(int64_t reader, const int64_t* keys, int64_t n) {
  // Outside the lock: the keys asked for, sorted and unique.
  std::vector<int64_t> asked(keys, keys + n);
  std::sort(asked.begin(), asked.end());
  asked.erase(std::unique(asked.begin(), asked.end()), asked.end());
  std::vector<int64_t> out;
  std::lock_guard<std::mutex> lock(mu_);
  Reader* found = Registered(reader);
  if (found == nullptr) return out;
  Reader& r = *found;
  Compact(r);  // sorted and unique: the intersection and the rest in one merge
  std::vector<int64_t> rest;
  rest.reserve(r.keys.size());
  auto a = asked.begin();
  for (int64_t key : r.keys) {
    while (a != asked.end() && *a < key) ++a;
    if (a != asked.end() && *a == key) {
      out.push_back(key);
      r.pushed.erase(key);  // (its increments' floats stay until the next Take)
    } else {
      rest.push_back(key);
    }
  }
  r.keys.swap(rest);
  r.sorted = r.keys.size();
  r.compact_at = std::max(kMinCompact, 2 * r.keys.size());
  return out;
}

int64_t ChangeLog::Held(int64_t reader) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = readers_.find(reader);
  return it == readers_.end() ? 0 : static_cast<int64_t>(it->second.keys.size());
}

void ChangeLog::Compact(Reader& reader) {
  auto& keys = reader.keys;
  const auto prefix = keys.begin() + static_cast<std::ptrdiff_t>(reader.sorted);
  std::sort(prefix, keys.end());
  std::inplace_merge(keys.begin(), prefix, keys.end());
  keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
  reader.sorted = keys.size();
  reader.compact_at = std::max(kMinCompact, 2 * keys.size());
}

}  // namespace tfpsx
