// The checkpoint manifest reader (train/checkpoint_manifest.h): any bytes are accepted as
// a manifest whose pieces cover every tensor exactly once, or refused with moe::Error;
// an accepted version-2 manifest writes back to text that parses to the same.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/error.h"
#include "train/checkpoint_manifest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const std::string text(reinterpret_cast<const char*>(data), size);
    const moe::CheckpointManifest manifest = moe::parse_checkpoint_manifest(text, "fuzz");
    if (manifest.version >= 2) {
      const std::string written = moe::manifest_to_json(manifest);
      if (moe::manifest_to_json(moe::parse_checkpoint_manifest(written, "written")) != written) std::abort();
    }
  } catch (const moe::Error&) {
  }
  return 0;
}
