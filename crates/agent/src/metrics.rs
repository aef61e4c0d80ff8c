//! Prometheus metrics (prometheus-client), in base units.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Metric, Registry, Unit};
use std::sync::atomic::AtomicU64;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabels {
    pub state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TransitionLabels {
    pub service: String,
    pub kind: String,
    pub result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    pub kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ServiceLabels {
    pub service: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PodKeyLabels {
    /// `NAMESPACE/NAME`.
    pub pod: String,
    pub key: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabels {
    pub phase: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EventLabels {
    pub event: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// A model some service serves, or `unknown` (never the client's string).
    pub model: String,
    pub status: String,
}

fn phase_buckets() -> Histogram {
    // 100 us .. ~14 min: a state-file write to a checkpoint of 75 GB.
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(0.0001, 2.0, 24))
}

fn seconds_buckets() -> Histogram {
    // 1 ms .. ~9 min: a proxy hop to a resume of tens of GB to a cold wake.
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(0.001, 2.0, 20))
}

pub struct Metrics {
    pub registry: Registry,
    pub services: Family<StateLabels, Gauge>,
    pub transitions: Family<TransitionLabels, Counter>,
    pub durations: Histograms<KindLabels>,
    pub wait: Histograms<ServiceLabels>,
    pub in_flight: Family<ServiceLabels, Gauge>,
    pub host_bytes: Gauge<u64, AtomicU64>,
    /// Pinned host memory the fast-swap servers' libraries hold for copies.
    pub pinned_bytes: Gauge<u64, AtomicU64>,
    pub image_bytes: Gauge<u64, AtomicU64>,
    pub refusals: Family<ServiceLabels, Counter>,
    pub connections_closed: Family<ServiceLabels, Counter>,
    pub swap_phase: Histograms<PhaseLabels>,
    pub swap: Histograms<KindLabels>,
    pub swap_events: Family<EventLabels, Counter>,
    pub faults: Family<ServiceLabels, Counter>,
    pub fast_swap_bind_failures: Family<ServiceLabels, Counter>,
    pub annotation_errors: Family<PodKeyLabels, Counter>,
    pub socket_wakes: Family<ServiceLabels, Counter>,
    pub socket_wake_delay: Histograms<ServiceLabels>,
    /// 1 for a service whose process was started with another `command` or
    /// `fast_swap` than its config says now (found again by a restarted agent).
    pub config_drift: Family<ServiceLabels, Gauge>,
    /// Reloads of the config: `ok`, or `refused` (the config in use kept).
    pub reloads: Family<ResultLabels, Counter>,
    /// Front-door requests by model and HTTP status.
    pub requests: Family<RequestLabels, Counter>,
    /// The last request-driven wakes, for the status page (not exported).
    pub recent: crate::recent::Recent,
}

/// A histogram family whose buckets come from `fn() -> Histogram`.
type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;

/// Registers `metric` (in `unit` where it has one) and gives back the handle
/// the agent updates: each metric is made and registered in one place.
fn register<M: Metric + Clone>(
    registry: &mut Registry,
    name: &str,
    help: &str,
    unit: Option<Unit>,
    metric: M,
) -> M {
    match unit {
        Some(unit) => registry.register_with_unit(name, help, unit, metric.clone()),
        None => registry.register(name, help, metric.clone()),
    }
    metric
}

/// A histogram family in seconds, with `buckets`.
fn seconds<L: Clone + std::hash::Hash + Eq>(
    registry: &mut Registry,
    name: &str,
    help: &str,
    buckets: fn() -> Histogram,
) -> Histograms<L>
where
    Histograms<L>: Metric + Clone,
{
    register(registry, name, help, Some(Unit::Seconds), Family::new_with_constructor(buckets))
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("gpusnap_agent");
        let r = &mut registry;
        Self {
            services: register(r, "services", "Services by state", None, Family::default()),
            transitions: register(
                r,
                "transitions",
                "Transitions by service, kind and result",
                None,
                Family::default(),
            ),
            durations: seconds(
                r,
                "transition_duration",
                "Duration of suspend, resume, hibernate and wake",
                seconds_buckets,
            ),
            wait: seconds(
                r,
                "request_wait",
                "Time a connection waited for its service to come back",
                seconds_buckets,
            ),
            in_flight: register(r, "connections_in_flight", "Open client connections", None, Family::default()),
            host_bytes: register(
                r,
                "host_memory",
                "Device memory of suspended and parked services, held in host RAM",
                Some(Unit::Bytes),
                Gauge::default(),
            ),
            pinned_bytes: register(
                r,
                "pinned_host_memory",
                "Pinned host memory the fast-swap servers hold for their copies (each within [agent] pinned_budget)",
                Some(Unit::Bytes),
                Gauge::default(),
            ),
            image_bytes: register(
                r,
                "image",
                "Size of the images of hibernated services",
                Some(Unit::Bytes),
                Gauge::default(),
            ),
            refusals: register(
                r,
                "admission_refusals",
                "Resumes refused for lack of GPU memory",
                None,
                Family::default(),
            ),
            connections_closed: register(
                r,
                "connections_closed_unserved",
                "Connections closed because their service could not come back in time, or refused at a connection cap",
                None,
                Family::default(),
            ),
            swap_phase: seconds(
                r,
                "swap_phase",
                "Phases of a wake caused by a request (a swap when it evicts), from accept to the first byte; \
                 they add up to gpusnap_agent_swap_seconds",
                phase_buckets,
            ),
            swap: seconds(
                r,
                "swap",
                "Wakes caused by a request, from the proxy's accept to the answer's first byte",
                phase_buckets,
            ),
            swap_events: register(
                r,
                "swap_events",
                "What wakes caused by a request had to do: admissions, refusals, evictions, NVML reads, connect retries",
                None,
                Family::default(),
            ),
            config_drift: register(
                r,
                "service_config_drift",
                "1 for a service whose process runs with another command or fast_swap than its config says \
                 (restart it to apply the config), else 0",
                None,
                Family::default(),
            ),
            reloads: register(
                r,
                "reloads",
                "Reloads of the config file (SIGHUP, POST /v1/reload): ok, or refused (the file did not parse or \
                 check; the config in use kept)",
                None,
                Family::default(),
            ),
            requests: register(
                r,
                "requests",
                "Front-door requests by model (one a service serves, else unknown) and HTTP status",
                None,
                Family::default(),
            ),
            faults: register(
                r,
                "faults",
                "Processes of a service whose CUDA context faulted (the guard could not suspend them)",
                None,
                Family::default(),
            ),
            fast_swap_bind_failures: register(
                r,
                "fast_swap_bind_failures",
                "Processes of a service started with fast swap whose library could not bind its control socket \
                 (fast swap off in them: they cannot be parked, and a suspend moves everything through the driver)",
                None,
                Family::default(),
            ),
            annotation_errors: register(
                r,
                "kubernetes_annotation_errors",
                "Bad gpusnap.io annotations of the node's pods, by pod and key (each pod left alone)",
                None,
                Family::default(),
            ),
            socket_wakes: register(
                r,
                "socket_wakes",
                "Resumes asked by the socket watch (wake_on = \"socket\"): a connection or bytes seen on the server's port",
                None,
                Family::default(),
            ),
            socket_wake_delay: seconds(
                r,
                "socket_wake_delay",
                "From the socket watch's first sight of a request to the start of the resume it asks",
                phase_buckets,
            ),
            registry,
            recent: Default::default(),
        }
    }

    /// A finished wake of `service`: observed, and kept among the recent
    /// ones.
    pub fn swap_done(&self, service: &str, t: &crate::trace::WakeTrace) {
        self.swap_trace(t);
        self.recent.push(service, t);
    }

    /// A finished wake trace: its phases, its total and its counts.
    pub fn swap_trace(&self, t: &crate::trace::WakeTrace) {
        for (phase, d) in t.phases() {
            self.swap_phase.get_or_create(&PhaseLabels { phase: phase.into() }).observe(d.as_secs_f64());
        }
        self.swap.get_or_create(&KindLabels { kind: t.kind.into() }).observe(t.total().as_secs_f64());
        let c = &t.counts;
        for (event, n) in [
            ("admission", c.admissions),
            ("refusal", c.refusals),
            ("eviction", c.evictions),
            ("release_poll", c.release_polls),
            ("memory_poll", c.memory_polls),
            ("connect_retry", c.connect_retries),
        ] {
            self.swap_events.get_or_create(&EventLabels { event: event.into() }).inc_by(u64::from(n));
        }
    }

    /// OpenMetrics text, as prometheus-client writes it.
    pub fn encode_openmetrics(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    /// The Prometheus text format (0.0.4), which every scraper and
    /// `promtool check metrics` read.
    pub fn encode(&self) -> String {
        to_prometheus_text(&self.encode_openmetrics())
    }

    pub fn transition(&self, service: &str, kind: &str, ok: bool, secs: f64) {
        self.transitions
            .get_or_create(&TransitionLabels {
                service: service.into(),
                kind: kind.into(),
                result: if ok { "ok" } else { "failed" }.into(),
            })
            .inc();
        if ok {
            self.durations.get_or_create(&KindLabels { kind: kind.into() }).observe(secs);
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// OpenMetrics -> Prometheus text 0.0.4. prometheus-client writes only
/// OpenMetrics, whose counter families are named without `_total` (their
/// samples carry it) and which has `# UNIT` and `# EOF` lines; the older
/// format names the family as its samples. A few lines of rewriting, rather
/// than a second metrics crate.
pub fn to_prometheus_text(om: &str) -> String {
    let counters: std::collections::HashSet<&str> = om
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(om.len());
    for line in om.lines() {
        if line.starts_with("# UNIT ") || line == "# EOF" {
            continue;
        }
        let rewritten = ["# HELP ", "# TYPE "].iter().find_map(|p| {
            let rest = line.strip_prefix(p)?;
            let (name, tail) = rest.split_once(' ')?;
            counters.contains(name).then(|| format!("{p}{name}_total {tail}"))
        });
        out.push_str(rewritten.as_deref().unwrap_or(line));
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn counters_are_named_as_their_samples() {
        let m = super::Metrics::new();
        m.transition("a", "suspend", true, 0.5);
        let text = m.encode();
        assert!(text.contains("# TYPE gpusnap_agent_transitions_total counter"), "{text}");
        assert!(text.contains("# HELP gpusnap_agent_transitions_total "), "{text}");
        assert!(!text.contains("# EOF") && !text.contains("# UNIT"), "{text}");
    }
}
