// fmha._C.capabilities(): the capability table (fmha/capabilities.h) as plain Python data,
// and check_forward / check_backward / check_forward_kvcache: the C++ validation contract
// (fmha/validate.h) alone, for either backend, on host arrays -- the params are filled as
// fmha._C fills them (backend='cuda': as the emulator does, the host arrays standing for
// device memory), then checked, and no kernel runs. tests/api/test_capabilities.py holds
// the contract to the table through them; tools/capability_matrix.py writes the docs
// from capabilities().
#pragma once

#include <pybind11/pybind11.h>

#include <string>

#include "bindings/params_from_dlpack.h"
#include "fmha/capabilities.h"
#include "fmha/validate.h"

namespace fmha {
namespace bind {

inline const char* support_name(Support s) {
  switch (s) {
    case Support::kNo: return "no";
    case Support::kYes: return "yes";
    case Support::kIgnored: return "ignored";
  }
  return "?";
}

// {"backends": {name: {...}}, "features": [{...}, ...]}: lists, dicts, str and int only.
inline py::dict capabilities_dict() {
  py::dict backends;
  for (const BackendCaps& c : kBackendCaps) {
    py::list dtypes, codes;
    for (int i = 0; i < c.num_dtypes; ++i) dtypes.append(dtype_name(c.dtypes[i]));
    for (int i = 0; i < c.num_kv_codes; ++i) codes.append(kv_code_name(c.kv_codes[i]));
    py::dict features;
    for (const FeatureRow& f : kFeatures) features[f.key] = support_name(support(c.backend, f.feature));
    py::dict d;
    d["label"] = c.label;
    d["dtypes"] = dtypes;
    d["head_dim"] = py::make_tuple(c.head_dim_min, c.head_dim_max);
    d["head_dim_why"] = c.head_dim_why;
    d["kv_cache_dtypes"] = codes;
    d["kv8_head_dim_max"] = c.kv8_head_dim_max;
    d["kv8_head_dim_why"] = c.kv8_head_dim_why;
    d["features"] = features;
    backends[c.name] = d;
  }
  py::list features;
  for (const FeatureRow& f : kFeatures) {
    py::dict d;
    d["key"] = f.key;
    d["title"] = f.title;
    d["notes"] = py::dict(py::arg("cpu") = f.cpu_note, py::arg("cuda") = f.cuda_note);
    features.append(d);
  }
  py::dict out;
  out["backends"] = backends;
  out["features"] = features;
  return out;
}

// The backend= keyword of the check functions, taken out of the settings the filler reads.
inline Backend pop_backend(py::kwargs& kw) {
  FMHA_CHECK_ARG(kw.contains("backend"), "backend: required ('cpu' or 'cuda')");
  const std::string name = py::str(kw["backend"]);
  PyDict_DelItemString(kw.ptr(), "backend");
  for (const BackendCaps& c : kBackendCaps)
    if (name == c.name) return c.backend;
  throw InvalidArgument(concat("backend: expected 'cpu' or 'cuda', got '", name, "'"));
}

inline void register_capabilities(py::module_& m) {
  m.def("capabilities", &capabilities_dict,
        "The capability table (csrc/fmha/capabilities.h): {'backends': {'cpu' | 'cuda': "
        "{label, dtypes, head_dim (lo, hi), head_dim_why, kv_cache_dtypes, kv8_head_dim_max, "
        "kv8_head_dim_why, features: {key: 'yes' | 'no' | 'ignored'}}}, 'features': [{key, "
        "title, notes: {'cpu', 'cuda'}}]}.");
  def_with_arrays(
      m, "check_forward", kForwardArrays, 4,
      [](py::object q, py::object k, py::object v, py::object out, py::object lse,
         py::object bias, py::object mask, py::object alibi, py::object cu_q, py::object cu_k,
         py::object block_index, py::object block_masks, py::object q_descale,
         py::object k_descale, py::object v_descale, py::kwargs kw) {
        py::kwargs settings = py::reinterpret_steal<py::kwargs>(PyDict_Copy(kw.ptr()));
        const Backend b = pop_backend(settings);
        auto c = forward_call(q, k, v, out, lse, bias, mask, alibi, cu_q, cu_k, settings,
                              /*host_only=*/b == Backend::kCuda);
        fill_block_mask(c, block_index, block_masks);
        fill_descales(c, q_descale, k_descale, v_descale);
        check_params(c.p, b);
      },
      "fmha._C.forward's arguments plus backend='cpu' | 'cuda' (host arrays): fills the "
      "params and checks them against that backend's validation contract; runs nothing.");
  def_with_arrays(
      m, "check_backward", kBackwardArrays, 9,
      [](py::object dout, py::object q, py::object k, py::object v, py::object out,
         py::object lse, py::object dq, py::object dk, py::object dv, py::object dbias,
         py::object bias, py::object mask, py::object alibi, py::object cu_q, py::object cu_k,
         py::object dlse, py::object block_index, py::object block_masks, py::kwargs kw) {
        py::kwargs settings = py::reinterpret_steal<py::kwargs>(PyDict_Copy(kw.ptr()));
        const Backend b = pop_backend(settings);
        auto c = backward_call(dout, q, k, v, out, lse, dq, dk, dv, dbias, bias, mask, alibi,
                               cu_q, cu_k, dlse, settings, /*host_only=*/b == Backend::kCuda);
        fill_block_mask(c, block_index, block_masks);
        check_params(c.p, b);
      },
      "fmha._C.backward's arguments plus backend=: as check_forward.");
  def_with_arrays(
      m, "check_forward_kvcache", kKvcacheArrays, 5,
      [](py::object q, py::object k_cache, py::object v_cache, py::object out, py::object lse,
         py::object k, py::object v, py::object cache_seqlens, py::object block_table,
         py::object alibi, py::object k_scale, py::object v_scale, py::kwargs kw) {
        py::kwargs settings = py::reinterpret_steal<py::kwargs>(PyDict_Copy(kw.ptr()));
        const Backend b = pop_backend(settings);
        const auto c = kvcache_call(q, k_cache, v_cache, out, lse, k, v, cache_seqlens,
                                    block_table, alibi, k_scale, v_scale, settings);
        check_params(c.p, b);
      },
      "fmha._C.forward_kvcache's arguments plus backend=: as check_forward.");
}

}  // namespace bind
}  // namespace fmha
