// Every collective of the world's backend (mpi under mpirun, tcp under `moe launch`)
// against a serial reference that each rank computes on its own. Values are small
// integers, exact in every dtype, so the results must match bit for bit whatever the
// reduction order.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

#include "comm_mpi_world.h"
#include "core/bf16.h"
#include "core/error.h"
#include "dist/comm_util.h"
#include "dist/mpi_communicator.h"

namespace moe::dist {
namespace {

using testing::world;

// The value rank r contributes at element i: small integers, some negative.
double contribution(int rank, size_t i) { return static_cast<double>((rank * 7 + static_cast<int>(i) * 3) % 11 - 4); }

// Host buffer of count elements of dtype from doubles.
std::vector<char> make_buffer(DType dtype, const std::vector<double>& values) {
  std::vector<char> bytes(values.size() * dtype_bytes(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    const double v = values[i];
    char* at = bytes.data() + i * dtype_bytes(dtype);
    switch (dtype) {
      case DType::f32: { float x = static_cast<float>(v); std::memcpy(at, &x, 4); break; }
      case DType::f64: std::memcpy(at, &v, 8); break;
      case DType::bf16: { bf16 x = float_to_bf16(static_cast<float>(v)); std::memcpy(at, &x, 2); break; }
      case DType::i32: { int32_t x = static_cast<int32_t>(v); std::memcpy(at, &x, 4); break; }
      case DType::i64: { int64_t x = static_cast<int64_t>(v); std::memcpy(at, &x, 8); break; }
      case DType::u8: { uint8_t x = static_cast<uint8_t>(v); std::memcpy(at, &x, 1); break; }
    }
  }
  return bytes;
}

const DType kAllTypes[] = {DType::f32, DType::f64, DType::bf16, DType::i32, DType::i64, DType::u8};

// u8 cannot hold negatives: shift the values up.
double shift_for(DType dtype) { return dtype == DType::u8 ? 10 : 0; }

std::vector<double> rank_values(int rank, size_t count, DType dtype) {
  std::vector<double> values(count);
  for (size_t i = 0; i < count; ++i) values[i] = contribution(rank, i) + shift_for(dtype);
  return values;
}

std::vector<double> reduced_reference(int ranks, size_t count, DType dtype, ReduceOp op) {
  std::vector<double> result = rank_values(0, count, dtype);
  for (int r = 1; r < ranks; ++r) {
    const std::vector<double> other = rank_values(r, count, dtype);
    for (size_t i = 0; i < count; ++i)
      result[i] = op == ReduceOp::sum ? result[i] + other[i]
                  : op == ReduceOp::max ? std::max(result[i], other[i])
                                        : std::min(result[i], other[i]);
  }
  return result;
}

TEST(Collectives, AllReduceEveryTypeAndOp) {
  Communicator& comm = world();
  for (DType dtype : kAllTypes)
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::max, ReduceOp::min})
      for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{1001}}) {
        std::vector<char> data = make_buffer(dtype, rank_values(comm.rank(), count, dtype));
        comm.all_reduce(data.data(), count, dtype, op);
        EXPECT_EQ(data, make_buffer(dtype, reduced_reference(comm.size(), count, dtype, op)))
            << dtype_name(dtype) << " " << reduce_op_name(op) << " count " << count;
      }
}

TEST(Collectives, ReduceScatter) {
  Communicator& comm = world();
  const int P = comm.size();
  for (DType dtype : {DType::f32, DType::bf16, DType::i64})
    for (size_t block : {size_t{0}, size_t{1}, size_t{13}}) {
      std::vector<char> send = make_buffer(dtype, rank_values(comm.rank(), block * P, dtype));
      std::vector<char> recv(block * dtype_bytes(dtype));
      comm.reduce_scatter(send.data(), recv.data(), block, dtype, ReduceOp::sum);
      const std::vector<double> full = reduced_reference(P, block * P, dtype, ReduceOp::sum);
      const std::vector<double> mine(full.begin() + comm.rank() * block, full.begin() + (comm.rank() + 1) * block);
      EXPECT_EQ(recv, make_buffer(dtype, mine)) << dtype_name(dtype) << " block " << block;
    }
}

// In place, as ZeRO-1 reduces its buckets (NCCL's convention): recv is this rank's block
// of send.
TEST(Collectives, ReduceScatterInPlace) {
  Communicator& comm = world();
  const int P = comm.size();
  for (DType dtype : {DType::f32, DType::bf16})
    for (size_t block : {size_t{0}, size_t{1}, size_t{13}}) {
      std::vector<char> data = make_buffer(dtype, rank_values(comm.rank(), block * P, dtype));
      char* mine = data.data() + comm.rank() * block * dtype_bytes(dtype);
      comm.reduce_scatter(data.data(), mine, block, dtype, ReduceOp::sum);
      const std::vector<double> full = reduced_reference(P, block * P, dtype, ReduceOp::sum);
      const std::vector<double> sums(full.begin() + comm.rank() * block, full.begin() + (comm.rank() + 1) * block);
      EXPECT_EQ(std::vector<char>(mine, mine + block * dtype_bytes(dtype)), make_buffer(dtype, sums))
          << dtype_name(dtype) << " block " << block;
    }
}

TEST(Collectives, AllGatherIncludingInPlace) {
  Communicator& comm = world();
  const int P = comm.size();
  for (size_t block : {size_t{0}, size_t{5}}) {
    std::vector<double> expected;
    for (int r = 0; r < P; ++r)
      for (size_t i = 0; i < block; ++i) expected.push_back(contribution(r, i));
    std::vector<char> send = make_buffer(DType::f32, rank_values(comm.rank(), block, DType::f32));
    std::vector<char> recv(block * P * 4, 0);
    comm.all_gather(send.data(), recv.data(), block, DType::f32);
    EXPECT_EQ(recv, make_buffer(DType::f32, expected));
    // In place: this rank's block already sits in recv.
    std::vector<char> in_place(block * P * 4, 0);
    if (block > 0) std::memcpy(in_place.data() + comm.rank() * block * 4, send.data(), block * 4);
    comm.all_gather(in_place.data() + comm.rank() * block * 4, in_place.data(), block, DType::f32);
    EXPECT_EQ(in_place, make_buffer(DType::f32, expected));
  }
}

// Elements rank src sends rank dst: ragged, with zeros (including whole zero rows).
int64_t a2a_count(int src, int dst, int salt) { return (src * 3 + dst * 5 + salt) % 4 == 0 ? 0 : (src + 2 * dst + salt) % 5; }
double a2a_value(int src, int dst, int64_t i) { return src * 1000 + dst * 100 + static_cast<double>(i); }

void check_all_to_all_v(Communicator& comm, int salt) {
  const int P = comm.size(), me = comm.rank();
  std::vector<int64_t> send_counts(P), recv_counts(P);
  std::vector<double> send_values, expected;
  for (int p = 0; p < P; ++p) {
    send_counts[p] = a2a_count(me, p, salt);
    recv_counts[p] = a2a_count(p, me, salt);
    for (int64_t i = 0; i < send_counts[p]; ++i) send_values.push_back(a2a_value(me, p, i));
    for (int64_t i = 0; i < recv_counts[p]; ++i) expected.push_back(a2a_value(p, me, i));
  }
  const std::vector<char> send = make_buffer(DType::f32, send_values);
  std::vector<char> recv(expected.size() * 4, 0x7f);
  comm.all_to_all_v(send.data(), send_counts, recv.data(), recv_counts, DType::f32);
  EXPECT_EQ(recv, make_buffer(DType::f32, expected)) << "salt " << salt << " on rank " << me;
}

TEST(Collectives, AllToAllVRaggedAndZeroCounts) {
  for (int salt = 0; salt < 6; ++salt) check_all_to_all_v(world(), salt);
}

// Nothing to send anywhere (null buffers included): it completes on every rank, writes
// nothing, and the ranks stay in step (the next collective pairs with the next one, as
// a rank that skipped or half-issued the exchange would not).
TEST(Collectives, AllToAllVAllZero) {
  Communicator& comm = world();
  const int P = comm.size();
  std::vector<int64_t> zeros(P, 0);
  EXPECT_NO_THROW(comm.all_to_all_v(nullptr, zeros, nullptr, zeros, DType::f64));
  const std::vector<double> send(4, 1.0);
  std::vector<double> recv(4, -7.0);
  EXPECT_NO_THROW(comm.all_to_all_v(send.data(), zeros, recv.data(), zeros, DType::f64));
  EXPECT_EQ(recv, std::vector<double>(4, -7.0));
  int64_t rank_sum = comm.rank() + 1;
  comm.all_reduce(&rank_sum, 1, DType::i64, ReduceOp::sum);
  EXPECT_EQ(rank_sum, static_cast<int64_t>(P) * (P + 1) / 2);
  // Then a non-empty exchange still pairs up: rank r sends r to rank r + 1 only.
  std::vector<int64_t> send_counts(P, 0), recv_counts(P, 0);
  send_counts[(comm.rank() + 1) % P] = 1;
  recv_counts[(comm.rank() + P - 1) % P] = 1;
  const double mine = comm.rank();
  double got = -1;
  comm.all_to_all_v(&mine, send_counts, &got, recv_counts, DType::f64);
  EXPECT_EQ(got, static_cast<double>((comm.rank() + P - 1) % P));
}

TEST(Collectives, AllToAllVWrongNumberOfCountsIsAnError) {
  Communicator& comm = world();
  // Checked before anything is sent, so every rank throws and the world stays usable.
  std::vector<int64_t> wrong_size(comm.size() + 1, 0);
  EXPECT_THROW(comm.all_to_all_v(nullptr, wrong_size, nullptr, wrong_size, DType::f32), Error);
  std::vector<int64_t> negative(comm.size(), 0);
  negative[0] = -1;
  EXPECT_THROW(comm.all_to_all_v(nullptr, negative, nullptr, negative, DType::f32), Error);
}

TEST(Collectives, BroadcastFromEveryRoot) {
  Communicator& comm = world();
  for (int root = 0; root < comm.size(); ++root) {
    std::vector<char> data = make_buffer(DType::i32, rank_values(comm.rank(), 17, DType::i32));
    comm.broadcast(data.data(), 17, DType::i32, root);
    EXPECT_EQ(data, make_buffer(DType::i32, rank_values(root, 17, DType::i32))) << "root " << root;
  }
}

TEST(Collectives, AsyncOperationsCompleteInAnyWaitOrder) {
  Communicator& comm = world();
  std::vector<char> a = make_buffer(DType::f32, rank_values(comm.rank(), 300, DType::f32));
  std::vector<char> b = make_buffer(DType::f64, rank_values(comm.rank(), 50, DType::f64));
  auto first = comm.all_reduce_async(a.data(), 300, DType::f32, ReduceOp::sum);
  auto second = comm.all_reduce_async(b.data(), 50, DType::f64, ReduceOp::max);
  second->wait();
  first->wait();
  EXPECT_TRUE(first->done());
  EXPECT_TRUE(second->done());
  EXPECT_EQ(a, make_buffer(DType::f32, reduced_reference(comm.size(), 300, DType::f32, ReduceOp::sum)));
  EXPECT_EQ(b, make_buffer(DType::f64, reduced_reference(comm.size(), 50, DType::f64, ReduceOp::max)));
  comm.barrier();
}

TEST(Collectives, SplitGroupsRunTheirOwnCollectives) {
  Communicator& comm = world();
  const int me = comm.rank(), P = comm.size();
  // Even and odd ranks, ordered backwards by key.
  std::unique_ptr<Communicator> half = comm.split(me % 2, P - me);
  ASSERT_NE(half, nullptr);
  std::vector<int> members;
  for (int r = P - 1; r >= 0; --r)
    if (r % 2 == me % 2) members.push_back(r);
  ASSERT_EQ(half->size(), static_cast<int>(members.size()));
  EXPECT_EQ(members[half->rank()], me);
  int32_t world_rank = me;
  std::vector<int32_t> gathered(members.size());
  half->all_gather(&world_rank, gathered.data(), 1, DType::i32);
  EXPECT_EQ(gathered, std::vector<int32_t>(members.begin(), members.end()));
  int64_t sum = me;
  half->all_reduce(&sum, 1, DType::i64);
  EXPECT_EQ(sum, std::accumulate(members.begin(), members.end(), int64_t{0}));
  check_all_to_all_v(*half, 3);
  // A negative color leaves a rank out.
  std::unique_ptr<Communicator> only_zero = comm.split(me == 0 ? 0 : -1, 0);
  EXPECT_EQ(only_zero != nullptr, me == 0);
  if (only_zero) EXPECT_EQ(only_zero->size(), 1);
}

TEST(Collectives, MpiSplitsLargeMessages) {
  Communicator& comm = world();
  if (comm.backend() != "mpi") GTEST_SKIP() << "MPI only";
  // Pretend MPI counts hold 3 elements: all-reduce, broadcast and all-to-all must split.
  set_mpi_max_message_elements(3);
  std::vector<char> data = make_buffer(DType::f32, rank_values(comm.rank(), 20, DType::f32));
  comm.all_reduce(data.data(), 20, DType::f32, ReduceOp::sum);
  EXPECT_EQ(data, make_buffer(DType::f32, reduced_reference(comm.size(), 20, DType::f32, ReduceOp::sum)));
  std::vector<char> root_data = make_buffer(DType::f32, rank_values(comm.rank(), 10, DType::f32));
  comm.broadcast(root_data.data(), 10, DType::f32, 1 % comm.size());
  EXPECT_EQ(root_data, make_buffer(DType::f32, rank_values(1 % comm.size(), 10, DType::f32)));
  for (int salt = 0; salt < 3; ++salt) check_all_to_all_v(comm, salt);
  std::vector<char> block(4 * 4 * comm.size()), out(16);
  EXPECT_THROW(comm.reduce_scatter(block.data(), out.data(), 4, DType::f32), Error);
  set_mpi_max_message_elements(0);
  comm.barrier();
}

}  // namespace
}  // namespace moe::dist
