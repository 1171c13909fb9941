// scripts/parquet_to_jsonl.py: a parquet file written by pyarrow becomes JSONL that
// `moe train` reads through data.dir (row for row); bad input is one line and exit code 2.
#include <gtest/gtest.h>

#include "shell_command.h"
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "cli/moe_process.h"

namespace moe {
namespace {

namespace fs = std::filesystem;

// 50 rows (one null) of text plus an id column.
constexpr const char* kWriteParquet = R"PY(
import sys
import pyarrow as pa, pyarrow.parquet as pq
texts = ["Row %d: the quick brown fox \"jumps\" over the lazy dog. \u00e9\n%s" % (i, "xyz" * i) for i in range(50)]
texts[7] = None
pq.write_table(pa.table({"id": list(range(50)), "text": texts}), sys.argv[1], row_group_size=16)
)PY";

class ParquetToJsonl : public test::CliTempDir {
 protected:
  std::string convert(const std::string& args) {
    return test::oracle_python() + " " + (test::source_root() / "scripts/parquet_to_jsonl.py").string() + " " + args;
  }
};

TEST_F(ParquetToJsonl, ConvertsRowsThatMoeTrainReads) {
  std::ofstream(p("write.py")) << kWriteParquet;
  test::MoeResult r = test::run_command(test::oracle_python() + " " + p("write.py") + " " + p("rows.parquet"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = test::run_command(convert("--input " + p("rows.parquet") + " --output " + p("jsonl") + " --rows-per-file 20"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("49 rows from 1 files -> 3 files in " + p("jsonl") + " (1 null rows skipped)"),
            std::string::npos)
      << r.output;
  int lines = 0;
  for (const char* part : {"part_00000.jsonl", "part_00001.jsonl", "part_00002.jsonl"}) {
    std::ifstream in(fs::path(p("jsonl")) / part);
    ASSERT_TRUE(in) << part;
    for (std::string line; std::getline(in, line);) {
      ++lines;
      EXPECT_TRUE(line.starts_with("{\"text\": \"Row ")) << line;
    }
  }
  EXPECT_EQ(lines, 49);
  // Trained on as documents (49 of them, split by data.val_fraction), not as JSON text.
  std::ofstream(p("tiny.toml")) << "[model]\ndim = 16\nn_layers = 1\nn_heads = 2\nn_kv_heads = 1\nseq_len = 32\n"
                                << "[moe]\nn_experts = 4\nexpert_hidden = 16\n"
                                << "[training]\nsteps = 2\nglobal_batch_tokens = 64\nmicro_batch = 2\n"
                                << "val_interval = 0\nthreads = 1\n";
  const test::MoeResult train = test::run_moe("train --config " + p("tiny.toml") +
                                              " --device cpu --data.val_fraction=0.2 --data.extension=.jsonl "
                                              "--data.dir=" + p("jsonl"));
  ASSERT_EQ(train.exit_code, 0) << train.output;
  const auto at = train.output.find("| train ", train.output.find("data: " + p("jsonl")));
  ASSERT_NE(at, std::string::npos) << train.output;
  int train_docs = 0, val_docs = 0;
  ASSERT_EQ(std::sscanf(train.output.c_str() + at, "| train %d docs", &train_docs), 1);
  const auto val_at = train.output.find("| validation ", at);
  ASSERT_EQ(std::sscanf(train.output.c_str() + val_at, "| validation %d docs", &val_docs), 1);
  EXPECT_EQ(train_docs + val_docs, 49) << train.output;
}

TEST_F(ParquetToJsonl, BadInputIsOneLineAndExitTwo) {
  std::ofstream(p("write.py")) << kWriteParquet;
  ASSERT_EQ(test::run_command(test::oracle_python() + " " + p("write.py") + " " + p("rows.parquet")).exit_code, 0);
  std::ofstream(p("fake.parquet")) << "not parquet at all";
  struct Case {
    std::string args, fragment;
  };
  for (const Case& c : {Case{"--input " + p("missing.parquet") + " --output " + p("o"), "no such file"},
                        Case{"--input " + p("rows.parquet") + " --output " + p("o") + " --column body",
                             "no column 'body' (--column; columns: id, text)"},
                        Case{"--input " + p("rows.parquet") + " --output " + p("o") + " --column id",
                             "column 'id' holds int values, not strings"},
                        Case{"--input " + p("fake.parquet") + " --output " + p("o"), "not a readable parquet file"},
                        Case{"--input " + p("rows.parquet") + " --output " + p("o") + " --rows-per-file 0",
                             "--rows-per-file must be >= 1"}}) {
    test::expect_one_line_error(test::run_command(convert(c.args)), 2, {"parquet_to_jsonl: error: ", c.fragment});
  }
}

}  // namespace
}  // namespace moe
