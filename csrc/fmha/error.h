// Errors raised by the core. The bindings turn them into Python exceptions:
// InvalidArgument -> ValueError, Unsupported -> NotImplementedError, others -> RuntimeError.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace fmha {

struct InvalidArgument : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};
struct Unsupported : std::runtime_error {
  using std::runtime_error::runtime_error;
};

template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

#define FMHA_CHECK_ARG(cond, ...) \
  do { if (!(cond)) throw ::fmha::InvalidArgument(::fmha::concat(__VA_ARGS__)); } while (0)

}  // namespace fmha
