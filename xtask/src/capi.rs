//! The C API's steps: `cargo xtask header [--check]` (include/rotkv.h from capi/ by a
//! pinned cbindgen, installed from crates.io into the cache folder once) and `cargo xtask
//! capi` (capi/tests/smoke.c compiled with the system `cc` against the staticlib, run on
//! the emulated device; the header also checked as C++). Both are steps of `ci`.

use super::{Step, cache_dir, offline_or, root, target_dir};
use std::path::PathBuf;
use std::process::Command;

/// The cbindgen that writes the committed header.
pub const CBINDGEN_VERSION: &str = "0.29.2";
const HEADER: &str = "include/rotkv.h";

/// `<cache>/cbindgen-<version>/bin/cbindgen`, installed with `cargo install --locked`
/// when missing (its build in `target/cbindgen`).
fn cbindgen() -> Result<PathBuf, Step> {
    let dir = cache_dir()?.join(format!("cbindgen-{CBINDGEN_VERSION}"));
    let bin = dir.join("bin").join("cbindgen");
    if bin.exists() {
        return Ok(bin);
    }
    println!("installing cbindgen {CBINDGEN_VERSION} into {}", dir.display());
    let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["install", "--quiet", "--locked", "cbindgen", "--version", &format!("={CBINDGEN_VERSION}")])
        .arg("--root")
        .arg(&dir)
        .arg("--target-dir")
        .arg(target_dir().join("cbindgen"))
        .status();
    if !matches!(status, Ok(s) if s.success()) || !bin.exists() {
        return Err(offline_or("index.crates.io", format!("cannot install cbindgen {CBINDGEN_VERSION}")));
    }
    Ok(bin)
}

/// Writes include/rotkv.h, or with `check` fails when the committed one differs from
/// what cbindgen writes now.
pub fn header(check: bool) -> Result<(), Step> {
    let bin = cbindgen()?;
    let fresh = target_dir().join("rotkv.h.new");
    std::fs::create_dir_all(target_dir()).map_err(|e| Step::Failed(e.to_string()))?;
    let out = Command::new(&bin)
        .current_dir(root())
        .args(["--quiet", "--config", "capi/cbindgen.toml", "--crate", "rotkv-capi", "--output"])
        .arg(&fresh)
        .output()
        .map_err(|e| Step::Failed(format!("cbindgen: {e}")))?;
    if !out.status.success() {
        return Err(Step::Failed(format!("cbindgen failed: {}", String::from_utf8_lossy(&out.stderr))));
    }
    let new = std::fs::read_to_string(&fresh).map_err(|e| Step::Failed(format!("{}: {e}", fresh.display())))?;
    let path = root().join(HEADER);
    if check {
        let old = std::fs::read_to_string(&path).unwrap_or_default();
        if old != new {
            return Err(Step::Failed(format!("{HEADER} is stale: run `cargo xtask header` and commit it")));
        }
        println!("{HEADER} is fresh (cbindgen {CBINDGEN_VERSION})");
        return Ok(());
    }
    std::fs::write(&path, new).map_err(|e| Step::Failed(e.to_string()))?;
    println!("wrote {HEADER}");
    Ok(())
}

/// Builds `target/debug/librotkv_capi.a` in the test profile (with `Some(features)`: the
/// workspace's libraries with them, which `ci`'s test step has already built, so nothing
/// is rebuilt; `None`: the crate alone), compiles capi/tests/smoke.c with `cc` against it
/// and runs it.
pub fn smoke(features: Option<&str>) -> Result<(), Step> {
    if Command::new("cc").arg("--version").output().is_err() {
        return Err(Step::Skipped("no C compiler (`cc`) here".into()));
    }
    let mut c = super::cargo();
    c.args(["build", "--quiet", "--profile", "test", "--lib"]);
    match features {
        Some(f) => c.args(["--workspace", "--features", f]),
        None => c.args(["-p", "rotkv-capi"]),
    };
    if !super::run("capi: the staticlib", c).map_err(Step::Failed)? {
        return Err(Step::Failed("building librotkv_capi.a failed".into()));
    }
    let lib = target_dir().join("debug").join("librotkv_capi.a");
    let exe = target_dir().join("capi-smoke");
    let mut cc = Command::new("cc");
    cc.current_dir(root()).args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-Iinclude", "capi/tests/smoke.c"]);
    cc.arg(&lib).args(["-lpthread", "-ldl", "-lm", "-o"]).arg(&exe);
    if !super::run("capi: cc smoke.c", cc).map_err(Step::Failed)? {
        return Err(Step::Failed("compiling capi/tests/smoke.c failed".into()));
    }
    if !super::run("capi: smoke test", Command::new(&exe)).map_err(Step::Failed)? {
        return Err(Step::Failed("capi/tests/smoke.c failed".into()));
    }
    // The header is also C++ (`extern "C"`, no C-only syntax).
    if Command::new("c++").arg("--version").output().is_err() {
        println!("SKIPPED: capi: the header as C++ (no `c++` here)");
        return Ok(());
    }
    let mut cxx = Command::new("c++");
    cxx.current_dir(root()).args(["-std=c++17", "-Wall", "-Werror", "-fsyntax-only", "-x", "c++", HEADER]);
    if !super::run("capi: the header as C++", cxx).map_err(Step::Failed)? {
        return Err(Step::Failed(format!("{HEADER} does not compile as C++")));
    }
    Ok(())
}
