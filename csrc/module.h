// The rnnkern._C Python module (module.cpp): its functions come from the
// files that define them, each registering its own at load time, so that
// this floor includes nothing of a backend's.
#pragma once

#include <Python.h>

#include <exception>
#include <initializer_list>
#include <string>

namespace rnnkern {

// Adds functions to rnnkern._C; called by a static object of the defining
// file (e.g. cpu/module.cpp), before Python runs PyInit__C.
void add_module_functions(std::initializer_list<PyMethodDef> functions);

// Registers functions at load time: `static ModuleFunctions f({...});`.
struct ModuleFunctions {
  ModuleFunctions(std::initializer_list<PyMethodDef> functions) { add_module_functions(functions); }
};

// The body of a module function taking one str (an op namespace): calls
// fn(that str) and returns None, or raises RuntimeError with what fn threw
// (no C++ exception may cross into Python).
template <typename Fn>
PyObject* call_with_namespace(PyObject* ns, Fn&& fn) {
  const char* name = PyUnicode_AsUTF8(ns);
  if (name == nullptr) return nullptr;
  try {
    fn(std::string(name));
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  Py_RETURN_NONE;
}

}  // namespace rnnkern
