//! Pod selection policies: one trait, one file per policy, a factory from configuration.
//!
//! The scorer computes, for every eligible pod, a [`Candidate`]: how many of the request's
//! prompt tokens that pod has cached, kvgate's own predicted load on it, and the load it last
//! reported. A [`Policy`] picks one candidate and explains the figures behind the choice.

mod kv;
mod least_loaded;
mod power_of_two;
mod prefix;
mod random;
mod round_robin;
mod ttft;

pub(crate) use kv::home;
pub use kv::{KvPolicy, KvPolicyConfig, PrefillEstimate};
pub use least_loaded::LeastLoaded;
pub use power_of_two::PowerOfTwo;
pub use prefix::LongestPrefix;
pub use random::Random;
pub use round_robin::RoundRobin;
pub use ttft::TtftPolicy;

pub use crate::adapters::{AdapterFit, SlotQueue};
use crate::load::PodLoad;
use crate::pod_set::PodId;
use rand::SeedableRng;
use rand::rngs::StdRng;
use serde::Deserialize;

/// Load a pod reported itself (vLLM `/metrics`), when scraped (`/v1/pods` shows it).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct ReportedLoad {
    pub running: f64,
    pub waiting: f64,
    /// 0–1.
    pub kv_cache_usage: f64,
    /// KV blocks the engine has (`vllm:cache_config_info{num_gpu_blocks}`), 0 if unknown.
    #[serde(skip)]
    pub num_gpu_blocks: f64,
}

/// One eligible pod and the figures a policy may weigh.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate {
    pub pod: PodId,
    /// Prompt tokens this pod holds in its prefix cache (leading full blocks).
    pub cached_tokens: u32,
    /// Prompt tokens right after those that the pod holds offloaded (host memory, storage):
    /// loaded back, not computed.
    pub offloaded_tokens: u32,
    /// What loading them costs, in tokens of computing ([`crate::index::OffloadConfig`]).
    pub offload_work_tokens: u32,
    /// Blocks the router believes the pod's cache holds in all: of equally good pods, a
    /// new prefix goes to the emptiest, where its blocks evict the least.
    pub pod_blocks: u64,
    /// kvgate's own bookkeeping of what it sent there.
    pub load: PodLoad,
    pub reported: Option<ReportedLoad>,
    /// How much slower than the fleet's average the pod prefills (1 = average), learned
    /// online ([`crate::speed`]): the policies that predict time scale their costs by it.
    pub slowness: f64,
    /// Where the pod stands in this prompt's own order of pods (a rendezvous hash of the
    /// prompt's first block and the pod's key): ties between equally good, equally full
    /// pods go to the highest, so gateway replicas that have not yet heard of each other's
    /// latest choices still send a new prefix to the same pod. 0 when the prompt has no
    /// full block (ties broken at random).
    pub tie_rank: u64,
    /// Requests in flight on the pod whose prompts share this one's first block (its prefix
    /// group); counted at the prompt's [`home`] only (the pile-up guard's question), 0 elsewhere.
    pub group_inflight: u32,
    /// The share of the pod's recent GPU stores that computed again a block it had evicted
    /// lately ([`crate::index::KvIndex::recompute_share`]): high, its cache thrashes.
    pub recompute_share: f64,
    /// Blocks of the prompts routed to the pod lately ([`crate::recent::RecentBlocks`]):
    /// what its recent traffic needs cached.
    pub recent_blocks: u64,
    /// The pod's KV connector offloads blocks to another tier (host memory, storage): what
    /// its GPU cache evicts is loaded back from there, not computed again.
    pub offloads: bool,
    /// The pod runs a hybrid model (KV-cache groups beside full attention: a sliding
    /// window, mamba): a prefix it caches serves a prompt only as far as every group holds
    /// what it needs there.
    pub hybrid: bool,
    /// Part of the prompt's prefix is credited to the pod only because a request in flight
    /// there is computing it: no KV event has announced it and no finished request held it.
    pub computing_prefix: bool,
    /// How the pod stands for the request's LoRA adapter.
    pub adapter: AdapterFit,
    /// The pod's adapter slots and the requests waiting there for one (none without an
    /// adapter).
    pub slot_queue: SlotQueue,
}

/// The request, as far as policies care.
#[derive(Clone, Copy, Debug)]
pub struct RouteInput {
    pub prompt_tokens: u32,
    pub block_size: u32,
    /// Seconds the request holds its LoRA adapter's slot (its expected decode; 0 without an
    /// adapter).
    pub slot_seconds: f64,
    /// Tokens of prefill the fixed part of a first token's time is worth on a pod of the
    /// fleet's average speed (the base cost of the steps it waits through, learned:
    /// [`crate::speed::PodSpeeds::fixed_prefill_tokens`]; 0 until then). Policies that
    /// compare pods in time add it to each pod's work before scaling by its slowness: on a
    /// fleet of one speed it is the same everywhere, on a mixed one a slower pod takes
    /// longer over it, however short the prompt.
    pub fixed_prefill_tokens: f64,
    /// The pod receives the prompt's KV from a prefill pod (the decode leg of a
    /// disaggregated request): every candidate is priced holding the whole prompt, a
    /// transfer rather than a cache.
    pub kv_received: bool,
}

/// A policy's choice: the index of the chosen candidate and, per candidate, the cost it was
/// given (lower is better; `None` where the policy did not score it, e.g. filtered).
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    pub chosen: usize,
    pub costs: Vec<Option<f64>>,
}

/// A way to choose a pod (named by its configuration: [`PolicyConfig::name`]).
pub trait Policy: Send {
    /// Chooses among `candidates` (never empty).
    fn select(&mut self, input: &RouteInput, candidates: &[Candidate]) -> Decision;
}

/// Policy configuration, as written in the scorer's YAML (`policy: {name: kv, ...}`).
#[derive(
    Clone,
    Debug,
    Deserialize,
    serde::Serialize,
    PartialEq,
    schemars::JsonSchema,
    strum::IntoStaticStr,
    strum::VariantNames,
    smart_default::SmartDefault,
)]
#[serde(tag = "name", rename_all = "kebab-case", deny_unknown_fields)]
#[strum(serialize_all = "kebab-case")]
pub enum PolicyConfig {
    /// Boxed: its many weights would size every other variant.
    #[default]
    Kv(Box<KvPolicyConfig>),
    Prefix,
    Ttft,
    LeastLoaded,
    PowerOfTwo,
    RoundRobin,
    Random,
}

impl PolicyConfig {
    /// Every policy's name, as configured (`policy: {name: …}`) and in metrics.
    pub const NAMES: &[&str] = <Self as strum::VariantNames>::VARIANTS;

    /// The policy's name, as configured and in metrics.
    pub fn name(&self) -> &'static str {
        self.into()
    }

    /// Checks the policy's parameters.
    pub fn validate(&self) -> Result<(), crate::validate::Invalid> {
        match self {
            PolicyConfig::Kv(kv) => kv.validate(),
            _ => Ok(()),
        }
    }

    /// Builds the policy; `seed` makes its random choices reproducible.
    pub fn build(&self, seed: u64) -> Box<dyn Policy> {
        let rng = StdRng::seed_from_u64(seed);
        match self {
            PolicyConfig::Kv(config) => Box::new(KvPolicy::new(KvPolicyConfig::clone(config), rng)),
            PolicyConfig::Prefix => Box::new(LongestPrefix::new(rng)),
            PolicyConfig::Ttft => Box::new(TtftPolicy::new(rng)),
            PolicyConfig::LeastLoaded => Box::new(LeastLoaded::default()),
            PolicyConfig::RoundRobin => Box::new(RoundRobin::default()),
            PolicyConfig::Random => Box::new(Random::new(rng)),
            PolicyConfig::PowerOfTwo => Box::new(PowerOfTwo::new(rng)),
        }
    }
}

/// Index of the lowest cost; `None` costs are skipped. Ties go to the candidate whose cache
/// holds the fewest blocks, then to the highest [`Candidate::tie_rank`], or uniformly at
/// random when the prompt gave no ranks.
pub(crate) fn argmin_tie(costs: &[Option<f64>], candidates: &[Candidate], rng: &mut StdRng) -> usize {
    use rand::Rng;
    let best = costs.iter().flatten().copied().fold(f64::INFINITY, f64::min);
    let is_best = |i: usize| costs[i].is_some_and(|c| c <= best);
    let emptiest = (0..costs.len()).filter(|&i| is_best(i)).map(|i| candidates[i].pod_blocks).min().unwrap_or(0);
    let ties: smallvec::SmallVec<[usize; 8]> =
        (0..costs.len()).filter(|&i| is_best(i) && candidates[i].pod_blocks == emptiest).collect();
    match ties.len() {
        0 => 0,
        1 => ties[0],
        n if candidates[ties[0]].tie_rank == 0 => ties[rng.random_range(0..n)],
        _ => ties.iter().copied().max_by_key(|&i| candidates[i].tie_rank).unwrap_or(ties[0]),
    }
}

impl Candidate {
    /// Prompt tokens the pod need not compute: its cached prefix, and its offloaded blocks
    /// less what loading them costs.
    pub fn credited_tokens(&self) -> u32 {
        self.cached_tokens + self.offloaded_tokens - self.offload_work_tokens
    }

    /// Whether the pod's GPU fill says how much room it has: it states its KV capacity
    /// (`num_gpu_blocks`) and does not [`offload`](Self::offloads) to another tier, whose
    /// size no engine reports.
    pub fn states_room(&self) -> bool {
        !self.offloads && self.reported.is_some_and(|r| r.num_gpu_blocks > 0.0)
    }

    /// The pod as priced holding `tokens` of the prompt on its GPU and nothing offloaded.
    pub(crate) fn holding(&self, tokens: u32) -> Candidate {
        Candidate { cached_tokens: tokens, offloaded_tokens: 0, offload_work_tokens: 0, ..*self }
    }
}

/// Prompt tokens a candidate would compute (loading offloaded blocks counted at its cost):
/// at least one, since an engine always recomputes the last prompt token to sample from.
pub(crate) fn uncached_tokens(input: &RouteInput, c: &Candidate) -> u32 {
    let uncached = input.prompt_tokens.saturating_sub(c.credited_tokens());
    if input.prompt_tokens > 0 { uncached.max(1) } else { 0 }
}

#[cfg(test)]
pub(crate) mod test_support {
    use super::*;

    pub fn candidate(pod: u32, cached_tokens: u32, inflight: u32, queued_prefill_tokens: u64) -> Candidate {
        Candidate {
            pod: PodId(pod),
            cached_tokens,
            offloaded_tokens: 0,
            offload_work_tokens: 0,
            pod_blocks: 0,
            load: PodLoad {
                inflight_requests: inflight,
                queued_prefill_tokens,
                queued_prefill_work: queued_prefill_tokens as f64 * 100.0,
                decode_blocks: f64::from(inflight) * 10.0,
                decode_read_blocks: f64::from(inflight) * 20.0,
            },
            reported: None,
            slowness: 1.0,
            tie_rank: 0,
            group_inflight: 0,
            recompute_share: 0.0,
            recent_blocks: 0,
            offloads: false,
            hybrid: false,
            computing_prefix: false,
            adapter: AdapterFit::Unlimited,
            slot_queue: SlotQueue::default(),
        }
    }

    pub const INPUT: RouteInput = RouteInput {
        prompt_tokens: 1000,
        block_size: 16,
        slot_seconds: 0.0,
        fixed_prefill_tokens: 0.0,
        kv_received: false,
    };

    /// How often each candidate index is chosen over `n` selections.
    pub fn histogram(policy: &mut dyn Policy, candidates: &[Candidate], n: usize) -> Vec<usize> {
        let mut counts = vec![0; candidates.len()];
        for _ in 0..n {
            counts[policy.select(&INPUT, candidates).chosen] += 1;
        }
        counts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_are_configured_by_name_and_reject_unknown_fields() {
        let parse = |s: &str| serde_json::from_str::<PolicyConfig>(s);
        assert_eq!(parse(r#"{"name": "round-robin"}"#).unwrap(), PolicyConfig::RoundRobin);
        assert!(
            matches!(parse(r#"{"name": "kv", "decode_weight": 0.5}"#).unwrap(), PolicyConfig::Kv(c) if c.decode_weight == 0.5)
        );
        assert!(parse(r#"{"name": "kv", "decode_wieght": 0.5}"#).unwrap_err().to_string().contains("decode_wieght"));
        assert!(parse(r#"{"name": "fastest"}"#).is_err());
        assert_eq!(PolicyConfig::NAMES.len(), 7);
        for &name in PolicyConfig::NAMES {
            let config = parse(&format!(r#"{{"name": "{name}"}}"#)).unwrap();
            assert_eq!(config.name(), name, "the name it is configured by is the one it goes by");
        }
    }

    #[test]
    fn ties_go_to_the_emptiest_cache_then_the_highest_rank_or_at_random() {
        use test_support::candidate;
        let mut rng = StdRng::seed_from_u64(1);
        let costs = [Some(2.0), Some(1.0), None, Some(1.0)];
        let unranked: Vec<Candidate> = (0..4).map(|i| candidate(i, 0, 0, 0)).collect();
        let mut seen = [0; 4];
        for _ in 0..200 {
            seen[argmin_tie(&costs, &unranked, &mut rng)] += 1;
        }
        assert_eq!((seen[0], seen[2]), (0, 0));
        assert!(seen[1] > 50 && seen[3] > 50, "{seen:?}");
        // Ranked: always the same of the tied, never a cheaper-ranked but dearer pod.
        let ranks = [99, 5, 7, 3];
        let ranked: Vec<Candidate> =
            (0..4).map(|i| Candidate { tie_rank: ranks[i], ..candidate(i as u32, 0, 0, 0) }).collect();
        assert!((0..50).all(|_| argmin_tie(&costs, &ranked, &mut rng) == 1));
        let reranked: Vec<Candidate> =
            ranked.iter().map(|c| Candidate { tie_rank: 9 - c.tie_rank % 9, ..*c }).collect();
        assert_eq!(argmin_tie(&costs, &reranked, &mut rng), 3);
        // A fuller cache loses the tie whatever its rank, and only the tie.
        let mut fuller = reranked.clone();
        fuller[3].pod_blocks = 40;
        assert_eq!(argmin_tie(&costs, &fuller, &mut rng), 1);
        fuller[1].pod_blocks = 80;
        assert_eq!(argmin_tie(&costs, &fuller, &mut rng), 3);
        fuller[3].pod_blocks = 0;
        fuller[0].pod_blocks = 0;
        assert_eq!(argmin_tie(&costs, &fuller, &mut rng), 3, "the emptier pod 0 costs more");
    }
}
