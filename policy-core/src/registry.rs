use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use serde::de::DeserializeOwned;

use crate::baseline::{BaselineKind, BaselinePolicy};
use crate::cache_aware::{CACHE_AWARE, CacheAwarePolicy};
use crate::consistent_hash::{CONSISTENT_HASH, ConsistentHashPolicy};
use crate::{BackendError, BackendSpec, LoadSource, Policy, PolicyContext, PolicyError};

/// Builds a policy from its config section (JSON; `null` for "all defaults").
pub type PolicyFactory = Arc<
    dyn Fn(&serde_json::Value, &PolicyContext) -> Result<Box<dyn Policy>, PolicyError>
        + Send
        + Sync,
>;

/// Builds one worker's load source.
pub type BackendFactory =
    Arc<dyn Fn(&BackendSpec) -> Result<Arc<dyn LoadSource>, BackendError> + Send + Sync>;

/// Policies by name. Policy crates add theirs with a `register` function.
#[derive(Clone, Default)]
pub struct PolicyRegistry {
    factories: BTreeMap<String, PolicyFactory>,
}

impl PolicyRegistry {
    /// An empty registry.
    pub fn new() -> PolicyRegistry {
        PolicyRegistry::default()
    }

    /// `round_robin`, `random`, `least_requests`, and the two prefix-aware
    /// baselines `cache_aware` and `consistent_hash`.
    pub fn with_baselines() -> PolicyRegistry {
        let mut registry = PolicyRegistry::new();
        for kind in BaselineKind::ALL {
            registry.register(kind.name(), move |section, context| {
                BaselinePolicy::from_section(kind, section, context)
                    .map(|policy| Box::new(policy) as Box<dyn Policy>)
            });
        }
        registry.register(CACHE_AWARE, |section, context| {
            CacheAwarePolicy::from_section(section, context)
                .map(|policy| Box::new(policy) as Box<dyn Policy>)
        });
        registry.register(CONSISTENT_HASH, |section, context| {
            ConsistentHashPolicy::from_section(section, context)
                .map(|policy| Box::new(policy) as Box<dyn Policy>)
        });
        registry
    }

    pub fn register(
        &mut self,
        name: &str,
        factory: impl Fn(&serde_json::Value, &PolicyContext) -> Result<Box<dyn Policy>, PolicyError>
        + Send
        + Sync
        + 'static,
    ) {
        self.factories.insert(name.to_owned(), Arc::new(factory));
    }

    pub fn names(&self) -> Vec<&str> {
        self.factories.keys().map(String::as_str).collect()
    }

    pub fn build(
        &self,
        name: &str,
        section: &serde_json::Value,
        context: &PolicyContext,
    ) -> Result<Box<dyn Policy>, PolicyError> {
        let factory = self
            .factories
            .get(name)
            .ok_or_else(|| PolicyError::UnknownPolicy {
                name: name.to_owned(),
                valid: self.names().join(", "),
            })?;
        factory(section, context)
    }
}

impl fmt::Debug for PolicyRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PolicyRegistry")
            .field("names", &self.names())
            .finish()
    }
}

/// Where a backend reads a worker's load, declared when it registers, so a
/// router checks a worker's `load_url` without knowing backends by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadAddress {
    /// Over HTTP: at the worker's own address, or at an optional separate
    /// `http://` or `https://host:port` load address.
    Http,
    /// Over gRPC: a separate `grpc://host:port` load address is required.
    Grpc,
}

impl LoadAddress {
    /// What a worker's `load_url` must be, in words, for error messages.
    pub fn describe(self) -> &'static str {
        match self {
            LoadAddress::Http => "an http:// or https://host:port URL without a query, or none",
            LoadAddress::Grpc => "a grpc://host:port address (required by this backend)",
        }
    }
}

/// Backends by name, each with the load address it needs. Backend crates
/// add theirs with a `register` function.
#[derive(Clone, Default)]
pub struct BackendRegistry {
    factories: BTreeMap<String, (LoadAddress, BackendFactory)>,
}

impl BackendRegistry {
    pub fn new() -> BackendRegistry {
        BackendRegistry::default()
    }

    /// Registers backend `name`, whose sources read load at `address`.
    pub fn register(
        &mut self,
        name: &str,
        address: LoadAddress,
        factory: impl Fn(&BackendSpec) -> Result<Arc<dyn LoadSource>, BackendError>
        + Send
        + Sync
        + 'static,
    ) {
        self.factories
            .insert(name.to_owned(), (address, Arc::new(factory)));
    }

    pub fn names(&self) -> Vec<&str> {
        self.factories.keys().map(String::as_str).collect()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.factories.contains_key(name)
    }

    /// The load address backend `name` declared, `None` for an unknown name.
    pub fn load_address(&self, name: &str) -> Option<LoadAddress> {
        self.factories.get(name).map(|(address, _)| *address)
    }

    pub fn build(
        &self,
        name: &str,
        spec: &BackendSpec,
    ) -> Result<Arc<dyn LoadSource>, BackendError> {
        let (_, factory) =
            self.factories
                .get(name)
                .ok_or_else(|| BackendError::UnknownBackend {
                    name: name.to_owned(),
                    valid: self.names().join(", "),
                })?;
        factory(spec)
    }
}

impl fmt::Debug for BackendRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BackendRegistry")
            .field("names", &self.names())
            .finish()
    }
}

/// Reads a policy's config section into its parameter type: `null` gives the
/// defaults, unknown keys are errors (the type should deny them).
pub fn parse_section<T: DeserializeOwned + Default>(
    policy: &str,
    section: &serde_json::Value,
) -> Result<T, PolicyError> {
    if section.is_null() {
        return Ok(T::default());
    }
    serde_json::from_value(section.clone()).map_err(|source| PolicyError::InvalidSection {
        policy: policy.to_owned(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn unknown_policy_lists_the_valid_ones() {
        let registry = PolicyRegistry::with_baselines();
        let err = registry
            .build(
                "fastest",
                &serde_json::Value::Null,
                &PolicyContext::default(),
            )
            .err()
            .unwrap();
        assert_eq!(
            err.to_string(),
            r#"unknown policy "fastest"; valid policies: cache_aware, consistent_hash, least_requests, random, round_robin"#
        );
    }

    #[test]
    fn unknown_keys_in_a_section_are_rejected() {
        let registry = PolicyRegistry::with_baselines();
        let section = serde_json::json!({"kv_pressure_weight": 1.0});
        let err = registry
            .build("round_robin", &section, &PolicyContext::default())
            .err()
            .unwrap();
        assert_eq!(err.to_string(), "invalid [round_robin] section");
        let cause = err.source().unwrap().to_string();
        assert!(
            cause.contains("unknown field `kv_pressure_weight`"),
            "{cause}"
        );
        // An empty section and a null section both mean "defaults".
        for ok in [serde_json::json!({}), serde_json::Value::Null] {
            let policy = registry
                .build("random", &ok, &PolicyContext::default())
                .unwrap();
            assert_eq!(policy.name(), "random");
        }
    }

    #[test]
    fn unknown_backend_lists_the_valid_ones() {
        let mut registry = BackendRegistry::new();
        registry.register("b", LoadAddress::Http, |_spec| {
            Err(BackendError::MissingLoadUrl {
                backend: "b".into(),
            })
        });
        registry.register("a", LoadAddress::Http, |_spec| {
            Err(BackendError::MissingLoadUrl {
                backend: "a".into(),
            })
        });
        registry.register("g", LoadAddress::Grpc, |_spec| {
            Err(BackendError::MissingLoadUrl {
                backend: "g".into(),
            })
        });
        assert_eq!(registry.load_address("g"), Some(LoadAddress::Grpc));
        assert_eq!(registry.load_address("a"), Some(LoadAddress::Http));
        assert_eq!(registry.load_address("c"), None);
        let err = registry
            .build("c", &BackendSpec::new("http://h:1"))
            .err()
            .unwrap();
        assert_eq!(
            err.to_string(),
            r#"unknown backend "c"; valid backends: a, b, g"#
        );
        assert!(registry.contains("a"));
        let err = registry
            .build("a", &BackendSpec::new("http://h:1"))
            .err()
            .unwrap();
        assert!(matches!(err, BackendError::MissingLoadUrl { .. }));
    }
}
