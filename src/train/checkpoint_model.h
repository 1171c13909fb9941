// A checkpoint's model for inference (`moe generate`): its run's config (config.toml), the
// parameters and balancing biases from any layout, no optimizer state; and the decoder
// that runs it on the device asked for.
#pragma once
#include <cstdint>
#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

#include "config/run_config.h"
#include "model/decoder.h"
#include "model/transformer.h"

namespace moe {

struct CheckpointModel {
  RunConfig config;  // the run's, model.vocab_size resolved
  int64_t step = 0;
  std::unique_ptr<Transformer<float>> model;
  std::string tokenizer_json;  // the run's tokenizer as the checkpoint keeps it; "": none kept
};

// `overrides` ("section.key=value") apply to the run's config, as `moe eval` takes them
// (another data.dir to find the tokenizer's corpus, say); one that changes the model's
// shape is refused, other differences from the checkpoint warn on `warnings`. Throws
// ConfigError for a path that is not a checkpoint directory, moe::Error (one line naming
// the file) for a damaged one.
CheckpointModel load_checkpoint_model(const std::string& path, const std::vector<std::string>& overrides,
                                      std::ostream& warnings);

// "cpu", "gpu" or "auto" (the GPU when the build has CUDA and a GPU is visible: GpuDecoder,
// model/cuda/gpu_decoder.h). A GPU asked for without one is a ConfigError.
std::unique_ptr<Decoder> make_decoder(const Transformer<float>& model, const std::string& device);

}  // namespace moe
