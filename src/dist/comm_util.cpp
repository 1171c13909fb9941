#include "dist/comm_util.h"

#include <algorithm>

#include "core/bf16.h"
#include "core/error.h"

namespace moe::dist {

size_t dtype_bytes(DType dtype) {
  switch (dtype) {
    case DType::f32: return 4;
    case DType::f64: return 8;
    case DType::bf16: return 2;
    case DType::i32: return 4;
    case DType::i64: return 8;
    case DType::u8: return 1;
  }
  MOE_THROW("unknown communicator dtype {}", static_cast<int>(dtype));
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::bf16: return "bf16";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::u8: return "u8";
  }
  return "?";
}

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::max: return "max";
    case ReduceOp::min: return "min";
  }
  return "?";
}

int64_t checked_count_sum(const std::vector<int64_t>& counts, int peers, const char* what) {
  MOE_CHECK(static_cast<int>(counts.size()) == peers, "{} has {} entries for a group of {} ranks", what,
            counts.size(), peers);
  int64_t total = 0;
  for (size_t p = 0; p < counts.size(); ++p) {
    MOE_CHECK(counts[p] >= 0, "{}[{}] = {} is negative", what, p, counts[p]);
    total += counts[p];
  }
  return total;
}

std::vector<int64_t> block_offsets(const std::vector<int64_t>& counts) {
  std::vector<int64_t> offsets(counts.size(), 0);
  for (size_t p = 1; p < counts.size(); ++p) offsets[p] = offsets[p - 1] + counts[p - 1];
  return offsets;
}

namespace {

template <typename T>
void reduce_typed(T* inout, const T* in, size_t count, ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      for (size_t i = 0; i < count; ++i) inout[i] = static_cast<T>(inout[i] + in[i]);
      return;
    case ReduceOp::max:
      for (size_t i = 0; i < count; ++i) inout[i] = std::max(inout[i], in[i]);
      return;
    case ReduceOp::min:
      for (size_t i = 0; i < count; ++i) inout[i] = std::min(inout[i], in[i]);
      return;
  }
}

void reduce_bf16(bf16* inout, const bf16* in, size_t count, ReduceOp op) {
  for (size_t i = 0; i < count; ++i) {
    const float a = bf16_to_float(inout[i]), b = bf16_to_float(in[i]);
    const float r = op == ReduceOp::sum ? a + b : op == ReduceOp::max ? std::max(a, b) : std::min(a, b);
    inout[i] = float_to_bf16(r);
  }
}

}  // namespace

void reduce_into(void* inout, const void* in, size_t count, DType dtype, ReduceOp op) {
  switch (dtype) {
    case DType::f32: return reduce_typed(static_cast<float*>(inout), static_cast<const float*>(in), count, op);
    case DType::f64: return reduce_typed(static_cast<double*>(inout), static_cast<const double*>(in), count, op);
    case DType::i32:
      return reduce_typed(static_cast<int32_t*>(inout), static_cast<const int32_t*>(in), count, op);
    case DType::i64:
      return reduce_typed(static_cast<int64_t*>(inout), static_cast<const int64_t*>(in), count, op);
    case DType::u8: return reduce_typed(static_cast<uint8_t*>(inout), static_cast<const uint8_t*>(in), count, op);
    case DType::bf16: return reduce_bf16(static_cast<bf16*>(inout), static_cast<const bf16*>(in), count, op);
  }
}

void all_gather_host(Communicator& comm, const void* send, void* recv, size_t send_count, DType dtype) {
  if (!comm.device_memory()) {
    comm.all_gather(send, recv, send_count, dtype);
    return;
  }
  const size_t send_bytes = send_count * dtype_bytes(dtype);
  std::shared_ptr<void> staged = comm.allocate(send_bytes * static_cast<size_t>(comm.size() + 1));
  char* staged_recv = static_cast<char*>(staged.get()) + send_bytes;
  comm.copy(staged.get(), send, send_bytes);
  comm.all_gather(staged.get(), staged_recv, send_count, dtype);
  comm.copy(recv, staged_recv, send_bytes * static_cast<size_t>(comm.size()));
  comm.synchronize();
}

void all_reduce_host(Communicator& comm, void* data, size_t count, DType dtype, ReduceOp op) {
  if (!comm.device_memory()) {
    comm.all_reduce(data, count, dtype, op);
    return;
  }
  const size_t bytes = count * dtype_bytes(dtype);
  std::shared_ptr<void> staged = comm.allocate(bytes);
  comm.copy(staged.get(), data, bytes);
  comm.all_reduce(staged.get(), count, dtype, op);
  comm.copy(data, staged.get(), bytes);
  comm.synchronize();
}

}  // namespace moe::dist
