// The rnnkern._C Python module: `import rnnkern._C` runs the static
// registrations of the ops (ops.cpp's schemas, each backend's
// implementations); the module itself says whether the CUDA kernels were
// compiled in and holds the functions the other files add (module.h):
// register_autograd here, the CPU backend's in cpu/module.cpp.
#include "module.h"

#include <string>
#include <vector>

#include "autograd.h"

namespace rnnkern {
namespace {

std::vector<PyMethodDef>& module_functions() {
  static std::vector<PyMethodDef> functions;
  return functions;
}

PyObject* register_autograd(PyObject*, PyObject* ns) {
  return call_with_namespace(ns, [](const std::string& name) { rnnkern::register_autograd(name); });
}

const ModuleFunctions functions({
    {"register_autograd", register_autograd, METH_O,
     "Registers rnnkern's autograd formulas for the op family in the given namespace."},
});

}  // namespace

void add_module_functions(std::initializer_list<PyMethodDef> functions) {
  module_functions().insert(module_functions().end(), functions);
}

}  // namespace rnnkern

extern "C" PyObject* PyInit__C(void) {
  // The table Python keeps a pointer to: every registered function, then the sentinel.
  static std::vector<PyMethodDef> methods = [] {
    std::vector<PyMethodDef> all = rnnkern::module_functions();
    all.push_back({nullptr, nullptr, 0, nullptr});
    return all;
  }();
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods.data()};
  PyObject* m = PyModule_Create(&module_def);
  if (m == nullptr) return nullptr;
#ifdef RNNKERN_WITH_CUDA
  const long with_cuda = 1;
#else
  const long with_cuda = 0;
#endif
  if (PyModule_AddIntConstant(m, "WITH_CUDA", with_cuda) != 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
