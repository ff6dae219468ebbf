// The in-RAM index of a tiered table's disk rows: which segment may hold a key, at 4
// bytes an entry and no key stored.
//
// A cuckoo filter (Fan et al., 2014) whose entries carry a payload: each is a 16-bit
// fingerprint of the key beside the 16-bit id of the segment that holds its row, in
// buckets of 4, each key having two buckets (the second one derived from the first and
// the fingerprint, so entries move between their buckets without the key). A lookup
// returns the segments whose entries match the key's fingerprint in its buckets: the
// caller reads those rows and keeps the one whose key matches (a fingerprint shared by
// another key costs a read, ~8 / 65,536 per level, never a wrong row). A key that was
// never stored matches nothing but such collisions, so it costs no disk read.
//
// A full level does not rehash (the keys are not here to rehash): the next one, twice
// as large, takes new keys, and lookups ask every level. Memory is 4 bytes an entry
// over the filled levels' load (~95% with buckets of 4), so 4.2-8.4 bytes a key.
// Not thread-safe: the tiered table's lock guards it.

#ifndef TFPSX_CORE_KEY_INDEX_H_
#define TFPSX_CORE_KEY_INDEX_H_

#include <cstdint>
#include <utility>
#include <vector>

namespace tfpsx {

class KeyIndex {
 public:
  static constexpr int kWays = 4;
  static constexpr int64_t kMaxSegments = 65535;  // ids 0..65534
  static constexpr int64_t kFirstBuckets = 1 << 12;   // 64 KiB

  // first_buckets: buckets of the first level (a power of two).
  explicit KeyIndex(int64_t first_buckets = kFirstBuckets);

  // Adds an entry for key in segment `segment`. A key may have several entries only
  // while the caller keeps at most one of them current (the others' rows marked dead).
  void Insert(int64_t key, int64_t segment);
  // The segments of the entries matching key, appended to `out`.
  void Candidates(int64_t key, std::vector<int32_t>* out) const;
  // For keys[n]: (key, segment) of every matching entry, appended to `out`; the buckets
  // of the keys ahead are prefetched (a lookup touches two cache lines per level).
  void Candidates(const int64_t* keys, int64_t n,
                  std::vector<std::pair<int64_t, int32_t>>* out) const;
  // Removes one entry of key in `segment`; false when there is none.
  bool Erase(int64_t key, int64_t segment);
  // Moves one entry of key from segment `from` to segment `to` (compaction).
  bool Relabel(int64_t key, int64_t from, int64_t to);
  void Clear();

  int64_t size() const { return size_; }
  int64_t bytes() const;
  int levels() const { return static_cast<int>(levels_.size()); }

 private:
  struct Level {
    std::vector<uint32_t> slots;  // buckets * kWays entries: fp << 16 | segment; 0 empty
    uint64_t mask = 0;            // buckets - 1
    int64_t count = 0;            // entries held
  };
  struct Where {
    uint64_t h;
    uint32_t fp;
  };
  static Where Locate(int64_t key);
  static uint64_t Alternate(uint64_t bucket, uint32_t fp, uint64_t mask);
  static uint32_t Entry(uint32_t fp, int64_t segment) {
    return fp << 16 | static_cast<uint32_t>(segment);
  }
  // Puts entry in one of its buckets of `level`, moving others; false (level unchanged)
  // when no place was found within the kick limit.
  bool Place(Level& level, uint32_t entry, uint64_t bucket);
  // The entry and its level, or {nullptr, nullptr}.
  std::pair<uint32_t*, Level*> FindEntry(int64_t key, int64_t segment);

  std::vector<Level> levels_;
  int64_t size_ = 0;
  uint64_t kick_state_ = 0x9e3779b97f4a7c15ULL;
};

}  // namespace tfpsx

#endif  // TFPSX_CORE_KEY_INDEX_H_
