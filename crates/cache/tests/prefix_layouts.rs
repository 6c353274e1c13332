//! The prefix cache keeps one entry per prefix for each set of caches (a drafting sequence's
//! carry the drafter's too): both kinds are restored for the same tokens, and they share one
//! budget, evicted least recently used across them.

use cache::prefix::PrefixCache;
use cache::{KvCache, LayerCache};
use mlx::Array;

fn filled(t: i32, v: f32) -> LayerCache {
    let keys = Array::full(&[1, 2, t, 8], v as f64, mlx::Dtype::F32).unwrap();
    let mut cache = KvCache::new();
    cache.update(&keys, &keys).unwrap();
    LayerCache::Kv(cache)
}

fn fresh(n: usize) -> Vec<LayerCache> {
    (0..n).map(|_| LayerCache::Kv(KvCache::new())).collect()
}

#[test]
fn each_set_of_caches_keeps_its_prefixes_within_one_budget() {
    let tokens: Vec<u32> = (0..16).collect();
    let one = vec![filled(16, 1.0)];
    let two = vec![filled(16, 2.0), filled(16, 3.0)];
    let entry = |n: usize| n * 2 * 2 * 16 * 8 * 4;

    let mut both = PrefixCache::new(entry(1) + entry(2), 64);
    both.insert(&tokens, &one, Vec::new()).unwrap();
    both.insert(&tokens, &two, Vec::new()).unwrap();
    assert_eq!(both.bytes(), entry(1) + entry(2));
    for n in [1, 2] {
        let r = both.restore(&tokens, fresh(n)).unwrap();
        assert_eq!(r.cached, 15, "{n} caches");
        assert_eq!(r.caches.len(), n);
    }
    let r = both.restore(&tokens, fresh(2)).unwrap();
    let LayerCache::Kv(kv) = &r.caches[1] else {
        panic!()
    };
    let (k, _) = kv.state().unwrap().unwrap();
    assert!(k.to_vec::<f32>().unwrap().iter().all(|&x| x == 3.0));

    // Room for the larger entry only: the one used least recently goes, whichever trie.
    let mut tight = PrefixCache::new(entry(2), 64);
    tight.insert(&tokens, &one, Vec::new()).unwrap();
    tight.insert(&tokens, &two, Vec::new()).unwrap();
    assert_eq!(tight.restore(&tokens, fresh(1)).unwrap().cached, 0);
    assert_eq!(tight.restore(&tokens, fresh(2)).unwrap().cached, 15);
    tight.insert(&tokens, &one, Vec::new()).unwrap();
    assert_eq!(tight.restore(&tokens, fresh(2)).unwrap().cached, 0);
    assert_eq!(tight.restore(&tokens, fresh(1)).unwrap().cached, 15);
    assert!(tight.bytes() <= entry(2));
}
