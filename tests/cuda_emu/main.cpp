// emu_selftest: runs the emulator's C++ tests (known-answer tests of the primitives, checks
// of the emulator itself, the tensor-core GEMM, the planted bugs).
//   emu_selftest list            names and the PTX ISA sections each case encodes
//   emu_selftest run PATTERN...  runs matching cases (fnmatch); exit status 1 if any fails
#include <fnmatch.h>

#include <cstdio>
#include <cstring>
#include <exception>

#include "cuda/emu/runtime.h"
#include "emu_test.h"

namespace emu_test {

std::vector<Case>& registry() {
  static std::vector<Case> cases;
  return cases;
}

std::string launch_error(const std::function<void()>& launch) {
  try {
    launch();
  } catch (const emu::LaunchError& e) {
    return e.what();
  }
  return "";
}

}  // namespace emu_test

int main(int argc, char** argv) {
  using emu_test::registry;
  if (argc >= 2 && std::strcmp(argv[1], "list") == 0) {
    for (const auto& c : registry()) std::printf("%s\t%s\n", c.name.c_str(), c.cites.c_str());
    return 0;
  }
  if (argc < 3 || std::strcmp(argv[1], "run") != 0) {
    std::fprintf(stderr, "usage: %s list | run PATTERN...\n", argv[0]);
    return 2;
  }
  int ran = 0, failed = 0;
  for (const auto& c : registry()) {
    bool match = false;
    for (int i = 2; i < argc; ++i) match = match || fnmatch(argv[i], c.name.c_str(), 0) == 0;
    if (!match) continue;
    ++ran;
    emu_test::Result r;
    try {
      r = c.fn();
    } catch (const std::exception& e) {
      r = emu_test::fail(std::string("exception: ") + e.what());
    }
    std::printf("%s %s%s%s\n", r.ok ? "PASS" : "FAIL", c.name.c_str(), r.detail.empty() ? "" : ": ",
                r.detail.c_str());
    std::fflush(stdout);
    failed += r.ok ? 0 : 1;
  }
  if (ran == 0) {
    std::fprintf(stderr, "no test matches\n");
    return 2;
  }
  std::printf("%d passed, %d failed\n", ran - failed, failed);
  return failed ? 1 : 0;
}
