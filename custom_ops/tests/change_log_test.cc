// Native tests of the per-reader change tracking (change_log.h): what each reader takes,
// the skipped reader, counted pushes and their increments, and the bound on a reader
// that takes rarely.

#include <algorithm>
#include <cstdio>
#include <thread>
#include <vector>

#include "custom_ops/cc/core/change_log.h"
#include "custom_ops/tests/check.h"

namespace {

using tfpsx::ChangeLog;
using tfpsx_test::failures;
using Keys = std::vector<int64_t>;

void Registration() {
  ChangeLog log;
  const int64_t k[] = {5};
  log.Mark(k, 1);  // nobody registered: nothing kept
  CHECK(!log.active());
  CHECK(log.Take(1).empty());  // registers reader 1
  CHECK(log.active());
  CHECK(log.Take(1).empty());  // the mark before it registered is not its
  log.Mark(k, 1);
  CHECK(log.Take(1) == Keys({5}));
  CHECK(log.Take(1).empty());  // taken: reset
}

void SortedUniqueAndSkip() {
  ChangeLog log;
  log.Take(0);
  log.Take(1);
  log.Take(2);
  const int64_t a[] = {9, 3, 9, 7};
  const int64_t b[] = {3, 1};
  log.Mark(a, 4, /*skip_reader=*/1);
  log.Mark(b, 2);
  CHECK(log.Take(0) == Keys({1, 3, 7, 9}));
  CHECK(log.Take(1) == Keys({1, 3}));  // its own write (skipped) is not in its take
  CHECK(log.Take(2) == Keys({1, 3, 7, 9}));
}

void CountedPushes() {
  ChangeLog log;
  log.Take(0);
  log.Take(1);
  const int64_t keys[] = {4, 6};
  const float moved[] = {1, 2, 10, 20};  // dim 2
  log.Mark(keys, 2, /*skip_reader=*/0, /*push=*/true, moved, 2);
  log.Mark(keys, 1, /*skip_reader=*/0, /*push=*/true, moved, 2);
  const int64_t plain[] = {8};
  log.Mark(plain, 1);  // not a push: counts nothing
  const int64_t asked[] = {4, 6, 8, 11};
  int32_t pushes[4];
  float sums[8];
  log.Pushes(1, asked, 4, pushes, sums, 2);
  CHECK(pushes[0] == 2 && pushes[1] == 1 && pushes[2] == 0 && pushes[3] == 0);
  CHECK(sums[0] == 2 && sums[1] == 4 && sums[2] == 10 && sums[3] == 20);
  CHECK(sums[4] == 0 && sums[5] == 0 && sums[6] == 0 && sums[7] == 0);
  log.Pushes(0, asked, 4, pushes);  // the pusher skipped itself
  CHECK(pushes[0] == 0 && pushes[1] == 0);
  CHECK(log.Take(1) == Keys({4, 6, 8}));
  log.Pushes(1, asked, 4, pushes, sums, 2);  // a take resets the counts
  CHECK(pushes[0] == 0 && pushes[1] == 0 && sums[0] == 0);
  log.Pushes(7, asked, 4, pushes);  // a reader never registered: nothing
  CHECK(pushes[0] == 0);
}

void TakeAmongLeavesTheRest() {
  // GEO's pull of the rows a worker will read: a reader takes the marked keys among
  // those asked (any order, repeats), the others stay marked for a later take; a key
  // asked for but not marked is not taken; a new reader registers, as with Take.
  ChangeLog log;
  CHECK(log.TakeAmong(1, nullptr, 0).empty());  // registers reader 1
  log.Take(2);
  const int64_t marked[] = {8, 2, 5, 11, 2};
  log.Mark(marked, 5);
  const int64_t asked[] = {11, 3, 2, 11};
  CHECK(log.TakeAmong(1, asked, 4) == Keys({2, 11}));
  CHECK(log.TakeAmong(1, asked, 4).empty());  // reset: taken once
  const int64_t again[] = {11};
  log.Mark(again, 1);  // marked again after its take: taken again
  CHECK(log.Held(1) == 3);  // 5, 8 and the new 11
  CHECK(log.Take(1) == Keys({5, 8, 11}));  // the rest, and the new mark
  CHECK(log.Take(2) == Keys({2, 5, 8, 11}));  // another reader: untouched
  // Counted pushes: the taken key's count is reset, the others' kept.
  const int64_t pushed[] = {4, 6};
  const float moved[] = {1, 2, 10, 20};  // dim 2
  log.Mark(pushed, 2, /*skip_reader=*/-1, /*push=*/true, moved, 2);
  const int64_t four[] = {4};
  CHECK(log.TakeAmong(1, four, 1) == Keys({4}));
  int32_t pushes[2];
  float sums[4];
  log.Pushes(1, pushed, 2, pushes, sums, 2);
  CHECK(pushes[0] == 0 && pushes[1] == 1 && sums[2] == 10 && sums[3] == 20);
  // Many keys, a part asked: exactly the part, the rest in the next take.
  std::vector<int64_t> many(200000), part;
  for (int64_t i = 0; i < 200000; ++i) many[i] = (i * 7919) % 200000;
  log.Take(1);
  log.Mark(many.data(), static_cast<int64_t>(many.size()));
  for (int64_t i = 0; i < 200000; i += 3) part.push_back(i);
  CHECK(log.TakeAmong(1, part.data(), static_cast<int64_t>(part.size())) == part);
  const std::vector<int64_t> rest = log.Take(1);
  CHECK(rest.size() == 200000 - part.size());
  CHECK(std::none_of(rest.begin(), rest.end(), [](int64_t k) { return k % 3 == 0; }));
}

void RareTakerStaysBounded() {
  // A reader that does not take while the same keys are marked over and over holds them
  // compacted (at most twice the larger of its distinct keys and the first compaction's
  // 65,536, plus one mark's keys), not every mark; its take is still exact.
  for (int64_t distinct : {int64_t{1000}, int64_t{300000}}) {
    ChangeLog log;
    log.Take(0);
    std::vector<int64_t> keys(distinct);
    for (int64_t i = 0; i < distinct; ++i) keys[i] = distinct - i;  // descending
    int64_t most = 0;
    for (int round = 0; round < 20; ++round) {
      for (int64_t at = 0; at < distinct; at += 1000) {
        log.Mark(keys.data() + at, std::min<int64_t>(1000, distinct - at));
        most = std::max(most, log.Held(0));
      }
    }
    CHECK(most <= 2 * std::max<int64_t>(distinct, 65536) + 1000);
    Keys taken = log.Take(0);
    CHECK(static_cast<int64_t>(taken.size()) == distinct);
    CHECK(taken.front() == 1 && taken.back() == distinct);
    CHECK(log.Held(0) == 0);
  }
  CHECK(ChangeLog().Held(3) == 0);
}

void Concurrent() {
  ChangeLog log;
  for (int64_t r = 0; r < 4; ++r) log.Take(r);
  std::vector<std::thread> threads;
  std::vector<Keys> got(4);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&log, &got, t] {
      for (int64_t i = 0; i < 20000; ++i) {
        const int64_t key = t * 100000 + i;
        log.Mark(&key, 1, /*skip_reader=*/t, /*push=*/i % 2 == 0);
        if (i % 1000 == 0) {
          Keys part = log.Take(t);
          got[t].insert(got[t].end(), part.begin(), part.end());
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < 4; ++t) {
    Keys part = log.Take(t);
    got[t].insert(got[t].end(), part.begin(), part.end());
    // Every other thread's 20,000 keys, each taken once; none of its own.
    CHECK(got[t].size() == 60000);
    for (int64_t key : got[t]) CHECK(key / 100000 != t);
  }
}

}  // namespace

int main() {
  Registration();
  SortedUniqueAndSkip();
  CountedPushes();
  TakeAmongLeavesTheRest();
  RareTakerStaysBounded();
  Concurrent();
  return tfpsx_test::Finish("change_log_test");
}
