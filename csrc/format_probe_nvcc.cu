// See format_probe.h. The nvcc-compiled half.
#include "format_probe.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include <string>
#include <vector>

namespace dflash_probe {
void raise_in_cu(int64_t which) {
  const std::vector<int64_t> v{3, 4};
  switch (which) {
    case 0: TORCH_CHECK_VALUE(false, "dflash_probe.cu: text only");
    case 1: TORCH_CHECK_VALUE(false, "dflash_probe.cu: string ", std::string("abc"));
    case 2: TORCH_CHECK_VALUE(false, "dflash_probe.cu: int64 ", int64_t(42));
    case 3: TORCH_CHECK_VALUE(false, "dflash_probe.cu: double ", 1.5);
    case 4: TORCH_CHECK_VALUE(false, "dflash_probe.cu: IntArrayRef ", c10::IntArrayRef(v));
    default: TORCH_CHECK_VALUE(false, "dflash_probe.cu: device ", c10::Device("cuda:0"));
  }
}
}  // namespace dflash_probe
