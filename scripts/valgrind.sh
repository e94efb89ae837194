#!/usr/bin/env bash
# Runs umm's host and simulated-device suites and the C ABI's tests under valgrind memcheck, and fails on any
# memcheck error (invalid reads and writes, uses of uninitialised values, bad frees) or definitely lost block in
# them. Not part of CI (.ci/run): a documented command, see docs/GUIDE.md, "Checking memory safety".
#
#   scripts/valgrind.sh            # everything below, about 15 minutes on two cores
#   scripts/valgrind.sh backends   # one suite: backends, faults, facade, capi or c-abi
#
# What runs, each test binary under `valgrind --error-exitcode=1 --leak-check=full
# --errors-for-leak-kinds=definite` with scripts/valgrind.supp:
# - backends: umm-backends' unit tests without GPU features (engine, pools, thread caches, locks, host and sim
#   backends);
# - faults:   backends/tests/faults.rs, the sampled fault sweep and the conformance workloads on host and sim,
#   and backends/tests/teardown.rs (pools dropped with live, cached and lent blocks and mapped pages);
# - facade:   the root crate's tests that run on the host with `UMM_BACKENDS=none` (facade, concurrency, trace,
#   plan, overlap, migration, teardown), built without the GPU APIs;
# - capi:     capi/tests/*.rs (abi, fuzz, c_header) with no GPU (every call takes its "no pool" path);
# - c-abi:    capi/tests/abi_test.c compiled against libumm_capi.so and run directly under valgrind (c_header.rs
#   runs it as a child process, which valgrind does not follow).
#
# Left out, for time (memcheck runs code 20 to 50 times slower): the exhaustive fault sweep
# (`every_fault_over_every_shared_trace`, ignored by default anyway) and tests filtered below with --skip, each
# with its reason. Tests that need an accelerator skip themselves on a machine without one, as in CI.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v valgrind >/dev/null 2>&1; then
  echo "valgrind not found: apt-get install valgrind" >&2
  exit 2
fi

SUITES=("$@")
[ ${#SUITES[@]} -gt 0 ] || SUITES=(backends faults facade capi c-abi)
LOGS="${CARGO_TARGET_DIR:-target}/valgrind"
mkdir -p "$LOGS"
export UMM_BACKENDS=none
# Keep the pools' background cleanup and the tests' own thread pools small: valgrind runs one thread at a time.
export RUST_TEST_THREADS="${RUST_TEST_THREADS:-2}"

VALGRIND=(valgrind --error-exitcode=1 --leak-check=full --errors-for-leak-kinds=definite
  --show-leak-kinds=definite --suppressions=scripts/valgrind.supp --num-callers=30)

# Builds the test binaries `cargo test ARGS --no-run` makes and prints their paths.
test_binaries() {
  cargo test "$@" --no-run --message-format=json 2>/dev/null |
    jq -r 'select(.reason == "compiler-artifact" and .profile.test == true and .executable != null) | .executable'
}

failed=()
summary=()
# run NAME BINARY [ARGS...]: one binary under valgrind, its log in $LOGS/NAME.log.
run() {
  local name=$1
  shift
  local log="$LOGS/$name.log"
  local start=$SECONDS
  if "${VALGRIND[@]}" --log-file="$log.vg" "$@" >"$log" 2>&1; then
    status=ok
  else
    status="FAILED (exit $?)"
    failed+=("$name")
  fi
  local errors
  errors=$(grep -ho 'ERROR SUMMARY: [0-9]*' "$log.vg" | awk '{s += $3} END {print s + 0}')
  summary+=("$(printf '%-28s %-16s %3s errors %5ss  (%s)' "$name" "$status" "$errors" $((SECONDS - start)) "$log")")
  echo "${summary[-1]}"
}

for suite in "${SUITES[@]}"; do
  case $suite in
    backends)
      for bin in $(test_binaries -p umm-backends --lib); do
        # Skipped, each a minute or more natively (an hour under memcheck) and safe code over paths the other
        # tests cover: the 10^5-operation shadow-model sequence (`engine_matches_shadow`, its shorter property
        # check, runs), the stream-number limit (allocates on thousands of streams), and the two 8-thread stress
        # tests (`excludes_under_contention`, `a_block_freed_on_another_thread_...` cover threads). Also two
        # tests whose verdict hangs on wall-clock timing that memcheck's one-thread-at-a-time scheduling misses:
        # the lock's fairness test (a 10 s bound) and the large-block cache test (a worker must reach the pool's
        # lock within 50 ms).
        run backends "$bin" --skip long_random_sequence_matches_shadow \
          --skip a_pool_refuses_streams_past_the_most_it_can_number \
          --skip eight_threads_keep_data_and_statistics_exact --skip concurrent_allocate_and_free_keep_blocks_disjoint \
          --skip a_sleeper_is_not_starved --skip large_blocks_are_cached_only_by_threads_that_met_contention
      done
      ;;
    faults)
      for bin in $(test_binaries -p umm-backends --test faults --test teardown); do
        run "$(basename "$bin" | sed 's/-[0-9a-f]*$//')" "$bin"
      done
      ;;
    facade)
      # Without the GPU APIs compiled in (`UMM_BACKENDS=none` would not probe them anyway): a far shorter build.
      for bin in $(test_binaries -p umm -p umm-tools --no-default-features --test facade --test concurrency \
        --test trace --test plan --test overlap --test migration --test teardown); do
        run "facade-$(basename "$bin" | sed 's/-[0-9a-f]*$//')" "$bin"
      done
      ;;
    capi)
      for bin in $(test_binaries -p umm-capi --tests); do
        run "capi-$(basename "$bin" | sed 's/-[0-9a-f]*$//')" "$bin"
      done
      ;;
    c-abi)
      cargo build -p umm-capi --lib 2>/dev/null
      lib_dir="${CARGO_TARGET_DIR:-target}/debug"
      exe="$LOGS/abi_test"
      cc -std=c11 -Wall -Wextra -Werror -g -I capi/include -I capi/tests capi/tests/abi_test.c -L "$lib_dir" \
        "-Wl,-rpath,$(cd "$lib_dir" && pwd)" -lumm_capi -o "$exe"
      run c-abi "$exe"
      ;;
    *)
      echo "unknown suite $suite (backends, faults, facade, capi, c-abi)" >&2
      exit 2
      ;;
  esac
done

echo
echo "== valgrind memcheck =="
printf '%s\n' "${summary[@]}"
if [ ${#failed[@]} -gt 0 ]; then
  echo "failed: ${failed[*]} (see the logs; *.log.vg holds valgrind's report)" >&2
  exit 1
fi
