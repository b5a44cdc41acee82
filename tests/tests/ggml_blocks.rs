//! The GGUF reader's dequantization of every ggml block type it reads, against the
//! values gguf-py (llama.cpp's Python package, an independent implementation) gives for
//! the same random blocks (`data/ggml_blocks.json`, made by `data/make_ggml_blocks.py`).

use rotkv::model::gguf::{dequantize, type_name};

#[test]
fn dequantization_matches_gguf_py() {
    let path = rotkv_tests::repo_data().join("ggml_blocks.json");
    let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let cases = doc.as_object().unwrap();
    assert_eq!(cases.len(), 7, "Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K");
    for (name, case) in cases {
        let kind = case["type"].as_u64().unwrap() as u32;
        assert_eq!(type_name(kind), name);
        let hex = case["bytes"].as_str().unwrap();
        let bytes: Vec<u8> =
            (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect();
        let want: Vec<f32> = case["values"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
        let got = dequantize(kind, &bytes).unwrap();
        assert_eq!(got.len(), want.len(), "{name}");
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            // Both compute in f32 from the same f16 fields; products may round differently.
            assert!((a - b).abs() <= 1e-6 * b.abs().max(1.0), "{name}[{i}]: {a} vs {b}");
        }
        // A block cut short is an error, not a panic.
        assert!(dequantize(kind, &bytes[..bytes.len() - 1]).is_err(), "{name}");
    }
}
