# Included right after ggml's project() by a build for the tests alone
# (benchmarks/peers/llama_cpp.py --for-tests): llama.cpp's own C++ is compiled there without
# optimisation, to build in a third of the time, and ggml's kernels, which do the tests'
# quantising and arithmetic, stay optimised as in a release build.
set(CMAKE_CXX_FLAGS_RELEASE "-O3 -DNDEBUG")

# llama-common's forty-odd sources each parse the same JSON and chat headers: half of that
# build's compiler time. Compiled as unity sources, eight files to one, they take half of
# what they did. json.cpp specialises templates the other files instantiate, so it stays a
# source of its own. The target exists only once the top-level directory has been read,
# hence the deferred call (CMake 3.19 or later).
function(attnlab_unity_common)
  if(TARGET llama-common)
    set_target_properties(llama-common PROPERTIES UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE 8)
    set_source_files_properties("${CMAKE_SOURCE_DIR}/common/json.cpp"
      TARGET_DIRECTORY llama-common PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)
  endif()
endfunction()
if(CMAKE_VERSION VERSION_GREATER_EQUAL 3.19)
  cmake_language(DEFER DIRECTORY "${CMAKE_SOURCE_DIR}" CALL attnlab_unity_common)
endif()
