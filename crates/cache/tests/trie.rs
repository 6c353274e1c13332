//! The prefix trie's logic with fake payloads that record which tokens they cover.

use cache::trie::{Checkpoint, Segment, Trie};

#[derive(Debug, Clone, PartialEq)]
struct Fake(Vec<u32>);

impl Segment for Fake {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn split(self, at: usize) -> (Self, Self) {
        let (a, b) = self.0.split_at(at);
        (Fake(a.to_vec()), Fake(b.to_vec()))
    }
    fn join(mut self, next: Self) -> Self {
        self.0.extend(next.0);
        self
    }
    fn bytes(&self) -> usize {
        self.0.len() * 10
    }
}

#[derive(Debug, Clone, PartialEq)]
struct Cp(usize);

impl Checkpoint for Cp {
    fn bytes(&self) -> usize {
        5
    }
}

fn insert(t: &mut Trie<Fake, Cp>, tokens: &[u32], cps: &[usize]) -> usize {
    let owned = tokens.to_vec();
    t.insert(
        tokens,
        |s, e| Fake(owned[s..e].to_vec()),
        cps.iter().map(|&p| (p, Cp(p))).collect(),
    )
}

/// The tokens the stored segments give for positions `0..upto` along the match.
fn restored(t: &Trie<Fake, Cp>, m: &cache::trie::Match, upto: usize) -> Vec<u32> {
    t.segments_until(m, upto)
        .into_iter()
        .flat_map(|(s, n)| s.0[..n].to_vec())
        .collect()
}

#[test]
fn insert_and_longest_match() {
    let mut t = Trie::new();
    assert_eq!(insert(&mut t, &[1, 2, 3, 4], &[]), 40);
    let m = t.lookup(&[1, 2, 3, 9]);
    assert_eq!(m.len, 3);
    assert_eq!(restored(&t, &m, 3), vec![1, 2, 3]);
    assert_eq!(t.lookup(&[5, 1]).len, 0);
    assert_eq!(t.lookup(&[1, 2, 3, 4, 5]).len, 4);
    assert_eq!(t.lookup(&[]).len, 0);
    // Re-inserting a stored prefix adds nothing.
    assert_eq!(insert(&mut t, &[1, 2], &[]), 0);
    assert_eq!(t.node_count(), 1);
}

#[test]
fn divergence_splits_an_edge() {
    let mut t = Trie::new();
    insert(&mut t, &[1, 2, 3, 4], &[]);
    insert(&mut t, &[1, 2, 7, 8, 9], &[]);
    assert_eq!(t.sequences(), vec![vec![1, 2, 3, 4], vec![1, 2, 7, 8, 9]]);
    assert_eq!(t.node_count(), 3, "[1,2] then [3,4] and [7,8,9]");
    assert_eq!(t.bytes(), 70, "the shared prefix is stored once");
    let m = t.lookup(&[1, 2, 7, 8, 0]);
    assert_eq!(m.len, 4);
    assert_eq!(restored(&t, &m, 4), vec![1, 2, 7, 8]);
    assert_eq!(restored(&t, &m, 1), vec![1]);
    let m = t.lookup(&[1, 2, 3, 4]);
    assert_eq!(restored(&t, &m, 4), vec![1, 2, 3, 4]);
}

#[test]
fn eviction_merges_the_remaining_branch() {
    let mut t = Trie::new();
    insert(&mut t, &[1, 2, 3, 4], &[]);
    insert(&mut t, &[1, 2, 7], &[]);
    t.lookup(&[1, 2, 3, 4]); // [1, 2, 7] is now the least recently used
    let freed = t.evict(45, &[]);
    assert_eq!(freed, 10);
    assert_eq!(t.sequences(), vec![vec![1, 2, 3, 4]]);
    assert_eq!(
        t.node_count(),
        1,
        "the single remaining child merged into its parent"
    );
    let m = t.lookup(&[1, 2, 3, 4]);
    assert_eq!(restored(&t, &m, 4), vec![1, 2, 3, 4]);
}

#[test]
fn eviction_takes_the_least_recently_used_leaf_first() {
    let mut t = Trie::new();
    insert(&mut t, &[1, 1], &[]); // A
    insert(&mut t, &[2, 2, 2], &[]); // B
    insert(&mut t, &[3], &[]); // C
    t.lookup(&[1, 1]); // A used last; B is the LRU
    t.evict(t.bytes() - 1, &[]);
    assert_eq!(t.sequences(), vec![vec![1, 1], vec![3]]);

    // Within the least recently used path, the leaf goes first and its parent later.
    let mut t = Trie::new();
    insert(&mut t, &[1, 2, 3], &[]);
    insert(&mut t, &[1, 2, 3, 4, 5], &[]);
    insert(&mut t, &[7, 7], &[]);
    t.lookup(&[7, 7]);
    t.evict(t.bytes() - 1, &[]);
    assert_eq!(
        t.sequences(),
        vec![vec![1, 2, 3], vec![7, 7]],
        "the deepest node of the LRU path"
    );
    t.evict(t.bytes() - 1, &[]);
    assert_eq!(t.sequences(), vec![vec![7, 7]]);
}

#[test]
fn budget_is_respected_and_protection_and_branch_points_hold() {
    let mut t = Trie::new();
    for i in 0..10u32 {
        insert(&mut t, &[100, i, i, i], &[]);
    }
    assert_eq!(t.bytes(), 10 + 10 * 30);
    let protect = t.lookup(&[100, 3, 3, 3]).path;
    t.evict(100, &protect);
    assert!(t.bytes() <= 100, "{}", t.bytes());
    assert!(
        t.sequences().contains(&vec![100, 3, 3, 3]),
        "the protected path survives"
    );
    // The shared [100] node is a branch point or on the protected path: never removed.
    assert_eq!(t.lookup(&[100]).len, 1);
    // A budget of zero removes everything not protected; the root stays usable.
    t.evict(0, &[]);
    assert_eq!(t.bytes(), 0);
    assert_eq!(t.node_count(), 0);
    insert(&mut t, &[5, 6], &[]);
    assert_eq!(t.lookup(&[5, 6]).len, 2);
}

#[test]
fn checkpoints_follow_their_positions_through_splits() {
    let mut t = Trie::new();
    insert(&mut t, &[1, 2, 3, 4, 5, 6], &[2, 4, 6]);
    let m = t.lookup(&[1, 2, 3, 4, 5, 6]);
    assert_eq!(t.checkpoints_on(&m), vec![2, 4, 6]);
    // A branch at position 3 splits the edge; checkpoints 2 stays above, 4 and 6 below.
    insert(&mut t, &[1, 2, 3, 9], &[3, 4]);
    let m = t.lookup(&[1, 2, 3, 9]);
    assert_eq!(
        t.checkpoints_on(&m),
        vec![2, 3, 4],
        "3 was added at the branch point"
    );
    assert_eq!(t.checkpoint_at(&m, 3), Some(&Cp(3)));
    let m = t.lookup(&[1, 2, 3, 4, 5, 7]);
    assert_eq!(m.len, 5);
    assert_eq!(t.checkpoints_on(&m), vec![2, 3, 4]);
    // A duplicate checkpoint is not stored twice.
    let b = t.bytes();
    insert(&mut t, &[1, 2, 3, 4, 5, 6], &[4]);
    assert_eq!(t.bytes(), b);
}
