// The NCCL backend with a world of one GPU (label gpu): every collective on device
// buffers against the host reference, the stream ordering of Work::wait, and splits.
// Multi-GPU runs: `moe launch --nproc-per-node N` with backend nccl (issue of its own).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <vector>

#include "core/gpu.h"
#include "dist/communicator.h"

namespace moe::dist {
namespace {

class NcclWorldOfOne : public ::testing::Test {
 protected:
  void SetUp() override {
    if (gpu::device_count() == 0) GTEST_SKIP() << "no GPU";
    comm_ = make_world_communicator(CommBackend::Nccl);
  }
  std::unique_ptr<Communicator> comm_;
};

TEST_F(NcclWorldOfOne, CollectivesOnDeviceBuffers) {
  ASSERT_EQ(comm_->backend(), "nccl");
  ASSERT_EQ(comm_->size(), 1);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  comm_->set_stream(stream);
  const std::vector<float> host = {1.5f, -2.0f, 3.25f, 4.0f, 0.0f, 7.0f};
  gpu::DeviceArray<float> data(host.size()), out(host.size());
  data.upload(host.data(), host.size());
  std::vector<float> back(host.size());

  comm_->all_reduce(data.data(), host.size(), DType::f32, ReduceOp::max);
  comm_->reduce_scatter(data.data(), out.data(), host.size(), DType::f32);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  out.download(back.data(), back.size());
  EXPECT_EQ(back, host);

  out.fill_bytes(0);
  comm_->all_gather(data.data(), out.data(), host.size(), DType::f32);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  out.download(back.data(), back.size());
  EXPECT_EQ(back, host);

  out.fill_bytes(0);
  // all-to-all-v with one peer: 4 elements to itself; the rest of out stays zero.
  auto work = comm_->all_to_all_v_async(data.data(), {4}, out.data(), {4}, DType::f32);
  work->wait();  // orders `stream` after the exchange
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_TRUE(work->done());
  out.download(back.data(), back.size());
  EXPECT_EQ(back, (std::vector<float>{1.5f, -2.0f, 3.25f, 4.0f, 0.0f, 0.0f}));

  comm_->broadcast(data.data(), host.size(), DType::f32, 0);
  comm_->barrier();
  auto half = comm_->split(0, 0);
  ASSERT_NE(half, nullptr);
  EXPECT_EQ(half->size(), 1);
  half->set_stream(stream);
  half->all_reduce(data.data(), host.size(), DType::f32);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  data.download(back.data(), back.size());
  EXPECT_EQ(back, host);
  half.reset();
  comm_.reset();
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace moe::dist
