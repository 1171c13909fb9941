// `moe export --format hf`: the folder is read back with the PyPI safetensors package
// (numpy API) and checked against the checkpoint tensor by tensor: Mixtral's names,
// shapes, dtypes and values, config.json fields, and sharding with an index.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <fcntl.h>
#include <unistd.h>

#include "shell_command.h"
#include "train/checkpoint.h"
#include "train/export.h"
#include "train/safetensors.h"
#include "train/test_resume_fixtures.h"

namespace moe {
namespace {

namespace fs = std::filesystem;


// Loads the export and the checkpoint shard with safetensors.numpy and compares them.
constexpr const char* kCheck = R"PY(
import json, os, sys
import numpy as np
from safetensors.numpy import load_file
from safetensors import safe_open

out, ckpt, sharded, temperature = sys.argv[1], sys.argv[2], sys.argv[3] == "1", float(sys.argv[4])
cfg = json.load(open(os.path.join(out, "config.json")))
assert cfg["architectures"] == ["MixtralForCausalLM"] and cfg["model_type"] == "mixtral", cfg
L, D, E, F = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_local_experts"], cfg["intermediate_size"]
H, G, hd, V = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["vocab_size"]
assert (L, D, E, F, H, G, hd, V) == (2, 16, 4, 16, 2, 1, 8, 257), cfg
assert cfg["num_experts_per_tok"] == 2 and cfg["hidden_act"] == "silu" and cfg["tie_word_embeddings"] is False
assert cfg["rope_theta"] == 10000.0 and cfg["rms_norm_eps"] == 1e-5 and cfg["max_position_embeddings"] == 8

files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
tensors = {}
if sharded:
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert len(files) > 1 and files[0] == "model-00001-of-%05d.safetensors" % len(files), files
    assert sorted(set(index["weight_map"].values())) == files
    for f in files:
        part = load_file(os.path.join(out, f))
        for name in part:
            assert index["weight_map"][name] == f, name
        tensors.update(part)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
else:
    assert files == ["model.safetensors"], files
    tensors = load_file(os.path.join(out, "model.safetensors"))
with safe_open(os.path.join(out, files[0]), framework="np") as f:
    assert f.metadata() == {"format": "pt"}

expected = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}
for l in range(L):
    p = "model.layers.%d." % l
    expected.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                     p + "self_attn.q_proj.weight": (H * hd, D), p + "self_attn.k_proj.weight": (G * hd, D),
                     p + "self_attn.v_proj.weight": (G * hd, D), p + "self_attn.o_proj.weight": (D, H * hd),
                     p + "block_sparse_moe.gate.weight": (E, D)})
    for e in range(E):
        q = p + "block_sparse_moe.experts.%d." % e
        expected.update({q + "w1.weight": (F, D), q + "w3.weight": (F, D), q + "w2.weight": (D, F)})
assert set(tensors) == set(expected), set(tensors) ^ set(expected)
for name, shape in expected.items():
    assert tensors[name].shape == shape and tensors[name].dtype == np.float32, (name, tensors[name].shape)

# The checkpoint's shard: pieces "NAME@BEGIN" of the manifest's tensors (one process: whole).
raw = load_file(ckpt)
manifest = json.load(open(os.path.join(os.path.dirname(ckpt), "manifest.json")))
ours = {}
for t in manifest["tensors"]:
    assert [(p["begin"], p["count"]) for p in t["pieces"]] == [(0, int(np.prod(t["shape"])))], t["name"]
    ours[t["name"]] = raw[t["name"] + "@0"].reshape(t["shape"])
def same(theirs, mine):
    assert np.array_equal(tensors[theirs], mine), theirs
same("model.embed_tokens.weight", ours["param/embedding"])
same("lm_head.weight", ours["param/lm_head"])
same("model.norm.weight", ours["param/final_norm"])
for l in range(L):
    p, m = "model.layers.%d." % l, "param/layers.%d." % l
    same(p + "input_layernorm.weight", ours[m + "attn_norm"])
    same(p + "post_attention_layernorm.weight", ours[m + "ffn_norm"])
    for a, b in (("q", "wq"), ("k", "wk"), ("v", "wv"), ("o", "wo")):
        same(p + "self_attn.%s_proj.weight" % a, ours[m + "attn." + b])
    same(p + "block_sparse_moe.gate.weight", ours[m + "moe.router.weight"] / np.float32(temperature))
    for e in range(E):
        q = p + "block_sparse_moe.experts.%d." % e
        for w in ("w1", "w2", "w3"):
            same(q + w + ".weight", ours[m + "moe.experts." + w][e])
print("OK", len(tensors))
)PY";

// The check script through the oracle venv's python.
test::CommandResult run_python(const fs::path& script, const std::string& args) {
  return test::run_command(test::oracle_python() + " " + script.string() + " " + args);
}

class HfExport : public test::TempDirTest {
 protected:
  // A checkpoint before any update (router bias still zero) and one after two steps.
  void SetUp() override {
    TempDirTest::SetUp();
    RunConfig config = test::tiny_config();
    config.model.moe.temperature = 2.0;  // folded into the gate
    config.checkpoint.dir = (dir_ / "ckpt").string();
    config.training.stop_at = 2;
    auto trainer = test::make_trainer(config);
    std::ostringstream log;
    trainer->save_checkpoint(log);
    trainer->run(log);
  }
  fs::path step(int s) const { return dir_ / "ckpt" / fmt::format("step_{:08d}", s); }
};

TEST_F(HfExport, MixtralFolderReadsBackWithSafetensors) {
  std::ofstream(dir_ / "check.py") << kCheck;
  for (bool sharded : {false, true}) {
    SCOPED_TRACE(sharded);
    ExportOptions options;
    options.checkpoint = step(0).string();
    options.output = (dir_ / (sharded ? "hf_sharded" : "hf")).string();
    if (sharded) options.max_shard_bytes = 8000;  // a few experts per shard
    std::ostringstream out;
    export_checkpoint(options, out);
    EXPECT_NE(out.str().find("as MixtralForCausalLM"), std::string::npos) << out.str();
    EXPECT_EQ(fs::exists(dir_ / (sharded ? "hf_sharded" : "hf") / "model.safetensors.index.json"), sharded);
    const test::CommandResult py = run_python(dir_ / "check.py", options.output + " " + (step(0) / "rank_00000.safetensors").string() +
                                                    " " + (sharded ? "1" : "0") + " 2.0");
    EXPECT_EQ(py.exit_code, 0) << py.output;
    EXPECT_NE(py.output.find("OK 41"), std::string::npos) << py.output;  // 3 + 2 layers x (7 + 4 experts x 3)
  }
}

// Every entry of `dir` (a failed export must leave none, not even a hidden one).
std::vector<std::string> entries(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// An export that fails half-way (a file size limit makes writing model.safetensors fail
// with EFBIG, as a full disk would) leaves nothing behind: neither its temporary folder nor
// the parent folders it created. "out/" exports into "out", as "out" does.
TEST_F(HfExport, AFailedExportLeavesNothingAndATrailingSlashWorks) {
  ExportOptions options;
  options.checkpoint = step(0).string();
  options.output = (dir_ / "new" / "deeper" / "hf").string() + "/";
  const std::vector<std::string> before = entries(dir_);
  rlimit old{};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old), 0);
  rlimit small = old;
  small.rlim_cur = 20000;  // config.json fits; model.safetensors (~65 kB) does not
  void (*old_handler)(int) = std::signal(SIGXFSZ, SIG_IGN);  // write() fails with EFBIG instead
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  std::ostringstream out;
  std::string error;
  try {
    export_checkpoint(options, out);
  } catch (const Error& e) {
    error = e.what();
  }
  setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_NE(error.find("File too large"), std::string::npos) << error;
  EXPECT_EQ(entries(dir_), before);
  // The rerun is not refused, and the trailing slash names the folder itself.
  export_checkpoint(options, out);
  EXPECT_TRUE(fs::exists(dir_ / "new" / "deeper" / "hf" / "model.safetensors"));
  EXPECT_EQ(entries(dir_ / "new" / "deeper"), std::vector<std::string>{"hf"});
  EXPECT_EQ(entries(dir_ / "new" / "deeper" / "hf"),
            (std::vector<std::string>{"config.json", "generation_config.json", "model.safetensors",
                                      "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"}));
  EXPECT_NE(out.str().find("-> " + options.output + " as MixtralForCausalLM"), std::string::npos) << out.str();
}

TEST_F(HfExport, WhatMixtralCannotHoldIsRefused) {
  ExportOptions options;
  options.checkpoint = step(2).string();
  options.output = (dir_ / "hf").string();
  std::ostringstream out;
  try {
    export_checkpoint(options, out);
    ADD_FAILURE() << "a trained router bias was exported silently";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("layers.0.moe.router.bias is not zero"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("--allow-inexact"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(dir_ / "hf"));
  options.allow_inexact = true;
  export_checkpoint(options, out);
  EXPECT_NE(out.str().find("warning: export: layers.0.moe.router.bias is not zero"), std::string::npos) << out.str();
  EXPECT_TRUE(fs::exists(dir_ / "hf" / "model.safetensors"));
  // The output must be new or empty; the format must be hf.
  EXPECT_THROW(export_checkpoint(options, out), ConfigError);
  options.output = (dir_ / "hf2").string();
  options.format = "gguf";
  EXPECT_THROW(export_checkpoint(options, out), ConfigError);
  // Shared experts have no Mixtral counterpart.
  RunConfig shared = test::tiny_config();
  shared.model.moe.n_shared_experts = 1;
  shared.checkpoint.dir = (dir_ / "shared").string();
  shared.training.stop_at = 1;
  auto trainer = test::make_trainer(shared);
  trainer->run(out);
  options.format = "hf";
  options.checkpoint = (dir_ / "shared" / "step_00000001").string();
  try {
    export_checkpoint(options, out);
    ADD_FAILURE() << "shared experts exported";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("moe.n_shared_experts = 1 (Mixtral has no shared experts)"),
              std::string::npos)
        << e.what();
  }
}

// moe.temperature_control: each layer's gate is its router weight over that layer's own
// tuned temperature (read from the checkpoint), not over moe.temperature.
TEST_F(HfExport, FoldsEachLayersOwnTemperature) {
  RunConfig config = test::tiny_config();
  config.model.moe.bias_balancing = false;
  config.model.moe.router_bias = false;
  config.model.moe.temperature_control = true;
  config.model.moe.temperature_gain = 0.5;
  config.metrics.alert_imbalance = 0.0;
  config.checkpoint.dir = (dir_ / "tuned").string();
  config.training.stop_at = 3;
  auto trainer = test::make_trainer(config);
  std::ostringstream log;
  trainer->run(log);
  const fs::path ckpt_dir = dir_ / "tuned" / "step_00000003";
  const LoadedCheckpoint ckpt = read_checkpoint(ckpt_dir);
  ExportOptions options;
  options.checkpoint = ckpt_dir.string();
  options.output = (dir_ / "hf_tuned").string();
  std::ostringstream out;
  export_checkpoint(options, out);
  const std::string file = (dir_ / "hf_tuned" / "model.safetensors").string();
  const int fd = ::open(file.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0) << file;
  const SafeTensorsHeader header = read_safetensors_header(fd, file);
  std::vector<float> temperatures;
  for (int layer = 0; layer < 2; ++layer) {
    const std::string moe = fmt::format("layers.{}.moe", layer);
    const float t = read_tensor(ckpt, "router_temperature/" + moe)[0];
    EXPECT_NE(t, 1.0f) << "the temperature never moved: the test checks nothing";
    temperatures.push_back(t);
    const std::vector<float> w = read_tensor(ckpt, "param/" + moe + ".router.weight");
    const std::string name = fmt::format("model.layers.{}.block_sparse_moe.gate.weight", layer);
    const auto it = std::find_if(header.tensors.begin(), header.tensors.end(), [&](const auto& x) { return x.name == name; });
    ASSERT_NE(it, header.tensors.end()) << name;
    ASSERT_EQ(it->dtype, "F32");
    std::vector<float> gate(static_cast<size_t>(it->numel()));
    read_exactly(fd, gate.data(), gate.size() * sizeof(float), header.data_start + it->begin, file);
    ASSERT_EQ(gate.size(), w.size());
    for (size_t i = 0; i < w.size(); ++i) EXPECT_EQ(gate[i], static_cast<float>(w[i] / static_cast<double>(t))) << name << " " << i;
  }
  ::close(fd);
  EXPECT_NE(temperatures[0], temperatures[1]);  // per layer, not one value
}

}  // namespace
}  // namespace moe
