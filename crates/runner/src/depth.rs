//! Choosing the draft depth: the `k` that maximises committed tokens per second, from measured
//! acceptance per draft position and measured round cost, kept per loaded model and shared by
//! its requests. Depth 0 (plain decoding) is a candidate like any other, so a drafter that does
//! not pay is switched off. `--draft-depth N` fixes the depth instead.
//!
//! Acceptance of position `j` (given `j − 1` was accepted) is a decayed success count whose prior
//! is the estimate of position `j − 1` (0.5 for the first), so a few rejections are enough to
//! doubt a drafter and a few acceptances to trust one. Round cost is modelled as
//! `base + k · per_draft`: depth 0 measures plain decoding and measured depths give the slope, so
//! depths never tried are predicted rather than explored one by one. Exploration is one plain
//! step and one round at the deepest depth; after that, a probe one deeper than the choice now
//! and then, less often while probes change nothing.
//!
//! The engine keeps one controller per batch size, since a batched step's price depends on how
//! many rows share it. A step is a price only when it did nothing but its rounds: it is recorded
//! once (however many rows drafted in it), and not at all when it also prefilled or caught a
//! drafter up with tokens decoded plainly (a probe after a stretch of plain steps pays for that),
//! in which case an exploration or probe depth is tried again. Each depth's estimate is a moving
//! average that takes one stalled step as at most twice the estimate, and the slope weighs each
//! depth by how often it was measured: a depth priced out by one bad sample would seldom be
//! measured again.
//!
//! A seeded sampling request must give the same output on every run, but which tokens a round
//! draws depends on its depth; timings (and other requests' history) would make the depth, and
//! so the output, vary from run to run. Such a request gets a controller of its own
//! ([`DepthController::for_seeded_request`]) that starts from the priors, learns acceptance from
//! its own rounds only, and prices a round with a fixed cost model instead of the clock: its
//! depths are a function of its own tokens, hence of its prompt, options and seed.

/// Weight kept by older observations at each new one.
const DECAY: f64 = 0.95;
const COST_ALPHA: f64 = 0.3;
/// After this many samples of a depth, a sample is taken as at most `OUTLIER_CAP` times the
/// estimate.
const OUTLIER_AFTER: u64 = 2;
const OUTLIER_CAP: f64 = 2.0;
/// Further rounds at an exploration or probe depth whose step could not price it.
const PRICE_TRIES: u32 = 3;
/// Choices between probes one depth deeper than the best, doubling (up to the maximum) while
/// probes change nothing, so that a drafter that improves (a new kind of text) is noticed.
const PROBE_FIRST: u64 = 16;
const PROBE_MAX: u64 = 512;
/// The fixed cost model of a seeded request's controller: a round of depth `k` costs
/// `1 + k · STATIC_DRAFT_COST` plain decode steps (a drafted token is a small drafter step plus
/// one more row of the verify forward).
const STATIC_DRAFT_COST: f64 = 0.3;

#[derive(Debug, Clone, Copy, Default)]
struct Rate {
    accepted: f64,
    trials: f64,
}

impl Rate {
    fn add(&mut self, ok: bool) {
        self.accepted = self.accepted * DECAY + f64::from(u8::from(ok));
        self.trials = self.trials * DECAY + 1.0;
    }

    /// The posterior mean with a prior of weight one at `prior`.
    fn value(&self, prior: f64) -> f64 {
        (self.accepted + prior) / (self.trials + 1.0)
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct Cost {
    seconds: f64,
    samples: u64,
}

impl Cost {
    fn add(&mut self, s: f64) {
        self.seconds = if self.samples == 0 {
            s
        } else {
            // One stalled step (the machine busy elsewhere) must not price a depth out for
            // good: a depth judged too dear is rarely measured again.
            let s = if self.samples >= OUTLIER_AFTER {
                s.min(self.seconds * OUTLIER_CAP)
            } else {
                s
            };
            self.seconds + COST_ALPHA * (s - self.seconds)
        };
        self.samples += 1;
    }

    /// How much the depth's estimate is trusted in the slope fit: measured often, more.
    fn weight(&self) -> f64 {
        self.samples.min(8) as f64
    }
}

#[derive(Debug, Clone)]
pub struct DepthController {
    max: usize,
    fixed: Option<usize>,
    /// P(position j accepted | position j − 1 accepted), j = 1..=max.
    accept: Vec<Rate>,
    /// Measured seconds per round at each depth 0..=max.
    cost: Vec<Cost>,
    choices: u64,
    probe_every: u64,
    last_best: usize,
    /// Whether round costs are measured (`false`: the fixed model, for reproducible depths).
    timed: bool,
    /// An exploration or probe depth whose cost is still unmeasured (its round shared the step
    /// with other work or caught the drafter up), and how many more times to try it.
    unpriced: Option<(usize, u32)>,
}

impl DepthController {
    /// Adaptive over `0..=max`, or always `fixed`.
    pub fn new(max: usize, fixed: Option<usize>) -> DepthController {
        DepthController {
            max,
            fixed,
            accept: vec![Rate::default(); max],
            cost: vec![Cost::default(); max + 1],
            choices: 0,
            probe_every: PROBE_FIRST,
            last_best: 0,
            timed: true,
            unpriced: None,
        }
    }

    pub fn max(&self) -> usize {
        self.fixed.unwrap_or(self.max)
    }

    /// Expected tokens committed by one round of depth `k`: the current token plus each draft
    /// position reached.
    pub fn expected(&self, k: usize) -> f64 {
        let rates = self.acceptance();
        let mut total = 1.0;
        let mut reach = 1.0;
        for r in rates.iter().take(k.min(self.max)) {
            reach *= r;
            total += reach;
        }
        total
    }

    /// Predicted seconds per round at depth `k`, or `None` before anything is measured.
    fn predicted_cost(&self, k: usize) -> Option<f64> {
        if self.cost[k].samples > 0 {
            return Some(self.cost[k].seconds);
        }
        let base = self.cost[0];
        let deeper: Vec<(f64, f64, f64)> = (1..=self.max)
            .filter(|&d| self.cost[d].samples > 0)
            .map(|d| (d as f64, self.cost[d].seconds, self.cost[d].weight()))
            .collect();
        if base.samples == 0 || deeper.is_empty() {
            return None;
        }
        // Weighted least-squares slope through the base point: a depth measured once long ago
        // (the exploration round) must not outweigh one measured all the time.
        let (num, den) = deeper.iter().fold((0.0, 0.0), |(n, d), &(x, y, w)| {
            (n + w * x * (y - base.seconds), d + w * x * x)
        });
        let slope = (num / den).max(0.0);
        Some(base.seconds + slope * k as f64)
    }

    /// The depth for the next round, at most `limit`.
    /// A controller for one seeded request: the same depth bounds, fresh acceptance estimates,
    /// and no clock (see the module documentation).
    pub fn for_seeded_request(&self) -> DepthController {
        DepthController {
            timed: false,
            ..DepthController::new(self.max, self.fixed)
        }
    }

    /// What a round of depth `k` is expected to cost (`None`: unknown).
    fn round_cost(&self, k: usize) -> Option<f64> {
        if self.timed {
            self.predicted_cost(k)
        } else {
            Some(1.0 + STATIC_DRAFT_COST * k as f64)
        }
    }

    pub fn choose(&mut self, limit: usize) -> usize {
        self.choices += 1;
        if let Some(f) = self.fixed {
            return f.min(limit);
        }
        let limit = limit.min(self.max);
        if limit == 0 {
            return 0;
        }
        // A plain step and one round as deep as allowed give the cost model its two points and
        // measure acceptance at every position at once.
        if self.timed && self.cost[0].samples == 0 {
            return 0;
        }
        if let Some((k, tries)) = self.unpriced {
            if tries > 0 && k <= limit {
                self.unpriced = Some((k, tries - 1));
                return k;
            }
            self.unpriced = None;
        }
        if self.timed && (1..=self.max).all(|d| self.cost[d].samples == 0) {
            return self.measuring(limit);
        }
        let value =
            |k: usize| self.expected(k) / self.round_cost(k).unwrap_or(f64::INFINITY).max(1e-9);
        let best = (0..=limit)
            .max_by(|&a, &b| value(a).total_cmp(&value(b)))
            .unwrap_or(0);
        if best != self.last_best {
            self.last_best = best;
            self.probe_every = PROBE_FIRST;
        }
        if self.choices.is_multiple_of(self.probe_every) && best < limit {
            self.probe_every = (self.probe_every * 2).min(PROBE_MAX);
            self.measuring(best + 1)
        } else {
            best
        }
    }

    /// Depth `k`, to be chosen again until a step prices it (see [`Self::record_cost`]).
    fn measuring(&mut self, k: usize) -> usize {
        if self.timed {
            self.unpriced = Some((k, PRICE_TRIES));
        }
        k
    }

    /// Records a round of depth `k` in which `accepted` drafts were accepted, taking `seconds`.
    pub fn record(&mut self, k: usize, accepted: usize, seconds: f64) {
        self.record_acceptance(k, accepted);
        self.record_cost(k, seconds);
    }

    /// Records that a step whose deepest round was `k` took `seconds`: once per step, however
    /// many sequences drafted in it, and only for a step that did nothing else (no prefill).
    pub fn record_cost(&mut self, k: usize, seconds: f64) {
        if self.timed && k <= self.max {
            self.cost[k].add(seconds);
            if self.unpriced.is_some_and(|(u, _)| u == k) {
                self.unpriced = None;
            }
        }
    }

    /// Records one sequence's round of depth `k` in which `accepted` drafts were accepted.
    pub fn record_acceptance(&mut self, k: usize, accepted: usize) {
        if k > self.max {
            return;
        }
        for j in 1..=k {
            self.accept[j - 1].add(j <= accepted);
            if j > accepted {
                // Deeper positions were not reached.
                break;
            }
        }
    }

    /// Estimated acceptance per position, for logs.
    pub fn acceptance(&self) -> Vec<f64> {
        let mut prior = 0.5;
        self.accept
            .iter()
            .map(|r| {
                prior = r.value(prior);
                prior
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Simulates `rounds` choices with acceptance `p` per position and cost `1 + slope·k`;
    /// returns the tokens committed per unit of time.
    fn simulate(c: &mut DepthController, rounds: usize, p: f64, slope: f64) -> f64 {
        let (mut tokens, mut time) = (0.0, 0.0);
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        for _ in 0..rounds {
            let k = c.choose(6);
            let mut n = 0;
            while n < k {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                if (x % 1000) as f64 / 1000.0 >= p {
                    break;
                }
                n += 1;
            }
            let cost = 1.0 + slope * k as f64;
            c.record(k, n, cost);
            tokens += 1.0 + n as f64;
            time += cost;
        }
        tokens / time
    }

    #[test]
    fn high_acceptance_and_cheap_drafts_go_deep() {
        let mut c = DepthController::new(6, None);
        let rate = simulate(&mut c, 300, 1.0, 0.2);
        assert!(c.choose(6) >= 5);
        // Depth 6 would give 7 / 2.2 = 3.2 tokens per unit.
        assert!(rate > 2.8, "{rate}");
    }

    #[test]
    fn useless_drafts_cost_little() {
        let mut c = DepthController::new(6, None);
        let rate = simulate(&mut c, 300, 0.0, 0.3);
        // Plain decoding gives 1 token per unit; exploration and probes may cost a few percent.
        assert!(rate > 0.95, "{rate}");
    }

    #[test]
    fn middling_acceptance_finds_a_middle_depth() {
        let mut c = DepthController::new(6, None);
        simulate(&mut c, 400, 0.7, 0.3);
        let k = c.choose(6);
        assert!((1..=4).contains(&k), "{k}");
    }

    #[test]
    fn fixed_depth_and_limits() {
        let mut c = DepthController::new(4, Some(3));
        assert_eq!(c.choose(10), 3);
        assert_eq!(c.choose(1), 1);
        let mut a = DepthController::new(4, None);
        assert_eq!(a.choose(0), 0);
        assert_eq!(a.expected(0), 1.0);
        a.record(2, 1, 1.0);
        assert!(a.expected(2) > 1.0);
    }

    #[test]
    fn an_unpriced_exploration_is_tried_again() {
        let mut c = DepthController::new(4, None);
        assert_eq!(c.choose(4), 0);
        c.record(0, 0, 1.0);
        // The deep exploration round shared its step with a prefill: no price came back.
        assert_eq!(c.choose(4), 4);
        c.record_acceptance(4, 4);
        assert_eq!(c.choose(4), 4);
        c.record(4, 4, 1.8);
        // Priced now: the model decides (5 tokens for 1.8 beat 1 for 1).
        assert_eq!(c.choose(4), 4);
    }

    #[test]
    fn one_stalled_step_does_not_price_a_depth_out() {
        let mut c = DepthController::new(6, None);
        simulate(&mut c, 100, 1.0, 0.2);
        assert!(c.choose(6) >= 5);
        // The machine stalls for one deep round: fifty times its usual cost.
        let k = c.choose(6);
        c.record(k, k, 50.0);
        simulate(&mut c, 50, 1.0, 0.2);
        assert!(c.choose(6) >= 5);
    }
}
