#include "custom_ops/cc/core/change_log.h"

#include <algorithm>

namespace tfpsx {

void ChangeLog::Mark(const int64_t* keys, int64_t n, int64_t skip_reader) {
  if (!active()) return;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& reader : changed_) {
    if (reader.first != skip_reader) reader.second.insert(keys, keys + n);
  }
}

std::vector<int64_t> ChangeLog::Take(int64_t reader) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int64_t> out;
  auto it = changed_.find(reader);
  if (it == changed_.end()) {
    changed_[reader];  // registered from now on
    active_.store(true, std::memory_order_release);
    return out;
  }
  out.assign(it->second.begin(), it->second.end());
  std::sort(out.begin(), out.end());
  it->second.clear();
  return out;
}

}  // namespace tfpsx
