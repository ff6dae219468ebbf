// A native stack trace when a tfpsx process dies of a fatal signal.
//
// A parameter server that crashes inside a kernel (ours or TensorFlow's) otherwise dies
// without a word: its workers only see "connection reset by peer". The handler writes the
// signal, the faulting address and the native stack (glibc's backtrace: exported symbols
// and offsets, enough to name the library and the function) to stderr, then hands the
// signal to the handler that was there before (Python's faulthandler, which adds every
// Python thread's stack) or to the default action, so the process still dies of the same
// signal and a core dump, if enabled, is still written.
//
// Python installs it through ctypes (tfpsx/ops/crash_trace.py); TFPSX_CRASH_TRACE=0 opts out.

#include <errno.h>
#include <execinfo.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <ucontext.h>
#include <unistd.h>

namespace {

constexpr int kSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
constexpr int kNumSignals = sizeof(kSignals) / sizeof(kSignals[0]);
struct sigaction g_previous[kNumSignals];
int g_fd = 2;
volatile sig_atomic_t g_installed = 0;
volatile sig_atomic_t g_in_handler = 0;

// Async-signal-safe output: write(2) only, no allocation, no stdio.
void WriteStr(const char* s) {
  size_t n = strlen(s);
  while (n > 0) {
    ssize_t w = write(g_fd, s, n);
    if (w <= 0) return;
    s += w;
    n -= static_cast<size_t>(w);
  }
}

void WriteNum(unsigned long long v, int base) {
  char buf[32];
  int i = sizeof(buf) - 1;
  buf[i] = '\0';
  do {
    const int d = static_cast<int>(v % base);
    buf[--i] = static_cast<char>(d < 10 ? '0' + d : 'a' + d - 10);
    v /= base;
  } while (v != 0 && i > 0);
  WriteStr(buf + i);
}

const char* SignalName(int sig) {
  switch (sig) {
    case SIGSEGV: return "SIGSEGV";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGILL: return "SIGILL";
    case SIGABRT: return "SIGABRT";
    default: return "signal";
  }
}

void Handler(int sig, siginfo_t* info, void* context) {
  int slot = 0;
  while (slot < kNumSignals && kSignals[slot] != sig) ++slot;
  if (!g_in_handler) {  // a fault inside the trace itself skips straight to the chain
    g_in_handler = 1;
    WriteStr("\n*** tfpsx: fatal ");
    WriteStr(SignalName(sig));
    WriteStr(" (");
    WriteNum(static_cast<unsigned long long>(sig), 10);
    WriteStr(") in pid ");
    WriteNum(static_cast<unsigned long long>(getpid()), 10);
    if (info != nullptr && sig != SIGABRT) {
      WriteStr(", address 0x");
      WriteNum(reinterpret_cast<unsigned long long>(info->si_addr), 16);
    }
    WriteStr("; native stack (innermost first):\n");
    bool unwind = true;
#if defined(__x86_64__) && defined(__linux__)
    // First the interrupted instruction, from the signal's context: the stack below
    // stops at the signal frame when it cannot unwind from there (or the unwinder itself
    // faults, and the process dies with the stack unwritten). A jump to a null (or tiny)
    // address, a call through a null pointer, leaves nothing to unwind from; its
    // caller's return address is then on top of the stack.
    if (context != nullptr) {
      const ucontext_t* uc = static_cast<const ucontext_t*>(context);
      void* at[2];
      int k = 0;
      at[k++] = reinterpret_cast<void*>(uc->uc_mcontext.gregs[REG_RIP]);
      WriteStr("*** faulting instruction:\n");
      backtrace_symbols_fd(at, k, g_fd);
      if (reinterpret_cast<uintptr_t>(at[0]) < 4096) {
        at[0] = *reinterpret_cast<void* const*>(uc->uc_mcontext.gregs[REG_RSP]);
        WriteStr("*** a jump to a null address; called from:\n");
        backtrace_symbols_fd(at, 1, g_fd);
        unwind = false;  // glibc's unwinder faults from there: the chain below must run
      }
    }
#endif
    if (unwind) {
      WriteStr("*** the handler's stack:\n");
      void* frames[64];
      const int n = backtrace(frames, 64);
      backtrace_symbols_fd(frames, n, g_fd);
    }
    WriteStr("*** end of native stack\n");
  }
  // Chain: the previous handler (faulthandler's prints the Python stacks and re-raises),
  // else the default action with the signal raised again.
  if (slot < kNumSignals) {
    const struct sigaction& prev = g_previous[slot];
    if ((prev.sa_flags & SA_SIGINFO) && prev.sa_sigaction != nullptr) {
      sigaction(sig, &prev, nullptr);
      prev.sa_sigaction(sig, info, context);
      return;
    }
    if (prev.sa_handler != SIG_DFL && prev.sa_handler != SIG_IGN && prev.sa_handler != nullptr) {
      sigaction(sig, &prev, nullptr);
      prev.sa_handler(sig);
      return;
    }
  }
  signal(sig, SIG_DFL);
  raise(sig);
}

}  // namespace

// Installs the handler once per process; `fd` is where the trace goes (2: stderr).
// Returns 0, or the errno of the sigaction that failed (nothing is left half-installed).
extern "C" __attribute__((visibility("default"))) int tfpsx_install_crash_trace(int fd) {
  if (g_installed) return 0;
  g_fd = fd;
  // backtrace() loads libgcc on its first call; do it now, not inside a signal handler.
  void* warm[1];
  backtrace(warm, 1);
  struct sigaction action;
  memset(&action, 0, sizeof(action));
  action.sa_sigaction = Handler;
  action.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&action.sa_mask);
  for (int i = 0; i < kNumSignals; ++i) {
    if (sigaction(kSignals[i], &action, &g_previous[i]) != 0) {
      const int err = errno;
      for (int j = 0; j < i; ++j) sigaction(kSignals[j], &g_previous[j], nullptr);
      return err;
    }
  }
  g_installed = 1;
  return 0;
}
