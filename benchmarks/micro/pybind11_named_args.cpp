// What pybind11's named parameters cost per call, against (*args, **kwargs): two functions of
// a throwaway module, called as fmha's binding is (5 arrays by position, 7 settings by name).
// csrc/bindings/params_from_dlpack.h (ArrayArgs) and docs/cpu_kernels.md ("Small calls")
// quote it. Build and run (pybind11 installed):
//
//   g++ -O2 -shared -fPIC -std=c++17 $(python -m pybind11 --includes) \
//       benchmarks/micro/pybind11_named_args.cpp -o /tmp/named_args$(python3-config --extension-suffix)
//   PYTHONPATH=/tmp python -c "import named_args; named_args.report()"
#include <pybind11/eval.h>
#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace {

int named(py::object, py::object, py::object, py::object, py::object, py::object, py::object,
          py::object, py::object, py::object, py::object, py::object, py::kwargs kw) {
  return int(kw.size());
}

int packed(py::args a, py::kwargs kw) { return int(a.size() + kw.size()); }

}  // namespace

PYBIND11_MODULE(named_args, m) {
  m.def("named", &named, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"),
        py::arg("lse"), py::arg("bias") = py::none(), py::arg("mask") = py::none(),
        py::arg("alibi_slopes") = py::none(), py::arg("cu_seqlens_q") = py::none(),
        py::arg("cu_seqlens_k") = py::none(), py::arg("block_index") = py::none(),
        py::arg("block_masks") = py::none());
  m.def("packed", &packed);
  m.def("report", [m]() {
    py::exec(R"(
import statistics, time
kw = dict(scale=0.125, softcap=0.0, window_left=-1, window_right=-1, bottom_right=True,
          dropout_p=0.0, num_threads=2)
x = object()
def per_call_us(f, n=200000):
    for _ in range(1000): f()
    runs = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(n): f()
        runs.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(runs)
print(f"12 named parameters + 7 keywords: {per_call_us(lambda: named(x, x, x, x, x, **kw)):.2f} us")
print(f"(*args, **kwargs), same call:     {per_call_us(lambda: packed(x, x, x, x, x, **kw)):.2f} us")
)", m.attr("__dict__"));
  });
}
