#!/usr/bin/env bash
# Mutation testing of the areas whose tests must catch what breaks them (docs/MUTANTS.md has the scores): each
# area is one `cargo mutants` run over its files with the test targets that cover them, on the simulated devices,
# so no GPU is needed. Needs `cargo install cargo-mutants`.
#
#   scripts/mutants.sh AREA [SHARD]   # AREA: decision | trace | capi | engine-pool | streams | all
#                                   # SHARD (engine-pool, streams): k/n, a round-robin sample of 1 in n mutants
#                                   # (streams runs every mutant unless SHARD is given; it samples the backends' files)
#
# Outputs land in /tmp/umm-mutants/AREA/mutants.out (caught.txt, missed.txt, ...). On a 2-core machine: decision
# 6 min, trace 46 min, capi 20 min; engine-pool a median of 57 s per mutant over 2,077 mutants, so it runs a shard
# (0/24 took 107 min beside other jobs; the default 0/48 about 50); the whole area is a soak for a larger machine.
set -euo pipefail
cd "$(dirname "$0")/.."
area=${1:-}
given_shard=${2:-}
shard=${2:-0/48}
out=/tmp/umm-mutants

run() {
  local name=$1
  shift
  mkdir -p "$out/$name"
  cargo mutants -j 1 --timeout 300 -o "$out/$name" "$@"
}

case $area in
  decision)
    run decision -p umm-placement -f 'placement/src/decision/*.rs'
    ;;
  trace)
    # The reader's suites only (in umm, and in umm-tools, whose oracle runs the `umm` command); without the
    # accelerator backends, which it does not touch.
    run trace -p umm -f src/trace/mod.rs --test-package umm,umm-tools --no-default-features \
      -- --lib --test trace --test trace_oracle --test fuzz_inputs
    ;;
  capi)
    run capi-history -p umm-capi -f history.rs -f device_pool.rs
    run capi-registry -p umm-capi -f registry.rs -f 'ffi/*.rs' -f tag.rs -f sleep.rs -f snapshot.rs -f config.rs
    ;;
  engine-pool)
    # The backends' suites that run on host memory and the simulated device, with the stress tests' cycles cut
    # (UMM_STRESS_CYCLES) and the 120,000-operation shadow run left to CI (the engine's other shadow tests run).
    UMM_STRESS_CYCLES=300 run engine-pool -p umm-backends \
      -f 'backends/src/engine/*.rs' -f 'backends/src/pool/*.rs' --shard "$shard" --sharding round-robin \
      -- --lib --test conformance --test steps --test sleep --test faults --test cross_stream \
      --test reserved_group --test teardown -- --skip long_random_sequence_matches_shadow
    ;;
  streams)
    # Stream-ordered reuse: StreamPool's recorded streams and pending frees, sharing across streams, the arenas of
    # each stream, with the suites of the stream oracle (tests/stream_oracle.rs) and the hand-written cases; then
    # the C ABI's registry (its free path) under all of umm-capi's tests (2 s a run; 16 min for its 113 mutants).
    sample=()
    if [ -n "$given_shard" ]; then sample=(--shard "$given_shard" --sharding round-robin); fi
    # A failing oracle workload shrinks for 2 s at most: the outcome is the same, a caught mutant costs less.
    PROPTEST_MAX_SHRINK_TIME=2000 run streams-backends -p umm-backends -f backends/src/pool/recorded.rs \
      -f backends/src/pool/share.rs -f backends/src/pool/streams.rs "${sample[@]}" \
      -- --lib --test stream_oracle --test cross_stream --test capture -- pool::recorded pool::streams oracle \
      never_hands_out reach stream capture
    PROPTEST_MAX_SHRINK_TIME=2000 run streams-capi -p umm-capi -f registry.rs
    ;;
  all)
    for a in decision trace capi engine-pool streams; do "$0" "$a" ${given_shard:+"$given_shard"}; done
    ;;
  *)
    sed -n '2,12p' "$0"
    exit 2
    ;;
esac
