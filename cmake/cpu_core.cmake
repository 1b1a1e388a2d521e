# The C++ core without Python: fmha_validate (the validation contract, csrc/fmha/validate.h)
# and fmha_core (params, dispatch, threads, and the CPU kernels once per instruction-set
# level). Included by CMakeLists.txt (the package) and by tests/cpu_core/CMakeLists.txt (the
# case runner, cross-compiled for aarch64 and built under the sanitizers), so both compile
# the core the same way.
#
# CPU kernel levels, lowest first: scalar (portable C++, always built), then avx2, avx512,
# avx512bf16, built only when the target processor is x86-64 and the compiler takes their
# flags and intrinsics, each only on top of the one below it (so the levels a build has are
# always a prefix of that list). dispatch.cpp learns which ones exist from the definitions
# FMHA_CPU_HAVE_AVX2, FMHA_CPU_HAVE_AVX512, FMHA_CPU_HAVE_AVX512BF16 and never names a level
# that was not compiled. FMHA_CPU_LEVELS (set here) lists the levels built.
include_guard(GLOBAL)
include(CheckCXXSourceCompiles)
get_filename_component(FMHA_CORE_ROOT "${CMAKE_CURRENT_LIST_DIR}/.." ABSOLUTE)
find_package(Threads REQUIRED)

add_library(fmha_validate STATIC ${FMHA_CORE_ROOT}/csrc/fmha/validate.cpp)
target_include_directories(fmha_validate PUBLIC ${FMHA_CORE_ROOT}/csrc)

add_library(fmha_core STATIC ${FMHA_CORE_ROOT}/csrc/fmha/dispatch.cpp
            ${FMHA_CORE_ROOT}/csrc/fmha/kvcache.cpp ${FMHA_CORE_ROOT}/csrc/fmha/threads.cpp
            ${FMHA_CORE_ROOT}/csrc/fmha/fp8.cpp
            ${FMHA_CORE_ROOT}/csrc/cpu/amx_model.cpp)
# The AMX model pins the rounding mode around its arithmetic (csrc/cpu/amx_model.cpp): tell
# the compiler that the mode can change there.
set_source_files_properties(${FMHA_CORE_ROOT}/csrc/cpu/amx_model.cpp PROPERTIES
                            COMPILE_OPTIONS "-frounding-math")
target_include_directories(fmha_core PUBLIC ${FMHA_CORE_ROOT}/csrc ${FMHA_CORE_ROOT}/third_party)
target_link_libraries(fmha_core PUBLIC fmha_validate Threads::Threads ${CMAKE_DL_LIBS})

# The flags of each level above scalar, and a probe that the compiler takes them: the
# intrinsics of that level the kernels use (csrc/cpu/simd.h, numeric.h, bf16_pairs.h).
set(FMHA_CPU_FLAGS_avx2 -mavx2 -mfma -mf16c)
set(FMHA_CPU_PROBE_avx2 "__m256 f(__m256 a) { return _mm256_fmadd_ps(a, a, _mm256_cvtph_ps(_mm_set1_epi16(1))); }")
set(FMHA_CPU_FLAGS_avx512 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c
    -mprefer-vector-width=512)
set(FMHA_CPU_PROBE_avx512 "float f(__m512 a) { return _mm512_reduce_add_ps(_mm512_fmadd_ps(a, a, a)); }")
set(FMHA_CPU_FLAGS_avx512bf16 ${FMHA_CPU_FLAGS_avx512} -mavx512bf16)
set(FMHA_CPU_PROBE_avx512bf16 "__m512 f(__m512 a, __m512i b) { return _mm512_dpbf16_ps(a, (__m512bh)b, (__m512bh)b); }")

# Optimisation of the kernels; the sanitizer build of tests/cpu_core may lower it.
if(NOT DEFINED FMHA_CPU_OPT_FLAGS)
  set(FMHA_CPU_OPT_FLAGS -O3)
endif()
set(FMHA_CPU_COMMON_FLAGS ${FMHA_CPU_OPT_FLAGS} -fopenmp-simd -fno-math-errno -fno-trapping-math)

function(fmha_cpu_isa isa)
  add_library(fmha_cpu_${isa} OBJECT ${FMHA_CORE_ROOT}/csrc/cpu/instantiate_${isa}.cpp)
  target_include_directories(fmha_cpu_${isa} PRIVATE ${FMHA_CORE_ROOT}/csrc
                             ${FMHA_CORE_ROOT}/third_party)
  target_compile_options(fmha_cpu_${isa} PRIVATE ${FMHA_CPU_COMMON_FLAGS} ${FMHA_CPU_FLAGS_${isa}})
  target_sources(fmha_core PRIVATE $<TARGET_OBJECTS:fmha_cpu_${isa}>)
  if(NOT isa STREQUAL "scalar")
    string(TOUPPER "${isa}" _upper)
    target_compile_definitions(fmha_core PRIVATE FMHA_CPU_HAVE_${_upper}=1)
  endif()
endfunction()

set(FMHA_CPU_LEVELS scalar)
fmha_cpu_isa(scalar)
if(CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64|x64)$")
  foreach(_isa avx2 avx512 avx512bf16)
    list(JOIN FMHA_CPU_FLAGS_${_isa} " " CMAKE_REQUIRED_FLAGS)
    check_cxx_source_compiles("#include <immintrin.h>\n${FMHA_CPU_PROBE_${_isa}}\nint main() { return 0; }"
                              FMHA_CXX_HAS_${_isa})
    unset(CMAKE_REQUIRED_FLAGS)
    if(NOT FMHA_CXX_HAS_${_isa})
      message(STATUS "fmha: the compiler does not take the ${_isa} flags or intrinsics: the "
                     "${_isa} CPU kernels and the levels above it are not built")
      break()
    endif()
    fmha_cpu_isa(${_isa})
    list(APPEND FMHA_CPU_LEVELS ${_isa})
  endforeach()
else()
  message(STATUS "fmha: target processor '${CMAKE_SYSTEM_PROCESSOR}' is not x86-64: only the "
                 "portable scalar CPU kernels are built")
endif()

# The amx level (csrc/cpu/instantiate_amx.cpp): the bfloat16 forward on AMX tiles, built on top
# of avx512bf16 with its flags (the AMX flags are added below when the compiler takes them;
# without them the level runs its tiles through the software model only). dispatch.cpp learns
# of it from FMHA_CPU_HAVE_AMX.
if("avx512bf16" IN_LIST FMHA_CPU_LEVELS)
  add_library(fmha_cpu_amx OBJECT ${FMHA_CORE_ROOT}/csrc/cpu/instantiate_amx.cpp)
  target_include_directories(fmha_cpu_amx PRIVATE ${FMHA_CORE_ROOT}/csrc
                             ${FMHA_CORE_ROOT}/third_party)
  target_compile_options(fmha_cpu_amx PRIVATE ${FMHA_CPU_COMMON_FLAGS} ${FMHA_CPU_FLAGS_avx512bf16})
  target_sources(fmha_core PRIVATE $<TARGET_OBJECTS:fmha_cpu_amx>)
  target_compile_definitions(fmha_core PRIVATE FMHA_CPU_HAVE_AMX=1)
  list(APPEND FMHA_CPU_LEVELS amx)
endif()
message(STATUS "fmha: CPU kernel levels: ${FMHA_CPU_LEVELS}")

# The AMX instructions (AMX-TILE, AMX-BF16): csrc/cpu/amx_hardware.cpp, the one translation unit
# built with them, only on x86-64 and when the compiler takes the flags and the intrinsics; it
# gets no other ISA flag. dispatch.cpp calls into it (FMHA_CPU_HAVE_AMX_HW) only after the
# run-time check (fmha::amx_usable). Without it the AMX model still runs (amx_model.cpp).
set(FMHA_CPU_FLAGS_amx -mamx-tile -mamx-bf16)
set(FMHA_CPU_PROBE_amx "void f(const void* c, void* p) { _tile_loadconfig(c); _tile_loadd(1, p, 64); _tile_dpbf16ps(0, 1, 2); _tile_stored(0, p, 64); _tile_release(); }")
set(FMHA_CPU_AMX_HW OFF)
if(CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64|x64)$")
  list(JOIN FMHA_CPU_FLAGS_amx " " CMAKE_REQUIRED_FLAGS)
  check_cxx_source_compiles("#include <immintrin.h>\n${FMHA_CPU_PROBE_amx}\nint main() { return 0; }"
                            FMHA_CXX_HAS_amx)
  unset(CMAKE_REQUIRED_FLAGS)
  if(FMHA_CXX_HAS_amx)
    add_library(fmha_cpu_amx_hw OBJECT ${FMHA_CORE_ROOT}/csrc/cpu/amx_hardware.cpp)
    target_include_directories(fmha_cpu_amx_hw PRIVATE ${FMHA_CORE_ROOT}/csrc
                               ${FMHA_CORE_ROOT}/third_party)
    target_compile_options(fmha_cpu_amx_hw PRIVATE ${FMHA_CPU_COMMON_FLAGS} ${FMHA_CPU_FLAGS_amx})
    target_sources(fmha_core PRIVATE $<TARGET_OBJECTS:fmha_cpu_amx_hw>)
    target_compile_definitions(fmha_core PRIVATE FMHA_CPU_HAVE_AMX_HW=1)
    if(TARGET fmha_cpu_amx)  # the amx level's kernels reach the hardware tiles too
      target_compile_options(fmha_cpu_amx PRIVATE ${FMHA_CPU_FLAGS_amx})
    endif()
    set(FMHA_CPU_AMX_HW ON)
  else()
    message(STATUS "fmha: the compiler does not take -mamx-tile -mamx-bf16 or their intrinsics: "
                   "AMX runs only as the software model")
  endif()
endif()
message(STATUS "fmha: AMX instructions built (FMHA_CPU_HAVE_AMX_HW): ${FMHA_CPU_AMX_HW}")
