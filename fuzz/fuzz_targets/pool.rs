//! cargo-fuzz target: arbitrary pools, side stores, block tables and lengths through the paged decode (reference and cpu)
//! (`tests/src/fuzz_harness.rs`).
#![no_main]

#[path = "../../tests/src/fuzz_harness.rs"]
#[allow(dead_code)]
mod harness;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    harness::pool(data);
});
