//! The prefix cache's disk tier on real files: what a restore builds equals the caches that were
//! stored (every kind, the sliding window's ring included, and the next writes after it), a
//! corrupt or foreign file is skipped and removed, and the directory never exceeds its budget.

use cache::disk::{DiskConfig, DiskTier};
use cache::prefix::CacheCheckpoint;
use cache::{KvCache, LatentCache, LayerCache, RotatingKvCache};
use mlx::{Array, Dtype, RowFormat};
use std::path::Path;
use std::sync::atomic::Ordering;

const BLOCK: usize = 8;
const WINDOW: usize = 6;

fn rows(start: usize, l: usize, width: i32, salt: u32) -> Array {
    let v: Vec<f32> = (0..l * width as usize)
        .map(|i| {
            let p = (start * width as usize + i) as u32;
            let h = p
                .wrapping_mul(2654435761)
                .wrapping_add(salt.wrapping_mul(40503));
            (h % 1000) as f32 / 500.0 - 1.0
        })
        .collect();
    Array::from_slice(&v, &[1, 2, l as i32, width / 2]).unwrap()
}

fn f32s(a: &Array) -> Vec<f32> {
    a.astype(Dtype::F32).unwrap().to_vec().unwrap()
}

fn fresh() -> Vec<LayerCache> {
    fresh_as(RowFormat::AsComputed)
}

fn fresh_as(format: RowFormat) -> Vec<LayerCache> {
    vec![
        LayerCache::Kv(KvCache::with_format(format)),
        LayerCache::Rotating(RotatingKvCache::with_slack(WINDOW, 2).with_format(format)),
        LayerCache::Latent(LatentCache::with_format(format)),
    ]
}

/// Row widths (keys and values over two heads; latent rows) for caches of `format`: wide
/// enough for a quantization group where the format quantizes.
fn widths(format: RowFormat) -> (i32, i32) {
    match format {
        RowFormat::Affine { .. } => (128, 64),
        _ => (8, 6),
    }
}

/// Caches fed `n` positions in writes of `chunk`, with a sliding-window snapshot at every block
/// end; `salt` makes another sequence's contents.
fn fed(n: usize, chunk: usize, salt: u32) -> (Vec<LayerCache>, Vec<(usize, CacheCheckpoint)>) {
    fed_as(n, chunk, salt, RowFormat::AsComputed)
}

fn fed_as(
    n: usize,
    chunk: usize,
    salt: u32,
    format: RowFormat,
) -> (Vec<LayerCache>, Vec<(usize, CacheCheckpoint)>) {
    let (w, lw) = widths(format);
    let mut caches = fresh_as(format);
    let mut checkpoints = Vec::new();
    let mut at = 0;
    while at < n {
        let l = chunk.min(n - at).min(BLOCK - at % BLOCK);
        for c in caches.iter_mut() {
            match c {
                LayerCache::Kv(kv) => {
                    kv.update(&rows(at, l, w, salt), &rows(at, l, w, salt + 1))
                        .unwrap();
                }
                LayerCache::Rotating(r) => {
                    r.update(&rows(at, l, w, salt + 2), &rows(at, l, w, salt + 3))
                        .unwrap();
                }
                LayerCache::Latent(lc) => {
                    lc.update(
                        &rows(at, l, lw, salt + 4)
                            .reshape(&[1, 1, l as i32, lw])
                            .unwrap(),
                    )
                    .unwrap();
                }
            }
        }
        at += l;
        if at % BLOCK == 0 {
            checkpoints.push((at, CacheCheckpoint::of(&caches)));
        }
    }
    (caches, checkpoints)
}

fn tokens(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| i * 7 + salt).collect()
}

fn open(dir: &Path, model: &str, budget: u64) -> DiskTier {
    let cfg = DiskConfig {
        dir: dir.to_path_buf(),
        budget,
    };
    DiskTier::open(&cfg, model, BLOCK).unwrap()
}

fn block_files(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "block"))
        .collect();
    v.sort();
    v
}

fn dir_bytes(dir: &Path) -> u64 {
    block_files(dir)
        .iter()
        .map(|p| std::fs::metadata(p).unwrap().len())
        .sum()
}

/// Every layer's state, as plain numbers.
fn contents(caches: &[LayerCache]) -> Vec<Vec<f32>> {
    caches
        .iter()
        .flat_map(|c| match c {
            LayerCache::Kv(kv) => {
                let (k, v) = kv.state().unwrap().unwrap();
                vec![f32s(&k), f32s(&v)]
            }
            LayerCache::Rotating(r) => {
                let (k, v) = r.linear_state().unwrap().unwrap();
                let (k, v) = (k.dense().unwrap(), v.dense().unwrap());
                vec![f32s(&k), f32s(&v), vec![r.offset() as f32]]
            }
            LayerCache::Latent(l) => {
                let (r, _) = (l.copy_range(0, l.offset()).unwrap(), ());
                vec![f32s(&r.dense().unwrap())]
            }
        })
        .collect()
}

#[test]
fn a_restore_equals_what_was_stored_and_goes_on_alike() {
    mlx::init_thread().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let toks = tokens(37, 1);
    let (caches, checkpoints) = fed(37, 5, 10);
    {
        let tier = open(dir.path(), "model-a", 1 << 30);
        assert_eq!(tier.store(&toks, &caches, &checkpoints).unwrap(), 4);
        tier.flush();
        // Stored again: nothing new to write.
        assert_eq!(tier.store(&toks, &caches, &checkpoints).unwrap(), 0);
    }
    assert_eq!(block_files(dir.path()).len(), 4);

    // A new tier over the same directory (a restarted runner).
    let tier = open(dir.path(), "model-a", 1 << 30);
    let mut prompt = toks[..33].to_vec();
    prompt.push(9999);
    assert_eq!(tier.depth(&prompt, &fresh()), 32);
    let got = tier.restore(&prompt, fresh(), 0).expect("restored");
    assert_eq!((got.restored.cached, got.blocks), (32, 4));
    let (want, _) = fed(32, 5, 10);
    assert_eq!(contents(&got.restored.caches), contents(&want));

    // The next writes land alike in the restored caches and in caches fed from scratch.
    let (mut a, mut b) = (got.restored.caches, want);
    for step in 0..WINDOW + 3 {
        for caches in [&mut a, &mut b] {
            if let LayerCache::Rotating(r) = &mut caches[1] {
                let (k, v) = r
                    .update(&rows(32 + step, 1, 8, 50), &rows(32 + step, 1, 8, 51))
                    .unwrap();
                let _ = (f32s(&k), f32s(&v));
            }
        }
        let pos = |c: &[LayerCache]| match &c[1] {
            LayerCache::Rotating(r) => r.key_positions(),
            _ => unreachable!(),
        };
        let state = |c: &[LayerCache]| match &c[1] {
            LayerCache::Rotating(r) => r.state().unwrap().map(|(k, v, _)| (f32s(&k), f32s(&v))),
            _ => unreachable!(),
        };
        assert_eq!(pos(&a), pos(&b), "step {step}");
        assert_eq!(state(&a), state(&b), "step {step}");
    }

    // Not beyond what the memory tier already has: nothing read.
    assert!(tier.restore(&prompt, fresh(), 32).is_none());
    // Another model's key, or caches of another layout, find nothing.
    let other = open(dir.path(), "model-b", 1 << 30);
    assert_eq!(other.depth(&prompt, &fresh()), 0);
    let fewer = vec![LayerCache::Kv(KvCache::new())];
    assert_eq!(tier.depth(&prompt, &fewer), 0);
}

/// Quantized caches (`--kv-cache-type q8|q4`) go to disk as their packed words, scales and
/// biases, come back with the same bits in the same form, and are never read by a runner of
/// another cache type.
#[test]
fn quantized_caches_round_trip_packed() {
    mlx::init_thread().unwrap();
    for bits in [8, 4] {
        let format = RowFormat::Affine { bits };
        let dir = tempfile::tempdir().unwrap();
        let toks = tokens(21, 3);
        let (caches, checkpoints) = fed_as(21, 3, 40, format);
        let tier = open(dir.path(), "model-q", 1 << 30);
        assert_eq!(tier.store(&toks, &caches, &checkpoints).unwrap(), 2);
        tier.flush();
        let bytes = std::fs::read(&block_files(dir.path())[0]).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut names: Vec<String> = st.names().into_iter().cloned().collect();
        names.sort();
        assert!(
            names.contains(&"0.keys.q".to_string()),
            "q{bits}: {names:?}"
        );
        assert!(
            names.contains(&"2.rows.scales".to_string()),
            "q{bits}: {names:?}"
        );
        assert_eq!(
            st.tensor("0.keys.q").unwrap().dtype(),
            safetensors::Dtype::U32
        );

        let tier = open(dir.path(), "model-q", 1 << 30);
        let mut prompt = toks[..17].to_vec();
        prompt.push(9999);
        let got = tier
            .restore(&prompt, fresh_as(format), 0)
            .expect("restored");
        assert_eq!(got.restored.cached, 16);
        for c in &got.restored.caches {
            assert_eq!(c.format(), format, "q{bits}: restored in its form");
        }
        let (want, _) = fed_as(16, 3, 40, format);
        assert_eq!(contents(&got.restored.caches), contents(&want), "q{bits}");
        // Caches of another type find nothing.
        assert_eq!(
            tier.depth(&prompt, &fresh_as(RowFormat::Float(Dtype::F16))),
            0
        );
    }
}

#[test]
fn corrupt_and_foreign_files_are_skipped_and_removed() {
    mlx::init_thread().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let toks = tokens(33, 2);
    let (caches, checkpoints) = fed(33, 8, 20);
    let tier = open(dir.path(), "model-a", 1 << 30);
    assert_eq!(tier.store(&toks, &caches, &checkpoints).unwrap(), 4);
    tier.flush();
    drop(tier);
    // Block 3 of 4 (by its tokens: each file says which it is).
    let third = block_files(dir.path())
        .into_iter()
        .find(|p| {
            let b = std::fs::read(p).unwrap();
            String::from_utf8_lossy(&b).contains("\"start\":\"16\"")
        })
        .unwrap();
    let mut bytes = std::fs::read(&third).unwrap();
    let last = bytes.len() - 3;
    bytes[last] ^= 0x40;
    std::fs::write(&third, &bytes).unwrap();

    let tier = open(dir.path(), "model-a", 1 << 30);
    let got = tier
        .restore(&toks, fresh(), 0)
        .expect("the blocks before it");
    assert_eq!(got.restored.cached, 16);
    assert_eq!(tier.stats().skipped.load(Ordering::Relaxed), 1);
    assert!(!third.exists(), "a corrupt block is removed");
    let (want, _) = fed(16, 8, 20);
    assert_eq!(contents(&got.restored.caches), contents(&want));

    // A file under another block's name (a foreign or misplaced file) is refused too.
    let files = block_files(dir.path());
    let (first, second) = files.iter().fold((None, None), |(f, s), p| {
        let b = String::from_utf8_lossy(&std::fs::read(p).unwrap()).into_owned();
        if b.contains("\"start\":\"0\"") {
            (Some(p.clone()), s)
        } else if b.contains("\"start\":\"8\"") {
            (f, Some(p.clone()))
        } else {
            (f, s)
        }
    });
    std::fs::copy(second.unwrap(), first.as_ref().unwrap()).unwrap();
    let tier = open(dir.path(), "model-a", 1 << 30);
    assert!(tier.restore(&toks, fresh(), 0).is_none());
    assert_eq!(tier.stats().skipped.load(Ordering::Relaxed), 1);
    assert!(!first.unwrap().exists());

    // Truncated, and not a safetensors file at all.
    for damage in [&b"\x08\0\0\0\0\0\0\0{}"[..], b"garbage"] {
        let tier = open(dir.path(), "model-a", 1 << 30);
        tier.store(&toks, &caches, &checkpoints).unwrap();
        tier.flush();
        let victim = block_files(dir.path())
            .into_iter()
            .find(|p| {
                String::from_utf8_lossy(&std::fs::read(p).unwrap()).contains("\"start\":\"0\"")
            })
            .unwrap();
        std::fs::write(&victim, damage).unwrap();
        drop(tier);
        let tier = open(dir.path(), "model-a", 1 << 30);
        assert!(tier.restore(&toks, fresh(), 0).is_none());
        assert_eq!(tier.stats().skipped.load(Ordering::Relaxed), 1);
    }
}

#[test]
fn the_directory_never_holds_more_than_its_budget() {
    mlx::init_thread().unwrap();
    let dir = tempfile::tempdir().unwrap();
    // One block's size, measured.
    let one = {
        let probe = tempfile::tempdir().unwrap();
        let tier = open(probe.path(), "m", 1 << 30);
        let (c, cp) = fed(8, 8, 0);
        tier.store(&tokens(8, 0), &c, &cp).unwrap();
        tier.flush();
        dir_bytes(probe.path())
    };
    let budget = one * 5 + one / 2;
    let tier = open(dir.path(), "m", budget);
    for s in 0..6u32 {
        let (c, cp) = fed(24, 8, 100 * s);
        tier.store(&tokens(24, 1000 * s), &c, &cp).unwrap();
        tier.flush();
        assert!(dir_bytes(dir.path()) <= budget, "sequence {s}");
    }
    assert!(tier.stats().evicted.load(Ordering::Relaxed) > 0);
    // The newest sequence is whole; the oldest went first.
    let newest = tokens(25, 5000);
    assert_eq!(tier.depth(&newest, &fresh()), 24);
    assert_eq!(tier.depth(&tokens(25, 0), &fresh()), 0);
    // A sequence longer than the budget keeps its start: deeper blocks are worth less.
    let small = tempfile::tempdir().unwrap();
    let tier2 = open(small.path(), "m", one * 2 + one / 2);
    let (c, cp) = fed(40, 8, 7);
    tier2.store(&tokens(40, 77), &c, &cp).unwrap();
    tier2.flush();
    assert_eq!(tier2.depth(&tokens(41, 77), &fresh()), 16);
    assert!(tier2.stats().dropped.load(Ordering::Relaxed) >= 3);
    // A lower budget at the next start evicts down to it.
    drop(tier);
    let tier = open(dir.path(), "m", one * 2);
    assert!(dir_bytes(dir.path()) <= one * 2);
    assert_eq!(
        tier.stats().bytes.load(Ordering::Relaxed),
        dir_bytes(dir.path())
    );
}
