//! A split model's other ranks keep rank 0's prefix trie by repeating its calls (lookups,
//! exact restores, exact stores with rank 0's evictions), each with its own layers' data:
//! they restore where rank 0 restores, and evict what rank 0 evicts, though their bytes differ.

use cache::prefix::{CacheCheckpoint, PrefixCache};
use cache::{KvCache, LayerCache, RotatingKvCache};
use mlx::Array;

/// A full-attention layer holding `t` positions of `heads` heads, position `p` valued
/// `tag + p`.
fn kv(t: usize, heads: i32, tag: f32) -> LayerCache {
    let mut c = KvCache::new();
    write(&mut c, 0, t, heads, tag);
    LayerCache::Kv(c)
}

fn write(c: &mut KvCache, from: usize, to: usize, heads: i32, tag: f32) {
    if to == from {
        return;
    }
    let vals: Vec<f32> = (0..heads as usize)
        .flat_map(|_| (from..to).flat_map(|p| [tag + p as f32; 4]))
        .collect();
    let x = Array::from_slice(&vals, &[1, heads, (to - from) as i32, 4]).unwrap();
    c.update(&x, &x).unwrap();
}

fn rotating(t: usize, window: usize, tag: f32) -> LayerCache {
    let mut c = RotatingKvCache::new(window);
    for p in 0..t {
        let x = Array::full(&[1, 1, 1, 4], (tag + p as f32) as f64, mlx::Dtype::F32).unwrap();
        c.update(&x, &x).unwrap();
    }
    LayerCache::Rotating(c)
}

fn first_key_at(c: &LayerCache, p: usize) -> f32 {
    let LayerCache::Kv(kv) = c else { panic!() };
    let (k, _) = kv.state().unwrap().unwrap();
    k.to_vec::<f32>().unwrap()[p * 4]
}

/// Rank 0 (two full layers of 4 heads, one trie key) and a follower (one layer of 2 heads)
/// seeing the same prompts: every restore rank 0 makes, the follower makes at the same
/// position with its own data, through evictions rank 0's budget forces.
#[test]
fn a_mirror_restores_and_evicts_as_rank_0_does() {
    let entry = 2 * 2 * 4 * 4 * 4; // bytes a position costs rank 0: 2 layers, k and v
    let mut lead = PrefixCache::new(40 * entry, 8);
    let mut mirror = PrefixCache::new(usize::MAX, 8);
    let prompts: Vec<Vec<u32>> = vec![
        (0..20).collect(),
        (0..10).chain(100..110).collect(),
        (50..70).collect(),
        (0..20).chain(200..205).collect(),
        (50..65).collect(),
        (0..10).collect(),
        (300..330).collect(),
        (0..20).collect(),
        (50..70).collect(),
    ];
    let (mut hits, mut evicted) = (0, 0);
    for (i, prompt) in prompts.iter().enumerate() {
        let r = lead
            .restore(prompt, vec![kv(0, 4, 0.0), kv(0, 4, 0.0)])
            .unwrap();
        let at = r.cached;
        let seen = &prompt[..prompt.len().min(r.matched + 1)];
        if at > 0 {
            hits += 1;
            let caches = mirror
                .restore_exact(2, seen, vec![kv(0, 2, 0.0)], at)
                .unwrap()
                .unwrap_or_else(|| panic!("prompt {i}: the mirror cannot restore {at}"));
            assert_eq!(caches[0].offset(), at);
            assert_eq!(first_key_at(&caches[0], at - 1), 1000.0 + at as f32 - 1.0);
        } else {
            mirror.touch(2, seen);
        }
        let t = prompt.len();
        let stored = lead
            .insert(prompt, &[kv(t, 4, 0.0), kv(t, 4, 0.0)], Vec::new())
            .unwrap();
        assert_eq!(stored.held, t);
        evicted += stored.evicted;
        mirror
            .insert_exact(2, prompt, &[kv(t, 2, 1000.0)], Vec::new(), stored.evicted)
            .unwrap();
        assert!(lead.bytes() <= 40 * entry);
    }
    assert!(hits >= 3 && evicted >= 2, "{hits} hits, {evicted} evicted");
    // What is left is alike: every prompt restores as far on both.
    for prompt in &prompts {
        let r = lead
            .restore(prompt, vec![kv(0, 4, 0.0), kv(0, 4, 0.0)])
            .unwrap();
        let seen = &prompt[..prompt.len().min(r.matched + 1)];
        let m = mirror
            .restore_exact(2, seen, vec![kv(0, 2, 0.0)], r.cached)
            .unwrap();
        assert_eq!(m.is_some(), r.cached > 0, "{prompt:?}");
    }
}

/// Rank 0's layers do not rotate but a follower's do: told that some rank's layers rotate,
/// rank 0 restores only where snapshots were taken, which the follower holds too; where the
/// follower lacks the snapshot it says so (and both start cold).
#[test]
fn rank_0_restores_only_where_every_rank_has_a_snapshot() {
    let mut lead = PrefixCache::new(usize::MAX, 8).rotating(true);
    let mut mirror = PrefixCache::new(usize::MAX, 8);
    let prompt: Vec<u32> = (0..24).collect();
    let snaps = [8usize, 16];
    let cps = snaps
        .iter()
        .map(|&p| (p, CacheCheckpoint::of(&[kv(p, 4, 0.0)])))
        .collect();
    let stored = lead.insert(&prompt, &[kv(24, 4, 0.0)], cps).unwrap();
    assert_eq!(stored.checkpoints, vec![8, 16, 24]);
    let follower = stored
        .checkpoints
        .iter()
        .map(|&p| {
            (
                p,
                CacheCheckpoint::of(&[kv(p, 2, 1000.0), rotating(p, 4, 0.0)]),
            )
        })
        .collect();
    mirror
        .insert_exact(
            1,
            &prompt,
            &[kv(24, 2, 1000.0), rotating(24, 4, 0.0)],
            follower,
            0,
        )
        .unwrap();
    let longer: Vec<u32> = (0..30).collect();
    let r = lead.restore(&longer, vec![kv(0, 4, 0.0)]).unwrap();
    assert_eq!((r.cached, r.matched), (24, 24));
    let fresh = || vec![kv(0, 2, 0.0), LayerCache::Rotating(RotatingKvCache::new(4))];
    let seen = &longer[..25];
    let caches = mirror.restore_exact(1, seen, fresh(), 24).unwrap().unwrap();
    assert_eq!(caches[1].offset(), 24);
    let short: Vec<u32> = (0..20).collect();
    let r = lead.restore(&short, vec![kv(0, 4, 0.0)]).unwrap();
    assert_eq!(r.cached, 16, "the deepest snapshot within the prompt");
    assert!(mirror
        .restore_exact(1, &short, fresh(), 16)
        .unwrap()
        .is_some());
    // No snapshot at 12 on the follower: it cannot restore there.
    assert!(mirror
        .restore_exact(1, &short, fresh(), 12)
        .unwrap()
        .is_none());
}
