// METH_FASTCALL methods on a pybind11 class, for the few calls on the path of every small
// transfer and every imm round trip (the engine's fast_write and fast_imm, the counter
// table's wait). pybind11's dispatcher costs about 0.15-0.25 us a call on the 2-core machine;
// a plain CPython method costs a few tens of ns. Such a method takes positional arguments
// only, with the timeout (a float, in seconds) last, and maps C++ exceptions to Python ones
// as pybind11 would.
#pragma once

#include <pybind11/pybind11.h>

#include <exception>
#include <new>
#include <stdexcept>

namespace fabric::fastcall {

namespace py = pybind11;

// Runs ``f(self as Cls&, timeout_s)`` for a METH_FASTCALL method ``name`` that takes ``want``
// positional arguments, the last a float; ``f`` returns the result as a py::object.
template <class Cls, class F>
PyObject* call(PyObject* self, PyObject* const* a, Py_ssize_t n, Py_ssize_t want, const char* name, F&& f) {
    if (n != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd positional arguments (%zd given)", name, want, n);
        return nullptr;
    }
    double timeout_s = PyFloat_AsDouble(a[want - 1]);
    if (timeout_s == -1.0 && PyErr_Occurred()) return nullptr;
    try {
        return f(py::cast<Cls&>(py::handle(self)), timeout_s).release().ptr();
    } catch (py::error_already_set& err) {
        err.restore();
    } catch (const py::cast_error& err) {
        PyErr_SetString(PyExc_TypeError, err.what());
    } catch (const py::builtin_exception& err) {  // py::type_error and the like
        err.set_error();
    } catch (const std::invalid_argument& err) {
        PyErr_SetString(PyExc_ValueError, err.what());
    } catch (const std::bad_alloc&) {
        PyErr_NoMemory();
    } catch (const std::exception& err) {
        PyErr_SetString(PyExc_RuntimeError, err.what());
    }
    return nullptr;
}

// Adds ``defs`` to the pybind11 class ``cls`` as method descriptors, as a def() would (the
// instance comes as self). ``defs`` must outlive the class: a static array.
template <size_t N>
void add(py::handle cls, PyMethodDef (&defs)[N]) {
    for (PyMethodDef& def : defs) {
        auto descr = py::reinterpret_steal<py::object>(PyDescr_NewMethod(reinterpret_cast<PyTypeObject*>(cls.ptr()), &def));
        if (!descr) throw py::error_already_set();
        py::setattr(cls, def.ml_name, descr);
    }
}

// A METH_FASTCALL function as PyMethodDef's ml_meth wants it.
template <class Fn>
PyCFunction method(Fn* fn) {
    return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fn));
}

}  // namespace fabric::fastcall
