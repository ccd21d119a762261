//! The cluster simulator end to end (small scale): deterministic per seed, every request
//! accounted for, and the routing differences it exists to show are there.

use kvgate_bench::cluster::{ClusterConfig, PodRole, run};
use kvgate_bench::report::Summary;
use kvgate_bench::routers;
use kvgate_bench::workload::{self, Params};
use kvgate_sim::engine::EngineConfig;

fn simulate(workload: &str, router: &str, seed: u64) -> Summary {
    let params = Params { seed, pods: 4, scale: 0.15, load: 1.0 };
    let w = workload::build(workload, &params).unwrap();
    let roles: Vec<PodRole> = (0..params.pods)
        .map(|i| match (w.prefill_pods, i < w.prefill_pods) {
            (0, _) => PodRole::Both,
            (_, true) => PodRole::Prefill,
            (_, false) => PodRole::Decode,
        })
        .collect();
    let config = ClusterConfig {
        roles: roles.clone(),
        engine: EngineConfig { num_blocks: w.num_blocks, hash_seed: Some("0".into()), ..EngineConfig::default() },
        scrape_interval: 1.0,
    };
    let mut r = routers::build(router, &roles, seed).unwrap();
    let result = run(&w, &config, r.as_mut());
    assert_eq!(result.requests.len(), w.requests(), "every turn of every session ran");
    let decode: Vec<usize> = (0..roles.len()).filter(|&p| roles[p] != PodRole::Prefill).collect();
    Summary::of(workload, router, &result, &decode)
}

#[test]
fn runs_are_deterministic_and_complete() {
    let a = simulate("chat", "kv", 5);
    let b = simulate("chat", "kv", 5);
    assert_eq!(serde_json::to_string(&a).unwrap(), serde_json::to_string(&b).unwrap());
    assert_eq!(a.failed, 0);
    assert!(a.ttft_p50_ms > 0.0 && a.itl_mean_ms > 0.0 && a.throughput_tokens_per_s > 0.0);
    let other_seed = simulate("chat", "kv", 6);
    assert_ne!(a.ttft_p90_ms, other_seed.ttft_p90_ms, "the seed matters");
}

#[test]
fn cache_aware_routing_hits_the_shared_prefixes_that_round_robin_misses() {
    for w in ["chat", "documents"] {
        let kv = simulate(w, "kv", 1);
        let rr = simulate(w, "round-robin", 1);
        let sglang = simulate(w, "sglang-cache-aware", 1);
        assert!(kv.prefix_hit_rate > rr.prefix_hit_rate + 0.05, "{w}: kv {kv:?} vs round-robin {rr:?}");
        assert!(sglang.prefix_hit_rate > rr.prefix_hit_rate + 0.05, "{w}: sglang {sglang:?}");
        assert!(kv.ttft_mean_ms < rr.ttft_mean_ms, "{w}: kv {kv:?} vs round-robin {rr:?}");
    }
}

#[test]
fn longest_prefix_piles_unique_prompts_on_one_pod_and_kv_does_not() {
    let prefix = simulate("unique-long", "prefix", 1);
    let kv = simulate("unique-long", "kv", 1);
    assert!(prefix.imbalance > 3.0, "{prefix:?}");
    assert!(kv.imbalance < 1.5, "{kv:?}");
}

#[test]
fn disaggregated_requests_run_on_both_pools() {
    let pd = simulate("pd-mixed", "kv@pd-always", 1);
    let direct = simulate("pd-mixed", "kv@no-pd", 1);
    assert_eq!((pd.failed, direct.failed), (0, 0));
    // The decode pod pulls the prompt's KV and computes one token: decode pools see no
    // prefill interference, so tokens stream faster than when every pod prefills.
    assert!(pd.itl_mean_ms < direct.itl_mean_ms, "pd {pd:?} vs direct {direct:?}");
}
