// The rnnkern._C Python module (module.cpp): its functions come from the
// files that define them, each registering its own at load time, so that
// this floor includes nothing of a backend's.
#pragma once

#include <Python.h>

#include <initializer_list>

namespace rnnkern {

// Adds functions to rnnkern._C; called by a static object of the defining
// file (e.g. cpu/module.cpp), before Python runs PyInit__C.
void add_module_functions(std::initializer_list<PyMethodDef> functions);

// Registers functions at load time: `static ModuleFunctions f({...});`.
struct ModuleFunctions {
  ModuleFunctions(std::initializer_list<PyMethodDef> functions) { add_module_functions(functions); }
};

}  // namespace rnnkern
