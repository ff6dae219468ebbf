#include "custom_ops/cc/core/batch_reader.h"

// io_uring's header comes with the kernel's headers (linux-libc-dev); a machine without
// them, or with headers older than IORING_OP_READ (Linux 5.6), builds the pread path.
#if defined(__linux__) && __has_include(<linux/io_uring.h>)
#include <linux/io_uring.h>
#if defined(IORING_FEAT_RW_CUR_POS)
#define TFPSX_IO_URING 1
#endif
#endif
#ifndef TFPSX_IO_URING
#define TFPSX_IO_URING 0
#endif

#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <stdexcept>

#include "custom_ops/cc/core/env_bool.h"

namespace tfpsx {
namespace {

std::runtime_error ReadError(const std::string& path, int err) {
  return std::runtime_error("cannot read the segment " + path + ": " + std::strerror(err));
}

// The rest of a read with pread (a short io_uring read, or no ring).
void PreadRest(const FileRead& r, int64_t done) {
  while (done < r.bytes) {
    const ssize_t got = ::pread(r.fd, r.buf + done, static_cast<size_t>(r.bytes - done),
                                r.offset + done);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) throw ReadError(*r.path, got == 0 ? EIO : errno);  // 0: the file was cut
    done += got;
  }
}

#if TFPSX_IO_URING
// The rings' indexes are shared with the kernel: read with acquire, written with release.
unsigned LoadAcquire(unsigned* p) {
  return std::atomic_load_explicit(reinterpret_cast<std::atomic<unsigned>*>(p),
                                   std::memory_order_acquire);
}
void StoreRelease(unsigned* p, unsigned v) {
  std::atomic_store_explicit(reinterpret_cast<std::atomic<unsigned>*>(p), v,
                             std::memory_order_release);
}

// One io_uring: its submission and completion rings mapped into this process.
class Ring {
 public:
  static constexpr unsigned kEntries = 256;

  // Null when the kernel gives no ring (too old, or io_uring disabled).
  static std::unique_ptr<Ring> Make() {
    std::unique_ptr<Ring> ring(new Ring());
    return ring->Setup() ? std::move(ring) : nullptr;
  }
  ~Ring() {
    if (sqes_ != nullptr) ::munmap(sqes_, sqes_bytes_);
    if (cq_map_ != nullptr && cq_map_ != sq_map_) ::munmap(cq_map_, cq_bytes_);
    if (sq_map_ != nullptr) ::munmap(sq_map_, sq_bytes_);
    if (fd_ >= 0) ::close(fd_);
  }

  // Reads reads[n] (n <= kEntries): one submission; returns false when the kernel
  // refused the opcode (the caller then reads with pread). Throws the batch's first
  // error only once no read of the batch is left with the kernel and every completion
  // was taken off the ring: the buffers are the caller's, and the next batch of this
  // thread must find the ring empty.
  bool Read(FileRead* reads, unsigned n) {
    const unsigned first_tail = *sq_tail_;
    unsigned tail = first_tail;
    for (unsigned i = 0; i < n; ++i) {
      const unsigned at = tail & *sq_mask_;
      io_uring_sqe* sqe = &sqes_[at];
      std::memset(sqe, 0, sizeof(*sqe));
      sqe->opcode = IORING_OP_READ;
      sqe->fd = reads[i].fd;
      sqe->addr = reinterpret_cast<uint64_t>(reads[i].buf);
      sqe->len = static_cast<uint32_t>(reads[i].bytes);
      sqe->off = static_cast<uint64_t>(reads[i].offset);
      sqe->user_data = i;
      sq_array_[at] = at;
      ++tail;
    }
    StoreRelease(sq_tail_, tail);
    unsigned submitted = 0, completed = 0;
    bool refused = false;
    std::exception_ptr error;
    while (completed < n) {
      const int got = static_cast<int>(::syscall(__NR_io_uring_enter, fd_, n - submitted,
                                                 n - completed, IORING_ENTER_GETEVENTS,
                                                 nullptr, 0));
      if (got < 0) {
        const int err = errno;
        if (err == EINTR || err == EAGAIN || err == EBUSY) continue;
        if (!error) error = std::make_exception_ptr(ReadError(*reads[0].path, err));
        if (submitted < n) {
          // The kernel took none of the rest (no SQPOLL: it reads the ring only in
          // io_uring_enter): take them back, so no later batch submits them, and wait
          // for those already submitted alone.
          StoreRelease(sq_tail_, first_tail + submitted);
          n = submitted;
          continue;
        }
        // Reads in flight that cannot be waited for would write into buffers the
        // caller is about to free: stop the process rather than corrupt it.
        std::fprintf(stderr, "tfpsx: io_uring_enter failed (%s) with %u reads in flight "
                     "into this process's buffers; aborting\n", std::strerror(err),
                     n - completed);
        std::abort();
      }
      submitted += static_cast<unsigned>(got);
      unsigned head = *cq_head_;
      const unsigned end = LoadAcquire(cq_tail_);
      for (; head != end; ++head, ++completed) {
        const io_uring_cqe cqe = cqes_[head & *cq_mask_];
        if (error) continue;  // after the first error, only reaped
        FileRead& r = reads[cqe.user_data];
        try {
          if (cqe.res == -EINVAL || cqe.res == -EOPNOTSUPP) {
            refused = true;  // a kernel without IORING_OP_READ: pread does it
            PreadRest(r, 0);
          } else if (cqe.res < 0 && cqe.res != -EINTR && cqe.res != -EAGAIN) {
            throw ReadError(*r.path, -cqe.res);
          } else {
            PreadRest(r, cqe.res > 0 ? cqe.res : 0);  // a short read's rest
          }
        } catch (...) {
          error = std::current_exception();
        }
      }
      StoreRelease(cq_head_, head);
    }
    if (error) std::rethrow_exception(error);
    return !refused;
  }

 private:
  Ring() = default;

  bool Setup() {
    io_uring_params p;
    std::memset(&p, 0, sizeof(p));
    fd_ = static_cast<int>(::syscall(__NR_io_uring_setup, kEntries, &p));
    if (fd_ < 0) return false;
    sq_bytes_ = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    cq_bytes_ = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
    const bool single = p.features & IORING_FEAT_SINGLE_MMAP;
    if (single) sq_bytes_ = cq_bytes_ = std::max(sq_bytes_, cq_bytes_);
    sq_map_ = ::mmap(nullptr, sq_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                     fd_, IORING_OFF_SQ_RING);
    if (sq_map_ == MAP_FAILED) return (sq_map_ = nullptr), false;
    cq_map_ = single ? sq_map_
                     : ::mmap(nullptr, cq_bytes_, PROT_READ | PROT_WRITE,
                              MAP_SHARED | MAP_POPULATE, fd_, IORING_OFF_CQ_RING);
    if (cq_map_ == MAP_FAILED) return (cq_map_ = nullptr), false;
    sqes_bytes_ = p.sq_entries * sizeof(io_uring_sqe);
    void* sqes = ::mmap(nullptr, sqes_bytes_, PROT_READ | PROT_WRITE,
                        MAP_SHARED | MAP_POPULATE, fd_, IORING_OFF_SQES);
    if (sqes == MAP_FAILED) return false;
    sqes_ = static_cast<io_uring_sqe*>(sqes);
    char* sq = static_cast<char*>(sq_map_);
    char* cq = static_cast<char*>(cq_map_);
    sq_tail_ = reinterpret_cast<unsigned*>(sq + p.sq_off.tail);
    sq_mask_ = reinterpret_cast<unsigned*>(sq + p.sq_off.ring_mask);
    sq_array_ = reinterpret_cast<unsigned*>(sq + p.sq_off.array);
    cq_head_ = reinterpret_cast<unsigned*>(cq + p.cq_off.head);
    cq_tail_ = reinterpret_cast<unsigned*>(cq + p.cq_off.tail);
    cq_mask_ = reinterpret_cast<unsigned*>(cq + p.cq_off.ring_mask);
    cqes_ = reinterpret_cast<io_uring_cqe*>(cq + p.cq_off.cqes);
    return p.sq_entries >= kEntries;
  }

  int fd_ = -1;
  void* sq_map_ = nullptr;
  void* cq_map_ = nullptr;
  size_t sq_bytes_ = 0, cq_bytes_ = 0, sqes_bytes_ = 0;
  io_uring_sqe* sqes_ = nullptr;
  unsigned *sq_tail_ = nullptr, *sq_mask_ = nullptr, *sq_array_ = nullptr;
  unsigned *cq_head_ = nullptr, *cq_tail_ = nullptr, *cq_mask_ = nullptr;
  io_uring_cqe* cqes_ = nullptr;
};

#else
class Ring {  // built without io_uring's header: never made
 public:
  static constexpr unsigned kEntries = 256;
  static std::unique_ptr<Ring> Make() { return nullptr; }
  bool Read(FileRead*, unsigned) { return false; }
};
#endif

// This thread's ring: made on first use; null when the kernel gives none, the setting
// is off, or the kernel refused an opcode once.
struct ThreadRing {
  bool tried = false;
  std::unique_ptr<Ring> ring;
  Ring* Get() {
    if (!tried) {
      tried = true;
      if (EnvBool("TFPSX_TIER_IO_URING", true)) ring = Ring::Make();
    }
    return ring.get();
  }
};

thread_local ThreadRing this_thread_ring;

}  // namespace

int64_t ReadAll(FileRead* reads, int64_t n) {
  Ring* ring = this_thread_ring.Get();
  if (ring == nullptr) {
    for (int64_t i = 0; i < n; ++i) PreadRest(reads[i], 0);
    return n;
  }
  int64_t submissions = 0;
  for (int64_t first = 0; first < n; first += Ring::kEntries) {
    const unsigned count =
        static_cast<unsigned>(std::min<int64_t>(Ring::kEntries, n - first));
    ++submissions;
    if (!ring->Read(reads + first, count)) {
      this_thread_ring.ring.reset();  // an old kernel: pread from now on
      for (int64_t i = first + count; i < n; ++i) PreadRest(reads[i], 0);
      return submissions + (n - first - count);
    }
  }
  return submissions;
}

bool BatchReadsUseIoUring() { return this_thread_ring.Get() != nullptr; }

}  // namespace tfpsx
