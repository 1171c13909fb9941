#include "train/signals.h"

#include <unistd.h>

#include <atomic>
#include <csignal>

namespace moe {
namespace {

// Lock-free atomics are async-signal-safe.
std::atomic<int> g_stop_count{0};
std::atomic<int> g_stop_signal{0};
static_assert(std::atomic<int>::is_always_lock_free);

extern "C" void on_stop_signal(int sig) {
  if (g_stop_count.fetch_add(1) >= 1) _exit(128 + sig);  // the second signal: no cleanup
  g_stop_signal.store(sig);
  // write(2) is async-signal-safe; stdio is not.
  static const char kNote[] = "moe: stop requested: finishing the step and saving (signal again to exit now)\n";
  [[maybe_unused]] ssize_t n = ::write(2, kNote, sizeof kNote - 1);
}

}  // namespace

void install_stop_signal_handlers() {
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;  // blocking reads and writes continue after the first signal
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
}

bool stop_requested() { return g_stop_count.load() > 0; }
int stop_signal() { return g_stop_signal.load(); }
void request_stop() { g_stop_count.fetch_add(1); }
void clear_stop_request() {
  g_stop_count.store(0);
  g_stop_signal.store(0);
}

}  // namespace moe
