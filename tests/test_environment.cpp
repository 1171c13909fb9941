// Exports the build's paths to the tests as environment variables before main() runs,
// unless the caller set them: MOE_SOURCE_DIR (the repository), MOE_BINARY (the `moe`
// binary) and MOE_PYTHON (the virtual environment with the Python test oracles).
#include <cstdlib>

namespace {

struct ExportTestPaths {
  ExportTestPaths() {
    setenv("MOE_SOURCE_DIR", MOE_TEST_SOURCE_DIR, /*overwrite=*/0);
    setenv("MOE_BINARY", MOE_TEST_BINARY, 0);
    setenv("MOE_PYTHON", MOE_TEST_PYTHON, 0);
  }
} export_test_paths;

}  // namespace
