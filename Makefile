# Entry points. `make train` and `make test` work on a fresh Debian machine:
# they install what is missing, configure, build and run.
BUILD_DIR ?= build
BUILD_TYPE ?= Release
JOBS ?= $(shell nproc)
CONFIG ?= configs/default.toml
ARGS ?=

.PHONY: all setup configure build train test clean

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

clean:
	rm -rf $(BUILD_DIR)
