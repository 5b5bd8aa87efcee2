//! A continuous-batching engine model, the fleet simulator and mock engine servers.
//!
//! Not built yet: its issue fills it in.
