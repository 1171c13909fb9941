#include "dist/tcp_communicator.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

#include "core/error.h"
#include "dist/comm_util.h"
#include "dist/rendezvous.h"

namespace moe::dist {
namespace {

// Completion state shared by a TcpWork and the task that fills it.
struct WorkState {
  std::mutex mutex;
  std::condition_variable cv;
  bool finished = false;
  std::exception_ptr error;
};

class TcpWork final : public Work {
 public:
  explicit TcpWork(std::shared_ptr<WorkState> state) : state_(std::move(state)) {}
  void wait() override {
    std::unique_lock lock(state_->mutex);
    state_->cv.wait(lock, [&] { return state_->finished; });
    if (state_->error) std::rethrow_exception(state_->error);
  }
  bool done() override {
    std::lock_guard lock(state_->mutex);
    return state_->finished;
  }

 private:
  std::shared_ptr<WorkState> state_;
};

// One peer's part of an exchange: a 16-byte header (the length, and the operation's tag:
// its communicator's id and the operation's number there), then the bytes; the receiver
// checks the header against what it expects, so ranks that issue collectives in different
// orders, or a count mismatch, are an error naming both, not a hang
// or garbage. send_bytes / recv_bytes < 0: no message with this peer.
struct WireHeader {
  int64_t bytes = 0;
  uint64_t tag = 0;  // communicator id << 32 | operation number
};
constexpr int64_t kHeaderBytes = sizeof(WireHeader);
static_assert(kHeaderBytes == 16, "the header is two 8-byte words");

struct PeerTransfer {
  int peer = -1;  // world rank
  const char* send_data = nullptr;
  int64_t send_bytes = -1;
  char* recv_data = nullptr;
  int64_t recv_bytes = -1;
};

// The connections of this process to every other world rank, and the thread that runs
// collectives on them in issue order.
class TcpMesh {
 public:
  TcpMesh(int rank, std::vector<int> fds) : rank_(rank), fds_(std::move(fds)) {
    thread_ = std::thread([this] { run(); });
  }
  ~TcpMesh() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    // An operation still in flight (its Work never waited for, or this rank leaving after
    // an error) may wait for peers that never come: shutting the sockets down ends it, so
    // that a failing rank exits instead of hanging. Bytes already sent still arrive.
    for (int fd : fds_)
      if (fd >= 0) shutdown(fd, SHUT_RDWR);
    thread_.join();
    for (int fd : fds_) net::close_fd(fd);
  }
  int rank() const { return rank_; }

  std::shared_ptr<WorkState> enqueue(std::function<void()> task) {
    auto state = std::make_shared<WorkState>();
    {
      std::lock_guard lock(mutex_);
      queue_.push_back([state, task = std::move(task), this] {
        std::exception_ptr error = broken_;
        if (!error) {
          try {
            task();
          } catch (...) {
            // The stream of bytes with some peer is now out of step: fail everything after.
            error = broken_ = std::current_exception();
          }
        }
        std::lock_guard state_lock(state->mutex);
        state->finished = true;
        state->error = error;
        state->cv.notify_all();
      });
    }
    cv_.notify_all();
    return state;
  }

  // Sends and receives with all listed peers at once (poll), so that large messages in
  // both directions cannot deadlock on full socket buffers. Runs on the mesh thread.
  void exchange(std::vector<PeerTransfer>& transfers, uint64_t tag) {
    struct Progress {
      PeerTransfer* transfer;
      WireHeader send_header, recv_header{};
      int64_t sent = 0, received = 0;  // including the header's bytes
    };
    std::vector<Progress> progress;
    for (PeerTransfer& t : transfers) {
      if (t.peer == rank_) {
        MOE_CHECK(t.send_bytes == t.recv_bytes, "rank {} sends itself {} bytes but expects {}", rank_, t.send_bytes,
                  t.recv_bytes);
        if (t.send_bytes > 0 && t.recv_data != t.send_data) std::memmove(t.recv_data, t.send_data, t.send_bytes);
        continue;
      }
      if (t.send_bytes < 0 && t.recv_bytes < 0) continue;
      progress.push_back({&t, WireHeader{t.send_bytes, tag}});
    }
    auto send_done = [](const Progress& p) {
      return p.transfer->send_bytes < 0 || p.sent == kHeaderBytes + p.send_header.bytes;
    };
    auto recv_done = [](const Progress& p) {
      return p.transfer->recv_bytes < 0 ||
             (p.received >= kHeaderBytes && p.received == kHeaderBytes + p.transfer->recv_bytes);
    };
    std::vector<pollfd> polled;
    while (true) {
      polled.clear();
      std::vector<Progress*> owners;
      for (Progress& p : progress) {
        short events = 0;
        if (!send_done(p)) events |= POLLOUT;
        if (!recv_done(p)) events |= POLLIN;
        if (events) {
          polled.push_back({fds_[p.transfer->peer], events, 0});
          owners.push_back(&p);
        }
      }
      if (polled.empty()) return;
      if (poll(polled.data(), polled.size(), -1) < 0) {
        if (errno == EINTR) continue;
        MOE_THROW("tcp backend: poll(): {}", std::strerror(errno));
      }
      for (size_t i = 0; i < polled.size(); ++i) {
        Progress& p = *owners[i];
        const int peer = p.transfer->peer;
        if ((polled[i].revents & POLLOUT) && !send_done(p)) pump_send(p.transfer, p.send_header, p.sent, peer);
        if ((polled[i].revents & (POLLIN | POLLHUP | POLLERR)) && !recv_done(p))
          pump_recv(p.transfer, p.recv_header, tag, p.received, peer);
        else if ((polled[i].revents & (POLLHUP | POLLERR)) && !send_done(p))
          MOE_THROW("tcp backend: connection to rank {} lost (did it exit?)", peer);
      }
    }
  }

 private:
  void pump_send(PeerTransfer* t, const WireHeader& header, int64_t& sent, int peer) {
    const int64_t H = kHeaderBytes;
    while (sent < H + header.bytes) {
      const char* from = sent < H ? reinterpret_cast<const char*>(&header) + sent : t->send_data + (sent - H);
      const int64_t left = sent < H ? H - sent : H + header.bytes - sent;
      const ssize_t n = send(fds_[peer], from, static_cast<size_t>(left), MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return;
        MOE_THROW("tcp backend: sending to rank {} failed: {} (did it exit?)", peer, std::strerror(errno));
      }
      sent += n;
    }
  }
  void pump_recv(PeerTransfer* t, WireHeader& header, uint64_t tag, int64_t& received, int peer) {
    const int64_t H = kHeaderBytes;
    while (received < H || received < H + header.bytes) {
      char* into = received < H ? reinterpret_cast<char*>(&header) + received : t->recv_data + (received - H);
      const int64_t left = received < H ? H - received : H + header.bytes - received;
      const ssize_t n = recv(fds_[peer], into, static_cast<size_t>(left), MSG_DONTWAIT);
      if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return;
        MOE_THROW("tcp backend: receiving from rank {} failed: {} (did it exit?)", peer, std::strerror(errno));
      }
      if (n == 0) MOE_THROW("tcp backend: rank {} closed its connection (did it exit?)", peer);
      received += n;
      if (received == H) {
        MOE_CHECK(header.tag == tag,
                  "tcp backend: rank {} is at operation {} of communicator {:08x} where rank {} is at operation {} of "
                  "communicator {:08x}: the ranks issued their collectives in different orders",
                  peer, header.tag & 0xffffffffu, header.tag >> 32, rank_, tag & 0xffffffffu, tag >> 32);
        MOE_CHECK(header.bytes == t->recv_bytes, "tcp backend: rank {} sends {} bytes where rank {} expects {}", peer,
                  header.bytes, rank_, t->recv_bytes);
      }
    }
  }

  void run() {
    while (true) {
      std::function<void()> task;
      {
        std::unique_lock lock(mutex_);
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, and everything issued has run
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      task();
    }
  }

  int rank_;
  std::vector<int> fds_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  std::exception_ptr broken_;
  std::thread thread_;
};

class TcpCommunicator final : public Communicator {
 public:
  // members: world ranks of this group in group order.
  // id: the same on every member (the world's 1; a split's from its parent's, the split's
  // number and the color), so an operation's tag names it on every rank.
  TcpCommunicator(std::shared_ptr<TcpMesh> mesh, std::vector<int> members, uint32_t id = 1)
      : mesh_(std::move(mesh)), members_(std::move(members)), id_(id) {
    rank_ = static_cast<int>(std::find(members_.begin(), members_.end(), mesh_->rank()) - members_.begin());
  }
  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(members_.size()); }
  std::string backend() const override { return "tcp"; }

  std::unique_ptr<Work> all_reduce_async(void* data, size_t count, DType dtype, ReduceOp op) override {
    const int P = size();
    return submit([=, tag = next_tag(), members = members_, mesh = mesh_.get(), me = rank_] {
      // Reduce-scatter of P chunks (each rank sums its chunk over the ranks in rank
      // order), then all-gather of the chunks.
      const size_t elem = dtype_bytes(dtype), chunk = (count + P - 1) / P;
      auto chunk_begin = [&](int p) { return std::min(count, chunk * static_cast<size_t>(p)); };
      auto chunk_size = [&](int p) { return chunk_begin(p + 1) - chunk_begin(p); };
      char* bytes = static_cast<char*>(data);
      const size_t mine = chunk_size(me);
      std::vector<char> blocks(mine * elem * P);
      std::vector<PeerTransfer> transfers(P);
      for (int p = 0; p < P; ++p)
        transfers[p] = {members[p], bytes + chunk_begin(p) * elem, static_cast<int64_t>(chunk_size(p) * elem),
                        blocks.data() + p * mine * elem, static_cast<int64_t>(mine * elem)};
      mesh->exchange(transfers, tag);
      reduce_blocks(blocks.data(), P, mine, dtype, op, bytes + chunk_begin(me) * elem);
      for (int p = 0; p < P; ++p)
        transfers[p] = {members[p], bytes + chunk_begin(me) * elem, static_cast<int64_t>(mine * elem),
                        bytes + chunk_begin(p) * elem, static_cast<int64_t>(chunk_size(p) * elem)};
      mesh->exchange(transfers, tag);
    });
  }

  std::unique_ptr<Work> reduce_scatter_async(const void* send, void* recv, size_t recv_count, DType dtype,
                                             ReduceOp op) override {
    const int P = size();
    return submit([=, tag = next_tag(), members = members_, mesh = mesh_.get()] {
      const size_t block = recv_count * dtype_bytes(dtype);
      std::vector<char> blocks(block * P);
      std::vector<PeerTransfer> transfers(P);
      for (int p = 0; p < P; ++p)
        transfers[p] = {members[p], static_cast<const char*>(send) + p * block, static_cast<int64_t>(block),
                        blocks.data() + p * block, static_cast<int64_t>(block)};
      mesh->exchange(transfers, tag);
      reduce_blocks(blocks.data(), P, recv_count, dtype, op, static_cast<char*>(recv));
    });
  }

  std::unique_ptr<Work> all_gather_async(const void* send, void* recv, size_t send_count, DType dtype) override {
    const int P = size();
    return submit([=, tag = next_tag(), members = members_, mesh = mesh_.get()] {
      const size_t block = send_count * dtype_bytes(dtype);
      std::vector<PeerTransfer> transfers(P);
      for (int p = 0; p < P; ++p)
        transfers[p] = {members[p], static_cast<const char*>(send), static_cast<int64_t>(block),
                        static_cast<char*>(recv) + p * block, static_cast<int64_t>(block)};
      mesh->exchange(transfers, tag);
    });
  }

  std::unique_ptr<Work> all_to_all_v_async(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                                           const std::vector<int64_t>& recv_counts, DType dtype) override {
    const int P = size();
    checked_count_sum(send_counts, P, "send_counts");
    checked_count_sum(recv_counts, P, "recv_counts");
    return submit([=, tag = next_tag(), members = members_, mesh = mesh_.get()] {
      const int64_t elem = static_cast<int64_t>(dtype_bytes(dtype));
      const std::vector<int64_t> send_offsets = block_offsets(send_counts), recv_offsets = block_offsets(recv_counts);
      std::vector<PeerTransfer> transfers(P);
      for (int p = 0; p < P; ++p)
        transfers[p] = {members[p], static_cast<const char*>(send) + send_offsets[p] * elem, send_counts[p] * elem,
                        static_cast<char*>(recv) + recv_offsets[p] * elem, recv_counts[p] * elem};
      mesh->exchange(transfers, tag);
    });
  }

  std::unique_ptr<Work> broadcast_async(void* data, size_t count, DType dtype, int root) override {
    const int P = size();
    MOE_CHECK(root >= 0 && root < P, "broadcast root {} outside a group of {} ranks", root, P);
    return submit([=, tag = next_tag(), members = members_, mesh = mesh_.get(), me = rank_] {
      const int64_t bytes = static_cast<int64_t>(count * dtype_bytes(dtype));
      std::vector<PeerTransfer> transfers;
      for (int p = 0; p < P; ++p) {
        if (p == me) continue;
        if (me == root) transfers.push_back({members[p], static_cast<const char*>(data), bytes, nullptr, -1});
        else if (p == root) transfers.push_back({members[p], nullptr, -1, static_cast<char*>(data), bytes});
      }
      mesh->exchange(transfers, tag);
    });
  }

  void barrier() override {
    const int P = size();
    submit([=, tag = next_tag(), members = members_, mesh = mesh_.get()] {
      std::vector<PeerTransfer> transfers(P);
      for (int p = 0; p < P; ++p) transfers[p] = {members[p], nullptr, 0, nullptr, 0};
      mesh->exchange(transfers, tag);
    })->wait();
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    const int P = size();
    ++splits_;  // every member splits the same times (a collective)
    std::vector<int32_t> mine = {color, key}, all(2 * static_cast<size_t>(P));
    all_gather(mine.data(), all.data(), 2, DType::i32);
    if (color < 0) return nullptr;
    std::vector<std::pair<std::pair<int32_t, int>, int>> chosen;  // ((key, old rank), world rank)
    for (int p = 0; p < P; ++p)
      if (all[2 * p] == color) chosen.push_back({{all[2 * p + 1], p}, members_[p]});
    std::sort(chosen.begin(), chosen.end());
    std::vector<int> members;
    for (const auto& entry : chosen) members.push_back(entry.second);
    // splitmix64 of (parent id, split number, color): distinct groups get distinct ids.
    uint64_t z = (static_cast<uint64_t>(id_) << 32 | splits_) * 0x9E3779B97F4A7C15ull + static_cast<uint32_t>(color);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return std::make_unique<TcpCommunicator>(mesh_, std::move(members), static_cast<uint32_t>(z ^ (z >> 31)));
  }

 private:
  std::unique_ptr<Work> submit(std::function<void()> task) {
    return std::make_unique<TcpWork>(mesh_->enqueue(std::move(task)));
  }
  // result = blocks[0] op blocks[1] op ... in rank order (count elements each).
  static void reduce_blocks(const char* blocks, int P, size_t count, DType dtype, ReduceOp op, char* result) {
    const size_t bytes = count * dtype_bytes(dtype);
    if (bytes == 0) return;
    std::memcpy(result, blocks, bytes);
    for (int p = 1; p < P; ++p) reduce_into(result, blocks + p * bytes, count, dtype, op);
  }

  // The next operation's tag: issued in the same order on every member (collectives).
  uint64_t next_tag() { return static_cast<uint64_t>(id_) << 32 | ops_++; }

  std::shared_ptr<TcpMesh> mesh_;
  std::vector<int> members_;
  int rank_ = 0;
  uint32_t id_ = 1, ops_ = 0, splits_ = 0;
};

}  // namespace

std::unique_ptr<Communicator> make_tcp_world(const LaunchEnv& env) {
  const int world_size = env.world_size, rank = env.rank;
  std::vector<int> fds(static_cast<size_t>(world_size), -1);
  if (world_size > 1) {
    int port = 0;
    const int listener = net::listen_on(0, world_size, &port);
    std::vector<RendezvousEntry> entries;
    try {
      entries = rendezvous_all_gather(env.master_addr, env.rendezvous_port, rank, world_size, "tcp-mesh",
                                      std::to_string(port));
      // Lower ranks listen, higher ranks connect; connects complete in the listeners'
      // backlog, so connecting to all lower ranks first cannot deadlock.
      for (int peer = 0; peer < rank; ++peer) {
        fds[peer] = net::connect_to(entries[peer].host, std::stoi(entries[peer].payload), 60);
        const int32_t me = rank;
        net::send_all(fds[peer], &me, sizeof me);
      }
      for (int accepted = rank + 1; accepted < world_size; ++accepted) {
        const int fd = net::accept_one(listener, 60, nullptr);
        int32_t peer = -1;
        net::recv_all(fd, &peer, sizeof peer);
        MOE_CHECK(peer > rank && peer < world_size && fds[peer] < 0, "tcp backend: unexpected peer rank {}", peer);
        fds[peer] = fd;
      }
    } catch (...) {
      net::close_fd(listener);
      for (int fd : fds) net::close_fd(fd);
      throw;
    }
    net::close_fd(listener);
  }
  std::vector<int> members(static_cast<size_t>(world_size));
  for (int r = 0; r < world_size; ++r) members[r] = r;
  return std::make_unique<TcpCommunicator>(std::make_shared<TcpMesh>(rank, std::move(fds)), std::move(members));
}

}  // namespace moe::dist
