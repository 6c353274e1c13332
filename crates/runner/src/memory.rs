//! The runner's memory plan, made once at start: what the machine lets it use, what one
//! sequence's caches cost at the context it serves, and what is left for the prefix cache.
//!
//! The caches' cost is measured, not derived from the config: one token through fresh caches
//! shows each layer's bytes per position (its dtype, heads and widths, KV sharing and k_eq_v
//! included) and which layers are windows; growing caches then cost whole
//! [`cache::STEP`]s, and a window at most its ring plus one prefill chunk.

use cache::LayerCache;
use std::fmt;

/// Of what is available, this share is kept for what the plan does not count: activations of
/// a prefill chunk, the sampler, the tokenizer, the allocator's slack.
const RESERVE_PERCENT: usize = 10;

/// An unset context length may take at most this share of the usable memory, so that a model
/// whose maximum context cannot all be cached still starts, leaving the rest to the prefix
/// cache.
const DEFAULT_CONTEXT_PERCENT: usize = 50;

/// The default prefix-cache budget: this share of what the live caches leave.
const PREFIX_PERCENT: usize = 25;

/// One cache's cost: bytes per position, and the most positions it ever holds (a window's
/// ring), `None` for a cache that keeps every position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerCost {
    pub per_token: usize,
    pub most: Option<usize>,
}

/// What one sequence's caches cost, layer by layer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CacheCost {
    pub layers: Vec<LayerCost>,
}

impl CacheCost {
    /// The cost of caches that have seen at least one token.
    pub fn of(caches: &[LayerCache]) -> CacheCost {
        CacheCost {
            layers: caches
                .iter()
                .map(|c| LayerCost {
                    per_token: c.bytes_per_position(),
                    most: c.most_positions(),
                })
                .collect(),
        }
    }

    /// Bytes one sequence's caches hold at `ctx` tokens, prefilled `chunk` at a time.
    pub fn bytes(&self, ctx: usize, chunk: usize) -> usize {
        let grown = ctx.div_ceil(cache::STEP) * cache::STEP;
        self.layers
            .iter()
            .map(|l| {
                let positions = match l.most {
                    Some(ring) => ctx.min(ring + chunk),
                    None => grown,
                };
                l.per_token * positions
            })
            .sum()
    }

    /// The longest context up to `max` whose caches for `sequences` fit in `bytes`; 0 when not
    /// even one token does.
    pub fn longest_within(
        &self,
        bytes: usize,
        sequences: usize,
        chunk: usize,
        max: usize,
    ) -> usize {
        let fits = |n: usize| self.bytes(n, chunk).saturating_mul(sequences) <= bytes;
        if fits(max) {
            return max;
        }
        let (mut lo, mut hi) = (0, max); // fits(lo) or lo == 0; !fits(hi)
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if fits(mid) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    }
}

/// Bytes, as people read them.
pub struct Bytes(pub usize);

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0 as f64;
        match self.0 {
            n if n >= 1 << 30 => write!(f, "{:.1} GiB", b / (1u64 << 30) as f64),
            n if n >= 1 << 20 => write!(f, "{:.1} MiB", b / (1u64 << 20) as f64),
            n if n >= 1 << 10 => write!(f, "{:.1} KiB", b / 1024.0),
            n => write!(f, "{n} B"),
        }
    }
}

/// "1 sequence", "4 sequences".
pub fn sequences(n: usize) -> String {
    match n {
        1 => "1 sequence".into(),
        n => format!("{n} sequences"),
    }
}

/// What the plan starts from.
#[derive(Debug, Clone)]
pub struct PlanInput {
    /// Bytes the runner may still allocate (after its weights).
    pub available: usize,
    /// Where `available` came from, for messages.
    pub source: &'static str,
    pub cost: CacheCost,
    pub sequences: usize,
    pub chunk: usize,
    /// The model's longest context.
    pub max_context: usize,
    /// A context asked for (`--ctx-size`, a stored `num_ctx`): refused when it cannot be held.
    pub asked_context: Option<usize>,
    pub asked_budget: Option<usize>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryPlan {
    /// What it was made from: bytes available after the weights.
    pub available: usize,
    pub context: usize,
    /// What the live caches of every sequence hold at `context`.
    pub live_caches: usize,
    pub prefix_budget: usize,
    /// Set when the model's maximum context was cut to fit.
    pub clamped_from: Option<usize>,
}

pub fn plan(i: &PlanInput) -> Result<MemoryPlan, String> {
    let usable = i.available - i.available / 100 * RESERVE_PERCENT;
    let live = |ctx: usize| i.cost.bytes(ctx, i.chunk).saturating_mul(i.sequences);
    let (context, clamped_from) = match i.asked_context {
        Some(asked) => {
            let ctx = asked.min(i.max_context);
            if live(ctx) > usable {
                let fits = i.cost.longest_within(usable, i.sequences, i.chunk, ctx);
                return Err(format!(
                    "a context of {ctx} tokens needs {} of KV cache for {} ({} each), \
                     and {} is available ({}, less {RESERVE_PERCENT}% kept back): use \
                     --ctx-size {fits} or less, or a smaller --parallel",
                    Bytes(live(ctx)),
                    sequences(i.sequences),
                    Bytes(i.cost.bytes(ctx, i.chunk)),
                    Bytes(usable),
                    i.source,
                ));
            }
            (ctx, None)
        }
        None => {
            let room = usable / 100 * DEFAULT_CONTEXT_PERCENT;
            let ctx = i
                .cost
                .longest_within(room, i.sequences, i.chunk, i.max_context);
            if ctx == 0 {
                return Err(format!(
                    "{} is available ({}): not enough for one token of KV cache for {}",
                    Bytes(i.available),
                    i.source,
                    sequences(i.sequences)
                ));
            }
            (ctx, (ctx < i.max_context).then_some(i.max_context))
        }
    };
    let live_caches = live(context);
    let prefix_budget = i
        .asked_budget
        .unwrap_or((usable - live_caches) / 100 * PREFIX_PERCENT);
    Ok(MemoryPlan {
        available: i.available,
        context,
        live_caches,
        prefix_budget,
        clamped_from,
    })
}

/// One sequence's caches (the target's and, when drafting, the drafter's), measured by one
/// token through fresh ones. The graph is built, not evaluated: shapes are all it needs.
pub fn measure(
    model: &models::LoadedModel,
    draft: Option<&dyn models::Drafter>,
) -> Result<CacheCost, String> {
    let m = model.model.as_ref();
    let mut caches = m.make_caches();
    let token = mlx::Array::from_slice(&[0i32], &[1, 1]).map_err(|e| e.to_string())?;
    m.forward(&token, &mut caches)
        .map_err(|e| format!("measuring the caches: {e}"))?;
    if let Some(d) = draft {
        let own = d
            .probe_caches(&m.make_caches())
            .map_err(|e| format!("measuring the drafter's caches: {e}"))?;
        caches.extend(own);
    }
    Ok(CacheCost::of(&caches))
}

#[cfg(test)]
mod tests {
    use super::*;

    const STEP: usize = cache::STEP;

    fn cost() -> CacheCost {
        // Two full layers of 100 bytes a position, one window of 8 positions at 10 bytes.
        CacheCost {
            layers: vec![
                LayerCost {
                    per_token: 100,
                    most: None,
                },
                LayerCost {
                    per_token: 100,
                    most: None,
                },
                LayerCost {
                    per_token: 10,
                    most: Some(8),
                },
            ],
        }
    }

    fn input(available: usize, asked: Option<usize>) -> PlanInput {
        PlanInput {
            available,
            source: "test",
            cost: cost(),
            sequences: 2,
            chunk: 4,
            max_context: 4 * STEP,
            asked_context: asked,
            asked_budget: None,
        }
    }

    #[test]
    fn full_layers_grow_in_steps_and_windows_stop_at_their_ring() {
        let c = cost();
        // One token: a whole step of each full layer, one position of the window.
        assert_eq!(c.bytes(1, 4), 2 * 100 * STEP + 10);
        // Past the ring plus a chunk, the window costs no more.
        assert_eq!(c.bytes(STEP + 1, 4), 2 * 100 * 2 * STEP + 10 * 12);
    }

    #[test]
    fn the_longest_context_that_fits_is_found_exactly() {
        let c = cost();
        let budget = c.bytes(3 * STEP, 4) * 2;
        let n = c.longest_within(budget, 2, 4, 10 * STEP);
        assert_eq!(n, 3 * STEP);
        assert!(c.bytes(n + 1, 4) * 2 > budget);
        assert_eq!(c.longest_within(0, 2, 4, 10 * STEP), 0);
        assert_eq!(c.longest_within(usize::MAX, 2, 4, 10 * STEP), 10 * STEP);
    }

    #[test]
    fn a_context_asked_for_that_cannot_be_held_is_refused_with_what_would_fit() {
        let need = cost().bytes(4 * STEP, 4) * 2;
        let e = plan(&input(need, Some(4 * STEP))).unwrap_err();
        assert!(e.contains("a context of 1024 tokens needs"), "{e}");
        assert!(e.contains("for 2 sequences ("), "{e}");
        assert!(e.contains("use --ctx-size 768 or less"), "{e}");
        // Asked past the model's maximum: the maximum is what is checked.
        let ok = plan(&input(need * 2, Some(100 * STEP))).unwrap();
        assert_eq!(ok.context, 4 * STEP);
        assert_eq!(ok.clamped_from, None);
        assert_eq!(ok.live_caches, need);
    }

    #[test]
    fn an_unset_context_is_cut_to_half_the_usable_memory_and_the_budget_is_a_share_of_the_rest() {
        let avail = 500_000;
        let p = plan(&input(avail, None)).unwrap();
        let usable = avail - avail / 100 * RESERVE_PERCENT;
        assert!(p.live_caches <= usable / 2, "{p:?}");
        assert!(p.context < 4 * STEP);
        assert_eq!(p.clamped_from, Some(4 * STEP));
        assert_eq!(
            p.prefix_budget,
            (usable - p.live_caches) / 100 * PREFIX_PERCENT
        );
        // Room for everything: the model's maximum, not clamped.
        let p = plan(&input(usize::MAX / 4, None)).unwrap();
        assert_eq!((p.context, p.clamped_from), (4 * STEP, None));
        // Not one token fits.
        assert!(plan(&input(10, None))
            .unwrap_err()
            .contains("not enough for one token"));
        // A budget asked for is kept.
        let mut i = input(avail, None);
        i.asked_budget = Some(7);
        assert_eq!(plan(&i).unwrap().prefix_budget, 7);
    }
}
