// Registers the CUDA kernels of csrc/ for the ops that dflash_ops/ops/*.py define (schemas live
// in Python so the package works without this extension). Loading the library is enough:
//   setup.py builds it as the Python module dflash_ops._C (DFLASH_OPS_PYTHON_MODULE defined);
//   the JIT build (torch.utils.cpp_extension.load, is_python_module=False) and the CMake
//   library load it as a plain shared library.
#ifdef DFLASH_OPS_PYTHON_MODULE
#include <Python.h>  // first, as Python asks
#endif

#include <torch/library.h>

#include "dflash_ops.h"

TORCH_LIBRARY_IMPL(dflash, CUDA, m) {
  m.impl("rms_norm", TORCH_FN(dflash_ops::rms_norm));
  m.impl("fused_add_rms_norm_", TORCH_FN(dflash_ops::fused_add_rms_norm_));
  m.impl("rope_", TORCH_FN(dflash_ops::rope_));
  m.impl("qk_norm_rope_", TORCH_FN(dflash_ops::qk_norm_rope_));
  m.impl("knorm_rope_", TORCH_FN(dflash_ops::knorm_rope_));
  m.impl("store_kv_", TORCH_FN(dflash_ops::store_kv_));
  m.impl("kv_proj", TORCH_FN(dflash_ops::kv_proj));
  m.impl("context_kv_", TORCH_FN(dflash_ops::context_kv_));
  m.impl("block_attention", TORCH_FN(dflash_ops::block_attention));
  m.impl("block_attention_out_", TORCH_FN(dflash_ops::block_attention_out_));
  m.impl("silu_mul", TORCH_FN(dflash_ops::silu_mul));
}

// The speculator's bookkeeping kernels: schemas here (the package calls them only when this
// extension is loaded; dflash_ops/speculator/accept.py).
TORCH_LIBRARY(dflash_spec, m) {
  m.def("greedy_commit_(Tensor block, Tensor post, Tensor rows, Tensor(a!) n_out, "
        "Tensor(b!) start, Tensor(c!) last, Tensor(d!) out_tokens, Tensor stop_ids, "
        "int max_new, Tensor(e!) kept, Tensor(f!) done, Tensor(g!) ctx_pos) -> ()");
  m.def("sample_commit_(Tensor block, Tensor p, Tensor q, Tensor u, Tensor u_res, Tensor rows, "
        "Tensor(a!) n_out, Tensor(b!) start, Tensor(c!) last, Tensor(d!) out_tokens, "
        "Tensor stop_ids, int max_new, Tensor(e!) kept, Tensor(f!) done, Tensor(g!) ctx_pos) "
        "-> ()");
  m.def("prepare_step_(Tensor rows, Tensor last, Tensor start, Tensor drafts, Tensor ctx_rows, "
        "Tensor ctx_pos, int fill_id, int scratch, Tensor(a!) block_out, "
        "Tensor(b!) requests_out, Tensor(c!) start_out, Tensor(d!) ctx_req_out, "
        "Tensor(e!) ctx_pos_out) -> ()");
}
TORCH_LIBRARY_IMPL(dflash_spec, CUDA, m) {
  m.impl("greedy_commit_", TORCH_FN(dflash_ops::greedy_commit_));
  m.impl("sample_commit_", TORCH_FN(dflash_ops::sample_commit_));
  m.impl("prepare_step_", TORCH_FN(dflash_ops::prepare_step_));
}

#ifdef DFLASH_OPS_PYTHON_MODULE
// `import dflash_ops._C` runs the static registration above; the module itself is empty.
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr,
                               nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module);
}
#endif
