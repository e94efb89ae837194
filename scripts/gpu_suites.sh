#!/usr/bin/env bash
# Runs every test suite that touches an accelerator on a GPU machine, with CUDA, OpenCL and Vulkan required
# (`UMM_REQUIRE_BACKENDS=cuda,opencl,wgpu,cuda-vmm`: a suite that finds one of them missing fails instead of
# skipping). For a GPU machine without Rust: build the test binaries where Rust is, carry the folder over, run it
# there.
#
#   scripts/gpu_suites.sh pack [DIR]   # here: builds the workspace's tests, copies the GPU-relevant binaries and the
#                                    # `umm` binary into DIR (default .gpu-suites/), stripped, with this script
#   DIR/gpu_suites.sh run            # there: runs each binary, 4 test threads, prints one line per suite and
#                                    # its test results; logs in DIR/logs/
#
# On a machine with several GPUs, name multi-gpu too (`UMM_REQUIRE_BACKENDS=cuda,opencl,wgpu,cuda-vmm,multi-gpu
# DIR/gpu_suites.sh run`): `multi_gpu` then fails where it finds one GPU instead of skipping, and checks Auto's
# spread of 4 x 1 GiB per GPU and peer migration between every pair. The several-GPU figures come from two
# examples built and carried the same way: `multi_gpu_migrate` (every ordered pair against a raw peer copy) and
# `multi_gpu_threads` (one thread per GPU against one thread on one).
#
# On a machine with Rust and a GPU, `pack` then `run` in place does both. Vulkan needs its loader (libvulkan1)
# and the driver's ICD; on the project's GPU machine that is the recipe in DEVELOPERS.md (VK_DRIVER_FILES).
set -euo pipefail

mode=${1:-}
dir=${2:-.gpu-suites}
# The suites that reach a device: the backends' (conformance, CUDA, OpenCL, wgpu, teardown, the names check),
# the C ABI's, the root crate's that place buffers on devices, and the tools' that run the `umm` command on them.
SUITES=" umm-backends:conformance umm-backends:cuda umm-backends:cuda_ipc umm-backends:cuda_sleep umm-backends:opencl umm-backends:wgpu umm-backends:teardown
umm-backends:required_backends umm-capi:umm_capi umm-capi:abi umm-capi:c_header umm-capi:fuzz umm:concurrency
umm:facade umm:front_door umm:kernels umm:ordinary_kernels umm:migration umm:multi_gpu umm:overlap umm:teardown
umm-tools:observability "
SUITES=$(echo $SUITES)

case $mode in
  pack)
    cd "$(dirname "$0")/.."
    mkdir -p "$dir/bin"
    cargo build --bin umm
    # A package id names its package after '#' (`path+file:///w/umm-main#umm@0.1.0`), except where the package's
    # name is its folder's, when only the version follows (`path+file:///w/umm#0.1.0`): then the folder names it.
    cargo test --workspace --no-run --message-format=json 2>/dev/null |
      jq -r 'select(.reason == "compiler-artifact" and .profile.test == true and .executable != null)
             | (.package_id | if test("#[^@/]+@") then capture("#(?<n>[^@/]+)@").n
                 else capture("/(?<n>[^/#]+)#").n end) as $package
             | "\($package) \(.target.name) \(.executable)"' |
      while read -r package target exe; do
        case " $SUITES " in
          *" $package:$target "*)
            cp "$exe" "$dir/bin/$package-$target"
            strip "$dir/bin/$package-$target" 2>/dev/null || true
            ;;
        esac
      done
    # observability's CLI test runs the `umm` binary from where it was built.
    mkdir -p "$dir/bin/target-debug"
    built=$(cd "${CARGO_TARGET_DIR:-target}/debug" && pwd)
    cp "$built/umm" "$dir/bin/target-debug/umm"
    strip "$dir/bin/target-debug/umm" 2>/dev/null || true
    echo "$built" >"$dir/bin/target-debug/path"
    # observability's plot test reads a committed trace, beside where it runs when not where it was built.
    mkdir -p "$dir/examples/traces"
    cp examples/traces/resnet50_train.trace.gz "$dir/examples/traces/"
    cp "$0" "$dir/gpu_suites.sh"
    ls "$dir/bin"
    ;;
  run)
    cd "$(dirname "$0")"
    dir=.
    export UMM_REQUIRE_BACKENDS=${UMM_REQUIRE_BACKENDS:-cuda,opencl,wgpu,cuda-vmm} RUST_BACKTRACE=1
    # A call into wgpu in flight for 30 s is reported with where every thread waits (UMM_WGPU_WATCHDOG).
    export UMM_WGPU_WATCHDOG=${UMM_WGPU_WATCHDOG:-30}
    # The `umm` binary where the observability test looks for it, if that folder can be made here.
    built=$(cat "$dir/bin/target-debug/path")
    if [ ! -x "$built/umm" ] && mkdir -p "$built" 2>/dev/null; then cp "$dir/bin/target-debug/umm" "$built/umm"; fi
    mkdir -p "$dir/logs"
    failed=0
    for bin in "$dir"/bin/*; do
      [ -f "$bin" ] && [ -x "$bin" ] || continue
      name=$(basename "$bin")
      if timeout "${SUITE_TIMEOUT:-300}" "$bin" --test-threads 4 >"$dir/logs/$name.txt" 2>&1; then
        status=ok
      else
        status="FAILED ($?)"
        failed=1
      fi
      printf '%-32s %-12s %s\n' "$name" "$status" "$(grep -h 'test result' "$dir/logs/$name.txt" | tail -1)"
    done
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || true
    exit $failed
    ;;
  *)
    echo "usage: scripts/gpu_suites.sh pack [DIR] | DIR/gpu_suites.sh run" >&2
    exit 2
    ;;
esac
