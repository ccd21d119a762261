//! The documentation holds together: every relative link in the repository's Markdown
//! resolves (file and `#anchor`, with GitHub's heading anchors), every `make` target a page
//! names exists in the Makefile, every repository path a page names in code exists, every
//! Rust name a contributor guide cites is defined, and the
//! README stays a front door (short, no dates, no commit hashes). Each check is also shown to
//! reject a broken page.

use kvgate_test_harness::root;
use pulldown_cmark::{Event, HeadingLevel, Parser, Tag, TagEnd};
use regex::Regex;
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// The README's length limit, in lines.
const README_MAX_LINES: usize = 300;

/// What one Markdown page links to, names and defines.
#[derive(Default)]
struct Page {
    /// Link and image destinations.
    links: Vec<String>,
    /// GitHub's anchors of the page's headings.
    anchors: BTreeSet<String>,
    /// Inline code spans.
    spans: Vec<String>,
    /// Code blocks.
    blocks: Vec<String>,
}

/// GitHub's anchor for a heading: lowercase, punctuation dropped, spaces as hyphens;
/// a repeated heading gets `-1`, `-2`, ….
fn anchor(heading: &str, seen: &mut HashMap<String, usize>) -> String {
    let base: String = heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect();
    let n = seen.entry(base.clone()).or_insert(0);
    let slug = if *n == 0 { base.clone() } else { format!("{base}-{n}") };
    *n += 1;
    slug
}

fn parse(text: &str) -> Page {
    let mut page = Page::default();
    let mut seen = HashMap::new();
    let mut heading: Option<String> = None;
    let mut block: Option<String> = None;
    for event in Parser::new(text) {
        match event {
            Event::Start(Tag::Heading { level, .. }) if level <= HeadingLevel::H6 => heading = Some(String::new()),
            Event::End(TagEnd::Heading(_)) => {
                if let Some(h) = heading.take() {
                    page.anchors.insert(anchor(&h, &mut seen));
                }
            }
            Event::Start(Tag::Link { dest_url, .. }) | Event::Start(Tag::Image { dest_url, .. }) => {
                page.links.push(dest_url.to_string())
            }
            Event::Start(Tag::CodeBlock(_)) => block = Some(String::new()),
            Event::End(TagEnd::CodeBlock) => page.blocks.extend(block.take()),
            Event::Text(t) => {
                if let Some(b) = block.as_mut() {
                    b.push_str(&t);
                }
                if let Some(h) = heading.as_mut() {
                    h.push_str(&t);
                }
            }
            Event::Code(c) => {
                if let Some(h) = heading.as_mut() {
                    h.push_str(&c);
                }
                page.spans.push(c.to_string());
            }
            _ => {}
        }
    }
    page
}

/// Every Markdown file of the repository, but build output and what setup fetched.
fn markdown_files() -> Vec<PathBuf> {
    repository_files(".md")
}

/// Every file of the repository whose name ends with `suffix`, but build output and what
/// setup fetched.
fn repository_files(suffix: &str) -> Vec<PathBuf> {
    fn walk(dir: &Path, suffix: &str, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap().flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if path.is_dir() {
                if !matches!(name.as_str(), "target" | ".git" | ".kvgate" | "node_modules") {
                    walk(&path, suffix, out);
                }
            } else if name.ends_with(suffix) {
                out.push(path);
            }
        }
    }
    let mut out = Vec::new();
    walk(&root(), suffix, &mut out);
    out.sort();
    out
}

/// Names the guides cite that are other projects' (vLLM's), not kvgate's.
const OTHER_PROJECTS_NAMES: [&str; 1] = ["OffloadingConnector"];

/// The contributor guides: the Rust names they cite must stay true to the code.
const GUIDES: [&str; 2] = ["docs/adding-a-way-in.md", "scorer/README.md"];

/// The Rust names a page cites in code spans (`Type`, `Type::member`, `Type::member()`) that
/// `sources` does not define: no `struct`, `enum`, `trait`, `type` or variant of that name, or
/// no `fn`, constant or variant of the member's anywhere (a cheap check: not per type).
fn undefined_names(page: &Page, sources: &str) -> Vec<String> {
    // CamelCase (not an all-capitals word such as a vLLM medium, `CPU`).
    let name = Regex::new(r"^([A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*)(?:::([A-Za-z_][A-Za-z0-9_]*)(?:\(\))?)?$").unwrap();
    let defined = |pattern: String| Regex::new(&pattern).unwrap().is_match(sources);
    let mut out = Vec::new();
    for span in &page.spans {
        let Some(m) = name.captures(span) else { continue };
        if OTHER_PROJECTS_NAMES.contains(&span.as_str()) {
            continue;
        }
        // A type, or a variant (an enum's line `Name,`, `Name(…)` or `Name {…}`).
        let item = |name: &str| format!(r"(?m)\b(struct|enum|trait|type|fn|const)\s+{name}\b|^\s*{name}\b\s*[,({{]");
        let ty = defined(item(&m[1]));
        let member = m.get(2).is_none_or(|member| defined(item(member.as_str())));
        if !(ty && member) {
            out.push(format!("names what the code does not define: {span}"));
        }
    }
    out
}

fn rust_sources() -> String {
    repository_files(".rs")
        .iter()
        .map(|f| std::fs::read_to_string(f).unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn the_contributor_guides_name_what_the_code_defines() {
    let sources = rust_sources();
    let mut problems = Vec::new();
    let mut cited = 0;
    for guide in GUIDES {
        let page = parse(&std::fs::read_to_string(root().join(guide)).unwrap());
        cited += page.spans.len();
        problems.extend(undefined_names(&page, &sources).into_iter().map(|p| format!("{guide}: {p}")));
    }
    assert!(cited > 50, "the guides were read");
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    // And a guide naming what is gone is caught.
    let stale = parse("`Router::route_all()`, `Saturation`, `RouterConfig`, `Picker::pick`, `PickingService`, `CPU`\n");
    let caught = undefined_names(&stale, &sources);
    assert_eq!(
        caught,
        ["names what the code does not define: Router::route_all()", "names what the code does not define: Saturation"]
    );
}

fn makefile_targets() -> BTreeSet<String> {
    let makefile = std::fs::read_to_string(root().join("Makefile")).unwrap();
    let target = Regex::new(r"^([A-Za-z0-9_-]+):([^=]|$)").unwrap();
    makefile.lines().filter_map(|l| target.captures(l)).map(|c| c[1].to_string()).collect()
}

/// What is wrong with one page: links that do not resolve, `make` targets and repository
/// paths that do not exist. `anchors` holds every page's anchors, by canonical path.
fn problems(
    file: &Path,
    page: &Page,
    anchors: &HashMap<PathBuf, BTreeSet<String>>,
    targets: &BTreeSet<String>,
) -> Vec<String> {
    let dir = file.parent().unwrap();
    let mut out = Vec::new();
    for link in &page.links {
        if link.contains("://") || link.starts_with("mailto:") {
            continue;
        }
        let (path, fragment) = link.split_once('#').unwrap_or((link.as_str(), ""));
        let target = if path.is_empty() { file.to_path_buf() } else { dir.join(path) };
        let Ok(target) = target.canonicalize() else {
            out.push(format!("link to a missing file: {link}"));
            continue;
        };
        if !fragment.is_empty() && target.extension().is_some_and(|e| e == "md") {
            let known = anchors.get(&target).is_some_and(|a| a.contains(fragment));
            if !known {
                out.push(format!("link to a missing heading: {link}"));
            }
        }
    }
    let make = Regex::new(r"\bmake ([a-z][a-z0-9-]*)").unwrap();
    // A path in code that starts at one of the repository's own top-level folders.
    let repo_path = Regex::new(r"^(\.ci|deploy|docs|envoy|filter|route-api|scorer|tests)/[A-Za-z0-9_./-]*$").unwrap();
    for code in page.spans.iter().chain(&page.blocks) {
        for m in make.captures_iter(code) {
            if !targets.contains(&m[1]) {
                out.push(format!("no Makefile target: make {}", &m[1]));
            }
        }
    }
    // A code span that is a path, and every word of a code block (in a span of several words
    // `deploy/x` may be a kubectl resource).
    let words = page.blocks.iter().flat_map(|b| b.split_whitespace());
    for word in page.spans.iter().map(String::as_str).chain(words) {
        let word = word.trim_end_matches([',', ';', ')']);
        if repo_path.is_match(word) && !root().join(word).exists() && !dir.join(word).exists() {
            out.push(format!("no such path: {word}"));
        }
    }
    out
}

fn check_all(files: &[(PathBuf, Page)]) -> Vec<String> {
    let anchors: HashMap<PathBuf, BTreeSet<String>> =
        files.iter().map(|(f, p)| (f.canonicalize().unwrap_or(f.clone()), p.anchors.clone())).collect();
    let targets = makefile_targets();
    let base = root();
    files
        .iter()
        .flat_map(|(f, p)| {
            let name = f.strip_prefix(&base).unwrap_or(f).display().to_string();
            problems(f, p, &anchors, &targets).into_iter().map(move |e| format!("{name}: {e}"))
        })
        .collect()
}

fn pages() -> Vec<(PathBuf, Page)> {
    markdown_files().into_iter().map(|f| (f.clone(), parse(&std::fs::read_to_string(&f).unwrap()))).collect()
}

#[test]
fn every_link_make_target_and_path_resolves() {
    let files = pages();
    assert!(files.iter().any(|(f, _)| f.ends_with("docs/benchmarks.md")), "docs/ was not walked");
    let problems = check_all(&files);
    assert!(problems.is_empty(), "the docs name what does not exist:\n{}", problems.join("\n"));
}

#[test]
fn the_checks_reject_broken_pages() {
    let mut files = pages();
    let readme = root().join("README.md");
    let broken = "# Broken\n\nSee [nowhere](docs/no-such-page.md), [a heading](docs/benchmarks.md#no-such-heading), \
                  run `make no-such-target`, read `deploy/no-such-file.yaml`.\n";
    files.retain(|(f, _)| *f != readme);
    files.push((readme, parse(broken)));
    let problems = check_all(&files);
    for expected in [
        "missing file: docs/no-such-page.md",
        "missing heading: docs/benchmarks.md#no-such-heading",
        "no Makefile target: make no-such-target",
        "no such path: deploy/no-such-file.yaml",
    ] {
        assert!(problems.iter().any(|p| p.ends_with(expected)), "not caught: {expected}\n{problems:?}");
    }
}

#[test]
fn anchors_are_githubs() {
    let mut seen = HashMap::new();
    assert_eq!(
        anchor("Gateway replicas that decide as one (`sync`)", &mut seen),
        "gateway-replicas-that-decide-as-one-sync"
    );
    assert_eq!(anchor("The gateway's overhead", &mut seen), "the-gateways-overhead");
    assert_eq!(
        anchor("Goodput at an SLO (`--sweep`, `src/goodput.rs`; `make bench-goodput`)", &mut seen),
        "goodput-at-an-slo---sweep-srcgoodputrs-make-bench-goodput"
    );
    assert_eq!(anchor("The gateway's overhead", &mut seen), "the-gateways-overhead-1");
}

/// A dated line (`2026-11-25`) or a commit hash (7–40 hex digits with a letter and a digit).
fn diary_marks(text: &str) -> Vec<String> {
    let date = Regex::new(r"\b20\d\d-\d\d-\d\d\b").unwrap();
    let hash = Regex::new(r"\b[0-9a-f]{7,40}\b").unwrap();
    let mut out: Vec<String> = date.find_iter(text).map(|m| m.as_str().to_string()).collect();
    out.extend(
        hash.find_iter(text)
            .map(|m| m.as_str())
            .filter(|h| h.chars().any(|c| c.is_ascii_digit()) && h.chars().any(|c| c.is_ascii_alphabetic()))
            .map(str::to_string),
    );
    out
}

#[test]
fn the_readme_is_a_front_door() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let lines = readme.lines().count();
    assert!(
        lines <= README_MAX_LINES,
        "README.md has {lines} lines; at most {README_MAX_LINES} (the rest belongs in docs/)"
    );
    let marks = diary_marks(&readme);
    assert!(marks.is_empty(), "README.md names dates or commits (they belong in docs/): {marks:?}");
    assert_eq!(diary_marks("as of 2026-11-25, at commit 8798c8a, sha256 deadbeef"), ["2026-11-25", "8798c8a"]);
}
