//! A fixed number of allocate+drop pairs of 4 KiB, for instruction counts under callgrind: through
//! `allocate_universal` on a simulated device (`manager`), or through the bare pool under it (`pool`). Run it with
//! 0 and with N pairs and divide the difference by N:
//!
//! ```sh
//! cargo build --release --example count_ops
//! for n in 0 100000; do valgrind --tool=callgrind --callgrind-out-file=/dev/null \
//!     target/release/examples/count_ops manager $n 2>&1 | grep Collected; done
//! ```
//!
//! Both warm up with 1,000 pairs first, so neither count includes the first touch of a pool.

use umm::backends::{Pool, PoolConfig, SimBackend, StreamId};
use umm::{Placement, UniversalMemoryManager};

const WARM_UP: usize = 1000;

fn main() {
    let mut args = std::env::args().skip(1);
    let (what, pairs) = match (args.next(), args.next().and_then(|n| n.parse::<usize>().ok())) {
        (Some(what), Some(pairs)) if what == "manager" || what == "pool" => (what, pairs),
        _ => {
            eprintln!("usage: count_ops manager|pool PAIRS");
            std::process::exit(2);
        }
    };
    if what == "manager" {
        manager_pairs(pairs);
    } else {
        pool_pairs(pairs);
    }
}

/// Each setting in a function of its own, not inlined into `main`: what the compiler does with one cannot move
/// the other's count.
#[inline(never)]
fn manager_pairs(pairs: usize) {
    let mm = UniversalMemoryManager::builder()
        .backends(false, false, false)
        .simulated_device(1 << 34)
        .build()
        .expect("a manager over a simulated device");
    for _ in 0..WARM_UP + pairs {
        let buffer = mm.allocate_universal::<u8>(4096, Placement::DeviceLocal).expect("room on the device");
        drop(std::hint::black_box(buffer));
    }
}

#[inline(never)]
fn pool_pairs(pairs: usize) {
    let pool = Pool::new(SimBackend::new("sim", 1 << 34), PoolConfig::default()).expect("a pool");
    for _ in 0..WARM_UP + pairs {
        let block = pool.allocate(std::hint::black_box(4096), StreamId(0)).expect("room on the device");
        pool.free(&block).expect("a live block");
    }
}
