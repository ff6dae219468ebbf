// The input of a job as splits leased to its workers: the data plane's coordinator
// (a resource on PS 0, kernels/split_kernels.cc; the Python side is tfpsx/data/).
//
// The job's input is a fixed table of splits (a file, or a byte range of one); every
// epoch visits each split once, in an order drawn from the job's seed and the epoch. A
// worker takes a split (a lease: the split is its own until it is done, released, or
// its lease expires without a renewal), reads it from where the split's committed
// position stands, and commits how far it trained: the end offset of the last record a
// step put into the model. A split whose committed position reaches its end is done;
// an epoch whose splits are all done is finished. A split that comes back (its worker
// released it, or stopped renewing its leases: dead) goes to the front of its epoch's
// queue and is read again from its committed position: what was trained stays trained,
// what was not is trained by whoever takes it (at least once; the repeats are the
// records trained but not yet committed).
//
// Commits are positions, monotonic: a commit never moves a split back, and one that
// arrives after the split went to another worker still counts (its records are in the
// model). Several epochs may be open at once (a fast worker starts the next while a slow
// one finishes its last split); a take serves the oldest open epoch up to the one asked
// for first, so that a split given back is trained before its epoch ends.
//
// A stream (ConfigureStream, tfpsx.data.stream) is an input whose files keep landing:
// its table starts empty and grows (Append, files named, each once), in landing order,
// as one epoch (0) that never finishes; a take with nothing to lease waits for more
// (kWait), until StopStream: every take then ends (kEnd), and what is left stays in the
// position for the job's next run. The files' names are the coordinator's (Files), as
// the workers cannot list what landed the same way at the same moment.
//
// The state (the splits' committed positions of every open epoch) exports as bytes,
// which the job's checkpoint saves before the model (a restore can repeat steps but
// never skip one); an import clears every lease. Thread-safe (one mutex: every call is
// O(splits touched), small).

#ifndef TFPSX_CORE_SPLIT_COORDINATOR_H_
#define TFPSX_CORE_SPLIT_COORDINATOR_H_

#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace tfpsx {

struct SplitSpec {
  int32_t file = 0;
  int64_t start = 0, end = 0;  // bytes [start, end) of the file
};

struct SplitLease {
  enum Status : int32_t {
    kOk = 0,    // a split to read
    kWait = 1,  // none to take now: other workers hold the rest of the epoch's splits
    kEnd = 2,   // none left for this worker in the epochs up to the one asked for:
                // every split is done, or held by this worker
    kPaused = 3,  // an exact save's barrier is up: ask again when it is down
  };
  int32_t status = kEnd;
  int64_t epoch = 0;
  int32_t index = 0;       // the split's index in the table
  int32_t file = 0;
  int64_t start = 0, resume = 0, end = 0;  // read from resume (committed) to end
  int64_t key() const { return Key(epoch, index); }
  static int64_t Key(int64_t epoch, int32_t index) { return (epoch << 32) | uint32_t(index); }
};

// An exact save's barrier (BarrierBegin .. BarrierEnd): every worker holding a lease acks
// once each step it put into the model is committed and it puts in no more; the save
// waits for `waiting` to reach 0. A worker that acked takes no lease while it is up; one
// that did not may (its pipeline may need the next split to reach its next step
// boundary, where it acks), and becomes one the save waits for, until every holder has
// acked: then the barrier is sealed and no worker takes one.
struct SplitBarrier {
  int64_t generation = 0;  // the last barrier begun
  bool up = false;         // begun, not ended, not past its deadline
  int64_t waiting = 0;     // workers holding a lease that have not acked `generation`
};

struct SplitStats {
  int64_t first_open = 0;  // the oldest epoch not finished
  int64_t splits = 0;      // splits an epoch
  int64_t done = 0, leased = 0, left = 0;  // of first_open's splits
  int64_t leases_returned = 0;  // leases that came back (released or expired), ever
};

class SplitCoordinator {
 public:
  // Sets the job's split table (once). `digest` names the input (its files, sizes and
  // split size): a second call with the same digest does nothing, another throws
  // std::invalid_argument naming both. lease_ms: a lease not renewed for this long
  // comes back.
  void Configure(const std::string& digest, uint64_t seed, std::vector<SplitSpec> splits,
                 int64_t lease_ms);
  bool configured() const;
  std::string digest() const;

  // A stream's table (see above): empty, growing by Append. `digest` names the stream
  // (its pattern, format and split size); a second call with it does nothing.
  void ConfigureStream(const std::string& digest, uint64_t seed, int64_t lease_ms);
  // Adds the files `names` not added before, with their splits (`splits[i].file`: an
  // index into `names`), at the end of the stream. Returns the splits added. Throws
  // std::logic_error for an input that is not a stream.
  int64_t Append(const std::vector<std::string>& names, const std::vector<SplitSpec>& splits);
  // The stream's file names from index `from` on (a lease's `file` indexes them).
  std::vector<std::string> Files(int64_t from) const;
  // Every take from now on ends (kEnd): the job stops; its position keeps the rest.
  void StopStream();
  bool streaming() const;

  // The oldest epoch not finished (0 before any; epochs are opened by takes).
  int64_t FirstOpen() const;

  // The next split for `worker`, from the oldest open epoch up to `epoch` (opening it).
  // Renews the worker's leases. Throws std::logic_error before Configure.
  SplitLease Take(int32_t worker, int64_t epoch, int64_t now_ms);

  // Positions: keys[i] (SplitLease::key) trained up to offsets[i]. Returns how many
  // splits became done.
  int64_t Commit(const int64_t* keys, const int64_t* offsets, int64_t n);

  // The worker is alive: its leases last lease_ms more.
  void Renew(int32_t worker, int64_t now_ms);
  // Every lease of `worker` comes back (a worker started again in place releases its
  // earlier process's). Returns how many.
  int64_t Release(int32_t worker);
  // The leases of `keys` that `worker` holds come back (an iterator of the worker that
  // was abandoned before it read them). Returns how many.
  int64_t GiveBack(int32_t worker, const int64_t* keys, int64_t n);

  SplitStats Stats() const;

  // The exact save's barrier: Begin raises it for at most timeout_ms (a saver that dies
  // does not hold the job) and returns its generation; a worker acks it; End lowers it
  // (a generation not the last is ignored). Barrier says where it stands.
  int64_t BarrierBegin(int64_t now_ms, int64_t timeout_ms);
  void BarrierAck(int32_t worker, int64_t generation);
  void BarrierEnd(int64_t generation);
  SplitBarrier Barrier(int64_t now_ms);

  // The state as bytes (the table, the seed, every open epoch's positions), and back:
  // Import configures an unconfigured coordinator (or checks the digest of a configured
  // one) and clears every lease. Throws std::invalid_argument for bytes that are not an
  // export, or of another input (the digests, named).
  std::string Export() const;
  void Import(const std::string& bytes);

 private:
  struct Lease {
    int32_t worker;
    int64_t deadline_ms;
  };
  struct Epoch {
    std::vector<int64_t> committed;   // per split
    std::deque<int32_t> available;    // splits to take, in order
    std::map<int32_t, Lease> leased;  // by split
    int64_t done = 0;
  };

  Epoch& Open(int64_t epoch);  // creates it from the table (the epoch's order)
  void ExpireLocked(int64_t now_ms);
  void FinishLocked();  // drops finished epochs at the front
  bool Done(const Epoch& e, int32_t index) const {
    return e.committed[index] >= splits_[index].end;
  }

  mutable std::mutex mu_;
  std::string digest_;
  uint64_t seed_ = 0;
  int64_t lease_ms_ = 0;
  std::vector<SplitSpec> splits_;
  std::map<int64_t, Epoch> epochs_;  // open ones
  int64_t first_open_ = 0;
  int64_t returned_ = 0;
  int64_t barrier_generation_ = 0;
  int64_t barrier_deadline_ms_ = 0;  // 0: down
  std::map<int32_t, int64_t> acked_;  // worker -> the last generation it acked
  bool sealed_ = false;  // every holder acked the last generation: no take at all
  bool streaming_ = false, stopping_ = false;
  std::vector<std::string> files_;         // a stream's files, by index
  std::map<std::string, int32_t> known_;  // their indexes, by name
  bool BarrierUpLocked(int64_t now_ms) const {
    return barrier_deadline_ms_ != 0 && now_ms < barrier_deadline_ms_;
  }
};

// The order of a job's epoch: a permutation of [0, n) from (seed, epoch), the same on
// every platform (a Fisher-Yates over splitmix64).
std::vector<int32_t> EpochOrder(uint64_t seed, int64_t epoch, int32_t n);

}  // namespace tfpsx

#endif  // TFPSX_CORE_SPLIT_COORDINATOR_H_
