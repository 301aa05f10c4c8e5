# Sourced by the llama.cpp benchmarks: $src (llama.cpp's sources inside PyPI's llama-cpp-python
# sdist, fetched once; no GitHub here) and $server (`llama-server`, built once with this CPU's
# flags). Needs $P, the peers' folder.
version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
# Without AMX: its AMX path crashed at the first product on session 51's Xeon (a SIGSEGV in
# ggml_backend_amx_mul_mat, the embedded model too); AVX-512 and its weight repacking stay.
src=$P/llama-cpp-python-$version/vendor/llama.cpp; server=$src/build-noamx/bin/llama-server
if [ ! -d "$src" ]; then
  python3 -m pip download -q --no-deps --no-binary :all: -d "$P" "llama-cpp-python==$version"
  tar xzf "$P/llama_cpp_python-$version.tar.gz" -C "$P"
  mv "$P/llama_cpp_python-$version" "$P/llama-cpp-python-$version"
fi
if [ ! -x "$server" ]; then
  no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  cmake -S "$src" -B "$src/build-noamx" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DCMAKE_C_FLAGS="$no_amx" -DCMAKE_CXX_FLAGS="$no_amx" >/dev/null
  cmake --build "$src/build-noamx" --target llama-server -j"$(nproc)" >/dev/null
fi
