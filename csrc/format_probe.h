// Diagnostics for a crash seen on the H200 (2026-11-29): TORCH_CHECK_VALUE messages that stream a
// number segfaulted in our C++ argument checks. `dflash_probe::raise_in_cu(which)` (compiled by
// nvcc) and `raise_in_cpp(which)` (compiled by the host C++ compiler) each throw one
// TORCH_CHECK_VALUE whose message holds one kind of value, so a crash names the culprit:
//   0: text only   1: std::string   2: int64_t   3: double   4: IntArrayRef   5: c10::Device
// Registered as torch.ops.dflash_probe.raise_cu / raise_cpp (tests/probe_bad_inputs_gpu.py).
#pragma once

#include <cstdint>
#include <string>

namespace dflash_probe {
void raise_in_cu(int64_t which);
void raise_in_cpp(int64_t which);
// Formats without throwing: which 0: int64 via c10::str, 1: double via c10::str, 2: int64 via
// std::ostringstream. Registered as torch.ops.dflash_probe.fmt_cpp.
std::string fmt_in_cpp(int64_t which);
// Installs a SIGSEGV handler that prints a backtrace (execinfo) to stderr and exits 139.
void trace_segv();
}  // namespace dflash_probe
