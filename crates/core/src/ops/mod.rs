//! The operations views, apart from the pipeline that decides calls: what the guard did, for a
//! dashboard ([`activity`]) and for Prometheus ([`metrics`]). The pipeline writes to them and
//! never reads them back. (What an operator may do to budgets is [`crate::operator`].)

pub mod activity;
pub mod metrics;
