// The tokenizer.json reader (src/data/bpe_io.cpp): any bytes load or throw moe::Error, and
// a file that loads (byte-level or byte-fallback) encodes and decodes hostile text.
// It reads a path, so each input goes through a file in /dev/shm.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <string>

#include "core/error.h"
#include "data/bpe.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = "/dev/shm/moe_fuzz_tokenizer_" + std::to_string(::getpid()) + ".json";
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  try {
    moe::BpeTokenizer tok(moe::load_hf_tokenizer(path), path);
    for (bool special : {false, true}) {
      const std::vector<int32_t> ids = tok.encode("a  b\xff\xfe \xe6\x97\xa5\xf0\x9f\x8e\x89\n\t</s><s>", special);
      tok.decode(ids);
    }
  } catch (const moe::Error&) {
  }
  return 0;
}
