// Megatron-LM indexed datasets (.bin + .idx): written here by numpy following Megatron's
// _IndexWriter layout, read by MegatronDataset to the same tokens; corrupt or truncated
// files are one-line ConfigErrors naming the file; ids must fit the vocabulary.
#include <gtest/gtest.h>

#include "shell_command.h"
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>

#include "core/atomic_file.h"
#include "core/error.h"
#include "data/megatron_dataset.h"

namespace fs = std::filesystem;

namespace moe {
namespace {

std::string python() { return test::oracle_python(); }

// argv: prefix, numpy dtype name, documents as JSON (a list of documents, each a list of
// sequences, each a list of ids). Megatron's layout, written independently of the reader.
constexpr const char* kWriter = R"PY(
import json, struct, sys
import numpy as np
prefix, dtype, docs = sys.argv[1], np.dtype(sys.argv[2]), json.loads(sys.argv[3])
codes = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "float64": 6, "float32": 7, "uint16": 8}
sizes, pointers, doc_index, offset = [], [], [0], 0
with open(prefix + ".bin", "wb") as f:
    for doc in docs:
        for seq in doc:
            f.write(np.array(seq, dtype=dtype).tobytes())
            sizes.append(len(seq)); pointers.append(offset); offset += len(seq) * dtype.itemsize
        doc_index.append(len(sizes))
with open(prefix + ".idx", "wb") as f:
    f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", codes[dtype.name]))
    f.write(struct.pack("<Q", len(sizes)) + struct.pack("<Q", len(doc_index)))
    f.write(np.array(sizes, dtype=np.int32).tobytes())
    f.write(np.array(pointers, dtype=np.int64).tobytes())
    f.write(np.array(doc_index, dtype=np.int64).tobytes())
)PY";

using Docs = std::vector<std::vector<std::vector<int64_t>>>;  // documents of sequences of ids

std::string to_json(const Docs& docs) {
  std::string out = "[";
  for (const auto& doc : docs) {
    out += (out.size() > 1 ? ",[" : "[");
    for (size_t s = 0; s < doc.size(); ++s) {
      out += s ? ",[" : "[";
      for (size_t i = 0; i < doc[s].size(); ++i) out += (i ? "," : "") + std::to_string(doc[s][i]);
      out += "]";
    }
    out += "]";
  }
  return out + "]";
}

class Megatron : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("moe_megatron_" + std::to_string(getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string write(const std::string& name, const std::string& dtype, const Docs& docs) {
    const std::string prefix = (dir_ / name).string();
    std::ofstream(dir_ / "writer.py") << kWriter;
    const std::string cmd = python() + " " + (dir_ / "writer.py").string() + " " + prefix + " " + dtype + " '" +
                            to_json(docs) + "' 2>&1";
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
    return prefix;
  }
  fs::path dir_;
};

Docs sample_docs(int64_t max_id) {
  Docs docs;
  for (int d = 0; d < 9; ++d) {
    std::vector<std::vector<int64_t>> doc;
    const int sequences = d == 4 ? 3 : 1;  // a document of several sequences (sentences)
    for (int s = 0; s < sequences; ++s) {
      std::vector<int64_t> seq;
      for (int i = 0; i < (d == 2 ? 0 : 5 + 7 * d + s); ++i) seq.push_back((d * 1009 + s * 31 + i * 7919) % (max_id + 1));
      doc.push_back(seq);
    }
    docs.push_back(doc);
  }
  docs[1][0].back() = max_id;
  return docs;
}

void expect_reads(const MegatronDataset& data, const Docs& docs) {
  ASSERT_EQ(data.n_docs(), static_cast<int64_t>(docs.size()));
  int64_t total = 0;
  for (size_t d = 0; d < docs.size(); ++d) {
    std::vector<int32_t> want;
    for (const auto& seq : docs[d]) want.insert(want.end(), seq.begin(), seq.end());
    ASSERT_EQ(data.doc_size(static_cast<int64_t>(d)), static_cast<int64_t>(want.size())) << "document " << d;
    std::vector<int32_t> got(want.size());
    data.copy(static_cast<int64_t>(d), 0, static_cast<int64_t>(got.size()), got.data());
    EXPECT_EQ(got, want) << "document " << d;
    if (want.size() > 3) {  // from an offset, as the packed loader reads across sequences
      std::vector<int32_t> tail(2);
      data.copy(static_cast<int64_t>(d), 2, 2, tail.data());
      EXPECT_EQ(tail, std::vector<int32_t>(want.begin() + 2, want.begin() + 4));
    }
    total += static_cast<int64_t>(want.size());
  }
  EXPECT_EQ(data.n_tokens(), total);
}

TEST_F(Megatron, ReadsTheTokensNumpyWrote) {
  for (const auto& [dtype, max_id] : std::vector<std::pair<std::string, int64_t>>{
           {"uint16", 65535}, {"int32", 200000}, {"uint8", 255}, {"int64", 100000}}) {
    SCOPED_TRACE(dtype);
    const Docs docs = sample_docs(max_id);
    const std::string prefix = write("set_" + dtype, dtype, docs);
    for (const std::string& path : {prefix, prefix + ".idx", prefix + ".bin"}) {
      MegatronDataset data(path);
      EXPECT_EQ(data.prefix(), prefix);
      expect_reads(data, docs);
      EXPECT_EQ(data.token_range().second, max_id);
      data.check_vocabulary(max_id + 1, "model.vocab_size");  // fits exactly
      try {
        data.check_vocabulary(max_id, "model.vocab_size");
        ADD_FAILURE() << "id " << max_id << " accepted in a vocabulary of " << max_id;
      } catch (const ConfigError& e) {
        EXPECT_NE(std::string(e.what()).find(prefix + ".bin': token id " + std::to_string(max_id) +
                                             " outside the vocabulary of " + std::to_string(max_id)),
                  std::string::npos)
            << e.what();
      }
    }
    EXPECT_EQ(megatron_prefix(prefix + ".bin"), prefix);
    EXPECT_EQ(megatron_prefix(prefix), prefix);
    EXPECT_EQ(megatron_prefix((dir_ / "absent").string()), "");
  }
}

TEST_F(Megatron, CorruptOrTruncatedFilesAreOneLineErrorsNamingTheFile) {
  const std::string prefix = write("good", "uint16", sample_docs(1000));
  const std::string idx = read_file_bytes(prefix + ".idx"), bin = read_file_bytes(prefix + ".bin");
  auto put = [](std::string bytes, size_t at, const void* value, size_t n) {
    std::memcpy(bytes.data() + at, value, n);
    return bytes;
  };
  const uint64_t version2 = 2, huge = uint64_t{1} << 60;
  const uint8_t float_code = 6, bad_code = 9;
  const int64_t moved = 2;
  const int32_t negative = -1;
  const size_t n = 11;  // sequences: 8 documents of one, one of three
  const size_t pointers_at = kMegatronIndexHeaderBytes + 4 * n, doc_index_at = pointers_at + 8 * n;
  struct Case {
    std::string name, idx, bin, fragment;
  };
  const std::vector<Case> cases = {
      {"magic", put(idx, 0, "MMIDIDY", 7), bin, "wrong magic"},
      {"version", put(idx, 9, &version2, 8), bin, "unsupported version 2"},
      {"float", put(idx, 17, &float_code, 1), bin, "dtype code 6 (float64) is not an integer token id type"},
      {"code", put(idx, 17, &bad_code, 1), bin, "dtype code 9"},
      {"header", idx.substr(0, 20), bin, "truncated: 20 bytes, the header alone needs 34"},
      {"cut", idx.substr(0, idx.size() - 3), bin, "truncated"},
      {"long", idx + "xyz", bin, "wrong size"},
      {"count", put(idx, 18, &huge, 8), bin, "do not fit"},
      {"size", put(idx, kMegatronIndexHeaderBytes + 4, &negative, 4), bin, "sequence 1 has a negative size"},
      {"pointer", put(idx, pointers_at + 8, &moved, 8), bin, "sequence 1 starts at byte 2"},
      {"doc_start", put(idx, doc_index_at, &moved, 8), bin, "does not start at sequence 0"},
      {"doc_end", put(idx, idx.size() - 8, &moved, 8), bin, "outside"},
      {"bin", idx, bin.substr(0, bin.size() - 2), "the .bin has"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string p = (dir_ / ("bad_" + c.name)).string();
    std::ofstream(p + ".idx", std::ios::binary) << c.idx;
    std::ofstream(p + ".bin", std::ios::binary) << c.bin;
    try {
      MegatronDataset data(p);
      ADD_FAILURE() << "accepted";
    } catch (const ConfigError& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find(p + ".idx"), std::string::npos) << message;
      EXPECT_NE(message.find(c.fragment), std::string::npos) << message;
      EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    }
  }
  fs::remove(prefix + ".bin");
  try {
    MegatronDataset data(prefix);
    ADD_FAILURE() << "a missing .bin accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(prefix + ".bin': cannot open"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace moe
