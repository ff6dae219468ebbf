# tfpsx developer entry points. `make demo` and `make test` set everything up on a fresh
# machine (virtualenv, TensorFlow, the op library built against it) and then run.
#
#   make test             tests against tensorflow-cpu 2.21 (what CI runs; builds the docs too):
#                         every feature end to end, not the variants and soaks marked slow
#   make test-all         make test plus the tests marked slow (before a release, and when
#                         touching their area: docs/testing.md lists them)
#   make test-fast        the unit and single-process tests, not the slow or heavy ones (the
#                         inner loop: about a minute)
#   make docs             the documentation site (MkDocs, --strict) into build/site
#   make test TF=2.16     the same suite against tensorflow-cpu 2.16, in a separate copy
#   make demo             a local job (scheduler, 2 PS, 2 workers, GEO) training the Criteo-
#                         format Wide&Deep of examples/criteo on generated data
#   make build            rebuild the op library after changing custom_ops/
#   make native-test      the TF-free table core's native tests (g++ only)
#   make cuda-check       compile the CUDA sources with nvcc, no GPU needed (skipped without nvcc;
#                         make test compiles the TF-free CUDA core's part, cuda-core-check)
#   make cuda-native-test run the core's native CUDA tests (a machine with a GPU, no TF needed)
#   make cuda-bench       the GPU table's native benchmark (a machine with a GPU)
#   make bench            benchmarks (ratios measured side by side in one run)
#   make bazel            build the op library with Bazel (apt-get install bazel-bootstrap)
#   make proto            regenerate tfpsx/control/proto/*_pb2*.py from its .proto files

PYTHON ?= python3
TF ?= 2.21
PYTEST_ARGS ?=
# Parallel compiles of the native tests (make test's set-up time on 2 cores).
JOBS ?= $(shell nproc 2>/dev/null || echo 2)

# A TF minor version maps to the newest patch release we test; pinned so that `make test`
# means the same thing on every machine (tfpsx itself accepts any installed TF 2.16 .. 2.21).
TF_SPEC_2.21 := tensorflow-cpu==2.21.0
TF_SPEC_2.16 := tensorflow-cpu==2.16.2
TF_SPEC ?= $(or $(TF_SPEC_$(TF)),tensorflow-cpu==$(TF).*)

VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tfpsx-setup
OP_SOURCES := $(shell find custom_ops -name '*.cc' -o -name '*.h' 2>/dev/null)
# Another TF gets its own copy of the tree (the editable install builds the op library
# in place, and one tree holds one build).
ALT_DIR := .tf$(TF)

.PHONY: setup build test test-all test-fast docs native-test native-asan native-tsan tier-peer cuda-check cuda-core-check \
    cuda-native-test cuda-bench demo bench bazel \
    proto clean

ifeq ($(TF),2.21)

setup: $(STAMP)

$(STAMP): setup.py pyproject.toml $(OP_SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TF_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -c "import tfpsx; tfpsx.load_ops(); print('tfpsx ops load with TensorFlow', __import__('tensorflow').__version__)"
	touch $(STAMP)

build: setup
	$(PY) -m pip install -q -e ".[test]"

# The TF-free table core has its own native test binaries (no TensorFlow needed): one per
# custom_ops/tests/*_test.cc, each linked with the core's objects. NATIVE_DIR and
# NATIVE_CXXFLAGS make other builds of them (`make native-asan` is one).
NATIVE_DIR ?= build/native
NATIVE_CXXFLAGS ?= -O2 -g
NATIVE_CORE_OBJS := $(patsubst %.cc,$(NATIVE_DIR)/%.o,\
    $(filter-out %.cu.cc,$(wildcard custom_ops/cc/core/*.cc)))
NATIVE_TESTS := $(patsubst custom_ops/tests/%.cc,$(NATIVE_DIR)/%,\
    $(filter-out %.cu.cc,$(wildcard custom_ops/tests/*_test.cc)))

$(NATIVE_DIR)/%.o: %.cc
	@mkdir -p $(dir $@)
	$(CXX) $(NATIVE_CXXFLAGS) -pthread -std=c++17 -Wall -I. -MMD -MP -c $< -o $@

$(NATIVE_DIR)/%_test: $(NATIVE_DIR)/custom_ops/tests/%_test.o $(NATIVE_CORE_OBJS)
	$(CXX) $(NATIVE_CXXFLAGS) -pthread $^ -o $@

# Objects are kept between runs (make would delete them as intermediates).
.PRECIOUS: $(NATIVE_DIR)/%.o

-include $(NATIVE_CORE_OBJS:.o=.d) \
    $(NATIVE_TESTS:$(NATIVE_DIR)/%=$(NATIVE_DIR)/custom_ops/tests/%.d)

native-test:
	@$(MAKE) --no-print-directory -j$(JOBS) $(NATIVE_TESTS)
	@for t in $(NATIVE_TESTS); do echo $$t; $$t || exit 1; done

# The same tests under AddressSanitizer and UBSan.
native-asan:
	$(MAKE) native-test NATIVE_DIR=build/native-asan \
	    NATIVE_CXXFLAGS="-O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined \
	    -fno-sanitize-recover=undefined"

# The same tests under ThreadSanitizer (the tier's prefetch reads without the table's lock).
native-tsan:
	$(MAKE) native-test NATIVE_DIR=build/native-tsan NATIVE_CXXFLAGS="-O1 -g -fsanitize=thread"

# CUDA. nvcc is looked for on PATH, then at /usr/local/cuda/bin; NVCC=... overrides.
NVCC ?= $(firstword $(shell command -v nvcc 2>/dev/null) $(wildcard /usr/local/cuda/bin/nvcc))
CUDA_CORE_SOURCES := $(wildcard custom_ops/cc/core/*.cu.cc custom_ops/cuda/*.cu.cc)
CUDA_CORE_SOURCES := $(filter-out %_bench.cu.cc,$(CUDA_CORE_SOURCES))
CUDA_NATIVE_TESTS := $(patsubst custom_ops/tests/%.cu.cc,build/native/cuda/%,\
    $(wildcard custom_ops/tests/*_test.cu.cc))
CUDA_BENCH := build/native/cuda/gpu_table_bench
CUDA_OBJ := build/native/cuda/obj
CUDA_CORE_OBJS := $(patsubst %.cu.cc,$(CUDA_OBJ)/%.o,$(CUDA_CORE_SOURCES))
CUDA_HEADERS := $(wildcard custom_ops/cc/core/*.h custom_ops/cuda/*.h custom_ops/tests/check.h)
NVCC_FLAGS := -std=c++17 -O2 -DGOOGLE_CUDA=1 --expt-relaxed-constexpr -I.
NVCC_CHECK = $(if $(NVCC),,$(error no nvcc on PATH or at /usr/local/cuda/bin/nvcc; set NVCC=/path/to/nvcc))

# nvcc compiles one language per call (-x cu), so every CUDA source is its own object;
# the CPU table core (NATIVE_CORE_OBJS, g++) links into the tests that check the GPU
# against it. The tests and the benchmark need nvcc only, no TensorFlow, so they build
# and run on the GPU machines, which have none.
$(CUDA_OBJ)/%.o: %.cu.cc $(CUDA_HEADERS)
	$(NVCC_CHECK)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCC_FLAGS) -x cu -c $< -o $@

build/native/cuda/%_test: $(CUDA_OBJ)/custom_ops/tests/%_test.o $(CUDA_CORE_OBJS) \
    $(NATIVE_CORE_OBJS)
	$(NVCC) $^ -Xcompiler -pthread -o $@

$(CUDA_BENCH): $(CUDA_OBJ)/custom_ops/cuda/gpu_table_bench.o $(CUDA_CORE_OBJS)
	$(NVCC) $^ -o $@

# Compiles every CUDA source with nvcc, no GPU needed: the op library's *.cu.cc exactly
# as a TFPSX_WITH_CUDA=1 build does (the installed TF's flags and the include shim:
# setup.py cuda_check), and the core's CUDA tests (compiled and linked, not run).
cuda-check: setup cuda-core-check
ifeq ($(NVCC),)
	@echo "cuda-check: skipped: no nvcc on PATH or at /usr/local/cuda/bin/nvcc" \
	    "(install the CUDA toolkit or set NVCC=/path/to/nvcc to check the CUDA sources)"
else
	NVCC=$(NVCC) $(PY) setup.py -q cuda_check
endif

# make test's part of it: the TF-free CUDA core, its native tests and the benchmark
# compiled and linked (what runs on a GPU machine); cuda-check adds the op library's
# CUDA kernels, compiled against TF's headers (1-2 minutes more on 2 cores: make test-all).
cuda-core-check:
ifeq ($(NVCC),)
	@echo "cuda-core-check: skipped: no nvcc on PATH or at /usr/local/cuda/bin/nvcc"
else
	$(MAKE) --no-print-directory -j$(JOBS) $(CUDA_NATIVE_TESTS) $(CUDA_BENCH) NVCC=$(NVCC)
endif

cuda-native-test: $(CUDA_NATIVE_TESTS)
	@for t in $^; do echo $$t; $$t || exit 1; done

cuda-bench: $(CUDA_BENCH)
	$(CUDA_BENCH)

# Every test process imports tfpsx: its bytecode is written once here, also where
# PYTHONDONTWRITEBYTECODE is set (0.3 s of CPU a process otherwise, ~150 processes a run).
BYTECODE = $(PY) -m compileall -q tfpsx tests examples benchmarks > /dev/null

# The tiers in two runs. The single-process ones (unit, ops: one process each test, about
# one core) run two at a time under pytest-xdist: 202 s instead of 425 s on 2 cores. The
# ones that start clusters (cluster, examples) run one at a time: a job's processes keep
# both cores busy, and two jobs at once made each 1.7-2x slower (the time guard failed
# four) for 19% less wall time. PYTEST_ARGS goes to both runs; a run whose tiers it
# selects none of (exit code 5) is not a failure.
TEST_JOBS ?= $(JOBS)

test: setup native-test cuda-core-check docs
	$(BYTECODE)
	$(PY) -m pytest -ra --durations=15 -n $(TEST_JOBS) -m "not slow" tests/unit tests/ops \
	    $(PYTEST_ARGS) || test $$? -eq 5
	$(PY) -m pytest -ra --durations=25 -m "not slow" tests/cluster tests/examples \
	    $(PYTEST_ARGS) || test $$? -eq 5

test-all: setup native-test cuda-check docs
	$(BYTECODE)
	$(PY) -m pytest -ra --durations=40 $(PYTEST_ARGS)

test-fast: setup
	$(BYTECODE)
	$(PY) -m pytest -ra --durations=10 -n $(TEST_JOBS) tests/unit tests/ops \
	    -m "not slow and not heavy" $(PYTEST_ARGS)

# MkDocs + mkdocs-material (the site's theme): a docs extra, installed on first use.
docs: setup
	$(PY) -c "import mkdocs, material" 2>/dev/null || $(PY) -m pip install -q mkdocs mkdocs-material
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet

DEMO_DATA := data/criteo-demo

demo: setup
	test -f $(DEMO_DATA)/planted.json || $(PY) examples/criteo/make_data.py \
	    --out $(DEMO_DATA) --train_rows 400000 --eval_rows 30000
	$(VENV)/bin/tfpsx-run --server_num 2 --worker_num 2 --log_dir logs/demo --timeout 600 \
	    examples/criteo/train.py --train_data '$(DEMO_DATA)/train-*' \
	    --eval_data $(DEMO_DATA)/eval.txt --mode geo --k_steps 50 --epochs 2

# The disk tier's store against RocksDB behind the same interface (the tier benchmark's
# peer, benchmarks/tiered_store_peer.cc). Debian's librocksdb-dev is installed for it
# when missing (root only); without it the peer runs ours against RAM alone. Nothing of
# tfpsx links RocksDB.
ROCKSDB_H := /usr/include/rocksdb/db.h
tier-peer:
	@test -f $(ROCKSDB_H) || { apt-get update -qq && apt-get install -y -qq librocksdb-dev; } \
	    >/dev/null 2>&1 || echo "librocksdb-dev not installed: the peer runs without RocksDB"
	@$(MAKE) --no-print-directory $(NATIVE_DIR)/tiered_store_peer

$(NATIVE_DIR)/tiered_store_peer: benchmarks/tiered_store_peer.cc $(NATIVE_CORE_OBJS)
	$(CXX) $(NATIVE_CXXFLAGS) -pthread -std=c++17 -I. \
	    $(if $(wildcard $(ROCKSDB_H)),-DTFPSX_PEER_ROCKSDB) $^ \
	    $(if $(wildcard $(ROCKSDB_H)),-lrocksdb) -o $@

bench: setup tier-peer
	$(PY) -c "import matplotlib" 2>/dev/null || $(PY) -m pip install -q matplotlib
	$(PY) benchmarks/time_to_auc.py --networks 1ms --modes sync,async,geo10,geo100,geo400,\
	geo10_earlier,geo100_earlier,geo100_bf16,async_cache,async_cache_ceiling,geo100_cache,local
	$(PY) benchmarks/time_to_auc.py --job word2vec --networks 1ms
	$(PY) benchmarks/geo_round_traffic.py --data 'data/bench-criteo-1000000/train-*' \
	    --workers 2,4,8 --k 10,100,auto
	$(PY) benchmarks/cluster_ready.py
	$(PY) benchmarks/geo_scale.py --workers 1,4,8 --k 10 --rules mean
	$(PY) benchmarks/geo_scale.py --workers 1,4,8 --k 10 --rules shared --async_part dense \
	    --hot_count 4 --hot_per_round auto --no_async
	$(PY) benchmarks/geo_scale.py --job word2vec --workers 1,4,8 --k 5 --dim 16 \
	    --table_lr 0.1 --rules mean,shared --hot_count 4
	$(PY) benchmarks/geo_scale.py --job word2vec --workers 8 --k 10 --dim 16 \
	    --table_lr 0.1 --rules shared --hot_count 4 --hot_per_round 0
	$(PY) benchmarks/geo_scale.py --job word2vec --workers 8 --k 10 --dim 16 \
	    --table_lr 0.1 --rules shared --hot_count 4 --hot_per_round auto --no_async
	$(PY) benchmarks/embedding_ops.py
	$(PY) benchmarks/embedding_cache.py
	$(PY) benchmarks/tiered_table.py --ram_mb 64 --fill 10 --dims 16,64 --steps 200
	$(PY) benchmarks/tier_miss_floor.py --ids 4534382 --rows 74000,148000,300000
	$(PY) benchmarks/geo_vs_async.py
	$(PY) benchmarks/keras_modes.py
	$(PY) benchmarks/session_run_cost.py
	$(PY) benchmarks/geo_step_ops.py
	$(PY) benchmarks/serving_deltas.py
	$(PY) benchmarks/online_freshness.py
	$(PY) benchmarks/collective_scaling.py
	$(PY) benchmarks/collective_scaling.py --criteo --rounds 2
	$(PY) benchmarks/data_plane.py
	$(PY) benchmarks/incremental_checkpoint.py
	$(PY) benchmarks/fault_soak.py
	$(PY) benchmarks/startup_soak.py --kind keras --jobs 24 --parallel 2
	$(PY) benchmarks/startup_soak.py --kind graph --jobs 12 --parallel 2

# Bazel 4 (Debian's bazel-bootstrap) builds the same library offline against the
# installed wheel, and the core's native tests; the check loads the library through
# tfpsx's loader and runs an op. `bazel build --config=cuda //:_tfpsx_ops.so` adds CUDA.
bazel: setup
	$(PY) configure.py
	bazel build //:_tfpsx_ops.so
	bazel test --test_output=errors //:all
	$(PY) -c "from tfpsx.ops import loader as _loader; import tensorflow as tf; \
	    ops = _loader.load_ops('bazel-bin'); \
	    h = ops.tfpsx_counter_handle_op(shared_name='bazel/check'); \
	    assert int(ops.tfpsx_counter_add(h, tf.constant(2, tf.int64))) == 2; \
	    print('Bazel-built', _loader.find_library('bazel-bin'), 'loads and runs on TF', tf.__version__)"

# grpcio-tools 1.62 emits protobuf 4.25 gencode: the oldest that TF 2.16's protobuf 4.x
# accepts and that newer protobuf runtimes (5.x .. 7.x) still load. It lives in its own
# virtualenv because it needs protobuf 4.x.
proto:
	test -x .venv-proto/bin/python || $(PYTHON) -m venv .venv-proto
	.venv-proto/bin/pip install -q "grpcio-tools==1.62.3"
	.venv-proto/bin/python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. \
	    tfpsx/control/proto/scheduler.proto
	.venv-proto/bin/python -m grpc_tools.protoc -I. --python_out=. \
	    tfpsx/control/proto/tf_eager.proto

else

setup test test-all test-fast docs demo build bench:
	mkdir -p $(ALT_DIR)/src
	git ls-files -z --cached --others --exclude-standard | \
	    tar --null -T - -cf - | tar -xf - -C $(ALT_DIR)/src
	$(MAKE) -C $(ALT_DIR)/src $@ TF=2.21 TF_SPEC="$(TF_SPEC)" PYTHON=$(PYTHON) \
	    PYTEST_ARGS="$(PYTEST_ARGS)"

endif

clean:
	rm -rf build dist *.egg-info tfpsx/*.so logs .tf2.* .pytest_cache
