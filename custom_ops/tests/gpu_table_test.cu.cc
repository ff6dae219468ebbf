// Native CUDA test of the GPU embedding core (custom_ops/cuda/gpu_table.h) against the
// CPU table core (custom_ops/cc/core/hash_table.h) on random data: nvcc, no TensorFlow.
// `make cuda-check` compiles and links it; `make cuda-native-test` runs it on a GPU.
//
// Covered: find_or_insert / find / accumulate / evict at 1k, 100k and 10M keys with
// duplicates and misses (dim 16; dim 7 for a row that is no multiple of a float4),
// inserts of overlapping keys from 4 streams at once, a full table, dedup (unique +
// inverse), gather and scatter-add. Rows drawn by the initializer are compared with a
// relative tolerance of 1e-5 (the device's logf/sinf/cosf differ from glibc's by an ulp);
// accumulated rows with 1e-4 (atomic adds land in any order).

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <memory>
#include <set>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "custom_ops/cc/core/hash_table.h"
#include "custom_ops/cuda/gpu_table.h"
#include "custom_ops/tests/check.h"

namespace {

using tfpsx::cuda::GpuHashTable;

using tfpsx_test::failures;

#define CUDA_OK(call) tfpsx::cuda::Check((call), #call)

template <typename T>
struct Device {
  T* ptr = nullptr;
  size_t n = 0;
  explicit Device(size_t count) : n(count) { CUDA_OK(cudaMalloc(&ptr, std::max<size_t>(1, n) * sizeof(T))); }
  explicit Device(const std::vector<T>& host) : Device(host.size()) {
    CUDA_OK(cudaMemcpy(ptr, host.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  }
  ~Device() { cudaFree(ptr); }
  // (bool comes back as char: std::vector<bool> has no data())
  using HostT = std::conditional_t<std::is_same_v<T, bool>, char, T>;
  // The first count elements (all by default): copying a tail the device never wrote
  // is what compute-sanitizer's initcheck reports.
  std::vector<HostT> Host(size_t count = static_cast<size_t>(-1)) const {
    std::vector<HostT> out(std::min(count, n));
    CUDA_OK(cudaMemcpy(out.data(), ptr, out.size() * sizeof(T), cudaMemcpyDeviceToHost));
    return out;
  }
};

tfpsx::TableOptions CpuOptions(int64_t dim) {
  tfpsx::TableOptions o;
  o.dim = dim;
  o.init = tfpsx::InitKind::kNormal;
  o.init_a = 0.f;
  o.init_b = 0.5f;
  o.seed = 1234;
  return o;
}

tfpsx::RowInitializer GpuInit(const tfpsx::TableOptions& o) {
  tfpsx::RowInitializer init;
  init.kind = o.init;
  init.a = o.init_a;
  init.b = o.init_b;
  init.seed = o.seed;
  return init;
}

// Elements of got and want further apart than tol relative (tol absolute near 0).
size_t CountFar(const std::vector<float>& got, const std::vector<float>& want, float tol) {
  size_t far = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    far += !(std::fabs(got[i] - want[i]) <= tol * std::max(1.f, std::fabs(want[i])));
  }
  return far;
}

// n keys drawn from `distinct` values spread over the int64 range (negative ones too).
std::vector<int64_t> RandomKeys(int64_t n, int64_t distinct, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> keys(n);
  for (auto& k : keys) k = static_cast<int64_t>((rng() % distinct) * 0x9E3779B97F4A7C15ULL);
  return keys;
}

void TestAgainstCpu(int64_t n, int64_t dim) {
  std::printf("  %lld keys, dim %lld\n", static_cast<long long>(n), static_cast<long long>(dim));
  const auto options = CpuOptions(dim);
  tfpsx::HashTable cpu(options);
  GpuHashTable gpu(2 * n, dim, GpuInit(options));
  // Inserts with duplicates (about n/2 distinct keys).
  const auto keys = RandomKeys(n, n / 2 + 1, 7 + n);
  Device<int64_t> d_keys(keys);
  Device<float> d_rows(n * dim);
  Device<unsigned long long> d_failed(std::vector<unsigned long long>{0});
  gpu.FindOrInsert(d_keys.ptr, n, d_rows.ptr, nullptr, d_failed.ptr);
  std::vector<float> want(n * dim);
  cpu.FindOrInsert(keys.data(), n, 0, want.data());
  CHECK(CountFar(d_rows.Host(), want, 1e-5f) == 0);
  CHECK(d_failed.Host()[0] == 0);
  CHECK(gpu.Size(nullptr) == cpu.Size());

  // Finds: half present, half missing (misses get initial rows, found = false).
  auto probe = RandomKeys(n, n + 1, 99 + n);
  for (int64_t i = 0; i < n; i += 2) probe[i] = keys[(i * 7) % n];
  Device<int64_t> d_probe(probe);
  Device<bool> d_found(n);
  gpu.Find(d_probe.ptr, n, d_rows.ptr, d_found.ptr, nullptr);
  std::vector<char> found_cpu(n);
  cpu.Find(probe.data(), n, want.data(), reinterpret_cast<bool*>(found_cpu.data()));
  CHECK(CountFar(d_rows.Host(), want, 1e-5f) == 0);
  const auto found_gpu = d_found.Host();
  int64_t mismatched = 0;
  for (int64_t i = 0; i < n; ++i) mismatched += found_gpu[i] != (found_cpu[i] != 0);
  CHECK(mismatched == 0);
  CHECK(gpu.Size(nullptr) == cpu.Size());  // finds insert nothing

  // Accumulate over the probe keys (new ones start from their initial rows).
  std::vector<float> deltas(n * dim);
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> uni(-1.f, 1.f);
  for (auto& d : deltas) d = uni(rng);
  Device<float> d_deltas(deltas);
  gpu.Accumulate(d_probe.ptr, n, d_deltas.ptr, nullptr, d_failed.ptr);
  cpu.Accumulate(probe.data(), n, deltas.data(), 0);
  gpu.Find(d_probe.ptr, n, d_rows.ptr, nullptr, nullptr);
  cpu.Find(probe.data(), n, want.data(), nullptr);
  CHECK(CountFar(d_rows.Host(), want, 1e-4f) == 0);
  CHECK(gpu.Size(nullptr) == cpu.Size());

  // Evict the first half of the inserted keys; then they are misses again, and a new
  // insert draws their initial rows.
  const int64_t half = n / 2;
  Device<unsigned long long> d_removed(std::vector<unsigned long long>{0});
  gpu.Evict(d_keys.ptr, half, nullptr, d_removed.ptr);
  const int64_t removed = cpu.Remove(keys.data(), half);
  CHECK(static_cast<int64_t>(d_removed.Host()[0]) == removed);
  CHECK(gpu.Size(nullptr) == cpu.Size());
  gpu.Find(d_keys.ptr, half, d_rows.ptr, d_found.ptr, nullptr);
  const auto after = d_found.Host();
  CHECK(std::none_of(after.begin(), after.begin() + half, [](bool f) { return f; }));
  gpu.FindOrInsert(d_keys.ptr, n, d_rows.ptr, nullptr, d_failed.ptr);
  cpu.FindOrInsert(keys.data(), n, 0, want.data());
  CHECK(CountFar(d_rows.Host(), want, 1e-4f) == 0);
  CHECK(gpu.Size(nullptr) == cpu.Size());
  CHECK(d_failed.Host()[0] == 0);
}

void TestConcurrentStreams() {
  const int64_t n = 200000, dim = 16;
  const auto options = CpuOptions(dim);
  GpuHashTable gpu(4 * n, dim, GpuInit(options));
  std::vector<cudaStream_t> streams(4);
  std::vector<std::unique_ptr<Device<int64_t>>> keys;
  std::vector<std::unique_ptr<Device<float>>> rows;
  std::set<int64_t> distinct;
  for (int s = 0; s < 4; ++s) {
    CUDA_OK(cudaStreamCreateWithFlags(&streams[s], cudaStreamNonBlocking));
    auto host = RandomKeys(n, n, 11);  // the same keys on every stream, other orders
    std::shuffle(host.begin(), host.end(), std::mt19937_64(s));
    distinct.insert(host.begin(), host.end());
    keys.emplace_back(new Device<int64_t>(host));
    rows.emplace_back(new Device<float>(n * dim));
  }
  for (int s = 0; s < 4; ++s) {
    gpu.FindOrInsert(keys[s]->ptr, n, rows[s]->ptr, reinterpret_cast<tfpsx::cuda::Stream>(streams[s]));
  }
  CUDA_OK(cudaDeviceSynchronize());
  CHECK(gpu.Size(nullptr) == static_cast<int64_t>(distinct.size()));
  std::vector<int64_t> out_keys(gpu.capacity());
  std::vector<float> out_rows(gpu.capacity() * dim);
  const int64_t held = gpu.Export(out_keys.data(), out_rows.data(), nullptr);
  CHECK(held == static_cast<int64_t>(distinct.size()));
  std::set<int64_t> seen(out_keys.begin(), out_keys.begin() + held);
  CHECK(seen.size() == static_cast<size_t>(held));  // no key stored twice
  std::vector<float> want(held * dim);
  tfpsx::HashTable cpu(options);
  for (int64_t i = 0; i < held; ++i) cpu.InitialRow(out_keys[i], want.data() + i * dim);
  out_rows.resize(held * dim);
  CHECK(CountFar(out_rows, want, 1e-5f) == 0);
  for (int s = 0; s < 4; ++s) {  // every stream read each key's initial row
    std::vector<float> got = rows[s]->Host(), expect(n * dim);
    const auto host = keys[s]->Host();
    for (int64_t i = 0; i < n; ++i) cpu.InitialRow(host[i], expect.data() + i * dim);
    CHECK(CountFar(got, expect, 1e-5f) == 0);
    cudaStreamDestroy(streams[s]);
  }
}

void TestFullTable() {
  GpuHashTable gpu(8, 4, GpuInit(CpuOptions(4)));
  std::vector<int64_t> keys(20);
  for (int i = 0; i < 20; ++i) keys[i] = 1000 + i;
  Device<int64_t> d_keys(keys);
  Device<float> d_rows(20 * 4);
  Device<unsigned long long> d_failed(std::vector<unsigned long long>{0});
  gpu.FindOrInsert(d_keys.ptr, 20, d_rows.ptr, nullptr, d_failed.ptr);
  CHECK(gpu.Size(nullptr) == 8);
  CHECK(d_failed.Host()[0] == 12);
  // Every key still got its initial row.
  std::vector<float> want(20 * 4);
  tfpsx::HashTable cpu(CpuOptions(4));
  for (int i = 0; i < 20; ++i) cpu.InitialRow(keys[i], want.data() + i * 4);
  CHECK(CountFar(d_rows.Host(), want, 1e-5f) == 0);
}

void TestUniqueGatherScatter(int64_t n) {
  const auto keys = RandomKeys(n, n / 3 + 1, 5);
  Device<int64_t> d_keys(keys), d_unique(n), d_inverse(n);
  const int64_t u = tfpsx::cuda::UniqueKeys(d_keys.ptr, n, d_unique.ptr, d_inverse.ptr, nullptr);
  std::vector<int64_t> want(keys);
  std::sort(want.begin(), want.end());
  want.erase(std::unique(want.begin(), want.end()), want.end());
  CHECK(u == static_cast<int64_t>(want.size()));
  const auto unique = d_unique.Host(u);
  CHECK(unique == want);
  const auto inverse = d_inverse.Host();
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) bad += !(inverse[i] >= 0 && inverse[i] < u && unique[inverse[i]] == keys[i]);
  CHECK(bad == 0);

  // Gather the unique rows back per key, and scatter-add per-key rows into unique rows.
  const int64_t dim = 5;
  std::vector<float> table(u * dim), per_key(n * dim);
  for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<float>(i % 97) * 0.5f;
  for (size_t i = 0; i < per_key.size(); ++i) per_key[i] = static_cast<float>(i % 13) * 0.25f;
  Device<float> d_table(table), d_gathered(n * dim), d_per_key(per_key);
  tfpsx::cuda::GatherRows(d_table.ptr, dim, d_inverse.ptr, n, d_gathered.ptr, nullptr);
  std::vector<float> gathered_want(n * dim), summed_want(u * dim, 0.f);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < dim; ++j) {
      gathered_want[i * dim + j] = table[inverse[i] * dim + j];
      summed_want[inverse[i] * dim + j] += per_key[i * dim + j];
    }
  }
  CHECK(CountFar(d_gathered.Host(), gathered_want, 0.f) == 0);
  Device<float> d_summed(std::vector<float>(u * dim, 0.f));
  tfpsx::cuda::ScatterAddRows(d_per_key.ptr, dim, d_inverse.ptr, n, d_summed.ptr, nullptr);
  CHECK(CountFar(d_summed.Host(), summed_want, 1e-5f) == 0);
}

}  // namespace

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "gpu_table_test: no CUDA device\n");
    return 2;
  }
  try {
    for (int64_t n : {1000LL, 100000LL, 10000000LL}) TestAgainstCpu(n, 16);
    TestAgainstCpu(5000, 7);
    TestConcurrentStreams();
    TestFullTable();
    for (int64_t n : {1000LL, 1000000LL}) TestUniqueGatherScatter(n);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpu_table_test: %s\n", e.what());
    return 1;
  }
  return tfpsx_test::Finish("gpu_table_test");
}
