//! cargo-fuzz target: the calibration-file reader and its validation
//! (`tests/src/fuzz_harness.rs`).
#![no_main]

#[path = "../../tests/src/fuzz_harness.rs"]
#[allow(dead_code)]
mod harness;

libfuzzer_sys::fuzz_target!(|data: &[u8]| harness::calibration(data));
