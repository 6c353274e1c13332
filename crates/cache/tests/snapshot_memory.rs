//! What the prefix cache keeps is what it counts: a snapshot of a sequence's positions owns
//! exactly those positions, so once the live caches are gone their allocations are freed. (MLX's
//! `copy` shares its input's buffer, and an unevaluated copy is a graph holding its input: either
//! way a snapshot counted at a few positions kept a whole live allocation alive.) One test in its
//! own binary: MLX's memory counters are the process's.

use cache::prefix::PrefixCache;
use cache::{KvCache, LayerCache};
use mlx::Array;

/// A layer cache holding `t` positions of 8 heads × 64 dims, float32, in one allocation for
/// keys and one for values (4 MiB each at 2,048 positions).
fn filled(t: i32) -> KvCache {
    let keys = Array::zeros(&[1, 8, t, 64], mlx::Dtype::F32).unwrap();
    let values = Array::ones(&[1, 8, t, 64], mlx::Dtype::F32).unwrap();
    keys.eval().unwrap();
    values.eval().unwrap();
    let mut cache = KvCache::new();
    let (k, v) = cache.update(&keys, &values).unwrap();
    k.eval().unwrap();
    v.eval().unwrap();
    cache
}

/// Bytes freed by dropping `live` (MLX's buffer cache emptied first and after).
fn freed_by_dropping<T>(live: T) -> usize {
    mlx::memory::clear_cache();
    let before = mlx::memory::active();
    drop(live);
    mlx::memory::clear_cache();
    before.saturating_sub(mlx::memory::active())
}

#[test]
fn snapshots_own_their_positions_and_nothing_more() {
    // A range copy.
    let cache = filled(2048);
    let (ks, vs) = cache.copy_range(0, 16).unwrap();
    let (ks, vs) = (ks.dense().unwrap(), vs.dense().unwrap());
    ks.eval().unwrap();
    vs.eval().unwrap();
    assert_eq!(ks.nbytes(), 8 * 16 * 64 * 4);
    let freed = freed_by_dropping(cache);
    assert!(
        freed >= 6 << 20,
        "dropping the cache freed {freed} bytes: the copy holds its buffer"
    );
    assert!(vs.to_vec::<f32>().unwrap().iter().all(|&x| x == 1.0));

    // A sequence stored in the prefix cache: 32 positions of 2,048-position allocations.
    let mut prefix = PrefixCache::new(1 << 30, 64);
    let caches = vec![LayerCache::Kv(filled(2048)), LayerCache::Kv(filled(2048))];
    let tokens: Vec<u32> = (0..32).collect();
    prefix.insert(&tokens, &caches, Vec::new()).unwrap();
    let stored = prefix.bytes();
    assert_eq!(stored, 2 * 2 * 8 * 32 * 64 * 4);
    let freed = freed_by_dropping(caches);
    // The live allocations (16 MiB) go; only the stored copies stay.
    assert!(
        freed >= (16 << 20) - stored - (1 << 20),
        "dropping the live caches freed {freed} bytes: the snapshots hold their buffers"
    );
    let restored = prefix
        .restore(
            &tokens,
            vec![
                LayerCache::Kv(KvCache::new()),
                LayerCache::Kv(KvCache::new()),
            ],
        )
        .unwrap();
    assert_eq!(restored.cached, 31);
}
