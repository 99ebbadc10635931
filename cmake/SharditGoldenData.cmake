# The tests' view of the golden data: a folder in the build tree with the layout of the golden set,
# in which every file is a symbolic link to the golden folder's file, except the packed ones.
#
# The repository keeps its large, compressible golden files packed, so that its tree stays small
# (tests/golden/README.md): `<name>.xz` (xz, which every Debian system has) beside `<name>.sha256`
# (the SHA-256 of the unpacked file, in the format of `sha256sum`). The view holds each of them
# unpacked, as `<name>`, byte for byte the file diffusers made: configure fails when its SHA-256
# differs from the recorded one. A golden folder without packed files (a complete copy of the golden
# set) gets a view of links only.
#
# The view is made again at every configure (a link costs nothing, an unpacked file is only
# rewritten when it no longer matches); a golden file added or removed, or a packed file changed,
# reconfigures.

function(shardit_make_golden_view golden_dir view_dir)
  if(NOT IS_DIRECTORY "${golden_dir}")
    message(STATUS "golden data: '${golden_dir}' is not a folder; the golden-labelled tests will fail "
                   "(set SHARDIT_GOLDEN_DIR, or leave them out with `ctest -LE golden`)")
    return()
  endif()
  file(GLOB_RECURSE files CONFIGURE_DEPENDS LIST_DIRECTORIES false RELATIVE "${golden_dir}" "${golden_dir}/*")
  set(view_entries "")
  foreach(file IN LISTS files)
    set(checksum_of_packed OFF)
    if(file MATCHES "^(.*)\\.sha256$")
      if("${CMAKE_MATCH_1}.xz" IN_LIST files)
        set(checksum_of_packed ON)  # the recorded SHA-256 of a packed file, not a golden file
      endif()
    endif()
    if(file MATCHES "^(.*)\\.xz$")
      set(unpacked "${CMAKE_MATCH_1}")
      shardit_unpack_golden_file("${golden_dir}" "${unpacked}" "${view_dir}")
      list(APPEND view_entries "${unpacked}")
    elseif(NOT checksum_of_packed)
      get_filename_component(parent "${view_dir}/${file}" DIRECTORY)
      file(MAKE_DIRECTORY "${parent}")
      file(CREATE_LINK "${golden_dir}/${file}" "${view_dir}/${file}" SYMBOLIC)
      list(APPEND view_entries "${file}")
    endif()
  endforeach()
  # What an earlier view holds that the golden folder no longer has would still be read.
  file(GLOB_RECURSE view_files LIST_DIRECTORIES false RELATIVE "${view_dir}" "${view_dir}/*")
  foreach(file IN LISTS view_files)
    if(NOT file IN_LIST view_entries)
      file(REMOVE "${view_dir}/${file}")
    endif()
  endforeach()
endfunction()

# Unpacks `<name>.xz` of the golden folder to `<name>` in the view, and checks it against
# `<name>.sha256`.
function(shardit_unpack_golden_file golden_dir name view_dir)
  set(packed "${golden_dir}/${name}.xz")
  set(checksum_file "${golden_dir}/${name}.sha256")
  set(unpacked "${view_dir}/${name}")
  if(IS_SYMLINK "${packed}")
    # A packed file kept once and linked from other folders (tests/golden/README.md): the view
    # links to the view's unpacked copy of it in the same way.
    file(READ_SYMLINK "${packed}" target)
    if(NOT target MATCHES "^([^/].*)\\.xz$")
      message(FATAL_ERROR "golden data: ${packed} links to ${target}, not to a packed file by a relative path")
    endif()
    get_filename_component(parent "${unpacked}" DIRECTORY)
    file(MAKE_DIRECTORY "${parent}")
    file(CREATE_LINK "${CMAKE_MATCH_1}" "${unpacked}" SYMBOLIC)
    return()
  endif()
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${packed}" "${checksum_file}")
  if(NOT EXISTS "${checksum_file}")
    message(FATAL_ERROR "golden data: ${packed} has no recorded SHA-256 (${checksum_file})")
  endif()
  file(STRINGS "${checksum_file}" recorded LIMIT_COUNT 1)
  string(REGEX MATCH "^[0-9a-f]+" recorded "${recorded}")
  if(EXISTS "${unpacked}" AND NOT IS_SYMLINK "${unpacked}")
    file(SHA256 "${unpacked}" actual)
    if(actual STREQUAL recorded)
      return()
    endif()
  endif()
  find_program(SHARDIT_XZ xz)
  if(NOT SHARDIT_XZ)
    message(FATAL_ERROR "golden data: xz not found, needed to unpack ${packed} (Debian: xz-utils)")
  endif()
  get_filename_component(parent "${unpacked}" DIRECTORY)
  file(MAKE_DIRECTORY "${parent}")
  file(REMOVE "${unpacked}")
  execute_process(COMMAND "${SHARDIT_XZ}" --decompress --stdout "${packed}"
                  OUTPUT_FILE "${unpacked}" RESULT_VARIABLE result ERROR_VARIABLE error)
  if(NOT result EQUAL 0)
    file(REMOVE "${unpacked}")
    message(FATAL_ERROR "golden data: unpacking ${packed} failed: ${error}")
  endif()
  file(SHA256 "${unpacked}" actual)
  if(NOT actual STREQUAL recorded)
    file(REMOVE "${unpacked}")
    message(FATAL_ERROR "golden data: ${packed} unpacks to a file whose SHA-256 is ${actual}, "
                        "not the ${recorded} that ${checksum_file} records")
  endif()
endfunction()
