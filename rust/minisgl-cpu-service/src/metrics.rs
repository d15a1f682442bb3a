//! The service's own counters, reported in every `Stats` message under `cpu_backend` (the API
//! server's `/metrics` renders them as `minisgl_cpu_backend{path="service.<name>"}`).

use rmpv::Value;

use crate::wire;

#[derive(Debug, Clone, Copy, Default)]
pub struct Counters {
    pub requests: u64,
    pub steps: u64,
    pub tokens: u64,
    pub rejected_frames: u64,
    /// CPU microseconds spent tokenizing and queueing requests.
    pub ingress_us: u64,
    /// CPU microseconds spent scheduling and encoding steps.
    pub schedule_us: u64,
    /// CPU microseconds spent committing results and detokenizing.
    pub commit_us: u64,
    /// The most steps ever in flight at once (2 when the service runs a step ahead).
    pub max_in_flight: u64,
}

impl Counters {
    pub fn to_value(&self, in_flight: usize) -> Value {
        wire::map(vec![
            ("backend", "rust_service".into()),
            (
                "service",
                wire::map(vec![
                    ("requests", self.requests.into()),
                    ("steps", self.steps.into()),
                    ("tokens", self.tokens.into()),
                    ("rejected_frames", self.rejected_frames.into()),
                    ("ingress_us", self.ingress_us.into()),
                    ("schedule_us", self.schedule_us.into()),
                    ("commit_us", self.commit_us.into()),
                    ("steps_in_flight", (in_flight as u64).into()),
                    ("max_steps_in_flight", self.max_in_flight.into()),
                ]),
            ),
        ])
    }
}
