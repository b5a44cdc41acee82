//! `cargo xtask <command>`: the project's automation.
//!
//! - `ci`: format check, clippy (warnings denied), the whole test suite. Every step runs;
//!   the command fails if any step failed. A step whose tool cannot be installed prints
//!   `SKIPPED: <why>` and the rest still runs.
//! - `bench-table`: the decode benchmark table (markdown) from criterion's results in
//!   `target/criterion` (run `cargo bench -p rotkv-benches --bench cpu -- decode` first).

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("ci") => ci(),
        Some("bench-table") => bench_table(),
        _ => {
            eprintln!("usage: cargo xtask <ci | bench-table>");
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask sits in the workspace").to_path_buf()
}

fn cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root());
    c
}

/// Runs a command, echoing it; Ok(true) when it succeeded.
fn run(what: &str, mut cmd: Command) -> Result<bool, String> {
    println!("\n==> {what}: {cmd:?}");
    let status = cmd.status().map_err(|e| format!("{what}: cannot start: {e}"))?;
    Ok(status.success())
}

/// Makes sure a rustup component (rustfmt, clippy) is installed for the active toolchain.
fn ensure_component(name: &str, probe: &[&str]) -> Result<(), String> {
    let ok = cargo().args(probe).output().map(|o| o.status.success()).unwrap_or(false);
    if ok {
        return Ok(());
    }
    println!("installing rustup component {name}");
    let status = Command::new("rustup").args(["component", "add", name]).status();
    match status {
        Ok(s) if s.success() => Ok(()),
        Ok(s) => Err(format!("rustup component add {name} exited with {s}")),
        Err(e) => Err(format!("rustup not available: {e}")),
    }
}

fn ci() -> Result<(), String> {
    let mut failed = Vec::new();
    let mut skipped = Vec::new();

    match ensure_component("rustfmt", &["fmt", "--version"]) {
        Ok(()) => {
            let mut c = cargo();
            c.args(["fmt", "--all", "--", "--check"]);
            if !run("format", c)? {
                failed.push("format");
            }
        }
        Err(why) => {
            println!("SKIPPED: format check: {why}");
            skipped.push("format");
        }
    }
    match ensure_component("clippy", &["clippy", "--version"]) {
        Ok(()) => {
            let mut c = cargo();
            c.args(["clippy", "--workspace", "--all-targets", "--all-features", "--", "-D", "warnings"]);
            if !run("clippy", c)? {
                failed.push("clippy");
            }
        }
        Err(why) => {
            println!("SKIPPED: clippy: {why}");
            skipped.push("clippy");
        }
    }
    let mut c = cargo();
    c.args(["test", "--workspace", "--all-features"]);
    if !run("tests", c)? {
        failed.push("tests");
    }

    println!();
    if !skipped.is_empty() {
        println!("SKIPPED steps: {}", skipped.join(", "));
    }
    if failed.is_empty() {
        println!("xtask ci: all steps passed");
        Ok(())
    } else {
        Err(format!("failed steps: {}", failed.join(", ")))
    }
}

/// One criterion result: median time (ns) and bytes per iteration.
struct Result1 {
    median_ns: f64,
    bytes: Option<f64>,
}

fn read_result(dir: &Path) -> Option<Result1> {
    let est: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("new/estimates.json")).ok()?).ok()?;
    let bench: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("new/benchmark.json")).ok()?).ok()?;
    Some(Result1 { median_ns: est["median"]["point_estimate"].as_f64()?, bytes: bench["throughput"]["Bytes"].as_f64() })
}

fn bench_table() -> Result<(), String> {
    let base = root().join("target/criterion");
    let mut groups: Vec<PathBuf> = std::fs::read_dir(&base)
        .map_err(|e| format!("{}: {e} (run the benchmarks first)", base.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("decode_")))
        .collect();
    groups.sort();
    println!("| shape | context | k2v2 ms | f16 ms | memcpy ms | k2v2 GB/s | f16 GB/s | memcpy GB/s | k2v2 speedup |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for g in groups {
        let shape = g.file_name().unwrap().to_string_lossy().trim_start_matches("decode_").to_string();
        let mut ctxs: Vec<u64> = std::fs::read_dir(g.join("k2v2"))
            .map_err(|e| e.to_string())?
            .filter_map(|e| e.ok()?.file_name().to_string_lossy().parse().ok())
            .collect();
        ctxs.sort_unstable();
        for ctx in ctxs {
            let get = |f: &str| read_result(&g.join(f).join(ctx.to_string()));
            let (Some(q), Some(h), Some(m)) = (get("k2v2"), get("f16"), get("memcpy_f16_size")) else { continue };
            let gbs = |r: &Result1| r.bytes.map_or(f64::NAN, |b| b / r.median_ns);
            println!(
                "| {shape} | {ctx} | {:.2} | {:.2} | {:.2} | {:.1} | {:.1} | {:.1} | {:.2}x |",
                q.median_ns / 1e6,
                h.median_ns / 1e6,
                m.median_ns / 1e6,
                gbs(&q),
                gbs(&h),
                gbs(&m),
                h.median_ns / q.median_ns
            );
        }
    }
    Ok(())
}
