use super::*;
use crate::adapters::ReportedAdapters;
use crate::hash::{root_hash, sequence_hashes};
use crate::index::IndexConfig;
use crate::load::{LoadConfig, Origin};
use crate::policy::{AdapterFit, PolicyConfig, ReportedLoad};

fn router(threshold: u32) -> Router {
    Router::new(&test_config(threshold))
}

fn test_config(threshold: u32) -> RouterConfig {
    RouterConfig {
        block_size: 16,
        index: IndexConfig { approximate_ttl_seconds: 60.0, ..IndexConfig::default() },
        load: LoadConfig { default_output_tokens: 64, ..LoadConfig::default() },
        policy: PolicyConfig::default(),
        pd: PdConfig { threshold_tokens: threshold, decode_policy: PolicyConfig::LeastLoaded, ..PdConfig::default() },
        seed: 7,
        admission: None,
    }
}

fn chain(seed: u32, tokens: u32) -> Vec<SequenceHash> {
    let ids: Vec<u32> = (0..tokens).map(|i| seed * 100_000 + i).collect();
    let mut out = Vec::new();
    sequence_hashes(root_hash(None, None), &ids, 16, &mut out);
    out
}

/// `pod` announces the 512-token prompt of `chain(1, 512)`'s first `blocks` blocks in `tier`.
fn announce(r: &mut Router, pod: PodId, blocks: usize, tier: crate::events::Tier) {
    use crate::events::{BlockStored, EventBatch, KvEvent};
    let stored = BlockStored {
        block_hashes: (0..blocks as u64).map(|h| crate::hash::EngineHash(h + 1)).collect(),
        parent_block_hash: None,
        token_ids: (0..blocks as u32 * 16).map(|i| 100_000 + i).collect(),
        block_size: 16,
        lora_name: None,
        first_block_extra: vec![],
        opaque_extra_keys: false,
        tier,
        group: 0,
        group_kind: crate::events::GroupKind::FullAttention,
    };
    r.apply_events(pod, &EventBatch { ts: 0.0, events: vec![KvEvent::BlockStored(stored)], data_parallel_rank: None });
}

#[test]
fn an_adapters_requests_follow_the_pod_running_it_and_spread_when_its_slots_are_full() {
    let mut r = router(u32::MAX);
    let pods: Vec<PodId> = (0..3).map(|_| r.add_pod(Role::Both, true)).collect();
    let one_slot = ReportedAdapters { max_loras: 1, ..ReportedAdapters::default() };
    for &p in &pods {
        r.reported_adapters(p, one_slot.clone());
    }
    let (sql, law) = (AdapterId::of("sql"), AdapterId::of("law"));
    let route = |r: &mut Router, id: &str, seed: u32, adapter: AdapterId, now: f64| {
        let c = chain(seed, 64);
        let request = RouteRequest { adapter: Some(adapter), ..RouteRequest::new(id, &c, 64, Some(64)) };
        r.route(&request, now).unwrap()
    };
    let first = route(&mut r, "s1", 1, sql, 0.0).decode.pod;
    let second = route(&mut r, "s2", 2, sql, 0.0);
    assert_eq!(second.decode.pod, first, "the pod running sql takes its next request, another prompt");
    assert_eq!(second.decode.adapter, AdapterFit::Running);
    // The only slot there holds sql (two requests of 64 tokens at 50 tokens/s: 1.28 s, and
    // a stream of them keeps it e¹ times as long): law goes elsewhere and pays for its
    // load there.
    let third = route(&mut r, "l1", 3, law, 0.0);
    assert_ne!(third.decode.pod, first);
    assert_eq!(third.decode.adapter, AdapterFit::Free { load: true });
    let at_home = third.candidates.iter().find(|c| c.pod == first).unwrap();
    assert!(
        matches!(at_home.adapter, AdapterFit::Full { load: true, wait_seconds, .. } if (wait_seconds - 1.28 * 1f64.exp()).abs() < 1e-9),
        "{:?}",
        at_home.adapter
    );
    // A crowd of long sql prompts piles up at its home until its queue outweighs a second
    // slot.
    let spread: Vec<PodId> = (0..40)
        .map(|i| {
            let (c, id) = (chain(10 + i, 1024), format!("s{}", i + 3));
            let request = RouteRequest { adapter: Some(sql), ..RouteRequest::new(&id, &c, 1024, Some(64)) };
            r.route(&request, 0.0).unwrap().decode.pod
        })
        .collect();
    assert_eq!(spread[0], first);
    let third_pod = pods.iter().copied().find(|p| *p != first && *p != third.decode.pod).unwrap();
    assert!(spread.contains(&third_pod), "sql spreads to the free pod once its home is busy: {spread:?}");
    assert!(!spread.contains(&third.decode.pod), "never behind law's slot");
    // Base-model requests take no slot.
    let base = r.route(&RouteRequest::new("b", &chain(99, 64), 64, Some(8)), 0.0).unwrap();
    assert!(base.candidates.iter().all(|c| c.adapter == AdapterFit::Unlimited));
}

#[test]
fn a_prompt_held_whole_is_credited_up_to_its_last_token_only() {
    // vLLM computes a prompt's last token whatever it holds: of a block-aligned prompt held
    // whole it serves one block short (a real engine reported 96 of 128; kvgate said 128).
    let mut r = router(u32::MAX);
    let pod = r.add_pod(Role::Both, true);
    announce(&mut r, pod, 32, crate::events::Tier::Gpu);
    let cached = |r: &mut Router, tokens: u32| {
        let c = chain(1, tokens);
        r.route(&RouteRequest::new("q", &c, tokens, Some(1)), 0.0).unwrap().decode.cached_tokens
    };
    assert_eq!(cached(&mut r, 512), 496, "32 blocks held, 31 served");
    assert_eq!(cached(&mut r, 513), 512, "a token past them: all 32");
    assert_eq!(cached(&mut r, 17), 16);
    assert_eq!(cached(&mut r, 16), 0);
    assert_eq!(cached(&mut r, 1), 0);
}

#[test]
fn a_request_served_elsewhere_takes_its_adapter_along() {
    let mut r = router(u32::MAX);
    let pods: Vec<PodId> = (0..2).map(|_| r.add_pod(Role::Both, true)).collect();
    for &p in &pods {
        r.reported_adapters(p, ReportedAdapters { max_loras: 1, ..ReportedAdapters::default() });
    }
    let sql = AdapterId::of("sql");
    let c = chain(1, 64);
    let ask = |id| RouteRequest { adapter: Some(sql), ..RouteRequest::new(id, &c, 64, Some(8)) };
    let picked = r.route(&ask("a"), 0.0).unwrap().decode.pod;
    let other = pods.into_iter().find(|p| *p != picked).unwrap();
    // The proxy retried it on the other pod, where it ran and ended.
    assert_eq!(r.served("a", other, 0.1), Ok(Some(picked)));
    r.report("a", Lifecycle::Done, false, 0.2).unwrap();
    let next = r.route(&ask("b"), 0.3).unwrap();
    let fit = next.candidates.iter().find(|c| c.pod == other).unwrap().adapter;
    assert_eq!(fit, AdapterFit::Free { load: false }, "sql was loaded where it ran");
}

#[test]
fn an_adapters_blocks_as_vllm_publishes_them_serve_its_requests_only() {
    // vLLM 0.33's engine stores "sql"'s blocks and the base model's of the same 8 tokens
    // (block size 4), then evicts the second block of each.
    let mut r = Router::new(&RouterConfig { block_size: 4, ..test_config(u32::MAX) });
    let pod = r.add_pod(Role::Both, true);
    let tokens: Vec<u32> = (1..=8).collect();
    let found = |r: &mut Router, lora: Option<&str>| {
        let mut c = Vec::new();
        sequence_hashes(root_hash(lora, None), &tokens, 4, &mut c);
        let request = RouteRequest { adapter: lora.map(AdapterId::of), ..RouteRequest::new("q", &c, 9, Some(1)) };
        r.route(&request, 0.0).unwrap().decode.cached_tokens
    };
    for (batch, cached) in [(0, 8), (1, 4)] {
        let payload = kvgate_test_harness::vllm_fixture_payload("vllm-0.33.0-lora-kv-events.json", batch);
        r.apply_events(pod, &crate::events::decode_batch(&payload).unwrap());
        assert_eq!((found(&mut r, Some("sql")), found(&mut r, None)), (cached, cached), "batch {batch}");
        assert_eq!(found(&mut r, Some("law")), 0, "another adapter's blocks are not these");
    }
}

#[test]
fn a_hybrid_models_prefix_as_vllm_publishes_its_groups_counts_as_far_as_its_window_serves_it() {
    // vLLM 0.33's engine of a hybrid model stores 4 blocks (of 4 tokens) in its
    // full-attention group and its sliding-window group (9 tokens: 2 blocks), then the
    // window group evicts blocks 0 and 1, then block 3.
    let mut r = Router::new(&RouterConfig { block_size: 4, ..test_config(u32::MAX) });
    let pod = r.add_pod(Role::Both, true);
    let tokens: Vec<u32> = (1..=17).collect();
    let mut c = Vec::new();
    sequence_hashes(root_hash(None, None), &tokens, 4, &mut c);
    for (batch, cached) in [(0, 16), (1, 16), (2, 0)] {
        let payload = kvgate_test_harness::vllm_fixture_payload("vllm-0.33.0-hybrid-kv-events.json", batch);
        r.apply_events(pod, &crate::events::decode_batch(&payload).unwrap());
        let routed = r.route(&RouteRequest::new(&format!("q{batch}"), &c, 17, Some(1)), 0.0).unwrap();
        assert_eq!(routed.decode.cached_tokens, cached, "batch {batch}");
        r.report(&format!("q{batch}"), Lifecycle::Done, false, 0.0).unwrap();
    }
    assert_eq!(r.index().stats(pod).removed_blocks, 3);
}

#[test]
fn a_prompt_held_offloaded_is_loaded_not_recomputed() {
    use crate::events::Tier;
    let c = chain(1, 512);
    let setup = |offload: crate::index::OffloadConfig| {
        let mut config = test_config(0);
        config.index.offload = offload;
        let mut r = Router::new(&config);
        let pods = [r.add_pod(Role::Both, true), r.add_pod(Role::Both, true), r.add_pod(Role::Both, true)];
        announce(&mut r, pods[1], 32, Tier::Cpu);
        announce(&mut r, pods[2], 16, Tier::Gpu);
        (r, pods)
    };
    let (mut r, pods) = setup(Default::default());
    let routed = r.route(&RouteRequest::new("a", &c, 512, Some(8)), 0.0).unwrap();
    assert_eq!(routed.decode.pod, pods[1], "loading 512 tokens from host memory beats computing 256");
    assert_eq!((routed.decode.cached_tokens, routed.decode.offloaded_tokens), (0, 512));
    assert_eq!(routed.decode.offload_work_tokens, 52, "a tenth of computing them, rounded up");
    assert_eq!(routed.candidates[2].offloaded_tokens, 0);
    // The booking counts the loading as prefill work, not the whole prompt.
    assert_eq!(r.load().load(pods[1], 0.0).queued_prefill_tokens, 52);
    // Offload tiers left out: the GPU prefix wins.
    let off = crate::index::OffloadConfig { max_blocks_per_pod: 0, ..Default::default() };
    let (mut r, pods) = setup(off);
    assert_eq!(r.route(&RouteRequest::new("a", &c, 512, Some(8)), 0.0).unwrap().decode.pod, pods[2]);
    // Loading costing as much as computing: a GPU prefix of half the prompt wins again.
    let dear = crate::index::OffloadConfig { cpu_load_cost: 1.0, ..Default::default() };
    let (mut r, pods) = setup(dear);
    assert_eq!(r.route(&RouteRequest::new("a", &c, 512, Some(8)), 0.0).unwrap().decode.pod, pods[2]);
}

#[test]
fn a_prefill_booked_past_its_pods_reported_kv_capacity_does_not_teach_the_pods_speed() {
    let mut r = router(1 << 20);
    let pod = r.add_pod(Role::Both, false);
    // 40 blocks of 16 tokens.
    r.reported(pod, ReportedLoad { num_gpu_blocks: 40.0, ..ReportedLoad::default() });
    for i in 0..6 {
        let (id, c) = (format!("short-{i}"), chain(10 + i, 64));
        let at = f64::from(i);
        r.route(&RouteRequest::new(&id, &c, 64, Some(8)), at).unwrap();
        r.report(&id, Lifecycle::FirstToken, false, at + 0.02).unwrap();
        r.report(&id, Lifecycle::Done, false, at + 0.1).unwrap();
    }
    let taught = r.load().speed(pod);
    assert!(taught.samples > 0.0, "short prefills that fit teach: {taught:?}");
    // 1,024 tokens need 64 blocks: the engine holds the request back for room.
    let c = chain(99, 1024);
    r.route(&RouteRequest::new("long", &c, 1024, Some(8)), 10.0).unwrap();
    r.report("long", Lifecycle::FirstToken, false, 12.0).unwrap();
    assert_eq!(r.load().speed(pod), taught, "its wait is not the pod's speed");
}

#[test]
fn routes_a_repeated_prefix_back_and_books_until_done() {
    let mut r = router(1024);
    let pods = [r.add_pod(Role::Both, false), r.add_pod(Role::Both, false)];
    let c = chain(1, 512);
    let req = |id| RouteRequest::new(id, &c, 512, Some(8));
    let first = r.route(&req("a"), 0.0).unwrap();
    assert_eq!((first.prefill, first.cached_tokens()), (None, 0));
    assert!(!first.prefill_pods);
    r.report("a", Lifecycle::Done, false, 1.0).unwrap();
    let again = r.route(&req("b"), 2.0).unwrap();
    assert_eq!(again.decode.pod, first.decode.pod, "the approximate index remembers where the prefix went");
    assert_eq!(again.cached_tokens(), 496, "all but the block of its last token");
    assert_eq!(r.load().load(again.decode.pod, 2.0).inflight_requests, 1);
    r.report("b", Lifecycle::Done, false, 3.0).unwrap();
    assert!(pods.iter().all(|&p| r.load().load(p, 3.0).inflight_requests == 0));
    assert!(r.report("b", Lifecycle::Done, false, 3.0).is_err(), "a second done names no request");
}

#[test]
fn a_prompt_that_ended_is_credited_on_its_pod_until_the_pod_clears_its_cache() {
    use crate::events::{EventBatch, KvEvent};
    let mut r = router(u32::MAX);
    r.add_pod(Role::Both, true);
    r.add_pod(Role::Both, true);
    let c = chain(1, 512);
    let req = |id| RouteRequest::new(id, &c, 512, Some(8));
    let first = r.route(&req("a"), 0.0).unwrap();
    r.report("a", Lifecycle::FirstToken, false, 0.1).unwrap();
    r.report("a", Lifecycle::Done, false, 0.2).unwrap();
    // No event has announced the prompt yet: what the request left is credited there.
    let again = r.route(&req("b"), 0.3).unwrap();
    assert_eq!((again.decode.pod, again.cached_tokens()), (first.decode.pod, 496));
    r.report("b", Lifecycle::Done, false, 0.4).unwrap();
    let home = first.decode.pod;
    r.apply_events(home, &EventBatch { ts: 0.0, events: vec![KvEvent::AllBlocksCleared], data_parallel_rank: None });
    let after = r.route(&req("c"), 0.5).unwrap();
    assert_eq!(after.cached_tokens(), 0, "a reset cache holds nothing: {after:?}");
}

#[test]
fn the_homes_group_counts_the_requests_in_flight_that_share_the_prompts_first_block() {
    let mut r = router(u32::MAX);
    let _pods = [r.add_pod(Role::Both, false), r.add_pod(Role::Both, false)];
    let (shared, other) = (chain(1, 512), chain(2, 512));
    let mut question = shared[..16].to_vec();
    question.extend(chain(3, 256));
    let home = r.route(&RouteRequest::new("a", &shared, 512, Some(8)), 0.0).unwrap().decode.pod;
    r.route(&RouteRequest::new("b", &shared, 512, Some(8)), 0.0).unwrap();
    let d = r.route(&RouteRequest::new("q", &question, 768, Some(8)), 0.0).unwrap();
    assert_eq!(d.decode.pod, home, "the shared blocks in flight count as cached there");
    let group = |d: &Routed| d.candidates.iter().map(|c| (c.pod, c.group_inflight)).collect::<Vec<_>>();
    assert!(group(&d).contains(&(home, 2)), "{:?}", group(&d));
    assert!(group(&d).iter().all(|&(p, n)| p == home || n == 0));
    let elsewhere = r.route(&RouteRequest::new("o", &other, 512, Some(8)), 0.0).unwrap();
    assert!(group(&elsewhere).iter().all(|&(_, n)| n == 0), "no pod holds its group");
}

#[test]
fn a_pods_recent_traffic_counts_each_block_routed_there_once_for_the_window() {
    let load = LoadConfig { recent_window_seconds: 10.0, ..LoadConfig::default() };
    let mut r = Router::new(&RouterConfig { load, ..test_config(u32::MAX) });
    let _pods = [r.add_pod(Role::Both, true), r.add_pod(Role::Both, true)];
    let (long, short) = (chain(1, 512), chain(2, 256));
    let home = r.route(&RouteRequest::new("a", &long, 512, Some(8)), 0.0).unwrap().decode.pod;
    assert_eq!(r.route(&RouteRequest::new("b", &long, 512, Some(8)), 1.0).unwrap().decode.pod, home);
    let recent = |d: &Routed| d.candidates.iter().map(|c| (c.pod, c.recent_blocks)).collect::<Vec<_>>();
    let d = r.route(&RouteRequest::new("c", &short, 256, Some(8)), 2.0).unwrap();
    let held = |p: PodId| if p == home { 32 } else { 0 };
    assert_eq!(recent(&d), [PodId(0), PodId(1)].map(|p| (p, held(p))), "the prompt's 32 blocks, routed twice");
    let d = r.route(&RouteRequest::new("d", &short, 256, Some(8)), 25.0).unwrap();
    assert!(recent(&d).iter().all(|&(_, n)| n == 0), "a window later: {:?}", recent(&d));
}

#[test]
fn disaggregates_above_the_threshold_and_skips_unhealthy_pods() {
    let mut r = router(256);
    let prefill = r.add_pod(Role::Prefill, false);
    let decode = [r.add_pod(Role::Decode, false), r.add_pod(Role::Decode, false)];
    let long = chain(2, 512);
    let routed = r.route(&RouteRequest::new("p", &long, 512, None), 0.0).unwrap();
    assert_eq!(routed.prefill.map(|p| p.pod), Some(prefill));
    assert!(decode.contains(&routed.decode.pod));
    assert_eq!((routed.policy, routed.uncached_tokens), ("least-loaded", 512));
    assert_eq!(r.load().load(prefill, 0.0).inflight_requests, 1);
    r.report("p", Lifecycle::Done, true, 1.0).unwrap();
    assert_eq!(r.load().load(prefill, 1.0).inflight_requests, 0, "prefill_done ends the prefill booking");
    assert_eq!(r.load().load(routed.decode.pod, 1.0).inflight_requests, 1);

    let short = chain(3, 64);
    let direct = r.route(&RouteRequest::new("s", &short, 64, None), 1.0).unwrap();
    assert!(direct.prefill.is_none() && direct.prefill_pods, "below the threshold: one decode pod");

    r.unhealthy(decode[0]);
    r.unhealthy(decode[1]);
    assert!(!r.ready());
    let none = r.route(&RouteRequest::new("x", &short, 64, None), 2.0);
    assert_eq!(none.unwrap_err(), Unroutable::NoPod);
    r.reported(decode[1], ReportedLoad::default());
    r.remove_pod(decode[0]);
    r.reported(decode[0], ReportedLoad::default());
    assert!(!r.is_healthy(decode[0]), "a removed pod stays out whatever it reports");
    assert_eq!(r.route(&RouteRequest::new("y", &short, 64, None), 3.0).unwrap().decode.pod, decode[1]);
}

#[test]
fn fallbacks_follow_the_costs_and_the_subset_limits_the_choice() {
    let mut r = router(1024);
    let pods: Vec<PodId> = (0..4).map(|_| r.add_pod(Role::Both, false)).collect();
    let warm = chain(5, 256);
    // pod 2 caches the prefix; pods 0 and 1 carry load; pod 3 is idle.
    r.route(
        &RouteRequest { subset: Some(&[pods[2]].into_iter().collect()), ..RouteRequest::new("w", &warm, 256, Some(1)) },
        0.0,
    )
    .unwrap();
    r.report("w", Lifecycle::Done, false, 0.1).unwrap();
    for (i, pod) in [pods[0], pods[0], pods[1]].into_iter().enumerate() {
        let c = chain(10 + i as u32, 512);
        let subset: PodSet = [pod].into_iter().collect();
        let id = format!("busy{i}");
        r.route(&RouteRequest { subset: Some(&subset), ..RouteRequest::new(&id, &c, 512, Some(64)) }, 0.2).unwrap();
    }
    let routed = r.route(&RouteRequest { fallbacks: 3, ..RouteRequest::new("q", &warm, 256, Some(1)) }, 0.3).unwrap();
    assert_eq!(routed.decode.pod, pods[2], "the cached prefix wins");
    assert_eq!(routed.fallbacks, vec![pods[3], pods[1], pods[0]], "then by cost: idle, one busy, two busy");
    let two = r.route(&RouteRequest { fallbacks: 1, ..RouteRequest::new("q2", &warm, 256, Some(1)) }, 0.3).unwrap();
    assert_eq!(two.fallbacks.len(), 1);
    let only: PodSet = [pods[0], pods[1]].into_iter().collect();
    let limited = r
        .route(&RouteRequest { subset: Some(&only), fallbacks: 3, ..RouteRequest::new("q3", &warm, 256, Some(1)) }, 0.3)
        .unwrap();
    assert_eq!(
        (limited.decode.pod, limited.fallbacks.clone()),
        (pods[1], vec![pods[0]]),
        "only the subset, cache elsewhere ignored"
    );
    let nobody: PodSet = [PodId(99)].into_iter().collect();
    assert_eq!(
        r.route(&RouteRequest { subset: Some(&nobody), ..RouteRequest::new("q4", &warm, 256, None) }, 0.3).unwrap_err(),
        Unroutable::NoPod
    );
}

#[test]
fn replicas_that_cannot_hear_each_other_send_a_new_prefix_to_the_same_pod() {
    // Two gateway replicas that found the same 6 pods in different orders, and differ in
    // seed: on an idle fleet every pod ties, and each prefix still goes to the same pod
    // (by address) on both, while different prefixes spread over the pods.
    let addresses: Vec<String> = (0..6).map(|i| format!("10.0.0.{i}:8000")).collect();
    let replica = |order: &mut dyn Iterator<Item = usize>, seed| {
        let mut r = Router::new(&RouterConfig { seed, ..test_config(1024) });
        let mut address_of = Vec::new();
        for i in order {
            let pod = r.add_pod(Role::Both, true);
            r.set_pod_key(pod, &addresses[i]);
            address_of.push(addresses[i].clone());
        }
        (r, address_of)
    };
    let (mut a, a_address) = replica(&mut (0..6), 1);
    let (mut b, b_address) = replica(&mut (0..6).rev(), 2);
    let mut used = std::collections::HashSet::new();
    for seed in 0..40 {
        let c = chain(seed, 320);
        let pick = |r: &mut Router| r.route(&RouteRequest::new("x", &c, 320, None), 0.0).unwrap().decode.pod;
        let (on_a, on_b) = (pick(&mut a), pick(&mut b));
        assert_eq!(a_address[on_a.index()], b_address[on_b.index()], "prefix {seed}");
        used.insert(a_address[on_a.index()].clone());
        // Idle again for the next prefix.
        for r in [&mut a, &mut b] {
            r.report("x", Lifecycle::Done, false, 0.0).unwrap();
        }
    }
    assert_eq!(used.len(), 6, "40 prefixes over 6 pods use them all");
}

#[test]
fn a_booking_follows_the_pod_that_served() {
    let mut r = router(1024);
    let pods = [r.add_pod(Role::Both, true), r.add_pod(Role::Both, true)];
    let c = chain(7, 320);
    let first = r.route(&RouteRequest::new("a", &c, 320, Some(4)), 0.0).unwrap();
    let other = if first.decode.pod == pods[0] { pods[1] } else { pods[0] };
    assert_eq!(r.served("a", first.decode.pod, 0.1), Ok(None), "served where booked: nothing moves");
    assert_eq!(r.served("a", other, 0.1), Ok(Some(first.decode.pod)));
    assert_eq!(r.load().load(first.decode.pod, 0.1), crate::load::PodLoad::default());
    let moved = r.load().load(other, 0.1);
    assert_eq!((moved.inflight_requests, moved.queued_prefill_tokens), (1, 320));
    // The prefix is being computed where it was served: the next request follows it there.
    assert_eq!(r.route(&RouteRequest::new("b", &c, 320, Some(4)), 0.3).unwrap().decode.pod, other);
    assert!(r.served("zzz", other, 0.3).is_err());
}

#[test]
fn a_prefix_is_being_computed_where_a_request_in_flight_computes_it_until_that_request_ends() {
    let mut r = router(1024);
    let pods = [r.add_pod(Role::Both, true), r.add_pod(Role::Both, true)];
    let c = chain(7, 320);
    let next = RouteRequest::new("b", &c, 320, Some(4));
    let computing = |r: &mut Router, now| {
        let candidates = r.candidates(&pods, &next, now, None);
        candidates.iter().filter(|c| c.computing_prefix).map(|c| c.pod).collect::<Vec<_>>()
    };
    assert_eq!(computing(&mut r, 0.0), vec![], "nothing in flight");
    let first = r.route(&RouteRequest::new("a", &c, 320, Some(4)), 0.0).unwrap().decode.pod;
    assert_eq!(computing(&mut r, 0.1), vec![first]);
    r.report("a", Lifecycle::Done, false, 0.2).unwrap();
    assert_eq!(computing(&mut r, 0.3), vec![], "the finished request held it");
}

#[test]
fn saturated_pods_are_skipped_and_a_saturated_fleet_makes_the_request_wait() {
    let mut r = Router::new(&RouterConfig {
        admission: Some(Admission { max_queued_prefill_tokens: Some(1000), ..Admission::default() }),
        ..test_config(1024)
    });
    let pods = [r.add_pod(Role::Both, false), r.add_pod(Role::Both, false)];
    let c = |seed| chain(seed, 640);
    let first = r.route(&RouteRequest::new("a", &c(1), 640, None), 0.0).unwrap().decode.pod;
    let second = r.route(&RouteRequest::new("b", &c(2), 640, None), 0.0).unwrap().decode.pod;
    assert_ne!(first, second, "640 queued is below the limit, but the policy spreads");
    // Both pods now queue 640 tokens; one more each reaches 1280 ≥ 1000.
    let third = r.route(&RouteRequest::new("c", &c(3), 640, None), 0.0).unwrap().decode.pod;
    let fourth = r.route(&RouteRequest::new("d", &c(4), 640, None), 0.0).unwrap().decode.pod;
    assert_ne!(third, fourth, "a pod with room is chosen over a saturated one");
    assert_eq!(r.route(&RouteRequest::new("e", &c(5), 640, None), 0.0).unwrap_err(), Unroutable::Saturated);
    // A first token frees prefill room on its pod.
    r.report("a", Lifecycle::FirstToken, false, 1.0).unwrap();
    assert_eq!(r.route(&RouteRequest::new("e", &c(5), 640, None), 1.0).unwrap().decode.pod, first);
    assert!(pods.contains(&first));
}

#[test]
fn replicas_sharing_bookings_see_each_others_requests_in_flight() {
    let replica = || {
        let mut r = router(256);
        r.add_pod(Role::Prefill, false);
        r.add_pod(Role::Both, false);
        r.add_pod(Role::Both, false);
        r.share_bookings();
        r
    };
    let (mut a, mut b) = (replica(), replica());
    let from_a = Origin(1);
    let long = chain(11, 512);
    let first = a.route(&RouteRequest::new("r1", &long, 512, Some(8)), 0.0).unwrap();
    let prefill = first.prefill.expect("512 uncached tokens disaggregate").pod;
    for update in a.take_shared() {
        b.apply_shared(from_a, &update, 0.1).unwrap();
    }
    assert!(a.take_shared().is_empty(), "taken once");
    let seen = |r: &Router, pod| r.load().load(pod, 0.1).inflight_requests;
    assert_eq!((seen(&b, prefill), seen(&b, first.decode.pod)), (1, 1), "both legs of a's request");
    // b's own request with the same id is another booking; the prefix a sent is cached
    // (approximate index) where a sent it.
    let again = b.route(&RouteRequest::new("r1", &long, 512, Some(8)), 0.2).unwrap();
    assert_eq!((again.prefill, again.decode.pod), (None, first.decode.pod));
    assert_eq!(again.cached_tokens(), 496, "all but the block of its last token");
    assert_eq!(seen(&b, first.decode.pod), 2);

    // a's lifecycle follows: prefill done, then done.
    a.report("r1", Lifecycle::Done, true, 0.3).unwrap();
    a.report("r1", Lifecycle::Done, false, 0.4).unwrap();
    let reports = a.take_shared();
    assert_eq!(reports.len(), 2);
    for update in &reports {
        b.apply_shared(from_a, update, 0.4).unwrap();
    }
    assert_eq!((seen(&b, prefill), seen(&b, first.decode.pod)), (0, 1), "only b's own is left");
    assert!(b.apply_shared(from_a, &reports[1], 0.5).is_err(), "a repeated done names nothing");

    // A booking moved by the proxy moves on the other replica too.
    let other = |p: PodId| if p == PodId(1) { PodId(2) } else { PodId(1) };
    let short = chain(12, 64);
    let routed = a.route(&RouteRequest::new("r2", &short, 64, None), 1.0).unwrap().decode.pod;
    a.served("r2", other(routed), 1.1).unwrap();
    for update in a.take_shared() {
        b.apply_shared(from_a, &update, 1.1).unwrap();
    }
    assert_eq!(seen(&b, other(routed)), 1 + u32::from(other(routed) == first.decode.pod));

    // A replica that joins rebuilds a's bookings from a snapshot; one that loses a
    // forgets them.
    let mut c = replica();
    a.report("r2", Lifecycle::FirstToken, false, 1.2).unwrap();
    for update in a.snapshot() {
        c.apply_shared(from_a, &update, 1.3).unwrap();
    }
    let on = |r: &Router, pod| {
        let l = r.load().load(pod, 1.3);
        (l.inflight_requests, l.queued_prefill_tokens)
    };
    assert_eq!(on(&c, other(routed)), on(&a, other(routed)));
    assert_eq!(on(&c, other(routed)).1, 0, "past its first token: no prefill queued");
    assert_eq!(b.clear_origin(from_a), 1);
    assert_eq!(seen(&b, other(routed)), u32::from(other(routed) == first.decode.pod));
}

#[test]
fn headroom_is_kept_for_higher_priorities() {
    let mut r = Router::new(&RouterConfig {
        admission: Some(Admission { max_inflight_requests: Some(4), headroom: 0.5, ..Admission::default() }),
        ..test_config(1024)
    });
    r.add_pod(Role::Both, false);
    let c = chain(9, 64);
    let ordinary = |id| RouteRequest { leave_headroom: true, ..RouteRequest::new(id, &c, 64, None) };
    r.route(&ordinary("a"), 0.0).unwrap();
    r.route(&ordinary("b"), 0.0).unwrap();
    assert_eq!(r.route(&ordinary("c"), 0.0).unwrap_err(), Unroutable::Saturated, "half the pod is kept");
    r.route(&RouteRequest::new("p1", &c, 64, None), 0.0).unwrap();
    r.route(&RouteRequest::new("p2", &c, 64, None), 0.0).unwrap();
    assert_eq!(r.route(&RouteRequest::new("p3", &c, 64, None), 0.0).unwrap_err(), Unroutable::Saturated);
}

#[test]
fn a_request_goes_only_to_pods_serving_its_model_and_a_model_nobody_serves_is_unroutable() {
    let mut r = router(u32::MAX);
    let pods: Vec<PodId> = (0..3).map(|_| r.add_pod(Role::Both, true)).collect();
    let (qwen, llama, sql) = (ModelId::of("qwen"), ModelId::of("llama"), ModelId::of("sql"));
    r.served_models(pods[0], vec![qwen, sql]);
    r.served_models(pods[1], vec![llama]);
    // pods[2] has not listed its models: it may serve any.
    let route = |r: &mut Router, id: &str, model: ModelId| {
        let c = chain(3, 64);
        let request = RouteRequest { model: Some(model), fallbacks: 2, ..RouteRequest::new(id, &c, 64, Some(1)) };
        r.route(&request, 0.0).map(|routed| {
            let mut chosen: Vec<PodId> = routed.fallbacks.clone();
            chosen.push(routed.decode.pod);
            chosen.sort();
            chosen
        })
    };
    assert_eq!(route(&mut r, "a", qwen).unwrap(), vec![pods[0], pods[2]], "the adapter's base and the unlisted pod");
    assert_eq!(route(&mut r, "b", sql).unwrap(), vec![pods[0], pods[2]]);
    assert_eq!(route(&mut r, "c", llama).unwrap(), vec![pods[1], pods[2]]);
    // Once every pod has listed its models, one none lists is nobody's.
    r.served_models(pods[2], vec![qwen]);
    assert_eq!(route(&mut r, "d", llama).unwrap(), vec![pods[1]]);
    assert_eq!(route(&mut r, "e", ModelId::of("mistral")).unwrap_err(), Unroutable::ModelNotServed);
    // No model named: any pod. A pod that serves it but is down: no pod at all.
    let c = chain(4, 64);
    assert!(r.route(&RouteRequest::new("f", &c, 64, Some(1)), 0.0).is_ok());
    r.unhealthy(pods[1]);
    r.unhealthy(pods[0]);
    r.unhealthy(pods[2]);
    assert_eq!(route(&mut r, "g", llama).unwrap_err(), Unroutable::NoPod);
}
