#include "custom_ops/cc/core/key_index.h"

#include <algorithm>
#include <stdexcept>
#include <utility>

#include "custom_ops/cc/core/initializer.h"

namespace tfpsx {
namespace {

constexpr int kMaxKicks = 500;

}  // namespace

KeyIndex::KeyIndex(int64_t first_buckets) {
  if (first_buckets < 1 || (first_buckets & (first_buckets - 1)) != 0)
    throw std::invalid_argument("KeyIndex: first_buckets must be a power of two");
  Level level;
  level.slots.assign(static_cast<size_t>(first_buckets * kWays), 0);
  level.mask = static_cast<uint64_t>(first_buckets - 1);
  levels_.push_back(std::move(level));
}

KeyIndex::Where KeyIndex::Locate(int64_t key) {
  // A hash of its own (not the RAM table's HashKey), so that a key's place here does
  // not correlate with its stripe there.
  const uint64_t h = Mix(static_cast<uint64_t>(key) ^ 0x5bd1e9955bd1e995ULL);
  uint32_t fp = static_cast<uint32_t>(h >> 48);
  if (fp == 0) fp = 1;  // 0 marks an empty slot
  return {h, fp};
}

uint64_t KeyIndex::Alternate(uint64_t bucket, uint32_t fp, uint64_t mask) {
  return (bucket ^ Mix(fp)) & mask;
}

bool KeyIndex::Place(Level& level, uint32_t entry, uint64_t bucket) {
  const uint64_t mask = level.mask;
  const uint32_t fp = entry >> 16;
  const uint64_t other = Alternate(bucket, fp, mask);
  for (uint64_t b : {bucket, other}) {
    for (int w = 0; w < kWays; ++w) {
      uint32_t& slot = level.slots[b * kWays + w];
      if (slot == 0) {
        slot = entry;
        return true;
      }
    }
  }
  // Kick: swap the entry in hand with one of the bucket's and move that one to its
  // other bucket, kMaxKicks times at most; on failure undo every swap in reverse.
  std::vector<size_t> path;
  uint32_t hand = entry;
  uint64_t b = (kick_state_ & 1) ? bucket : other;
  for (int kick = 0; kick < kMaxKicks; ++kick) {
    kick_state_ = kick_state_ * 6364136223846793005ULL + 1442695040888963407ULL;
    const size_t at = b * kWays + ((kick_state_ >> 33) & (kWays - 1));
    std::swap(hand, level.slots[at]);
    path.push_back(at);
    b = Alternate(b, hand >> 16, mask);
    for (int w = 0; w < kWays; ++w) {
      uint32_t& slot = level.slots[b * kWays + w];
      if (slot == 0) {
        slot = hand;
        return true;
      }
    }
  }
  for (auto it = path.rbegin(); it != path.rend(); ++it) std::swap(hand, level.slots[*it]);
  return false;  // hand == entry again
}

void KeyIndex::Insert(int64_t key, int64_t segment) {
  if (segment < 0 || segment >= kMaxSegments)
    throw std::out_of_range("KeyIndex: segment id out of range");
  const Where w = Locate(key);
  const uint32_t entry = Entry(w.fp, segment);
  // A free slot in an earlier level first: the rows that leave the disk free theirs, and
  // reusing them keeps the index the size of what the disk holds.
  for (size_t l = 0; l + 1 < levels_.size(); ++l) {
    Level& level = levels_[l];
    // A level more than 90% full rarely has a free slot in the key's two buckets.
    if (level.count * 10 > static_cast<int64_t>(level.slots.size()) * 9) continue;
    const uint64_t b1 = w.h & level.mask, b2 = Alternate(b1, w.fp, level.mask);
    for (uint64_t b : {b1, b2}) {
      for (int i = 0; i < kWays; ++i) {
        uint32_t& slot = level.slots[b * kWays + i];
        if (slot == 0) {
          slot = entry;
          ++level.count;
          ++size_;
          return;
        }
      }
    }
  }
  Level* level = &levels_.back();
  if (!Place(*level, entry, w.h & level->mask)) {
    Level next;
    next.mask = level->mask * 2 + 1;
    next.slots.assign(static_cast<size_t>((next.mask + 1) * kWays), 0);
    levels_.push_back(std::move(next));
    level = &levels_.back();
    if (!Place(*level, entry, w.h & level->mask))
      throw std::length_error("KeyIndex: a fresh level took no entry");
  }
  ++level->count;
  ++size_;
}

void KeyIndex::Candidates(int64_t key, std::vector<int32_t>* out) const {
  const Where w = Locate(key);
  for (const Level& level : levels_) {
    const uint64_t b1 = w.h & level.mask, b2 = Alternate(b1, w.fp, level.mask);
    for (uint64_t b : {b1, b2}) {
      for (int i = 0; i < kWays; ++i) {
        const uint32_t e = level.slots[b * kWays + i];
        if (e != 0 && (e >> 16) == w.fp) out->push_back(static_cast<int32_t>(e & 0xffff));
      }
      if (b2 == b1) break;
    }
  }
}

void KeyIndex::Candidates(const int64_t* keys, int64_t n,
                          std::vector<std::pair<int64_t, int32_t>>* out) const {
  constexpr int64_t kAhead = 8;
  auto prefetch = [&](int64_t key) {
    const Where w = Locate(key);
    for (const Level& level : levels_) {
      const uint64_t b1 = w.h & level.mask;
      __builtin_prefetch(&level.slots[b1 * kWays]);
      __builtin_prefetch(&level.slots[Alternate(b1, w.fp, level.mask) * kWays]);
    }
  };
  for (int64_t i = 0; i < std::min(n, kAhead); ++i) prefetch(keys[i]);
  std::vector<int32_t> segments;
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n) prefetch(keys[i + kAhead]);
    segments.clear();
    Candidates(keys[i], &segments);
    for (int32_t seg : segments) out->emplace_back(keys[i], seg);
  }
}

std::pair<uint32_t*, KeyIndex::Level*> KeyIndex::FindEntry(int64_t key, int64_t segment) {
  const Where w = Locate(key);
  const uint32_t entry = Entry(w.fp, segment);
  // The largest level first: it holds about half the entries (a lookup of a stored key
  // then touches ~2 levels, not all of them).
  for (auto it = levels_.rbegin(); it != levels_.rend(); ++it) {
    Level& level = *it;
    const uint64_t b1 = w.h & level.mask, b2 = Alternate(b1, w.fp, level.mask);
    for (uint64_t b : {b1, b2}) {
      for (int i = 0; i < kWays; ++i) {
        uint32_t& e = level.slots[b * kWays + i];
        if (e == entry) return {&e, &level};
      }
    }
  }
  return {nullptr, nullptr};
}

bool KeyIndex::Erase(int64_t key, int64_t segment) {
  auto [e, level] = FindEntry(key, segment);
  if (e == nullptr) return false;
  *e = 0;
  --level->count;
  --size_;
  return true;
}

bool KeyIndex::Relabel(int64_t key, int64_t from, int64_t to) {
  uint32_t* e = FindEntry(key, from).first;
  if (e == nullptr) return false;
  *e = Entry(*e >> 16, to);
  return true;
}

void KeyIndex::Clear() {
  levels_.resize(1);
  std::fill(levels_[0].slots.begin(), levels_[0].slots.end(), 0);
  levels_[0].count = 0;
  size_ = 0;
}

int64_t KeyIndex::bytes() const {
  int64_t total = 0;
  for (const Level& level : levels_) total += static_cast<int64_t>(level.slots.capacity()) * 4;
  return total;
}

}  // namespace tfpsx
