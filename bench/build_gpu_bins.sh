#!/usr/bin/env bash
# Build the CUDA executables that bench/gpu.sh runs, in release mode, and copy
# them, stripped, into bench/bin/ (gitignored):
#   bench/bin/boostr_runtime_tests   the unit/generated tests of boostr-runtime
#                                    with the cuda feature
#   bench/bin/gpu_bench              examples/gpu_bench.rs
# gzipped (bench/bin/*.gz) unless --raw is given.
# numr's build runs nvcc: CUDA_PATH must point at a CUDA toolkit (defaults to
# the pip-installed one below when present); NUMR_CUDA_ARCH defaults to 90.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${CUDA_PATH:-}" ]; then
    for n in /root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/nvidia/cu13 /usr/local/cuda; do
        if [ -x "$n/bin/nvcc" ]; then
            export CUDA_PATH="$n"
            break
        fi
    done
fi
if [ -z "${CUDA_PATH:-}" ] || [ ! -x "$CUDA_PATH/bin/nvcc" ]; then
    echo "build_gpu_bins.sh: no nvcc found; set CUDA_PATH to a CUDA toolkit" >&2
    exit 1
fi
export PATH="$CUDA_PATH/bin:$PATH"
export NUMR_CUDA_ARCH="${NUMR_CUDA_ARCH:-90}"
echo "build_gpu_bins.sh: CUDA_PATH=$CUDA_PATH NUMR_CUDA_ARCH=$NUMR_CUDA_ARCH" >&2

tests_exe=$(cargo test --release -p boostr-runtime --features cuda --no-run \
    --message-format=json-render-diagnostics |
    python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    t = m.get("target", {})
    if (m.get("reason") == "compiler-artifact" and m.get("executable")
            and m.get("profile", {}).get("test") and "lib" in t.get("kind", [])
            and t.get("name") == "boostr_runtime"):
        print(m["executable"])
')
if [ -z "$tests_exe" ]; then
    echo "build_gpu_bins.sh: could not find the boostr-runtime test executable" >&2
    exit 1
fi
cargo build --release -p boostr-runtime --features cuda --example gpu_bench

mkdir -p bench/bin
cp -f "$tests_exe" bench/bin/boostr_runtime_tests
cp -f target/release/examples/gpu_bench bench/bin/gpu_bench
if command -v strip >/dev/null; then
    strip bench/bin/boostr_runtime_tests bench/bin/gpu_bench
else
    echo "build_gpu_bins.sh: no strip; the executables keep their symbols" >&2
fi
# numr embeds its CUDA kernels (PTX) in every executable, about 30 MB each:
# gzip them (about 12 MB each) so that both fit the 64 MiB that travels to a
# GPU machine; bench/gpu.sh unpacks them. --raw keeps them uncompressed.
if [ "${1:-}" != "--raw" ]; then
    rm -f bench/bin/boostr_runtime_tests.gz bench/bin/gpu_bench.gz
    gzip -9 bench/bin/boostr_runtime_tests bench/bin/gpu_bench
    files=(bench/bin/boostr_runtime_tests.gz bench/bin/gpu_bench.gz)
else
    rm -f bench/bin/boostr_runtime_tests.gz bench/bin/gpu_bench.gz
    files=(bench/bin/boostr_runtime_tests bench/bin/gpu_bench)
fi
ls -l "${files[@]}"
total=$(cat "${files[@]}" | wc -c)
echo "build_gpu_bins.sh: total size $total bytes ($((total / 1048576)) MiB; the limit is 64 MiB)"
if [ "$total" -ge $((64 * 1048576)) ]; then
    echo "build_gpu_bins.sh: the executables exceed 64 MiB" >&2
    exit 1
fi
