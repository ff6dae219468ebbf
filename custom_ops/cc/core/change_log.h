// Per-reader change tracking for sparse GEO: every write marks its keys changed for all
// registered readers; Take returns a reader's keys changed since its last call and resets
// them. A reader is registered by its first Take. Until one is, writers skip collecting
// keys altogether (active() is one atomic load).
//
// Thread safety: every method may be called concurrently.

#ifndef TFPSX_CORE_CHANGE_LOG_H_
#define TFPSX_CORE_CHANGE_LOG_H_

#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace tfpsx {

class ChangeLog {
 public:
  bool active() const { return active_.load(std::memory_order_acquire); }
  // Marks keys[n] changed for every registered reader but `skip_reader` (-1: none): a
  // worker's own push need not come back to it in its next pull.
  void Mark(const int64_t* keys, int64_t n, int64_t skip_reader = -1);
  // The reader's keys changed since its previous call, sorted; registers a new reader
  // (and returns nothing).
  std::vector<int64_t> Take(int64_t reader);

 private:
  std::atomic<bool> active_{false};
  std::mutex mu_;
  std::unordered_map<int64_t, std::unordered_set<int64_t>> changed_;
};

}  // namespace tfpsx

#endif  // TFPSX_CORE_CHANGE_LOG_H_
