// The SentencePiece .model reader (src/data/sentencepiece_tokenizer.cpp over
// libsentencepiece): any bytes load or throw moe::Error, and a model that loads encodes and
// decodes hostile text. It reads a path, so each input goes through a file in /dev/shm.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <string>

#include "core/error.h"
#include "data/sentencepiece_tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = "/dev/shm/moe_fuzz_spm_" + std::to_string(::getpid()) + ".model";
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  try {
    moe::SentencePieceTokenizer tok(path);
    const std::vector<int32_t> ids = tok.encode("a  b\xff\xfe \xe6\x97\xa5\xf0\x9f\x8e\x89\n\t</s>");
    tok.decode(ids);
  } catch (const moe::Error&) {
  }
  return 0;
}
