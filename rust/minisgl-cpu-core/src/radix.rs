//! Arena-allocated radix prefix cache over token ids.
//!
//! Mirrors `minisgl.kvcache.radix.RadixCache` exactly (see the crate docs for the rules):
//! node ids, the logical clock, split placement and the `(last_access, id)` eviction order.
//! Nodes live in a `Vec`; links are `u32` arena indices, so the tree is `Send + Sync`.
//! Evicted arena slots are recycled through a free list; node *ids* are never reused.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use crate::fxhash::FxBuild;

/// Arena index of a node (the opaque handle handed to callers).
pub type NodeIdx = u32;
/// The root's arena index; the root is never evicted and holds no tokens.
pub const ROOT: NodeIdx = 0;
const NONE: NodeIdx = u32::MAX;

#[derive(Debug, Clone)]
struct Node {
    id: u64,
    key: Vec<i32>,
    value: Vec<i32>,
    parent: NodeIdx,
    children: HashMap<Box<[i32]>, NodeIdx, FxBuild>,
    refc: i32,
    last_access: u64,
    alive: bool,
}

impl Node {
    fn new(id: u64, key: Vec<i32>, value: Vec<i32>, parent: NodeIdx) -> Self {
        Node {
            id,
            key,
            value,
            parent,
            children: HashMap::default(),
            refc: 0,
            last_access: 0,
            alive: true,
        }
    }
}

/// Errors of the radix cache (mirroring the Python exceptions).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RadixError {
    /// `insert` with unequal or non page-aligned tokens / indices (Python `ValueError`).
    BadInsert,
    /// `unlock` of a node whose lock count is already zero (Python `RuntimeError`).
    UnlockUnlocked(u64),
    /// A handle that does not name a live node.
    BadHandle(NodeIdx),
}

impl std::fmt::Display for RadixError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RadixError::BadInsert => {
                write!(f, "insert needs equal, page-aligned tokens and indices")
            }
            RadixError::UnlockUnlocked(id) => write!(f, "unlock of unlocked radix node {id}"),
            RadixError::BadHandle(h) => write!(f, "radix handle {h} names no live node"),
        }
    }
}

impl std::error::Error for RadixError {}

/// The radix tree. See the crate documentation for the exact semantics.
#[derive(Debug, Clone)]
pub struct RadixTree {
    page_size: usize,
    nodes: Vec<Node>,
    free: Vec<NodeIdx>,
    next_id: u64,
    clock: u64,
    evictable: usize,
    protected: usize,
}

impl RadixTree {
    /// An empty tree (root only) for `page_size`-token pages.
    pub fn new(page_size: usize) -> Self {
        assert!(page_size > 0, "page_size must be > 0");
        let mut root = Node::new(0, Vec::new(), Vec::new(), NONE);
        root.refc = 1;
        RadixTree {
            page_size,
            nodes: vec![root],
            free: Vec::new(),
            next_id: 1,
            clock: 0,
            evictable: 0,
            protected: 0,
        }
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Tokens held by unlocked nodes.
    pub fn evictable_size(&self) -> usize {
        self.evictable
    }

    /// Tokens held by locked nodes.
    pub fn protected_size(&self) -> usize {
        self.protected
    }

    /// The logical clock (advanced once per `match_prefix` / `insert`).
    pub fn clock(&self) -> u64 {
        self.clock
    }

    /// Number of live nodes, root excluded.
    pub fn num_nodes(&self) -> usize {
        self.nodes.len() - 1 - self.free.len()
    }

    /// The stable node id of a handle (root = 0), as the Python reference numbers nodes.
    pub fn node_id(&self, h: NodeIdx) -> Result<u64, RadixError> {
        self.live(h).map(|n| n.id)
    }

    fn live(&self, h: NodeIdx) -> Result<&Node, RadixError> {
        match self.nodes.get(h as usize) {
            Some(n) if n.alive => Ok(n),
            _ => Err(RadixError::BadHandle(h)),
        }
    }

    /// Match the longest cached page-aligned prefix of `tokens`; appends the matched KV
    /// locations to `out` and returns the handle of the node ending exactly there.
    pub fn match_prefix(&mut self, tokens: &[i32], out: &mut Vec<i32>) -> NodeIdx {
        let n = tokens.len() / self.page_size * self.page_size;
        self.clock += 1;
        let (node, _) = self.walk(&tokens[..n], Some(out));
        node
    }

    /// Insert a page-aligned sequence; returns how many leading tokens were already present.
    pub fn insert(&mut self, tokens: &[i32], indices: &[i32]) -> Result<usize, RadixError> {
        if tokens.len() != indices.len() || !tokens.len().is_multiple_of(self.page_size) {
            return Err(RadixError::BadInsert);
        }
        self.clock += 1;
        let (node, pos) = self.walk(tokens, None);
        if pos < tokens.len() {
            let leaf = self.new_node(tokens[pos..].to_vec(), indices[pos..].to_vec(), node);
            self.nodes[leaf as usize].last_access = self.clock;
            let key: Box<[i32]> = tokens[pos..pos + self.page_size].into();
            self.nodes[node as usize].children.insert(key, leaf);
            self.evictable += tokens.len() - pos;
        }
        Ok(pos)
    }

    /// Add one reference to every node from `h` up to (excluding) the root.
    pub fn lock(&mut self, h: NodeIdx) -> Result<(), RadixError> {
        self.live(h)?;
        let mut cur = h;
        while cur != ROOT && cur != NONE {
            let node = &mut self.nodes[cur as usize];
            if node.refc == 0 {
                self.evictable -= node.key.len();
                self.protected += node.key.len();
            }
            node.refc += 1;
            cur = node.parent;
        }
        Ok(())
    }

    /// Remove one reference from every node from `h` up to (excluding) the root.
    pub fn unlock(&mut self, h: NodeIdx) -> Result<(), RadixError> {
        self.live(h)?;
        let mut cur = h;
        while cur != ROOT && cur != NONE {
            let node = &mut self.nodes[cur as usize];
            if node.refc <= 0 {
                return Err(RadixError::UnlockUnlocked(node.id));
            }
            node.refc -= 1;
            if node.refc == 0 {
                self.evictable += node.key.len();
                self.protected -= node.key.len();
            }
            cur = node.parent;
        }
        Ok(())
    }

    /// Evict unlocked leaves in `(last_access, id)` order until at least `num_tokens` are
    /// freed (or nothing evictable is left); appends the freed KV locations to `out`.
    pub fn evict(&mut self, num_tokens: usize, out: &mut Vec<i32>) -> usize {
        if num_tokens == 0 {
            return 0;
        }
        let mut heap: BinaryHeap<Reverse<(u64, u64, NodeIdx)>> = self
            .nodes
            .iter()
            .enumerate()
            .skip(1)
            .filter(|(_, n)| n.alive && n.children.is_empty() && n.refc == 0)
            .map(|(i, n)| Reverse((n.last_access, n.id, i as NodeIdx)))
            .collect();
        let mut total = 0;
        while total < num_tokens {
            let Some(Reverse((_, _, leaf))) = heap.pop() else {
                break;
            };
            let ps = self.page_size;
            let (parent, key, value) = {
                let node = &mut self.nodes[leaf as usize];
                node.alive = false;
                node.children = HashMap::default();
                (
                    node.parent,
                    std::mem::take(&mut node.key),
                    std::mem::take(&mut node.value),
                )
            };
            self.nodes[parent as usize].children.remove(&key[..ps]);
            out.extend_from_slice(&value);
            total += value.len();
            self.evictable -= key.len();
            self.free.push(leaf);
            let p = &self.nodes[parent as usize];
            if parent != ROOT && p.children.is_empty() && p.refc == 0 {
                heap.push(Reverse((p.last_access, p.id, parent)));
            }
        }
        total
    }

    /// Every KV location the cache owns (arena order).
    pub fn all_indices(&self) -> Vec<i32> {
        let mut out = Vec::with_capacity(self.evictable + self.protected);
        for n in self.nodes.iter().skip(1).filter(|n| n.alive) {
            out.extend_from_slice(&n.value);
        }
        out
    }

    /// The same checks as the Python `check_integrity`, plus arena reachability.
    pub fn check_integrity(&self) -> Result<(), String> {
        let ps = self.page_size;
        let (mut evictable, mut protected, mut live) = (0usize, 0usize, 0usize);
        for (i, node) in self.nodes.iter().enumerate().skip(1) {
            if !node.alive {
                continue;
            }
            live += 1;
            if node.key.is_empty()
                || !node.key.len().is_multiple_of(ps)
                || node.key.len() != node.value.len()
            {
                return Err(format!("radix node {}: bad key/value lengths", node.id));
            }
            let parent = match self.nodes.get(node.parent as usize) {
                Some(p) if p.alive => p,
                _ => return Err(format!("radix node {}: dead parent", node.id)),
            };
            if parent.children.get(&node.key[..ps]).copied() != Some(i as NodeIdx) {
                return Err(format!(
                    "radix node {}: not linked from its parent",
                    node.id
                ));
            }
            if node.refc < 0 || (node.parent != ROOT && parent.refc < node.refc) {
                return Err(format!(
                    "radix node {}: bad lock count {}",
                    node.id, node.refc
                ));
            }
            if node.refc == 0 {
                evictable += node.key.len();
            } else {
                protected += node.key.len();
            }
        }
        if (evictable, protected) != (self.evictable, self.protected) {
            return Err(format!(
                "radix size accounting: counted {:?}, tracked {:?}",
                (evictable, protected),
                (self.evictable, self.protected)
            ));
        }
        // reachability: every live node hangs off the root
        let mut stack = vec![ROOT];
        let mut seen = 0usize;
        while let Some(h) = stack.pop() {
            for &c in self.nodes[h as usize].children.values() {
                seen += 1;
                stack.push(c);
            }
        }
        if seen != live {
            return Err(format!("radix arena: {live} live nodes, {seen} reachable"));
        }
        let mut idx = self.all_indices();
        idx.sort_unstable();
        if idx.windows(2).any(|w| w[0] == w[1]) {
            return Err("radix cache holds a KV location twice".into());
        }
        Ok(())
    }

    // ------------------------------------------------------------------ internals
    fn walk(&mut self, tokens: &[i32], mut out: Option<&mut Vec<i32>>) -> (NodeIdx, usize) {
        let ps = self.page_size;
        let n = tokens.len();
        let (mut node, mut pos) = (ROOT, 0usize);
        while pos < n {
            let Some(&child) = self.nodes[node as usize]
                .children
                .get(&tokens[pos..pos + ps])
            else {
                break;
            };
            let common = {
                let key = &self.nodes[child as usize].key;
                let rest = &tokens[pos..];
                let m = key.len().min(rest.len());
                let c = key[..m]
                    .iter()
                    .zip(&rest[..m])
                    .position(|(a, b)| a != b)
                    .unwrap_or(m);
                c / ps * ps
            };
            let child = if common < self.nodes[child as usize].key.len() {
                self.split(child, common)
            } else {
                child
            };
            let c = &mut self.nodes[child as usize];
            c.last_access = self.clock;
            if let Some(o) = out.as_deref_mut() {
                o.extend_from_slice(&c.value);
            }
            pos += common;
            node = child;
        }
        (node, pos)
    }

    fn split(&mut self, child: NodeIdx, at: usize) -> NodeIdx {
        let ps = self.page_size;
        let (parent, key, value, refc, last_access) = {
            let c = &mut self.nodes[child as usize];
            let key_tail = c.key.split_off(at);
            let val_tail = c.value.split_off(at);
            let key = std::mem::replace(&mut c.key, key_tail);
            let value = std::mem::replace(&mut c.value, val_tail);
            (c.parent, key, value, c.refc, c.last_access)
        };
        let first: Box<[i32]> = key[..ps].into();
        let mid = self.new_node(key, value, parent);
        {
            let m = &mut self.nodes[mid as usize];
            m.refc = refc;
            m.last_access = last_access;
        }
        let child_first: Box<[i32]> = self.nodes[child as usize].key[..ps].into();
        self.nodes[child as usize].parent = mid;
        self.nodes[mid as usize].children.insert(child_first, child);
        self.nodes[parent as usize].children.insert(first, mid);
        mid
    }

    fn new_node(&mut self, key: Vec<i32>, value: Vec<i32>, parent: NodeIdx) -> NodeIdx {
        let node = Node::new(self.next_id, key, value, parent);
        self.next_id += 1;
        if let Some(h) = self.free.pop() {
            self.nodes[h as usize] = node;
            h
        } else {
            self.nodes.push(node);
            (self.nodes.len() - 1) as NodeIdx
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn send_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<RadixTree>();
    }

    #[test]
    fn insert_match_split_ids() {
        let mut t = RadixTree::new(1);
        assert_eq!(t.insert(&[1, 2, 3, 4], &[10, 11, 12, 13]).unwrap(), 0);
        let mut out = Vec::new();
        let h = t.match_prefix(&[1, 2, 9], &mut out);
        assert_eq!(out, vec![10, 11]);
        // the split prefix takes the next id (2); the old leaf keeps id 1
        assert_eq!(t.node_id(h).unwrap(), 2);
        assert_eq!(t.insert(&[1, 2, 3, 4, 5], &[0, 0, 0, 0, 14]).unwrap(), 4);
        assert_eq!(t.evictable_size(), 5);
        t.check_integrity().unwrap();
    }

    #[test]
    fn lock_and_evict_order() {
        let mut t = RadixTree::new(2);
        t.insert(&[1, 1, 2, 2], &[0, 1, 2, 3]).unwrap();
        t.insert(&[3, 3], &[4, 5]).unwrap();
        let mut out = Vec::new();
        let h = t.match_prefix(&[3, 3], &mut out);
        t.lock(h).unwrap();
        assert_eq!(t.protected_size(), 2);
        let mut freed = Vec::new();
        assert_eq!(t.evict(100, &mut freed), 4);
        assert_eq!(freed, vec![0, 1, 2, 3]);
        assert!(t.unlock(h).is_ok());
        assert!(matches!(t.unlock(h), Err(RadixError::UnlockUnlocked(_))));
        t.check_integrity().unwrap();
    }

    #[test]
    fn bad_insert() {
        let mut t = RadixTree::new(2);
        assert_eq!(t.insert(&[1, 2, 3], &[1, 2, 3]), Err(RadixError::BadInsert));
        assert_eq!(t.insert(&[1, 2], &[1]), Err(RadixError::BadInsert));
    }
}
