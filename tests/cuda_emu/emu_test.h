// A minimal test registry for the emulator's C++ tests: each case returns pass/fail with a
// message; `emu_selftest run PATTERN...` runs the cases whose names match (fnmatch).
#pragma once

#include <functional>
#include <initializer_list>
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

// A launch that must fail: its error message (empty when it succeeded) must name every word,
// so that a check fails on the wrong error as well as on none. The message, cut to `keep`
// characters, is the pass's detail.
inline Result expect_error(const std::string& err, std::initializer_list<const char*> words,
                           size_t keep = 240) {
  if (err.empty()) return fail("the launch succeeded; expected an error");
  for (const char* w : words)
    if (err.find(w) == std::string::npos)
      return fail("error message lacks \"" + std::string(w) + "\": " + err);
  return pass(err.substr(0, keep));
}

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
