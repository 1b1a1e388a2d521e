# What the CUDA kernels are built for: architectures and head-dim tiles. Shared by the real
# CUDA build (CMakeLists.txt) and the emulator build (cmake/emulator.cmake), so that both
# compile the same set of instantiation files.

# The head-dim tiles that the kernels know, read from their one definition (kHeadDimTiles in
# csrc/cuda/head_dims.h): bit i of FMHA_CUDA_HDIM_MASK is tile i of this list.
file(STRINGS "${CMAKE_CURRENT_LIST_DIR}/../csrc/cuda/head_dims.h" _fmha_tiles_line
     REGEX "kHeadDimTiles\\[\\] *= *\\{")
if(NOT _fmha_tiles_line MATCHES "\\{([0-9, ]+)\\}")
  message(FATAL_ERROR "fmha: no kHeadDimTiles[] = {...} line in csrc/cuda/head_dims.h")
endif()
string(REGEX REPLACE "[ ]" "" FMHA_KNOWN_HEAD_DIM_TILES "${CMAKE_MATCH_1}")
string(REPLACE "," ";" FMHA_KNOWN_HEAD_DIM_TILES "${FMHA_KNOWN_HEAD_DIM_TILES}")

# A list option that a cache variable or the environment variable of the same name sets
# (the environment wins, so `FMHA_CUDA_ARCHS=90 pip install .` works without -C flags).
# Commas are accepted as separators too: "64,128" is easier to pass through a shell.
macro(fmha_list_option name default doc)
  set(${name} "${default}" CACHE STRING "${doc}")
  if(DEFINED ENV{${name}} AND NOT "$ENV{${name}}" STREQUAL "")
    set(${name} "$ENV{${name}}")
  endif()
  string(REPLACE "," ";" ${name} "${${name}}")
  string(REPLACE " " ";" ${name} "${${name}}")
  list(REMOVE_ITEM ${name} "")
  list(REMOVE_DUPLICATES ${name})
endmacro()

# Checks a head-dim list (named `option` in messages) and returns its FMHA_CUDA_HDIM_MASK.
function(fmha_head_dim_mask option dims out_mask)
  if(NOT dims)
    message(FATAL_ERROR "fmha: ${option} is empty; expected a non-empty subset of "
                        "\"${FMHA_KNOWN_HEAD_DIM_TILES}\"")
  endif()
  set(mask 0)
  foreach(d IN LISTS dims)
    list(FIND FMHA_KNOWN_HEAD_DIM_TILES "${d}" i)
    if(i LESS 0)
      message(FATAL_ERROR "fmha: ${option} contains \"${d}\"; expected head-dim tiles from "
                          "\"${FMHA_KNOWN_HEAD_DIM_TILES}\" (received \"${dims}\")")
    endif()
    math(EXPR mask "${mask} | (1 << ${i})" OUTPUT_FORMAT HEXADECIMAL)
  endforeach()
  set(${out_mask} ${mask} PARENT_SCOPE)
endfunction()

# Keeps, from the list variable `sources_var`, the per-instantiation files
# (csrc/cuda/instantiations/flash_*_hdim{D}_*.cu) whose D is in `dims`; files that name no
# head dim (the dispatchers, device.cu, ...) are always kept.
function(fmha_filter_head_dims sources_var dims)
  set(kept)
  foreach(src IN LISTS ${sources_var})
    get_filename_component(fname "${src}" NAME)
    if(fname MATCHES "_hdim([0-9]+)(_|\\.)")
      list(FIND dims "${CMAKE_MATCH_1}" i)
      if(i LESS 0)
        continue()
      endif()
    endif()
    list(APPEND kept "${src}")
  endforeach()
  set(${sources_var} "${kept}" PARENT_SCOPE)
endfunction()

fmha_list_option(FMHA_CUDA_HEAD_DIMS "${FMHA_KNOWN_HEAD_DIM_TILES}"
                 "Head-dim tiles of the CUDA kernels to build (subset of ${FMHA_KNOWN_HEAD_DIM_TILES})")
fmha_head_dim_mask(FMHA_CUDA_HEAD_DIMS "${FMHA_CUDA_HEAD_DIMS}" FMHA_CUDA_HDIM_MASK)

fmha_list_option(FMHA_CUDA_ARCHS "80;90" "CUDA architectures to build (sm_XX numbers, >= 80)")
if(NOT FMHA_CUDA_ARCHS)
  message(FATAL_ERROR "fmha: FMHA_CUDA_ARCHS is empty; expected sm numbers such as \"80;90\"")
endif()
foreach(a IN LISTS FMHA_CUDA_ARCHS)
  if(NOT a MATCHES "^[0-9]+$" OR a LESS 80)
    message(FATAL_ERROR "fmha: FMHA_CUDA_ARCHS contains \"${a}\"; expected compute-capability "
                        "numbers >= 80 such as \"80;90\" (the kernels use sm_80 tensor-core "
                        "instructions; received \"${FMHA_CUDA_ARCHS}\")")
  endif()
endforeach()
list(SORT FMHA_CUDA_ARCHS COMPARE NATURAL)

# CMAKE_CUDA_ARCHITECTURES for FMHA_CUDA_ARCHS: machine code (SASS) for every arch, and PTX
# only for the highest one, which the driver JIT-compiles on GPUs newer than anything
# built (PTX for the lower archs would only make the binary larger). A plain number is the
# generic target (sm_90, not the arch-specific sm_90a, whose code runs on Hopper only).
function(fmha_cuda_architectures archs out)
  list(GET archs -1 highest)
  set(result)
  foreach(a IN LISTS archs)
    if(a STREQUAL highest)
      list(APPEND result "${a}")  # real + virtual: SASS and PTX
    else()
      list(APPEND result "${a}-real")
    endif()
  endforeach()
  set(${out} "${result}" PARENT_SCOPE)
endfunction()
