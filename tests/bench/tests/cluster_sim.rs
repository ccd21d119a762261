//! The cluster simulator end to end (small scale): deterministic per seed, every request
//! accounted for, and the routing differences it exists to show are there.

use kvgate_bench::cluster::{Arrival, Choice, ClusterConfig, ClusterRouter, FORESEEN_MAX, Foreseen, run};
use kvgate_bench::report::Summary;
use kvgate_bench::routers;
use kvgate_bench::workload::{self, Params};
use kvgate_sim::engine::Engine;

fn simulate(workload: &str, router: &str, seed: u64) -> Summary {
    simulate_asking(workload, router, seed, 1.0, None)
}

/// As [`simulate`], at `load` × the workload's rate, clients asking for `max_tokens` output
/// tokens.
fn simulate_asking(workload: &str, router: &str, seed: u64, load: f64, max_tokens: Option<usize>) -> Summary {
    let params = Params { seed, pods: 4, scale: 0.15, load, max_tokens };
    let w = workload::build(workload, &params).unwrap();
    let config = ClusterConfig { max_tokens_asked: max_tokens, ..ClusterConfig::for_workload(&w, params.pods) };
    let mut r = routers::build(router, &config.roles, seed).unwrap();
    let result = run(&w, &config, r.as_mut());
    assert_eq!(result.requests.len(), w.requests(), "every turn of every session ran");
    Summary::of(workload, router, &result, &config.decode_pods())
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
fn clients_asking_for_more_than_they_get_change_the_plan_not_the_answers() {
    // Under KV-capacity pressure, where the blocks a pod's requests will still fill weigh.
    let plain = |router: &str| simulate_asking("capacity", router, 2, 1.0, None);
    let asking = |router: &str| simulate_asking("capacity", router, 2, 1.0, Some(4096));
    // A router that ignores max_tokens sees the same run: the engines stop at each request's
    // own length either way.
    let json = |s: &Summary| serde_json::to_string(s).unwrap();
    assert_eq!(json(&plain("round-robin")), json(&asking("round-robin")));
    // kvgate plans with what is asked; told the truth (@informed) it plans as before.
    assert_eq!(json(&plain("kv@informed")).replace("kv@informed", "kv"), json(&plain("kv")));
    let informed = asking("kv@informed");
    assert_eq!(json(&informed).replace("kv@informed", "kv"), json(&plain("kv")));
    assert_ne!(json(&asking("kv")), json(&plain("kv")), "the asked figure changes kvgate's plan");
}

#[test]
fn cache_aware_routing_hits_the_shared_prefixes_that_round_robin_misses() {
    for w in ["chat", "documents"] {
        let kv = simulate(w, "kv", 1);
        let rr = simulate(w, "round-robin", 1);
        assert!(kv.prefix_hit_rate > rr.prefix_hit_rate + 0.05, "{w}: kv {kv:?} vs round-robin {rr:?}");
        for peer in ["sglang-cache-aware", "vllm-kv-aware"] {
            let p = simulate(w, peer, 1);
            assert!(p.prefix_hit_rate > rr.prefix_hit_rate + 0.05, "{w}: {p:?} vs round-robin {rr:?}");
        }
        assert!(kv.ttft_mean_ms < rr.ttft_mean_ms, "{w}: kv {kv:?} vs round-robin {rr:?}");
    }
}

#[test]
fn longest_prefix_piles_unique_prompts_on_one_pod_and_kv_does_not() {
    // vllm-router's kv_aware too: every pod that served holds the common prefix, and the
    // tie goes to the last of them.
    for longest_prefix in ["prefix", "vllm-kv-aware"] {
        let s = simulate("unique-long", longest_prefix, 1);
        assert!(s.imbalance > 3.0, "{s:?}");
    }
    let kv = simulate("unique-long", "kv", 1);
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

#[test]
fn a_load_sweep_reports_goodput_at_the_slo_with_its_plot() {
    let out = std::env::temp_dir().join(format!("kvgate-sweep-{}", std::process::id()));
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_kvgate-cluster-sim"))
        .args(["--workloads", "documents", "--routers", "kv", "round-robin", "--pods", "4", "--scale", "0.2"])
        .args(["--seeds", "1", "--threads", "2", "--sweep", "0.25,0.5,1,2", "--out"])
        .arg(&out)
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("goodput.json")).unwrap()).unwrap();
    let curve =
        |router: &str| json["curves"].as_array().unwrap().iter().find(|c| c["router"] == router).unwrap().clone();
    let (kv, rr) = (curve("kv"), curve("round-robin"));
    // Round robin misses the documents' cache and breaks the SLO (3 × the best unloaded p90)
    // at once; kvgate carries load before it does.
    assert!(rr["goodput"]["Below"].is_number(), "{rr}");
    let kv_goodput = kv["goodput"]["At"].as_f64().unwrap_or_else(|| panic!("{kv}"));
    assert!(kv_goodput > rr["goodput"]["Below"].as_f64().unwrap());
    let points = kv["points"].as_array().unwrap();
    assert!(points.len() >= 2 && points[0]["offered"].as_f64() < points[1]["offered"].as_f64());
    let svg = std::fs::read_to_string(out.join("documents-goodput.svg")).unwrap();
    assert_eq!(svg.matches("<polyline").count(), 2);
    let markdown = std::fs::read_to_string(out.join("goodput.md")).unwrap();
    assert!(markdown.contains("| documents |") && markdown.contains("≥ "), "{markdown}");
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn a_mixed_fleet_has_slower_pods_and_a_smaller_cache() {
    let params = Params { seed: 1, pods: 4, scale: 0.15, load: 1.0, max_tokens: None };
    let w = workload::build("heterogeneous", &params).unwrap();
    let config = ClusterConfig::for_workload(&w, params.pods);
    assert_eq!(config.engines[0].num_blocks * 8, config.engines[2].num_blocks);
    let mut rr = routers::build("round-robin", &config.roles, 1).unwrap();
    let result = run(&w, &config, rr.as_mut());
    // Inter-token latency per pod parity: every step of an odd pod takes twice as long.
    let itl = |odd: usize| {
        let v: Vec<f64> = result
            .requests
            .iter()
            .filter(|r| r.decode_pod % 2 == odd && r.output_tokens > 1)
            .map(|r| (r.finished.unwrap() - r.first_token.unwrap()) / (r.output_tokens - 1) as f64)
            .collect();
        v.iter().sum::<f64>() / v.len() as f64
    };
    assert!(itl(1) > 1.6 * itl(0), "slow {} vs fast {}", itl(1), itl(0));
}

#[test]
fn on_hybrid_model_pods_kvgate_predicts_the_hit_rate_the_pods_report() {
    let s = simulate("hybrid", "kv", 1);
    let predicted = s.predicted_hit_rate.expect("kvgate predicts what it routes");
    assert!(s.prefix_hit_rate > 0.5, "the documents are found: {}", s.prefix_hit_rate);
    assert!((predicted - s.prefix_hit_rate).abs() < 0.02, "predicted {predicted}, reported {}", s.prefix_hit_rate);
    assert_eq!(simulate("hybrid", "sglang-cache-aware", 1).predicted_hit_rate, None);
}

/// Round robin that notes what the simulator foresees at each decision.
struct Foreseeing {
    foresight: f64,
    pods: usize,
    next: usize,
    /// (when, prompt) of every arrival foreseen, and of every arrival that came.
    foreseen: Vec<(f64, Vec<u32>)>,
    came: Vec<(f64, Vec<u32>)>,
}

impl ClusterRouter for Foreseeing {
    fn route(&mut self, _request: &Arrival<'_>, _now: f64) -> Choice {
        unreachable!("the simulator calls route_seeing")
    }

    fn foresight(&self) -> f64 {
        self.foresight
    }

    fn route_seeing(
        &mut self,
        request: &Arrival<'_>,
        now: f64,
        _engines: &[&Engine],
        foreseen: &[Foreseen<'_>],
    ) -> Choice {
        assert!(foreseen.len() <= FORESEEN_MAX);
        assert!(foreseen.windows(2).all(|w| w[0].at <= w[1].at), "soonest first");
        for f in foreseen {
            assert!(f.at >= now && f.at <= now + self.foresight, "within the foresight");
            self.foreseen.push((f.at, f.request.prompt.to_vec()));
        }
        self.came.push((now, request.prompt.to_vec()));
        self.next += 1;
        Choice::pod(self.next % self.pods)
    }

    fn done(&mut self, _id: u64, _output_tokens: Option<u32>, _now: f64) {}
}

#[test]
fn the_arrivals_a_router_foresees_are_the_ones_that_come() {
    let params = Params { seed: 3, pods: 4, scale: 0.15, load: 1.0, max_tokens: None };
    let w = workload::build("chat", &params).unwrap();
    let config = ClusterConfig::for_workload(&w, params.pods);
    let mut router = Foreseeing { foresight: 0.2, pods: 4, next: 0, foreseen: Vec::new(), came: Vec::new() };
    run(&w, &config, &mut router);
    assert!(router.foreseen.len() > w.requests(), "arrivals are foreseen, most more than once");
    for (at, prompt) in &router.foreseen {
        assert!(
            router.came.iter().any(|(t, p)| t == at && p == prompt),
            "an arrival foreseen at {at} s came as foreseen"
        );
    }

    // A router without foresight is shown none.
    let mut blind = Foreseeing { foresight: 0.0, ..router };
    blind.foreseen.clear();
    run(&w, &config, &mut blind);
    assert!(blind.foreseen.is_empty());
}

#[test]
fn pods_known_to_be_slow_are_spared_from_the_first_request() {
    // The mixed fleet: odd pods take twice as long. Learned, their speed is known only after
    // their first prefills; declared (`pods[].slowness`), before the first document lands.
    let slow = |router: &str| {
        let s = simulate_asking("heterogeneous", router, 1, 1.0, None);
        let odd = s.per_pod.iter().filter(|p| p.pod % 2 == 1);
        let prefill: u64 = s.per_pod.iter().map(|p| p.prefill_tokens).sum();
        let share = odd.clone().map(|p| p.share).sum::<f64>();
        (share, odd.map(|p| p.prefill_tokens).sum::<u64>() as f64 / prefill as f64)
    };
    let (learned, known) = (slow("kv"), slow("kv@known-speed"));
    assert!(known.0 < learned.0, "requests on the slow pods: known {known:?}, learned {learned:?}");
    assert!(known.1 < 0.7 * learned.1, "prompt tokens computed there: known {known:?}, learned {learned:?}");
}

#[test]
fn clients_holding_requests_in_flight_send_the_next_turn_only_as_an_answer_ends() {
    // kvgate-live-bench's clients: at most `limit` requests in flight, every session's first
    // turn queued at t = 0, each next turn behind what already waits.
    let params = Params { seed: 2, pods: 4, scale: 0.15, load: 1.0, max_tokens: None };
    let w = workload::build("live", &params).unwrap();
    let limit = 6;
    let config = ClusterConfig { in_flight: Some(limit), ..ClusterConfig::for_workload(&w, params.pods) };
    let mut r = routers::build("kv", &config.roles, 2).unwrap();
    let result = run(&w, &config, r.as_mut());
    assert_eq!(result.requests.len(), w.requests(), "every turn of every session ran");
    let finished: Vec<f64> = result.requests.iter().map(|r| r.finished.expect("finished")).collect();
    // Ends before starts at one instant: a slot is freed, then taken.
    let mut edges: Vec<(f64, i32)> = result.requests.iter().map(|r| (r.arrival, 1)).collect();
    edges.extend(finished.iter().map(|&t| (t, -1)));
    edges.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let mut in_flight = 0;
    let mut peak = 0;
    for (_, step) in edges {
        in_flight += step;
        peak = peak.max(in_flight);
    }
    assert_eq!(peak, limit as i32, "the clients keep exactly their limit in flight");
    let at_start = result.requests.iter().filter(|r| r.arrival == 0.0).count();
    assert_eq!(at_start, limit, "the first {limit} requests go out at once");
    for r in result.requests.iter().filter(|r| r.arrival > 0.0) {
        assert!(finished.contains(&r.arrival), "a request at {} s was sent as an answer ended", r.arrival);
    }
    // Start times no longer matter: the open loop's schedule is not this one.
    let open = run(
        &w,
        &ClusterConfig::for_workload(&w, params.pods),
        routers::build("kv", &config.roles, 2).unwrap().as_mut(),
    );
    assert_ne!(
        open.requests.iter().map(|r| r.arrival).collect::<Vec<_>>(),
        result.requests.iter().map(|r| r.arrival).collect::<Vec<_>>()
    );
}
