// libfmha's own translation unit: the library's version, for C++ users who load it directly
// (docs/guides/cpp.md). Everything else in libfmha comes whole from fmha_core (CMakeLists.txt).
#include "fmha/api.h"

namespace fmha {

const char* library_version() { return FMHA_VERSION; }

}  // namespace fmha
