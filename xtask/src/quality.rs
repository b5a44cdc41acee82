//! `cargo xtask quality [--windows N] [--table-only]`: the recommended recipes on every
//! real model the cache folder holds and on outlier-injected variants of them, written as
//! `docs/results/quality.json` (the book's table `quality`, `cargo xtask docs --tables`).
//!
//! For each model (SmolLM2-135M, Gemma 3 270M) and variant (as shipped, and
//! `--inject-key-outliers` [`INJECTIONS`]), `rotkv calibrate` runs on each of the two
//! texts (first 2048 tokens), then `rotkv ppl --json` on the other text with that
//! calibration: `--kv` [`METHODS`] (with `--calib` a bare `k2v2` or `k4v2` is the
//! recipe: centering, the smoothing measured per layer and KV head, 8 detected sinks),
//! N windows of 1024 tokens (default 2), 16 tokens per decode step, quantized weights,
//! the cpu backend. Outputs go to `target/quality/`; `--table-only` rebuilds the JSON
//! from those. Not run by CI.

use crate::{cache_dir, cargo, root, run, target_dir};
use std::path::Path;
use std::process::Command;

/// The KV methods of each run: f16, the two recipes (bare names with `--calib`), and
/// KIVI-2 (simulated per-channel keys, no rotation) as the anchor from the literature.
pub const METHODS: &str = "f16,k2v2,k4v2,kivi2";

/// The outlier injections (`SEED,COUNT,SCALE`) every model is also measured with: 4
/// RoPE pairs per KV head scaled by 16, the issue's worst case.
pub const INJECTIONS: [&str; 1] = ["1,4,16"];

/// (evaluated text, calibration text).
const PAIRS: [(&str, &str); 2] = [("lcet10", "alice29"), ("alice29", "lcet10")];

/// (label, file under the cache folder, file name stem for outputs).
const MODELS: [(&str, &str, &str); 2] = [
    ("SmolLM2-135M", "models/SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2"),
    ("Gemma 3 270M", "models/gemma-3-270m-q4_k_m.gguf", "gemma3"),
];

fn variants() -> Vec<(String, Option<&'static str>)> {
    std::iter::once(("".to_string(), None))
        .chain(INJECTIONS.iter().map(|i| (format!("-inj{}", i.replace(',', "_")), Some(*i))))
        .collect()
}

/// `cargo xtask quality [--windows N] [--table-only]`.
pub fn quality(args: &[String]) -> Result<(), String> {
    let mut windows = 2usize;
    let mut table_only = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--table-only" => table_only = true,
            "--windows" => {
                windows = it.next().and_then(|n| n.parse().ok()).filter(|&n| n > 0).ok_or("--windows N (N > 0)")?;
            }
            other => {
                return Err(format!(
                    "unknown argument {other}; usage: cargo xtask quality [--windows N] [--table-only]"
                ));
            }
        }
    }
    let out = target_dir().join("quality");
    let started = std::time::Instant::now();
    if !table_only {
        let cache = cache_dir().map_err(|e| e.to_string())?;
        std::fs::create_dir_all(&out).map_err(|e| e.to_string())?;
        let mut build = cargo();
        build.args(["build", "--release", "--quiet", "-p", "rotkv", "--features", "cli", "--bin", "rotkv"]);
        if !run("build rotkv", build)? {
            return Err("building rotkv failed".into());
        }
        // The commit the measured binary is built from, recorded before the runs (the tree
        // may move on while they take their half hour).
        std::fs::write(out.join("commit.txt"), commit()).map_err(|e| e.to_string())?;
        let bin = target_dir().join("release").join(format!("rotkv{}", std::env::consts::EXE_SUFFIX));
        let rotkv = |inject: Option<&str>, args: &[&std::ffi::OsStr], stdout: &Path| -> Result<(), String> {
            let mut c = Command::new(&bin);
            c.args(["--weights", "quantized"]);
            if let Some(i) = inject {
                c.args(["--inject-key-outliers", i]);
            }
            c.args(args);
            c.stdout(std::fs::File::create(stdout).map_err(|e| e.to_string())?);
            if !run("rotkv", c)? {
                return Err(format!("rotkv failed (its output: {})", stdout.display()));
            }
            Ok(())
        };
        for (_, file, stem) in MODELS {
            let model = cache.join(file);
            if !model.exists() {
                return Err(format!("{} is missing: run cargo xtask fetch", model.display()));
            }
            for (suffix, inject) in variants() {
                for (_, calib_text) in PAIRS {
                    let t = cache.join(format!("text/{calib_text}.txt"));
                    let cal = out.join(format!("calib-{stem}{suffix}-{calib_text}.safetensors"));
                    let log = out.join(format!("calib-{stem}{suffix}-{calib_text}.txt"));
                    let args: [&std::ffi::OsStr; 9] = [
                        "calibrate".as_ref(),
                        "--model".as_ref(),
                        model.as_os_str(),
                        "--text".as_ref(),
                        t.as_os_str(),
                        "--tokens".as_ref(),
                        "2048".as_ref(),
                        "--out".as_ref(),
                        cal.as_os_str(),
                    ];
                    rotkv(inject, &args, &log)?;
                }
                for (text, calib_text) in PAIRS {
                    let t = cache.join(format!("text/{text}.txt"));
                    let cal = out.join(format!("calib-{stem}{suffix}-{calib_text}.safetensors"));
                    let w = windows.to_string();
                    let args: [&std::ffi::OsStr; 18] = [
                        "ppl".as_ref(),
                        "--model".as_ref(),
                        model.as_os_str(),
                        "--text".as_ref(),
                        t.as_os_str(),
                        "--ctx".as_ref(),
                        "1024".as_ref(),
                        "--windows".as_ref(),
                        w.as_ref(),
                        "--chunk".as_ref(),
                        "16".as_ref(),
                        "--backend".as_ref(),
                        "cpu".as_ref(),
                        "--kv".as_ref(),
                        METHODS.as_ref(),
                        "--calib".as_ref(),
                        cal.as_os_str(),
                        "--json".as_ref(),
                    ];
                    rotkv(inject, &args, &out.join(format!("ppl-{stem}{suffix}-{text}.json")))?;
                }
            }
        }
    }
    let json = table(&out, windows)?;
    let path = root().join("docs/results/quality.json");
    std::fs::write(&path, json).map_err(|e| format!("{}: {e}", path.display()))?;
    println!(
        "quality: wrote {} in {:.0} s; `cargo xtask docs --tables` puts it into the book",
        path.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// `HEAD`'s short hash, "with uncommitted changes" where tracked files differ from it.
fn commit() -> String {
    let commit = command_output("git", &["rev-parse", "--short", "HEAD"]).unwrap_or_else(|| "unknown".into());
    let dirty =
        command_output("git", &["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    if dirty { format!("{commit} with uncommitted changes") } else { commit }
}

fn command_output(program: &str, args: &[&str]) -> Option<String> {
    let o = Command::new(program).args(args).current_dir(root()).output().ok()?;
    o.status.success().then(|| String::from_utf8_lossy(&o.stdout).trim().to_string())
}

/// The results JSON (the format of `docs/results/*.json`) from the runs under `out`.
fn table(out: &Path, windows: usize) -> Result<String, String> {
    let mut rows = Vec::new();
    for (label, _, stem) in MODELS {
        for (suffix, inject) in variants() {
            for (text, calib_text) in PAIRS {
                let p = out.join(format!("ppl-{stem}{suffix}-{text}.json"));
                let s = std::fs::read_to_string(&p)
                    .map_err(|e| format!("{}: {e} (run cargo xtask quality)", p.display()))?;
                let v: serde_json::Value = serde_json::from_str(&s).map_err(|e| format!("{}: {e}", p.display()))?;
                if v["windows"].as_u64() != Some(windows as u64) {
                    return Err(format!("{} holds {} windows, not {windows}", p.display(), v["windows"]));
                }
                let results = v["results"].as_array().cloned().unwrap_or_default();
                let f16 = results.iter().find(|r| r["method"] == "f16").and_then(|r| r["ppl"].as_f64());
                let model = match inject {
                    Some(i) => format!("{label}, outliers {i}"),
                    None => label.to_string(),
                };
                for r in results.iter().filter(|r| r["method"] != "f16") {
                    let method = r["method"].as_str().unwrap_or("?");
                    let spelled = r["recipe"].as_str().map_or(method.to_string(), |full| format!("{method} ({full})"));
                    rows.push(vec![
                        model.clone(),
                        format!("{text} (calib. {calib_text})"),
                        spelled,
                        format!("{:.2}", r["bits_per_element"].as_f64().unwrap_or(f64::NAN)),
                        f16.map_or("-".into(), |x| format!("{x:.3}")),
                        format!("{:+.2}%", 100.0 * r["vs_f16"].as_f64().unwrap_or(f64::NAN)),
                        format!("{:.4}", r["kl_vs_f16"].as_f64().unwrap_or(f64::NAN)),
                        format!("{:.1}%", 100.0 * r["top1_vs_f16"].as_f64().unwrap_or(f64::NAN)),
                    ]);
                }
            }
        }
    }
    let commit = std::fs::read_to_string(out.join("commit.txt")).unwrap_or_else(|_| commit());
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| "processor not recorded".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let date = command_output("date", &["-u", "+%Y-%m-%d"]).unwrap_or_else(|| "not recorded".into());
    let doc = serde_json::json!({
        "title": format!(
            "The recipes against the f16 cache, {windows} windows of 1024 tokens per text, calibration from the other text"
        ),
        "command": format!("cargo xtask quality --windows {windows}"),
        "commit": commit.trim(),
        "machine": format!("{cores} cores, {cpu}"),
        "date": date,
        "notes": format!(
            "Each row: rotkv calibrate on the first 2048 tokens of the calibration text, then rotkv ppl --weights quantized \
             --ctx 1024 --windows {windows} --chunk 16 --backend cpu --kv {METHODS} --calib (with a calibration a bare \
             preset is the recipe); outliers SEED,COUNT,SCALE: --inject-key-outliers (the f16 perplexity is the model's own)."
        ),
        "columns": ["model", "text", "method", "bits", "f16 ppl", "vs f16", "KL", "top-1"],
        "align": ["l", "l", "l", "r", "r", "r", "r", "r"],
        "rows": rows,
    });
    serde_json::to_string_pretty(&doc).map(|s| s + "\n").map_err(|e| e.to_string())
}
