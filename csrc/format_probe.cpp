// See format_probe.h. The host-compiler half, and the registration of both.
#include "format_probe.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

#include <sstream>
#include <string>
#include <vector>

namespace dflash_probe {
void raise_in_cpp(int64_t which) {
  const std::vector<int64_t> v{3, 4};
  switch (which) {
    case 0: TORCH_CHECK_VALUE(false, "dflash_probe.cpp: text only");
    case 1: TORCH_CHECK_VALUE(false, "dflash_probe.cpp: string ", std::string("abc"));
    case 2: TORCH_CHECK_VALUE(false, "dflash_probe.cpp: int64 ", int64_t(42));
    case 3: TORCH_CHECK_VALUE(false, "dflash_probe.cpp: double ", 1.5);
    case 4: TORCH_CHECK_VALUE(false, "dflash_probe.cpp: IntArrayRef ", c10::IntArrayRef(v));
    default: TORCH_CHECK_VALUE(false, "dflash_probe.cpp: device ", c10::Device("cuda:0"));
  }
}
std::string fmt_in_cpp(int64_t which) {
  if (which == 0) return c10::str("int64 ", int64_t(42));
  if (which == 1) return c10::str("double ", 1.5);
  std::ostringstream os;
  os << "ostringstream " << int64_t(42);
  return os.str();
}
namespace {
void on_segv(int sig) {
  void* frames[48];
  const int n = backtrace(frames, 48);
  const char head[] = "dflash_probe: SIGSEGV, backtrace:\n";
  (void)!write(2, head, sizeof(head) - 1);
  backtrace_symbols_fd(frames, n, 2);
  _exit(128 + sig);
}
}  // namespace

void trace_segv() {
  struct sigaction sa {};
  sa.sa_handler = on_segv;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, nullptr);
}
}  // namespace dflash_probe

TORCH_LIBRARY(dflash_probe, m) {
  m.def("raise_cu(int which) -> ()", &dflash_probe::raise_in_cu);
  m.def("raise_cpp(int which) -> ()", &dflash_probe::raise_in_cpp);
  m.def("fmt_cpp(int which) -> str", &dflash_probe::fmt_in_cpp);
  m.def("trace_segv() -> ()", &dflash_probe::trace_segv);
}
