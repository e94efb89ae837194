//! `umm_sim_stream`: a test's hand on the streams of a simulated device (`UMM_CAPI_SIM`), so that tests driving
//! the C ABI can queue work on a stream, hold it back and let it run one item at a time, and ask which physical
//! bytes an address stands for: what a model of stream-ordered reuse checks the C ABI against. The pools of one
//! simulated device share its streams ([`umm_backends::SimDeviceStreams`]).

use crate::graph_pool::slot;
use umm_backends::{SimBackend, StreamId};

/// What `umm_sim_stream` is asked (`umm.h`'s `umm_sim_op`, whose values these are).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SimStreamOp {
    /// Queue one item of work on the stream: answers its number.
    Launch = 0,
    /// Hold the stream's work back.
    Hold = 1,
    /// Run the stream's work up to item `arg`.
    Run = 2,
    /// Run all of it and let later work run at once.
    Finish = 3,
    /// Answers the items run so far.
    Completed = 4,
    /// Answers the last item of stream `arg` that the stream's later work is ordered after on the device.
    OrderedAfter = 5,
    /// Answers a number for the byte at address `arg`: two addresses with the same number are the same byte of
    /// device memory (a physical page mapped at both, or the address itself in a plain segment).
    Byte = 6,
}

impl SimStreamOp {
    fn from_code(code: i32) -> Option<Self> {
        use SimStreamOp::*;
        [Launch, Hold, Run, Finish, Completed, OrderedAfter, Byte].into_iter().find(|op| *op as i32 == code)
    }
}

/// Physical bytes of each simulated backend lie this far apart in the numbers [`SimStreamOp::Byte`] answers
/// (beyond any simulated device's addresses): backend `id` from `(id + 1) << 48`.
const PER_BACKEND: u32 = 48;

/// `umm_sim_stream`.
pub(crate) fn sim_stream(device: i64, stream: StreamId, code: i32, arg: u64) -> Result<u64, String> {
    const WHAT: &str = "umm_sim_stream";
    let op = SimStreamOp::from_code(code).ok_or_else(|| format!("{WHAT}: {code} is no umm_sim_op"))?;
    let pools = slot(WHAT, device)?.pools();
    let sims: Vec<&SimBackend> = pools.iter().filter_map(|p| p.simulated()).collect();
    if sims.len() != pools.len() {
        return Err(format!("{WHAT}: device {device} is not simulated (UMM_CAPI_SIM)"));
    }
    // The pools share the device's streams: any one of them answers for all.
    let sim = sims.first().ok_or_else(|| format!("{WHAT}: device {device} has no pool"))?;
    Ok(match op {
        SimStreamOp::Launch => sim.launch(stream),
        SimStreamOp::Hold => {
            sim.hold_stream(stream);
            0
        }
        SimStreamOp::Run => {
            sim.complete_stream(stream, arg);
            0
        }
        SimStreamOp::Finish => {
            sim.finish_stream(stream);
            0
        }
        SimStreamOp::Completed => sim.stream_progress(stream).1,
        SimStreamOp::OrderedAfter => sim.ordered_after(stream, StreamId(arg)),
        SimStreamOp::Byte => sims
            .iter()
            .find_map(|s| {
                let page = s.physical_page(arg)?;
                Some(((s.id() + 1) << PER_BACKEND) + page * s.page_size() + arg % s.page_size())
            })
            .unwrap_or(arg),
    })
}
