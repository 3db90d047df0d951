// The Python module init of dflash_ops._C. Each csrc/<family>.cu registers its kernels for the
// ops that dflash_ops/ops/*.py define (TORCH_LIBRARY_IMPL(dflash, CUDA, m); the schemas live in
// Python so the package works without this extension), so loading the library is enough:
//   setup.py builds it as the Python module dflash_ops._C (DFLASH_OPS_PYTHON_MODULE defined),
//   whose `import` needs PyInit__C; the JIT build (torch.utils.cpp_extension.load,
//   is_python_module=False) and the CMake library load it as a plain shared library, and this
//   file compiles to nothing.
#ifdef DFLASH_OPS_PYTHON_MODULE
#include <Python.h>

// `import dflash_ops._C` loads the library (running the registrations); the module is empty.
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr,
                               nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module);
}
#endif
