//! Token-work expected-wait routing: the least_load and power_of_two policies.
//!
//! Not built yet: its issue fills it in.
