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
  // No element: nothing is read or written through it, so its strides (NumPy gives size-0
  // arrays zero strides) and its data pointer (often null) do not matter.
  bool empty() const {
    for (int i = 0; i < ndim; ++i)
      if (shape[size_t(i)] == 0) return true;
    return false;
  }
};

// Where a producer says its array lives (__dlpack_device__), without exporting it; kDLCPU
// for producers that do not say.
inline DLDevice dlpack_device(const py::handle& obj) {
  DLDevice d{kDLCPU, 0};
  if (!py::hasattr(obj, "__dlpack_device__")) return d;
  const py::tuple t = obj.attr("__dlpack_device__")();
  d.device_type = static_cast<DLDeviceType>(t[0].cast<int>());
  d.device_id = t[1].cast<int>();
  return d;
}

// The view of an exported capsule ("dltensor_versioned" or "dltensor"), named `name` in
// errors; the view holds the capsule, and so the producer's memory.
inline View view_of(const std::string& name, py::object cap, bool writable) {
  View v;
  v.name = name;
  const DLTensor* t = nullptr;
  if (PyCapsule_IsValid(cap.ptr(), "dltensor_versioned")) {
    auto* m = static_cast<DLManagedTensorVersioned*>(
        PyCapsule_GetPointer(cap.ptr(), "dltensor_versioned"));
    t = &m->dl_tensor;
    v.read_only = (m->flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0;
  } else if (PyCapsule_IsValid(cap.ptr(), "dltensor")) {
    t = &static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap.ptr(), "dltensor"))->dl_tensor;
  } else {
    throw py::type_error(concat(name, ": not a DLPack capsule (or one already consumed)"));
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

// `cuda_stream`: the stream the kernels will run on (a cudaStream_t as an integer, 0 = the
// legacy default stream), or -1 for none. A CUDA producer is then asked to make the array
// ready on that stream (DLPack's `stream` argument, where 1 names the legacy default stream
// because 0 is reserved), so work still queued on the producer's stream is ordered before
// ours.
inline View import(const std::string& name, const py::handle& obj, bool writable,
                   intptr_t cuda_stream = -1) {
  // A DLPack capsule already exported by the caller (fmha's torch layer passes
  // torch.utils.dlpack.to_dlpack's, which costs far less than Tensor.__dlpack__): borrowed
  // as it is, with no stream handshake -- the caller exported it on the stream it launches
  // on. It is not renamed "used_dltensor": the producer's destructor still owns it.
  if (PyCapsule_CheckExact(obj.ptr()))
    return view_of(name, py::reinterpret_borrow<py::object>(obj), writable);
  // obj.__dlpack__(max_version=(1, 0)[, stream=s]) through the vectorcall protocol: no
  // keyword dictionary is built (the export is on every call's path).
  static PyObject* const method = PyUnicode_InternFromString("__dlpack__");
  if (!PyObject_HasAttr(obj.ptr(), method))
    throw py::type_error(concat(name, ": expected an array with __dlpack__, got ",
                                std::string(py::str(py::type::of(obj).attr("__name__")))));
  static PyObject* const version = py::make_tuple(1, 0).release().ptr();
  static PyObject* const kw_version = py::make_tuple("max_version").release().ptr();
  static PyObject* const kw_version_stream =
      py::make_tuple("max_version", "stream").release().ptr();
  static PyObject* const kw_stream = py::make_tuple("stream").release().ptr();
  py::object stream;
  if (cuda_stream >= 0) {
    const DLDevice d = dlpack_device(obj);
    if (d.device_type == kDLCUDA || d.device_type == kDLCUDAManaged)
      stream = py::int_(cuda_stream == 0 ? intptr_t(1) : cuda_stream);
  }
  PyObject* args[3] = {obj.ptr(), version, stream.ptr()};
  py::object cap = py::reinterpret_steal<py::object>(PyObject_VectorcallMethod(
      method, args, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, stream ? kw_version_stream : kw_version));
  if (!cap) {
    if (!PyErr_ExceptionMatches(PyExc_TypeError)) throw py::error_already_set();
    PyErr_Clear();  // a producer from before DLPack 1.0: no max_version
    args[1] = stream.ptr();
    cap = py::reinterpret_steal<py::object>(PyObject_VectorcallMethod(
        method, args, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, stream ? kw_stream : nullptr));
    if (!cap) throw py::error_already_set();
  }
  return view_of(name, std::move(cap), writable);
}

}  // namespace fmha
