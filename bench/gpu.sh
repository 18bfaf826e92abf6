#!/usr/bin/env bash
# boostr on an NVIDIA GPU, in one go (under 8 minutes: the stages are capped
# at 100 s, 170 s and 190 s; flex compiles stop starting after --torch-budget):
#   1. the generated CUDA tests (BOOSTR_TEST_REQUIRE_DEVICE=1: no skipping),
#   2. examples/gpu_bench.rs: bf16 spot checks against the CPU backend, then
#      forward and forward+backward timings of the stock variants,
#   3. bench/gpu_torch.py: PyTorch SDPA and FlexAttention on the same shapes,
#   4. bench/gpu_table.py: one table of TFLOP/s and boostr/sdpa, boostr/flex.
#
# Executables come from bench/bin/ (made by bench/build_gpu_bins.sh, plain or
# gzipped), or are built when missing and cargo exists. Results (logs, JSON lines, the table)
# go to $OUT when set, else to a fresh temporary directory (printed).
#
# usage: bench/gpu.sh [--quick] [--variants a,b] [--seqs 1024,4096]
#                     [--dims 64,128] [--reps N] [--skip-tests] [--skip-torch]
#                     [--torch-budget SECONDS]
#   --quick: S=4096 and D=128 only, 5 reps.
# The exit status is non-zero when there is no GPU, when a test or a check
# fails, or when a stage errs or runs out of its time; the table is still
# printed from whatever was measured.
set -uo pipefail
cd "$(dirname "$0")/.."

variants=causal,sliding_window,alibi,softcap
seqs=1024,4096
dims=64,128
reps=10
warmup=3
run_tests=1
run_torch=1
torch_budget=150
while [ $# -gt 0 ]; do
    case "$1" in
        --quick) seqs=4096; dims=128; reps=5 ;;
        --variants) variants="$2"; shift ;;
        --seqs) seqs="$2"; shift ;;
        --dims) dims="$2"; shift ;;
        --reps) reps="$2"; shift ;;
        --skip-tests) run_tests=0 ;;
        --skip-torch) run_torch=0 ;;
        --torch-budget) torch_budget="$2"; shift ;;
        -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { print }' "$0"; exit 0 ;;
        *) echo "gpu.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

die() {
    echo "gpu.sh: $*" >&2
    exit 1
}

# A GPU, or stop before anything pretends to have measured.
if ! command -v nvidia-smi >/dev/null 2>&1; then
    die "no NVIDIA GPU: nvidia-smi is not installed; nothing was tested or measured"
fi
if ! gpus=$(nvidia-smi -L 2>&1) || ! grep -q '^GPU ' <<<"$gpus"; then
    die "no NVIDIA GPU: nvidia-smi -L says: $gpus; nothing was tested or measured"
fi
echo "gpu.sh: $gpus"

bin=bench/bin
tests_exe=$bin/boostr_runtime_tests
bench_exe=$bin/gpu_bench
# Gzipped executables (bench/build_gpu_bins.sh's default): unpack them into a
# temporary directory.
unpacked=$(mktemp -d)
trap 'rm -rf "$unpacked"' EXIT
if { [ ! -x "$tests_exe" ] || [ ! -x "$bench_exe" ]; } &&
    [ -f "$tests_exe.gz" ] && [ -f "$bench_exe.gz" ]; then
    gzip -dc "$tests_exe.gz" >"$unpacked/boostr_runtime_tests" &&
        gzip -dc "$bench_exe.gz" >"$unpacked/gpu_bench" ||
        die "could not unpack $tests_exe.gz and $bench_exe.gz"
    chmod +x "$unpacked/boostr_runtime_tests" "$unpacked/gpu_bench"
    tests_exe=$unpacked/boostr_runtime_tests
    bench_exe=$unpacked/gpu_bench
fi
if [ ! -x "$tests_exe" ] || [ ! -x "$bench_exe" ]; then
    if command -v cargo >/dev/null 2>&1; then
        echo "gpu.sh: building the executables (bench/build_gpu_bins.sh)"
        bench/build_gpu_bins.sh --raw || die "building the executables failed"
    else
        die "no executables in $bin/ and no cargo to build them (run bench/build_gpu_bins.sh on a machine with Rust and copy $bin/ here)"
    fi
fi

# NVRTC and the driver are loaded at run time (cudarc, dynamic loading): add
# the CUDA toolkit's and PyTorch's library directories to the search path, and
# provide an unversioned libnvrtc.so when only a versioned one exists.
libdirs=()
for d in "${CUDA_PATH:-}/lib64" "${CUDA_PATH:-}/lib" /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -d "$d" ] && libdirs+=("$d")
done
if command -v python3 >/dev/null 2>&1; then
    while IFS= read -r d; do
        [ -n "$d" ] && libdirs+=("$d")
    done < <(python3 - <<'EOF' 2>/dev/null
import glob, os, site
for root in site.getsitepackages():
    for d in sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib"))) + [os.path.join(root, "torch", "lib")]:
        if os.path.isdir(d):
            print(d)
EOF
)
fi
shim=$unpacked/lib
mkdir -p "$shim"
nvrtc=""
for d in "${libdirs[@]}"; do
    for f in "$d"/libnvrtc.so "$d"/libnvrtc.so.12 "$d"/libnvrtc.so.1[0-9]*; do
        if [ -e "$f" ]; then nvrtc="$f"; break 2; fi
    done
done
if [ -n "$nvrtc" ]; then
    ln -s "$nvrtc" "$shim/libnvrtc.so"
    echo "gpu.sh: NVRTC: $nvrtc"
else
    echo "gpu.sh: warning: no libnvrtc found in the usual places; relying on the loader path" >&2
fi
path_join=$(IFS=:; echo "${libdirs[*]:-}")
export LD_LIBRARY_PATH="$shim${path_join:+:$path_join}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

results="${OUT:-$(mktemp -d)}"
mkdir -p "$results"
echo "gpu.sh: results in $results"
status=0

if [ "$run_tests" = 1 ]; then
    echo "== generated CUDA tests"
    BOOSTR_TEST_REQUIRE_DEVICE=1 timeout 100 "$tests_exe" cuda >"$results/tests.log" 2>&1
    rc=$?
    grep -E '^test result|FAILED|panicked' "$results/tests.log" | head -40
    if [ $rc -ne 0 ]; then
        [ $rc -eq 124 ] && echo "gpu.sh: the tests ran out of time (100 s)" >&2
        echo "gpu.sh: CUDA tests FAILED (exit $rc; log: $results/tests.log)" >&2
        tail -30 "$results/tests.log" >&2
        status=1
    else
        echo "gpu.sh: CUDA tests passed"
    fi
fi

echo "== boostr gpu_bench"
timeout 170 "$bench_exe" --variants "$variants" --seqs "$seqs" --dims "$dims" \
    --reps "$reps" --warmup "$warmup" --dtype bf16 >"$results/boostr.jsonl" 2>"$results/boostr.err"
rc=$?
grep -v '^{' "$results/boostr.jsonl"
if [ $rc -ne 0 ]; then
    [ $rc -eq 124 ] && echo "gpu.sh: gpu_bench ran out of time (170 s)" >&2
    echo "gpu.sh: gpu_bench FAILED (exit $rc)" >&2
    tail -20 "$results/boostr.err" >&2
    status=1
fi

if [ "$run_torch" = 1 ]; then
    echo "== PyTorch SDPA and FlexAttention"
    timeout $((torch_budget + 40)) python3 bench/gpu_torch.py --variants "$variants" --seqs "$seqs" \
        --dims "$dims" --reps "$reps" --warmup "$warmup" --budget-s "$torch_budget" \
        >"$results/torch.jsonl" 2>"$results/torch.err"
    rc=$?
    grep -E '^gpu_torch' "$results/torch.err"
    if [ $rc -ne 0 ]; then
        [ $rc -eq 124 ] && echo "gpu.sh: gpu_torch.py ran out of time" >&2
        echo "gpu.sh: gpu_torch.py FAILED (exit $rc)" >&2
        tail -20 "$results/torch.err" >&2
        status=1
    fi
fi

echo "== table"
files=("$results/boostr.jsonl")
[ "$run_torch" = 1 ] && files+=("$results/torch.jsonl")
python3 bench/gpu_table.py "${files[@]}" | tee "$results/table.txt" || status=1

if [ $status -ne 0 ]; then
    echo "gpu.sh: FAILED (see above; logs in $results)" >&2
else
    echo "gpu.sh: OK (logs in $results)"
fi
exit $status
