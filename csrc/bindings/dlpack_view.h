// DLPack import shared by the extension modules (fmha._C and fmha._cuda_emu): any object with
// __dlpack__ (torch, NumPy, CuPy, JAX) becomes a borrowed view. Header-only, pybind11 side.
#pragma once

#include <pybind11/pybind11.h>

#include <array>
#include <cstdint>
#include <string>

#include "dlpack/dlpack.h"
#include "fmha/error.h"

namespace fmha {

namespace py = pybind11;

// A borrowed view of one DLPack tensor; the capsule (and so the producer's memory) stays
// alive as long as the view.
struct View {
  py::object capsule;
  void* data = nullptr;
  int ndim = 0;
  std::array<int64_t, 4> shape{}, strides{};
  DLDataType dtype{};
  DLDevice device{};
  bool read_only = false;
  std::string name;

  int64_t size(int i) const { return shape[size_t(i)]; }
  int64_t stride(int i) const { return strides[size_t(i)]; }
};

inline View import(const std::string& name, const py::handle& obj, bool writable) {
  if (!py::hasattr(obj, "__dlpack__"))
    throw py::type_error(concat(name, ": expected an array with __dlpack__, got ",
                                std::string(py::str(py::type::of(obj).attr("__name__")))));
  View v;
  v.name = name;
  py::object cap;
  try {
    cap = obj.attr("__dlpack__")(py::arg("max_version") = py::make_tuple(1, 0));
  } catch (py::error_already_set& e) {
    if (!e.matches(PyExc_TypeError)) throw;
    cap = obj.attr("__dlpack__")();  // a producer from before DLPack 1.0
  }
  const DLTensor* t = nullptr;
  if (PyCapsule_IsValid(cap.ptr(), "dltensor_versioned")) {
    auto* m = static_cast<DLManagedTensorVersioned*>(
        PyCapsule_GetPointer(cap.ptr(), "dltensor_versioned"));
    t = &m->dl_tensor;
    v.read_only = (m->flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0;
  } else if (PyCapsule_IsValid(cap.ptr(), "dltensor")) {
    t = &static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap.ptr(), "dltensor"))->dl_tensor;
  } else {
    throw py::type_error(concat(name, ": __dlpack__ did not return a DLPack capsule"));
  }
  FMHA_CHECK_ARG(t->ndim >= 1 && t->ndim <= 4, name, ": expected 1 to 4 dimensions, got ",
                 t->ndim);
  FMHA_CHECK_ARG(!(writable && v.read_only), name, ": the array is read-only");
  v.capsule = cap;
  v.ndim = t->ndim;
  v.dtype = t->dtype;
  v.device = t->device;
  v.data = static_cast<char*>(t->data) + t->byte_offset;
  int64_t compact = 1;
  for (int i = t->ndim - 1; i >= 0; --i) {
    v.shape[size_t(i)] = t->shape[i];
    v.strides[size_t(i)] = t->strides ? t->strides[i] : compact;
    compact *= t->shape[i];
  }
  return v;
}

}  // namespace fmha
