// run_case: fmha's CPU forward and backward on cases read from files, through the core's C++
// entry points (csrc/fmha/api.h) with no Python in the process. tests/native/test_cpu_core_portable.py
// writes the cases, runs this program (cross-compiled for aarch64 under qemu-user, and
// natively under AddressSanitizer + UndefinedBehaviorSanitizer at each CPU kernel level) and
// compares what it writes with fmha.reference.
//
//   run_case --info              the best CPU kernel level of this build on this CPU, the
//                                active one (FMHA_CPU_ISA may force a lower one), the features
//   run_case TAG CASE_DIR...     runs each case: the forward, then the backward when the case
//                                has dout; writes CASE_DIR/TAG.<field>.bin for each output
//
// CASE_DIR/case.txt holds one setting per line:
//   <field> <value>                    a scalar of fmha::BwdParams, named as in
//                                      csrc/fmha/params.h (bias.* and mask.* for the two
//                                      Broadcast4 operands); dtypes by name (float32, ...)
//   in <field> <elem_bytes> <file>     an input array: the bytes of CASE_DIR/<file>
//   out <field> <elem_bytes> <count>   an output array of <count> elements
// Every array is aligned to its element and to nothing wider, and ends where its allocation
// ends (make_buffer); every output starts filled with 0xff bytes (NaN in every float dtype),
// so an element the kernels fail to write shows.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "fmha/api.h"
#include "fmha/params.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#else
#define ASAN_POISON_MEMORY_REGION(addr, size) ((void)(addr), (void)(size))
#endif

namespace {

using fmha::BwdParams;
using fmha::DType;

[[noreturn]] void fail(const std::string& what) { throw std::runtime_error(what); }

DType parse_dtype(const std::string& s) {
  for (DType t : {DType::kFloat64, DType::kFloat32, DType::kBFloat16, DType::kFloat16,
                  DType::kFloat8E4M3})
    if (s == fmha::dtype_name(t)) return t;
  fail("unknown dtype '" + s + "'");
}

// One array, at `data`: `elem_bytes` past a 64-byte boundary (aligned to its element only,
// as a NumPy or torch view may be), and the last byte of its allocation, so that
// AddressSanitizer reports a read or write even one byte past the end. The 64 bytes before
// that boundary are poisoned too.
struct Buffer {
  struct Free {
    void operator()(unsigned char* p) const { ::operator delete(p, std::align_val_t(64)); }
  };
  std::unique_ptr<unsigned char[], Free> block;
  unsigned char* data = nullptr;
  size_t bytes = 0;
};

Buffer make_buffer(size_t bytes, size_t elem_bytes) {
  Buffer b;
  const size_t lead = 64 + elem_bytes;
  b.block.reset(static_cast<unsigned char*>(::operator new(lead + bytes, std::align_val_t(64))));
  b.data = b.block.get() + lead;
  b.bytes = bytes;
  ASAN_POISON_MEMORY_REGION(b.block.get(), 64);
  return b;
}

// The scalar fields of BwdParams a case may set.
struct Scalars {
  std::map<std::string, int*> i32;
  std::map<std::string, int64_t*> i64;
  std::map<std::string, uint64_t*> u64;
  std::map<std::string, double*> f64;
  std::map<std::string, bool*> flag;
  std::map<std::string, DType*> dtype;

  explicit Scalars(BwdParams& p) {
    i32 = {{"batch", &p.batch}, {"heads_q", &p.heads_q}, {"heads_kv", &p.heads_kv},
           {"seqlen_q", &p.seqlen_q}, {"seqlen_k", &p.seqlen_k}, {"head_dim", &p.head_dim},
           {"head_dim_v", &p.head_dim_v}, {"window_left", &p.window_left},
           {"window_right", &p.window_right}, {"num_threads", &p.num_threads},
           {"num_splits", &p.num_splits}, {"dbias_batch", &p.dbias_batch},
           {"dbias_heads", &p.dbias_heads}, {"dbias_rows", &p.dbias_rows},
           {"dbias_cols", &p.dbias_cols}, {"total_q", &p.total_q}, {"total_k", &p.total_k}};
    i64 = {{"q_batch_stride", &p.q_batch_stride}, {"q_row_stride", &p.q_row_stride},
           {"q_head_stride", &p.q_head_stride}, {"k_batch_stride", &p.k_batch_stride},
           {"k_row_stride", &p.k_row_stride}, {"k_head_stride", &p.k_head_stride},
           {"v_batch_stride", &p.v_batch_stride}, {"v_row_stride", &p.v_row_stride},
           {"v_head_stride", &p.v_head_stride}, {"o_batch_stride", &p.o_batch_stride},
           {"o_row_stride", &p.o_row_stride}, {"o_head_stride", &p.o_head_stride},
           {"lse_batch_stride", &p.lse_batch_stride}, {"lse_head_stride", &p.lse_head_stride},
           {"lse_row_stride", &p.lse_row_stride}, {"alibi_batch_stride", &p.alibi_batch_stride},
           {"alibi_head_stride", &p.alibi_head_stride}, {"do_batch_stride", &p.do_batch_stride},
           {"do_row_stride", &p.do_row_stride}, {"do_head_stride", &p.do_head_stride},
           {"dq_batch_stride", &p.dq_batch_stride}, {"dq_row_stride", &p.dq_row_stride},
           {"dq_head_stride", &p.dq_head_stride}, {"dk_batch_stride", &p.dk_batch_stride},
           {"dk_row_stride", &p.dk_row_stride}, {"dk_head_stride", &p.dk_head_stride},
           {"dv_batch_stride", &p.dv_batch_stride}, {"dv_row_stride", &p.dv_row_stride},
           {"dv_head_stride", &p.dv_head_stride},
           {"q_descale_batch_stride", &p.q_descale_batch_stride},
           {"q_descale_head_stride", &p.q_descale_head_stride},
           {"k_descale_batch_stride", &p.k_descale_batch_stride},
           {"k_descale_head_stride", &p.k_descale_head_stride},
           {"v_descale_batch_stride", &p.v_descale_batch_stride},
           {"v_descale_head_stride", &p.v_descale_head_stride}};
    for (auto [name, b] : {std::pair<const char*, fmha::Broadcast4*>{"bias", &p.bias},
                           {"mask", &p.mask}}) {
      const std::string n = name;
      i64[n + ".batch_stride"] = &b->batch_stride;
      i64[n + ".head_stride"] = &b->head_stride;
      i64[n + ".row_stride"] = &b->row_stride;
      i64[n + ".col_stride"] = &b->col_stride;
    }
    u64 = {{"seed", &p.seed}, {"offset", &p.offset}};
    f64 = {{"scale", &p.scale}, {"softcap", &p.softcap}, {"dropout_p", &p.dropout_p}};
    flag = {{"bottom_right", &p.bottom_right}, {"deterministic", &p.deterministic}};
    dtype = {{"dtype", &p.dtype}, {"bias.dtype", &p.bias.dtype}, {"o_dtype", &p.o_dtype}};
  }

  void set(const std::string& key, const std::string& value) {
    std::istringstream in(value);
    bool ok = false;
    if (auto it = i32.find(key); it != i32.end()) ok = bool(in >> *it->second);
    else if (auto it = i64.find(key); it != i64.end()) ok = bool(in >> *it->second);
    else if (auto it = u64.find(key); it != u64.end()) ok = bool(in >> *it->second);
    else if (auto it = f64.find(key); it != f64.end()) ok = bool(in >> *it->second);
    else if (auto it = flag.find(key); it != flag.end()) {
      int v = 0;
      ok = bool(in >> v);
      *it->second = v != 0;
    } else if (auto it = dtype.find(key); it != dtype.end()) {
      *it->second = parse_dtype(value);
      ok = true;
    } else {
      fail("unknown setting '" + key + "'");
    }
    if (!ok) fail("bad value '" + value + "' for " + key);
  }
};

// Where each array field of BwdParams goes.
void set_pointer(BwdParams& p, const std::string& field, void* ptr) {
  if (field == "q") p.q = ptr;
  else if (field == "k") p.k = ptr;
  else if (field == "v") p.v = ptr;
  else if (field == "o") p.o = ptr;
  else if (field == "lse") p.lse = ptr;
  else if (field == "dout") p.dout = ptr;
  else if (field == "dq") p.dq = ptr;
  else if (field == "dk") p.dk = ptr;
  else if (field == "dv") p.dv = ptr;
  else if (field == "dbias") p.dbias = ptr;
  else if (field == "bias") p.bias.ptr = ptr;
  else if (field == "mask") p.mask.ptr = ptr;
  else if (field == "alibi_slopes") p.alibi_slopes = static_cast<const double*>(ptr);
  else if (field == "cu_seqlens_q") p.cu_seqlens_q = static_cast<const int32_t*>(ptr);
  else if (field == "cu_seqlens_k") p.cu_seqlens_k = static_cast<const int32_t*>(ptr);
  else if (field == "q_descale") p.q_descale = static_cast<const float*>(ptr);
  else if (field == "k_descale") p.k_descale = static_cast<const float*>(ptr);
  else if (field == "v_descale") p.v_descale = static_cast<const float*>(ptr);
  else fail("unknown array '" + field + "'");
}

std::vector<unsigned char> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail("cannot open " + path);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

void write_file(const std::string& path, const Buffer& b) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(b.data), std::streamsize(b.bytes));
  if (!f) fail("cannot write " + path);
}

void run_case(const std::string& tag, const std::string& dir) {
  BwdParams p;
  Scalars scalars(p);
  std::map<std::string, Buffer> inputs, outputs;
  std::ifstream in(dir + "/case.txt");
  if (!in) fail("cannot open " + dir + "/case.txt");
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream words(line);
    std::string key, value;
    if (!(words >> key) || key[0] == '#') continue;
    if (key == "in" || key == "out") {
      std::string field, last;
      size_t elem = 0;
      if (!(words >> field >> elem >> last) || elem == 0) fail("bad line: " + line);
      if (key == "in") {
        const auto bytes = read_file(dir + "/" + last);
        Buffer b = make_buffer(bytes.size(), elem);
        if (!bytes.empty()) std::memcpy(b.data, bytes.data(), bytes.size());
        set_pointer(p, field, b.data);
        inputs[field] = std::move(b);
      } else {
        Buffer b = make_buffer(elem * std::stoull(last), elem);
        std::memset(b.data, 0xff, b.bytes);
        set_pointer(p, field, b.data);
        outputs[field] = std::move(b);
      }
      continue;
    }
    std::getline(words >> std::ws, value);
    scalars.set(key, value);
  }
  // Buffers moved into the maps keep their blocks, so the pointers stay valid.
  fmha::cpu_forward(p);
  if (p.dout != nullptr) fmha::cpu_backward(p);
  for (const auto& [field, b] : outputs) write_file(dir + "/" + tag + "." + field + ".bin", b);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc == 2 && std::string(argv[1]) == "--info") {
      std::printf("best %s\n", fmha::isa_name(fmha::best_cpu_isa()));
      std::printf("active %s\n", fmha::isa_name(fmha::active_cpu_isa()));
      std::printf("features");
      for (const auto& f : fmha::cpu_features()) std::printf(" %s", f.c_str());
      std::printf("\n");
      return 0;
    }
    if (argc < 3) {
      std::fprintf(stderr, "usage: run_case --info | run_case TAG CASE_DIR...\n");
      return 2;
    }
    std::printf("isa %s\n", fmha::isa_name(fmha::active_cpu_isa()));
    for (int i = 2; i < argc; ++i) {
      try {
        run_case(argv[1], argv[i]);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "run_case: %s: %s\n", argv[i], e.what());
        return 1;
      }
      std::printf("done %s\n", argv[i]);
      std::fflush(stdout);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "run_case: %s\n", e.what());
    return 1;
  }
  return 0;
}
