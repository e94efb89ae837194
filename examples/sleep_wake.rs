//! Sleep and wake by tag: "weights" are offloaded to host memory and come back with their bytes, the
//! "kv_cache" is discarded, and every buffer keeps its device address, so kernels and captured CUDA graphs that
//! hold those addresses work after the wake. On a device without virtual memory management (OpenCL, wgpu, a CPU
//! device) the sleep is refused with the reason, and nothing changes.
//!
//! `cargo run --release --example sleep_wake`

use umm::{AllocOptions, Placement, SleepPolicy, UniversalMemoryManager};

fn main() -> umm::Result<()> {
    let mm = UniversalMemoryManager::new()?;
    let device = AllocOptions::new().placement(Placement::DeviceLocal);
    let weights: Vec<f32> = (0..8 << 20).map(|i| (i % 1000) as f32 * 0.001).collect();
    let w = mm.allocate_universal_from_with(&weights, device.clone().tag("weights"))?;
    let kv = {
        let _tag = mm.tag_scope("kv_cache")?;
        mm.allocate_universal_with::<f16_bits>(64 << 20, device)?
    };
    println!("weights: {} MiB on {}; kv cache: {} MiB", (w.len() * 4) >> 20, w.device().name(), (kv.len() * 2) >> 20);
    let before = mm.global_memory_stats().total.reserved_bytes.current;
    let slept = match mm.sleep(&SleepPolicy::new().offload("weights").discard("kv_cache")) {
        Ok(slept) => slept,
        Err(e) => {
            println!("this device cannot sleep: {e}");
            return Ok(());
        }
    };
    let asleep = mm.global_memory_stats().total;
    println!(
        "asleep: reserved {} MiB -> {} MiB; {} MiB offloaded, {} MiB given back, in {:?}",
        before >> 20,
        asleep.reserved_bytes.current >> 20,
        slept.bytes_offloaded >> 20,
        slept.bytes_released >> 20,
        slept.elapsed
    );
    match w.to_vec() {
        Err(e) if e.is_asleep() => println!("reading the weights now: {e}"),
        other => panic!("a sleeping buffer answered {other:?}"),
    }
    let woken = mm.wake(&[])?;
    println!("awake: {} MiB restored in {:?}", woken.bytes_restored >> 20, woken.elapsed);
    assert_eq!(w.to_vec()?, weights, "the weights came back");
    println!("the weights are back, bit for bit, at the same address");
    Ok(())
}

/// A half-precision value's bits (the example needs no arithmetic on them).
#[allow(non_camel_case_types)]
type f16_bits = u16;
