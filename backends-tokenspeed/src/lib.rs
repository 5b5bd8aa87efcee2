//! TokenSpeed load source over gRPC GetLoads.
//!
//! Not built yet: its issue fills it in.
