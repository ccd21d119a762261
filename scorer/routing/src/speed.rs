//! Each pod's prefill speed, learned online from what it does — so a fleet mixing GPU
//! generations (an A100 beside H100s) needs no per-pod configuration.
//!
//! A request's first token (the end of its prefill leg, when disaggregated) is a sample:
//! `x` = the uncached prompt tokens it computed there, `y` = the seconds from its booking to
//! its first token — taken only when no earlier prefill on that pod was still unfinished at
//! its booking. A prefill queued behind others measures the queue, and under load (steps
//! shared with many decoding sequences, a thrashing cache) a pod looks slower than it is:
//! learning from those turned a loaded pod "slow", routed its prefixes away and broke cache
//! affinity (the cluster simulator's capacity workload collapsed past its knee).
//! Under sustained load a pod keeps what it learned when it had room. Nor does a prefill
//! teach whose credited cache the engine evicted after its booking (it computed more than
//! it was booked for), or one booked past its pod's KV capacity (the blocks its requests in
//! flight hold, with its own new ones, exceed the pod's `num_gpu_blocks`): vLLM holds it
//! back until room frees, so its time is that wait. On 64 pods of one type offloading to
//! host memory, such waits set pods 1.45 times apart while their caches filled, the fleet
//! was judged mixed, and prefix groups left pods taken for slow ones. A sample is held at
//! [`OUTLIER_FACTOR`] times what the pod's learned speed predicts: an engine that holds a
//! prefill back (for KV room kvgate's bookings did not see, a preemption) takes a second
//! over a 20 ms prefill, and a few such samples had made pods of one GPU type look up to
//! 2.4× apart on 64 pods under load.
//!
//! Two decayed fits turn samples into a comparison:
//!
//! - the **fleet**'s time per prefill on a pod of its average speed, `y ≈ a + b·x + c·d`,
//!   least squares over every pod's samples, each scaled by the pods' mean learned
//!   slowness over its own pod's (fitted on raw times, slow pods that serve mostly short
//!   cache hits beside fast pods serving long misses made the slow pods' times look like
//!   the fleet's fixed cost), `d` the requests in flight on the pod at the booking (the
//!   sequences its steps are shared with: a prefill beside thirty decoding sequences is not
//!   a slow pod's); the intercept is the fixed cost of a step and of reporting: short
//!   prefills are not taken for slow ones. While `d` has not varied, the line in `x`;
//! - per **pod**, the ratio of the seconds it took to the seconds the fleet fit, as it now
//!   stands, predicts for the same samples (judged by the prediction of their moment, one
//!   short prefill set against a fleet's first poor fit had made a half-speed pod look the
//!   fleet's fastest for 40 s): its **slowness** (1 = the fleet's average speed, 2 = half
//!   as fast), shrunk toward 1 by `prior_samples` pseudo-samples so a handful of reports
//!   cannot swing it, clamped to `[1/max_slowness, max_slowness]`. While the learned
//!   slownesses span less than `alike_spread` (slowest ÷ fastest) the fleet counts as alike
//!   and every pod is applied as 1: on a fleet of one GPU type the ±5 % of noise would
//!   otherwise decide ties. Only pods with `judge_samples` samples of their own (or a
//!   declared slowness) count in that spread: a few samples of a real engine can be far
//!   apart, and few pseudo-samples would then let them pass for a mixed fleet.
//!
//! Both fits forget at the rate of `window_samples` (each new sample multiplies the old
//! sums by `1 − 1/window`), so a pod that changes speed is re-learned within a window of its
//! own samples. The `kv` and `ttft` policies multiply a pod's cost by its slowness: pods are
//! compared in predicted seconds, not tokens.
//!
//! A pod's slowness can be **declared** ([`PodSpeeds::declare`]): what its hardware is known
//! to be beside the fleet's. Its `prior_samples` pseudo-samples then sit at the declared
//! slowness instead of 1, so it applies from the first request — before any sample, when a
//! cold fleet places its first prefixes and later requests follow them — and the pod's own
//! samples refine it as they come.
//!
//! Decode speed is learned beside it, per pod, from the `done` reports that carry the
//! request's output tokens: tokens after the first ÷ seconds after the first token (decayed
//! alike). It sets how fast a pod's bookings are taken to generate their expected output
//! (in place of `load.decode_tokens_per_second`), so a slow pod's decode load is held
//! longer. Time is the caller's (no clock here).

use crate::pod_set::{PodId, PodMap};
use crate::validate::{Invalid, check};
use serde::Deserialize;
use smart_default::SmartDefault;

/// A prefill sample counts as at most this many times what the pod's learned speed
/// predicts for it ([`PodSpeeds::prefill_done`]); a pod truly slower than that is learned
/// over a few samples, each raising its slowness by up to this factor. At 3, the prefills
/// engines held back under KV pressure still spread 64 pods of one type over 0.77–1.16,
/// right on `alike_spread`: the fleet was judged mixed and alike by turns, and learning
/// from fewer `prior_samples` then steered it by noise.
const OUTLIER_FACTOR: f64 = 1.5;

/// How pod speeds are learned.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, schemars::JsonSchema, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct SpeedConfig {
    /// Learn and apply pod speeds; false = every pod counts as the fleet's average.
    #[default(true)]
    pub learn: bool,
    /// Memory of both fits, in samples (a pod's own samples for its slowness).
    #[default(200.0)]
    pub window_samples: f64,
    /// Pseudo-samples at slowness 1 (or at the pod's declared `slowness`) every pod starts
    /// with; also the fleet samples needed before any pod is judged. Fewer learn a mixed
    /// fleet sooner (its first prefixes land before its speeds are known): from 8, the
    /// cluster simulator's mixed fleet carried 2–4 % less at its SLO, its pods twice as slow
    /// learned 1.45 times as slow 3 s into a run at twice its rate.
    #[default(4.0)]
    pub prior_samples: f64,
    /// Samples of its own a pod needs before its slowness counts in judging the fleet alike
    /// or mixed (`alike_spread`); a declared slowness counts from the start. On two real
    /// vLLM engines of one type, four samples each had set them 0.69 and 1.10 apart, and a
    /// conversation's follow-ups then left its engine (docs/design/placement.md).
    #[default(8.0)]
    pub judge_samples: f64,
    /// Slowness is kept within `[1/max, max]`.
    #[default(8.0)]
    pub max_slowness: f64,
    /// A fleet whose learned slownesses span less than this factor (slowest ÷ fastest) is
    /// taken as alike and every pod's slowness applied as 1: noise, or one pod's passing
    /// load, is not a slower GPU, and alike pods keep comparing on work alone.
    #[default(1.5)]
    pub alike_spread: f64,
}

impl SpeedConfig {
    pub fn validate(&self) -> Result<(), Invalid> {
        let at_least = |v: f64, min: f64| v >= min && v.is_finite();
        check(at_least(self.window_samples, 2.0), "window_samples", "must be at least 2")?;
        check(at_least(self.prior_samples, 0.0), "prior_samples", "must be 0 or more")?;
        check(at_least(self.judge_samples, 0.0), "judge_samples", "must be 0 or more")?;
        check(at_least(self.max_slowness, 1.0), "max_slowness", "must be at least 1")?;
        check(at_least(self.alike_spread, 1.0), "alike_spread", "must be at least 1")
    }

    /// The slownesses a pod can have: `[1/max_slowness, max_slowness]`.
    pub fn slowness_range(&self) -> std::ops::RangeInclusive<f64> {
        1.0 / self.max_slowness..=self.max_slowness
    }
}

/// Exponentially decayed sums for a least-squares plane `y = a + b·x + c·d`: the seconds
/// of a prefill of `x` tokens beside `d` requests in flight on its pod.
#[derive(Clone, Copy, Debug, Default)]
struct Fit {
    n: f64,
    sx: f64,
    sd: f64,
    sy: f64,
    sxx: f64,
    sdd: f64,
    sxd: f64,
    sxy: f64,
    sdy: f64,
}

impl Fit {
    fn add(&mut self, x: f64, d: f64, y: f64, keep: f64) {
        *self = Fit {
            n: self.n * keep + 1.0,
            sx: self.sx * keep + x,
            sd: self.sd * keep + d,
            sy: self.sy * keep + y,
            sxx: self.sxx * keep + x * x,
            sdd: self.sdd * keep + d * d,
            sxd: self.sxd * keep + x * d,
            sxy: self.sxy * keep + x * y,
            sdy: self.sdy * keep + d * y,
        };
    }

    /// The plane's `(a, b, c)`, kept non-negative. While `d` has not varied (or the plane
    /// would make more requests in flight faster), the line in `x` alone (`c` = 0); while
    /// `x` has not varied either, the mean (`b` = 0).
    fn coefficients(&self) -> (f64, f64, f64) {
        let mean = |sum: f64| sum / self.n;
        let (mx, md, my) = (mean(self.sx), mean(self.sd), mean(self.sy));
        let (vxx, vdd, vxd) = (mean(self.sxx) - mx * mx, mean(self.sdd) - md * md, mean(self.sxd) - mx * md);
        let (cxy, cdy) = (mean(self.sxy) - mx * my, mean(self.sdy) - md * my);
        let varies = |v: f64, m: f64| v > 1e-9 * m * m.max(1.0);
        let det = vxx * vdd - vxd * vxd;
        let plane = (varies(vxx, mx) && varies(vdd, md) && det > 1e-6 * vxx * vdd)
            .then(|| ((cxy * vdd - cdy * vxd) / det, (cdy * vxx - cxy * vxd) / det))
            .filter(|&(b, c)| b >= 0.0 && c >= 0.0);
        let (b, c) = plane.unwrap_or_else(|| (if varies(vxx, mx) { (cxy / vxx).max(0.0) } else { 0.0 }, 0.0));
        ((my - b * mx - c * md).max(0.0), b, c)
    }
}

#[derive(Clone, Copy, Debug, SmartDefault)]
struct PodSpeed {
    /// When the pod last finished a prefill (its next one started no earlier).
    #[default(f64::NEG_INFINITY)]
    busy_until: f64,
    /// Decayed seconds its samples took, and their uncached tokens and requests in flight
    /// beside them: what the fleet fit predicts for them is taken at the fit's current
    /// coefficients, so samples judged against the fit of a fleet's first seconds are judged
    /// again as it learns.
    observed: f64,
    tokens: f64,
    beside: f64,
    samples: f64,
    /// Decayed output tokens after the first, the seconds they took, and the samples.
    decoded_tokens: f64,
    decode_seconds: f64,
    decode_samples: f64,
    /// Where its slowness starts (1 unless declared).
    #[default(1.0)]
    declared: f64,
}

/// A prefill that finished ([`PodSpeeds::prefill_done`]).
#[derive(Clone, Copy, Debug)]
pub struct Prefill {
    /// When it was booked on its pod.
    pub booked_at: f64,
    /// The uncached prompt tokens it was booked to compute.
    pub tokens: u64,
    /// Requests in flight on the pod at its booking, besides it.
    pub beside: u32,
    /// The engine evicted part of the cache it was booked with: it computed more than
    /// `tokens`.
    pub credit_evicted: bool,
    /// Booked past the pod's KV capacity: its requests in flight and its new blocks needed
    /// more blocks than the pod has, so the engine held it back until others freed room, and
    /// its time measures that wait.
    pub past_capacity: bool,
}

impl Prefill {
    /// `tokens` booked at `booked_at` on an idle pod, its cache kept.
    #[cfg(test)]
    fn alone(booked_at: f64, tokens: u64) -> Self {
        Self { booked_at, tokens, beside: 0, credit_evicted: false, past_capacity: false }
    }
}

/// A pod's learned speed, for `/v1/pods` and metrics.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SpeedView {
    /// Seconds it takes per second the fleet's average pod would (1 = average).
    pub slowness: f64,
    /// Its decayed count of samples.
    pub samples: f64,
    /// Tokens per second one sequence decodes there, once `prior_samples` reports taught it.
    pub decode_tokens_per_second: Option<f64>,
}

/// The learner (see the module doc).
pub struct PodSpeeds {
    config: SpeedConfig,
    /// What each decayed sum keeps of itself per new sample: `1 − 1/window_samples`.
    keep: f64,
    /// The decayed count of `prior_samples` reports, `(1 − keepⁿ) / (1 − keep)`: the decode
    /// reports a pod needs before its decode speed is used.
    decode_reports_needed: f64,
    /// The decayed count of `judge_samples` samples: the samples a pod needs before it
    /// counts in judging the fleet's spread.
    judge_after: f64,
    fleet: Fit,
    pods: PodMap<PodSpeed>,
    /// Whether the learned slownesses span more than `alike_spread` (updated per sample).
    unlike: bool,
    /// The mean learned slowness of the pods that have taught samples (updated per sample):
    /// the fleet fit is of a pod this slow.
    mean_slowness: f64,
    /// The fleet fit's `(a, b, c)`, updated per sample (read at every decision).
    coefficients: (f64, f64, f64),
    /// [`Self::fixed_prefill_tokens`], updated per sample (read at every decision).
    fixed_prefill_tokens: Option<f64>,
}

impl PodSpeeds {
    pub fn new(config: SpeedConfig) -> Self {
        let keep = 1.0 - 1.0 / config.window_samples;
        // What `n` samples in a row count for once decayed (less a rounding margin).
        let decayed = |n: f64| (1.0 - keep.powf(n)) / (1.0 - keep) - 1e-9;
        Self {
            config,
            keep,
            decode_reports_needed: decayed(config.prior_samples.max(1.0)),
            judge_after: decayed(config.judge_samples),
            fleet: Fit::default(),
            pods: PodMap::default(),
            unlike: false,
            mean_slowness: 1.0,
            coefficients: (0.0, 0.0, 0.0),
            fixed_prefill_tokens: None,
        }
    }

    /// `prefill` on `pod` finished at `now`.
    pub fn prefill_done(&mut self, pod: PodId, prefill: Prefill, now: f64) {
        let Prefill { booked_at, tokens, beside, credit_evicted, past_capacity } = prefill;
        let keep = self.keep;
        if tokens == 0 {
            return; // Nothing computed there (its KV came from a prefill pod).
        }
        let state = self.pods.get_mut(pod);
        // Only a prefill that had the pod to itself from its booking teaches: one queued
        // behind others measures the queue, and a pod under load looks slower than it is.
        let queued = booked_at < state.busy_until;
        state.busy_until = state.busy_until.max(now);
        if queued || credit_evicted || past_capacity || now < booked_at {
            return;
        }
        let learned = self.fleet_learned();
        let slowness = self.pods.get(pod).map_or(1.0, |p| self.learned_slowness(p));
        let (x, d) = (tokens as f64, f64::from(beside));
        let predicted = self.predict(x, d);
        // A sample far slower than the pod's learned speed predicts is held at
        // `OUTLIER_FACTOR` times it: a prefill the engine held back (no KV room for it, a
        // preemption) takes many times its compute, and one such second among tens of
        // milliseconds made a pod of a uniform fleet look twice as slow for seconds.
        let y = if learned { (now - booked_at).min(OUTLIER_FACTOR * slowness * predicted) } else { now - booked_at };
        let state = self.pods.get_mut(pod);
        if learned {
            state.observed = state.observed * keep + y;
            state.tokens = state.tokens * keep + x;
            state.beside = state.beside * keep + d;
            state.samples = state.samples * keep + 1.0;
        }
        // The fleet fit is of a pod of the fleet's mean slowness: each sample scaled by its
        // pod's learned slowness. Fitted on raw times, a mixed fleet whose slow pods serve
        // mostly cache hits and whose fast pods serve mostly long misses took the slow pods'
        // short prefills for the fleet's fixed cost, and they looked less slow than they are.
        self.fleet.add(x, d, y * self.mean_slowness / slowness, keep);
        self.coefficients = self.fleet.coefficients();
        let (a, b, _) = self.coefficients;
        self.fixed_prefill_tokens = (self.fleet_learned() && b > 0.0).then(|| a / b);
        self.judge_spread();
    }

    /// `pod` is known to take `slowness` times the fleet's average time (its GPU beside the
    /// fleet's): its learning starts there instead of at 1 (with learning off, every pod
    /// still counts as average).
    pub fn declare(&mut self, pod: PodId, slowness: f64) {
        let range = self.config.slowness_range();
        self.pods.get_mut(pod).declared =
            if slowness.is_finite() { slowness.clamp(*range.start(), *range.end()) } else { 1.0 };
        self.judge_spread();
    }

    /// Whether the slownesses of the pods judged so far (by `judge_samples` samples or
    /// declared) span more than `alike_spread`. Once some pod is declared, the fleet's
    /// average (1) counts too: declaring the slow pods alone says the others are not. And the
    /// mean slowness of the pods that have taught samples, which sets the fleet fit's scale.
    fn judge_spread(&mut self) {
        let (mut fastest, mut slowest, mut declared) = (f64::INFINITY, 0.0_f64, false);
        let (mut taught, mut sum) = (0usize, 0.0);
        for (_, p) in self.pods.iter().filter(|(_, p)| p.samples > 0.0 || p.declared != 1.0) {
            let s = self.learned_slowness(p);
            if p.declared != 1.0 || p.samples >= self.judge_after {
                (fastest, slowest, declared) = (fastest.min(s), slowest.max(s), declared || p.declared != 1.0);
            }
            if p.samples > 0.0 {
                (taught, sum) = (taught + 1, sum + s);
            }
        }
        self.mean_slowness = if taught > 0 { sum / taught as f64 } else { 1.0 };
        if declared {
            (fastest, slowest) = (fastest.min(1.0), slowest.max(1.0));
        }
        self.unlike = slowest > fastest * self.config.alike_spread;
    }

    /// A request on `pod` whose first token came at `first_token_at` finished at `now` with
    /// `output_tokens` tokens.
    pub fn decode_done(&mut self, pod: PodId, first_token_at: f64, output_tokens: u32, now: f64) {
        let keep = self.keep;
        let state = self.pods.get_mut(pod);
        if output_tokens < 2 || now <= first_token_at {
            return;
        }
        state.decoded_tokens = state.decoded_tokens * keep + f64::from(output_tokens - 1);
        state.decode_seconds = state.decode_seconds * keep + (now - first_token_at);
        state.decode_samples = state.decode_samples * keep + 1.0;
    }

    /// The pod's learned decode speed per sequence, if learning is on and it has one.
    pub fn decode_tokens_per_second(&self, pod: PodId) -> Option<f64> {
        self.pods.get(pod).filter(|_| self.config.learn).and_then(|p| self.learned_decode(p))
    }

    /// The mean of the pods' learned decode speeds, if learning is on and some pod has one.
    pub fn mean_decode_tokens_per_second(&self) -> Option<f64> {
        if !self.config.learn {
            return None;
        }
        let learned = self.pods.iter().filter_map(|(_, p)| self.learned_decode(p));
        let (n, sum) = learned.fold((0usize, 0.0), |(n, sum), speed| (n + 1, sum + speed));
        (n > 0).then(|| sum / n as f64)
    }

    /// The pod's slowness as applied: 1 unless learning is on and the fleet's pods are
    /// unlike (their learned slownesses span more than `alike_spread`).
    pub fn slowness(&self, pod: PodId) -> f64 {
        match self.pods.get(pod) {
            Some(p) if self.config.learn && self.unlike => self.learned_slowness(p),
            _ => 1.0,
        }
    }

    /// Predicted seconds for `pod` to prefill `tokens` uncached tokens beside `beside`
    /// requests in flight: the fleet's fit times the pod's slowness as applied; `None` until
    /// the fleet has taught the fit (`prior_samples` first tokens).
    pub fn prefill_seconds(&self, pod: PodId, tokens: u64, beside: u32) -> Option<f64> {
        self.fleet_learned().then(|| {
            if tokens == 0 { 0.0 } else { self.predict(tokens as f64, f64::from(beside)) * self.slowness(pod) }
        })
    }

    /// The fleet fit's seconds for `x` tokens beside `d` requests on a pod of the fleet's
    /// mean slowness, at its coefficients as of the last sample.
    fn predict(&self, x: f64, d: f64) -> f64 {
        let (a, b, c) = self.coefficients;
        a + b * x + c * d
    }

    /// Whether the fleet fit has taught enough samples (`prior_samples`, at least 2) to be
    /// used.
    fn fleet_learned(&self) -> bool {
        self.fleet.n >= self.config.prior_samples.max(2.0)
    }

    /// Tokens of prefill the fixed part of a first token's time is worth on a pod of the
    /// fleet's average speed: the fleet fit's intercept (the base cost of the steps a
    /// request waits through, and of reporting) over its seconds per token. A slower pod
    /// takes longer over it too, however short the prompt. `None` until the fleet has
    /// taught the fit, or while its prefills have not varied in size.
    pub fn fixed_prefill_tokens(&self) -> Option<f64> {
        self.fixed_prefill_tokens
    }

    /// Seconds taken ÷ seconds the fleet fit predicted, with `prior_samples` samples that
    /// took the declared slowness (1 by default) times what the fleet predicts (its mean)
    /// added to both, clamped.
    fn learned_slowness(&self, state: &PodSpeed) -> f64 {
        let prior = if self.fleet.n > 0.0 { self.config.prior_samples * self.fleet.sy / self.fleet.n } else { 0.0 };
        let (a, b, c) = self.coefficients;
        let expected = a * state.samples + b * state.tokens + c * state.beside;
        let (observed, expected) = (state.observed + state.declared * prior, expected + prior);
        let slowness = if expected > 0.0 { observed / expected } else { state.declared };
        slowness.clamp(1.0 / self.config.max_slowness, self.config.max_slowness)
    }

    /// Output tokens after the first ÷ their seconds, once enough reports arrived.
    fn learned_decode(&self, state: &PodSpeed) -> Option<f64> {
        (state.decode_samples >= self.decode_reports_needed).then(|| state.decoded_tokens / state.decode_seconds)
    }

    /// The pod's learned speed (whether or not it is applied).
    pub fn view(&self, pod: PodId) -> SpeedView {
        match self.pods.get(pod) {
            Some(state) => SpeedView {
                slowness: self.learned_slowness(state),
                samples: state.samples,
                decode_tokens_per_second: self.learned_decode(state),
            },
            None => SpeedView { slowness: 1.0, samples: 0.0, decode_tokens_per_second: None },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// Prefill seconds of `tokens` on a pod `slowness` times the reference: a step's fixed
    /// cost plus a per-token one, with ±`noise` relative jitter.
    fn prefill_secs(tokens: u64, slowness: f64, noise: f64, rng: &mut StdRng) -> f64 {
        (0.006 + 40e-6 * tokens as f64) * slowness * (1.0 + noise * (2.0 * rng.random::<f64>() - 1.0))
    }

    /// Feeds `n` isolated prefills per pod (pods idle between them), prompt sizes drawn
    /// from `sizes`, round robin over the pods.
    fn feed(speeds: &mut PodSpeeds, slowness: &[f64], sizes: &[u64], n: usize, t: &mut f64, rng: &mut StdRng) {
        for i in 0..n * slowness.len() {
            let pod = i % slowness.len();
            let tokens = sizes[rng.random_range(0..sizes.len())];
            let secs = prefill_secs(tokens, slowness[pod], 0.3, rng);
            speeds.prefill_done(PodId(pod as u32), Prefill::alone(*t, tokens), *t + secs);
            *t += 1.0;
        }
    }

    /// A learner (of pods 0–3, as the tests feed it).
    fn learner(config: SpeedConfig) -> PodSpeeds {
        PodSpeeds::new(config)
    }

    /// What was learned (before the tolerance).
    fn slowness(speeds: &PodSpeeds, pods: usize) -> Vec<f64> {
        (0..pods as u32).map(|p| speeds.view(PodId(p)).slowness).collect()
    }

    #[test]
    fn a_pod_twice_as_slow_is_found_through_noise() {
        let mut speeds = learner(SpeedConfig::default());
        let (mut rng, mut t) = (StdRng::seed_from_u64(3), 0.0);
        let truth = [1.0, 2.0, 1.0, 2.0];
        assert_eq!(slowness(&speeds, 4), vec![1.0; 4], "nothing learned yet");
        feed(&mut speeds, &truth, &[16, 100, 500, 2000, 4000], 300, &mut t, &mut rng);
        let s = slowness(&speeds, 4);
        // Relative to the fleet's average (1.5): 2/3 and 4/3.
        for (pod, &learned) in s.iter().enumerate() {
            let expected = truth[pod] / 1.5;
            assert!((learned / expected - 1.0).abs() < 0.12, "pod {pod}: {learned} vs {expected} ({s:?})");
            assert_eq!(speeds.slowness(PodId(pod as u32)), learned, "unlike pods: applied");
        }
    }

    #[test]
    fn a_pod_counts_in_the_spread_only_after_its_own_judge_samples() {
        // Pod 1 is three times as slow. Its first samples already show it, but a few samples
        // are what noise on one engine type also shows: the fleet stays alike until both
        // pods have taught `judge_samples` samples each (counted whole: no forgetting).
        let config = SpeedConfig { window_samples: 1e9, ..Default::default() };
        let mut speeds = learner(config);
        let (mut rng, mut t) = (StdRng::seed_from_u64(7), 0.0);
        let (mut seen_apart, mut applied) = (false, false);
        for round in 0..40 {
            feed(&mut speeds, &[1.0, 3.0], &[500, 2000], 1, &mut t, &mut rng);
            let (fast, slow) = (speeds.view(PodId(0)), speeds.view(PodId(1)));
            let judged = fast.samples.min(slow.samples) > config.judge_samples - 0.5;
            if !judged {
                seen_apart |= slow.slowness > fast.slowness * config.alike_spread;
                assert_eq!(speeds.slowness(PodId(1)), 1.0, "round {round}: applied on {} samples", slow.samples);
            } else {
                applied |= speeds.slowness(PodId(1)) > 1.0;
            }
        }
        assert!(seen_apart, "the pods looked apart before they were judged");
        assert!(applied, "judged unlike once both had their samples");
    }

    #[test]
    fn a_first_tokens_fixed_time_is_learned_in_tokens_of_prefill() {
        // Every prefill takes 6 ms plus 40 µs a token: the fixed part is worth 150 tokens,
        // on pods of any speed.
        let mut speeds = learner(SpeedConfig::default());
        let (mut rng, mut t) = (StdRng::seed_from_u64(19), 0.0);
        assert_eq!(speeds.fixed_prefill_tokens(), None, "nothing learned yet");
        feed(&mut speeds, &[1.0, 2.0, 1.0, 2.0], &[16, 100, 400], 200, &mut t, &mut rng);
        let fixed = speeds.fixed_prefill_tokens().expect("learned");
        assert!((fixed / 150.0 - 1.0).abs() < 0.15, "{fixed} tokens");
    }

    #[test]
    fn slow_pods_serving_mostly_cache_hits_are_found_as_slow_as_they_are() {
        // Pods 2 and 3 take twice as long; cache affinity has given them mostly short
        // prefills (hits on documents they hold) and the fast pods mostly long ones.
        let mut speeds = learner(SpeedConfig::default());
        let (mut rng, mut t) = (StdRng::seed_from_u64(23), 0.0);
        let truth = [1.0, 1.0, 2.0, 2.0];
        for i in 0..1200 {
            let pod = i % 4;
            let short = (pod >= 2) == (rng.random::<f64>() < 0.8);
            let tokens = if short { rng.random_range(16..80) } else { rng.random_range(2000..4000) };
            let secs = prefill_secs(tokens, truth[pod], 0.2, &mut rng);
            speeds.prefill_done(PodId(pod as u32), Prefill::alone(t, tokens), t + secs);
            t += 1.0;
        }
        // The least of the four ratios, seeds 1–5: 1.69–1.77 with the fleet fitted on raw
        // times, 1.81–1.90 fitted per pod of mean slowness (the rest is the pseudo-samples
        // at 1).
        let s = slowness(&speeds, 4);
        for slow in [2, 3] {
            for fast in [0, 1] {
                let ratio = s[slow] / s[fast];
                assert!((ratio / 2.0 - 1.0).abs() < 0.1, "pod {slow} against {fast}: {ratio} ({s:?})");
            }
        }
    }

    #[test]
    fn a_pod_judged_against_the_fleets_first_fit_is_judged_again_as_the_fit_learns() {
        // The fleet's first samples make a poor fit: three of its first cold prompts were
        // held back a second beside three requests, so it predicts most of a second for a
        // short prefill beside five, which the slow pod 1 then takes in 17 ms. (With 8
        // pseudo-samples, so that these first samples set the fit, not pod 0's slowness.)
        let mut speeds = learner(SpeedConfig { prior_samples: 8.0, ..Default::default() });
        let (mut rng, mut t) = (StdRng::seed_from_u64(29), 0.0);
        for (i, beside) in [0, 0, 3, 0, 0, 3, 0, 0, 3, 0].into_iter().enumerate() {
            let tokens = [2000, 4000][i % 2];
            let held = if beside > 0 { 1.0 } else { 0.0 };
            let secs = prefill_secs(tokens, 1.0, 0.1, &mut rng) + held;
            speeds.prefill_done(PodId(0), Prefill { beside, ..Prefill::alone(t, tokens) }, t + secs);
            t += 2.0;
        }
        let secs = prefill_secs(65, 2.0, 0.0, &mut rng);
        speeds.prefill_done(PodId(1), Prefill { beside: 5, ..Prefill::alone(t, 65) }, t + secs);
        t += 1.0;
        let first = slowness(&speeds, 2);
        assert!(first[1] < first[0], "taken for the faster: {first:?}");
        // Each sample used to stay judged by the prediction of its moment: after 60 samples
        // each the slow pod looked 1.19 times as slow. Judged by the fit as it now stands,
        // 1.53 (the rest is the pseudo-samples and the hold on slow samples).
        feed(&mut speeds, &[1.0, 2.0], &[16, 100, 500, 2000, 4000], 60, &mut t, &mut rng);
        let s = slowness(&speeds, 2);
        assert!(s[1] / s[0] > 1.4, "{first:?} then {s:?}");
    }

    #[test]
    fn short_prefills_are_not_taken_for_a_slow_pod() {
        // Same hardware; pod 0 gets only cache hits (16 new tokens: a step's fixed cost
        // dominates), pod 1 only cold 4000-token prompts.
        let mut speeds = learner(SpeedConfig::default());
        let (mut rng, mut t) = (StdRng::seed_from_u64(5), 0.0);
        for i in 0..600 {
            let (pod, tokens) = if i % 2 == 0 { (0, 16) } else { (1, 4000) };
            // Mix in both sizes on a third pod so the fleet fit sees the whole range.
            speeds.prefill_done(PodId(pod), Prefill::alone(t, tokens), t + prefill_secs(tokens, 1.0, 0.2, &mut rng));
            let mixed = if i % 3 == 0 { 16 } else { 4000 };
            speeds.prefill_done(PodId(2), Prefill::alone(t, mixed), t + prefill_secs(mixed, 1.0, 0.2, &mut rng));
            t += 1.0;
        }
        for (pod, s) in slowness(&speeds, 3).into_iter().enumerate() {
            assert!((s - 1.0).abs() < 0.15, "pod {pod}: {s}");
            assert_eq!(speeds.slowness(PodId(pod as u32)), 1.0, "alike pods");
        }
    }

    #[test]
    fn a_prefill_held_back_by_its_engine_does_not_make_a_pod_slow() {
        // Four pods of one type; once the fleet is under load, one prefill in twenty on pod 1
        // waits a second for KV room.
        let mut speeds = learner(SpeedConfig::default());
        let (mut rng, mut t) = (StdRng::seed_from_u64(13), 0.0);
        for i in 0..400 {
            let pod = i % 4;
            let tokens = [50, 100, 400][rng.random_range(0..3)];
            let mut secs = prefill_secs(tokens, 1.0, 0.2, &mut rng);
            if i >= 100 && pod == 1 && i % 20 == 1 {
                secs += 1.0;
            }
            speeds.prefill_done(PodId(pod as u32), Prefill::alone(t, tokens), t + secs);
            t += 1.0;
        }
        let s = slowness(&speeds, 4);
        assert!(s[1] < 1.4, "pod 1 looks {}x slower ({s:?})", s[1]);
        assert_eq!(speeds.slowness(PodId(1)), 1.0, "alike pods: {s:?}");
        // A prefill whose credited cache was evicted computed more than it was booked for.
        let before = speeds.view(PodId(2));
        speeds.prefill_done(PodId(2), Prefill { credit_evicted: true, ..Prefill::alone(t, 100) }, t + 0.5);
        assert_eq!(speeds.view(PodId(2)), before, "it teaches nothing");
        // Nor does one booked past the pod's KV capacity: it waited for room.
        t += 1.0;
        speeds.prefill_done(PodId(2), Prefill { past_capacity: true, ..Prefill::alone(t, 100) }, t + 0.5);
        assert_eq!(speeds.view(PodId(2)), before, "it teaches nothing either");
    }

    #[test]
    fn requests_in_flight_beside_a_prefill_are_not_taken_for_a_slow_pod() {
        // Same hardware; each step also serves the pod's decoding sequences, so a prefill
        // beside `d` of them takes (1 + d/40) times as long. Pod 1 always has 30–40 in
        // flight, pods 0 and 2 up to 20.
        let mut speeds = learner(SpeedConfig::default());
        let (mut rng, mut t) = (StdRng::seed_from_u64(17), 0.0);
        for i in 0..900 {
            let pod = i % 3;
            let beside = if pod == 1 { rng.random_range(30..=40) } else { rng.random_range(0..=20) };
            let tokens = [50, 200, 1000][rng.random_range(0..3)];
            let secs = prefill_secs(tokens, 1.0, 0.1, &mut rng) * (1.0 + f64::from(beside) / 40.0);
            speeds.prefill_done(PodId(pod as u32), Prefill { beside, ..Prefill::alone(t, tokens) }, t + secs);
            t += 1.0;
        }
        let s = slowness(&speeds, 3);
        assert!(s[1] < 1.15, "pod 1 looks {}x slower ({s:?})", s[1]);
        // The fit predicts a loaded pod's prefill longer than an idle one's.
        let (idle, loaded) = (speeds.prefill_seconds(PodId(0), 1000, 0), speeds.prefill_seconds(PodId(0), 1000, 40));
        assert!(loaded.unwrap() > 1.3 * idle.unwrap(), "{idle:?} {loaded:?}");
    }

    #[test]
    fn queued_prefills_teach_nothing() {
        let mut speeds = learner(SpeedConfig { prior_samples: 0.0, ..Default::default() });
        let (mut rng, mut t) = (StdRng::seed_from_u64(9), 0.0);
        feed(&mut speeds, &[1.0, 1.0], &[1000], 100, &mut t, &mut rng);
        let before = speeds.view(PodId(1));
        // Pod 1 gets ten 1000-token requests at once: each finishes 46 ms after the previous
        // one. Counted from their bookings they would look up to ten times slower.
        for k in 1..=10 {
            speeds.prefill_done(PodId(1), Prefill::alone(t, 1000), t + 0.046 * f64::from(k));
        }
        let after = speeds.view(PodId(1));
        let keep = 1.0 - 1.0 / SpeedConfig::default().window_samples;
        assert!((after.samples - (before.samples * keep + 1.0)).abs() < 1e-9, "only the first had the pod to itself");
        assert!(after.slowness < 1.15, "pod 1 looks {}x slower", after.slowness);
    }

    #[test]
    fn a_pod_that_slows_down_is_relearned_within_a_window() {
        let config = SpeedConfig { window_samples: 50.0, ..Default::default() };
        let mut speeds = learner(config);
        let (mut rng, mut t) = (StdRng::seed_from_u64(11), 0.0);
        let sizes = [50, 500, 3000];
        feed(&mut speeds, &[1.0; 4], &sizes, 200, &mut t, &mut rng);
        let before = speeds.view(PodId(3)).slowness;
        assert!((before - 1.0).abs() < 0.15, "{before}");
        // Pod 3 throttles to a third of its speed.
        feed(&mut speeds, &[1.0, 1.0, 1.0, 3.0], &sizes, 150, &mut t, &mut rng);
        let after = speeds.view(PodId(3)).slowness;
        let fleet_average = (1.0 + 1.0 + 1.0 + 3.0) / 4.0;
        assert!((after / (3.0 / fleet_average) - 1.0).abs() < 0.15, "{after}");
        assert!(speeds.view(PodId(0)).slowness < 0.85, "the others now look faster than the average");
    }

    #[test]
    fn learning_off_leaves_every_pod_average_but_still_shows_what_it_learned() {
        let mut speeds = learner(SpeedConfig { learn: false, ..Default::default() });
        let (mut rng, mut t) = (StdRng::seed_from_u64(1), 0.0);
        feed(&mut speeds, &[1.0, 3.0], &[200, 2000], 200, &mut t, &mut rng);
        assert_eq!(speeds.slowness(PodId(1)), 1.0);
        assert!(speeds.view(PodId(1)).slowness > 1.3);
        assert!(speeds.view(PodId(1)).samples > 100.0);
    }

    #[test]
    fn a_declared_speed_applies_before_any_sample_and_samples_correct_it() {
        let mut speeds = learner(SpeedConfig::default());
        speeds.declare(PodId(1), 2.0);
        assert_eq!((speeds.slowness(PodId(0)), speeds.slowness(PodId(1))), (1.0, 2.0), "one declared slow pod");
        let mut speeds = learner(SpeedConfig::default());
        speeds.declare(PodId(1), 1.2);
        assert_eq!(speeds.slowness(PodId(1)), 1.0, "a spread within alike_spread is not applied");
        speeds.declare(PodId(0), 0.6);
        assert_eq!(slowness(&speeds, 2), vec![0.6, 1.2], "applied from the first request");
        assert_eq!(speeds.slowness(PodId(1)), 1.2);
        // The pods are in fact alike: their samples bring both back to 1, and the fleet to alike.
        let (mut rng, mut t) = (StdRng::seed_from_u64(5), 0.0);
        feed(&mut speeds, &[1.0, 1.0], &[100, 500, 2000], 400, &mut t, &mut rng);
        let s = slowness(&speeds, 2);
        assert!(s.iter().all(|v| (v - 1.0).abs() < 0.15), "{s:?}");
        assert_eq!(speeds.slowness(PodId(1)), 1.0);
        // Nonsense is clamped or ignored.
        speeds.declare(PodId(2), f64::NAN);
        speeds.declare(PodId(3), 1000.0);
        assert_eq!(speeds.view(PodId(2)).slowness, 1.0);
        assert_eq!(speeds.view(PodId(3)).slowness, SpeedConfig::default().max_slowness);
    }

    #[test]
    fn decode_speed_is_learned_per_pod_from_done_reports() {
        let mut speeds = learner(SpeedConfig::default());
        let mut rng = StdRng::seed_from_u64(2);
        for i in 0..100 {
            for (pod, tokens_per_second) in [(0, 80.0), (1, 40.0)] {
                let output = rng.random_range(10..300);
                let secs = f64::from(output - 1) / tokens_per_second * (0.8 + 0.4 * rng.random::<f64>());
                speeds.decode_done(PodId(pod), f64::from(i), output, f64::from(i) + secs);
            }
            // One-token answers and reports out of order teach nothing.
            speeds.decode_done(PodId(2), 5.0, 1, 6.0);
            speeds.decode_done(PodId(2), 5.0, 50, 4.0);
        }
        let learned = |p| speeds.decode_tokens_per_second(PodId(p));
        assert!((learned(0).unwrap() / 80.0 - 1.0).abs() < 0.1, "{:?}", learned(0));
        assert!((learned(1).unwrap() / 40.0 - 1.0).abs() < 0.1, "{:?}", learned(1));
        assert_eq!(learned(2), None);
        let off = learner(SpeedConfig { learn: false, ..Default::default() });
        assert_eq!(off.decode_tokens_per_second(PodId(0)), None);
    }

    #[test]
    fn bad_settings_are_refused() {
        assert!(SpeedConfig::default().validate().is_ok());
        for bad in [
            SpeedConfig { window_samples: 1.0, ..Default::default() },
            SpeedConfig { prior_samples: -1.0, ..Default::default() },
            SpeedConfig { judge_samples: -1.0, ..Default::default() },
            SpeedConfig { max_slowness: 0.5, ..Default::default() },
            SpeedConfig { alike_spread: 0.9, ..Default::default() },
            SpeedConfig { window_samples: f64::NAN, ..Default::default() },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }
}
