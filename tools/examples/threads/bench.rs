//! Configurations, rows and the table: every configuration of one subject measured in turn, each result a
//! table row and an object of the JSON file; a subject made ready to run them.

use crate::allocators::{Allocator, Subject};
use crate::timing::run_threads;
use crate::{Workload, GIB};
use serde::Serialize;
use std::time::Duration;

/// One row of the table (and of the JSON file).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Row {
    pool: &'static str,
    device: String,
    workload: &'static str,
    threads: usize,
    pairs: u64,
    elapsed_s: f64,
    mops_per_s: f64,
    /// Over the 1-thread row of the same pool and workload (`None` when that one was skipped).
    speedup: Option<f64>,
    ns_per_pair_per_thread: f64,
    /// Segments created and pages mapped during the timed run (after the warm-up, a workload that fits what it
    /// reserved makes none).
    device_allocs: u64,
}

/// Every configuration of `subject`: a fresh allocator, a warm-up, the timed run, and the check that nothing
/// is left allocated.
pub(crate) fn bench<A: Allocator>(
    subject: &Subject<A>,
    workloads: &[Workload],
    thread_counts: &[usize],
    secs: Duration,
) -> Vec<Row> {
    let mut rows = Vec::new();
    for &workload in workloads {
        let mut one_thread: Option<f64> = None;
        for &threads in thread_counts {
            let worst = workload.worst_case_bytes(threads);
            if let Some(memory) = subject.memory.filter(|&m| worst > m / 4 * 3) {
                println!(
                    "{:<10} {:<6} {threads:>7}  skipped: up to {:.1} GiB live, over 3/4 of {:.1} GiB (see --max-threads)",
                    subject.pool,
                    workload.name(),
                    worst as f64 / GIB,
                    memory as f64 / GIB
                );
                continue;
            }
            let allocator = (subject.make)();
            // Warm-up with the same seeds: the timed run starts on segments (and pages) that already exist.
            run_threads(&allocator, workload.sizes(), threads, secs);
            let (before, device_allocs) = (allocator.allocations_by_device(), allocator.device_allocs());
            let m = run_threads(&allocator, workload.sizes(), threads, secs);
            let device = served_by(&subject.device, &before, &allocator.allocations_by_device());
            let device_allocs = allocator.device_allocs() - device_allocs;
            let left = allocator.allocated_bytes();
            assert_eq!(left, 0, "{} {} {threads} threads: {left} bytes still allocated", subject.pool, workload.name());
            (subject.reset)(&allocator);
            let seconds = m.elapsed.as_secs_f64();
            let mops = m.pairs as f64 / seconds / 1e6;
            if threads == 1 {
                one_thread = Some(mops);
            }
            let row = Row {
                pool: subject.pool,
                device,
                workload: workload.name(),
                threads,
                pairs: m.pairs,
                elapsed_s: seconds,
                mops_per_s: mops,
                speedup: one_thread.map(|base| mops / base),
                ns_per_pair_per_thread: seconds * 1e9 * threads as f64 / m.pairs as f64,
                device_allocs,
            };
            print_row(&row);
            rows.push(row);
        }
    }
    rows
}

/// Where the timed run's allocations went: `fallback` for a pool of one device, else each device that served
/// any with its share (the manager may move requests between devices, under memory pressure for one).
fn served_by(fallback: &str, before: &[(String, u64)], after: &[(String, u64)]) -> String {
    // The manager's device list is fixed at discovery, so the two lists pair up by position.
    let served: Vec<(&str, u64)> = after
        .iter()
        .zip(before)
        .map(|((name, a), (_, b))| (name.as_str(), a.saturating_sub(*b)))
        .filter(|&(_, n)| n > 0)
        .collect();
    let total: u64 = served.iter().map(|&(_, n)| n).sum();
    match served[..] {
        [] => fallback.to_string(),
        [(name, _)] => name.to_string(),
        _ => served
            .iter()
            .map(|&(name, n)| match 100.0 * n as f64 / total as f64 {
                share if share < 0.5 => format!("{name} <1%"),
                share => format!("{name} {share:.0}%"),
            })
            .collect::<Vec<_>>()
            .join(", "),
    }
}

pub(crate) fn print_table_header() {
    println!(
        "{:<10} {:<6} {:>7} {:>10} {:>8} {:>16} {:>9}  served by",
        "pool", "load", "threads", "M ops/s", "speedup", "ns/pair/thread", "dev alloc"
    );
}

fn print_row(row: &Row) {
    let speedup = row.speedup.map_or("-".to_string(), |s| format!("{s:.2}x"));
    println!(
        "{:<10} {:<6} {:>7} {:>10.3} {:>8} {:>16.1} {:>9}  {}",
        row.pool,
        row.workload,
        row.threads,
        row.mops_per_s,
        speedup,
        row.ns_per_pair_per_thread,
        row.device_allocs,
        row.device
    );
}

/// A subject made ready to run: discovery is done (and its lines printed) before the table starts.
pub(crate) type Planned = Box<dyn FnOnce(&[Workload], &[usize], Duration) -> Vec<Row>>;

pub(crate) fn planned<A: Allocator>(subject: Subject<A>) -> Planned {
    Box::new(move |workloads, counts, secs| bench(&subject, workloads, counts, secs))
}
