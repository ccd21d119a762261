//! `kvgate-profile-stages` (`make profile`): where the scorer's CPU goes, by stage of a
//! request, from `perf` samples folded into stacks (`inferno-collapse-perf` output on stdin:
//! `thread;outer;…;inner count` per line). Each sample counts for the innermost frame that
//! names a stage; the scorer's threads are told from Envoy's by name. Prints a table.

use std::io::BufRead;

/// Stages in the order they are tried on a frame; the first pattern a frame contains wins.
const STAGES: [(&str, &[&str]); 9] = [
    ("chat template", &["minijinja"]),
    ("tokenize", &["tokenizers::", "kvgate_tokenize", "fancy_regex", "regex_automata", "onig"]),
    ("parse the request body", &["serde_json", "kvgate_scorer::prompt"]),
    ("block hashing", &["kvgate_routing::hash", "xxh"]),
    ("decision: index, load, policy", &["kvgate_routing::"]),
    (
        "bookings, admission, lifecycle",
        &[
            "kvgate_scorer::scorer",
            "kvgate_scorer::admission",
            "kvgate_scorer::picking",
            "kvgate_scorer::transport::http::lifecycle",
        ],
    ),
    (
        "route stream, route socket and HTTP (tonic, h2, hyper, prost)",
        &["tonic::", "h2::", "hyper", "prost::", "axum::", "kvgate_scorer::transport", "kvgate_route_api::Frames"],
    ),
    ("kernel: sockets, wake-ups", &["entry_SYSCALL", "do_syscall", "asm_sysvec", "__schedule"]),
    ("tokio runtime", &["tokio::"]),
];

fn is_scorer_thread(name: &str) -> bool {
    name.starts_with("tokio") || name.starts_with("kvgate")
}

fn main() -> anyhow::Result<()> {
    let mut counts = [0u64; STAGES.len() + 1];
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        let Some((stack, count)) = line.rsplit_once(' ') else { continue };
        let count: u64 = count.parse()?;
        let mut frames = stack.split(';');
        if !frames.next().is_some_and(is_scorer_thread) {
            continue;
        }
        let frames: Vec<&str> = frames.collect();
        let stage = frames
            .iter()
            .rev()
            .find_map(|frame| STAGES.iter().position(|(_, patterns)| patterns.iter().any(|p| frame.contains(p))))
            .unwrap_or(STAGES.len());
        counts[stage] += count;
    }
    let total: u64 = counts.iter().sum();
    anyhow::ensure!(total > 0, "no scorer samples on stdin");
    println!("| scorer stage | share of its CPU |\n|---|---|");
    let mut order: Vec<usize> = (0..counts.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(counts[i]));
    for i in order.into_iter().filter(|&i| counts[i] > 0) {
        let name = STAGES.get(i).map_or("other", |(name, _)| name);
        println!("| {name} | {:.1} % |", 100.0 * counts[i] as f64 / total as f64);
    }
    Ok(())
}
