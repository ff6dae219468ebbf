#include "custom_ops/cc/core/segment_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <utility>

namespace tfpsx {
namespace {

constexpr char kMagic[8] = {'T', 'F', 'P', 'S', 'X', 'S', 'E', 'G'};
constexpr char kPrefix[] = "seg_";
constexpr char kSuffix[] = ".dat";

std::runtime_error IoError(const std::string& what, const std::string& path) {
  return std::runtime_error(what + " " + path + ": " + std::strerror(errno));
}

void MakeDirs(const std::string& path) {
  for (size_t at = 1; at <= path.size(); ++at) {
    if (at != path.size() && path[at] != '/') continue;
    const std::string part = path.substr(0, at);
    if (::mkdir(part.c_str(), 0755) != 0 && errno != EEXIST)
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
      group_records_(std::max<int64_t>(kGroupRecords, kGroupBytes / (20 + 4 * width))) {}

SegmentStore::~SegmentStore() { DropAll(); }

void SegmentStore::Open() {
  MakeDirs(directory_);
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

void SegmentStore::ParseRecord(const char* p, int64_t* key, int64_t* step, uint32_t* freq,
                               const float** row) const {
  std::memcpy(key, p, 8);
  std::memcpy(step, p + 8, 8);
  std::memcpy(freq, p + 16, 4);
  *row = reinterpret_cast<const float*>(p + 20);
}

int32_t SegmentStore::Write(const RecordBatch& batch, const std::vector<int64_t>* order) {
  const int64_t n = batch.size();
  int32_t id = 0;
  while (id < static_cast<int32_t>(segs_.size()) && segs_[id] != nullptr) ++id;
  if (id >= 65535) throw std::runtime_error("tiered table: 65,535 segments in " + directory_);
  auto seg = std::make_unique<Segment>();
  seg->path = directory_ + "/" + kPrefix + std::to_string(next_file_++) + kSuffix;
  seg->count = seg->live = n;
  seg->dead.assign(static_cast<size_t>((n + 63) / 64), 0);
  seg->fd = ::open(seg->path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (seg->fd < 0) throw IoError("cannot create the segment", seg->path);
  // Written through a buffer of at most kMaxRunBytes: a spill costs no copy of itself.
  std::vector<char> buf;
  buf.reserve(static_cast<size_t>(std::min(kHeaderBytes + n * record_bytes_, kMaxRunBytes)));
  auto flush = [&]() {
    const char* p = buf.data();
    size_t left = buf.size();
    while (left > 0) {
      const ssize_t w = ::write(seg->fd, p, left);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        if (w == 0) errno = EIO;
        const std::runtime_error error = IoError("cannot write the segment", seg->path);
        ::close(seg->fd);
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
  if (id == static_cast<int32_t>(segs_.size())) segs_.emplace_back();
  segs_[id] = std::move(seg);
  return id;
}

void SegmentStore::Pread(const Segment& s, char* buf, int64_t bytes, int64_t offset) {
  int64_t done = 0;
  while (done < bytes) {
    const ssize_t r = ::pread(s.fd, buf + done, static_cast<size_t>(bytes - done), offset + done);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      if (r == 0) errno = EIO;  // shorter than written: the file was cut
      throw IoError("cannot read the segment", s.path);
    }
    done += r;
  }
  bytes_read_ += bytes;
  ++read_calls_;
}

void SegmentStore::ReadMany(std::vector<Request>* requests, RecordBatch* into,
                            std::vector<int64_t>* found_at) {
  struct Want {
    int32_t segment;
    int64_t group;
    int64_t request;
  };
  std::vector<Want> wants;
  wants.reserve(requests->size());
  for (int64_t q = 0; q < static_cast<int64_t>(requests->size()); ++q) {
    Request& r = (*requests)[q];
    r.record = -1;
    const Segment* s = r.segment < static_cast<int32_t>(segs_.size()) ? segs_[r.segment].get()
                                                                        : nullptr;
    if (s == nullptr || s->fences.empty() || r.key < s->fences.front()) continue;
    const int64_t g =
        std::upper_bound(s->fences.begin(), s->fences.end(), r.key) - s->fences.begin() - 1;
    wants.push_back({r.segment, g, q});
  }
  std::sort(wants.begin(), wants.end(), [](const Want& a, const Want& b) {
    return a.segment != b.segment ? a.segment < b.segment : a.group < b.group;
  });
  std::vector<char>& buf = read_buf_;
  std::vector<std::pair<int64_t, int64_t>> hits;  // (request, record)
  const int64_t max_groups = std::max<int64_t>(1, kMaxRunBytes / (group_records_ * record_bytes_));
  for (size_t a = 0; a < wants.size();) {
    // A run: groups of one segment, each at most one past the last, within kMaxRunBytes.
    const Segment& s = *segs_[wants[a].segment];
    const int64_t first = wants[a].group;
    size_t b = a + 1;
    while (b < wants.size() && wants[b].segment == wants[a].segment &&
           wants[b].group <= wants[b - 1].group + 1 && wants[b].group - first < max_groups)
      ++b;
    const int64_t last = wants[b - 1].group;
    const int64_t begin = first * group_records_;
    const int64_t end = std::min(s.count, (last + 1) * group_records_);
    buf.resize(static_cast<size_t>((end - begin) * record_bytes_));
    Pread(s, buf.data(), (end - begin) * record_bytes_, kHeaderBytes + begin * record_bytes_);
    for (size_t w = a; w < b; ++w) {
      Request& r = (*requests)[wants[w].request];
      int64_t lo = wants[w].group * group_records_ - begin;
      int64_t hi = std::min(end, (wants[w].group + 1) * group_records_) - begin;
      while (lo < hi) {  // first record with key >= r.key
        const int64_t mid = (lo + hi) / 2;
        int64_t k;
        std::memcpy(&k, buf.data() + mid * record_bytes_, 8);
        if (k < r.key) lo = mid + 1; else hi = mid;
      }
      if (lo >= end - begin) continue;
      int64_t key, step;
      uint32_t freq;
      const float* row;
      ParseRecord(buf.data() + lo * record_bytes_, &key, &step, &freq, &row);
      if (key != r.key || IsDead(s, begin + lo)) continue;
      r.record = begin + lo;
      hits.emplace_back(wants[w].request, r.record);
      into->Add(key, step, freq, row);
    }
    a = b;
  }
  // Rows were appended in disk order; found_at says whose each is.
  for (const auto& hit : hits) found_at->push_back(hit.first);
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
  ::close(s->fd);
  ::unlink(s->path.c_str());
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
