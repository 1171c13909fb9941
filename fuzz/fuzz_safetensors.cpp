// The safetensors header reader: any bytes are accepted with consistent offsets or
// refused with moe::Error; every tensor of an accepted file can be read.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/error.h"
#include "train/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    moe::SafeTensorsFile file =
        moe::SafeTensorsFile::from_bytes(std::string(reinterpret_cast<const char*>(data), size), "fuzz");
    for (const auto& t : file.header().tensors) {
      if (t.dtype != "F32") continue;
      std::vector<float> out(static_cast<size_t>(t.numel()));
      file.read_f32(t.name, out.data(), t.numel());
    }
  } catch (const moe::Error&) {
  }
  return 0;
}
