// The [data] section: where the text comes from and how it is tokenized
// (docs/CONFIG.md describes every key).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace moe {

// The byte tokenizer's ids: the 256 bytes and one end-of-document id.
inline constexpr int64_t kByteVocabSize = 257;

struct DataConfig {
  std::string dir = "/usr/share/doc/python3.11-doc/html/_sources";
  std::string extension = ".txt";     // files under dir whose name ends with this
  std::string tokenizer = "byte";     // byte | bpe:<vocab> | [hf:]path/tokenizer.json | tiktoken:<pattern>:<file> | sentencepiece:<file> | path.model
  double val_fraction = 0.05;         // share of documents held out, chosen by path hash
  int64_t max_bytes = 0;              // read at most this many bytes of text (0: all)
  std::string shards = "";            // a `moe tokenize` output folder to train from instead of dir ("" : read dir)
  std::string text_field = "text";    // the string field of each line of a .jsonl document file
  std::string sources = "";           // "W:PATH,W:PATH,...": weighted blend of several sources instead of dir ("" : read dir)
};

// One entry of data.sources: a folder of text or JSONL, a `moe tokenize` folder, or a
// Megatron indexed dataset (the path prefix of its .bin and .idx), drawn with probability
// weight / (sum of the weights).
struct DataSourceSpec {
  double weight = 1;
  std::string path;
};
// The entries of a data.sources string: comma-separated `WEIGHT:PATH` or `PATH` (weight 1;
// a path holding ':' needs the weight). Empty when the text has none; on bad syntax
// returns {} and sets `error` to what was wrong (for a one-line ConfigError).
std::vector<DataSourceSpec> parse_data_sources(std::string_view text, std::string* error);

// The kinds of data.tokenizer (a specification string, since it also names files).
enum class TokenizerKind { Byte, TrainBpe, HfJson, Tiktoken, SentencePiece, Invalid };
struct TokenizerSpec {
  TokenizerKind kind = TokenizerKind::Invalid;
  int64_t bpe_vocab = 0;  // TrainBpe: bpe:<vocab>, trained on data.dir and cached under data_cache/
  std::string path;       // HfJson, Tiktoken, SentencePiece: the file (without hf:, tiktoken:<pattern>:, sentencepiece:)
};
// What a data.tokenizer string asks for (Invalid: none of the forms docs/CONFIG.md lists).
TokenizerSpec parse_tokenizer_spec(std::string_view spec);

}  // namespace moe
