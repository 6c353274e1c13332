//! Counters and histograms for `/metrics`, in Prometheus' text exposition format. Plain atomics:
//! the engine thread writes, HTTP handlers read.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// A cumulative histogram with fixed bucket bounds (seconds).
pub struct Histogram {
    bounds: &'static [f64],
    buckets: Vec<AtomicU64>,
    count: AtomicU64,
    /// Sum in microseconds, to keep it an integer.
    sum_us: AtomicU64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            buckets: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum_us: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, seconds: f64) {
        for (b, c) in self.bounds.iter().zip(&self.buckets) {
            if seconds <= *b {
                c.fetch_add(1, Relaxed);
            }
        }
        self.count.fetch_add(1, Relaxed);
        self.sum_us.fetch_add((seconds * 1e6) as u64, Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, c) in self.bounds.iter().zip(&self.buckets) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {}", c.load(Relaxed));
        }
        let n = self.count.load(Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {n}");
        let _ = writeln!(out, "{name}_sum {}", self.sum_us.load(Relaxed) as f64 / 1e6);
        let _ = writeln!(out, "{name}_count {n}");
    }
}

const LATENCY: &[f64] = &[
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];
const PER_TOKEN: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0];
/// Counts (rows in a forward, tokens in a forward), not seconds.
const ROWS: &[f64] = &[1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0, 64.0];
const TOKENS: &[f64] = &[
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0,
];

/// Draft positions tracked per position (deeper drafts are counted in the last one).
pub const DRAFT_POSITIONS: usize = 16;

pub struct Metrics {
    pub requests: AtomicU64,
    pub requests_failed: AtomicU64,
    pub requests_cancelled: AtomicU64,
    pub bad_requests: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub cache_hits: AtomicU64,
    pub cache_misses: AtomicU64,
    pub cached_tokens: AtomicU64,
    pub recomputed_tokens: AtomicU64,
    /// Requests restored from the disk tier, and the prompt tokens it gave them.
    pub disk_hits: AtomicU64,
    pub disk_tokens: AtomicU64,
    /// Images run through the vision tower (an image the prefix cache restored is not).
    pub images_encoded: AtomicU64,
    /// Clips run through the audio tower (likewise).
    pub audio_encoded: AtomicU64,
    /// Steps in which a media encoder ran ahead of its chunk beside other sequences' work.
    pub encode_steps: AtomicU64,
    pub draft_tokens: AtomicU64,
    pub draft_accepted: AtomicU64,
    pub drafted_at: Vec<AtomicU64>,
    pub accepted_at: Vec<AtomicU64>,
    pub time_to_first_token: Histogram,
    pub request_duration: Histogram,
    pub time_per_token: Histogram,
    /// Sequences in each target forward pass that fed tokens.
    pub batch_rows: Histogram,
    /// Tokens each such pass added to its sequences' caches (a prefill chunk's length, one
    /// per decoding row, a speculative round's accepted tokens plus one).
    pub batch_tokens: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            requests: AtomicU64::new(0),
            requests_failed: AtomicU64::new(0),
            requests_cancelled: AtomicU64::new(0),
            bad_requests: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            generated_tokens: AtomicU64::new(0),
            cache_hits: AtomicU64::new(0),
            cache_misses: AtomicU64::new(0),
            cached_tokens: AtomicU64::new(0),
            recomputed_tokens: AtomicU64::new(0),
            disk_hits: AtomicU64::new(0),
            disk_tokens: AtomicU64::new(0),
            images_encoded: AtomicU64::new(0),
            audio_encoded: AtomicU64::new(0),
            encode_steps: AtomicU64::new(0),
            draft_tokens: AtomicU64::new(0),
            draft_accepted: AtomicU64::new(0),
            drafted_at: (0..DRAFT_POSITIONS).map(|_| AtomicU64::new(0)).collect(),
            accepted_at: (0..DRAFT_POSITIONS).map(|_| AtomicU64::new(0)).collect(),
            time_to_first_token: Histogram::new(LATENCY),
            request_duration: Histogram::new(LATENCY),
            time_per_token: Histogram::new(PER_TOKEN),
            batch_rows: Histogram::new(ROWS),
            batch_tokens: Histogram::new(TOKENS),
        }
    }
}

fn counter(out: &mut String, name: &str, help: &str, v: &AtomicU64) {
    let _ = writeln!(
        out,
        "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
        v.load(Relaxed)
    );
}

fn gauge(out: &mut String, name: &str, help: &str, v: u64) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
}

impl Metrics {
    /// The exposition text; `memory` and `cache_memory` are current gauges in bytes, `disk`
    /// the disk tier's counters and budget when it is on.
    pub fn render(
        &self,
        memory: u64,
        cache_memory: u64,
        cache_budget: u64,
        disk: Option<&(std::sync::Arc<cache::disk::DiskStats>, u64)>,
    ) -> String {
        let mut o = String::new();
        counter(
            &mut o,
            "mlx_runner_requests_total",
            "Completion requests accepted.",
            &self.requests,
        );
        counter(
            &mut o,
            "mlx_runner_requests_failed_total",
            "Completion requests that ended in an engine error.",
            &self.requests_failed,
        );
        counter(
            &mut o,
            "mlx_runner_requests_cancelled_total",
            "Completion requests whose client went away.",
            &self.requests_cancelled,
        );
        counter(
            &mut o,
            "mlx_runner_bad_requests_total",
            "Requests refused with a 4xx status.",
            &self.bad_requests,
        );
        counter(
            &mut o,
            "mlx_runner_prompt_tokens_total",
            "Prompt tokens of completion requests.",
            &self.prompt_tokens,
        );
        counter(
            &mut o,
            "mlx_runner_generated_tokens_total",
            "Tokens generated.",
            &self.generated_tokens,
        );
        counter(
            &mut o,
            "mlx_runner_cache_hits_total",
            "Requests that reused a cached prefix.",
            &self.cache_hits,
        );
        counter(
            &mut o,
            "mlx_runner_cache_misses_total",
            "Requests that found no cached prefix.",
            &self.cache_misses,
        );
        counter(
            &mut o,
            "mlx_runner_cached_tokens_total",
            "Prompt tokens served from the prefix cache.",
            &self.cached_tokens,
        );
        counter(
            &mut o,
            "mlx_runner_images_encoded_total",
            "Images run through the vision tower (not those the prefix cache restored).",
            &self.images_encoded,
        );
        counter(
            &mut o,
            "mlx_runner_audio_encoded_total",
            "Clips run through the audio tower (not those the prefix cache restored).",
            &self.audio_encoded,
        );
        counter(
            &mut o,
            "mlx_runner_encode_steps_total",
            "Steps in which a media encoder ran a few layers ahead of its chunk, beside other sequences' work.",
            &self.encode_steps,
        );
        counter(
            &mut o,
            "mlx_runner_recomputed_tokens_total",
            "Cached tokens recomputed to reach a restorable state.",
            &self.recomputed_tokens,
        );
        counter(
            &mut o,
            "mlx_runner_draft_tokens_total",
            "Draft tokens proposed.",
            &self.draft_tokens,
        );
        counter(
            &mut o,
            "mlx_runner_draft_accepted_total",
            "Draft tokens accepted.",
            &self.draft_accepted,
        );
        let _ = writeln!(o, "# HELP mlx_runner_draft_position_total Draft tokens by position in the round.\n# TYPE mlx_runner_draft_position_total counter");
        for (i, (d, a)) in self.drafted_at.iter().zip(&self.accepted_at).enumerate() {
            let _ = writeln!(
                o,
                "mlx_runner_draft_position_total{{position=\"{}\",outcome=\"drafted\"}} {}",
                i + 1,
                d.load(Relaxed)
            );
            let _ = writeln!(
                o,
                "mlx_runner_draft_position_total{{position=\"{}\",outcome=\"accepted\"}} {}",
                i + 1,
                a.load(Relaxed)
            );
        }
        gauge(
            &mut o,
            "mlx_runner_memory_bytes",
            "MLX active plus buffer-cache memory.",
            memory,
        );
        gauge(
            &mut o,
            "mlx_runner_prefix_cache_bytes",
            "Memory held by the prefix cache's snapshots.",
            cache_memory,
        );
        gauge(
            &mut o,
            "mlx_runner_prefix_cache_budget_bytes",
            "What the prefix cache may hold, from the memory plan made at start.",
            cache_budget,
        );
        if let Some((d, budget)) = disk {
            counter(
                &mut o,
                "mlx_runner_prefix_disk_hits_total",
                "Requests resumed from the prefix cache's disk tier.",
                &self.disk_hits,
            );
            counter(
                &mut o,
                "mlx_runner_prefix_disk_tokens_total",
                "Prompt tokens restored from the disk tier.",
                &self.disk_tokens,
            );
            counter(
                &mut o,
                "mlx_runner_prefix_disk_written_total",
                "Blocks written to the disk tier.",
                &d.written,
            );
            counter(
                &mut o,
                "mlx_runner_prefix_disk_dropped_total",
                "Blocks not written (the writer's queue full, a write failed, over the budget).",
                &d.dropped,
            );
            counter(
                &mut o,
                "mlx_runner_prefix_disk_skipped_total",
                "Block files refused on read (corrupt, truncated, foreign) and removed.",
                &d.skipped,
            );
            counter(
                &mut o,
                "mlx_runner_prefix_disk_evicted_total",
                "Block files evicted to stay within the budget.",
                &d.evicted,
            );
            gauge(
                &mut o,
                "mlx_runner_prefix_disk_bytes",
                "Bytes of block files in the disk tier's directory.",
                d.bytes.load(Relaxed),
            );
            gauge(
                &mut o,
                "mlx_runner_prefix_disk_budget_bytes",
                "What the disk tier's directory may hold.",
                *budget,
            );
        }
        self.time_to_first_token.render(
            &mut o,
            "mlx_runner_time_to_first_token_seconds",
            "Request start to first token.",
        );
        self.request_duration.render(
            &mut o,
            "mlx_runner_request_duration_seconds",
            "Request start to end.",
        );
        self.time_per_token.render(
            &mut o,
            "mlx_runner_time_per_output_token_seconds",
            "Decode time per generated token.",
        );
        self.batch_rows.render(
            &mut o,
            "mlx_runner_batch_rows",
            "Sequences in each forward pass of the target model.",
        );
        self.batch_tokens.render(
            &mut o,
            "mlx_runner_batch_tokens",
            "Tokens each forward pass of the target model added to its sequences' caches.",
        );
        o
    }
}
