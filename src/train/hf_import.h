// `moe train --init-from-hf DIR`: continued pretraining from a Hugging Face Mixtral folder
// (config.json and model.safetensors, or shards with model.safetensors.index.json), the
// inverse of `moe export` (train/export.h): the same tensor mapping read the other way,
// the gate multiplied by moe.temperature, a router bias (moe.router_bias) started at zero.
// The run's config must have the folder's shape; what Mixtral has and our config cannot
// express, or the other way round, is refused with one line naming both values. F32, BF16
// and F16 tensors are read (converted to fp32), in the legacy per-expert layout
// (block_sparse_moe.experts.E.w{1,2,3}) that the published checkpoints use.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "config/model_config.h"

namespace moe {

// The folder holds a Mixtral config.json (checked before the run loads its data).
void check_hf_model_folder(const std::string& dir);

class HfWeights {
 public:
  // Checks config.json against `model` and opens every safetensors file (headers only).
  // Throws ConfigError naming the folder and what does not match or is missing.
  HfWeights(const std::string& dir, const ModelConfig& model);
  ~HfWeights();
  HfWeights(const HfWeights&) = delete;
  HfWeights& operator=(const HfWeights&) = delete;

  // Elements [begin, begin + count) of our parameter `name` (Transformer's names and
  // layouts, e.g. "layers.0.moe.experts.w1" [E, F, D]) into out[0..count).
  void read(const std::string& name, int64_t begin, int64_t count, float* out) const;

 private:
  struct File;
  struct Located {
    const File* file;
    size_t tensor;  // in file->header.tensors
  };
  // HF tensor `hf_name`, elements [begin, begin + count), as fp32.
  void read_hf(const std::string& hf_name, int64_t begin, int64_t count, float* out) const;
  const Located& locate(const std::string& hf_name) const;

  std::string dir_;
  ModelConfig model_;
  std::vector<std::unique_ptr<File>> files_;
  std::map<std::string, Located> tensors_;
};

}  // namespace moe
