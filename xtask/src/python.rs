//! `cargo xtask python`: the Python package (`python/`, outside the workspace) built and
//! tested, as one step of `ci`.
//!
//! 1. A virtual environment in `<cache>/python-venv` (made once) with the pinned
//!    [`PY_PACKAGES`] from PyPI, torch included (SKIPPED when PyPI cannot be reached).
//! 2. `cargo fmt --check` and `cargo clippy --all-targets -D warnings` on the package
//!    (its own manifest and lockfile; the workspace's fmt and clippy do not see it).
//! 3. The golden results: `cargo run --release --bin rotkv-golden` (the Rust API on a
//!    fixed scenario) into `target/python/golden`.
//! 4. `pip install --no-build-isolation ./python` (the README's install command, with the
//!    venv's pinned maturin as the build backend) into the venv.
//! 5. `pytest python/tests` with `ROTKV_GOLDEN` set, the examples' overhead script not
//!    included (it is a measurement).
//!
//! Every cargo build goes to `target/python` (release: the wheel and the golden program
//! share one build of rotkv).

use super::{Step, cache_dir, offline_or, root, target_dir};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The Python packages of the test environment, pinned (numpy 2.4 needs CPython 3.11 or
/// newer; the wheel itself is abi3 for 3.9 and newer). torch is PyPI's Linux wheel, which
/// brings its CUDA libraries (about 3 GB more; it does not import without them, even for
/// CPU tensors): on this machine the whole venv took 53 s to install and 5.4 GB of disk.
pub const PY_PACKAGES: &[&str] =
    &["maturin==1.16.0", "numpy==2.4.6", "pytest==9.2.0", "ml_dtypes==0.7.0", "torch==2.15.0"];

/// The venv's python, after making the venv and installing [`PY_PACKAGES`] when missing
/// (a stamp file names what is installed).
fn venv() -> Result<PathBuf, Step> {
    let dir = cache_dir()?.join("python-venv");
    let python = dir.join("bin").join("python");
    let stamp = dir.join("rotkv-packages.txt");
    let want = PY_PACKAGES.join("\n");
    if std::fs::read_to_string(&stamp).is_ok_and(|s| s == want) && python.exists() {
        return Ok(python);
    }
    println!("python: making {} with {}", dir.display(), PY_PACKAGES.join(" "));
    let status = Command::new("python3").args(["-m", "venv", "--clear"]).arg(&dir).status();
    if !matches!(status, Ok(s) if s.success()) {
        return Err(Step::Skipped("python3 -m venv failed (no python3 with venv here)".into()));
    }
    let status = Command::new(&python)
        .args(["-m", "pip", "install", "--quiet", "--only-binary=:all:"])
        .args(PY_PACKAGES)
        .status();
    if !matches!(status, Ok(s) if s.success()) {
        return Err(offline_or("pypi.org", format!("cannot install {} with pip", PY_PACKAGES.join(" "))));
    }
    std::fs::write(&stamp, want).map_err(|e| Step::Failed(format!("{}: {e}", stamp.display())))?;
    Ok(python)
}

/// A cargo command on the package's manifest, building in `target/python`.
fn cargo_python(python: &Path, args: &[&str]) -> Command {
    let mut c = super::cargo();
    c.args(args).arg("--manifest-path").arg(root().join("python/Cargo.toml"));
    c.env("CARGO_TARGET_DIR", target_dir().join("python")).env("PYO3_PYTHON", python);
    c
}

fn ok(what: &str, c: Command) -> Result<(), Step> {
    match super::run(what, c) {
        Ok(true) => Ok(()),
        Ok(false) => Err(Step::Failed(format!("{what} failed"))),
        Err(e) => Err(Step::Failed(e)),
    }
}

/// The step; `Ok` with pytest's (passed, failed, skipped) counts.
pub fn python() -> Result<(u64, u64, u64), Step> {
    let python = venv()?;
    let mut fmt = cargo_python(&python, &["fmt"]);
    fmt.args(["--", "--check"]);
    ok("python: format", fmt)?;
    let mut clippy = cargo_python(&python, &["clippy", "--all-targets"]);
    clippy.args(["--", "-D", "warnings"]);
    ok("python: clippy", clippy)?;
    let golden = target_dir().join("python").join("golden");
    let mut c = cargo_python(&python, &["run", "--quiet", "--release", "--bin", "rotkv-golden"]);
    c.arg("--").arg(&golden);
    ok("python: golden results of the Rust API", c)?;
    let mut pip = Command::new(&python);
    pip.current_dir(root()).args(["-m", "pip", "install", "--quiet", "--no-build-isolation", "--no-deps", "./python"]);
    // The build backend runs the venv's `maturin` by name.
    let bin = python.parent().map(Path::to_path_buf).unwrap_or_default();
    let path = std::env::join_paths(
        std::iter::once(bin).chain(std::env::var_os("PATH").iter().flat_map(std::env::split_paths)),
    )
    .map_err(|e| Step::Failed(format!("PATH: {e}")))?;
    pip.env("CARGO_TARGET_DIR", target_dir().join("python")).env("PATH", path).env("PYO3_PYTHON", &python);
    ok("python: pip install ./python", pip)?;
    let mut pytest = Command::new(&python);
    pytest.current_dir(root()).args(["-m", "pytest", "-rs", "-p", "no:cacheprovider", "python/tests"]);
    // The real-model inputs `cargo xtask fetch` put in the cache folder (the calibration
    // test skips without them).
    pytest.env("ROTKV_GOLDEN", &golden).env("ROTKV_CACHE_DIR", cache_dir()?).env_remove("PYTHONPATH");
    println!("\n==> python: pytest: {pytest:?}");
    let out = pytest.output().map_err(|e| Step::Failed(format!("pytest: {e}")))?;
    let text = String::from_utf8_lossy(&out.stdout);
    print!("{text}{}", String::from_utf8_lossy(&out.stderr));
    let counts = pytest_counts(&text);
    if !out.status.success() {
        return Err(Step::Failed(format!("pytest failed ({} passed, {} failed)", counts.0, counts.1)));
    }
    Ok(counts)
}

/// (passed, failed, skipped) from pytest's closing line ("== 20 passed, 1 skipped in 5s ==").
fn pytest_counts(out: &str) -> (u64, u64, u64) {
    let last = out.lines().rev().find(|l| l.contains(" in ") && l.starts_with('=')).unwrap_or("");
    let num = |key: &str| -> u64 {
        let words: Vec<&str> = last.split(|c: char| c == ',' || c.is_whitespace()).filter(|w| !w.is_empty()).collect();
        words.windows(2).find(|w| w[1] == key).and_then(|w| w[0].parse().ok()).unwrap_or(0)
    };
    (num("passed"), num("failed") + num("error") + num("errors"), num("skipped"))
}

#[cfg(test)]
mod tests {
    use super::pytest_counts;

    #[test]
    fn reads_pytest_closing_lines() {
        assert_eq!(pytest_counts("x\n======= 20 passed in 5.68s =======\n"), (20, 0, 0));
        assert_eq!(pytest_counts("== 1 failed, 19 passed, 2 skipped in 4.64s ==\n"), (19, 1, 2));
        assert_eq!(pytest_counts("== 3 passed, 1 error in 1.0s ==\n"), (3, 1, 0));
        assert_eq!(pytest_counts("nothing"), (0, 0, 0));
    }
}
