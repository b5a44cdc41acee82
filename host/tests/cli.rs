//! The `rotkv` program as a user runs it.

use std::process::Command;

fn rotkv(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_rotkv")).args(args).output().expect("rotkv runs");
    assert!(out.status.success(), "rotkv {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("utf-8 output")
}

fn data(name: &str) -> String {
    format!("{}/../data/{name}", env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn eval_json_reproduces_the_numpy_metrics() {
    let out = rotkv(&["eval", "--input", &data("smollm2-alice-kv-l0-l5.safetensors"), "--json"]);
    let got: serde_json::Value = serde_json::from_str(&out).expect("one JSON object");
    let want: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(data("smollm2-alice-kv.metrics.json")).unwrap()).unwrap();
    assert_eq!(got["file"], "smollm2-alice-kv-l0-l5.safetensors");
    let layers = got["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 2);
    for layer in layers {
        let w = &want["layers"][layer["layer"].to_string()];
        for m in layer["methods"].as_array().unwrap() {
            let name = m["name"].as_str().unwrap();
            let Some(expect) = w["attn_rel_err"][name].as_f64() else { continue };
            for (key, tol) in [("k_rel_err", 0.01), ("v_rel_err", 0.01), ("attn_rel_err", 0.03)] {
                let (g, e) = (m[key].as_f64().unwrap(), w[key][name].as_f64().unwrap());
                assert!((g - e).abs() / e <= tol, "{name} {key}: {g} vs {e} ({expect})");
            }
        }
    }
}

#[test]
fn configs_lists_every_config_with_72_bytes_for_the_reference_point() {
    let out = rotkv(&["configs"]);
    assert_eq!(out.lines().count(), 1 + rotkv::SUPPORTED.len());
    assert!(out.lines().any(|l| l.split_whitespace().collect::<Vec<_>>()[..5] == ["128", "2", "2", "128", "72"]));
}

#[test]
fn bad_arguments_fail_with_a_message() {
    let out = Command::new(env!("CARGO_BIN_EXE_rotkv"))
        .args(["eval", "--input", "/nonexistent.safetensors"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("nonexistent"));
    // The model commands: a missing model file and an unknown KV method are named.
    let fail = |args: &[&str], says: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_rotkv")).args(args).output().unwrap();
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{args:?}: {err}");
    };
    fail(&["ppl", "--model", "/nonexistent.gguf", "--text", "/dev/null"], "nonexistent.gguf");
    fail(
        &["ppl", "--weights", "q3", "--model", "/no.gguf", "--text", "/dev/null"],
        "invalid value 'q3' for '--weights",
    );
    fail(&["ppl", "--weights", "quantized", "--model", "/no.gguf", "--text", "/dev/null"], "no.gguf");
    fail(&["capture", "--model", "/no.gguf", "--text", "/dev/null", "--out", "/tmp/x"], "no.gguf");
    // A file that is not GGUF (the bundled safetensors tile).
    let tile = data("smollm2-alice-kv-l0-l5.safetensors");
    fail(&["generate", "--model", &tile, "--prompt", "hi"], "not a GGUF file");
    // Calibration methods this build does not have are named, before any work.
    fail(
        &["calibrate", "--model", &tile, "--text", "/dev/null", "--out", "/tmp/x", "--methods", "center,bogus"],
        "bogus",
    );
    fail(&["calibrate", "--model", &tile, "--text", "/dev/null", "--out", "/tmp/x", "--methods", "sinks"], "prefill");
    fail(&["ppl", "--model", &tile, "--text", "/dev/null", "--calib", "/nonexistent.calib"], "nonexistent.calib");
}

#[test]
fn demo_runs_and_prints_its_sections() {
    let out = rotkv(&["demo"]);
    for needle in ["72 B per token per KV head", "k2v2_s4_w128", "32K-token cache", "CPU decode", "speedup"] {
        assert!(out.contains(needle), "demo output lacks {needle:?}:\n{out}");
    }
}

#[test]
fn token_count_overflows_are_errors_not_panics() {
    let huge = (u64::MAX / 2).to_string();
    let out = Command::new(env!("CARGO_BIN_EXE_rotkv"))
        .args(["ppl", "--model", "/nonexistent.gguf", "--text", "/dev/null", "--ctx", &huge, "--windows", "4"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("4 windows of") && err.contains("too many tokens") && !err.contains("panicked"), "{err}");
}
