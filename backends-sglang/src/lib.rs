//! SGLang load sources: HTTP /v1/loads, gRPC GetLoads and the /metrics fallback.
//!
//! Not built yet: its issue fills it in.
