//! `cargo xtask docs`: the book under `docs/` (mdBook), its generated results tables and
//! its link check.
//!
//! - Results tables: every `docs/results/<name>.json` holds one recorded run (the command
//!   line, commit, machine, date, notes, the column names, their alignment and the rows).
//!   A chapter (or the README) holds the table between `<!-- table:<name> -->` and
//!   `<!-- /table -->`; `cargo xtask docs --tables` rewrites what lies between from the
//!   JSON, and [`check_tables`] (a test of this crate, so `cargo test --workspace` runs it,
//!   and a step of `ci`) fails when a table no longer matches its JSON. An opening marker
//!   may pick rows and columns (`<!-- table:<name> rows=0,1 cols=0,2,3 -->`, indices into
//!   the JSON's lists) for a shorter table, as the README's headline tables do.
//! - Links: [`check_links`] reads the markdown of the book, the README and the CHANGELOG:
//!   every relative link must name a file that exists and every `#anchor` a heading of
//!   its target (mdBook's and GitHub's heading ids), no network. A chapter's links stay
//!   inside `docs/src` (the built book holds nothing else), and every chapter is listed in
//!   `SUMMARY.md`.
//! - The book: mdBook [`MDBOOK_VERSION`] from crates.io, installed once with `cargo install
//!   --locked` into `<cache>/mdbook-<version>` (the cache folder of `fetch`), built into
//!   `target/book`; `--serve` builds it and serves it as static files (Python's
//!   `http.server` on port 3000). Where it cannot be installed the build says
//!   SKIPPED and the table and link checks still run.

use crate::{Step, cache_dir, offline_or, root, target_dir};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The mdBook release the book is built with.
pub const MDBOOK_VERSION: &str = "0.5.4";
/// Its features: the search index only, without the live-reload server and file watcher
/// (measured cold on two shared cores: 2 min 18 s of user CPU against 3 min 22 s with the
/// default features).
const MDBOOK_FEATURES: &str = "search";

/// `cargo xtask docs [--tables | --check | --serve]`.
pub fn docs(arg: Option<&str>) -> Result<(), String> {
    let root = root();
    match arg {
        Some("--tables") => {
            let changed = write_tables(&root)?;
            println!("docs: {} file(s) rewritten from docs/results/*.json", changed.len());
            for f in changed {
                println!("  {}", f.display());
            }
            Ok(())
        }
        Some("--check") => checks(&root),
        Some("--serve") => {
            book().map_err(|e| e.to_string())?;
            // mdBook is installed without its server (a third less to compile in CI), so
            // the built book is served as static files.
            let out = target_dir().join("book");
            println!("serving {} at http://localhost:3000 (Ctrl-C stops it)", out.display());
            let mut c = Command::new("python3");
            c.args(["-m", "http.server", "3000", "--bind", "127.0.0.1", "--directory"]).arg(&out);
            crate::sanitize::status(c).map_err(|e| format!("{e} (open {} instead)", out.join("index.html").display()))
        }
        None => book().map_err(|e| e.to_string()),
        Some(other) => Err(format!("unknown argument {other}; usage: cargo xtask docs [--tables | --check | --serve]")),
    }
}

/// The table and link checks (no tools needed).
fn checks(root: &Path) -> Result<(), String> {
    let mut problems = check_tables(root)?;
    problems.extend(check_links(root)?);
    if problems.is_empty() {
        println!("docs: every generated table matches its JSON and every link resolves");
        Ok(())
    } else {
        Err(format!("docs: {} problem(s):\n  {}", problems.len(), problems.join("\n  ")))
    }
}

/// `ci`'s book step: the table and link checks, then the book built with mdBook (SKIPPED
/// where mdBook cannot be installed).
pub fn book() -> Result<(), Step> {
    let root = root();
    checks(&root).map_err(Step::Failed)?;
    let mdbook = ensure_mdbook()?;
    let mut c = Command::new(mdbook);
    c.arg("build").arg(root.join("docs")).arg("--dest-dir").arg(target_dir().join("book"));
    crate::sanitize::status(c)?;
    let out = target_dir().join("book");
    let problems = check_html(&out).map_err(Step::Failed)?;
    if !problems.is_empty() {
        return Err(Step::Failed(format!("the built book: {}", problems.join("; "))));
    }
    println!("book: {} (every internal link and anchor of its HTML resolves)", out.join("index.html").display());
    Ok(())
}

/// One line per `href` of the built book's pages that names a missing file or an `id` its
/// page lacks (links with a scheme are not followed: no network).
fn check_html(book: &Path) -> Result<Vec<String>, String> {
    let mut problems = Vec::new();
    let pages: Vec<PathBuf> = std::fs::read_dir(book)
        .map_err(|e| format!("{}: {e}", book.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "html"))
        .collect();
    let read = |p: &Path| std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()));
    for page in &pages {
        let html = read(page)?;
        for href in html.split("href=\"").skip(1).filter_map(|s| s.split('"').next()) {
            if href.contains(':') || href.is_empty() {
                continue;
            }
            let (path, anchor) = href.split_once('#').unwrap_or((href, ""));
            let dest = if path.is_empty() { page.clone() } else { normalize(&book.join(path)) };
            if !dest.exists() {
                problems.push(format!("{}: href `{href}`: no such file", page.display()));
            } else if !anchor.is_empty() && !read(&dest)?.contains(&format!("id=\"{anchor}\"")) {
                problems.push(format!("{}: href `{href}`: no id `{anchor}`", page.display()));
            }
        }
    }
    Ok(problems)
}

/// The mdBook binary: installed once into the cache folder.
fn ensure_mdbook() -> Result<PathBuf, Step> {
    let dir = cache_dir()?.join(format!("mdbook-{MDBOOK_VERSION}-{MDBOOK_FEATURES}"));
    let bin = dir.join("bin").join("mdbook");
    if bin.is_file() {
        return Ok(bin);
    }
    println!("installing mdbook {MDBOOK_VERSION} into {} (once)", dir.display());
    let mut c = crate::cargo();
    c.args(["install", "mdbook", "--version", MDBOOK_VERSION, "--locked", "--no-default-features"]);
    c.args(["--features", MDBOOK_FEATURES, "--root"]).arg(&dir);
    // Its own target folder under ours, kept, so that an interrupted install resumes.
    c.arg("--target-dir").arg(target_dir().join("mdbook-build"));
    crate::sanitize::status(c)
        .map_err(|e| offline_or("index.crates.io", format!("mdbook {MDBOOK_VERSION} cannot be installed: {e}")))?;
    if bin.is_file() { Ok(bin) } else { Err(Step::Skipped(format!("no {} after the install", bin.display()))) }
}

/// One recorded run: `docs/results/<name>.json`.
struct Recorded {
    title: String,
    command: String,
    commit: String,
    machine: String,
    date: String,
    notes: String,
    columns: Vec<String>,
    align: Vec<String>,
    rows: Vec<Vec<String>>,
}

fn load(root: &Path, name: &str) -> Result<Recorded, String> {
    let path = root.join("docs").join("results").join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let field = |k: &str| -> Result<String, String> {
        v.get(k)
            .and_then(|x| x.as_str())
            .map(str::to_string)
            .ok_or_else(|| format!("{}: no string `{k}`", path.display()))
    };
    let strings = |x: &serde_json::Value| -> Option<Vec<String>> {
        x.as_array()?.iter().map(|s| s.as_str().map(str::to_string)).collect()
    };
    let list = |k: &str| -> Result<Vec<String>, String> {
        v.get(k).and_then(strings).ok_or_else(|| format!("{}: `{k}` is not a list of strings", path.display()))
    };
    let rows: Vec<Vec<String>> = v
        .get("rows")
        .and_then(|r| r.as_array()?.iter().map(strings).collect())
        .ok_or_else(|| format!("{}: `rows` is not a list of lists of strings", path.display()))?;
    let rec = Recorded {
        title: field("title")?,
        command: field("command")?,
        commit: field("commit")?,
        machine: field("machine")?,
        date: field("date")?,
        notes: v.get("notes").and_then(|x| x.as_str()).unwrap_or("").to_string(),
        columns: list("columns")?,
        align: list("align")?,
        rows,
    };
    if rec.align.len() != rec.columns.len() || rec.rows.iter().any(|r| r.len() != rec.columns.len()) {
        return Err(format!("{}: every row and `align` need one entry per column", path.display()));
    }
    Ok(rec)
}

/// A marker's selection: `rows=0,2 cols=0,1` (indices), all when absent.
struct Pick {
    rows: Option<Vec<usize>>,
    cols: Option<Vec<usize>>,
}

fn parse_pick(attrs: &str) -> Result<Pick, String> {
    let mut pick = Pick { rows: None, cols: None };
    for a in attrs.split_whitespace() {
        let (k, v) = a.split_once('=').ok_or_else(|| format!("marker attribute `{a}` is not key=list"))?;
        let list = v
            .split(',')
            .map(|n| n.parse::<usize>().map_err(|_| format!("marker attribute `{a}`: `{n}` is not an index")))
            .collect::<Result<Vec<_>, _>>()?;
        match k {
            "rows" => pick.rows = Some(list),
            "cols" => pick.cols = Some(list),
            _ => return Err(format!("marker attribute `{k}`: only rows= and cols=")),
        }
    }
    Ok(pick)
}

/// The markdown between the markers for `rec` (without the marker lines).
fn render(name: &str, rec: &Recorded, pick: &Pick) -> Result<String, String> {
    let all_cols: Vec<usize> = (0..rec.columns.len()).collect();
    let all_rows: Vec<usize> = (0..rec.rows.len()).collect();
    let cols = pick.cols.as_ref().unwrap_or(&all_cols);
    let rows = pick.rows.as_ref().unwrap_or(&all_rows);
    if let Some(&c) = cols.iter().find(|&&c| c >= rec.columns.len()) {
        return Err(format!("table {name}: column {c} is past its {} columns", rec.columns.len()));
    }
    if let Some(&r) = rows.iter().find(|&&r| r >= rec.rows.len()) {
        return Err(format!("table {name}: row {r} is past its {} rows", rec.rows.len()));
    }
    let mut s = String::new();
    let notes = if rec.notes.is_empty() { String::new() } else { format!(" {}", rec.notes) };
    let _ = writeln!(
        s,
        "*{}.* Recorded run: `{}`; commit: {}; machine: {}; date: {}.{notes} (Generated from \
         `docs/results/{name}.json` by `cargo xtask docs --tables`.)",
        rec.title, rec.command, rec.commit, rec.machine, rec.date
    );
    s.push('\n');
    let line = |cells: Vec<&str>| format!("| {} |\n", cells.join(" | "));
    s.push_str(&line(cols.iter().map(|&c| rec.columns[c].as_str()).collect()));
    s.push_str(&line(cols.iter().map(|&c| if rec.align[c] == "r" { "---:" } else { "---" }).collect()));
    for &r in rows {
        s.push_str(&line(cols.iter().map(|&c| rec.rows[r][c].as_str()).collect()));
    }
    Ok(s)
}

const OPEN: &str = "<!-- table:";
const CLOSE: &str = "<!-- /table -->";

/// `text` with every table between markers generated from its JSON.
fn regenerate(root: &Path, text: &str) -> Result<String, String> {
    let mut out = String::new();
    let mut rest = text;
    while let Some(start) = rest.find(OPEN) {
        let end_of_open = rest[start..].find("-->").ok_or("a table marker is not closed with -->")? + start + 3;
        let spec = rest[start + OPEN.len()..end_of_open - 3].trim();
        let (name, attrs) = spec.split_once(char::is_whitespace).unwrap_or((spec, ""));
        let close = rest[end_of_open..].find(CLOSE).ok_or_else(|| format!("table {name}: no {CLOSE}"))? + end_of_open;
        let body = render(name, &load(root, name)?, &parse_pick(attrs)?)?;
        out.push_str(&rest[..end_of_open]);
        out.push_str("\n\n");
        out.push_str(&body);
        out.push('\n');
        rest = &rest[close..];
    }
    out.push_str(rest);
    Ok(out)
}

/// The markdown files that may hold generated tables or links: the book's chapters, the
/// README and the CHANGELOG.
fn markdown_files(root: &Path) -> Result<Vec<PathBuf>, String> {
    let mut files = vec![root.join("README.md"), root.join("CHANGELOG.md")];
    let src = root.join("docs").join("src");
    let mut chapters: Vec<PathBuf> = std::fs::read_dir(&src)
        .map_err(|e| format!("{}: {e}", src.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    chapters.sort();
    files.extend(chapters);
    Ok(files.into_iter().filter(|p| p.is_file()).collect())
}

/// Rewrites every file whose tables differ from their JSON; returns those files.
fn write_tables(root: &Path) -> Result<Vec<PathBuf>, String> {
    let mut changed = Vec::new();
    for f in markdown_files(root)? {
        let text = std::fs::read_to_string(&f).map_err(|e| format!("{}: {e}", f.display()))?;
        let new = regenerate(root, &text).map_err(|e| format!("{}: {e}", f.display()))?;
        if new != text {
            std::fs::write(&f, new).map_err(|e| format!("{}: {e}", f.display()))?;
            changed.push(f);
        }
    }
    Ok(changed)
}

/// One line per file whose generated tables no longer match their JSON.
pub fn check_tables(root: &Path) -> Result<Vec<String>, String> {
    let mut problems = Vec::new();
    for f in markdown_files(root)? {
        let text = std::fs::read_to_string(&f).map_err(|e| format!("{}: {e}", f.display()))?;
        match regenerate(root, &text) {
            Ok(new) if new == text => {}
            Ok(_) => problems.push(format!(
                "{}: a generated table differs from its docs/results JSON (run `cargo xtask docs --tables`)",
                f.display()
            )),
            Err(e) => problems.push(format!("{}: {e}", f.display())),
        }
    }
    Ok(problems)
}

/// The heading ids of a markdown file, as mdBook and GitHub derive them: lowercase; letters,
/// digits, `-` and `_` kept; spaces become `-`; everything else dropped; a repeated id gets
/// `-1`, `-2`, ...
fn heading_ids(text: &str) -> Vec<String> {
    let mut ids: Vec<String> = Vec::new();
    for line in outside_code(text) {
        let Some(title) = line.strip_prefix('#') else { continue };
        let title = title.trim_start_matches('#');
        if !title.starts_with(' ') {
            continue;
        }
        let mut id = String::new();
        for ch in title.trim().chars() {
            if ch.is_alphanumeric() || ch == '-' || ch == '_' {
                id.extend(ch.to_lowercase());
            } else if ch == ' ' {
                id.push('-');
            }
        }
        let base = id.clone();
        let mut n = 0;
        while ids.contains(&id) {
            n += 1;
            id = format!("{base}-{n}");
        }
        ids.push(id);
    }
    ids
}

/// The lines of `text` outside fenced code blocks.
fn outside_code(text: &str) -> Vec<&str> {
    let mut fence = false;
    let mut lines = Vec::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fence = !fence;
            continue;
        }
        if !fence {
            lines.push(line);
        }
    }
    lines
}

/// The link targets of a markdown line: `[text](target)`, outside inline code spans.
fn link_targets(line: &str) -> Vec<String> {
    // Inline code spans removed first (their brackets are not links).
    let mut plain = String::new();
    let mut in_code = false;
    for ch in line.chars() {
        if ch == '`' {
            in_code = !in_code;
        } else if !in_code {
            plain.push(ch);
        }
    }
    let mut out = Vec::new();
    let mut rest = plain.as_str();
    while let Some(i) = rest.find("](") {
        let after = &rest[i + 2..];
        match after.find(')') {
            Some(j) => {
                out.push(after[..j].split_whitespace().next().unwrap_or("").to_string());
                rest = &after[j + 1..];
            }
            None => break,
        }
    }
    out
}

/// One line per link of the book, README or CHANGELOG that does not resolve.
pub fn check_links(root: &Path) -> Result<Vec<String>, String> {
    let src = root.join("docs").join("src");
    let mut problems = Vec::new();
    let files = markdown_files(root)?;
    for f in &files {
        let text = std::fs::read_to_string(f).map_err(|e| format!("{}: {e}", f.display()))?;
        let in_book = f.starts_with(&src);
        for line in outside_code(&text) {
            for target in link_targets(line) {
                if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                    continue;
                }
                let (path, anchor) = target.split_once('#').unwrap_or((&target, ""));
                let dest = if path.is_empty() { f.clone() } else { normalize(&f.parent().unwrap_or(root).join(path)) };
                let at = format!("{}: link `{target}`", f.display());
                if !dest.exists() {
                    problems.push(format!("{at}: no such file"));
                    continue;
                }
                if in_book && !dest.starts_with(&src) {
                    problems.push(format!("{at}: leaves docs/src (the built book holds only its chapters)"));
                    continue;
                }
                if !anchor.is_empty() {
                    if dest.extension().is_none_or(|x| x != "md") {
                        problems.push(format!("{at}: an anchor into a file that is not markdown"));
                        continue;
                    }
                    let body = std::fs::read_to_string(&dest).map_err(|e| format!("{}: {e}", dest.display()))?;
                    if !heading_ids(&body).iter().any(|id| id == anchor) {
                        problems.push(format!("{at}: no heading `#{anchor}` in {}", dest.display()));
                    }
                }
            }
        }
    }
    // Every chapter is in the table of contents.
    let summary = std::fs::read_to_string(src.join("SUMMARY.md")).map_err(|e| format!("SUMMARY.md: {e}"))?;
    let listed: Vec<String> = summary.lines().flat_map(link_targets).collect();
    for f in files.iter().filter(|f| f.starts_with(&src)) {
        let name = f.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name != "SUMMARY.md" && !listed.iter().any(|l| l == name) {
            problems.push(format!("{}: not listed in docs/src/SUMMARY.md", f.display()));
        }
    }
    Ok(problems)
}

/// `a/b/../c` as `a/c` (no file system access: the target may not exist).
fn normalize(p: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_tables_match_their_recorded_runs() {
        let problems = check_tables(&root()).expect("the markdown files are readable");
        assert!(problems.is_empty(), "{}", problems.join("\n"));
    }

    #[test]
    fn book_readme_and_changelog_links_resolve() {
        let problems = check_links(&root()).expect("the markdown files are readable");
        assert!(problems.is_empty(), "{}", problems.join("\n"));
    }

    #[test]
    fn heading_ids_follow_mdbook() {
        let ids = heading_ids("# The `cpu` backend: 512-bit kernels\n```\n# not a heading\n```\n## A, b\n## A, b\n");
        assert_eq!(ids, ["the-cpu-backend-512-bit-kernels", "a-b", "a-b-1"]);
    }

    #[test]
    fn links_are_found_outside_code_spans() {
        assert_eq!(link_targets("see [a](x.md#y) and `[b](no.md)` or [c](z.md \"t\")"), ["x.md#y", "z.md"]);
    }

    #[test]
    fn a_changed_cell_is_reported_and_rewritten() {
        let rec = Recorded {
            title: "T".into(),
            command: "cmd".into(),
            commit: "abc".into(),
            machine: "m".into(),
            date: "d".into(),
            notes: String::new(),
            columns: vec!["a".into(), "b".into()],
            align: vec!["l".into(), "r".into()],
            rows: vec![vec!["x".into(), "1".into()], vec!["y".into(), "2".into()]],
        };
        let all = render("t", &rec, &Pick { rows: None, cols: None }).expect("renders");
        assert!(all.contains("| a | b |\n| --- | ---: |\n| x | 1 |\n| y | 2 |\n"), "{all}");
        let some = render("t", &rec, &Pick { rows: Some(vec![1]), cols: Some(vec![1]) }).expect("renders");
        assert!(some.ends_with("| b |\n| ---: |\n| 2 |\n"), "{some}");
        assert!(render("t", &rec, &Pick { rows: Some(vec![2]), cols: None }).is_err());
    }
}
