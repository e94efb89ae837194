//! Sleep and wake of several pools at once, for callers that put a tag to sleep on every device (the manager,
//! the C ABI): each pool on a thread of its own, so that one pool's copies to the host run while another's pages
//! are unmapped, and a sleep that is all or nothing.

use super::{SleepReport, WakeReport};
use crate::{Error, Result};

/// Runs `op` on every item at once, a thread each (one item alone runs on the caller's thread), and returns the
/// results in the items' order; a thread that panics gives an error. The thread that runs an item leaves with
/// the CUDA context it came with (where umm is built with CUDA): a pool binds its device's context to sleep or
/// wake, and the caller's current context is not the pool's business.
pub fn each_at_once<I: Sync, R: Send>(items: &[I], op: impl Fn(&I) -> Result<R> + Sync) -> Vec<Result<R>> {
    let run = |item: &I| {
        #[cfg(feature = "cuda")]
        let _context = crate::cuda::ContextScope::enter_saving();
        op(item)
    };
    if let [item] = items {
        return vec![run(item)];
    }
    let panicked =
        || Error::Unsupported { backend: "umm".into(), what: "sleep or wake: a pool's thread panicked".into() };
    std::thread::scope(|scope| {
        let threads: Vec<_> = items.iter().map(|item| scope.spawn(|| run(item))).collect();
        threads.into_iter().map(|t| t.join().unwrap_or_else(|_| Err(panicked()))).collect()
    })
}

/// Puts every item's pool to sleep at once ([`each_at_once`]), all or nothing: the reports in the items' order,
/// or, where a pool cannot sleep, the index of the first that failed and its error, after every pool that slept
/// was woken (a failure to wake one is logged: its memory stays offloaded, and its tag can be woken again).
pub fn sleep_all_or_none<I: Sync>(
    items: &[I],
    sleep: impl Fn(&I) -> Result<SleepReport> + Sync,
    wake: impl Fn(&I) -> Result<WakeReport>,
) -> std::result::Result<Vec<SleepReport>, (usize, Error)> {
    let mut slept = Vec::with_capacity(items.len());
    let mut failure = None;
    for (index, result) in each_at_once(items, sleep).into_iter().enumerate() {
        match result {
            Ok(report) => slept.push((index, report)),
            Err(e) => {
                failure.get_or_insert((index, e));
            }
        }
    }
    let Some(failure) = failure else { return Ok(slept.into_iter().map(|(_, report)| report).collect()) };
    for (index, _) in slept {
        if let Err(again) = wake(&items[index]) {
            log::error!("waking a pool after a failed sleep: {again}");
        }
    }
    Err(failure)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    fn report(bytes: u64) -> SleepReport {
        SleepReport { bytes_released: bytes, ..SleepReport::default() }
    }

    fn refusal(item: u64) -> Error {
        Error::Unsupported { backend: format!("pool {item}"), what: "sleep".into() }
    }

    #[test]
    fn each_runs_every_item_once_and_keeps_their_order_and_a_panic_is_an_error() {
        let items: Vec<u64> = (0..6).collect();
        let results = each_at_once(&items, |&i| Ok(i * 10));
        assert_eq!(results.into_iter().map(Result::unwrap).collect::<Vec<_>>(), [0, 10, 20, 30, 40, 50]);
        let results = each_at_once(&items, |&i| if i == 3 { panic!("pool {i}") } else { Ok(i) });
        let failed: Vec<usize> = (0..6).filter(|&i| results[i].is_err()).collect();
        assert_eq!(failed, [3]);
        assert!(results[3].as_ref().unwrap_err().to_string().contains("panicked"));
        assert_eq!(each_at_once(&[7u64], |&i| Ok(i)).pop().unwrap().unwrap(), 7, "one item on the caller's thread");
    }

    #[test]
    fn a_sleep_is_all_or_none() {
        let items: Vec<u64> = (0..5).collect();
        let woken = Mutex::new(Vec::new());
        let wake = |&i: &u64| {
            woken.lock().unwrap().push(i);
            Ok(WakeReport::default())
        };
        let reports = sleep_all_or_none(&items, |&i| Ok(report(i)), wake).unwrap();
        assert_eq!(reports.iter().map(|r| r.bytes_released).collect::<Vec<_>>(), items);
        assert!(woken.lock().unwrap().is_empty(), "nothing woken when every pool slept");

        let sleep = |&i: &u64| if i == 1 || i == 3 { Err(refusal(i)) } else { Ok(report(i)) };
        let (failed, error) = sleep_all_or_none(&items, sleep, wake).unwrap_err();
        assert_eq!(failed, 1, "the first pool that could not sleep");
        assert!(error.to_string().contains("pool 1"), "{error}");
        let mut woken = woken.into_inner().unwrap();
        woken.sort();
        assert_eq!(woken, [0, 2, 4], "every pool that slept, and only those, woken");
    }
}
