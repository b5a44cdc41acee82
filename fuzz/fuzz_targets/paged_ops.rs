//! cargo-fuzz target: KvCache operation sequences on the cpu backend against the reference
//! (`tests/src/fuzz_harness.rs`).
#![no_main]

#[path = "../../tests/src/fuzz_harness.rs"]
#[allow(dead_code)]
mod harness;

libfuzzer_sys::fuzz_target!(|data: &[u8]| harness::paged_ops(data));
