# Included right after ggml's project() by a build for the tests alone
# (benchmarks/peers/llama_cpp.py --for-tests): llama.cpp's own C++ is compiled there without
# optimisation, to build in a third of the time, and ggml's kernels, which do the tests'
# quantising and arithmetic, stay optimised as in a release build.
set(CMAKE_CXX_FLAGS_RELEASE "-O3 -DNDEBUG")
