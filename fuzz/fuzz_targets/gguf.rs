//! cargo-fuzz target: the GGUF reader, tokenizer, llama load and a 3-token forward pass
//! (`tests/src/fuzz_harness.rs`).
#![no_main]

#[path = "../../tests/src/fuzz_harness.rs"]
#[allow(dead_code)]
mod harness;

libfuzzer_sys::fuzz_target!(|data: &[u8]| harness::gguf(data));
