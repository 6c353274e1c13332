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
//! A seeded sampling request must give the same output on every run, but which tokens a round
//! draws depends on its depth; timings (and other requests' history) would make the depth, and
//! so the output, vary from run to run. Such a request gets a controller of its own
//! ([`DepthController::for_seeded_request`]) that starts from the priors, learns acceptance from
//! its own rounds only, and prices a round with a fixed cost model instead of the clock: its
//! depths are a function of its own tokens, hence of its prompt, options and seed.

/// Weight kept by older observations at each new one.
const DECAY: f64 = 0.95;
const COST_ALPHA: f64 = 0.3;
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
            self.seconds + COST_ALPHA * (s - self.seconds)
        };
        self.samples += 1;
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
        let deeper: Vec<(f64, f64)> = (1..=self.max)
            .filter(|&d| self.cost[d].samples > 0)
            .map(|d| (d as f64, self.cost[d].seconds))
            .collect();
        if base.samples == 0 || deeper.is_empty() {
            return None;
        }
        // Least-squares slope through the base point.
        let (num, den) = deeper.iter().fold((0.0, 0.0), |(n, d), &(x, y)| {
            (n + x * (y - base.seconds), d + x * x)
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
        if self.timed && (1..=self.max).all(|d| self.cost[d].samples == 0) {
            return limit;
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
            best + 1
        } else {
            best
        }
    }

    /// Records a round of depth `k` in which `accepted` drafts were accepted, taking `seconds`.
    pub fn record(&mut self, k: usize, accepted: usize, seconds: f64) {
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
        if self.timed {
            self.cost[k].add(seconds);
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
}
