// Per-reader change tracking for sparse GEO: every write marks its keys changed for all
// registered readers; Take returns a reader's keys changed since its last call and resets
// them. A reader is registered by its first Take. Until one is, writers skip collecting
// keys altogether (active() is one atomic load).
//
// Pushes are tracked further (GEO's parallel pushes of a row, hash_table.h's
// HashTable::Combine): a reader keeps, per key, how many pushes marked it since its last
// Take and, for pushes that give their increments, their sum (the row's move by others
// since the reader last pulled it). Other writes, such as a lookup inserting a row, an
// optimizer's update or a summed push, mark without counting.
//
// A reader's marked keys are an append-only list, made unique by Take. Mark compacts
// it when it reaches twice the size of its sorted, unique prefix (sorting only the keys
// appended since and merging them in, linear in the list), so that a reader that takes
// rarely holds at most about twice its distinct keys (or 65,536), 8 bytes each (the
// vector's capacity up to twice that), not one hash node per key. A mark without counting is then a copy per reader, not a hash-set
// insert per key and reader: on a GEO parameter server every write marks for N readers,
// and the per-reader sets were its largest cost (12% of the PS's CPU, plus their
// allocations, at 1 PS + 4 workers under GEO's rule for many workers, whose pushes are
// summed, measured with perf). Counted pushes (the earlier rule's "mean" / "scaled"
// combines) also keep a per-key map of their counts and increments.
//
// Thread safety: every method may be called concurrently.

#ifndef TFPSX_CORE_CHANGE_LOG_H_
#define TFPSX_CORE_CHANGE_LOG_H_

#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace tfpsx {

class ChangeLog {
 public:
  bool active() const { return active_.load(std::memory_order_acquire); }
  // Marks keys[n] changed for every registered reader but `skip_reader` (-1: none): a
  // worker's own push need not come back to it in its next pull. `push`: counted as a
  // push; `moved` (push only, may be null): the rows' increments, n * dim floats.
  void Mark(const int64_t* keys, int64_t n, int64_t skip_reader = -1, bool push = false,
            const float* moved = nullptr, int64_t dim = 0);
  // The reader's keys changed since its previous call, sorted; registers a new reader
  // (and returns nothing).
  std::vector<int64_t> Take(int64_t reader);
  // Of the reader's keys changed since its previous Take, those among keys[n] (any
  // order, repeats allowed), sorted; they are reset, the others stay marked for a later
  // Take or TakeAmong (GEO's pull of the rows a worker will read). Registers a new
  // reader (and returns nothing), as Take.
  std::vector<int64_t> TakeAmong(int64_t reader, const int64_t* keys, int64_t n);
  // For `reader` since its previous Take (nothing for a reader not registered):
  // pushes[i], the pushes that marked keys[i]; moved[i * dim ...] (may be null), the sum
  // of the increments they gave (zeros when none).
  void Pushes(int64_t reader, const int64_t* keys, int64_t n, int32_t* pushes,
              float* moved = nullptr, int64_t dim = 0);
  // The keys the reader's list holds now, repeats included (0 for a reader not
  // registered): what its marks cost in memory, 8 bytes each.
  int64_t Held(int64_t reader);

 private:
  struct Marked {
    int32_t pushes = 0;
    int64_t moved = -1;  // offset of the increments' sum in Reader::moved (-1: none)
  };
  struct Reader {
    std::vector<int64_t> keys;  // marked since the last Take: a sorted unique prefix,
                                // then the keys marked since, with repeats
    size_t sorted = 0;          // the prefix's length
    size_t compact_at = kMinCompact;  // keys.size() that makes Mark compact them
    std::unordered_map<int64_t, Marked> pushed;  // the counted pushes' keys
    std::vector<float> moved;  // dim floats per key with increments, cleared by Take
  };
  static constexpr size_t kMinCompact = size_t{1} << 16;
  // The reader's state, or null after registering a reader not seen before (mu_ held).
  Reader* Registered(int64_t reader);
  // Makes reader.keys sorted and unique in place (the new keys sorted, then merged into
  // the prefix); the next compaction comes at twice the size.
  static void Compact(Reader& reader);
  std::atomic<bool> active_{false};
  std::mutex mu_;
  std::unordered_map<int64_t, Reader> readers_;
};

}  // namespace tfpsx

#endif  // TFPSX_CORE_CHANGE_LOG_H_
