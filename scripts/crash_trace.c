// A backtrace on a fatal signal, for binaries run where no debugger is installed (a lent
// GPU node): built into the bundle by scripts/bundle.sh as lib/libcrash_trace.so and
// loaded with LD_PRELOAD=DIR/lib/libcrash_trace.so. On SIGSEGV, SIGBUS, SIGFPE, SIGILL or
// SIGABRT it writes the frames as module(+offset) to stderr, then dies of the signal as
// it would have. Resolve an offset on the build machine against the unstripped binary:
//   addr2line -C -f -i -e build/moe_gpu_tests 0x3b460a
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static void on_fatal(int sig) {
  void* frames[64];
  const int n = backtrace(frames, 64);
  char line[96];
  const int length = snprintf(line, sizeof line, "crash_trace: signal %d; frames:\n", sig);
  if (length > 0) write(STDERR_FILENO, line, (size_t)length);
  backtrace_symbols_fd(frames, n, STDERR_FILENO);
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void install(void) {
  static char stack[1 << 16];  // a stack overflow's handler needs its own
  stack_t alt = {.ss_sp = stack, .ss_size = sizeof stack};
  sigaltstack(&alt, NULL);
  struct sigaction action;
  memset(&action, 0, sizeof action);
  action.sa_handler = on_fatal;
  action.sa_flags = SA_ONSTACK;
  const int signals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
  for (size_t i = 0; i < sizeof signals / sizeof signals[0]; ++i) sigaction(signals[i], &action, NULL);
}
