//! Prints the kernel sets this CPU can run, one name per line (the names
//! `SDPA_KERNEL` takes), then the one `f32` calls use.
//!
//! ```text
//! cargo run --example kernel_sets
//! ```

fn main() {
    for set in sdpa::simd::available_kernel_sets() {
        println!("{set}");
    }
    match sdpa::simd::selected_kernel_set() {
        Ok(set) => eprintln!("selected: {set}"),
        Err(err) => eprintln!("SDPA_KERNEL: {err}"),
    }
}
