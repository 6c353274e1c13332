//! A compressed prefix trie over token ids, generic in what it stores, so that its logic is
//! tested with fake payloads (no MLX) and used with real cache data by [`crate::prefix`].
//!
//! Each node's edge is a run of tokens at positions `depth .. depth + len`. It holds a
//! [`Segment`] for those positions (the data of caches that keep every position) and
//! [`Checkpoint`]s at some positions in `depth + 1 ..= depth + len` (full states of caches that
//! can only be restored where a snapshot was taken, like the rotating sliding-window cache).

/// Data covering a run of positions, splittable and joinable.
pub trait Segment: Sized {
    /// Positions covered.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The first `at` positions and the rest.
    fn split(self, at: usize) -> (Self, Self);
    /// This run followed by `next`.
    fn join(self, next: Self) -> Self;
    fn bytes(&self) -> usize;
}

/// A snapshot of state at one position.
pub trait Checkpoint {
    fn bytes(&self) -> usize;
}

struct Node<S, C> {
    parent: Option<usize>,
    children: Vec<usize>,
    tokens: Vec<u32>,
    depth: usize,
    segment: Option<S>,
    /// Sorted by position; positions in `depth + 1 ..= depth + tokens.len()`.
    checkpoints: Vec<(usize, C)>,
    last_used: u64,
}

impl<S: Segment, C: Checkpoint> Node<S, C> {
    fn end(&self) -> usize {
        self.depth + self.tokens.len()
    }

    fn bytes(&self) -> usize {
        self.segment.as_ref().map_or(0, S::bytes)
            + self
                .checkpoints
                .iter()
                .map(|(_, c)| c.bytes())
                .sum::<usize>()
    }
}

/// The longest stored prefix of a token sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Match {
    /// Nodes from the root's first child down to the one where the match ends.
    pub path: Vec<usize>,
    /// Tokens matched.
    pub len: usize,
}

pub struct Trie<S, C> {
    nodes: Vec<Option<Node<S, C>>>,
    free: Vec<usize>,
    clock: u64,
    bytes: usize,
}

const ROOT: usize = 0;

impl<S: Segment, C: Checkpoint> Default for Trie<S, C> {
    fn default() -> Self {
        Self::new()
    }
}

impl<S: Segment, C: Checkpoint> Trie<S, C> {
    pub fn new() -> Self {
        Trie {
            nodes: vec![Some(Node {
                parent: None,
                children: Vec::new(),
                tokens: Vec::new(),
                depth: 0,
                segment: None,
                checkpoints: Vec::new(),
                last_used: 0,
            })],
            free: Vec::new(),
            clock: 0,
            bytes: 0,
        }
    }

    fn node(&self, i: usize) -> &Node<S, C> {
        self.nodes[i].as_ref().expect("live node id")
    }

    fn node_mut(&mut self, i: usize) -> &mut Node<S, C> {
        self.nodes[i].as_mut().expect("live node id")
    }

    fn alloc(&mut self, n: Node<S, C>) -> usize {
        match self.free.pop() {
            Some(i) => {
                self.nodes[i] = Some(n);
                i
            }
            None => {
                self.nodes.push(Some(n));
                self.nodes.len() - 1
            }
        }
    }

    /// Bytes held by every segment and checkpoint.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Stored nodes, the root excluded.
    pub fn node_count(&self) -> usize {
        self.nodes.iter().flatten().count() - 1
    }

    fn child_starting(&self, n: usize, t: u32) -> Option<usize> {
        self.node(n)
            .children
            .iter()
            .copied()
            .find(|&c| self.node(c).tokens.first() == Some(&t))
    }

    /// The longest stored prefix of `tokens`; marks the nodes it crosses as just used.
    pub fn lookup(&mut self, tokens: &[u32]) -> Match {
        self.clock += 1;
        let (mut n, mut pos, mut path) = (ROOT, 0, Vec::new());
        while pos < tokens.len() {
            let Some(c) = self.child_starting(n, tokens[pos]) else {
                break;
            };
            let edge = &self.node(c).tokens;
            let common = edge
                .iter()
                .zip(&tokens[pos..])
                .take_while(|(a, b)| a == b)
                .count();
            path.push(c);
            pos += common;
            if common < edge.len() {
                break;
            }
            n = c;
        }
        let clock = self.clock;
        for &p in &path {
            self.node_mut(p).last_used = clock;
        }
        Match { path, len: pos }
    }

    /// Checkpoint positions stored along `m`'s path, up to `m.len`, ascending.
    pub fn checkpoints_on(&self, m: &Match) -> Vec<usize> {
        m.path
            .iter()
            .flat_map(|&p| self.node(p).checkpoints.iter().map(|(pos, _)| *pos))
            .filter(|&pos| pos <= m.len)
            .collect()
    }

    pub fn checkpoint_at(&self, m: &Match, pos: usize) -> Option<&C> {
        m.path
            .iter()
            .flat_map(|&p| self.node(p).checkpoints.iter())
            .find(|(q, _)| *q == pos)
            .map(|(_, c)| c)
    }

    /// The segments that cover positions `0..upto` along `m`'s path, each with how many of its
    /// leading positions to take.
    pub fn segments_until(&self, m: &Match, upto: usize) -> Vec<(&S, usize)> {
        let mut out = Vec::new();
        for &p in &m.path {
            let n = self.node(p);
            if n.depth >= upto {
                break;
            }
            if let Some(s) = &n.segment {
                out.push((s, (upto - n.depth).min(n.tokens.len())));
            }
        }
        out
    }

    /// Splits node `c` so that its first `at` tokens become a new parent node.
    fn split(&mut self, c: usize, at: usize) -> usize {
        let (parent, depth, head_tokens, tail_tokens, head_seg, tail_seg, head_cps, tail_cps, used) = {
            let n = self.node_mut(c);
            let tail_tokens = n.tokens.split_off(at);
            let head_tokens = std::mem::take(&mut n.tokens);
            let (hs, ts) = match n.segment.take() {
                Some(s) => {
                    let (a, b) = s.split(at);
                    (Some(a), Some(b))
                }
                None => (None, None),
            };
            let cps = std::mem::take(&mut n.checkpoints);
            let cut = n.depth + at;
            let (hc, tc): (Vec<_>, Vec<_>) = cps.into_iter().partition(|(p, _)| *p <= cut);
            (
                n.parent,
                n.depth,
                head_tokens,
                tail_tokens,
                hs,
                ts,
                hc,
                tc,
                n.last_used,
            )
        };
        let head = self.alloc(Node {
            parent,
            children: vec![c],
            tokens: head_tokens,
            depth,
            segment: head_seg,
            checkpoints: head_cps,
            last_used: used,
        });
        {
            let n = self.node_mut(c);
            n.parent = Some(head);
            n.tokens = tail_tokens;
            n.depth = depth + at;
            n.segment = tail_seg;
            n.checkpoints = tail_cps;
        }
        if let Some(p) = parent {
            let ch = &mut self.node_mut(p).children;
            if let Some(slot) = ch.iter_mut().find(|x| **x == c) {
                *slot = head;
            }
        }
        head
    }

    /// Records `tokens` (whose cache data `segment(start, end)` can produce for any run the
    /// trie lacks) and the checkpoints taken along them. Existing data is kept; checkpoints at
    /// positions that already have one are dropped. Returns the bytes added.
    pub fn insert(
        &mut self,
        tokens: &[u32],
        mut segment: impl FnMut(usize, usize) -> S,
        checkpoints: Vec<(usize, C)>,
    ) -> usize {
        self.clock += 1;
        let before = self.bytes;
        let (mut n, mut pos) = (ROOT, 0);
        let mut path = Vec::new();
        while pos < tokens.len() {
            let Some(c) = self.child_starting(n, tokens[pos]) else {
                break;
            };
            let edge_len = self.node(c).tokens.len();
            let common = self
                .node(c)
                .tokens
                .iter()
                .zip(&tokens[pos..])
                .take_while(|(a, b)| a == b)
                .count();
            // Split only where the sequence goes on differently; one that ends inside the edge
            // is already stored.
            let diverges = common < edge_len && pos + common < tokens.len();
            let c = if diverges {
                let old = self.node(c).bytes();
                let head = self.split(c, common);
                // Splitting moves bytes between nodes; the total only changes through rounding
                // of shared buffers, so recount the two halves.
                self.bytes = self.bytes - old + self.node(head).bytes() + self.node(c).bytes();
                head
            } else {
                c
            };
            path.push(c);
            pos += common;
            n = c;
            if common < edge_len {
                break;
            }
        }
        if pos < tokens.len() {
            let seg = segment(pos, tokens.len());
            let leaf = self.alloc(Node {
                parent: Some(n),
                children: Vec::new(),
                tokens: tokens[pos..].to_vec(),
                depth: pos,
                segment: Some(seg),
                checkpoints: Vec::new(),
                last_used: self.clock,
            });
            self.bytes += self.node(leaf).bytes();
            self.node_mut(n).children.push(leaf);
            path.push(leaf);
        }
        let clock = self.clock;
        for &p in &path {
            self.node_mut(p).last_used = clock;
        }
        for (at, cp) in checkpoints {
            let Some(&owner) = path.iter().find(|&&p| {
                let n = self.node(p);
                at > n.depth && at <= n.end()
            }) else {
                continue;
            };
            let n = self.node_mut(owner);
            if n.checkpoints.iter().any(|(q, _)| *q == at) {
                continue;
            }
            let b = cp.bytes();
            let i = n.checkpoints.partition_point(|(q, _)| *q < at);
            n.checkpoints.insert(i, (at, cp));
            self.bytes += b;
        }
        self.bytes - before
    }

    fn is_branch_point(&self, n: usize) -> bool {
        self.node(n).children.len() >= 2
    }

    /// Removes leaves until at most `budget` bytes are held: least recently used first, then
    /// the deepest, then the largest. Branch points are never removed (a leaf never is one), and
    /// neither are the nodes in `protected`. Returns the bytes freed.
    pub fn evict(&mut self, budget: usize, protected: &[usize]) -> usize {
        let start = self.bytes;
        while self.bytes > budget {
            let Some(v) = self.victim(protected) else {
                break;
            };
            self.remove_leaf(v);
        }
        start - self.bytes
    }

    /// The leaf [`Trie::evict`] would remove next.
    fn victim(&self, protected: &[usize]) -> Option<usize> {
        self.nodes
            .iter()
            .enumerate()
            .filter_map(|(i, n)| n.as_ref().map(|n| (i, n)))
            .filter(|(i, n)| *i != ROOT && n.children.is_empty() && !protected.contains(i))
            .min_by(|(_, a), (_, b)| {
                a.last_used
                    .cmp(&b.last_used)
                    .then(b.end().cmp(&a.end()))
                    .then(b.bytes().cmp(&a.bytes()))
            })
            .map(|(i, _)| i)
    }

    /// When the leaf [`Trie::evict`] would remove next was last used (`None`: nothing to
    /// remove), to choose between tries sharing one clock ([`Trie::clock_at_least`]).
    pub fn next_victim_used(&self) -> Option<u64> {
        self.victim(&[]).map(|v| self.node(v).last_used)
    }

    /// Removes the leaf [`Trie::evict`] would remove next; returns the bytes freed.
    pub fn evict_one(&mut self) -> usize {
        let start = self.bytes;
        if let Some(v) = self.victim(&[]) {
            self.remove_leaf(v);
        }
        start - self.bytes
    }

    /// The use clock, and a floor for it: several tries whose clocks are kept in step (each
    /// raised to the highest before it is used) order their uses alike.
    pub fn clock(&self) -> u64 {
        self.clock
    }

    pub fn clock_at_least(&mut self, t: u64) {
        self.clock = self.clock.max(t);
    }

    fn remove_leaf(&mut self, v: usize) {
        let Some(n) = self.nodes[v].take() else {
            return;
        };
        self.free.push(v);
        self.bytes -= n.bytes();
        if let Some(p) = n.parent {
            self.node_mut(p).children.retain(|&c| c != v);
            self.merge_single_child(p);
        }
    }

    /// A non-root node left with one child absorbs it, keeping the trie compressed.
    fn merge_single_child(&mut self, p: usize) {
        if p == ROOT || self.node(p).children.len() != 1 || self.is_branch_point(p) {
            return;
        }
        let c = self.node(p).children[0];
        let Some(child) = self.nodes[c].take() else {
            return;
        };
        self.free.push(c);
        let before = self.node(p).bytes() + child.bytes();
        let n = self.node_mut(p);
        n.tokens.extend_from_slice(&child.tokens);
        n.segment = match (n.segment.take(), child.segment) {
            (Some(a), Some(b)) => Some(a.join(b)),
            (a, b) => a.or(b),
        };
        n.checkpoints.extend(child.checkpoints);
        n.children = child.children;
        n.last_used = n.last_used.max(child.last_used);
        let grandchildren = n.children.clone();
        let after = n.bytes();
        for g in grandchildren {
            self.node_mut(g).parent = Some(p);
        }
        self.bytes = self.bytes - before + after;
    }

    /// The token sequences of every leaf (for tests and debugging).
    pub fn sequences(&self) -> Vec<Vec<u32>> {
        let mut out = Vec::new();
        for (i, n) in self.nodes.iter().enumerate() {
            let Some(n) = n else { continue };
            if i == ROOT || !n.children.is_empty() {
                continue;
            }
            let mut chain = vec![i];
            let mut cur = n.parent;
            while let Some(p) = cur {
                if p == ROOT {
                    break;
                }
                chain.push(p);
                cur = self.node(p).parent;
            }
            let seq: Vec<u32> = chain
                .iter()
                .rev()
                .flat_map(|&x| self.node(x).tokens.clone())
                .collect();
            out.push(seq);
        }
        out.sort();
        out
    }
}
