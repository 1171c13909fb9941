// The Hugging Face export loaded by `transformers` (fp32, AutoModelForCausalLM and
// AutoTokenizer, from the oracle venv) computes our model: its logits equal our forward's
// within 1e-4 relative, greedy decoding picks our tokens, and the exported tokenizer gives
// our ids and EOS (tests/train/hf_mixtral_oracle.py checks; this side trains, exports and
// computes ours).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "core/bf16.h"
#include "data/tokenizer.h"
#include "shell_command.h"
#include "model/generator.h"
#include "train/export.h"
#include "train/test_resume_fixtures.h"

namespace moe {
namespace {

namespace fs = std::filesystem;

test::CommandResult run_python(const std::string& args) {
  return test::run_command(test::oracle_python() + " " + args);
}

// hf_mixtral_oracle.py on dir/hf with the files the tests write beside it.
test::CommandResult run_oracle(const fs::path& dir) {
  return run_python((test::source_root() / "tests/train/hf_mixtral_oracle.py").string() + " " + (dir / "hf").string() +
                    " " + (dir / "tokens.bin").string() + " " + (dir / "logits.bin").string() + " " +
                    (dir / "greedy.bin").string() + " " + (dir / "text.txt").string());
}

template <class T>
void write_raw(const fs::path& path, const std::vector<T>& values) {
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(values.data()), static_cast<std::streamsize>(values.size() * sizeof(T)));
}

// A model with everything Mixtral has: GQA, several layers, top-2 of 4 experts, the
// temperature folded into the gate, untied head; trained a few steps so that no weight is
// still at its initial value (norms away from 1).
RunConfig exportable_config(const fs::path& dir) {
  RunConfig config = test::tiny_config();
  ModelConfig& m = config.model;
  m.dim = 32;
  m.n_heads = 4;
  m.n_kv_heads = 2;
  m.seq_len = 24;
  m.rope_theta = 500.0;
  m.moe.router_bias = false;
  m.moe.bias_balancing = false;
  m.moe.temperature = 0.7;
  config.training.micro_batch = 2;
  config.training.global_batch_tokens = 96;  // 2 micro-batches
  config.data.tokenizer = "byte";
  config.lr.peak = 3e-2;
  config.checkpoint.dir = (dir / "ckpt").string();
  config.training.stop_at = 4;
  return config;
}

// Our logits at every position of `tokens` (padded to seq_len; causal attention keeps the
// padding out of them), from the training model's own forward.
std::vector<float> our_logits(Transformer<float>& model, std::vector<int32_t> tokens) {
  const int64_t S = model.config().seq_len, V = model.config().vocab_size;
  const size_t n = tokens.size();
  tokens.resize(static_cast<size_t>(S), 0);
  const std::vector<int32_t> targets(static_cast<size_t>(S), 0);
  model.plan(1);
  model.forward(tokens.data(), targets.data());
  return std::vector<float>(model.logits_TV(), model.logits_TV() + n * static_cast<size_t>(V));
}

// Greedy decoding by full forwards (the reference, no cache): the argmax of the last
// position's logits, appended, `count` times.
std::vector<int32_t> greedy(Transformer<float>& model, std::vector<int32_t> tokens, int count) {
  const int64_t V = model.config().vocab_size;
  std::vector<int32_t> added;
  for (int i = 0; i < count; ++i) {
    const std::vector<float> logits = our_logits(model, tokens);
    const float* last = logits.data() + (tokens.size() - 1) * static_cast<size_t>(V);
    const auto next = static_cast<int32_t>(std::max_element(last, last + V) - last);
    tokens.push_back(next);
    added.push_back(next);
  }
  return added;
}

class HfTransformers : public test::TempDirTest {
 protected:
  fs::path checkpoint() const { return dir_ / "ckpt" / "step_00000004"; }
  // exportable_config trained to its step-4 checkpoint (keeping `tokenizer_json`, as
  // `moe train` does), exported to dir_/hf; what the export printed goes to export_log_.
  std::unique_ptr<Trainer> train_and_export(const std::string& tokenizer_json = "") {
    auto trainer = test::make_trainer(exportable_config(dir_));
    trainer->tokenizer_json = tokenizer_json;
    std::ostringstream log;
    trainer->run(log);
    ExportOptions options;
    options.checkpoint = checkpoint().string();
    options.output = (dir_ / "hf").string();
    export_checkpoint(options, export_log_);
    return trainer;
  }
  std::ostringstream export_log_;
};

TEST_F(HfTransformers, ExportComputesOurLogitsGreedyTokensAndTokenizer) {
  auto trainer = train_and_export(ByteTokenizer().hf_tokenizer_json());
  ASSERT_TRUE(fs::exists(checkpoint() / "tokenizer.json"));
  EXPECT_FALSE(read_checkpoint(checkpoint()).find("param/layers.0.moe.router.bias")) << "moe.router_bias = false keeps none";
  // Exact: no --allow-inexact needed, nothing dropped.
  EXPECT_EQ(export_log_.str().find("warning"), std::string::npos) << export_log_.str();
  for (const char* file : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"})
    EXPECT_TRUE(fs::exists(dir_ / "hf" / file)) << file;

  Transformer<float>& model = trainer->model();
  const std::vector<int32_t> prompt = {3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3};
  write_raw(dir_ / "tokens.bin", prompt);
  write_raw(dir_ / "logits.bin", our_logits(model, prompt));
  const std::vector<int32_t> want = greedy(model, prompt, 8);
  // What `moe generate --temperature 0` writes: the KV-cache decoder's greedy tokens.
  CpuDecoder decoder(model);
  GenerateOptions greedy_options;
  greedy_options.max_tokens = 8;
  greedy_options.sampling.temperature = 0;
  EXPECT_EQ(generate(decoder, prompt, greedy_options).tokens, want);
  write_raw(dir_ / "greedy.bin", want);
  const std::string text = "def f(x):\n    return x  # caf\xc3\xa9, \xe4\xb8\xad\xe6\x96\x87, \xf0\x9f\x98\x80\t end";
  std::ofstream(dir_ / "text.txt", std::ios::binary) << text;
  write_raw(dir_ / "text.txt.ids", ByteTokenizer().encode(text));

  const test::CommandResult py = run_oracle(dir_);
  EXPECT_EQ(py.exit_code, 0) << py.output;
  EXPECT_NE(py.output.find("OK "), std::string::npos) << py.output;
  std::printf("transformers oracle: %s", py.output.c_str());  // "OK <max relative logit error>"
}

// The oracle is not vacuous: a gate scaled by 1.01 (the temperature folded wrongly, say)
// makes it fail on the logits.
TEST_F(HfTransformers, TheOracleSeesAWrongGate) {
  auto trainer = train_and_export();
  Transformer<float>& model = trainer->model();
  const std::vector<int32_t> prompt = {3, 1, 4, 1, 5, 9, 2, 6};
  write_raw(dir_ / "tokens.bin", prompt);
  float* gate = model.params().value(model.params().find("layers.1.moe.router.weight"));
  const int64_t n = model.params().numel(model.params().find("layers.1.moe.router.weight"));
  for (int64_t i = 0; i < n; ++i) gate[i] *= 1.01f;
  write_raw(dir_ / "logits.bin", our_logits(model, prompt));
  write_raw(dir_ / "greedy.bin", std::vector<int32_t>{});
  std::ofstream(dir_ / "text.txt", std::ios::binary) << "abc";
  write_raw(dir_ / "text.txt.ids", ByteTokenizer().encode("abc"));
  const test::CommandResult py = run_oracle(dir_);
  EXPECT_NE(py.exit_code, 0) << py.output;
  EXPECT_NE(py.output.find("logit"), std::string::npos) << py.output;
}

// A copy of the export with every tensor in bf16 (as published checkpoints are), written
// by torch.
constexpr const char* kToBf16 = R"PY(
import shutil, sys, torch
from safetensors.torch import load_file, save_file
src, dst = sys.argv[1], sys.argv[2]
shutil.copytree(src, dst)
tensors = {k: v.to(torch.bfloat16) for k, v in load_file(src + "/model.safetensors").items()}
save_file(tensors, dst + "/model.safetensors", metadata={"format": "pt"})
print("bf16", len(tensors))
)PY";

// --init-from-hf reads the export back: every parameter as trained (the gate through the
// temperature within 1 ulp), bf16 files as their bf16 values, and a run continues from them.
TEST_F(HfTransformers, InitFromHfReadsTheExportBack) {
  auto trained = train_and_export();
  std::ostringstream log;
  std::ofstream(dir_ / "to_bf16.py") << kToBf16;
  const test::CommandResult py = run_python((dir_ / "to_bf16.py").string() + " " + (dir_ / "hf").string() + " " + (dir_ / "hf_bf16").string());
  ASSERT_EQ(py.exit_code, 0) << py.output;

  RunConfig fresh = exportable_config(dir_);
  fresh.checkpoint.dir = "";
  fresh.training.stop_at = 0;
  auto& want = trained->model().params();
  for (const char* folder : {"hf", "hf_bf16"}) {
    SCOPED_TRACE(folder);
    auto started = test::make_trainer(fresh);
    std::ostringstream out;
    started->init_from_hf((dir_ / folder).string(), out);
    EXPECT_NE(out.str().find("init: parameters from"), std::string::npos) << out.str();
    auto& got = started->model().params();
    const bool bf16_file = std::string(folder) == "hf_bf16";
    for (int id = 0; id < want.size(); ++id) {
      const std::string& name = want.spec(id).name;
      const bool gate = name.ends_with("router.weight");
      for (int64_t i = 0; i < want.numel(id); ++i) {
        float expected = want.value(id)[i];
        if (bf16_file) expected = bf16_to_float(float_to_bf16(gate ? static_cast<float>(expected / 0.7) : expected));
        if (bf16_file && gate) expected = static_cast<float>(expected * 0.7);
        const float actual = got.value(id)[i];
        if (gate) ASSERT_NEAR(actual, expected, 2e-7f * std::fabs(expected) + 1e-12f) << name << "[" << i << "]";
        else ASSERT_EQ(actual, expected) << name << "[" << i << "]";
      }
    }
  }
  // Continued pretraining: the run goes on from there.
  auto started = test::make_trainer(fresh);
  started->init_from_hf((dir_ / "hf").string(), log);
  const double want_loss = trained->validate();
  EXPECT_NEAR(started->validate(), want_loss, 1e-5 * want_loss);  // the gate within 1 ulp
}

TEST_F(HfTransformers, InitFromHfRefusesAnotherShapeOrAMissingTensor) {
  const RunConfig config = exportable_config(dir_);
  train_and_export();
  std::ostringstream log;
  auto expect_refused = [&](RunConfig c, const std::string& folder, const std::string& why) {
    c.checkpoint.dir = "";
    auto trainer = test::make_trainer(c);
    try {
      trainer->init_from_hf((dir_ / folder).string(), log);
      ADD_FAILURE() << "accepted: " << why;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
    }
  };
  RunConfig wider = config;
  wider.model.moe.expert_hidden = 32;
  expect_refused(wider, "hf", "config.json intermediate_size is 16, moe.expert_hidden is 32");
  RunConfig shared = config;
  shared.model.moe.n_shared_experts = 1;
  expect_refused(shared, "hf", "moe.n_shared_experts > 0");
  expect_refused(config, "nothing_here", "not a directory");
  fs::remove(dir_ / "hf" / "model.safetensors");
  expect_refused(config, "hf", "cannot open model.safetensors");
}

}  // namespace
}  // namespace moe
