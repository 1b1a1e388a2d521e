// A minimal test registry for the emulator's C++ tests: each case returns pass/fail with a
// message; `emu_selftest run PATTERN...` runs the cases whose names match (fnmatch).
#pragma once

#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace emu_test {

struct Result {
  bool ok;
  std::string detail;
};
inline Result pass(std::string detail = {}) { return {true, std::move(detail)}; }
inline Result fail(std::string detail) { return {false, std::move(detail)}; }

struct Case {
  std::string name;
  std::string cites;  // the PTX ISA sections (or other rules) the case encodes
  Result (*fn)();
};
std::vector<Case>& registry();

struct Register {
  Register(const char* name, const char* cites, Result (*fn)()) {
    registry().push_back({name, cites, fn});
  }
};

// Runs `launch` (a callable that launches a kernel) and returns the LaunchError message, or
// "" if it did not throw.
std::string launch_error(const std::function<void()>& launch);

}  // namespace emu_test

#define EMU_TEST_CAT2(a, b) a##b
#define EMU_TEST_CAT(a, b) EMU_TEST_CAT2(a, b)
// EMU_TEST("kat.mma_f16", "PTX ISA 9.0 §...") { ...; return emu_test::pass(); }
#define EMU_TEST(name, cites)                                                          \
  static ::emu_test::Result EMU_TEST_CAT(emu_test_fn_, __LINE__)();                    \
  static ::emu_test::Register EMU_TEST_CAT(emu_test_reg_, __LINE__)(                   \
      name, cites, &EMU_TEST_CAT(emu_test_fn_, __LINE__));                             \
  static ::emu_test::Result EMU_TEST_CAT(emu_test_fn_, __LINE__)()
