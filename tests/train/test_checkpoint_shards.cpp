// Sharded checkpoints in one process: the manifest's coverage rule, the even split of
// replicated slices, four "ranks" writing their shards and rank 0 the manifest, reading
// back in another layout, and the refusals (missing or foreign shard, shape mismatch, a
// rank that never reports, overlapping pieces).
#include <gtest/gtest.h>

#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <thread>

#include "core/atomic_file.h"
#include "test_resume_fixtures.h"
#include "train/checkpoint.h"
#include "train/checkpoint_manifest.h"
#include "train/checkpoint_shards.h"
#include "expect_error.h"

namespace moe {
namespace {

namespace fs = std::filesystem;

void expect_error(const std::function<void()>& fn, const std::vector<std::string>& fragments) {
  test::expect_one_line_error<Error>(fn, fragments);
}

std::vector<ManifestShard> two_shards() {
  return {{0, "rank_00000.safetensors", 0, "", ""}, {1, "rank_00001.safetensors", 0, "", ""}};
}

TEST(CheckpointManifest, CoverageIsExactlyOnce) {
  const auto shards = two_shards();
  std::vector<ManifestTensor> ok = {{"t", "F32", {2, 4}, {{1, 4, 4, "h"}, {0, 0, 4, "h"}}}};
  check_tensor_coverage(ok, shards, "m.json");
  EXPECT_EQ(ok[0].pieces[0].begin, 0) << "sorted by begin";
  std::vector<ManifestTensor> overlap = {{"t", "F32", {2, 4}, {{0, 0, 6, "h"}, {1, 4, 4, "h"}}}};
  expect_error([&] { check_tensor_coverage(overlap, shards, "m.json"); },
               {"m.json: tensor 't': elements [4, 6) are stored twice (rank_00000.safetensors and rank_00001.safetensors)"});
  std::vector<ManifestTensor> hole = {{"t", "F32", {2, 4}, {{0, 0, 3, "h"}, {1, 4, 4, "h"}}}};
  expect_error([&] { check_tensor_coverage(hole, shards, "m.json"); }, {"tensor 't': elements [3, 4) are in no shard"});
  std::vector<ManifestTensor> short_end = {{"t", "F32", {2, 4}, {{0, 0, 6, "h"}}}};
  expect_error([&] { check_tensor_coverage(short_end, shards, "m.json"); }, {"elements [6, 8) are in no shard"});
  std::vector<ManifestTensor> past = {{"t", "F32", {2, 4}, {{0, 0, 9, "h"}}}};
  expect_error([&] { check_tensor_coverage(past, shards, "m.json"); }, {"reach element 9, past its 8 elements"});
  std::vector<ManifestTensor> no_shard = {{"t", "F32", {8}, {{2, 0, 8, "h"}}}};
  expect_error([&] { check_tensor_coverage(no_shard, shards, "m.json"); }, {"not one of the 2 shards"});
}

// Every element of a replicated slice is written by exactly one copy: an even split of
// large slices (known answer), small ones whole by one copy.
TEST(CheckpointManifest, ReplicaSharesSplitEvenlyAndCoverOnce) {
  EXPECT_EQ(replica_share("t", 100, 10000, 4, 0), (Range{100, 2500}));
  EXPECT_EQ(replica_share("t", 100, 10000, 4, 3), (Range{7600, 2500}));
  EXPECT_EQ(replica_share("t", 0, 10001, 3, 1), (Range{3333, 3334}));
  EXPECT_EQ(replica_share("t", 5, 7, 1, 0), (Range{5, 7}));
  for (int64_t count : {int64_t{1}, int64_t{100}, kWholePieceElements - 1, kWholePieceElements, int64_t{123457}})
    for (int replicas : {1, 2, 3, 8}) {
      std::vector<int> written(static_cast<size_t>(count), 0);
      int writers = 0;
      for (int r = 0; r < replicas; ++r) {
        const auto [begin, n] = replica_share("layers.0.w", 0, count, replicas, r);
        writers += n > 0;
        for (int64_t i = begin; i < begin + n; ++i) ++written[static_cast<size_t>(i)];
      }
      EXPECT_EQ(std::count(written.begin(), written.end(), 1), count) << count << " over " << replicas;
      if (count < kWholePieceElements) EXPECT_EQ(writers, 1);
      else EXPECT_EQ(writers, replicas);
    }
}

// A 4-rank save made by hand: tensor "a" [8, 700] stored by rows (rank r rows 2r, 2r+1),
// "b" [5000] replicated on every rank (split evenly), "c" [3] replicated (one writer).
class ShardedCheckpoint : public test::TempDirTest {
 protected:
  static constexpr int kRanks = 4;
  std::vector<float> a_ = values(8 * 700, 1.0f), b_ = values(5000, -3.0f), c_ = values(3, 7.0f);

  static std::vector<float> values(int64_t n, float base) {
    std::vector<float> v(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = base + 0.001f * static_cast<float>(i);
    return v;
  }
  CheckpointSnapshot snapshot(int rank, const std::string& save_id, int64_t step = 5) const {
    SavedState state;
    state.adam_steps = 5;
    state.pieces.push_back({"a", {8, 700}, rank * 1400, 1400, a_.data() + rank * 1400, 1, 0});
    state.pieces.push_back({"b", {5000}, 0, 5000, b_.data(), kRanks, rank});
    state.pieces.push_back({"c", {3}, 0, 3, c_.data(), kRanks, rank});
    test::ResumableTask data(16, 8, 1);
    TrainProgress progress;
    progress.step = step;
    CheckpointSnapshot snap = capture_state(test::tiny_config(), state, data, progress);
    snap.rank = rank;
    snap.world_size = kRanks;
    snap.expert_parallel = 2;
    snap.zero = 1;
    snap.save_id = save_id;
    return snap;
  }
  // Ranks 1..3 in threads (rank 0 waits for their reports), as the ranks of a run would.
  fs::path save(const fs::path& dir, const std::string& save_id, int64_t step = 5) {
    std::vector<std::thread> others;
    for (int r = 1; r < kRanks; ++r) others.emplace_back([&, r] { write_checkpoint(dir, snapshot(r, save_id, step), 3); });
    std::optional<CheckpointWrite> written;
    try {
      written = write_checkpoint(dir, snapshot(0, save_id, step), 3, 60);
    } catch (const Error& e) {
      ADD_FAILURE() << e.what();
    }
    for (auto& t : others) t.join();
    return written ? written->path : fs::path();
  }
};

TEST_F(ShardedCheckpoint, RoundTripsAndReadsInAnotherLayout) {
  const fs::path path = save(dir_ / "ckpt", "00000000000a");
  for (int r = 0; r < kRanks; ++r) EXPECT_TRUE(fs::exists(path / shard_file_name(r))) << r;
  EXPECT_FALSE(fs::exists(path / report_file_name(1))) << "reports are folded into the manifest";
  const LoadedCheckpoint loaded = read_checkpoint(path);
  EXPECT_EQ(loaded.manifest.world_size, 4);
  EXPECT_EQ(loaded.manifest.expert_parallel, 2);
  EXPECT_EQ(loaded.manifest.zero, 1);
  EXPECT_EQ(loaded.manifest.adam_steps, 5);
  ASSERT_NE(loaded.find("b"), nullptr);
  EXPECT_EQ(loaded.find("b")->pieces.size(), 4u) << "split over the 4 copies";
  EXPECT_EQ(loaded.find("c")->pieces.size(), 1u) << "small: one copy writes it";
  EXPECT_EQ(read_tensor(loaded, "a"), a_);
  EXPECT_EQ(read_tensor(loaded, "b"), b_);
  EXPECT_EQ(read_tensor(loaded, "c"), c_);
  // Another layout's slices: across shard boundaries, inside one piece, and two targets
  // overlapping one piece.
  std::vector<float> x(3000), y(10), z(1300), w(1300);
  const SliceReadStats stats = read_slices(loaded, {{"a", {8, 700}, 1000, 3000, x.data()},
                                                    {"a", {8, 700}, 4300, 10, y.data()},
                                                    {"b", {5000}, 1200, 1300, z.data()},
                                                    {"b", {5000}, 1250, 1300, w.data()}});
  EXPECT_TRUE(std::equal(x.begin(), x.end(), a_.begin() + 1000));
  EXPECT_TRUE(std::equal(y.begin(), y.end(), a_.begin() + 4300));
  EXPECT_TRUE(std::equal(z.begin(), z.end(), b_.begin() + 1200));
  EXPECT_TRUE(std::equal(w.begin(), w.end(), b_.begin() + 1250));
  // Each overlapped piece read once: a's four, b's [0, 1250), [1250, 2500), [2500, 3750).
  EXPECT_EQ(stats.bytes, (4 * 1400 + 3 * 1250) * 4);
  // The manifest text parses back to itself.
  const std::string text = read_file_bytes(path / "manifest.json");
  EXPECT_EQ(manifest_to_json(parse_checkpoint_manifest(text, "m")), text);
}

TEST_F(ShardedCheckpoint, MissingForeignAndCorruptShardsAreRefusedNamingTheFile) {
  const fs::path good = save(dir_ / "one", "00000000000a");
  const fs::path other = save(dir_ / "two", "00000000000b");
  auto variant = [&](const std::string& name) {
    const fs::path p = dir_ / name;
    fs::copy(good, p);
    return p;
  };
  const fs::path missing = variant("missing");
  fs::remove(missing / "rank_00002.safetensors");
  expect_error([&] { read_checkpoint(missing); }, {"missing/rank_00002.safetensors", "missing"});
  // Another save's shard of the same step and size.
  const fs::path foreign = variant("foreign");
  fs::copy_file(other / "rank_00001.safetensors", foreign / "rank_00001.safetensors",
                fs::copy_options::overwrite_existing);
  expect_error([&] { read_checkpoint(foreign); }, {"foreign/rank_00001.safetensors", "foreign shard"});
  // A flipped bit in a piece: found when that piece is read.
  const fs::path flipped = variant("flipped");
  std::string bytes = read_file_bytes(flipped / "rank_00003.safetensors");
  bytes[bytes.size() - 5] ^= 0x10;
  std::ofstream(flipped / "rank_00003.safetensors", std::ios::binary | std::ios::trunc) << bytes;
  const LoadedCheckpoint loaded = read_checkpoint(flipped);
  EXPECT_EQ(read_tensor(loaded, "a", 0, 1400), std::vector<float>(a_.begin(), a_.begin() + 1400));
  expect_error([&] { read_tensor(loaded, "b"); }, {"flipped/rank_00003.safetensors", "hash", "corrupted"});
  // A shape mismatch: one line naming the tensor and both shapes.
  std::vector<float> out(700 * 8);
  expect_error([&] { read_slices(read_checkpoint(good), {{"a", {7, 800}, 0, 5600, out.data()}}); },
               {"tensor 'a' has shape [8, 700] in the checkpoint, this run's model [7, 800]"});
  expect_error([&] { read_tensor(read_checkpoint(good), "nope"); }, {"has no tensor 'nope'"});
}

// A rank that dies before reporting (here: never writes) leaves no COMPLETE; rank 0 says
// which shard is missing, and the earlier checkpoint stays the latest.
TEST_F(ShardedCheckpoint, ARankThatNeverReportsLeavesNothingComplete) {
  const fs::path earlier = save(dir_ / "ckpt", "00000000000a", 4);
  for (int r : {1, 3}) write_checkpoint(dir_ / "ckpt", snapshot(r, "00000000000c"), 3);
  expect_error([&] { write_checkpoint(dir_ / "ckpt", snapshot(0, "00000000000c"), 3, 0.2); },
               {"rank 2 did not report its shard rank_00002.safetensors", "not marked complete"});
  EXPECT_FALSE(fs::exists(dir_ / "ckpt" / "step_00000005"));
  EXPECT_EQ(latest_checkpoint(dir_ / "ckpt"), earlier);
  // Two ranks claiming the same rows: refused at the manifest, nothing complete either.
  std::vector<std::thread> others;
  for (int r = 1; r < kRanks; ++r)
    others.emplace_back([&, r] {
      CheckpointSnapshot snap = snapshot(r, "00000000000d");
      if (r == 2) snap.tensors[0].begin = 1400;  // rank 1's rows again
      write_checkpoint(dir_ / "ckpt", snap, 3);
    });
  for (auto& t : others) t.join();
  expect_error([&] { write_checkpoint(dir_ / "ckpt", snapshot(0, "00000000000d"), 3, 60); },
               {"tensor 'a': elements [1400, 2800) are stored twice (rank_00001.safetensors and rank_00002.safetensors)"});
  EXPECT_FALSE(fs::exists(dir_ / "ckpt" / "step_00000005"));
}

// A state with an owner is kept, not copied (an async save then blocks training only for
// the backend's download); without one the snapshot copies the pieces, since they change
// with the next step. A non-finite weight is refused at the write, before any file of the
// save lands, naming the parameter.
TEST_F(ShardedCheckpoint, AnOwnedStateIsKeptAndANonFiniteWeightIsRefused) {
  auto buffers = std::make_shared<std::vector<float>>(values(20, 2.0f));
  std::vector<float> live = values(20, 2.0f);
  test::ResumableTask data(16, 8, 1);
  for (const bool owned : {true, false}) {
    SCOPED_TRACE(owned ? "owned" : "copied");
    SavedState state;
    const float* source = owned ? buffers->data() : live.data();
    state.pieces.push_back({"param/w", {20}, 0, 20, source, 1, 0});
    if (owned) state.owner = buffers;
    CheckpointSnapshot snap = capture_state(test::tiny_config(), state, data, TrainProgress{});
    state = SavedState{};
    ASSERT_EQ(snap.tensors.size(), 1u);
    EXPECT_EQ(snap.tensors[0].data == source, owned);
    EXPECT_EQ(buffers.use_count(), owned ? 2 : 1) << "the snapshot keeps the owner alive";
    live[3] = -1.0f;  // the next step
    EXPECT_EQ(snap.tensors[0].data[3], values(20, 2.0f)[3]);
    live = values(20, 2.0f);
  }
  SavedState bad;
  (*buffers)[7] = std::numeric_limits<float>::quiet_NaN();
  bad.pieces.push_back({"param/layers.0.w", {20}, 0, 20, buffers->data(), 1, 0});
  bad.owner = buffers;
  TrainProgress progress;
  progress.step = 6;
  CheckpointSnapshot snap = capture_state(test::tiny_config(), bad, data, progress);
  snap.save_id = "00000000000e";
  expect_error([&] { write_checkpoint(dir_ / "ckpt", snap, 3); },
               {"parameter 'layers.0.w' is not finite; refusing to checkpoint it"});
  EXPECT_FALSE(fs::exists(dir_ / "ckpt" / "step_00000006"));
  EXPECT_FALSE(latest_checkpoint(dir_ / "ckpt").has_value());
}

}  // namespace
}  // namespace moe
