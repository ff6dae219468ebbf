#include "custom_ops/cc/core/segment_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <utility>

#include "custom_ops/cc/core/batch_reader.h"

namespace tfpsx {
namespace {

constexpr char kMagic[8] = {'T', 'F', 'P', 'S', 'X', 'S', 'E', 'G'};
constexpr char kPrefix[] = "seg_";
constexpr char kSuffix[] = ".dat";
// The folder's owner: a process holds an exclusive flock on it while the store is open
// and writes its pid and host into it, so that a second opener can name it.
constexpr char kLockName[] = "LOCK";

std::runtime_error IoError(const std::string& what, const std::string& path) {
  return std::runtime_error(what + " " + path + ": " + std::strerror(errno));
}

void MakeDirs(const std::string& path) {
  for (size_t at = 1; at <= path.size(); ++at) {
    if (at != path.size() && path[at] != '/') continue;
    const std::string part = path.substr(0, at);
    // Only this user reads a table's rows (they are the model).
    if (::mkdir(part.c_str(), 0700) != 0 && errno != EEXIST)
      throw IoError("cannot create the tiered table's directory", part);
  }
  struct stat st;
  if (::stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    throw IoError("the tiered table's directory is not a directory:", path);
  if (::access(path.c_str(), W_OK | X_OK) != 0)
    throw IoError("cannot write the tiered table's directory", path);
}

bool EndsWith(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

}  // namespace

SegmentStore::SegmentStore(std::string directory, int64_t width)
    : directory_(std::move(directory)),
      width_(width),
      record_bytes_(20 + 4 * width),
      group_records_(std::max<int64_t>(
          kMinGroupRecords, std::min<int64_t>(kGroupRecords, kGroupBytes / (20 + 4 * width)))) {}

SegmentStore::~SegmentStore() {
  DropAll();
  if (lock_fd_ >= 0) ::close(lock_fd_);  // releases the folder
}

void SegmentStore::Lock() {
  const std::string path = directory_ + "/" + kLockName;
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) throw IoError("cannot open the tiered table's lock file", path);
  int rc;
  do rc = ::flock(fd, LOCK_EX | LOCK_NB);
  while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    const int err = errno;
    std::string holder;
    if (err == EWOULDBLOCK) {
      char buf[256];
      const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
      holder.assign(buf, n > 0 ? static_cast<size_t>(n) : 0);
      while (!holder.empty() && (holder.back() == '\n' || holder.back() == '\0'))
        holder.pop_back();
    }
    ::close(fd);
    if (err != EWOULDBLOCK) {
      errno = err;
      throw IoError("cannot lock the tiered table's folder", path);
    }
    throw std::runtime_error(
        "the tiered table's folder " + directory_ + " is in use by another open table (" +
        (holder.empty() ? std::string("its owner wrote no pid yet") : holder) +
        "): a disk tier belongs to one process, and opening it again would erase the "
        "rows that process keeps there. Give this table another tier directory "
        "(TieredBackend(directory=...)), or stop that process first; nothing was changed");
  }
  char host[256] = {0};
  if (::gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
  const std::string owner = "pid " + std::to_string(::getpid()) + " on host " + host + "\n";
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, owner.data(), owner.size(), 0) !=
                                     static_cast<ssize_t>(owner.size())) {
    ::close(fd);
    throw IoError("cannot write the tiered table's lock file", path);
  }
  lock_fd_ = fd;
}

void SegmentStore::Open() {
  MakeDirs(directory_);
  // Before anything in the folder is touched: its segments may be a live process's.
  if (lock_fd_ < 0) Lock();
  DIR* dir = ::opendir(directory_.c_str());
  if (dir == nullptr) throw IoError("cannot list", directory_);
  std::vector<std::string> stale;
  while (const dirent* e = ::readdir(dir)) {
    const std::string name = e->d_name;
    if (name.rfind(kPrefix, 0) == 0 && (EndsWith(name, kSuffix) || EndsWith(name, ".tmp")))
      stale.push_back(directory_ + "/" + name);
  }
  ::closedir(dir);
  for (const std::string& path : stale) {
    if (::unlink(path.c_str()) != 0 && errno != ENOENT)
      throw IoError("cannot remove the earlier process's segment", path);
  }
}

SegmentStore::File::~File() {
  if (fd >= 0) ::close(fd);
}

void SegmentStore::ParseRecord(const char* p, int64_t* key, int64_t* step, uint32_t* freq,
                               const float** row) {
  std::memcpy(key, p, 8);
  std::memcpy(step, p + 8, 8);
  std::memcpy(freq, p + 16, 4);
  *row = reinterpret_cast<const float*>(p + 20);
}

int32_t SegmentStore::Write(const RecordBatch& batch, const std::vector<int64_t>* order) {
  const int64_t n = batch.size();
  int32_t id = 0;
  while (id < static_cast<int32_t>(segs_.size()) && segs_[id] != nullptr) ++id;
  if (id >= KeyIndex::kMaxSegments)
    throw std::runtime_error("tiered table: 65,535 segments in " + directory_);
  auto seg = std::make_unique<Segment>();
  seg->number = next_file_++;
  seg->path = directory_ + "/" + kPrefix + std::to_string(seg->number) + kSuffix;
  seg->count = seg->live = n;
  seg->dead.assign(static_cast<size_t>((n + 63) / 64), 0);
  auto file = std::make_shared<File>();
  file->path = seg->path;
  // O_EXCL: a file of that name is not this store's (Open removed the earlier
  // process's), so it is never overwritten.
  file->fd = ::open(seg->path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (file->fd < 0) throw IoError("cannot create the segment", seg->path);
  const int fd = file->fd;
  // Written through a buffer of at most kMaxRunBytes: a spill costs no copy of itself.
  std::vector<char> buf;
  buf.reserve(static_cast<size_t>(std::min(kHeaderBytes + n * record_bytes_, kMaxRunBytes)));
  auto flush = [&]() {
    const char* p = buf.data();
    size_t left = buf.size();
    while (left > 0) {
      const ssize_t w = ::write(fd, p, left);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        if (w == 0) errno = EIO;
        const std::runtime_error error = IoError("cannot write the segment", seg->path);
        file.reset();  // closes it
        ::unlink(seg->path.c_str());
        throw error;
      }
      p += w;
      left -= static_cast<size_t>(w);
    }
    buf.clear();
  };
  buf.resize(kHeaderBytes, 0);
  std::memcpy(buf.data(), kMagic, 8);
  const int64_t header[3] = {1, width_, n};
  std::memcpy(buf.data() + 8, header, sizeof(header));
  for (int64_t at = 0; at < n; ++at) {
    const int64_t i = order ? (*order)[at] : at;
    if (static_cast<int64_t>(buf.size()) + record_bytes_ > kMaxRunBytes) flush();
    const size_t tail = buf.size();
    buf.resize(tail + static_cast<size_t>(record_bytes_));
    char* p = buf.data() + tail;
    std::memcpy(p, &batch.keys[i], 8);
    std::memcpy(p + 8, &batch.steps[i], 8);
    std::memcpy(p + 16, &batch.freqs[i], 4);
    std::memcpy(p + 20, batch.rows.data() + i * width_, 4 * width_);
    if (at % group_records_ == 0) seg->fences.push_back(batch.keys[i]);
  }
  flush();
  const int64_t bytes = kHeaderBytes + n * record_bytes_;
  bytes_written_ += bytes;
  disk_bytes_ += bytes;
  live_rows_ += n;
  seg->file = std::move(file);
  if (id == static_cast<int32_t>(segs_.size())) segs_.emplace_back();
  segs_[id] = std::move(seg);
  return id;
}

void SegmentStore::Pread(const File& f, char* buf, int64_t bytes, int64_t offset) {
  int64_t done = 0;
  while (done < bytes) {
    const ssize_t r = ::pread(f.fd, buf + done, static_cast<size_t>(bytes - done), offset + done);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      if (r == 0) errno = EIO;  // shorter than written: the file was cut
      throw IoError("cannot read the segment", f.path);
    }
    done += r;
  }
}

SegmentStore::Read SegmentStore::PlanRead(const std::vector<Request>& requests) const {
  Read read;
  read.record_bytes = record_bytes_;
  std::vector<Read::Want>& wants = read.wants;
  wants.reserve(requests.size());
  for (int64_t q = 0; q < static_cast<int64_t>(requests.size()); ++q) {
    const Request& r = requests[q];
    const Segment* s = r.segment >= 0 && r.segment < static_cast<int32_t>(segs_.size())
                           ? segs_[r.segment].get()
                           : nullptr;
    if (s == nullptr || s->fences.empty() || r.key < s->fences.front()) continue;
    // The key's group (its fences), then the index's place in it.
    const int64_t g =
        std::upper_bound(s->fences.begin(), s->fences.end(), r.key) - s->fences.begin() - 1;
    const int64_t record = g * group_records_ + r.slot;
    if (r.slot < 0 || r.slot >= group_records_ || record >= s->count || IsDead(*s, record))
      continue;
    wants.push_back({q, record});
  }
  auto seg = [&](const Read::Want& w) { return requests[w.request].segment; };
  auto key = [&](const Read::Want& w) { return requests[w.request].key; };
  std::sort(wants.begin(), wants.end(), [&](const Read::Want& a, const Read::Want& b) {
    if (seg(a) != seg(b)) return seg(a) < seg(b);
    return a.record != b.record ? a.record < b.record : key(a) < key(b);
  });
  // One want per (record, key): two keys can hold identical entries (fingerprint,
  // segment, slot) in the same buckets, so a key may name one record twice; read twice,
  // its row would come back twice.
  wants.erase(std::unique(wants.begin(), wants.end(),
                          [&](const Read::Want& a, const Read::Want& b) {
                            return seg(a) == seg(b) && a.record == b.record && key(a) == key(b);
                          }),
              wants.end());
  const int64_t gap = std::max<int64_t>(1, kMergeGapBytes / record_bytes_);
  const int64_t max_records = std::max<int64_t>(1, kMaxRunBytes / record_bytes_);
  for (size_t a = 0; a < wants.size();) {
    // A run: records of one segment, each at most `gap` past the last, within
    // kMaxRunBytes (two candidates of one record share it).
    const int32_t id = seg(wants[a]);
    const Segment& s = *segs_[id];
    const int64_t first = wants[a].record;
    size_t b = a + 1;
    while (b < wants.size() && seg(wants[b]) == id &&
           wants[b].record <= wants[b - 1].record + gap && wants[b].record - first < max_records)
      ++b;
    read.runs.push_back({s.file, id, s.number, first, wants[b - 1].record + 1, a, b});
    a = b;
  }
  return read;
}

void SegmentStore::RunRead(const std::vector<Request>& requests, Read* read) {
  const int64_t rb = read->record_bytes;
  read->rows.width = (rb - 20) / 4;
  // Kept per thread: a fresh buffer per batch would fault its pages in each time.
  thread_local std::vector<char> buf;
  std::vector<FileRead> ops;
  std::vector<int64_t> at;  // each run's place in buf
  // Windows of runs, each at most kMaxRunBytes (the buffer's bound) and one submission.
  for (size_t first = 0; first < read->runs.size();) {
    size_t end = first;
    int64_t bytes = 0;
    ops.clear();
    at.clear();
    while (end < read->runs.size()) {
      const Read::Run& run = read->runs[end];
      const int64_t b = (run.end - run.begin) * rb;
      if (end > first && bytes + b > kMaxRunBytes) break;
      at.push_back(bytes);
      bytes += b;
      ++end;
    }
    buf.resize(static_cast<size_t>(bytes));
    for (size_t r = first; r < end; ++r) {
      const Read::Run& run = read->runs[r];
      ops.push_back({run.file->fd, &run.file->path, buf.data() + at[r - first],
                     (run.end - run.begin) * rb, kHeaderBytes + run.begin * rb});
    }
    ReadAll(ops.data(), static_cast<int64_t>(ops.size()));
    read->bytes_read += bytes;
    read->read_calls += static_cast<int64_t>(ops.size());
    for (size_t r = first; r < end; ++r) {
      const Read::Run& run = read->runs[r];
      const char* data = buf.data() + at[r - first];
      for (size_t w = run.first_want; w < run.end_want; ++w) {
        const Read::Want& want = read->wants[w];
        int64_t key, step;
        uint32_t freq;
        const float* row;
        ParseRecord(data + (want.record - run.begin) * rb, &key, &step, &freq, &row);
        // Another key's record when the candidate was a fingerprint's collision.
        if (key != requests[want.request].key) continue;
        read->hits.push_back({want.request, run.segment, run.number, want.record});
        read->rows.Add(key, step, freq, row);
      }
    }
    first = end;
  }
}

bool SegmentStore::Live(int32_t segment, uint64_t number, int64_t record) const {
  if (segment < 0 || segment >= static_cast<int32_t>(segs_.size())) return false;
  const Segment* s = segs_[segment].get();
  return s != nullptr && s->number == number && !IsDead(*s, record);
}

void SegmentStore::ReadMany(std::vector<Request>* requests, RecordBatch* into,
                            std::vector<int64_t>* found_at) {
  for (Request& r : *requests) r.record = -1;
  Read read = PlanRead(*requests);
  RunRead(*requests, &read);
  Count(read);
  const int64_t width = read.rows.width;
  into->width = width;
  for (size_t h = 0; h < read.hits.size(); ++h) {
    const Read::Hit& hit = read.hits[h];
    if (!Live(hit.segment, hit.number, hit.record)) continue;
    (*requests)[hit.request].record = hit.record;
    found_at->push_back(hit.request);
    into->Add(read.rows.keys[h], read.rows.steps[h], read.rows.freqs[h],
              read.rows.rows.data() + h * width);
  }
}

void SegmentStore::MarkDead(int32_t segment, int64_t record) {
  Segment& s = *segs_[segment];
  uint64_t& word = s.dead[record >> 6];
  const uint64_t bit = uint64_t{1} << (record & 63);
  if (word & bit) return;
  word |= bit;
  --s.live;
  --live_rows_;
}

void SegmentStore::Drop(int32_t segment) {
  std::unique_ptr<Segment>& s = segs_[segment];
  if (s == nullptr) return;
  ::unlink(s->path.c_str());  // a read in flight keeps the file open until it ends
  live_rows_ -= s->live;
  disk_bytes_ -= kHeaderBytes + s->count * record_bytes_;
  s.reset();
}

void SegmentStore::DropAll() {
  for (int32_t id = 0; id < static_cast<int32_t>(segs_.size()); ++id) Drop(id);
  segs_.clear();
}

std::vector<int32_t> SegmentStore::segments() const {
  std::vector<int32_t> ids;
  for (int32_t id = 0; id < static_cast<int32_t>(segs_.size()); ++id)
    if (segs_[id] != nullptr) ids.push_back(id);
  return ids;
}

int64_t SegmentStore::ram_bytes() const {
  int64_t total = static_cast<int64_t>(segs_.capacity() * sizeof(segs_[0]));
  for (const auto& s : segs_) {
    if (s == nullptr) continue;
    total += static_cast<int64_t>(sizeof(Segment) + s->path.capacity() +
                                  s->fences.capacity() * 8 + s->dead.capacity() * 8);
  }
  return total;
}

}  // namespace tfpsx
