# Entry points. `make train` and `make test` work on a fresh Debian machine:
# they install what is missing, configure, build and run.
BUILD_DIR ?= build
BUILD_TYPE ?= Release
JOBS ?= $(shell nproc)
CONFIG ?= configs/default.toml
ARGS ?=

.PHONY: all setup configure build train test sanitize clean

all: build

setup:
	@bash scripts/setup.sh

$(BUILD_DIR)/build.ninja: | setup
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE)

configure: $(BUILD_DIR)/build.ninja

build: setup configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

train: build
	./$(BUILD_DIR)/moe train --config $(CONFIG) $(ARGS)

test: build
	ctest --test-dir $(BUILD_DIR) -L 'cpu|mpi' --output-on-failure -j $(JOBS)

# The CPU tests again under AddressSanitizer and UndefinedBehaviorSanitizer (a CPU-only
# build of its own; ~40 min on 2 cores, so not part of CI's `make test`).
SANITIZE_DIR ?= build-sanitize
SANITIZE_FLAGS = -march=x86-64-v2 -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
sanitize: setup
	cmake -S . -B $(SANITIZE_DIR) -G Ninja -DMOE_ENABLE_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DCMAKE_CXX_FLAGS="$(SANITIZE_FLAGS)"
	cmake --build $(SANITIZE_DIR) -j $(JOBS)
	ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 \
	  ctest --test-dir $(SANITIZE_DIR) -L 'cpu|mpi' --output-on-failure -j $(JOBS)

clean:
	rm -rf $(BUILD_DIR)
