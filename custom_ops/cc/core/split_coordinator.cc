#include "custom_ops/cc/core/split_coordinator.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <utility>

namespace tfpsx {
namespace {

constexpr char kMagic[8] = {'T', 'F', 'P', 'S', 'X', 'S', 'P', 'L'};
constexpr uint32_t kVersion = 2;  // 2: a stream's flag and file names (1 still read)

uint64_t SplitMix64(uint64_t* state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

class Writer {
 public:
  template <typename T>
  void Put(T v) {
    out_.append(reinterpret_cast<const char*>(&v), sizeof v);
  }
  void PutBytes(const std::string& s) {
    Put<uint32_t>(static_cast<uint32_t>(s.size()));
    out_ += s;
  }
  std::string Take() { return std::move(out_); }
  void Raw(const char* p, size_t n) { out_.append(p, n); }

 private:
  std::string out_;
};

class Reader {
 public:
  explicit Reader(const std::string& in) : in_(in) {}
  template <typename T>
  T Get() {
    T v;
    Need(sizeof v);
    std::memcpy(&v, in_.data() + at_, sizeof v);
    at_ += sizeof v;
    return v;
  }
  std::string GetBytes() {
    const uint32_t n = Get<uint32_t>();
    Need(n);
    std::string s = in_.substr(at_, n);
    at_ += n;
    return s;
  }
  void Skip(size_t n) {
    Need(n);
    at_ += n;
  }
  bool AtEnd() const { return at_ == in_.size(); }
  void Need(size_t n) const {
    if (in_.size() - at_ < n)
      throw std::invalid_argument("the input position's bytes are cut short (" +
                                  std::to_string(in_.size()) + " bytes)");
  }

 private:
  const std::string& in_;
  size_t at_ = 0;
};

}  // namespace

std::vector<int32_t> EpochOrder(uint64_t seed, int64_t epoch, int32_t n) {
  std::vector<int32_t> order(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) order[i] = i;
  uint64_t state = seed ^ (static_cast<uint64_t>(epoch) * 0xD1B54A32D192ED03ull);
  for (int32_t i = n - 1; i > 0; --i) {
    const int32_t j = static_cast<int32_t>(SplitMix64(&state) % static_cast<uint64_t>(i + 1));
    std::swap(order[i], order[j]);
  }
  return order;
}

void SplitCoordinator::Configure(const std::string& digest, uint64_t seed,
                                 std::vector<SplitSpec> splits, int64_t lease_ms) {
  std::lock_guard<std::mutex> l(mu_);
  if (!digest_.empty()) {
    if (digest != digest_)
      throw std::invalid_argument("the job's input is " + digest_ + ", and this worker's is " +
                                  digest + ": every worker must read the same files with the "
                                  "same split size");
    lease_ms_ = lease_ms;
    return;
  }
  if (digest.empty()) throw std::invalid_argument("an input needs a digest");
  if (splits.empty()) throw std::invalid_argument("an input needs at least one split");
  if (splits.size() > 0x7fffffff) throw std::invalid_argument("too many splits");
  for (const SplitSpec& s : splits)
    if (s.start < 0 || s.end < s.start || s.file < 0)
      throw std::invalid_argument("a split must have 0 <= start <= end and a file >= 0");
  digest_ = digest;
  seed_ = seed;
  splits_ = std::move(splits);
  lease_ms_ = lease_ms;
}

void SplitCoordinator::ConfigureStream(const std::string& digest, uint64_t seed,
                                       int64_t lease_ms) {
  std::lock_guard<std::mutex> l(mu_);
  if (!digest_.empty()) {
    if (digest != digest_)
      throw std::invalid_argument("the job's input is " + digest_ + ", and this worker's is " +
                                  digest + ": every worker must follow the same stream");
    lease_ms_ = lease_ms;
    return;
  }
  if (digest.empty()) throw std::invalid_argument("an input needs a digest");
  digest_ = digest;
  seed_ = seed;
  lease_ms_ = lease_ms;
  streaming_ = true;
}

int64_t SplitCoordinator::Append(const std::vector<std::string>& names,
                                 const std::vector<SplitSpec>& splits) {
  std::lock_guard<std::mutex> l(mu_);
  if (!streaming_) throw std::logic_error("files are appended to a stream only");
  for (const SplitSpec& s : splits)
    if (s.start < 0 || s.end < s.start || s.file < 0 ||
        s.file >= static_cast<int32_t>(names.size()))
      throw std::invalid_argument(
          "a split must have 0 <= start <= end and a file that indexes the names given");
  std::vector<int32_t> index(names.size(), -1);  // the new files' indexes in files_
  for (size_t i = 0; i < names.size(); ++i) {
    if (known_.count(names[i])) continue;
    if (files_.size() >= 0x7fffffff) throw std::invalid_argument("too many files");
    index[i] = static_cast<int32_t>(files_.size());
    known_[names[i]] = index[i];
    files_.push_back(names[i]);
  }
  int64_t added = 0;
  for (const SplitSpec& s : splits) {
    if (index[s.file] < 0) continue;  // a file added before
    if (splits_.size() >= 0x7fffffff) throw std::invalid_argument("too many splits");
    const int32_t i = static_cast<int32_t>(splits_.size());
    splits_.push_back({index[s.file], s.start, s.end});
    for (auto& [number, e] : epochs_) {
      e.committed.push_back(s.start);
      if (Done(e, i)) {
        ++e.done;
      } else {
        e.available.push_back(i);
      }
    }
    ++added;
  }
  return added;
}

std::vector<std::string> SplitCoordinator::Files(int64_t from) const {
  std::lock_guard<std::mutex> l(mu_);
  if (from < 0) from = 0;
  if (from >= static_cast<int64_t>(files_.size())) return {};
  return std::vector<std::string>(files_.begin() + from, files_.end());
}

void SplitCoordinator::StopStream() {
  std::lock_guard<std::mutex> l(mu_);
  stopping_ = true;
}

bool SplitCoordinator::streaming() const {
  std::lock_guard<std::mutex> l(mu_);
  return streaming_;
}

bool SplitCoordinator::configured() const {
  std::lock_guard<std::mutex> l(mu_);
  return !digest_.empty();
}

std::string SplitCoordinator::digest() const {
  std::lock_guard<std::mutex> l(mu_);
  return digest_;
}

int64_t SplitCoordinator::FirstOpen() const {
  std::lock_guard<std::mutex> l(mu_);
  return first_open_;
}

SplitCoordinator::Epoch& SplitCoordinator::Open(int64_t epoch) {
  auto it = epochs_.find(epoch);
  if (it != epochs_.end()) return it->second;
  Epoch& e = epochs_[epoch];
  const int32_t n = static_cast<int32_t>(splits_.size());
  e.committed.resize(splits_.size());
  for (int32_t i = 0; i < n; ++i) e.committed[i] = splits_[i].start;
  std::vector<int32_t> order(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) order[i] = i;  // a stream: in landing order
  if (!streaming_) order = EpochOrder(seed_, epoch, n);
  for (int32_t i : order) {
    if (Done(e, i)) {
      ++e.done;  // an empty range: nothing to train
    } else {
      e.available.push_back(i);
    }
  }
  return e;
}

void SplitCoordinator::ExpireLocked(int64_t now_ms) {
  for (auto& [number, e] : epochs_) {
    for (auto it = e.leased.begin(); it != e.leased.end();) {
      if (it->second.deadline_ms <= now_ms) {
        e.available.push_front(it->first);  // read again from its committed position
        ++returned_;
        it = e.leased.erase(it);
      } else {
        ++it;
      }
    }
  }
}

void SplitCoordinator::FinishLocked() {
  if (streaming_) return;  // a stream's epoch never finishes
  while (!epochs_.empty()) {
    auto it = epochs_.begin();
    if (it->first != first_open_ ||
        it->second.done < static_cast<int64_t>(splits_.size()))
      break;
    epochs_.erase(it);
    ++first_open_;
  }
}

SplitLease SplitCoordinator::Take(int32_t worker, int64_t epoch, int64_t now_ms) {
  std::lock_guard<std::mutex> l(mu_);
  if (digest_.empty()) throw std::logic_error("the input's splits are not configured yet");
  ExpireLocked(now_ms);
  for (auto& [number, e] : epochs_)  // taking renews this worker's leases
    for (auto& [index, lease] : e.leased)
      if (lease.worker == worker) lease.deadline_ms = now_ms + lease_ms_;
  SplitLease out;
  if (BarrierUpLocked(now_ms) &&
      (sealed_ || (acked_.count(worker) && acked_[worker] >= barrier_generation_))) {
    // A lease now would train during the save.
    out.status = SplitLease::kPaused;
    out.epoch = std::max(first_open_, epoch);
    return out;
  }
  if (streaming_ && stopping_) {  // the job stops: the rest stays in the position
    out.status = SplitLease::kEnd;
    out.epoch = first_open_;
    return out;
  }
  bool waiting = streaming_;  // a stream: more may land
  if (streaming_) epoch = first_open_;
  for (int64_t n = first_open_; n <= epoch; ++n) {
    Epoch& e = Open(n);
    while (!e.available.empty()) {
      const int32_t i = e.available.front();
      e.available.pop_front();
      if (Done(e, i) || e.leased.count(i)) continue;  // (a late commit finished it)
      e.leased[i] = Lease{worker, now_ms + lease_ms_};
      out.status = SplitLease::kOk;
      out.epoch = n;
      out.index = i;
      out.file = splits_[i].file;
      out.start = splits_[i].start;
      out.resume = e.committed[i];
      out.end = splits_[i].end;
      return out;
    }
    // Splits others hold: wait for them (trained, or back when their worker dies). The
    // worker's own are trained by its own pipeline, which must not wait for them.
    for (const auto& [index, lease] : e.leased)
      if (lease.worker != worker) waiting = true;
  }
  FinishLocked();
  out.status = waiting ? SplitLease::kWait : SplitLease::kEnd;
  out.epoch = std::max(first_open_, epoch);
  return out;
}

int64_t SplitCoordinator::Commit(const int64_t* keys, const int64_t* offsets, int64_t n) {
  std::lock_guard<std::mutex> l(mu_);
  int64_t finished = 0;
  for (int64_t k = 0; k < n; ++k) {
    const int64_t epoch = keys[k] >> 32;
    const int64_t index = static_cast<int64_t>(static_cast<uint32_t>(keys[k]));
    auto it = epochs_.find(epoch);
    if (it == epochs_.end() || index >= static_cast<int64_t>(splits_.size()))
      continue;  // a finished epoch's (or not this input's)
    Epoch& e = it->second;
    const int32_t i = static_cast<int32_t>(index);
    if (Done(e, i) || offsets[k] <= e.committed[i]) continue;
    e.committed[i] = offsets[k];
    if (Done(e, i)) {
      ++e.done;
      ++finished;
      e.leased.erase(i);
    }
  }
  if (finished) FinishLocked();
  return finished;
}

int64_t SplitCoordinator::BarrierBegin(int64_t now_ms, int64_t timeout_ms) {
  std::lock_guard<std::mutex> l(mu_);
  barrier_deadline_ms_ = now_ms + std::max<int64_t>(1, timeout_ms);
  sealed_ = false;
  return ++barrier_generation_;
}

void SplitCoordinator::BarrierAck(int32_t worker, int64_t generation) {
  std::lock_guard<std::mutex> l(mu_);
  int64_t& acked = acked_[worker];
  acked = std::max(acked, generation);
}

void SplitCoordinator::BarrierEnd(int64_t generation) {
  std::lock_guard<std::mutex> l(mu_);
  if (generation == barrier_generation_) barrier_deadline_ms_ = 0;
}

SplitBarrier SplitCoordinator::Barrier(int64_t now_ms) {
  std::lock_guard<std::mutex> l(mu_);
  ExpireLocked(now_ms);  // a dead worker's leases: it puts nothing more in the model
  SplitBarrier out;
  out.generation = barrier_generation_;
  out.up = BarrierUpLocked(now_ms);
  std::map<int32_t, bool> holders;
  for (const auto& [number, e] : epochs_)
    for (const auto& [index, lease] : e.leased) holders[lease.worker] = true;
  for (const auto& [worker, unused] : holders) {
    auto it = acked_.find(worker);
    if (it == acked_.end() || it->second < barrier_generation_) ++out.waiting;
  }
  if (out.up && out.waiting == 0) sealed_ = true;  // the save may start: nobody joins it
  return out;
}

void SplitCoordinator::Renew(int32_t worker, int64_t now_ms) {
  std::lock_guard<std::mutex> l(mu_);
  for (auto& [number, e] : epochs_)
    for (auto& [index, lease] : e.leased)
      if (lease.worker == worker) lease.deadline_ms = now_ms + lease_ms_;
}

int64_t SplitCoordinator::Release(int32_t worker) {
  std::lock_guard<std::mutex> l(mu_);
  int64_t n = 0;
  for (auto& [number, e] : epochs_) {
    for (auto it = e.leased.begin(); it != e.leased.end();) {
      if (it->second.worker == worker) {
        e.available.push_front(it->first);
        ++n;
        it = e.leased.erase(it);
      } else {
        ++it;
      }
    }
  }
  returned_ += n;
  return n;
}

int64_t SplitCoordinator::GiveBack(int32_t worker, const int64_t* keys, int64_t n) {
  std::lock_guard<std::mutex> l(mu_);
  int64_t back = 0;
  for (int64_t k = 0; k < n; ++k) {
    auto it = epochs_.find(keys[k] >> 32);
    if (it == epochs_.end()) continue;
    Epoch& e = it->second;
    const int32_t i = static_cast<int32_t>(static_cast<uint32_t>(keys[k]));
    auto lease = e.leased.find(i);
    if (lease == e.leased.end() || lease->second.worker != worker) continue;
    e.leased.erase(lease);
    e.available.push_front(i);
    ++back;
  }
  returned_ += back;
  return back;
}

SplitStats SplitCoordinator::Stats() const {
  std::lock_guard<std::mutex> l(mu_);
  SplitStats s;
  s.first_open = first_open_;
  s.splits = static_cast<int64_t>(splits_.size());
  s.leases_returned = returned_;
  auto it = epochs_.find(first_open_);
  if (it == epochs_.end()) {
    s.left = s.splits;
  } else {
    s.done = it->second.done;
    s.leased = static_cast<int64_t>(it->second.leased.size());
    s.left = s.splits - s.done - s.leased;
  }
  return s;
}

std::string SplitCoordinator::Export() const {
  std::lock_guard<std::mutex> l(mu_);
  if (digest_.empty()) throw std::logic_error("the input's splits are not configured yet");
  Writer w;
  w.Raw(kMagic, sizeof kMagic);
  w.Put<uint32_t>(kVersion);
  w.PutBytes(digest_);
  w.Put<uint64_t>(seed_);
  w.Put<int64_t>(lease_ms_);
  w.Put<uint8_t>(streaming_ ? 1 : 0);
  w.Put<uint32_t>(static_cast<uint32_t>(files_.size()));
  for (const std::string& f : files_) w.PutBytes(f);
  w.Put<uint32_t>(static_cast<uint32_t>(splits_.size()));
  for (const SplitSpec& s : splits_) {
    w.Put<int32_t>(s.file);
    w.Put<int64_t>(s.start);
    w.Put<int64_t>(s.end);
  }
  w.Put<int64_t>(first_open_);
  w.Put<uint32_t>(static_cast<uint32_t>(epochs_.size()));
  for (const auto& [number, e] : epochs_) {
    w.Put<int64_t>(number);
    for (int64_t c : e.committed) w.Put<int64_t>(c);
  }
  return w.Take();
}

void SplitCoordinator::Import(const std::string& bytes) {
  Reader r(bytes);
  r.Need(sizeof kMagic);
  if (std::memcmp(bytes.data(), kMagic, sizeof kMagic) != 0)
    throw std::invalid_argument("these bytes are not a tfpsx input position");
  r.Skip(sizeof kMagic);
  const uint32_t version = r.Get<uint32_t>();
  if (version != kVersion && version != 1)
    throw std::invalid_argument("an input position of format " + std::to_string(version) +
                                "; this build reads format " + std::to_string(kVersion));
  const std::string digest = r.GetBytes();
  const uint64_t seed = r.Get<uint64_t>();
  const int64_t lease_ms = r.Get<int64_t>();
  bool streaming = false;
  std::vector<std::string> files;
  if (version >= 2) {
    streaming = r.Get<uint8_t>() != 0;
    files.resize(r.Get<uint32_t>());
    for (std::string& f : files) f = r.GetBytes();
  }
  const uint32_t n = r.Get<uint32_t>();
  std::vector<SplitSpec> splits(n);
  for (SplitSpec& s : splits) {
    s.file = r.Get<int32_t>();
    s.start = r.Get<int64_t>();
    s.end = r.Get<int64_t>();
  }
  const int64_t first_open = r.Get<int64_t>();
  const uint32_t open = r.Get<uint32_t>();
  std::vector<std::pair<int64_t, std::vector<int64_t>>> epochs(open);
  for (auto& [number, committed] : epochs) {
    number = r.Get<int64_t>();
    committed.resize(n);
    for (int64_t& c : committed) c = r.Get<int64_t>();
  }
  if (!r.AtEnd()) throw std::invalid_argument("an input position with bytes past its end");
  std::lock_guard<std::mutex> l(mu_);
  if (!digest_.empty() && digest_ != digest)
    throw std::invalid_argument("the checkpoint's input position is of " + digest +
                                ", but this job reads " + digest_ + ": the files or the split "
                                "size changed since it was saved");
  if (!digest_.empty() && streaming_ != streaming)
    throw std::invalid_argument("the checkpoint's input position is " +
                                std::string(streaming ? "a stream's" : "of files") +
                                ", but this job's input " + digest_ + " is " +
                                (streaming_ ? "a stream" : "files"));
  if (digest_.empty()) {
    digest_ = digest;
    seed_ = seed;
    lease_ms_ = lease_ms;
  }
  // The saved table (a stream's: the files landed by then; files': the same table).
  splits_ = std::move(splits);
  streaming_ = streaming;
  stopping_ = false;  // a restored stream follows on
  files_ = std::move(files);
  known_.clear();
  for (size_t i = 0; i < files_.size(); ++i) known_[files_[i]] = static_cast<int32_t>(i);
  epochs_.clear();
  first_open_ = first_open;
  for (auto& [number, committed] : epochs) {
    Epoch& e = epochs_[number];
    e.committed = std::move(committed);
    std::vector<int32_t> order(splits_.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
    if (!streaming_) order = EpochOrder(seed_, number, static_cast<int32_t>(splits_.size()));
    for (int32_t i : order) {
      if (Done(e, i)) {
        ++e.done;
      } else {
        e.available.push_back(i);  // leased or not when saved: from its position
      }
    }
  }
  FinishLocked();
}

}  // namespace tfpsx
