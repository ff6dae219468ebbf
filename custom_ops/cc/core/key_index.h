// The in-RAM index of a tiered table's disk rows: where a key's row may be, at 4 bytes an
// entry and no key stored.
//
// A cuckoo filter (Fan et al., 2014) whose entries carry a payload: each is an 11-bit
// fingerprint of the key, the 16-bit id of the segment that holds its row and the
// row's 5-bit place in its group of the segment (segment_store.h: the group is found
// from the key by the segment's fences, so a lookup reads that one record, not the
// group). Buckets of 4 entries; each key has two buckets, the second derived from the
// first and the fingerprint, so entries move between their buckets without the key. A
// lookup returns the entries matching the key's fingerprint in its two buckets (one
// cache line each): the caller reads those records and keeps the one whose key matches
// (a fingerprint shared by another key costs a read, ~8 / 2,047 of lookups, never a
// wrong row). A key that was never stored matches nothing but such collisions, so it
// costs no disk read.
//
// One level, of any number of buckets. It cannot grow by itself (the keys are not here
// to place again): Insert refuses an entry once the level is 95% full (or when no place
// is found), and the owner rebuilds it larger from the disk's keys (Reset, then Insert
// of every live disk row). Memory: 4 bytes an entry over the load, which the owner keeps
// between 50% and 95% above the least size (rebuilt for 60% when the disk's rows reach
// 95% of its room, or fall below half of it: evicted, removed, brought back): 4.2-8
// bytes a key. (A rebuild after rows left costs a scan of what remains; an eviction
// scans the disk's rows anyway.)
// Not thread-safe: the tiered table's lock guards it.

#ifndef TFPSX_CORE_KEY_INDEX_H_
#define TFPSX_CORE_KEY_INDEX_H_

#include <cstdint>
#include <vector>

namespace tfpsx {

class KeyIndex {
 public:
  static constexpr int kWays = 4;
  static constexpr int64_t kMaxSegments = 65535;  // ids 0..65534
  static constexpr int64_t kMaxSlot = 31;         // places in a group: 0..31
  static constexpr int64_t kFirstBuckets = 1 << 12;  // 64 KiB
  static constexpr double kMaxLoad = 0.95;
  // The load a rebuild sizes the level for; below kShrinkLoad the owner rebuilds it
  // smaller.
  static constexpr double kRebuildLoad = 0.6;
  static constexpr double kShrinkLoad = 0.5;

  struct Candidate {
    int64_t key;
    int32_t segment;
    int32_t slot;  // the record's place in its group
  };

  explicit KeyIndex(int64_t buckets = kFirstBuckets);

  // Adds an entry for key at (segment, slot). False, nothing changed, when the level is
  // full: the owner rebuilds it (Reset with more buckets, every key again). A key may
  // have several entries only while the caller keeps at most one of them current (the
  // others' records dead).
  bool Insert(int64_t key, int64_t segment, int64_t slot);
  // The candidates of keys[n] (every entry matching a key's fingerprint), appended to
  // `out`; the buckets of the keys ahead are prefetched.
  void Candidates(const int64_t* keys, int64_t n, std::vector<Candidate>* out) const;
  // Removes the entry of key at (segment, slot); false when there is none.
  bool Erase(int64_t key, int64_t segment, int64_t slot);
  // Moves the entry of key from (from, from_slot) to (to, to_slot) (compaction).
  bool Relabel(int64_t key, int64_t from, int64_t from_slot, int64_t to, int64_t to_slot);
  // Empties the level and sizes it to `buckets` (>= 1). Throws std::bad_alloc with the
  // index left empty, of 0 buckets.
  void Reset(int64_t buckets);
  // The buckets a rebuild for `keys` entries takes (kRebuildLoad; never below the first).
  static int64_t BucketsFor(int64_t keys, int64_t at_least = kFirstBuckets);

  int64_t size() const { return size_; }
  int64_t buckets() const { return buckets_; }
  int64_t bytes() const { return static_cast<int64_t>(slots_.capacity()) * 4; }

 private:
  struct Where {
    uint64_t bucket;
    uint32_t fp;
  };
  Where Locate(int64_t key) const;
  uint64_t Alternate(uint64_t bucket, uint32_t fp) const;
  static uint32_t Entry(uint32_t fp, int64_t segment, int64_t slot) {
    return fp << 21 | static_cast<uint32_t>(segment) << 5 | static_cast<uint32_t>(slot);
  }
  // Puts entry in one of its buckets, moving others; false (level unchanged) when no
  // place was found within the kick limit.
  bool Place(uint32_t entry, uint64_t bucket);
  uint32_t* FindEntry(int64_t key, uint32_t segment_and_slot);

  std::vector<uint32_t> slots_;  // buckets_ * kWays entries; 0: empty
  int64_t buckets_ = 0;
  int64_t size_ = 0;
  uint64_t kick_state_ = 0x9e3779b97f4a7c15ULL;
};

}  // namespace tfpsx

#endif  // TFPSX_CORE_KEY_INDEX_H_
