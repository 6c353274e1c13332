//! Choosing the draft depth: the `k` that maximises committed tokens per second, from measured
//! acceptance per draft position and measured round cost, kept per loaded model and shared by
//! its requests. Depth 0 (plain decoding) is a candidate like any other, so a drafter that does
//! not pay is switched off. `--draft-depth N` fixes the depth instead.

/// Exponentially weighted moving average.
#[derive(Debug, Clone, Copy, Default)]
struct Ewma {
    value: f64,
    samples: u64,
}

impl Ewma {
    fn add(&mut self, x: f64, alpha: f64) {
        self.value = if self.samples == 0 {
            x
        } else {
            self.value + alpha * (x - self.value)
        };
        self.samples += 1;
    }
}

const ACCEPT_ALPHA: f64 = 0.1;
const COST_ALPHA: f64 = 0.3;
/// Acceptance estimates with fewer samples borrow from the position before them.
const TRUSTED: u64 = 10;
/// Every this many rounds, the controller tries one deeper than its choice.
const PROBE_EVERY: u64 = 16;

#[derive(Debug, Clone)]
pub struct DepthController {
    max: usize,
    fixed: Option<usize>,
    /// P(position j accepted | position j − 1 accepted), j = 1..=max.
    accept: Vec<Ewma>,
    /// Seconds per round at each depth 0..=max.
    cost: Vec<Ewma>,
    rounds: u64,
}

impl DepthController {
    /// Adaptive over `0..=max`, or always `fixed`.
    pub fn new(max: usize, fixed: Option<usize>) -> DepthController {
        DepthController {
            max,
            fixed,
            accept: vec![Ewma::default(); max],
            cost: vec![Ewma::default(); max + 1],
            rounds: 0,
        }
    }

    pub fn max(&self) -> usize {
        self.fixed.unwrap_or(self.max)
    }

    /// Acceptance of position `j` (1-based), optimistic while unmeasured.
    fn rate(&self, j: usize) -> f64 {
        let mut fallback = 1.0;
        for i in 0..j {
            let e = self.accept[i];
            if e.samples >= TRUSTED {
                fallback = e.value;
            }
        }
        let e = self.accept[j - 1];
        if e.samples >= TRUSTED {
            e.value
        } else {
            fallback
        }
    }

    /// Expected tokens committed by one round of depth `k`: the current token plus each draft
    /// position reached.
    pub fn expected(&self, k: usize) -> f64 {
        let mut total = 1.0;
        let mut reach = 1.0;
        for j in 1..=k.min(self.max) {
            reach *= self.rate(j);
            total += reach;
        }
        total
    }

    /// The depth for the next round, at most `limit`.
    pub fn choose(&mut self, limit: usize) -> usize {
        self.rounds += 1;
        if let Some(f) = self.fixed {
            return f.min(limit);
        }
        let limit = limit.min(self.max);
        // Measure every depth once before comparing.
        if let Some(k) = (0..=limit).find(|&k| self.cost[k].samples == 0) {
            return k;
        }
        let best = (0..=limit)
            .max_by(|&a, &b| {
                let ra = self.expected(a) / self.cost[a].value.max(1e-9);
                let rb = self.expected(b) / self.cost[b].value.max(1e-9);
                ra.total_cmp(&rb)
            })
            .unwrap_or(0);
        if self.rounds % PROBE_EVERY == 0 && best < limit {
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
            if j <= accepted {
                self.accept[j - 1].add(1.0, ACCEPT_ALPHA);
            } else {
                // The first rejection is observed; deeper positions were not reached.
                self.accept[j - 1].add(0.0, ACCEPT_ALPHA);
                break;
            }
        }
        self.cost[k].add(seconds, COST_ALPHA);
    }

    /// Mean acceptance per position, for logs.
    pub fn acceptance(&self) -> Vec<f64> {
        self.accept.iter().map(|e| e.value).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn high_acceptance_and_cheap_drafts_go_deep() {
        let mut c = DepthController::new(6, None);
        for _ in 0..400 {
            let k = c.choose(6);
            // Every draft accepted; a round costs 1 + 0.2 k.
            c.record(k, k, 1.0 + 0.2 * k as f64);
        }
        assert!(c.choose(6) >= 5, "{:?}", c);
    }

    #[test]
    fn useless_drafts_are_switched_off() {
        let mut c = DepthController::new(6, None);
        let mut zeros = 0;
        for _ in 0..400 {
            let k = c.choose(6);
            c.record(k, 0, 1.0 + 0.3 * k as f64);
            if k == 0 {
                zeros += 1;
            }
        }
        assert!(zeros > 300, "depth 0 chosen only {zeros} times of 400");
    }

    #[test]
    fn fixed_depth_and_limits() {
        let mut c = DepthController::new(4, Some(3));
        assert_eq!(c.choose(10), 3);
        assert_eq!(c.choose(1), 1);
        let mut a = DepthController::new(4, None);
        assert!(a.choose(2) <= 2);
        assert_eq!(a.expected(0), 1.0);
        a.record(2, 1, 1.0);
        assert!(a.expected(2) > 1.0);
    }
}
