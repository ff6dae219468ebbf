// Native tests of the data plane's core (split_coordinator.h, split_reader.h): leases,
// commits, returns and expiry keep every split of an epoch trained at least once and
// its committed positions monotonic; the exported state restores exactly; a split's
// records are the file's, read from any committed position, each once over the splits.

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "custom_ops/cc/core/split_coordinator.h"
#include "custom_ops/cc/core/split_reader.h"
#include "custom_ops/tests/check.h"

namespace {

using tfpsx::RecordFormat;
using tfpsx::SplitCoordinator;
using tfpsx::SplitLease;
using tfpsx::SplitSpec;
using tfpsx_test::failures;

std::string TempFile(const std::string& contents) {
  char tmpl[] = "/tmp/tfpsx_split_XXXXXX";
  const int fd = ::mkstemp(tmpl);
  if (fd < 0) throw std::runtime_error("mkstemp failed");
  size_t done = 0;
  while (done < contents.size()) {
    const ssize_t w = ::write(fd, contents.data() + done, contents.size() - done);
    if (w <= 0) throw std::runtime_error("write failed");
    done += static_cast<size_t>(w);
  }
  ::close(fd);
  return tmpl;
}

std::vector<SplitSpec> Ranges(int files, int per_file, int64_t bytes) {
  std::vector<SplitSpec> out;
  for (int f = 0; f < files; ++f)
    for (int i = 0; i < per_file; ++i) out.push_back({f, i * bytes, (i + 1) * bytes});
  return out;
}

void TestOrderIsAPermutationThatDependsOnTheEpoch() {
  const auto a = tfpsx::EpochOrder(7, 0, 100), b = tfpsx::EpochOrder(7, 1, 100);
  std::vector<int32_t> sorted = a;
  std::sort(sorted.begin(), sorted.end());
  for (int i = 0; i < 100; ++i) CHECK(sorted[i] == i);
  CHECK(a != b);
  CHECK(a == tfpsx::EpochOrder(7, 0, 100));  // the same on every worker
}

// Three workers take and commit splits of two epochs; one takes two and dies (no
// renewals): its splits come back after the lease, from their committed positions, and
// every split of both epochs is done, none twice past its position.
void TestLeasesCommitsAndExpiry() {
  SplitCoordinator c;
  c.Configure("in-a", 11, Ranges(2, 10, 100), /*lease_ms=*/1000);
  int64_t now = 0;
  std::map<int64_t, int64_t> trained;  // key -> records trained (offset units)
  // Worker 2 takes two splits, trains half of the first, commits, and dies.
  const SplitLease d1 = c.Take(2, 0, now), d2 = c.Take(2, 0, now);
  CHECK(d1.status == SplitLease::kOk && d2.status == SplitLease::kOk && d1.index != d2.index);
  const int64_t half[] = {d1.key()}, half_off[] = {d1.start + 50};
  c.Commit(half, half_off, 1);
  std::set<int64_t> done;
  int rounds = 0;
  for (bool busy = true; busy && rounds < 10000; ++rounds) {
    busy = false;
    for (int32_t w = 0; w < 2; ++w) {
      const SplitLease l = c.Take(w, 1, now);
      if (l.status == SplitLease::kWait) {
        busy = true;
        continue;
      }
      if (l.status == SplitLease::kEnd) continue;
      busy = true;
      if (l.key() == d1.key()) CHECK(l.resume == d1.start + 50);  // from its position
      CHECK(!done.count(l.key()));
      const int64_t key = l.key(), end = l.end;
      c.Commit(&key, &end, 1);
      done.insert(key);
    }
    now += 100;  // time passes: worker 2's leases expire after 1000 ms
  }
  CHECK(done.size() == 40);  // 20 splits, 2 epochs
  CHECK(c.Stats().first_open == 2 && c.Stats().leases_returned == 2);
  CHECK(c.Take(0, 1, now).status == SplitLease::kEnd);
  // A late commit of a finished epoch's split changes nothing.
  const int64_t late[] = {d2.key()}, late_off[] = {d2.end};
  CHECK(c.Commit(late, late_off, 1) == 0);
}

// A worker in epoch 1 takes a split of epoch 0 that came back first.
void TestAGivenBackSplitIsTakenBeforeTheNextEpoch() {
  SplitCoordinator c;
  c.Configure("in-b", 3, Ranges(1, 4, 10), 1000);
  std::vector<SplitLease> held;
  for (int i = 0; i < 4; ++i) held.push_back(c.Take(0, 0, 0));
  CHECK(c.Take(1, 0, 0).status == SplitLease::kWait);  // all leased by worker 0
  CHECK(c.Take(0, 0, 0).status == SplitLease::kEnd);   // its own: nothing to wait for
  for (int i = 1; i < 4; ++i) {
    const int64_t k = held[i].key(), e = held[i].end;
    c.Commit(&k, &e, 1);
  }
  const int64_t other_key = held[1].key(), not_held = SplitLease::Key(0, 99);
  const int64_t back_keys[] = {held[0].key(), other_key, not_held};
  CHECK(c.GiveBack(1, back_keys, 3) == 0);  // not worker 1's
  CHECK(c.GiveBack(0, back_keys, 3) == 1);  // held[0] (held[1] is done)
  CHECK(c.Take(0, 0, 0).index == held[0].index);  // back at the front
  CHECK(c.Release(0) == 1);  // worker 0 started again: its last lease comes back
  const SplitLease l = c.Take(1, 1, 0);
  CHECK(l.status == SplitLease::kOk && l.epoch == 0 && l.index == held[0].index);
  CHECK(c.Stats().first_open == 0 && c.Stats().leased == 1);
}

void TestAnExactSavesBarrierPausesTakesAndCountsTheHoldersAcks() {
  SplitCoordinator c;
  c.Configure("in-barrier", 5, Ranges(1, 6, 10), /*lease_ms=*/1000);
  const SplitLease a = c.Take(0, 0, 0), b = c.Take(1, 0, 0);
  CHECK(a.status == SplitLease::kOk && b.status == SplitLease::kOk);
  CHECK(!c.Barrier(0).up && c.Barrier(0).waiting == 2);  // (no barrier: nobody acked)
  const int64_t g = c.BarrierBegin(10, /*timeout_ms=*/500);
  CHECK(g == 1 && c.Barrier(10).up && c.Barrier(10).waiting == 2);
  c.BarrierAck(0, g);
  CHECK(c.Barrier(20).waiting == 1);
  CHECK(c.Take(0, 0, 20).status == SplitLease::kPaused);  // it acked: it trains no more
  // Worker 1 has not acked: its pipeline may take the next split to reach its next step.
  const SplitLease b2 = c.Take(1, 0, 20);
  CHECK(b2.status == SplitLease::kOk && c.Barrier(20).waiting == 1);
  c.BarrierAck(1, g - 1);  // an older barrier's ack counts for nothing
  CHECK(c.Barrier(20).waiting == 1);
  const int64_t both[] = {a.key(), b.key(), b2.key()}, ends[] = {a.end, b.end, b2.end};
  CHECK(c.Commit(both + 1, ends + 1, 2) == 2);  // worker 1's splits done: it holds none
  CHECK(c.Barrier(30).waiting == 0);  // every holder acked: sealed
  CHECK(c.Take(2, 0, 30).status == SplitLease::kPaused);  // nobody joins the save now
  c.BarrierEnd(g - 1);  // not the last barrier: still up
  CHECK(c.Barrier(30).up);
  c.BarrierEnd(g);
  CHECK(!c.Barrier(30).up && c.Take(2, 0, 30).status == SplitLease::kOk);
  // A saver that dies: the barrier falls by itself at its deadline; a dead worker's
  // expired leases stop counting.
  const int64_t g2 = c.BarrierBegin(40, 100);
  CHECK(g2 == 2 && c.Barrier(139).up && !c.Barrier(140).up);
  CHECK(c.Barrier(140).waiting == 2);  // workers 0 and 2 hold leases, neither acked g2
  CHECK(c.Barrier(5000).waiting == 0);  // both leases expired
  (void)c.Commit(both, ends, 1);
}

void TestExportImportRestoresPositionsAndDropsLeases() {
  SplitCoordinator c;
  c.Configure("in-c", 5, Ranges(1, 6, 100), 1000);
  const SplitLease a = c.Take(0, 0, 0), b = c.Take(1, 0, 0);
  const int64_t keys[] = {a.key(), b.key()}, offs[] = {a.start + 30, b.end};
  c.Commit(keys, offs, 2);
  const std::string saved = c.Export();
  SplitCoordinator d;  // a new job's, restored
  d.Import(saved);
  CHECK(d.configured() && d.digest() == "in-c" && d.Export() == saved);
  std::map<int32_t, int64_t> resumed;
  for (SplitLease l = d.Take(3, 0, 0); l.status == SplitLease::kOk; l = d.Take(3, 0, 0))
    resumed[l.index] = l.resume;
  CHECK(resumed.size() == 5);  // b is done; a comes back from its position
  CHECK(resumed[a.index] == a.start + 30 && !resumed.count(b.index));
  SplitCoordinator e;
  e.Configure("in-other", 5, Ranges(1, 6, 100), 1000);
  bool refused = false;
  try {
    e.Import(saved);
  } catch (const std::invalid_argument& err) {
    refused = std::string(err.what()).find("in-c") != std::string::npos &&
              std::string(err.what()).find("in-other") != std::string::npos;
  }
  CHECK(refused && e.Stats().first_open == 0);
  bool garbage = false;
  try {
    d.Import("not a position");
  } catch (const std::invalid_argument&) {
    garbage = true;
  }
  CHECK(garbage);
  bool other = false;
  try {
    d.Configure("in-d", 5, Ranges(1, 6, 100), 1000);
  } catch (const std::invalid_argument& err) {
    other = std::string(err.what()).find("in-d") != std::string::npos;
  }
  CHECK(other);
}

// Lines read over byte-range splits, from their starts and from committed positions,
// are every line of the file once, with exact end offsets; chunks bound the memory.
void TestTextSplitsHoldEveryLineOnce() {
  std::mt19937 rng(3);
  std::string text;
  std::vector<std::string> lines;
  for (int i = 0; i < 3000; ++i) {
    std::string line = "line-" + std::to_string(i) + std::string(rng() % 40, 'x');
    if (i % 97 == 0) line.clear();  // an empty line is a record too
    lines.push_back(line);
    text += line + "\n";
  }
  text += "tail-without-newline";
  lines.push_back("tail-without-newline");
  const std::string path = TempFile(text);
  for (int64_t split : {int64_t{1}, int64_t{7}, int64_t{1000}, int64_t{100000}}) {
    std::vector<std::string> got;
    int64_t expected_end = 0;
    for (int64_t start = 0; start < static_cast<int64_t>(text.size()); start += split) {
      const int64_t end = std::min<int64_t>(start + split, text.size());
      for (int64_t at = start; at != -1;) {
        const tfpsx::SplitChunk c = tfpsx::ReadSplit(path, RecordFormat::kText, start, at, end,
                                                     /*max_bytes=*/500);
        for (size_t i = 0; i < c.records.size(); ++i) {
          got.push_back(c.records[i]);
          expected_end += static_cast<int64_t>(c.records[i].size()) + 1;
          CHECK(c.ends[i] == std::min<int64_t>(expected_end, text.size()));
        }
        at = c.next;
      }
    }
    CHECK(got == lines);
  }
  // From a committed position: the lines after it.
  const int64_t after = static_cast<int64_t>(lines[0].size() + lines[1].size() + 2);
  const auto c = tfpsx::ReadSplit(path, RecordFormat::kText, 0, after, 200, 1 << 20);
  CHECK(!c.records.empty() && c.records[0] == lines[2]);
  // A split of a large file reads about its own bytes.
  std::string big(64 << 20, 'a');
  for (size_t i = 99; i < big.size(); i += 100) big[i] = '\n';
  const std::string big_path = TempFile(big);
  const auto mid = tfpsx::ReadSplit(big_path, RecordFormat::kText, 40 << 20, 40 << 20,
                                    (40 << 20) + (1 << 20), 4 << 20);
  CHECK(mid.records.size() == (1 << 20) / 100 + 1 || mid.records.size() == (1 << 20) / 100);
  CHECK(mid.bytes_read <= (1 << 20) + (600 << 10));  // the split and a little past it
  ::unlink(big_path.c_str());
  bool named = false;
  try {
    tfpsx::ReadSplit("/nonexistent/tfpsx.txt", RecordFormat::kText, 0, 0, 10, 10);
  } catch (const std::runtime_error& e) {
    named = std::string(e.what()).find("/nonexistent/tfpsx.txt") != std::string::npos;
  }
  CHECK(named);
  ::unlink(path.c_str());
}

std::string TfRecord(const std::string& data) {
  std::string out(12, '\0');
  const uint64_t len = data.size();
  std::memcpy(&out[0], &len, 8);
  const uint32_t lc = tfpsx::MaskCrc(tfpsx::Crc32c(out.data(), 8));
  std::memcpy(&out[8], &lc, 4);
  out += data;
  const uint32_t dc = tfpsx::MaskCrc(tfpsx::Crc32c(data.data(), data.size()));
  out.append(reinterpret_cast<const char*>(&dc), 4);
  return out;
}

void TestTfRecordsWithTheirCrcs() {
  // CRC-32C of "123456789" is 0xE3069283 (the standard check value).
  CHECK(tfpsx::Crc32c("123456789", 9) == 0xE3069283u);
  std::string file;
  std::vector<int64_t> ends;
  for (int i = 0; i < 50; ++i) {
    file += TfRecord("record-" + std::to_string(i));
    ends.push_back(static_cast<int64_t>(file.size()));
  }
  const std::string path = TempFile(file);
  std::vector<std::string> got;
  for (int64_t at = 0; at != -1;) {
    const auto c = tfpsx::ReadSplit(path, RecordFormat::kTfRecord, 0, at, file.size(), 64);
    got.insert(got.end(), c.records.begin(), c.records.end());
    for (size_t i = 0; i < c.ends.size(); ++i) CHECK(c.ends[i] == ends[got.size() - c.ends.size() + i]);
    at = c.next;
  }
  CHECK(got.size() == 50 && got[49] == "record-49");
  const auto resumed = tfpsx::ReadSplit(path, RecordFormat::kTfRecord, 0, ends[9], file.size(),
                                        1 << 20);
  CHECK(resumed.records.size() == 40 && resumed.records[0] == "record-10");
  std::string damaged = file;
  damaged[ends[3] + 14] ^= 1;  // a byte of record 4's data
  const std::string bad = TempFile(damaged);
  bool caught = false;
  try {
    tfpsx::ReadSplit(bad, RecordFormat::kTfRecord, 0, 0, damaged.size(), 1 << 20);
  } catch (const std::runtime_error& e) {
    caught = std::string(e.what()).find("offset " + std::to_string(ends[3])) != std::string::npos;
  }
  CHECK(caught);
  ::unlink(path.c_str());
  ::unlink(bad.c_str());
}

void TestAStreamGrowsAsFilesLandWaitsForMoreAndStops() {
  SplitCoordinator c;
  c.ConfigureStream("stream-a", 3, 1000);
  CHECK(c.streaming() && c.Take(0, 0, 0).status == SplitLease::kWait);  // nothing yet
  // Two files land: 2 splits, then 1.
  CHECK(c.Append({"/d/h0/a", "/d/h0/b"}, {{0, 0, 50}, {0, 50, 100}, {1, 0, 40}}) == 3);
  CHECK(c.Append({"/d/h0/a"}, {{0, 0, 50}}) == 0);  // a file appended again: nothing
  CHECK(c.Files(0) == std::vector<std::string>({"/d/h0/a", "/d/h0/b"}));
  const SplitLease a = c.Take(0, 0, 0), b = c.Take(1, 5, 0);  // (a stream's epoch is 0)
  CHECK(a.status == SplitLease::kOk && a.index == 0 && b.index == 1 && b.epoch == 0);
  const int64_t keys[] = {a.key(), b.key()}, offs[] = {a.end, b.end};
  CHECK(c.Commit(keys, offs, 2) == 2);
  const SplitLease d = c.Take(0, 0, 0);
  CHECK(d.status == SplitLease::kOk && d.file == 1 && c.Files(1)[0] == "/d/h0/b");
  const int64_t dk[] = {d.key()}, doff[] = {d.start + 10};
  c.Commit(dk, doff, 1);
  // Everything landed is taken: wait (even with no other holder), the epoch stays open.
  CHECK(c.Take(1, 0, 0).status == SplitLease::kWait && c.Stats().first_open == 0);
  CHECK(c.Append({"/d/h1/a"}, {{0, 0, 30}}) == 1);
  const SplitLease e = c.Take(1, 0, 0);
  CHECK(e.status == SplitLease::kOk && e.file == 2 && e.index == 3);
  // Saved and restored: the files and positions come back; more land after.
  const std::string saved = c.Export();
  SplitCoordinator r;
  r.ConfigureStream("stream-a", 3, 1000);
  r.Import(saved);
  CHECK(r.Export() == saved && r.Files(0).size() == 3);
  std::map<int32_t, int64_t> resumed;
  for (SplitLease l = r.Take(2, 0, 0); l.status == SplitLease::kOk; l = r.Take(2, 0, 0))
    resumed[l.index] = l.resume;
  CHECK(resumed.size() == 2 && resumed[2] == d.start + 10 && resumed[3] == 0);
  CHECK(r.Append({"/d/h1/a", "/d/h2/a"}, {{0, 0, 30}, {1, 0, 8}}) == 1);  // only h2/a
  // Stopped: every take ends, what is left stays in the position.
  r.StopStream();
  CHECK(r.Take(2, 0, 0).status == SplitLease::kEnd);
  SplitCoordinator again;
  again.ConfigureStream("stream-a", 3, 1000);
  again.Import(r.Export());
  const SplitLease next = again.Take(0, 0, 0);
  CHECK(next.status == SplitLease::kOk);  // a restored stream follows on
  // A file input's position into a stream (and back) is refused, naming both.
  SplitCoordinator files;
  files.Configure("stream-a", 3, Ranges(1, 2, 10), 1000);
  bool refused = false;
  try {
    files.Import(saved);
  } catch (const std::invalid_argument& err) {
    refused = std::string(err.what()).find("stream") != std::string::npos;
  }
  CHECK(refused);
  bool not_a_stream = false;
  try {
    files.Append({"x"}, {{0, 0, 1}});
  } catch (const std::logic_error&) {
    not_a_stream = true;
  }
  CHECK(not_a_stream);
}

}  // namespace

int main() {
  TestOrderIsAPermutationThatDependsOnTheEpoch();
  TestLeasesCommitsAndExpiry();
  TestAGivenBackSplitIsTakenBeforeTheNextEpoch();
  TestAnExactSavesBarrierPausesTakesAndCountsTheHoldersAcks();
  TestExportImportRestoresPositionsAndDropsLeases();
  TestAStreamGrowsAsFilesLandWaitsForMoreAndStops();
  TestTextSplitsHoldEveryLineOnce();
  TestTfRecordsWithTheirCrcs();
  return tfpsx_test::Finish("split_coordinator_test");
}
