//! The router binary: config, worker registry, load monitor, proxy, admin API and metrics.
//!
//! Not built yet: its issue fills it in.
