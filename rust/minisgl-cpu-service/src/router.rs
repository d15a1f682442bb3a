//! Data-parallel routing (`--dp N`): which replica serves a new request.
//!
//! `prefix` (the default): the replica whose cache holds the longest prefix of the prompt, when
//! that prefix is at least [`MIN_MATCH_RATIO`] of it; else (or when that replica is far busier
//! than the least loaded one: [`BALANCE_ABS`], [`BALANCE_REL`]) the least loaded replica:
//! queued + running requests, then KV pressure, then the fewest requests routed so far. The
//! cache seen here is a radix tree per replica of the prompts routed to it (the core crate's
//! [`RadixTree`]), evicted LRU at the replica's KV capacity: it holds the prompts still in
//! flight, which the replica's own cache takes only once they are computed. `round_robin`:
//! the live replicas in turn.
//! A replica that is down gets nothing. Pure: no I/O.

use minisgl_cpu_core::RadixTree;

/// The share of the prompt a cached prefix must cover to decide the replica by itself.
pub const MIN_MATCH_RATIO: f64 = 0.25;
/// The prefix replica is passed over when its load exceeds the least one's by this many
/// requests and by [`BALANCE_REL`] times (SGLang's cache-aware router weighs the same two).
pub const BALANCE_ABS: usize = 32;
/// See [`BALANCE_ABS`].
pub const BALANCE_REL: f64 = 1.5;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    Prefix,
    RoundRobin,
}

impl Policy {
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "prefix" => Ok(Policy::Prefix),
            "round_robin" => Ok(Policy::RoundRobin),
            other => Err(format!(
                "--dp-routing: prefix or round_robin, got {other:?}"
            )),
        }
    }
}

/// A replica's load as the router weighs it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Load {
    /// Queued + running requests.
    pub requests: usize,
    /// Used KV pages / all pages, in [0, 1].
    pub kv_used: f64,
}

/// Where a request went and how much of its prompt the chosen replica holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    pub replica: usize,
    pub matched: usize,
}

pub struct Router {
    policy: Policy,
    trees: Vec<RadixTree>,
    capacity: usize,
    alive: Vec<bool>,
    routed: Vec<u64>,
    next: usize,
    scratch: Vec<i32>,
}

impl Router {
    /// `replicas` replicas of `capacity` cached tokens each.
    pub fn new(policy: Policy, replicas: usize, capacity: usize) -> Self {
        Router {
            policy,
            trees: (0..replicas).map(|_| RadixTree::new(1)).collect(),
            capacity: capacity.max(1),
            alive: vec![true; replicas],
            routed: vec![0; replicas],
            next: 0,
            scratch: Vec::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.alive.len()
    }

    pub fn is_empty(&self) -> bool {
        self.alive.is_empty()
    }

    pub fn alive(&self, replica: usize) -> bool {
        self.alive.get(replica).copied().unwrap_or(false)
    }

    pub fn any_alive(&self) -> bool {
        self.alive.iter().any(|&a| a)
    }

    /// Requests routed to each replica so far.
    pub fn routed(&self) -> &[u64] {
        &self.routed
    }

    /// Take a replica out of rotation for good; what it cached is forgotten.
    pub fn set_down(&mut self, replica: usize) {
        if let Some(a) = self.alive.get_mut(replica) {
            *a = false;
            self.trees[replica] = RadixTree::new(1);
        }
    }

    /// The replica for a prompt (`loads`: one per replica); None when every replica is down.
    pub fn route(&mut self, ids: &[i32], loads: &[Load]) -> Option<Route> {
        let live: Vec<usize> = (0..self.len()).filter(|&r| self.alive[r]).collect();
        if live.is_empty() {
            return None;
        }
        let matched: Vec<usize> = (0..self.len()).map(|r| self.match_len(r, ids)).collect();
        let replica = match self.policy {
            Policy::RoundRobin => {
                let r = (0..self.len())
                    .map(|k| (self.next + k) % self.len())
                    .find(|&r| self.alive[r])
                    .unwrap_or(live[0]);
                self.next = (r + 1) % self.len();
                r
            }
            Policy::Prefix => self.by_prefix(&live, &matched, ids.len(), loads),
        };
        self.remember(replica, ids);
        self.routed[replica] += 1;
        Some(Route {
            replica,
            matched: matched[replica],
        })
    }

    fn by_prefix(&self, live: &[usize], matched: &[usize], len: usize, loads: &[Load]) -> usize {
        let load = |r: usize| loads.get(r).copied().unwrap_or_default();
        let key = |r: usize| (load(r).requests as f64 + load(r).kv_used, self.routed[r], r);
        let least = |set: &mut dyn Iterator<Item = usize>| {
            set.min_by(|&a, &b| {
                key(a)
                    .partial_cmp(&key(b))
                    .unwrap_or(std::cmp::Ordering::Equal)
            })
        };
        let idle = least(&mut live.iter().copied()).unwrap_or(live[0]);
        let best = live.iter().map(|&r| matched[r]).max().unwrap_or(0);
        if best == 0 || (best as f64) < MIN_MATCH_RATIO * len as f64 {
            return idle;
        }
        let holder =
            least(&mut live.iter().copied().filter(|&r| matched[r] == best)).unwrap_or(idle);
        let (busy, least) = (load(holder).requests, load(idle).requests);
        if busy > least + BALANCE_ABS && busy as f64 > BALANCE_REL * least as f64 {
            return idle;
        }
        holder
    }

    fn match_len(&mut self, replica: usize, ids: &[i32]) -> usize {
        if !self.alive[replica] {
            return 0;
        }
        self.scratch.clear();
        self.trees[replica].match_prefix(ids, &mut self.scratch);
        self.scratch.len()
    }

    /// Record that `replica` will cache `ids`; evict the least recently used past capacity.
    fn remember(&mut self, replica: usize, ids: &[i32]) {
        if self.policy != Policy::Prefix {
            return;
        }
        let tree = &mut self.trees[replica];
        // the values are never read: the tokens stand in for KV locations
        if tree.insert(ids, ids).is_err() {
            return;
        }
        let size = tree.evictable_size();
        if size > self.capacity {
            self.scratch.clear();
            tree.evict(size - self.capacity, &mut self.scratch);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn idle(n: usize) -> Vec<Load> {
        vec![Load::default(); n]
    }

    fn prompt(head: i32, len: usize, tail: i32) -> Vec<i32> {
        let mut v = vec![head; len];
        v.push(tail);
        v
    }

    #[test]
    fn shared_prefixes_stay_on_one_replica_and_groups_spread() {
        let mut r = Router::new(Policy::Prefix, 2, 10_000);
        for g in 0..4 {
            let homes: Vec<Option<usize>> = (0..3)
                .map(|k| r.route(&prompt(g + 1, 32, k), &idle(2)).map(|x| x.replica))
                .collect();
            assert_eq!(homes, vec![Some(g as usize % 2); 3], "group {g}");
        }
        assert_eq!(r.routed(), &[6, 6]);
    }

    #[test]
    fn a_prefix_match_counts_and_short_matches_do_not() {
        let mut r = Router::new(Policy::Prefix, 2, 10_000);
        assert_eq!(
            r.route(&prompt(1, 40, 0), &idle(2)).map(|x| x.replica),
            Some(0)
        );
        let again = r.route(&prompt(1, 40, 5), &idle(2));
        assert_eq!(
            again,
            Some(Route {
                replica: 0,
                matched: 40
            })
        );
        // one shared token of 40 is no reason to pile onto replica 0
        let mut other = prompt(1, 1, 0);
        other.extend(vec![7; 40]);
        assert_eq!(r.route(&other, &idle(2)).map(|x| x.replica), Some(1));
    }

    #[test]
    fn load_breaks_ties_and_a_busy_holder_is_passed_over() {
        let mut r = Router::new(Policy::Prefix, 2, 10_000);
        let busy0 = [
            Load {
                requests: 3,
                kv_used: 0.0,
            },
            Load::default(),
        ];
        assert_eq!(
            r.route(&prompt(1, 8, 0), &busy0).map(|x| x.replica),
            Some(1)
        );
        let swamped = [
            Load::default(),
            Load {
                requests: 40,
                kv_used: 0.9,
            },
        ];
        assert_eq!(
            r.route(&prompt(1, 8, 1), &swamped).map(|x| x.replica),
            Some(0)
        );
        let kv = [
            Load {
                requests: 1,
                kv_used: 0.9,
            },
            Load {
                requests: 1,
                kv_used: 0.1,
            },
        ];
        assert_eq!(r.route(&[50, 51, 52], &kv).map(|x| x.replica), Some(1));
    }

    #[test]
    fn a_holder_moderately_busier_keeps_its_prefix() {
        // a burst of 64 requests over 8 prefixes leaves one replica a few requests ahead:
        // moving a prefix then costs its whole prefill on the other replica (and every
        // request of it that arrives before that prefill ends), more than the queue saves
        let mut r = Router::new(Policy::Prefix, 2, 10_000);
        r.route(&prompt(1, 64, 0), &idle(2));
        let ahead = |holder: usize, other: usize| {
            [
                Load {
                    requests: holder,
                    kv_used: 0.2,
                },
                Load {
                    requests: other,
                    kv_used: 0.1,
                },
            ]
        };
        for (holder, other) in [(11, 1), (30, 12), (40, 24), (44, 13)] {
            let to = r.route(&prompt(1, 64, 1), &ahead(holder, other));
            assert_eq!(to.map(|x| x.replica), Some(0), "{holder} vs {other}");
        }
        // far busier (by BALANCE_ABS and by BALANCE_REL): the other replica takes it
        let to = r.route(&prompt(1, 64, 2), &ahead(60, 20));
        assert_eq!(to.map(|x| x.replica), Some(1));
    }

    #[test]
    fn round_robin_skips_replicas_that_are_down() {
        let mut r = Router::new(Policy::RoundRobin, 3, 100);
        let order: Vec<usize> = (0..4)
            .filter_map(|i| r.route(&[i], &idle(3)).map(|x| x.replica))
            .collect();
        assert_eq!(order, vec![0, 1, 2, 0]);
        r.set_down(2);
        let order: Vec<usize> = (0..4)
            .filter_map(|i| r.route(&[i], &idle(3)).map(|x| x.replica))
            .collect();
        assert_eq!(order, vec![1, 0, 1, 0]);
        r.set_down(0);
        r.set_down(1);
        assert!(!r.any_alive());
        assert_eq!(r.route(&[1], &idle(3)), None);
    }

    #[test]
    fn a_down_replica_loses_its_prefixes_and_capacity_evicts() {
        let mut r = Router::new(Policy::Prefix, 2, 16);
        r.route(&prompt(1, 12, 0), &idle(2));
        r.set_down(0);
        assert_eq!(
            r.route(&prompt(1, 12, 1), &idle(2)).map(|x| x.replica),
            Some(1)
        );
        r.route(&prompt(2, 12, 0), &idle(2)); // replica 1 holds 16 tokens at most
        let back = r.route(&prompt(1, 12, 2), &idle(2));
        assert_eq!(back.map(|x| x.matched), Some(0));
    }
}
