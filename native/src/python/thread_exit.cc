// Daemon threads that the exiting Python interpreter ends: parked, as CPython 3.14 does,
// instead of unwound through torch's C++ frames.
//
// CPython 3.11-3.13 end a daemon thread that asks for the GIL once the interpreter finalizes
// with pthread_exit, a forced unwind of the thread's whole stack.  When that stack holds C++
// frames that reacquire the GIL -- a torch operator calling back into a Python dispatch mode,
// which fake CUDA installs in every Python thread (fakegpu/fake_cuda/_patch.py), or torch's
// thread-local destructors releasing those modes -- the unwind crosses a noexcept frame and
// the process aborts ("terminate called without an active exception") after the program
// itself finished, so torchrun reports a completed rank as failed.  CPython 3.14 parks such
// threads instead (they never run again; the process exit ends them).  The shim is preloaded
// into every rank, so its pthread_exit is the one libpython calls: while the interpreter
// finalizes it parks the calling thread.  Parking is bounded: should the process not have
// exited after kParkSeconds (its exit waiting on something the parked thread holds), the
// thread is ended as before.  Outside a Python interpreter, or before finalization, this is
// glibc's pthread_exit.
#include <dlfcn.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>

namespace {

constexpr long kParkSeconds = 10;

using IsFinalizing = int (*)();
using PthreadExit = void (*)(void*);

IsFinalizing find_is_finalizing() {
  // The interpreter's own symbols: Py_IsFinalizing from 3.13, _Py_IsFinalizing before; absent
  // in a process without Python.
  if (void* f = dlsym(RTLD_DEFAULT, "Py_IsFinalizing")) return reinterpret_cast<IsFinalizing>(f);
  return reinterpret_cast<IsFinalizing>(dlsym(RTLD_DEFAULT, "_Py_IsFinalizing"));
}

bool python_is_finalizing() {
  IsFinalizing is_finalizing = find_is_finalizing();
  // Reading the flag needs no GIL (an atomic load in CPython).
  return is_finalizing != nullptr && is_finalizing() != 0;
}

void park() {
  timespec left{kParkSeconds, 0};
  while (nanosleep(&left, &left) == -1 && errno == EINTR) {
  }
}

}  // namespace

extern "C" __attribute__((visibility("default"), noreturn)) void pthread_exit(void* value) {
  static const PthreadExit real = reinterpret_cast<PthreadExit>(dlsym(RTLD_NEXT, "pthread_exit"));
  const bool main_thread = syscall(SYS_gettid) == getpid();
  if (!main_thread && python_is_finalizing()) park();
  real(value);
  __builtin_unreachable();
}
