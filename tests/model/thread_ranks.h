// Ranks simulated by threads for the MoE layer's distributed interfaces: MoEBatchGroup
// (sums and gathers over the data-parallel ranks) and ExpertExchange (all-to-alls over
// the EP group). Everything meets at one barrier; sums are added in rank order. The
// exchange can record what each rank received, for tests that check the messages.
#pragma once
#include <barrier>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/arena.h"
#include "model/parameters.h"

#include "core/error.h"
#include "model/moe_layer.h"
#include "moe/token_exchange.h"

namespace moe::test {

class ThreadRanks {
 public:
  explicit ThreadRanks(int ranks) : ranks_(ranks), sync_(ranks), doubles_(ranks), ints_(ranks), mail_(ranks) {
    for (auto& row : mail_) row.resize(static_cast<size_t>(ranks));
  }
  int size() const { return ranks_; }

  class Batch final : public MoEBatchGroup {
   public:
    Batch(ThreadRanks& ranks, int rank) : ranks_(ranks), rank_(rank) {}
    int size() const override { return ranks_.ranks_; }
    int rank() const override { return rank_; }
    void sum(double* values, int64_t count) override {
      ranks_.doubles_[rank_].assign(values, values + count);
      ranks_.sync_.arrive_and_wait();
      std::vector<double> total(static_cast<size_t>(count), 0.0);
      for (const auto& part : ranks_.doubles_)
        for (int64_t i = 0; i < count; ++i) total[i] += part[i];
      ranks_.sync_.arrive_and_wait();
      std::copy(total.begin(), total.end(), values);
    }
    void all_gather(const int64_t* values, int64_t count, int64_t* all) override {
      ranks_.ints_[rank_].assign(values, values + count);
      ranks_.sync_.arrive_and_wait();
      for (int r = 0; r < ranks_.ranks_; ++r) std::copy(ranks_.ints_[r].begin(), ranks_.ints_[r].end(), all + r * count);
      ranks_.sync_.arrive_and_wait();
    }

   private:
    ThreadRanks& ranks_;
    int rank_;
  };

  // One received message, whole (a round trip: what arrived, and the results sent back).
  struct Received {
    std::string what;  // "gather", "exchange", "rows", "results"
    std::vector<char> bytes;
  };

  class Exchange final : public ExpertExchange {
   public:
    Exchange(ThreadRanks& ranks, int rank, int chunks) : ranks_(ranks), rank_(rank), chunks_(chunks) {}
    int size() const override { return ranks_.ranks_; }
    int rank() const override { return rank_; }
    int chunks() const override { return chunks_; }
    void all_gather(const int32_t* values, int64_t count, int32_t* all) override {
      const auto* bytes = reinterpret_cast<const char*>(values);
      std::vector<std::vector<char>> out(static_cast<size_t>(size()), std::vector<char>(bytes, bytes + count * 4));
      const auto in = ranks_.all_to_all(rank_, out);
      for (int p = 0; p < size(); ++p) std::memcpy(all + p * count, in[static_cast<size_t>(p)].data(), static_cast<size_t>(count) * 4);
      record("gather", all, size() * count * 4);
    }
    void exchange(const void* send, const std::vector<int64_t>& send_bytes_P, void* recv,
                  const std::vector<int64_t>& recv_bytes_P) override {
      std::vector<std::vector<char>> out;
      const auto* from = static_cast<const char*>(send);
      for (int64_t n : send_bytes_P) {
        out.emplace_back(from, from + n);
        from += n;
      }
      const auto in = ranks_.all_to_all(rank_, out);
      auto* to = static_cast<char*>(recv);
      int64_t total = 0;
      for (int p = 0; p < size(); ++p) {
        MOE_CHECK(static_cast<int64_t>(in[static_cast<size_t>(p)].size()) == recv_bytes_P[static_cast<size_t>(p)],
                  "thread exchange: {} bytes from rank {}, {} expected", in[static_cast<size_t>(p)].size(), p,
                  recv_bytes_P[static_cast<size_t>(p)]);
        if (!in[static_cast<size_t>(p)].empty())
          std::memcpy(to + total, in[static_cast<size_t>(p)].data(), in[static_cast<size_t>(p)].size());
        total += recv_bytes_P[static_cast<size_t>(p)];
      }
      record("exchange", recv, total);
    }
    void round_trip(const void* send, const std::vector<int64_t>& send_rows_P, void* recv,
                    const std::vector<int64_t>& recv_rows_P, const void* result, void* back, size_t row_bytes,
                    const std::function<void(int chunk)>& compute) override {
      const auto bytes = static_cast<int64_t>(row_bytes);
      const std::vector<int64_t> send_start = starts(send_rows_P), recv_start = starts(recv_rows_P);
      for (int c = 0; c < chunks_; ++c) {
        std::vector<std::vector<char>> out;
        for (int p = 0; p < size(); ++p) {
          const auto [lo, hi] = chunk_of_block(send_rows_P[static_cast<size_t>(p)], c, chunks_);
          const char* from = static_cast<const char*>(send) + (send_start[static_cast<size_t>(p)] + lo) * bytes;
          out.emplace_back(from, from + (hi - lo) * bytes);
        }
        const auto in = ranks_.all_to_all(rank_, out);
        for (int p = 0; p < size(); ++p) {
          const auto [lo, hi] = chunk_of_block(recv_rows_P[static_cast<size_t>(p)], c, chunks_);
          MOE_CHECK(static_cast<int64_t>(in[static_cast<size_t>(p)].size()) == (hi - lo) * bytes, "thread round trip: sizes");
          if (!in[static_cast<size_t>(p)].empty())
            std::memcpy(static_cast<char*>(recv) + (recv_start[static_cast<size_t>(p)] + lo) * bytes,
                        in[static_cast<size_t>(p)].data(), in[static_cast<size_t>(p)].size());
        }
        compute(c);
        out.clear();
        for (int p = 0; p < size(); ++p) {
          const auto [lo, hi] = chunk_of_block(recv_rows_P[static_cast<size_t>(p)], c, chunks_);
          const char* from = static_cast<const char*>(result) + (recv_start[static_cast<size_t>(p)] + lo) * bytes;
          out.emplace_back(from, from + (hi - lo) * bytes);
        }
        const auto home = ranks_.all_to_all(rank_, out);
        for (int p = 0; p < size(); ++p) {
          const auto [lo, hi] = chunk_of_block(send_rows_P[static_cast<size_t>(p)], c, chunks_);
          MOE_CHECK(static_cast<int64_t>(home[static_cast<size_t>(p)].size()) == (hi - lo) * bytes, "thread round trip: sizes");
          if (!home[static_cast<size_t>(p)].empty())
            std::memcpy(static_cast<char*>(back) + (send_start[static_cast<size_t>(p)] + lo) * bytes,
                        home[static_cast<size_t>(p)].data(), home[static_cast<size_t>(p)].size());
        }
      }
      record("rows", recv, recv_start.back() * bytes);
      record("results", result, recv_start.back() * bytes);
    }
    // What this rank received, call by call, while recording.
    std::vector<Received> received;
    bool recording = false;

   private:
    static std::vector<int64_t> starts(const std::vector<int64_t>& rows_P) {
      std::vector<int64_t> start(rows_P.size() + 1, 0);
      for (size_t p = 0; p < rows_P.size(); ++p) start[p + 1] = start[p] + rows_P[p];
      return start;
    }
    void record(const char* what, const void* data, int64_t bytes) {
      if (!recording) return;
      const auto* from = static_cast<const char*>(data);
      received.push_back({what, std::vector<char>(from, from + bytes)});
    }
    ThreadRanks& ranks_;
    int rank_;
    int chunks_;
  };

 private:
  // in[p] = what rank p put in out[me].
  std::vector<std::vector<char>> all_to_all(int me, const std::vector<std::vector<char>>& out) {
    for (int p = 0; p < ranks_; ++p) mail_[static_cast<size_t>(me)][static_cast<size_t>(p)] = out[static_cast<size_t>(p)];
    sync_.arrive_and_wait();
    std::vector<std::vector<char>> in;
    for (int p = 0; p < ranks_; ++p) in.push_back(mail_[static_cast<size_t>(p)][static_cast<size_t>(me)]);
    sync_.arrive_and_wait();
    return in;
  }

  int ranks_;
  std::barrier<> sync_;
  std::vector<std::vector<double>> doubles_;
  std::vector<std::vector<int64_t>> ints_;
  std::vector<std::vector<std::vector<char>>> mail_;  // [from][to]
};

// One MoE layer ("layers.0.moe") with its parameters and arenas planned for `tokens` rows,
// over a batch group and expert exchange (null: one rank) and slots (null: equal blocks).
template <typename T>
struct MoELayerRig {
  ParameterStore<T> params;
  std::unique_ptr<MoELayer<T>> layer;
  std::optional<Arena> saved, scratch;
  MoELayerRig(const ModelConfig& config, int64_t tokens, MoEBatchGroup* batch, ExpertExchange* exchange = nullptr,
              const ExpertSlots* slots = nullptr, int hot_expert = -1) {
    layer = std::make_unique<MoELayer<T>>(params, config, "layers.0.moe");
    params.allocate(11);
    // A hot expert: most tokens choose it first (not all, so its rows vary by micro-batch).
    if (hot_expert >= 0) params.value(params.find("layers.0.moe.router.bias"))[hot_expert] = T(0.1);
    layer->set_parallel(batch, exchange, slots);
    Arena measure_saved = Arena::measuring("saved"), measure_scratch = Arena::measuring("scratch");
    layer->plan(measure_saved, measure_scratch, tokens);
    saved.emplace("saved", measure_saved.high_water());
    scratch.emplace("scratch", measure_scratch.high_water());
    layer->plan(*saved, *scratch, tokens);
  }
};

// What one rank's forward and backward gave.
template <typename T>
struct RankPass {
  MoEForwardStats stats;
  std::vector<T> y, dx;
};

// Each rank's layer forward and backward on its own thread, on its rows of the global x
// and dy ([rows, D]): its local token t is global row global_row(r, t), T_local of them.
template <typename T>
std::vector<RankPass<T>> forward_backward_on_ranks(std::vector<std::unique_ptr<MoELayerRig<T>>>& rigs,
                                                   const std::vector<T>& x, const std::vector<T>& dy,
                                                   int64_t T_local, int64_t D,
                                                   const std::function<int64_t(int, int64_t)>& global_row) {
  std::vector<RankPass<T>> passes(rigs.size());
  std::vector<std::thread> threads;
  for (int r = 0; r < static_cast<int>(rigs.size()); ++r)
    threads.emplace_back([&, r] {
      std::vector<T> x_local(static_cast<size_t>(T_local * D)), dy_local(static_cast<size_t>(T_local * D));
      for (int64_t t = 0; t < T_local; ++t)
        for (int64_t d = 0; d < D; ++d) {
          x_local[static_cast<size_t>(t * D + d)] = x[static_cast<size_t>(global_row(r, t) * D + d)];
          dy_local[static_cast<size_t>(t * D + d)] = dy[static_cast<size_t>(global_row(r, t) * D + d)];
        }
      RankPass<T>& pass = passes[static_cast<size_t>(r)];
      pass.y.resize(x_local.size());
      pass.dx.resize(x_local.size());
      pass.stats = rigs[static_cast<size_t>(r)]->layer->forward(pass.y.data(), x_local.data());
      rigs[static_cast<size_t>(r)]->layer->backward(pass.dx.data(), dy_local.data(), x_local.data(), 1.0);
    });
  for (auto& t : threads) t.join();
  return passes;
}

}  // namespace moe::test
