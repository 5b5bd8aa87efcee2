//! vLLM load sources: Prometheus /metrics and gRPC GetLoads.
//!
//! Not built yet: its issue fills it in.
